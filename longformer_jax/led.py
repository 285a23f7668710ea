"""LED, the Longformer-Encoder-Decoder (paper §6), in Flax NNX: `LEDModel`,
`LEDForConditionalGeneration` and `LEDForQuestionAnswering`.

LED is BART with Longformer self-attention in the encoder, so that the encoder reads 16K-token
documents: every encoder layer is the project's `LongformerLayer` (band + global attention with
its own global projections, post-LN), and the decoder is BART's (causal self-attention, then
cross-attention over the encoder output, then the MLP; post-LN). Token embeddings are one table
shared by encoder, decoder and the tied LM head, and are not scaled; positions are learned tables
used WITHOUT BART's two offset rows (`convert.bart_to_led` drops them). The models compute what HF
transformers' classes of the same names compute (tests/test_led.py: 1e-5 in float32), with these
interface differences:
  * `LEDConfig.attention_window` is one-sided (docs/design.md §3);
  * encoder inputs of any length up to `max_encoder_position_embeddings`: the attention op pads
    internally and slices off, so the caller never sees padding to a multiple of the window
    (HF pads to a multiple of its largest window and cuts the outputs back);
  * a global token on padding is a ValueError when the masks are concrete (HF silently drops it);
    under jit it is dropped, as in `LongformerModel`;
  * heads return logits, not losses; no `output_attentions`;
  * decoding uses a static-shape cache (below) instead of HF's growing one.

Decoding. `encode` runs the encoder once; `init_cache(encoder_hidden_states, mask, max_length=M)`
projects the encoder output into every decoder layer's cross-attention keys and values once and
allocates self-attention key/value slots for M decoder positions; `decode_step(ids, cache)` (or
`decode(ids, cache=cache)` on the base model) embeds T new tokens at positions `cache.index ..
cache.index + T - 1`, writes their keys and values into the slots, attends over the slots written
so far, and returns the logits and the cache with `index` advanced by T. Every shape is fixed by
(batch, M, encoder length), so one compiled step serves a whole `lax.while_loop` generation.

Generation. `LEDForConditionalGeneration.generate` is HF's `generate` (greedy, sampling, beam
search; HF's outputs token for token, tests/test_led_generate.py): the encoder once, then the
search of `longformer_jax.search` over `decode_step` in one jitted `lax.while_loop`. Beam search
decodes B * J rows whose self-attention caches are reordered every step
(`LEDDecoderCache.reorder_rows`) while the J beams of an item share its cross-attention keys and
values (stored at B rows).

Shape letters: the alphabet of `longformer_jax.ops`; here N counts encoder tokens, T the
decoder tokens of a call, K the keys of an attention (encoder tokens in cross-attention, decoder
tokens or cache slots in self-attention) and E is d_model.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longformer_jax import search
from longformer_jax.config import LEDConfig
from longformer_jax.encoder import LongformerLayer
from longformer_jax.generation import SamplingConfig
from longformer_jax.layers import activation, dense, embed, layer_norm, logical_axes, maybe_remat
from longformer_jax.modeling import check_ids
from longformer_jax.ops.validation import check_index_values, check_mask_values, is_traced
from longformer_jax.pretrained import HFCheckpointMixin

# torch.nn.LayerNorm's default: HF's LED builds every LayerNorm without an eps argument.
LAYER_NORM_EPS = 1e-5


# ----------------------------------------------------------------------------------------------
# Outputs and the decoding cache.


@flax.struct.dataclass
class LEDEncoderOutput:
  last_hidden_state: jax.Array  # [B, N, E]
  hidden_states: tuple[jax.Array, ...] | None = None  # embeddings + every layer, each [B, N, E]


@flax.struct.dataclass
class LEDLayerCache:
  """One decoder layer's keys and values. Slots at and after the cache's `index` hold zeros (or
  stale values) and are never attended.

  R, the decoding rows, is B, or B * J for a beam search (row b * J + j: beam j of batch item b);
  the encoder side stays at B rows, shared by an item's J beams (`LEDDecoderLayer`). Keys and
  values are heads-major, the layout the attention contracts (`LEDDecoderAttention.key_value`)."""
  self_key: jax.Array  # [R, H, K, D], K = max_length
  self_value: jax.Array  # [R, H, K, D]
  cross_key: jax.Array  # [B, H, N, D]: the encoder output through this layer's k_proj, once
  cross_value: jax.Array  # [B, H, N, D]


@flax.struct.dataclass
class LEDDecoderCache:
  """Everything a decoding step needs besides the new tokens: a pytree of fixed shapes."""
  layers: tuple[LEDLayerCache, ...]
  encoder_mask: jax.Array  # [B, N] bool: the cross-attention keys that are real tokens
  index: jax.Array  # int32 []: decoder positions written so far = position of the next token

  @property
  def max_length(self) -> int:
    return self.layers[0].self_key.shape[2]

  @property
  def rows(self) -> int:
    """R: decoding rows (batch * beams)."""
    return self.layers[0].self_key.shape[0]

  def reorder_rows(self, rows_R: jax.Array) -> LEDDecoderCache:
    """Row r takes row rows_R[r]'s self-attention keys and values (beam search: each beam
    continues from the one it extends). `rows_R` must stay within each batch item's J rows: the
    cross-attention keys and values, one copy per item, are not moved."""
    layers = tuple(layer.replace(self_key=layer.self_key[rows_R],
                                 self_value=layer.self_value[rows_R]) for layer in self.layers)
    return self.replace(layers=layers)


@flax.struct.dataclass
class LEDDecoderOutput:
  last_hidden_state: jax.Array  # [B, T, E]
  cache: LEDDecoderCache | None = None  # the updated cache when one was given
  hidden_states: tuple[jax.Array, ...] | None = None  # embeddings + every layer, each [B, T, E]


@flax.struct.dataclass
class LEDSeq2SeqModelOutput:
  last_hidden_state: jax.Array  # decoder output [B, T, E]
  encoder_last_hidden_state: jax.Array  # [B, N, E]
  decoder_hidden_states: tuple[jax.Array, ...] | None = None
  encoder_hidden_states: tuple[jax.Array, ...] | None = None


@flax.struct.dataclass
class LEDSeq2SeqLMOutput:
  logits: jax.Array  # [B, T, V]
  encoder_last_hidden_state: jax.Array  # [B, N, E]
  decoder_hidden_states: tuple[jax.Array, ...] | None = None
  encoder_hidden_states: tuple[jax.Array, ...] | None = None


@flax.struct.dataclass
class LEDSeq2SeqQuestionAnsweringOutput:
  start_logits: jax.Array  # [B, T]
  end_logits: jax.Array  # [B, T]
  encoder_last_hidden_state: jax.Array  # [B, N, E]
  decoder_hidden_states: tuple[jax.Array, ...] | None = None
  encoder_hidden_states: tuple[jax.Array, ...] | None = None


def shift_tokens_right(input_ids_BxT: jax.Array, pad_token_id: int,
                       decoder_start_token_id: int) -> jax.Array:
  """Teacher-forcing decoder inputs: the decoder start token, then the ids without the last one
  (label padding -100 becomes the pad token), as HF's `shift_tokens_right`."""
  ids_BxT = jnp.asarray(input_ids_BxT)
  start_Bx1 = jnp.full((ids_BxT.shape[0], 1), decoder_start_token_id, ids_BxT.dtype)
  shifted_BxT = jnp.concatenate([start_Bx1, ids_BxT[:, :-1]], axis=1)
  return jnp.where(shifted_BxT == -100, pad_token_id, shifted_BxT)


# ----------------------------------------------------------------------------------------------
# Layers.


class LEDDecoderAttention(nnx.Module):
  """BART's multi-head attention (decoder self- and cross-attention): dense, float32 softmax.

  The keys and values are projected by the caller through `key_value` (from the new tokens, the
  cache or the encoder output), so that the same module serves the full forward and decoding.
  """

  def __init__(self, d_model: int, num_heads: int, *, init, dtype, param_dtype, rngs: nnx.Rngs):
    head_dim = d_model // num_heads
    args = dict(init=init, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    proj = lambda: dense(d_model, (num_heads, head_dim), ("embed", "heads", "kv"), **args)
    self.q_proj, self.k_proj, self.v_proj = proj(), proj(), proj()
    self.out_proj = dense((num_heads, head_dim), d_model, ("heads", "kv", "embed"), **args)

  def key_value(self, x_BxKxE: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys and values [B, H, K, D], heads-major: the layout the attention contracts, so that a
    cache holding them is read in place. (Cached [B, K, H, D], they were transposed at every
    decoding step: cross-attention over 16K encoder tokens was ~4x slower on CPU.)"""
    heads_major = lambda x_BxKxHxD: x_BxKxHxD.transpose(0, 2, 1, 3)
    return heads_major(self.k_proj(x_BxKxE)), heads_major(self.v_proj(x_BxKxE))

  def __call__(self, hidden_BxTxE, key_BxHxKxD, value_BxHxKxD, mask_Bx1xTxK=None):
    """mask: True where query t may attend key s (broadcast over heads; None: every key).

    What `jax.nn.dot_product_attention` computes (XLA path), on heads-major keys: scores
    accumulated and softmaxed in float32 whatever the input dtype, masked keys at a large
    negative number, so that a row with no key left gets a uniform average instead of NaN (HF's
    min-value mask does the same; with the masks built here only decoder padding rows can have
    none)."""
    q_BxTxHxD = self.q_proj(hidden_BxTxE)
    scores_BxHxTxK = jnp.einsum("bthd,bhsd->bhts", q_BxTxHxD, key_BxHxKxD,
                                preferred_element_type=jnp.float32)
    scores_BxHxTxK = scores_BxHxTxK * (1.0 / np.sqrt(q_BxTxHxD.shape[-1])).astype(np.float32)
    if mask_Bx1xTxK is not None:
      large_negative = -0.7 * np.finfo(np.float32).max
      scores_BxHxTxK = jnp.where(mask_Bx1xTxK, scores_BxHxTxK, large_negative)
    probs_BxHxTxK = jax.nn.softmax(scores_BxHxTxK, axis=-1).astype(value_BxHxKxD.dtype)
    out_BxTxHxD = jnp.einsum("bhts,bhsd->bthd", probs_BxHxTxK, value_BxHxKxD)
    return self.out_proj(out_BxTxHxD)


class LEDDecoderLayer(nnx.Module):
  """BART's post-LN decoder layer: causal self-attention, cross-attention, MLP, each followed by
  dropout, the residual add and a LayerNorm."""

  def __init__(self, config: LEDConfig, *, rngs: nnx.Rngs):
    c = config
    init = nnx.initializers.normal(c.init_std)
    dtypes = dict(dtype=c.dtype, param_dtype=c.param_dtype)
    attention = lambda: LEDDecoderAttention(c.d_model, c.decoder_attention_heads, init=init,
                                            **dtypes, rngs=rngs)
    norm = lambda: layer_norm(c.d_model, LAYER_NORM_EPS, **dtypes, rngs=rngs)
    self.self_attn, self.self_attn_layer_norm = attention(), norm()
    self.encoder_attn, self.encoder_attn_layer_norm = attention(), norm()
    self.fc1 = dense(c.d_model, c.decoder_ffn_dim, ("embed", "mlp"), init=init, **dtypes,
                     rngs=rngs)
    self.fc2 = dense(c.decoder_ffn_dim, c.d_model, ("mlp", "embed"), init=init, **dtypes,
                     rngs=rngs)
    self.final_layer_norm = norm()
    self.act = activation(c.activation_function)
    self.dropout = nnx.Dropout(c.dropout, rngs=rngs)

  def __call__(self, hidden_BxTxE, self_mask_Bx1xTxK, cross_mask_Bx1x1xN, encoder_BxNxE,
               cache: LEDLayerCache | None, index):
    """Returns (hidden [B, T, E], the layer's updated cache or None).

    Without a cache the keys are the T tokens themselves and the cross keys come from
    `encoder_BxNxE`; with one, the T new keys/values are written at slots index..index+T-1 and
    the cross keys/values are the cached ones.
    """
    key_BxHxKxD, value_BxHxKxD = self.self_attn.key_value(hidden_BxTxE)
    if cache is None:
      cross_key_BxHxNxD, cross_value_BxHxNxD = self.encoder_attn.key_value(encoder_BxNxE)
    else:
      start = (0, 0, index, 0)
      key_BxHxKxD = jax.lax.dynamic_update_slice(
          cache.self_key, key_BxHxKxD.astype(cache.self_key.dtype), start)
      value_BxHxKxD = jax.lax.dynamic_update_slice(
          cache.self_value, value_BxHxKxD.astype(cache.self_value.dtype), start)
      cache = cache.replace(self_key=key_BxHxKxD, self_value=value_BxHxKxD)
      cross_key_BxHxNxD, cross_value_BxHxNxD = cache.cross_key, cache.cross_value
    attn_BxTxE = self.self_attn(hidden_BxTxE, key_BxHxKxD, value_BxHxKxD, self_mask_Bx1xTxK)
    hidden_BxTxE = self.self_attn_layer_norm(hidden_BxTxE + self.dropout(attn_BxTxE))
    # A beam search's J rows per batch item (b * J + j) share the item's encoder keys, stored
    # once: they attend as one row of J * T queries ([B * J, T, E] -> [B, J * T, E]), the same
    # attention since cross-attention has no causal mask.
    grouped_BxJTxE = hidden_BxTxE.reshape(cross_key_BxHxNxD.shape[0], -1, hidden_BxTxE.shape[-1])
    attn_BxTxE = self.encoder_attn(grouped_BxJTxE, cross_key_BxHxNxD, cross_value_BxHxNxD,
                                   cross_mask_Bx1x1xN).reshape(hidden_BxTxE.shape)
    hidden_BxTxE = self.encoder_attn_layer_norm(hidden_BxTxE + self.dropout(attn_BxTxE))
    mlp_BxTxE = self.fc2(self.act(self.fc1(hidden_BxTxE)))
    return self.final_layer_norm(hidden_BxTxE + self.dropout(mlp_BxTxE)), cache


class _Embeddings(nnx.Module):
  """Learned positions (row i for position i: no offset) added to the token embeddings, then
  LayerNorm and dropout: the input stage of both encoder and decoder."""

  def __init__(self, config: LEDConfig, max_positions: int, *, rngs: nnx.Rngs):
    c = config
    dtypes = dict(dtype=c.dtype, param_dtype=c.param_dtype)
    self.embed_positions = embed(max_positions, c.d_model, (None, "embed"), stddev=c.init_std,
                                 **dtypes, rngs=rngs)
    self.layernorm_embedding = layer_norm(c.d_model, LAYER_NORM_EPS, **dtypes, rngs=rngs)
    self.dropout = nnx.Dropout(c.dropout, rngs=rngs)

  def embed_inputs(self, tokens_BxTxE: jax.Array, positions_T: jax.Array):
    """tokens: the shared table's rows of the ids (the caller looks them up: a module is never a
    positional argument of another's call, which `nnx.tabulate` cannot display)."""
    hidden_BxTxE = tokens_BxTxE + self.embed_positions(positions_T)[None]
    return self.dropout(self.layernorm_embedding(hidden_BxTxE))


class LEDEncoder(_Embeddings):
  """Embeddings, then `encoder_layers` Longformer layers (each with its own window)."""

  def __init__(self, config: LEDConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None, seq_axis: str | None = None):
    super().__init__(config, config.max_encoder_position_embeddings, rngs=rngs)
    c = config
    self.remat = c.remat
    self.layers = nnx.List([
        LongformerLayer(c.d_model, c.encoder_attention_heads, c.encoder_ffn_dim, window=window,
                        impl=c.attention_impl, hidden_act=c.activation_function,
                        layer_norm_eps=LAYER_NORM_EPS, dropout_rate=c.dropout,
                        initializer_range=c.init_std, dtype=c.dtype,
                        param_dtype=c.param_dtype, rngs=rngs, mesh=mesh, seq_axis=seq_axis)
        for window in c.layer_windows])

  def __call__(self, tokens_BxNxE, mask_BxN, global_BxN, *, max_global: int | None,
               output_hidden_states: bool) -> LEDEncoderOutput:
    hidden_BxNxE = self.embed_inputs(tokens_BxNxE, jnp.arange(tokens_BxNxE.shape[1]))

    def run_layer(layer, hidden_BxNxE, mask_BxN, global_BxN):
      return layer(hidden_BxNxE, mask_BxN, global_BxN, max_global=max_global)[0]

    run_layer = maybe_remat(run_layer, self.remat)
    all_hidden = [hidden_BxNxE]
    for layer in self.layers:
      hidden_BxNxE = run_layer(layer, hidden_BxNxE, mask_BxN, global_BxN)
      all_hidden.append(hidden_BxNxE)
    return LEDEncoderOutput(hidden_BxNxE,
                            tuple(all_hidden) if output_hidden_states else None)


class LEDDecoder(_Embeddings):
  """Embeddings, then `decoder_layers` BART decoder layers; with or without a cache."""

  def __init__(self, config: LEDConfig, *, rngs: nnx.Rngs):
    super().__init__(config, config.max_decoder_position_embeddings, rngs=rngs)
    self.remat = config.remat
    self.layers = nnx.List([LEDDecoderLayer(config, rngs=rngs)
                            for _ in range(config.decoder_layers)])

  def __call__(self, tokens_BxTxE, encoder_BxNxE, encoder_mask_BxN, decoder_mask_BxT,
               cache: LEDDecoderCache | None, *, output_hidden_states: bool) -> LEDDecoderOutput:
    num_new = tokens_BxTxE.shape[1]
    if cache is None:
      index = 0
      positions_T = jnp.arange(num_new)
      # Causal: query t sees keys s <= t, and only real decoder tokens.
      self_mask_Bx1xTxK = jnp.tril(jnp.ones((num_new, num_new), bool))[None, None]
      if decoder_mask_BxT is not None:
        self_mask_Bx1xTxK = self_mask_Bx1xTxK & decoder_mask_BxT[:, None, None, :]
      layer_caches = (None,) * len(self.layers)
    else:
      index = cache.index
      positions_T = index + jnp.arange(num_new)
      # Query at position p sees the slots 0..p: the earlier steps' and this call's up to itself.
      slots_K = jnp.arange(cache.max_length)
      self_mask_Bx1xTxK = (slots_K[None, :] <= positions_T[:, None])[None, None]
      encoder_mask_BxN = cache.encoder_mask
      layer_caches = cache.layers
    cross_mask_Bx1x1xN = (None if encoder_mask_BxN is None
                          else encoder_mask_BxN[:, None, None, :])
    hidden_BxTxE = self.embed_inputs(tokens_BxTxE, positions_T)

    def run_layer(layer, hidden_BxTxE, self_mask, cross_mask, encoder_BxNxE, layer_cache, index):
      return layer(hidden_BxTxE, self_mask, cross_mask, encoder_BxNxE, layer_cache, index)

    run_layer = maybe_remat(run_layer, self.remat)
    all_hidden, new_caches = [hidden_BxTxE], []
    for layer, layer_cache in zip(self.layers, layer_caches):
      hidden_BxTxE, layer_cache = run_layer(layer, hidden_BxTxE, self_mask_Bx1xTxK,
                                            cross_mask_Bx1x1xN, encoder_BxNxE, layer_cache, index)
      all_hidden.append(hidden_BxTxE)
      new_caches.append(layer_cache)
    if cache is not None:
      cache = cache.replace(layers=tuple(new_caches), index=cache.index + num_new)
    return LEDDecoderOutput(hidden_BxTxE, cache,
                            tuple(all_hidden) if output_hidden_states else None)


# ----------------------------------------------------------------------------------------------
# Models.


def _bool_mask(name: str, mask, shape: tuple[int, ...], like: str) -> jax.Array | None:
  """`mask != 0`, after checking it has the shape of the array called `like` and, when it is
  concrete, that it holds only 0 and 1 (`check_mask_values`; under jit nonzero counts as 1)."""
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  if mask.shape != shape:
    raise ValueError(f"{name} has shape {mask.shape}; expected the shape of {like}, {shape}")
  check_mask_values(name, mask)
  return mask != 0


def _encoder_inputs(config: LEDConfig, input_ids, attention_mask, global_attention_mask
                    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """(ids [B, N], attention mask [B, N] bool (default all real), global mask [B, N] bool or
  None), checked: N fits the encoder's position table, the masks have the ids' shape and, when
  they are concrete, no global token is padding."""
  ids_BxN = check_ids(input_ids, 2, "[batch, seq]")
  check_index_values("input_ids", ids_BxN, config.vocab_size, f"vocab_size={config.vocab_size}")
  shape = ids_BxN.shape
  if shape[1] > config.max_encoder_position_embeddings:
    raise ValueError(f"input_ids has {shape[1]} tokens; the encoder's position table holds "
                     f"max_encoder_position_embeddings={config.max_encoder_position_embeddings}")
  mask_BxN = _bool_mask("attention_mask", attention_mask, shape, "input_ids")
  mask_BxN = jnp.ones(shape, bool) if mask_BxN is None else mask_BxN
  global_BxN = _bool_mask("global_attention_mask", global_attention_mask, shape, "input_ids")
  if global_BxN is not None and not (is_traced(global_BxN) or is_traced(mask_BxN)):
    # Reduced to scalars on the device: the masks may be global arrays sharded over processes.
    on_padding_BxN = global_BxN & ~mask_BxN
    count = int(jnp.sum(on_padding_BxN))
    if count:
      row, position = divmod(int(jnp.argmax(on_padding_BxN.reshape(-1))), shape[1])
      raise ValueError(
          f"global_attention_mask marks {count} padding token(s), the first at row {row}, "
          f"position {position} (attention_mask 0 there); a padding token cannot be global")
  return ids_BxN, mask_BxN, global_BxN


def _max_global(global_BxN: jax.Array) -> int:
  """The most global tokens in any row (concrete masks only): the static bound `encode` needs."""
  return int(jnp.max(jnp.sum(global_BxN, axis=1), initial=0))


class LEDModel(HFCheckpointMixin, nnx.Module):
  """The encoder-decoder: a shared token embedding, the Longformer encoder, the BART decoder.

  mesh, seq_axis: handed to every encoder attention layer (see `LongformerSelfAttention`); the
  decoder's dense attention is plain XLA, which GSPMD partitions by itself.
  """

  def __init__(self, config: LEDConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None, seq_axis: str | None = None):
    self.config = config
    self.shared = embed(config.vocab_size, config.d_model, ("vocab", "embed"),
                        stddev=config.init_std, dtype=config.dtype,
                        param_dtype=config.param_dtype, rngs=rngs)
    self.encoder = LEDEncoder(config, rngs=rngs, mesh=mesh, seq_axis=seq_axis)
    self.decoder = LEDDecoder(config, rngs=rngs)

  def encode(self, input_ids, attention_mask=None, global_attention_mask=None, *,
             max_global: int | None = None,
             output_hidden_states: bool = False) -> LEDEncoderOutput:
    """Runs the encoder.

    Args:
      input_ids: [B, N] token ids, N <= config.max_encoder_position_embeddings (any N: no
        padding to a multiple of the window is needed).
      attention_mask: [B, N], 1 for real tokens, 0 for padding; default all real.
      global_attention_mask: [B, N], 1 for tokens with global attention (the paper puts it on
        the first token for summarization); default none. Must not mark padding.
      max_global: static bound on global tokens per row, needed under jit with a global mask.

    Token ids (here and in `decode`) must be in [0, vocab_size): a concrete id outside is a
    ValueError naming it and its position; under jit it is not checked and its embedding, and
    so the outputs it reaches, are NaN (`layers.Embed`), as in every model of the library.
    """
    ids_BxN, mask_BxN, global_BxN = _encoder_inputs(self.config, input_ids, attention_mask,
                                                    global_attention_mask)
    if global_BxN is not None:
      if max_global is None and not is_traced(global_BxN):
        max_global = _max_global(global_BxN)
      global_BxN = global_BxN & mask_BxN  # under jit: a padding token is never global
    return self.encoder(self.shared(ids_BxN), mask_BxN, global_BxN, max_global=max_global,
                        output_hidden_states=output_hidden_states)

  def init_cache(self, encoder_hidden_states, encoder_attention_mask=None, *,
                 max_length: int, num_beams: int = 1) -> LEDDecoderCache:
    """The decoding cache for `max_length` decoder positions, from the encoder output [B, N, E]:
    every layer's cross-attention keys and values are computed here, once. With num_beams = J
    the cache decodes B * J rows (row b * J + j: beam j of item b) that share their item's
    cross-attention keys and values (kept at B rows)."""
    c = self.config
    if not isinstance(max_length, int) or not 1 <= max_length <= c.max_decoder_position_embeddings:
      raise ValueError(f"max_length={max_length!r} must be an int in [1, "
                       f"max_decoder_position_embeddings={c.max_decoder_position_embeddings}]")
    search.check_int("num_beams", num_beams, 1)
    encoder_BxNxE = jnp.asarray(encoder_hidden_states)
    batch, num_encoder = encoder_BxNxE.shape[:2]
    mask_BxN = _bool_mask("encoder_attention_mask", encoder_attention_mask, (batch, num_encoder),
                          "the encoder output's first two axes")
    layers = []
    for layer in self.decoder.layers:
      cross_key_BxHxNxD, cross_value_BxHxNxD = layer.encoder_attn.key_value(encoder_BxNxE)
      _, heads, _, head_dim = cross_key_BxHxNxD.shape
      slots_RxHxKxD = jnp.zeros((batch * num_beams, heads, max_length, head_dim),
                                cross_key_BxHxNxD.dtype)
      layers.append(LEDLayerCache(slots_RxHxKxD, slots_RxHxKxD, cross_key_BxHxNxD,
                                  cross_value_BxHxNxD))
    return LEDDecoderCache(
        layers=tuple(layers),
        encoder_mask=jnp.ones((batch, num_encoder), bool) if mask_BxN is None else mask_BxN,
        index=jnp.zeros((), jnp.int32))

  def decode(self, decoder_input_ids, encoder_hidden_states=None, encoder_attention_mask=None,
             decoder_attention_mask=None, *, cache: LEDDecoderCache | None = None,
             output_hidden_states: bool = False) -> LEDDecoderOutput:
    """Runs the decoder: over a whole sequence (no cache), or on the next tokens of a cache.

    Args:
      decoder_input_ids: [B, T] token ids; without a cache T <= max_decoder_position_embeddings,
        with one the tokens sit at positions cache.index .. cache.index + T - 1.
      encoder_hidden_states, encoder_attention_mask: [B, N, E] and [B, N] (no cache only: a
        cache holds the projected encoder output and its mask).
      decoder_attention_mask: [B, T], 0 for decoder padding keys (no cache only).
      cache: from `init_cache` or a previous call; the output carries the updated one.
    """
    c = self.config
    ids_BxT = check_ids(decoder_input_ids, 2, "[batch, decoder_seq]")
    check_index_values("decoder_input_ids", ids_BxT, c.vocab_size, f"vocab_size={c.vocab_size}")
    batch, num_new = ids_BxT.shape
    if cache is None:
      if encoder_hidden_states is None:
        raise ValueError("decode needs encoder_hidden_states, or a cache from init_cache")
      if num_new > c.max_decoder_position_embeddings:
        raise ValueError(
            f"decoder_input_ids has {num_new} tokens; the decoder's position table holds "
            f"max_decoder_position_embeddings={c.max_decoder_position_embeddings}")
      encoder_BxNxE = jnp.asarray(encoder_hidden_states)
      encoder_mask_BxN = _bool_mask("encoder_attention_mask", encoder_attention_mask,
                                    encoder_BxNxE.shape[:2], "the encoder output's first two axes")
      decoder_mask_BxT = _bool_mask("decoder_attention_mask", decoder_attention_mask,
                                    ids_BxT.shape, "decoder_input_ids")
    else:
      if any(x is not None for x in (encoder_hidden_states, encoder_attention_mask,
                                     decoder_attention_mask)):
        raise ValueError("with a cache, decode takes only the new decoder_input_ids: the "
                         "encoder output and its mask are in the cache, and cached decoding "
                         "has no decoder padding")
      if cache.rows != batch:
        raise ValueError(f"decoder_input_ids has batch {batch}; the cache was built for batch "
                         f"{cache.rows}")
      position = "cache.index" if is_traced(cache.index) else int(cache.index)
      if num_new > cache.max_length or (
          isinstance(position, int) and position + num_new > cache.max_length):
        raise ValueError(f"{num_new} new decoder tokens at position {position} do not fit the "
                         f"cache's max_length={cache.max_length}")
      encoder_BxNxE = encoder_mask_BxN = decoder_mask_BxT = None
    return self.decoder(self.shared(ids_BxT), encoder_BxNxE, encoder_mask_BxN, decoder_mask_BxT,
                        cache, output_hidden_states=output_hidden_states)

  def __call__(self, input_ids, attention_mask=None, decoder_input_ids=None,
               decoder_attention_mask=None, *, global_attention_mask=None,
               encoder_outputs: LEDEncoderOutput | None = None, max_global: int | None = None,
               output_hidden_states: bool = False) -> LEDSeq2SeqModelOutput:
    """Encoder, then decoder over the whole decoder input (teacher forcing).

    decoder_input_ids default: `shift_tokens_right(input_ids)` (HF's default). encoder_outputs:
    reuse an `encode` result instead of encoding input_ids again (input_ids may then be None if
    decoder_input_ids are given). Other arguments: `encode` and `decode`.
    """
    c = self.config
    if encoder_outputs is None:
      encoder_outputs = self.encode(input_ids, attention_mask, global_attention_mask,
                                    max_global=max_global,
                                    output_hidden_states=output_hidden_states)
    if decoder_input_ids is None:
      if input_ids is None:
        raise ValueError("give decoder_input_ids, or input_ids to shift right into them")
      decoder_input_ids = shift_tokens_right(check_ids(input_ids, 2, "[batch, seq]"),
                                             c.pad_token_id, c.decoder_start_token_id)
    decoded = self.decode(decoder_input_ids, encoder_outputs.last_hidden_state, attention_mask,
                          decoder_attention_mask, output_hidden_states=output_hidden_states)
    return LEDSeq2SeqModelOutput(decoded.last_hidden_state, encoder_outputs.last_hidden_state,
                                 decoded.hidden_states, encoder_outputs.hidden_states)


class LEDForConditionalGeneration(HFCheckpointMixin, nnx.Module):
  """LEDModel + the LM head: the shared embedding matrix (tied, as in HF) plus `final_logits_bias`.

  HF keeps `final_logits_bias` as a buffer (loaded, never trained); it is a Param here so that
  checkpoints carry it: leave it out of the optimizer to fine-tune as HF does.
  """

  def __init__(self, config: LEDConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None, seq_axis: str | None = None):
    self.config = config
    self.led = LEDModel(config, rngs=rngs, mesh=mesh, seq_axis=seq_axis)
    self.final_logits_bias = nnx.Param(jnp.zeros((config.vocab_size,), config.param_dtype),
                                       **logical_axes("vocab"))

  def lm_logits(self, hidden_BxTxE: jax.Array) -> jax.Array:
    shared = self.led.shared
    hidden_BxTxE, table_VxE = shared.promote_dtype((hidden_BxTxE, shared.embedding[...]),
                                                   dtype=shared.dtype)
    # `Embed.attend`'s computation, with the table's E axis contracted in place: attend's
    # jnp.dot(h, table.T) makes XLA:CPU copy the [V, E] table transposed at every call, which
    # made a one-row decoding step ~10x slower at V = 50k.
    logits_BxTxV = jnp.einsum("bte,ve->btv", hidden_BxTxE, table_VxE)
    return logits_BxTxV + self.final_logits_bias[...].astype(logits_BxTxV.dtype)

  def __call__(self, input_ids, attention_mask=None, decoder_input_ids=None,
               decoder_attention_mask=None, **kwargs) -> LEDSeq2SeqLMOutput:
    """Arguments: `LEDModel.__call__`. Returns logits [B, T, V]."""
    out = self.led(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask,
                   **kwargs)
    return LEDSeq2SeqLMOutput(self.lm_logits(out.last_hidden_state),
                              out.encoder_last_hidden_state, out.decoder_hidden_states,
                              out.encoder_hidden_states)

  def encode(self, *args, **kwargs) -> LEDEncoderOutput:
    """`LEDModel.encode`."""
    return self.led.encode(*args, **kwargs)

  def init_cache(self, *args, **kwargs) -> LEDDecoderCache:
    """`LEDModel.init_cache`."""
    return self.led.init_cache(*args, **kwargs)

  def decode_step(self, decoder_input_ids, cache: LEDDecoderCache
                  ) -> tuple[jax.Array, LEDDecoderCache]:
    """(logits [B, T, V], updated cache) for T new tokens at positions cache.index onwards: one
    step of generation (T = 1), or a prompt prefilled at once. Shapes depend only on T and the
    cache's, so under jit one compilation serves every step."""
    out = self.led.decode(decoder_input_ids, cache=cache)
    return self.lm_logits(out.last_hidden_state), out.cache

  def generate(self, input_ids, attention_mask=None, global_attention_mask=None, *,
               max_new_tokens: int = 20, num_beams: int = 1, do_sample: bool = False,
               temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
               length_penalty: float = 1.0, early_stopping: bool | str = False,
               no_repeat_ngram_size: int = 0, min_length: int = 0,
               forced_bos_token_id: int | None = None, forced_eos_token_id: int | None = None,
               seed: int = 0) -> jax.Array:
    """Summaries (or any outputs) of the encoder inputs: HF's `generate` for LED, compiled.

    Two jitted programs: the encoder pass (once), then the generation loop: the cache
    (cross-attention keys and values computed once, `init_cache`) and the whole search, one
    `lax.while_loop` (longformer_jax.search) that feeds one token per step through the static
    cache and stops as soon as every row (or beam) is done. The encoder compiles once per model
    structure, input shape and global-token bound, the loop once per model structure, shape and
    settings; later calls reuse both. Call it outside jit: it checks the masks and reads the
    output length on the host.

    Args:
      input_ids, attention_mask: [B, N] encoder tokens, padding 0 in the mask (default none).
      global_attention_mask: [B, N]; default: the first real token of each row (<s>), as HF
        documents for LED summarization (HF itself defaults to none: pass it there).
      max_new_tokens: tokens generated after the decoder start token (<= the decoder's
        position table, max_decoder_position_embeddings).
      num_beams: 1 for greedy decoding or sampling, J > 1 for beam search.
      do_sample, temperature, top_k, top_p: sampling (num_beams = 1 only), through
        `generation.SamplingConfig` / `sample_logits`; HF's sampling defaults top_k to 50, here
        it is None (off). Token n is drawn with fold_in(key(seed), n).
      length_penalty, early_stopping: beam search's (`search.BeamConfig`): HF's semantics and
        defaults (1.0 and False; True and "never" are its other values).
      no_repeat_ngram_size, min_length, forced_bos_token_id, forced_eos_token_id: HF's logits
        processors of those names (`search.SearchConfig`; min_length counts the decoder start
        token, as HF's). Default off: HF's `GenerationConfig.from_model_config` sets none of
        them for an LED config, which has no such fields.
      seed: for sampling.

    The config's decoder_start_token_id starts every output, eos_token_id ends a row and
    pad_token_id fills it afterwards (HF's defaults for LED: 2, 2, 1). Dropout is off (the
    model's train/eval mode is not changed).

    Returns int32 [B, T]: HF's output for the same settings (do_sample=False: token for token,
    tests/test_led_generate.py), T = 1 + the new tokens of the longest row (the loop's length
    for greedy decoding, the longest best hypothesis for beam search).
    """
    c = self.config
    settings = generate_settings(
        c, max_new_tokens=max_new_tokens, num_beams=num_beams, do_sample=do_sample,
        temperature=temperature, top_k=top_k, top_p=top_p, length_penalty=length_penalty,
        early_stopping=early_stopping, no_repeat_ngram_size=no_repeat_ngram_size,
        min_length=min_length, forced_bos_token_id=forced_bos_token_id,
        forced_eos_token_id=forced_eos_token_id, seed=seed)
    ids_BxN, mask_BxN, global_BxN = _encoder_inputs(c, input_ids, attention_mask,
                                                    global_attention_mask)
    if global_BxN is None:
      # The first real token of each row (position 0 unless the row is left-padded).
      global_BxN = mask_BxN & (jnp.cumsum(mask_BxN, axis=1) == 1)
    graphdef, state = nnx.split(self)
    encoder_BxNxE = _encode_fn(graphdef, _max_global(global_BxN))(
        state, ids_BxN.astype(jnp.int32), mask_BxN, global_BxN)
    sequences_BxT, length = _generate_fn(graphdef, settings)(state, encoder_BxNxE, mask_BxN,
                                                             jax.random.key(seed))
    return sequences_BxT[:, :int(length)]


@dataclasses.dataclass(frozen=True)
class _GenerateSettings:
  """Everything static about a generation loop (a key of the compiled-program cache)."""
  search_config: search.SearchConfig
  beams: search.BeamConfig
  sampling: SamplingConfig


def generate_settings(c: LEDConfig, **settings) -> _GenerateSettings:
  """The static settings of `LEDForConditionalGeneration.generate` for a model of config `c`:
  `settings` are its keyword arguments after the inputs (its defaults for those left out),
  checked without any input, so that a run's generation settings are refused when the run is
  configured rather than after training. Raises ValueError (or TypeError) naming the first
  setting `generate` would refuse, or the names it does not take."""
  defaults = {name: p.default for name, p in inspect.signature(
      LEDForConditionalGeneration.generate).parameters.items() if p.kind is p.KEYWORD_ONLY}
  unknown = sorted(set(settings) - set(defaults))
  if unknown:
    raise ValueError(f"unknown generation settings {unknown}; known: {list(defaults)}")
  s = {**defaults, **settings}
  max_new_tokens, num_beams, min_length = s["max_new_tokens"], s["num_beams"], s["min_length"]
  do_sample, top_k = s["do_sample"], s["top_k"]
  if not isinstance(do_sample, bool):
    raise TypeError(f"do_sample must be True or False, got {do_sample!r}")
  if not isinstance(s["seed"], int) or isinstance(s["seed"], bool):
    raise TypeError(f"seed must be an int, got {s['seed']!r}")
  search.check_int("max_new_tokens", max_new_tokens, 1)
  search.check_int("num_beams", num_beams, 1)
  if max_new_tokens > c.max_decoder_position_embeddings:
    raise ValueError(
        f"max_new_tokens={max_new_tokens} exceeds the decoder's position table "
        f"(max_decoder_position_embeddings={c.max_decoder_position_embeddings})")
  if isinstance(min_length, int) and min_length > 1 + max_new_tokens:
    raise ValueError(f"min_length={min_length} can never be reached: outputs hold at most "
                     f"1 + max_new_tokens={1 + max_new_tokens} tokens")
  for name in ("forced_bos_token_id", "forced_eos_token_id"):
    value = s[name]
    if value is not None and not (isinstance(value, int) and 0 <= value < c.vocab_size):
      raise ValueError(f"{name}={value!r} is not a token id of the vocabulary "
                       f"(vocab_size={c.vocab_size})")
  if do_sample:
    if num_beams > 1:
      raise ValueError(f"do_sample=True with num_beams={num_beams}: beam sampling is not "
                       f"supported (sample with num_beams=1, or search with do_sample=False)")
    if not (isinstance(s["temperature"], (int, float)) and s["temperature"] > 0):
      raise ValueError(f"temperature must be > 0 with do_sample=True, got "
                       f"{s['temperature']!r} (do_sample=False is greedy)")
    if top_k is not None and isinstance(top_k, int) and top_k > c.vocab_size:
      raise ValueError(f"top_k={top_k} exceeds the vocabulary (vocab_size={c.vocab_size})")
    sampling = SamplingConfig(temperature=s["temperature"], top_k=top_k, top_p=s["top_p"])
  else:
    sampling = SamplingConfig(temperature=0.0)  # greedy: argmax of the processed logits
  return _GenerateSettings(
      search_config=search.SearchConfig(
          max_length=1 + max_new_tokens, eos_token_id=c.eos_token_id,
          pad_token_id=c.pad_token_id, min_length=min_length,
          no_repeat_ngram_size=s["no_repeat_ngram_size"],
          forced_bos_token_id=s["forced_bos_token_id"],
          forced_eos_token_id=s["forced_eos_token_id"]),
      beams=search.BeamConfig(num_beams, s["length_penalty"], s["early_stopping"]),
      sampling=sampling)


def _merged_for_inference(graphdef, state):
  model = nnx.merge(graphdef, state)
  model.eval()  # this merged copy only: generation never drops out
  return model


@functools.lru_cache(maxsize=16)
def _encode_fn(graphdef, max_global: int):
  """The jitted encoder pass of `generate` ([B, N, E]), compiled apart from the search loop so
  that one compilation serves every search setting."""

  @jax.jit
  def run(state, ids_BxN, mask_BxN, global_BxN):
    model = _merged_for_inference(graphdef, state)
    return model.encode(ids_BxN, mask_BxN, global_BxN, max_global=max_global).last_hidden_state

  return run


@functools.lru_cache(maxsize=16)
def _generate_fn(graphdef, settings: _GenerateSettings):
  """One jitted generation loop per model structure and settings: the cache (cross-attention
  keys and values, once) and the whole search, one `lax.while_loop`."""

  @jax.jit
  def run(state, encoder_BxNxE, mask_BxN, key):
    model = _merged_for_inference(graphdef, state)
    c, num_beams = model.config, settings.beams.num_beams
    # Positions 0 .. max_new_tokens - 1 are fed (the last token generated never is).
    cache = model.init_cache(encoder_BxNxE, mask_BxN, num_beams=num_beams,
                             max_length=settings.search_config.max_length - 1)
    start_Bx1 = jnp.full((encoder_BxNxE.shape[0], 1), c.decoder_start_token_id, jnp.int32)

    def step(tokens_RxT, cache):
      logits_RxTxV, cache = model.decode_step(tokens_RxT, cache)
      return logits_RxTxV[:, -1], cache

    if num_beams == 1:  # HF's `_sample` (greedy or sampling)
      return search.sample_search(step, cache, start_Bx1, settings.search_config,
                                  settings.sampling, key)
    return search.beam_search(step, LEDDecoderCache.reorder_rows, cache, start_Bx1,
                              settings.search_config, settings.beams)

  return run


class LEDForQuestionAnswering(HFCheckpointMixin, nnx.Module):
  """Start and end logits from the DECODER's states (as HF's LED and BART do). HF sets no global
  attention by default here: pass a global_attention_mask (e.g. on the question)."""

  def __init__(self, config: LEDConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None, seq_axis: str | None = None):
    self.config = config
    self.led = LEDModel(config, rngs=rngs, mesh=mesh, seq_axis=seq_axis)
    self.qa_outputs = dense(config.d_model, 2, ("embed", None),
                            init=nnx.initializers.normal(config.init_std), dtype=config.dtype,
                            param_dtype=config.param_dtype, rngs=rngs)

  def __call__(self, input_ids, attention_mask=None, decoder_input_ids=None,
               decoder_attention_mask=None, **kwargs) -> LEDSeq2SeqQuestionAnsweringOutput:
    """Arguments: `LEDModel.__call__`."""
    out = self.led(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask,
                   **kwargs)
    logits_BxTx2 = self.qa_outputs(out.last_hidden_state)
    return LEDSeq2SeqQuestionAnsweringOutput(
        logits_BxTx2[..., 0], logits_BxTx2[..., 1], out.encoder_last_hidden_state,
        out.decoder_hidden_states, out.encoder_hidden_states)


MODEL_CLASSES: dict[str, type[nnx.Module]] = {
    cls.__name__: cls for cls in (LEDModel, LEDForConditionalGeneration,
                                  LEDForQuestionAnswering)}


__all__ = [
    "LEDModel", "LEDForConditionalGeneration", "LEDForQuestionAnswering", "LEDEncoderOutput",
    "LEDDecoderOutput", "LEDDecoderCache", "LEDLayerCache", "LEDSeq2SeqModelOutput",
    "LEDSeq2SeqLMOutput", "LEDSeq2SeqQuestionAnsweringOutput", "MODEL_CLASSES",
    "generate_settings", "shift_tokens_right",
]
