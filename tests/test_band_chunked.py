"""The chunked band kernel (`ops/band_chunked.py`) against the dense band reference, forward and
gradients with cotangents for both outputs: block sizes for small and large windows, windows past
the sequence, many query blocks (the `lax.map`/`lax.scan` loops), causal, every dtype, vmap and
remat; and its compiled program holds no key slab and takes every dot in the layout the CPU's dot
library runs fast (docs/design.md §2.3)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longformer_jax.ops import band_chunked
from longformer_jax.ops.band_reference import EMPTY_LSE, band_attention_reference
from testing import assert_close, make_band_inputs, seed_of, tolerance

pytestmark = pytest.mark.unit


def _loss_and_grads(fn, q, k, v, key_mask, seed):
  """out, lse and d(out . ct + lse . ct_lse)/d(q, k, v): the lse cotangent is exercised too
  (it is what the global-key merge sends back), on the rows that have a key."""
  ct = jax.random.normal(jax.random.key(seed), q.shape, jnp.float32)
  ct_lse = jax.random.normal(jax.random.key(seed + 1), (q.shape[0], q.shape[2], q.shape[1]))

  def loss(q, k, v):
    out, lse = fn(q, k, v, key_mask)
    real = lse > 0.5 * EMPTY_LSE
    return (jnp.sum(out.astype(jnp.float32) * ct) + jnp.sum(jnp.where(real, lse, 0.0) * ct_lse),
            (out, lse))

  grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, lse, grads


def _check(case_id, q, k, v, key_mask, *, window, causal, block=None, dtype=jnp.float32):
  chunked = lambda q, k, v, m: band_chunked.band_attention_chunked(
      q, k, v, m, window=window, causal=causal, block=block)
  reference = lambda q, k, v, m: band_attention_reference(q, k, v, m, window=window,
                                                          causal=causal)
  seed = seed_of(case_id)
  got = _loss_and_grads(chunked, q, k, v, key_mask, seed)
  want = _loss_and_grads(reference, q, k, v, key_mask, seed)
  tol = tolerance(dtype)
  assert got[0].dtype == q.dtype and got[1].dtype == jnp.float32
  assert_close(got[0], want[0], tol, f"{case_id} out")
  assert_close(got[1], want[1], tol, f"{case_id} lse")
  for name, g, g_ref in zip("qkv", got[2], want[2]):
    assert g.dtype == q.dtype
    assert_close(g, g_ref, tol, f"{case_id} d{name}")


# (seq, window, block): a window below MIN_BLOCK, one block of reach, several blocks of reach
# with a partial last block, a window longer than the sequence, window 0, and blocks forced.
CASES = [(40, 3, None), (70, 20, None), (150, 100, None), (33, 90, None), (20, 0, None),
         (45, 7, 4), (45, 12, 5)]


@pytest.mark.parametrize("seq,window,block", CASES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_band_reference(seq, window, block, causal):
  case_id = f"{seq}-{window}-{block}-{causal}"
  q, k, v, key_mask = make_band_inputs(seed_of(case_id), 2, seq, 2, 8, jnp.float32,
                                       "holes+empty")
  _check(case_id, q, k, v, key_mask, window=window, causal=causal, block=block)


@pytest.mark.parametrize("causal", [False, True])
def test_many_blocks(causal):
  """16 query blocks whose key spans overlap by 2 * window - block keys: the backward adds each
  block's key and value gradients into the overlapping spans of one accumulator."""
  seq, window, block = 61, 9, 4
  case_id = f"blocks-{causal}"
  q, k, v, key_mask = make_band_inputs(seed_of(case_id), 2, seq, 2, 8, jnp.float32, "holes")
  _check(case_id, q, k, v, key_mask, window=window, causal=causal, block=block)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_half_precision_inputs(dtype):
  case_id = f"dtype-{jnp.dtype(dtype).name}"
  q, k, v, key_mask = make_band_inputs(seed_of(case_id), 1, 50, 2, 16, dtype, "holes")
  _check(case_id, q, k, v, key_mask, window=11, causal=False, dtype=dtype)


def test_vmap_and_remat_match_the_plain_call():
  q, k, v, key_mask = make_band_inputs(5, 3, 37, 2, 8, jnp.float32, "holes")
  fn = lambda q, k, v, m: band_chunked.band_attention_chunked(q, k, v, m, window=6, causal=False)
  plain = _loss_and_grads(fn, q, k, v, key_mask, 9)
  per_row = lambda q, k, v, m: jax.vmap(lambda *a: fn(*(x[None] for x in a)))(q, k, v, m)
  unbatch = lambda q, k, v, m: jax.tree.map(lambda x: x[:, 0], per_row(q, k, v, m))
  for other in (unbatch, jax.checkpoint(fn)):
    got = _loss_and_grads(other, q, k, v, key_mask, 9)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain)):
      np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window,expected", [(1, 16), (16, 16), (64, 64), (100, 100), (256, 128),
                                             (512, 128), (2000, 125)])
def test_default_block_splits_the_window(window, expected):
  """Blocks of about TARGET_BLOCK that split the window into equal parts, never below MIN_BLOCK
  nor above MAX_BLOCK: the band scores 2w + block keys per query."""
  assert band_chunked.default_block(window) == expected


def test_compiled_program_has_no_key_slab():
  """fwd+bwd at window 256: no concatenate, no array with a head_dim axis holding more than twice
  the laid-out keys (a key slab, every query block's span of 2w + block keys side by side, would
  hold (2w + block) / block = 5 times as many), and every dot contracts its left operand's last
  axis (the form XLA's CPU dot library takes; contracting the query axis of stored [Q, S] and
  [Q, D] sent two backward dots to XLA's slower generic dot). The undifferentiated forward, whose
  loop takes FORWARD_UNROLL blocks a step, concatenates only those blocks' outputs (no key-span
  axis, at most FORWARD_UNROLL blocks of queries' size)."""
  seq, heads, head_dim, window = 1024, 2, 16, 256
  q = jnp.ones((1, seq, heads, head_dim))
  mask = jnp.ones((1, seq), bool)

  def loss(q, k, v):
    out, _ = band_chunked.band_attention_chunked(q, k, v, mask, window=window, causal=False)
    return jnp.sum(out * q)

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile().as_text()
  assert not re.search(r"= \S+ concatenate\(", hlo)
  forward = jax.jit(loss).lower(q, q, q).compile().as_text()
  block = band_chunked.default_block(window)
  stacked = re.findall(r"= \w+\[([\d,]+)\]\S* concatenate\(", forward)
  assert stacked  # the unrolled loop's, as this test expects to find them
  for shape in stacked:
    dims = [int(d) for d in shape.split(",")]
    assert block + 2 * window not in dims, shape
    assert np.prod(dims) <= band_chunked.FORWARD_UNROLL * block * heads * head_dim, shape
  keys = (seq + 2 * window) * heads * head_dim
  key_like = [[int(d) for d in shape.split(",")] for shape in re.findall(r"f32\[([\d,]+)\]", hlo)]
  sizes = [int(np.prod(dims)) for dims in key_like if head_dim in dims]  # q/k/v-like arrays
  assert max(sizes) <= 2 * keys, (max(sizes), keys)
  dots = re.findall(r"f32\[([\d,]+)\]\{[\d,]*\} dot\((.*?)lhs_contracting_dims=\{(\d+)\}", hlo)
  assert len(dots) >= 7, dots  # forward 2, backward 5
  for shape, _, contracting in dots:
    assert int(contracting) == len(shape.split(",")) - 1, (shape, contracting)
