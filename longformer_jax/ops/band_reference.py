"""Dense reference for the *band kernel* interface shared by every band implementation.

A band kernel is the inner piece of Longformer attention (docs/design.md §2.1): undilated
sliding-window attention with a key-keep vector, returning the softmax's log-sum-exp so that
callers can merge it with other key sets (the global keys) and overwrite rows (the global
queries). Dilation, global attention and query padding are composed around it in
`longformer_jax.ops.attention` (the Pallas kernels also take dilation and the global keys
themselves: `band_pallas.band_attention_pallas(dilation=..., global_kv=...)`).

Contract, for q, k, v of shape [batch, seq, heads, head_dim] and key_mask [batch, seq] (bool):
  query i attends key j iff key_mask[b, j] and
    bidirectional: |i - j| <= window;   causal: 0 <= i - j <= window.
  scores = q_i . k_j / sqrt(head_dim), softmax in float32.
  returns out [batch, seq, heads, head_dim] (dtype of q) and lse [batch, heads, seq] (float32).
  A row with no key gets out = 0 and lse = EMPTY_LSE, and all its gradients are finite.
  Keys and values where key_mask is False must be finite: their probability of exactly 0 does
  not cancel NaN or inf in P @ V (`longformer_attention` zeroes padding before any band kernel).
  Differentiable w.r.t. q, k, v with cotangents for both out and lse.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The log-sum-exp of a row that attends nothing. Finite (not -inf) so that merging two empty
# parts with logaddexp, and differentiating through it, never produces NaN.
EMPTY_LSE = -1e30
# Added to the scores of masked keys: exp(score + _MASKED_SCORE - row_max) is exactly 0 in
# float32 whenever the row has one allowed key.
_MASKED_SCORE = -1e30


def band_mask(seq: int, window: int, causal: bool) -> jax.Array:
  """[seq, seq] bool: True where query i may attend key j inside the band."""
  i = jnp.arange(seq)[:, None]
  j = jnp.arange(seq)[None, :]
  if causal:
    return (i - j >= 0) & (i - j <= window)
  return jnp.abs(i - j) <= window


def masked_softmax_attention(q, k, v, mask_BxHxNxK):
  """Dense attention of q [B,N,H,D] over k, v [B,K,H,D] (K key rows) restricted to a boolean mask.

  The mask broadcasts against [B, H, N, K] (pass H = 1 to share it across heads).
  Returns (out [B,N,H,D] in q.dtype, lse [B,H,N] float32, probs [B,H,N,K] float32). Rows with no
  allowed key give out = 0, lse = EMPTY_LSE, probs = 0, with finite gradients.
  """
  scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1]))
  # Scaling q rather than the scores touches N*D instead of N*K elements.
  scores_BxHxNxK = jnp.einsum(
      "bnhd,bkhd->bhnk", q.astype(jnp.float32) * scale, k.astype(jnp.float32))
  # A finite bias rather than -inf: masked entries underflow to exactly 0 after exp, nothing
  # ever computes inf - inf, and the bias is built once per head group, not per head.
  scores_BxHxNxK = scores_BxHxNxK + jnp.where(mask_BxHxNxK, 0.0, _MASKED_SCORE)
  # The shift only guards exp() against overflow; softmax and lse = max + log(sum) are exact for
  # any constant shift, so it needs no gradient.
  row_max = jax.lax.stop_gradient(jnp.max(scores_BxHxNxK, axis=-1, keepdims=True))
  unnorm_BxHxNxK = jnp.exp(scores_BxHxNxK - row_max)
  denom_BxHxNx1 = jnp.sum(unnorm_BxHxNxK, axis=-1, keepdims=True)
  # In a row with no allowed key every score carries the bias, so the row is garbage (not NaN):
  # it is replaced by zeros on the small [.., N] side instead of masking the [.., N, K] side.
  has_key_BxHxN = jnp.broadcast_to(jnp.any(mask_BxHxNxK, axis=-1), denom_BxHxNx1.shape[:-1])
  inv_denom_BxHxN = jnp.where(has_key_BxHxN, 1.0 / denom_BxHxNx1[..., 0], 0.0)
  # Normalise the [N, D] output, not the [N, K] probabilities.
  out = jnp.einsum("bhnk,bkhd->bnhd", unnorm_BxHxNxK, v.astype(jnp.float32))
  out = out * inv_denom_BxHxN.transpose(0, 2, 1)[..., None]
  lse = jnp.where(has_key_BxHxN, row_max[..., 0] + jnp.log(denom_BxHxNx1[..., 0]), EMPTY_LSE)
  probs_BxHxNxK = unnorm_BxHxNxK * inv_denom_BxHxN[..., None]  # dead code unless asked for
  return out.astype(q.dtype), lse, probs_BxHxNxK


def band_attention_reference(q, k, v, key_mask, *, window: int, causal: bool):
  """The band kernel contract above, computed densely (O(seq^2)); for tests only."""
  seq = q.shape[1]
  mask_BxHxNxN = (band_mask(seq, window, causal)[None, None]
                  & key_mask.astype(bool)[:, None, None, :])
  out, lse, _ = masked_softmax_attention(q, k, v, mask_BxHxNxN)
  return out, lse
