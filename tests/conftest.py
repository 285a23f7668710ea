"""Shared test set-up: deterministic, CPU-only JAX."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_generate_tests(metafunc):
  """A test class's `GRID` attribute parametrizes its `grid_case` argument, so a subclass that
  reruns a suite with another implementation can choose its own grid."""
  if "grid_case" in metafunc.fixturenames:
    metafunc.parametrize("grid_case", metafunc.cls.GRID, ids=str)
