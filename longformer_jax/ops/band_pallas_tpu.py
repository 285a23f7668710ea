"""Mosaic TPU kernels for the band (called by `band_pallas.band_attention_pallas(backend='tpu')`).

Layout [B, H, N, D] (tiles (rows, head_dim): head_dim is the lane dim, a full array dim). The
band is walked by the innermost grid axis: grid step `s` of query block `i` visits key block
lo(i) + s, and the key/value index maps clamp to the band's last block, so a step past the band
re-uses the block already in VMEM (Pallas skips the copy when the block index repeats) and
`pl.when` skips its compute. The grid width is the widest band in blocks, not seq / block:
nothing outside the band is fetched or computed.

Accumulators live in VMEM scratch across the band axis ("arbitrary" semantics). Row statistics
(max, sum) are kept as (rows, 128) lane-replicated tiles, as in jax's splash attention, so that
broadcasting against (rows, keys) tiles needs no relayout. lse and delta travel as lane-dense
rows [B, H, 1, N] (block (1, block_q)); the dK/dV kernel computes transposed tiles (keys x
queries) so those rows broadcast without relayout; the dQ kernel and the key mask of the dK/dV
kernel turn a row into a column with `expand_dims(ref[0], -1)` (the relayout splash uses).

TPU block constraints: block dims divisible by (8, 128) or equal to the array dims, so every
block size is a power of two >= 128 and the sequence is padded to a multiple of the largest.
Verified here: interpret mode on CPU against the dense reference (forward and gradients) and
lowering to a Mosaic `tpu_custom_call` from CPU; not yet compiled or timed on a TPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from longformer_jax.ops.band_pallas import (band_keep, k_block_range, max_band_blocks,
                                            q_block_range)
from longformer_jax.ops.band_reference import EMPTY_LSE

LANES = 128
NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T
NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b
_SEMANTICS = ("parallel", "parallel", "parallel", "arbitrary")


def fit_blocks(blocks, seq: int):
  """Caps every block size at the padded sequence so short inputs are not padded to 512."""
  cap = max(LANES, 1 << (max(seq, 1) - 1).bit_length())
  return dataclasses.replace(blocks, **{
      f.name: min(getattr(blocks, f.name), cap) for f in dataclasses.fields(blocks)
      if f.name.startswith("block_")})


def _compiler_params():
  return pltpu.CompilerParams(dimension_semantics=_SEMANTICS)


def _f32_dot(a, b, dims):
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _fwd_kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref, *, scale,
                window, causal, block_q, block_k, num_k_blocks, num_steps):
  q_block, step = pl.program_id(2), pl.program_id(3)
  lo, hi = k_block_range(q_block, block_q, block_k, window, causal, num_k_blocks)
  k_block = lo + step

  @pl.when(step == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(k_block < hi)
  def _accumulate():
    s_QxK = _f32_dot(q_ref[...], k_ref[...], NT_DIMS) * scale
    rows_QxK = q_block * block_q + lax.broadcasted_iota(jnp.int32, s_QxK.shape, 0)
    cols_QxK = k_block * block_k + lax.broadcasted_iota(jnp.int32, s_QxK.shape, 1)
    keep_QxK = band_keep(rows_QxK, cols_QxK, window, causal) & (mask_ref[...] > 0.5)
    s_QxK = jnp.where(keep_QxK, s_QxK, -jnp.inf)
    m_prev_Qx128 = m_ref[...]
    m_next_Qx128 = jnp.maximum(m_prev_Qx128, jnp.max(s_QxK, axis=1)[:, None])
    # Rows with no key so far keep max -inf: exponentiate against 0 (never -inf - -inf = NaN).
    m_safe_Qx128 = jnp.where(m_next_Qx128 == -jnp.inf, 0.0, m_next_Qx128)
    p_QxK = jnp.exp(s_QxK - jnp.tile(m_safe_Qx128, (1, block_k // LANES)))
    alpha_Qx128 = jnp.exp(m_prev_Qx128 - m_safe_Qx128)
    m_ref[...] = m_next_Qx128
    l_ref[...] = alpha_Qx128 * l_ref[...] + jnp.sum(p_QxK, axis=1)[:, None]
    v_KxD = v_ref[...]
    head_dim = acc_ref.shape[-1]
    alpha_QxD = jnp.tile(alpha_Qx128, (1, pl.cdiv(head_dim, LANES)))[:, :head_dim]
    acc_ref[...] = alpha_QxD * acc_ref[...] + _f32_dot(p_QxK.astype(v_KxD.dtype), v_KxD, NN_DIMS)

  @pl.when(step == num_steps - 1)
  def _finish():
    l_Qx128 = l_ref[...]
    has_key_Qx128 = l_Qx128 > 0.0
    l_safe_Qx128 = jnp.where(has_key_Qx128, l_Qx128, 1.0)
    head_dim = acc_ref.shape[-1]
    inv_QxD = jnp.tile(1.0 / l_safe_Qx128, (1, pl.cdiv(head_dim, LANES)))[:, :head_dim]
    o_ref[...] = (acc_ref[...] * inv_QxD).astype(o_ref.dtype)
    lse_Qx128 = jnp.where(has_key_Qx128, m_ref[...] + jnp.log(l_safe_Qx128), EMPTY_LSE)
    lse_ref[...] = lse_Qx128.T[:1, :]  # lanes are replicated: row 0 of the transpose


def _dq_kernel(q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_acc_ref, *,
               scale, window, causal, block_q, block_k, num_k_blocks, num_steps):
  q_block, step = pl.program_id(2), pl.program_id(3)
  lo, hi = k_block_range(q_block, block_q, block_k, window, causal, num_k_blocks)
  k_block = lo + step

  @pl.when(step == 0)
  def _init():
    dq_acc_ref[...] = jnp.zeros(dq_acc_ref.shape, jnp.float32)

  @pl.when(k_block < hi)
  def _accumulate():
    k_KxD, v_KxD = k_ref[...], v_ref[...]
    s_QxK = _f32_dot(q_ref[...], k_KxD, NT_DIMS) * scale
    rows_QxK = q_block * block_q + lax.broadcasted_iota(jnp.int32, s_QxK.shape, 0)
    cols_QxK = k_block * block_k + lax.broadcasted_iota(jnp.int32, s_QxK.shape, 1)
    keep_QxK = band_keep(rows_QxK, cols_QxK, window, causal) & (mask_ref[...] > 0.5)
    lse_Qx1 = jnp.expand_dims(lse_ref[0], -1)
    delta_Qx1 = jnp.expand_dims(delta_ref[0], -1)
    p_QxK = jnp.where(keep_QxK, jnp.exp(s_QxK - lse_Qx1), 0.0)
    dp_QxK = _f32_dot(do_ref[...], v_KxD, NT_DIMS)
    ds_QxK = p_QxK * (dp_QxK - delta_Qx1)
    dq_acc_ref[...] += _f32_dot(ds_QxK.astype(k_KxD.dtype), k_KxD, NN_DIMS)

  @pl.when(step == num_steps - 1)
  def _finish():
    dq_ref[...] = (dq_acc_ref[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
                dk_acc_ref, dv_acc_ref, *, scale, window, causal, block_q, block_k, num_q_blocks,
                num_steps):
  k_block, step = pl.program_id(2), pl.program_id(3)
  lo, hi = q_block_range(k_block, block_q, block_k, window, causal, num_q_blocks)
  q_block = lo + step

  @pl.when(step == 0)
  def _init():
    dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
    dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

  @pl.when(q_block < hi)
  def _accumulate():
    # Transposed tiles (keys x queries): lse/delta rows broadcast over sublanes as stored.
    q_QxD, do_QxD = q_ref[...], do_ref[...]
    s_KxQ = _f32_dot(k_ref[...], q_QxD, NT_DIMS) * scale
    keys_KxQ = k_block * block_k + lax.broadcasted_iota(jnp.int32, s_KxQ.shape, 0)
    queries_KxQ = q_block * block_q + lax.broadcasted_iota(jnp.int32, s_KxQ.shape, 1)
    mask_Kx1 = jnp.expand_dims(mask_ref[0], -1)
    keep_KxQ = band_keep(queries_KxQ, keys_KxQ, window, causal) & (mask_Kx1 > 0.5)
    p_KxQ = jnp.where(keep_KxQ, jnp.exp(s_KxQ - lse_ref[...]), 0.0)
    dv_acc_ref[...] += _f32_dot(p_KxQ.astype(do_QxD.dtype), do_QxD, NN_DIMS)
    dp_KxQ = _f32_dot(v_ref[...], do_QxD, NT_DIMS)
    ds_KxQ = p_KxQ * (dp_KxQ - delta_ref[...])
    dk_acc_ref[...] += _f32_dot(ds_KxQ.astype(q_QxD.dtype), q_QxD, NN_DIMS)

  @pl.when(step == num_steps - 1)
  def _finish():
    dk_ref[...] = (dk_acc_ref[...] * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)


def _band_index_maps(block_outer, block_inner, cfg, num_inner, by_query):
  """(outer block, band step) -> the inner block visited, clamped to the band's last block."""
  rng = k_block_range if by_query else q_block_range

  def inner_block(outer, step):
    if by_query:
      lo, hi = rng(outer, block_outer, block_inner, cfg.window, cfg.causal, num_inner)
    else:
      lo, hi = rng(outer, block_inner, block_outer, cfg.window, cfg.causal, num_inner)
    return jnp.minimum(lo + step, hi - 1)  # past the band: repeat the last block (no new DMA)

  return inner_block


def forward(q, k, v, mask_BxN, cfg):
  """q, k, v [B, H, N, D] (N a multiple of the blocks) -> out [B, H, N, D], lse [B, H, N]."""
  batch, heads, seq, head_dim = q.shape
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  num_q, num_k = seq // bq, seq // bk
  steps = max_band_blocks(num_q, bq, bk, cfg.window, cfg.causal, num_k, by_query=True)
  kv_of = _band_index_maps(bq, bk, cfg, num_k, by_query=True)
  kernel = functools.partial(_fwd_kernel, scale=cfg.scale, window=cfg.window, causal=cfg.causal,
                             block_q=bq, block_k=bk, num_k_blocks=num_k, num_steps=steps)
  q_spec = pl.BlockSpec((None, None, bq, head_dim), lambda b, h, i, s: (b, h, i, 0))
  kv_spec = pl.BlockSpec((None, None, bk, head_dim), lambda b, h, i, s: (b, h, kv_of(i, s), 0))
  mask_spec = pl.BlockSpec((None, 1, bk), lambda b, h, i, s: (b, 0, kv_of(i, s)))
  out, lse = pl.pallas_call(
      kernel,
      grid=(batch, heads, num_q, steps),
      in_specs=[q_spec, kv_spec, kv_spec, mask_spec],
      out_specs=[q_spec, pl.BlockSpec((None, None, 1, bq), lambda b, h, i, s: (b, h, 0, i))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, heads, 1, seq), jnp.float32)],
      scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
                      pltpu.VMEM((bq, head_dim), jnp.float32)],
      compiler_params=_compiler_params(),
      interpret=cfg.interpret,
      name="band_attention_fwd_tpu",
  )(q, k, v, mask_BxN.astype(jnp.float32)[:, None, :])
  return out, lse[:, :, 0, :]


def backward(q, k, v, mask_BxN, do, lse_BxHxN, delta_BxHxN, cfg):
  """Gradients (dq, dk, dv) [B, H, N, D] given dout [B, H, N, D] and delta = rowdot - dlse."""
  batch, heads, seq, head_dim = q.shape
  blocks = cfg.blocks
  mask_Bx1xN = mask_BxN.astype(jnp.float32)[:, None, :]
  lse_BxHx1xN = lse_BxHxN[:, :, None, :]
  delta_BxHx1xN = delta_BxHxN[:, :, None, :]
  do = do.astype(q.dtype)
  common = dict(scale=cfg.scale, window=cfg.window, causal=cfg.causal)

  # dQ: grid over query blocks, band axis over key blocks (as the forward).
  bq, bk = blocks.block_q_dq, blocks.block_k_dq
  num_q, num_k = seq // bq, seq // bk
  steps = max_band_blocks(num_q, bq, bk, cfg.window, cfg.causal, num_k, by_query=True)
  kv_of = _band_index_maps(bq, bk, cfg, num_k, by_query=True)
  q_spec = pl.BlockSpec((None, None, bq, head_dim), lambda b, h, i, s: (b, h, i, 0))
  kv_spec = pl.BlockSpec((None, None, bk, head_dim), lambda b, h, i, s: (b, h, kv_of(i, s), 0))
  row_spec = pl.BlockSpec((None, None, 1, bq), lambda b, h, i, s: (b, h, 0, i))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, block_q=bq, block_k=bk, num_k_blocks=num_k,
                        num_steps=steps, **common),
      grid=(batch, heads, num_q, steps),
      in_specs=[q_spec, kv_spec, kv_spec,
                pl.BlockSpec((None, 1, bk), lambda b, h, i, s: (b, 0, kv_of(i, s))),
                q_spec, row_spec, row_spec],
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      scratch_shapes=[pltpu.VMEM((bq, head_dim), jnp.float32)],
      compiler_params=_compiler_params(),
      interpret=cfg.interpret,
      name="band_attention_bwd_dq_tpu",
  )(q, k, v, mask_Bx1xN, do, lse_BxHx1xN, delta_BxHx1xN)

  # dK, dV: grid over key blocks, band axis over the query blocks that reach them.
  bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
  num_q, num_k = seq // bq, seq // bk
  steps = max_band_blocks(num_k, bk, bq, cfg.window, cfg.causal, num_q, by_query=False)
  q_of = _band_index_maps(bk, bq, cfg, num_q, by_query=False)
  k_spec = pl.BlockSpec((None, None, bk, head_dim), lambda b, h, j, s: (b, h, j, 0))
  q_spec = pl.BlockSpec((None, None, bq, head_dim), lambda b, h, j, s: (b, h, q_of(j, s), 0))
  row_spec = pl.BlockSpec((None, None, 1, bq), lambda b, h, j, s: (b, h, 0, q_of(j, s)))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, block_q=bq, block_k=bk, num_q_blocks=num_q,
                        num_steps=steps, **common),
      grid=(batch, heads, num_k, steps),
      in_specs=[q_spec, k_spec, k_spec,
                pl.BlockSpec((None, 1, bk), lambda b, h, j, s: (b, 0, j)),
                q_spec, row_spec, row_spec],
      out_specs=[k_spec, k_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      scratch_shapes=[pltpu.VMEM((bk, head_dim), jnp.float32),
                      pltpu.VMEM((bk, head_dim), jnp.float32)],
      compiler_params=_compiler_params(),
      interpret=cfg.interpret,
      name="band_attention_bwd_dkv_tpu",
  )(q, k, v, mask_Bx1xN, do, lse_BxHx1xN, delta_BxHx1xN)
  return dq, dk, dv
