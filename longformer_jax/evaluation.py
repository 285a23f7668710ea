"""Bits per character of a causal byte LM over a whole split, every character scored once.

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
import functools
import math
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longformer_jax import checkpoint
from longformer_jax.causal_lm import LongformerForCausalLM, next_byte_nll

PROTOCOLS = ("sliding", "chunks")


@dataclasses.dataclass(frozen=True)
class Window:
  start: int       # first input position
  end: int         # one past the last input position
  score_from: int  # first scored input position (start <= score_from < end)


def window_plan(num_bytes: int, context: int, stride: int, protocol: str = "sliding"
                ) -> list[Window]:
  """The windows that score each of the num_bytes - 1 predictions exactly once."""
  if protocol not in PROTOCOLS:
    raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
  if context < 1:
    raise ValueError(f"context must be >= 1, got {context}")
  if protocol == "sliding" and not 1 <= stride <= context:
    raise ValueError(f"stride must be in [1, context={context}], got {stride}")
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


@functools.lru_cache(maxsize=16)
def _nll_sums_fn(graphdef, windows):
  """One jitted scorer per model structure and windows: evaluating every N training steps
  reuses the compiled function instead of tracing a new one."""

  @jax.jit
  def nll_sums(state, inputs_BxN, targets_BxN, weights_BxN):
    logits_BxNxV = nnx.merge(graphdef, state)(inputs_BxN, windows=windows)
    nll_BxN = next_byte_nll(logits_BxNxV, targets_BxN)
    return jnp.sum(nll_BxN * weights_BxN), jnp.sum(weights_BxN)

  return nll_sums


def evaluate_nll(model: nnx.Module, data: np.ndarray, *, context: int = 32256, stride: int = 512,
                 score_last: int | None = None, batch_size: int = 1, protocol: str = "sliding",
                 windows: Sequence[int] | None = None, mesh: jax.sharding.Mesh | None = None,
                 progress: bool = False) -> tuple[float, int]:
  """(sum of cross-entropies in nats, number of scored predictions); see `evaluate_bpc`."""
  if score_last is not None and protocol == "sliding" and score_last != stride:
    raise ValueError(
        f"score_last={score_last} differs from stride={stride}: each character is scored "
        "exactly once only when a window scores exactly the positions it adds")
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  data = np.asarray(data)
  if data.ndim != 1:
    raise ValueError(f"data must be a 1-D array of token ids, got shape {data.shape}")
  plan = window_plan(len(data), context, stride, protocol)
  length = max(w.end - w.start for w in plan)
  graphdef, state = nnx.split(model)
  windows = None if windows is None else tuple(windows)

  if mesh is not None:
    # Not at the top: `import longformer_jax` (which imports this module) leaves training out.
    from longformer_jax.training.sharding import (  # pylint: disable=g-import-not-at-top
        batch_axes, row_group, seq_axis)
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

  nll_sums = _nll_sums_fn(graphdef, windows)
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
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    batches = tqdm(batches, total=math.ceil(len(plan) / batch_size), desc=f"eval {protocol}",
                   unit="batch")
  for inputs, targets, weights in batches:
    s, c = nll_sums(state, put(inputs), put(targets), put(weights))
    # Sum on the host in float64: a 5M-character split overflows float32's exact range.
    total += float(s)
    count += int(round(float(c)))
  return total, count


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
  total, count = evaluate_nll(model, data, context=context, stride=stride, score_last=score_last,
                              batch_size=batch_size, protocol=protocol, windows=windows,
                              mesh=mesh, progress=progress)
  return total / count / math.log(2)


def _default_mesh(mesh):
  from longformer_jax.training import make_mesh  # pylint: disable=g-import-not-at-top
  return make_mesh((-1, 1)) if mesh is None else mesh


def restore_run(workdir, *, step: int | None = None, mesh: jax.sharding.Mesh | None = None):
  """(model, step, windows) of a training run's checkpoint: the model of
  <workdir>/run_config.json with the parameters of checkpoint `step` (default: the newest that
  restores and verifies; damaged ones are skipped with a warning) and nothing else (no optimizer
  state), built for and sharded over `mesh` (default: all devices on the data axis) by the run's
  logical rules; windows: the final stage's, from the settings saved with that checkpoint."""
  # Not at the top: `import longformer_jax` (which imports this module) leaves training out.
  from longformer_jax.training import (  # pylint: disable=g-import-not-at-top
      param_shardings, read_run_config)
  from longformer_jax.training.config import (  # pylint: disable=g-import-not-at-top
      config_from_record)
  from longformer_jax.training.sharding import seq_axis  # pylint: disable=g-import-not-at-top
  cfg = read_run_config(workdir)
  mesh = _default_mesh(mesh)
  model, step, meta = checkpoint.restore_model_and_meta(
      lambda: LongformerForCausalLM(cfg.model, rngs=nnx.Rngs(cfg.seed), mesh=mesh,
                                    seq_axis=seq_axis(mesh)),
      workdir, step=step,
      shardings=lambda params: param_shardings(params, mesh, cfg.logical_rules))
  # The stages may have grown since the run started (an extended run): the checkpoint's own
  # settings say which windows its last stage trains with.
  windows = config_from_record(meta["run"], f"step {step} meta").stage_windows(-1)
  return model, step, windows


def evaluate_run(workdir, data: np.ndarray, *, step: int | None = None,
                 mesh: jax.sharding.Mesh | None = None, context: int = 32256, stride: int = 512,
                 score_last: int | None = None, batch_size: int = 1, protocol: str = "sliding",
                 progress: bool = False) -> dict:
  """BPC of a training run's checkpoint on `data`: the evaluation of train/charlm.py (after
  training) and of eval/bpc.py.

  Reads <workdir>/run_config.json for the model, restores the parameters of checkpoint `step`
  (default: the newest that restores and verifies; damaged ones are skipped with a warning) and
  nothing else (`checkpoint.load_params`: no optimizer state), and scores `data` with the final
  stage's attention windows of the settings saved with that checkpoint (`evaluate_bpc`'s other
  arguments). mesh: the batch is split over it as in `evaluate_bpc`, the model is built for it,
  and the parameters are sharded by the run's logical rules (default: all devices on the data
  axis). Returns {"bpc", "bytes", "step", "windows", and the protocol}.
  """
  mesh = _default_mesh(mesh)
  model, step, windows = restore_run(workdir, step=step, mesh=mesh)
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
