"""HotpotQA's two-stage reader (paper §6) as a task: the inputs, the multi-task loss, decoding
into HotpotQA's official prediction format and the two-stage pipeline, on the model of
`longformer_jax.hotpotqa` and the rows of `longformer_jax.data.hotpotqa` (see the model
module's docstring for the flow).

Shape letters: B batch, N positions, P paragraph slots, S sentence slots, A answer occurrences.
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

from longformer_jax.data import hotpotqa as hq
from longformer_jax.hotpotqa import HotpotQAOutput, LongformerForHotpotQA
from longformer_jax.tasks.finetune_kinds import best_spans
from longformer_jax.tasks.qa_metrics import all_occurrence_span_loss

__all__ = [
    "STAGE1_WEIGHTS", "STAGE2_WEIGHTS", "HotpotLossWeights", "decode", "hotpot_loss",
    "model_inputs", "predictions", "run_rows", "stage1_rows", "stage1_selection",
    "two_stage_predictions",
]


_INPUTS = ("input_ids", "attention_mask", "global_attention_mask", "paragraph_positions",
           "sentence_positions", "token_paragraph", "token_sentence", "paragraph_mask",
           "sentence_mask", "context_mask")


def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
  """The model's arguments from a batch of `data.hotpotqa.stack_layouts` (its labels left out)."""
  return {name: batch[name] for name in _INPUTS}


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


@functools.partial(nnx.jit, static_argnames=("max_global", "max_answer_length"))
def _forward(model, inputs, max_global: int, max_answer_length: int):
  out = model(**inputs, max_global=max_global)
  return {"paragraph_logits": out.paragraph_logits,
          **decode(out, max_answer_length=max_answer_length)}


def run_rows(model: LongformerForHotpotQA, layouts: Sequence[hq.Layout], *, batch_size: int = 8,
             max_answer_length: int = 30) -> dict[str, np.ndarray]:
  """The model on rows of one shape, in batches of batch_size (the last one padded with copies
  of the first row, so that one program serves every batch): {"paragraph_logits" [R, P], and
  `decode`'s "start", "end", "type" [R], "sentence_probs" [R, S]} as host arrays. Run the model
  in evaluation mode (`model.eval()`: no dropout)."""
  if not layouts:
    raise ValueError("run_rows needs at least one layout")
  max_global = max(x.num_global for x in layouts)
  parts: dict[str, list[np.ndarray]] = {}
  for first in range(0, len(layouts), batch_size):
    rows = list(layouts[first:first + batch_size])
    real = len(rows)
    rows += [layouts[0]] * (batch_size - real)
    out = _forward(model, model_inputs(hq.stack_layouts(rows)), max_global, max_answer_length)
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
