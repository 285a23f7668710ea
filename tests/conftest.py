"""Shared test set-up: deterministic, CPU-only JAX (set JAX_PLATFORMS=cuda or tpu to run the
compiled-kernel test classes on an accelerator), and the `GRID` parametrization hook."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import pytest

import testing
# pylint: enable=g-import-not-at-top,wrong-import-position


def pytest_generate_tests(metafunc):
  """A test class's `GRID` attribute parametrizes its `grid_case` argument (testing.py)."""
  testing.parametrize_grid(metafunc)


@pytest.fixture(scope="module")
def quick_compilation(tmp_path_factory):
  """For one module (`pytestmark = pytest.mark.usefixtures("quick_compilation")`): XLA's cheaper
  optimisation level (a third of a tiny train step's compile time on a CPU; tiny models run fast
  either way) and a persistent compilation cache in a directory of that module, so that a
  resumed run, an evaluation-only run and the checkpoint checksums read back the programs an
  earlier run of the module compiled. The settings are restored after."""
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.compilation_cache import compilation_cache as cc
  settings = {"jax_disable_most_optimizations": True,
              "jax_compilation_cache_dir": str(tmp_path_factory.mktemp("jax_cache")),
              "jax_persistent_cache_min_compile_time_secs": 0,
              "jax_persistent_cache_min_entry_size_bytes": -1}
  old = {name: jax.config.values[name] for name in settings}
  cc.reset_cache()
  for name, value in settings.items():
    jax.config.update(name, value)
  yield
  cc.reset_cache()
  for name, value in old.items():
    jax.config.update(name, value)
