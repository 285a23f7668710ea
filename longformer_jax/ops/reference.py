"""Dense reference for Longformer attention: plainly correct, O(seq^2), for tests only.

It builds the exact key set of docs/design.md §1 for every query as an [seq, seq] boolean mask
and runs an ordinary masked softmax. It shares nothing with the fast paths except the masked
softmax, so a bug in the chunked/Pallas composition (dilation reshapes, LSE merge, global scatter)
cannot hide behind the same bug here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from longformer_jax.ops.band_reference import masked_softmax_attention
from longformer_jax.ops.validation import validate_attention_args, zero_padding


def dilated_band_mask(seq: int, window: int, dilations, causal: bool) -> jax.Array:
  """[heads, seq, seq] bool: key j is in the band of query i for each head's dilation.

  Bidirectional: j = i + d*t for t in -w..w; causal: j = i - d*t for t in 0..w (paper §3.1,
  allenai's index formula i + D[h]*(k - w)).
  """
  # Capped at the sequence, which changes no key set (a step of seq or more leaves it) and keeps
  # both in int32.
  window = min(window, seq)
  d_Hx1x1 = jnp.asarray([min(d, max(seq, 1)) for d in dilations], jnp.int32)[:, None, None]
  delta_NxN = jnp.arange(seq)[:, None] - jnp.arange(seq)[None, :]  # i - j
  on_lattice = delta_NxN % d_Hx1x1 == 0
  steps = delta_NxN // d_Hx1x1
  if causal:
    return on_lattice & (steps >= 0) & (steps <= window)
  return on_lattice & (jnp.abs(steps) <= window)


def longformer_attention_reference(q, k, v, *, window: int, dilation=1, causal: bool = False,
                                   attention_mask=None, global_mask=None, global_qkv=None,
                                   return_probs: bool = False):
  """The op's reference implementation, with the op's arguments (see `longformer_attention`).

  With `return_probs=True` it returns (out, probs [batch, heads, seq, seq] float32): each query's
  attention probabilities over all keys (zero rows for padding queries); dense, for small inputs
  (e.g. `output_attentions`).
  """
  dilations, attention_mask, global_mask, global_qkv, num_global = validate_attention_args(
      q, k, v, window=window, dilation=dilation, causal=causal, attention_mask=attention_mask,
      global_mask=global_mask, global_qkv=global_qkv, max_global=q.shape[1])
  batch, seq, heads, _ = q.shape
  if not batch * seq * heads:  # nothing to attend: empty results, as from the op
    out = jnp.zeros(q.shape, q.dtype)
    return (out, jnp.zeros((batch, heads, seq, seq), jnp.float32)) if return_probs else out
  return dense_attention(q, k, v, window=window, dilations=dilations, causal=causal,
                         attention_mask=attention_mask, global_mask=global_mask,
                         global_qkv=global_qkv, num_global=num_global,
                         return_probs=return_probs)


def dense_attention(q, k, v, *, window: int, dilations, causal: bool, attention_mask,
                    global_mask, global_qkv, num_global: int, return_probs: bool = False):
  """Longformer attention computed densely, on arguments normalised by `validate_attention_args`.

  Args:
    q, k, v: [batch, seq, heads, head_dim].
    window: one-sided window.
    dilations: tuple with one int per head.
    causal: causal band (then there are no global tokens).
    attention_mask: [batch, seq] bool, True for real tokens.
    global_mask: [batch, seq] bool, True for global tokens (and-ed with attention_mask), or None.
    global_qkv: (q_g, k_g, v_g) or None when no token is global (or num_global is 0).
    num_global: the bound on global tokens per row; a row with more is NaN at its real queries
      (§1.4: a traced mask over a too-small max_global).
    return_probs: also return the attention probabilities [batch, heads, seq, seq] (float32) of
      each query over all keys; for `output_attentions` in small models.

  Returns:
    out [batch, seq, heads, head_dim] (dtype of q), and probs if asked.
  """
  seq = q.shape[1]
  # Padding positions zeroed by a select: masked keys get probability 0, but 0 * NaN is NaN.
  q, k, v, global_qkv = zero_padding(attention_mask, (q, k, v, global_qkv))
  band_HxNxN = dilated_band_mask(seq, window, dilations, causal)
  real_key_Bx1x1xN = attention_mask[:, None, None, :]
  # Non-global queries: the band plus every global key, each real key once (§2).
  local_mask = real_key_Bx1x1xN & band_HxNxN[None]
  if global_mask is not None:
    local_mask = local_mask | (real_key_Bx1x1xN & global_mask[:, None, None, :])
  out, _, probs = masked_softmax_attention(q, k, v, local_mask)
  if global_qkv is not None:
    # Global queries attend every real key, with their own projections.
    q_g, k_g, v_g = global_qkv
    out_g, _, probs_g = masked_softmax_attention(q_g, k_g, v_g, real_key_Bx1x1xN)
    is_global_q_BxNx1x1 = global_mask[:, :, None, None]
    out = jnp.where(is_global_q_BxNx1x1, out_g, out)
    probs = jnp.where(global_mask[:, None, :, None], probs_g, probs)
  if global_mask is not None:
    too_many_Bx1x1x1 = (jnp.sum(global_mask, axis=1) > num_global)[:, None, None, None]
    out = jnp.where(too_many_Bx1x1x1, jnp.nan, out)
    probs = jnp.where(too_many_Bx1x1x1, jnp.nan, probs)
  real_q_BxNx1x1 = attention_mask[:, :, None, None]
  out = jnp.where(real_q_BxNx1x1, out, jnp.zeros((), out.dtype))
  if return_probs:
    return out, jnp.where(attention_mask[:, None, :, None], probs, 0.0)
  return out
