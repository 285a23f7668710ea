"""Coreference's span arithmetic, model-free: the grid of candidate spans, the distance buckets of
the pairwise scorer, and clusters from antecedent links (Lee et al. 2017/2018, Joshi et al.
2019). The grid and the buckets are jax.numpy with static shapes (usable inside jit); the
clusters are built on the host from the decoded links.

  span_grid               every span of up to W tokens within a sentence: starts, ends, valid
  distance_buckets        the ten buckets 0, 1, 2, 3, 4, 5-7, 8-15, 16-31, 32-63, 64+
  argmax_antecedents      each mention's best antecedent (or none) from its scores
  clusters_from_antecedents  clusters as the transitive closure of the antecedent links

Shape letters: the alphabet of `longformer_jax.ops` (N tokens, W widths, M mentions, K
antecedents per mention).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Lower bounds of the distance buckets 1..9 (bucket 0 is distance 0).
_BUCKET_FLOORS = (1, 2, 3, 4, 5, 8, 16, 32, 64)
NUM_DISTANCE_BUCKETS = len(_BUCKET_FLOORS) + 1


def span_grid(sentence_ids_N: jax.Array, max_width: int, token_mask_N: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The candidate spans of a token sequence, in a static [N * W] layout.

  Entry i * W + w is the span that starts at token i and ends at token i + w (end inclusive;
  W = max_width). It is valid when it ends inside the sequence, its first and last tokens have
  the same sentence id (sentence ids never decrease along the sequence, so the span lies in
  one sentence), and, when `token_mask_N` is given, every token it covers is a real token
  (padding, or segment markers between stitched segments, are not).

  Args:
    sentence_ids_N: int [N], non-decreasing along the sequence.
    max_width: W, the longest span in tokens (a Python int: it fixes the shapes).
    token_mask_N: optional bool [N], the tokens a span may cover.

  Returns:
    starts, ends: int32 [N * W] (an invalid span's end is clipped to N - 1);
    valid: bool [N * W]. Valid entries come ordered by start, then by end, as a loop over
    starts and widths enumerates them.
  """
  if not isinstance(max_width, int) or isinstance(max_width, bool) or max_width < 1:
    raise ValueError(f"max_width must be a positive int, got {max_width!r}")
  sentence_ids_N = jnp.asarray(sentence_ids_N)
  if sentence_ids_N.ndim != 1:
    raise ValueError(f"sentence_ids must be one id per token [N], got shape "
                     f"{sentence_ids_N.shape}")
  n = sentence_ids_N.shape[0]
  starts_NxW = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, max_width))
  unclipped_NxW = starts_NxW + jnp.arange(max_width, dtype=jnp.int32)[None, :]
  ends_NxW = jnp.minimum(unclipped_NxW, n - 1)
  valid_NxW = (unclipped_NxW < n) & (sentence_ids_N[starts_NxW] == sentence_ids_N[ends_NxW])
  if token_mask_N is not None:
    token_mask_N = jnp.asarray(token_mask_N, bool)
    if token_mask_N.shape != (n,):
      raise ValueError(f"token_mask must be one flag per token [{n}], got shape "
                       f"{token_mask_N.shape}")
    # Masked-out tokens before each position: a span covers none when the counts at its two
    # ends agree and its first token is real.
    masked_N = jnp.cumsum(~token_mask_N, dtype=jnp.int32)
    valid_NxW &= (masked_N[ends_NxW] == masked_N[starts_NxW]) & token_mask_N[starts_NxW]
  return starts_NxW.reshape(-1), ends_NxW.reshape(-1), valid_NxW.reshape(-1)


def distance_buckets(distance: jax.Array) -> jax.Array:
  """The bucket (int32, 0..9) of each distance: 0, 1, 2, 3, 4 for distances 0..4, then 5-7 -> 5,
  8-15 -> 6, 16-31 -> 7, 32-63 -> 8, 64 and beyond -> 9 (floor(log2 d) + 3 for d >= 5, capped).
  Distances are >= 0 (a negative one falls in bucket 0)."""
  distance = jnp.asarray(distance)
  floors = jnp.asarray(_BUCKET_FLOORS, distance.dtype)
  return jnp.sum(distance[..., None] >= floors, axis=-1, dtype=jnp.int32)


def argmax_antecedents(scores_MxK1: jax.Array, antecedents_MxK: jax.Array) -> jax.Array:
  """Each mention's predicted antecedent: int32 [M], an index into the mentions or -1 for none.

  Args:
    scores_MxK1: [M, K + 1], column 0 the dummy antecedent ("no antecedent", scored 0 by the
      model), column k + 1 the score of candidate antecedents_MxK[:, k]; candidates that cannot
      be chosen carry -inf (or a large negative score). Ties go to the lower column, so the
      dummy wins a tie.
    antecedents_MxK: int [M, K], the mention index of each candidate.
  """
  best_M = jnp.argmax(scores_MxK1, axis=-1)
  chosen_M = jnp.take_along_axis(antecedents_MxK, jnp.maximum(best_M - 1, 0)[:, None], axis=-1)
  return jnp.where(best_M > 0, chosen_M[:, 0], -1).astype(jnp.int32)


def clusters_from_antecedents(starts_M: Sequence[int], ends_M: Sequence[int],
                              antecedents_M: Sequence[int]
                              ) -> tuple[tuple[tuple[int, int], ...], ...]:
  """Clusters as the transitive closure of antecedent links: mention i and its antecedent
  antecedents_M[i] (-1: none) share a cluster, and so does everything linked to either. A
  mention with no link either way forms no cluster (predicted singletons are not output).
  Mentions are identified by their (start, end) span, so two entries with one span are one
  mention.

  Returns:
    clusters of (start, end) spans (end inclusive), each sorted, ordered by their first span.

  Raises:
    ValueError: lengths that differ, or an antecedent that is not -1 or another mention's index.
  """
  starts_M, ends_M = np.asarray(starts_M).reshape(-1), np.asarray(ends_M).reshape(-1)
  antecedents_M = np.asarray(antecedents_M).reshape(-1)
  m = len(antecedents_M)
  if len(starts_M) != m or len(ends_M) != m:
    raise ValueError(f"need one start, end and antecedent per mention: got {len(starts_M)} "
                     f"starts, {len(ends_M)} ends and {m} antecedents")
  parent: dict[tuple[int, int], tuple[int, int]] = {}

  def root(span):
    while parent[span] != span:
      parent[span] = parent[parent[span]]  # path halving keeps the trees shallow
      span = parent[span]
    return span

  for i, a in enumerate(antecedents_M.tolist()):
    if a == -1:
      continue
    if not 0 <= a < m or a == i:
      raise ValueError(f"mention {i}: antecedent {a} must be -1 (none) or the index of another "
                       f"of the {m} mentions")
    mention = (int(starts_M[i]), int(ends_M[i]))
    antecedent = (int(starts_M[a]), int(ends_M[a]))
    for span in (mention, antecedent):
      parent.setdefault(span, span)
    parent[root(mention)] = root(antecedent)
  groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
  for span in parent:
    groups.setdefault(root(span), []).append(span)
  return tuple(sorted(tuple(sorted(g)) for g in groups.values() if len(g) > 1))


__all__ = [
    "NUM_DISTANCE_BUCKETS", "argmax_antecedents", "clusters_from_antecedents",
    "distance_buckets", "span_grid",
]
