"""The device mesh and how parameters and batches are laid out on it.

Parameters carry logical axis names (`longformer_jax.layers.LOGICAL_AXES`); `LOGICAL_RULES` maps
them to the mesh axes (data, fsdp). FSDP shards the `embed` dimension of every matrix (each device
holds 1/fsdp of the weights and optimizer moments; XLA all-gathers them per layer); the batch is
split over both axes, so an fsdp group also divides the data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

LOGICAL_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("vocab", None),
    ("heads", None),
    ("kv", None),
    ("mlp", None),
    ("norm", None),
)


def make_mesh(mesh_shape: tuple[int, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp) mesh over `devices` (default: all); one of the sizes may be -1 (the rest)."""
  devices = list(jax.devices() if devices is None else devices)
  data, fsdp = mesh_shape
  if data == -1 and fsdp == -1:
    raise ValueError(f"at most one mesh dimension may be -1, got {mesh_shape}")
  if data == -1:
    data = len(devices) // fsdp
  if fsdp == -1:
    fsdp = len(devices) // data
  if data * fsdp != len(devices):
    raise ValueError(f"mesh_shape {mesh_shape} -> (data={data}, fsdp={fsdp}) does not use the "
                     f"{len(devices)} devices")
  return Mesh(np.array(devices).reshape(data, fsdp), ("data", "fsdp"))


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


def batch_sharding(mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> NamedSharding:
  """The sharding of every batch array: the leading (batch) axis over the `batch` rule's axes,
  the other axes replicated."""
  return NamedSharding(mesh, logical_to_mesh(P("batch"), rules))


def _names(axes) -> tuple[str, ...]:
  if axes is None:
    return ()
  return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
