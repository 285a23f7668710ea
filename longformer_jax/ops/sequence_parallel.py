"""Collectives of sequence-parallel band attention (docs/design.md §2.6), per shard of the sequence.

Every function runs inside `shard_map` on one shard's slice of the sequence ([B, n, ...] with
n = seq / shards) and names the mesh axis the sequence is split over. What moves between shards,
and why it is the minimum:
  * keys/values of the band: a query sees at most `window * dilation` positions on either side,
    so a shard needs exactly that many rows from its neighbours (`halo_exchange`: `ppermute`,
    one hop per neighbouring shard the halo reaches into; causal bands need the left side only).
    Never the whole sequence.
  * global tokens: at most `max_global` per row, so their keys/values are all-gathered
    (`all_gather_slots`: [B, shards * G, ...]) and every shard attends them locally.
  * global rows: a global query attends every key, so each shard attends its own keys and the
    partial softmaxes are merged across shards by their log-sum-exps (`merge_partial_softmax`),
    each shard receiving only the rows of its own global tokens (`psum_scatter`).
All three are differentiable: `ppermute`, `all_gather` and `psum_scatter` transpose into one
another, so the backward pass moves exactly as much as the forward.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax


def halo_exchange(x_BxNx, *, axis_name: str, num_shards: int, left: int, right: int):
  """[B, n, ...] per shard -> [B, left + n + right, ...]: `left` rows that precede this shard's
  first row and `right` rows that follow its last, taken from the neighbouring shards.

  Rows beyond either end of the whole sequence are zeros (a `ppermute` with no source sends
  zeros), so a key mask exchanged alongside the keys masks them out. `left`/`right` may exceed
  n: the halo then spans several shards, one `ppermute` per shard it reaches into.
  """
  n = x_BxNx.shape[1]
  if n == 0:
    raise ValueError("halo_exchange needs at least one row per shard")
  parts = []
  # Left halo, farthest shard first so that rows stay in sequence order: from shard s - j this
  # shard needs its last min(n, left - (j - 1) n) rows.
  for hop in range(math.ceil(left / n), 0, -1):
    rows = min(n, left - (hop - 1) * n)
    perm = [(src, src + hop) for src in range(num_shards - hop)]
    parts.append(lax.ppermute(x_BxNx[:, n - rows:], axis_name, perm))
  parts.append(x_BxNx)
  # Right halo, nearest shard first: from shard s + j the first min(n, right - (j - 1) n) rows.
  for hop in range(1, math.ceil(right / n) + 1):
    rows = min(n, right - (hop - 1) * n)
    perm = [(src, src - hop) for src in range(hop, num_shards)]
    parts.append(lax.ppermute(x_BxNx[:, :rows], axis_name, perm))
  return jnp.concatenate(parts, axis=1) if len(parts) > 1 else x_BxNx


def all_gather_slots(x_BxG, *, axis_name: str):
  """[B, G, ...] per shard -> [B, shards * G, ...]: shard s's slots are block s of the result."""
  return lax.all_gather(x_BxG, axis_name, axis=1, tiled=True)


def merge_partial_softmax(out_BxSGxHxD, lse_BxHxSG, *, axis_name: str):
  """Merges, across shards, softmax attention of the same queries over each shard's keys, and
  returns to each shard the rows of its own slots (the block of `all_gather_slots` it sent).

  out: [B, shards * G, H, D] float32, each shard's attention over its keys (normalised over them);
  lse: [B, H, shards * G] its log-sum-exp (`EMPTY_LSE` where the shard had no key).
  Returns [B, G, H, D] float32: softmax over the union of every shard's keys.
  """
  # The shift only keeps exp() in range; stop_gradient before pmax, which has no derivative.
  shift_BxHxSG = lax.pmax(lax.stop_gradient(lse_BxHxSG), axis_name)
  weight_BxHxSG = jnp.exp(lse_BxHxSG - shift_BxHxSG)  # 0 for shards without a key
  weighted = out_BxSGxHxD * weight_BxHxSG.transpose(0, 2, 1)[..., None]
  num_BxGxHxD = lax.psum_scatter(weighted, axis_name, scatter_dimension=1, tiled=True)
  den_BxHxG = lax.psum_scatter(weight_BxHxSG, axis_name, scatter_dimension=2, tiled=True)
  # Filler slots (no global token) have no key anywhere: 0 / 1 instead of 0 / 0.
  den_BxHxG = jnp.where(den_BxHxG > 0, den_BxHxG, 1.0)
  return num_BxGxHxD / den_BxHxG.transpose(0, 2, 1)[..., None]
