"""Triton (GPU) kernels of the band (called by
`band_pallas.band_attention_pallas(backend='triton')`).

Grid (query block, batch, residue, head); each program keeps its query tile and loops with
`lax.fori_loop` over only the key blocks that intersect the band of that query block (bounds
computed from `pl.program_id`), then, with global keys, over one more tile holding them. q, k, v
stay in the caller's [B, N, H, D] layout (Triton addresses strided blocks, no transpose); a
dilated head's subsequences are strided blocks of the same array (docs/design.md §2.1), one
launch per run of heads with one dilation. Backward: one kernel for dK/dV (grid over key
blocks, loop over the query blocks whose band reaches them) and one for dQ (grid over query
blocks, loop as in the forward); delta = rowsum(out * dout) - dlse is a small XLA reduction
outside the kernels (`backward`).

Why Triton and not Mosaic GPU for the GPU kernel: the Pallas Triton backend lowers for the
target (jax 0.11.2 and 0.12, checked from CPU) and its kernels run in interpret mode on CPU, so
every line of the GPU kernel is tested here, forward and backward, against the dense reference.
Mosaic GPU (the named successor; jax 0.12 warns that the Triton backend is deprecated) needs
warpgroup-level code with explicit TMA/barrier pipelining, and its interpret mode with a grid
fails in jax 0.12 (docs/design.md §5.1), so a Mosaic GPU kernel could be neither run nor tested
on a machine without a GPU.
The Triton choice is to be revisited by measurement on the H200 (`benchmarks/pallas_gpu_check.py`).
Checked without a GPU: the Triton kernels run in interpret mode against the reference, lower for
'cuda', and their Triton IR compiles to sm_90 cubins within the H200's shared memory
(tests/test_band_pallas.py).

Numerics: float32 inputs use IEEE float32 matmuls on GPU, not TF32 (`_precision`), so that
float32 results meet the reference at ~1e-5; scores are in base 2 (exp2 is the native GPU
instruction) and converted back for the lse.
"""

from __future__ import annotations

import functools
import math

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from longformer_jax.ops.band_blocks import (BandConfig, BlockSizes, band_keep, head_runs,
                                            k_block_range, out_struct, q_block_range)
from longformer_jax.ops.band_reference import EMPTY_LSE

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------------
# Triton (GPU) kernels. Refs are 2-D [rows, head_dim] views of one (batch, residue, head)'s
# subsequence; the global key block (optional) is [globals, head_dim] with a keep vector.
#
# Dilation (paper §3.1) costs no copy: a head of dilation d attends an undilated band on each
# subsequence of positions congruent mod d, and the [B, N, H, D] array seen as
# [B, N/d, d, H, D] (a free reshape) has that subsequence as the rows of index (b, :, r, h), so
# the kernels' BlockSpecs address it directly - the same kernels, strided rows.

def _dot(a, b, precision, trans_a=False, trans_b=False):
  """a @ b (optionally transposed operands) with float32 accumulation."""
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _online_softmax_step(carry, q_tile_QxD, k_tile_KxD, v_tile_KxD, keep_QxK, scale2, precision):
  """One key tile of the forward's online softmax (scores in base 2)."""
  acc_QxD, m_Q, l_Q = carry
  s_QxK = _dot(q_tile_QxD, k_tile_KxD, precision, trans_b=True) * scale2
  s_QxK = jnp.where(keep_QxK, s_QxK, -jnp.inf)
  m_new_Q = jnp.maximum(m_Q, jnp.max(s_QxK, axis=1))
  # A row with no key so far keeps max -inf; exponentiate against 0 instead so that
  # exp2(-inf - (-inf)) = NaN never happens (every term is then exp2(-inf) = 0).
  m_safe_Q = jnp.where(m_new_Q == -jnp.inf, 0.0, m_new_Q)
  p_QxK = jnp.exp2(s_QxK - m_safe_Q[:, None])
  alpha_Q = jnp.exp2(m_Q - m_safe_Q)
  l_Q = alpha_Q * l_Q + jnp.sum(p_QxK, axis=1)
  acc_QxD = alpha_Q[:, None] * acc_QxD + _dot(p_QxK.astype(v_tile_KxD.dtype), v_tile_KxD,
                                              precision)
  return acc_QxD, m_new_Q, l_Q


def _global_keep(gmask_ref, rows):
  """bool [rows, G]: the real global slots (padding slots of the global block are 0)."""
  keep_G = gmask_ref[...] != 0
  return jnp.broadcast_to(keep_G[None, :], (rows, keep_G.shape[0]))


def _triton_fwd_kernel(q_ref, k_ref, v_ref, mask_ref, *refs, scale, window, causal, block_q,
                       block_k, num_k_blocks, precision, has_global):
  o_ref, lse_ref = refs[-2:]  # refs between are the global block and the aliased outputs
  q_block = pl.program_id(0)
  q_tile_QxD = q_ref[...]
  rows_Q = q_block * block_q + jnp.arange(block_q)
  lo, hi = k_block_range(q_block, block_q, block_k, window, causal, num_k_blocks)
  # Scores in base 2 (exp2 is the native GPU instruction); converted back for the lse.
  scale2 = scale * _LOG2E

  def body(k_block, carry):
    start = k_block * block_k
    cols_K = start + jnp.arange(block_k)
    keep_QxK = (band_keep(rows_Q[:, None], cols_K[None, :], window, causal)
                & (mask_ref[pl.ds(start, block_k)] != 0)[None, :])
    return _online_softmax_step(carry, q_tile_QxD, k_ref[pl.ds(start, block_k), :],
                                v_ref[pl.ds(start, block_k), :], keep_QxK, scale2, precision)

  head_dim = q_tile_QxD.shape[-1]
  carry = (jnp.zeros((block_q, head_dim), jnp.float32),
           jnp.full((block_q,), -jnp.inf, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  carry = lax.fori_loop(lo, hi, body, carry)
  if has_global:  # the global keys: one more tile of the same online softmax
    kg_ref, vg_ref, gmask_ref = refs[:3]
    carry = _online_softmax_step(carry, q_tile_QxD, kg_ref[...], vg_ref[...],
                                 _global_keep(gmask_ref, block_q), scale2, precision)
  acc_QxD, m_Q, l_Q = carry
  has_key_Q = l_Q > 0.0
  l_safe_Q = jnp.where(has_key_Q, l_Q, 1.0)
  o_ref[...] = (acc_QxD / l_safe_Q[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(has_key_Q, (m_Q + jnp.log2(l_safe_Q)) * _LN2, EMPTY_LSE)


def _triton_probs(q_tile_QxD, k_tile_KxD, lse_Q, keep_QxK, scale, precision):
  """Recomputed probabilities P [Q, K] of one tile (0 where keep is False)."""
  s_QxK = _dot(q_tile_QxD, k_tile_KxD, precision, trans_b=True) * (scale * _LOG2E)
  return jnp.where(keep_QxK, jnp.exp2(s_QxK - (lse_Q * _LOG2E)[:, None]), 0.0)


def _band_tile_keep(rows_Q, cols_K, mask_K, window, causal):
  return band_keep(rows_Q[:, None], cols_K[None, :], window, causal) & (mask_K != 0)[None, :]


def _triton_dkv_kernel(q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, *refs, scale,
                       window, causal, block_q, block_k, num_q_blocks, precision):
  dk_ref, dv_ref = refs[-2:]  # refs before them are the aliased outputs
  k_block = pl.program_id(0)
  k_tile_KxD = k_ref[...]
  v_tile_KxD = v_ref[...]
  cols_K = k_block * block_k + jnp.arange(block_k)
  mask_K = mask_ref[pl.ds(k_block * block_k, block_k)]
  lo, hi = q_block_range(k_block, block_q, block_k, window, causal, num_q_blocks)

  def body(q_block, carry):
    dk_KxD, dv_KxD = carry
    start = q_block * block_q
    q_tile_QxD = q_ref[pl.ds(start, block_q), :]
    do_tile_QxD = do_ref[pl.ds(start, block_q), :]
    lse_Q = lse_ref[pl.ds(start, block_q)]
    delta_Q = delta_ref[pl.ds(start, block_q)]
    keep_QxK = _band_tile_keep(start + jnp.arange(block_q), cols_K, mask_K, window, causal)
    p_QxK = _triton_probs(q_tile_QxD, k_tile_KxD, lse_Q, keep_QxK, scale, precision)
    dv_KxD += _dot(p_QxK.astype(do_tile_QxD.dtype), do_tile_QxD, precision, trans_a=True)
    dp_QxK = _dot(do_tile_QxD, v_tile_KxD, precision, trans_b=True)
    ds_QxK = p_QxK * (dp_QxK - delta_Q[:, None])
    dk_KxD += _dot(ds_QxK.astype(q_tile_QxD.dtype), q_tile_QxD, precision, trans_a=True)
    return dk_KxD, dv_KxD

  head_dim = k_tile_KxD.shape[-1]
  zeros = jnp.zeros((block_k, head_dim), jnp.float32)
  dk_KxD, dv_KxD = lax.fori_loop(lo, hi, body, (zeros, zeros))
  dk_ref[...] = (dk_KxD * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv_KxD.astype(dv_ref.dtype)


def _triton_dq_kernel(q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, *refs, scale,
                      window, causal, block_q, block_k, num_k_blocks, precision, has_global):
  dq_ref = refs[-1]  # refs before it: the global block, the aliased output
  q_block = pl.program_id(0)
  q_tile_QxD = q_ref[...]
  do_tile_QxD = do_ref[...]
  lse_Q = lse_ref[...]
  delta_Q = delta_ref[...]
  rows_Q = q_block * block_q + jnp.arange(block_q)
  lo, hi = k_block_range(q_block, block_q, block_k, window, causal, num_k_blocks)

  def tile_grad(keep_QxK, k_tile_KxD, v_tile_KxD):
    p_QxK = _triton_probs(q_tile_QxD, k_tile_KxD, lse_Q, keep_QxK, scale, precision)
    dp_QxK = _dot(do_tile_QxD, v_tile_KxD, precision, trans_b=True)
    ds_QxK = p_QxK * (dp_QxK - delta_Q[:, None])
    return _dot(ds_QxK.astype(k_tile_KxD.dtype), k_tile_KxD, precision)

  def body(k_block, dq_QxD):
    start = k_block * block_k
    keep_QxK = _band_tile_keep(rows_Q, start + jnp.arange(block_k),
                               mask_ref[pl.ds(start, block_k)], window, causal)
    return dq_QxD + tile_grad(keep_QxK, k_ref[pl.ds(start, block_k), :],
                              v_ref[pl.ds(start, block_k), :])

  dq_QxD = lax.fori_loop(lo, hi, body, jnp.zeros(q_tile_QxD.shape, jnp.float32))
  if has_global:
    kg_ref, vg_ref, gmask_ref = refs[:3]
    dq_QxD += tile_grad(_global_keep(gmask_ref, block_q), kg_ref[...], vg_ref[...])
  dq_ref[...] = (dq_QxD * scale).astype(dq_ref.dtype)


def _triton_params(blocks: BlockSizes):
  from jax.experimental.pallas import triton as pl_triton
  return pl_triton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _precision(dtype):
  # IEEE float32 matmuls for float32 inputs (Triton's default would be TF32, ~1e-3 error).
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None



class _RunSpecs:
  """BlockSpecs of one run of heads (dilation d, heads h0..h0+nh) on the [B, N/d, d, ...] views.

  Grid (row block, batch, residue, head): programs of one residue r see the subsequence of
  positions r, r + d, r + 2d, ... as contiguous rows 0, 1, 2, ...
  """

  def __init__(self, dilation, first_head, seq, head_dim, num_global):
    self.d, self.h0, self.sub = dilation, first_head, seq // dilation
    self.head_dim, self.num_global = head_dim, num_global

  def tile(self, rows):  # rows [i*rows, (i+1)*rows) of one subsequence, one head
    return pl.BlockSpec((None, rows, None, None, self.head_dim),
                        lambda i, b, r, h: (b, i, r, h + self.h0, 0))

  def whole(self):  # the whole subsequence of one head
    return pl.BlockSpec((None, self.sub, None, None, self.head_dim),
                        lambda i, b, r, h: (b, 0, r, h + self.h0, 0))

  def key_mask(self):
    return pl.BlockSpec((None, self.sub, None), lambda i, b, r, h: (b, 0, r))

  def row_tile(self, rows):  # [B, H, N/d, d] per-row statistics (lse, delta)
    return pl.BlockSpec((None, None, rows, None), lambda i, b, r, h: (b, h + self.h0, i, r))

  def whole_row(self):
    return pl.BlockSpec((None, None, self.sub, None), lambda i, b, r, h: (b, h + self.h0, 0, r))

  def global_block(self):  # kg, vg [B, G, H, D] and their keep vector [B, G]
    kv = pl.BlockSpec((None, self.num_global, None, self.head_dim),
                      lambda i, b, r, h: (b, 0, h + self.h0, 0))
    return [kv, kv, pl.BlockSpec((None, self.num_global), lambda i, b, r, h: (b, 0))]

  def view(self, x):  # [B, N, ...] -> [B, N/d, d, ...]
    return x.reshape(x.shape[0], self.sub, self.d, *x.shape[2:])

  def view_rows(self, x):  # [B, H, N] -> [B, H, N/d, d]
    return x.reshape(*x.shape[:2], self.sub, self.d)

  def grid(self, rows, batch, heads):
    return (self.sub // rows, batch, self.d, heads)


def _launch_runs(cfg: BandConfig, shape, launch):
  """Calls `launch(specs, num_heads, previous_outputs)` for each run of heads, threading the
  outputs through so that every launch writes its heads into the same (aliased) buffers."""
  _, seq, _, head_dim = shape
  outputs = None
  for dilation, h0, num_heads in head_runs(cfg.dilations):
    specs = _RunSpecs(dilation, h0, seq, head_dim, cfg.num_global)
    outputs = launch(specs, num_heads, outputs)
  return outputs


def _aliased(specs_out, views, n_inputs, previous):
  """In-specs, arguments and input_output_aliases that pass the `previous` launch's outputs
  (seen through `views`, one per output) back in as the buffers this launch writes into."""
  if previous is None:
    return [], [], {}
  return (list(specs_out), [view(x) for view, x in zip(views, previous)],
          {n_inputs + i: i for i in range(len(specs_out))})


def forward(q, k, v, mask_BxN, glob, cfg: BandConfig):
  batch, seq, heads, head_dim = q.shape
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  has_global = glob is not None

  def launch(s, num_heads, previous):
    kernel = functools.partial(
        _triton_fwd_kernel, scale=cfg.scale, window=cfg.window, causal=cfg.causal, block_q=bq,
        block_k=bk, num_k_blocks=s.sub // bk, precision=_precision(q.dtype),
        has_global=has_global)
    in_specs = [s.tile(bq), s.whole(), s.whole(), s.key_mask()]
    args = [s.view(q), s.view(k), s.view(v), s.view(mask_BxN)]
    if has_global:
      in_specs += s.global_block()
      args += list(glob)
    out_specs = [s.tile(bq), s.row_tile(bq)]
    prev_specs, prev_args, aliases = _aliased(out_specs, (s.view, s.view_rows), len(args),
                                              previous)
    out, lse = pl.pallas_call(
        kernel,
        grid=s.grid(bq, batch, num_heads),
        in_specs=in_specs + prev_specs,
        out_specs=out_specs,
        out_shape=[out_struct(s.view(q).shape, q.dtype, *args),
                   out_struct((batch, heads, s.sub, s.d), jnp.float32, *args)],
        input_output_aliases=aliases,
        compiler_params=None if cfg.interpret else _triton_params(cfg.blocks),
        interpret=cfg.interpret,
        name="band_attention_fwd",
    )(*args, *prev_args)
    return out.reshape(q.shape), lse.reshape(batch, heads, seq)

  return _launch_runs(cfg, q.shape, launch)


def _backward_kernels(q, k, v, mask_BxN, glob, do, lse_BxHxN, delta_BxHxN, cfg: BandConfig):
  batch, seq, heads, head_dim = q.shape
  blocks = cfg.blocks
  precision = _precision(q.dtype)
  params = None if cfg.interpret else _triton_params(blocks)
  has_global = glob is not None

  def launch_dkv(s, num_heads, previous):
    bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
    args = [s.view(q), s.view(k), s.view(v), s.view(mask_BxN), s.view(do),
            s.view_rows(lse_BxHxN), s.view_rows(delta_BxHxN)]
    out_specs = [s.tile(bk), s.tile(bk)]
    prev_specs, prev_args, aliases = _aliased(out_specs, (s.view, s.view), len(args), previous)
    dk, dv = pl.pallas_call(
        functools.partial(_triton_dkv_kernel, scale=cfg.scale, window=cfg.window,
                          causal=cfg.causal, block_q=bq, block_k=bk, num_q_blocks=s.sub // bq,
                          precision=precision),
        grid=s.grid(bk, batch, num_heads),
        in_specs=[s.whole(), s.tile(bk), s.tile(bk), s.key_mask(), s.whole(), s.whole_row(),
                  s.whole_row()] + prev_specs,
        out_specs=out_specs,
        out_shape=[out_struct(s.view(k).shape, k.dtype, *args),
                   out_struct(s.view(v).shape, v.dtype, *args)],
        input_output_aliases=aliases,
        compiler_params=params, interpret=cfg.interpret, name="band_attention_bwd_dkv",
    )(*args, *prev_args)
    return dk.reshape(k.shape), dv.reshape(v.shape)

  def launch_dq(s, num_heads, previous):
    bq, bk = blocks.block_q_dq, blocks.block_k_dq
    in_specs = [s.tile(bq), s.whole(), s.whole(), s.key_mask(), s.tile(bq), s.row_tile(bq),
                s.row_tile(bq)]
    args = [s.view(q), s.view(k), s.view(v), s.view(mask_BxN), s.view(do),
            s.view_rows(lse_BxHxN), s.view_rows(delta_BxHxN)]
    if has_global:
      in_specs += s.global_block()
      args += list(glob)
    prev_specs, prev_args, aliases = _aliased([s.tile(bq)], (s.view,), len(args), previous)
    dq = pl.pallas_call(
        functools.partial(_triton_dq_kernel, scale=cfg.scale, window=cfg.window,
                          causal=cfg.causal, block_q=bq, block_k=bk, num_k_blocks=s.sub // bk,
                          precision=precision, has_global=has_global),
        grid=s.grid(bq, batch, num_heads),
        in_specs=in_specs + prev_specs,
        out_specs=s.tile(bq),
        out_shape=out_struct(s.view(q).shape, q.dtype, *args),
        input_output_aliases=aliases,
        compiler_params=params, interpret=cfg.interpret, name="band_attention_bwd_dq",
    )(*args, *prev_args)
    return (dq.reshape(q.shape),)

  dk, dv = _launch_runs(cfg, q.shape, launch_dkv)
  dq, = _launch_runs(cfg, q.shape, launch_dq)
  dglob = None
  if has_global:
    dglob = _global_key_grads(q, glob, do, lse_BxHxN, delta_BxHxN, cfg.scale, cfg.global_keys)
  return dq, dk, dv, dglob


def _global_key_grads(q, glob, do, lse_BxHxN, delta_BxHxN, scale, num_keys):
  """dK, dV of the global key block: a [N x G] pass in XLA over the `num_keys` real slots (the
  kernels' block is padded to 16 rows; the padding's gradient is zero).

  P_ig = exp(s_ig - lse_i) with the lse of the whole row (band + globals), as in the kernels.
  """
  pad = glob[0].shape[1] - num_keys
  kg, vg, gmask_BxG = (x[:, :num_keys] for x in glob)
  f32 = jnp.float32
  s_BxHxNxG = jnp.einsum("bnhd,bghd->bhng", q.astype(f32) * scale, kg.astype(f32))
  p_BxHxNxG = jnp.where(gmask_BxG[:, None, None, :] != 0,
                        jnp.exp(s_BxHxNxG - lse_BxHxN[..., None]), 0.0)
  dv_g = jnp.einsum("bhng,bnhd->bghd", p_BxHxNxG, do.astype(f32))
  dp_BxHxNxG = jnp.einsum("bnhd,bghd->bhng", do.astype(f32), vg.astype(f32))
  ds_BxHxNxG = p_BxHxNxG * (dp_BxHxNxG - delta_BxHxN[..., None])
  dk_g = jnp.einsum("bhng,bnhd->bghd", ds_BxHxNxG, q.astype(f32)) * scale
  pad_rows = lambda x: jnp.pad(x.astype(kg.dtype), ((0, 0), (0, pad), (0, 0), (0, 0)))
  return pad_rows(dk_g), pad_rows(dv_g), None



def backward(q, k, v, mask_BxN, glob, out, lse_BxHxN, dout, dlse_BxHxN, cfg: BandConfig):
  """Gradients (dq, dk, dv, dglob) of out [B, N, H, D] and lse [B, H, N] given their cotangents
  dout [B, N, H, D] and dlse [B, H, N]; dglob is None without global keys."""
  # delta_i = sum_d out_id * dout_id - dlse_i: with it ds = P * (dP - delta) carries both the
  # out and the lse cotangent (d lse_i / d s_ij = P_ij).
  rowdot = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)
  rowdot = jnp.swapaxes(rowdot, 1, 2)  # [B, N, H] -> [B, H, N]
  delta_BxHxN = rowdot - dlse_BxHxN.astype(jnp.float32)
  return _backward_kernels(q, k, v, mask_BxN, glob, dout.astype(q.dtype), lse_BxHxN, delta_BxHxN,
                           cfg)
