"""Question answering's model-free pieces: the answer normalisers, HotpotQA's official scores and
the all-occurrence ("or") span loss. Pure functions on numpy / jax.numpy: importing this module
imports no model, data layer or training loop.

  normalize_answer, normalize_triviaqa, NORMALIZERS, get_normalizer
                 SQuAD v1.1's and TriviaQA's answer normalisers, selectable by name
  hotpot_scores  HotpotQA's answer, supporting-fact and joint EM / F1 / precision / recall
  all_occurrence_span_loss
                 the loss over every occurrence of every gold answer (Clark & Gardner's
                 "shared-normalisation or" objective, as TriviaQA's Longformer model trains)

Every score is a fraction in [0, 1] (the official scripts print some of them 100x). Shape
letters: the alphabet of `longformer_jax.ops` (B batch, N positions, A gold answer positions).
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

# ----------------------------------------------------------------------------------------------
# Answer normalisers

_SQUAD_PUNCTUATION = frozenset(string.punctuation)
# TriviaQA's evaluation also treats the typographic quotes as punctuation, and replaces every
# punctuation character by a space (SQuAD deletes it: "rock-and-roll" -> "rockandroll").
_TRIVIAQA_PUNCTUATION = frozenset(string.punctuation + "\u2018\u2019\u00b4`")
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
  """SQuAD v1.1's answer normalisation (its official evaluate script, which HotpotQA's also
  uses): lower case, punctuation (Python's `string.punctuation`) deleted, the articles a/an/the
  removed, whitespace collapsed."""
  s = "".join(ch for ch in s.lower() if ch not in _SQUAD_PUNCTUATION)
  return " ".join(_ARTICLES.sub(" ", s).split())


def normalize_triviaqa(s: str) -> str:
  """TriviaQA's answer normalisation (its evaluation utilities): "_" -> space, lower case,
  punctuation and the quotes ‘ ’ ´ ` each replaced by a space, the articles a/an/the removed,
  whitespace collapsed. Unlike SQuAD's, "rock-and-roll", "U.S." and "New_York" keep their word
  boundaries ("rock and roll", "u s", "new york")."""
  s = s.replace("_", " ").lower()
  s = "".join(" " if ch in _TRIVIAQA_PUNCTUATION else ch for ch in s)
  return " ".join(_ARTICLES.sub(" ", s).split())


NORMALIZERS: Mapping[str, Callable[[str], str]] = {
    "squad": normalize_answer,
    "triviaqa": normalize_triviaqa,
}


def get_normalizer(name: str) -> Callable[[str], str]:
  """The answer normaliser called `name` (a key of `NORMALIZERS`)."""
  if name not in NORMALIZERS:
    raise ValueError(f"unknown answer normalizer {name!r}: expected one of "
                     f"{', '.join(sorted(NORMALIZERS))}")
  return NORMALIZERS[name]


# ----------------------------------------------------------------------------------------------
# HotpotQA

HOTPOT_METRICS = ("em", "f1", "prec", "recall", "sp_em", "sp_f1", "sp_prec", "sp_recall",
                  "joint_em", "joint_f1", "joint_prec", "joint_recall")
# When either normalised answer is one of these and they differ, HotpotQA scores F1 = P = R = 0
# (a "yes" must not earn partial credit against "yes, in 1990").
_CLOSED_ANSWERS = ("yes", "no", "noanswer")


def _answer_scores(prediction: str, gold: str) -> tuple[float, float, float, float]:
  """(EM, F1, precision, recall) of one answer, HotpotQA's way."""
  p, g = normalize_answer(prediction), normalize_answer(gold)
  em = float(p == g)
  if p != g and (p in _CLOSED_ANSWERS or g in _CLOSED_ANSWERS):
    return em, 0.0, 0.0, 0.0
  p_tokens, g_tokens = p.split(), g.split()
  same = sum((collections.Counter(p_tokens) & collections.Counter(g_tokens)).values())
  if same == 0:
    return em, 0.0, 0.0, 0.0
  precision, recall = same / len(p_tokens), same / len(g_tokens)
  return em, 2 * precision * recall / (precision + recall), precision, recall


def _sp_scores(predicted: set, gold: set) -> tuple[float, float, float, float]:
  """(EM, F1, precision, recall) of the supporting facts, sets of (title, sentence id)."""
  tp = len(predicted & gold)
  fp, fn = len(predicted - gold), len(gold - predicted)
  precision = tp / (tp + fp) if tp + fp else 0.0
  recall = tp / (tp + fn) if tp + fn else 0.0
  f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
  return float(fp + fn == 0), f1, precision, recall


def _facts(value: Any, where: str) -> set[tuple[str, int]]:
  """A list of [title, sentence id] pairs as a set of tuples."""
  if not isinstance(value, (list, tuple)):
    raise ValueError(f"{where} must be a list of [title, sentence id] pairs, got "
                     f"{type(value).__name__}")
  facts = set()
  for i, fact in enumerate(value):
    if (not isinstance(fact, (list, tuple)) or len(fact) != 2 or not isinstance(fact[0], str)
        or not isinstance(fact[1], int) or isinstance(fact[1], bool)):
      raise ValueError(f"{where}[{i}] must be a [title (str), sentence id (int)] pair, got "
                       f"{fact!r}"[:300])
    facts.add((fact[0], fact[1]))
  return facts


def hotpot_scores(*, predictions: Mapping[str, Mapping], golds: Sequence[Mapping]
                  ) -> dict[str, float]:
  """HotpotQA's official metrics (its hotpot_evaluate_v1 script), each a fraction in [0, 1].

  Args:
    predictions: the official prediction file's object, {"answer": {id: answer text}, "sp":
      {id: [[title, sentence id], ...]}}. Ids absent from either map score 0 in that part and
      in the joint metrics; ids that no gold record has are ignored.
    golds: HotpotQA records, each with at least "_id", "answer" and "supporting_facts"
      ([[title, sentence id], ...]); the other fields are not read.

  Returns:
    {"em", "f1", "prec", "recall"}: the answer, after SQuAD's normalisation; F1, precision and
    recall are over the words, and all three are 0 when either normalised answer is "yes", "no"
    or "noanswer" and the two differ. {"sp_em", "sp_f1", "sp_prec", "sp_recall"}: the supporting
    facts as sets of (title, sentence id); EM is 1 when the sets are equal. {"joint_em",
    "joint_f1", "joint_prec", "joint_recall"}: joint precision = answer precision x
    supporting-fact precision, joint recall likewise, joint F1 from those two, joint EM = answer
    EM x supporting-fact EM. Every metric is the mean over `golds`.

  Raises:
    ValueError: no gold record, a record or prediction of the wrong shape (its index or id
      named), or a gold id repeated.
  """
  if not isinstance(predictions, Mapping) or not all(
      isinstance(predictions.get(k), Mapping) for k in ("answer", "sp")):
    raise ValueError("predictions must be the official prediction object {\"answer\": {id: "
                     "str}, \"sp\": {id: [[title, sentence id]]}}, got "
                     f"{type(predictions).__name__} with keys "
                     f"{sorted(predictions) if isinstance(predictions, Mapping) else None}")
  if not golds:
    raise ValueError("golds holds no record (need at least one to average over)")
  answers, facts = predictions["answer"], predictions["sp"]
  totals = dict.fromkeys(HOTPOT_METRICS, 0.0)
  seen = set()
  for i, record in enumerate(golds):
    missing = [k for k in ("_id", "answer", "supporting_facts")
               if not isinstance(record, Mapping) or k not in record]
    if missing:
      raise ValueError(f"golds[{i}] lacks {', '.join(missing)} (a HotpotQA record has _id, "
                       f"answer and supporting_facts)")
    key = record["_id"]
    if key in seen:
      raise ValueError(f"golds[{i}]: _id {key!r} repeats an earlier record's")
    seen.add(key)
    if not isinstance(record["answer"], str):
      raise ValueError(f"golds[{i}] (_id {key!r}): answer must be a string, got "
                       f"{record['answer']!r}"[:300])
    gold_facts = _facts(record["supporting_facts"], f"golds[{i}] (_id {key!r}) supporting_facts")
    answer = sp = None
    if key in answers:
      if not isinstance(answers[key], str):
        raise ValueError(f"predictions['answer'][{key!r}] must be a string, got "
                         f"{answers[key]!r}"[:300])
      answer = _answer_scores(answers[key], record["answer"])
      for name, value in zip(("em", "f1", "prec", "recall"), answer):
        totals[name] += value
    if key in facts:
      sp = _sp_scores(_facts(facts[key], f"predictions['sp'][{key!r}]"), gold_facts)
      for name, value in zip(("sp_em", "sp_f1", "sp_prec", "sp_recall"), sp):
        totals[name] += value
    if answer is not None and sp is not None:
      precision, recall = answer[2] * sp[2], answer[3] * sp[3]
      totals["joint_em"] += answer[0] * sp[0]
      totals["joint_prec"] += precision
      totals["joint_recall"] += recall
      if precision + recall:
        totals["joint_f1"] += 2 * precision * recall / (precision + recall)
  return {name: value / len(golds) for name, value in totals.items()}


# ----------------------------------------------------------------------------------------------
# The all-occurrence span loss


def _or_nll(logits_BxN: jax.Array, positions_BxA: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(-log of the probability mass on the distinct gold positions [B], has a gold [B])."""
  positions_BxA = jnp.asarray(positions_BxA, jnp.int32)
  logits_BxN = jnp.asarray(logits_BxN, jnp.float32)
  valid_BxA = positions_BxA >= 0
  # A position listed twice (two aliases, or two answers that share a start) counts once: keep
  # only its first listing, so the numerator is a sum over distinct positions.
  same_BxAxA = positions_BxA[:, :, None] == positions_BxA[:, None, :]
  earlier_AxA = jnp.tril(jnp.ones(same_BxAxA.shape[1:], bool), k=-1)
  repeat_BxA = jnp.any(same_BxAxA & earlier_AxA & valid_BxA[:, None, :], axis=-1)
  keep_BxA = valid_BxA & ~repeat_BxA
  has_B = jnp.any(keep_BxA, axis=-1)
  gold_BxA = jnp.take_along_axis(logits_BxN, jnp.maximum(positions_BxA, 0), axis=-1)
  gold_BxA = jnp.where(keep_BxA, gold_BxA, -jnp.inf)
  # A row without a gold position would take logsumexp of all -inf (a NaN gradient): give it
  # finite stand-ins, and its loss is zeroed below.
  gold_BxA = jnp.where(has_B[:, None], gold_BxA, 0.0)
  nll_B = jax.nn.logsumexp(logits_BxN, axis=-1) - jax.nn.logsumexp(gold_BxA, axis=-1)
  return jnp.where(has_B, nll_B, 0.0), has_B


def all_occurrence_span_loss(start_logits_BxN: jax.Array, end_logits_BxN: jax.Array,
                             starts_BxA: jax.Array, ends_BxA: jax.Array) -> jax.Array:
  """The "or" loss over every gold occurrence [B]: per row, (start loss + end loss) / 2, where
  the start loss is logsumexp(start logits at every distinct gold start position) -
  logsumexp(start logits at all N positions), negated, and the end loss likewise. The model is
  rewarded for putting its mass on any occurrence of any alias, not on one chosen occurrence.

  Args:
    start_logits_BxN, end_logits_BxN: the logits, positions that cannot answer already masked
      (e.g. -1e9 outside the context).
    starts_BxA, ends_BxA: int gold positions into N, padded with -1. Starts and ends are taken
      as two sets (not pairs); a position listed more than once counts once.

  Returns:
    float32 [B]; 0 for a row with no gold start (or end) position: average over the rows that
    have one, e.g. `(starts_BxA >= 0).any(-1)`.
  """
  start_B, has_start_B = _or_nll(start_logits_BxN, starts_BxA)
  end_B, has_end_B = _or_nll(end_logits_BxN, ends_BxA)
  return jnp.where(has_start_B & has_end_B, 0.5 * (start_B + end_B), 0.0)


__all__ = [
    "HOTPOT_METRICS", "NORMALIZERS", "all_occurrence_span_loss", "get_normalizer",
    "hotpot_scores", "normalize_answer", "normalize_triviaqa",
]
