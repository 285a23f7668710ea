"""Shared test set-up: deterministic, CPU-only JAX."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
