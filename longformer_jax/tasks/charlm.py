"""The character-level LM task (paper §4): `LongformerForCausalLM` on a byte stream, next-byte
NLL, `BatchSampler` batches, and bits per character over whole splits (the paper's evaluation).

Bits per character of a causal byte LM over a whole split, every character scored once.

Indexing: a split of N bytes gives N - 1 predictions; the logit at input position p predicts
byte p + 1 (the first byte has no context and is not scored, as in every enwik8/text8 number
in the literature). A window is the input slice [start, end) of the bytes; it scores the
predictions made at positions [score_from, end).

Protocols:
  "sliding" (the paper's): windows of `context` bytes moved `stride` at a time, each scoring only
    its last `stride` positions, so every prediction but those of the first window sees at least
    context - stride bytes of history. The first window scores all its positions and the last
    window ends at the end of the split, so each of the N - 1 predictions is scored exactly once.
  "chunks": non-overlapping windows of `context` bytes, each scoring all its positions (cheaper,
    and worse: the first predictions of every chunk see little history).

BPC = (sum of per-prediction cross-entropies in nats) / (N - 1) / ln 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from longformer_jax.causal_lm import LongformerForCausalLM, next_byte_nll
from longformer_jax.config import CharLMConfig
from longformer_jax.training import examples
from longformer_jax.tasks.runs import read_run
from longformer_jax.training.config import (
    Stage, TrainConfig, check_int, config_from_record, final_eval_settings, paper_stages)
from longformer_jax.training.sharding import (
    batch_axes, make_mesh, row_group, seq_axis)
from longformer_jax.training.task import Batches, FinalEvaluation, Task, dict_batches, restore

PROTOCOLS = ("sliding", "chunks")
SPLITS = ("train", "validation", "test")
# What a run's `final_eval` may set (`CharLMTask.final_evaluation`): the split, and the rest of
# `evaluate_run`'s settings.
FINAL_EVAL_SETTINGS = ("split", "step", "protocol", "context", "stride", "score_last",
                       "batch_size")


@dataclasses.dataclass(frozen=True)
class Window:
  start: int       # first input position
  end: int         # one past the last input position
  score_from: int  # first scored input position (start <= score_from < end)


def check_bpc_settings(*, context: int | None = None, stride: int | None = None,
                       score_last: int | None = None, batch_size: int = 1,
                       protocol: str = "sliding") -> None:
  """Raises ValueError (TypeError for a value that is no int) naming the first of
  `evaluate_bpc`'s settings (same names) that it would refuse, before any data is read: what
  eval.bpc and a run's `final_eval` are checked with. A context or stride of None is the run's
  (`evaluate_run`), known only once its checkpoint is read: what is given is checked."""
  if protocol not in PROTOCOLS:
    raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
  if context is not None:
    check_int("context", context, minimum=1)
  check_int("batch_size", batch_size, minimum=1)
  if protocol == "sliding" and stride is not None:
    check_int("stride", stride)
    if context is None and stride < 1:
      raise ValueError(f"stride must be >= 1, got {stride!r}")
    if context is not None and not 1 <= stride <= context:
      raise ValueError(f"stride must be in [1, context={context}], got {stride!r}")
  if (score_last is not None and stride is not None and protocol == "sliding"
      and score_last != stride):
    raise ValueError(
        f"score_last={score_last} differs from stride={stride}: each character is scored "
        "exactly once only when a window scores exactly the positions it adds")


def check_final_eval(cfg: TrainConfig) -> None:
  """ValueError (or TypeError) naming a setting of `cfg.final_eval` that
  `CharLMTask.final_evaluation` does not take or would refuse: checked when a run is configured,
  not after training."""
  settings = final_eval_settings(cfg, FINAL_EVAL_SETTINGS)
  split = settings.pop("split", "test")
  if split not in SPLITS:
    raise ValueError(f"final_eval.split must be one of {SPLITS}, got {split!r}")
  step = settings.pop("step", None)
  try:
    if step is not None:
      check_int("step", step, minimum=0)
    check_bpc_settings(**settings)
  except (TypeError, ValueError) as e:
    raise type(e)(f"final_eval: {e}") from None


def window_plan(num_bytes: int, context: int, stride: int, protocol: str = "sliding"
                ) -> list[Window]:
  """The windows that score each of the num_bytes - 1 predictions exactly once."""
  check_bpc_settings(context=context, stride=stride, protocol=protocol)
  if num_bytes < 2:
    raise ValueError(f"a split needs at least 2 bytes to score a prediction, got {num_bytes}")
  positions = num_bytes - 1
  windows = []
  if protocol == "chunks":
    for start in range(0, positions, context):
      windows.append(Window(start, min(start + context, positions), start))
    return windows
  end = min(context, positions)
  windows.append(Window(0, end, 0))
  while end < positions:
    new_end = min(end + stride, positions)
    windows.append(Window(max(0, new_end - context), new_end, end))
    end = new_end
  return windows


def _batches(data: np.ndarray, windows: Sequence[Window], length: int, batch_size: int
             ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """(inputs, targets, weights), each [batch_size, length]; padding rows and tails weigh 0."""
  for first in range(0, len(windows), batch_size):
    inputs = np.zeros((batch_size, length), np.int32)
    targets = np.zeros((batch_size, length), np.int32)
    weights = np.zeros((batch_size, length), np.float32)
    for row, w in enumerate(windows[first:first + batch_size]):
      n = w.end - w.start
      inputs[row, :n] = data[w.start:w.end]
      targets[row, :n] = data[w.start + 1:w.end + 1]
      weights[row, w.score_from - w.start:n] = 1.0
    yield inputs, targets, weights


def _window_nll(model, batch, *, windows):
  """Per-position weighted next-byte NLL of a batch of windows (`examples.nll_sums_fn`)."""
  nll_BxN = next_byte_nll(model(batch["inputs"], windows=windows), batch["targets"])
  return nll_BxN * batch["weights"], batch["weights"]


def evaluate_nll(model: nnx.Module, data: np.ndarray, *, context: int = 32256, stride: int = 512,
                 score_last: int | None = None, batch_size: int = 1, protocol: str = "sliding",
                 windows: Sequence[int] | None = None, mesh: jax.sharding.Mesh | None = None,
                 progress: bool = False) -> tuple[float, int]:
  """(sum of cross-entropies in nats, number of scored predictions); see `evaluate_bpc`."""
  check_bpc_settings(context=context, stride=stride, score_last=score_last,
                     batch_size=batch_size, protocol=protocol)
  data = np.asarray(data)
  if data.ndim != 1:
    raise ValueError(f"data must be a 1-D array of token ids, got shape {data.shape}")
  plan = window_plan(len(data), context, stride, protocol)
  length = max(w.end - w.start for w in plan)
  graphdef, state = nnx.split(model)
  windows = None if windows is None else tuple(windows)

  if mesh is not None:
    rows, seq = batch_axes(mesh), seq_axis(mesh)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(rows, seq))
    row_shards = math.prod(mesh.shape[a] for a in rows)
    batch_size = -(-batch_size // row_shards) * row_shards   # every device gets whole rows
    if seq is not None:
      # Every piece of a sequence the same length: pad at the end, which a causal model's
      # earlier positions never see (the padding weighs 0).
      length = -(-length // mesh.shape[seq]) * mesh.shape[seq]
  else:
    sharding = None

  nll_sums = examples.nll_sums_fn(_window_nll, graphdef, windows=windows)
  def put(x):
    if sharding is None:
      return x
    # Each process feeds the rows of its row group (every process holds the whole batch).
    group, groups = row_group(sharding, x.shape)
    rows = x.shape[0] // groups
    return jax.make_array_from_process_local_data(sharding, x[group * rows:(group + 1) * rows],
                                                  x.shape)

  total, count = 0.0, 0
  batches = _batches(data, plan, length, batch_size)
  if progress and jax.process_index() == 0:
    from tqdm import tqdm
    batches = tqdm(batches, total=math.ceil(len(plan) / batch_size), desc=f"eval {protocol}",
                   unit="batch")
  for inputs, targets, weights in batches:
    s, c = nll_sums(state, {"inputs": put(inputs), "targets": put(targets),
                            "weights": put(weights)})
    # Sum on the host in float64: a 5M-character split overflows float32's exact range.
    total += float(s)
    count += int(round(float(c)))
  return total, count


def check_bytes(data: np.ndarray, vocab_size: int, what: str) -> None:
  """ValueError naming the first byte of `data` outside the model's vocabulary [0, vocab_size)
  and its position: its embedding lookup would give NaN, and the run would end in "lower the
  learning rate" (training) or "the weights are not usable" (scoring), blaming the wrong thing.
  A vocabulary of 256 takes every byte, and nothing is read."""
  if vocab_size >= 256:
    return
  data = np.asarray(data)
  bad = np.flatnonzero(data >= vocab_size)
  if len(bad):
    i = int(bad[0])
    raise ValueError(f"{what} holds byte {int(data[i])} at position {i:,} ({len(bad):,} bytes "
                     f">= {vocab_size}); the model's vocabulary is bytes 0..{vocab_size - 1} "
                     f"(vocab_size={vocab_size}): pick data it can read, or a model with "
                     f"vocab_size=256")


def evaluate_bpc(model: nnx.Module, data: np.ndarray, *, context: int = 32256, stride: int = 512,
                 score_last: int | None = None, batch_size: int = 1, protocol: str = "sliding",
                 windows: Sequence[int] | None = None, mesh: jax.sharding.Mesh | None = None,
                 progress: bool = False) -> float:
  """Bits per character of `model` on `data` (1-D uint8/int bytes), each character scored once.

  context: window length in bytes; stride: how far the window moves (sliding protocol);
  score_last: the positions each window after the first scores; must equal stride (default);
  protocol: "sliding" (the paper's: context 32,256, stride 512) or "chunks" (non-overlapping);
  windows: per-layer attention windows for this evaluation (default: the model config's);
  mesh: shard each batch over it: rows over every axis but `seq`, and the length over `seq`
    when the mesh has that axis with more than one device (the model must have been built for
    the same mesh, e.g. by `evaluate_run` or the `Trainer`, for its attention to run per
    shard). batch_size is rounded up to a multiple of the row shards.
  """
  check_bytes(data, model.config.vocab_size, "the data to score")
  total, count = evaluate_nll(model, data, context=context, stride=stride, score_last=score_last,
                              batch_size=batch_size, protocol=protocol, windows=windows,
                              mesh=mesh, progress=progress)
  return total / count / math.log(2)


def _default_mesh(mesh):
  return make_mesh((-1, 1)) if mesh is None else mesh


def restore_run(workdir, *, step: int | None = None, mesh: jax.sharding.Mesh | None = None):
  """(model, step, windows) of a training run's checkpoint: the model of
  <workdir>/run_config.json with the parameters of checkpoint `step` (default: the newest that
  restores and verifies; damaged ones are skipped with a warning) and nothing else (no optimizer
  state), built for and sharded over `mesh` (default: all devices on the data axis) by the run's
  logical rules; windows: the final stage's, from the settings saved with that checkpoint.
  ValueError for a workdir that holds a run of another kind (`runs.read_run`)."""
  model, step, run = _restore_run(workdir, step, mesh)
  return model, step, run.stage_windows(-1)


def _restore_run(workdir, step: int | None, mesh: jax.sharding.Mesh | None
                 ) -> tuple[nnx.Module, int, TrainConfig]:
  """(model, step, the run's settings saved with that checkpoint) of `restore_run`."""
  _, cfg = read_run(workdir, "charlm")
  model, step, meta = restore(LongformerForCausalLM, cfg, workdir, _default_mesh(mesh),
                              step=step)
  # The stages may have grown since the run started (an extended run): the checkpoint's own
  # settings say which windows its last stage trains with.
  return model, step, config_from_record(meta["run"], f"step {step} meta")


def default_stride(context: int) -> int:
  """The stride that goes with `context` when none is given: the paper's 512, or half the
  context when that is shorter (each window then scores its second half, after at least as many
  bytes of history), at least 1."""
  return max(1, min(512, context // 2))


def run_context(run: TrainConfig) -> tuple[int, int | None, str]:
  """(context, stride or None, where they come from) of a run's own BPC evaluation: the context
  of its `final_eval` (and that stride, if it sets one), else its last stage's sequence length.
  A stride of None is `default_stride(context)`."""
  settings = run.final_eval or {}
  if settings.get("context") is not None:
    return settings["context"], settings.get("stride"), "the run's final_eval"
  return run.stages[-1].seq_len, None, "the run's last stage's seq_len"


def evaluate_run(workdir, data: np.ndarray, *, step: int | None = None,
                 mesh: jax.sharding.Mesh | None = None, context: int | None = None,
                 stride: int | None = None, score_last: int | None = None, batch_size: int = 1,
                 protocol: str = "sliding", progress: bool = False) -> dict:
  """BPC of a training run's checkpoint on `data`: the evaluation of train.charlm (after
  training, `CharLMTask.final_evaluation`) and of eval.bpc.

  Reads <workdir>/run_config.json for the model, restores the parameters of checkpoint `step`
  (default: the newest that restores and verifies; damaged ones are skipped with a warning) and
  nothing else (`checkpoint.load_params`: no optimizer state), and scores `data` with the final
  stage's attention windows of the settings saved with that checkpoint (`evaluate_bpc`'s other
  arguments). context: default: the run's own (`run_context` of the settings saved with the
  checkpoint: its final_eval's, else its last stage's sequence length; one line on stdout says
  which), not the paper's 32,256, which would cost a small model minutes for nothing; stride:
  default: the run's final_eval's with its context, else `default_stride(context)`. mesh: the
  batch is split over it as in `evaluate_bpc`, the model is built for it, and the parameters are
  sharded by the run's logical rules (default: all devices on the data axis). Returns {"bpc",
  "bytes", "step", "windows", and the protocol}.
  """
  mesh = _default_mesh(mesh)
  model, step, run = _restore_run(workdir, step, mesh)
  windows = run.stage_windows(-1)
  origin = None
  if context is None:
    context, run_stride, origin = run_context(run)
    stride = run_stride if stride is None else stride
  if stride is None:
    stride = default_stride(context)
  if origin is not None and jax.process_index() == 0:
    took = f"context {context}" + (f", stride {stride}" if protocol == "sliding" else "")
    print(f"{took}: {origin} (step {step})", flush=True)
  start = time.perf_counter()
  bpc = evaluate_bpc(model, data, context=context, stride=stride, score_last=score_last,
                     batch_size=batch_size, protocol=protocol, windows=windows, mesh=mesh,
                     progress=progress)
  return {"bpc": bpc, "bytes": int(len(data)), "step": step, "windows": list(windows),
          "protocol": protocol, "context": context, "stride": stride, "batch_size": batch_size,
          "seconds": round(time.perf_counter() - start, 1)}


def describe(result: dict) -> str:
  """One line for an `evaluate_run` result."""
  return (f"{result['bpc']:.4f} bpc ({result['protocol']}, context {result['context']}, stride "
          f"{result['stride']}; {result['bytes']:,} bytes; step {result['step']})")



class CharLMTask(Task):
  """train_data / valid_data: byte arrays (default: `cfg.dataset`'s train and validation splits,
  loaded when first needed). Batches are {"inputs", "targets"}, int32 [rows, seq_len]."""

  plot_keys = ("train_bpc", "valid_bpc")
  plot_ylabel = "bits per character"

  def __init__(self, train_data: np.ndarray | None = None,
               valid_data: np.ndarray | None = None, *, data_file: str | None = None):
    self._train_data = None if train_data is None else np.asarray(train_data)
    self._valid_data = None if valid_data is None else np.asarray(valid_data)
    self.data_file = data_file

  @classmethod
  def of_file(cls, path: str) -> CharLMTask:
    """Training, validation and the final evaluation on a file's bytes (`split_of_file`)."""
    return cls(split_of_file(path, "train"), split_of_file(path, "validation"), data_file=path)

  def check(self, cfg: TrainConfig) -> None:
    if not isinstance(cfg.model, CharLMConfig):
      raise ValueError(f"the char-LM task trains a CharLMConfig model, got "
                       f"{type(cfg.model).__name__}")
    check_final_eval(cfg)
    for i, stage in enumerate(cfg.stages):
      if stage.windows is not None and len(stage.windows) != cfg.model.num_hidden_layers:
        raise ValueError(f"stages[{i}].windows has {len(stage.windows)} entries for a "
                         f"{cfg.model.num_hidden_layers}-layer model: {stage.windows}")
    if cfg.model.vocab_size < 256:  # bytes beyond the vocabulary: refused before training
      splits = ("train", "validation") + (
          ((cfg.final_eval or {}).get("split", "test"),) if cfg.final_eval is not None else ())
      for split in dict.fromkeys(splits):
        check_bytes(self._split(cfg, split), cfg.model.vocab_size,
                    f"{self.data_file or cfg.dataset} ({split} split)")
    if self.data_file is not None:  # a file's splits may be too small (the corpora are not)
      from longformer_jax.data import BatchSampler
      for i, stage in enumerate(cfg.stages):
        try:
          BatchSampler(self._train_data, seq_len=stage.seq_len,
                       global_batch_size=stage.batch_size)
        except ValueError as e:
          raise ValueError(f"{self.data_file}: its train split (the first 90% of its bytes) "
                           f"is too short for stages[{i}]: {e}") from None
      if len(self._valid_data) < 2:
        raise ValueError(f"{self.data_file}: its validation split (5% of its bytes) holds "
                         f"{len(self._valid_data)} byte(s); scoring needs at least 2")

  def _split(self, cfg: TrainConfig, split: str) -> np.ndarray:
    """The bytes of `split` (kept for training and validation, loaded when first needed)."""
    if split == "train":
      if self._train_data is None:
        self._train_data = _load(cfg, "train")
      return self._train_data
    if split == "validation":
      if self._valid_data is None:
        self._valid_data = _load(cfg, "validation")
      return self._valid_data
    return split_of_file(self.data_file, split) if self.data_file else _load(cfg, split)

  def data_identity(self, cfg: TrainConfig) -> dict[str, Any]:
    """The training bytes' length and SHA-256 (a 90 MB split hashes in well under a second)."""
    if self._train_data is None:
      self._train_data = _load(cfg, "train")
    data = np.ascontiguousarray(self._train_data)
    identity = {"train_bytes": int(data.size),
                "train_sha256": hashlib.sha256(data.tobytes()).hexdigest()}
    if self.data_file is not None:
      # Where the bytes were (eval.bpc scores the run's own data by default); not part of what
      # fixes the run: the same bytes elsewhere are the same data (training.identity.FREE_KEYS).
      identity["data_file"] = os.path.abspath(self.data_file)
    return identity

  def build_model(self, config: CharLMConfig, rngs: nnx.Rngs, mesh: Mesh | None = None,
                  seq_axis: str | None = None) -> LongformerForCausalLM:
    return LongformerForCausalLM(config, rngs=rngs, mesh=mesh, seq_axis=seq_axis)

  def loss(self, model, batch, stage: Stage, dropout_key: jax.Array) -> jax.Array:
    # stage.windows None: the model config's windows.
    logits_BxNxV = model(batch["inputs"], windows=stage.windows, dropout_key=dropout_key)
    return jnp.mean(next_byte_nll(logits_BxNxV, batch["targets"]))

  def batches(self, cfg: TrainConfig, stage_index: int, *, process_index: int,
              process_count: int) -> Batches:
    from longformer_jax.data import BatchSampler
    if self._train_data is None:
      self._train_data = _load(cfg, "train")
    stage = cfg.stages[stage_index]
    sampler = BatchSampler(
        self._train_data, seq_len=stage.seq_len, global_batch_size=stage.batch_size,
        seed=cfg.seed + stage_index, process_index=process_index, process_count=process_count)
    return dict_batches(sampler, ("inputs", "targets"))

  def evaluate(self, model, cfg: TrainConfig, stage_index: int, mesh: Mesh) -> dict[str, float]:
    """BPC on the first `cfg.eval_tokens` bytes of the validation data, in non-overlapping
    windows of the stage's sequence length, with the stage's windows."""
    if self._valid_data is None:
      self._valid_data = _load(cfg, "validation")
    data = self._valid_data
    if cfg.eval_tokens is not None:
      data = data[:cfg.eval_tokens + 1]
    stage = cfg.stages[stage_index]
    bpc = evaluate_bpc(model, data, context=stage.seq_len, stride=stage.seq_len,
                       batch_size=cfg.eval_batch_size, protocol="chunks",
                       windows=cfg.stage_windows(stage_index), mesh=mesh)
    return {"valid_bpc": bpc}

  def train_metrics(self, loss: float) -> dict[str, float]:
    return {"train_bpc": loss / math.log(2)}


  def final_evaluation(self, cfg: TrainConfig, workdir, mesh: Mesh, *,
                       progress: bool = False) -> FinalEvaluation:
    """`evaluate_run` of the run's newest checkpoint on `cfg.final_eval["split"]` (default
    "test") of the dataset (or of the data file), with the rest of `cfg.final_eval`."""
    if cfg.final_eval is None:
      return FinalEvaluation({})
    eval_args = dict(cfg.final_eval)
    split = eval_args.pop("split", "test")
    if self.data_file is not None:
      source, data = self.data_file, split_of_file(self.data_file, split)
    else:
      source, data = cfg.dataset, _load(cfg, split)
    result = evaluate_run(workdir, data, mesh=mesh, progress=progress, **eval_args)
    return FinalEvaluation({f"{split}_bpc": result["bpc"],
                            "eval": {"dataset": source, "split": split, **result}},
                           lines=(f"{source} {split}: {describe(result)}",), step=result["step"])


def split_of_file(path: str, split: str) -> np.ndarray:
  """`split` ("train", "validation", "test") of a file's bytes: the first 90%, the next 5%, the
  rest, as the corpora are split."""
  from etils import epath
  from longformer_jax.data.corpora import split_bounds
  data = np.frombuffer(epath.Path(path).read_bytes(), np.uint8)
  start, stop = split_bounds(len(data))[split]
  return data[start:stop].copy()


def run_data(record: dict, cfg: TrainConfig, split: str, data_dir: str | None = None
             ) -> tuple[np.ndarray, dict[str, Any], str]:
  """(bytes, {"data_file" or "dataset", "split"}, a name for file names) of `split` of the data a
  run trained on, from its record: the file of a `--data-file` run (`split_of_file`), else its
  dataset. Either is checked to be the data the run trained on: the training split's length
  and SHA-256 against the record's (a file changed since, or a record of a `--data-file` run
  that does not name its file, would else be scored as if it were the run's data). Raises
  FileNotFoundError / ValueError naming the data."""
  from etils import epath
  identity = record.get("data") or {}
  data_file = identity.get("data_file")
  if data_file is not None:
    if not isinstance(data_file, str) or not epath.Path(data_file).is_file():
      raise FileNotFoundError(f"the run trained on --data-file {data_file}, which is not there "
                              f"now: give --file (or --dataset)")
    train, what = split_of_file(data_file, "train"), f"--data-file {data_file}"
    data = split_of_file(data_file, split)
    source, name = {"data_file": data_file, "split": split}, f"file_{epath.Path(data_file).name}"
  else:
    from longformer_jax.data import load_split
    dataset_dir = data_dir or cfg.data_dir
    train, what = load_split(cfg.dataset, "train", dataset_dir), f"dataset {cfg.dataset}"
    data = load_split(cfg.dataset, split, dataset_dir)
    source, name = {"dataset": cfg.dataset, "split": split}, cfg.dataset
  recorded = identity.get("train_sha256")
  if recorded is not None and (
      len(train) != identity.get("train_bytes")
      or hashlib.sha256(np.ascontiguousarray(train).tobytes()).hexdigest() != recorded):
    raise ValueError(f"the {what} is not the data the run trained on: its train split has "
                     f"{len(train):,} bytes and another SHA-256 than the run recorded "
                     f"({identity.get('train_bytes'):,} bytes, sha256 {recorded[:16]}...); "
                     f"give --file or --dataset to score other data")
  return data, source, f"{name}_{split}"


def _load(cfg: TrainConfig, split: str) -> np.ndarray:
  from longformer_jax.data import load_split
  return load_split(cfg.dataset, split, cfg.data_dir)


# ----------------------------------------------------------------------------------------------
# Presets (`--preset NAME`; train/configs/char_*.py return them, with their commands)


def char_tiny() -> TrainConfig:
  """The CPU demo on enwik8_sample (bundled; `CharLMConfig.tiny()`): one stage of 3,000 steps of
  8 x 256 bytes, then the sliding-window test evaluation (context 512, stride 256: the paper's
  protocol scaled down)."""
  model = CharLMConfig.tiny()
  return TrainConfig(
      model=model,
      dataset="enwik8_sample",
      # One stage: on 2 cores the paper's growing sequence lengths buy nothing but compile time.
      # Small batches: early in training the loss falls faster per byte seen with more, smaller
      # steps (batch 8 at lr 4e-3 beats batch 16 at lr 3e-3 for the same bytes).
      stages=(Stage(seq_len=256, batch_size=8, steps=3000, learning_rate=4e-3,
                    end_learning_rate=1e-4, warmup_steps=100),),
      weight_decay=0.01,
      eval_every=750,
      eval_tokens=32_768,
      eval_batch_size=16,
      checkpoint_every=750,
      final_eval=dict(split="test", protocol="sliding", context=512, stride=256,
                      batch_size=16),
  )


def char_small() -> TrainConfig:
  """The paper's 12-layer model (`CharLMConfig.small()`) and 5-stage schedule on enwik8 (TPU VM
  or GPUs), then the paper's evaluation (context 32,256, stride 512)."""
  model = CharLMConfig.small()
  return TrainConfig(
      model=model,
      dataset="enwik8",
      stages=paper_stages(model),
      weight_decay=0.01,
      clip_norm=0.25,
      # Sequences per accumulation step over all devices; the stage batch (32 or 16) must be a
      # multiple. Lower it if a stage does not fit in memory.
      microbatch_size=16,
      mesh_shape=(-1, 1),
      log_every=50,
      eval_every=5000,
      eval_tokens=1_000_000,
      checkpoint_every=2000,
      final_eval=dict(split="test", protocol="sliding", context=32256, stride=512,
                      batch_size=8),
  )


def char_large() -> TrainConfig:
  """The paper's 30-layer model (`CharLMConfig.large()`) and its 5-stage schedule (TPU VM
  slice), parameters and optimizer moments sharded over 4 devices per group (`fsdp`); every
  other setting as char_small."""
  model = CharLMConfig.large()
  # paper_stages gives the 30-layer model the paper's large step counts.
  return dataclasses.replace(char_small(), model=model, stages=paper_stages(model),
                             mesh_shape=(-1, 4))


