"""The composition of the op on whole sequences (docs/design.md §2.1-2.2): one device, or one
shard of the batch or heads.

Around a band kernel (`dispatch.band_kernel_for`):
  0. the padding positions of q, k, v and of the global projections are zeroed by a select, so
     that no value there (NaN and inf included) reaches a real row, forward or backward;
  1. dilation: a head with dilation d attends an undilated band on the d interleaved
     subsequences i mod d (paper §3.1), so heads are grouped by dilation and each group runs the
     band kernel on [batch * d, seq / d] - no kernel knows about dilation;
  2. the band kernel runs with global keys removed from its key set and returns its LSE;
  3. a small dense [seq x globals] part attends the global keys (local projections) and is
     merged with the band by log-sum-exp, so each key is counted once;
  4. the global rows are overwritten by a dense [globals x seq] pass with the global projections;
  5. rows with more global tokens than slots (a traced mask, a too-small max_global) are set to
     NaN, and padding queries are zeroed.
Steps 3-5 are `global_tokens.py`'s. The Pallas kernels (Triton on GPU, Mosaic on TPU) fold
steps 1 and 3 in (`_compose_fused`, §2.4): dilation is addressed in place by their BlockSpecs
and the global keys are one more key tile of their online softmax, so neither copies q/k/v nor
merges in float32 outside the kernel. With the sequence split over a mesh axis the same steps
run per shard in `sequence_parallel.py`.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from longformer_jax.ops.band_blocks import reachable_dilations
from longformer_jax.ops.dispatch import BandKernel
from longformer_jax.ops.global_tokens import (finish, global_query_rows, global_rows_dense,
                                              global_slots, has_slots, scatter_global_rows,
                                              select_rows, takes_rows_kernel, with_globals)
from longformer_jax.ops.validation import zero_padding

def _dilated_band(band_kernel: BandKernel, q, k, v, key_mask, *, window, dilation, causal):
  """Runs the band kernel on heads of one dilation `d` via the interleaved subsequences."""
  if dilation == 1:
    return band_kernel(q, k, v, key_mask, window=window, causal=causal)
  batch, seq, heads, head_dim = q.shape
  sub = math.ceil(seq / dilation)
  pad = sub * dilation - seq

  def split(x):  # [B, N, ...] -> [B * d, N / d, ...]: row r*d + j of the result is i mod d == j.
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(batch, sub, dilation, *x.shape[2:])
    return jnp.swapaxes(x, 1, 2).reshape(batch * dilation, sub, *x.shape[3:])

  out, lse = band_kernel(split(q), split(k), split(v), split(key_mask),
                         window=window, causal=causal)
  out = jnp.swapaxes(out.reshape(batch, dilation, sub, heads, head_dim), 1, 2)
  out = out.reshape(batch, sub * dilation, heads, head_dim)[:, :seq]
  lse = lse.reshape(batch, dilation, heads, sub).transpose(0, 2, 3, 1)
  lse = lse.reshape(batch, heads, sub * dilation)[..., :seq]
  return out, lse


def band_all_heads(band_kernel, q, k, v, key_mask, *, window, dilations, causal, fused=False,
                    global_kv=None):
  """Groups heads by dilation, runs each group, and puts the heads back in order (a fused
  kernel addresses the dilated heads in place instead, and takes the global keys `global_kv`
  as one more key tile)."""
  # A dilation past the rows the band runs on reaches only the query itself, as the length
  # does (`band_blocks.reachable_dilations`): capped so that nothing is padded by its raw value.
  dilations = reachable_dilations(dilations, q.shape[1])
  if fused:
    return band_kernel(q, k, v, key_mask, window=window, causal=causal, dilation=dilations,
                       global_kv=global_kv)
  if global_kv is not None:
    raise ValueError("global_kv needs a fused band kernel")
  groups = sorted(set(dilations))
  if len(groups) == 1:
    return _dilated_band(band_kernel, q, k, v, key_mask, window=window,
                         dilation=groups[0], causal=causal)
  outs, lses, order = [], [], []
  for d in groups:
    heads_d = np.array([h for h, dh in enumerate(dilations) if dh == d])
    o, l = _dilated_band(band_kernel, q[:, :, heads_d], k[:, :, heads_d], v[:, :, heads_d],
                         key_mask, window=window, dilation=d, causal=causal)
    outs.append(o), lses.append(l), order.append(heads_d)
  inverse = np.argsort(np.concatenate(order))
  return (jnp.concatenate(outs, axis=2)[:, :, inverse],
          jnp.concatenate(lses, axis=1)[:, inverse])


def _compose_fused(band_kernel, q, k, v, attention_mask, global_mask, global_qkv, *, window,
                   dilations, causal, num_global, rows_kernel=None):
  """Steps 1-4, with global tokens, with a kernel that takes the dilation and the global keys
  itself: the only work outside it is gathering the G global rows, the [G x N] pass of step 4
  (`global_rows_dense`) and writing its rows over the output.

  q, k, v [B, N, H, D] with their padding zeroed, the global projections as given (read where
  they are used). Returns [B, N, H*D]: the kernel's output is row-major [B, N, H*D], so the
  global rows are written over whole lane-dense rows."""
  batch, seq, heads, head_dim = q.shape
  flat = lambda x: x.reshape(batch, -1, heads * head_dim)
  idx_BxG, valid_BxG = global_slots(global_mask, num_global)
  global_kv = (select_rows(k, idx_BxG), select_rows(v, idx_BxG), valid_BxG)
  out, _ = band_kernel(q, k, v, attention_mask & ~global_mask, window=window, causal=causal,
                       dilation=dilations, global_kv=global_kv)
  q_g, k_g, v_g = global_qkv
  q_rows = global_query_rows(q_g, idx_BxG, attention_mask)
  if takes_rows_kernel(rows_kernel, seq):
    global_rows, _ = rows_kernel(q_rows, k_g, v_g, attention_mask)
  else:  # zeroed at padding by a select the matmuls' operands fuse
    keep_BxNx1 = attention_mask[:, :, None]
    zeroed = lambda x: jnp.where(keep_BxNx1, flat(x), jnp.zeros((), x.dtype))
    global_rows = global_rows_dense(q_rows, zeroed(k_g), zeroed(v_g), attention_mask)
  return scatter_global_rows(flat(out), flat(global_rows), idx_BxG, valid_BxG)


def compose(band_kernel, q, k, v, attention_mask, global_mask, global_qkv, *, window,
             dilations, causal, num_global, fused=False, rows_kernel=None):
  """Steps 0-5 of the module docstring on whole sequences (one device, or one batch shard).
  rows_kernel: step 4 by this kernel where it takes the shape (on TPU
  `band_mosaic.global_rows_lse`: (q_rows, k_g, v_g, key_mask) -> (out float32, lse)), else by
  XLA."""
  if fused and has_slots(global_mask, num_global):
    # q, k, v zeroed as without global tokens; the global projections are zeroed where they
    # are read (`_compose_fused`, `global_rows_dense`). From the kernel's output on, [B, N, H*D]
    # (see _compose_fused).
    shape = q.shape
    q, k, v = zero_padding(attention_mask, (q, k, v))
    out = _compose_fused(band_kernel, q, k, v, attention_mask, global_mask, global_qkv,
                         window=window, dilations=dilations, causal=causal,
                         num_global=num_global, rows_kernel=rows_kernel)
    return finish(out, attention_mask, global_mask, num_global).reshape(shape)
  q, k, v, global_qkv = zero_padding(attention_mask, (q, k, v, global_qkv))
  if fused:
    out, _ = band_kernel(q, k, v, attention_mask, window=window, causal=causal,
                         dilation=dilations)
    return finish(out, attention_mask, global_mask, num_global)
  globals_ = has_slots(global_mask, num_global)
  key_mask = attention_mask & ~global_mask if globals_ else attention_mask
  out, lse = band_all_heads(band_kernel, q, k, v, key_mask, window=window,
                             dilations=dilations, causal=causal)
  if globals_:
    out = with_globals(out, lse, q, k, v, global_qkv, attention_mask, global_mask, num_global)
  return finish(out, attention_mask, global_mask, num_global)
