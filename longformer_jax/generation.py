"""Autoregressive sampling from the char LM with a window-bounded ring-buffer key/value cache.

A causal band layer with one-sided window w and per-head dilations d_h lets the query at position
i see the keys i - d_h*t, t = 0..w (docs/design.md §1.2): nothing older than i - w*max(d_h). So
each layer keeps only the keys and values of its last K = w*max(d_h) + 1 positions, position p
in slot p % K of a ring buffer, and decoding costs O(K) memory per layer and O(H*w*D) work per
layer and token, however long the text grows. (`attention="full"` layers have no band: their K
is the whole length, as for any dense decoder.)

Positions are rotary (relative; `longformer_jax.causal_lm`), so there is no position table to
run off: any length can be generated. A key is rotated once, at its absolute position, when it
enters the cache, exactly as the full forward rotates it.

Pieces, bottom up:
  Band                 the static geometry of one layer's decoding (window, dilations, K)
  band_attention_step  pure: one query over a layer's ring buffer
  prompt_cache, attend_step   the attention module's projections around it (prefill / one token)
  sample_logits        greedy, temperature, top-k and top-p sampling
  generate             prefill + `lax.scan` over the new tokens, all under one `jit`
`LongformerForCausalLM.generate` is the entry point. Shape letters: the alphabet of
`longformer_jax.ops`; here K counts the slots of a cache (the keys of a decode step).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longformer_jax.layers import rotary
from longformer_jax.ops.validation import check_index_values, is_traced


@dataclasses.dataclass(frozen=True)
class Band:
  """The causal band of one layer, as decoding needs it (static: it fixes shapes).

  window: one-sided window w; dilations: one d_h per head. The query at position i sees
  i - d_h*t for t = 0..w.
  """

  window: int
  dilations: tuple[int, ...]

  @property
  def cache_len(self) -> int:
    """K: the oldest key any head can reach is w*max(d_h) positions back, plus the query."""
    return self.window * max(self.dilations) + 1


def layer_band(attention, window: int, max_len: int) -> Band:
  """The `Band` of a `LongformerSelfAttention` run with `window`, for sequences of at most
  `max_len` tokens (only dense `attention="full"` layers need it: their band is everything)."""
  num_heads = attention.query.out_features[0]
  if attention.attention == "full":
    return Band(max(max_len - 1, 0), (1,) * num_heads)
  dilation = attention.dilation
  return Band(window, (dilation,) * num_heads if isinstance(dilation, int) else dilation)


class KVCache(NamedTuple):
  """One layer's ring buffer: the rotated key and the value of position p in slot p % K."""

  k_BxKxHxD: jax.Array
  v_BxKxHxD: jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How the next token is drawn from the logits.

  temperature: 0 is greedy (argmax); otherwise the logits are divided by it.
  top_k: sample among the k most likely tokens only (None: all).
  top_p: nucleus sampling: among the fewest most likely tokens whose probability (after top_k)
    adds up to at least top_p (None or 1: all).
  Greedy decoding ignores top_k and top_p: the argmax survives every filter.
  """

  temperature: float = 1.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
            and self.temperature >= 0):
      raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
    if self.top_k is not None and (not isinstance(self.top_k, int)
                                   or isinstance(self.top_k, bool) or self.top_k < 1):
      raise ValueError(f"top_k must be an int >= 1 or None, got {self.top_k!r}")
    if self.top_p is not None and not (isinstance(self.top_p, (int, float))
                                       and 0 < self.top_p <= 1):
      raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


# ----------------------------------------------------------------------------------------------
# Attention of one new token over the cache.


def _project(attention, dense, a_BxNxE: jax.Array, positions_N) -> jax.Array:
  """q or k of the band projections (`dense`), rotated at `positions_N` if the module is."""
  x_BxNxHxD = dense(a_BxNxE)
  if attention.rope_base is None:
    return x_BxNxHxD
  return rotary(x_BxNxHxD, attention.rope_base, positions_N)


def band_attention_step(q_BxHxD: jax.Array, cache: KVCache, position: jax.Array,
                        band: Band) -> jax.Array:
  """The causal band attention of the one query at `position`, whose own key is in the cache.

  The cache must hold positions max(0, position - K + 1)..position (slot p % K). Each head
  gathers its own w + 1 slots (its dilation decides which), so the work is O(H*w*D) whatever
  the widest head's reach; keys before position 0 do not exist and are masked. Softmax in
  float32 (docs/design.md §1.1); the output comes back in q's dtype. Pure.
  """
  slots_k = cache.k_BxKxHxD.shape[1]
  # [W, H] static offsets back from the query: t * d_h for t = 0..w.
  offsets_WxH = np.arange(band.window + 1)[:, None] * np.asarray(band.dilations)[None, :]
  slots_WxH = (position - offsets_WxH) % slots_k
  k_BxWxHxD = jnp.take_along_axis(cache.k_BxKxHxD, slots_WxH[None, :, :, None], axis=1)
  v_BxWxHxD = jnp.take_along_axis(cache.v_BxKxHxD, slots_WxH[None, :, :, None], axis=1)
  scale = 1.0 / jnp.sqrt(jnp.float32(q_BxHxD.shape[-1]))
  scores_BxHxW = jnp.einsum("bhd,bwhd->bhw", q_BxHxD.astype(jnp.float32) * scale,
                            k_BxWxHxD.astype(jnp.float32))
  # t = 0 (the query itself) is always there, so no row is empty and -inf is safe.
  exists_1xHxW = (offsets_WxH <= position).T[None]
  probs_BxHxW = jax.nn.softmax(jnp.where(exists_1xHxW, scores_BxHxW, -jnp.inf), axis=-1)
  out_BxHxD = jnp.einsum("bhw,bwhd->bhd", probs_BxHxW, v_BxWxHxD.astype(jnp.float32))
  return out_BxHxD.astype(q_BxHxD.dtype)


def prompt_cache(attention, a_BxPxE: jax.Array, band: Band) -> KVCache:
  """The cache after a prompt: the keys and values of its last K positions (all of them when
  it is shorter), from `attention`'s projections of its normalised inputs `a_BxPxE`."""
  prompt_len, cache_len = a_BxPxE.shape[1], band.cache_len
  kept = min(prompt_len, cache_len)
  positions = np.arange(prompt_len - kept, prompt_len)
  a_BxNxE = a_BxPxE[:, prompt_len - kept:]
  k_BxNxHxD = _project(attention, attention.key, a_BxNxE, positions)
  v_BxNxHxD = attention.value(a_BxNxE)

  def ring(x_BxNxHxD):
    empty = jnp.zeros((x_BxNxHxD.shape[0], cache_len) + x_BxNxHxD.shape[2:], x_BxNxHxD.dtype)
    return empty.at[:, positions % cache_len].set(x_BxNxHxD)

  return KVCache(ring(k_BxNxHxD), ring(v_BxNxHxD))


def attend_step(attention, a_BxE: jax.Array, cache: KVCache, position: jax.Array,
                band: Band) -> tuple[jax.Array, KVCache]:
  """`attention` (a `LongformerSelfAttention`, its projections reused) for the one token at
  `position` with normalised input `a_BxE`: it enters the cache (overwriting position - K),
  then attends over it. Returns (output [B, E], the updated cache)."""
  position = jnp.asarray(position, jnp.int32)
  a_Bx1xE, positions_1 = a_BxE[:, None], position[None]
  q_BxHxD = _project(attention, attention.query, a_Bx1xE, positions_1)[:, 0]
  k_Bx1xHxD = _project(attention, attention.key, a_Bx1xE, positions_1)
  slot = position % cache.k_BxKxHxD.shape[1]
  cache = KVCache(
      jax.lax.dynamic_update_slice_in_dim(cache.k_BxKxHxD, k_Bx1xHxD, slot, axis=1),
      jax.lax.dynamic_update_slice_in_dim(cache.v_BxKxHxD, attention.value(a_Bx1xE), slot,
                                          axis=1))
  return attention.output(band_attention_step(q_BxHxD, cache, position, band)), cache


# ----------------------------------------------------------------------------------------------
# Sampling and the generation loop.


def sample_logits(logits_BxV: jax.Array, key: jax.Array, sampling: SamplingConfig) -> jax.Array:
  """One token per row [B] (int32) drawn from float logits [B, V] as `sampling` says."""
  if sampling.greedy:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  scaled_BxV = logits_BxV.astype(jnp.float32) / sampling.temperature
  if sampling.top_k is None and sampling.top_p is None:
    return jax.random.categorical(key, scaled_BxV, axis=-1).astype(jnp.int32)
  k = sampling.top_k or logits_BxV.shape[-1]
  # Sorted descending; equal logits keep the lower id first, as argmax does (so top_k=1 is
  # greedy even on ties).
  top_BxC, ids_BxC = jax.lax.top_k(scaled_BxV, k)
  if sampling.top_p is not None:
    probs_BxC = jax.nn.softmax(top_BxC, axis=-1)
    # Keep a token while the mass before it is short of top_p: the most likely always stays.
    before_BxC = jnp.cumsum(probs_BxC, axis=-1) - probs_BxC
    top_BxC = jnp.where(before_BxC < sampling.top_p, top_BxC, -jnp.inf)
  choice_B = jax.random.categorical(key, top_BxC, axis=-1)
  return jnp.take_along_axis(ids_BxC, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)


def generate(model, prompt, max_new_tokens: int, *, sampling: SamplingConfig = SamplingConfig(),
             seed: int = 0, windows: Sequence[int] | None = None, return_logits: bool = False):
  """`max_new_tokens` tokens following `prompt` ([B, P] or [P] ints, P >= 1), sampled from a
  `LongformerForCausalLM` (see `LongformerForCausalLM.generate`, the public entry point).

  The prompt goes through the model's ordinary forward once (prefill), keeping each layer's last
  K keys and values; then each new token is one `decode_step` over the caches, in a `lax.scan`,
  all in one jitted call (compiled once per model structure, prompt shape, length and sampling
  settings). Token n is drawn with `fold_in(key(seed), n)`: a seed gives the same text whatever
  `max_new_tokens` is (a shorter run is a prefix of a longer one).
  The prompt may be traced (under `jit` or `jax.export`: its shape is static, so one program
  serves every prompt of that shape); its token values are then not range-checked.
  Returns int32 [B, max_new_tokens] ([max_new_tokens] for a 1-D prompt), and with return_logits
  also the float32 logits [B, max_new_tokens, V] each token was drawn from.
  """
  traced = is_traced(prompt)
  if not traced:
    prompt = np.asarray(prompt)  # a list, a host or a device array: checked on the host
  if prompt.ndim not in (1, 2) or not np.issubdtype(prompt.dtype, np.integer):
    raise ValueError(f"prompt must be ints of shape [P] or [B, P], got {prompt.dtype} "
                     f"{prompt.shape}")
  if prompt.shape[-1] < 1:
    raise ValueError("the prompt must hold at least one token: the model has no start token")
  vocab = model.config.vocab_size
  check_index_values("prompt", prompt, vocab, f"vocab_size={vocab}")
  if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
    raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
  if sampling.top_k is not None and sampling.top_k > vocab:
    raise ValueError(f"top_k={sampling.top_k} exceeds the vocabulary ({vocab})")
  prompt_BxP = jnp.asarray(prompt.reshape(-1, prompt.shape[-1]), jnp.int32)
  windows = None if windows is None else tuple(windows)
  graphdef, state = nnx.split(model)
  run = _generate_fn(graphdef, windows, max_new_tokens, sampling, return_logits)
  tokens_BxN, logits_BxNxV = run(state, prompt_BxP, jax.random.key(seed))
  if prompt.ndim == 1:
    tokens_BxN, logits_BxNxV = tokens_BxN[0], None if logits_BxNxV is None else logits_BxNxV[0]
  return (tokens_BxN, logits_BxNxV) if return_logits else tokens_BxN


@functools.lru_cache(maxsize=16)
def _generate_fn(graphdef, windows, max_new_tokens, sampling, return_logits):
  """One jitted generator per model structure and settings (sampling again reuses it)."""

  @jax.jit
  def run(state, prompt_BxP, key):
    model = nnx.merge(graphdef, state)
    batch, prompt_len = prompt_BxP.shape
    if max_new_tokens == 0:
      return (jnp.zeros((batch, 0), jnp.int32),
              jnp.zeros((batch, 0, model.config.vocab_size), jnp.float32)
              if return_logits else None)
    bands = model.decode_bands(windows, max_len=prompt_len + max_new_tokens)
    logits_BxV, caches = model.prefill(prompt_BxP, bands)
    first_B = sample_logits(logits_BxV, jax.random.fold_in(key, 0), sampling)

    def step(carry, n):
      # Feeds token n - 1 (at position P + n - 1), draws token n. The carry is the only state
      # that crosses steps: its size does not depend on the length generated.
      token_B, caches = carry
      logits_BxV, caches = model.decode_step(token_B, caches, prompt_len + n - 1, bands)
      token_B = sample_logits(logits_BxV, jax.random.fold_in(key, n), sampling)
      return (token_B, caches), (token_B, logits_BxV if return_logits else None)

    _, (rest_NxB, rest_NxBxV) = jax.lax.scan(step, (first_B, caches),
                                             jnp.arange(1, max_new_tokens))
    tokens_BxN = jnp.concatenate([first_B[:, None], rest_NxB.T], axis=1)
    if not return_logits:
      return tokens_BxN, None
    return tokens_BxN, jnp.concatenate([logits_BxV[:, None], rest_NxBxV.transpose(1, 0, 2)], 1)

  return run
