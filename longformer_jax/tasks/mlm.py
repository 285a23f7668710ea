"""Masked-LM pretraining (paper §5): `MLMTask` for the shared loop, RoBERTa's masking, the
evaluation in bits, the presets, and starting points (a RoBERTa made long, a Longformer).

Masking (RoBERTa's, as fairseq's MaskTokensDataset does it): in each sequence,
floor(0.15 * M + u) of its M maskable tokens (u uniform in [0, 1): 15% in expectation), chosen
uniformly without replacement; special tokens (<s>, </s>, <pad>, <unk>, <mask>) are never
chosen. A chosen token becomes <mask> with probability 0.8, a uniformly random non-special token
with 0.1, and stays itself with 0.1; the loss is the cross-entropy of the original token at every
chosen position. The masks are drawn afresh for every step (RoBERTa's dynamic masking) by a
counter-based generator keyed by (seed, stage, step, global row), so they do not depend on how
many processes feed the batch or on gradient accumulation, and a resumed run draws the same ones.
Only the chosen positions go through the LM head (`LongformerForMaskedLM(prediction_positions=)`).

Evaluation (`evaluate_mlm`), on a held-out split packed in order (`data.tokenized.pack`) with
masks keyed by (seed, row) alone, so every evaluation of a run scores the same targets:
  loss            = sum over targets of -ln p(target) / number of targets (nats per masked token)
  bits_per_token  = loss / ln 2: what the Longformer paper's Table 5 reports as "BPC" (allenai's
                    pretrain.py logs mlm_bpc = loss / ln 2 of HF's mean masked-token loss)
  bpc             = sum over targets of -log2 p(target) / sum over the same targets of the
                    UTF-8 bytes each target token stands for (bits per character of the masked
                    text; bytes, as enwik8's characters are; byte-level BPE only)

Starting points (`load_pretrained`): a RoBERTa directory is made long by the paper's recipe
(`convert.roberta_to_longformer`: positions copied), an HF Longformer directory is read by
`convert.from_hf`, and a project model checkpoint by `checkpoint.load_model`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from longformer_jax.config import LongformerConfig
from longformer_jax.data import tokenized
from longformer_jax.data.tokenizer import (SpecialIds, check_tokenizer, load_tokenizer, special_ids,
                                           tokenizer_sha256)
from longformer_jax.modeling import LongformerForMaskedLM, masked_positions
from longformer_jax.training import examples
from longformer_jax.training.config import Stage, TrainConfig, check_int, final_eval_settings
from longformer_jax.training.sharding import LOGICAL_RULES
from longformer_jax.training.sources import open_model_dir
from longformer_jax.training.task import Batches, FinalEvaluation, Task

MASK_RATE = 0.15           # RoBERTa's (and BERT's) share of tokens predicted
MASK_REPLACE = (0.8, 0.1)  # of those: <mask>, a random token; the rest (0.1) stay unchanged
TOKENIZER_FILE = "tokenizer.json"  # the run's tokenizer, saved in its workdir
SPLITS = ("train", "validation", "test")
# What a run's `final_eval` may set: `evaluate_mlm_run`'s settings.
FINAL_EVAL_SETTINGS = ("split", "step", "max_tokens", "batch_size")
_TRAIN, _EVAL = 0, 1       # mask-key domains: training steps and held-out rows never share keys


# ----------------------------------------------------------------------------------------------
# Masking.


def max_predictions(seq_len: int, rate: float = MASK_RATE) -> int:
  """The most targets a sequence of `seq_len` tokens can get (`mask_tokens` chooses
  floor(rate * M + u) <= ceil(rate * seq_len) of its M <= seq_len maskable tokens): the static Y
  of `masked_positions`, so that it never drops one."""
  return max(1, math.ceil(rate * seq_len))


@functools.lru_cache(maxsize=8)
def _replacement_ids(vocab_size: int, special: tuple[int, ...]) -> np.ndarray:
  """The ids a chosen token may be replaced by: every non-special id of the vocabulary."""
  return np.setdiff1d(np.arange(vocab_size), np.asarray(special, np.int64)).astype(np.int32)


def _uniform(raw: np.ndarray) -> np.ndarray:
  """uint64 raw bits -> floats uniform in [0, 1) (the top 53 bits)."""
  return (raw >> np.uint64(11)).astype(np.float64) * 2.0**-53


def mask_tokens(ids_BxN: np.ndarray, row_keys: Sequence[Sequence[int]], specials: SpecialIds,
                vocab_size: int, rate: float = MASK_RATE) -> tuple[np.ndarray, np.ndarray]:
  """RoBERTa's masking of each row (module docstring), row r drawn from the key `row_keys[r]`.

  Args:
    ids_BxN: token ids.
    row_keys: one sequence of non-negative ints per row (e.g. (seed, stage, step, row)).
    specials: the tokenizer's special ids (never chosen) and <mask>.
    vocab_size: the tokenizer's vocabulary; random replacements are its non-special ids.
    rate: the expected share of maskable tokens chosen.
  Returns:
    (input_ids [B, N] int32 with the replacements, labels [B, N] int32: the original id at
    every chosen position, -100 elsewhere).
  """
  ids_BxN = np.asarray(ids_BxN)
  if ids_BxN.ndim != 2:
    raise ValueError(f"ids must be [batch, seq], got shape {ids_BxN.shape}")
  if len(row_keys) != ids_BxN.shape[0]:
    raise ValueError(f"{len(row_keys)} row keys for {ids_BxN.shape[0]} rows")
  if not 0.0 < rate < 1.0:
    raise ValueError(f"mask rate must be in (0, 1), got {rate!r}")
  n = ids_BxN.shape[1]
  replacements = _replacement_ids(vocab_size, specials.special)
  maskable_BxN = ~np.isin(ids_BxN, specials.special)
  inputs_BxN = ids_BxN.astype(np.int32)  # a copy
  labels_BxN = np.full(ids_BxN.shape, -100, np.int32)
  for r, key in enumerate(row_keys):
    # Raw Philox bits (stable across NumPy versions, unlike its distribution samplers): one for
    # the count's rounding, then per position a rank, a kind and a replacement.
    raw = np.random.Philox(np.random.SeedSequence([int(k) for k in key])).random_raw(3 * n + 1)
    rank_N, kind_N, pick_N = raw[1:n + 1], _uniform(raw[n + 1:2 * n + 1]), raw[2 * n + 1:]
    candidates = np.flatnonzero(maskable_BxN[r])
    count = int(rate * candidates.size + _uniform(raw[:1])[0])
    chosen = candidates[np.argsort(rank_N[candidates], kind="stable")[:count]]
    labels_BxN[r, chosen] = ids_BxN[r, chosen]
    to_mask = chosen[kind_N[chosen] < MASK_REPLACE[0]]
    to_random = chosen[(kind_N[chosen] >= MASK_REPLACE[0])
                       & (kind_N[chosen] < MASK_REPLACE[0] + MASK_REPLACE[1])]
    inputs_BxN[r, to_mask] = specials.mask
    inputs_BxN[r, to_random] = replacements[pick_N[to_random] % np.uint64(replacements.size)]
  return inputs_BxN, labels_BxN


def masked_lm_nll(model: LongformerForMaskedLM, input_ids_BxN: jax.Array, labels_BxN: jax.Array,
                  *, pad_id: int, num_predictions: int) -> tuple[jax.Array, jax.Array]:
  """(-ln p(target) [B, Y], weights [B, Y]: 1 for a target, 0 for padding of Y) of the MLM
  targets (labels >= 0), with the LM head run at the Y = num_predictions target positions only.
  Padding tokens (`pad_id`) are masked out of attention."""
  positions_BxY, targets_BxY, _ = masked_positions(labels_BxN, num_predictions)
  logits_BxYxV = model(input_ids_BxN, input_ids_BxN != pad_id,
                       prediction_positions=positions_BxY).logits
  weights_BxY = (targets_BxY >= 0).astype(jnp.float32)
  nll_BxY = optax.softmax_cross_entropy_with_integer_labels(
      logits_BxYxV.astype(jnp.float32), jnp.maximum(targets_BxY, 0))
  return nll_BxY * weights_BxY, weights_BxY


# ----------------------------------------------------------------------------------------------
# Batches.


class MaskedBatches:
  """Training batches {"input_ids", "labels"}, int32 [rows, seq_len]: rows of `<s>` + seq_len - 2
  stream tokens + `</s>` drawn by a `BatchSampler` (per-epoch offsets and order; this process's
  rows), masked by `mask_tokens` with keys (seed, stage, step, global row)."""

  def __init__(self, stream: np.ndarray, stage: Stage, *, seed: int, stage_index: int,
               specials: SpecialIds, vocab_size: int, rate: float, process_index: int,
               process_count: int):
    from longformer_jax.data import BatchSampler
    # Windows of seq_len - 1 tokens; the sampler's next-token target (the last) is not used.
    self._sampler = BatchSampler(stream, seq_len=stage.seq_len - 2,
                                 global_batch_size=stage.batch_size, seed=seed + stage_index,
                                 process_index=process_index, process_count=process_count)
    self._key = (seed, _TRAIN, stage_index)
    self._first_row = process_index * self._sampler.local_batch_size
    self._specials, self._vocab_size, self._rate = specials, vocab_size, rate

  def __next__(self) -> dict[str, np.ndarray]:
    step = self._sampler.step
    chunks_BxN, _ = next(self._sampler)
    rows = range(self._first_row, self._first_row + chunks_BxN.shape[0])
    input_ids, labels = mask_tokens(tokenized.with_specials(chunks_BxN, self._specials),
                                    [(*self._key, step, row) for row in rows], self._specials,
                                    self._vocab_size, self._rate)
    return {"input_ids": input_ids, "labels": labels}

  def __iter__(self):
    return self

  def state(self) -> dict[str, Any]:
    return self._sampler.state()

  def load_state(self, state: Mapping[str, Any]) -> None:
    self._sampler.load_state(state)


# ----------------------------------------------------------------------------------------------
# Evaluation.


def _masked_nll(model, batch, *, pad_id: int, num_predictions: int):
  """Per-prediction NLL and weights of a batch, dropout off (`examples.nll_sums_fn`)."""
  model.eval()  # no dropout (the scorer's merged copy only)
  return masked_lm_nll(model, batch["input_ids"], batch["labels"], pad_id=pad_id,
                       num_predictions=num_predictions)


def evaluate_mlm(model: LongformerForMaskedLM, stream: np.ndarray, *, seq_len: int,
                 specials: SpecialIds, bytes_per_token: np.ndarray | None, vocab_size: int,
                 seed: int = 0, rate: float = MASK_RATE, batch_size: int = 8,
                 max_tokens: int | None = None, mesh: Mesh | None = None,
                 rules: Sequence[tuple[str, Any]] = LOGICAL_RULES,
                 progress: bool = False) -> dict[str, float]:
  """MLM loss, bits per masked token and bits per character (module docstring) of `model` on a
  token stream, packed into rows of `seq_len` (`tokenized.pack`), masked with keys (seed, row).

  stream: a split's token ids (`tokenized.token_ids`); max_tokens: score its first tokens only.
  bytes_per_token: `tokenized.token_bytes(tokenizer)` (None: no "bpc", e.g. for a tokenizer
    that is not byte-level); vocab_size: the tokenizer's.
  mesh, rules: batches are laid out as training batches (`examples.put_batch`), for a model
    built for that mesh; batch_size is rounded up to a multiple of the row shards.
  """
  _check_eval_limits(batch_size, max_tokens)
  stream = np.asarray(stream)
  if max_tokens is not None:
    stream = stream[:max_tokens]
  rows_RxN = tokenized.pack(stream, seq_len, specials)
  input_ids, labels = mask_tokens(rows_RxN, [(seed, _EVAL, r) for r in range(len(rows_RxN))],
                                  specials, vocab_size, rate)
  multiple = examples.row_multiple(mesh)
  batch_size = -(-batch_size // multiple) * multiple
  graphdef, state = nnx.split(model)
  nll_sums = examples.nll_sums_fn(_masked_nll, graphdef, pad_id=specials.pad,
                                  num_predictions=max_predictions(seq_len, rate))
  starts = range(0, len(rows_RxN), batch_size)
  starts = examples.progress(starts, len(starts), "eval mlm", "batch", progress)
  total_nats, targets = 0.0, 0
  for start in starts:
    ids_BxN = np.full((batch_size, seq_len), specials.pad, np.int32)  # padding rows: no targets
    labels_BxN = np.full((batch_size, seq_len), -100, np.int32)
    chunk = slice(start, start + batch_size)
    ids_BxN[:len(input_ids[chunk])] = input_ids[chunk]
    labels_BxN[:len(labels[chunk])] = labels[chunk]
    batch = examples.put_batch({"input_ids": ids_BxN, "labels": labels_BxN}, mesh, rules)
    nats, count = nll_sums(state, batch)
    total_nats += float(nats)  # summed on the host in float64
    targets += int(round(float(count)))
  if targets == 0:
    raise ValueError(f"nothing to score: {stream.size} tokens in {len(rows_RxN)} rows of "
                     f"{seq_len} gave no masked targets")
  loss = total_nats / targets
  result = {"loss": loss, "bits_per_token": loss / math.log(2), "masked_tokens": targets,
            "tokens": int(stream.size), "sequences": len(rows_RxN), "seq_len": seq_len}
  if bytes_per_token is not None:
    target_bytes = int(np.sum(np.asarray(bytes_per_token)[labels[labels >= 0]]))
    result.update(bpc=total_nats / math.log(2) / target_bytes, masked_bytes=target_bytes)
  return result


def _check_eval_limits(batch_size: int, max_tokens: int | None) -> None:
  """ValueError (TypeError) unless batch_size is an int >= 1 and max_tokens None or an int >= 1
  (a slice bound of 0 or less would score a silently shortened stream)."""
  check_int("batch_size", batch_size, minimum=1)
  if max_tokens is not None:
    check_int("max_tokens", max_tokens, minimum=1)


# ----------------------------------------------------------------------------------------------
# The task.


class MLMTask(Task):
  """Masked-LM pretraining of a `LongformerForMaskedLM` on `cfg.dataset` (a text source of
  `data.tokenized.text_of`), tokenized by `tokenizer`.

  train_ids / valid_ids: token streams (default: the dataset's train and validation splits,
    tokenized and cached when first needed).
  init_identity: JSON values naming the weights the run starts from (`params_fingerprint`),
    stored with the run: a resume from other weights is refused. None: initialised from the seed.
  """

  plot_keys = ("train_loss", "valid_loss")
  plot_ylabel = "MLM loss (nats per masked token)"

  def __init__(self, tokenizer, *, train_ids: np.ndarray | None = None,
               valid_ids: np.ndarray | None = None, rate: float = MASK_RATE,
               init_identity: Mapping[str, Any] | None = None):
    if not 0.0 < rate < 1.0:
      raise ValueError(f"mask rate must be in (0, 1), got {rate!r}")
    self.tokenizer = tokenizer
    self.specials = special_ids(tokenizer)
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    # Bits per character counts each target's bytes: byte-level BPE tokenizers only.
    self.bytes_per_token = (tokenized.token_bytes(tokenizer)
                            if tokenized.is_byte_level(tokenizer) else None)
    self.rate = rate
    self.init_identity = None if init_identity is None else dict(init_identity)
    self._ids = {"train": train_ids, "validation": valid_ids}

  def ids(self, cfg: TrainConfig, split: str) -> np.ndarray:
    """The token stream of a split of `cfg.dataset` (given, or tokenized once and cached)."""
    if self._ids.get(split) is None:
      self._ids[split] = tokenized.token_ids(cfg.dataset, split, self.tokenizer,
                                             data_dir=cfg.data_dir)
    return self._ids[split]

  def check(self, cfg: TrainConfig) -> None:
    model = cfg.model
    if not isinstance(model, LongformerConfig):
      raise ValueError(f"the MLM task trains a LongformerConfig model, got "
                       f"{type(model).__name__}")
    if model.causal:
      raise ValueError("the MLM task trains a bidirectional model; model.causal is True")
    check_final_eval(cfg)
    if self.vocab_size > model.vocab_size:
      raise ValueError(f"the tokenizer has {self.vocab_size} ids; the model's vocabulary holds "
                       f"{model.vocab_size} (model.vocab_size)")
    check_tokenizer(self.tokenizer, model)  # <s>, <pad>, </s> at the model's ids
    for i, stage in enumerate(cfg.stages):
      if stage.windows is not None:
        raise ValueError(f"stages[{i}].windows={stage.windows}: the MLM model's windows are "
                         f"model.attention_window, not set per stage")
      if not 3 <= stage.seq_len <= model.max_sequence_length:
        raise ValueError(
            f"stages[{i}].seq_len={stage.seq_len} must be in [3, {model.max_sequence_length}] "
            f"(<s> + tokens + </s>; the position table holds {model.max_sequence_length}: "
            f"model.max_position_embeddings={model.max_position_embeddings})")

  def data_identity(self, cfg: TrainConfig) -> dict[str, Any]:
    """The training stream's length and SHA-256, the tokenizer's SHA-256, the masking rate and
    the starting weights."""
    stream = np.ascontiguousarray(self.ids(cfg, "train"))
    return {"train_tokens": int(stream.size),
            "train_sha256": hashlib.sha256(stream.tobytes()).hexdigest(),
            "tokenizer_sha256": tokenizer_sha256(self.tokenizer),
            "mask_rate": self.rate, "init": self.init_identity}

  def build_model(self, config: LongformerConfig, rngs: nnx.Rngs, mesh: Mesh | None = None,
                  seq_axis: str | None = None) -> LongformerForMaskedLM:
    return LongformerForMaskedLM(config, rngs=rngs, mesh=mesh, seq_axis=seq_axis)

  def loss(self, model, batch, stage: Stage, dropout_key: jax.Array) -> jax.Array:
    # The dropout layers draw from the model's "default" stream (it is built with
    # nnx.Rngs(seed)): keyed by the step (and microbatch) here, so every step drops anew.
    nnx.reseed(model, default=dropout_key)
    nll_BxY, weights_BxY = masked_lm_nll(
        model, batch["input_ids"], batch["labels"], pad_id=self.specials.pad,
        num_predictions=max_predictions(stage.seq_len, self.rate))
    return jnp.sum(nll_BxY) / jnp.maximum(jnp.sum(weights_BxY), 1.0)

  def batches(self, cfg: TrainConfig, stage_index: int, *, process_index: int,
              process_count: int) -> Batches:
    return MaskedBatches(self.ids(cfg, "train"), cfg.stages[stage_index], seed=cfg.seed,
                         stage_index=stage_index, specials=self.specials,
                         vocab_size=self.vocab_size, rate=self.rate,
                         process_index=process_index, process_count=process_count)

  def evaluate(self, model, cfg: TrainConfig, stage_index: int, mesh: Mesh) -> dict[str, float]:
    """Loss, bits per masked token and BPC (byte-level tokenizers) on the first
    `cfg.eval_tokens` validation tokens, in rows of the stage's sequence length."""
    result = self.score(model, self.ids(cfg, "validation"),
                        seq_len=cfg.stages[stage_index].seq_len, seed=cfg.seed,
                        max_tokens=cfg.eval_tokens, batch_size=cfg.eval_batch_size, mesh=mesh,
                        rules=cfg.logical_rules)
    return {f"valid_{k}": result[k] for k in ("loss", "bits_per_token", "bpc") if k in result}

  def score(self, model, stream: np.ndarray, *, seq_len: int, seed: int = 0,
            max_tokens: int | None = None, batch_size: int = 8, mesh: Mesh | None = None,
            rules: Sequence[tuple[str, Any]] = LOGICAL_RULES,
            progress: bool = False) -> dict[str, float]:
    """`evaluate_mlm` of `model` on a token stream with this task's tokenizer and masking rate
    (masks keyed by `seed`)."""
    return evaluate_mlm(model, stream, seq_len=seq_len, specials=self.specials,
                        bytes_per_token=self.bytes_per_token, vocab_size=self.vocab_size,
                        seed=seed, rate=self.rate, batch_size=batch_size,
                        max_tokens=max_tokens, mesh=mesh, rules=rules, progress=progress)

  def train_metrics(self, loss: float) -> dict[str, float]:
    return {"train_bits_per_token": loss / math.log(2)}

  def final_evaluation(self, cfg: TrainConfig, workdir, mesh: Mesh, *,
                       progress: bool = False) -> FinalEvaluation:
    """`evaluate_mlm_run` of the run's newest checkpoint with `cfg.final_eval`'s settings."""
    if cfg.final_eval is None:
      return FinalEvaluation({})
    result = evaluate_mlm_run(workdir, mesh=mesh, progress=progress, **cfg.final_eval)
    return FinalEvaluation({"eval": result}, lines=(f"{cfg.dataset} {describe(result)}",),
                           step=result["step"])


def check_final_eval(cfg: TrainConfig) -> None:
  """ValueError (or TypeError) naming a setting of `cfg.final_eval` that `evaluate_mlm_run`
  does not take or would refuse: checked when a run is configured, not after training."""
  settings = final_eval_settings(cfg, FINAL_EVAL_SETTINGS)
  split = settings.get("split", "test")
  if split not in SPLITS:
    raise ValueError(f"final_eval.split must be one of {SPLITS}, got {split!r}")
  try:
    if settings.get("step") is not None:
      check_int("step", settings["step"], minimum=0)
    _check_eval_limits(settings.get("batch_size", 8), settings.get("max_tokens"))
  except (TypeError, ValueError) as e:
    raise type(e)(f"final_eval: {e}") from None


def describe(result: dict[str, Any]) -> str:
  """One line for an `evaluate_mlm_run` result (and eval.mlm's of --init, which has no step)."""
  bpc = f", {result['bpc']:.4f} bpc" if "bpc" in result else ""
  step = f"; step {result['step']}" if result.get("step") is not None else ""
  return (f"{result['split']}: loss {result['loss']:.4f}, {result['bits_per_token']:.4f} bits "
          f"per masked token{bpc} ({result['masked_tokens']:,} targets{step})")


def check_run_tokenizer(tokenizer, record: Mapping[str, Any] | None,
                        source: str | os.PathLike) -> None:
  """`identity.RunFileError` naming `source` unless `tokenizer` is the one the run of `record`
  (its run record; None: a run not started, nothing to check) trained with: the same
  `tokenizer_sha256` as the record's data."""
  from longformer_jax.training import identity
  if record is not None:
    identity.check_checksum(f"the tokenizer {os.fspath(source)}",
                            record["data"]["tokenizer_sha256"], tokenizer_sha256(tokenizer),
                            "not the one the run trained with")


def evaluate_mlm_run(workdir, *, split: str = "test", step: int | None = None,
                     mesh: Mesh | None = None, max_tokens: int | None = None,
                     batch_size: int = 8, progress: bool = False) -> dict[str, Any]:
  """`evaluate_mlm` of a training run's checkpoint (default: the newest that restores and
  verifies) on a split of its dataset, with the run's tokenizer (<workdir>/tokenizer.json), seed,
  masking rate and the last stage's sequence length. Reads the parameters only. ValueError for a
  workdir that holds a run of another kind (`runs.read_run`); `identity.RunFileError` for a
  run_config.json or tokenizer.json that is not the run's (checked before the model is read)."""
  from etils import epath
  from longformer_jax.tasks.runs import read_run
  from longformer_jax.training.config import config_from_record
  from longformer_jax.training.sharding import make_mesh
  from longformer_jax.training.task import restore
  _check_eval_limits(batch_size, max_tokens)
  workdir = epath.Path(workdir)
  record, cfg = read_run(workdir, "mlm")  # checked against the checkpoints
  tokenizer = load_tokenizer(workdir / TOKENIZER_FILE)
  check_run_tokenizer(tokenizer, record, workdir / TOKENIZER_FILE)  # before the model is read
  mesh = make_mesh((-1, 1)) if mesh is None else mesh
  model, step, meta = restore(LongformerForMaskedLM, cfg, workdir, mesh, step=step)
  run = config_from_record(meta["run"], f"step {step} meta")  # the stages may have grown
  task = MLMTask(tokenizer, rate=meta["run"]["data"]["mask_rate"])
  result = task.score(model, task.ids(run, split), seq_len=run.stages[-1].seq_len,
                      seed=run.seed, max_tokens=max_tokens, batch_size=batch_size, mesh=mesh,
                      rules=run.logical_rules, progress=progress)
  return {**result, "split": split, "dataset": run.dataset, "step": step}


# ----------------------------------------------------------------------------------------------
# Starting points.


def load_pretrained(source: str | os.PathLike, *, max_positions: int, window: int
                    ) -> tuple[LongformerForMaskedLM, str]:
  """(model, kind) from a local directory (`sources.open_model_dir`): a RoBERTa made long by the
  paper's recipe (`max_positions` tokens, one-sided `window`; kind "hf_roberta"), an HF
  Longformer ("hf_longformer"; its own positions and windows), a project model checkpoint
  ("checkpoint") or an MLM training workdir ("workdir")."""
  from longformer_jax import convert
  hf = {"roberta": functools.partial(convert.roberta_to_longformer, max_positions=max_positions,
                                     window=window),
        "longformer": functools.partial(convert.from_hf, model_class=LongformerForMaskedLM)}

  def workdir_class(record, cfg):
    del record
    if not isinstance(cfg.model, LongformerConfig):
      raise ValueError(f"{os.fspath(source)!r} is a run of a {type(cfg.model).__name__} model; "
                       f"MLM pretraining continues a Longformer")
    return LongformerForMaskedLM

  kind, model = open_model_dir(source, hf, workdir_class)
  if not isinstance(model, LongformerForMaskedLM):
    raise ValueError(f"{os.fspath(source)!r} holds a {type(model).__name__}; MLM pretraining "
                     f"continues a masked LM (LongformerForMaskedLM, RobertaForMaskedLM)")
  return model, kind


def check_params_fit(config: LongformerConfig, params) -> None:
  """Raises ValueError naming the first parameter of `params` (an nnx.State) whose shape is not
  what a `LongformerForMaskedLM` of `config` has (e.g. after a `--set model.hidden_size=...` on
  top of a pretrained model). Nothing is allocated."""
  abstract = nnx.state(nnx.eval_shape(lambda: LongformerForMaskedLM(config, rngs=nnx.Rngs(0))),
                       nnx.Param)
  shapes = lambda state: {jax.tree_util.keystr(path, simple=True, separator="/"): x.shape
                          for path, x in jax.tree_util.tree_leaves_with_path(
                              nnx.to_pure_dict(state))}
  want, given = shapes(abstract), shapes(params)
  for name in sorted(set(want) | set(given)):
    if want.get(name) != given.get(name):
      raise ValueError(f"the pretrained parameter {name} has shape {given.get(name)}; the model "
                       f"config asks for {want.get(name)} (a model.* override changed its shape)")


# ----------------------------------------------------------------------------------------------
# Presets.


def mlm_paper(large: bool = False) -> TrainConfig:
  """The paper's continued MLM pretraining (paper §5, "Training Procedure"): sequences of 4,096
  tokens, batch 64 (2^18 tokens; here 8 microbatches of 8), 65K steps, peak learning rate 3e-5
  after 500 linear warm-up steps, then a power-3 polynomial decay (to 0); window 512 total
  ("Attention Pattern"), 256 per side here; "the rest of the hyperparameters are the same as
  RoBERTa": AdamW b2 0.98, eps 1e-6, weight decay 0.01, dropout 0.1. Gradient clipping at 1.0
  (RoBERTa clips none; a safety margin here). No global attention in pretraining (allenai's
  pretrain.py sets none). The model is replaced by the `--init` checkpoint's
  (roberta-base/large made long); its compute settings (bf16 matmuls, remat) are kept."""
  shape = LongformerConfig.large() if large else LongformerConfig.base()
  model = shape.replace(attention_window=256, dtype=jnp.bfloat16, remat=True)
  return TrainConfig(
      model=model, dataset="enwik8",
      stages=(Stage(seq_len=4096, batch_size=64, steps=65_000, learning_rate=3e-5,
                    warmup_steps=500, end_learning_rate=0.0, decay_power=3.0),),
      microbatch_size=8, weight_decay=0.01, adam_b1=0.9, adam_b2=0.98, adam_eps=1e-6,
      clip_norm=1.0, eval_every=1000, eval_tokens=2**18, eval_batch_size=8,
      checkpoint_every=1000, final_eval=dict(split="test", max_tokens=None, batch_size=8))


def mlm_tiny() -> TrainConfig:
  """A CPU run from scratch on enwik8_sample (bundled): 2 layers, hidden 128, 4,096-id byte-level
  BPE trained on the sample (`--init` replaces the model), 512-token sequences, window 64 per
  side, 300 steps of 8 sequences: a check of the whole pipeline, not a model (measured: test loss
  6.73 nats, 9.71 bits per masked token, 3.31 bpc, near the unigram statistics; 2.7 minutes of
  training on 2 loaded cores, ~4 in all)."""
  model = LongformerConfig(vocab_size=4096, hidden_size=128, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=512,
                           max_position_embeddings=514, attention_window=64,
                           hidden_dropout_prob=0.0)
  return TrainConfig(
      model=model, dataset="enwik8_sample",
      stages=(Stage(seq_len=512, batch_size=8, steps=300, learning_rate=1e-3, warmup_steps=30,
                    end_learning_rate=0.0, decay_power=1.0),),
      weight_decay=0.01, adam_b2=0.98, adam_eps=1e-6, eval_every=100, eval_tokens=32_768,
      eval_batch_size=8, checkpoint_every=100,
      final_eval=dict(split="test", max_tokens=65_536, batch_size=8))


# The presets (train/configs/<name>.py) that continue a pretrained model (their learning rate
# is a fine-tuning one).
NEEDS_INIT = ("mlm_paper", "mlm_paper_large")


def keep_compute_settings(pretrained: LongformerConfig, preset_model: LongformerConfig
                          ) -> LongformerConfig:
  """The pretrained model's config with the preset's compute settings (attention_impl, dtype,
  remat): what a run started from a checkpoint trains."""
  return dataclasses.replace(pretrained, attention_impl=preset_model.attention_impl,
                             dtype=preset_model.dtype, remat=preset_model.remat)


__all__ = [
    "MASK_RATE", "MLMTask", "MaskedBatches", "NEEDS_INIT", "TOKENIZER_FILE",
    "check_params_fit", "check_run_tokenizer", "evaluate_mlm",
    "evaluate_mlm_run", "keep_compute_settings", "load_pretrained", "mask_tokens",
    "masked_lm_nll", "max_predictions", "mlm_paper", "mlm_tiny",
]
