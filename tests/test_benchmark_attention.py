"""benchmarks/attention.py's op table: the old chunked path it times side by side really is the
old kernel (patched into the op's dispatch while tracing), and it computes the same attention."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import attention as bench  # benchmarks/attention.py
import chunked_old

pytestmark = pytest.mark.unit


def test_the_old_chunked_row_traces_the_old_kernel_and_agrees(monkeypatch):
  shape = bench.Shape(seq=40, heads=2, head_dim=8, window=5)
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (1, 40, 2, 8), jnp.float32) for key in keys)
  calls = []
  old = chunked_old.band_attention_chunked
  monkeypatch.setattr(chunked_old, "band_attention_chunked",
                      lambda *a, **kw: calls.append(1) or old(*a, **kw))
  fn = bench.ours("chunked")(shape)
  new = jax.jit(fn)(q, k, v)
  assert not calls  # the library's kernel outside the patch
  with bench.old_chunked_kernel():
    before = jax.jit(lambda q, k, v: fn(q, k, v))(q, k, v)
  assert calls  # traced through benchmarks/chunked_old.py
  np.testing.assert_allclose(np.asarray(before), np.asarray(new), rtol=1e-5, atol=1e-5)
  jax.jit(lambda q, k, v: fn(q, k, v))(q, k, v)  # a fresh trace after the patch
  assert len(calls) == 1  # the library's kernel is back
