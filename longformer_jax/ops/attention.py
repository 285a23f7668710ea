"""`longformer_attention`: the public op, one signature for every implementation.

It validates its arguments (`validation.py`) and hands each concern to its module:
  dispatch.py           the implementation ("auto" resolved) and the platform, which band kernel
  compose.py            the composition around the band kernel on whole sequences (§2.1-2.2)
  global_tokens.py      global slots, the log-sum-exp merge, the dense pass of the global rows
  sequence_parallel.py  the composition of one shard of a split sequence and its collectives
  sharded.py            the three ways the op meets a mesh, and its own shard_map (§2.6)
The `"reference"` implementation bypasses all of this and computes the masks densely
(`reference.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from longformer_jax.ops import sharded
from longformer_jax.ops.dispatch import (IMPLS, band_kernel_for, checks_vma, op_platform,
                                         platform_of, resolve_impl, target_platform)
from longformer_jax.ops.reference import dense_attention
from longformer_jax.ops.sequence_parallel import dense_sequence_shard
from longformer_jax.ops.validation import check_arrays, validate_attention_args

__all__ = ["IMPLS", "longformer_attention", "platform_of", "resolve_impl", "target_platform"]


def longformer_attention(q, k, v, *, window: int, dilation=1, causal: bool = False,
                         attention_mask=None, global_mask=None, global_qkv=None,
                         impl: str = "auto", max_global: int | None = None,
                         mesh: Mesh | None = None, seq_axis: str | None = None,
                         batch_axes: str | tuple[str, ...] | None = None,
                         head_axis: str | None = None) -> jax.Array:
  """Longformer self-attention (docs/design.md §1): sliding window + dilation + symmetric global.

  Args:
    q, k, v: [batch, seq, heads, head_dim] arrays of one float dtype, global_qkv's too (softmax
      runs in float32). With no element (a dimension 0) the output is empty (§1.1).
    window: ONE-SIDED window: a query sees `window` band positions on each side and itself
      (HF's `attention_window` is the total, twice this).
    dilation: an int, or a tuple with one int per head (seq or more: the query alone, §1.2).
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
  check_arrays(q=q, k=k, v=v)
  ctx, dilation = sharded.caller_mesh(q, dilation, mesh=mesh, seq_axis=seq_axis,
                                      batch_axes=batch_axes, head_axis=head_axis)
  dilations, attention_mask, global_mask, global_qkv, num_global = validate_attention_args(
      q, k, v, window=window, dilation=dilation, causal=causal, attention_mask=attention_mask,
      global_mask=global_mask, global_qkv=global_qkv, max_global=max_global)
  platform = op_platform(mesh, ctx)
  impl = resolve_impl(impl, q, window, platform, dilations)
  if q.size == 0:  # an empty batch or sequence, no heads, head_dim 0: nothing to attend
    return jnp.zeros_like(q)
  args = (q, k, v, attention_mask, global_mask, global_qkv)
  static = dict(window=window, dilations=dilations, causal=causal, num_global=num_global)
  if impl == "reference":  # dense, for tests: XLA partitions it on a mesh
    if seq_axis is not None and ctx is not None and seq_axis in ctx.manual_axes:
      return dense_sequence_shard(*args, seq_axis=seq_axis, **static).astype(q.dtype)
    return dense_attention(q, k, v, attention_mask=attention_mask, global_mask=global_mask,
                           global_qkv=global_qkv, **static)
  band_kernel, options = band_kernel_for(impl, platform)
  out = sharded.run_per_shard(band_kernel, dict(static, **options), args, mesh=mesh, ctx=ctx,
                              seq_axis=seq_axis, batch_axes=batch_axes, head_axis=head_axis,
                              check_vma=checks_vma(impl, platform))
  return out.astype(q.dtype)
