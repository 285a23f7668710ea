"""Mosaic TPU kernels for the band (called by `band_pallas.band_attention_pallas(backend='tpu')`).

Layout: the caller's [B, N, H, D], seen by the kernels as [B, N, H*D] (a free reshape), with
heads taken in groups of `g = head_group(D)` so that a block's minor (lane) dim `g*D` fills the
128 TPU lanes: tiles (rows, g*D), g = 2 for head_dim 64 (the wrapper zero-pads the heads to a
multiple of g). Why not [B, H, N, D]: HBM arrays are stored in (8, 128) tiles of their two minor
dims, so a minor dim of 64 is padded to 128 lanes, which doubled every q, k, v, out, dout, dq,
dk and dv held in that layout, and the transposes into and out of it were extra copies.
A kernel step loops over its g heads with static lane slices `[:, h*D:(h+1)*D]`; the band and
key masks are computed once per step for all of them.

Dilation (docs/design.md §2.1) is addressed in place, by one launch of each kernel for every
head: a head of dilation d attends an undilated band on each residue class mod d. A block is
`rows` consecutive positions, a multiple of every dilation of the call (`_Layout.rows`), so it
holds rows / d rows of each residue of a head of dilation d: residue r's are the strided rows
r, r + d, ... of the block (`_residue`, strided loads; Mosaic stores only 32-bit data strided,
so the accumulators, float32, are kept in position order and the output is written whole).
The kernels work in subsequence coordinates per residue and branch on the head group's
dilation (`_Layout.for_group_dilation`); in position coordinates a head of dilation d reaches
window * d positions, which is what the index maps use (`_Layout.band_block`). Rows (lse,
dlse, delta) and the key mask are kept residue-major within each block (`rows_order`,
`_key_masks`: one key-mask row per dilation), so a residue's rows are one lane range. Heads
come in lane groups of one dilation (`band_blocks.tpu_head_order`). The earlier layout, a
launch per run of heads on [B, N, H*D] seen as [B, N/d, d*H*D], was not free on TPU: a
reshape that moves rows across (8, 128) tiles is a relayout, and XLA copied every operand of
every dilated launch.

Global keys: the G (a multiple of 8) global keys/values are one more block that every step of a
head group sees (its index never changes, so it is fetched once); the forward merges them into
the online softmax at the band's last step, the dQ kernel adds their share of dQ there and
writes this query block's share of their dK, dV ([B, N / rows, G, H*D] float32, summed in
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
relayout. lse, dlse and delta travel as lane-dense rows [B, H, 1, N] (block (g, 1, rows));
the dK/dV kernel computes transposed tiles (keys x queries) so those rows broadcast without
relayout; the dQ kernel and the key mask of the dK/dV kernel turn a row into a column with
`expand_dims(row, -1)` (the relayout splash uses).

TPU block constraints: block dims divisible by (8, 128) or equal to the array dims, so every
configured block size is a power of two >= 128 (a block of a dilated call is lcm(dilations)
times a power of two >= 128) and the sequence is padded to a multiple of the largest times
lcm(dilations).
Verified here: interpret mode on CPU against the dense reference (forward and gradients), and
compiled by XLA's TPU compiler and Mosaic on CPU through libtpu's compile-only client
(tests/test_tpu_aot.py); not yet run or timed on a TPU.
"""

from __future__ import annotations

import functools
import math

import jax
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
# Grid (batch, head group, block, band step): the band axis carries the accumulators.
_SEMANTICS = ("parallel",) * 3 + ("arbitrary",)
# A block of a call whose dilations have least common multiple L covers L * b0 positions, b0 the
# largest power of two <= block / L (at least 128, the lanes of a row block): L * b0 <= block
# while L <= block / 128, so the tiles stay the configured size.


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


def _residue(r, rows, d):
  """The rows of residue r (mod d) of a block of d * rows positions: a strided slice."""
  return pl.ds(r, rows, stride=d)


def _row_part(r, rows):
  """Residue r's part of a block's row statistics (kept residue-major: `rows_order`)."""
  return pl.ds(r * rows, rows)


def _softmax_step(m_ref, l_ref, acc_ref, h, rows, s_QxK, v_KxD, pv_dims=NN_DIMS):
  """One key tile (band block or global keys) of head `h`'s online softmax for the query rows
  `rows` of the block; masked scores are -inf. pv_dims: how P [Q, K] meets v (NT_DIMS: v given
  transposed, [D, K])."""
  head_dim = acc_ref.shape[-1]
  m_prev_Qx128 = m_ref.at[h][rows]
  m_next_Qx128 = jnp.maximum(m_prev_Qx128, jnp.max(s_QxK, axis=1)[:, None])
  # Rows with no key so far keep max -inf: exponentiate against 0 (never -inf - -inf = NaN).
  m_safe_Qx128 = jnp.where(m_next_Qx128 == -jnp.inf, 0.0, m_next_Qx128)
  p_QxK = jnp.exp(s_QxK - _widen(m_safe_Qx128, s_QxK.shape[1]))
  alpha_Qx128 = jnp.exp(m_prev_Qx128 - m_safe_Qx128)
  m_ref.at[h][rows] = m_next_Qx128
  l_ref.at[h][rows] = alpha_Qx128 * l_ref.at[h][rows] + jnp.sum(p_QxK, axis=1)[:, None]
  acc_ref.at[h][rows] = (_widen(alpha_Qx128, head_dim) * acc_ref.at[h][rows]
                      + _f32_dot(p_QxK.astype(v_KxD.dtype), v_KxD, pv_dims))


def _global_keep(gkeep_ref, rows):
  """bool [rows, G]: the real global slots (the padding slots of the global block are 0)."""
  return jnp.broadcast_to(gkeep_ref[...] > 0.5, (rows, gkeep_ref.shape[-1]))


def _band_tile_keep(outer_block, inner_block, outer_rows, inner_rows, window, causal, by_query):
  """bool (outer_rows, inner_rows): the band between two blocks in subsequence coordinates
  (queries x keys, or keys x queries for the dK/dV kernel)."""
  shape = (outer_rows, inner_rows)
  outer = outer_block * outer_rows + lax.broadcasted_iota(jnp.int32, shape, 0)
  inner = inner_block * inner_rows + lax.broadcasted_iota(jnp.int32, shape, 1)
  return band_keep(outer, inner, window, causal) if by_query else band_keep(inner, outer, window,
                                                                             causal)


def _band_step(d, outer_block, step, rows_q, rows_k, window, causal, num_inner, by_query):
  """Band step `step` of a head group of dilation d: (a residue's rows in a query block, in a key
  block, the inner block visited, whether it is inside the band)."""
  bq, bk = rows_q // d, rows_k // d
  block_range = k_block_range if by_query else q_block_range
  lo, hi = block_range(outer_block, bq, bk, window, causal, num_inner)
  return bq, bk, lo + step, lo + step < hi


def _query_tiles(d, q_block, k_block, bq, bk, window, causal, mask_ref, layout):
  """(residue, its query rows, its key rows, keep [Q, K]) of each residue of a query block x key
  block band tile of a head group of dilation d (the forward and dQ kernels)."""
  band_QxK = _band_tile_keep(q_block, k_block, bq, bk, window, causal, by_query=True)
  mask = layout.mask_row(d)
  for r in range(d):
    yield (r, _residue(r, bq, d), _residue(r, bk, d),
           band_QxK & (mask_ref[mask:mask + 1, _row_part(r, bk)] > 0.5))


def _fwd_kernel(q_ref, k_ref, v_ref, mask_ref, *refs, layout, scale, window, causal, rows_q,
                rows_k, num_k_blocks, num_steps, has_global):
  # refs: [kg, vg, global keep] (has_global), the outputs out, lse and the scratch m, l, acc
  # (rows in position order).
  o_ref, lse_ref, m_ref, l_ref, acc_ref = refs[-5:]
  head_group_id, q_block, step = pl.program_id(1), pl.program_id(2), pl.program_id(3)
  group, _, head_dim = acc_ref.shape

  @pl.when(step == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def band(d):  # this head group's dilation d, static
    bq, bk, k_block, in_band = _band_step(d, q_block, step, rows_q, rows_k, window, causal,
                                          num_k_blocks, by_query=True)

    @pl.when(in_band)
    def _accumulate():
      for _, q_rows, k_rows, keep_QxK in _query_tiles(d, q_block, k_block, bq, bk, window, causal,
                                                      mask_ref, layout):
        q_QxW, k_KxW, v_KxW = q_ref[q_rows, :], k_ref[k_rows, :], v_ref[k_rows, :]
        for h in range(group):
          lanes = _lanes(h, head_dim)
          s_QxK = _f32_dot(q_QxW[:, lanes], k_KxW[:, lanes], NT_DIMS) * scale
          _softmax_step(m_ref, l_ref, acc_ref, h, q_rows, jnp.where(keep_QxK, s_QxK, -jnp.inf),
                        v_KxW[:, lanes])

  layout.for_group_dilation(band, head_group_id)

  @pl.when(step == num_steps - 1)
  def _finish():
    every_row = pl.ds(0, rows_q)
    if has_global:  # the global keys: one more tile of the same online softmax, every row
      kg_ref, vg_ref, gkeep_ref = refs[:3]
      keep_QxG = _global_keep(gkeep_ref, rows_q)
      for h in range(group):
        lanes = _lanes(h, head_dim)
        s_QxG = _f32_dot(q_ref[:, lanes], kg_ref[:, lanes], NT_DIMS) * scale
        _softmax_step(m_ref, l_ref, acc_ref, h, every_row,
                      jnp.where(keep_QxG, s_QxG, -jnp.inf), vg_ref[:, lanes])
    for h in range(group):
      l_Qx128 = l_ref[h]
      l_safe_Qx128 = jnp.where(l_Qx128 > 0.0, l_Qx128, 1.0)
      o_ref[:, _lanes(h, head_dim)] = (acc_ref[h] * _widen(1.0 / l_safe_Qx128, head_dim)
                                       ).astype(o_ref.dtype)

    def lse_rows(d):  # residue-major: residue r's rows are one lane range
      bq = rows_q // d
      for r in range(d):
        q_rows = _residue(r, bq, d)
        for h in range(group):
          l_Qx128 = l_ref.at[h][q_rows]
          has_key_Qx128 = l_Qx128 > 0.0
          log_l_Qx128 = jnp.log(jnp.where(has_key_Qx128, l_Qx128, 1.0))
          lse_Qx128 = jnp.where(has_key_Qx128, m_ref.at[h][q_rows] + log_l_Qx128, EMPTY_LSE)
          lse_ref[h, :, _row_part(r, bq)] = lse_Qx128.T[:1, :]  # lanes replicated: row 0

    layout.for_group_dilation(lse_rows, head_group_id)


def _dq_kernel(q_ref, k_ref, v_ref, mask_ref, do_ref, out_ref, lse_ref, dlse_ref, *refs, layout,
               scale, window, causal, rows_q, rows_k, num_k_blocks, num_steps, has_global):
  # refs: [kg, vg, global keep] (has_global), then the outputs dq, delta, [this query block's dK,
  # dV of the global keys] and the scratch dq_acc, delta (rows in position order).
  dq_acc_ref, delta_ref = refs[-2:]
  outputs = refs[-6:-2] if has_global else refs[-4:-2]
  dq_ref, delta_out_ref = outputs[:2]
  head_group_id, q_block, step = pl.program_id(1), pl.program_id(2), pl.program_id(3)
  group, _, head_dim = dq_acc_ref.shape

  def tile_grad(h, q_rows, row_part, q_QxD, do_QxD, keep_QxK, k_KxD, v_KxD):
    """dS [Q, K] and P [Q, K] of head `h`'s rows `q_rows` against one key tile."""
    s_QxK = _f32_dot(q_QxD, k_KxD, NT_DIMS) * scale
    lse_Qx1 = jnp.expand_dims(lse_ref[h, 0, row_part], -1)
    p_QxK = jnp.where(keep_QxK, jnp.exp(s_QxK - lse_Qx1), 0.0)
    dp_QxK = _f32_dot(do_QxD, v_KxD, NT_DIMS)
    return p_QxK * (dp_QxK - _widen(delta_ref.at[h][q_rows], keep_QxK.shape[1])), p_QxK

  def band(d):  # this head group's dilation d, static
    bq, bk = rows_q // d, rows_k // d

    @pl.when(step == 0)
    def _init():
      dq_acc_ref[...] = jnp.zeros(dq_acc_ref.shape, jnp.float32)
      # delta = rowsum(out * dout) - dlse, for this kernel (lane-replicated column) and for
      # the dK/dV kernel (a row). Here and not in XLA: XLA reduces over head_dim by
      # transposing a float32 copy of out ([B, N, H*D], 4 bytes per element), the largest
      # temporary of the backward pass.
      for r in range(d):
        q_rows, row_part = _residue(r, bq, d), _row_part(r, bq)
        out_QxW = out_ref[q_rows, :].astype(jnp.float32)
        do_QxW = do_ref[q_rows, :].astype(jnp.float32)
        for h in range(group):
          lanes = _lanes(h, head_dim)
          dlse_Qx1 = jnp.expand_dims(dlse_ref[h, 0, row_part], -1)
          delta_Qx1 = jnp.sum(out_QxW[:, lanes] * do_QxW[:, lanes], axis=1,
                              keepdims=True) - dlse_Qx1
          delta_Qx128 = jnp.broadcast_to(delta_Qx1, (bq, LANES))
          delta_ref.at[h][q_rows] = delta_Qx128
          delta_out_ref[h, :, row_part] = delta_Qx128.T[:1, :]  # lanes replicated: row 0

    _, _, k_block, in_band = _band_step(d, q_block, step, rows_q, rows_k, window, causal,
                                        num_k_blocks, by_query=True)

    @pl.when(in_band)
    def _accumulate():
      for r, q_rows, k_rows, keep_QxK in _query_tiles(d, q_block, k_block, bq, bk, window, causal,
                                                      mask_ref, layout):
        q_QxW, do_QxW = q_ref[q_rows, :], do_ref[q_rows, :]
        k_KxW, v_KxW = k_ref[k_rows, :], v_ref[k_rows, :]
        for h in range(group):
          lanes = _lanes(h, head_dim)
          k_KxD = k_KxW[:, lanes]
          ds_QxK, _ = tile_grad(h, q_rows, _row_part(r, bq), q_QxW[:, lanes], do_QxW[:, lanes],
                                keep_QxK, k_KxD, v_KxW[:, lanes])
          dq_acc_ref.at[h][q_rows] += _f32_dot(ds_QxK.astype(k_KxD.dtype), k_KxD, NN_DIMS)

    if has_global:
      @pl.when(step == num_steps - 1)
      def _global_keys():
        # Their share of dQ, and this query block's share of their dK, dV (summed over query
        # blocks in XLA: [B, N / block, G, H*D], a few rows per block).
        kg_ref, vg_ref, gkeep_ref = refs[:3]
        dkg_ref, dvg_ref = outputs[2:]
        keep_QxG = _global_keep(gkeep_ref, bq)
        dkg, dvg = [0.0] * group, [0.0] * group
        for r in range(d):
          q_rows = _residue(r, bq, d)
          q_QxW, do_QxW = q_ref[q_rows, :], do_ref[q_rows, :]
          for h in range(group):
            lanes = _lanes(h, head_dim)
            kg_GxD, q_QxD, do_QxD = kg_ref[:, lanes], q_QxW[:, lanes], do_QxW[:, lanes]
            ds_QxG, p_QxG = tile_grad(h, q_rows, _row_part(r, bq), q_QxD, do_QxD, keep_QxG,
                                      kg_GxD, vg_ref[:, lanes])
            dq_acc_ref.at[h][q_rows] += _f32_dot(ds_QxG.astype(kg_GxD.dtype), kg_GxD, NN_DIMS)
            dkg[h] += _f32_dot(ds_QxG.astype(q_QxD.dtype), q_QxD, TN_DIMS)
            dvg[h] += _f32_dot(p_QxG.astype(do_QxD.dtype), do_QxD, TN_DIMS)
        for h in range(group):
          dkg_ref[:, _lanes(h, head_dim)] = dkg[h] * scale
          dvg_ref[:, _lanes(h, head_dim)] = dvg[h]

  layout.for_group_dilation(band, head_group_id)

  @pl.when(step == num_steps - 1)
  def _finish():
    for h in range(group):
      dq_ref[:, _lanes(h, head_dim)] = (dq_acc_ref[h] * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, *refs, layout, scale,
                window, causal, rows_q, rows_k, num_q_blocks, num_steps):
  # refs: the outputs dk, dv, the scratch dk_acc, dv_acc (rows in position order).
  dk_ref, dv_ref, dk_acc_ref, dv_acc_ref = refs[-4:]
  head_group_id, k_block, step = pl.program_id(1), pl.program_id(2), pl.program_id(3)
  group, _, head_dim = dk_acc_ref.shape

  @pl.when(step == 0)
  def _init():
    dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
    dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

  def band(d):  # this head group's dilation d, static
    bq, bk, q_block, in_band = _band_step(d, k_block, step, rows_q, rows_k, window, causal,
                                          num_q_blocks, by_query=False)
    mask = layout.mask_row(d)

    @pl.when(in_band)
    def _accumulate():
      # Transposed tiles (keys x queries): lse/delta rows broadcast over sublanes as stored.
      band_KxQ = _band_tile_keep(k_block, q_block, bk, bq, window, causal, by_query=False)
      for r in range(d):
        q_rows, k_rows, row_part = _residue(r, bq, d), _residue(r, bk, d), _row_part(r, bq)
        mask_Kx1 = jnp.expand_dims(mask_ref[mask, _row_part(r, bk)], -1)
        keep_KxQ = band_KxQ & (mask_Kx1 > 0.5)
        q_QxW, do_QxW = q_ref[q_rows, :], do_ref[q_rows, :]
        k_KxW, v_KxW = k_ref[k_rows, :], v_ref[k_rows, :]
        for h in range(group):
          lanes = _lanes(h, head_dim)
          q_QxD, do_QxD = q_QxW[:, lanes], do_QxW[:, lanes]
          s_KxQ = _f32_dot(k_KxW[:, lanes], q_QxD, NT_DIMS) * scale
          p_KxQ = jnp.where(keep_KxQ, jnp.exp(s_KxQ - lse_ref[h, :, row_part]), 0.0)
          dv_acc_ref.at[h][k_rows] += _f32_dot(p_KxQ.astype(do_QxD.dtype), do_QxD, NN_DIMS)
          dp_KxQ = _f32_dot(v_KxW[:, lanes], do_QxD, NT_DIMS)
          ds_KxQ = p_KxQ * (dp_KxQ - delta_ref[h, :, row_part])
          dk_acc_ref.at[h][k_rows] += _f32_dot(ds_KxQ.astype(q_QxD.dtype), q_QxD, NN_DIMS)

  layout.for_group_dilation(band, head_group_id)

  @pl.when(step == num_steps - 1)
  def _finish():
    for h in range(group):
      lanes = _lanes(h, head_dim)
      dk_ref[:, lanes] = (dk_acc_ref[h] * scale).astype(dk_ref.dtype)
      dv_ref[:, lanes] = dv_acc_ref[h].astype(dv_ref.dtype)


def _same_block(group, outer, step):
  del group, step
  return outer


class _Layout:
  """How one call's heads and rows map onto the kernels' grid (batch, head group, block, band
  step) and BlockSpecs. Heads come in lane groups of `head_group(D)` heads of one dilation
  (`band_blocks.tpu_head_order`); a block is `rows` consecutive positions, `rows` a multiple of
  every dilation, so that a block holds rows / d rows of each residue class of a head of
  dilation d: block i of residue r's subsequence is the strided slice r, r + d, ... of block i
  (`_residue`). The kernels branch on the group's dilation (`for_group_dilation`); the index
  maps use it as a traced scalar (`dilation_of`).
  """

  def __init__(self, cfg, heads, head_dim):
    self.group = _check_group(heads, head_dim)
    self.width = self.group * head_dim
    dilations = cfg.dilations or (1,) * heads
    self.head_dilations = dilations
    self.group_dilations = dilations[::self.group]
    if any(len(set(dilations[g:g + self.group])) > 1 for g in range(0, heads, self.group)):
      raise ValueError(f"dilations={dilations}: each lane group of {self.group} heads must share "
                       "one dilation (band_attention_pallas orders them)")
    self.groups = len(self.group_dilations)
    self.distinct = tuple(sorted(set(dilations)))
    self.lcm = math.lcm(*self.distinct)

  def rows(self, block: int) -> int:
    """Positions per block for a configured block size (a power of two >= 128): lcm * b0, b0
    the largest power of two <= block / lcm and >= 128 (the lanes of a residue's row part)."""
    b0 = max(LANES, 1 << max((block // self.lcm).bit_length() - 1, 0))
    return self.lcm * b0

  def dilation_of(self, group):
    """The dilation of head group `group` (a traced grid index) as an int32 scalar."""
    runs = head_runs(self.group_dilations)
    d = jnp.int32(runs[-1][0])
    for dilation, g0, n in reversed(runs[:-1]):
      d = jnp.where(group < g0 + n, jnp.int32(dilation), d)
    return d

  def for_group_dilation(self, body, group):
    """body(d) for the dilation d (a static int) of head group `group` (`pl.program_id(1)`, read
    at the kernel's top level): one branch per dilation."""
    if len(self.distinct) == 1:
      body(self.distinct[0])
      return
    d_group = self.dilation_of(group)
    for d in self.distinct:
      pl.when(d_group == d)(functools.partial(body, d))

  def mask_row(self, d: int) -> int:
    return self.distinct.index(d)

  def band_steps(self, num_outer, outer_rows, inner_rows, cfg, num_inner, by_query):
    """The grid's band axis: the widest band in blocks over every dilation."""
    return max(max_band_blocks(num_outer, outer_rows // d, inner_rows // d, cfg.window,
                               cfg.causal, num_inner, by_query) for d in self.distinct)

  def band_block(self, cfg, outer_rows, inner_rows, num_inner, by_query):
    """(group, outer block, band step) -> the inner block visited, clamped to the band's last
    block (no new DMA past the band). In position coordinates a head of dilation d reaches
    window * d positions: the same blocks as its subsequences' band (blocks are multiples of
    d)."""
    def inner_block(group, outer, step):
      reach = cfg.window * self.dilation_of(group)
      if by_query:
        lo, hi = k_block_range(outer, outer_rows, inner_rows, reach, cfg.causal, num_inner)
      else:
        lo, hi = q_block_range(outer, inner_rows, outer_rows, reach, cfg.causal, num_inner)
      return jnp.minimum(lo + step, hi - 1)
    return inner_block

  def tile(self, rows, block_of):  # q, k, v, out ... [B, N, H*D]
    return pl.BlockSpec((None, rows, self.width), lambda b, g, i, s: (
        b, block_of(g, i, s), g))

  def row(self, rows, block_of):  # lse, dlse, delta [B, H, 1, N], `rows_order`
    return pl.BlockSpec((None, self.group, 1, rows), lambda b, g, i, s: (
        b, g, 0, block_of(g, i, s)))

  def key_mask(self, rows, block_of):  # [B, dilations, N]: one row per dilation, `_key_masks`
    return pl.BlockSpec((None, len(self.distinct), rows), lambda b, g, i, s: (
        b, 0, block_of(g, i, s)))

  def global_block(self, num_global):  # kg, vg [B, G, H*D] and their keep vector [B, 1, G]
    kv = pl.BlockSpec((None, num_global, self.width), lambda b, g, i, s: (b, 0, g))
    return [kv, kv, pl.BlockSpec((None, 1, num_global), lambda b, g, i, s: (b, 0, 0))]

  def global_part(self, num_global):  # [B, N / rows, G, H*D]: one part per query block
    return pl.BlockSpec((None, None, num_global, self.width),
                        lambda b, g, i, s: (b, i, 0, g))

  def grid(self, batch, num_blocks, steps):
    return (batch, self.groups, num_blocks, steps)


def _call(kernel, layout, grid, in_specs, args, out_specs, out_shape, scratch, cfg, name):
  del layout
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=scratch,
      compiler_params=_compiler_params(),
      interpret=cfg.interpret,
      name=name,
  )(*args)


def _check_group(heads, head_dim):
  group = head_group(head_dim)
  if heads % group:
    raise ValueError(f"heads={heads} must be a multiple of {group} for head_dim={head_dim} "
                     "(band_attention_pallas pads them)")
  return group


def _residue_major(x_Bx_xN, d: int, rows: int, to_rows: bool):
  """[..., N] between position order and residue-major order within each block of `rows`
  positions (position i * rows + t * d + r at i * rows + r * rows / d + t)."""
  *lead, seq = x_Bx_xN.shape
  shape = (*lead, seq // rows) + ((rows // d, d) if to_rows else (d, rows // d))
  return jnp.swapaxes(x_Bx_xN.reshape(shape), -1, -2).reshape(x_Bx_xN.shape)


def rows_order(x_BxHxN, layout, rows: int, to_rows: bool):
  """Per-row statistics [B, H, N] between position order and the kernels' order for blocks of
  `rows` positions: residue-major within each block for a head of dilation d > 1, so that a
  residue's rows are one lane range of a block (`_row_part`); heads of dilation 1 unchanged."""
  if layout.distinct == (1,):
    return x_BxHxN
  parts = []
  for d, h0, n in head_runs(layout.head_dilations):
    part = x_BxHxN[:, h0:h0 + n]
    parts.append(part if d == 1 else _residue_major(part, d, rows, to_rows))
  return jnp.concatenate(parts, axis=1)


def _key_masks(mask_BxN, layout, rows: int):
  """The key mask [B, dilations, N] float32: row j for the heads of dilation
  `layout.distinct[j]`, in that dilation's order of blocks of `rows` keys (`rows_order`)."""
  mask = mask_BxN.astype(jnp.float32)
  return jnp.stack([mask if d == 1 else _residue_major(mask, d, rows, to_rows=True)
                    for d in layout.distinct], axis=1)


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
  `head_group(D)`, each lane group of heads of one dilation); glob: (kg, vg [B, G, H, D],
  keep [B, G]) or None. -> out [B, N, H, D], lse [B, H, N] (position order)."""
  batch, seq, heads, head_dim = q.shape
  layout = _Layout(cfg, heads, head_dim)
  group = layout.group
  q2, k2, v2 = (x.reshape(batch, seq, heads * head_dim) for x in (q, k, v))
  glob_args = _global_args(glob)
  bq, bk = layout.rows(cfg.blocks.block_q), layout.rows(cfg.blocks.block_k)
  num_q, num_k = seq // bq, seq // bk
  steps = layout.band_steps(num_q, bq, bk, cfg, num_k, by_query=True)
  kv_of = layout.band_block(cfg, bq, bk, num_k, by_query=True)
  kernel = functools.partial(_fwd_kernel, layout=layout, scale=cfg.scale, window=cfg.window,
                             causal=cfg.causal, rows_q=bq, rows_k=bk, num_k_blocks=num_k,
                             num_steps=steps, has_global=bool(glob_args))
  in_specs = [layout.tile(bq, _same_block), layout.tile(bk, kv_of), layout.tile(bk, kv_of),
              layout.key_mask(bk, kv_of)]
  args = [q2, k2, v2, _key_masks(mask_BxN, layout, bk)]
  if glob_args:
    in_specs += layout.global_block(cfg.num_global)
    args += glob_args
  out, lse = _call(
      kernel, layout, layout.grid(batch, num_q, steps), in_specs, args,
      [layout.tile(bq, _same_block), layout.row(bq, _same_block)],
      [out_struct(q2.shape, q.dtype, *args),
       out_struct((batch, heads, 1, seq), jnp.float32, *args)],
      [pltpu.VMEM((group, bq, LANES), jnp.float32),
       pltpu.VMEM((group, bq, LANES), jnp.float32),
       pltpu.VMEM((group, bq, head_dim), jnp.float32)],
      cfg, "band_attention_fwd_tpu")
  return out.reshape(q.shape), rows_order(lse[:, :, 0, :], layout, bq, to_rows=False)


def backward(q, k, v, mask_BxN, glob, out, do, lse_BxHxN, dlse_BxHxN, cfg):
  """Gradients (dq, dk, dv [B, N, H, D], dglob) of out [B, N, H, D] and lse [B, H, N] (position
  order) given their cotangents dout [B, N, H, D] and dlse [B, H, N]; dglob is (dkg, dvg,
  None) with global keys, else None."""
  batch, seq, heads, head_dim = q.shape
  layout = _Layout(cfg, heads, head_dim)
  group = layout.group
  hd = heads * head_dim
  q2, k2, v2, out2, do2 = (x.reshape(batch, seq, hd) for x in (q, k, v, out, do.astype(q.dtype)))
  glob_args = _global_args(glob)
  has_global = bool(glob_args)
  blocks = cfg.blocks
  rows_of = lambda x_BxHxN, rows: rows_order(x_BxHxN, layout, rows, to_rows=True)[:, :, None, :]
  common = dict(layout=layout, scale=cfg.scale, window=cfg.window, causal=cfg.causal)
  num_global = cfg.num_global

  # dQ (and delta; with global keys, their dK/dV per query block): grid over query blocks,
  # band axis over key blocks (as the forward).
  bq, bk = layout.rows(blocks.block_q_dq), layout.rows(blocks.block_k_dq)
  num_q, num_k = seq // bq, seq // bk
  steps = layout.band_steps(num_q, bq, bk, cfg, num_k, by_query=True)
  kv_of = layout.band_block(cfg, bq, bk, num_k, by_query=True)
  q_spec, row_spec = layout.tile(bq, _same_block), layout.row(bq, _same_block)
  in_specs = [q_spec, layout.tile(bk, kv_of), layout.tile(bk, kv_of),
              layout.key_mask(bk, kv_of), q_spec, q_spec, row_spec, row_spec]
  args = [q2, k2, v2, _key_masks(mask_BxN, layout, bk), do2, out2, rows_of(lse_BxHxN, bq),
          rows_of(dlse_BxHxN.astype(jnp.float32), bq)]
  out_specs = [q_spec, row_spec]
  out_shape = [out_struct(q2.shape, q.dtype, *args),
               out_struct((batch, heads, 1, seq), jnp.float32, *args)]
  if has_global:
    in_specs += layout.global_block(num_global)
    args += glob_args
    out_specs += [layout.global_part(num_global)] * 2
    out_shape += [out_struct((batch, num_q, num_global, hd), jnp.float32, *args)] * 2
  dq, delta_rows, *global_parts = _call(
      functools.partial(_dq_kernel, rows_q=bq, rows_k=bk, num_k_blocks=num_k, num_steps=steps,
                        has_global=has_global, **common),
      layout, layout.grid(batch, num_q, steps), in_specs, args, out_specs, out_shape,
      [pltpu.VMEM((group, bq, head_dim), jnp.float32),
       pltpu.VMEM((group, bq, LANES), jnp.float32)],
      cfg, "band_attention_bwd_dq_tpu")
  bq_dq = bq

  # dK, dV: grid over key blocks, band axis over the query blocks that reach them.
  bq, bk = layout.rows(blocks.block_q_dkv), layout.rows(blocks.block_k_dkv)
  num_q, num_k = seq // bq, seq // bk
  steps = layout.band_steps(num_k, bk, bq, cfg, num_q, by_query=False)
  q_of = layout.band_block(cfg, bk, bq, num_q, by_query=False)
  if bq != bq_dq:  # delta in the dK/dV kernel's blocks
    delta = rows_order(delta_rows[:, :, 0, :], layout, bq_dq, to_rows=False)
    delta_rows = rows_of(delta, bq)
  k_spec, q_spec, row_spec = layout.tile(bk, _same_block), layout.tile(bq, q_of), layout.row(
      bq, q_of)
  args = [q2, k2, v2, _key_masks(mask_BxN, layout, bk), do2, rows_of(lse_BxHxN, bq), delta_rows]
  dk, dv = _call(
      functools.partial(_dkv_kernel, rows_q=bq, rows_k=bk, num_q_blocks=num_q, num_steps=steps,
                        **common),
      layout, layout.grid(batch, num_k, steps),
      [q_spec, k_spec, k_spec, layout.key_mask(bk, _same_block), q_spec, row_spec, row_spec],
      args, [k_spec, k_spec],
      [out_struct(k2.shape, k.dtype, *args), out_struct(v2.shape, v.dtype, *args)],
      [pltpu.VMEM((group, bk, head_dim), jnp.float32),
       pltpu.VMEM((group, bk, head_dim), jnp.float32)],
      cfg, "band_attention_bwd_dkv_tpu")
  dglob = None
  if has_global:
    kg = glob[0]
    dkg, dvg = (jnp.sum(part, axis=1).reshape(kg.shape).astype(kg.dtype)
                for part in global_parts)
    dglob = (dkg, dvg, None)
  return dq.reshape(q.shape), dk.reshape(q.shape), dv.reshape(q.shape), dglob


# ---------------------------------------------------------------------------------------------
# The global rows (docs/design.md §2.1 step 4): the G global queries of each head against every
# key, on the global projections k_g, v_g as XLA lays [B, N, H, D] out on TPU (N minor: 64
# features would pad to 128 lanes), i.e. the transposed view [B, H, D, N] is a free bitcast and
# a block (D, keys) is lane-dense. XLA's own forms of this pass read and wrote the operands
# several times (10.6 to 14.4 passes over a [B, N, H*D] array in XLA's estimate, forward +
# backward, where reading k_g, v_g twice and writing their gradients once is 6).

def _global_rows_block(num_keys: int) -> int:
  """Keys per block: the largest of 2048 .. 128 that divides N (the lanes of a (D, keys) tile)."""
  return next(b for b in (2048, 1024, 512, 256, 128) if num_keys % b == 0)


def _global_rows_fwd_kernel(q_ref, kt_ref, vt_ref, mask_ref, o_ref, lse_ref, m_ref, l_ref,
                            acc_ref, *, scale, num_steps):
  step = pl.program_id(2)

  @pl.when(step == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  keep_1xK = mask_ref[...] > 0.5
  zero = jnp.zeros((), vt_ref.dtype)
  s_GxK = _f32_dot(q_ref[...], jnp.where(keep_1xK, kt_ref[...], zero), NN_DIMS) * scale
  every_row = pl.ds(0, q_ref.shape[0])
  _softmax_step(m_ref, l_ref, acc_ref, 0, every_row, jnp.where(keep_1xK, s_GxK, -jnp.inf),
                jnp.where(keep_1xK, vt_ref[...], zero), pv_dims=NT_DIMS)

  @pl.when(step == num_steps - 1)
  def _finish():
    l_Gx128 = l_ref[0]
    has_key_Gx128 = l_Gx128 > 0.0
    l_safe_Gx128 = jnp.where(has_key_Gx128, l_Gx128, 1.0)
    o_ref[...] = acc_ref[0] * _widen(1.0 / l_safe_Gx128, acc_ref.shape[-1])
    lse_ref[...] = jnp.where(has_key_Gx128, m_ref[0] + jnp.log(l_safe_Gx128), EMPTY_LSE)


def _global_rows_bwd_kernel(q_ref, do_ref, lse_ref, delta_ref, kt_ref, vt_ref, mask_ref,
                            dkt_ref, dvt_ref, dq_ref, *, scale):
  keep_1xK = mask_ref[...] > 0.5
  zero = jnp.zeros((), kt_ref.dtype)
  kt_DxK = jnp.where(keep_1xK, kt_ref[...], zero)
  vt_DxK = jnp.where(keep_1xK, vt_ref[...], zero)
  q_GxD, do_GxD = q_ref[...], do_ref[...]
  s_GxK = _f32_dot(q_GxD, kt_DxK, NN_DIMS) * scale
  p_GxK = jnp.where(keep_1xK, jnp.exp(s_GxK - _widen(lse_ref[...], s_GxK.shape[1])), 0.0)
  dvt_ref[...] = _f32_dot(do_GxD, p_GxK.astype(do_GxD.dtype), TN_DIMS).astype(dvt_ref.dtype)
  dp_GxK = _f32_dot(do_GxD, vt_DxK, NN_DIMS)
  ds_GxK = (p_GxK * (dp_GxK - _widen(delta_ref[...], s_GxK.shape[1]))).astype(q_GxD.dtype)
  dkt_ref[...] = (_f32_dot(q_GxD, ds_GxK, TN_DIMS) * scale).astype(dkt_ref.dtype)
  dq_ref[...] = _f32_dot(ds_GxK, kt_DxK, NT_DIMS) * scale


def _global_rows_specs(q_rows, kt, block):
  """BlockSpecs of the global-rows kernels, grid (batch, head, key block)."""
  num_global, head_dim = q_rows.shape[2:]
  rows = pl.BlockSpec((None, None, num_global, head_dim), lambda b, h, j: (b, h, 0, 0))
  stats = pl.BlockSpec((None, None, num_global, LANES), lambda b, h, j: (b, h, 0, 0))
  keys = pl.BlockSpec((None, None, head_dim, block), lambda b, h, j: (b, h, 0, j))
  mask = pl.BlockSpec((None, 1, block), lambda b, h, j: (b, 0, j))
  del kt
  return rows, stats, keys, mask


def _global_rows_call(q_BxHxGxD, kt_BxHxDxN, vt_BxHxDxN, mask_Bx1xN, interpret):
  """-> (out [B, H, G, D] float32, lse [B, H, G, 128] float32, lane-replicated)."""
  batch, heads, num_global, head_dim = q_BxHxGxD.shape
  seq = kt_BxHxDxN.shape[-1]
  block = _global_rows_block(seq)
  rows, stats, keys, mask = _global_rows_specs(q_BxHxGxD, kt_BxHxDxN, block)
  args = (q_BxHxGxD, kt_BxHxDxN, vt_BxHxDxN, mask_Bx1xN)
  return pl.pallas_call(
      functools.partial(_global_rows_fwd_kernel, scale=1.0 / math.sqrt(head_dim),
                        num_steps=seq // block),
      grid=(batch, heads, seq // block),
      in_specs=[rows, keys, keys, mask],
      out_specs=[rows, stats],
      out_shape=[out_struct((batch, heads, num_global, head_dim), jnp.float32, *args),
                 out_struct((batch, heads, num_global, LANES), jnp.float32, *args)],
      scratch_shapes=[pltpu.VMEM((1, num_global, LANES), jnp.float32),
                      pltpu.VMEM((1, num_global, LANES), jnp.float32),
                      pltpu.VMEM((1, num_global, head_dim), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret, name="global_rows_fwd_tpu")(*args)


def _transposed(x_BxNxHxD):
  """[B, N, H, D] -> [B, H, D, N]: a bitcast of XLA's TPU layout of [B, N, H, D] (N minor)."""
  return jnp.transpose(x_BxNxHxD, (0, 2, 3, 1))


def global_rows(q_rows_BxGxHxD, k_g_BxNxHxD, v_g_BxNxHxD, key_mask_BxN, interpret=False):
  """The G global queries [B, G, H, D] of each head against every key of k_g, v_g [B, N, H, D]
  (N a multiple of 128), keys outside key_mask [B, N] never read (a select: NaN there reaches
  nothing). Inputs in their dtype, float32 accumulation and softmax; returns [B, G, H, D] in
  q's dtype (rows with no key: 0); gradients of all three, k_g's and v_g's in their dtype."""
  out, _ = global_rows_lse(q_rows_BxGxHxD, k_g_BxNxHxD, v_g_BxNxHxD, key_mask_BxN, interpret)
  return out.astype(q_rows_BxGxHxD.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def global_rows_lse(q_rows_BxGxHxD, k_g_BxNxHxD, v_g_BxNxHxD, key_mask_BxN, interpret=False):
  """`global_rows` with the rows' log-sum-exp: (out [B, G, H, D] float32, lse [B, H, G] float32,
  `EMPTY_LSE` for a row with no key), so that softmaxes over disjoint key sets (the shards of a
  split sequence) can be merged (`sequence_parallel.merge_partial_softmax`). Differentiable in
  both outputs: d lse / d s = p, so the lse cotangent enters the backward as delta - dlse."""
  return _global_rows_fwd(q_rows_BxGxHxD, k_g_BxNxHxD, v_g_BxNxHxD, key_mask_BxN,
                          interpret)[0]


def _global_rows_fwd(q_rows_BxGxHxD, k_g_BxNxHxD, v_g_BxNxHxD, key_mask_BxN, interpret):
  q_BxHxGxD = jnp.swapaxes(q_rows_BxGxHxD.astype(k_g_BxNxHxD.dtype), 1, 2)
  mask_Bx1xN = key_mask_BxN.astype(jnp.float32)[:, None, :]
  kt, vt = _transposed(k_g_BxNxHxD), _transposed(v_g_BxNxHxD)
  out_BxHxGxD, lse_BxHxGx128 = _global_rows_call(q_BxHxGxD, kt, vt, mask_Bx1xN, interpret)
  outputs = (jnp.swapaxes(out_BxHxGxD, 1, 2), lse_BxHxGx128[..., 0])
  residuals = (q_BxHxGxD, kt, vt, mask_Bx1xN, out_BxHxGxD, lse_BxHxGx128,
               jnp.zeros((), q_rows_BxGxHxD.dtype))
  return outputs, residuals


def _global_rows_bwd(interpret, residuals, cotangents):
  q_BxHxGxD, kt, vt, mask_Bx1xN, out_BxHxGxD, lse_BxHxGx128, q_dtype = residuals
  dout_BxGxHxD, dlse_BxHxG = cotangents
  batch, heads, num_global, head_dim = q_BxHxGxD.shape
  seq = kt.shape[-1]
  block = _global_rows_block(seq)
  do_BxHxGxD = jnp.swapaxes(dout_BxGxHxD, 1, 2).astype(jnp.float32)
  # ds = p * (dp - delta) + dlse * p: the lse cotangent is folded into delta (tiny: G rows).
  delta_BxHxGx1 = (jnp.sum(do_BxHxGxD * out_BxHxGxD, axis=-1, keepdims=True)
                   - dlse_BxHxG.astype(jnp.float32)[..., None])
  delta_BxHxGx128 = jnp.broadcast_to(delta_BxHxGx1, lse_BxHxGx128.shape)
  rows, stats, keys, mask = _global_rows_specs(q_BxHxGxD, kt, block)
  parts = pl.BlockSpec((None, None, None, num_global, head_dim), lambda b, h, j: (b, h, j, 0, 0))
  args = (q_BxHxGxD, do_BxHxGxD.astype(kt.dtype), lse_BxHxGx128, delta_BxHxGx128, kt, vt,
          mask_Bx1xN)
  dkt, dvt, dq_parts = pl.pallas_call(
      functools.partial(_global_rows_bwd_kernel, scale=1.0 / math.sqrt(head_dim)),
      grid=(batch, heads, seq // block),
      in_specs=[rows, rows, stats, stats, keys, keys, mask],
      out_specs=[keys, keys, parts],
      out_shape=[out_struct(kt.shape, kt.dtype, *args), out_struct(vt.shape, vt.dtype, *args),
                 out_struct((batch, heads, seq // block, num_global, head_dim), jnp.float32,
                            *args)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3),
      interpret=interpret, name="global_rows_bwd_tpu")(*args)
  untranspose = lambda x: jnp.transpose(x, (0, 3, 1, 2))  # [B, H, D, N] -> [B, N, H, D]
  dq = jnp.swapaxes(jnp.sum(dq_parts, axis=2), 1, 2).astype(q_dtype.dtype)
  return dq, untranspose(dkt), untranspose(dvt), None


global_rows_lse.defvjp(_global_rows_fwd, _global_rows_bwd)
