"""The segment baseline of the paper's fine-tuning comparison (§6) for every fine-tuning kind:
`FinetuneOptions(baseline="segments")` (`--set baseline=segments`).

Each example is featurised as for the Longformer (`fd.read_split` at the run's max_length: the
same tokens are kept, so both read the same evidence), then its document is read in segments of
`segment_length` tokens by the encoder, each segment a row of its own,

    <s> prefix </s></s> segment </s>      (QA: the question; multiple choice: question </s></s>
                                           candidate)
    <s> segment </s>                      (classification, tagging)

all segments of a batch's examples encoded as one batch, positions restarting in every row, no
token of one segment seeing any of another (`longformer_jax.segments`), and the states stitched
back to document positions. The heads are the kinds' own (the same model classes, the same
parameters: a segments run saves, reloads and resumes as any run):

  classification   the first segment's `<s>` state (segment_pool "first", the default), or the
                   mean of every read segment's (segment_pool "mean"): our choice, the paper does
                   not say which its baseline used.
  qa               start and end logits over the stitched document: one softmax per example
                   across all its segments, the best span over the whole document (a span may
                   cross a segment boundary: the stitched logits are per position).
  token            every document position's tags from its stitched state.
  multiple_choice  each candidate's score summed over its segments (each segment's pooled `<s>`
                   scored by the kind's classifier).
  hotpotqa         its own reading (`Kind.reads_segments`, `tasks.hotpotqa.segment_outputs`):
                   both stages' rows `<s> [q] question [/q] segment </s>`, the heads on the
                   states stitched back to row positions.

Global attention follows the kind's mode inside each row ("first": every row's `<s>`,
"question": `<s>` and the prefix). Run with a short model (an HF RoBERTa directory, one of ours)
this is the paper's baseline; run with a long one, it is that model denied any reach across
segments. `SegmentReading` is the kind's batch / logits / loss / outputs in this form; the rest
(scoring, labels, the head's size) is the kind's. Shape letters: B examples, C candidates, R rows
of documents (B, or B*C), N document tokens, Q prefix tokens, S segments, L segment length, K
tags.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from longformer_jax import segments
from longformer_jax.data import finetune_data as fd
from longformer_jax.data.tokenizer import SpecialIds
from longformer_jax.tasks.finetune_kinds import (
    KINDS, Classification, Kind, MultipleChoice, QuestionAnswering, Tagging, best_spans)

BASELINES = ("longformer", "segments")
SEGMENT_POOLS = segments.POOL_MODES
_KINDS = (Classification, QuestionAnswering, Tagging, MultipleChoice)
_NEG = -1e9  # as the kinds': positions and candidates that cannot be chosen
_ce = optax.softmax_cross_entropy_with_integer_labels


def check_kind(kind: Kind) -> None:
  """ValueError unless `kind` can be read in segments."""
  if not isinstance(kind, _KINDS):
    own = [k.name for k in KINDS.values() if k.reads_segments]
    names = ", ".join([k.name for k in _KINDS] + own)
    raise ValueError(f"baseline='segments' reads the tasks {names} in segments; task "
                     f"{kind.name!r} has no segment form (use baseline='longformer')")


def _rows(kind: Kind, example: fd.Example) -> list[tuple[np.ndarray | None, np.ndarray]]:
  """(prefix or None, document) of each of the example's rows (multiple choice: one per
  candidate), cut out of the Longformer row `<s> prefix </s></s> document </s>` /
  `<s> document </s>`: the segments read exactly what that row keeps."""
  rows = example.input_ids if isinstance(example.input_ids, tuple) else (example.input_ids,)
  if not kind.has_question:
    return [(None, row[1:-1]) for row in rows]
  ends = example.candidate_ends or (example.question_end,)
  return [(row[1:end], row[end + 2:-1]) for row, end in zip(rows, ends)]


def _heads(kind: Kind, example: fd.Example) -> int:
  """The Longformer row position of the example's first document token."""
  return example.question_end + 2 if kind.has_question else 1


# Each split's prefix width, computed once (a pass over every example) instead of per batch;
# an entry leaves with its split (`weakref.finalize`), so a new split never reads a stale one.
_PREFIX_WIDTHS: dict[int, int] = {}


def prefix_width(kind: Kind, split: fd.FinetuneSplit) -> int:
  """Q: the longest prefix of the split's rows (0 without one): the static width every batch of
  the split is padded to, so that one program serves them all."""
  if not kind.has_question:
    return 0
  key = id(split)
  if key not in _PREFIX_WIDTHS:
    _PREFIX_WIDTHS[key] = max((len(p) for e in split.examples for p, _ in _rows(kind, e)),
                              default=0)
    weakref.finalize(split, _PREFIX_WIDTHS.pop, key, None)
  return _PREFIX_WIDTHS[key]


def document_width(kind: Kind, split: fd.FinetuneSplit) -> int:
  """N: the most document tokens a row of the split's max_length can hold."""
  return split.max_length - (4 if kind.has_question else 2)


@dataclasses.dataclass(frozen=True)
class SegmentReading:
  """A kind (`kind`) read in segments of `segment_length` tokens, consecutive segments sharing
  `overlap` document tokens, classification pooling `pool`, global attention `global_mode`
  ("none", "first", "question"): the kind's `batch`, `logits`, `loss` and `outputs` in the
  segment form (module docstring). Hashable: `predict` compiles one program per reading."""
  kind: Kind
  segment_length: int = 512
  overlap: int = 0
  pool: str = "first"
  global_mode: str = "none"

  def __post_init__(self):
    check_kind(self.kind)

  @property
  def name(self) -> str:
    return self.kind.name

  def check(self, split: fd.FinetuneSplit) -> None:
    """ValueError when a segment of the split's longest prefix leaves no document token beyond
    the overlap (the message names the setting to change)."""
    q = prefix_width(self.kind, split)
    extra = 3 + q if self.kind.has_question else 1
    room = self.segment_length - extra - 1
    if room < self.overlap + 1:
      before = f"<s>, a prefix of {q} tokens, </s></s>" if self.kind.has_question else "<s>"
      raise ValueError(f"{split.path}: segment_length={self.segment_length} leaves {room} "
                       f"document tokens per segment after {before} and </s>; it must leave "
                       f"more than segment_overlap={self.overlap} (raise segment_length or "
                       f"lower max_question_length)")

  # Arrays.

  def batch(self, split: fd.FinetuneSplit, rows: Sequence[int], *, global_attention: str,
            specials: SpecialIds) -> dict[str, np.ndarray]:
    """document_ids, document_mask int32 [R, N]; with a prefix prefix_ids, prefix_mask
    [R, Q]; then the kind's targets at document positions (QA: start_positions, end_positions
    [B] into the document, -1 for none, and row_heads [B], where the document starts in the
    Longformer row; tagging: labels [B, N]; classification and multiple choice as the kind's:
    labels, choice_mask)."""
    del global_attention  # the reading's global_mode
    kind = self.kind
    examples = [split.examples[i] for i in rows]
    pieces = [_rows(kind, e) for e in examples]
    if isinstance(kind, MultipleChoice):  # filler candidates: empty rows, masked out
      c = split.num_choices
      pieces = [p + [(np.zeros(0, np.int32), np.zeros(0, np.int32))] * (c - len(p))
                for p in pieces]
    flat = [row for p in pieces for row in p]
    n = document_width(kind, split)
    document_ids, document_mask = _pad([d for _, d in flat], n, specials.pad)
    out = {"document_ids": document_ids, "document_mask": document_mask}
    if kind.has_question:
      q = max(1, prefix_width(kind, split))
      out["prefix_ids"], out["prefix_mask"] = _pad([p for p, _ in flat], q, specials.pad)
    targets = kind.targets(split, examples)
    if isinstance(kind, QuestionAnswering):
      heads = np.asarray([_heads(kind, e) for e in examples], np.int32)
      for name in ("start_positions", "end_positions"):
        at = targets[name]
        out[name] = np.where(at >= 0, at - heads, -1).astype(np.int32)
      out["row_heads"] = heads
    elif isinstance(kind, Tagging):
      out["labels"] = targets["labels"][:, 1:1 + n]
    else:
      out.update(targets)
    return out

  # The model.

  def encode(self, model: nnx.Module, batch: Mapping[str, jax.Array]) -> segments.SegmentOutput:
    """The model's encoder (`model.longformer`) on the segments of the batch's documents."""
    encoder = model.longformer
    mode = self.global_mode
    if mode == "question" and not self.kind.has_question:
      mode = "first"
    return segments.encode_segments(
        lambda ids, mask, global_mask, **kwargs: encoder(ids, mask, global_mask, **kwargs),
        batch["document_ids"], batch["document_mask"], prefix_ids=batch.get("prefix_ids"),
        prefix_mask=batch.get("prefix_mask"), specials=SpecialIds.of_config(model.config),
        segment_length=self.segment_length, overlap=self.overlap, global_mode=mode)

  def logits(self, model: nnx.Module, batch: Mapping[str, jax.Array], max_global: int = 0
             ) -> dict[str, jax.Array]:
    """The kind's float32 logits over the segments: classification and multiple choice
    "logits" [B, L] / [B, C]; QA "start_logits", "end_logits" [B, N] over the stitched
    document (positions not read: -1e9) and "row_heads"; tagging "logits" [B, N, K]. max_global
    is the rows' own (`segments.encode_segments`): the argument is taken for the kind's
    signature."""
    del max_global
    out = self.encode(model, batch)
    kind, layout = self.kind, out.layout
    if isinstance(kind, Classification):
      if self.pool == "first":
        states = out.row_states[:, 0]  # the first segment's row: the head reads its <s>
      else:
        states = segments.pool(out.row_states, layout, "mean")[:, None, :]
      return {"logits": _float(model.classifier(states))}
    if isinstance(kind, QuestionAnswering):
      both = _float(model.qa_outputs(out.row_states))  # [B, S, L, 2]
      kept = layout.kept
      return {"start_logits": jnp.where(kept, segments.stitch(both[..., 0], layout), _NEG),
              "end_logits": jnp.where(kept, segments.stitch(both[..., 1], layout), _NEG),
              "row_heads": batch["row_heads"]}
    if isinstance(kind, Tagging):
      return {"logits": _float(model.classifier(model.dropout(out.last_hidden_state)))}
    # Multiple choice: each segment's <s> pooled and scored, summed over the segments.
    pooled = jnp.tanh(model.longformer.pooler(out.segment_starts))  # [BC, S, E]
    scores_RxS = _float(model.classifier(model.dropout(pooled)))[..., 0]
    choice = batch["choice_mask"]
    summed = segments.sum_over_segments(scores_RxS, layout).reshape(choice.shape)
    return {"logits": jnp.where(choice != 0, summed, _NEG)}

  def loss(self, model: nnx.Module, batch: Mapping[str, jax.Array], max_global: int = 0
           ) -> jax.Array:
    """The kind's mean cross-entropy (nats) over the segment logits."""
    logits = self.logits(model, batch, max_global)
    if isinstance(self.kind, QuestionAnswering):
      return 0.5 * jnp.mean(_ce(logits["start_logits"], batch["start_positions"])
                            + _ce(logits["end_logits"], batch["end_positions"]))
    if isinstance(self.kind, Tagging):
      labels = batch["labels"]
      real = labels != fd.IGNORE_INDEX
      nll = _ce(logits["logits"], jnp.where(real, labels, 0))
      return jnp.sum(jnp.where(real, nll, 0.0)) / jnp.maximum(jnp.sum(real), 1)
    return jnp.mean(_ce(logits["logits"], batch["labels"]))

  def outputs(self, logits: Mapping[str, jax.Array], max_answer_length: int
              ) -> dict[str, jax.Array]:
    """The kind's outputs, at Longformer row positions (what `Kind.score` reads): QA's best
    span over the stitched document, tagging's tags shifted past `<s>`."""
    if isinstance(self.kind, QuestionAnswering):
      start, end, score = best_spans(logits["start_logits"], logits["end_logits"],
                                     max_answer_length)
      heads = logits["row_heads"]
      return {"start": start + heads, "end": end + heads, "score": score}
    if isinstance(self.kind, Tagging):
      tags = jnp.argmax(logits["logits"], axis=-1).astype(jnp.int32)
      return {"tags": jnp.pad(tags, ((0, 0), (1, 1)))}
    return self.kind.outputs(logits, max_answer_length)


def _float(x: jax.Array) -> jax.Array:
  return x.astype(jnp.float32)


def _pad(sequences: Sequence[np.ndarray], width: int, pad_id: int
         ) -> tuple[np.ndarray, np.ndarray]:
  """int32 [len(sequences), width] ids (padded with pad_id) and their 0/1 mask."""
  ids = np.full((len(sequences), width), pad_id, np.int32)
  mask = np.zeros((len(sequences), width), np.int32)
  for i, s in enumerate(sequences):
    ids[i, :len(s)] = s
    mask[i, :len(s)] = 1
  return ids, mask


def reading(kind: Kind, *, baseline: str, segment_length: int, overlap: int, pool: str,
            global_mode: str) -> Kind | SegmentReading:
  """The kind itself (baseline "longformer", or a kind that reads its segments itself,
  `Kind.reads_segments`) or its `SegmentReading` (baseline "segments")."""
  if baseline == "longformer" or kind.reads_segments:
    return kind
  return SegmentReading(kind, segment_length=segment_length, overlap=overlap, pool=pool,
                        global_mode=global_mode)


__all__ = ["BASELINES", "SEGMENT_POOLS", "SegmentReading", "check_kind", "document_width",
           "prefix_width", "reading"]
