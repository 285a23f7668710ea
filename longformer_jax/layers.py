"""Building blocks of a Longformer encoder in flax.nnx: embeddings, self-attention, encoder layer.

Each block takes the hyperparameters it needs, not the whole `LongformerConfig`; the models in
`longformer_jax.modeling` read the config and build them. Parameters carry logical axis names
("vocab", "embed", "heads", "kv", "mlp") in their `out_sharding` metadata, so a training mesh shards
them with rules given from outside (`nnx.logical_axis_rules`); without rules they are replicated.

Shapes: B batch, N sequence, D hidden, H heads, K head_dim, F intermediate, V vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from longformer_jax import ops

_ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # HF "gelu" is the erf form.
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}


def activation(name: str):
  """The activation function HF calls `name`."""
  if name not in _ACTIVATIONS:
    raise ValueError(f"hidden_act={name!r} is not one of {sorted(_ACTIVATIONS)}")
  return _ACTIVATIONS[name]


def logical_axes(*names: str | None) -> dict:
  """Variable metadata giving the logical axis name of each dimension.

  Flax shards a variable when it is created if a mesh is set (`jax.set_mesh`), mapping the names
  to mesh axes by `nnx.logical_axis_rules`; without a mesh the names are only recorded, for
  sharding from outside later (`nnx.get_partition_spec`).
  """
  mesh_set = not jax.sharding.get_abstract_mesh().empty
  return {"out_sharding": names, "eager_sharding": nnx.using_eager_sharding() and mesh_set}


def dense(in_features: int | Sequence[int], out_features: int | Sequence[int],
          axes: tuple[str | None, ...], *, stddev: float, dtype, param_dtype,
          rngs: nnx.Rngs) -> nnx.LinearGeneral:
  """A linear map with bias, HF's init (normal(stddev), zero bias) and logical axis names.

  `axes` names every kernel dimension, input dimensions first; the bias takes the output names.
  Several input dimensions (e.g. heads and head_dim) are contracted together.
  """
  in_shape = tuple(in_features) if isinstance(in_features, Sequence) else (in_features,)
  return nnx.LinearGeneral(
      in_shape, out_features, axis=tuple(range(-len(in_shape), 0)),
      kernel_init=nnx.initializers.normal(stddev),
      kernel_metadata=logical_axes(*axes),
      bias_metadata=logical_axes(*axes[len(in_shape):]),
      dtype=dtype, param_dtype=param_dtype, rngs=rngs)


def layer_norm(size: int, eps: float, *, dtype, param_dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
  # Statistics are computed in float32 by flax whatever `dtype` is.
  # Two-pass variance, as torch computes it: E[x^2] - E[x]^2 loses digits on small activations.
  return nnx.LayerNorm(size, epsilon=eps, use_fast_variance=False, dtype=dtype,
                       param_dtype=param_dtype,
                       scale_metadata=logical_axes("embed"), bias_metadata=logical_axes("embed"),
                       rngs=rngs)


def embed(num: int, size: int, axes: tuple[str | None, str], *, stddev: float, dtype,
          param_dtype, rngs: nnx.Rngs) -> nnx.Embed:
  return nnx.Embed(num, size, embedding_init=nnx.initializers.normal(stddev),
                   embedding_metadata=logical_axes(*axes),
                   dtype=dtype, param_dtype=param_dtype, rngs=rngs)


def roberta_position_ids(input_ids_BxN: jax.Array, pad_token_id: int) -> jax.Array:
  """RoBERTa position ids: real tokens count up from pad_token_id + 1, pad tokens get pad_token_id.

  Positions depend on the pad token, not on the attention mask, exactly as in HF (DESIGN.md §5).
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
    hidden_BxNxD = (self.word_embeddings(input_ids_BxN)
                    + self.position_embeddings(position_ids_BxN)
                    + self.token_type_embeddings(token_type_ids_BxN))
    return self.dropout(self.layer_norm(hidden_BxNxD))


class LongformerSelfAttention(nnx.Module):
  """Sliding-window + global self-attention (DESIGN.md §2), output projection included.

  Local projections `query, key, value` serve the band; `query_global, key_global, value_global`
  serve global tokens. The window is one-sided; `dilation` is an int or one int per head.
  """

  def __init__(self, hidden_size: int, num_heads: int, *, window: int,
               dilation: int | Sequence[int] = 1, causal: bool = False, impl: str = "auto",
               initializer_range: float = 0.02, dtype=None, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    if hidden_size % num_heads:
      raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}")
    head_dim = hidden_size // num_heads
    self.window = window
    self.dilation = dilation if isinstance(dilation, int) else tuple(dilation)
    self.causal = causal
    self.impl = impl
    init = dict(stddev=initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    in_axes = ("embed", "heads", "kv")
    self.query = dense(hidden_size, (num_heads, head_dim), in_axes, **init)
    self.key = dense(hidden_size, (num_heads, head_dim), in_axes, **init)
    self.value = dense(hidden_size, (num_heads, head_dim), in_axes, **init)
    self.query_global = dense(hidden_size, (num_heads, head_dim), in_axes, **init)
    self.key_global = dense(hidden_size, (num_heads, head_dim), in_axes, **init)
    self.value_global = dense(hidden_size, (num_heads, head_dim), in_axes, **init)
    self.output = dense((num_heads, head_dim), hidden_size, ("heads", "kv", "embed"), **init)

  def __call__(self, hidden_BxNxD, attention_mask_BxN, global_mask_BxN=None, *,
               max_global: int | None = None, output_attentions: bool = False):
    """Returns (output [B,N,D], probabilities [B,H,N,N] float32 if output_attentions else None).

    attention_mask: True for real tokens. global_mask: True for global tokens, or None (then the
    global projections are not computed). max_global: static bound on global tokens per row,
    needed by the op when global_mask is traced (see `ops.longformer_attention`).
    output_attentions runs the dense O(N^2) reference attention: for inspecting small inputs.
    """
    q_BxNxHxK = self.query(hidden_BxNxD)
    k_BxNxHxK = self.key(hidden_BxNxD)
    v_BxNxHxK = self.value(hidden_BxNxD)
    global_qkv = None
    if global_mask_BxN is not None:
      global_qkv = (self.query_global(hidden_BxNxD), self.key_global(hidden_BxNxD),
                    self.value_global(hidden_BxNxD))
    args = dict(window=self.window, dilation=self.dilation, causal=self.causal,
                attention_mask=attention_mask_BxN, global_mask=global_mask_BxN,
                global_qkv=global_qkv)
    probs_BxHxNxN = None
    if output_attentions:
      out_BxNxHxK, probs_BxHxNxN = ops.longformer_attention_reference(
          q_BxNxHxK, k_BxNxHxK, v_BxNxHxK, **args, return_probs=True)
    else:
      out_BxNxHxK = ops.longformer_attention(q_BxNxHxK, k_BxNxHxK, v_BxNxHxK, **args,
                                             impl=self.impl, max_global=max_global)
    return self.output(out_BxNxHxK), probs_BxHxNxN


class LongformerLayer(nnx.Module):
  """Post-LayerNorm transformer layer (as RoBERTa): attention, add & norm, MLP, add & norm."""

  def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, *, window: int,
               dilation: int | Sequence[int] = 1, causal: bool = False, impl: str = "auto",
               hidden_act: str = "gelu", layer_norm_eps: float = 1e-5,
               dropout_rate: float = 0.1, initializer_range: float = 0.02, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.act = activation(hidden_act)
    init = dict(stddev=initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    norm = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.attention = LongformerSelfAttention(
        hidden_size, num_heads, window=window, dilation=dilation, causal=causal, impl=impl,
        initializer_range=initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.attention_norm = layer_norm(hidden_size, layer_norm_eps, **norm)
    self.intermediate = dense(hidden_size, intermediate_size, ("embed", "mlp"), **init)
    self.output = dense(intermediate_size, hidden_size, ("mlp", "embed"), **init)
    self.output_norm = layer_norm(hidden_size, layer_norm_eps, **norm)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

  def __call__(self, hidden_BxNxD, attention_mask_BxN, global_mask_BxN=None, *,
               max_global: int | None = None, output_attentions: bool = False):
    """Returns (hidden [B,N,D], attention probabilities or None); see LongformerSelfAttention."""
    attn_BxNxD, probs = self.attention(hidden_BxNxD, attention_mask_BxN, global_mask_BxN,
                                       max_global=max_global,
                                       output_attentions=output_attentions)
    hidden_BxNxD = self.attention_norm(hidden_BxNxD + self.dropout(attn_BxNxD))
    mlp_BxNxD = self.output(self.act(self.intermediate(hidden_BxNxD)))
    return self.output_norm(hidden_BxNxD + self.dropout(mlp_BxNxD)), probs
