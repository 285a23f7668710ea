"""HotpotQA's two-stage reader (paper §6) as a task: the inputs, the multi-task loss, decoding
into HotpotQA's official prediction format and the two-stage pipeline, on the model of
`longformer_jax.hotpotqa` and the rows of `longformer_jax.data.hotpotqa` (see the model
module's docstring for the flow).

The segment baseline (`HotpotSegments`, `segment_outputs`): the same rows read in segments of a
short encoder's length, each `<s> [q] question [/q] segment </s>` (`longformer_jax.segments`), the
states stitched back to row positions, and the same heads on them.

Shape letters: B batch, N positions, P paragraph slots, S sentence slots, A answer occurrences,
D document positions, Q prefix positions, L segment length, E hidden size.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from longformer_jax import segments
from longformer_jax.data import hotpotqa as hq
from longformer_jax.data.tokenizer import SpecialIds
from longformer_jax.hotpotqa import HotpotQAOutput, LongformerForHotpotQA
from longformer_jax.tasks.finetune_kinds import best_spans
from longformer_jax.tasks.qa_metrics import all_occurrence_span_loss

__all__ = [
    "STAGE1_WEIGHTS", "STAGE2_WEIGHTS", "HotpotLossWeights", "HotpotSegments", "decode",
    "forward", "hotpot_loss", "model_inputs", "predictions", "run_rows", "segment_outputs",
    "segment_states", "stage1_rows", "stage1_selection", "two_stage_predictions",
]


_INPUTS = ("input_ids", "attention_mask", "global_attention_mask", "paragraph_positions",
           "sentence_positions", "token_paragraph", "token_sentence", "paragraph_mask",
           "sentence_mask", "context_mask")


def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
  """The model's arguments from a batch of `data.hotpotqa.stack_layouts` (its labels left out)."""
  return {name: batch[name] for name in _INPUTS}


# ----------------------------------------------------------------------------------------------
# The segment baseline


@dataclasses.dataclass(frozen=True)
class HotpotSegments:
  """The segment baseline's reading of HotpotQA rows (static: one compiled program per value).

  segment_length: L, the tokens of a segment's row, `<s>`, the question and `</s>` included.
  overlap: document tokens consecutive segments share (`longformer_jax.segments`).
  prefix_width: Q, the most tokens of `[q] question [/q]` (max_question_length + 2).
  global_mode: the rows' global tokens, the run's mode: "question" (`<s>`, the question and the
    row's markers that the segment holds), "first" (`<s>`), "none".
  """
  segment_length: int = 512
  overlap: int = 0
  prefix_width: int = 130
  global_mode: str = "question"

  def __post_init__(self):
    if self.global_mode not in segments.GLOBAL_MODES:
      raise ValueError(f"global_mode must be one of {segments.GLOBAL_MODES}, got "
                       f"{self.global_mode!r}")
    room = self.segment_length - 1 - self.prefix_width - 1
    if room < self.overlap + 1:
      raise ValueError(
          f"segment_length={self.segment_length} leaves {room} document tokens per segment "
          f"after <s>, the question's {self.prefix_width} tokens ([q] question [/q], "
          f"max_question_length={self.prefix_width - 2}) and </s>; it must leave more than "
          f"segment_overlap={self.overlap} (raise segment_length or lower max_question_length)")


def segment_states(model: LongformerForHotpotQA, inputs: Mapping[str, Any],
                   reading: HotpotSegments, *, max_global: int
                   ) -> tuple[jax.Array, jax.Array, segments.SegmentOutput]:
  """The encoder's states at row positions [B, N, E] when `model.longformer` reads the rows of
  `inputs` (`model_inputs`) in segments, whether each row position holds a read state [B, N],
  and the `segments.SegmentOutput`.

  A row `<s> [q] question [/q] [p] ... </s>` is cut after `[/q]`: the question part is the
  prefix of every segment row, `<s> [q] question [/q] segment </s>` (no separator: a row that
  fits one segment is read as the whole-row reader reads it), the paragraphs are the document.
  Row positions take their states as follows: `<s>` and the question the first segment's, each
  paragraph token the segment where it is most central (`segments.stitch`), `</s>` and padding
  zeros (no head reads them). The markers of the row's global mask attend globally in the
  segment that holds them (`reading.global_mode` "question"). Static shapes throughout:
  everything is a gather (jit-able, no loop over rows or segments).
  """
  ids_BxN = jnp.asarray(inputs["input_ids"], jnp.int32)
  batch, n = ids_BxN.shape
  real_BxN = jnp.asarray(inputs["attention_mask"]) != 0
  global_BxN = jnp.asarray(inputs["global_attention_mask"]) != 0
  in_paragraph_BxN = jnp.asarray(inputs["token_paragraph"]) >= 0
  row_length_B = jnp.sum(real_BxN, axis=1, dtype=jnp.int32)
  # The first paragraph's [p] follows [/q]; a row without paragraphs ends at its </s>.
  head_B = jnp.where(jnp.any(in_paragraph_BxN, axis=1),
                     jnp.argmax(in_paragraph_BxN, axis=1).astype(jnp.int32), row_length_B - 1)
  # The prefix: row positions 1 .. head - 1 ([q] question [/q]).
  q = reading.prefix_width
  pos_Q = jnp.arange(q, dtype=jnp.int32)
  prefix_ids = jnp.take_along_axis(ids_BxN, jnp.clip(1 + pos_Q, 0, n - 1)[None, :].repeat(
      batch, 0), axis=1)
  prefix_mask = (pos_Q[None, :] < (head_B - 1)[:, None]).astype(jnp.int32)
  # The document: row positions head .. (the row's </s>) - 1. A row holds <s>, [q], a question
  # token at least, [/q] and </s> besides: at most n - 5 document tokens.
  width = max(1, n - 5)
  pos_D = jnp.arange(width, dtype=jnp.int32)
  row_of_BxD = jnp.clip(head_B[:, None] + pos_D[None, :], 0, n - 1)
  document_mask = (pos_D[None, :] < (row_length_B - 1 - head_B)[:, None]).astype(jnp.int32)
  document_ids = jnp.where(document_mask != 0,
                           jnp.take_along_axis(ids_BxN, row_of_BxD, axis=1), 0)
  document_global = jnp.take_along_axis(global_BxN, row_of_BxD, axis=1) & (document_mask != 0)
  encoder = model.longformer
  out = segments.encode_segments(
      lambda ids, mask, global_mask, **kwargs: encoder(ids, mask, global_mask, **kwargs),
      document_ids, document_mask, prefix_ids=prefix_ids, prefix_mask=prefix_mask,
      specials=SpecialIds.of_config(model.config), segment_length=reading.segment_length,
      overlap=reading.overlap, global_mode=reading.global_mode, separate_prefix=False,
      document_global=document_global if reading.global_mode == "question" else None,
      max_global=min(max_global, reading.segment_length))
  # Back to row positions: <s> and the question from the first segment (same positions there),
  # the paragraphs from the stitched document.
  pos_N = jnp.arange(n, dtype=jnp.int32)
  first_BxLxE = out.row_states[:, 0]
  leading_BxNxE = jnp.take_along_axis(
      first_BxLxE, jnp.clip(pos_N, 0, reading.segment_length - 1)[None, :, None], axis=1)
  doc_BxN = pos_N[None, :] - head_B[:, None]
  doc_index = jnp.clip(doc_BxN, 0, width - 1)
  document_BxNxE = jnp.take_along_axis(out.last_hidden_state, doc_index[:, :, None], axis=1)
  in_document_BxN = ((doc_BxN >= 0) & (doc_BxN < width)
                     & jnp.take_along_axis(out.layout.kept, doc_index, axis=1))
  leading_BxN = pos_N[None, :] < head_B[:, None]
  hidden_BxNxE = jnp.where(leading_BxN[..., None], leading_BxNxE,
                           jnp.where(in_document_BxN[..., None], document_BxNxE,
                                     jnp.zeros((), document_BxNxE.dtype)))
  return hidden_BxNxE, leading_BxN | in_document_BxN, out


def segment_outputs(model: LongformerForHotpotQA, inputs: Mapping[str, Any],
                    reading: HotpotSegments, *, max_global: int) -> HotpotQAOutput:
  """The model's outputs when its encoder reads the rows in segments (`segment_states`): the
  same heads on the stitched states (paragraph logits at the [p] markers, sentence logits at
  the [s] markers, span logits over every stitched position, masked as the row's context, the
  question type from the first segment's `<s>`). max_global: the whole rows' bound (a segment
  holds no more global tokens than its row)."""
  hidden_BxNxE, read_BxN, _ = segment_states(model, inputs, reading, max_global=max_global)
  context = inputs.get("context_mask")
  context = read_BxN if context is None else (jnp.asarray(context) != 0) & read_BxN
  return model.heads(hidden_BxNxE, paragraph_positions=inputs["paragraph_positions"],
                     sentence_positions=inputs["sentence_positions"],
                     token_paragraph=inputs["token_paragraph"],
                     token_sentence=inputs["token_sentence"],
                     paragraph_mask=inputs.get("paragraph_mask"),
                     sentence_mask=inputs.get("sentence_mask"), context_mask=context)


def forward(model: LongformerForHotpotQA, inputs: Mapping[str, Any], *, max_global: int,
            reading: HotpotSegments | None = None) -> HotpotQAOutput:
  """The model on `model_inputs`: the rows read whole (reading None), or in segments."""
  if reading is None:
    return model(**inputs, max_global=max_global)
  return segment_outputs(model, inputs, reading, max_global=max_global)


# ----------------------------------------------------------------------------------------------
# Loss


@dataclasses.dataclass(frozen=True)
class HotpotLossWeights:
  """The multi-task loss's weights: answer span, question type, evidence sentences, paragraph
  relevance."""
  span: float = 1.0
  type: float = 1.0
  sentence: float = 1.0
  paragraph: float = 1.0


# Stage 1 selects paragraphs; stage 2 answers, types and finds the evidence (the paper's split).
STAGE1_WEIGHTS = HotpotLossWeights(span=0.0, type=0.0, sentence=0.0, paragraph=1.0)
STAGE2_WEIGHTS = HotpotLossWeights(span=1.0, type=1.0, sentence=1.0, paragraph=0.0)


def _masked_mean(values, mask):
  mask = jnp.asarray(mask, jnp.float32)
  return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def hotpot_loss(outputs: HotpotQAOutput, batch: Mapping[str, Any], *,
                weights: HotpotLossWeights = HotpotLossWeights()
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(total, {"span", "type", "sentence", "paragraph"}): the weighted sum of four masked means.

  span: `qa_metrics.all_occurrence_span_loss` over every occurrence of the answer in the row
    (batch answer_starts / answer_ends [B, A], -1 padded), averaged over the rows of span
    questions that have one (a yes / no row, or one whose answer was truncated away, adds 0).
  type: softmax cross-entropy of type_logits against type_labels [B], over every row.
  sentence, paragraph: binary cross-entropy of each [s] / [p] logit against sentence_labels
    [B, S] / paragraph_labels [B, P], averaged over the real slots (sentence_mask,
    paragraph_mask).
  A part whose weight is 0 is still reported (and costs nothing in the gradient).
  """
  starts_BxA = jnp.asarray(batch["answer_starts"], jnp.int32)
  span_B = all_occurrence_span_loss(outputs.start_logits, outputs.end_logits, starts_BxA,
                                    jnp.asarray(batch["answer_ends"], jnp.int32))
  has_span_B = jnp.any(starts_BxA >= 0, axis=-1) & (jnp.asarray(batch["type_labels"]) == 0)
  span = _masked_mean(span_B, has_span_B)
  type_ = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      outputs.type_logits, jnp.asarray(batch["type_labels"], jnp.int32)))
  sentence = _masked_mean(optax.sigmoid_binary_cross_entropy(
      outputs.sentence_logits, jnp.asarray(batch["sentence_labels"], jnp.float32)),
      batch["sentence_mask"])
  paragraph = _masked_mean(optax.sigmoid_binary_cross_entropy(
      outputs.paragraph_logits, jnp.asarray(batch["paragraph_labels"], jnp.float32)),
      batch["paragraph_mask"])
  parts = {"span": span, "type": type_, "sentence": sentence, "paragraph": paragraph}
  total = sum(getattr(weights, name) * value for name, value in parts.items())
  return total, parts


# ----------------------------------------------------------------------------------------------
# Predictions


def stage1_selection(layouts: Sequence[hq.Layout], paragraph_logits_BxP, *, k: int = 2,
                     num_paragraphs: Sequence[int] | None = None) -> list[list[int]]:
  """Per row, the indices (into its record's context) of the k paragraphs stage 2 reads: the
  k highest [p] logits of the stage-1 row (`data.hotpotqa.select_paragraphs`), in context order.

  num_paragraphs: each record's paragraph count (default: the paragraphs its row read and the
    highest index among them + 1). A paragraph stage 1 truncated away is chosen only to fill k.
  """
  logits = np.asarray(paragraph_logits_BxP, np.float64)
  chosen = []
  for row, layout in enumerate(layouts):
    count = (num_paragraphs[row] if num_paragraphs is not None
             else max((i for i, _ in layout.paragraphs), default=-1) + 1)
    scores = hq.paragraph_scores(layout, logits[row], count)
    chosen.append(hq.select_paragraphs(scores, k))
  return chosen


def decode(outputs: HotpotQAOutput, *, max_answer_length: int = 30) -> dict[str, jax.Array]:
  """The stage-2 decisions, arrays under jit: start, end [B] (row positions, end inclusive, the
  best span with start <= end < start + max_answer_length by start + end logit), type [B]
  (argmax of type_logits: 0 span, 1 yes, 2 no), sentence_probs [B, S] (sigmoid of the evidence
  logits; empty slots ~0)."""
  start_B, end_B, _ = best_spans(outputs.start_logits, outputs.end_logits, max_answer_length)
  return {"start": start_B, "end": end_B, "type": jnp.argmax(outputs.type_logits, axis=-1),
          "sentence_probs": jax.nn.sigmoid(outputs.sentence_logits)}


def predictions(layouts: Sequence[hq.Layout], decoded: Mapping[str, Any], *,
                sp_threshold: float = 0.5, min_sentences: int = 0) -> dict[str, dict]:
  """HotpotQA's official prediction object {"answer": {id: text}, "sp": {id: [[title,
  sentence id], ...]}} from stage-2 rows and their `decode`d outputs.

  The answer is "yes" / "no" when the type says so, else the text of the predicted span
  (`data.hotpotqa.answer_text`). The supporting facts are the [s] slots whose probability is
  above sp_threshold, in row order; min_sentences: at least this many, the most probable first
  (HotpotQA's gold always has >= 2; 0 keeps the threshold's choice alone).
  """
  if not 0.0 <= sp_threshold <= 1.0:
    raise ValueError(f"sp_threshold must be a probability in [0, 1], got {sp_threshold!r}")
  starts, ends = np.asarray(decoded["start"]), np.asarray(decoded["end"])
  types, probs = np.asarray(decoded["type"]), np.asarray(decoded["sentence_probs"])
  answers, facts = {}, {}
  for row, layout in enumerate(layouts):
    kind = int(types[row])
    answers[layout.id] = (hq.QUESTION_TYPES[kind] if kind else
                          hq.answer_text(layout, int(starts[row]), int(ends[row])))
    p = probs[row, :len(layout.sentences)]
    keep = set(np.flatnonzero(p > sp_threshold).tolist())
    if len(keep) < min_sentences:
      keep |= set(np.argsort(-p, kind="stable")[:min_sentences].tolist())
    facts[layout.id] = [list(layout.sentences[s]) for s in sorted(keep)]
  return {"answer": answers, "sp": facts}


# ----------------------------------------------------------------------------------------------
# The two-stage pipeline


@functools.partial(nnx.jit, static_argnames=("max_global", "max_answer_length", "reading"))
def _forward(model, inputs, max_global: int, max_answer_length: int,
             reading: HotpotSegments | None):
  out = forward(model, inputs, max_global=max_global, reading=reading)
  return {"paragraph_logits": out.paragraph_logits,
          **decode(out, max_answer_length=max_answer_length)}


def run_rows(model: LongformerForHotpotQA, layouts: Sequence[hq.Layout], *, batch_size: int = 8,
             max_answer_length: int = 30, reading: HotpotSegments | None = None
             ) -> dict[str, np.ndarray]:
  """The model on rows of one shape, in batches of batch_size (the last one padded with copies
  of the first row, so that one program serves every batch): {"paragraph_logits" [R, P], and
  `decode`'s "start", "end", "type" [R], "sentence_probs" [R, S]} as host arrays. Run the model
  in evaluation mode (`model.eval()`: no dropout). reading: the segment baseline's
  (`HotpotSegments`), None for whole rows."""
  if not layouts:
    raise ValueError("run_rows needs at least one layout")
  max_global = max(x.num_global for x in layouts)
  parts: dict[str, list[np.ndarray]] = {}
  for first in range(0, len(layouts), batch_size):
    rows = list(layouts[first:first + batch_size])
    real = len(rows)
    rows += [layouts[0]] * (batch_size - real)
    out = _forward(model, model_inputs(hq.stack_layouts(rows)), max_global, max_answer_length,
                   reading)
    for name, value in out.items():
      parts.setdefault(name, []).append(np.asarray(value)[:real])
  return {name: np.concatenate(values) for name, values in parts.items()}


def stage1_rows(records: Sequence[hq.HotpotRecord], encode: hq.Encoder, specials,
                markers: hq.MarkerIds, *, max_length: int, max_question_length: int = 64
                ) -> list[hq.Layout]:
  """Stage 1's rows of `records`: every paragraph, one shape (as many [p] / [s] slots as the
  records need at most)."""
  slots = dict(max_paragraphs=max(len(r.context) for r in records),
               max_sentences=max(sum(len(s) for _, s in r.context) for r in records))
  return [hq.build_layout(r, encode, specials, markers, max_length=max_length,
                          max_question_length=max_question_length, **slots) for r in records]


def two_stage_predictions(stage1: LongformerForHotpotQA, stage2: LongformerForHotpotQA,
                          records: Sequence[hq.HotpotRecord], encode: hq.Encoder,
                          specials, markers: hq.MarkerIds, *, max_length: int, k: int = 2,
                          stage2_max_length: int | None = None, max_question_length: int = 64,
                          batch_size: int = 8, max_answer_length: int = 30,
                          sp_threshold: float = 0.5, min_sentences: int = 0
                          ) -> tuple[dict[str, dict], list[list[int]], list[hq.Layout]]:
  """HotpotQA's two-stage evaluation: stage 1 reads each record's question with all its
  paragraphs and scores the [p] markers; its k best paragraphs (`stage1_selection`) are read by
  stage 2 with the question, whose span, type and evidence outputs become the official
  prediction object (`predictions`).

  The rows of a stage share one shape: stage 1 max_length with as many [p] / [s] slots as the
  records need at most; stage 2 stage2_max_length (default max_length) with k [p] slots.
  Returns (the prediction object, the paragraphs chosen per record, the stage-2 layouts).
  """
  rows1 = stage1_rows(records, encode, specials, markers, max_length=max_length,
                      max_question_length=max_question_length)
  logits = run_rows(stage1, rows1, batch_size=batch_size,
                    max_answer_length=max_answer_length)["paragraph_logits"]
  chosen = stage1_selection(rows1, logits, k=k, num_paragraphs=[len(r.context) for r in records])
  slots2 = dict(max_paragraphs=k, max_sentences=max(
      sum(len(r.context[i][1]) for i in pick) for r, pick in zip(records, chosen)))
  rows2 = [hq.build_layout(r, encode, specials, markers, paragraphs=pick,
                           max_length=stage2_max_length or max_length, **slots2,
                           max_question_length=max_question_length)
           for r, pick in zip(records, chosen)]
  decoded = run_rows(stage2, rows2, batch_size=batch_size, max_answer_length=max_answer_length)
  preds = predictions(rows2, decoded, sp_threshold=sp_threshold, min_sentences=min_sentences)
  return preds, chosen, rows2
