"""Pallas band-attention kernel: the band-kernel contract of `band_reference.py`, skipping every
key block outside the band.

Public entry: `band_attention_pallas(q, k, v, key_mask, *, window, causal, block_sizes=None,
interpret=None, backend=None) -> (out [B,N,H,D], lse [B,H,N] float32)`, differentiable w.r.t.
q, k, v with cotangents for both outputs (forward and backward are separate Pallas kernels joined
by `jax.custom_vjp`; the backward takes the lse cotangent as ds = P * (dP - (delta - dlse))).

Two kernel families share the wrapper here (padding, block bounds, custom_vjp):

* backend="triton" (GPU, this file): grid (query block, batch, head); each program keeps its
  query tile and loops with `lax.fori_loop` over only the key blocks that intersect the band of
  that query block (bounds computed from `pl.program_id`). q, k, v stay in the caller's
  [B, N, H, D] layout (Triton addresses strided blocks, no transpose). Backward: one kernel for
  dK/dV (grid over key blocks, loop over the query blocks whose band reaches them) and one for dQ
  (grid over query blocks, loop as in the forward); delta = rowsum(out * dout) - dlse is a small
  XLA reduction outside the kernels.
* backend="tpu" (`band_pallas_tpu.py`): Mosaic TPU kernels with the band walked by a grid axis
  whose index maps clamp to the band, VMEM scratch accumulators; q, k, v stay [B, N, H, D], seen
  as [B, N, H*D] with heads in lane-dense groups (the heads are zero-padded to a multiple of
  `band_pallas_tpu.head_group(head_dim)`, exact like the head_dim padding).

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
(tests/test_band_pallas.py); nothing here has been run or timed on a GPU yet.

Numerics: scores and softmax in float32; matmul inputs in the input dtype with float32
accumulation (float32 inputs use IEEE float32 matmuls on GPU, not TF32, so that float32 results
meet the reference at ~1e-5). Masked scores are *replaced* by -inf and the running max is
clamped, so rows with no key give out = 0, lse = EMPTY_LSE and finite (zero) gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from longformer_jax.ops.band_reference import EMPTY_LSE

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Head dims the kernels run natively. Triton tiles need power-of-two extents of at least 16
# (tl.dot minimum); Mosaic TPU has head_dim as the lane (minor) dim of q/k/v tiles. Any other
# head_dim up to MAX_HEAD_DIM is zero-padded to the next native one (exact: zero features add
# nothing to q.k and produce zero output columns, which are sliced off), at the cost of the
# padded bytes; larger head dims are refused.
GPU_HEAD_DIMS = (16, 32, 64, 128, 256)
TPU_HEAD_DIMS = (64, 128, 256)
MAX_HEAD_DIM = 256
# Shared memory one Triton program may use on sm_80/sm_90 (A100: 163 KB, H100/H200: 227 KB);
# the H100/H200 figure is the default, `fit_gpu_shared_memory` takes another.
GPU_SHARED_MEMORY_BYTES = 227 * 1024
_SHARED_MEMORY_MARGIN = 12 * 1024
_BLOCK_FIELDS = ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq")
BACKENDS = ("triton", "tpu")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the band kernels (rows of queries x rows of keys per tile).

  block_q/block_k: forward; *_dkv: the dK/dV backward kernel; *_dq: the dQ backward kernel.
  num_warps/num_stages: Triton launch parameters (ignored by the TPU kernel).
  The sequence is padded to a multiple of every block size (they are powers of two).
  """
  block_q: int = 64
  block_k: int = 64
  block_q_dkv: int = 64
  block_k_dkv: int = 64
  block_q_dq: int = 64
  block_k_dq: int = 64
  num_warps: int = 4
  num_stages: int = 2

  @classmethod
  def for_device(cls, kind: str) -> "BlockSizes":
    """Defaults by `jax.Device.device_kind` (e.g. 'NVIDIA H200', 'TPU v5 lite', 'cpu').

    Not yet tuned by measurement (no GPU/TPU at hand when written): GPU values follow the usual
    Triton flash-attention choices for head_dim 64 on Hopper; TPU blocks are large because each
    grid step costs ~0.35 us of fixed overhead; CPU (interpret mode) uses mid-size tiles so that
    the interpreter runs few steps while band skipping is still exercised.
    """
    kind_l = kind.lower()
    if "tpu" in kind_l:
      return cls(block_q=512, block_k=512, block_q_dkv=512, block_k_dkv=512,
                 block_q_dq=512, block_k_dq=512)
    if any(g in kind_l for g in ("h100", "h200", "h800", "gh200", "b200")):
      return cls(block_q=128, block_k=64, block_q_dkv=64, block_k_dkv=64,
                 block_q_dq=64, block_k_dq=64, num_warps=4, num_stages=3)
    if any(g in kind_l for g in ("nvidia", "a100", "l4", "rtx", "tesla", "gpu")):
      return cls(block_q=64, block_k=64, num_warps=4, num_stages=2)
    return cls()

  def fit_gpu_shared_memory(self, head_dim: int, dtype,
                            limit_bytes: int = GPU_SHARED_MEMORY_BYTES) -> "BlockSizes":
    """Shrinks stages, then blocks, until every Triton kernel's shared memory fits `limit_bytes`.

    Triton keeps `num_stages` copies of the streamed tiles (two per step: k and v, or q and
    dout) plus the resident tiles in shared memory; the estimate below matches what Triton 3.8
    allocates for these kernels on sm_90 to within ~9 KB (checked by compiling the lowered
    kernels), hence the margin. Without this, head_dim 256 in bf16 needs ~260 KB and fails to
    launch on an H100/H200 (227 KB per block).
    """
    item = jnp.dtype(dtype).itemsize
    blocks = self

    def estimate(b):
      tile = lambda rows: rows * head_dim * item
      return max(b.num_stages * 2 * tile(b.block_k) + tile(b.block_q),           # forward
                 b.num_stages * 2 * tile(b.block_q_dkv) + 2 * tile(b.block_k_dkv),  # dK/dV
                 b.num_stages * 2 * tile(b.block_k_dq) + 2 * tile(b.block_q_dq))    # dQ

    while estimate(blocks) + _SHARED_MEMORY_MARGIN > limit_bytes:
      if blocks.num_stages > 2:
        blocks = dataclasses.replace(blocks, num_stages=blocks.num_stages - 1)
        continue
      sizes = {f: getattr(blocks, f) for f in _BLOCK_FIELDS}
      name = max(sizes, key=sizes.get)
      if sizes[name] <= 16:
        break  # nothing left to shrink; the launch will report the shortfall
      blocks = dataclasses.replace(blocks, **{name: sizes[name] // 2})
    return blocks

  def all_sizes(self) -> tuple[int, ...]:
    return (self.block_q, self.block_k, self.block_q_dkv, self.block_k_dkv,
            self.block_q_dq, self.block_k_dq)


def _platform_of_backend(backend: str) -> str:
  return "tpu" if backend == "tpu" else "cuda"


def _default_backend() -> str:
  return "tpu" if jax.default_backend() == "tpu" else "triton"


def check_supported(q_shape, dtype, window, backend: str,
                    block_sizes: BlockSizes | None = None) -> None:
  """Raises ValueError naming the offending value when a kernel cannot take these inputs."""
  if backend not in BACKENDS:
    raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
  if len(q_shape) != 4:
    raise ValueError(f"q must be [batch, seq, heads, head_dim], got shape {tuple(q_shape)}")
  head_dim = q_shape[-1]
  dtype = jnp.dtype(dtype)
  if dtype not in SUPPORTED_DTYPES:
    raise ValueError(f"dtype={dtype} not supported by the Pallas band kernel; "
                     f"use one of {[str(d) for d in SUPPORTED_DTYPES]}")
  if not 1 <= head_dim <= MAX_HEAD_DIM:
    raise ValueError(f"head_dim={head_dim} not supported by the Pallas band kernel "
                     f"(1..{MAX_HEAD_DIM}; native {native_head_dims(backend)}, others padded)")
  if backend == "tpu" and dtype == jnp.float16:
    raise ValueError("dtype=float16 not supported by the TPU band kernel (use bfloat16)")
  if not isinstance(window, numbers.Integral) or isinstance(window, bool) or window < 0:
    raise ValueError(f"window={window!r} must be a non-negative int (one-sided)")
  if block_sizes is not None:
    minimum = 128 if backend == "tpu" else 16
    for b in block_sizes.all_sizes():
      if b < minimum or b & (b - 1):
        raise ValueError(f"block size {b} in {block_sizes} must be a power of two >= {minimum} "
                         f"for backend={backend!r}")


def native_head_dims(backend: str) -> tuple[int, ...]:
  return TPU_HEAD_DIMS if backend == "tpu" else GPU_HEAD_DIMS


def kernel_head_dim(head_dim: int, backend: str) -> int:
  """The head_dim the kernel runs at: the smallest native one >= head_dim."""
  return min(d for d in native_head_dims(backend) if d >= head_dim)


def pallas_supported(q_shape, dtype, window, platform: str) -> bool:
  """Whether `band_attention_pallas` can take these inputs on `platform`.

  platform: 'tpu', 'gpu'/'cuda' (Triton kernel), or 'cpu' (the Triton kernel in interpret mode).
  ROCm is reported unsupported (the kernel is untested there). Use it to fall back, not fail.
  """
  if platform == "tpu":
    backend = "tpu"
  elif platform in ("gpu", "cuda", "cpu"):
    backend = "triton"
  else:
    return False
  try:
    check_supported(q_shape, dtype, window, backend)
  except ValueError:
    return False
  return True


# ---------------------------------------------------------------------------------------------
# Band geometry shared by both kernel families. Query i attends key j iff j - i in [-window, hi]
# with hi = window (bidirectional) or 0 (causal). Works on Python ints and traced int32 scalars.

def _upper(window: int, causal: bool) -> int:
  return 0 if causal else window


def _is_static(*xs) -> bool:
  return all(isinstance(x, int) for x in xs)


def _max(a, b):
  return max(a, b) if _is_static(a, b) else jnp.maximum(a, b)


def _min(a, b):
  return min(a, b) if _is_static(a, b) else jnp.minimum(a, b)


def _div(a, b):
  """Floor division of a non-negative a (lax.div: `//` does not lower on program ids)."""
  return a // b if _is_static(a, b) else lax.div(a, b)


def k_block_range(q_block, block_q, block_k, window, causal, num_k_blocks):
  """[lo, hi) of the key blocks that intersect the band of query block `q_block`."""
  first_key = _max(q_block * block_q - window, 0)
  last_key = q_block * block_q + block_q - 1 + _upper(window, causal)
  return _div(first_key, block_k), _min(_div(last_key, block_k) + 1, num_k_blocks)


def q_block_range(k_block, block_q, block_k, window, causal, num_q_blocks):
  """[lo, hi) of the query blocks whose band reaches key block `k_block`."""
  first_query = _max(k_block * block_k - _upper(window, causal), 0)
  last_query = k_block * block_k + block_k - 1 + window
  return _div(first_query, block_q), _min(_div(last_query, block_q) + 1, num_q_blocks)


def max_band_blocks(num_outer, block_outer, block_inner, window, causal, num_inner, by_query):
  """Static max over outer blocks of the number of inner blocks in the band (grid width)."""
  rng = k_block_range if by_query else q_block_range
  widest = 0
  for b in range(num_outer):
    if by_query:
      lo, hi = rng(b, block_outer, block_inner, window, causal, num_inner)
    else:
      lo, hi = rng(b, block_inner, block_outer, window, causal, num_inner)
    widest = max(widest, hi - lo)
  return max(widest, 1)


def band_keep(rows, cols, window, causal):
  """bool [rows, cols]: key col inside the band of query row (both absolute positions)."""
  diff = cols - rows  # j - i
  if causal:
    return (diff <= 0) & (diff >= -window)
  return (diff <= window) & (diff >= -window)


# ---------------------------------------------------------------------------------------------
# Triton (GPU) kernels. Refs are 2-D [rows, head_dim] views of [B, N, H, D] arrays.

def _dot(a, b, precision, trans_a=False, trans_b=False):
  """a @ b (optionally transposed operands) with float32 accumulation."""
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _triton_fwd_kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, lse_ref, *, scale, window, causal,
                       block_q, block_k, num_k_blocks, precision):
  q_block = pl.program_id(0)
  q_tile_QxD = q_ref[...]
  rows_Q = q_block * block_q + jnp.arange(block_q)
  lo, hi = k_block_range(q_block, block_q, block_k, window, causal, num_k_blocks)
  # Scores in base 2 (exp2 is the native GPU instruction); converted back for the lse.
  scale2 = scale * _LOG2E

  def body(k_block, carry):
    acc_QxD, m_Q, l_Q = carry
    start = k_block * block_k
    k_tile_KxD = k_ref[pl.ds(start, block_k), :]
    v_tile_KxD = v_ref[pl.ds(start, block_k), :]
    cols_K = start + jnp.arange(block_k)
    keep_QxK = (band_keep(rows_Q[:, None], cols_K[None, :], window, causal)
                & (mask_ref[pl.ds(start, block_k)] != 0)[None, :])
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

  head_dim = q_tile_QxD.shape[-1]
  init = (jnp.zeros((block_q, head_dim), jnp.float32),
          jnp.full((block_q,), -jnp.inf, jnp.float32),
          jnp.zeros((block_q,), jnp.float32))
  acc_QxD, m_Q, l_Q = lax.fori_loop(lo, hi, body, init)
  has_key_Q = l_Q > 0.0
  l_safe_Q = jnp.where(has_key_Q, l_Q, 1.0)
  o_ref[...] = (acc_QxD / l_safe_Q[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(has_key_Q, (m_Q + jnp.log2(l_safe_Q)) * _LN2, EMPTY_LSE)


def _triton_probs(q_tile_QxD, k_tile_KxD, lse_Q, rows_Q, cols_K, mask_K, scale, window, causal,
                  precision):
  """Recomputed probabilities P [Q, K] of one tile (0 outside the band or on masked keys)."""
  keep_QxK = band_keep(rows_Q[:, None], cols_K[None, :], window, causal) & (mask_K != 0)[None, :]
  s_QxK = _dot(q_tile_QxD, k_tile_KxD, precision, trans_b=True) * (scale * _LOG2E)
  return jnp.where(keep_QxK, jnp.exp2(s_QxK - (lse_Q * _LOG2E)[:, None]), 0.0)


def _triton_dkv_kernel(q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
                       *, scale, window, causal, block_q, block_k, num_q_blocks, precision):
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
    rows_Q = start + jnp.arange(block_q)
    p_QxK = _triton_probs(q_tile_QxD, k_tile_KxD, lse_Q, rows_Q, cols_K, mask_K, scale, window,
                          causal, precision)
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


def _triton_dq_kernel(q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
                      scale, window, causal, block_q, block_k, num_k_blocks, precision):
  q_block = pl.program_id(0)
  q_tile_QxD = q_ref[...]
  do_tile_QxD = do_ref[...]
  lse_Q = lse_ref[...]
  delta_Q = delta_ref[...]
  rows_Q = q_block * block_q + jnp.arange(block_q)
  lo, hi = k_block_range(q_block, block_q, block_k, window, causal, num_k_blocks)

  def body(k_block, dq_QxD):
    start = k_block * block_k
    k_tile_KxD = k_ref[pl.ds(start, block_k), :]
    v_tile_KxD = v_ref[pl.ds(start, block_k), :]
    cols_K = start + jnp.arange(block_k)
    mask_K = mask_ref[pl.ds(start, block_k)]
    p_QxK = _triton_probs(q_tile_QxD, k_tile_KxD, lse_Q, rows_Q, cols_K, mask_K, scale, window,
                          causal, precision)
    dp_QxK = _dot(do_tile_QxD, v_tile_KxD, precision, trans_b=True)
    ds_QxK = p_QxK * (dp_QxK - delta_Q[:, None])
    return dq_QxD + _dot(ds_QxK.astype(k_tile_KxD.dtype), k_tile_KxD, precision)

  dq_QxD = lax.fori_loop(lo, hi, body, jnp.zeros(q_tile_QxD.shape, jnp.float32))
  dq_ref[...] = (dq_QxD * scale).astype(dq_ref.dtype)


def _triton_params(blocks: BlockSizes):
  from jax.experimental.pallas import triton as pl_triton  # pylint: disable=g-import-not-at-top
  return pl_triton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _precision(dtype):
  # IEEE float32 matmuls for float32 inputs (Triton's default would be TF32, ~1e-3 error).
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _triton_forward(q, k, v, mask_BxN, cfg: "_Config"):
  batch, seq, heads, head_dim = q.shape
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  kernel = functools.partial(
      _triton_fwd_kernel, scale=cfg.scale, window=cfg.window, causal=cfg.causal, block_q=bq,
      block_k=bk, num_k_blocks=seq // bk, precision=_precision(q.dtype))
  tile = lambda rows: pl.BlockSpec((None, rows, None, head_dim), lambda i, b, h: (b, i, h, 0))
  whole = pl.BlockSpec((None, seq, None, head_dim), lambda i, b, h: (b, 0, h, 0))
  return pl.pallas_call(
      kernel,
      grid=(seq // bq, batch, heads),
      in_specs=[tile(bq), whole, whole, pl.BlockSpec((None, seq), lambda i, b, h: (b, 0))],
      out_specs=[tile(bq), pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32)],
      compiler_params=None if cfg.interpret else _triton_params(cfg.blocks),
      interpret=cfg.interpret,
      name="band_attention_fwd",
  )(q, k, v, mask_BxN)


def _triton_backward(q, k, v, mask_BxN, do, lse_BxHxN, delta_BxHxN, cfg: "_Config"):
  batch, seq, heads, head_dim = q.shape
  blocks = cfg.blocks
  precision = _precision(q.dtype)
  params = None if cfg.interpret else _triton_params(blocks)
  whole = pl.BlockSpec((None, seq, None, head_dim), lambda i, b, h: (b, 0, h, 0))
  whole_row = pl.BlockSpec((None, None, seq), lambda i, b, h: (b, h, 0))
  mask_spec = pl.BlockSpec((None, seq), lambda i, b, h: (b, 0))
  tile = lambda rows: pl.BlockSpec((None, rows, None, head_dim), lambda i, b, h: (b, i, h, 0))

  bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
  dk, dv = pl.pallas_call(
      functools.partial(_triton_dkv_kernel, scale=cfg.scale, window=cfg.window,
                        causal=cfg.causal, block_q=bq, block_k=bk, num_q_blocks=seq // bq,
                        precision=precision),
      grid=(seq // bk, batch, heads),
      in_specs=[whole, tile(bk), tile(bk), mask_spec, whole, whole_row, whole_row],
      out_specs=[tile(bk), tile(bk)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=params, interpret=cfg.interpret, name="band_attention_bwd_dkv",
  )(q, k, v, mask_BxN, do, lse_BxHxN, delta_BxHxN)

  bq, bk = blocks.block_q_dq, blocks.block_k_dq
  row_tile = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
  dq = pl.pallas_call(
      functools.partial(_triton_dq_kernel, scale=cfg.scale, window=cfg.window, causal=cfg.causal,
                        block_q=bq, block_k=bk, num_k_blocks=seq // bk, precision=precision),
      grid=(seq // bq, batch, heads),
      in_specs=[tile(bq), whole, whole, mask_spec, tile(bq), row_tile, row_tile],
      out_specs=tile(bq),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=params, interpret=cfg.interpret, name="band_attention_bwd_dq",
  )(q, k, v, mask_BxN, do, lse_BxHxN, delta_BxHxN)
  return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# custom_vjp shared by both backends. Inputs are already padded (seq a multiple of every block;
# for tpu, heads a multiple of the head group), [B, N, H, D] for both.

@dataclasses.dataclass(frozen=True)
class _Config:
  window: int
  causal: bool
  scale: float
  blocks: BlockSizes
  backend: str
  interpret: Any  # bool, or pltpu.InterpretParams for the TPU kernel


# Jitted (cfg static) so that eager calls, e.g. interpret mode in tests, compile each kernel
# once per shape instead of re-interpreting it on every call; inlined under an outer jit.
@functools.partial(jax.jit, static_argnums=(4,))
def _forward_impl(q, k, v, mask_BxN, cfg):
  if cfg.backend == "tpu":
    from longformer_jax.ops import band_pallas_tpu  # pylint: disable=g-import-not-at-top
    return band_pallas_tpu.forward(q, k, v, mask_BxN, cfg)
  return _triton_forward(q, k, v, mask_BxN, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _band_padded(q, k, v, mask_BxN, cfg):
  return _forward_impl(q, k, v, mask_BxN, cfg)


def _band_padded_fwd(q, k, v, mask_BxN, cfg):
  out, lse = _forward_impl(q, k, v, mask_BxN, cfg)
  return (out, lse), (q, k, v, mask_BxN, out, lse)


def _band_padded_bwd(cfg, residuals, cotangents):
  return (*_backward_impl(*residuals, *cotangents, cfg), None)


@functools.partial(jax.jit, static_argnums=(8,))
def _backward_impl(q, k, v, mask_BxN, out, lse_BxHxN, dout, dlse_BxHxN, cfg):
  # delta_i = sum_d out_id * dout_id - dlse_i: with it ds = P * (dP - delta) carries both the
  # out and the lse cotangent (d lse_i / d s_ij = P_ij).
  if cfg.backend == "tpu":  # The TPU dQ kernel computes delta itself (see band_pallas_tpu).
    from longformer_jax.ops import band_pallas_tpu  # pylint: disable=g-import-not-at-top
    return band_pallas_tpu.backward(q, k, v, mask_BxN, out, dout, lse_BxHxN, dlse_BxHxN, cfg)
  rowdot = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)
  rowdot = jnp.swapaxes(rowdot, 1, 2)  # [B, N, H] -> [B, H, N]
  delta_BxHxN = rowdot - dlse_BxHxN.astype(jnp.float32)
  return _triton_backward(q, k, v, mask_BxN, dout.astype(q.dtype), lse_BxHxN, delta_BxHxN, cfg)


_band_padded.defvjp(_band_padded_fwd, _band_padded_bwd)


def band_attention_pallas(q, k, v, key_mask, *, window: int, causal: bool,
                          block_sizes: BlockSizes | None = None, interpret=None,
                          backend: str | None = None):
  """Band attention (contract in `band_reference.py`) with Pallas kernels.

  q, k, v: [batch, seq, heads, head_dim], same dtype (float32, bfloat16, float16).
  key_mask: [batch, seq] bool (or 0/1). window: one-sided, >= 0 (may exceed seq).
  block_sizes: defaults to `BlockSizes.for_device` of the first device (the TPU backend caps
    them to the padded length; see band_pallas_tpu). interpret: None = True on a CPU-only
    process; for backend='tpu' it may also be a `pltpu.InterpretParams`.
  backend: 'triton' (GPU) or 'tpu'; None picks by `jax.default_backend()`.
  Returns (out [batch, seq, heads, head_dim] in q.dtype, lse [batch, heads, seq] float32).
  Raises ValueError for inputs the kernels cannot take (see `pallas_supported`).
  """
  backend = backend or _default_backend()
  if q.shape != k.shape or q.shape != v.shape:
    raise ValueError(f"q, k, v must have equal shapes, got {q.shape}, {k.shape}, {v.shape}")
  if q.dtype != k.dtype or q.dtype != v.dtype:
    raise ValueError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  batch, seq, heads, head_dim = q.shape
  if key_mask.shape != (batch, seq):
    raise ValueError(f"key_mask shape {key_mask.shape} != (batch, seq) = {(batch, seq)}")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
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
                                                      limit)
  check_supported(q.shape, q.dtype, window, backend, block_sizes)

  pad_heads = 0
  if backend == "tpu":
    from longformer_jax.ops import band_pallas_tpu  # pylint: disable=g-import-not-at-top
    block_sizes = band_pallas_tpu.fit_blocks(block_sizes, seq)
    # Zero heads, like zero features, attend and output nothing that is kept (sliced off).
    pad_heads = -heads % band_pallas_tpu.head_group(kernel_head_dim(head_dim, backend))
  multiple = max(block_sizes.all_sizes())  # powers of two: the max is a common multiple
  padded = -(-seq // multiple) * multiple
  # The band never reaches further than the padded length, and a clamp keeps int32 bounds safe.
  window_eff = min(int(window), padded)
  cfg = _Config(window=window_eff, causal=bool(causal), scale=1.0 / math.sqrt(head_dim),
                blocks=block_sizes, backend=backend, interpret=interpret)

  pad = padded - seq
  pad_dim = kernel_head_dim(head_dim, backend) - head_dim  # zero features: exact (see above)
  mask_BxN = jnp.pad(key_mask.astype(jnp.int32), ((0, 0), (0, pad)))  # padded keys masked out
  q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, pad_heads), (0, pad_dim))) for x in (q, k, v))
  out, lse_BxHxN = _band_padded(q, k, v, mask_BxN, cfg)
  return out[:, :seq, :heads, :head_dim], lse_BxHxN[:, :heads, :seq]
