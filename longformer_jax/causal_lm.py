"""Autoregressive character-level Longformer (the paper's §4 language model), in Flax NNX.

A pre-LayerNorm decoder over bytes: the shared `LongformerSelfAttention` in its causal form (a
window per layer, a dilation per head, rotary positions, no global projections), a GELU MLP, and
a (tied or untied) byte embedding. `CharLMConfig(attention="full")` swaps the band for dense
causal attention with everything else unchanged, as a baseline. Configs and presets:
`longformer_jax.config.CharLMConfig`.

Positions: the paper used Transformer-XL-style relative sinusoidal position terms. Rotary
embeddings are also relative (the score of q_i . k_j depends on i - j only), need no extra
per-layer parameters or the O(window) relative-bias bookkeeping in the attention kernel, and keep
the attention op a plain `softmax(q k^T) v` that every implementation (chunked einsums, Pallas,
cuDNN) already provides. Because nothing is tied to absolute positions, a model trained on short
sequences runs unchanged on longer ones (the staged schedule and the 32K-context evaluation rely
on this).

Windows are a property of the *call*, not of the parameters: the staged schedule grows them
stage by stage, so `__call__` takes an optional `windows` tuple that overrides the config's.

Sampling: `generate` (prefill the prompt with the ordinary forward, then one `decode_step` per
token over per-layer ring-buffer key/value caches of the band's reach, O(window x dilation) per
layer whatever the length; `longformer_jax.generation`).
Shape letters: the alphabet of `longformer_jax.ops`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from longformer_jax import generation
from longformer_jax.attention import LongformerSelfAttention
from longformer_jax.config import CharLMConfig, check_windows
from longformer_jax.generation import Band, KVCache
from longformer_jax.layers import activation, dense, embed, layer_norm, maybe_remat
from longformer_jax.ops.validation import check_index_values


def _fan_in_init(scale: float = 1.0):
  return nnx.initializers.variance_scaling(scale, "fan_in", "truncated_normal")


class CausalLMLayer(nnx.Module):
  """x + attn(LN(x)), then x + mlp(LN(x)): pre-LayerNorm, dropout on each branch output."""

  def __init__(self, cfg: CharLMConfig, layer: int, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None, seq_axis: str | None = None):
    # Output projections start small (GPT-2's 1/sqrt(2 * layers) in std) so that the residual
    # stream of a deep pre-LN stack does not grow with depth at initialisation.
    out_init = _fan_in_init(1.0 / (2 * cfg.num_hidden_layers))
    # LayerNorm statistics and the residual stream stay float32 whatever the compute dtype:
    # bf16 variances of a residual stream with large outliers are the classic source of
    # divergence.
    norm = dict(dtype=jnp.float32, param_dtype=cfg.param_dtype, rngs=rngs,
                two_pass_variance=False)
    dense_args = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    self.ln_attn = layer_norm(cfg.hidden_size, cfg.layer_norm_eps, **norm)
    self.attention = LongformerSelfAttention(
        cfg.hidden_size, cfg.num_attention_heads, window=cfg.layer_windows[layer],
        dilation=cfg.layer_dilations[layer], causal=True, impl=cfg.attention_impl,
        global_projections="none", rope_base=cfg.rope_base, attention=cfg.attention,
        kernel_init=_fan_in_init(), output_init=out_init, mesh=mesh, seq_axis=seq_axis,
        **dense_args)
    self.ln_mlp = layer_norm(cfg.hidden_size, cfg.layer_norm_eps, **norm)
    self.intermediate = dense(cfg.hidden_size, cfg.intermediate_size, ("embed", "mlp"),
                              init=_fan_in_init(), **dense_args)
    self.output = dense(cfg.intermediate_size, cfg.hidden_size, ("mlp", "embed"),
                        init=out_init, **dense_args)
    self.act = activation(cfg.hidden_act)
    self.dropout = nnx.Dropout(cfg.hidden_dropout_prob)

  def __call__(self, x_BxNxE, window: int, dropout_key: jax.Array | None):
    return self._block(x_BxNxE, lambda a_BxNxE: self.attention(a_BxNxE, window=window),
                       dropout_key)[0]

  def prefill(self, x_BxPxE: jax.Array, band: Band) -> tuple[jax.Array, KVCache]:
    """`__call__` over a prompt (no dropout), also returning the layer's cache after it."""
    attend = lambda a_BxPxE: (self.attention(a_BxPxE, window=band.window)[0],
                              generation.prompt_cache(self.attention, a_BxPxE, band))
    return self._block(x_BxPxE, attend)

  def decode(self, x_BxE: jax.Array, cache: KVCache, position: jax.Array,
             band: Band) -> tuple[jax.Array, KVCache]:
    """The layer for the one token at `position` (input [B, E]), attending over `cache`."""
    attend = lambda a_BxE: generation.attend_step(self.attention, a_BxE, cache, position, band)
    return self._block(x_BxE, attend)

  def _block(self, x, attend, dropout_key: jax.Array | None = None):
    """(x + attn(LN(x)), then x + mlp(LN(x)); aux) for `attend(LN(x)) -> (attn, aux)`: the one
    residual structure that training, prefill and decoding share (x: [..., E])."""
    deterministic = dropout_key is None
    keys = jax.random.split(dropout_key, 2) if dropout_key is not None else (None, None)
    h, aux = attend(self.ln_attn(x))
    # The residual stream stays float32: bf16 branch outputs are added to a float32 sum.
    x = x + self.dropout(h, deterministic=deterministic, rngs=keys[0])
    h = self.output(self.act(self.intermediate(self.ln_mlp(x))))
    return x + self.dropout(h, deterministic=deterministic, rngs=keys[1]), aux


class LongformerForCausalLM(nnx.Module):
  """Bytes in, next-byte logits out: `model(tokens_BxN) -> logits_BxNxV` (float32).

  mesh, seq_axis: the device mesh the activations are laid out on and the axis that splits
  sequences, for the attention op (see `LongformerSelfAttention`); None: as on one device.
  """

  def __init__(self, config: CharLMConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None, seq_axis: str | None = None):
    if not isinstance(config, CharLMConfig):
      raise TypeError(f"config must be a CharLMConfig, got {type(config).__name__}")
    self.config = cfg = config
    self.embed = embed(cfg.vocab_size, cfg.hidden_size, ("vocab", "embed"),
                       stddev=cfg.initializer_range, dtype=cfg.dtype,
                       param_dtype=cfg.param_dtype, rngs=rngs)
    self.layers = nnx.List([CausalLMLayer(cfg, i, rngs=rngs, mesh=mesh, seq_axis=seq_axis)
                            for i in range(cfg.num_hidden_layers)])
    self.ln_final = layer_norm(cfg.hidden_size, cfg.layer_norm_eps, dtype=jnp.float32,
                               param_dtype=cfg.param_dtype, rngs=rngs, two_pass_variance=False)
    self.dropout = nnx.Dropout(cfg.hidden_dropout_prob)
    self.head = None if cfg.tie_word_embeddings else dense(
        cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), init=_fan_in_init(),
        dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)

  def __call__(self, tokens_BxN: jax.Array, *, windows: Sequence[int] | None = None,
               dropout_key: jax.Array | None = None) -> jax.Array:
    """windows: per-layer one-sided windows for this call (default: the config's).
    dropout_key: a PRNG key turns dropout on; None (the default) is deterministic.

    tokens: ints in [0, vocab_size). A concrete token outside is a ValueError naming it and its
    position (here and in `prefill`, `decode_step` and `generate`); under jit it is not checked
    and its embedding, and so the logits of its row, are NaN (`layers.Embed`)."""
    return self.from_embeddings(self._embed(tokens_BxN, "tokens"), windows=windows,
                                dropout_key=dropout_key)

  def from_embeddings(self, x_BxNxE: jax.Array, *, windows: Sequence[int] | None = None,
                      dropout_key: jax.Array | None = None) -> jax.Array:
    """The network after the embedding lookup (differentiable w.r.t. its input: causality
    tests take gradients here)."""
    cfg = self.config
    windows = check_windows(cfg.layer_windows if windows is None else windows,
                            cfg.num_hidden_layers)
    if cfg.hidden_dropout_prob == 0.0:
      dropout_key = None
    keys = [None] * (cfg.num_hidden_layers + 1)
    if dropout_key is not None:
      keys = list(jax.random.split(dropout_key, cfg.num_hidden_layers + 1))
    x_BxNxE = self.dropout(x_BxNxE, deterministic=keys[-1] is None, rngs=keys[-1])
    for layer, window, key in zip(self.layers, windows, keys):
      x_BxNxE = maybe_remat(_with_window(window), cfg.remat)(layer, x_BxNxE, key)
    return self._logits(x_BxNxE)

  def generate(self, prompt, max_new_tokens: int, *, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, seed: int = 0,
               windows: Sequence[int] | None = None, return_logits: bool = False):
    """`max_new_tokens` tokens sampled after `prompt` (ints [B, P] or [P], P >= 1, any length;
    it may be traced: `jax.jit` or `jax.export` over the prompt compile one program per shape).

    temperature 0 is greedy; top_k / top_p restrict sampling to the k most likely tokens / the
    nucleus of probability top_p (`generation.SamplingConfig`); seed: the PRNG seed (the same
    seed gives the same tokens). windows: per-layer windows (default: the config's; a trained
    run samples with its last stage's). Memory: one ring buffer of K = w*max(d)+1 keys and
    values per layer (`decode_bands`), independent of the prompt and of max_new_tokens. Returns
    int32 [B, max_new_tokens] ([max_new_tokens] for a 1-D prompt); with return_logits also the
    float32 logits [..., max_new_tokens, V] that each token was drawn from.
    """
    return generation.generate(
        self, prompt, max_new_tokens, seed=seed, windows=windows, return_logits=return_logits,
        sampling=generation.SamplingConfig(temperature, top_k, top_p))

  def decode_bands(self, windows: Sequence[int] | None = None, *,
                   max_len: int) -> tuple[Band, ...]:
    """Each layer's causal band for decoding with `windows` (default: the config's), and so the
    length of its cache (`Band.cache_len`); max_len (prompt + new tokens) matters only to
    dense `attention="full"` layers, whose band is the whole sequence."""
    windows = check_windows(self.config.layer_windows if windows is None else windows,
                            self.config.num_hidden_layers)
    return tuple(generation.layer_band(layer.attention, window, max_len)
                 for layer, window in zip(self.layers, windows))

  def prefill(self, tokens_BxP: jax.Array, bands: Sequence[Band]
              ) -> tuple[jax.Array, tuple[KVCache, ...]]:
    """The prompt through the ordinary (band) forward: (logits [B, V] of its last position,
    each layer's cache holding its last K positions)."""
    x_BxPxE, caches = self._embed(tokens_BxP, "tokens"), []
    for layer, band in zip(self.layers, bands):
      x_BxPxE, cache = layer.prefill(x_BxPxE, band)
      caches.append(cache)
    return self._logits(x_BxPxE[:, -1]), tuple(caches)

  def decode_step(self, token_B: jax.Array, caches: Sequence[KVCache], position: jax.Array,
                  bands: Sequence[Band]) -> tuple[jax.Array, tuple[KVCache, ...]]:
    """The token at `position` ([B] ints), every earlier one being in `caches`: (its logits
    [B, V], the caches with it added)."""
    x_BxE, new_caches = self._embed(token_B, "token"), []
    for layer, cache, band in zip(self.layers, caches, bands):
      x_BxE, cache = layer.decode(x_BxE, cache, position, band)
      new_caches.append(cache)
    return self._logits(x_BxE), tuple(new_caches)

  def _embed(self, tokens: jax.Array, name: str) -> jax.Array:
    tokens = jnp.asarray(tokens)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise TypeError(f"{name} must hold integer byte ids; got dtype {tokens.dtype}")
    vocab = self.config.vocab_size
    check_index_values(name, tokens, vocab, f"vocab_size={vocab}")
    return self.embed(tokens.astype(jnp.int32)).astype(jnp.float32)

  def _logits(self, x: jax.Array) -> jax.Array:
    """Final LayerNorm and the (tied or untied) byte head: [..., E] -> float32 [..., V]."""
    x = self.ln_final(x)
    logits = self.embed.attend(x.astype(self.config.dtype)) if self.head is None else self.head(x)
    return logits.astype(jnp.float32)


def _with_window(window: int):
  # Closed over, not passed: remat traces every argument, and the window must stay a Python int.
  return lambda layer, x_BxNxE, key: layer(x_BxNxE, window, key)


def next_byte_nll(logits_BxNxV: jax.Array, targets_BxN: jax.Array) -> jax.Array:
  """Per-position cross-entropy in nats, float32 [B, N]."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits_BxNxV.astype(jnp.float32), targets_BxN.astype(jnp.int32))


def num_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
