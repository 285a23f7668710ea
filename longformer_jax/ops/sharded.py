"""The op on a mesh (docs/design.md §2.6): which mesh the caller's arrays live on, how they are
split, and the op's own `shard_map` around the composition of one shard.

The op meets a mesh in one of three ways:
  * `mesh=`: it runs per shard under its own shard_map over every axis of that mesh, the batch
    split over `batch_axes` (default: every axis but seq_axis and head_axis);
  * Explicit axes (`jax.make_mesh`'s default; under `jax.set_mesh`, or in the inputs' types):
    per shard under its own shard_map over those axes, each dimension split as the type of `q`
    says (or as `batch_axes`/`seq_axis`/`head_axis` say), the output laid out as `q`;
  * inside a caller's shard_map (Manual axes): the arrays already are shards, the composition
    runs on them as they are, and `seq_axis` names the caller's axis the sequence is split over.
Why per shard rather than XLA partitioning the composition: the Pallas kernels are custom calls
that no partitioner can split, and the chunked path's reshapes merge the batch with sharded
dimensions, which Explicit types refuse; per shard every array is local, so every impl runs
the same code on one device, on a mesh and inside a caller's shard_map.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from longformer_jax.ops.compose import compose
from longformer_jax.ops.sequence_parallel import compose_sequence_shard

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


def context_mesh(q) -> Mesh | AbstractMesh | None:
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


def check_context_axes(ctx, seq_axis, batch_axes, head_axis):
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


def check_layout(mesh, q_shape, batch_axes, seq_axis, head_axes, *, local_axes=()):
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


def dilations_per_head_shard(dilations, shards: int, head_axes):
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


def dilation_of_local_heads(dilation, local_heads: int, ctx, head_axis):
  """Inside a caller's shard_map that splits heads over `head_axis` (Manual), `dilation` may be
  given per local head, or per head of the whole model as with `mesh=` (then every shard must
  hold the same pattern, and that pattern is returned)."""
  shards = _shards(ctx, _axes(head_axis))
  if (isinstance(dilation, (tuple, list)) and shards > 1
      and len(dilation) == local_heads * shards):
    return dilations_per_head_shard(dilation, shards, head_axis)
  return dilation


def explicit_layout(q, ctx, batch_axes, seq_axis, head_axis):
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


def per_shard(band_kernel, static, seq_axis, seq_shards):
  """The composition one shard runs: whole sequences, or one shard of them over `seq_axis`."""
  if seq_axis is None:
    return functools.partial(compose, band_kernel, **static)
  return functools.partial(compose_sequence_shard, band_kernel, **static,
                           axis_name=seq_axis, num_shards=seq_shards)


def on_mesh(compose, mesh, axis_names, batch_axes, seq_axis, head_axes, q, k, v,
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


def caller_mesh(q, dilation, *, mesh, seq_axis, batch_axes, head_axis):
  """(ctx, dilation): the caller's mesh when `mesh=None` (`context_mesh`; None without one) with
  the axes named checked against it, and `dilation` as the caller's head shards take it; with
  `mesh=`, ctx is None and the mesh is checked (a mesh, not one the caller's shard_map is
  already over)."""
  if mesh is None:
    ctx = context_mesh(q)
    check_context_axes(ctx, seq_axis, batch_axes, head_axis)
    if head_axis is not None and set(_axes(head_axis)) <= set(ctx.manual_axes):
      dilation = dilation_of_local_heads(dilation, q.shape[2], ctx, head_axis)
    return ctx, dilation
  if not isinstance(mesh, (Mesh, AbstractMesh)):
    raise TypeError(f"mesh={mesh!r}: expected a jax.sharding.Mesh")
  inside = set(jax.sharding.get_abstract_mesh().manual_axes) & set(mesh.axis_names)
  if inside:
    raise ValueError(f"mesh={dict(mesh.shape)} inside a shard_map over its axes "
                     f"{sorted(inside)}: q, k, v already are shards there; pass mesh=None "
                     "and name the caller's axis that splits the sequence as seq_axis")
  if head_axis is not None and not isinstance(head_axis, str):
    raise TypeError(f"head_axis={head_axis!r}: expected one mesh axis name")
  return None, dilation


def run_per_shard(band_kernel, static, args, *, mesh, ctx, seq_axis, batch_axes, head_axis,
                  check_vma):
  """The composition `static` configures (window, dilations, causal, num_global and the band
  kernel's options) on `args` = (q, k, v, attention_mask, global_mask, global_qkv), as the mesh
  lays them out: under the op's own shard_map over `mesh=`'s axes or the caller's Explicit
  axes, else as they are (one device, Auto axes, or shards inside the caller's shard_map).
  Returns [B, N, H, D], not yet cast to q's dtype."""
  q = args[0]
  manual = () if ctx is None else tuple(ctx.manual_axes)
  if mesh is not None:
    if batch_axes is None:  # every other axis splits the batch
      batch_axes = tuple(a for a in mesh.axis_names if a not in (seq_axis, head_axis))
    batch_axes, head_axes = _axes(batch_axes), _axes(head_axis)
    seq_shards = check_layout(mesh, q.shape, batch_axes, seq_axis, head_axes)
    static = dict(static, dilations=dilations_per_head_shard(
        static["dilations"], _shards(mesh, head_axes), head_axes))
    return on_mesh(per_shard(band_kernel, static, seq_axis, seq_shards), mesh,
                   tuple(mesh.axis_names), batch_axes, seq_axis, head_axes, *args,
                   check_vma=check_vma)
  if ctx is None or not ctx.explicit_axes:
    # One device, a program XLA partitions (Auto axes), or a shard inside a caller's shard_map.
    if ctx is not None:
      check_layout(ctx, q.shape, _axes(batch_axes), seq_axis, _axes(head_axis),
                   local_axes=manual)
    seq_shards = 1 if seq_axis is None else ctx.shape[seq_axis]
    return per_shard(band_kernel, static, seq_axis, seq_shards)(*args)
  batch_axes, explicit_seq, head_axes = explicit_layout(q, ctx, batch_axes, seq_axis, head_axis)
  seq_axis = explicit_seq if seq_axis is None else seq_axis  # may be a Manual axis
  local = tuple(a for a in _axes(head_axis) if a in manual)  # heads the caller split
  seq_shards = check_layout(ctx, q.shape, batch_axes, seq_axis, head_axes + local,
                            local_axes=manual)
  static = dict(static, dilations=dilations_per_head_shard(
      static["dilations"], _shards(ctx, head_axes), head_axes))
  return on_mesh(per_shard(band_kernel, static, seq_axis, seq_shards), ctx,
                 tuple(ctx.explicit_axes), batch_axes, explicit_seq, head_axes, *args,
                 check_vma=check_vma)
