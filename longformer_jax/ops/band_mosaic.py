"""Mosaic TPU kernels for the band (called by `band_pallas.band_attention_pallas(backend='tpu')`).

Layout: the caller's [B, N, H, D], seen by the kernels as [B, N, H*D] (a free reshape), with
heads taken in groups of `g = head_group(D)` so that a block's minor (lane) dim `g*D` fills the
128 TPU lanes: tiles (rows, g*D), g = 2 for head_dim 64 (the wrapper zero-pads the heads to a
multiple of g). Why not [B, H, N, D]: HBM arrays are stored in (8, 128) tiles of their two minor
dims, so a minor dim of 64 is padded to 128 lanes, which doubled every q, k, v, out, dout, dq,
dk and dv held in that layout, and the transposes into and out of it were extra copies.
A kernel step loops over its g heads with static lane slices `[:, h*D:(h+1)*D]`; the band and
key masks are computed once per step for all of them.

Dilation (docs/design.md §2.1) is addressed in place: a head of dilation d attends an undilated
band on each residue class mod d, and [B, N, H*D] seen as [B, N/d, d*H*D] (a free reshape)
holds residue r's rows of head group g as block column r * H/g + g (`_Run`). The grid is
(batch, residue, head group, block, band step); the kernels work in subsequence coordinates
and are the same for every dilation. Rows (lse, dlse, delta) and the key mask of a dilated head
are kept residue-major (`rows_order`) so that one block of them is one residue's. One launch per
run of heads with one dilation (whole lane groups: `band_blocks.tpu_head_order`), each writing
its heads into the previous launch's outputs (aliased, passed unread with memory_space ANY).

Global keys: the G (a multiple of 8) global keys/values are one more block that every step of a
head group sees (its index never changes, so it is fetched once); the forward merges them into
the online softmax at the band's last step, the dQ kernel adds their share of dQ there and
writes this query block's share of their dK, dV ([B, N / block_q, G, H*D] float32, summed in
XLA), so their gradients need no [N x G] pass over q and dout outside the kernel.

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

from longformer_jax.ops.band_blocks import (LANES, band_keep, head_group, head_runs,
                                            k_block_range, max_band_blocks, out_struct,
                                            q_block_range)
from longformer_jax.ops.band_reference import EMPTY_LSE

NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T
NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b
TN_DIMS = (((0,), (0,)), ((), ()))  # a.T @ b
# Grid (batch, residue, head group, block, band step): the band axis carries the accumulators.
_SEMANTICS = ("parallel",) * 4 + ("arbitrary",)


def _compiler_params():
  return pltpu.CompilerParams(dimension_semantics=_SEMANTICS)


def _f32_dot(a, b, dims):
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _lanes(head, head_dim):
  """The lanes of head `head` of a group in a (rows, g * head_dim) tile."""
  return slice(head * head_dim, (head + 1) * head_dim)


def _widen(x_Rx128, lanes):
  """A lane-replicated (rows, 128) statistic as (rows, lanes)."""
  return jnp.tile(x_Rx128, (1, pl.cdiv(lanes, LANES)))[:, :lanes]


def _softmax_step(m_ref, l_ref, acc_ref, h, s_QxK, v_KxD):
  """One key tile (band block or global keys) of head `h`'s online softmax; masked scores are
  -inf."""
  head_dim = acc_ref.shape[-1]
  m_prev_Qx128 = m_ref[h]
  m_next_Qx128 = jnp.maximum(m_prev_Qx128, jnp.max(s_QxK, axis=1)[:, None])
  # Rows with no key so far keep max -inf: exponentiate against 0 (never -inf - -inf = NaN).
  m_safe_Qx128 = jnp.where(m_next_Qx128 == -jnp.inf, 0.0, m_next_Qx128)
  p_QxK = jnp.exp(s_QxK - _widen(m_safe_Qx128, s_QxK.shape[1]))
  alpha_Qx128 = jnp.exp(m_prev_Qx128 - m_safe_Qx128)
  m_ref[h] = m_next_Qx128
  l_ref[h] = alpha_Qx128 * l_ref[h] + jnp.sum(p_QxK, axis=1)[:, None]
  acc_ref[h] = (_widen(alpha_Qx128, head_dim) * acc_ref[h]
                + _f32_dot(p_QxK.astype(v_KxD.dtype), v_KxD, NN_DIMS))


def _global_keep(gkeep_ref, rows):
  """bool [rows, G]: the real global slots (the padding slots of the global block are 0)."""
  return jnp.broadcast_to(gkeep_ref[...] > 0.5, (rows, gkeep_ref.shape[-1]))


def _fwd_kernel(q_ref, k_ref, v_ref, mask_ref, *refs, scale, window, causal, block_q, block_k,
                num_k_blocks, num_steps, has_global):
  # refs: [kg, vg, global keep] (has_global), [the previous launch's out, lse] (aliased, never
  # read), then the outputs out, lse and the scratch m, l, acc.
  o_ref, lse_ref, m_ref, l_ref, acc_ref = refs[-5:]
  q_block, step = pl.program_id(3), pl.program_id(4)
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
      _softmax_step(m_ref, l_ref, acc_ref, h, jnp.where(keep_QxK, s_QxK, -jnp.inf),
                    v_ref[:, lanes])

  @pl.when(step == num_steps - 1)
  def _finish():
    if has_global:  # the global keys: one more tile of the same online softmax
      kg_ref, vg_ref, gkeep_ref = refs[:3]
      keep_QxG = _global_keep(gkeep_ref, block_q)
      for h in range(group):
        lanes = _lanes(h, head_dim)
        s_QxG = _f32_dot(q_ref[:, lanes], kg_ref[:, lanes], NT_DIMS) * scale
        _softmax_step(m_ref, l_ref, acc_ref, h, jnp.where(keep_QxG, s_QxG, -jnp.inf),
                      vg_ref[:, lanes])
    for h in range(group):
      l_Qx128 = l_ref[h]
      has_key_Qx128 = l_Qx128 > 0.0
      l_safe_Qx128 = jnp.where(has_key_Qx128, l_Qx128, 1.0)
      o_ref[:, _lanes(h, head_dim)] = (acc_ref[h] * _widen(1.0 / l_safe_Qx128, head_dim)
                                       ).astype(o_ref.dtype)
      lse_Qx128 = jnp.where(has_key_Qx128, m_ref[h] + jnp.log(l_safe_Qx128), EMPTY_LSE)
      lse_ref[h] = lse_Qx128.T[:1, :]  # lanes are replicated: row 0 of the transpose


def _dq_kernel(q_ref, k_ref, v_ref, mask_ref, do_ref, out_ref, lse_ref, dlse_ref, *refs, scale,
               window, causal, block_q, block_k, num_k_blocks, num_steps, has_global):
  # refs: [kg, vg, global keep] (has_global), the previous launch's outputs (aliased, never
  # read), then the outputs dq, delta, [this query block's dK, dV of the global keys] and the
  # scratch dq_acc, delta.
  dq_acc_ref, delta_ref = refs[-2:]
  outputs = refs[-6:-2] if has_global else refs[-4:-2]
  dq_ref, delta_out_ref = outputs[:2]
  q_block, step = pl.program_id(3), pl.program_id(4)
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

  def tile_grad(h, keep_QxK, k_KxD, v_KxD):
    """dS [Q, K] and P [Q, K] of head `h` against one key tile."""
    lanes = _lanes(h, head_dim)
    s_QxK = _f32_dot(q_ref[:, lanes], k_KxD, NT_DIMS) * scale
    lse_Qx1 = jnp.expand_dims(lse_ref[h, 0], -1)
    p_QxK = jnp.where(keep_QxK, jnp.exp(s_QxK - lse_Qx1), 0.0)
    dp_QxK = _f32_dot(do_ref[:, lanes], v_KxD, NT_DIMS)
    return p_QxK * (dp_QxK - _widen(delta_ref[h], keep_QxK.shape[1])), p_QxK

  @pl.when(k_block < hi)
  def _accumulate():
    shape_QxK = (block_q, block_k)
    rows_QxK = q_block * block_q + lax.broadcasted_iota(jnp.int32, shape_QxK, 0)
    cols_QxK = k_block * block_k + lax.broadcasted_iota(jnp.int32, shape_QxK, 1)
    keep_QxK = band_keep(rows_QxK, cols_QxK, window, causal) & (mask_ref[...] > 0.5)
    for h in range(group):
      lanes = _lanes(h, head_dim)
      k_KxD = k_ref[:, lanes]
      ds_QxK, _ = tile_grad(h, keep_QxK, k_KxD, v_ref[:, lanes])
      dq_acc_ref[h] += _f32_dot(ds_QxK.astype(k_KxD.dtype), k_KxD, NN_DIMS)

  @pl.when(step == num_steps - 1)
  def _finish():
    if has_global:
      # The global keys: their share of dQ, and this query block's share of their dK, dV
      # (summed over query blocks in XLA: [B, N / block_q, G, H*D], a few rows per block).
      kg_ref, vg_ref, gkeep_ref = refs[:3]
      dkg_ref, dvg_ref = outputs[2:]
      keep_QxG = _global_keep(gkeep_ref, block_q)
      for h in range(group):
        lanes = _lanes(h, head_dim)
        kg_GxD = kg_ref[:, lanes]
        ds_QxG, p_QxG = tile_grad(h, keep_QxG, kg_GxD, vg_ref[:, lanes])
        dq_acc_ref[h] += _f32_dot(ds_QxG.astype(kg_GxD.dtype), kg_GxD, NN_DIMS)
        q_QxD, do_QxD = q_ref[:, lanes], do_ref[:, lanes]
        dkg_ref[:, lanes] = _f32_dot(ds_QxG.astype(q_QxD.dtype), q_QxD, TN_DIMS) * scale
        dvg_ref[:, lanes] = _f32_dot(p_QxG.astype(do_QxD.dtype), do_QxD, TN_DIMS)
    for h in range(group):
      dq_ref[:, _lanes(h, head_dim)] = (dq_acc_ref[h] * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, *refs, scale, window,
                causal, block_q, block_k, num_q_blocks, num_steps):
  # refs: the previous launch's dk, dv (aliased, never read), the outputs dk, dv, the scratch.
  dk_ref, dv_ref, dk_acc_ref, dv_acc_ref = refs[-4:]
  k_block, step = pl.program_id(3), pl.program_id(4)
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


def _same_block(outer, step):
  del step
  return outer


class _Run:
  """BlockSpecs of one launch: heads [h0, h0 + n) of one dilation d (h0, n multiples of the head
  group), grid (batch, residue, head group, block, band step).

  A tile of rows of residue r's subsequence is block (b, i, r * groups + g) of the [B, N, H*D]
  array seen as [B, N/d, d*H*D] (a free reshape: row t holds positions t*d .. t*d + d - 1);
  rows (lse, dlse, delta [B, H, 1, N]) and the key mask ([B, 1, N]) are kept residue-major per
  head (`rows_order`), so a run of rows of one residue is one block of them too.
  """

  def __init__(self, dilation, first_head, num_heads, seq, heads, head_dim):
    self.d, self.sub = dilation, seq // dilation
    self.group = head_group(head_dim)
    self.width = self.group * head_dim
    self.g0, self.groups = first_head // self.group, num_heads // self.group
    self.lane_blocks = heads // self.group  # lane blocks of one position

  def view(self, x_BxNxHD):
    batch, seq, hd = x_BxNxHD.shape
    return x_BxNxHD.reshape(batch, seq // self.d, self.d * hd)

  def tile(self, rows, block_of):
    return pl.BlockSpec((None, rows, self.width), lambda b, r, g, i, s: (
        b, block_of(i, s), r * self.lane_blocks + self.g0 + g))

  def row(self, rows, block_of):
    blocks = self.sub // rows
    return pl.BlockSpec((None, self.group, 1, rows), lambda b, r, g, i, s: (
        b, self.g0 + g, 0, r * blocks + block_of(i, s)))

  def key_mask(self, rows, block_of):
    blocks = self.sub // rows
    return pl.BlockSpec((None, 1, rows), lambda b, r, g, i, s: (
        b, 0, r * blocks + block_of(i, s)))

  def global_block(self, num_global):  # kg, vg [B, G, H*D] and their keep vector [B, 1, G]
    kv = pl.BlockSpec((None, num_global, self.width), lambda b, r, g, i, s: (b, 0, self.g0 + g))
    return [kv, kv, pl.BlockSpec((None, 1, num_global), lambda b, r, g, i, s: (b, 0, 0))]

  def global_part(self, rows, num_global):  # [B, N / rows, G, H*D]: one part per query block
    blocks = self.sub // rows
    return pl.BlockSpec((None, None, num_global, self.width),
                        lambda b, r, g, i, s: (b, r * blocks + i, 0, self.g0 + g))

  def grid(self, batch, num_blocks, steps):
    return (batch, self.d, self.groups, num_blocks, steps)


def _launch_runs(cfg, shape, launch):
  """Calls `launch(run, previous_outputs)` for each run of heads, threading the outputs through
  so that every launch writes its heads into the same (aliased) buffers."""
  _, seq, heads, head_dim = shape
  group = head_group(head_dim)
  outputs = None
  for dilation, h0, num_heads in head_runs(cfg.dilations or (1,) * heads):
    if h0 % group or num_heads % group:
      raise ValueError(f"dilations={cfg.dilations}: each run of heads must be whole groups of "
                       f"{group} heads (band_attention_pallas orders them)")
    outputs = launch(_Run(dilation, h0, num_heads, seq, heads, head_dim), outputs)
  return outputs


def _call(kernel, run, grid, in_specs, args, out_specs, out_shape, scratch, previous, views,
          cfg, name):
  """One launch; `previous` (the last launch's outputs, seen through `views`) are passed back,
  unread (memory_space ANY), as the buffers this launch writes its heads into."""
  prev_args = [] if previous is None else [view(x) for view, x in zip(views, previous)]
  aliases = {len(args) + i: i for i in range(len(prev_args))}
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs + [pl.BlockSpec(memory_space=pl.ANY)] * len(prev_args),
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=scratch,
      input_output_aliases=aliases,
      compiler_params=_compiler_params(),
      interpret=cfg.interpret,
      name=name,
  )(*args, *prev_args)


def _check_group(heads, head_dim):
  group = head_group(head_dim)
  if heads % group:
    raise ValueError(f"heads={heads} must be a multiple of {group} for head_dim={head_dim} "
                     "(band_attention_pallas pads them)")
  return group


def rows_order(x_BxHxN, cfg, to_rows: bool):
  """Per-row statistics [B, H, N] between position order and the kernels' order, residue-major
  per head of a dilated run (position t*d + r at r * N/d + t); heads of dilation 1 unchanged."""
  dilations = cfg.dilations or (1,) * x_BxHxN.shape[1]
  if set(dilations) == {1}:
    return x_BxHxN
  batch, _, seq = x_BxHxN.shape
  parts = []
  for d, h0, n in head_runs(dilations):
    part = x_BxHxN[:, h0:h0 + n]
    if d > 1:
      shape = (batch, n, seq // d, d) if to_rows else (batch, n, d, seq // d)
      part = jnp.swapaxes(part.reshape(shape), 2, 3).reshape(batch, n, seq)
    parts.append(part)
  return jnp.concatenate(parts, axis=1)


def _key_masks(mask_BxN, cfg):
  """{dilation: the key mask [B, 1, N] float32, residue-major for that dilation}."""
  batch, seq = mask_BxN.shape
  mask = mask_BxN.astype(jnp.float32)
  masks = {}
  for d in sorted(set(cfg.dilations or (1,))):
    masks[d] = jnp.swapaxes(mask.reshape(batch, seq // d, d), 1, 2).reshape(batch, 1, seq)
  return masks


def _global_args(glob):
  """(kg [B, G, H*D], vg, keep [B, 1, G] float32) of the global key block, or ()."""
  if glob is None:
    return ()
  kg, vg, keep = glob
  batch, num_global = keep.shape
  flat = lambda x: x.reshape(batch, num_global, -1)
  return flat(kg), flat(vg), keep.astype(jnp.float32)[:, None, :]


def forward(q, k, v, mask_BxN, glob, cfg):
  """q, k, v [B, N, H, D] (N a multiple of the blocks times every dilation, H of
  `head_group(D)`, each run of heads of one dilation whole groups); glob: (kg, vg [B, G, H, D],
  keep [B, G]) or None. -> out [B, N, H, D], lse [B, H, N] in the kernels' order
  (`rows_order`)."""
  batch, seq, heads, head_dim = q.shape
  group = _check_group(heads, head_dim)
  q2, k2, v2 = (x.reshape(batch, seq, heads * head_dim) for x in (q, k, v))
  masks = _key_masks(mask_BxN, cfg)
  glob_args = _global_args(glob)
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k

  def launch(run, previous):
    num_q, num_k = run.sub // bq, run.sub // bk
    steps = max_band_blocks(num_q, bq, bk, cfg.window, cfg.causal, num_k, by_query=True)
    kv_of = _band_index_maps(bq, bk, cfg, num_k, by_query=True)
    kernel = functools.partial(_fwd_kernel, scale=cfg.scale, window=cfg.window,
                               causal=cfg.causal, block_q=bq, block_k=bk, num_k_blocks=num_k,
                               num_steps=steps, has_global=bool(glob_args))
    in_specs = [run.tile(bq, _same_block), run.tile(bk, kv_of), run.tile(bk, kv_of),
                run.key_mask(bk, kv_of)]
    args = [run.view(q2), run.view(k2), run.view(v2), masks[run.d]]
    if glob_args:
      in_specs += run.global_block(cfg.num_global)
      args += glob_args
    out, lse = _call(
        kernel, run, run.grid(batch, num_q, steps), in_specs, args,
        [run.tile(bq, _same_block), run.row(bq, _same_block)],
        [out_struct(args[0].shape, q.dtype, *args),
         out_struct((batch, heads, 1, seq), jnp.float32, *args)],
        [pltpu.VMEM((group, bq, LANES), jnp.float32),
         pltpu.VMEM((group, bq, LANES), jnp.float32),
         pltpu.VMEM((group, bq, head_dim), jnp.float32)],
        previous, (run.view, lambda x: x), cfg, "band_attention_fwd_tpu")
    return out.reshape(q2.shape), lse

  out, lse = _launch_runs(cfg, q.shape, launch)
  return out.reshape(q.shape), lse[:, :, 0, :]


def backward(q, k, v, mask_BxN, glob, out, do, lse_BxHxN, dlse_BxHxN, cfg):
  """Gradients (dq, dk, dv [B, N, H, D], dglob) of out [B, N, H, D] and lse [B, H, N] (the
  forward's, in the kernels' order) given their cotangents dout [B, N, H, D] and dlse [B, H, N]
  (position order); dglob is (dkg, dvg, None) with global keys, else None."""
  batch, seq, heads, head_dim = q.shape
  group = _check_group(heads, head_dim)
  hd = heads * head_dim
  q2, k2, v2, out2, do2 = (x.reshape(batch, seq, hd) for x in (q, k, v, out, do.astype(q.dtype)))
  masks = _key_masks(mask_BxN, cfg)
  glob_args = _global_args(glob)
  has_global = bool(glob_args)
  blocks = cfg.blocks
  lse_BxHx1xN = lse_BxHxN[:, :, None, :]
  dlse_BxHx1xN = rows_order(dlse_BxHxN.astype(jnp.float32), cfg, to_rows=True)[:, :, None, :]
  common = dict(scale=cfg.scale, window=cfg.window, causal=cfg.causal)
  num_global = cfg.num_global
  same = lambda x: x

  # dQ (and delta; with global keys, their dK/dV per query block): grid over query blocks,
  # band axis over key blocks (as the forward).
  bq, bk = blocks.block_q_dq, blocks.block_k_dq

  def launch_dq(run, previous):
    num_q, num_k = run.sub // bq, run.sub // bk
    steps = max_band_blocks(num_q, bq, bk, cfg.window, cfg.causal, num_k, by_query=True)
    kv_of = _band_index_maps(bq, bk, cfg, num_k, by_query=True)
    q_spec = run.tile(bq, _same_block)
    row_spec = run.row(bq, _same_block)
    in_specs = [q_spec, run.tile(bk, kv_of), run.tile(bk, kv_of), run.key_mask(bk, kv_of),
                q_spec, q_spec, row_spec, row_spec]
    args = [run.view(q2), run.view(k2), run.view(v2), masks[run.d], run.view(do2),
            run.view(out2), lse_BxHx1xN, dlse_BxHx1xN]
    out_specs = [q_spec, row_spec]
    out_shape = [out_struct(args[0].shape, q.dtype, *args),
                 out_struct((batch, heads, 1, seq), jnp.float32, *args)]
    views = [run.view, same]
    if has_global:
      in_specs += run.global_block(num_global)
      args += glob_args
      out_specs += [run.global_part(bq, num_global)] * 2
      out_shape += [out_struct((batch, seq // bq, num_global, hd), jnp.float32, *args)] * 2
      views += [same, same]
    results = _call(
        functools.partial(_dq_kernel, block_q=bq, block_k=bk, num_k_blocks=num_k,
                          num_steps=steps, has_global=has_global, **common),
        run, run.grid(batch, num_q, steps), in_specs, args, out_specs, out_shape,
        [pltpu.VMEM((group, bq, head_dim), jnp.float32),
         pltpu.VMEM((group, bq, LANES), jnp.float32)],
        previous, views, cfg, "band_attention_bwd_dq_tpu")
    return [results[0].reshape(q2.shape), *results[1:]]

  dq, delta_BxHx1xN, *global_parts = _launch_runs(cfg, q.shape, launch_dq)

  # dK, dV: grid over key blocks, band axis over the query blocks that reach them.
  bq, bk = blocks.block_q_dkv, blocks.block_k_dkv

  def launch_dkv(run, previous):
    num_q, num_k = run.sub // bq, run.sub // bk
    steps = max_band_blocks(num_k, bk, bq, cfg.window, cfg.causal, num_q, by_query=False)
    q_of = _band_index_maps(bk, bq, cfg, num_q, by_query=False)
    k_spec, q_spec = run.tile(bk, _same_block), run.tile(bq, q_of)
    row_spec = run.row(bq, q_of)
    args = [run.view(q2), run.view(k2), run.view(v2), masks[run.d], run.view(do2), lse_BxHx1xN,
            delta_BxHx1xN]
    dk, dv = _call(
        functools.partial(_dkv_kernel, block_q=bq, block_k=bk, num_q_blocks=num_q,
                          num_steps=steps, **common),
        run, run.grid(batch, num_k, steps),
        [q_spec, k_spec, k_spec, run.key_mask(bk, _same_block), q_spec, row_spec, row_spec],
        args, [k_spec, k_spec],
        [out_struct(args[1].shape, k.dtype, *args), out_struct(args[2].shape, v.dtype, *args)],
        [pltpu.VMEM((group, bk, head_dim), jnp.float32),
         pltpu.VMEM((group, bk, head_dim), jnp.float32)],
        previous, (run.view, run.view), cfg, "band_attention_bwd_dkv_tpu")
    return dk.reshape(q2.shape), dv.reshape(q2.shape)

  dk, dv = _launch_runs(cfg, q.shape, launch_dkv)
  dglob = None
  if has_global:
    kg = glob[0]
    dkg, dvg = (jnp.sum(part, axis=1).reshape(kg.shape).astype(kg.dtype)
                for part in global_parts)
    dglob = (dkg, dvg, None)
  return dq.reshape(q.shape), dk.reshape(q.shape), dv.reshape(q.shape), dglob
