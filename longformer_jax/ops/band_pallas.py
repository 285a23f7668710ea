"""Pallas band attention: the band-kernel contract of `band_reference.py`, skipping every key
block outside the band. This module is the dispatch: argument checks, padding, the custom VJP
and the public `band_attention_pallas`; the kernels and their arithmetic live beside it:

  band_blocks.py  block arithmetic shared by both kernel families (`BlockSizes`, band geometry,
                  head runs, support checks, `BandConfig`); imports no kernel
  band_triton.py  Triton (GPU) kernels, backend="triton": a `fori_loop` over the band's key
                  blocks, dilation and the global key tile inside the kernels
  band_mosaic.py  Mosaic TPU kernels, backend="tpu": the band walked by a clamped grid axis,
                  heads in lane-dense groups (zero-padded to a multiple of
                  `band_blocks.head_group(head_dim)`, exact like the head_dim padding),
                  dilation addressed by the index maps and the global key tile inside

Public entry: `band_attention_pallas(q, k, v, key_mask, *, window, causal, dilation=1,
global_kv=None, block_sizes=None, interpret=None, backend=None) -> (out [B,N,H,D], lse [B,H,N]
float32)`, differentiable w.r.t. q, k, v (and the global keys/values) with cotangents for both
outputs (forward and backward are separate Pallas kernels joined by `jax.custom_vjp`; the
backward takes the lse cotangent as ds = P * (dP - (delta - dlse))).

Numerics: scores and softmax in float32; matmul inputs in the input dtype with float32
accumulation (float32 inputs use IEEE float32 matmuls on GPU, not TF32, so that float32 results
meet the reference at ~1e-5). Masked scores are *replaced* by -inf and the running max is
clamped, so rows with no key give out = 0, lse = EMPTY_LSE and finite (zero) gradients.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from longformer_jax.ops import band_triton
from longformer_jax.ops.band_blocks import (BACKENDS, GPU_HEAD_DIMS, MAX_HEAD_DIM,
                                            SUPPORTED_DTYPES, TPU_HEAD_DIMS, BandConfig,
                                            BlockSizes, check_dilations, check_supported,
                                            default_backend, fit_blocks, head_group,
                                            kernel_head_dim, native_head_dims, pallas_supported,
                                            reachable_dilations, tpu_head_order, varying_axes)

# Re-exported: callers configure and check the kernels through this module.
__all__ = ["BACKENDS", "GPU_HEAD_DIMS", "MAX_HEAD_DIM", "SUPPORTED_DTYPES", "TPU_HEAD_DIMS",
           "BlockSizes", "band_attention_pallas", "check_supported", "kernel_head_dim",
           "native_head_dims", "pallas_supported"]


# Jitted (cfg static) so that eager calls, e.g. interpret mode in tests, compile each kernel
# once per shape instead of re-interpreting it on every call; inlined under an outer jit.
@functools.partial(jax.jit, static_argnums=(5,))
def _forward_impl(q, k, v, mask_BxN, glob, cfg):
  """-> (out, lse [B, H, N])."""
  if cfg.backend == "tpu":
    from longformer_jax.ops import band_mosaic  # Lazy: only backend="tpu" needs Mosaic.
    return band_mosaic.forward(q, k, v, mask_BxN, glob, cfg)
  return band_triton.forward(q, k, v, mask_BxN, glob, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _band_padded(q, k, v, mask_BxN, glob, cfg):
  return _forward_impl(q, k, v, mask_BxN, glob, cfg)


def _band_padded_fwd(q, k, v, mask_BxN, glob, cfg):
  out, lse = _forward_impl(q, k, v, mask_BxN, glob, cfg)
  return (out, lse), (q, k, v, mask_BxN, glob, out, lse)


def _band_padded_bwd(cfg, residuals, cotangents):
  dq, dk, dv, dglob = _backward_impl(*residuals, *cotangents, cfg)
  return dq, dk, dv, None, dglob


@functools.partial(jax.jit, static_argnums=(9,))
def _backward_impl(q, k, v, mask_BxN, glob, out, lse_BxHxN, dout, dlse_BxHxN, cfg):
  # Both backends take delta = rowsum(out * dout) - dlse, so that ds = P * (dP - delta) carries
  # the out and the lse cotangent: the Triton one from an XLA reduction, the TPU dQ kernel
  # computes it itself (see band_mosaic).
  if cfg.backend == "tpu":
    from longformer_jax.ops import band_mosaic  # Lazy: only backend="tpu" needs Mosaic.
    return band_mosaic.backward(q, k, v, mask_BxN, glob, out, dout, lse_BxHxN, dlse_BxHxN, cfg)
  return band_triton.backward(q, k, v, mask_BxN, glob, out, lse_BxHxN, dout, dlse_BxHxN, cfg)


_band_padded.defvjp(_band_padded_fwd, _band_padded_bwd)


def _check_dilation(dilation, heads: int) -> tuple[int, ...]:
  dilations = (dilation,) * heads if isinstance(dilation, numbers.Integral) else tuple(dilation)
  if len(dilations) != heads or any(
      not isinstance(d, numbers.Integral) or isinstance(d, bool) or d < 1 for d in dilations):
    raise ValueError(f"dilation={dilation!r}: expected a positive int or one positive int per "
                     f"head ({heads} heads)")
  return tuple(int(d) for d in dilations)


def _check_global_kv(global_kv, q):
  if not (isinstance(global_kv, tuple) and len(global_kv) == 3):
    raise TypeError(f"global_kv must be a tuple (k_glob, v_glob, keep), got {type(global_kv)}")
  kg, vg, keep = global_kv
  batch, _, heads, head_dim = q.shape
  if kg.shape != vg.shape or kg.ndim != 4 or (kg.shape[0], *kg.shape[2:]) != (
      batch, heads, head_dim):
    raise ValueError(f"global keys/values must be [batch, globals, heads, head_dim] = "
                     f"[{batch}, G, {heads}, {head_dim}], got {kg.shape} and {vg.shape}")
  if keep.shape != kg.shape[:2]:
    raise ValueError(f"global keep vector shape {keep.shape} != (batch, globals) = "
                     f"{kg.shape[:2]}")
  if kg.dtype != q.dtype or vg.dtype != q.dtype:
    raise ValueError(f"global keys/values must have q's dtype {q.dtype}, got {kg.dtype}, "
                     f"{vg.dtype}")


def band_attention_pallas(q, k, v, key_mask, *, window: int, causal: bool, dilation=1,
                          global_kv=None, block_sizes: BlockSizes | None = None, interpret=None,
                          backend: str | None = None):
  """Band attention (contract in `band_reference.py`) with Pallas kernels.

  q, k, v: [batch, seq, heads, head_dim], same dtype (float32, bfloat16, float16).
  key_mask: [batch, seq] bool (or 0/1). window: one-sided, >= 0 (may exceed seq).
  dilation: an int or one int per head; a head with dilation d attends keys i + d*t,
    |t| <= window (causal: -window <= t <= 0), addressed in place by the kernels (TPU: heads
    are gathered by dilation only when a run of them is not whole lane groups,
    `band_blocks.tpu_head_order`).
  global_kv: (k_glob [batch, G, heads, head_dim], v_glob, keep [batch, G]):
    extra keys every query attends besides its band (the global tokens' keys, docs/design.md
    §2.1 step 3), merged in the kernel's online softmax; out and lse then cover both key sets.
    Their positions must be masked out of `key_mask` so that no key counts twice.
  block_sizes: defaults to `BlockSizes.for_device` of the first device (the TPU backend caps
    them to the padded length; see band_blocks.fit_blocks). interpret: None = True on a CPU-only
    process; it may also be a `pltpu.InterpretParams` (the TPU interpreter, which True becomes
    for inputs that vary over manual mesh axes, inside `shard_map(check_vma=True)`).
  backend: 'triton' (GPU) or 'tpu'; None picks by `jax.default_backend()`.
  Returns (out [batch, seq, heads, head_dim] in q.dtype, lse [batch, heads, seq] float32).
  Raises ValueError for inputs the kernels cannot take (see `pallas_supported`).
  """
  backend = backend or default_backend()
  if q.shape != k.shape or q.shape != v.shape:
    raise ValueError(f"q, k, v must have equal shapes, got {q.shape}, {k.shape}, {v.shape}")
  if q.dtype != k.dtype or q.dtype != v.dtype:
    raise ValueError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  batch, seq, heads, head_dim = q.shape
  if key_mask.shape != (batch, seq):
    raise ValueError(f"key_mask shape {key_mask.shape} != (batch, seq) = {(batch, seq)}")
  dilations = _check_dilation(dilation, heads)
  check_dilations(dilations, seq)
  dilations = reachable_dilations(dilations, seq)  # the same key sets (see there)
  if global_kv is not None:
    _check_global_kv(global_kv, q)
  # The global key tile's rows: tl.dot needs >= 16; Mosaic tiles take multiples of 8 sublanes.
  rows = 8 if backend == "tpu" else 16
  num_global = 0 if global_kv is None else max(rows, -(-global_kv[0].shape[1] // rows) * rows)
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  if interpret is True and any(map(varying_axes, (q, k, v, key_mask, *(global_kv or ())))):
    # Inside shard_map(check_vma=True) pallas's HLO interpreter (interpret=True) fails on any
    # kernel that combines a block with a constant (jax 0.11, 0.12: the block carries the
    # varying manual axes, the constant none); the TPU interpreter runs the same kernel through
    # callbacks, where those types do not exist, with results equal to the bit.
    from jax.experimental.pallas import tpu as pltpu
    interpret = pltpu.InterpretParams()
  if block_sizes is None:
    if backend == "tpu":
      kind = "tpu"
    elif interpret:
      kind = "cpu"
    else:
      kind = jax.devices()[0].device_kind
    block_sizes = BlockSizes.for_device(kind)
    if backend == "triton" and not interpret:
      limit = (163 if "a100" in kind.lower() else 227) * 1024
      block_sizes = block_sizes.fit_gpu_shared_memory(kernel_head_dim(head_dim, backend), q.dtype,
                                                      limit, global_rows=num_global)
  check_supported(q.shape, q.dtype, window, backend, block_sizes)

  order, kernel_dilations = tuple(range(heads)), dilations
  if backend == "tpu":
    block_sizes = fit_blocks(block_sizes, seq)
    # Zero heads, like zero features, attend and output nothing that is kept (sliced off).
    order, kernel_dilations = tpu_head_order(dilations,
                                             head_group(kernel_head_dim(head_dim, backend)))
  # Every subsequence (length padded / d) must be a whole number of blocks (powers of two: the
  # max is a common multiple of the block sizes).
  multiple = max(block_sizes.all_sizes()) * math.lcm(*dilations)
  padded = -(-seq // multiple) * multiple
  # The band never reaches further than the padded length, and a clamp keeps int32 bounds safe.
  window_eff = min(int(window), padded)
  pad_dim = kernel_head_dim(head_dim, backend) - head_dim  # zero features: exact (see above)
  glob = None
  if global_kv is not None:
    kg, vg, keep = global_kv
    pad_g = num_global - kg.shape[1]
    kg, vg = (jnp.pad(_heads_in(x, order), ((0, 0), (0, pad_g), (0, 0), (0, pad_dim)))
              for x in (kg, vg))
    glob = (kg, vg, jnp.pad(keep.astype(jnp.int32), ((0, 0), (0, pad_g))))
  cfg = BandConfig(window=window_eff, causal=bool(causal), scale=1.0 / math.sqrt(head_dim),
                   blocks=block_sizes, backend=backend, interpret=interpret,
                   dilations=kernel_dilations, num_global=num_global,
                   global_keys=0 if global_kv is None else global_kv[0].shape[1])

  pad = padded - seq
  mask_BxN = jnp.pad(key_mask.astype(jnp.int32), ((0, 0), (0, pad)))  # padded keys masked out
  q, k, v = (jnp.pad(_heads_in(x, order), ((0, 0), (0, pad), (0, 0), (0, pad_dim)))
             for x in (q, k, v))
  out, lse_BxHxN = _band_padded(q, k, v, mask_BxN, glob, cfg)
  return (_heads_out(out, order, axis=2)[:, :seq, :, :head_dim],
          _heads_out(lse_BxHxN, order, axis=1)[:, :, :seq])


def _in_order(order, heads: int) -> bool:
  return order[:heads] == tuple(range(heads))


def _heads_in(x_BxNxHxD, order):
  """The kernel's heads (`band_blocks.tpu_head_order`): zero heads appended, or (heads of one
  dilation not in whole lane groups) gathered, -1 taking a zero head."""
  heads = x_BxNxHxD.shape[2]
  if _in_order(order, heads):
    return jnp.pad(x_BxNxHxD, ((0, 0), (0, 0), (0, len(order) - heads), (0, 0)))
  x = jnp.pad(x_BxNxHxD, ((0, 0), (0, 0), (0, 1), (0, 0)))
  return jnp.take(x, np.array([h if h >= 0 else heads for h in order]), axis=2)


def _heads_out(x, order, axis: int):
  """The caller's heads of a kernel output (the inverse of `_heads_in`)."""
  heads = sum(h >= 0 for h in order)
  if _in_order(order, heads):
    return lax.slice_in_dim(x, 0, heads, axis=axis)
  return jnp.take(x, np.array([order.index(h) for h in range(heads)]), axis=axis)
