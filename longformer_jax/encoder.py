"""The Longformer encoder's building blocks in flax.nnx: RoBERTa embeddings and the post-LN layer.

Each block takes the hyperparameters it needs, not the whole `LongformerConfig`; the models in
`longformer_jax.modeling` read the config and build them. Parameter names follow HF's so that
`longformer_jax.convert` maps checkpoints one to one. Shape letters: the alphabet of
`longformer_jax.ops`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from longformer_jax.attention import LongformerSelfAttention
from longformer_jax.layers import activation, dense, embed, layer_norm


def roberta_position_ids(input_ids_BxN: jax.Array, pad_token_id: int) -> jax.Array:
  """RoBERTa position ids: real tokens count up from pad_token_id + 1, pad tokens get pad_token_id.

  Positions depend on the pad token, not on the attention mask, exactly as in HF
  (docs/design.md §5.3).
  """
  is_real_BxN = (input_ids_BxN != pad_token_id).astype(jnp.int32)
  return jnp.cumsum(is_real_BxN, axis=1) * is_real_BxN + pad_token_id


class LongformerEmbeddings(nnx.Module):
  """Word + RoBERTa position + token type embeddings, then LayerNorm and dropout."""

  def __init__(self, vocab_size: int, hidden_size: int, max_position_embeddings: int,
               type_vocab_size: int, *, pad_token_id: int, layer_norm_eps: float,
               dropout_rate: float, initializer_range: float, dtype, param_dtype,
               rngs: nnx.Rngs):
    self.pad_token_id = pad_token_id
    init = dict(stddev=initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.word_embeddings = embed(vocab_size, hidden_size, ("vocab", "embed"), **init)
    self.position_embeddings = embed(max_position_embeddings, hidden_size, (None, "embed"), **init)
    self.token_type_embeddings = embed(type_vocab_size, hidden_size, (None, "embed"), **init)
    self.layer_norm = layer_norm(hidden_size, layer_norm_eps, dtype=dtype,
                                 param_dtype=param_dtype, rngs=rngs)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

  def __call__(self, input_ids_BxN, token_type_ids_BxN=None, position_ids_BxN=None):
    if position_ids_BxN is None:
      position_ids_BxN = roberta_position_ids(input_ids_BxN, self.pad_token_id)
    if token_type_ids_BxN is None:
      token_type_ids_BxN = jnp.zeros_like(input_ids_BxN)
    hidden_BxNxE = (self.word_embeddings(input_ids_BxN)
                    + self.position_embeddings(position_ids_BxN)
                    + self.token_type_embeddings(token_type_ids_BxN))
    return self.dropout(self.layer_norm(hidden_BxNxE))


class LongformerLayer(nnx.Module):
  """Post-LayerNorm transformer layer (as RoBERTa): attention, add & norm, MLP, add & norm.

  mesh, seq_axis: for the attention op; global_projections: how global attention is projected
  (see `LongformerSelfAttention`).
  """

  def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, *, window: int,
               dilation: int | Sequence[int] = 1, causal: bool = False, impl: str = "auto",
               global_projections: str = "separate",
               hidden_act: str = "gelu", layer_norm_eps: float = 1e-5,
               dropout_rate: float = 0.1, initializer_range: float = 0.02, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs, mesh: jax.sharding.Mesh | None = None,
               seq_axis: str | None = None):
    self.act = activation(hidden_act)
    kernel_init = nnx.initializers.normal(initializer_range)  # HF's init
    init = dict(init=kernel_init, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    norm = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.attention = LongformerSelfAttention(
        hidden_size, num_heads, window=window, dilation=dilation, causal=causal, impl=impl,
        global_projections=global_projections, kernel_init=kernel_init, dtype=dtype,
        param_dtype=param_dtype, rngs=rngs, mesh=mesh, seq_axis=seq_axis)
    self.attention_norm = layer_norm(hidden_size, layer_norm_eps, **norm)
    self.intermediate = dense(hidden_size, intermediate_size, ("embed", "mlp"), **init)
    self.output = dense(intermediate_size, hidden_size, ("mlp", "embed"), **init)
    self.output_norm = layer_norm(hidden_size, layer_norm_eps, **norm)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

  def __call__(self, hidden_BxNxE, attention_mask_BxN, global_mask_BxN=None, *,
               max_global: int | None = None, output_attentions: bool = False):
    """Returns (hidden [B,N,E], attention probabilities or None); see LongformerSelfAttention."""
    attn_BxNxE, probs = self.attention(hidden_BxNxE, attention_mask_BxN, global_mask_BxN,
                                       max_global=max_global,
                                       output_attentions=output_attentions)
    hidden_BxNxE = self.attention_norm(hidden_BxNxE + self.dropout(attn_BxNxE))
    mlp_BxNxE = self.output(self.act(self.intermediate(hidden_BxNxE)))
    return self.output_norm(hidden_BxNxE + self.dropout(mlp_BxNxE)), probs
