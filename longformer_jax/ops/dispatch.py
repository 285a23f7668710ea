"""Which implementation and which band kernel the op runs, for which platform.

`resolve_impl` turns `impl="auto"` into the fastest implementation that takes the inputs; the
platform is the mesh's devices' (`platform_of`), else the one `target_platform` sets for the
block being traced (export for a TPU from a CPU host), else the default backend's. The band
kernel of each implementation (`band_kernel_for`) comes with the options of the composition
around it (docs/design.md §2.1, §2.4).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable

import jax
from jax.sharding import AbstractMesh, Mesh

from longformer_jax.ops.band_chunked import band_attention_chunked

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


def _pallas_available(q, window: int, platform: str, dilation) -> bool:
  try:
    from longformer_jax.ops import band_pallas  # Lazy: Pallas imports are heavy and optional.
  except ImportError:
    return False
  return band_pallas.pallas_supported(q.shape, q.dtype, window, platform, dilation)


def resolve_impl(impl: str, q, window: int, platform: str | None = None, dilation=1) -> str:
  """'auto' -> the fastest implementation that can take these inputs (with `dilation`, an int or
  one per head) on `platform` (default: `target_platform`'s, else the default backend's)."""
  if impl not in IMPLS + ("auto",):
    raise ValueError(f"impl={impl!r}; expected one of {IMPLS + ('auto',)}")
  platform = platform_of(None) if platform is None else platform
  if impl == "pallas" and platform not in KERNEL_PLATFORMS:
    raise ValueError(f"impl='pallas': platform {platform!r} has no Pallas band kernel "
                     f"(kernels for {KERNEL_PLATFORMS}); use impl='chunked'")
  if impl != "auto":
    return impl
  if platform in ("gpu", "cuda", "tpu") and _pallas_available(q, window, platform, dilation):
    return "pallas"
  return "chunked"


def op_platform(mesh: Mesh | AbstractMesh | None,
                ctx: Mesh | AbstractMesh | None) -> str:
  """The platform one call of the op compiles for: `mesh=`'s when given; else `target_platform`'s
  (set to export for another platform, it outranks the caller's mesh), else that of the
  caller's mesh `ctx`, else the default backend's."""
  return platform_of(mesh if mesh is not None else None if _TARGET_PLATFORM.get() else ctx)


def band_kernel_for(impl: str, platform: str) -> tuple[BandKernel, dict]:
  """The band kernel of `impl` ("chunked" or "pallas") on `platform`, and the composition's
  options for it: `fused`, whether it takes dilation and global keys itself (the Pallas kernels,
  Triton and Mosaic) rather than having them composed around it, and on TPU `rows_kernel`, the
  Mosaic kernel of the global rows (`compose.compose`)."""
  if impl == "chunked":
    return band_attention_chunked, dict(fused=False)
  from longformer_jax.ops import band_pallas  # Lazy: Pallas imports are heavy and optional.
  backend = "tpu" if platform == "tpu" else "triton"
  options = dict(fused=True)
  if platform == "tpu":
    from longformer_jax.ops import band_mosaic  # Lazy: only the TPU path needs Mosaic.
    options["rows_kernel"] = band_mosaic.global_rows_lse
  return functools.partial(band_pallas.band_attention_pallas, interpret=platform == "cpu",
                           backend=backend), options


def checks_vma(impl: str, platform: str) -> bool:
  """Whether the op's own shard_map checks varying manual axes (the kernels state them for their
  outputs, `band_blocks.out_struct`): always, except around kernels in interpret mode. jax's
  Pallas HLO interpreter cannot evaluate a kernel on values of varying type (jax 0.11, 0.12), and
  the TPU interpreter, which can, synchronises all devices in host callbacks, which deadlocked
  XLA's CPU collectives at 8 devices. Without the check the HLO interpreter runs the kernel."""
  return not (impl == "pallas" and platform == "cpu")
