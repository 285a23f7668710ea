"""Sequence-parallel band attention (docs/design.md §2.6): the composition of one shard of the
sequence (`compose_sequence_shard`, the sequence-split `compose.compose`) and its collectives.

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

import functools
import math

import jax.numpy as jnp
from jax import lax

from longformer_jax.ops.band_reference import masked_softmax_attention
from longformer_jax.ops.compose import band_all_heads
from longformer_jax.ops.global_tokens import (finish, gather_rows, global_query_rows,
                                              global_slots, has_slots,
                                              merge_band_and_global_keys, scatter_global_rows,
                                              select_rows, takes_rows_kernel)
from longformer_jax.ops.reference import dense_attention
from longformer_jax.ops.validation import zero_padding


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


def compose_sequence_shard(band_kernel, q, k, v, attention_mask, global_mask, global_qkv, *,
                            window, dilations, causal, num_global, axis_name, num_shards,
                            fused=False, rows_kernel=None):
  """Steps 0-5 on one shard of the sequence (inside shard_map; docs/design.md §2.6).

  The band: keys, values and the key mask are extended by the `window * dilation` rows each side
  that this shard's queries can reach (`halo_exchange`); the band kernel runs on the extended
  rows with zero queries in the halo, whose outputs are dropped (exact: a dropped row gets a
  zero cotangent, so it adds nothing to dK/dV). The band structure is translation invariant, so
  dilation's residue classes need no global offset. Globals: with a fused kernel
  `_compose_sequence_shard_fused`, else `_with_globals_sharded`.
  """
  if fused and has_slots(global_mask, num_global):
    # Steps 0-5 there: q, k, v zeroed as without global tokens, the global projections where
    # they are read.
    return _compose_sequence_shard_fused(
        band_kernel, q, k, v, attention_mask, global_mask, global_qkv, window=window,
        dilations=dilations, causal=causal, num_global=num_global, axis_name=axis_name,
        num_shards=num_shards, rows_kernel=rows_kernel).reshape(q.shape)
  # Zeroed before the halo exchange: a shard's halo holds its neighbours' zeroed rows.
  q, k, v, global_qkv = zero_padding(attention_mask, (q, k, v, global_qkv))
  globals_ = has_slots(global_mask, num_global)
  key_mask = attention_mask & ~global_mask if globals_ else attention_mask
  out, lse, left = _band_on_extended_shard(band_kernel, q, k, v, key_mask, window=window,
                                           dilations=dilations, causal=causal,
                                           axis_name=axis_name, num_shards=num_shards,
                                           fused=fused)
  n = q.shape[1]
  out, lse = out[:, left:left + n], lse[:, :, left:left + n]
  if globals_:
    out = _with_globals_sharded(out, lse, q, k, v, global_qkv, attention_mask, global_mask,
                                num_global, axis_name)
  return finish(out, attention_mask, global_mask, num_global, axis_name)


def _band_on_extended_shard(band_kernel, q, k, v, key_mask, *, window, dilations, causal,
                            axis_name, num_shards, fused, global_kv=None, query_mask=None):
  """The band of this shard's queries (see `compose_sequence_shard`) on the extended rows:
  (out [B, left + n + right, H, D], lse [B, H, left + n + right], left); rows left .. left + n
  are this shard's queries, the rest the halo's zero queries. query_mask [B, n]: q as given,
  zeroed where it is False in the pass that pads it (else q comes zeroed at padding)."""
  n = q.shape[1]
  # A shard never needs rows from further than the whole rest of the sequence.
  reach = min(window * max(dilations), (num_shards - 1) * n)
  left, right = reach, 0 if causal else reach
  extend = functools.partial(halo_exchange, axis_name=axis_name, num_shards=num_shards,
                             left=left, right=right)
  k_ext, v_ext = extend(k), extend(v)
  key_mask_ext = extend(key_mask.astype(jnp.int32)).astype(bool)  # beyond the ends: 0
  q_ext = jnp.pad(q, ((0, 0), (left, right), (0, 0), (0, 0)))
  if query_mask is not None:
    keep = jnp.pad(query_mask, ((0, 0), (left, right)))
    q_ext = zero_padding(keep, q_ext)
  out, lse = band_all_heads(band_kernel, q_ext, k_ext, v_ext, key_mask_ext, window=window,
                             dilations=dilations, causal=causal, fused=fused,
                             global_kv=global_kv)
  return out, lse, left


def _compose_sequence_shard_fused(band_kernel, q, k, v, attention_mask, global_mask,
                                  global_qkv, *, window, dilations, causal, num_global,
                                  axis_name, num_shards, rows_kernel):
  """Steps 0-5 on one shard with a kernel that takes the dilation and the global keys itself
  (the sequence-split `compose._compose_fused`): each shard selects the keys/values of its own
  global tokens (`select_rows`: no gather of a full array), the slots of all shards are all-gathered
  (shards * num_global rows) and the kernel takes them as its global key tile, so no float32
  merge of full-size arrays remains. Step 4: the all-gathered global query rows (input dtype)
  attend this shard's keys (`rows_kernel` with its log-sum-exp where it takes the shape, else
  XLA) and the partial softmaxes are merged across shards. Returns [B, n, H*D]."""
  batch, n, heads, head_dim = q.shape
  flat = lambda x: x.reshape(batch, -1, heads * head_dim)
  idx_BxG, valid_BxG = global_slots(global_mask, min(num_global, n))
  gather = functools.partial(all_gather_slots, axis_name=axis_name)
  # q is zeroed in the pass that pads it with the halo's queries (`query_mask`) rather than
  # here with k and v: zeroed here, XLA kept the zeroed q as one more shard-sized array and moved
  # it in and out of VMEM (compiled for v5e at 65,536 tokens per shard: 3 KB per token more
  # accessed, and at 32,768 4.5 KB per token more temporaries).
  k, v = zero_padding(attention_mask, (k, v))
  global_kv = (gather(select_rows(k, idx_BxG)), gather(select_rows(v, idx_BxG)),
               gather(valid_BxG))
  out_ext, _, left = _band_on_extended_shard(
      band_kernel, q, k, v, attention_mask & ~global_mask, window=window, dilations=dilations,
      causal=causal, axis_name=axis_name, num_shards=num_shards, fused=True,
      global_kv=global_kv, query_mask=attention_mask)
  q_g, k_g, v_g = global_qkv
  q_rows_BxSGxHxD = gather(global_query_rows(q_g, idx_BxG, attention_mask))
  if takes_rows_kernel(rows_kernel, n):
    part_out, part_lse = rows_kernel(q_rows_BxSGxHxD, k_g, v_g, attention_mask)
  else:  # float32 rows (tiny); k_g, v_g zeroed at padding by a select
    keep_BxNx1x1 = attention_mask[:, :, None, None]
    zeroed = lambda x: jnp.where(keep_BxNx1x1, x, jnp.zeros((), x.dtype))
    part_out, part_lse, _ = masked_softmax_attention(
        q_rows_BxSGxHxD.astype(jnp.float32), zeroed(k_g), zeroed(v_g),
        attention_mask[:, None, None, :])
  rows_BxGxHxD = merge_partial_softmax(part_out, part_lse, axis_name=axis_name)
  # The global rows and step 5 written on the extended rows (the halo's are dropped) and then
  # sliced, not the other way round: the cotangent is then padded before these selects and
  # enters the kernel from their fusion (sliced first, its pad sat between the selects and the
  # kernel and XLA kept one more shard-sized copy of the output's gradient).
  right = out_ext.shape[1] - left - n
  extend = lambda x_BxN: jnp.pad(x_BxN, ((0, 0), (left, right)))  # halo rows: False
  out_ext = scatter_global_rows(flat(out_ext), flat(rows_BxGxHxD), idx_BxG + left, valid_BxG)
  out_ext = finish(out_ext, extend(attention_mask), extend(global_mask), num_global,
                    axis_name)
  return out_ext[:, left:left + n]


def _with_globals_sharded(band_out, band_lse, q, k, v, global_qkv, attention_mask, global_mask,
                          num_global, axis_name):
  """Steps 3-4 with the sequence split over `axis_name` and a band kernel that takes no global
  keys: each shard gathers the keys/values of its own global tokens (up to num_global slots),
  the slots of all shards are all-gathered (shards * num_global rows: never the full length),
  merged with the band by LSE, and the global rows are computed as partial softmaxes over each
  shard's keys merged across shards."""
  slots = min(num_global, q.shape[1])
  idx_BxG, valid_BxG = global_slots(global_mask, slots)
  gather = functools.partial(all_gather_slots, axis_name=axis_name)
  valid_BxSG = gather(valid_BxG)
  out = merge_band_and_global_keys(band_out, band_lse, q, gather(gather_rows(k, idx_BxG)),
                                    gather(gather_rows(v, idx_BxG)), valid_BxSG)
  q_g, k_g, v_g = global_qkv
  part_out, part_lse, _ = masked_softmax_attention(
      gather(gather_rows(q_g, idx_BxG)).astype(jnp.float32), k_g, v_g,
      attention_mask[:, None, None, :])
  gq_out = merge_partial_softmax(part_out, part_lse, axis_name=axis_name)
  return scatter_global_rows(out, gq_out, idx_BxG, valid_BxG)


def dense_sequence_shard(q, k, v, attention_mask, global_mask, global_qkv, *, seq_axis,
                          **dense):
  """The dense reference on this shard of a sequence split over the caller's `seq_axis`: the
  whole sequence is gathered and this shard's rows kept (for tests: O(seq^2))."""
  whole = lambda x: None if x is None else lax.all_gather(x, seq_axis, axis=1, tiled=True)
  out = dense_attention(whole(q), whole(k), whole(v), attention_mask=whole(attention_mask),
                        global_mask=whole(global_mask),
                        global_qkv=None if global_qkv is None else tuple(map(whole, global_qkv)),
                        **dense)
  n = q.shape[1]
  return lax.dynamic_slice_in_dim(out, lax.axis_index(seq_axis) * n, n, axis=1)
