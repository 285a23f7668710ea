"""TPU programs compiled on a machine without a TPU (docs/design.md §5.1).

libtpu (the `tpu` extra of pyproject.toml, installed by `./run.sh test`) brings a compile-only
TPU client: `jax.experimental.topologies` describes a named slice (e.g. "v5e:2x2") whose devices
can form a `Mesh`; `jax.jit(f).lower(<ShapeDtypeStructs sharded on that mesh>).compile()` then
runs XLA's TPU compiler and Mosaic for real and `compiled.memory_analysis()` gives the memory
of one chip. Nothing runs: there is no TPU to run on. This works with JAX_PLATFORMS=cpu (the
tests' setting, tests/conftest.py), so the CPU backend stays the default.

`tpu_mesh` skips, with the reason in pytest's `-ra` summary, only when libtpu is not
installed; any other failure to build a topology fails the test. Only jax, numpy and pytest are
imported here.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import os

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import pytest

# libtpu takes /tmp/libtpu_lockfile so that one process owns the TPU chips; a compile-only
# client owns none, and pytest-xdist's workers (or a benchmark running beside the tests) each
# load libtpu: without this the second one fails with "Internal error when accessing libtpu
# multi-process lockfile".
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# The custom call every Mosaic (Pallas TPU) kernel becomes in compiled HLO; the interpret path
# and XLA fallbacks have none.
MOSAIC_TARGET = 'custom_call_target="tpu_custom_call"'


def libtpu_version() -> str | None:
  """The installed libtpu's version, or None when it is not installed."""
  try:
    return importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    return None


@functools.cache
def topology(name: str):
  """The device description of a named TPU slice, e.g. 'v5e:2x2' (compile-only, cached)."""
  from jax.experimental import topologies
  return topologies.get_topology_desc(topology_name=name, platform="tpu")


def make_mesh(name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> Mesh:
  """A mesh over the devices of the slice `name` (compile-only), `shape` over `axes`.

  The shape must use every device of the slice. v4 (megacore) slices are not supported by
  `topologies.make_mesh` in jax 0.12.
  """
  from jax.experimental import topologies
  devices = topology(name).devices
  if math.prod(shape) != len(devices):
    raise ValueError(f"mesh shape {shape} does not use the {len(devices)} chips of {name}")
  return topologies.make_mesh(topology(name), shape, axes)


def require_libtpu():
  """Skips the calling test when libtpu is not installed (install the `tpu` extra)."""
  if libtpu_version() is None:
    pytest.skip("TPU compile tests need libtpu: pip install -e '.[tpu]' (./run.sh test does)")


def tpu_mesh(name: str = "v5e:2x2", shape=(4,), axes=("data",)) -> Mesh:
  """`make_mesh`, skipping when libtpu is absent (for fixtures)."""
  require_libtpu()
  return make_mesh(name, tuple(shape), tuple(axes))


def sds(shape, dtype, mesh: Mesh, spec=None) -> jax.ShapeDtypeStruct:
  """An abstract argument of `shape`/`dtype` laid out on `mesh` by `spec` (default replicated)."""
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec or P()))


def mosaic_calls(compiled) -> int:
  """Number of Mosaic kernel calls in the compiled (optimized, scheduled) program."""
  return compiled.as_text().count(MOSAIC_TARGET)


def memory(compiled) -> dict[str, int]:
  """Bytes per chip from `compiled.memory_analysis()`: argument, output, temp, alias, and total
  (argument + output + temp - alias: what the program needs resident at its peak)."""
  stats = compiled.memory_analysis()
  out = {"argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
         "temp": stats.temp_size_in_bytes, "alias": stats.alias_size_in_bytes,
         "generated_code": stats.generated_code_size_in_bytes}
  out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
  return out
