"""Scoring whole examples on a mesh: batches of example rows, host batches put on the mesh the
way training batches are, results brought back to every process, and a progress bar.

Evaluation and prediction (seq2seq, fine-tuning, MLM) go through a dataset's examples in order,
not through a training sampler: every process holds the whole host batch, and every example is
scored exactly once. `row_batches` fills the last batch with copies of its last real row, so that
no row is all padding (a fully padded row has no key to attend to); callers drop the copies.

    for rows, real in examples.row_batches(len(split), batch_size, mesh):
      batch = make_batch(split, rows)                       # host arrays, rows first
      out = examples.to_host(score(state, examples.put_batch(batch, mesh)))[:real]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from longformer_jax.data.text import ExampleSampler
from longformer_jax.training.sharding import LOGICAL_RULES, batch_axes, batch_sharding

__all__ = ["ExampleBatches", "nll_sums_fn", "progress", "put_batch", "row_batches",
           "row_multiple", "to_host"]


def nll_sums_fn(nll: Callable[..., tuple[jax.Array, jax.Array]], graphdef, **static
                ) -> Callable[[Any, Mapping[str, jax.Array]], tuple[jax.Array, jax.Array]]:
  """The jitted scorer of every evaluation: (model state, batch) -> (sum of the negative
  log-likelihoods, sum of their weights) over the batch, for `nll(model, batch, **static)`, which
  returns per-position (nll, weights) arrays with the nll already weighted (0 where nothing is
  scored). One compilation per (nll, model structure, static settings): evaluating every N
  training steps reuses it. Callers sum the results on the host in float64."""
  return _nll_sums_fn(nll, graphdef, tuple(sorted(static.items())))


@functools.lru_cache(maxsize=32)
def _nll_sums_fn(nll, graphdef, static):

  @jax.jit
  def nll_sums(state, batch):
    nll_sum, weights = nll(nnx.merge(graphdef, state), batch, **dict(static))
    return jnp.sum(nll_sum), jnp.sum(weights)

  return nll_sums


class ExampleBatches(ExampleSampler):
  """Training `Batches` of whole examples: the sampler's order over `rows` (the indices of the
  examples trained on), each batch `make(rows of the batch)`'s host arrays; state() and
  load_state() are the sampler's (`data.text.ExampleSampler`: global_batch_size, seed,
  process_index, process_count)."""

  def __init__(self, make: Callable[[list[int]], dict[str, np.ndarray]], rows: Sequence[int],
               **sampler_args):
    super().__init__(len(rows), **sampler_args)
    self._make, self._rows = make, list(rows)

  def __next__(self) -> dict[str, np.ndarray]:
    return self._make([self._rows[i] for i in super().__next__()])


def row_multiple(mesh: Mesh | None) -> int:
  """How many devices split a batch's rows (1 on no mesh): batch sizes are rounded up to it."""
  return 1 if mesh is None else math.prod(mesh.shape[a] for a in batch_axes(mesh))


def row_batches(num_examples: int, batch_size: int, mesh: Mesh | None = None
                ) -> list[tuple[list[int], int]]:
  """(rows, real) per batch: `batch_size` example indices (rounded up to `row_multiple(mesh)`),
  of which the first `real` are new; the last batch repeats its last example to fill up."""
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  multiple = row_multiple(mesh)
  batch_size = -(-batch_size // multiple) * multiple
  batches = []
  for first in range(0, num_examples, batch_size):
    rows = list(range(first, min(first + batch_size, num_examples)))
    batches.append((rows + [rows[-1]] * (batch_size - len(rows)), len(rows)))
  return batches


def put_batch(batch: Mapping[str, np.ndarray], mesh: Mesh | None,
              rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> dict[str, jax.Array]:
  """Every process's copy of the whole host `batch` as global arrays laid out like training
  batches (`sharding.batch_sharding`: rows over the batch axes, positions over a sequence axis);
  on no mesh, plain device arrays."""
  if mesh is None:
    return {k: jnp.asarray(v) for k, v in batch.items()}
  return {k: jax.make_array_from_callback(v.shape, batch_sharding(mesh, rules, v.shape),
                                          lambda index, v=v: v[index])
          for k, v in batch.items()}


def to_host(x: jax.Array) -> np.ndarray:
  """A global array's whole value, on every process."""
  if x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def progress(iterable: Iterable, total: int, desc: str, unit: str, enabled: bool = True):
  """`iterable` behind a tqdm bar (rate, ETA) on process 0 when `enabled`; else itself."""
  if not (enabled and jax.process_index() == 0):
    return iterable
  from tqdm import tqdm
  return tqdm(iterable, total=total, desc=desc, unit=unit, dynamic_ncols=True)
