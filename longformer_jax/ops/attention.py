"""`longformer_attention`: the public op, one signature for every implementation.

The composition (docs/design.md §2.1-2.2) of the chunked path:
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
The `"reference"` implementation bypasses all of this and computes the masks densely.
The Pallas kernels (Triton on GPU, Mosaic on TPU) fold steps 1 and 3 in (`_compose_fused`,
§2.4): dilation is addressed in place by their BlockSpecs and the global keys are one more key
tile of their online softmax, so neither copies q/k/v nor merges in float32 outside the kernel.

On a mesh (§2.6) the composition runs per shard inside `shard_map` (`_on_mesh`); with a
sequence axis, `_compose_sequence_shard` adds the halo exchange and the cross-shard global
tokens of `sequence_parallel.py`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from longformer_jax.ops import sequence_parallel as sp
from longformer_jax.ops.band_chunked import band_attention_chunked
from longformer_jax.ops.band_reference import masked_softmax_attention
from longformer_jax.ops.reference import dense_attention
from longformer_jax.ops.validation import validate_attention_args, zero_padding

IMPLS = ("reference", "chunked", "pallas")

BandKernel = Callable[..., tuple[jax.Array, jax.Array]]


# Platforms with a Pallas band kernel: the TPU (Mosaic) kernel, the GPU (Triton) kernel, and CPU,
# where the Triton kernel runs in interpret mode (tests, small shapes).
KERNEL_PLATFORMS = ("tpu", "gpu", "cuda", "cpu")


# Set by `target_platform`: the platform that ops without a mesh trace for (None: the default
# backend's). A context variable, so that it holds in the thread (or task) that traces.
_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "longformer_target_platform", default=None)


@contextlib.contextmanager
def target_platform(platform: str):
  """Within the block, the op traced without a mesh chooses its kernel for `platform` ("cpu",
  "cuda", "rocm", "gpu", "tpu") instead of the default backend: exporting a program for a TPU
  from a CPU host (`jax.export`, platforms=("tpu",)) then contains the Mosaic kernel.

  Only tracing inside the block sees it, and jax's trace caches do not: trace functions made
  for the block (a closure created inside it), not ones already traced outside.
  """
  if not isinstance(platform, str) or not platform:
    raise TypeError(f"platform={platform!r}: expected a platform name such as 'tpu'")
  token = _TARGET_PLATFORM.set(platform.lower())
  try:
    yield
  finally:
    _TARGET_PLATFORM.reset(token)


def platform_of(mesh: Mesh | AbstractMesh | None) -> str:
  """The platform the op compiles for: the mesh's devices' (an abstract mesh's
  `abstract_device`, when it has one), else the one `target_platform` sets, else the default
  backend.

  From the mesh, not `jax.default_backend()`: a program compiled ahead of time for a TPU slice
  from a CPU host (docs/design.md §5.1) must contain the TPU kernel, not the interpret path.
  """
  if isinstance(mesh, AbstractMesh):
    device = getattr(mesh, "abstract_device", None)
    if device is not None and device.platform:
      return device.platform
    mesh = None
  if mesh is None:
    return _TARGET_PLATFORM.get() or jax.default_backend()
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh={mesh!r}: expected a jax.sharding.Mesh")
  return mesh.devices.flat[0].platform


def _pallas_available(q, window: int, platform: str) -> bool:
  try:
    from longformer_jax.ops import band_pallas  # Lazy: Pallas imports are heavy and optional.
  except ImportError:
    return False
  return band_pallas.pallas_supported(q.shape, q.dtype, window, platform)


def resolve_impl(impl: str, q, window: int, platform: str | None = None) -> str:
  """'auto' -> the fastest implementation that can take these inputs on `platform` (default:
  `target_platform`'s, else the default backend's)."""
  if impl not in IMPLS + ("auto",):
    raise ValueError(f"impl={impl!r}; expected one of {IMPLS + ('auto',)}")
  platform = platform_of(None) if platform is None else platform
  if impl == "pallas" and platform not in KERNEL_PLATFORMS:
    raise ValueError(f"impl='pallas': platform {platform!r} has no Pallas band kernel "
                     f"(kernels for {KERNEL_PLATFORMS}); use impl='chunked'")
  if impl != "auto":
    return impl
  if platform in ("gpu", "cuda", "tpu") and _pallas_available(q, window, platform):
    return "pallas"
  return "chunked"


def _band_kernel(impl: str, platform: str) -> tuple[BandKernel, bool]:
  """The band kernel for `impl` on `platform`, and whether it takes dilation and global keys
  itself (the Pallas kernels, Triton and Mosaic) rather than having them composed around it."""
  if impl == "chunked":
    return band_attention_chunked, False
  from longformer_jax.ops import band_pallas  # Lazy: Pallas imports are heavy and optional.
  backend = "tpu" if platform == "tpu" else "triton"
  return functools.partial(band_pallas.band_attention_pallas, interpret=platform == "cpu",
                           backend=backend), True


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


def _band_all_heads(band_kernel, q, k, v, key_mask, *, window, dilations, causal, fused=False,
                    global_kv=None):
  """Groups heads by dilation, runs each group, and puts the heads back in order (a fused
  kernel addresses the dilated heads in place instead, and takes the global keys `global_kv`
  as one more key tile)."""
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


def _global_slots(global_mask, num_global: int):
  """Positions of each row's global tokens, [batch, num_global], and which slots are real (a
  row with more globals than slots loses the rest here: `_finish` poisons it)."""
  # The barrier keeps XLA from constant-folding what follows when the mask is a constant (a
  # fixed layout): it folded the stable argsort this replaced in 3.6 s at 1 x 65536 and 33 s at
  # 8 x 65536 on CPU, and seconds on the H200, at every compile.
  global_mask = lax.optimization_barrier(global_mask)
  # Slot g holds the (g+1)-th global position of the row: the number of positions whose running
  # count of globals is <= g. O(N * num_global), no sort; filler slots point at the last row.
  count_BxN = jnp.cumsum(global_mask, axis=1, dtype=jnp.int32)
  slots_G = jnp.arange(num_global, dtype=jnp.int32)
  idx_BxG = jnp.sum(count_BxN[:, None, :] <= slots_G[None, :, None], axis=2, dtype=jnp.int32)
  idx_BxG = jnp.minimum(idx_BxG, global_mask.shape[1] - 1)
  valid_BxG = slots_G[None, :] < count_BxN[:, -1:]
  return idx_BxG, valid_BxG


def _has_slots(global_mask, num_global: int) -> bool:
  """Whether global attention runs: a global mask and at least one slot (a traced mask with
  max_global=0 has none: `_finish` poisons its rows that hold global tokens)."""
  return global_mask is not None and num_global > 0


def _gather_rows(x_BxNx_, idx_BxG):
  """Rows idx_BxG of x [B, N, ...] -> [B, G, ...]."""
  return jnp.take_along_axis(x_BxNx_, idx_BxG.reshape(idx_BxG.shape + (1,) * (x_BxNx_.ndim - 2)),
                             axis=1)


def _merge_band_and_global_keys(band_out, band_lse, q, k_glob, v_glob, valid_BxG):
  """Step 3: every query over the global keys (local projections), merged with the band by LSE.
  Returns float32 [B, N, H, D]."""
  glob_out, glob_lse, _ = masked_softmax_attention(q, k_glob, v_glob, valid_BxG[:, None, None, :])
  lse_BxHxN = jnp.logaddexp(band_lse, glob_lse)
  w_band = jnp.exp(band_lse - lse_BxHxN).transpose(0, 2, 1)[..., None]  # [B, N, H, 1]
  w_glob = jnp.exp(glob_lse - lse_BxHxN).transpose(0, 2, 1)[..., None]
  return w_band * band_out.astype(jnp.float32) + w_glob * glob_out.astype(jnp.float32)


def _slot_hits(idx_BxG, valid_BxG, seq: int):
  """bool [B, N] per slot: the position each real slot holds (slots hold distinct positions)."""
  positions_1xN = jnp.arange(seq)[None, :]
  return [valid_BxG[:, g:g + 1] & (idx_BxG[:, g:g + 1] == positions_1xN)
          for g in range(idx_BxG.shape[1])]


def _scatter_global_rows(out, rows_BxGx_, idx_BxG, valid_BxG):
  """Step 4's rows written over the global positions of out [B, N, ...]: one select per slot
  rather than a scatter. Elementwise, XLA fuses the selects with those around them (and their
  transposes with the cotangent's), where a scatter and its transpose each copied a full-size
  array."""
  expand = (1,) * (out.ndim - 2)
  rows_BxGx_ = rows_BxGx_.astype(out.dtype)
  for g, hit_BxN in enumerate(_slot_hits(idx_BxG, valid_BxG, out.shape[1])):
    out = jnp.where(hit_BxN.reshape(hit_BxN.shape + expand), rows_BxGx_[:, g:g + 1], out)
  return out


def _finish(out, attention_mask, global_mask, num_global, axis_name=None):
  """Step 5: rows with more global tokens than `num_global` slots (only possible with a traced
  mask and a too-small max_global, 0 included) set to NaN rather than silently losing global
  tokens; padding queries zeroed. `axis_name`: the mesh axis the sequence is split over (the
  rows' counts are summed over it)."""
  if global_mask is not None:
    count_B = jnp.sum(global_mask, axis=1, dtype=jnp.int32)
    if axis_name is not None:
      count_B = lax.psum(count_B, axis_name)
    out = jnp.where((count_B > num_global).reshape((-1,) + (1,) * (out.ndim - 1)), jnp.nan,
                    out)
  return jnp.where(attention_mask.reshape(attention_mask.shape + (1,) * (out.ndim - 2)), out, 0)


def _with_globals(band_out, band_lse, q, k, v, global_qkv, attention_mask, global_mask,
                  num_global):
  """Steps 3-4 of the module docstring."""
  idx_BxG, valid_BxG = _global_slots(global_mask, num_global)
  out = _merge_band_and_global_keys(band_out, band_lse, q, _gather_rows(k, idx_BxG),
                                    _gather_rows(v, idx_BxG), valid_BxG)
  return _scatter_global_rows(out, _global_rows(*global_qkv, idx_BxG, attention_mask), idx_BxG,
                              valid_BxG)


def _global_rows(q_g, k_g, v_g, idx_BxG, attention_mask):
  """Step 4: the global queries over every real key, global projections: [B, G, H, D]."""
  out, _, _ = masked_softmax_attention(_gather_rows(q_g, idx_BxG), k_g, v_g,
                                       attention_mask[:, None, None, :])
  return out


def _block_diagonal(rows_BxGxHxD):
  """[B, G, H, D] -> [B, G*H, H*D]: row (g, h) holds head h's vector in head h's lanes, zeros
  elsewhere, so that one matmul against a [B, N, H*D] array computes every head's products."""
  batch, slots, heads, head_dim = rows_BxGxHxD.shape
  eye_HxH = jnp.eye(heads, dtype=rows_BxGxHxD.dtype)
  rows = rows_BxGxHxD[:, :, :, None, :] * eye_HxH[None, None, :, :, None]
  return rows.reshape(batch, slots * heads, heads * head_dim)


def _diagonal(x_BxKxC, heads: int):
  """The inverse of `_block_diagonal`: [B, G*H, H*D] -> [B, G, H, D], head h's lanes of row
  (g, h)."""
  batch, rows, lanes = x_BxKxC.shape
  x = x_BxKxC.reshape(batch, rows // heads, heads, heads, lanes // heads)
  eye_HxH = jnp.eye(heads, dtype=x.dtype)
  return jnp.sum(x * eye_HxH[None, None, :, :, None], axis=3)


def _dot(spec, a, b, dtype):
  return jnp.einsum(spec, a, b, preferred_element_type=dtype)


@jax.custom_vjp
def _global_rows_dense(q_rows_BxGxHxD, k_g_BxNxC, v_g_BxNxC, key_mask_BxN):
  """Step 4 with k_g, v_g as [B, N, H*D], zeroed at padding (the GPU path's, and TPU lengths
  that `band_mosaic.global_rows` does not take): the G global queries, block-diagonal
  (`_block_diagonal`), against every key in one matmul per product, with no transposed copy on
  a GPU; inputs in their dtype, float32 accumulation and softmax, the gradients of k_g and v_g
  written in their dtype: no float32 copy of a full-size array. Returns [B, G, H, D] in q's
  dtype (rows with no key: 0)."""
  return _global_rows_dense_fwd(q_rows_BxGxHxD, k_g_BxNxC, v_g_BxNxC, key_mask_BxN)[0]


def _global_rows_dense_fwd(q_rows_BxGxHxD, k_g_BxNxC, v_g_BxNxC, key_mask_BxN):
  heads, dtype = q_rows_BxGxHxD.shape[2], k_g_BxNxC.dtype
  scale = 1.0 / math.sqrt(q_rows_BxGxHxD.shape[3])
  q_BxKxC = _block_diagonal(q_rows_BxGxHxD.astype(dtype))
  s_BxKxN = _dot("bkc,bnc->bkn", q_BxKxC, k_g_BxNxC, jnp.float32) * scale
  s_BxKxN = jnp.where(key_mask_BxN[:, None, :], s_BxKxN, -jnp.inf)
  m_BxKx1 = jnp.max(s_BxKxN, axis=-1, keepdims=True)
  m_BxKx1 = jnp.where(m_BxKx1 == -jnp.inf, 0.0, m_BxKx1)  # a row with no key: p = 0
  p_BxKxN = jnp.exp(s_BxKxN - m_BxKx1)
  l_BxKx1 = jnp.sum(p_BxKxN, axis=-1, keepdims=True)
  p_BxKxN = p_BxKxN * jnp.where(l_BxKx1 > 0, 1.0 / jnp.where(l_BxKx1 > 0, l_BxKx1, 1.0), 0.0)
  o_BxKxC = _dot("bkn,bnc->bkc", p_BxKxN.astype(dtype), v_g_BxNxC, jnp.float32)
  out_BxGxHxD = _diagonal(o_BxKxC, heads)
  residuals = (q_BxKxC, k_g_BxNxC, v_g_BxNxC, p_BxKxN, out_BxGxHxD,
               jnp.zeros((), q_rows_BxGxHxD.dtype))
  return out_BxGxHxD.astype(q_rows_BxGxHxD.dtype), residuals


def _global_rows_dense_bwd(residuals, dout_BxGxHxD):
  q_BxKxC, k_g_BxNxC, v_g_BxNxC, p_BxKxN, out_BxGxHxD, q_dtype = residuals
  heads, dtype = dout_BxGxHxD.shape[2], k_g_BxNxC.dtype
  scale = 1.0 / math.sqrt(dout_BxGxHxD.shape[3])
  dout_BxGxHxD = dout_BxGxHxD.astype(jnp.float32)
  dout_BxKxC = _block_diagonal(dout_BxGxHxD).astype(dtype)
  # The [N, H*D] gradients contract over the G*H global rows only: written in the input dtype.
  dv_g = _dot("bkn,bkc->bnc", p_BxKxN.astype(dtype), dout_BxKxC, dtype)
  dp_BxKxN = _dot("bkc,bnc->bkn", dout_BxKxC, v_g_BxNxC, jnp.float32)
  delta_BxK = jnp.sum(dout_BxGxHxD * out_BxGxHxD, axis=-1).reshape(dp_BxKxN.shape[:2])
  ds_BxKxN = (p_BxKxN * (dp_BxKxN - delta_BxK[..., None]) * scale).astype(dtype)
  dk_g = _dot("bkn,bkc->bnc", ds_BxKxN, q_BxKxC, dtype)
  dq_rows = _diagonal(_dot("bkn,bnc->bkc", ds_BxKxN, k_g_BxNxC, jnp.float32), heads)
  return dq_rows.astype(q_dtype.dtype), dk_g, dv_g, None


_global_rows_dense.defvjp(_global_rows_dense_fwd, _global_rows_dense_bwd)


def _select_rows(x_BxNxHxD, idx_BxG):
  """Rows idx_BxG of x [B, N, H, D] as [B, G, H, D]: per slot, a sum over N of x where the
  position is the slot's (exact: one nonzero term; a select, so NaN elsewhere reaches nothing).
  Not a gather: on TPU XLA lays [B, N, H, D] out with N minor, and a gather along N made a
  relaid-out copy of all of x and its transpose a scatter into another; these reductions read x
  where it is, and their transposes are selects that fuse into the gradient's other terms."""
  valid_BxG = jnp.ones(idx_BxG.shape, bool)
  zero = jnp.zeros((), x_BxNxHxD.dtype)
  return jnp.stack([jnp.sum(jnp.where(hit_BxN[:, :, None, None], x_BxNxHxD, zero), axis=1)
                    for hit_BxN in _slot_hits(idx_BxG, valid_BxG, x_BxNxHxD.shape[1])], axis=1)


def _compose_fused(band_kernel, q, k, v, attention_mask, global_mask, global_qkv, *, window,
                   dilations, causal, num_global, rows_kernel=None):
  """Steps 1-4, with global tokens, with a kernel that takes the dilation and the global keys
  itself: the only work outside it is gathering the G global rows, the [G x N] pass of step 4
  (`_global_rows_dense`) and writing its rows over the output.

  q, k, v [B, N, H, D] with their padding zeroed, the global projections as given (read where
  they are used). Returns [B, N, H*D]: the kernel's output is row-major [B, N, H*D], so the
  global rows are written over whole lane-dense rows."""
  batch, seq, heads, head_dim = q.shape
  flat = lambda x: x.reshape(batch, -1, heads * head_dim)
  idx_BxG, valid_BxG = _global_slots(global_mask, num_global)
  global_kv = (_select_rows(k, idx_BxG), _select_rows(v, idx_BxG), valid_BxG)
  out, _ = band_kernel(q, k, v, attention_mask & ~global_mask, window=window, causal=causal,
                       dilation=dilations, global_kv=global_kv)
  q_g, k_g, v_g = global_qkv
  q_rows = _global_query_rows(q_g, idx_BxG, attention_mask)
  if _takes_rows_kernel(rows_kernel, seq):
    global_rows, _ = rows_kernel(q_rows, k_g, v_g, attention_mask)
  else:  # zeroed at padding by a select the matmuls' operands fuse
    keep_BxNx1 = attention_mask[:, :, None]
    zeroed = lambda x: jnp.where(keep_BxNx1, flat(x), jnp.zeros((), x.dtype))
    global_rows = _global_rows_dense(q_rows, zeroed(k_g), zeroed(v_g), attention_mask)
  return _scatter_global_rows(flat(out), flat(global_rows), idx_BxG, valid_BxG)


def _global_query_rows(q_g, idx_BxG, attention_mask):
  """The G global query rows of q_g [B, N, H, D] as [B, G, H, D] in q_g's dtype: selected
  (`_select_rows`) and zeroed here (a padding position may be a filler slot) rather than by a
  select over all of q_g."""
  return jnp.where(_gather_rows(attention_mask, idx_BxG)[:, :, None, None],
                   _select_rows(q_g, idx_BxG), jnp.zeros((), q_g.dtype))


def _takes_rows_kernel(rows_kernel, seq: int) -> bool:
  """Whether step 4 runs in `rows_kernel` (`band_mosaic.global_rows_lse`): its key blocks are
  whole multiples of 128 lanes."""
  return rows_kernel is not None and seq % 128 == 0


def _compose(band_kernel, q, k, v, attention_mask, global_mask, global_qkv, *, window,
             dilations, causal, num_global, fused=False, rows_kernel=None):
  """Steps 0-5 of the module docstring on whole sequences (one device, or one batch shard).
  rows_kernel: step 4 by this kernel where it takes the shape (on TPU
  `band_mosaic.global_rows_lse`: (q_rows, k_g, v_g, key_mask) -> (out float32, lse)), else by
  XLA."""
  if fused and _has_slots(global_mask, num_global):
    # q, k, v zeroed as without global tokens; the global projections are zeroed where they
    # are read (`_compose_fused`, `_global_rows_dense`). From the kernel's output on, [B, N, H*D]
    # (see _compose_fused).
    shape = q.shape
    q, k, v = zero_padding(attention_mask, (q, k, v))
    out = _compose_fused(band_kernel, q, k, v, attention_mask, global_mask, global_qkv,
                         window=window, dilations=dilations, causal=causal,
                         num_global=num_global, rows_kernel=rows_kernel)
    return _finish(out, attention_mask, global_mask, num_global).reshape(shape)
  q, k, v, global_qkv = zero_padding(attention_mask, (q, k, v, global_qkv))
  if fused:
    out, _ = band_kernel(q, k, v, attention_mask, window=window, causal=causal,
                         dilation=dilations)
    return _finish(out, attention_mask, global_mask, num_global)
  globals_ = _has_slots(global_mask, num_global)
  key_mask = attention_mask & ~global_mask if globals_ else attention_mask
  out, lse = _band_all_heads(band_kernel, q, k, v, key_mask, window=window,
                             dilations=dilations, causal=causal)
  if globals_:
    out = _with_globals(out, lse, q, k, v, global_qkv, attention_mask, global_mask, num_global)
  return _finish(out, attention_mask, global_mask, num_global)


def _compose_sequence_shard(band_kernel, q, k, v, attention_mask, global_mask, global_qkv, *,
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
  if fused and _has_slots(global_mask, num_global):
    # Steps 0-5 there: q, k, v zeroed as without global tokens, the global projections where
    # they are read.
    return _compose_sequence_shard_fused(
        band_kernel, q, k, v, attention_mask, global_mask, global_qkv, window=window,
        dilations=dilations, causal=causal, num_global=num_global, axis_name=axis_name,
        num_shards=num_shards, rows_kernel=rows_kernel).reshape(q.shape)
  # Zeroed before the halo exchange: a shard's halo holds its neighbours' zeroed rows.
  q, k, v, global_qkv = zero_padding(attention_mask, (q, k, v, global_qkv))
  globals_ = _has_slots(global_mask, num_global)
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
  return _finish(out, attention_mask, global_mask, num_global, axis_name)


def _band_on_extended_shard(band_kernel, q, k, v, key_mask, *, window, dilations, causal,
                            axis_name, num_shards, fused, global_kv=None, query_mask=None):
  """The band of this shard's queries (see `_compose_sequence_shard`) on the extended rows:
  (out [B, left + n + right, H, D], lse [B, H, left + n + right], left); rows left .. left + n
  are this shard's queries, the rest the halo's zero queries. query_mask [B, n]: q as given,
  zeroed where it is False in the pass that pads it (else q comes zeroed at padding)."""
  n = q.shape[1]
  # A shard never needs rows from further than the whole rest of the sequence.
  reach = min(window * max(dilations), (num_shards - 1) * n)
  left, right = reach, 0 if causal else reach
  extend = functools.partial(sp.halo_exchange, axis_name=axis_name, num_shards=num_shards,
                             left=left, right=right)
  k_ext, v_ext = extend(k), extend(v)
  key_mask_ext = extend(key_mask.astype(jnp.int32)).astype(bool)  # beyond the ends: 0
  q_ext = jnp.pad(q, ((0, 0), (left, right), (0, 0), (0, 0)))
  if query_mask is not None:
    keep = jnp.pad(query_mask, ((0, 0), (left, right)))
    q_ext = zero_padding(keep, q_ext)
  out, lse = _band_all_heads(band_kernel, q_ext, k_ext, v_ext, key_mask_ext, window=window,
                             dilations=dilations, causal=causal, fused=fused,
                             global_kv=global_kv)
  return out, lse, left


def _compose_sequence_shard_fused(band_kernel, q, k, v, attention_mask, global_mask,
                                  global_qkv, *, window, dilations, causal, num_global,
                                  axis_name, num_shards, rows_kernel):
  """Steps 0-5 on one shard with a kernel that takes the dilation and the global keys itself
  (the sequence-split `_compose_fused`): each shard selects the keys/values of its own global
  tokens (`_select_rows`: no gather of a full array), the slots of all shards are all-gathered
  (shards * num_global rows) and the kernel takes them as its global key tile, so no float32
  merge of full-size arrays remains. Step 4: the all-gathered global query rows (input dtype)
  attend this shard's keys (`rows_kernel` with its log-sum-exp where it takes the shape, else
  XLA) and the partial softmaxes are merged across shards. Returns [B, n, H*D]."""
  batch, n, heads, head_dim = q.shape
  flat = lambda x: x.reshape(batch, -1, heads * head_dim)
  idx_BxG, valid_BxG = _global_slots(global_mask, min(num_global, n))
  gather = functools.partial(sp.all_gather_slots, axis_name=axis_name)
  # q is zeroed in the pass that pads it with the halo's queries (`query_mask`) rather than
  # here with k and v: zeroed here, XLA kept the zeroed q as one more shard-sized array and moved
  # it in and out of VMEM (compiled for v5e at 65,536 tokens per shard: 3 KB per token more
  # accessed, and at 32,768 4.5 KB per token more temporaries).
  k, v = zero_padding(attention_mask, (k, v))
  global_kv = (gather(_select_rows(k, idx_BxG)), gather(_select_rows(v, idx_BxG)),
               gather(valid_BxG))
  out_ext, _, left = _band_on_extended_shard(
      band_kernel, q, k, v, attention_mask & ~global_mask, window=window, dilations=dilations,
      causal=causal, axis_name=axis_name, num_shards=num_shards, fused=True,
      global_kv=global_kv, query_mask=attention_mask)
  q_g, k_g, v_g = global_qkv
  q_rows_BxSGxHxD = gather(_global_query_rows(q_g, idx_BxG, attention_mask))
  if _takes_rows_kernel(rows_kernel, n):
    part_out, part_lse = rows_kernel(q_rows_BxSGxHxD, k_g, v_g, attention_mask)
  else:  # float32 rows (tiny); k_g, v_g zeroed at padding by a select
    keep_BxNx1x1 = attention_mask[:, :, None, None]
    zeroed = lambda x: jnp.where(keep_BxNx1x1, x, jnp.zeros((), x.dtype))
    part_out, part_lse, _ = masked_softmax_attention(
        q_rows_BxSGxHxD.astype(jnp.float32), zeroed(k_g), zeroed(v_g),
        attention_mask[:, None, None, :])
  rows_BxGxHxD = sp.merge_partial_softmax(part_out, part_lse, axis_name=axis_name)
  # The global rows and step 5 written on the extended rows (the halo's are dropped) and then
  # sliced, not the other way round: the cotangent is then padded before these selects and
  # enters the kernel from their fusion (sliced first, its pad sat between the selects and the
  # kernel and XLA kept one more shard-sized copy of the output's gradient).
  right = out_ext.shape[1] - left - n
  extend = lambda x_BxN: jnp.pad(x_BxN, ((0, 0), (left, right)))  # halo rows: False
  out_ext = _scatter_global_rows(flat(out_ext), flat(rows_BxGxHxD), idx_BxG + left, valid_BxG)
  out_ext = _finish(out_ext, extend(attention_mask), extend(global_mask), num_global,
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
  idx_BxG, valid_BxG = _global_slots(global_mask, slots)
  gather = functools.partial(sp.all_gather_slots, axis_name=axis_name)
  valid_BxSG = gather(valid_BxG)
  out = _merge_band_and_global_keys(band_out, band_lse, q, gather(_gather_rows(k, idx_BxG)),
                                    gather(_gather_rows(v, idx_BxG)), valid_BxSG)
  q_g, k_g, v_g = global_qkv
  part_out, part_lse, _ = masked_softmax_attention(
      gather(_gather_rows(q_g, idx_BxG)).astype(jnp.float32), k_g, v_g,
      attention_mask[:, None, None, :])
  gq_out = sp.merge_partial_softmax(part_out, part_lse, axis_name=axis_name)
  return _scatter_global_rows(out, gq_out, idx_BxG, valid_BxG)


# ----------------------------------------------------------------------------------------------
# On a mesh (docs/design.md §2.6). The op meets a mesh in one of three ways:
#   * `mesh=`: it runs per shard under its own shard_map over every axis of that mesh, the batch
#     split over `batch_axes` (default: every axis but seq_axis and head_axis);
#   * Explicit axes (`jax.make_mesh`'s default; under `jax.set_mesh`, or in the inputs' types):
#     per shard under its own shard_map over those axes, each dimension split as the type of `q`
#     says (or as `batch_axes`/`seq_axis`/`head_axis` say), the output laid out as `q`;
#   * inside a caller's shard_map (Manual axes): the arrays already are shards, the composition
#     runs on them as they are, and `seq_axis` names the caller's axis the sequence is split over.
# Why per shard rather than XLA partitioning the composition: the Pallas kernels are custom calls
# that no partitioner can split, and the chunked path's reshapes merge the batch with sharded
# dimensions, which Explicit types refuse; per shard every array is local, so every impl runs
# the same code on one device, on a mesh and inside a caller's shard_map.


def _axes(entry) -> tuple[str, ...]:
  """A PartitionSpec entry or an axes argument (None, a name, or names) as a tuple of names."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]):
  """Names as a PartitionSpec entry: None, one name, or a tuple of names."""
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _shards(mesh, axes: tuple[str, ...]) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def _context_mesh(q) -> Mesh | AbstractMesh | None:
  """The mesh the caller traces under: `jax.sharding.get_abstract_mesh()` (set by
  `jax.set_mesh`, `jax.sharding.use_abstract_mesh` and inside `shard_map`), else the mesh of
  q's type when it has Explicit axes (arrays laid out on one, used outside `jax.set_mesh`;
  called eagerly, the array's own mesh, whose devices the other inputs are moved to)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    mesh = getattr(getattr(jax.typeof(q), "sharding", None), "mesh", None)
    if not isinstance(mesh, AbstractMesh) or mesh.empty or not mesh.explicit_axes:
      return None
    if isinstance(getattr(q, "sharding", None), NamedSharding):  # a concrete array
      return q.sharding.mesh
  return mesh


def _check_context_axes(ctx, seq_axis, batch_axes, head_axis):
  """With mesh=None, every axis named must be an Explicit or Manual axis of the caller's mesh."""
  usable = () if ctx is None else tuple(ctx.explicit_axes) + tuple(ctx.manual_axes)
  for arg, value in (("seq_axis", seq_axis), ("batch_axes", batch_axes),
                     ("head_axis", head_axis)):
    for axis in _axes(value):
      if axis not in usable:
        where = ("no mesh is set (no jax.set_mesh, not inside shard_map)" if ctx is None else
                 f"{axis!r} is not an Explicit or Manual axis of the current mesh {ctx}")
        raise ValueError(f"{arg}={value!r} names a mesh axis, but mesh=None and {where}")
  if seq_axis is not None and not isinstance(seq_axis, str):
    raise TypeError(f"seq_axis={seq_axis!r}: expected one mesh axis name")


def _check_layout(mesh, q_shape, batch_axes, seq_axis, head_axes, *, local_axes=()):
  """Checks the axes that split the inputs against the mesh and q's shape; returns the number of
  sequence shards. `local_axes`: Manual axes, over which q is already a shard (nothing to
  divide)."""
  names = tuple(mesh.axis_names)
  for arg, axes in (("seq_axis", _axes(seq_axis)), ("head_axis", head_axes)):
    for axis in axes:
      if axis not in names:
        raise ValueError(f"{arg}={_entry(axes)!r} is not an axis of the mesh {dict(mesh.shape)}")
  if set(_axes(seq_axis)) & set(head_axes):
    raise ValueError(f"seq_axis and head_axis are both {seq_axis!r}")
  for axis in batch_axes:
    if axis not in names or axis in _axes(seq_axis) or axis in head_axes:
      raise ValueError(f"batch_axes={batch_axes}: {axis!r} is not a free axis of the mesh "
                       f"{dict(mesh.shape)} (seq_axis={seq_axis!r}, "
                       f"head_axis={_entry(head_axes)!r})")
  batch, seq, heads, _ = q_shape
  global_ = lambda axes: tuple(a for a in axes if a not in local_axes)
  batch_shards = _shards(mesh, global_(batch_axes))
  if batch % batch_shards:
    raise ValueError(f"batch {batch} does not divide over the mesh's batch axes {batch_axes} "
                     f"({batch_shards} shards)")
  head_shards = _shards(mesh, global_(head_axes))
  if heads % head_shards:
    raise ValueError(f"{heads} heads do not divide over head_axis={_entry(head_axes)!r} "
                     f"({head_shards} shards)")
  seq_shards = 1 if seq_axis is None else mesh.shape[seq_axis]
  if seq_axis not in local_axes and seq < seq_shards:
    raise ValueError(f"sequence length {seq} is shorter than the {seq_shards} shards of "
                     f"seq_axis={seq_axis!r}: every shard needs at least one token")
  return seq_shards


def _dilations_per_head_shard(dilations, shards: int, head_axes):
  """The dilations of one head shard: a shard's dilations are static, so every shard must have
  the same pattern (e.g. (1, 2, 1, 2) over 2 shards is (1, 2) on each)."""
  if shards == 1:
    return tuple(dilations)
  per_shard = np.asarray(dilations).reshape(shards, -1)
  if not (per_shard == per_shard[0]).all():
    raise ValueError(f"dilation={tuple(dilations)} differs between the {shards} shards of "
                     f"head_axis={_entry(_axes(head_axes))!r}: each shard must hold the same "
                     "dilations")
  return tuple(int(d) for d in per_shard[0])


def _dilation_of_local_heads(dilation, local_heads: int, ctx, head_axis):
  """Inside a caller's shard_map that splits heads over `head_axis` (Manual), `dilation` may be
  given per local head, or per head of the whole model as with `mesh=` (then every shard must
  hold the same pattern, and that pattern is returned)."""
  shards = _shards(ctx, _axes(head_axis))
  if (isinstance(dilation, (tuple, list)) and shards > 1
      and len(dilation) == local_heads * shards):
    return _dilations_per_head_shard(dilation, shards, head_axis)
  return dilation


def _explicit_layout(q, ctx, batch_axes, seq_axis, head_axis):
  """(batch axes, seq axis, head axes) of the op's shard_map over the Explicit axes of `ctx`:
  for each dimension the Explicit axes named by the argument, else those q's type splits it
  over. A sequence split over an Explicit axis makes it the sequence-parallel axis."""
  explicit = set(ctx.explicit_axes)
  spec = tuple(jax.typeof(q).sharding.spec) + (None,) * q.ndim
  # An axis named for one dimension is taken from the dimension q's type splits over it.
  named = set(_axes(batch_axes)) | set(_axes(seq_axis)) | set(_axes(head_axis))
  pick = lambda arg, dim: tuple(
      a for a in (_axes(spec[dim]) if arg is None else _axes(arg))
      if a in explicit and (arg is not None or a not in named))
  seq = pick(seq_axis, 1)
  if len(seq) > 1:
    raise ValueError(f"q's sequence is split over the mesh axes {seq}; sequence parallelism "
                     "takes one axis: lay the sequence over one axis or pass seq_axis=<axis>")
  return pick(batch_axes, 0), _entry(seq), pick(head_axis, 2)


def _lay_out(x, spec, mesh):
  """`x` laid out as `spec` over the Explicit axes of `mesh` (`jax.sharding.reshard`, a no-op when
  its type already says so): shard_map takes only arrays whose Explicit type matches its
  in_specs. Other axes in `spec` are left to shard_map."""
  explicit = set(mesh.explicit_axes)
  want = tuple(_entry(tuple(a for a in _axes(e) if a in explicit)) for e in spec)
  want += (None,) * (x.ndim - len(want))
  have = getattr(jax.typeof(x), "sharding", None)
  have_spec = () if have is None or have.mesh.empty else tuple(have.spec)
  have_spec = tuple(_entry(_axes(e)) for e in have_spec) + (None,) * (x.ndim - len(have_spec))
  if have_spec == want:
    return x
  return jax.sharding.reshard(x, NamedSharding(mesh, P(*want)))


def _per_shard(band_kernel, static, seq_axis, seq_shards):
  """The composition one shard runs: whole sequences, or one shard of them over `seq_axis`."""
  if seq_axis is None:
    return functools.partial(_compose, band_kernel, **static)
  return functools.partial(_compose_sequence_shard, band_kernel, **static,
                           axis_name=seq_axis, num_shards=seq_shards)


def _on_mesh(compose, mesh, axis_names, batch_axes, seq_axis, head_axes, q, k, v,
             attention_mask, global_mask, global_qkv, *, check_vma=True):
  """Runs `compose` per shard under `shard_map` over `axis_names` of `mesh`, the inputs split
  over `batch_axes`, `seq_axis` (an axis of `axis_names`, or None) and `head_axes`."""
  q_in, seq = q, q.shape[1]
  seq_shards = 1 if seq_axis is None else mesh.shape[seq_axis]
  # A length that does not divide: pad with masked-out tokens (their outputs are sliced off).
  pad = -seq % seq_shards
  if pad:
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    if global_qkv is not None:
      global_qkv = tuple(jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in global_qkv)
    attention_mask = jnp.pad(attention_mask, ((0, 0), (0, pad)))
    if global_mask is not None:
      global_mask = jnp.pad(global_mask, ((0, 0), (0, pad)))
  batch, heads = _entry(batch_axes), _entry(head_axes)
  spec_BxNxHxD = P(batch, seq_axis, heads, None)
  spec_BxN = P(batch, seq_axis)
  explicit = bool(set(mesh.explicit_axes) & set(axis_names))
  if explicit:
    lay = lambda x, spec: None if x is None else _lay_out(x, spec, mesh)
    q, k, v = (lay(x, spec_BxNxHxD) for x in (q, k, v))
    attention_mask, global_mask = lay(attention_mask, spec_BxN), lay(global_mask, spec_BxN)
    if global_qkv is not None:
      global_qkv = tuple(lay(x, spec_BxNxHxD) for x in global_qkv)
  args = (q, k, v, attention_mask, global_mask, global_qkv)
  specs = (spec_BxNxHxD,) * 3 + (spec_BxN, spec_BxN if global_mask is not None else None,
                                 (spec_BxNxHxD,) * 3 if global_qkv is not None else None)
  out = jax.shard_map(compose, mesh=mesh, in_specs=specs, out_specs=spec_BxNxHxD,
                      axis_names=frozenset(axis_names), check_vma=check_vma)(*args)
  if pad:
    if explicit and seq_axis in mesh.explicit_axes:  # an Explicit type refuses a sharded slice
      out = _lay_out(out, P(batch, None, heads, None), mesh)
    out = out[:, :seq]
  q_sharding = getattr(jax.typeof(q_in), "sharding", None)
  if explicit and q_sharding is not None and not q_sharding.mesh.empty:
    out = _lay_out(out, q_sharding.spec, mesh)  # the output is laid out as q
  return out


def _dense_sequence_shard(q, k, v, attention_mask, global_mask, global_qkv, *, seq_axis,
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


def longformer_attention(q, k, v, *, window: int, dilation=1, causal: bool = False,
                         attention_mask=None, global_mask=None, global_qkv=None,
                         impl: str = "auto", max_global: int | None = None,
                         mesh: Mesh | None = None, seq_axis: str | None = None,
                         batch_axes: str | tuple[str, ...] | None = None,
                         head_axis: str | None = None) -> jax.Array:
  """Longformer self-attention (docs/design.md §1): sliding window + dilation + symmetric global.

  Args:
    q, k, v: [batch, seq, heads, head_dim], any float dtype (softmax runs in float32).
    window: ONE-SIDED window: a query sees `window` band positions on each side and itself
      (HF's `attention_window` is the total, twice this).
    dilation: an int, or a tuple with one int per head.
    causal: query i sees keys i - d*t for t in 0..window. Incompatible with global tokens.
    attention_mask: [batch, seq], 1 for real tokens, 0 for padding. Padding queries output 0,
      and whatever q, k, v and global_qkv hold at padding positions (NaN and inf included)
      changes no output and no gradient.
    global_mask: [batch, seq], 1 for global tokens (any number per row).
    global_qkv: (q_g, k_g, v_g), shaped like q, from the global projections; required when any
      token is global.
    impl: "reference" (dense, tests only), "chunked" (blocked einsums), "pallas" (kernel;
      interpret mode on CPU) or "auto" (pallas on GPU/TPU where it can take the shapes, else
      chunked).
    max_global: static upper bound on global tokens per row. Needed only when global_mask is a
      traced value (inside jit, vmap or shard_map); otherwise the exact count is read from the
      mask. A row with more global tokens than this (0 included) outputs NaN at its real
      positions instead of silently dropping them; with a concrete mask a smaller bound than
      the count is a ValueError.
    mesh: the device mesh the inputs are laid out on. Given a mesh, the band runs per shard
      inside the op's own `shard_map` over every axis of it, and the platform (which kernel,
      interpret mode or not) is the mesh devices', so compiling ahead of time for a TPU from a
      CPU host gets the TPU kernel. None: the caller's mesh, if any, decides:
      * Explicit axes (`jax.make_mesh`'s default, under `jax.set_mesh` or in the types of the
        inputs): the op runs per shard inside its own `shard_map` over those axes, each
        dimension split as q's type says (the batch, the heads; a sequence split over one
        axis makes that axis `seq_axis`), and the output is laid out as q;
      * Manual axes (inside the caller's `jax.shard_map`): q, k, v are the caller's shards and
        the op runs on them; `seq_axis` names the caller's axis that splits the sequence;
      * Auto axes, or no mesh: one program that XLA partitions (the Pallas kernels then need
        `mesh=` or Explicit axes on a GPU/TPU: XLA cannot partition a kernel).
      The platform is then `target_platform`'s, else the device of the caller's abstract mesh,
      else the default backend's.
    seq_axis: the mesh axis the sequence is split over (sequence parallelism, §2.6): each shard
      fetches the `window * dilation` neighbouring keys/values its queries see, and the global
      tokens' keys/values; the result equals the unsplit op's. None: sequences are whole on
      every device (under Explicit axes: unless q's type splits them).
    batch_axes: the mesh axes the batch is split over (with `mesh=`, default: every axis other
      than seq_axis and head_axis; under Explicit axes: those of q's type; inside a caller's
      shard_map they are checked and need nothing else). head_axis: the axis heads are split
      over (with `mesh=`, default none). `dilation` is then given for all heads and every head
      shard must hold the same pattern; inside a caller's shard_map that splits the heads,
      `dilation` may also be given per local head.

  Returns:
    [batch, seq, heads, head_dim] in the dtype of q.
  """
  ctx = None  # the caller's mesh, when mesh=None
  if mesh is None:
    ctx = _context_mesh(q)
    _check_context_axes(ctx, seq_axis, batch_axes, head_axis)
    if head_axis is not None and set(_axes(head_axis)) <= set(ctx.manual_axes):
      dilation = _dilation_of_local_heads(dilation, q.shape[2], ctx, head_axis)
  else:
    if not isinstance(mesh, (Mesh, AbstractMesh)):
      raise TypeError(f"mesh={mesh!r}: expected a jax.sharding.Mesh")
    inside = set(jax.sharding.get_abstract_mesh().manual_axes) & set(mesh.axis_names)
    if inside:
      raise ValueError(f"mesh={dict(mesh.shape)} inside a shard_map over its axes "
                       f"{sorted(inside)}: q, k, v already are shards there; pass mesh=None "
                       "and name the caller's axis that splits the sequence as seq_axis")
  dilations, attention_mask, global_mask, global_qkv, num_global = validate_attention_args(
      q, k, v, window=window, dilation=dilation, causal=causal, attention_mask=attention_mask,
      global_mask=global_mask, global_qkv=global_qkv, max_global=max_global)
  if mesh is not None and head_axis is not None and not isinstance(head_axis, str):
    raise TypeError(f"head_axis={head_axis!r}: expected one mesh axis name")
  # `target_platform` (set to export for another platform) outranks the caller's mesh.
  platform = platform_of(mesh if mesh is not None else
                         None if _TARGET_PLATFORM.get() else ctx)
  impl = resolve_impl(impl, q, window, platform)
  manual = () if ctx is None else tuple(ctx.manual_axes)
  if impl == "reference":  # dense, for tests: XLA partitions it on a mesh
    dense = dict(window=window, dilations=dilations, causal=causal, num_global=num_global)
    if seq_axis is not None and seq_axis in manual:
      return _dense_sequence_shard(q, k, v, attention_mask, global_mask, global_qkv,
                                   seq_axis=seq_axis, **dense).astype(q.dtype)
    return dense_attention(q, k, v, attention_mask=attention_mask, global_mask=global_mask,
                           global_qkv=global_qkv, **dense)
  static = dict(window=window, dilations=dilations, causal=causal, num_global=num_global)
  band_kernel, static["fused"] = _band_kernel(impl, platform)
  if impl == "pallas" and platform == "tpu":
    from longformer_jax.ops import band_mosaic  # Lazy: only the TPU path needs Mosaic.
    static["rows_kernel"] = band_mosaic.global_rows_lse
  args = (q, k, v, attention_mask, global_mask, global_qkv)
  # The op's own shard_map checks varying manual axes (the kernels state them for their outputs,
  # `band_blocks.out_struct`), except around kernels in interpret mode: jax's Pallas HLO
  # interpreter cannot evaluate a kernel on values of varying type (jax 0.11, 0.12), and the TPU
  # interpreter, which can, synchronises all devices in host callbacks, which deadlocked XLA's
  # CPU collectives at 8 devices. Without the check the HLO interpreter runs the kernel.
  check_vma = not (impl == "pallas" and platform == "cpu")
  if mesh is not None:
    if batch_axes is None:  # every other axis splits the batch
      batch_axes = tuple(a for a in mesh.axis_names if a not in (seq_axis, head_axis))
    batch_axes, head_axes = _axes(batch_axes), _axes(head_axis)
    seq_shards = _check_layout(mesh, q.shape, batch_axes, seq_axis, head_axes)
    static["dilations"] = _dilations_per_head_shard(dilations, _shards(mesh, head_axes),
                                                    head_axes)
    out = _on_mesh(_per_shard(band_kernel, static, seq_axis, seq_shards), mesh,
                   tuple(mesh.axis_names), batch_axes, seq_axis, head_axes, *args,
                   check_vma=check_vma)
  elif ctx is None or not ctx.explicit_axes:
    # One device, a program XLA partitions (Auto axes), or a shard inside a caller's shard_map.
    if ctx is not None:
      _check_layout(ctx, q.shape, _axes(batch_axes), seq_axis, _axes(head_axis),
                    local_axes=manual)
    seq_shards = 1 if seq_axis is None else ctx.shape[seq_axis]
    out = _per_shard(band_kernel, static, seq_axis, seq_shards)(*args)
  else:
    batch_axes, explicit_seq, head_axes = _explicit_layout(q, ctx, batch_axes, seq_axis,
                                                           head_axis)
    seq_axis = explicit_seq if seq_axis is None else seq_axis  # may be a Manual axis
    local = tuple(a for a in _axes(head_axis) if a in manual)  # heads the caller split
    seq_shards = _check_layout(ctx, q.shape, batch_axes, seq_axis, head_axes + local,
                               local_axes=manual)
    static["dilations"] = _dilations_per_head_shard(dilations, _shards(ctx, head_axes),
                                                    head_axes)
    out = _on_mesh(_per_shard(band_kernel, static, seq_axis, seq_shards), ctx,
                   tuple(ctx.explicit_axes), batch_axes, explicit_seq, head_axes, *args,
                   check_vma=check_vma)
  return out.astype(q.dtype)
