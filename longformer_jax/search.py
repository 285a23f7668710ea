"""Decoding searches as pure functions over a model's step: greedy / sampled decoding and beam
search, each ONE `lax.while_loop` with static shapes that stops as soon as every row (or beam) is
done, so a caller can put the whole generation under one `jit`.

The model enters only through
  step_fn(tokens_RxT, cache) -> (logits_RxV, cache)
which feeds T new tokens per row (T = 1 in the loop; T = P - 1 once for a prompt of P tokens) and
returns the logits of the LAST one; and, for beam search,
  reorder_cache(cache, rows_R) -> cache
which gives row r the cache of row rows_R[r] (a gather on the rows of the self-attention cache).
R is the number of rows: the batch B for `sample_search`, B * J (batch-major, as HF flattens
beams) for `beam_search`. `longformer_jax.led` is the first user (`LEDForConditionalGeneration
.generate`); any decoder with such a step can use them.

Both follow HF transformers' `generate` (transformers/generation/utils.py: `_sample` and
`_beam_search` with its helpers) so that, given the same logits, they pick the same tokens and
return the same sequences:
  * sequences start with the prompt and hold `max_length` = prompt + new tokens positions; the
    caller cuts them to the returned length, HF's output length (the loop may stop early);
  * a row that emits EOS gets `pad_token_id` afterwards (greedy / sampling) and the search stops
    when every row has; beam search returns each batch item's best finished hypothesis, filled
    with HF's fill token after its end;
  * the logits processors HF adds for these settings, in HF's order (`_get_logits_processor`):
    NoRepeatNGram, MinLength, ForcedBOSToken, ForcedEOSToken (`process_scores`); sampling then
    applies temperature / top-k / top-p (`generation.sample_logits`).
Beam search is HF's "static-shape" algorithm (its running and finished arrays already have fixed
shapes; only its `cur_len` is a Python int there and a traced int32 here): 2J candidates per
step, finished hypotheses scored sum(log p) / generated_length ** length_penalty, HF's
`early_stopping` rules (True, False, "never") and the same final selection.

Shape letters: the alphabet of `longformer_jax.ops`; here R = B (sampling) or B * J (beam
search), C = 2J candidates per batch item and step, T = max_length.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from longformer_jax.generation import SamplingConfig, sample_logits

Cache = Any
StepFn = Callable[[jax.Array, Cache], tuple[jax.Array, Cache]]
ReorderFn = Callable[[Cache, jax.Array], Cache]

# HF's "very unlikely" score: beams other than the first start at it, and a candidate that must
# not be picked (finished, or unable to improve) is pushed down by it. Float32 additions in HF's
# order, so that the same candidates tie and win.
_NEG = -1.0e9


def check_int(name: str, value, minimum: int) -> None:
  """A ValueError naming `name` unless `value` is an int (not a bool) >= minimum."""
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SearchConfig:
  """What every search needs besides the model (static: it fixes shapes and branches).

  max_length: HF's `max_length`, prompt tokens + new tokens (`max_new_tokens + P`).
  eos_token_id: a row is done once it emits it (None: only max_length stops).
  pad_token_id: written after a row's EOS (HF: the EOS token when None).
  min_length: EOS is forbidden while the sequence (prompt included) is shorter (HF's
    MinLengthLogitsProcessor; 0: off).
  no_repeat_ngram_size: no n-gram of this size occurs twice in a sequence (prompt included;
    HF's NoRepeatNGramLogitsProcessor; 0: off).
  forced_bos_token_id: the only token allowed when the sequence holds one token (HF's
    ForcedBOSTokenLogitsProcessor: encoder-decoders force the first generated token).
  forced_eos_token_id: the only token allowed at the last position, max_length - 1 (HF's
    ForcedEOSTokenLogitsProcessor).
  """

  max_length: int
  eos_token_id: int | None = None
  pad_token_id: int | None = None
  min_length: int = 0
  no_repeat_ngram_size: int = 0
  forced_bos_token_id: int | None = None
  forced_eos_token_id: int | None = None

  def __post_init__(self):
    check_int("max_length", self.max_length, 1)
    check_int("min_length", self.min_length, 0)
    check_int("no_repeat_ngram_size", self.no_repeat_ngram_size, 0)
    for name in ("eos_token_id", "pad_token_id", "forced_bos_token_id", "forced_eos_token_id"):
      if getattr(self, name) is not None:
        check_int(name, getattr(self, name), 0)

  @property
  def pad(self) -> int | None:
    """HF's `_pad_token_tensor`: the pad token, or the EOS token when there is none."""
    return self.eos_token_id if self.pad_token_id is None else self.pad_token_id

  @property
  def beam_fill(self) -> int:
    """What HF's beam search writes after a hypothesis ends: `pad or eos if eos is not None
    else -1` in its code, so a pad id of 0 (falsy) gives the EOS token."""
    if self.eos_token_id is None:
      return -1
    return self.pad or self.eos_token_id


@dataclasses.dataclass(frozen=True)
class BeamConfig:
  """HF's beam search settings.

  num_beams: J, hypotheses kept per batch item.
  length_penalty: a finished hypothesis scores sum(log p) / length ** length_penalty, length
    counting its generated tokens (EOS included, prompt excluded); > 0 favours longer ones.
  early_stopping: True stops a batch item once it has J finished hypotheses; False stops it when
    the best running beam, scored at the current length, cannot beat the worst finished one
    (HF's heuristic); "never" does the same with the best length it could still reach when
    length_penalty > 0 (canonical beam search).
  """

  num_beams: int
  length_penalty: float = 1.0
  early_stopping: bool | str = False

  def __post_init__(self):
    check_int("num_beams", self.num_beams, 1)
    if (not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool)
        or not math.isfinite(self.length_penalty)):
      raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
    # HF tests `early_stopping is True`: 1 would silently mean False there. Only its three values.
    if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
      raise ValueError(f"early_stopping must be True, False or 'never', got "
                       f"{self.early_stopping!r}")


# ----------------------------------------------------------------------------------------------
# Logits processors.


def banned_ngram_tokens(sequences_RxT: jax.Array, cur_len: jax.Array, ngram_size: int,
                        vocab_size: int) -> jax.Array:
  """[R, V] bool: the tokens that would repeat an n-gram of the first `cur_len` tokens.

  HF's NoRepeatNGramLogitsProcessor with static shapes: the last n - 1 tokens are matched against
  the first n - 1 tokens of every n-token window that lies within the first cur_len tokens (the
  window starting at them would need one token more, so they never ban their own successor), and
  each matching window bans its last token.
  """
  rows, max_length = sequences_RxT.shape
  num_windows = max_length - ngram_size + 1
  if num_windows < 1:
    return jnp.zeros((rows, vocab_size), bool)
  # windows_RxWxn[r, w] = tokens w .. w + n - 1 of row r.
  windows_RxWxn = jnp.stack([sequences_RxT[:, j:j + num_windows] for j in range(ngram_size)],
                            axis=-1)
  # Clamped into range by dynamic_slice when cur_len < n; nothing is banned then (below).
  prefix_Rxn = jax.lax.dynamic_slice_in_dim(sequences_RxT, cur_len - ngram_size + 1,
                                            ngram_size - 1, axis=1)
  within_T = jnp.arange(num_windows) + ngram_size <= cur_len
  match_RxT = jnp.all(windows_RxWxn[..., :-1] == prefix_Rxn[:, None, :], axis=-1) & within_T
  # Windows that do not match write to a column past the vocabulary, which is dropped.
  banned_ids_RxT = jnp.where(match_RxT, windows_RxWxn[..., -1], vocab_size)
  rows_Rx1 = jnp.arange(rows)[:, None]
  return jnp.zeros((rows, vocab_size), bool).at[rows_Rx1, banned_ids_RxT].set(True, mode="drop")


def process_scores(scores_RxV: jax.Array, sequences_RxT: jax.Array, cur_len: jax.Array,
                   config: SearchConfig) -> jax.Array:
  """HF's logits processors for `config`, in HF's order, on float32 scores [R, V] (logits for
  greedy and sampling, log-probabilities for beam search, as in HF) of the token at position
  cur_len; `sequences_RxT` holds each row's first cur_len tokens (the rest is ignored)."""
  vocab_size = scores_RxV.shape[-1]
  ids_V = jnp.arange(vocab_size)
  if config.no_repeat_ngram_size:
    banned_RxV = banned_ngram_tokens(sequences_RxT, cur_len, config.no_repeat_ngram_size,
                                     vocab_size)
    scores_RxV = jnp.where(banned_RxV, -jnp.inf, scores_RxV)
  if config.min_length > 0 and config.eos_token_id is not None:
    too_short = cur_len < config.min_length
    scores_RxV = jnp.where(too_short & (ids_V == config.eos_token_id), -jnp.inf, scores_RxV)

  def force(scores_RxV, when, token):
    only_V = jnp.where(ids_V == token, 0.0, -jnp.inf).astype(scores_RxV.dtype)
    return jnp.where(when, only_V[None, :], scores_RxV)

  if config.forced_bos_token_id is not None:
    scores_RxV = force(scores_RxV, cur_len == 1, config.forced_bos_token_id)
  if config.forced_eos_token_id is not None:
    scores_RxV = force(scores_RxV, cur_len == config.max_length - 1, config.forced_eos_token_id)
  return scores_RxV


# ----------------------------------------------------------------------------------------------
# Searches.


def _check_prompt(prompt_RxP: jax.Array, config: SearchConfig) -> int:
  if prompt_RxP.ndim != 2 or prompt_RxP.shape[1] < 1:
    raise ValueError(f"the prompt must have shape [rows, P] with P >= 1, got {prompt_RxP.shape}")
  prompt_len = prompt_RxP.shape[1]
  if prompt_len >= config.max_length:
    raise ValueError(f"max_length={config.max_length} leaves no room to generate after a prompt "
                     f"of {prompt_len} tokens")
  return prompt_len


def _prefill(step_fn: StepFn, cache: Cache, prompt_RxP: jax.Array) -> Cache:
  """Feeds all prompt tokens but the last (the loop feeds that one and reads its logits)."""
  if prompt_RxP.shape[1] > 1:
    _, cache = step_fn(prompt_RxP[:, :-1], cache)
  return cache


def _float32_logits(logits_RxV: jax.Array) -> jax.Array:
  """The step's logits in float32 (HF processes and picks in float32 whatever the model's
  dtype), materialised: without the barrier XLA:CPU fuses the LM head's matmul into the
  reductions that follow (log_softmax, top-k, sampling) and recomputes it, which made a beam
  search step ~4x slower (led-small, V = 50k); on GPUs the matmul is a library call anyway."""
  return jax.lax.optimization_barrier(logits_RxV.astype(jnp.float32))


def _token_at(sequences_RxT: jax.Array, position) -> jax.Array:
  """[R, 1]: every row's token at a (traced) position."""
  return jax.lax.dynamic_slice_in_dim(sequences_RxT, position, 1, axis=1)


def sample_search(step_fn: StepFn, cache: Cache, prompt_RxP: jax.Array, config: SearchConfig,
                  sampling: SamplingConfig = SamplingConfig(temperature=0.0),
                  key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Greedy decoding (`sampling.temperature == 0`, the default) or sampling, as HF's `_sample`.

  Each step feeds every row's last token, processes the logits (`process_scores`), picks the next
  token with `generation.sample_logits` (token at position n drawn with fold_in(key, n)), writes
  `pad` instead for rows already done, and marks rows that emitted EOS done; the loop stops at
  max_length or when every row is done.

  Returns (sequences [R, max_length] int32, length int32 []): the prompt and the tokens up to
  `length`, HF's output length (the positions after it are meaningless).
  """
  prompt_len = _check_prompt(prompt_RxP, config)
  rows, max_length, eos = prompt_RxP.shape[0], config.max_length, config.eos_token_id
  if key is None:
    if not sampling.greedy:
      raise ValueError("sampling needs a PRNG key")
    key = jax.random.key(0)  # never drawn from
  cache = _prefill(step_fn, cache, prompt_RxP)
  fill = 0 if config.pad is None else config.pad
  sequences_RxT = jnp.full((rows, max_length), fill, jnp.int32).at[:, :prompt_len].set(
      prompt_RxP.astype(jnp.int32))

  def keep_going(state):
    _, _, unfinished_R, cur_len = state
    return (cur_len < max_length) & jnp.any(unfinished_R)

  def step(state):
    sequences_RxT, cache, unfinished_R, cur_len = state
    logits_RxV, cache = step_fn(_token_at(sequences_RxT, cur_len - 1), cache)
    scores_RxV = process_scores(_float32_logits(logits_RxV), sequences_RxT, cur_len, config)
    next_R = sample_logits(scores_RxV, jax.random.fold_in(key, cur_len), sampling)
    if eos is not None:  # HF's EosTokenCriteria: done rows get padding, EOS makes a row done
      next_R = jnp.where(unfinished_R, next_R, config.pad)
      unfinished_R = unfinished_R & (next_R != eos)
    sequences_RxT = jax.lax.dynamic_update_slice(sequences_RxT, next_R[:, None], (0, cur_len))
    return sequences_RxT, cache, unfinished_R, cur_len + 1

  state = (sequences_RxT, cache, jnp.ones((rows,), bool), jnp.asarray(prompt_len, jnp.int32))
  sequences_RxT, _, _, length = jax.lax.while_loop(keep_going, step, state)
  return sequences_RxT, length


def _gather_beams(x_BxJx___: jax.Array, index_BxI: jax.Array) -> jax.Array:
  """x[b, beams[b, j], ...]: HF's `_gather_beams` (take_along_dim on the beam axis)."""
  index = index_BxI.reshape(index_BxI.shape + (1,) * (x_BxJx___.ndim - 2))
  return jnp.take_along_axis(x_BxJx___, index, axis=1)


def beam_search(step_fn: StepFn, reorder_cache: ReorderFn, cache: Cache, prompt_BxP: jax.Array,
                config: SearchConfig, beams: BeamConfig) -> tuple[jax.Array, jax.Array]:
  """HF's `_beam_search` (do_sample=False, one returned sequence per batch item), static shapes.

  `cache` must hold B * J rows, row b * J + j for beam j of batch item b (the prompt is repeated
  here); `reorder_cache` moves each row's cache to the beam that continues it, every step.

  Per step, as HF (its helper in brackets):
   a. the J running beams' next-token log-probabilities (log_softmax of float32 logits, then
      `process_scores`) are added to their scores; the 2J best of the J*V continuations are the
      candidates [`_get_top_k_continuations`];
   b. a candidate is finished when its token is EOS or it reaches max_length; the J best
      unfinished candidates run on (finished ones pushed down by 1e9)
      [`_get_running_beams_for_next_iteration`];
   c. candidates among the first J that finished are scored sum(log p) / length ** penalty and
      merged with the J finished hypotheses kept so far, unless the batch item is full (early
      stopping True) or cannot improve (the heuristic of d) [`_update_finished_beams`];
   d. a batch item can still improve while the best running score at the hypothetical length
      (the current one; max_length with early_stopping="never" and a positive penalty) beats its
      worst finished score, or it has fewer than J finished [`_check_early_stop_heuristic`]; the
      search stops when no item can, or (early_stopping True) every item has J finished, or every
      candidate finished [`_beam_search_has_unfinished_sequences`].

  Returns (sequences [B, max_length] int32, length int32 []): each batch item's best finished
  hypothesis, HF's fill token after its end, and HF's output length (prompt + the longest best
  hypothesis): the caller keeps sequences[:, :length].
  """
  prompt_len = _check_prompt(prompt_BxP, config)
  batch, max_length, num_beams = prompt_BxP.shape[0], config.max_length, beams.num_beams
  rows = batch * num_beams
  # HF keeps max(2, 1 + number of EOS ids) * J candidates, so that J can run on even if the best
  # J all end.
  num_candidates = max(2, 1 + (config.eos_token_id is not None)) * num_beams
  early_stop_full = beams.early_stopping is True
  # HF divides float32 scores by `length ** length_penalty` computed by Python in double: the
  # same values for every length as a float32 table, indexed by the traced length (>= 1; entry 0
  # is never read).
  lengths_T = np.maximum(np.arange(max_length + 1, dtype=np.float64), 1.0)
  divisor_T = jnp.asarray((lengths_T ** beams.length_penalty).astype(np.float32))
  if beams.early_stopping == "never" and beams.length_penalty > 0.0:
    hypothetical_length = lambda cur_len: max_length - prompt_len
  else:
    hypothetical_length = lambda cur_len: cur_len - prompt_len

  prompt_RxP = jnp.repeat(prompt_BxP.astype(jnp.int32), num_beams, axis=0)
  cache = _prefill(step_fn, cache, prompt_RxP)
  running_BxJxT = jnp.full((batch, num_beams, max_length), config.beam_fill, jnp.int32)
  running_BxJxT = running_BxJxT.at[:, :, :prompt_len].set(prompt_RxP.reshape(batch, num_beams, -1))
  # Only the first beam's continuations count at the first step (the others are copies).
  running_scores_BxJ = jnp.full((batch, num_beams), _NEG, jnp.float32).at[:, 0].set(0.0)
  state = dict(
      running=running_BxJxT, running_scores=running_scores_BxJ, cache=cache,
      finished=running_BxJxT, finished_scores=jnp.full((batch, num_beams), _NEG, jnp.float32),
      is_finished=jnp.zeros((batch, num_beams), bool),
      # Generated tokens of each finished hypothesis (HF counts its beam indices): 0 for a slot
      # that holds none yet.
      finished_lengths=jnp.zeros((batch, num_beams), jnp.int32),
      improvable=jnp.ones((batch, 1), bool),
      cur_len=jnp.asarray(prompt_len, jnp.int32), done=jnp.asarray(False))
  batch_offset_Bx1 = jnp.arange(batch)[:, None] * num_beams
  top_beam_mask_C = jnp.arange(num_candidates) < num_beams

  def keep_going(s):
    return ~s["done"] & (s["cur_len"] < max_length)

  def step(s):
    cur_len = s["cur_len"]
    running_BxJxT = s["running"]
    running_RxT = running_BxJxT.reshape(rows, max_length)
    logits_RxV, cache = step_fn(_token_at(running_RxT, cur_len - 1), s["cache"])
    log_probs_RxV = jax.nn.log_softmax(_float32_logits(logits_RxV), axis=-1)
    log_probs_RxV = process_scores(log_probs_RxV, running_RxT, cur_len, config)
    vocab_size = log_probs_RxV.shape[-1]

    # a. Candidates: the best 2J of the J*V continuations of each batch item.
    scores_BxJxV = log_probs_RxV.reshape(batch, num_beams, vocab_size)
    scores_BxJV = (scores_BxJxV + s["running_scores"][:, :, None]).reshape(batch, -1)
    # lax.top_k sorts descending like torch.topk (equal scores: the lower index first).
    cand_scores_BxC, cand_index_BxC = jax.lax.top_k(scores_BxJV, num_candidates)
    cand_beam_BxC, cand_token_BxC = cand_index_BxC // vocab_size, cand_index_BxC % vocab_size
    at_cur_len_T = jnp.arange(max_length) == cur_len
    cand_BxCxT = jnp.where(at_cur_len_T, cand_token_BxC[..., None],
                           _gather_beams(running_BxJxT, cand_beam_BxC))
    hits_BxC = cur_len + 1 >= max_length  # HF's MaxLengthCriteria
    if config.eos_token_id is not None:
      hits_BxC = hits_BxC | (cand_token_BxC == config.eos_token_id)
    hits_BxC = jnp.broadcast_to(hits_BxC, cand_token_BxC.shape)

    # b. The J best candidates that did not finish run on.
    cand_running_BxC = cand_scores_BxC + hits_BxC.astype(jnp.float32) * _NEG
    running_scores_BxJ, keep_BxJ = jax.lax.top_k(cand_running_BxC, num_beams)
    running_BxJxT = _gather_beams(cand_BxCxT, keep_BxJ)
    origin_BxJ = _gather_beams(cand_beam_BxC, keep_BxJ)

    # c. Finished candidates (among the first J only) join the finished hypotheses if better.
    just_finished_BxC = hits_BxC & top_beam_mask_C
    length = cur_len + 1 - prompt_len
    final_BxC = cand_scores_BxC / divisor_T[length]
    full_Bx1 = jnp.all(s["is_finished"], axis=-1, keepdims=True) & early_stop_full
    final_BxC = final_BxC + full_Bx1.astype(jnp.float32) * _NEG
    final_BxC = final_BxC + (~s["improvable"]).astype(jnp.float32) * _NEG
    final_BxC = final_BxC + (~just_finished_BxC).astype(jnp.float32) * _NEG
    merged_scores = jnp.concatenate([s["finished_scores"], final_BxC], axis=1)
    finished_scores_BxJ, best_BxJ = jax.lax.top_k(merged_scores, num_beams)
    pick = lambda kept, new: _gather_beams(jnp.concatenate([kept, new], axis=1), best_BxJ)
    finished_BxJxT = pick(s["finished"], cand_BxCxT)
    is_finished_BxJ = pick(s["is_finished"], just_finished_BxC)
    finished_lengths_BxJ = pick(s["finished_lengths"], jnp.broadcast_to(length, hits_BxC.shape))

    # Each running beam continues from its origin beam's cache.
    cache = reorder_cache(cache, (batch_offset_Bx1 + origin_BxJ).reshape(rows))

    # d. Can each batch item still improve; is the search done?
    cur_len = cur_len + 1
    best_running_Bx1 = running_scores_BxJ[:, :1] / divisor_T[hypothetical_length(cur_len)]
    worst_finished_BxJ = jnp.where(
        is_finished_BxJ, jnp.min(finished_scores_BxJ, axis=1, keepdims=True), _NEG)
    improvable_Bx1 = s["improvable"] & jnp.any(best_running_Bx1 > worst_finished_BxJ, axis=-1,
                                               keepdims=True)
    all_full = jnp.all(is_finished_BxJ) & early_stop_full
    done = ~(jnp.any(improvable_Bx1) & ~all_full & ~jnp.all(hits_BxC))
    return dict(running=running_BxJxT, running_scores=running_scores_BxJ, cache=cache,
                finished=finished_BxJxT, finished_scores=finished_scores_BxJ,
                is_finished=is_finished_BxJ, finished_lengths=finished_lengths_BxJ,
                improvable=improvable_Bx1, cur_len=cur_len, done=done)

  s = jax.lax.while_loop(keep_going, step, state)
  # HF returns the best hypothesis of each item (slot 0: the finished slots are kept sorted) and
  # cuts every row to the longest of them.
  return s["finished"][:, 0], prompt_len + jnp.max(s["finished_lengths"][:, 0])


__all__ = ["SearchConfig", "BeamConfig", "process_scores", "banned_ngram_tokens",
           "sample_search", "beam_search", "check_int", "StepFn", "ReorderFn"]
