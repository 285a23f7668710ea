"""Coreference's scores: MUC, B-cubed and CEAF-phi4 (entity-based CEAF), accumulated over a corpus,
and the CoNLL F1 that averages them. Pure Python, numpy and scipy: importing this module imports
no model, data layer or training loop.

  coref_scores   the three metrics' precision / recall / F1 and the CoNLL F1 of a corpus
  metric_counts  one document's (precision numerator, precision denominator, recall numerator,
                 recall denominator) for each metric: what `coref_scores` sums

Definitions (Vilain et al. 1995; Bagga & Baldwin 1998; Luo 2005; Pradhan et al. 2014), with K the
key (gold) clusters and R the response (predicted) clusters, each a set of mentions:

  MUC     recall = sum over K of (|K| - |parts of K|) / sum over K of (|K| - 1), where the parts
          of K are its mentions grouped by the response cluster that holds them (a mention that
          no response cluster holds is a part of its own); precision swaps K and R.
  B-cubed recall = sum over K, R of |K & R|^2 / |K|, over the number of key mentions; precision
          = sum over K, R of |K & R|^2 / |R|, over the number of response mentions.
  CEAFe   phi4(K, R) = 2 |K & R| / (|K| + |R|); the best one-to-one alignment of key and response
          clusters (scipy's linear_sum_assignment) gives the similarity S; recall = S / |{K}|,
          precision = S / |{R}|.

Over a corpus each metric adds up its numerators and its denominators before dividing (the
reference scorer's and the coreference literature's way), so a long document weighs more than a
short one: it is not a mean of per-document F1. F1 = 2 P R / (P + R) (0 when both are 0); a
zero denominator gives 0. CoNLL F1 = the mean of the three F1s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

METRICS = ("muc", "b3", "ceafe")

Span = tuple[int, int]
Clusters = Sequence[Sequence[Sequence[int]]]


def _clusters(clusters: Clusters, where: str, singletons: bool) -> list[list[Span]]:
  """Checked clusters as lists of (start, end) tuples, each mention kept once (its first
  occurrence: a later repeat, in the same or another cluster, is dropped), clusters left empty
  dropped, and with singletons=False the one-mention clusters dropped too."""
  if isinstance(clusters, (str, bytes)) or not isinstance(clusters, Sequence):
    raise ValueError(f"{where} must be a list of clusters (lists of [start, end] spans), got "
                     f"{type(clusters).__name__}")
  seen: set[Span] = set()
  out = []
  for c, cluster in enumerate(clusters):
    if isinstance(cluster, (str, bytes)) or not isinstance(cluster, (Sequence, np.ndarray)):
      raise ValueError(f"{where} cluster {c} must be a list of [start, end] spans, got "
                       f"{cluster!r}"[:300])
    kept = []
    for m, span in enumerate(cluster):
      if isinstance(span, np.ndarray):
        span = span.tolist()
      if (isinstance(span, (str, bytes)) or not isinstance(span, Sequence) or len(span) != 2
          or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in span)
          or not 0 <= span[0] <= span[1]):
        raise ValueError(f"{where} cluster {c} mention {m} must be a [start, end] pair of ints "
                         f"with 0 <= start <= end (end inclusive), got {span!r}"[:300])
      mention = (int(span[0]), int(span[1]))
      if mention not in seen:
        seen.add(mention)
        kept.append(mention)
    if len(kept) > (0 if singletons else 1):
      out.append(kept)
  return out


def _muc(clusters: list[list[Span]], other: dict[Span, int]) -> tuple[float, float]:
  """(numerator, denominator) of MUC's recall of `clusters` against the partition `other`."""
  numerator = denominator = 0
  for cluster in clusters:
    parts = {other.get(m, ("alone", m)) for m in cluster}
    numerator += len(cluster) - len(parts)
    denominator += len(cluster) - 1
  return numerator, denominator


def _b3(clusters: list[list[Span]], other: dict[Span, int]) -> tuple[float, float]:
  """(numerator, denominator) of B-cubed's recall of `clusters` against the partition `other`."""
  numerator = 0.0
  denominator = 0
  for cluster in clusters:
    overlaps: dict[int, int] = {}
    for m in cluster:
      if m in other:
        overlaps[other[m]] = overlaps.get(other[m], 0) + 1
    numerator += sum(n * n for n in overlaps.values()) / len(cluster)
    denominator += len(cluster)
  return numerator, denominator


def _ceafe(key: list[list[Span]], response: list[list[Span]]) -> float:
  """CEAF-phi4's similarity: the best one-to-one alignment's sum of phi4."""
  if not key or not response:
    return 0.0
  from scipy.optimize import linear_sum_assignment  # scipy comes with jax; only needed here

  response_of = {m: j for j, cluster in enumerate(response) for m in cluster}
  phi_KxR = np.zeros((len(key), len(response)))
  for i, cluster in enumerate(key):
    for m in cluster:
      if m in response_of:
        phi_KxR[i, response_of[m]] += 1  # |K & R|
  phi_KxR *= 2 / (np.array([len(c) for c in key])[:, None]
                  + np.array([len(c) for c in response])[None, :])
  rows, cols = linear_sum_assignment(phi_KxR, maximize=True)
  return float(phi_KxR[rows, cols].sum())


def metric_counts(key: Clusters, response: Clusters, *, singletons: bool = True,
                  where: str = "document") -> dict[str, tuple[float, float, float, float]]:
  """One document's counts: {metric: (precision numerator, precision denominator, recall
  numerator, recall denominator)} for "muc", "b3" and "ceafe". `key` and `response` are lists
  of clusters of [start, end] spans (end inclusive); see `coref_scores` for the conventions.
  `where` names the document in error messages."""
  key = _clusters(key, f"{where} gold", singletons)
  response = _clusters(response, f"{where} prediction", singletons)
  key_of = {m: i for i, cluster in enumerate(key) for m in cluster}
  response_of = {m: j for j, cluster in enumerate(response) for m in cluster}
  muc_p, muc_r = _muc(response, key_of), _muc(key, response_of)
  b3_p, b3_r = _b3(response, key_of), _b3(key, response_of)
  similarity = _ceafe(key, response)
  return {"muc": (*muc_p, *muc_r), "b3": (*b3_p, *b3_r),
          "ceafe": (similarity, len(response), similarity, len(key))}


def _prf(p_num: float, p_den: float, r_num: float, r_den: float) -> dict[str, float]:
  p = p_num / p_den if p_den else 0.0
  r = r_num / r_den if r_den else 0.0
  return {"p": p, "r": r, "f1": 2 * p * r / (p + r) if p + r else 0.0}


def coref_scores(*, golds: Sequence[Clusters] | Mapping[str, Clusters],
                 predictions: Sequence[Clusters] | Mapping[str, Clusters],
                 singletons: bool = True) -> dict:
  """MUC, B-cubed and CEAF-phi4 precision / recall / F1 of a corpus, and the CoNLL F1.

  Args:
    golds: per document, its clusters, each a list of mentions as [start, end] token spans (end
      inclusive); a list of documents, or a mapping from document key to clusters.
    predictions: the same for the predicted clusters: a list as long as `golds`, or a mapping
      (with mappings, a document absent from `predictions` scores as an empty prediction, and
      a key that `golds` lacks is refused).
    singletons: True (default): the CoNLL reference scorer's convention, one-mention clusters
      are scored like any other (they count in B-cubed and CEAFe; MUC, which scores links, gives
      them no weight either way). False: the convention of the Lee et al. / Joshi et al.
      metrics (and most coreference papers), one-mention clusters of both sides are removed
      before scoring; the two agree when neither side has any, as on OntoNotes' gold.

  Repeated mentions, under both conventions: a mention listed again, in its own cluster or
  another, counts once, where it first occurs (clusters in order, mentions in order); the rest
  of the later cluster is scored, and a cluster left empty is dropped. The reference scorer
  (v8.01) does this for a repeated response mention that matches a gold mention (and refuses a
  response with more than ten repeats); here the rule also covers a repeated response mention
  that matches none, which the reference scorer leaves twice, and the gold, where it only warns.

  Returns:
    {"muc": {"p", "r", "f1"}, "b3": {...}, "ceafe": {...}, "conll_f1"}, fractions in [0, 1],
    each metric's numerators and denominators summed over the documents before dividing (the
    module docstring).

  Raises:
    ValueError: no document, `golds` and `predictions` of different lengths or kinds, or a
      malformed cluster or mention (its document, cluster and mention named).
  """
  if isinstance(golds, Mapping) != isinstance(predictions, Mapping):
    raise ValueError("golds and predictions must both be lists of documents or both mappings "
                     f"from document key, got {type(golds).__name__} and "
                     f"{type(predictions).__name__}")
  if isinstance(golds, Mapping):
    extra = sorted(set(predictions) - set(golds), key=str)
    if extra:
      raise ValueError(f"predictions name documents that golds lacks: {extra[:5]!r}")
    pairs = [(f"document {k!r}", golds[k], predictions.get(k, [])) for k in golds]
  else:
    if len(golds) != len(predictions):
      raise ValueError(f"need one prediction per gold document: got {len(predictions)} "
                       f"predictions for {len(golds)} documents")
    pairs = [(f"document {i}", g, p) for i, (g, p) in enumerate(zip(golds, predictions))]
  if not pairs:
    raise ValueError("golds holds no document")
  sums = {name: np.zeros(4) for name in METRICS}
  for where, key, response in pairs:
    for name, counts in metric_counts(key, response, singletons=singletons,
                                      where=where).items():
      sums[name] += counts
  scores = {name: _prf(*sums[name]) for name in METRICS}
  scores["conll_f1"] = sum(scores[name]["f1"] for name in METRICS) / len(METRICS)
  return scores


__all__ = ["METRICS", "coref_scores", "metric_counts"]
