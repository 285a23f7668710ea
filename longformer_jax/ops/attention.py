"""`longformer_attention`: the public op, one signature for every implementation.

The composition (docs/design.md §2.1-2.2), shared by the chunked path and the TPU kernel:
  1. dilation: a head with dilation d attends an undilated band on the d interleaved
     subsequences i mod d (paper §3.1), so heads are grouped by dilation and each group runs the
     band kernel on [batch * d, seq / d] - no kernel knows about dilation;
  2. the band kernel runs with global keys removed from its key set and returns its LSE;
  3. a small dense [seq x globals] part attends the global keys (local projections) and is
     merged with the band by log-sum-exp, so each key is counted once;
  4. the global rows are overwritten by a dense [globals x seq] pass with the global projections;
  5. padding queries are zeroed.
The `"reference"` implementation bypasses all of this and computes the masks densely.
The Triton (GPU) kernels fold steps 1 and 3 in (`_compose_fused`, §2.4): dilation is addressed
in place by their BlockSpecs and the global keys are one more key tile of their online softmax,
so neither copies q/k/v nor merges in float32 outside the kernel.

On a mesh (§2.6) the composition runs per shard inside `shard_map` (`_on_mesh`); with a
sequence axis, `_compose_sequence_shard` adds the halo exchange and the cross-shard global
tokens of `sequence_parallel.py`.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from longformer_jax.ops import sequence_parallel as sp
from longformer_jax.ops.band_chunked import band_attention_chunked
from longformer_jax.ops.band_reference import masked_softmax_attention
from longformer_jax.ops.reference import dense_attention
from longformer_jax.ops.validation import validate_attention_args

IMPLS = ("reference", "chunked", "pallas")

BandKernel = Callable[..., tuple[jax.Array, jax.Array]]


# Platforms with a Pallas band kernel: the TPU (Mosaic) kernel, the GPU (Triton) kernel, and CPU,
# where the Triton kernel runs in interpret mode (tests, small shapes).
KERNEL_PLATFORMS = ("tpu", "gpu", "cuda", "cpu")


def platform_of(mesh: Mesh | None) -> str:
  """The platform the op compiles for: the mesh's devices', else the default backend.

  From the mesh, not `jax.default_backend()`: a program compiled ahead of time for a TPU slice
  from a CPU host (docs/design.md §5.1) must contain the TPU kernel, not the interpret path.
  """
  if mesh is None:
    return jax.default_backend()
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
  the default backend's)."""
  if impl not in IMPLS + ("auto",):
    raise ValueError(f"impl={impl!r}; expected one of {IMPLS + ('auto',)}")
  platform = jax.default_backend() if platform is None else platform
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
  itself (the Triton kernels) rather than having them composed around it."""
  if impl == "chunked":
    return band_attention_chunked, False
  from longformer_jax.ops import band_pallas  # Lazy: Pallas imports are heavy and optional.
  backend = "tpu" if platform == "tpu" else "triton"
  return functools.partial(band_pallas.band_attention_pallas, interpret=platform == "cpu",
                           backend=backend), backend == "triton"


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


def _band_all_heads(band_kernel, q, k, v, key_mask, *, window, dilations, causal, fused=False):
  """Groups heads by dilation, runs each group, and puts the heads back in order (a fused
  kernel addresses the dilated heads in place instead)."""
  if fused:
    return band_kernel(q, k, v, key_mask, window=window, causal=causal, dilation=dilations)
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
  # Rows with more globals than slots (only possible under jit with a too-small max_global)
  # are poisoned with NaN below rather than silently losing global tokens.
  overflow_B = jnp.sum(global_mask, axis=1) > num_global
  return idx_BxG, valid_BxG, overflow_B


def _gather_rows(x_BxNxHxD, idx_BxG):
  return jnp.take_along_axis(x_BxNxHxD, idx_BxG[:, :, None, None], axis=1)


def _merge_band_and_global_keys(band_out, band_lse, q, k_glob, v_glob, valid_BxG):
  """Step 3: every query over the global keys (local projections), merged with the band by LSE.
  Returns float32 [B, N, H, D]."""
  glob_out, glob_lse, _ = masked_softmax_attention(q, k_glob, v_glob, valid_BxG[:, None, None, :])
  lse_BxHxN = jnp.logaddexp(band_lse, glob_lse)
  w_band = jnp.exp(band_lse - lse_BxHxN).transpose(0, 2, 1)[..., None]  # [B, N, H, 1]
  w_glob = jnp.exp(glob_lse - lse_BxHxN).transpose(0, 2, 1)[..., None]
  return w_band * band_out.astype(jnp.float32) + w_glob * glob_out.astype(jnp.float32)


def _scatter_global_rows(out, rows_BxGxHxD, idx_BxG, valid_BxG, overflow_B):
  """Step 4's rows written over the global positions; rows beyond max_global poison with NaN."""
  scatter_idx = jnp.where(valid_BxG, idx_BxG, out.shape[1])  # filler slots point past the end
  batch_idx = jnp.arange(out.shape[0])[:, None]
  out = out.at[batch_idx, scatter_idx].set(rows_BxGxHxD.astype(out.dtype), mode="drop")
  return jnp.where(overflow_B[:, None, None, None], jnp.nan, out)


def _with_globals(band_out, band_lse, q, k, v, global_qkv, attention_mask, global_mask,
                  num_global):
  """Steps 3-4 of the module docstring."""
  idx_BxG, valid_BxG, overflow_B = _global_slots(global_mask, num_global)
  out = _merge_band_and_global_keys(band_out, band_lse, q, _gather_rows(k, idx_BxG),
                                    _gather_rows(v, idx_BxG), valid_BxG)
  return _scatter_global_rows(out, _global_rows(*global_qkv, idx_BxG, attention_mask), idx_BxG,
                              valid_BxG, overflow_B)


def _global_rows(q_g, k_g, v_g, idx_BxG, attention_mask):
  """Step 4: the global queries over every real key, global projections: [B, G, H, D]."""
  out, _, _ = masked_softmax_attention(_gather_rows(q_g, idx_BxG), k_g, v_g,
                                       attention_mask[:, None, None, :])
  return out


def _compose_fused(band_kernel, q, k, v, attention_mask, global_mask, global_qkv, *, window,
                   dilations, causal, num_global):
  """Steps 1-5 with a kernel that takes the dilation and the global keys itself: the only work
  outside it is gathering the G global rows and the [G x N] pass of step 4."""
  if global_mask is None:
    out, _ = band_kernel(q, k, v, attention_mask, window=window, causal=causal,
                         dilation=dilations)
  else:
    idx_BxG, valid_BxG, overflow_B = _global_slots(global_mask, num_global)
    global_kv = (_gather_rows(k, idx_BxG), _gather_rows(v, idx_BxG), valid_BxG)
    out, _ = band_kernel(q, k, v, attention_mask & ~global_mask, window=window, causal=causal,
                         dilation=dilations, global_kv=global_kv)
    out = _scatter_global_rows(out, _global_rows(*global_qkv, idx_BxG, attention_mask), idx_BxG,
                               valid_BxG, overflow_B)
  return jnp.where(attention_mask[:, :, None, None], out, 0)


def _compose(band_kernel, q, k, v, attention_mask, global_mask, global_qkv, *, window,
             dilations, causal, num_global, fused=False):
  """Steps 1-5 of the module docstring on whole sequences (one device, or one batch shard)."""
  if fused:
    return _compose_fused(band_kernel, q, k, v, attention_mask, global_mask, global_qkv,
                          window=window, dilations=dilations, causal=causal,
                          num_global=num_global)
  key_mask = attention_mask if global_mask is None else attention_mask & ~global_mask
  out, lse = _band_all_heads(band_kernel, q, k, v, key_mask, window=window,
                             dilations=dilations, causal=causal)
  if global_mask is not None:
    out = _with_globals(out, lse, q, k, v, global_qkv, attention_mask, global_mask, num_global)
  return jnp.where(attention_mask[:, :, None, None], out, 0)


def _compose_sequence_shard(band_kernel, q, k, v, attention_mask, global_mask, global_qkv, *,
                            window, dilations, causal, num_global, axis_name, num_shards,
                            fused=False):
  """Steps 1-5 on one shard of the sequence (inside shard_map; docs/design.md §2.6).

  The band: keys, values and the key mask are extended by the `window * dilation` rows each side
  that this shard's queries can reach (`halo_exchange`); the band kernel runs on the extended
  rows with zero queries in the halo, whose outputs are dropped (exact: a dropped row gets a
  zero cotangent, so it adds nothing to dK/dV). The band structure is translation invariant, so
  dilation's residue classes need no global offset. Globals: see `_with_globals_sharded`.
  """
  n = q.shape[1]
  # A shard never needs rows from further than the whole rest of the sequence.
  reach = min(window * max(dilations), (num_shards - 1) * n)
  left, right = reach, 0 if causal else reach
  key_mask = attention_mask if global_mask is None else attention_mask & ~global_mask
  extend = functools.partial(sp.halo_exchange, axis_name=axis_name, num_shards=num_shards,
                             left=left, right=right)
  k_ext, v_ext = extend(k), extend(v)
  key_mask_ext = extend(key_mask.astype(jnp.int32)).astype(bool)  # beyond the ends: 0
  q_ext = jnp.pad(q, ((0, 0), (left, right), (0, 0), (0, 0)))
  out, lse = _band_all_heads(band_kernel, q_ext, k_ext, v_ext, key_mask_ext, window=window,
                             dilations=dilations, causal=causal, fused=fused)
  out, lse = out[:, left:left + n], lse[:, :, left:left + n]
  if global_mask is not None:
    out = _with_globals_sharded(out, lse, q, k, v, global_qkv, attention_mask, global_mask,
                                num_global, axis_name)
  return jnp.where(attention_mask[:, :, None, None], out, 0)


def _with_globals_sharded(band_out, band_lse, q, k, v, global_qkv, attention_mask, global_mask,
                          num_global, axis_name):
  """Steps 3-4 with the sequence split over `axis_name`: each shard gathers the keys/values of
  its own global tokens (up to num_global slots), the slots of all shards are all-gathered
  (shards * num_global rows: never the full length), and the global rows are computed as
  partial softmaxes over each shard's keys merged across shards."""
  slots = min(num_global, q.shape[1])
  idx_BxG, valid_BxG, _ = _global_slots(global_mask, slots)
  overflow_B = lax.psum(jnp.sum(global_mask, axis=1), axis_name) > num_global
  gather = functools.partial(sp.all_gather_slots, axis_name=axis_name)
  valid_BxSG = gather(valid_BxG)
  out = _merge_band_and_global_keys(band_out, band_lse, q, gather(_gather_rows(k, idx_BxG)),
                                    gather(_gather_rows(v, idx_BxG)), valid_BxSG)
  q_g, k_g, v_g = global_qkv
  part_out, part_lse, _ = masked_softmax_attention(
      gather(_gather_rows(q_g, idx_BxG)).astype(jnp.float32), k_g, v_g,
      attention_mask[:, None, None, :])
  gq_out = sp.merge_partial_softmax(part_out, part_lse, axis_name=axis_name)
  return _scatter_global_rows(out, gq_out, idx_BxG, valid_BxG, overflow_B)


# ----------------------------------------------------------------------------------------------
# On a mesh.


def _mesh_axes(mesh: Mesh, seq_axis, batch_axes, head_axis, q_shape):
  """Checks the mesh axes against the inputs; returns (batch_axes, num_seq_shards)."""
  names = tuple(mesh.axis_names)
  for arg, axis in (("seq_axis", seq_axis), ("head_axis", head_axis)):
    if axis is not None and axis not in names:
      raise ValueError(f"{arg}={axis!r} is not an axis of the mesh {dict(mesh.shape)}")
  if seq_axis is not None and seq_axis == head_axis:
    raise ValueError(f"seq_axis and head_axis are both {seq_axis!r}")
  if batch_axes is None:  # every other axis splits the batch
    batch_axes = tuple(a for a in names if a not in (seq_axis, head_axis))
  else:
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    for axis in batch_axes:
      if axis not in names or axis in (seq_axis, head_axis):
        raise ValueError(f"batch_axes={batch_axes}: {axis!r} is not a free axis of the mesh "
                         f"{dict(mesh.shape)} (seq_axis={seq_axis!r}, head_axis={head_axis!r})")
  batch, seq, heads, _ = q_shape
  batch_shards = math.prod(mesh.shape[a] for a in batch_axes)
  if batch % batch_shards:
    raise ValueError(f"batch {batch} does not divide over the mesh's batch axes {batch_axes} "
                     f"({batch_shards} shards)")
  if head_axis is not None and heads % mesh.shape[head_axis]:
    raise ValueError(f"{heads} heads do not divide over head_axis={head_axis!r} "
                     f"({mesh.shape[head_axis]} shards)")
  seq_shards = 1 if seq_axis is None else mesh.shape[seq_axis]
  if seq < seq_shards:
    raise ValueError(f"sequence length {seq} is shorter than the {seq_shards} shards of "
                     f"seq_axis={seq_axis!r}: every shard needs at least one token")
  return batch_axes, seq_shards


def _dilations_per_head_shard(dilations, mesh, head_axis):
  """The dilations of one head shard: a shard's dilations are static, so every shard must have
  the same pattern (e.g. (1, 2, 1, 2) over 2 shards is (1, 2) on each)."""
  if head_axis is None:
    return dilations
  shards = mesh.shape[head_axis]
  per_shard = np.asarray(dilations).reshape(shards, -1)
  if not (per_shard == per_shard[0]).all():
    raise ValueError(f"dilation={dilations} differs between the {shards} shards of "
                     f"head_axis={head_axis!r}: each shard must hold the same dilations")
  return tuple(int(d) for d in per_shard[0])


def _on_mesh(compose, mesh, seq_axis, batch_axes, head_axis, seq_shards, q, k, v,
             attention_mask, global_mask, global_qkv):
  """Runs `compose` per shard under `shard_map`: Pallas kernels (Mosaic, Triton) are custom calls
  that XLA cannot partition, so in a sharded program they must see per-device arrays."""
  seq = q.shape[1]
  # A length that does not divide: pad with masked-out tokens (their outputs are sliced off).
  pad = -seq % seq_shards
  if pad:
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    if global_qkv is not None:
      global_qkv = tuple(jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in global_qkv)
    attention_mask = jnp.pad(attention_mask, ((0, 0), (0, pad)))
    if global_mask is not None:
      global_mask = jnp.pad(global_mask, ((0, 0), (0, pad)))
  batch = batch_axes if batch_axes else None
  spec_BxNxHxD = P(batch, seq_axis, head_axis, None)
  spec_BxN = P(batch, seq_axis)
  args = (q, k, v, attention_mask, global_mask, global_qkv)
  specs = (spec_BxNxHxD,) * 3 + (spec_BxN, spec_BxN if global_mask is not None else None,
                                 (spec_BxNxHxD,) * 3 if global_qkv is not None else None)
  # check_vma=False: pallas_call's outputs carry no varying-axes annotation (jax 0.12 asks for
  # one per out_shape, jax 0.11 has none). The collectives used (ppermute, all_gather,
  # psum_scatter) transpose the same either way.
  out = jax.shard_map(compose, mesh=mesh, in_specs=specs, out_specs=spec_BxNxHxD,
                      check_vma=False)(*args)
  return out[:, :seq]


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
    mesh: the device mesh the inputs are laid out on (None: one device, or let XLA partition the
      chunked path). Given a mesh, the band runs per shard inside `shard_map`, and the platform
      (which kernel, interpret mode or not) is the mesh devices', so compiling ahead of time
      for a TPU from a CPU host gets the TPU kernel.
    seq_axis: the mesh axis the sequence is split over (sequence parallelism, §2.6): each shard
      fetches the `window * dilation` neighbouring keys/values its queries see, and the global
      tokens' keys/values; the result equals the unsplit op's. None: sequences are whole on
      every device.
    batch_axes: the mesh axes the batch is split over (default: every axis other than seq_axis
      and head_axis); head_axis: the axis heads are split over (default: none).

  Returns:
    [batch, seq, heads, head_dim] in the dtype of q.
  """
  dilations, attention_mask, global_mask, global_qkv, num_global = validate_attention_args(
      q, k, v, window=window, dilation=dilation, causal=causal, attention_mask=attention_mask,
      global_mask=global_mask, global_qkv=global_qkv, max_global=max_global)
  if mesh is None and (seq_axis, batch_axes, head_axis) != (None, None, None):
    raise ValueError(f"seq_axis={seq_axis!r}, batch_axes={batch_axes!r}, "
                     f"head_axis={head_axis!r} name mesh axes, but mesh=None")
  platform = platform_of(mesh)
  impl = resolve_impl(impl, q, window, platform)
  if impl == "reference":  # dense, for tests: XLA partitions it on a mesh
    return dense_attention(q, k, v, window=window, dilations=dilations, causal=causal,
                           attention_mask=attention_mask, global_mask=global_mask,
                           global_qkv=global_qkv)
  static = dict(window=window, dilations=dilations, causal=causal, num_global=num_global)
  band_kernel, static["fused"] = _band_kernel(impl, platform)
  if mesh is None:
    out = _compose(band_kernel, q, k, v, attention_mask, global_mask, global_qkv, **static)
  else:
    batch_axes, seq_shards = _mesh_axes(mesh, seq_axis, batch_axes, head_axis, q.shape)
    static["dilations"] = _dilations_per_head_shard(dilations, mesh, head_axis)
    if seq_axis is None:
      compose = functools.partial(_compose, band_kernel, **static)
    else:
      compose = functools.partial(_compose_sequence_shard, band_kernel, **static,
                                  axis_name=seq_axis, num_shards=seq_shards)
    out = _on_mesh(compose, mesh, seq_axis, batch_axes, head_axis, seq_shards, q, k, v,
                   attention_mask, global_mask, global_qkv)
  return out.astype(q.dtype)
