"""Band attention as blocked `jnp` einsums: the portable fast path (docs/design.md §2.3).

The queries are cut into blocks of `block` rows. Query block `n` attends the keys
`n * block - window .. n * block + block - 1 + window` (`.. n * block + block - 1` causal): one
contiguous span of `S = block + 2 * window` keys (`block + window` causal). So k and v are laid
out ONCE as [B, H, N', D] in float32 with `window` zero keys before the first and after the last
(the left ones only when causal): the span of block `n` then starts at key `n * block` of the
laid-out keys, and each block's scores are ONE dot of its queries [Q, D] with its span [S, D].
Nothing of size seq x seq and no [blocks, S] key slab exists: a loop over the query blocks
(`lax.scan`; a few independent blocks a step forward, see FORWARD_UNROLL) reads one span a block,
so a block's scores [B, H, Q, S] (3.9 MB at 12 heads, block 128, window 256) stay cached across
the dot, the row maximum, the exponentials, the sum and `P @ V`.

The band is the span's diagonal strip (`|i - j| <= window`, a comparison of two iotas, fused
into the masking), so the scores cost `S` keys per query for the band's `2 * window + 1` (640
for 513 at window 256; `default_block` weighs that against the loop's step count), while each
dot is large enough (contractions of 64 and S) to run near the machine's matmul rate.

The backward is written by hand (`jax.custom_vjp`): it recomputes each block's probabilities
from the saved log-sum-exp, so nothing of the scores' size is kept between the passes, and takes
the log-sum-exp's cotangent (`ds = P * (dP - (delta - dlse))`, docs/design.md §2.2). The key and
value gradients are accumulated transposed ([B, H, D, N'], transposed back once at the end):
then `dK^T = Q^T dS` and `dV^T = dO^T P` contract their left operand's last axis and their right
operand's first, the layout XLA's CPU dot library takes; contracting the query axis of [Q, S]
and [Q, D] as stored sent those two dots to XLA's generic dot (with 64-row blocks at 4k tokens:
a quarter of the fwd+bwd's op time, and the fwd+bwd 1.15x slower). Each block adds its span's
gradients into the accumulators in place (a dynamic-update-slice of the loop carry), with no
padding round trip.

Implements the band kernel contract of `band_reference.py`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax import lax

from longformer_jax.ops.band_reference import EMPTY_LSE

MAX_BLOCK = 128
# The block the window is split towards. Each query block is one step of the loops, and each
# step synchronises the cores several times (one per dot or fused pass), so fewer, larger blocks
# beat less waste: at window 256 on a 2-core CPU (4k tokens, 12 heads, fwd+bwd, interleaved
# calls), 128-row blocks (640 scored keys per query for 513) took 366-391 ms on a quiet machine
# and 485-503 ms on a contended one, 64-row blocks (576 keys) 373-426 and 589-616 ms, 256-row
# blocks (768 keys) 438-470 and 457-506 ms.
TARGET_BLOCK = 128
# Query blocks per step of the undifferentiated forward's loop. The blocks are independent, and
# XLA's CPU runtime runs independent ops of one step concurrently: one block's dot holds a core
# while another's key span is copied or its softmax computed, where a step of one block hands
# each short op between the two cores and waits for the second to answer. That wait varies with
# the machine's load, and with it the gain. In the op table (benchmarks/README.md, 2-core CPU,
# window 256, commit a37b19c) one block a step took 1.19x [1.11-1.23] the forward's time at 16k
# tokens and 0.92x [0.80-1.27] at 4k (per round: median [range]); against compiled PyTorch
# flex_attention (commit 850f4a1, 4k), flex's time over ours per round was 0.88-1.04 with 4
# blocks a step and 0.77-1.17 with one. Under differentiation the forward keeps one block a step:
# it is a third of the fwd+bwd's time there, and 4 blocks' scores held at once took the compiled
# fwd+bwd's temporaries from 16.8 to 28.0 KB/token at 4k (op table, commit 850f4a1).
FORWARD_UNROLL = 4
# Blocks are never smaller than this (a window of 1 would otherwise make 1-row dots).
MIN_BLOCK = 16
# Masked scores: after the row maximum is subtracted, exp() of them is exactly 0 whenever the row
# has one real key; finite, so nothing computes inf - inf (band_reference.py uses the same value).
_MASKED_SCORE = -1e30


def default_block(window: int) -> int:
  """The query block for a one-sided window: the window split into `round(window /
  TARGET_BLOCK)` equal parts (at least one), each of at least `MIN_BLOCK` and at most
  `MAX_BLOCK` rows."""
  window = max(window, 1)
  parts = max(1, round(window / TARGET_BLOCK), math.ceil(window / MAX_BLOCK))
  return max(MIN_BLOCK, math.ceil(window / parts))


def _keys(x, block_index, geometry):
  """Span of the laid-out keys or values [B, H, N', D]: [B, H, S, D]."""
  block, span, _, _ = geometry
  return lax.dynamic_slice_in_dim(x, block_index * block, span, axis=2)


def _scores(q_BxHxQxD, k_t, key_ok, block_index, geometry):
  """Masked scores of one query block against its span: [B, H, Q, S] float32."""
  block, span, window, causal = geometry
  s_BxHxQxS = jnp.einsum("bhqd,bhkd->bhqk", q_BxHxQxD, _keys(k_t, block_index, geometry))
  ok_BxS = lax.dynamic_slice_in_dim(key_ok, block_index * block, span, axis=1)
  # Query i of the block sits at span position i + window: the band is |i + window - j| <= w.
  delta = (lax.broadcasted_iota(jnp.int32, (block, span), 0) + window
           - lax.broadcasted_iota(jnp.int32, (block, span), 1))
  band = (delta >= 0) & (delta <= window) if causal else jnp.abs(delta) <= window
  keep = ok_BxS[:, None, None, :] & band
  return jnp.where(keep, s_BxHxQxS, _MASKED_SCORE)


def _block_forward(q_BxHxQxD, block_index, k_t, v_t, key_ok, geometry):
  s = _scores(q_BxHxQxD, k_t, key_ok, block_index, geometry)
  row_max = jnp.max(s, axis=-1)  # [B, H, Q]
  # A row with a real key has a real maximum; a row without one has exactly the masked score.
  has_key = row_max > 0.5 * _MASKED_SCORE
  unnorm = jnp.exp(s - row_max[..., None])
  denom = jnp.sum(unnorm, axis=-1)
  acc = jnp.einsum("bhqk,bhkd->bhqd", unnorm, _keys(v_t, block_index, geometry))
  out = acc * jnp.where(has_key, 1.0 / denom, 0.0)[..., None]
  lse = jnp.where(has_key, row_max + jnp.log(denom), EMPTY_LSE)
  # The backward recomputes P = exp(score - lse); for a row without a key it must be 0, which
  # an lse of +1e30 gives (every score there is finite and far below it).
  lse_bwd = jnp.where(has_key, lse, -_MASKED_SCORE)
  return out, lse, lse_bwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _band_blocks(q_b, k_t, v_t, key_ok, geometry):
  """q_b [blocks, B, H, Q, D] against the laid-out k_t, v_t [B, H, N', D]:
  (out [blocks, B, H, Q, D], lse [blocks, B, H, Q]). Undifferentiated: FORWARD_UNROLL blocks a
  step."""
  return _forward_loop(q_b, k_t, v_t, key_ok, geometry, FORWARD_UNROLL)[0]


def _band_blocks_forward(q_b, k_t, v_t, key_ok, geometry):
  # Under differentiation one block a step: see FORWARD_UNROLL.
  return _forward_loop(q_b, k_t, v_t, key_ok, geometry, 1)


def _forward_loop(q_b, k_t, v_t, key_ok, geometry, unroll):
  def one_block(args):
    q_BxHxQxD, n = args
    return _block_forward(q_BxHxQxD, n, k_t, v_t, key_ok, geometry)

  # lax.map, `unroll` independent blocks a step.
  _, (out_b, lse_b, lse_bwd_b) = lax.scan(
      lambda carry, args: (carry, one_block(args)), None, (q_b, jnp.arange(q_b.shape[0])),
      unroll=unroll)
  return (out_b, lse_b), (q_b, k_t, v_t, key_ok, out_b, lse_bwd_b)


def _band_blocks_backward(geometry, residuals, cotangents):
  q_b, k_t, v_t, key_ok, out_b, lse_bwd_b = residuals
  dout_b, dlse_b = cotangents
  block, span, _, _ = geometry

  def one_block(carry, xs):
    dk_BxHxDxN, dv_BxHxDxN = carry
    q, out, dout, dlse, lse_bwd, n = xs
    p = jnp.exp(_scores(q, k_t, key_ok, n, geometry) - lse_bwd[..., None])  # [B, H, Q, S]
    # ds = P * (dP - (delta - dlse)), delta = rowsum(out * dout) (docs/design.md §2.2).
    delta = jnp.sum(out * dout, axis=-1) - dlse
    dp = jnp.einsum("bhqd,bhkd->bhqk", dout, _keys(v_t, n, geometry))
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("bhqk,bhkd->bhqd", ds, _keys(k_t, n, geometry))
    # Transposed spans [B, H, D, S]: see the module docstring.
    dv_span = jnp.einsum("bhdq,bhqk->bhdk", jnp.swapaxes(dout, -1, -2), p)
    dk_span = jnp.einsum("bhdq,bhqk->bhdk", jnp.swapaxes(q, -1, -2), ds)
    start = n * block

    def add(acc, grad):
      return lax.dynamic_update_slice_in_dim(
          acc, lax.dynamic_slice_in_dim(acc, start, span, axis=3) + grad, start, axis=3)

    return (add(dk_BxHxDxN, dk_span), add(dv_BxHxDxN, dv_span)), dq

  # zeros_like keeps k_t's type under shard_map (varying over the manual axes), as the carry must.
  zeros = jnp.zeros_like(jnp.swapaxes(k_t, -1, -2))  # [B, H, D, N']
  xs = (q_b, out_b, dout_b, dlse_b, lse_bwd_b, jnp.arange(q_b.shape[0]))
  (dk_t, dv_t), dq_b = lax.scan(one_block, (zeros, zeros), xs)
  return dq_b, jnp.swapaxes(dk_t, -1, -2), jnp.swapaxes(dv_t, -1, -2), None


_band_blocks.defvjp(_band_blocks_forward, _band_blocks_backward)


def band_attention_chunked(q, k, v, key_mask, *, window: int, causal: bool,
                           block: int | None = None):
  """Band attention over query blocks; see the module docstring and `band_reference.py`."""
  batch, seq, heads, head_dim = q.shape
  # A window past the sequence attends everything; clamping keeps the span no wider than needed.
  window = min(window, seq - 1)
  block = min(block or default_block(window), max(seq, 1))
  num_blocks = math.ceil(seq / block)
  pad_end = num_blocks * block - seq
  right = 0 if causal else window
  span = block + window + right

  # q: [B, N, H, D] -> [blocks, B, H, Q, D], float32, pre-scaled (N*D multiplies rather than one
  # per score), in one copy.
  q_b = jnp.pad(q.astype(jnp.float32) * (1.0 / math.sqrt(head_dim)),
                [(0, 0), (0, pad_end), (0, 0), (0, 0)])
  q_b = q_b.reshape(batch, num_blocks, block, heads, head_dim).transpose(1, 0, 3, 2, 4)

  def key_layout(x):
    # [B, N, H, D] -> [B, H, window + N + pad (+ window), D], float32, zero keys at the ends.
    x = jnp.pad(x.astype(jnp.float32), [(0, 0), (window, right + pad_end), (0, 0), (0, 0)])
    return x.transpose(0, 2, 1, 3)

  key_ok = jnp.pad(key_mask.astype(bool), [(0, 0), (window, right + pad_end)])
  out_b, lse_b = _band_blocks(q_b, key_layout(k), key_layout(v), key_ok,
                              (block, span, window, causal))
  out = out_b.transpose(1, 0, 3, 2, 4).reshape(batch, num_blocks * block, heads, head_dim)
  lse = lse_b.transpose(1, 2, 0, 3).reshape(batch, heads, num_blocks * block)
  return out[:, :seq].astype(q.dtype), lse[..., :seq]
