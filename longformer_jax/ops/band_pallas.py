"""Pallas band-attention kernel: the band-kernel contract of `band_reference.py`, skipping every
key block outside the band.

Public entry: `band_attention_pallas(q, k, v, key_mask, *, window, causal, dilation=1,
global_kv=None, block_sizes=None, interpret=None, backend=None) -> (out [B,N,H,D], lse [B,H,N]
float32)`, differentiable w.r.t. q, k, v (and the global keys/values) with cotangents for both
outputs (forward and backward are separate Pallas kernels joined
by `jax.custom_vjp`; the backward takes the lse cotangent as ds = P * (dP - (delta - dlse))).

Two kernel families share the wrapper here (padding, block bounds, custom_vjp):

* backend="triton" (GPU, this file): grid (query block, batch, residue, head); each program
  keeps its query tile and loops with `lax.fori_loop` over only the key blocks that intersect the
  band of that query block (bounds computed from `pl.program_id`), then, with global keys, over
  one more tile holding them. q, k, v stay in the caller's [B, N, H, D] layout (Triton addresses
  strided blocks, no transpose); a dilated head's subsequences are strided blocks of the same
  array (docs/design.md §2.1), one launch per run of heads with one dilation. Backward: one kernel
  for dK/dV (grid over key blocks, loop over the query blocks whose band reaches them) and one for
  dQ (grid over query blocks, loop as in the forward); delta = rowsum(out * dout) - dlse is a small
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
import inspect
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
                            limit_bytes: int = GPU_SHARED_MEMORY_BYTES,
                            global_rows: int = 0) -> "BlockSizes":
    """Shrinks stages, then blocks, until every Triton kernel's shared memory fits `limit_bytes`.

    Triton keeps `num_stages` copies of the streamed tiles (two per step: k and v, or q and
    dout) plus the resident tiles in shared memory; the estimate below matches what Triton 3.8
    allocates for these kernels on sm_90 to within ~9 KB (checked by compiling the lowered
    kernels), hence the margin. Without this, head_dim 256 in bf16 needs ~260 KB and fails to
    launch on an H100/H200 (227 KB per block). `global_rows`: the global key tile (keys and
    values) that the forward and dQ kernels load once after their band loop.
    """
    item = jnp.dtype(dtype).itemsize
    blocks = self

    def estimate(b):
      tile = lambda rows: rows * head_dim * item
      glob = 2 * tile(global_rows)
      return max(b.num_stages * 2 * tile(b.block_k) + tile(b.block_q) + glob,          # forward
                 b.num_stages * 2 * tile(b.block_q_dkv) + 2 * tile(b.block_k_dkv),   # dK/dV
                 b.num_stages * 2 * tile(b.block_k_dq) + 2 * tile(b.block_q_dq) + glob)  # dQ

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


def _varying_axes(x) -> frozenset:
  """The manual mesh axes `x` varies over (inside `shard_map`; empty outside)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)  # jax 0.11, 0.12: a ManualAxisType; before: `aval.vma`
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _struct_varying_arg() -> str | None:
  """The `jax.ShapeDtypeStruct` argument that states the varying manual axes of an output:
  `manual_axis_type` (jax 0.11, 0.12) or `vma` (earlier); None when it has neither."""
  params = inspect.signature(jax.ShapeDtypeStruct).parameters
  return next((a for a in ("manual_axis_type", "vma") if a in params), None)


_STRUCT_VARYING_ARG = _struct_varying_arg()


def out_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
  """A kernel output's `jax.ShapeDtypeStruct`, varying over every manual mesh axis that any of
  `inputs` varies over: inside `shard_map(check_vma=True)`, `pallas_call` requires the
  annotation (a kernel is opaque to the check, so its outputs vary as its inputs do)."""
  varying = frozenset().union(*map(_varying_axes, inputs))
  if _STRUCT_VARYING_ARG == "manual_axis_type":
    return jax.ShapeDtypeStruct(shape, dtype,
                                manual_axis_type=jax.sharding.ManualAxisType(varying=varying))
  if _STRUCT_VARYING_ARG == "vma":
    return jax.ShapeDtypeStruct(shape, dtype, vma=varying)
  return jax.ShapeDtypeStruct(shape, dtype)


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


def head_runs(dilations: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
  """(dilation, first head, number of heads) of each run of consecutive heads with one dilation.

  Each run is one launch of each kernel; the launches write disjoint heads of one output buffer
  (aliased), so grouping heads needs no gather or concatenation.
  """
  runs = []
  for h, d in enumerate(dilations):
    if runs and runs[-1][0] == d:
      runs[-1][2] += 1
    else:
      runs.append([d, h, 1])
  return tuple(tuple(r) for r in runs)


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


def _launch_runs(cfg: "_Config", shape, launch):
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


def _triton_forward(q, k, v, mask_BxN, glob, cfg: "_Config"):
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


def _triton_backward(q, k, v, mask_BxN, glob, do, lse_BxHxN, delta_BxHxN, cfg: "_Config"):
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


# ---------------------------------------------------------------------------------------------
# custom_vjp shared by both backends. Inputs are already padded (seq a multiple of every block
# times every dilation; for tpu, heads a multiple of the head group), [B, N, H, D] for both.

@dataclasses.dataclass(frozen=True)
class _Config:
  window: int
  causal: bool
  scale: float
  blocks: BlockSizes
  backend: str
  interpret: Any  # bool, or pltpu.InterpretParams (the TPU interpreter, for either kernel)
  dilations: tuple[int, ...] = ()  # one per head (Triton); () = all 1
  num_global: int = 0  # rows of the global key block (Triton), 0 = none
  global_keys: int = 0  # how many of them are slots the caller passed (the rest is padding)


# Jitted (cfg static) so that eager calls, e.g. interpret mode in tests, compile each kernel
# once per shape instead of re-interpreting it on every call; inlined under an outer jit.
@functools.partial(jax.jit, static_argnums=(5,))
def _forward_impl(q, k, v, mask_BxN, glob, cfg):
  if cfg.backend == "tpu":
    from longformer_jax.ops import band_pallas_tpu
    return band_pallas_tpu.forward(q, k, v, mask_BxN, cfg)
  return _triton_forward(q, k, v, mask_BxN, glob, cfg)


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
  # delta_i = sum_d out_id * dout_id - dlse_i: with it ds = P * (dP - delta) carries both the
  # out and the lse cotangent (d lse_i / d s_ij = P_ij).
  if cfg.backend == "tpu":  # The TPU dQ kernel computes delta itself (see band_pallas_tpu).
    from longformer_jax.ops import band_pallas_tpu
    return (*band_pallas_tpu.backward(q, k, v, mask_BxN, out, dout, lse_BxHxN, dlse_BxHxN, cfg),
            None)
  rowdot = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)
  rowdot = jnp.swapaxes(rowdot, 1, 2)  # [B, N, H] -> [B, H, N]
  delta_BxHxN = rowdot - dlse_BxHxN.astype(jnp.float32)
  return _triton_backward(q, k, v, mask_BxN, glob, dout.astype(q.dtype), lse_BxHxN, delta_BxHxN,
                          cfg)


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
  dilation (Triton backend): an int or one int per head; a head with dilation d attends keys
    i + d*t, |t| <= window (causal: -window <= t <= 0), addressed in place by the kernels.
  global_kv (Triton backend): (k_glob [batch, G, heads, head_dim], v_glob, keep [batch, G]):
    extra keys every query attends besides its band (the global tokens' keys, docs/design.md
    §2.1 step 3), merged in the kernel's online softmax; out and lse then cover both key sets.
    Their positions must be masked out of `key_mask` so that no key counts twice.
  block_sizes: defaults to `BlockSizes.for_device` of the first device (the TPU backend caps
    them to the padded length; see band_pallas_tpu). interpret: None = True on a CPU-only
    process; it may also be a `pltpu.InterpretParams` (the TPU interpreter, which True becomes
    for inputs that vary over manual mesh axes, inside `shard_map(check_vma=True)`).
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
  dilations = _check_dilation(dilation, heads)
  if global_kv is not None:
    _check_global_kv(global_kv, q)
  if backend == "tpu" and (set(dilations) != {1} or global_kv is not None):
    raise ValueError("backend='tpu': the TPU band kernel takes dilation=1 and no global_kv "
                     "(longformer_attention composes them around it)")
  # The global key tile's rows: tl.dot needs >= 16.
  num_global = 0 if global_kv is None else max(16, -(-global_kv[0].shape[1] // 16) * 16)
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  if interpret is True and any(map(_varying_axes, (q, k, v, key_mask, *(global_kv or ())))):
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

  pad_heads = 0
  if backend == "tpu":
    from longformer_jax.ops import band_pallas_tpu
    block_sizes = band_pallas_tpu.fit_blocks(block_sizes, seq)
    # Zero heads, like zero features, attend and output nothing that is kept (sliced off).
    pad_heads = -heads % band_pallas_tpu.head_group(kernel_head_dim(head_dim, backend))
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
    kg, vg = (jnp.pad(x, ((0, 0), (0, pad_g), (0, 0), (0, pad_dim))) for x in (kg, vg))
    glob = (kg, vg, jnp.pad(keep.astype(jnp.int32), ((0, 0), (0, pad_g))))
  cfg = _Config(window=window_eff, causal=bool(causal), scale=1.0 / math.sqrt(head_dim),
                blocks=block_sizes, backend=backend, interpret=interpret,
                dilations=dilations + (1,) * pad_heads, num_global=num_global,
                global_keys=0 if global_kv is None else global_kv[0].shape[1])

  pad = padded - seq
  mask_BxN = jnp.pad(key_mask.astype(jnp.int32), ((0, 0), (0, pad)))  # padded keys masked out
  q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, pad_heads), (0, pad_dim))) for x in (q, k, v))
  out, lse_BxHxN = _band_padded(q, k, v, mask_BxN, glob, cfg)
  return out[:, :seq, :heads, :head_dim], lse_BxHxN[:, :heads, :seq]
