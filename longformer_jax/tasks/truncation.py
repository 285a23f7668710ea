"""What the length limit did to a fine-tuning split, and metrics split by example length.

`truncation_block` is the "truncation" record of a split's results, from per-example facts:

    {"max_length": 4096, "examples": 1000, "examples_truncated": 0.12,
     "document_tokens_kept": 0.97, "evidence_within_limit": 0.99}

  examples_truncated: the fraction of examples with any document or question (prefix) token cut.
  document_tokens_kept: the kept document (context) tokens over all document tokens; question
    and special tokens are not counted.
  evidence_within_limit: the fraction of examples whose evidence lies wholly inside what was kept
    (QA: an answer occurrence inside the kept context; multiple choice: the answer candidate in
    the kept supports; tagging: every word kept; coreference: every gold mention kept whole;
    HotpotQA: every supporting sentence in stage 1's row); None where a task has no evidence
    (classification). A kind may add keys of its own (`Kind.truncation_extras`: coreference's
    mentions_within_limit and links_within_limit).

Under the segment baseline "kept" is what the segments read (`segments.reading_stats`); a
fine-tuning run's segments read what a row of its max_length keeps
(`longformer_jax.tasks.finetune_segments`), so its block is the Longformer run's.

`by_length` splits per-example metric values by the tokens an example needs uncut (its full
length): `{"<=B": {metric: mean, ..., "examples": n}, ">B": {...}}`. A metric that is a mean of
per-example values (accuracy, EM, token F1 averaged per example) recombines exactly:
overall = (n_short * mean_short + n_long * mean_long) / (n_short + n_long) (`recombine`). A
corpus-level metric does not: macro F1 (a mean over classes of per-class F1, each a ratio of
counts over the whole split) of the two buckets says nothing exact about the split's, so
`by_length_with` computes such metrics on each bucket's examples anew, and they are not to be
averaged back. numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


def _counts(name: str, values, n: int | None = None) -> np.ndarray:
  a = np.asarray(values)
  if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
    raise ValueError(f"{name} must be a 1-d sequence of integer token counts, got "
                     f"{a.dtype} shape {a.shape}")
  if (a < 0).any():
    raise ValueError(f"{name} holds a negative count at example {int(np.argmax(a < 0))}")
  if n is not None and len(a) != n:
    raise ValueError(f"{name} has {len(a)} values for {n} examples")
  return a.astype(np.int64)


def truncation_block(*, max_length: int, document_tokens: Sequence[int],
                     kept_tokens: Sequence[int], prefix_cut: Sequence[bool] | None = None,
                     evidence_kept: Sequence[bool | None] | None = None) -> dict[str, Any]:
  """The split's "truncation" record (module docstring) from per-example facts.

  Args:
    max_length: the length limit the split was read with (a fine-tuning run's max_length,
      under the segment baseline too: its segments read what that row keeps).
    document_tokens: each example's document (context) tokens uncut.
    kept_tokens: each example's document tokens kept (<= document_tokens).
    prefix_cut: each example's question (prefix) lost tokens; default none did.
    evidence_kept: each example's evidence lies wholly inside what was kept (True/False), or None
      where the example has no evidence; None for the whole split (classification) gives
      `evidence_within_limit: None`. The fraction counts the examples with evidence.
  Fractions are None for an empty split (and document_tokens_kept when no example has a
  document token).
  """
  full = _counts("document_tokens", document_tokens)
  n = len(full)
  kept = _counts("kept_tokens", kept_tokens, n)
  if (kept > full).any():
    i = int(np.argmax(kept > full))
    raise ValueError(f"kept_tokens[{i}]={int(kept[i])} exceeds document_tokens[{i}]="
                     f"{int(full[i])}")
  cut = kept < full
  if prefix_cut is not None:
    prefix = np.asarray(prefix_cut, bool)
    if prefix.shape != (n,):
      raise ValueError(f"prefix_cut has shape {prefix.shape}; expected ({n},)")
    cut = cut | prefix
  evidence = None
  if evidence_kept is not None:
    if len(evidence_kept) != n:
      raise ValueError(f"evidence_kept has {len(evidence_kept)} values for {n} examples")
    known = [bool(e) for e in evidence_kept if e is not None]
    evidence = sum(known) / len(known) if known else None
  total = int(full.sum())
  return {"max_length": int(max_length), "examples": n,
          "examples_truncated": int(cut.sum()) / n if n else None,
          "document_tokens_kept": int(kept.sum()) / total if total else None,
          "evidence_within_limit": evidence}


def bucket_names(boundary: int) -> tuple[str, str]:
  """The keys of the two buckets: ("<=B", ">B")."""
  return f"<={boundary}", f">{boundary}"


def length_buckets(full_lengths: Sequence[int], boundary: int) -> dict[str, np.ndarray]:
  """{"<=B": indices of the examples needing at most `boundary` tokens, ">B": the others}."""
  if not isinstance(boundary, int) or isinstance(boundary, bool) or boundary < 1:
    raise ValueError(f"length bucket boundary must be an int >= 1, got {boundary!r}")
  lengths = _counts("full_lengths", full_lengths)
  short, long = bucket_names(boundary)
  return {short: np.flatnonzero(lengths <= boundary), long: np.flatnonzero(lengths > boundary)}


def by_length(full_lengths: Sequence[int], boundary: int,
              per_example: Mapping[str, Sequence[float]]) -> dict[str, dict[str, Any]]:
  """Per-example metric values averaged within each length bucket:
  `{"<=B": {metric: mean or None, ..., "examples": n}, ">B": {...}}` (None for an empty
  bucket). Means of the buckets recombine to the overall mean (`recombine`)."""
  buckets = length_buckets(full_lengths, boundary)
  n = sum(len(i) for i in buckets.values())
  values = {}
  for name, v in per_example.items():
    a = np.asarray(v, np.float64)
    if a.shape != (n,):
      raise ValueError(f"metric {name!r} has shape {a.shape}; expected ({n},), one value per "
                       "example")
    values[name] = a
  return {bucket: {**{name: math.fsum(a[idx]) / len(idx) if len(idx) else None
                      for name, a in values.items()}, "examples": len(idx)}
          for bucket, idx in buckets.items()}


def by_length_with(full_lengths: Sequence[int], boundary: int,
                   metrics: Callable[[np.ndarray], Mapping[str, Any]]
                   ) -> dict[str, dict[str, Any]]:
  """`metrics(indices)` (any metrics of those examples, corpus-level ones such as macro F1
  included) computed on each length bucket: `{"<=B": {...metrics, "examples": n}, ">B": ...}`.
  An empty bucket gets `{"examples": 0}` only."""
  return {bucket: ({**metrics(idx), "examples": len(idx)} if len(idx) else {"examples": 0})
          for bucket, idx in length_buckets(full_lengths, boundary).items()}


def recombine(buckets: Mapping[str, Mapping[str, Any]], metric: str) -> float | None:
  """The overall mean of a per-example metric from its bucket means: the examples-weighted mean
  (only for metrics that are means of per-example values; not macro F1)."""
  parts = [(b[metric], b["examples"]) for b in buckets.values() if b["examples"]]
  n = sum(k for _, k in parts)
  return math.fsum(m * k for m, k in parts) / n if n else None


__all__ = ["bucket_names", "by_length", "by_length_with", "length_buckets", "recombine",
           "truncation_block"]
