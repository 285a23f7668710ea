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

Shapes (docs/design.md §4): B batch, N encoder tokens, T decoder tokens of this call, S keys
(encoder tokens in cross-attention; decoder tokens or cache slots in self-attention), E d_model,
H heads, D head_dim, V vocabulary.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longformer_jax.config import LEDConfig
from longformer_jax.encoder import LongformerLayer
from longformer_jax.layers import activation, dense, embed, layer_norm, logical_axes, maybe_remat
from longformer_jax.modeling import _check_ids, _is_traced

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
  stale values) and are never attended."""
  self_key: jax.Array  # [B, S, H, D], S = max_length
  self_value: jax.Array  # [B, S, H, D]
  cross_key: jax.Array  # [B, N, H, D]: the encoder output through this layer's k_proj, once
  cross_value: jax.Array  # [B, N, H, D]


@flax.struct.dataclass
class LEDDecoderCache:
  """Everything a decoding step needs besides the new tokens: a pytree of fixed shapes."""
  layers: tuple[LEDLayerCache, ...]
  encoder_mask: jax.Array  # [B, N] bool: the cross-attention keys that are real tokens
  index: jax.Array  # int32 []: decoder positions written so far = position of the next token

  @property
  def max_length(self) -> int:
    return self.layers[0].self_key.shape[1]


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

  def key_value(self, x_BxSxE: jax.Array) -> tuple[jax.Array, jax.Array]:
    return self.k_proj(x_BxSxE), self.v_proj(x_BxSxE)

  def __call__(self, hidden_BxTxE, key_BxSxHxD, value_BxSxHxD, mask_Bx1xTxS=None):
    """mask: True where query t may attend key s (broadcast over heads; None: every key).

    `jax.nn.dot_product_attention` takes the softmax in float32 whatever the input dtype, and a
    row with no key left gets a uniform average instead of NaN (HF's min-value mask does the
    same); with the masks built here only decoder padding rows can have none."""
    q_BxTxHxD = self.q_proj(hidden_BxTxE)
    out_BxTxHxD = jax.nn.dot_product_attention(q_BxTxHxD, key_BxSxHxD, value_BxSxHxD,
                                               mask=mask_Bx1xTxS)
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

  def __call__(self, hidden_BxTxE, self_mask_Bx1xTxS, cross_mask_Bx1x1xN, encoder_BxNxE,
               cache: LEDLayerCache | None, index):
    """Returns (hidden [B, T, E], the layer's updated cache or None).

    Without a cache the keys are the T tokens themselves and the cross keys come from
    `encoder_BxNxE`; with one, the T new keys/values are written at slots index..index+T-1 and
    the cross keys/values are the cached ones.
    """
    key_BxSxHxD, value_BxSxHxD = self.self_attn.key_value(hidden_BxTxE)
    if cache is None:
      cross_key_BxNxHxD, cross_value_BxNxHxD = self.encoder_attn.key_value(encoder_BxNxE)
    else:
      start = (0, index, 0, 0)
      key_BxSxHxD = jax.lax.dynamic_update_slice(
          cache.self_key, key_BxSxHxD.astype(cache.self_key.dtype), start)
      value_BxSxHxD = jax.lax.dynamic_update_slice(
          cache.self_value, value_BxSxHxD.astype(cache.self_value.dtype), start)
      cache = cache.replace(self_key=key_BxSxHxD, self_value=value_BxSxHxD)
      cross_key_BxNxHxD, cross_value_BxNxHxD = cache.cross_key, cache.cross_value
    attn_BxTxE = self.self_attn(hidden_BxTxE, key_BxSxHxD, value_BxSxHxD, self_mask_Bx1xTxS)
    hidden_BxTxE = self.self_attn_layer_norm(hidden_BxTxE + self.dropout(attn_BxTxE))
    attn_BxTxE = self.encoder_attn(hidden_BxTxE, cross_key_BxNxHxD, cross_value_BxNxHxD,
                                   cross_mask_Bx1x1xN)
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

  def embed_inputs(self, embed_tokens: nnx.Embed, ids_BxT: jax.Array, positions_T: jax.Array):
    hidden_BxTxE = embed_tokens(ids_BxT) + self.embed_positions(positions_T)[None]
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

  def __call__(self, embed_tokens, ids_BxN, mask_BxN, global_BxN, *, max_global: int | None,
               output_hidden_states: bool) -> LEDEncoderOutput:
    hidden_BxNxE = self.embed_inputs(embed_tokens, ids_BxN, jnp.arange(ids_BxN.shape[1]))

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

  def __call__(self, embed_tokens, ids_BxT, encoder_BxNxE, encoder_mask_BxN, decoder_mask_BxT,
               cache: LEDDecoderCache | None, *, output_hidden_states: bool) -> LEDDecoderOutput:
    num_new = ids_BxT.shape[1]
    if cache is None:
      index = 0
      positions_T = jnp.arange(num_new)
      # Causal: query t sees keys s <= t, and only real decoder tokens.
      self_mask_Bx1xTxS = jnp.tril(jnp.ones((num_new, num_new), bool))[None, None]
      if decoder_mask_BxT is not None:
        self_mask_Bx1xTxS = self_mask_Bx1xTxS & decoder_mask_BxT[:, None, None, :]
      layer_caches = (None,) * len(self.layers)
    else:
      index = cache.index
      positions_T = index + jnp.arange(num_new)
      # Query at position p sees the slots 0..p: the earlier steps' and this call's up to itself.
      slots_S = jnp.arange(cache.max_length)
      self_mask_Bx1xTxS = (slots_S[None, :] <= positions_T[:, None])[None, None]
      encoder_mask_BxN = cache.encoder_mask
      layer_caches = cache.layers
    cross_mask_Bx1x1xN = (None if encoder_mask_BxN is None
                          else encoder_mask_BxN[:, None, None, :])
    hidden_BxTxE = self.embed_inputs(embed_tokens, ids_BxT, positions_T)

    def run_layer(layer, hidden_BxTxE, self_mask, cross_mask, encoder_BxNxE, layer_cache, index):
      return layer(hidden_BxTxE, self_mask, cross_mask, encoder_BxNxE, layer_cache, index)

    run_layer = maybe_remat(run_layer, self.remat)
    all_hidden, new_caches = [hidden_BxTxE], []
    for layer, layer_cache in zip(self.layers, layer_caches):
      hidden_BxTxE, layer_cache = run_layer(layer, hidden_BxTxE, self_mask_Bx1xTxS,
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
  """`mask != 0`, after checking it has the shape of the array called `like`."""
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  if mask.shape != shape:
    raise ValueError(f"{name} has shape {mask.shape}; expected the shape of {like}, {shape}")
  return mask != 0


class LEDModel(nnx.Module):
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
    """
    c = self.config
    ids_BxN = _check_ids(input_ids, 2, "[batch, seq]")
    shape = ids_BxN.shape
    if shape[1] > c.max_encoder_position_embeddings:
      raise ValueError(f"input_ids has {shape[1]} tokens; the encoder's position table holds "
                       f"max_encoder_position_embeddings={c.max_encoder_position_embeddings}")
    mask_BxN = _bool_mask("attention_mask", attention_mask, shape, "input_ids")
    mask_BxN = jnp.ones(shape, bool) if mask_BxN is None else mask_BxN
    global_BxN = _bool_mask("global_attention_mask", global_attention_mask, shape,
                            "input_ids")
    if global_BxN is not None:
      if not (_is_traced(global_BxN) or _is_traced(mask_BxN)):
        on_padding = np.argwhere(np.asarray(global_BxN & ~mask_BxN))
        if len(on_padding):
          raise ValueError(
              f"global_attention_mask marks {len(on_padding)} padding token(s), the first at "
              f"row {on_padding[0][0]}, position {on_padding[0][1]} (attention_mask 0 there); "
              f"a padding token cannot be global")
        if max_global is None:
          max_global = int(jnp.max(jnp.sum(global_BxN, axis=1), initial=0))
      global_BxN = global_BxN & mask_BxN  # under jit: a padding token is never global
    return self.encoder(self.shared, ids_BxN, mask_BxN, global_BxN, max_global=max_global,
                        output_hidden_states=output_hidden_states)

  def init_cache(self, encoder_hidden_states, encoder_attention_mask=None, *,
                 max_length: int) -> LEDDecoderCache:
    """The decoding cache for `max_length` decoder positions, from the encoder output [B, N, E]:
    every layer's cross-attention keys and values are computed here, once."""
    c = self.config
    if not isinstance(max_length, int) or not 1 <= max_length <= c.max_decoder_position_embeddings:
      raise ValueError(f"max_length={max_length!r} must be an int in [1, "
                       f"max_decoder_position_embeddings={c.max_decoder_position_embeddings}]")
    encoder_BxNxE = jnp.asarray(encoder_hidden_states)
    batch, num_encoder = encoder_BxNxE.shape[:2]
    mask_BxN = _bool_mask("encoder_attention_mask", encoder_attention_mask, (batch, num_encoder),
                          "the encoder output's first two axes")
    layers = []
    for layer in self.decoder.layers:
      cross_key_BxNxHxD, cross_value_BxNxHxD = layer.encoder_attn.key_value(encoder_BxNxE)
      slots_BxSxHxD = jnp.zeros((batch, max_length) + cross_key_BxNxHxD.shape[2:],
                                cross_key_BxNxHxD.dtype)
      layers.append(LEDLayerCache(slots_BxSxHxD, slots_BxSxHxD, cross_key_BxNxHxD,
                                  cross_value_BxNxHxD))
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
    ids_BxT = _check_ids(decoder_input_ids, 2, "[batch, decoder_seq]")
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
      if cache.encoder_mask.shape[0] != batch:
        raise ValueError(f"decoder_input_ids has batch {batch}; the cache was built for batch "
                         f"{cache.encoder_mask.shape[0]}")
      position = "cache.index" if _is_traced(cache.index) else int(cache.index)
      if num_new > cache.max_length or (
          isinstance(position, int) and position + num_new > cache.max_length):
        raise ValueError(f"{num_new} new decoder tokens at position {position} do not fit the "
                         f"cache's max_length={cache.max_length}")
      encoder_BxNxE = encoder_mask_BxN = decoder_mask_BxT = None
    return self.decoder(self.shared, ids_BxT, encoder_BxNxE, encoder_mask_BxN, decoder_mask_BxT,
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
      decoder_input_ids = shift_tokens_right(_check_ids(input_ids, 2, "[batch, seq]"),
                                             c.pad_token_id, c.decoder_start_token_id)
    decoded = self.decode(decoder_input_ids, encoder_outputs.last_hidden_state, attention_mask,
                          decoder_attention_mask, output_hidden_states=output_hidden_states)
    return LEDSeq2SeqModelOutput(decoded.last_hidden_state, encoder_outputs.last_hidden_state,
                                 decoded.hidden_states, encoder_outputs.hidden_states)


class LEDForConditionalGeneration(nnx.Module):
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
    logits_BxTxV = self.led.shared.attend(hidden_BxTxE)
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


class LEDForQuestionAnswering(nnx.Module):
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
    "shift_tokens_right",
]
