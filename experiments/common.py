"""What every study script shares (each script puts the repository and this folder on sys.path)."""

from __future__ import annotations

import tempfile

_CACHES: list[tempfile.TemporaryDirectory] = []


def compilation_cache(prefix: str = "study_xla_") -> None:
  """Every seed of an arm compiles the same programs (each Trainer jits its own functions):
  XLA's persistent cache, in a temporary directory that lives as long as the process, serves
  the repeats. A cache the process already has is kept (JAX reads the setting once per process:
  a second directory would never be read, and deleting the first breaks its writes)."""
  import jax
  if jax.config.jax_compilation_cache_dir:
    return
  _CACHES.append(tempfile.TemporaryDirectory(prefix=prefix))
  jax.config.update("jax_compilation_cache_dir", _CACHES[-1].name)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
