"""Shared test set-up: deterministic, CPU-only JAX (set JAX_PLATFORMS=cuda or tpu to run the
compiled-kernel test classes on an accelerator), and the `GRID` parametrization hook."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import testing  # pylint: disable=g-import-not-at-top,wrong-import-position


def pytest_generate_tests(metafunc):
  """A test class's `GRID` attribute parametrizes its `grid_case` argument (testing.py)."""
  testing.parametrize_grid(metafunc)
