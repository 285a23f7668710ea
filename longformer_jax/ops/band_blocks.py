"""Block arithmetic of the Pallas band kernels, shared by the Triton (`band_triton.py`) and
Mosaic TPU (`band_mosaic.py`) kernels and their dispatch (`band_pallas.py`); imports no kernel.

What is here: `BlockSizes` (tile sizes per device kind, shrunk to fit a GPU's shared memory), the
support checks (`check_supported`, `check_dilations`, `pallas_supported`) and native head dims, the
band geometry (`k_block_range`, `q_block_range`, `max_band_blocks`, `band_keep`: which key blocks a
query block's band meets and the reverse), `head_runs` (heads grouped by dilation), the TPU lane
grouping (`head_group`, `fit_blocks`), `out_struct` (kernel outputs inside `shard_map`), and
`BandConfig`, the static configuration both kernel families are called with.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

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


def varying_axes(x) -> frozenset:
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
  varying = frozenset().union(*map(varying_axes, inputs))
  if _STRUCT_VARYING_ARG == "manual_axis_type":
    return jax.ShapeDtypeStruct(shape, dtype,
                                manual_axis_type=jax.sharding.ManualAxisType(varying=varying))
  if _STRUCT_VARYING_ARG == "vma":
    return jax.ShapeDtypeStruct(shape, dtype, vma=varying)
  return jax.ShapeDtypeStruct(shape, dtype)


def default_backend() -> str:
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


def reachable_dilations(dilations: tuple[int, ...], seq: int) -> tuple[int, ...]:
  """Each dilation capped at `seq`: with d >= seq a query's band holds only itself (i + d*t lies
  outside [0, seq) for every t != 0), as with d = seq, so the cap changes no key set; it keeps
  what the kernels' layout pads (the sequence to a multiple of block * lcm(dilations)) bounded
  by the sequence rather than by the dilation given."""
  return tuple(min(int(d), max(seq, 1)) for d in dilations)


def check_dilations(dilations: tuple[int, ...], seq: int) -> None:
  """ValueError when the kernels' layout would pad the sequence past block * seq rows: every
  residue's subsequence must be whole blocks, so the sequence is padded to a multiple of
  block * lcm(dilations), which distinct large dilations (capped by `reachable_dilations`) can
  push far beyond the sequence (lcm(4091, 4093) at 4096 tokens: 2^17 times its memory)."""
  lcm = math.lcm(*reachable_dilations(dilations, seq))
  if lcm > max(seq, 1):
    raise ValueError(f"dilation={tuple(dilations)}: the Pallas kernels pad the sequence to a "
                     f"multiple of block x lcm(dilations) = block x {lcm} rows, more than the "
                     f"{seq} tokens; use impl='chunked' for these dilations")


def pallas_supported(q_shape, dtype, window, platform: str, dilation=1) -> bool:
  """Whether `band_attention_pallas` can take these inputs on `platform`.

  platform: 'tpu', 'gpu'/'cuda' (Triton kernel), or 'cpu' (the Triton kernel in interpret mode).
  ROCm is reported unsupported (the kernel is untested there). Use it to fall back, not fail.
  dilation: an int or one int per head (`check_dilations`).
  """
  if platform == "tpu":
    backend = "tpu"
  elif platform in ("gpu", "cuda", "cpu"):
    backend = "triton"
  else:
    return False
  try:
    check_supported(q_shape, dtype, window, backend)
    check_dilations((dilation,) if isinstance(dilation, numbers.Integral) else tuple(dilation),
                    q_shape[1])
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


def tpu_head_order(dilations: tuple[int, ...], group: int):
  """(order, dilations) of the TPU kernels' heads: `order` gives each kernel head as a head of the
  caller's (-1: a zero head), such that every run of heads with one dilation is whole lane
  groups of `group` heads (a block holds `group` heads' rows, so they must share a dilation).

  The caller's order plus trailing zero heads (which take the last run's dilation) when its runs
  allow it: nothing is copied beyond that padding. Otherwise the heads are gathered by dilation
  (in order of first appearance), each dilation's heads padded to whole groups: one copy of
  q, k, v and of the output, for patterns such as dilation (1, 2, 1, 2) with head_dim 64.
  """
  heads = len(dilations)
  pad = -heads % group
  padded = tuple(dilations) + (dilations[-1],) * pad
  if all(h0 % group == 0 and n % group == 0 for _, h0, n in head_runs(padded)):
    return tuple(range(heads)) + (-1,) * pad, padded
  order, kernel_dilations = [], []
  for d in dict.fromkeys(dilations):
    members = [h for h, dh in enumerate(dilations) if dh == d]
    members += [-1] * (-len(members) % group)
    order += members
    kernel_dilations += [d] * len(members)
  return tuple(order), tuple(kernel_dilations)


# ---------------------------------------------------------------------------------------------
# TPU lane grouping: the Mosaic kernels see [B, N, H, D] as [B, N, H*D] with heads in groups
# whose lane dim g*D fills the 128 TPU lanes (band_mosaic.py).

LANES = 128


def head_group(head_dim: int) -> int:
  """Heads per kernel block: enough that the block's lane dim g * head_dim is >= 128 lanes."""
  return max(1, LANES // head_dim)


def fit_blocks(blocks, seq: int):
  """Caps every block size at the padded sequence so short inputs are not padded to 512."""
  cap = max(LANES, 1 << (max(seq, 1) - 1).bit_length())
  return dataclasses.replace(blocks, **{
      f.name: min(getattr(blocks, f.name), cap) for f in dataclasses.fields(blocks)
      if f.name.startswith("block_")})


# ---------------------------------------------------------------------------------------------
# The static configuration of the padded kernel call (custom_vjp in band_pallas.py). Inputs are
# already padded (seq a multiple of every block times every dilation; for tpu, heads a multiple
# of the head group), [B, N, H, D] for both kernel families.

@dataclasses.dataclass(frozen=True)
class BandConfig:
  window: int
  causal: bool
  scale: float
  blocks: BlockSizes
  backend: str
  interpret: Any  # bool, or pltpu.InterpretParams (the TPU interpreter, for either kernel)
  dilations: tuple[int, ...] = ()  # one per head; () = all 1
  num_global: int = 0  # rows of the global key block, 0 = none
  global_keys: int = 0  # how many of them are slots the caller passed (the rest is padding)
