"""Band attention as blocked `jnp` einsums: the portable fast path (docs/design.md §2.3).

The sequence is cut into blocks of `block` positions and q, k, v are laid out ONCE as
[B, H, blocks, block, D] (float32, q pre-scaled), k and v with `reach = ceil(window / block)`
masked zero blocks on either side (only the left when causal). Every key of query block `n`
then lies in key block `n + s` for a shift `s` in `-reach..reach` (`-reach..0` causal), and the
scores are one tile `[block, block]` per shift: a batched dot of the query blocks with the key
blocks shifted by `s`, the shift a slice along the blocks axis of the padded keys. The softmax
runs across the tiles of a row without concatenating them (one row maximum over all tiles, one
sum), and the output is the sum of the tiles' `P @ V`. Nothing of size seq x seq, no key slab:
each key block is read by its `2 * reach + 1` tiles where it is.

The blocks are processed in groups (`lax.map` forward, `lax.scan` backward) sized so that one
group's score tiles (about `GROUP_BYTES`, at least one block) stay in the processor's cache
between the passes over them (dot, row maximum, exp, sum, `P @ V`) instead of streaming the whole
[.., N, 2w + block] scores through memory several times; each group reads its keys as one window
of `group + 2 * reach` blocks (a dynamic slice of the padded keys, not a copy of the array).

Only the tiles at the band's edge (`|s| = reach`, or a partial tile) carry a static
[block, block] band pattern; the inner tiles are entirely inside the band and only see the key
mask. The block is chosen for the window (`default_block`): the band costs
`2 * window + block` scored keys per query for its `2 * window + 1`, so smaller blocks waste
less, while each dot must stay large enough to run near the machine's matmul rate.

The backward is written by hand (`jax.custom_vjp`): it recomputes each tile's probabilities from
the saved log-sum-exp, so nothing of the scores' size is kept between the passes, and adds the
key and value gradients of the tiles of each shift into the keys' blocks directly, without the
pad-slice-concatenate round trip that differentiating a slab would make. It takes the
log-sum-exp's cotangent (`ds = P * (dP - (delta - dlse))`, docs/design.md §2.2).

Implements the band kernel contract of `band_reference.py`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax import lax

from longformer_jax.ops.band_reference import EMPTY_LSE

MAX_BLOCK = 128
# The block the window is split towards: on a 2-core CPU, [64 x 64] @ [64 x 64] tiles batched
# over blocks and heads ran as fast per useful flop as 128-row tiles while wasting half as much
# of the band (576 scored keys per query for 513 at window 256, against 640).
TARGET_BLOCK = 64
# Blocks are never smaller than this (a window of 1 would otherwise make 1-row dots); a window
# below it scores 3 blocks for its 2w + 1 keys.
MIN_BLOCK = 16
# Score bytes of one group of blocks: about one core's L2 cache, so the tiles of a group and their
# exponentials stay cached between passes. On a 2-core EPYC (1 MiB L2 per core, 16 MiB L3), the
# forward at 4k tokens, window 256, 12 heads took 0.72x the CPU time of the whole-array version
# with 1 MiB groups (one block per group there), 0.76x with 4 MiB, 0.93x with 16 MiB.
GROUP_BYTES = 1 << 20
# Masked scores: after the row maximum is subtracted, exp() of them is exactly 0 whenever the row
# has one real key; finite, so nothing computes inf - inf (band_reference.py uses the same value).
_MASKED_SCORE = -1e30


def default_block(window: int) -> int:
  """The block for a one-sided window: the window split into `round(window / TARGET_BLOCK)`
  equal parts (at least one), each of at least `MIN_BLOCK` and at most `MAX_BLOCK` rows."""
  window = max(window, 1)
  parts = max(1, round(window / TARGET_BLOCK), math.ceil(window / MAX_BLOCK))
  return max(MIN_BLOCK, math.ceil(window / parts))


def _tile_band(block: int, shift: int, window: int, causal: bool) -> np.ndarray | None:
  """[block, block] bool: which keys of key block `n + shift` are in the band of each query of
  block `n`; None when all are (an inner tile needs no band pattern)."""
  delta = np.arange(block)[:, None] - np.arange(block)[None, :] - shift * block  # i - j
  keep = (delta >= 0) & (delta <= window) if causal else np.abs(delta) <= window
  return None if keep.all() else keep


def _shifted(x, geometry, shift):
  """The key blocks `n + shift` of every query block `n` of a group (a slice of the group's key
  window, whose blocks axis is padded by `reach` blocks)."""
  _, _, group, reach = geometry
  start = reach + shift
  return x[:, :, start:start + group] if x.ndim == 5 else x[:, start:start + group]


def _tile_scores(q_t, k_t, key_ok, geometry, shift):
  """Masked scores of one shift: [B, H, blocks, Q, K] float32."""
  window, causal, _, _ = geometry
  block = q_t.shape[3]
  s_BxHxNxQxK = jnp.einsum("bhnqd,bhnkd->bhnqk", q_t, _shifted(k_t, geometry, shift))
  keep = _shifted(key_ok, geometry, shift)[:, None, :, None, :]  # [B, 1, blocks, 1, K]
  band = _tile_band(block, shift, window, causal)
  if band is not None:
    keep = keep & band
  return jnp.where(keep, s_BxHxNxQxK, _MASKED_SCORE)


def _shifts(geometry):
  _, causal, _, reach = geometry
  return range(-reach, 1) if causal else range(-reach, reach + 1)


def _group_forward(q_t, k_t, v_t, key_ok, geometry):
  scores = [_tile_scores(q_t, k_t, key_ok, geometry, s) for s in _shifts(geometry)]
  row_max = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1) for s in scores])  # [B,H,N,Q]
  # A row with a real key has a real maximum; a row without one has exactly the masked score.
  has_key = row_max > 0.5 * _MASKED_SCORE
  unnorm = [jnp.exp(s - row_max[..., None]) for s in scores]
  denom = functools.reduce(jnp.add, [jnp.sum(p, axis=-1) for p in unnorm])
  acc = functools.reduce(jnp.add, [
      jnp.einsum("bhnqk,bhnkd->bhnqd", p, _shifted(v_t, geometry, s))
      for p, s in zip(unnorm, _shifts(geometry))])
  inv_denom = jnp.where(has_key, 1.0 / denom, 0.0)
  out_t = acc * inv_denom[..., None]
  lse = jnp.where(has_key, row_max + jnp.log(denom), EMPTY_LSE)
  # The backward recomputes P = exp(score - lse); for a row without a key it must be 0, which
  # an lse of +1e30 gives (every score there is finite and far below it).
  lse_bwd = jnp.where(has_key, lse, -_MASKED_SCORE)
  return (out_t, lse), (q_t, k_t, v_t, key_ok, out_t, lse_bwd)


def _group_backward(geometry, residuals, cotangents):
  q_t, k_t, v_t, key_ok, out_t, lse_bwd = residuals
  dout_t, dlse = cotangents
  _, _, group, reach = geometry
  # ds = P * (dP - (delta - dlse)), delta = rowsum(out * dout) (docs/design.md §2.2).
  delta = jnp.sum(out_t * dout_t, axis=-1) - dlse  # [B, H, blocks, Q]
  dq_t = None
  dk_t = jnp.zeros_like(k_t)
  dv_t = jnp.zeros_like(v_t)
  for s in _shifts(geometry):
    k_s, v_s = _shifted(k_t, geometry, s), _shifted(v_t, geometry, s)
    p = jnp.exp(_tile_scores(q_t, k_t, key_ok, geometry, s) - lse_bwd[..., None])
    dv_s = jnp.einsum("bhnqk,bhnqd->bhnkd", p, dout_t)
    dp = jnp.einsum("bhnqd,bhnkd->bhnqk", dout_t, v_s)
    ds = p * (dp - delta[..., None])
    dq_s = jnp.einsum("bhnqk,bhnkd->bhnqd", ds, k_s)
    dk_s = jnp.einsum("bhnqk,bhnqd->bhnkd", ds, q_t)
    dq_t = dq_s if dq_t is None else dq_t + dq_s
    # The tiles of shift s are key blocks reach + s .. reach + s + blocks of the padded keys.
    start = reach + s
    dk_t = dk_t.at[:, :, start:start + group].add(dk_s)
    dv_t = dv_t.at[:, :, start:start + group].add(dv_s)
  return dq_t, dk_t, dv_t


def _key_window(x, group_index, geometry):
  """The key blocks of one group: its `group` blocks and `reach` more on either side (left only
  when causal), from the padded keys [B, H, blocks, K, D] or key mask [B, blocks, K]."""
  _, causal, group, reach = geometry
  size = group + reach * (1 if causal else 2)
  return lax.dynamic_slice_in_dim(x, group_index * group, size, axis=2 if x.ndim == 5 else 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _band_groups(q_g, k_t, v_t, key_ok, geometry):
  """q_g [groups, B, H, group, Q, D] against the padded k_t, v_t [B, H, blocks, K, D]:
  (out [groups, B, H, group, Q, D], lse [groups, B, H, group, Q])."""
  return _band_groups_forward(q_g, k_t, v_t, key_ok, geometry)[0]


def _band_groups_forward(q_g, k_t, v_t, key_ok, geometry):
  def one_group(args):
    q_t, g = args
    (out_t, lse), residuals = _group_forward(
        q_t, _key_window(k_t, g, geometry), _key_window(v_t, g, geometry),
        _key_window(key_ok, g, geometry), geometry)
    return out_t, lse, residuals[-1]

  out_g, lse_g, lse_bwd_g = lax.map(one_group, (q_g, jnp.arange(q_g.shape[0])))
  return (out_g, lse_g), (q_g, k_t, v_t, key_ok, out_g, lse_bwd_g)


def _band_groups_backward(geometry, residuals, cotangents):
  q_g, k_t, v_t, key_ok, out_g, lse_bwd_g = residuals
  dout_g, dlse_g = cotangents
  _, causal, group, reach = geometry
  size = group + reach * (1 if causal else 2)

  def one_group(carry, xs):
    dk_t, dv_t = carry
    q_t, out_t, dout_t, dlse, lse_bwd, g = xs
    dq_t, dk_w, dv_w = _group_backward(
        geometry, (q_t, _key_window(k_t, g, geometry), _key_window(v_t, g, geometry),
                   _key_window(key_ok, g, geometry), out_t, lse_bwd), (dout_t, dlse))
    # Each group adds into its own key window; neighbouring windows overlap by 2 * reach blocks.
    start = g * group
    dk_t = lax.dynamic_update_slice_in_dim(
        dk_t, lax.dynamic_slice_in_dim(dk_t, start, size, axis=2) + dk_w, start, axis=2)
    dv_t = lax.dynamic_update_slice_in_dim(
        dv_t, lax.dynamic_slice_in_dim(dv_t, start, size, axis=2) + dv_w, start, axis=2)
    return (dk_t, dv_t), dq_t

  xs = (q_g, out_g, dout_g, dlse_g, lse_bwd_g, jnp.arange(q_g.shape[0]))
  (dk_t, dv_t), dq_g = lax.scan(one_group, (jnp.zeros_like(k_t), jnp.zeros_like(v_t)), xs)
  return dq_g, dk_t, dv_t, None


_band_groups.defvjp(_band_groups_forward, _band_groups_backward)


def default_group(batch: int, heads: int, block: int, reach: int, num_blocks: int) -> int:
  """Blocks per group: as many as keep the group's score tiles within `GROUP_BYTES`."""
  tile_bytes = batch * heads * (2 * reach + 1) * block * block * 4
  return max(1, min(num_blocks, GROUP_BYTES // tile_bytes))


def band_attention_chunked(q, k, v, key_mask, *, window: int, causal: bool,
                           block: int | None = None):
  """Band attention over blocks; see the module docstring and `band_reference.py`."""
  batch, seq, heads, head_dim = q.shape
  # A window past the sequence attends everything; clamping keeps the band no wider than needed.
  window = min(window, seq - 1)
  block = min(block or default_block(window), max(seq, 1))
  reach = math.ceil(window / block)
  group = default_group(batch, heads, block, reach, math.ceil(seq / block))
  num_groups = math.ceil(seq / (block * group))
  num_blocks = num_groups * group
  pad_end = num_blocks * block - seq
  right = 0 if causal else reach

  # q: [B, N, H, D] -> [groups, B, H, group, Q, D], float32, pre-scaled (N*D multiplies rather
  # than one per score), in one copy.
  q_g = jnp.pad(q.astype(jnp.float32) * (1.0 / math.sqrt(head_dim)),
                [(0, 0), (0, pad_end), (0, 0), (0, 0)])
  q_g = q_g.reshape(batch, num_groups, group, block, heads, head_dim).transpose(1, 0, 4, 2, 3, 5)

  def key_layout(x):
    # [B, N, H, D] -> [B, H, blocks + reach (+ reach), K, D], float32, zero blocks at the ends.
    x = jnp.pad(x.astype(jnp.float32),
                [(0, 0), (reach * block, right * block + pad_end), (0, 0), (0, 0)])
    return x.transpose(0, 2, 1, 3).reshape(batch, heads, -1, block, head_dim)

  key_ok = jnp.pad(key_mask.astype(bool), [(0, 0), (reach * block, right * block + pad_end)])
  out_g, lse_g = _band_groups(q_g, key_layout(k), key_layout(v), key_ok.reshape(batch, -1, block),
                              (window, causal, group, reach))
  out = out_g.transpose(1, 0, 3, 4, 2, 5).reshape(batch, num_blocks * block, heads, head_dim)
  lse = lse_g.transpose(1, 2, 0, 3, 4).reshape(batch, heads, num_blocks * block)
  return out[:, :seq].astype(q.dtype), lse[..., :seq]
