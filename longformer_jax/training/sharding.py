"""The device mesh and how parameters and batches are laid out on it.

Parameters carry logical axis names (`longformer_jax.layers.LOGICAL_AXES`); `LOGICAL_RULES` maps
them to the mesh axes (data, fsdp, seq). FSDP shards the `embed` dimension of every matrix (each
device holds 1/fsdp of the weights and optimizer moments; XLA all-gathers them per layer); the
batch is split over data and fsdp, so an fsdp group also divides the data. The seq axis splits
every sequence into contiguous pieces (sequence parallelism: the attention op exchanges the
window's worth of keys at the pieces' edges, see `ops.longformer_attention`'s seq_axis); the
parameters are replicated over it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "seq")
SEQ_AXIS = "seq"

LOGICAL_RULES = (
    ("batch", ("data", "fsdp")),
    ("length", "seq"),
    ("embed", "fsdp"),
    ("vocab", None),
    ("heads", None),
    ("kv", None),
    ("mlp", None),
    ("norm", None),
)


def check_mesh_shape(mesh_shape: Sequence[int]) -> tuple[int, ...]:
  """`mesh_shape` as a tuple: (data, fsdp) or (data, fsdp, seq) ints, each >= 1 or -1 (at most
  one -1); raises ValueError naming the value otherwise."""
  shape = tuple(mesh_shape) if isinstance(mesh_shape, (tuple, list)) else None
  if (shape is None or len(shape) not in (2, 3)
      or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) for d in shape)):
    raise ValueError(f"mesh_shape must be (data, fsdp) or (data, fsdp, seq) ints, got "
                     f"{mesh_shape!r}")
  if any(d == 0 or d < -1 for d in shape) or shape.count(-1) > 1:
    raise ValueError(f"mesh_shape sizes must be >= 1, or -1 (the devices left over) for at most "
                     f"one of them, got {mesh_shape!r}")
  return tuple(int(d) for d in shape)


def make_mesh(mesh_shape: Sequence[int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, seq) mesh over `devices` (default: all).

  mesh_shape: (data, fsdp) (then seq = 1) or (data, fsdp, seq); one size may be -1 (the devices
  left over). The devices are laid out in their order, seq fastest: with `jax.devices()` (one
  process's devices after the other's) a sequence's pieces stay inside one process when seq
  divides the devices per process; a longer seq axis spans processes, which then feed the same
  rows (`row_group`).
  """
  shape = check_mesh_shape(mesh_shape)
  shape = shape + (1,) * (3 - len(shape))
  devices = list(jax.devices() if devices is None else devices)
  if -1 in shape:
    known = math.prod(d for d in shape if d != -1)
    shape = tuple(len(devices) // known if d == -1 else d for d in shape)
  if math.prod(shape) != len(devices):
    named = ", ".join(f"{a}={d}" for a, d in zip(MESH_AXES, shape))
    raise ValueError(f"mesh_shape {tuple(mesh_shape)} -> ({named}) does not use the "
                     f"{len(devices)} devices")
  return Mesh(np.array(devices).reshape(shape), MESH_AXES)


def row_group(sharding: NamedSharding, shape: tuple[int, ...],
              process_index: int | None = None) -> tuple[int, int]:
  """(group, groups): which rows of a global batch array of `shape` this process feeds.

  Processes whose devices hold the same rows (e.g. the pieces of one sequence when the seq
  axis spans hosts) form a group and read the same rows: `Task.batches` and
  `jax.make_array_from_process_local_data` then get [rows of the group, full length, ...],
  from which each device takes its piece of the length. With the seq axis inside a host, every
  process is its own group. Groups are numbered in row order; each holds B / groups
  consecutive rows. Raises ValueError for a layout where a process's rows are not one block.
  """
  process_index = jax.process_index() if process_index is None else process_index
  spans = {}
  for device, index in sharding.devices_indices_map(tuple(shape)).items():
    start, stop, _ = index[0].indices(shape[0])
    lo, hi = spans.get(device.process_index, (start, stop))
    spans[device.process_index] = (min(lo, start), max(hi, stop))
  groups = sorted(set(spans.values()))
  size = shape[0] // len(groups)
  if any(g != (i * size, (i + 1) * size) for i, g in enumerate(groups)):
    raise ValueError(f"the rows of a {tuple(shape)} batch on mesh {dict(sharding.mesh.shape)} "
                     f"do not split into equal consecutive blocks per process: {spans}")
  return groups.index(spans[process_index]), len(groups)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes the batch dimension is split over: every axis but seq."""
  return tuple(a for a in mesh.axis_names if a != SEQ_AXIS)


def seq_axis(mesh: Mesh) -> str | None:
  """The mesh's seq axis when it splits sequences (size > 1), else None."""
  if SEQ_AXIS in mesh.axis_names and mesh.shape[SEQ_AXIS] > 1:
    return SEQ_AXIS
  return None


def logical_to_mesh(spec: P, rules: Sequence[tuple[str, Any]]) -> P:
  """The mesh PartitionSpec of a logical one."""
  table = dict(rules)
  for name in spec:
    if name is not None and name not in table:
      raise ValueError(f"logical axis {name!r} has no rule in {tuple(table)}")
  return P(*(None if name is None else table[name] for name in spec))


def param_shardings(abstract_params, mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> Any:
  """NamedShardings (same tree as the params) from the logical axis annotations; raises when a
  sharded dimension does not divide evenly over its mesh axes."""
  specs, treedef = jax.tree_util.tree_flatten_with_path(nnx.get_partition_spec(abstract_params))
  shapes = [x.shape for x in jax.tree.leaves(abstract_params)]
  shardings = []
  for (path, spec), shape in zip(specs, shapes):
    mesh_spec = logical_to_mesh(spec, rules)
    for dim, (size, axes) in enumerate(zip(shape, mesh_spec)):
      devices = math.prod(mesh.shape[a] for a in _names(axes))
      if size % devices:
        raise ValueError(f"parameter {jax.tree_util.keystr(path)} {tuple(shape)}: dimension "
                         f"{dim} ({spec[dim]}, size {size}) does not divide over mesh axes "
                         f"{axes} ({devices} devices)")
    shardings.append(NamedSharding(mesh, mesh_spec))
  return jax.tree.unflatten(treedef, shardings)


def batch_sharding(mesh: Mesh, rules: Sequence[tuple[str, Any]],
                   shape: Sequence[int]) -> NamedSharding:
  """The sharding of a batch array of `shape`: axis 0 over the `batch` rule's mesh axes, and for
  a [batch, length] array (2-D) axis 1 over the `length` rule's (the seq axis); other axes are
  replicated.

  An array of another rank (e.g. [batch] labels, [batch, choices, length]) is split over its
  batch axis only: its axis 1 need not be a sequence. So is a 2-D array whose length does not
  divide over the seq axis. Rules without a `length` entry (run configs written before it
  existed) leave lengths whole.
  """
  if not shape:  # a scalar: nothing to split
    return NamedSharding(mesh, P())
  table = dict(rules)
  spec = [logical_to_mesh(P("batch"), rules)[0]] + [None] * (len(shape) - 1)
  length_axes = table.get("length")
  if len(shape) == 2 and length_axes is not None:
    shards = math.prod(mesh.shape[a] for a in _names(length_axes))
    if shape[1] % shards == 0:
      spec[1] = length_axes
  return NamedSharding(mesh, P(*spec))


def _names(axes) -> tuple[str, ...]:
  if axes is None:
    return ()
  return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
