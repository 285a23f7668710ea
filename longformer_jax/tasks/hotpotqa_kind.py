"""HotpotQA (distractor setting) as a fine-tuning kind: `train.finetune --task hotpotqa` trains the
paper's two-stage reader (`hotpotqa.LongformerForHotpotQA`, one model for both stages) and
evaluates it with the two-stage pipeline and HotpotQA's official metrics
(`tasks.qa_metrics.hotpot_scores`).

Training, multi-task: every step reads each record twice, as a stage-1 row (the question with
every paragraph, max_length tokens; the paragraph-relevance loss, `tasks.hotpotqa.STAGE1_WEIGHTS`)
and as a stage-2 row (the question with its gold paragraphs, hotpot_stage2_length tokens; the
answer-span, question-type and evidence losses, `STAGE2_WEIGHTS`); the step's loss is the sum of
the two means. Evaluation (`tasks.hotpotqa` pipeline): stage 1 scores every paragraph, its
hotpot_top_k best go to stage 2, whose span, type and evidence outputs (sentences above
hotpot_sp_threshold, at least hotpot_min_sentences) make the official prediction object.

Files: HotpotQA's JSON (a list of records, `data.hotpotqa.read_hotpotqa`). The tokenizer must
hold the four markers `[q] [/q] [p] [s]` (`data.hotpotqa.MARKER_TOKENS`) with ids inside the
model's vocabulary. Global attention: "default" / "question" is the paper's (`<s>`, the question
and every marker), "first" `<s>` alone, "none" no token.

The segment baseline (`--baseline segments`, `pipeline.HotpotSegments`): both stages' rows are read
in segments of segment_length tokens, each `<s> [q] question [/q] segment </s>`, and the heads
read the stitched states (`pipeline.segment_outputs`): the same model and parameters, the same
batches, a run that saves, reloads and evaluates as any.

Metrics (fractions in [0, 1], means over the split's records): em, f1, prec, recall (answer),
sp_em, sp_f1, sp_prec, sp_recall (supporting facts), joint_em, joint_f1, joint_prec,
joint_recall and paragraph_recall (the gold paragraphs among stage 1's choice, pooled over the
records). What the length limit cut is stage 1's row's (`HotpotExample.truncation`: the evidence
is every supporting sentence inside the row). Beside predictions_<split>.jsonl the run writes
predictions_<split>.json, the official prediction file {"answer": {id: text}, "sp": {id:
[[title, sentence id], ...]}}.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from flax import nnx

from longformer_jax.config import LongformerConfig
from longformer_jax.data import finetune_data as fd
from longformer_jax.data import hotpotqa as hq
from longformer_jax.data import text
from longformer_jax.data.tokenizer import copy_tokenizer
from longformer_jax.hotpotqa import LongformerForHotpotQA
from longformer_jax.tasks import hotpotqa as pipeline
from longformer_jax.tasks.finetune_kinds import SettingsKind, check_segment_settings, register
from longformer_jax.tasks.qa_metrics import HOTPOT_METRICS, hotpot_scores

__all__ = ["HotpotExample", "HotpotQA", "HotpotSettings", "HotpotSplit", "trivial_scores"]


@dataclasses.dataclass(frozen=True)
class HotpotSettings:
  """What of the run's `FinetuneOptions` the kind reads: its hotpot_* fields, and `segments`,
  the segment baseline's reading (`pipeline.HotpotSegments`; None: rows read whole)."""
  top_k: int = 2
  sp_threshold: float = 0.5
  min_sentences: int = 0
  segments: pipeline.HotpotSegments | None = None

  @classmethod
  def of(cls, options) -> HotpotSettings:
    return cls(top_k=options.hotpot_top_k, sp_threshold=float(options.hotpot_sp_threshold),
               min_sentences=options.hotpot_min_sentences, segments=_segments(options))


def _segments(options) -> pipeline.HotpotSegments | None:
  """The segment baseline's reading of the options (baseline "segments"), else None."""
  if options.baseline == "longformer":
    return None
  check_segment_settings(options, "hotpotqa", overlap=None,
                         pool="reads its question type from the first segment's <s>")
  return pipeline.HotpotSegments(
      segment_length=options.segment_length, overlap=options.segment_overlap,
      prefix_width=options.max_question_length + 2,
      global_mode=HotpotQA().resolve_global(options.global_attention))


@dataclasses.dataclass(frozen=True)
class HotpotExample:
  """One record: its stage-1 row (every paragraph) and its stage-2 training row (the gold
  paragraphs)."""
  line: int
  record: hq.HotpotRecord
  stage1: hq.Layout
  stage2: hq.Layout

  @property
  def truncation(self) -> fd.Truncation:
    """What stage 1's row (every paragraph, max_length tokens) lost: the document is the
    paragraphs' title and sentence tokens (markers, question and specials excluded), the prefix
    the question; evidence, every supporting sentence inside the row (None for a record with no
    supporting fact)."""
    t = self.stage1.truncation
    return fd.Truncation(full_length=t.full_length, document_tokens=t.document_tokens,
                         kept_tokens=t.document_tokens_kept,
                         prefix_cut=t.question_kept < t.question_tokens,
                         evidence=t.evidence_within_limit if t.supporting else None)

  def global_lengths(self, mode: str) -> tuple[int, ...]:
    """The most global tokens of its rows (the layouts' masks are not a prefix: the bound is
    what the attention needs)."""
    if mode == "none":
      return (0,)
    if mode == "first":
      return (1,)
    return (max(self.stage1.num_global, self.stage2.num_global),)


@dataclasses.dataclass(frozen=True)
class HotpotSplit(fd.FinetuneSplit):
  """A HotpotQA file, featurised: `fd.FinetuneSplit` with what stage 2 of the evaluation builds
  its rows with (`encode` the tokenizer, `markers`, `specials`, `stage2_length`, and
  `stage2_sentences`, the [s] slots of k paragraphs)."""
  encode: Any = None
  markers: hq.MarkerIds | None = None
  specials: Any = None
  stage2_length: int = 0
  stage2_sentences: int = 0
  max_question_length: int = 64


def _with_global(layout: hq.Layout, mode: str) -> hq.Layout:
  """The layout with the global mask of `mode` ("question": its own)."""
  if mode == "question":
    return layout
  mask = np.zeros_like(layout.global_attention_mask)
  if mode == "first":
    mask[0] = 1
  return dataclasses.replace(layout, global_attention_mask=mask)


def _stack(layouts: Sequence[hq.Layout], mode: str, prefix: str) -> dict[str, np.ndarray]:
  return {f"{prefix}{k}": v
          for k, v in hq.stack_layouts([_with_global(x, mode) for x in layouts]).items()}


def _unprefix(batch, prefix: str) -> dict[str, Any]:
  return {k[len(prefix):]: v for k, v in batch.items() if k.startswith(prefix)}


@register
class HotpotQA(SettingsKind):
  """hotpotqa: HotpotQA JSON records (the module docstring); LongformerForHotpotQA, both stages.
  Records {"id", "answer", "sp", "paragraphs" (the titles stage 1 chose)}."""
  name = "hotpotqa"
  model_class = LongformerForHotpotQA
  default_global = "question"
  has_question = True
  required = {}
  metrics = (*HOTPOT_METRICS, "paragraph_recall")
  option_fields: ClassVar[tuple[str, ...]] = ("hotpot_stage2_length",)
  # --baseline segments: the splits' settings carry the reading (`HotpotSettings.segments`).
  reads_segments = True

  settings_class = HotpotSettings

  # Records.

  def featurise(self, reader, record, by_text):
    raise TypeError("HotpotQA files are read whole by HotpotQA.read_split, not as JSONL records")

  def read_split(self, path, tokenizer, *, max_length, specials, vocab_size, options,
                 label_names=None):
    """The records of `path` as stage-1 rows of max_length tokens and stage-2 rows of their
    gold paragraphs (hotpot_stage2_length tokens, default max_length), each stage's rows of one
    shape; the split's kind carries the run's evaluation settings (`HotpotSettings.of`)."""
    del label_names
    path = os.fspath(path)
    if tokenizer is None:
      raise ValueError(f"{path}: HotpotQA records are text: give a tokenizer (--tokenizer)")
    try:
      markers = hq.MarkerIds.of_tokenizer(tokenizer)
    except ValueError as e:
      raise ValueError(f"{e}: the HotpotQA layout needs the markers {list(hq.MARKER_TOKENS)} "
                       f"in the tokenizer (tokenizer.add_special_tokens) and the model's "
                       f"vocabulary (convert.extend_vocabulary)") from None
    records = hq.read_hotpotqa(path)
    tokenizer = copy_tokenizer(tokenizer)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    encode = hq.tokenizer_encoder(tokenizer)
    length2 = options.hotpot_stage2_length or max_length
    k = options.hotpot_top_k
    sentences = [[len(s) for _, s in r.context] for r in records]
    gold = [hq.gold_paragraphs(r) for r in records]
    common = dict(max_question_length=options.max_question_length, vocab_size=vocab_size)
    slots1 = dict(max_paragraphs=max(len(r.context) for r in records),
                  max_sentences=max(sum(s) for s in sentences))
    slots2 = dict(max_paragraphs=max([1, *(len(g) for g in gold)]),
                  max_sentences=max([1, *(sum(s[i] for i in g) for s, g in zip(sentences, gold))]))
    examples = tuple(
        HotpotExample(
            line=i + 1, record=r,
            stage1=hq.build_layout(r, encode, specials, markers, max_length=max_length,
                                   **slots1, **common),
            stage2=hq.build_layout(r, encode, specials, markers, max_length=length2,
                                   paragraphs=g, **slots2, **common))
        for i, (r, g) in enumerate(zip(records, gold)))
    return HotpotSplit(
        kind=type(self)(HotpotSettings.of(options)), path=path, sha256=text.file_sha256(path),
        ids=tuple(r.id for r in records), examples=examples, max_length=max_length,
        by_text=True, encode=encode, markers=markers, specials=specials, stage2_length=length2,
        # Static [s] slots of stage 2 at evaluation: the k paragraphs with most sentences.
        stage2_sentences=max(1, max(sum(sorted(s, reverse=True)[:k]) for s in sentences)),
        max_question_length=options.max_question_length)

  # Arrays and the model.

  def batch(self, split, rows, *, global_attention, specials):
    """The stage-1 rows' arrays ("s1_" + `data.hotpotqa.stack_layouts`' names) and the stage-2
    rows' ("s2_"), with the global mask of `global_attention`."""
    del specials
    examples = [split.examples[i] for i in rows]
    return {**_stack([e.stage1 for e in examples], global_attention, "s1_"),
            **_stack([e.stage2 for e in examples], global_attention, "s2_")}

  def targets(self, split, examples):
    """(The labels are in `batch`'s stacked layouts.)"""
    del split, examples
    return {}

  def loss(self, model, batch, max_global):
    """Stage 1's paragraph loss on the s1_ rows plus stage 2's span, type and evidence losses
    on the s2_ rows (`tasks.hotpotqa.hotpot_loss`)."""
    total = 0.0
    for prefix, weights in (("s1_", pipeline.STAGE1_WEIGHTS), ("s2_", pipeline.STAGE2_WEIGHTS)):
      rows = _unprefix(batch, prefix)
      out = pipeline.forward(model, pipeline.model_inputs(rows), max_global=max_global,
                             reading=self.run_settings.segments)
      total = total + pipeline.hotpot_loss(out, rows, weights=weights)[0]
    return total

  def predict(self, model, split, *, global_attention, max_answer_length, batch_size,
              max_examples, progress=False, **settings):
    """The two-stage pipeline (module docstring) on the first max_examples records: object
    arrays "answer" [E] and "sp" [E], and "chosen" [E, k] (paragraph indices)."""
    del settings, progress
    global_attention = self.resolve_global(global_attention)
    model = nnx.merge(*nnx.split(model))  # a copy to switch to evaluation mode
    model.eval()
    num = len(split) if max_examples is None else min(max_examples, len(split))
    examples = split.examples[:num]
    k = self.run_settings.top_k
    reading = self.run_settings.segments
    if reading is not None:  # the segments' global tokens follow the evaluation's mode
      reading = dataclasses.replace(reading, global_mode=global_attention)
    rows1 = [_with_global(e.stage1, global_attention) for e in examples]
    logits = pipeline.run_rows(model, rows1, batch_size=batch_size,
                               max_answer_length=max_answer_length,
                               reading=reading)["paragraph_logits"]
    chosen = pipeline.stage1_selection(rows1, logits, k=k,
                                       num_paragraphs=[len(e.record.context) for e in examples])
    rows2 = [_with_global(hq.build_layout(
        e.record, split.encode, split.specials, split.markers, paragraphs=pick,
        max_length=split.stage2_length, max_paragraphs=k, max_sentences=split.stage2_sentences,
        max_question_length=split.max_question_length), global_attention)
        for e, pick in zip(examples, chosen)]
    decoded = pipeline.run_rows(model, rows2, batch_size=batch_size,
                                max_answer_length=max_answer_length, reading=reading)
    preds = pipeline.predictions(rows2, decoded, sp_threshold=self.run_settings.sp_threshold,
                                 min_sentences=self.run_settings.min_sentences)
    ids = [e.record.id for e in examples]
    answers, facts = np.empty(num, object), np.empty(num, object)
    for i, id_ in enumerate(ids):
      answers[i], facts[i] = preds["answer"][id_], preds["sp"][id_]
    picks = np.full((num, k), -1, np.int32)
    for i, pick in enumerate(chosen):
      picks[i, :len(pick)] = pick
    return {"answer": answers, "sp": facts, "chosen": picks}

  def score(self, split, examples, ids, outputs):
    preds = {"answer": {e.record.id: a for e, a in zip(examples, outputs["answer"])},
             "sp": {e.record.id: s for e, s in zip(examples, outputs["sp"])}}
    metrics = hotpot_scores(predictions=preds, golds=[e.record.as_json() for e in examples])
    found = wanted = 0
    records = []
    for e, a, s, pick in zip(examples, outputs["answer"], outputs["sp"], outputs["chosen"]):
      gold = set(hq.gold_paragraphs(e.record))
      picked = [int(p) for p in pick if p >= 0]
      found += len(gold & set(picked))
      wanted += len(gold)
      records.append({"id": e.record.id, "answer": a, "sp": s,
                      "paragraphs": [e.record.context[p][0] for p in picked]})
    metrics["paragraph_recall"] = found / wanted if wanted else 1.0
    return metrics, records

  def files(self, name, split, records):
    """predictions_<name>.json: the official prediction object."""
    official = {"answer": {r["id"]: r["answer"] for r in records},
                "sp": {r["id"]: r["sp"] for r in records}}
    return {f"predictions_{name}.json": json.dumps(official, ensure_ascii=False) + "\n"}

  # The head.

  def num_labels(self, splits, source):
    """No labels: the config's value is kept (unused)."""
    return source.config.num_labels

  def check_labels(self, split, config: LongformerConfig):
    del split, config


def trivial_scores(train_path: str | os.PathLike, path: str | os.PathLike) -> dict[str, float]:
  """The scores of the trivial predictor on the HotpotQA file `path`: every question answered
  with the most frequent answer of `train_path` (a "yes" / "no" answer when the most frequent
  question type there is one), no supporting fact."""
  import collections
  train = hq.read_hotpotqa(train_path)
  answer = collections.Counter(r.answer for r in train).most_common(1)[0][0]
  records = hq.read_hotpotqa(path)
  preds = {"answer": {r.id: answer for r in records}, "sp": {r.id: [] for r in records}}
  return hotpot_scores(predictions=preds, golds=[r.as_json() for r in records])
