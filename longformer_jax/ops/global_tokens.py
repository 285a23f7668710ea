"""Global tokens around a band kernel (docs/design.md §2.1 steps 3-5, §2.4): the slots that
hold each row's global positions, the log-sum-exp merge of the band with the global keys, the
dense pass of the global queries over every key, and the rows written back.

Each row's global positions are gathered into `G` static slots (`global_slots`; `G` is the
largest count in the batch, or `max_global` when the mask is traced), so everything here is
`O(N·G)`. `finish` poisons the rows with more global tokens than slots and zeroes padding.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from longformer_jax.ops.band_reference import masked_softmax_attention

def global_slots(global_mask, num_global: int):
  """Positions of each row's global tokens, [batch, num_global], and which slots are real (a
  row with more globals than slots loses the rest here: `finish` poisons it)."""
  # The barrier keeps XLA from constant-folding what follows when the mask is a constant (a
  # fixed layout): it folded the stable argsort this replaced in 3.6 s at 1 x 65536 and 33 s at
  # 8 x 65536 on CPU, and seconds on the H200, at every compile.
  global_mask = lax.optimization_barrier(global_mask)
  # Slot g holds the (g+1)-th global position of the row: the number of positions whose running
  # count of globals is <= g. O(N * num_global), no sort; filler slots point at the last row.
  count_BxN = jnp.cumsum(global_mask, axis=1, dtype=jnp.int32)
  slots_G = jnp.arange(num_global, dtype=jnp.int32)
  idx_BxG = jnp.sum(count_BxN[:, None, :] <= slots_G[None, :, None], axis=2, dtype=jnp.int32)
  idx_BxG = jnp.minimum(idx_BxG, global_mask.shape[1] - 1)
  valid_BxG = slots_G[None, :] < count_BxN[:, -1:]
  return idx_BxG, valid_BxG


def has_slots(global_mask, num_global: int) -> bool:
  """Whether global attention runs: a global mask and at least one slot (a traced mask with
  max_global=0 has none: `finish` poisons its rows that hold global tokens)."""
  return global_mask is not None and num_global > 0


def gather_rows(x_BxNx_, idx_BxG):
  """Rows idx_BxG of x [B, N, ...] -> [B, G, ...]."""
  return jnp.take_along_axis(x_BxNx_, idx_BxG.reshape(idx_BxG.shape + (1,) * (x_BxNx_.ndim - 2)),
                             axis=1)


def merge_band_and_global_keys(band_out, band_lse, q, k_glob, v_glob, valid_BxG):
  """Step 3: every query over the global keys (local projections), merged with the band by LSE.
  Returns float32 [B, N, H, D]."""
  glob_out, glob_lse, _ = masked_softmax_attention(q, k_glob, v_glob, valid_BxG[:, None, None, :])
  lse_BxHxN = jnp.logaddexp(band_lse, glob_lse)
  w_band = jnp.exp(band_lse - lse_BxHxN).transpose(0, 2, 1)[..., None]  # [B, N, H, 1]
  w_glob = jnp.exp(glob_lse - lse_BxHxN).transpose(0, 2, 1)[..., None]
  return w_band * band_out.astype(jnp.float32) + w_glob * glob_out.astype(jnp.float32)


def _slot_hits(idx_BxG, valid_BxG, seq: int):
  """bool [B, N] per slot: the position each real slot holds (slots hold distinct positions)."""
  positions_1xN = jnp.arange(seq)[None, :]
  return [valid_BxG[:, g:g + 1] & (idx_BxG[:, g:g + 1] == positions_1xN)
          for g in range(idx_BxG.shape[1])]


def scatter_global_rows(out, rows_BxGx_, idx_BxG, valid_BxG):
  """Step 4's rows written over the global positions of out [B, N, ...]: one select per slot
  rather than a scatter. Elementwise, XLA fuses the selects with those around them (and their
  transposes with the cotangent's), where a scatter and its transpose each copied a full-size
  array."""
  expand = (1,) * (out.ndim - 2)
  rows_BxGx_ = rows_BxGx_.astype(out.dtype)
  for g, hit_BxN in enumerate(_slot_hits(idx_BxG, valid_BxG, out.shape[1])):
    out = jnp.where(hit_BxN.reshape(hit_BxN.shape + expand), rows_BxGx_[:, g:g + 1], out)
  return out


def finish(out, attention_mask, global_mask, num_global, axis_name=None):
  """Step 5: rows with more global tokens than `num_global` slots (only possible with a traced
  mask and a too-small max_global, 0 included) set to NaN rather than silently losing global
  tokens; padding queries zeroed. `axis_name`: the mesh axis the sequence is split over (the
  rows' counts are summed over it)."""
  if global_mask is not None:
    count_B = jnp.sum(global_mask, axis=1, dtype=jnp.int32)
    if axis_name is not None:
      count_B = lax.psum(count_B, axis_name)
    out = jnp.where((count_B > num_global).reshape((-1,) + (1,) * (out.ndim - 1)), jnp.nan,
                    out)
  return jnp.where(attention_mask.reshape(attention_mask.shape + (1,) * (out.ndim - 2)), out, 0)


def with_globals(band_out, band_lse, q, k, v, global_qkv, attention_mask, global_mask,
                  num_global):
  """Steps 3-4 of the module docstring."""
  idx_BxG, valid_BxG = global_slots(global_mask, num_global)
  out = merge_band_and_global_keys(band_out, band_lse, q, gather_rows(k, idx_BxG),
                                    gather_rows(v, idx_BxG), valid_BxG)
  return scatter_global_rows(out, _global_rows(*global_qkv, idx_BxG, attention_mask), idx_BxG,
                              valid_BxG)


def _global_rows(q_g, k_g, v_g, idx_BxG, attention_mask):
  """Step 4: the global queries over every real key, global projections: [B, G, H, D]."""
  out, _, _ = masked_softmax_attention(gather_rows(q_g, idx_BxG), k_g, v_g,
                                       attention_mask[:, None, None, :])
  return out


def _block_diagonal(rows_BxGxHxD):
  """[B, G, H, D] -> [B, G*H, H*D]: row (g, h) holds head h's vector in head h's lanes, zeros
  elsewhere, so that one matmul against a [B, N, H*D] array computes every head's products."""
  batch, slots, heads, head_dim = rows_BxGxHxD.shape
  eye_HxH = jnp.eye(heads, dtype=rows_BxGxHxD.dtype)
  rows = rows_BxGxHxD[:, :, :, None, :] * eye_HxH[None, None, :, :, None]
  return rows.reshape(batch, slots * heads, heads * head_dim)


def _diagonal(x_BxKxC, heads: int):
  """The inverse of `_block_diagonal`: [B, G*H, H*D] -> [B, G, H, D], head h's lanes of row
  (g, h)."""
  batch, rows, lanes = x_BxKxC.shape
  x = x_BxKxC.reshape(batch, rows // heads, heads, heads, lanes // heads)
  eye_HxH = jnp.eye(heads, dtype=x.dtype)
  return jnp.sum(x * eye_HxH[None, None, :, :, None], axis=3)


def _dot(spec, a, b, dtype):
  return jnp.einsum(spec, a, b, preferred_element_type=dtype)


@jax.custom_vjp
def global_rows_dense(q_rows_BxGxHxD, k_g_BxNxC, v_g_BxNxC, key_mask_BxN):
  """Step 4 with k_g, v_g as [B, N, H*D], zeroed at padding (the GPU path's, and TPU lengths
  that `band_mosaic.global_rows` does not take): the G global queries, block-diagonal
  (`_block_diagonal`), against every key in one matmul per product, with no transposed copy on
  a GPU; inputs in their dtype, float32 accumulation and softmax, the gradients of k_g and v_g
  written in their dtype: no float32 copy of a full-size array. Returns [B, G, H, D] in q's
  dtype (rows with no key: 0)."""
  return _global_rows_dense_fwd(q_rows_BxGxHxD, k_g_BxNxC, v_g_BxNxC, key_mask_BxN)[0]


def _global_rows_dense_fwd(q_rows_BxGxHxD, k_g_BxNxC, v_g_BxNxC, key_mask_BxN):
  heads, dtype = q_rows_BxGxHxD.shape[2], k_g_BxNxC.dtype
  scale = 1.0 / math.sqrt(q_rows_BxGxHxD.shape[3])
  q_BxKxC = _block_diagonal(q_rows_BxGxHxD.astype(dtype))
  s_BxKxN = _dot("bkc,bnc->bkn", q_BxKxC, k_g_BxNxC, jnp.float32) * scale
  s_BxKxN = jnp.where(key_mask_BxN[:, None, :], s_BxKxN, -jnp.inf)
  m_BxKx1 = jnp.max(s_BxKxN, axis=-1, keepdims=True)
  m_BxKx1 = jnp.where(m_BxKx1 == -jnp.inf, 0.0, m_BxKx1)  # a row with no key: p = 0
  p_BxKxN = jnp.exp(s_BxKxN - m_BxKx1)
  l_BxKx1 = jnp.sum(p_BxKxN, axis=-1, keepdims=True)
  p_BxKxN = p_BxKxN * jnp.where(l_BxKx1 > 0, 1.0 / jnp.where(l_BxKx1 > 0, l_BxKx1, 1.0), 0.0)
  o_BxKxC = _dot("bkn,bnc->bkc", p_BxKxN.astype(dtype), v_g_BxNxC, jnp.float32)
  out_BxGxHxD = _diagonal(o_BxKxC, heads)
  residuals = (q_BxKxC, k_g_BxNxC, v_g_BxNxC, p_BxKxN, out_BxGxHxD,
               jnp.zeros((), q_rows_BxGxHxD.dtype))
  return out_BxGxHxD.astype(q_rows_BxGxHxD.dtype), residuals


def _global_rows_dense_bwd(residuals, dout_BxGxHxD):
  q_BxKxC, k_g_BxNxC, v_g_BxNxC, p_BxKxN, out_BxGxHxD, q_dtype = residuals
  heads, dtype = dout_BxGxHxD.shape[2], k_g_BxNxC.dtype
  scale = 1.0 / math.sqrt(dout_BxGxHxD.shape[3])
  dout_BxGxHxD = dout_BxGxHxD.astype(jnp.float32)
  dout_BxKxC = _block_diagonal(dout_BxGxHxD).astype(dtype)
  # The [N, H*D] gradients contract over the G*H global rows only: written in the input dtype.
  dv_g = _dot("bkn,bkc->bnc", p_BxKxN.astype(dtype), dout_BxKxC, dtype)
  dp_BxKxN = _dot("bkc,bnc->bkn", dout_BxKxC, v_g_BxNxC, jnp.float32)
  delta_BxK = jnp.sum(dout_BxGxHxD * out_BxGxHxD, axis=-1).reshape(dp_BxKxN.shape[:2])
  ds_BxKxN = (p_BxKxN * (dp_BxKxN - delta_BxK[..., None]) * scale).astype(dtype)
  dk_g = _dot("bkn,bkc->bnc", ds_BxKxN, q_BxKxC, dtype)
  dq_rows = _diagonal(_dot("bkn,bnc->bkc", ds_BxKxN, k_g_BxNxC, jnp.float32), heads)
  return dq_rows.astype(q_dtype.dtype), dk_g, dv_g, None


global_rows_dense.defvjp(_global_rows_dense_fwd, _global_rows_dense_bwd)


def select_rows(x_BxNxHxD, idx_BxG):
  """Rows idx_BxG of x [B, N, H, D] as [B, G, H, D]: per slot, a sum over N of x where the
  position is the slot's (exact: one nonzero term; a select, so NaN elsewhere reaches nothing).
  Not a gather: on TPU XLA lays [B, N, H, D] out with N minor, and a gather along N made a
  relaid-out copy of all of x and its transpose a scatter into another; these reductions read x
  where it is, and their transposes are selects that fuse into the gradient's other terms."""
  valid_BxG = jnp.ones(idx_BxG.shape, bool)
  zero = jnp.zeros((), x_BxNxHxD.dtype)
  return jnp.stack([jnp.sum(jnp.where(hit_BxN[:, :, None, None], x_BxNxHxD, zero), axis=1)
                    for hit_BxN in _slot_hits(idx_BxG, valid_BxG, x_BxNxHxD.shape[1])], axis=1)


def global_query_rows(q_g, idx_BxG, attention_mask):
  """The G global query rows of q_g [B, N, H, D] as [B, G, H, D] in q_g's dtype: selected
  (`select_rows`) and zeroed here (a padding position may be a filler slot) rather than by a
  select over all of q_g."""
  return jnp.where(gather_rows(attention_mask, idx_BxG)[:, :, None, None],
                   select_rows(q_g, idx_BxG), jnp.zeros((), q_g.dtype))


def takes_rows_kernel(rows_kernel, seq: int) -> bool:
  """Whether step 4 runs in `rows_kernel` (`band_mosaic.global_rows_lse`): its key blocks are
  whole multiples of 128 lanes."""
  return rows_kernel is not None and seq % 128 == 0
