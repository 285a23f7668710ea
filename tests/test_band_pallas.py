"""Pallas band kernels (Triton-style and Mosaic-TPU-style) against the dense band reference.

The kernel suites follow jax's tests/pallas pattern: `TestTritonBand` runs the COMPILED Triton
kernel (forward, and the gradients of q, k, v under random cotangents for BOTH out and lse) and
skips, with its reason in the `-ra` summary, unless jax's backend is a GPU; the one-line subclass
`TestTritonBandInterpret` reruns the same suite in Pallas interpret mode, on CPU. The TPU kernel
has the same pair (`TestTpuBand`, `TestTpuBandInterpret`), the Triton suite rerun with TPU
blocks and cases. tests/conftest.py sets JAX_PLATFORMS=cpu unless it is already set: run with
JAX_PLATFORMS=cuda (or tpu) for the compiled classes.

Also on CPU: lowering for 'cuda' and 'tpu' through an abstract mesh (docs/design.md §5.1), which
proves the kernels become Triton / Mosaic custom calls with no silent fallback to XLA; and the
captured Triton IR compiled to sm_90 cubins with the `triton` package (no GPU needed). The TPU
kernels
are compiled for real TPU slices (XLA's TPU compiler and Mosaic) in tests/test_tpu_aot.py.
Tolerances (tests/testing.py TOLERANCE) are on the error divided by max(1, max |reference|):
float32 1e-5, 16-bit 1e-2.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
import warnings

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from longformer_jax.ops import compose, global_tokens
from longformer_jax.ops.band_pallas import (BlockSizes, band_attention_pallas, check_supported,
                                            pallas_supported)
from longformer_jax.ops.band_reference import (EMPTY_LSE, band_attention_reference,
                                               masked_softmax_attention)
from testing import assert_close, make_band_inputs, tolerance

# Interpret-mode kernels at tiny shapes: compile time dominates (conftest.py).
pytestmark = [pytest.mark.kernels, pytest.mark.slow]


def assert_lse_close(actual, expected, tol):
  """Rows with keys: error relative to max(1, max |lse|) over those rows; empty rows: exact."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  empty = expected == np.float32(EMPTY_LSE)
  np.testing.assert_array_equal(actual[empty], expected[empty])
  if np.any(~empty):
    assert_close(actual[~empty], expected[~empty], tol, "lse")


class BandCase(typing.NamedTuple):
  """One kernel test case (its seed a fixed integer); `str` is its test id."""
  seed: int
  batch: int
  seq: int
  heads: int
  head_dim: int
  window: int
  causal: bool
  mask_kind: str  # see testing.make_band_inputs
  dtype: typing.Any

  def __str__(self):
    direction = "causal" if self.causal else "bidir"
    return (f"n{self.seq}-w{self.window}-{direction}-{self.mask_kind}-"
            f"{jnp.dtype(self.dtype).name}-s{self.seed}")


# Block sizes below make seq 64/128 exact multiples and 77/100/200 not; windows run from 0 to
# beyond seq.
TRITON_CASES = [BandCase(*case) for case in [
    (0, 2, 64, 2, 16, 1, False, "holes+empty", jnp.float32),
    (1, 2, 100, 2, 32, 7, True, "holes+empty", jnp.float32),
    (2, 2, 100, 1, 32, 300, False, "holes+empty", jnp.float32),
    (3, 1, 128, 2, 64, 0, True, "all", jnp.float32),
    (4, 1, 77, 2, 32, 33, False, "all", jnp.float32),
    (5, 2, 200, 1, 16, 16, True, "holes", jnp.float32),
    (6, 2, 100, 2, 32, 7, False, "holes+empty", jnp.bfloat16),
    (7, 1, 200, 2, 64, 40, True, "holes+empty", jnp.bfloat16),
    (8, 2, 77, 1, 32, 100, True, "holes+empty", jnp.float16),
    (9, 2, 50, 2, 8, 5, False, "holes+empty", jnp.float32),  # head_dim 8: zero-padded to 16
]]
# TPU tiles are >= 128 rows: seq 200/300 are padded, 256/384 exact; 384 with a small window has
# key blocks outside the band of every query block. head_dim 64 runs two heads per block (one
# head is padded to two, three to four); 128 and 256 one.
TPU_CASES = [BandCase(*case) for case in [
    (10, 2, 200, 2, 64, 7, False, "holes+empty", jnp.float32),
    (11, 1, 256, 2, 64, 1, True, "holes", jnp.float32),
    (12, 2, 300, 1, 64, 400, False, "holes+empty", jnp.float32),
    (13, 1, 384, 1, 128, 20, True, "holes+empty", jnp.float32),
    (14, 2, 200, 1, 40, 0, False, "all", jnp.float32),  # head_dim 40: zero-padded to 64
    (15, 2, 300, 1, 64, 130, False, "holes+empty", jnp.bfloat16),
    (16, 1, 384, 2, 64, 5, True, "holes", jnp.bfloat16),
    (17, 1, 256, 3, 64, 33, False, "holes", jnp.bfloat16),  # 3 heads: padded to 4
    (18, 1, 200, 2, 256, 50, True, "holes+empty", jnp.float32),
]]


class TestTritonBand:
  """The compiled Triton kernel against the reference; skips unless jax's backend is a GPU."""
  BACKEND = "triton"
  PLATFORM = "gpu"  # the jax.default_backend() that the compiled kernel needs
  INTERPRET = False
  # Unequal, small blocks: several blocks per sequence, band skipping in every kernel.
  BLOCKS = BlockSizes(block_q=16, block_k=32, block_q_dkv=32, block_k_dkv=16, block_q_dq=16,
                      block_k_dq=32)
  GRID = TRITON_CASES  # tests/conftest.py parametrizes `grid_case` over it

  def setup_method(self):
    backend = jax.default_backend()
    if not self.INTERPRET and backend != self.PLATFORM:
      kernel = {"triton": "Triton", "tpu": "Mosaic TPU"}[self.BACKEND]
      pytest.skip(f"compiled {kernel} kernels need a {self.PLATFORM.upper()} (jax backend is "
                  f"{backend}); {type(self).__name__}Interpret runs the same suite in "
                  "interpret mode")

  def band(self, q, k, v, key_mask, window, causal):
    return band_attention_pallas(q, k, v, key_mask, window=window, causal=causal,
                                 block_sizes=self.BLOCKS, interpret=self.INTERPRET,
                                 backend=self.BACKEND)

  def test_forward_and_gradients(self, grid_case):
    seed, batch, seq, heads, head_dim, window, causal, mask_kind, dtype = grid_case
    q, k, v, key_mask = make_band_inputs(seed, batch, seq, heads, head_dim, dtype, mask_kind)
    kernel = lambda q, k, v: self.band(q, k, v, key_mask, window, causal)
    reference = lambda q, k, v: band_attention_reference(q, k, v, key_mask, window=window,
                                                         causal=causal)
    (out, lse), kernel_vjp = jax.vjp(kernel, q, k, v)
    (out_ref, lse_ref), reference_vjp = jax.vjp(reference, q, k, v)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (batch, heads, seq)
    tol = tolerance(dtype)
    assert_close(out, out_ref, tol, "out")
    # lse is float32 whatever the input dtype; with 16-bit inputs it inherits their rounding.
    assert_lse_close(lse, lse_ref, tol)

    rng = np.random.default_rng(seed + 1000)
    dout = jnp.asarray(rng.standard_normal(out.shape), dtype)
    dlse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)
    grads = kernel_vjp((dout, dlse))
    grads_ref = reference_vjp((dout, dlse))
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
      assert g.dtype == dtype
      assert_close(g, g_ref, tol, name)

    if mask_kind == "holes+empty":  # batch row 0 has no key at all
      np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)
      np.testing.assert_array_equal(np.asarray(lse[0]), np.float32(EMPTY_LSE))
      np.testing.assert_array_equal(np.asarray(grads[0][0], np.float32), 0.0)

  def test_under_jit(self):
    q, k, v, key_mask = make_band_inputs(20, 1, 96, 2, 32 if self.BACKEND == "triton" else 64,
                                         jnp.float32, "holes")
    loss = lambda fn: (lambda q, k, v: sum(jnp.sum(jnp.sin(x)) for x in fn(q, k, v)))
    kernel = loss(lambda q, k, v: self.band(q, k, v, key_mask, 9, False))
    reference = loss(lambda q, k, v: band_attention_reference(q, k, v, key_mask, window=9,
                                                              causal=False))
    grads = jax.jit(jax.grad(kernel, argnums=(0, 1, 2)))(q, k, v)
    grads_ref = jax.grad(reference, argnums=(0, 1, 2))(q, k, v)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
      assert_close(g, g_ref, tolerance(jnp.float32), name)

  def test_skips_blocks_outside_the_band(self):
    """NaN in queries/keys/values far outside the band must not reach near rows: a kernel that
    computed those blocks (even fully masked) would spread NaN through 0 * NaN. NaN does spread
    legitimately within a computed tile and through rows that truly attend poisoned keys, so
    `near` keeps two tiles plus the window away from `far` (tiles are <= seq / 4 here)."""
    seq, window = (256, 4) if self.BACKEND == "triton" else (512, 4)
    near, far = seq // 4, seq * 3 // 4
    q, k, v, key_mask = make_band_inputs(21, 1, seq, 1, 64, jnp.float32, "all")
    poison = lambda x: x.at[:, far:].set(jnp.nan)
    (out, _), vjp = jax.vjp(lambda q, k, v: self.band(q, k, v, key_mask, window, False),
                            poison(q), poison(k), poison(v))
    dout = jnp.ones_like(out)
    dq, dk, dv = vjp((dout, jnp.ones((1, 1, seq), jnp.float32)))
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
      assert np.all(np.isfinite(np.asarray(x[:, :near]))), name


  @pytest.mark.parametrize("seed, seq, window, dilation, causal, num_global, dtype", [
      (30, 50, 3, (1, 2, 3), False, 3, jnp.float32),  # 50: not a multiple of 2, 3 or a block
      (31, 61, 2, (2, 2, 1, 1), True, 0, jnp.float32),  # causal takes no global keys
      (32, 96, 5, (3, 1, 1, 3), False, 1, jnp.float32),  # runs of heads: 3 | 1, 1 | 3
      (33, 70, 4, (1, 2, 2), False, 2, jnp.bfloat16),
  ])
  def test_dilation_and_global_keys(self, seed, seq, window, dilation, causal, num_global,
                                    dtype):
    """Dilation addressed by the kernels' BlockSpecs and the global key block merged in their
    online softmax, against one dense softmax over [band keys of each head's dilation; global
    keys], out, lse and the gradients of q, k, v and the global keys/values."""
    self.check_dilation_and_global_keys(seed, seq, window, dilation, causal, num_global, dtype,
                                        head_dim=16)

  def check_dilation_and_global_keys(self, seed, seq, window, dilation, causal, num_global,
                                     dtype, head_dim, gradients=True):
    """Raises AssertionError naming the first output or gradient that differs."""
    heads = len(dilation)
    q, k, v, key_mask = make_band_inputs(seed, 2, seq, heads, head_dim, dtype, "holes")
    rng = np.random.default_rng(seed + 1)
    kg, vg = (jnp.asarray(rng.standard_normal((2, max(num_global, 1), heads, head_dim)), dtype)
              for _ in range(2))
    keep = jnp.asarray(np.arange(max(num_global, 1))[None, :] < [[num_global], [num_global - 1]])
    has_global = num_global > 0

    def kernel(q, k, v, kg, vg):
      return band_attention_pallas(
          q, k, v, key_mask, window=window, causal=causal, dilation=dilation,
          global_kv=(kg, vg, keep) if has_global else None, block_sizes=self.BLOCKS,
          interpret=self.INTERPRET, backend=self.BACKEND)

    offset_NxN = np.arange(seq)[None, :] - np.arange(seq)[:, None]  # j - i
    band_HxNxN = np.stack([(offset_NxN % d == 0) & (offset_NxN >= -window * d)
                           & (offset_NxN <= (0 if causal else window * d)) for d in dilation])

    def reference(q, k, v, kg, vg):
      mask_BxHxNxK = band_HxNxN[None] & np.asarray(key_mask)[:, None, None, :]
      if has_global:
        k, v = jnp.concatenate([k, kg], axis=1), jnp.concatenate([v, vg], axis=1)
        keep_BxHxNxG = np.broadcast_to(np.asarray(keep)[:, None, None, :],
                                       (2, heads, seq, keep.shape[1]))
        mask_BxHxNxK = np.concatenate([np.broadcast_to(mask_BxHxNxK, keep_BxHxNxG.shape[:3]
                                                       + (seq,)), keep_BxHxNxG], axis=-1)
      out, lse, _ = masked_softmax_attention(q, k, v, mask_BxHxNxK)
      return out, lse

    (out, lse), kernel_vjp = jax.vjp(kernel, q, k, v, kg, vg)
    (out_ref, lse_ref), reference_vjp = jax.vjp(reference, q, k, v, kg, vg)
    tol = tolerance(dtype)
    assert_close(out, out_ref, tol, "out")
    assert_lse_close(lse, lse_ref, tol)
    if not gradients:
      return
    dout = jnp.asarray(rng.standard_normal(out.shape), dtype)
    dlse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)
    names = ("dq", "dk", "dv", "dk_global", "dv_global")[:5 if has_global else 3]
    for name, g, g_ref in zip(names, kernel_vjp((dout, dlse)), reference_vjp((dout, dlse))):
      assert g.dtype == dtype
      assert_close(g, g_ref, tol, name)


class TestTritonBandInterpret(TestTritonBand):
  INTERPRET = True


class TestTpuBand(TestTritonBand):
  """The compiled Mosaic TPU kernel; skips unless jax's backend is a TPU."""
  BACKEND, PLATFORM, BLOCKS, GRID = "tpu", "tpu", BlockSizes(*(128,) * 6), TPU_CASES

  @pytest.mark.parametrize("seed, seq, window, dilation, causal, num_global, dtype", [
      # head_dim 64: two heads per lane group. Runs 1,1 | 2,2 in place; 300 is no multiple.
      (40, 300, 5, (1, 1, 2, 2), False, 2, jnp.float32),
      (41, 200, 3, (2, 1, 3), False, 1, jnp.float32),  # runs of one head: gathered by dilation
      (42, 256, 4, (2, 2, 1, 1), True, 0, jnp.float32),
      (43, 256, 6, (1, 1, 3, 3), False, 3, jnp.bfloat16),
  ])
  def test_dilation_and_global_keys(self, seed, seq, window, dilation, causal, num_global,
                                    dtype):
    """As the Triton kernels: dilated runs of heads addressed in place by the index maps (or
    gathered by dilation where a run is not whole lane groups), the global key tile merged in
    the online softmax, its dK/dV from the dQ kernel."""
    self.check_dilation_and_global_keys(seed, seq, window, dilation, causal, num_global, dtype,
                                        head_dim=64)

  @pytest.mark.parametrize("mutation", ["head_offset", "dropped_global_key"])
  def test_dilation_and_global_keys_catches_mutations(self, mutation, monkeypatch):
    """The check above fails on a kernel that addresses its heads one lane group off (each
    group then runs with its neighbour's dilation), or that drops the last real global key (the
    case has 2 global keys in row 0)."""
    from longformer_jax.ops import band_mosaic
    # The kernels are jitted with their configuration static: retrace them with the mutation,
    # and again without it afterwards.
    jax.clear_caches()
    if mutation == "head_offset":
      from jax.experimental import pallas as pl
      tile = band_mosaic._Layout.tile

      def shifted(layout, rows, block_of):  # every tile one lane group further
        spec = tile(layout, rows, block_of)
        return pl.BlockSpec(spec.block_shape, lambda b, g, i, s: spec.index_map(
            b, (g + 1) % layout.groups, i, s))
      monkeypatch.setattr(band_mosaic._Layout, "tile", shifted)
    else:
      global_keep = band_mosaic._global_keep

      def dropped(gkeep_ref, rows):
        keep = global_keep(gkeep_ref, rows)
        return keep & (lax.broadcasted_iota(jnp.int32, keep.shape, 1) != 1)
      monkeypatch.setattr(band_mosaic, "_global_keep", dropped)
    try:
      with pytest.raises(AssertionError):
        self.check_dilation_and_global_keys(44, 256, 4, (2, 2, 1, 1), False, 2, jnp.float32,
                                            head_dim=64, gradients=False)
    finally:
      monkeypatch.undo()
      jax.clear_caches()


def _global_rows_inputs(seq, num_global, batch, heads, head_dim, dtype, seed):
  """(rng, global query rows [B, G, H, D], k_g, v_g [B, N, H, D], key mask [B, N]) for the
  global rows' kernel: ~30% of keys masked, and row 1 of the batch with no key at all."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((batch, num_global, heads, head_dim)), dtype)
  k, v = (jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), dtype)
          for _ in range(2))
  mask = jnp.asarray(rng.random((batch, seq)) > 0.3).at[1].set(False)
  return rng, q, k, v, mask


class TestTpuBandInterpret(TestTpuBand):
  INTERPRET = True

  @pytest.mark.parametrize("seq, num_global, dtype", [(384, 3, jnp.float32),
                                                      (256, 2, jnp.bfloat16)])
  def test_global_rows_kernel(self, seq, num_global, dtype):
    """The global rows' TPU kernel (`band_mosaic.global_rows`: 3 key blocks of 128 at 384, one
    of 256) against the XLA pass of the op (`global_tokens.global_rows_dense`, on inputs zeroed
    at masked keys), out and the gradients of the rows, k_g and v_g; NaN at masked keys (and a
    row of the batch with no key at all) reaches nothing."""
    from longformer_jax.ops import band_mosaic
    batch, heads, head_dim = 2, 3, 64
    rng, q, k, v, mask = _global_rows_inputs(seq, num_global, batch, heads, head_dim, dtype,
                                             seed=seq)
    keep = mask[:, :, None, None]

    def kernel(q, k, v):
      return band_mosaic.global_rows(q, jnp.where(keep, k, jnp.nan), jnp.where(keep, v, jnp.nan),
                                     mask, True)

    def reference(q, k, v):
      flat = lambda x: jnp.where(keep, x, 0).reshape(batch, seq, heads * head_dim)
      return global_tokens.global_rows_dense(q, flat(k), flat(v), mask)

    out, kernel_vjp = jax.vjp(kernel, q, k, v)
    out_ref, reference_vjp = jax.vjp(reference, q, k, v)
    tol = tolerance(dtype)
    assert_close(out, out_ref, tol, "out")
    dout = jnp.asarray(rng.standard_normal(out.shape), dtype)
    for name, g, g_ref in zip(("dq_rows", "dk_g", "dv_g"), kernel_vjp(dout),
                              reference_vjp(dout)):
      assert g.dtype == dtype
      assert_close(g, g_ref, tol, name)


  @pytest.mark.parametrize("seq, num_global, dtype", [(384, 3, jnp.float32),
                                                      (256, 8, jnp.bfloat16)])
  def test_global_rows_lse(self, seq, num_global, dtype):
    """`band_mosaic.global_rows_lse` (what the sequence-split path merges across shards): out
    and the log-sum-exp against a dense float32 softmax, and the gradients of q, k_g, v_g under
    random cotangents for BOTH outputs (the lse's enters as delta - dlse); a row of the batch
    with no key gives lse = EMPTY_LSE, zero gradients, and NaN at masked keys reaches nothing."""
    from longformer_jax.ops import band_mosaic
    batch, heads, head_dim = 2, 3, 64
    rng, q, k, v, mask = _global_rows_inputs(seq, num_global, batch, heads, head_dim, dtype,
                                             seed=seq + num_global)
    keep = mask[:, :, None, None]

    def kernel(q, k, v):
      return band_mosaic.global_rows_lse(q, jnp.where(keep, k, jnp.nan),
                                         jnp.where(keep, v, jnp.nan), mask, True)

    def reference(q, k, v):  # float32 [B, H, G, N] scores, masked keys dropped
      f32 = lambda x: x.astype(jnp.float32)
      s = jnp.einsum("bghd,bnhd->bhgn", f32(q), f32(k)) / math.sqrt(head_dim)
      s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
      m = jnp.max(s, axis=-1, keepdims=True)
      m = jnp.where(jnp.isfinite(m), m, 0.0)
      l = jnp.sum(jnp.exp(s - m), axis=-1, keepdims=True)
      p = jnp.exp(s - m) / jnp.where(l > 0, l, 1.0)
      out = jnp.einsum("bhgn,bnhd->bghd", p, f32(v))
      lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(l > 0, l, 1.0))[..., 0],
                      EMPTY_LSE)
      return out, lse

    (out, lse), kernel_vjp = jax.vjp(kernel, q, k, v)
    (out_ref, lse_ref), reference_vjp = jax.vjp(reference, q, k, v)
    assert out.dtype == lse.dtype == jnp.float32 and lse.shape == (batch, heads, num_global)
    tol = tolerance(dtype)
    assert_close(out, out_ref, tol, "out")
    assert_lse_close(lse, lse_ref, tol)
    dout = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)
    for name, g, g_ref in zip(("dq_rows", "dk_g", "dv_g"), kernel_vjp((dout, dlse)),
                              reference_vjp((dout, dlse))):
      assert g.dtype == dtype
      assert_close(g, g_ref, tol, name)
    # The lse cotangent alone moves dq and dk_g (not dv_g: lse does not depend on v).
    dq_lse, dk_lse, dv_lse = kernel_vjp((jnp.zeros_like(dout), dlse))
    dq_lse_ref, dk_lse_ref, _ = reference_vjp((jnp.zeros_like(dout), dlse))
    assert_close(dq_lse, dq_lse_ref, tol, "dq_rows from dlse")
    assert_close(dk_lse, dk_lse_ref, tol, "dk_g from dlse")
    assert not np.any(np.asarray(dv_lse, np.float32))


# ---------------------------------------------------------------------------------------------
# Lowering for hardware that is not here: valid Pallas MLIR inside the right custom call.

LOWERING = {
    # platform: (device kind, backend, custom-call target, kernel-name suffix)
    "tpu": ("TPU v5 lite", "tpu", "tpu_custom_call", "_tpu"),
    "cuda": ("NVIDIA H200", "triton", "__gpu$xla.gpu.triton", ""),
}


def _lower(platform, fn, *args):
  kind, _, _, _ = LOWERING[platform]
  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      device_kind=kind, num_cores=1 if platform == "tpu" else None, platform=platform))
  with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
    # jax 0.12 warns that the Pallas Triton backend is deprecated (docs/design.md §5.1).
    warnings.simplefilter("ignore", DeprecationWarning)
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", sorted(LOWERING))
@pytest.mark.parametrize("causal", [False, True])
def test_lowers_to_kernel_custom_calls(platform, causal):
  kind, backend, target, suffix = LOWERING[platform]
  shape = (2, 3000, 3, 64)  # padded to 3072: a block multiple, not a power of two
  qkv = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  key_mask = jax.ShapeDtypeStruct(shape[:2], jnp.bool_)
  blocks = BlockSizes.for_device(kind)

  def forward(q, k, v, key_mask):
    return band_attention_pallas(q, k, v, key_mask, window=256, causal=causal,
                                 block_sizes=blocks, interpret=False, backend=backend)

  def gradients(q, k, v, key_mask):
    def loss(q, k, v):
      out, lse = forward(q, k, v, key_mask)
      return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  forward_text = _lower(platform, forward, qkv, qkv, qkv, key_mask)
  assert forward_text.count(f"custom_call @{target}") == 1
  assert f"band_attention_fwd{suffix}" in forward_text
  gradient_text = _lower(platform, gradients, qkv, qkv, qkv, key_mask)
  assert gradient_text.count(f"custom_call @{target}") == 3  # fwd, dq, dk/dv
  for name in ("fwd", "bwd_dq", "bwd_dkv"):
    assert re.search(f"band_attention_{name}{suffix}\\b", gradient_text), name


def _full_size_ops(text, elements):
  """{op name: count} of the gathers, transposes and concatenations in lowered StableHLO whose
  result has at least `elements` elements (copies of q/k/v-sized arrays)."""
  counts = {}
  for line in text.splitlines():
    match = re.search(r"(stablehlo\.(?:gather|transpose|concatenate))\b.*-> tensor<([\dx]+)x\w+>",
                      line)
    if match and math.prod(int(d) for d in match.group(2).split("x")) >= elements:
      counts[match.group(1)] = counts.get(match.group(1), 0) + 1
  return counts


@pytest.mark.parametrize("with_globals", [False, True])
def test_dilation_and_globals_copy_nothing_on_gpu(with_globals):
  """The op as the GPU runs it (lowered for an H200), forward and gradients, dilation 2 on the
  last 2 of 12 heads: the dilated heads are addressed in place (no transpose, gather or
  concatenation of a q/k/v-sized array; the old composition lowered to 13 transposes, 7 gathers
  and a concatenation) and each run of heads is one launch of each kernel. With a global
  token neither (step 4's [G x N] pass runs block-diagonal on [B, N, H*D]; it used to transpose
  the float32 gradients of the global projections' keys and values)."""
  batch, seq, heads, head_dim = 2, 4096, 12, 64
  dilations = (1,) * 10 + (2, 2)
  attention_mask = jnp.ones((batch, seq), bool)
  global_mask = jnp.zeros((batch, seq), bool).at[:, 0].set(with_globals)
  kernel = functools.partial(band_attention_pallas, interpret=False, backend="triton",
                             block_sizes=BlockSizes.for_device("NVIDIA H200"))

  def loss(*qkv):
    out = compose.compose(
        kernel, *qkv[:3], attention_mask, global_mask if with_globals else None,
        qkv[3:] if with_globals else None, window=256, dilations=dilations, causal=False,
        num_global=1, fused=True)
    return jnp.sum(out.astype(jnp.float32))

  x = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.bfloat16)
  text = _lower("cuda", jax.grad(loss, argnums=tuple(range(6))), *[x] * 6)
  assert text.count("custom_call @__gpu$xla.gpu.triton") == 6  # 2 runs x (fwd, dq, dk/dv)
  copies = _full_size_ops(text, batch * seq * heads * head_dim // 4)
  assert copies == {}, copies


# ---------------------------------------------------------------------------------------------
# Shapes the kernels refuse, and the fallback predicate.

def test_rejects_unsupported_shapes_with_clear_errors():
  q = jnp.zeros((1, 64, 2, 320), jnp.float32)
  mask = jnp.ones((1, 64), bool)
  with pytest.raises(ValueError, match="head_dim=320"):
    band_attention_pallas(q, q, q, mask, window=4, causal=False, backend="triton")
  with pytest.raises(ValueError, match="head_dim=320"):
    band_attention_pallas(q, q, q, mask, window=4, causal=False, backend="tpu")
  with pytest.raises(ValueError, match="float16"):
    check_supported((1, 64, 2, 64), jnp.float16, 4, "tpu")
  with pytest.raises(ValueError, match="window=-1"):
    check_supported((1, 64, 2, 64), jnp.float32, -1, "triton")
  with pytest.raises(ValueError, match="window=2.0"):
    check_supported((1, 64, 2, 64), jnp.float32, 2.0, "triton")
  check_supported((1, 64, 2, 64), jnp.float32, np.int64(2), "triton")  # numpy ints are fine
  with pytest.raises(ValueError, match="block size 100"):
    check_supported((1, 64, 2, 64), jnp.float32, 4, "triton", BlockSizes(block_q=100))
  with pytest.raises(ValueError, match="block size 64"):
    check_supported((1, 64, 2, 64), jnp.float32, 4, "tpu", BlockSizes())
  with pytest.raises(ValueError, match="key_mask shape"):
    band_attention_pallas(q, q, q, mask[:, :10], window=4, causal=False)


def test_pallas_supported():
  for platform in ("cuda", "gpu", "tpu", "cpu"):
    assert pallas_supported((2, 4096, 12, 64), jnp.bfloat16, 256, platform)
  assert pallas_supported((2, 4096, 12, 8), jnp.float32, 256, "cpu")  # zero-padded to 16
  assert pallas_supported((2, 4096, 12, 48), jnp.bfloat16, 256, "tpu")  # zero-padded to 64
  assert not pallas_supported((2, 4096, 12, 512), jnp.bfloat16, 256, "cuda")
  assert not pallas_supported((2, 4096, 12, 512), jnp.bfloat16, 256, "tpu")
  assert not pallas_supported((2, 4096, 12, 64), jnp.float16, 256, "tpu")
  assert not pallas_supported((2, 4096, 12, 64), jnp.float64, 256, "cuda")
  assert not pallas_supported((2, 4096, 12, 64), jnp.bfloat16, 256, "rocm")


def test_block_sizes_for_device():
  assert BlockSizes.for_device("TPU v5 lite").block_q % 128 == 0
  assert BlockSizes.for_device("NVIDIA H200") == BlockSizes.for_device("NVIDIA H100 80GB HBM3")
  for kind in ("TPU v4", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "cpu"):
    blocks = BlockSizes.for_device(kind)
    check_supported((1, 64, 2, 64), jnp.bfloat16, 4, "tpu" if "TPU" in kind else "triton", blocks)
  with pytest.raises(dataclasses.FrozenInstanceError):
    BlockSizes().block_q = 8  # pytype: disable=attribute-error


# ---------------------------------------------------------------------------------------------
# Beyond lowering: compile the Triton kernels to an sm_90 cubin with the `triton` package (its
# bundled ptxas), which needs no GPU. This uses a private jax hook to capture the Triton module.

@pytest.mark.parametrize("dtype, causal, head_dim, fused", [(jnp.bfloat16, False, 64, False),
                                                            (jnp.float32, True, 64, False),
                                                            (jnp.bfloat16, True, 256, False),
                                                            (jnp.bfloat16, False, 64, True),
                                                            (jnp.float32, False, 256, True)])
def test_triton_kernels_compile_for_sm90(dtype, causal, head_dim, fused, monkeypatch, tmp_path):
  """fused: dilation (1, 2) (two runs of heads: six kernels) and a global key tile."""
  triton = pytest.importorskip("triton")
  from triton.backends.compiler import GPUTarget
  from jax._src.pallas.triton import pallas_call_registration
  lowering = pallas_call_registration.lowering
  modules = []
  original = lowering.lower_jaxpr_to_triton_module

  def capture(*args, **kwargs):
    result = original(*args, **kwargs)
    modules.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
  monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
  blocks = BlockSizes.for_device("NVIDIA H200").fit_gpu_shared_memory(
      head_dim, dtype, global_rows=16 if fused else 0)
  qkv = jax.ShapeDtypeStruct((1, 3000, 2, head_dim), dtype)

  def gradients(q, k, v, key_mask):
    def loss(q, k, v):
      fused_args = dict(dilation=(1, 2), global_kv=(k[:, :1], v[:, :1], key_mask[:, :1]))
      out, lse = band_attention_pallas(q, k, v, key_mask, window=256, causal=causal,
                                       block_sizes=blocks, interpret=False, backend="triton",
                                       **(fused_args if fused else {}))
      return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  _lower("cuda", gradients, qkv, qkv, qkv, jax.ShapeDtypeStruct((1, 3000), jnp.bool_))
  assert len(modules) == (6 if fused else 3)
  for text in modules:
    name = re.search(r"tt.func public @(\w+)", text).group(1)
    path = tmp_path / f"{name}.ttir"
    path.write_text(text)
    kernel = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=blocks.num_warps, num_stages=blocks.num_stages))
    assert kernel.asm["cubin"], name
    assert kernel.metadata.shared <= 227 * 1024, (name, kernel.metadata.shared)


def test_fit_gpu_shared_memory():
  h200 = BlockSizes.for_device("NVIDIA H200")
  assert h200.fit_gpu_shared_memory(64, jnp.bfloat16) == h200  # the common case is untouched
  fitted = h200.fit_gpu_shared_memory(256, jnp.float32)
  assert fitted.num_stages == 2 and max(fitted.all_sizes()) < max(h200.all_sizes())
  assert min(h200.fit_gpu_shared_memory(256, jnp.float32, limit_bytes=1).all_sizes()) == 16
