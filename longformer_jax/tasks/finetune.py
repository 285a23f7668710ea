"""Fine-tuning a Longformer encoder on four kinds of task (paper §6): the `Task` the shared loop
runs, where the weights come from, the evaluation, and the run a command starts.
`python -m train.finetune` is the command line; docs/finetune.md the guide. The kinds of task and
their metrics are `longformer_jax.tasks.finetune_kinds` (every name of it is re-exported here).

  FinetuneOptions   the settings outside `TrainConfig` (global attention, answer length, tags,
                    length buckets, the segment baseline: `tasks.finetune_segments`)
  FinetuneTask      the `Task`: cross-entropy of the kind's head, batches in `ExampleSampler`
                    order, validation metrics every `eval_every` steps
  load_source       the encoder to start from (HF Longformer or RoBERTa directory, project
                    checkpoint or workdir, or a preset) and `initial_params`, which puts its
                    weights into the task's model (a new head is initialised from the seed)
  predict, score    the model's outputs for a split, then its metrics and prediction records
  length_report     what the length limit cut of a split, and its metrics by length
  new_run_config, run_settings, read_splits, fit_head, training_task, evaluate_only
                    a run from its inputs: the schedule, a workdir's settings, the splits, the
                    head's size, the task; or scores without training
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax import traverse_util
from jax.sharding import Mesh

from longformer_jax import modeling
from longformer_jax.config import LongformerConfig
from longformer_jax.data import finetune_data as fd
from longformer_jax.data.tokenizer import SpecialIds, tokenizer_file
from longformer_jax.tasks.qa_metrics import NORMALIZERS
from longformer_jax.tasks import finetune_segments as fs
from longformer_jax.tasks import truncation
from longformer_jax.tasks.finetune_kinds import (
    KINDS, MODEL_CLASSES, Classification, Kind, MultipleChoice, QuestionAnswering, Tagging,
    best_spans, get_kind, macro_f1, normalize_answer, register, span_answer, squad_scores,
    tagging_scores)
# The kinds defined in their own modules register when imported.
from longformer_jax.tasks import coref_kind as _coref_kind  # noqa: F401
from longformer_jax.tasks import hotpotqa_kind as _hotpotqa_kind  # noqa: F401
from longformer_jax.tasks import wikihop as _wikihop  # noqa: F401
from longformer_jax.training.config import Stage, TrainConfig
from longformer_jax.training.sharding import LOGICAL_RULES
from longformer_jax.training.task import Batches, FinalEvaluation, Task
from longformer_jax.training import examples
from longformer_jax.training import sources
from longformer_jax.training.sources import ModelSource

TOKENIZER_FILE = "tokenizer.json"  # the copy of its tokenizer a run keeps in its workdir
QA_LOSSES = ("first", "all_occurrences")  # FinetuneOptions.qa_loss


@dataclasses.dataclass(frozen=True)
class FinetuneOptions:
  """The settings of a fine-tuning run outside `TrainConfig` (`--set name=value`).

  global_attention: "default" (the task's: `<s>` for classification, the question for QA, the
    question and the candidate for multiple choice, none for tagging), "none", "first" (`<s>`)
    or "question" (QA and multiple choice).
  max_question_length: question tokens kept (QA, multiple choice).
  max_answer_length: the longest answer span decoded, in tokens (QA; evaluation only).
  label_names: token task: the tags in id order (default: the tags of the training file,
    sorted with "O" first; "0".."K" for integer tags; a tag of another file outside them is an
    error). An "O" among them turns on the F1 metrics.
  roberta_positions, roberta_window: the position table and one-sided window of a Longformer
    made from a RoBERTa directory (`convert.roberta_to_longformer`).
  qa_normalizer: QA: the answer normaliser of exact match and F1, "squad" or "triviaqa"
    (`qa_metrics.NORMALIZERS`).
  qa_loss: QA: "first" (the first answer that survived truncation, HF's loss) or
    "all_occurrences" (every occurrence of every answer and alias in the kept context, the
    paper's TriviaQA loss; `QuestionAnswering`).
  length_buckets: the boundaries B of the results' "by_length" metrics: the examples needing at
    most B tokens uncut ("<=B") and the others (">B"), for each B (evaluation only).
  baseline: "longformer" (the encoder reads each example's row whole) or "segments" (the
    paper's segment baseline: the same kept tokens read in segments of `segment_length` tokens,
    each a row of its own, `longformer_jax.tasks.finetune_segments`; coreference reads its row
    in independent segments of `segment_length` tokens itself, `coref_kind`; WikiHop its
    chunk-and-sum in rows of `segment_length` tokens, `tasks.wikihop`).
  segment_length: baseline "segments": the tokens of a segment's row, special tokens and the
    question included (at most the model's positions; 512 for a RoBERTa).
  segment_overlap: baseline "segments": document tokens consecutive segments share (each
    position takes its state from the segment where it is most central).
  segment_pool: baseline "segments", classification: the first segment's `<s>` ("first") or the
    mean of every segment's ("mean").
  coref_*: coreference (`longformer_jax.tasks.coref_kind`): the head's `CorefConfig` fields
    max_span_width, top_span_ratio, max_top_spans, max_antecedents, ffnn_size, ffnn_depth,
    feature_size, use_speakers and dropout; coref_mention_weight, `coref_loss`'s mention
    cross-entropy weight; coref_singletons, the scoring convention (True: the reference
    scorer's; False: singletons removed).
  hotpot_*: HotpotQA (`longformer_jax.tasks.hotpotqa_kind`): hotpot_top_k, the paragraphs stage
    1 hands stage 2; hotpot_sp_threshold and hotpot_min_sentences, the evidence decision
    (`tasks.hotpotqa.predictions`); hotpot_stage2_length, stage 2's row length (None: the
    run's max_length).
  """
  global_attention: str = "default"
  max_question_length: int = 128
  max_answer_length: int = 30
  label_names: tuple[str, ...] | None = None
  roberta_positions: int = 4096
  roberta_window: int = 256
  qa_normalizer: str = "squad"
  qa_loss: str = "first"
  length_buckets: tuple[int, ...] = (512,)
  baseline: str = "longformer"
  segment_length: int = 512
  segment_overlap: int = 0
  segment_pool: str = "first"
  coref_max_span_width: int = 30
  coref_top_span_ratio: float = 0.4
  coref_max_top_spans: int = 3900
  coref_max_antecedents: int = 50
  coref_ffnn_size: int = 3000
  coref_ffnn_depth: int = 1
  coref_feature_size: int = 20
  coref_use_speakers: bool = True
  coref_dropout: float = 0.3
  coref_mention_weight: float = 0.0
  coref_singletons: bool = True
  hotpot_top_k: int = 2
  hotpot_sp_threshold: float = 0.5
  hotpot_min_sentences: int = 0
  hotpot_stage2_length: int | None = None

  def __post_init__(self):
    if self.global_attention not in fd.GLOBAL_MODES:
      raise ValueError(f"global_attention must be one of {fd.GLOBAL_MODES}, got "
                       f"{self.global_attention!r}")
    for name in ("max_question_length", "max_answer_length", "roberta_positions",
                 "roberta_window", "coref_max_span_width", "coref_max_top_spans",
                 "coref_max_antecedents", "coref_ffnn_size", "coref_feature_size",
                 "hotpot_top_k", "hotpot_stage2_length"):
      value = getattr(self, name)
      if value is None and name == "hotpot_stage2_length":
        continue
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if self.qa_normalizer not in NORMALIZERS:
      raise ValueError(f"qa_normalizer must be one of {tuple(NORMALIZERS)}, got "
                       f"{self.qa_normalizer!r}")
    if self.qa_loss not in QA_LOSSES:
      raise ValueError(f"qa_loss must be one of {QA_LOSSES}, got {self.qa_loss!r}")
    for name, low in (("coref_ffnn_depth", 0), ("hotpot_min_sentences", 0)):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    for name, low, high in (("coref_top_span_ratio", 1e-3, None), ("coref_dropout", 0.0, 1.0),
                            ("coref_mention_weight", 0.0, None),
                            ("hotpot_sp_threshold", 0.0, 1.0)):
      value = getattr(self, name)
      if (not isinstance(value, (int, float)) or isinstance(value, bool) or value != value
          or value < low or (high is not None and value > high) or value == float("inf")):
        bound = f"in [{low}, {high}]" if high is not None else f"a finite number >= {low}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    if self.coref_dropout >= 1.0:
      raise ValueError(f"coref_dropout must be below 1, got {self.coref_dropout!r}")
    for name in ("coref_use_speakers", "coref_singletons"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
    if self.label_names is not None and (
        not self.label_names or len(set(self.label_names)) != len(self.label_names)):
      raise ValueError(f"label_names must be distinct names, got {self.label_names!r}")
    buckets = self.length_buckets
    if (not isinstance(buckets, tuple) or not buckets
        or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets)
        or len(set(buckets)) != len(buckets)):
      raise ValueError(f"length_buckets must be distinct ints >= 1 (token counts, e.g. 512 or "
                       f"512,4096), got {buckets!r}")
    if self.baseline not in fs.BASELINES:
      raise ValueError(f"baseline must be one of {fs.BASELINES}, got {self.baseline!r}")
    if self.segment_pool not in fs.SEGMENT_POOLS:
      raise ValueError(f"segment_pool must be one of {fs.SEGMENT_POOLS}, got "
                       f"{self.segment_pool!r}")
    for name, least in (("segment_length", 4), ("segment_overlap", 0)):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if self.segment_overlap >= self.segment_length:
      raise ValueError(f"segment_overlap={self.segment_overlap} must be below segment_length="
                       f"{self.segment_length} (segments share part of their tokens)")

  @property
  def segment_settings(self) -> dict[str, Any]:
    """The settings of the segment baseline a run records (none for the Longformer's)."""
    if self.baseline == "longformer":
      return {}
    return {"baseline": self.baseline, "segment_length": self.segment_length,
            "segment_overlap": self.segment_overlap, "segment_pool": self.segment_pool}

  def reading(self, kind: Kind, global_mode: str) -> Kind | fs.SegmentReading:
    """How the encoder reads `kind`'s examples: the kind's rows whole, or its
    `fs.SegmentReading` (baseline "segments")."""
    return fs.reading(kind, baseline=self.baseline, segment_length=self.segment_length,
                      overlap=self.segment_overlap, pool=self.segment_pool,
                      global_mode=global_mode)


# ----------------------------------------------------------------------------------------------
# The task


class FinetuneTask(Task):
  """Fine-tuning a Longformer task head (module docstring) on a `FinetuneSplit`.

  task: the name of a kind (`KINDS`). train, validation: featurised splits of that kind
    (`fd.read_split`); validation (optional) gives "valid_<metric>" every `eval_every` steps,
    on its first `eval_tokens // max_length` examples (all when eval_tokens is None).
  global_attention: "none", "first" or "question" (`Kind.resolve_global`).
  options: the kind's settings (`Kind.configured`: the QA normaliser and loss) and the
    evaluation's (max_answer_length).
  identity: JSON values naming everything else that fixes what the run computes (tokenizer,
    starting weights); stored with the run and compared on resume.

  Examples the kind does not train on (`Kind.trains_on`: QA records whose answers all fall
  beyond max_length) are `skipped`.
  """

  plot_keys = ("train_loss",)
  plot_ylabel = "cross-entropy (nats)"

  def __init__(self, task: str, train: fd.FinetuneSplit,
               validation: fd.FinetuneSplit | None = None, *, global_attention: str,
               options: FinetuneOptions = FinetuneOptions(),
               identity: Mapping[str, Any] | None = None, test: fd.FinetuneSplit | None = None):
    for split in (train, validation):
      if split is not None and split.task != task:
        raise ValueError(f"{split.path} was read for task {split.task!r}, not {task!r}")
    # The training split's kind when it carries the run's settings (`Kind.read_split`), else
    # the registered kind configured by the options (`Kind.configured`).
    kind = (train.kind if train.kind is not get_kind(task)
            else get_kind(task).configured(options))
    self.task, self.kind, self.train, self.validation = task, kind, train, validation
    self.global_attention = kind.resolve_global(global_attention)
    self.options = options
    self.reading = options.reading(kind, self.global_attention)
    self.rows = [i for i, e in enumerate(train.examples) if kind.trains_on(e)]
    self.skipped = len(train) - len(self.rows)
    if not self.rows:
      raise ValueError(f"{train.path}: {kind.untrained.format(max_length=train.max_length)}: "
                       f"nothing to train on")
    self.max_global = train.max_global(self.global_attention)
    self._identity = dict(identity or {})
    self.test = test

  def check(self, cfg: TrainConfig) -> None:
    c = cfg.model
    if not isinstance(c, LongformerConfig):
      raise ValueError(f"fine-tuning trains a LongformerConfig model, got {type(c).__name__}")
    if c.causal:
      raise ValueError("fine-tuning needs a bidirectional encoder (model.causal=False)")
    n = self.train.max_length
    if self.options.baseline == "segments":
      # The rows the encoder reads are segments: max_length only bounds what is kept.
      if self.options.segment_length > c.max_sequence_length:
        raise ValueError(f"segment_length={self.options.segment_length} exceeds the model's "
                         f"{c.max_sequence_length} positions (max_position_embeddings="
                         f"{c.max_position_embeddings})")
      for split in (self.train, self.validation, self.test):
        if split is not None and self.reading is not self.kind:  # coreference: read_split's
          self.reading.check(split)
    elif n > c.max_sequence_length:
      raise ValueError(f"max_length={n} exceeds the model's {c.max_sequence_length} positions "
                       f"(max_position_embeddings={c.max_position_embeddings})")
    for i, stage in enumerate(cfg.stages):
      if stage.seq_len != n:
        raise ValueError(f"stages[{i}].seq_len={stage.seq_len} differs from max_length={n}")
      if stage.windows is not None:
        raise ValueError(f"stages[{i}].windows={stage.windows}: the encoder trains with the "
                         f"model config's windows (set model.attention_window)")
    for split in (self.train, self.validation):
      if split is not None:
        self.kind.check_labels(split, c)

  def data_identity(self, cfg: TrainConfig) -> dict[str, Any]:
    """The task, the training file (SHA-256, examples), the global tokens, the tags, the segment
    baseline's settings (a run of the Longformer's records none) and the given `identity` (the
    sequence length is the stages' seq_len)."""
    del cfg
    return {"task": self.task, "train_sha256": self.train.sha256,
            "train_examples": len(self.train), "global_attention": self.global_attention,
            "max_question_length": self.options.max_question_length,
            "label_names": self.train.label_names, **self.kind.settings(),
            **self.options.segment_settings,
            **{name: getattr(self.options, name) for name in self.kind.option_fields},
            **self._identity}

  def build_model(self, config: LongformerConfig, rngs: nnx.Rngs, mesh: Mesh | None = None,
                  seq_axis: str | None = None) -> nnx.Module:
    return self.kind.build_model(config, self.options, rngs=rngs, mesh=mesh, seq_axis=seq_axis)

  def loss(self, model, batch, stage: Stage, dropout_key: jax.Array) -> jax.Array:
    del stage
    # Dropout streams reseeded from the step's key: new masks every step, the same on resume.
    nnx.reseed(model, default=dropout_key)
    return self.reading.loss(model, batch, self.max_global)

  def batches(self, cfg: TrainConfig, stage_index: int, *, process_index: int,
              process_count: int) -> Batches:
    sampler = dict(global_batch_size=cfg.stages[stage_index].batch_size,
                   seed=cfg.seed + stage_index, process_index=process_index,
                   process_count=process_count)
    specials = SpecialIds.of_config(cfg.model)
    if self.reading is self.kind:  # whole rows: the kind orders them (WikiHop shuffles its own)
      return self.kind.training_batches(self.train, self.rows,
                                        global_attention=self.global_attention,
                                        specials=specials, **sampler)
    make = functools.partial(self.reading.batch, self.train,
                             global_attention=self.global_attention, specials=specials)
    return examples.ExampleBatches(lambda rows: make(rows=rows), self.rows, **sampler)

  def evaluate(self, model, cfg: TrainConfig, stage_index: int, mesh: Mesh) -> dict[str, float]:
    if self.validation is None:
      return {}
    limit = (None if cfg.eval_tokens is None
             else max(1, cfg.eval_tokens // cfg.stages[stage_index].seq_len))
    outputs = predict(model, self.validation, global_attention=self.global_attention,
                      max_answer_length=self.options.max_answer_length,
                      batch_size=cfg.eval_batch_size, max_examples=limit, mesh=mesh,
                      rules=cfg.logical_rules, options=self.options)
    metrics, _ = score(self.validation, outputs)
    return {f"valid_{k}": v for k, v in metrics.items() if k not in ("examples", "questions")}

  def final_evaluation(self, cfg: TrainConfig, workdir, mesh: Mesh, *,
                       progress: bool = False) -> FinalEvaluation:
    """The validation and test splits scored by the run's newest checkpoint (`score_splits`)."""
    model, step, _ = self.restore(cfg, workdir, mesh)
    evaluation = score_splits(
        model, {"validation": self.validation, "test": self.test},
        global_attention=self.global_attention, options=self.options, cfg=cfg, mesh=mesh,
        progress=progress)
    return dataclasses.replace(evaluation, step=step)


def score_splits(model: nnx.Module, splits: Mapping[str, fd.FinetuneSplit | None], *,
                 global_attention: str, options: FinetuneOptions, cfg: TrainConfig,
                 mesh: Mesh | None = None, progress: bool = False) -> FinalEvaluation:
  """`predict` and `score` of each split given (None: skipped): {name: metrics} and the files
  predictions_<name>.jsonl (one record per example)."""
  results, files, lines = {}, {}, []
  for name, split in splits.items():
    if split is None:
      continue
    outputs = predict(model, split, global_attention=global_attention,
                      max_answer_length=options.max_answer_length,
                      batch_size=cfg.eval_batch_size, mesh=mesh, rules=cfg.logical_rules,
                      progress=progress, options=options)
    metrics, records = score(split, outputs)
    report = length_report(split, metrics["examples"], outputs,
                           length_buckets=options.length_buckets)
    results[name] = {**metrics, **report}
    files[f"predictions_{name}.jsonl"] = "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                 for r in records)
    files.update(split.kind.files(name, split, records))
    lines.append(f"{name}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in metrics.items()))
    if "truncation" in report:
      lines.append(f"{name}: " + _truncation_line(report["truncation"]))
  return FinalEvaluation(results, files, tuple(lines))


def length_report(split: fd.FinetuneSplit, num: int, outputs: Mapping[str, np.ndarray], *,
                  length_buckets: Sequence[int] = (512,)) -> dict[str, Any]:
  """What the length limit did to the first `num` examples of `split` and the metrics by
  length (`longformer_jax.tasks.truncation`): {"truncation": {"max_length", "examples",
  "examples_truncated", "document_tokens_kept", "evidence_within_limit", and the kind's own
  keys, `Kind.truncation_extras`}, "by_length": {"<=B": {metrics..., "examples"}, ">B": {...}}
  for each B of `length_buckets`}. The kind's metrics are computed anew on each bucket's
  examples (`Kind.score`), so a corpus-level one (macro F1, tagging's micro F1, coreference's
  CoNLL F1) is that bucket's own and does not average back to the split's. {} when the kind
  does not record what it cut (`fd.Example.truncation` None)."""
  examples = split.examples[:num]
  facts = [e.truncation for e in examples]
  if not facts or any(f is None for f in facts):
    return {}
  block = truncation.truncation_block(
      max_length=split.max_length, document_tokens=[f.document_tokens for f in facts],
      kept_tokens=[f.kept_tokens for f in facts], prefix_cut=[f.prefix_cut for f in facts],
      evidence_kept=[f.evidence for f in facts])
  block.update(split.kind.truncation_extras(examples))
  ids = split.ids[:num]

  def metrics(idx: np.ndarray) -> dict[str, Any]:
    part = {name: np.asarray(x)[idx] for name, x in outputs.items()}
    return split.kind.score(split, [examples[i] for i in idx], [ids[i] for i in idx], part)[0]

  full = [f.full_length for f in facts]
  by_length = {}
  for boundary in sorted(length_buckets):
    by_length.update(truncation.by_length_with(full, boundary, metrics))
  return {"truncation": block, "by_length": by_length}


_COMMON_TRUNCATION = ("max_length", "examples", "examples_truncated", "document_tokens_kept",
                      "evidence_within_limit")


def _truncation_line(block: Mapping[str, Any]) -> str:
  share = lambda x: "n/a" if x is None else f"{x:.1%}"
  extras = "".join(f", {k.replace('_', ' ')} {share(v)}" for k, v in block.items()
                   if k not in _COMMON_TRUNCATION)
  return (f"max_length {block['max_length']}: {share(block['examples_truncated'])} of examples "
          f"cut, {share(block['document_tokens_kept'])} of document tokens kept, evidence "
          f"within the limit in {share(block['evidence_within_limit'])}{extras}")


# ----------------------------------------------------------------------------------------------
# Evaluation


@functools.lru_cache(maxsize=16)
def _outputs_fn(graphdef, kind: Kind | fs.SegmentReading, max_global: int,
                max_answer_length: int):
  """One jitted forward pass per model structure and setting: evaluating every N steps reuses
  the compilation."""

  @jax.jit
  def outputs(state, batch):
    logits = kind.logits(nnx.merge(graphdef, state), batch, max_global)
    return kind.outputs(logits, max_answer_length)

  return outputs


def predict(model: nnx.Module, split: fd.FinetuneSplit, *, global_attention: str,
            max_answer_length: int = 30, batch_size: int = 8, max_examples: int | None = None,
            mesh: Mesh | None = None, rules: Sequence[tuple[str, Any]] = LOGICAL_RULES,
            progress: bool = False, options: FinetuneOptions | None = None
            ) -> dict[str, np.ndarray]:
  """The model's outputs (dropout off) for the first `max_examples` examples of `split`
  (default all), one row each (`Kind.outputs`): "logits" [E, L] or [E, C] (classification,
  multiple choice), "tags" [E, N] (token), "start", "end" (row positions) and "score" [E]
  (qa). `options.baseline` "segments" reads them in segments (`fs.SegmentReading`, the same
  outputs at the same row positions); a kind with its own `Kind.predict` (HotpotQA's two stages)
  gives its own."""
  own = split.kind.predict(model, split, global_attention=global_attention,
                           max_answer_length=max_answer_length, batch_size=batch_size,
                           max_examples=max_examples, mesh=mesh, rules=rules, progress=progress)
  if own is not None:
    return own
  model = nnx.merge(*nnx.split(model))  # a copy to switch to evaluation mode
  model.eval()
  graphdef, state = nnx.split(model)
  mode = split.kind.resolve_global(global_attention)
  reading = (options or FinetuneOptions()).reading(split.kind, mode)
  fn = _outputs_fn(graphdef, reading, split.max_global(mode), max_answer_length)
  num = len(split) if max_examples is None else min(max_examples, len(split))
  # A head config wrapping the encoder's (coreference's CorefConfig) names its ids there.
  specials = SpecialIds.of_config(getattr(model.config, "encoder", model.config))
  parts = collections.defaultdict(list)
  batches = examples.row_batches(num, batch_size, mesh)
  for rows, real in examples.progress(batches, len(batches), f"eval {split.task}", "batch",
                                     progress):
    batch = reading.batch(split, rows, global_attention=mode, specials=specials)
    out = fn(state, examples.put_batch(batch, mesh, rules))
    for name, x in out.items():
      parts[name].append(examples.to_host(x)[:real])
  return {name: np.concatenate(xs) for name, xs in parts.items()}


def score(split: fd.FinetuneSplit, outputs: Mapping[str, np.ndarray]
          ) -> tuple[dict[str, float], list[dict[str, Any]]]:
  """(metrics, prediction records) of `predict`'s outputs for the first examples of `split`:
  the kind's (`Kind.score`), and "examples", how many were scored. Records are JSON objects,
  one per example, "id" first, with "full_length" (the tokens the example needs uncut, special
  tokens included) and "truncated" (a document or question token was cut) where the kind
  records them (`fd.Example.truncation`)."""
  num = len(next(iter(outputs.values())))
  metrics, records = split.kind.score(split, split.examples[:num], split.ids[:num], outputs)
  for record, e in zip(records, split.examples[:num]):
    facts = e.truncation
    if facts is not None:
      record.update(full_length=facts.full_length, truncated=facts.truncated)
  return {**metrics, "examples": num}, records


# ----------------------------------------------------------------------------------------------
# The run a command starts: settings, splits, head size, task


def new_run_config(source: ModelSource, *, steps: int, batch_size: int, learning_rate: float,
                   max_length: int | None, seed: int, warmup_steps: int | None = None
                   ) -> TrainConfig:
  """A run's TrainConfig: `source`'s model, one stage of `steps` AdamW steps of `batch_size`
  records at `learning_rate` with a linear warm-up over `warmup_steps` (None: the first 10% of
  `steps`; a started run passes its own, `started_warmup`) and a linear decay to 0, rows of
  `max_length` tokens (None: the model's positions)."""
  return TrainConfig(
      model=source.config, dataset="jsonl", seed=seed,
      stages=(Stage(seq_len=max_length or source.config.max_sequence_length,
                    batch_size=batch_size, steps=steps, learning_rate=learning_rate,
                    warmup_steps=steps // 10 if warmup_steps is None else warmup_steps,
                    end_learning_rate=0.0, decay_power=1.0),))


def started_warmup(workdir) -> int | None:
  """The warm-up of the run in `workdir` if it has started (it has a checkpoint): fixed when it
  started (10% of its first steps), it stays when more steps extend the run. None for a new
  workdir or a failed start."""
  from longformer_jax.training.config import started_record
  record = started_record(workdir)
  return None if record is None else record["stages"][0]["warmup_steps"]


def keep_tokenizer(workdir, tokenizer: str | os.PathLike | None) -> None:
  """Keeps a copy of the run's tokenizer file (a tokenizer.json or its directory) as
  <workdir>/tokenizer.json when the run starts, byte for byte: the SHA-256 its record holds is
  the copy's, and --eval-only takes it by default (`run_settings`)."""
  from etils import epath
  from longformer_jax.training.config import keep_run_file
  if tokenizer is not None:
    keep_run_file(workdir, TOKENIZER_FILE, epath.Path(tokenizer_file(tokenizer)).read_bytes())


def run_settings(workdir, task: str, max_length: int | None = None,
                 tokenizer: str | os.PathLike | None = None
                 ) -> tuple[TrainConfig, FinetuneOptions, Any]:
  """(TrainConfig, options, tokenizer) of the fine-tuning run of `task` in `workdir`: what
  scoring its checkpoints without training uses. Its record (run_config.json, checked against
  the checkpoints) gives the settings and the row length; the tokenizer is `tokenizer` (a
  tokenizer.json or its directory), else the copy the run keeps (<workdir>/tokenizer.json), else
  None (a run on records of ids, or one that kept none). A `max_length` or a tokenizer other
  than the run's is refused: ValueError, or `identity.RunFileError` naming the file and both
  SHA-256s (the kept copy included); ValueError too for a run of another kind or task."""
  from etils import epath
  from longformer_jax.data import text
  from longformer_jax.data.tokenizer import load_tokenizer
  from longformer_jax.tasks.runs import read_run
  from longformer_jax.training import identity
  record, cfg = read_run(workdir, "finetune")
  data = record["data"]
  if data["task"] != task:
    raise ValueError(f"{workdir} is a fine-tuning run of task {data['task']!r}, not {task!r} "
                     f"(--task {data['task']})")
  if max_length is not None and max_length != cfg.stages[0].seq_len:
    raise ValueError(f"max_length={max_length} is not the run's {cfg.stages[0].seq_len} (its "
                     f"stages.0.seq_len): a checkpoint is scored at the length it trained at; "
                     f"leave it out to take the run's")
  recorded = data.get("tokenizer_sha256")
  kept = epath.Path(workdir) / TOKENIZER_FILE
  path = (tokenizer_file(tokenizer) if tokenizer is not None
          else kept if recorded is not None and kept.exists() else None)
  if path is not None:
    hint = "" if tokenizer is None else " (leave it out: the run's is taken by default)"
    identity.check_checksum(f"the tokenizer {path}", recorded, text.file_sha256(path),
                            f"not the one the run in {workdir} trained with{hint}")
  # A kind's settings and the segment baseline's are in the record when they differ from the
  # defaults; a kind's own option fields always.
  settings = {k: data[k] for k in KIND_SETTINGS + _SEGMENT_SETTINGS + get_kind(task).option_fields
              if k in data}
  if data.get("coref_segment_length") is not None:
    # A coreference run recorded before it took the segment baseline's settings: the same
    # reading under its former name.
    settings.update(baseline="segments", segment_length=data["coref_segment_length"])
  options = FinetuneOptions(
      global_attention=data["global_attention"],
      max_question_length=data["max_question_length"],
      label_names=None if data["label_names"] is None else tuple(data["label_names"]),
      **settings)
  return cfg, options, None if path is None else load_tokenizer(path)


_SEGMENT_SETTINGS = ("baseline", "segment_length", "segment_overlap", "segment_pool")


def read_splits(task: str, paths: Mapping[str, str | os.PathLike | None], tokenizer,
                cfg: TrainConfig, options: FinetuneOptions, new_run: bool = False
                ) -> dict[str, fd.FinetuneSplit]:
  """The files `paths` ({split name: JSONL path or None}) featurised for `task` at the run's
  row length (`fd.read_split`), by name; None paths are left out.

  The label names (tagging) are `options.label_names` when given (a run's own are in its
  record), else, for a `new_run`, the tags of its training file (`Kind.label_names`): a tag of
  the validation or test file that training never saw is an error naming its file and line, not
  a new class. Without a training file (scoring a model without training) the given files name
  them."""
  kind = get_kind(task).configured(options)
  label_names = options.label_names
  if new_run:
    named_by = [paths["train"]] if paths.get("train") is not None else [
        p for p in paths.values() if p is not None]
    label_names = kind.label_names(named_by, options.label_names)
  return {name: kind.read_split(path, tokenizer, max_length=cfg.stages[0].seq_len,
                                specials=SpecialIds.of_config(cfg.model),
                                vocab_size=cfg.model.vocab_size, options=options,
                                label_names=label_names)
          for name, path in paths.items() if path is not None}


def fit_head(task: str, cfg: TrainConfig, splits: Mapping[str, fd.FinetuneSplit],
             source: ModelSource | None) -> TrainConfig:
  """`cfg` with the head sized starting from `source` (`Kind.num_labels`; source None:
  model.num_labels kept), after checking every split's labels fit it.

  The training split alone sizes the head: a validation or test label beyond its classes is an
  error naming the file and line (the run's config records the size). Without one (scoring a
  model without training), a source with the kind's head keeps its size; other sources get a
  new head sized by the given splits."""
  kind = get_kind(task)
  if source is not None:
    if kind.new_tokens and source.model_class != kind.model_class.__name__:
      cfg = dataclasses.replace(cfg, model=cfg.model.replace(
          vocab_size=cfg.model.vocab_size + len(kind.new_tokens)))
    if "train" in splits:
      size = kind.num_labels([splits["train"]], source)
    elif source.model_class == kind.model_class.__name__:
      size = source.config.num_labels
    else:
      size = kind.num_labels(list(splits.values()), source)
    cfg = dataclasses.replace(cfg, model=cfg.model.replace(num_labels=size))
  for split in splits.values():
    kind.check_labels(split, cfg.model)
  return cfg


def training_task(task: str, splits: Mapping[str, fd.FinetuneSplit], cfg: TrainConfig, *,
                  source: ModelSource, tokenizer: str | os.PathLike | None,
                  global_attention: str, options: FinetuneOptions) -> FinetuneTask:
  """The `FinetuneTask` of the splits "train" (required), "validation" and "test", checked
  against `cfg`; its identity names the starting weights and the tokenizer file's SHA-256
  (`tokenizer`: a tokenizer.json or its directory; None: records of ids)."""
  from longformer_jax.data import text
  identity = {"init": source.identity}
  if tokenizer is not None:
    identity["tokenizer_sha256"] = text.file_sha256(tokenizer_file(tokenizer))
  result = FinetuneTask(task, splits["train"], splits.get("validation"),
                        global_attention=global_attention, options=options, identity=identity,
                        test=splits.get("test"))
  result.check(cfg)
  return result


def evaluation_only(task: str, cfg: TrainConfig, source: ModelSource | None, workdir,
                    splits: Mapping[str, fd.FinetuneSplit], *, global_attention: str,
                    options: FinetuneOptions, progress: bool = False
                    ) -> Callable[[Mesh], FinalEvaluation]:
  """A function of the mesh scoring the "validation" and "test" splits without training
  (`evaluate_only`): with the newest checkpoint of the run in `workdir` (source None), else
  with `source`'s weights. ValueError when a preset `source` has none to score."""
  if source is not None and source.params is None:
    raise ValueError(f"nothing to evaluate: {workdir} has no checkpoint and --model "
                     f"{source.identity.get('preset')} is a preset (fresh weights)")
  given = {name: splits.get(name) for name in ("validation", "test")}
  return lambda mesh: evaluate_only(task, cfg, source, workdir, mesh, given,
                                    global_attention=global_attention, options=options,
                                    progress=progress)


# What `--eval-only` of a trained run may change: how the checkpoint is evaluated (the batch, the
# device layout, the attention implementation and rematerialisation, which compute the same
# function; global attention placement and answer decoding among the options), never the
# model's weights or architecture nor the data it was trained on.
EVAL_ONLY_SETTINGS = ("eval_batch_size", "mesh_shape", "logical_rules", "model.attention_impl",
                      "model.remat")
EVAL_ONLY_OPTIONS = ("global_attention", "max_answer_length", "qa_normalizer", "length_buckets",
                     "coref_singletons", "hotpot_top_k", "hotpot_sp_threshold",
                     "hotpot_min_sentences")
# The options a kind reads (`Kind.configured`), recorded in a run's identity when not the default.
KIND_SETTINGS = ("qa_normalizer", "qa_loss")


def _changes(old: Any, new: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
  """{dotted path: (old, new)} of the fields where two values of a (nested) frozen dataclass
  differ; tuples of dataclasses (stages) by index."""
  if dataclasses.is_dataclass(old) and type(old) is type(new):
    out = {}
    for f in dataclasses.fields(old):
      out.update(_changes(getattr(old, f.name), getattr(new, f.name), f"{prefix}{f.name}."))
    return out
  if (isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new)
          and any(dataclasses.is_dataclass(x) for x in old)):
    out = {}
    for i, (a, b) in enumerate(zip(old, new)):
      out.update(_changes(a, b, f"{prefix}{i}."))
    return out
  return {} if old == new else {prefix.rstrip("."): (old, new)}


def eval_only_changes(run_cfg: TrainConfig, cfg: TrainConfig, run_options: FinetuneOptions,
                      options: FinetuneOptions) -> dict[str, Any]:
  """{setting: value} of what an evaluation of a trained run changes of the run's settings
  (`cfg`, `options` against the run's own), each among `EVAL_ONLY_SETTINGS` /
  `EVAL_ONLY_OPTIONS`. Any other change is a ValueError naming it: scoring the checkpoint with
  another model (a --set model.layer_norm_eps, a new head size) or on data featurised otherwise
  (max_question_length, label_names) would report a number that is not the run's."""
  changed = {**_changes(run_cfg, cfg), **_changes(run_options, options)}
  refused = [f"{k}: {old!r} -> {new!r}" for k, (old, new) in sorted(changed.items())
             if k not in EVAL_ONLY_SETTINGS + EVAL_ONLY_OPTIONS]
  if refused:
    raise ValueError(
        f"--eval-only scores the run's own model on data read as it trained: "
        f"{'; '.join(refused)} would change its weights, architecture or data; only "
        f"{', '.join(EVAL_ONLY_SETTINGS + EVAL_ONLY_OPTIONS)} may differ (train a new run to "
        f"change the others)")
  return {k: new for k, (_, new) in sorted(changed.items())}


def starting_params(source: ModelSource, task: FinetuneTask, cfg: TrainConfig
                    ) -> dict[str, Any]:
  """A new run's parameters: the encoder from `source`, the head anew where it has none
  (`initial_params`; the kind's marker tokens added, `kind_params`), for `training.train`'s
  init_params."""
  return kind_params(task.kind, source, task.build_model(cfg.model, nnx.Rngs(cfg.seed)),
                     seed=cfg.seed)


def kind_params(kind: Kind, source: ModelSource, model: nnx.Module, *, seed: int = 0
                ) -> dict[str, Any]:
  """`initial_params` of `model`, a model of `kind`; when the kind adds marker tokens
  (`Kind.new_tokens`) and `source` lacks them, the source's weights are loaded into a model of
  the source's vocabulary, which `convert.extend_vocabulary` grows by the markers (new rows
  drawn from the table's statistics with `seed`, old rows bit-identical).

  Raises ValueError when `model`'s vocabulary has no room for the markers (`fit_head` sizes it).
  """
  from longformer_jax import convert
  if not kind.new_tokens or source.model_class == kind.model_class.__name__:
    return initial_params(source, model)
  # (After the return above: a kind without markers may have a config of its own, as
  # coreference's CorefConfig, with no vocab_size.)
  added = model.config.vocab_size - source.config.vocab_size
  if added != len(kind.new_tokens):
    raise ValueError(f"task {kind.name!r} adds the tokens {list(kind.new_tokens)} to the "
                     f"vocabulary: the model needs vocab_size={source.config.vocab_size} + "
                     f"{len(kind.new_tokens)}, got {model.config.vocab_size} (size the model "
                     f"with finetune.fit_head)")
  base = type(model)(model.config.replace(vocab_size=source.config.vocab_size),
                     rngs=nnx.Rngs(seed))
  state = nnx.state(base, nnx.Param)
  nnx.replace_by_pure_dict(state, initial_params(source, base))
  nnx.update(base, state)
  grown = convert.extend_vocabulary(base, added, seed=seed)
  return nnx.to_pure_dict(nnx.state(grown, nnx.Param))


# ----------------------------------------------------------------------------------------------
# The model to start from


def load_source(spec: str, tokenizer=None, *, options: FinetuneOptions = FinetuneOptions()
                ) -> ModelSource:
  """The Longformer named by `spec`:

    * a local HF Longformer directory (config.json, model_type "longformer"): `convert.from_hf`
      (allenai/longformer-base-4096 is a LongformerForMaskedLM: its encoder is used);
    * a local HF RoBERTa directory: `convert.roberta_to_longformer` (options.roberta_positions,
      options.roberta_window), the paper's recipe;
    * a project model checkpoint (`checkpoint.save_model`, model.json) of any Longformer class;
    * a project training workdir (run_config.json) of a LongformerConfig model: a fine-tuning
      run (its kind's head) or an MLM run (LongformerForMaskedLM), its newest good checkpoint;
    * a preset, "tiny", "base" or "large" (`LongformerConfig.tiny()/.base()/.large()`), with
      fresh weights; the ids of <s>, </s> and <pad> come from `tokenizer` when it has them.

  Raises FileNotFoundError / ValueError naming what is wrong.
  """
  from longformer_jax import convert

  def preset(name):
    ids = {}
    if tokenizer is not None:
      for token, fields in (("<s>", ("bos_token_id",)), ("</s>", ("eos_token_id", "sep_token_id")),
                            ("<pad>", ("pad_token_id",))):
        if tokenizer.token_to_id(token) is not None:
          ids.update(dict.fromkeys(fields, tokenizer.token_to_id(token)))
    return getattr(LongformerConfig, name)(**ids)

  hf = {"longformer": convert.from_hf,
        "roberta": functools.partial(convert.roberta_to_longformer,
                                     max_positions=options.roberta_positions,
                                     window=options.roberta_window)}

  def workdir_class(record, cfg):
    if not isinstance(cfg.model, LongformerConfig):
      raise ValueError(f"{spec} is a run of a {type(cfg.model).__name__} model, not a "
                       f"Longformer encoder")
    # A fine-tuning run names its task; an MLM run's model is a masked LM.
    return MODEL_CLASSES.get((record.get("data") or {}).get("task"),
                             modeling.LongformerForMaskedLM)

  return sources.load_source(spec, LongformerConfig, preset, hf, workdir_class,
                             expected="a Longformer encoder")


def initial_model(task: str, source: ModelSource, cfg: TrainConfig, mesh: Mesh,
                  options: FinetuneOptions = FinetuneOptions()) -> nnx.Module:
  """The task's model with the source's weights (`initial_params`), laid out on the mesh as a
  trained run's parameters are."""
  from longformer_jax.training.sharding import param_shardings, seq_axis
  model = get_kind(task).build_model(cfg.model, options, rngs=nnx.Rngs(cfg.seed), mesh=mesh,
                                     seq_axis=seq_axis(mesh))
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, kind_params(get_kind(task), source, model, seed=cfg.seed))
  nnx.update(model, jax.device_put(state, param_shardings(state, mesh, cfg.logical_rules)))
  return model


def evaluate_only(task: str, cfg: TrainConfig, source: ModelSource | None, workdir, mesh: Mesh,
                  splits: Mapping[str, fd.FinetuneSplit | None], *, global_attention: str,
                  options: FinetuneOptions, progress: bool = False) -> FinalEvaluation:
  """`score_splits` without training: of the newest checkpoint of the run in `workdir` (source
  None; its step is the evaluation's `step`), else of `source`'s weights (`initial_model`)."""
  from longformer_jax.training.task import restore
  step = None
  if source is None:
    model, step, _ = restore(
        lambda config, rngs, mesh=None, seq_axis=None: get_kind(task).build_model(
            config, options, rngs=rngs, mesh=mesh, seq_axis=seq_axis), cfg, workdir, mesh)
  else:
    model = initial_model(task, source, cfg, mesh, options)
  evaluation = score_splits(model, splits, global_attention=global_attention, options=options,
                            cfg=cfg, mesh=mesh, progress=progress)
  return dataclasses.replace(evaluation, step=step)


def _is_head(path: tuple) -> bool:
  """Parts a task model may initialise anew: everything outside the encoder, and its pooler
  (only multiple choice pools; HF's masked LM checkpoints have none)."""
  return path[0] != "longformer" or path[1] == "pooler"


def initial_params(source: ModelSource, model: nnx.Module) -> dict[str, Any]:
  """`model`'s parameters (a pure dict) with every array the source has at the same path and
  shape: the encoder always, a head of the same task and size too. Parts of `model` the source
  lacks (or holds in another shape: a head for another number of labels) keep their fresh
  values and the rest of the source is dropped, with a warning naming both (as
  `convert.from_hf` does for a new head).

  Raises ValueError when an encoder array is missing from the source or differs in shape (a
  `--set model.<field>` that changed the architecture).
  """
  target = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  given = traverse_util.flatten_dict(source.params)
  if source.model_class == "LongformerModel":  # the bare encoder: saved without the prefix
    given = {("longformer",) + path: x for path, x in given.items()}
  name = lambda path: "/".join(map(str, path))
  usable = {p for p, x in target.items() if p in given and given[p].shape == x.shape}
  bad = [f"{name(p)} {'missing' if p not in given else given[p].shape} (model: {x.shape})"
         for p, x in target.items() if p not in usable and not _is_head(p)]
  if bad:
    raise ValueError(f"the starting weights do not fit {type(model).__name__}'s encoder: "
                     f"{bad[:5]} (a --set model.<field> that changes the architecture?)")
  fresh = sorted(name(p) for p in target if p not in usable)
  unused = sorted(name(p) for p in given if p not in usable)
  if fresh or unused:
    warnings.warn(f"{type(model).__name__}: newly initialised {fresh}; unused starting weights "
                  f"{unused}", stacklevel=2)
  return traverse_util.unflatten_dict({p: given[p] if p in usable else x
                                       for p, x in target.items()})


__all__ = [
    "Classification", "FinetuneOptions", "FinetuneTask", "KINDS", "Kind", "MODEL_CLASSES",
    "ModelSource", "MultipleChoice", "QuestionAnswering", "TOKENIZER_FILE", "Tagging", "best_spans",
    "eval_only_changes", "evaluate_only", "evaluation_only", "fit_head",
    "get_kind", "initial_model", "initial_params", "keep_tokenizer", "kind_params",
    "length_report", "load_source", "macro_f1",
    "new_run_config", "normalize_answer", "predict", "read_splits", "register", "run_settings",
    "score", "score_splits", "span_answer", "squad_scores", "started_warmup", "starting_params",
    "tagging_scores", "training_task",
]
