"""Mosaic TPU kernels for the band (called by `band_pallas.band_attention_pallas(backend='tpu')`).

Layout: the caller's [B, N, H, D], seen by the kernels as [B, N, H*D] (a free reshape), with
heads taken in groups of `g = head_group(D)` so that a block's minor (lane) dim `g*D` fills the
128 TPU lanes: tiles (rows, g*D), g = 2 for head_dim 64 (the wrapper zero-pads the heads to a
multiple of g). Why not [B, H, N, D]: HBM arrays are stored in (8, 128) tiles of their two minor
dims, so a minor dim of 64 is padded to 128 lanes, which doubled every q, k, v, out, dout, dq,
dk and dv held in that layout, and the transposes into and out of it were extra copies.
A kernel step loops over its g heads with static lane slices `[:, h*D:(h+1)*D]`; the band and
key masks are computed once per step for all of them.

The backward pass computes delta = rowsum(out * dout) - dlse in the dQ kernel (at its first band
step, from the out and dout blocks) and hands it to the dK/dV kernel as a row, rather than in
XLA: XLA reduces over head_dim inside [B, N, H*D] by transposing a float32 copy of out, which
was the largest temporary of the backward pass.

Compiled for one v5e chip (fwd+bwd, bf16, 12 heads, head_dim 64, window 256, inputs as
[B, N, H, D] arrays in XLA's default TPU layout), XLA's temporaries went from 18 to 9 KB per
token at 128k-256k tokens, and from 18 to 3 KB when q, k, v arrive row-major as [B, N, H*D] as
from a projection (tests/test_tpu_aot.py). Below ~100k tokens XLA keeps whole temporaries in
VMEM (128 MiB on v5e), so the HBM figure is smaller there.

The band is walked by the innermost grid axis: grid step `s` of query block `i` visits key block
lo(i) + s, and the key/value index maps clamp to the band's last block, so a step past the band
re-uses the block already in VMEM (Pallas skips the copy when the block index repeats) and
`pl.when` skips its compute. The grid width is the widest band in blocks, not seq / block:
nothing outside the band is fetched or computed.

Accumulators live in VMEM scratch across the band axis ("arbitrary" semantics), one slot per
head of the group. Row statistics (max, sum, delta) are kept as (rows, 128) lane-replicated
tiles, as in jax's splash attention, so that broadcasting against (rows, keys) tiles needs no
relayout. lse, dlse and delta travel as lane-dense rows [B, H, 1, N] (block (g, 1, block_q));
the dK/dV kernel computes transposed tiles (keys x queries) so those rows broadcast without
relayout; the dQ kernel and the key mask of the dK/dV kernel turn a row into a column with
`expand_dims(row, -1)` (the relayout splash uses).

TPU block constraints: block dims divisible by (8, 128) or equal to the array dims, so every
block size is a power of two >= 128 and the sequence is padded to a multiple of the largest.
Verified here: interpret mode on CPU against the dense reference (forward and gradients), and
compiled by XLA's TPU compiler and Mosaic on CPU through libtpu's compile-only client
(tests/test_tpu_aot.py); not yet run or timed on a TPU.
"""

from __future__ import annotations

import functools

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from longformer_jax.ops.band_blocks import (LANES, band_keep, head_group, k_block_range,
                                            max_band_blocks, out_struct, q_block_range)
from longformer_jax.ops.band_reference import EMPTY_LSE

NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T
NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b
_SEMANTICS = ("parallel", "parallel", "parallel", "arbitrary")


def _compiler_params():
  return pltpu.CompilerParams(dimension_semantics=_SEMANTICS)


def _f32_dot(a, b, dims):
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _lanes(head, head_dim):
  """The lanes of head `head` of a group in a (rows, g * head_dim) tile."""
  return slice(head * head_dim, (head + 1) * head_dim)


def _fwd_kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref, *, scale,
                window, causal, block_q, block_k, num_k_blocks, num_steps):
  q_block, step = pl.program_id(2), pl.program_id(3)
  lo, hi = k_block_range(q_block, block_q, block_k, window, causal, num_k_blocks)
  k_block = lo + step
  group, _, head_dim = acc_ref.shape

  @pl.when(step == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(k_block < hi)
  def _accumulate():
    shape_QxK = (block_q, block_k)
    rows_QxK = q_block * block_q + lax.broadcasted_iota(jnp.int32, shape_QxK, 0)
    cols_QxK = k_block * block_k + lax.broadcasted_iota(jnp.int32, shape_QxK, 1)
    keep_QxK = band_keep(rows_QxK, cols_QxK, window, causal) & (mask_ref[...] > 0.5)
    for h in range(group):
      lanes = _lanes(h, head_dim)
      s_QxK = _f32_dot(q_ref[:, lanes], k_ref[:, lanes], NT_DIMS) * scale
      s_QxK = jnp.where(keep_QxK, s_QxK, -jnp.inf)
      m_prev_Qx128 = m_ref[h]
      m_next_Qx128 = jnp.maximum(m_prev_Qx128, jnp.max(s_QxK, axis=1)[:, None])
      # Rows with no key so far keep max -inf: exponentiate against 0 (never -inf - -inf = NaN).
      m_safe_Qx128 = jnp.where(m_next_Qx128 == -jnp.inf, 0.0, m_next_Qx128)
      p_QxK = jnp.exp(s_QxK - jnp.tile(m_safe_Qx128, (1, block_k // LANES)))
      alpha_Qx128 = jnp.exp(m_prev_Qx128 - m_safe_Qx128)
      m_ref[h] = m_next_Qx128
      l_ref[h] = alpha_Qx128 * l_ref[h] + jnp.sum(p_QxK, axis=1)[:, None]
      v_KxD = v_ref[:, lanes]
      alpha_QxD = jnp.tile(alpha_Qx128, (1, pl.cdiv(head_dim, LANES)))[:, :head_dim]
      acc_ref[h] = alpha_QxD * acc_ref[h] + _f32_dot(p_QxK.astype(v_KxD.dtype), v_KxD, NN_DIMS)

  @pl.when(step == num_steps - 1)
  def _finish():
    for h in range(group):
      l_Qx128 = l_ref[h]
      has_key_Qx128 = l_Qx128 > 0.0
      l_safe_Qx128 = jnp.where(has_key_Qx128, l_Qx128, 1.0)
      inv_QxD = jnp.tile(1.0 / l_safe_Qx128, (1, pl.cdiv(head_dim, LANES)))[:, :head_dim]
      o_ref[:, _lanes(h, head_dim)] = (acc_ref[h] * inv_QxD).astype(o_ref.dtype)
      lse_Qx128 = jnp.where(has_key_Qx128, m_ref[h] + jnp.log(l_safe_Qx128), EMPTY_LSE)
      lse_ref[h] = lse_Qx128.T[:1, :]  # lanes are replicated: row 0 of the transpose


def _dq_kernel(q_ref, k_ref, v_ref, mask_ref, do_ref, out_ref, lse_ref, dlse_ref, dq_ref,
               delta_out_ref, dq_acc_ref, delta_ref, *, scale, window, causal, block_q, block_k,
               num_k_blocks, num_steps):
  q_block, step = pl.program_id(2), pl.program_id(3)
  lo, hi = k_block_range(q_block, block_q, block_k, window, causal, num_k_blocks)
  k_block = lo + step
  group, _, head_dim = dq_acc_ref.shape

  @pl.when(step == 0)
  def _init():
    dq_acc_ref[...] = jnp.zeros(dq_acc_ref.shape, jnp.float32)
    # delta = rowsum(out * dout) - dlse, for this kernel (lane-replicated column) and for the
    # dK/dV kernel (a row). Here and not in XLA: XLA reduces over head_dim by transposing a
    # float32 copy of out ([B, N, H*D], 4 bytes per element), the largest temporary of the
    # backward pass.
    for h in range(group):
      lanes = _lanes(h, head_dim)
      out_QxD = out_ref[:, lanes].astype(jnp.float32)
      do_QxD = do_ref[:, lanes].astype(jnp.float32)
      dlse_Qx1 = jnp.expand_dims(dlse_ref[h, 0], -1)
      delta_Qx1 = jnp.sum(out_QxD * do_QxD, axis=1, keepdims=True) - dlse_Qx1
      delta_Qx128 = jnp.broadcast_to(delta_Qx1, (block_q, LANES))
      delta_ref[h] = delta_Qx128
      delta_out_ref[h] = delta_Qx128.T[:1, :]  # lanes are replicated: row 0 of the transpose

  @pl.when(k_block < hi)
  def _accumulate():
    shape_QxK = (block_q, block_k)
    rows_QxK = q_block * block_q + lax.broadcasted_iota(jnp.int32, shape_QxK, 0)
    cols_QxK = k_block * block_k + lax.broadcasted_iota(jnp.int32, shape_QxK, 1)
    keep_QxK = band_keep(rows_QxK, cols_QxK, window, causal) & (mask_ref[...] > 0.5)
    for h in range(group):
      lanes = _lanes(h, head_dim)
      k_KxD, v_KxD = k_ref[:, lanes], v_ref[:, lanes]
      s_QxK = _f32_dot(q_ref[:, lanes], k_KxD, NT_DIMS) * scale
      lse_Qx1 = jnp.expand_dims(lse_ref[h, 0], -1)
      delta_QxK = jnp.tile(delta_ref[h], (1, block_k // LANES))
      p_QxK = jnp.where(keep_QxK, jnp.exp(s_QxK - lse_Qx1), 0.0)
      dp_QxK = _f32_dot(do_ref[:, lanes], v_KxD, NT_DIMS)
      ds_QxK = p_QxK * (dp_QxK - delta_QxK)
      dq_acc_ref[h] += _f32_dot(ds_QxK.astype(k_KxD.dtype), k_KxD, NN_DIMS)

  @pl.when(step == num_steps - 1)
  def _finish():
    for h in range(group):
      dq_ref[:, _lanes(h, head_dim)] = (dq_acc_ref[h] * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
                dk_acc_ref, dv_acc_ref, *, scale, window, causal, block_q, block_k, num_q_blocks,
                num_steps):
  k_block, step = pl.program_id(2), pl.program_id(3)
  lo, hi = q_block_range(k_block, block_q, block_k, window, causal, num_q_blocks)
  q_block = lo + step
  group, _, head_dim = dk_acc_ref.shape

  @pl.when(step == 0)
  def _init():
    dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
    dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

  @pl.when(q_block < hi)
  def _accumulate():
    # Transposed tiles (keys x queries): lse/delta rows broadcast over sublanes as stored.
    shape_KxQ = (block_k, block_q)
    keys_KxQ = k_block * block_k + lax.broadcasted_iota(jnp.int32, shape_KxQ, 0)
    queries_KxQ = q_block * block_q + lax.broadcasted_iota(jnp.int32, shape_KxQ, 1)
    mask_Kx1 = jnp.expand_dims(mask_ref[0], -1)
    keep_KxQ = band_keep(queries_KxQ, keys_KxQ, window, causal) & (mask_Kx1 > 0.5)
    for h in range(group):
      lanes = _lanes(h, head_dim)
      q_QxD, do_QxD = q_ref[:, lanes], do_ref[:, lanes]
      s_KxQ = _f32_dot(k_ref[:, lanes], q_QxD, NT_DIMS) * scale
      p_KxQ = jnp.where(keep_KxQ, jnp.exp(s_KxQ - lse_ref[h]), 0.0)
      dv_acc_ref[h] += _f32_dot(p_KxQ.astype(do_QxD.dtype), do_QxD, NN_DIMS)
      dp_KxQ = _f32_dot(v_ref[:, lanes], do_QxD, NT_DIMS)
      ds_KxQ = p_KxQ * (dp_KxQ - delta_ref[h])
      dk_acc_ref[h] += _f32_dot(ds_KxQ.astype(q_QxD.dtype), q_QxD, NN_DIMS)

  @pl.when(step == num_steps - 1)
  def _finish():
    for h in range(group):
      lanes = _lanes(h, head_dim)
      dk_ref[:, lanes] = (dk_acc_ref[h] * scale).astype(dk_ref.dtype)
      dv_ref[:, lanes] = dv_acc_ref[h].astype(dv_ref.dtype)


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


def _grouped(x_BxNxHxD):
  """[B, N, H, D] -> ([B, N, H*D] (a free reshape), heads per block, lanes per block)."""
  batch, seq, heads, head_dim = x_BxNxHxD.shape
  group = head_group(head_dim)
  if heads % group:
    raise ValueError(f"heads={heads} must be a multiple of {group} for head_dim={head_dim} "
                     "(band_attention_pallas pads them)")
  return x_BxNxHxD.reshape(batch, seq, heads * head_dim), group, group * head_dim


def forward(q, k, v, mask_BxN, cfg):
  """q, k, v [B, N, H, D] (N a multiple of the blocks, H of `head_group(D)`) -> out [B, N, H, D],
  lse [B, H, N]."""
  batch, seq, heads, head_dim = q.shape
  (q, group, width), (k, _, _), (v, _, _) = _grouped(q), _grouped(k), _grouped(v)
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  num_q, num_k = seq // bq, seq // bk
  steps = max_band_blocks(num_q, bq, bk, cfg.window, cfg.causal, num_k, by_query=True)
  kv_of = _band_index_maps(bq, bk, cfg, num_k, by_query=True)
  kernel = functools.partial(_fwd_kernel, scale=cfg.scale, window=cfg.window, causal=cfg.causal,
                             block_q=bq, block_k=bk, num_k_blocks=num_k, num_steps=steps)
  q_spec = pl.BlockSpec((None, bq, width), lambda b, g, i, s: (b, i, g))
  kv_spec = pl.BlockSpec((None, bk, width), lambda b, g, i, s: (b, kv_of(i, s), g))
  mask_spec = pl.BlockSpec((None, 1, bk), lambda b, g, i, s: (b, 0, kv_of(i, s)))
  out, lse = pl.pallas_call(
      kernel,
      grid=(batch, heads // group, num_q, steps),
      in_specs=[q_spec, kv_spec, kv_spec, mask_spec],
      out_specs=[q_spec, pl.BlockSpec((None, group, 1, bq), lambda b, g, i, s: (b, g, 0, i))],
      out_shape=[out_struct(q.shape, q.dtype, q, k, v, mask_BxN),
                 out_struct((batch, heads, 1, seq), jnp.float32, q, k, v, mask_BxN)],
      scratch_shapes=[pltpu.VMEM((group, bq, LANES), jnp.float32),
                      pltpu.VMEM((group, bq, LANES), jnp.float32),
                      pltpu.VMEM((group, bq, head_dim), jnp.float32)],
      compiler_params=_compiler_params(),
      interpret=cfg.interpret,
      name="band_attention_fwd_tpu",
  )(q, k, v, mask_BxN.astype(jnp.float32)[:, None, :])
  return out.reshape(batch, seq, heads, head_dim), lse[:, :, 0, :]


def backward(q, k, v, mask_BxN, out, do, lse_BxHxN, dlse_BxHxN, cfg):
  """Gradients (dq, dk, dv) [B, N, H, D] of out [B, N, H, D] and lse [B, H, N] given their
  cotangents dout [B, N, H, D] and dlse [B, H, N]."""
  batch, seq, heads, head_dim = q.shape
  shape = q.shape
  (q, group, width), (k, _, _), (v, _, _) = _grouped(q), _grouped(k), _grouped(v)
  (out, _, _), (do, _, _) = _grouped(out), _grouped(do.astype(q.dtype))
  blocks = cfg.blocks
  mask_Bx1xN = mask_BxN.astype(jnp.float32)[:, None, :]
  lse_BxHx1xN = lse_BxHxN[:, :, None, :]
  dlse_BxHx1xN = dlse_BxHxN.astype(jnp.float32)[:, :, None, :]
  common = dict(scale=cfg.scale, window=cfg.window, causal=cfg.causal)
  inputs = (q, k, v, mask_Bx1xN, do, out, lse_BxHx1xN, dlse_BxHx1xN)  # what the outputs vary as

  # dQ (and delta): grid over query blocks, band axis over key blocks (as the forward).
  bq, bk = blocks.block_q_dq, blocks.block_k_dq
  num_q, num_k = seq // bq, seq // bk
  steps = max_band_blocks(num_q, bq, bk, cfg.window, cfg.causal, num_k, by_query=True)
  kv_of = _band_index_maps(bq, bk, cfg, num_k, by_query=True)
  q_spec = pl.BlockSpec((None, bq, width), lambda b, g, i, s: (b, i, g))
  kv_spec = pl.BlockSpec((None, bk, width), lambda b, g, i, s: (b, kv_of(i, s), g))
  row_spec = pl.BlockSpec((None, group, 1, bq), lambda b, g, i, s: (b, g, 0, i))
  dq, delta_BxHx1xN = pl.pallas_call(
      functools.partial(_dq_kernel, block_q=bq, block_k=bk, num_k_blocks=num_k,
                        num_steps=steps, **common),
      grid=(batch, heads // group, num_q, steps),
      in_specs=[q_spec, kv_spec, kv_spec,
                pl.BlockSpec((None, 1, bk), lambda b, g, i, s: (b, 0, kv_of(i, s))),
                q_spec, q_spec, row_spec, row_spec],
      out_specs=[q_spec, row_spec],
      out_shape=[out_struct(q.shape, q.dtype, *inputs),
                 out_struct((batch, heads, 1, seq), jnp.float32, *inputs)],
      scratch_shapes=[pltpu.VMEM((group, bq, head_dim), jnp.float32),
                      pltpu.VMEM((group, bq, LANES), jnp.float32)],
      compiler_params=_compiler_params(),
      interpret=cfg.interpret,
      name="band_attention_bwd_dq_tpu",
  )(q, k, v, mask_Bx1xN, do, out, lse_BxHx1xN, dlse_BxHx1xN)

  # dK, dV: grid over key blocks, band axis over the query blocks that reach them.
  bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
  num_q, num_k = seq // bq, seq // bk
  steps = max_band_blocks(num_k, bk, bq, cfg.window, cfg.causal, num_q, by_query=False)
  q_of = _band_index_maps(bk, bq, cfg, num_q, by_query=False)
  k_spec = pl.BlockSpec((None, bk, width), lambda b, g, j, s: (b, j, g))
  q_spec = pl.BlockSpec((None, bq, width), lambda b, g, j, s: (b, q_of(j, s), g))
  row_spec = pl.BlockSpec((None, group, 1, bq), lambda b, g, j, s: (b, g, 0, q_of(j, s)))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, block_q=bq, block_k=bk, num_q_blocks=num_q,
                        num_steps=steps, **common),
      grid=(batch, heads // group, num_k, steps),
      in_specs=[q_spec, k_spec, k_spec,
                pl.BlockSpec((None, 1, bk), lambda b, g, j, s: (b, 0, j)),
                q_spec, row_spec, row_spec],
      out_specs=[k_spec, k_spec],
      out_shape=[out_struct(k.shape, k.dtype, *inputs), out_struct(v.shape, v.dtype, *inputs)],
      scratch_shapes=[pltpu.VMEM((group, bk, head_dim), jnp.float32),
                      pltpu.VMEM((group, bk, head_dim), jnp.float32)],
      compiler_params=_compiler_params(),
      interpret=cfg.interpret,
      name="band_attention_bwd_dkv_tpu",
  )(q, k, v, mask_Bx1xN, do, lse_BxHx1xN, delta_BxHx1xN)
  return dq.reshape(shape), dk.reshape(shape), dv.reshape(shape)
