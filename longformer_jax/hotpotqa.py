"""HotpotQA's two-stage multi-task reader (paper §6) on `LongformerModel`: the model, its loss
and the decoding of its outputs into HotpotQA's official prediction format.

    >>> from longformer_jax import hotpotqa
    >>> from longformer_jax.data import hotpotqa as hq
    >>> model = hotpotqa.LongformerForHotpotQA(config, rngs=nnx.Rngs(0))
    >>> layouts = [hq.build_layout(r, encode, specials, markers, max_length=4096,
    ...                            paragraphs=hq.gold_paragraphs(r), max_paragraphs=2,
    ...                            max_sentences=40) for r in records]   # stage-2 training rows
    >>> batch = hq.stack_layouts(layouts)
    >>> out = model(**hotpotqa.model_inputs(batch), max_global=max_global)
    >>> loss, parts = hotpotqa.hotpot_loss(out, batch, weights=hotpotqa.STAGE2_WEIGHTS)
    >>> chosen = hotpotqa.stage1_selection(layouts, out.paragraph_logits, k=2)     # stage 1
    >>> preds = hotpotqa.predictions(layouts, hotpotqa.decode(out, max_answer_length=30),
    ...                              sp_threshold=0.5)                              # stage 2
    >>> longformer_jax.tasks.hotpot_scores(predictions=preds, golds=[r.as_json() for r in records])
    >>> preds, chosen, rows = hotpotqa.two_stage_predictions(stage1, stage2, records, encode,
    ...                                                      specials, markers, max_length=4096)

Stage 1 reads the question with all ten paragraphs and scores each [p] marker (paragraph
relevance); its top-k paragraphs (k = 2 by default) go to stage 2, which reads the question with
them and predicts, multi-task, the answer span (start / end logits over the titles and
sentences), the question type (span / yes / no, from <s>) and the supporting sentences (one
logit per [s] marker, read with its sentence's mean state). Both stages are this class,
trained with different loss weights (`STAGE1_WEIGHTS`, `STAGE2_WEIGHTS`).

Shape letters: B batch, N positions, E hidden, P paragraph slots, S sentence slots, A answer
occurrences, T question types (3).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from longformer_jax.config import LongformerConfig
from longformer_jax.data import hotpotqa as hq
from longformer_jax.layers import dense
from longformer_jax.modeling import LongformerModel, _classifier, check_ids
from longformer_jax.tasks.qa_metrics import all_occurrence_span_loss

__all__ = [
    "HotpotLossWeights", "HotpotQAOutput", "LongformerForHotpotQA", "STAGE1_WEIGHTS",
    "STAGE2_WEIGHTS", "decode", "hotpot_loss", "model_inputs", "predictions", "run_rows",
    "stage1_rows", "stage1_selection", "two_stage_predictions",
]

# Logits of positions and slots that cannot be chosen (float32: exp underflows to 0).
_NEG = -1e9
NUM_TYPES = len(hq.QUESTION_TYPES)


@flax.struct.dataclass
class HotpotQAOutput:
  start_logits: jax.Array  # [B, N] float32, -1e9 outside the titles and sentences
  end_logits: jax.Array  # [B, N] float32, likewise
  type_logits: jax.Array  # [B, T] float32 (span, yes, no)
  sentence_logits: jax.Array  # [B, S] float32, -1e9 on empty slots
  paragraph_logits: jax.Array  # [B, P] float32, -1e9 on empty slots
  hidden_states: tuple[jax.Array, ...] | None = None
  attentions: tuple[jax.Array, ...] | None = None


class _FeedForward(nnx.Module):
  """dropout -> dense (in -> E) -> GELU -> dropout -> dense (E -> out): the two-layer head the
  paper puts on the <s>, [s] and [p] states (in = E, or 2E for a marker state beside its
  span's mean state)."""

  def __init__(self, config: LongformerConfig, num_out: int, rngs: nnx.Rngs, in_factor: int = 1):
    self.dense = dense(in_factor * config.hidden_size, config.hidden_size, ("embed", None),
                       init=nnx.initializers.normal(config.initializer_range),
                       dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
    self.dropout = nnx.Dropout(config.hidden_dropout_prob, rngs=rngs)
    self.out_proj = _classifier(config, num_out, rngs)

  def __call__(self, x_BxYxE: jax.Array) -> jax.Array:
    x_BxYxE = jax.nn.gelu(self.dense(self.dropout(x_BxYxE)), approximate=False)
    return self.out_proj(self.dropout(x_BxYxE))


def _gather(hidden_BxNxE: jax.Array, positions_BxY: jax.Array) -> jax.Array:
  """The states at `positions` [B, Y, E] (static Y; positions clipped into the row)."""
  n = hidden_BxNxE.shape[1]
  positions_BxY = jnp.clip(jnp.asarray(positions_BxY, jnp.int32), 0, n - 1)
  return jnp.take_along_axis(hidden_BxNxE, positions_BxY[:, :, None], axis=1)


def _pool(hidden_BxNxE: jax.Array, slots_BxN: jax.Array, count: int) -> jax.Array:
  """The mean state of each slot's positions [B, count, E] (slots_BxN: the slot of each
  position, -1 for none; an empty slot gives zeros). A one-hot contraction over N, so a
  sequence-sharded N reduces like any matmul."""
  one_hot_BxNxY = jax.nn.one_hot(jnp.asarray(slots_BxN, jnp.int32), count, dtype=jnp.float32)
  # Sums and counts in float32 (bfloat16 counts only to 256 exactly; a paragraph is longer).
  sums_BxYxE = jnp.einsum("bny,bne->bye", one_hot_BxNxY.astype(hidden_BxNxE.dtype),
                          hidden_BxNxE, preferred_element_type=jnp.float32)
  counts_BxY = jnp.sum(one_hot_BxNxY, axis=1)
  return (sums_BxYxE / jnp.maximum(counts_BxY, 1)[..., None]).astype(hidden_BxNxE.dtype)


def _masked(logits, mask):
  logits = logits.astype(jnp.float32)
  return logits if mask is None else jnp.where(jnp.asarray(mask) != 0, logits, _NEG)


class LongformerForHotpotQA(nnx.Module):
  """The HotpotQA reader: answer start / end logits at every position, question-type logits from
  <s>, evidence logits at the [s] markers and relevance logits at the [p] markers (two-layer
  heads; the span head is one linear layer, as `LongformerForQuestionAnswering`'s, so its
  weights load from a QA checkpoint under the same name `qa_outputs`).

  A [s] (or [p]) slot is read as its marker's state beside the mean state of its sentence (its
  paragraph): every [s] marker is the same token, and a marker's state alone singles its own
  sentence out only through position-selective attention, which a model trained from scratch
  learns slowly (on the generated data a tiny model's evidence loss stayed at the label prior
  for hundreds of steps with the marker alone, and fell near 0 within 100 with the mean).

  Parameters: `longformer` (the encoder), `qa_outputs`, `type_head`, `sentence_head`,
  `paragraph_head`.
  """

  def __init__(self, config: LongformerConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None, seq_axis: str | None = None):
    self.config = config
    self.longformer = LongformerModel(config, add_pooling_layer=False, rngs=rngs, mesh=mesh,
                                      seq_axis=seq_axis)
    self.qa_outputs = _classifier(config, 2, rngs)
    self.type_head = _FeedForward(config, NUM_TYPES, rngs)
    self.sentence_head = _FeedForward(config, 1, rngs, in_factor=2)
    self.paragraph_head = _FeedForward(config, 1, rngs, in_factor=2)

  def __call__(self, input_ids, attention_mask=None, global_attention_mask=None, *,
               paragraph_positions, sentence_positions, token_paragraph, token_sentence,
               paragraph_mask=None, sentence_mask=None, context_mask=None,
               **kwargs) -> HotpotQAOutput:
    """Runs the reader on rows of `data.hotpotqa.build_layout` (`model_inputs(batch)` gives
    these arguments).

    Args:
      input_ids, attention_mask, global_attention_mask: [B, N], as `LongformerModel`'s (the
        layout's global mask: <s>, the question and every marker; under jit pass max_global).
      paragraph_positions [B, P], sentence_positions [B, S]: the [p] and [s] markers' positions
        (static P and S; empty slots hold any position and are masked).
      token_paragraph, token_sentence [B, N]: the [p] / [s] slot of each position (-1: none).
        A slot is represented by its marker's state beside the mean state of its span.
      paragraph_mask [B, P], sentence_mask [B, S]: 1 on real slots; empty ones get -1e9.
      context_mask [B, N]: 1 where an answer may start and end (the titles and sentences);
        elsewhere the span logits are -1e9. None: nowhere masked.
      **kwargs: the other arguments of `LongformerModel.__call__` (max_global, ...).
    """
    check_ids(input_ids, 2, "[batch, seq]")
    out = self.longformer(input_ids, attention_mask, global_attention_mask, **kwargs)
    hidden_BxNxE = out.last_hidden_state
    logits_BxNx2 = self.qa_outputs(hidden_BxNxE)
    type_BxT = self.type_head(hidden_BxNxE[:, :1])[:, 0]
    s, p = jnp.shape(sentence_positions)[-1], jnp.shape(paragraph_positions)[-1]
    sentence_BxSx2E = jnp.concatenate([_gather(hidden_BxNxE, sentence_positions),
                                       _pool(hidden_BxNxE, token_sentence, s)], axis=-1)
    paragraph_BxPx2E = jnp.concatenate([_gather(hidden_BxNxE, paragraph_positions),
                                        _pool(hidden_BxNxE, token_paragraph, p)], axis=-1)
    sentence_BxS = self.sentence_head(sentence_BxSx2E)[..., 0]
    paragraph_BxP = self.paragraph_head(paragraph_BxPx2E)[..., 0]
    return HotpotQAOutput(
        start_logits=_masked(logits_BxNx2[..., 0], context_mask),
        end_logits=_masked(logits_BxNx2[..., 1], context_mask),
        type_logits=type_BxT.astype(jnp.float32),
        sentence_logits=_masked(sentence_BxS, sentence_mask),
        paragraph_logits=_masked(paragraph_BxP, paragraph_mask),
        hidden_states=out.hidden_states, attentions=out.attentions)


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
  # Imported here: finetune_kinds imports the whole fine-tuning layer.
  from longformer_jax.tasks.finetune_kinds import best_spans
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
