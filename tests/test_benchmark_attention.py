"""benchmarks/attention.py's op table: the old chunked path it times side by side really is the
old kernel (patched into the op's dispatch while tracing), the one-block-a-step row really rolls
the forward loop, and each computes the same attention."""

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


def test_the_one_block_a_step_row_traces_a_rolled_forward_loop():
  """Under the patch the forward loop takes one block a step (no stacking of several blocks'
  outputs); the library's unroll is back after it, and both compute the same attention."""
  from longformer_jax.ops import band_chunked
  shape = bench.Shape(seq=256, heads=2, head_dim=8, window=16)
  keys = jax.random.split(jax.random.key(1), 3)
  q, k, v = (jax.random.normal(key, (1, 256, 2, 8), jnp.float32) for key in keys)
  fn = bench.ours("chunked")(shape)
  hlo = lambda: jax.jit(lambda q, k, v: fn(q, k, v)).lower(q, k, v).compile().as_text()
  unrolled, out = hlo(), jax.jit(fn)(q, k, v)
  with bench.one_block_a_step():
    rolled, rolled_out = hlo(), jax.jit(lambda q, k, v: fn(q, k, v))(q, k, v)
  assert band_chunked.FORWARD_UNROLL > 1
  assert " concatenate(" in unrolled and " concatenate(" not in rolled
  np.testing.assert_allclose(np.asarray(rolled_out), np.asarray(out), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_the_dots_only_row_does_the_kernels_matmuls(causal):
  """Its forward is each query block's unmasked scores times its span's values (the span the
  kernel reads: block + 2w keys, block + w causal), and its backward's dQ is dS K on the same span
  with dS the unmasked dP: the rows time exactly those products."""
  shape = bench.Shape(seq=40, heads=2, head_dim=8, window=5, causal=causal)
  fwd, both, (q_b, k_t, v_t, dout_b) = bench.dots_only(shape)
  out_b = np.asarray(fwd(q_b, k_t, v_t))
  _, dq_b, _, _ = both(q_b, k_t, v_t, dout_b)
  q_b, k_t, v_t, dout_b = (np.asarray(x, np.float64) for x in (q_b, k_t, v_t, dout_b))
  blocks, _, _, block, _ = q_b.shape
  span = block + (5 if causal else 10)
  assert k_t.shape[2] == (blocks - 1) * block + span
  for n in range(blocks):
    k_span, v_span = k_t[:, :, n * block:n * block + span], v_t[:, :, n * block:n * block + span]
    want = (q_b[n] @ np.swapaxes(k_span, -1, -2)) @ v_span
    np.testing.assert_allclose(out_b[n], want, rtol=1e-4, atol=1e-4)
    dp = dout_b[n] @ np.swapaxes(v_span, -1, -2)
    np.testing.assert_allclose(np.asarray(dq_b[n]), dp @ k_span, rtol=1e-4, atol=1e-4)


def test_the_op_rows_record_each_chunked_kernels_temporaries():
  """fwd+bwd temporaries per token of the chunked kernels, from the compiled programs: the old
  kernel's key slabs hold several times the new kernel's, whose forward takes one block a step
  under differentiation either way."""
  shape = bench.Shape(seq=512, heads=2, head_dim=16, window=64)
  rows, temporaries = bench.jax_op_rows(shape, jnp.float32, budget=0)
  ynnpack_off = "chunked" + bench.YNNPACK_OFF_SUFFIX
  kernels = {"chunked", "chunked_one_block_a_step", "chunked_old", ynnpack_off}
  assert {(name, kind) for name, kind, _ in rows} == {
      (name, kind) for name in kernels for kind in ("fwd", "fwdbwd")} - {
          ("chunked_one_block_a_step", "fwdbwd")}  # the same program as chunked's fwd+bwd
  assert set(temporaries) == kernels
  assert 0 < temporaries["chunked"] < temporaries["chunked_old"] / 2, temporaries
  assert temporaries["chunked_one_block_a_step"] == temporaries["chunked"], temporaries
  assert temporaries[ynnpack_off] > 0, temporaries


def test_the_ynnpack_off_rows_compile_without_ynnpack():
  """The option the YNNPACK-off rows compile with takes effect: by default (jax 0.12 on CPU) a
  matmul and a row maximum are YNNPACK fusions (docs/design.md §2.3), with YNNPACK_OFF neither
  is."""
  x = jnp.ones((64, 64), jnp.float32)
  row_max = lambda x, y: jnp.max(x, axis=-1)
  for fn, want in ((jnp.dot, np.full((64, 64), 64.0)), (row_max, np.ones(64))):
    default = jax.jit(fn).lower(x, x).compile().as_text()
    off = bench.compile_with(fn, (x, x), bench.YNNPACK_OFF)
    assert "__ynn_fusion" in default
    assert off is not None and "__ynn_fusion" not in off.as_text()
    np.testing.assert_allclose(np.asarray(off(x, x)), want)


def test_useful_flops_count_the_keys_of_each_mode():
  """4·B·H·N·keys·D with 2w + 1 keys a query, w + 1 causal (the band without its edges)."""
  bidir, causal = bench.Shape(seq=1024, window=256), bench.Shape(seq=1024, window=256, causal=True)
  assert bench.useful_flops_fwd(bidir) == 4 * 12 * 1024 * 513 * 64
  assert bench.useful_flops_fwd(causal) == 4 * 12 * 1024 * 257 * 64


def test_the_op_table_plot_draws_each_compared_row(tmp_path):
  """summarize's table drawn as a PNG: one line per row compared with the chunked path."""
  shape = bench.Shape(seq=64, heads=2, head_dim=8, window=4)
  rows = [(name, kind, None) for name, kind in [("matmul", "matmul"), ("chunked", "fwd"),
                                                 ("torch flex_attention", "fwd")]]
  times = [[[0.010, 0.011], [0.012]], [[0.020], [0.021]], [[0.018], [0.025]]]
  table = bench.summarize(shape, rows, times, [(1.0, 1.2), (1.2, 1.3)])
  flex = table["rows"][2]
  assert flex["vs_chunked_per_round"] == [0.9, 1.19]
  png = bench.plot_op_table(tmp_path / "table.png", table)
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
