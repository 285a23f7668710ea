"""The chunked band kernel as it was before its slab-free rewrite, kept ONLY so that
`benchmarks/attention.py --op-table` can time the old path beside the new one in one process
(the gain measured apart from machine load). Not part of the library; not maintained.

Old design (docs/design.md §2.3 before the rewrite): k and v padded by `reach` blocks, the shifted
views concatenated into one [B * blocks, (2 * reach + 1) * block, H, D] slab per query block,
one static band pattern over the slab, and XLA autodiff for the backward."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from longformer_jax.ops.band_reference import masked_softmax_attention

MAX_BLOCK = 128


def default_block(window: int) -> int:
  """The largest block <= MAX_BLOCK that divides the window into equal parts."""
  window = max(window, 1)
  return math.ceil(window / math.ceil(window / MAX_BLOCK))


def _slab_band_mask(block: int, shifts, window: int, causal: bool) -> np.ndarray:
  """[block, slab] bool: which slab keys are in the band of each query of a block."""
  r = np.arange(block)[:, None]
  key_offset = (np.asarray(shifts)[:, None] * block + np.arange(block)[None, :]).reshape(1, -1)
  delta = r - key_offset  # query position - key position
  if causal:
    return (delta >= 0) & (delta <= window)
  return np.abs(delta) <= window


def band_attention_chunked(q, k, v, key_mask, *, window: int, causal: bool,
                           block: int | None = None):
  """Band attention over blocks; see the module docstring and `band_reference.py`."""
  batch, seq, heads, head_dim = q.shape
  # A window past the sequence attends everything; clamping keeps the slab no bigger than needed.
  window = min(window, seq - 1)
  block = block or default_block(window)
  reach = math.ceil(window / block)
  num_blocks = math.ceil(seq / block)
  shifts = range(-reach, 1) if causal else range(-reach, reach + 1)

  def blocks_of(x_BxN, fill):
    # Pad `reach` blocks on the left (and right) so every shifted view is in range.
    pad_right = num_blocks * block - seq + (0 if causal else reach * block)
    widths = [(0, 0), (reach * block, pad_right)] + [(0, 0)] * (x_BxN.ndim - 2)
    x = jnp.pad(x_BxN, widths, constant_values=fill)
    return x.reshape(batch, -1, block, *x_BxN.shape[2:])

  def slab_of(x_blocks):
    # Key block b + s for every shift s, side by side: [batch, blocks, slab, ...].
    views = [x_blocks[:, reach + s: reach + s + num_blocks] for s in shifts]
    return jnp.concatenate(views, axis=2)

  # Tiles: a query block is a query tile (Q = block rows), its slab a key tile (K = slab rows);
  # batch and blocks are merged into the leading axis of every *_tiles array.
  q_blocks = jnp.pad(q, [(0, 0), (0, num_blocks * block - seq), (0, 0), (0, 0)])
  q_tiles = q_blocks.reshape(batch * num_blocks, block, heads, head_dim)  # [B * blocks, Q, H, D]
  k_tiles = slab_of(blocks_of(k, 0)).reshape(batch * num_blocks, -1, heads, head_dim)  # .., K, ..
  v_tiles = slab_of(blocks_of(v, 0)).reshape(batch * num_blocks, -1, heads, head_dim)
  key_ok_tiles = slab_of(blocks_of(key_mask.astype(bool), False)).reshape(
      batch * num_blocks, -1)  # [B * blocks, K]

  band_QxK = jnp.asarray(_slab_band_mask(block, shifts, window, causal))
  mask_tiles = band_QxK[None, None] & key_ok_tiles[:, None, None, :]  # [B * blocks, 1, Q, K]
  out, lse, _ = masked_softmax_attention(q_tiles, k_tiles, v_tiles, mask_tiles)

  out = out.reshape(batch, num_blocks * block, heads, head_dim)[:, :seq]
  lse_BxHxN = (lse.reshape(batch, num_blocks, heads, block).transpose(0, 2, 1, 3)
               .reshape(batch, heads, num_blocks * block)[..., :seq])
  return out, lse_BxHxN
