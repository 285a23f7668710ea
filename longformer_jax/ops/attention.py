"""`longformer_attention`: the public op, one signature for every implementation.

The composition (docs/design.md §2.1-2.2), shared by every band kernel:
  1. dilation: a head with dilation d attends an undilated band on the d interleaved
     subsequences i mod d (paper §3.1), so heads are grouped by dilation and each group runs the
     band kernel on [batch * d, seq / d] - no kernel knows about dilation;
  2. the band kernel runs with global keys removed from its key set and returns its LSE;
  3. a small dense [seq x globals] part attends the global keys (local projections) and is
     merged with the band by log-sum-exp, so each key is counted once;
  4. the global rows are overwritten by a dense [globals x seq] pass with the global projections;
  5. padding queries are zeroed.
The `"reference"` implementation bypasses all of this and computes the masks densely.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from longformer_jax.ops.band_chunked import band_attention_chunked
from longformer_jax.ops.band_reference import masked_softmax_attention
from longformer_jax.ops.reference import dense_attention
from longformer_jax.ops.validation import validate_attention_args

IMPLS = ("reference", "chunked", "pallas")

BandKernel = Callable[..., tuple[jax.Array, jax.Array]]


def _pallas_band_kernel(interpret: bool) -> BandKernel:
  from longformer_jax.ops import band_pallas  # Lazy: Pallas imports are heavy and optional.
  return functools.partial(band_pallas.band_attention_pallas, interpret=interpret)


def _pallas_available(q, window: int) -> bool:
  try:
    from longformer_jax.ops import band_pallas
  except ImportError:
    return False
  return band_pallas.pallas_supported(q.shape, q.dtype, window, jax.default_backend())


def resolve_impl(impl: str, q, window: int) -> str:
  """'auto' -> the fastest implementation that can take these inputs on this backend."""
  if impl not in IMPLS + ("auto",):
    raise ValueError(f"impl={impl!r}; expected one of {IMPLS + ('auto',)}")
  if impl != "auto":
    return impl
  if jax.default_backend() in ("gpu", "tpu") and _pallas_available(q, window):
    return "pallas"
  return "chunked"


def _band_kernel(impl: str) -> BandKernel:
  if impl == "chunked":
    return band_attention_chunked
  # On CPU the Pallas kernel runs in interpret mode (tests, small shapes).
  return _pallas_band_kernel(interpret=jax.default_backend() == "cpu")


# ----------------------------------------------------------------------------------------------
# Composition.


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


def _band_all_heads(band_kernel, q, k, v, key_mask, *, window, dilations, causal):
  """Groups heads by dilation, runs each group, and puts the heads back in order."""
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


def _global_slots(global_mask, num_global: int):
  """Positions of each row's global tokens, [batch, num_global], and which slots are real."""
  # Stable sort puts a row's global positions first, in order; the rest are filler slots.
  idx_BxG = jnp.argsort(~global_mask, axis=1, stable=True)[:, :num_global]
  valid_BxG = jnp.take_along_axis(global_mask, idx_BxG, axis=1)
  # Rows with more globals than slots (only possible under jit with a too-small max_global)
  # are poisoned with NaN below rather than silently losing global tokens.
  overflow_B = jnp.sum(global_mask, axis=1) > num_global
  return idx_BxG, valid_BxG, overflow_B


def _gather_rows(x_BxNxHxD, idx_BxG):
  return jnp.take_along_axis(x_BxNxHxD, idx_BxG[:, :, None, None], axis=1)


def _with_globals(band_out, band_lse, q, k, v, global_qkv, attention_mask, global_mask,
                  num_global):
  """Steps 3-4 of the module docstring."""
  idx_BxG, valid_BxG, overflow_B = _global_slots(global_mask, num_global)
  # 3. Every query over the global keys, local projections: [B, H, N, G].
  k_glob = _gather_rows(k, idx_BxG)
  v_glob = _gather_rows(v, idx_BxG)
  glob_out, glob_lse, _ = masked_softmax_attention(q, k_glob, v_glob, valid_BxG[:, None, None, :])
  lse_BxHxN = jnp.logaddexp(band_lse, glob_lse)
  w_band = jnp.exp(band_lse - lse_BxHxN).transpose(0, 2, 1)[..., None]  # [B, N, H, 1]
  w_glob = jnp.exp(glob_lse - lse_BxHxN).transpose(0, 2, 1)[..., None]
  out = (w_band * band_out.astype(jnp.float32) + w_glob * glob_out.astype(jnp.float32))

  # 4. Global queries over every real key, global projections: [B, H, G, N].
  q_g, k_g, v_g = global_qkv
  gq_out, _, _ = masked_softmax_attention(_gather_rows(q_g, idx_BxG), k_g, v_g,
                                          attention_mask[:, None, None, :])
  seq = q.shape[1]
  scatter_idx = jnp.where(valid_BxG, idx_BxG, seq)  # filler slots point past the end: dropped
  batch_idx = jnp.arange(q.shape[0])[:, None]
  out = out.at[batch_idx, scatter_idx].set(gq_out.astype(jnp.float32), mode="drop")
  return jnp.where(overflow_B[:, None, None, None], jnp.nan, out)


def longformer_attention(q, k, v, *, window: int, dilation=1, causal: bool = False,
                         attention_mask=None, global_mask=None, global_qkv=None,
                         impl: str = "auto", max_global: int | None = None) -> jax.Array:
  """Longformer self-attention (docs/design.md §1): sliding window + dilation + symmetric global.

  Args:
    q, k, v: [batch, seq, heads, head_dim], any float dtype (softmax runs in float32).
    window: ONE-SIDED window: a query sees `window` band positions on each side and itself
      (HF's `attention_window` is the total, twice this).
    dilation: an int, or a tuple with one int per head.
    causal: query i sees keys i - d*t for t in 0..window. Incompatible with global tokens.
    attention_mask: [batch, seq], 1 for real tokens, 0 for padding. Padding queries output 0.
    global_mask: [batch, seq], 1 for global tokens (any number per row).
    global_qkv: (q_g, k_g, v_g), shaped like q, from the global projections; required when any
      token is global.
    impl: "reference" (dense, tests only), "chunked" (blocked einsums), "pallas" (kernel;
      interpret mode on CPU) or "auto" (pallas on GPU/TPU where it can take the shapes, else
      chunked).
    max_global: static upper bound on global tokens per row. Needed only when global_mask is a
      traced value (inside jit or vmap); otherwise the exact count is read from the mask. A row
      with more global tokens than this outputs NaN instead of silently dropping them.

  Returns:
    [batch, seq, heads, head_dim] in the dtype of q.
  """
  dilations, attention_mask, global_mask, global_qkv, num_global = validate_attention_args(
      q, k, v, window=window, dilation=dilation, causal=causal, attention_mask=attention_mask,
      global_mask=global_mask, global_qkv=global_qkv, max_global=max_global)
  impl = resolve_impl(impl, q, window)
  if impl == "reference":
    return dense_attention(q, k, v, window=window, dilations=dilations, causal=causal,
                           attention_mask=attention_mask, global_mask=global_mask,
                           global_qkv=global_qkv)

  band_kernel = _band_kernel(impl)
  key_mask = attention_mask if global_mask is None else attention_mask & ~global_mask
  out, lse = _band_all_heads(band_kernel, q, k, v, key_mask, window=window,
                             dilations=dilations, causal=causal)
  if global_mask is not None:
    out = _with_globals(out, lse, q, k, v, global_qkv, attention_mask, global_mask, num_global)
  out = jnp.where(attention_mask[:, :, None, None], out, 0)
  return out.astype(q.dtype)
