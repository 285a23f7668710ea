"""The kinds of fine-tuning task (paper §6) and their metrics: what differs between
classification, QA, tagging and multiple choice. `longformer_jax.tasks.finetune` trains and
scores them (and re-exports every name here).

  Kind, KINDS, register  a kind of task (its records, head, logits, loss, predictions, metrics
                    and label count) and the registry of them by name: Classification
                    ("classification"), QuestionAnswering ("qa"), Tagging ("token"),
                    MultipleChoice ("multiple_choice"); MODEL_CLASSES, each name's head
  best_spans, span_answer   QA decoding: the best span of a row, its answer
  macro_f1, tagging_scores, squad_scores   the metrics the kinds report

Adding a kind: a `Kind` subclass with its class attributes and methods, decorated `@register`
(docs/finetune.md). Every metric is a fraction in [0, 1] (the SQuAD script prints 100x). Shape
letters: the alphabet of `longformer_jax.ops`.
"""

from __future__ import annotations

import abc
import collections
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from longformer_jax import modeling
from longformer_jax.config import LongformerConfig
from longformer_jax.data import finetune_data as fd
from longformer_jax.data import text
from longformer_jax.data.tokenizer import SpecialIds
from longformer_jax.training import examples as example_batches
from longformer_jax.training.sources import ModelSource
from longformer_jax.tasks.qa_metrics import (
    all_occurrence_span_loss, get_normalizer, normalize_answer)

# Logits of positions and candidates that cannot be chosen (float32: exp underflows to 0).
_NEG = -1e9

# ----------------------------------------------------------------------------------------------
# Kinds of task


class Kind(abc.ABC):
  """A kind of fine-tuning task: everything that differs between classification, QA, tagging and
  multiple choice. `register` puts one instance of each subclass in `KINDS`.

  Class attributes:
    name: the task's name (`--task`, the run's identity, `FinetuneSplit.task`).
    model_class: its head (`longformer_jax.modeling`).
    default_global: what global_attention="default" means: "none", "first" or "question".
    has_question: the records hold a question (global_attention="question" applies).
    required, documents: the record layout (`fd.RecordLayout`): the fields of every record, and
      the text field and "input_ids", one of which each record holds.
    metrics: the names `score` reports, each a fraction in [0, 1].
    untrained: why no example of a split can be trained on (`trains_on`), a format string of
      max_length.
    new_tokens: marker tokens the kind adds as the last rows of the vocabulary (a run from a
      model without them grows its table, `convert.extend_vocabulary`); none by default.

  Methods: `featurise`, `split_fields` and `label_names` read records; `batch` and `targets`
  make arrays; `logits`, `loss` and `outputs` run the model (under jit); `score` gives metrics
  and prediction records; `num_labels` and `check_labels` size the head.
  """
  name: ClassVar[str]
  model_class: ClassVar[type[nnx.Module]]
  default_global: ClassVar[str]
  has_question: ClassVar[bool] = False
  required: ClassVar[Mapping[str, Any]]
  documents: ClassVar[Mapping[str, Any]] = {"text": str, "input_ids": list}
  optional: ClassVar[Mapping[str, Any]] = {}
  metrics: ClassVar[tuple[str, ...]]
  untrained: ClassVar[str] = "no record can be trained on at max_length={max_length}"
  new_tokens: ClassVar[tuple[str, ...]] = ()

  def __repr__(self) -> str:
    settings = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
    return f"{type(self).__name__}({settings})"

  # Settings.

  def configured(self, options) -> Kind:
    """This kind with the settings of `options` (`FinetuneOptions`) it reads: here itself (a
    kind with settings returns a configured copy, itself when they are its defaults)."""
    del options
    return self

  def settings(self) -> dict[str, Any]:
    """The settings (`configured`) that differ from the defaults, by `FinetuneOptions` name:
    JSON values recorded in a run's identity."""
    return {}

  # Records.

  def read_records(self, path: str, schema: Mapping[str, Any], *, optional: Mapping[str, Any],
                   unique: Sequence[str]) -> list[text.Record]:
    """The records of a file, checked against the layout: here JSONL (`text.read_jsonl`)."""
    return text.read_jsonl(path, schema, optional=optional, unique=unique)

  @abc.abstractmethod
  def featurise(self, reader: fd.Reader, record: text.Record, by_text: bool) -> fd.Example:
    """One record as an `Example` (errors through `reader.error`)."""

  def split_fields(self, records: Sequence[text.Record], examples: Sequence[fd.Example],
                   label_names: tuple[str, ...] | None) -> dict[str, Any]:
    """`FinetuneSplit` fields of the whole file beyond the common ones."""
    del records, examples, label_names
    return {}

  def label_names(self, paths: Sequence[str | os.PathLike], given: Sequence[str] | None
                  ) -> tuple[str, ...] | None:
    """The label names to read the files `paths` with: `given` (kinds without named labels
    ignore them)."""
    del paths
    return None if given is None else tuple(given)

  def resolve_global(self, mode: str) -> str:
    """`mode` ("default", "none", "first", "question") as the mode this kind uses."""
    if mode not in fd.GLOBAL_MODES:
      raise ValueError(f"global_attention must be one of {fd.GLOBAL_MODES}, got {mode!r}")
    mode = self.default_global if mode == "default" else mode
    if mode == "question" and not self.has_question:
      raise ValueError(f"global_attention='question' needs a question: task {self.name!r} has "
                       f"none (use 'first' or 'none')")
    return mode

  def trains_on(self, example: fd.Example) -> bool:
    """Whether the example is trained on (every example can be scored)."""
    del example
    return True

  # Arrays.

  def batch(self, split: fd.FinetuneSplit, rows: Sequence[int], *, global_attention: str,
            specials: SpecialIds) -> dict[str, np.ndarray]:
    """The padded int32 arrays of `split`'s examples `rows` (N = split.max_length): input_ids,
    attention_mask, global_attention_mask [B, N], then the kind's `targets`.

    global_attention: "none", "first" or "question" (`resolve_global`).
    specials: the model's special ids (`SpecialIds.of_config`).
    """
    examples = [split.examples[i] for i in rows]
    arrays = fd.encoder_arrays([e.input_ids for e in examples],
                               [e.global_lengths(global_attention)[0] for e in examples],
                               split.max_length, specials.pad)
    return {**arrays, **self.targets(split, examples)}

  def training_batches(self, split: fd.FinetuneSplit, rows: Sequence[int], *,
                       global_attention: str, specials: SpecialIds, **sampler_args):
    """The training `Batches` of `split`'s examples `rows` in `ExampleSampler` order
    (sampler_args: global_batch_size, seed, process_index, process_count): here `batch` of
    each batch's rows."""
    return example_batches.ExampleBatches(
        lambda batch_rows: self.batch(split, batch_rows, global_attention=global_attention,
                                      specials=specials), rows, **sampler_args)

  @abc.abstractmethod
  def targets(self, split: fd.FinetuneSplit, examples: Sequence[fd.Example]
              ) -> dict[str, np.ndarray]:
    """The arrays the loss reads besides the inputs (labels, masks of what may be chosen)."""

  # The model.

  def logits(self, model: nnx.Module, batch: Mapping[str, jax.Array], max_global: int
             ) -> dict[str, jax.Array]:
    """The head's float32 logits, positions that cannot be chosen pushed to -1e9: here
    "logits" [B, L] or [B, N, L] as the head gives them.

    max_global: the static bound on global tokens per row (0: the batch's all-zero
    global_attention_mask switches global attention off, also the heads' own defaults).
    """
    return {"logits": _float(_forward(model, batch, max_global).logits)}

  def loss(self, model: nnx.Module, batch: Mapping[str, jax.Array], max_global: int
           ) -> jax.Array:
    """The mean cross-entropy (nats) of the batch: here per example."""
    return jnp.mean(_ce(self.logits(model, batch, max_global)["logits"], batch["labels"]))

  def outputs(self, logits: Mapping[str, jax.Array], max_answer_length: int
              ) -> dict[str, jax.Array]:
    """What `predict` keeps of the logits, one row per example: here "logits"."""
    del max_answer_length
    return {"logits": logits["logits"]}

  @abc.abstractmethod
  def score(self, split: fd.FinetuneSplit, examples: Sequence[fd.Example], ids: Sequence[Any],
            outputs: Mapping[str, np.ndarray]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(metrics, prediction records) of `predict`'s outputs for `examples` (the first of
    `split`), named by `ids`; each record a JSON object, "id" first."""

  # The head.

  @abc.abstractmethod
  def num_labels(self, splits: Sequence[fd.FinetuneSplit], source: ModelSource) -> int:
    """The size of the head for these splits, starting from `source`."""

  def check_labels(self, split: fd.FinetuneSplit, config: LongformerConfig) -> None:
    """ValueError (a `text.JsonlError` naming the file and line) when a label of `split` does
    not fit the model's head."""
    del split, config

  # Hooks of kinds whose data, model or evaluation do not follow the JSONL records and the one
  # forward pass of the four kinds above (coreference, HotpotQA): each default is their way.

  # `FinetuneOptions` fields that fix the model or the data of a run: recorded in its identity
  # (a resume must keep them) and restored by --eval-only (`finetune.run_settings`).
  option_fields: ClassVar[tuple[str, ...]] = ()
  # The kind reads the segment baseline (`--baseline segments`) itself, from the settings its
  # splits carry, instead of through `finetune_segments.SegmentReading` (coreference).
  reads_segments: ClassVar[bool] = False

  def read_split(self, path: str | os.PathLike, tokenizer, *, max_length: int,
                 specials: SpecialIds, vocab_size: int, options: Any,
                 label_names: tuple[str, ...] | None = None) -> fd.FinetuneSplit:
    """The file `path` featurised (`options`: the run's `FinetuneOptions`): here its JSONL
    records, `fd.read_split`."""
    return fd.read_split(path, self, tokenizer, max_length=max_length, specials=specials,
                         vocab_size=vocab_size, max_question_length=options.max_question_length,
                         label_names=label_names)

  def build_model(self, config: LongformerConfig, options: Any, *, rngs: nnx.Rngs,
                  mesh=None, seq_axis: str | None = None) -> nnx.Module:
    """A fresh model of the kind (`options`: the run's `FinetuneOptions`): here
    `model_class(config)`."""
    del options
    return self.model_class(config, rngs=rngs, mesh=mesh, seq_axis=seq_axis)

  def predict(self, model: nnx.Module, split: fd.FinetuneSplit, **settings
              ) -> dict[str, np.ndarray] | None:
    """The outputs of a kind whose evaluation is more than one forward pass per batch
    (`settings`: `finetune.predict`'s keywords); None (here) runs `finetune.predict`'s batches
    through `logits` and `outputs`."""
    del model, split, settings
    return None

  def truncation_extras(self, examples: Sequence[Any]) -> dict[str, Any]:
    """Keys of a split's "truncation" block beyond the common ones (`tasks.truncation`), from
    the examples scored (coreference: its gold mentions and links within the limit): here
    none."""
    del examples
    return {}

  def files(self, name: str, split: fd.FinetuneSplit, records: Sequence[Mapping[str, Any]]
            ) -> dict[str, str]:
    """Files written beside predictions_<name>.jsonl for the split `name` ({file name: text}):
    here none."""
    del name, split, records
    return {}


class SettingsKind(Kind):
  """A kind whose splits carry their run's settings (`settings_class`, a frozen dataclass, made
  from the options by its `of`): kinds with equal settings are one kind, since the evaluation's
  compiled function is cached by kind (coreference, HotpotQA)."""

  settings_class: ClassVar[type]

  def __init__(self, settings: Any = None):
    self.run_settings = self.settings_class() if settings is None else settings

  def __eq__(self, other) -> bool:
    return type(other) is type(self) and other.run_settings == self.run_settings

  def __hash__(self) -> int:
    return hash((type(self), self.run_settings))

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.run_settings})"


def check_segment_settings(options, task: str, *, overlap: str | None, pool: str) -> None:
  """ValueError naming a segment setting that a kind reading its segments itself cannot honour:
  `segment_overlap` when `overlap` says why its segments share no token (None: it takes
  overlaps), and a `segment_pool` other than "first", `pool` saying what it reads instead."""
  if overlap is not None and options.segment_overlap:
    raise ValueError(f"segment_overlap={options.segment_overlap}: --task {task} reads "
                     f"{overlap}; use segment_overlap=0")
  if options.segment_pool != "first":
    raise ValueError(f"segment_pool={options.segment_pool!r} pools classification segments; "
                     f"--task {task} {pool} (leave segment_pool at 'first')")


KINDS: dict[str, Kind] = {}


def register(cls: type[Kind]) -> type[Kind]:
  """Class decorator: registers an instance of the `Kind` subclass under its name."""
  if cls.name in KINDS:
    raise ValueError(f"a kind named {cls.name!r} is registered already: {KINDS[cls.name]!r}")
  KINDS[cls.name] = cls()
  return cls


def get_kind(task: str) -> Kind:
  """The registered kind named `task`; ValueError naming the known ones."""
  if task not in KINDS:
    raise ValueError(f"task must be one of {tuple(KINDS)}, got {task!r}")
  return KINDS[task]


class _ModelClasses(Mapping):
  """The head of every registered kind, by name: a view of `KINDS`."""

  def __getitem__(self, name: str) -> type[nnx.Module]:
    return KINDS[name].model_class

  def __iter__(self):
    return iter(KINDS)

  def __len__(self) -> int:
    return len(KINDS)


MODEL_CLASSES: Mapping[str, type[nnx.Module]] = _ModelClasses()


def _float(x: jax.Array) -> jax.Array:
  # Softmax and span scores in float32 whatever the compute dtype.
  return x.astype(jnp.float32)


def _forward(model: nnx.Module, batch: Mapping[str, jax.Array], max_global: int):
  return model(batch["input_ids"], batch["attention_mask"], batch["global_attention_mask"],
               max_global=max_global)


_ce = optax.softmax_cross_entropy_with_integer_labels


def _choices(examples: Sequence[fd.Example], ids: Sequence[Any], logits: np.ndarray
             ) -> tuple[dict[str, float], list[int], list[int], list[dict[str, Any]]]:
  """({"accuracy"}, predicted, gold, records {"id", "prediction", "label"}) of a choice among
  logits (classes or candidates)."""
  predicted = [int(i) for i in np.argmax(logits, axis=-1)]
  gold = [e.label for e in examples]
  records = [{"id": i, "prediction": p, "label": g} for i, p, g in zip(ids, predicted, gold)]
  return {"accuracy": float(np.mean(np.equal(predicted, gold)))}, predicted, gold, records


@register
class Classification(Kind):
  """classification: {"text": str | "input_ids": [int], "label": int} as `<s> text </s>`;
  LongformerForSequenceClassification on `<s>` (global by default, the paper's "[CLS] for
  classification", §3.1). Metrics: accuracy, macro F1 (`macro_f1`). Records {"id",
  "prediction", "label"}."""
  name = "classification"
  model_class = modeling.LongformerForSequenceClassification
  default_global = "first"
  required = {"label": int}
  metrics = ("accuracy", "f1")

  def featurise(self, reader, record, by_text):
    s = reader.specials
    ids, _ = reader.content(record, by_text)
    kept = ids[:reader.max_length - 2]
    row = np.concatenate([[s.bos], kept, [s.eos]]).astype(np.int32)
    return fd.Example(record.line, row, label=reader.label(record, "label"),
                      truncation=fd.Truncation(len(ids) + 2, len(ids), len(kept)))

  def targets(self, split, examples):
    """labels [B]."""
    return {"labels": np.asarray([e.label for e in examples], np.int32)}

  def score(self, split, examples, ids, outputs):
    metrics, predicted, gold, records = _choices(examples, ids, outputs["logits"])
    return {**metrics, "f1": macro_f1(gold, predicted)}, records

  def num_labels(self, splits, source):
    """The source's own head size when it is a classifier whose classes cover the labels (the
    classes it declares), else the largest label + 1 (at least 2), the labels being the dense
    range 0..K-1 (`fd.check_dense_labels`; each below `fd.MAX_LABELS`, checked when read)."""
    largest = max(e.label for split in splits for e in split.examples)
    if source.model_class == self.model_class.__name__ and largest < source.config.num_labels:
      return source.config.num_labels
    split = max(splits, key=lambda split: max(e.label for e in split.examples))
    line = next(e.line for e in split.examples if e.label == largest)
    fd.check_dense_labels(split.path, line, "label", largest,
                          {e.label for split in splits for e in split.examples})
    return max(2, largest + 1)

  def check_labels(self, split, config):
    """A label beyond the head's classes (a class the training records never name) is an
    error: it would be scored against a logit no record trained."""
    for e in split.examples:
      if e.label >= config.num_labels:
        raise text.JsonlError(split.path, e.line, "label", f"is {e.label}, not one of the "
                              f"model's num_labels={config.num_labels} classes 0.."
                              f"{config.num_labels - 1} (a new run's are its training "
                              f"labels; --set model.num_labels=N for more)")


@register
class QuestionAnswering(Kind):
  """qa: {"question": str, "context": str, "answers": [{"text": str, "answer_start": int}]}
  (character offsets into the context), or {"question": [int], "input_ids": [int], "answers":
  [{"start": int, "end": int}]} (token offsets into input_ids, end inclusive), as
  `<s> question </s></s> context </s>`; global attention on `<s>` and the question by default
  (the paper's "all question tokens for QA", §3.1). LongformerForQuestionAnswering: the best span
  start <= end < start + max_answer_length over every pair of context positions (`best_spans`).
  Metrics: exact match and F1 against the best-matching gold answer, after SQuAD's normalisation
  (`squad_scores`; `normalizer="triviaqa"` takes TriviaQA's). Records {"id", "prediction",
  "answers", "start", "end", "score"}: the answer text (id records: its token ids) and its
  context token offsets (end inclusive).

  TriviaQA's form (optional fields): "aliases", gold answers given without offsets (strings; id
  records: lists of ids), each of whose occurrences in the context (case-insensitive, at word
  boundaries; id records: the same ids in a row) is an answer span, so a record may hold aliases
  instead of "answers"; "question_id", the question a record is one evidence document of: the
  records of one question are scored as one, answered by the best-scoring span over all of them
  (metrics per question, and "questions", their count; each record gets its question's
  "question_prediction").

  Training: `loss="first"` (default, HF's) takes the first answer whose tokens all survived
  truncation (given answers before alias occurrences); `loss="all_occurrences"` the
  all-occurrence "or" loss over every occurrence of every answer and alias inside the kept
  context (`qa_metrics.all_occurrence_span_loss`, at most `MAX_OCCURRENCES` per record, the first
  in row order). A record none of whose answers survives truncation is scored but not trained
  on.
  """
  name = "qa"
  model_class = modeling.LongformerForQuestionAnswering
  default_global = "question"
  has_question = True
  required = {"question": (str, list)}
  optional = {"answers": list, "aliases": list, "question_id": (str, int)}
  documents = {"context": str, "input_ids": list}
  metrics = ("exact_match", "f1")
  untrained = "no answer of any record lies inside max_length={max_length}"
  MAX_OCCURRENCES = 64  # answer occurrences per record the all-occurrence loss reads
  normalizer: str = "squad"
  loss_mode: str = "first"

  def configured(self, options):
    normalizer, loss = options.qa_normalizer, options.qa_loss
    if (normalizer, loss) == (self.normalizer, self.loss_mode):
      return self
    kind = type(self)()
    kind.normalizer, kind.loss_mode = normalizer, loss
    return kind

  def settings(self):
    return {k: v for k, v, default in (("qa_normalizer", self.normalizer, "squad"),
                                       ("qa_loss", self.loss_mode, "first")) if v != default}

  def featurise(self, reader, record, by_text):
    s = reader.specials
    question, question_tokens = reader.question_tokens(record, by_text)
    ids, offsets = reader.content(record, by_text, "context")
    answers, aliases = record.fields.get("answers"), record.fields.get("aliases")
    if answers is None and aliases is None:
      raise reader.error(record, "answers", "is missing (a record needs \"answers\" or "
                         "\"aliases\")")
    if not answers and not aliases:
      raise reader.error(record, "answers" if answers is not None else "aliases",
                         "is empty (a record needs at least one answer)")
    spans, gold = [], []
    for i, answer in enumerate(answers or ()):
      span, answer_gold = self._answer(reader, record, i, answer, by_text, ids, offsets)
      spans.append(span)
      gold.append(answer_gold)
    alias_spans = []
    for i, alias in enumerate(aliases or ()):
      occurrences, alias_gold = self._alias(reader, record, i, alias, by_text, ids, offsets)
      alias_spans.extend(occurrences)
      gold.append(alias_gold)
    spans.extend(sorted(alias_spans))
    head = 1 + len(question) + 2  # <s> question </s></s>
    keep = min(len(ids), reader.room(record, head + 1, "question"))
    row = np.concatenate([[s.bos], question, [s.sep, s.sep], ids[:keep], [s.eos]])
    kept = [(head + a, head + b) for a, b in spans if b < keep]
    # The first answer whose tokens all survived truncation is the "first" loss's target; the
    # all-occurrence loss reads every kept one (`answer_spans`).
    return fd.Example(record.line, row.astype(np.int32), question_end=1 + len(question),
                      gold=tuple(dict.fromkeys(gold)), context=(head, head + keep),
                      offsets=None if offsets is None else offsets[:keep],
                      context_text=record.fields["context"] if by_text else None,
                      target=kept[0] if kept else None,
                      answer_spans=tuple(sorted(set(kept))),
                      question_id=record.fields.get("question_id"),
                      truncation=fd.Truncation(
                          1 + question_tokens + 2 + len(ids) + 1, len(ids), keep,
                          prefix_cut=question_tokens > len(question), evidence=bool(kept)))

  @staticmethod
  def _alias(reader, record, i: int, alias, by_text: bool, ids: np.ndarray,
             offsets: np.ndarray | None) -> tuple[list[tuple[int, int]], Any]:
    """([(first, last) context token of each occurrence], its gold value) of an alias."""
    if not by_text:
      alias_ids = reader.ids(record, "aliases", alias, what=f"element {i}")
      n = len(alias_ids)
      if n > len(ids):
        return [], tuple(int(x) for x in alias_ids)
      windows = np.lib.stride_tricks.sliding_window_view(ids, n)
      starts = np.flatnonzero(np.all(windows == alias_ids[None, :], axis=1))
      return [(int(a), int(a) + n - 1) for a in starts], tuple(int(x) for x in alias_ids)
    if not isinstance(alias, str) or not alias.strip():
      raise reader.error(record, "aliases", f"element {i} must be a non-empty string, got "
                         f"{alias!r}"[:300])
    pattern = re.compile(r"(?<!\w)" + re.escape(alias.strip()) + r"(?!\w)", re.IGNORECASE)
    occurrences = []
    for match in pattern.finditer(record.fields["context"]):
      start, end = match.span()
      inside = np.flatnonzero((offsets[:, 0] < end) & (offsets[:, 1] > start))
      if len(inside):
        occurrences.append((int(inside[0]), int(inside[-1])))
    return occurrences, alias

  @staticmethod
  def _answer(reader, record, i: int, answer, by_text: bool, ids: np.ndarray,
              offsets: np.ndarray | None) -> tuple[tuple[int, int], Any]:
    """((first, last) context token of an answer, its gold value)."""
    keys = ("text", "answer_start") if by_text else ("start", "end")
    types = (str, int) if by_text else (int, int)
    if not isinstance(answer, dict) or any(
        not isinstance(answer.get(k), t) or isinstance(answer.get(k), bool)
        for k, t in zip(keys, types)):
      raise reader.error(record, "answers", f"element {i} must be an object with "
                         f"{' and '.join(repr(k) for k in keys)} "
                         f"({', '.join(t.__name__ for t in types)}), got {answer!r}"[:300])
    if not by_text:
      a, b = answer["start"], answer["end"]
      if not 0 <= a <= b < len(ids):
        raise reader.error(record, "answers", f"element {i}: start={a}, end={b} must satisfy "
                           f"0 <= start <= end < {len(ids)} (token offsets into input_ids, end "
                           f"inclusive)")
      return (a, b), tuple(int(x) for x in ids[a:b + 1])
    context, answer_text, start = record.fields["context"], answer["text"], answer["answer_start"]
    if not answer_text.strip() or context[start:start + len(answer_text)] != answer_text:
      raise reader.error(record, "answers", f"element {i}: the context at answer_start={start} "
                         f"reads {context[start:start + len(answer_text)]!r}, not the answer "
                         f"{answer_text!r}")
    end = start + len(answer_text)
    inside = np.flatnonzero((offsets[:, 0] < end) & (offsets[:, 1] > start))
    if not len(inside):
      raise reader.error(record, "answers", f"element {i}: no token of the context covers "
                         f"characters [{start}, {end})")
    return (int(inside[0]), int(inside[-1])), answer_text

  def trains_on(self, example):
    return example.target is not None

  def targets(self, split, examples):
    """context_mask [B, N] (where an answer may start and end); start_positions,
    end_positions [B] (-1: no answer survived truncation); under the all-occurrence loss also
    answer_starts, answer_ends [B, MAX_OCCURRENCES] (-1 padded)."""
    context_BxN = np.zeros((len(examples), split.max_length), np.int32)
    for row, e in enumerate(examples):
      context_BxN[row, e.context[0]:e.context[1]] = 1
    targets = [e.target or (-1, -1) for e in examples]
    out = {"context_mask": context_BxN,
           "start_positions": np.asarray([t[0] for t in targets], np.int32),
           "end_positions": np.asarray([t[1] for t in targets], np.int32)}
    if self.loss_mode == "all_occurrences":
      spans_BxAx2 = np.full((len(examples), self.MAX_OCCURRENCES, 2), -1, np.int32)
      for row, e in enumerate(examples):
        kept = e.answer_spans[:self.MAX_OCCURRENCES]
        spans_BxAx2[row, :len(kept)] = np.asarray(kept, np.int32).reshape(-1, 2)
      out.update(answer_starts=spans_BxAx2[..., 0], answer_ends=spans_BxAx2[..., 1])
    return out

  def logits(self, model, batch, max_global):
    """start_logits, end_logits [B, N] (outside the context: -1e9)."""
    out = _forward(model, batch, max_global)
    context_BxN = batch["context_mask"] != 0
    return {"start_logits": jnp.where(context_BxN, _float(out.start_logits), _NEG),
            "end_logits": jnp.where(context_BxN, _float(out.end_logits), _NEG)}

  def loss(self, model, batch, max_global):
    """(start + end) / 2 per example: of the first surviving answer (HF's), or the
    all-occurrence loss (`loss_mode`) averaged over the rows with an answer."""
    logits = self.logits(model, batch, max_global)
    if self.loss_mode == "all_occurrences":
      nll_B = all_occurrence_span_loss(logits["start_logits"], logits["end_logits"],
                                       batch["answer_starts"], batch["answer_ends"])
      has_B = jnp.any(batch["answer_starts"] >= 0, axis=-1)
      return jnp.sum(nll_B) / jnp.maximum(jnp.sum(has_B), 1)
    return 0.5 * jnp.mean(_ce(logits["start_logits"], batch["start_positions"])
                          + _ce(logits["end_logits"], batch["end_positions"]))

  def outputs(self, logits, max_answer_length):
    """start, end (row positions) and score [B] of the best span."""
    start_B, end_B, score_B = best_spans(logits["start_logits"], logits["end_logits"],
                                         max_answer_length)
    return {"start": start_B, "end": end_B, "score": score_B}

  def score(self, split, examples, ids, outputs):
    records, answers = [], []
    for i, e, start, end, s in zip(ids, examples, outputs["start"], outputs["end"],
                                   outputs["score"]):
      answer = span_answer(e, int(start), int(end))
      answers.append(answer)
      first = e.context[0]
      records.append({"id": i, "prediction": answer, "answers": list(e.gold),
                      "start": int(start) - first, "end": int(end) - first, "score": float(s)})
    # One answer per question: the best-scoring span over its records (evidence documents).
    groups: dict[Any, list[int]] = {}
    for k, e in enumerate(examples):
      groups.setdefault(("record", k) if e.question_id is None else ("question", e.question_id),
                        []).append(k)
    predictions, golds = [], []
    for members in groups.values():
      best = max(members, key=lambda k: records[k]["score"])  # the first on ties
      predictions.append(answers[best])
      golds.append(tuple(dict.fromkeys(g for k in members for g in examples[k].gold)))
      if examples[best].question_id is not None:
        for k in members:
          records[k]["question_id"] = examples[k].question_id
          records[k]["question_prediction"] = answers[best]
    metrics = squad_scores(predictions, golds, normalize=split.by_text,
                           normalizer=get_normalizer(self.normalizer))
    if any(e.question_id is not None for e in examples):
      metrics["questions"] = len(groups)
    return metrics, records

  def num_labels(self, splits, source):
    """2: start and end."""
    return 2

  def check_labels(self, split, config):
    if config.num_labels != 2:
      raise ValueError(f"question answering predicts start and end: model.num_labels must be "
                       f"2, got {config.num_labels}")


@register
class Tagging(Kind):
  """token: {"text": str | "input_ids": [int], "labels": [str] or [int]}: one label per
  whitespace-separated word of "text", or per id of "input_ids", as `<s> text </s>`; no global
  attention by default (HF's LongformerForTokenClassification sets none).
  LongformerForTokenClassification on each word's first token (the other tokens are not
  scored). Metrics: accuracy over words; with an "O" tag, also micro precision/recall/F1 over
  the words whose gold or predicted tag is not "O" (`tagging_scores`). Records {"id",
  "prediction", "labels"}: a tag per word (or id), as the file spells tags; null for words cut
  off by max_length (scored as wrong).
  """
  name = "token"
  model_class = modeling.LongformerForTokenClassification
  default_global = "none"
  required = {"labels": list}
  metrics = ("accuracy", "precision", "recall", "f1")  # the last three with an "O" tag

  def featurise(self, reader, record, by_text):
    s, names = reader.specials, reader.label_names
    if names is None:
      raise ValueError("the token task needs label_names (Tagging.label_names of the files)")
    labels = record.fields["labels"]
    if by_text:
      content = record.fields["text"]
      # Words are the whitespace-separated pieces; each one's first token carries its label.
      spans = [m.span() for m in re.finditer(r"\S+", content)]
      ids, offsets = reader.encode(record, "text", content)
      first = fd.first_tokens(spans, offsets)
      unit = "words (the text split on whitespace)"
    else:
      ids = reader.ids(record, "input_ids", record.fields["input_ids"])
      first = np.arange(len(ids))
      unit = "input_ids"
    if len(labels) != len(first):
      raise reader.error(record, "labels", f"has {len(labels)} labels for {len(first)} {unit}")
    label_ids = []
    for i, label in enumerate(labels):
      index = names.index(label) if isinstance(label, str) and label in names else (
          label if isinstance(label, int) and not isinstance(label, bool)
          and 0 <= label < len(names) else None)
      if index is None:
        raise reader.error(record, "labels", f"element {i} is {label!r}, not one of the "
                           f"{len(names)} labels {list(names)[:20]} (a new run's are the tags of "
                           f"its training file; --set label_names=... names them all)")
      label_ids.append(index)
    keep = reader.max_length - 2
    row = np.concatenate([[s.bos], ids[:keep], [s.eos]]).astype(np.int32)
    # Positions in the row: +1 for <s>; words whose first token was cut away are -1.
    words = np.where((first >= 0) & (first < keep), first + 1, -1).astype(np.int32)
    token_labels = np.full(len(row), fd.IGNORE_INDEX, np.int32)
    token_labels[words[words >= 0]] = np.asarray(label_ids, np.int32)[words >= 0]
    return fd.Example(record.line, row, token_labels=token_labels, words=words,
                      gold=tuple(names[i] for i in label_ids), truncation=fd.Truncation(
                          len(ids) + 2, len(ids), min(len(ids), keep),
                          evidence=not bool(np.any(first >= keep))))

  def split_fields(self, records, examples, label_names):
    return {"label_names": label_names,
            "int_labels": any(isinstance(t, int) for r in records for t in r.fields["labels"])}

  def label_names(self, paths, given):
    """`given`, else the tags of the files (`tag_names`)."""
    return tuple(given) if given is not None else self.tag_names(paths)[0]

  @staticmethod
  def tag_names(paths: Sequence[str | os.PathLike]) -> tuple[tuple[str, ...], bool]:
    """(names, from_ints): the tags of the files, in id order: their string labels sorted (with
    "O" first when present), or "0".."K" for integer labels (then from_ints)."""
    strings, largest, ints, where = set(), -1, set(), None
    for path in paths:
      for record in text.read_jsonl(path, {"labels": list}):
        for i, label in enumerate(record.fields["labels"]):
          if isinstance(label, str) and label.strip():
            strings.add(label)
          elif isinstance(label, int) and not isinstance(label, bool) and label >= 0:
            fd.check_label_bound(os.fspath(path), record.line, "labels", label)
            ints.add(label)
            if label > largest:
              largest, where = label, (os.fspath(path), record.line)
          else:
            raise text.JsonlError(os.fspath(path), record.line, "labels",
                                  f"element {i} must be a non-empty string or an integer >= 0, "
                                  f"got {label!r}")
        if strings and largest >= 0:
          raise text.JsonlError(os.fspath(path), record.line, "labels",
                                "mixes string and integer labels (the files must use one kind)")
    if strings:
      return tuple(sorted(strings, key=lambda s: (s != "O", s))), False
    if where is not None:
      fd.check_dense_labels(*where, "labels", largest, ints)
    return tuple(str(i) for i in range(largest + 1)), True

  def targets(self, split, examples):
    """labels [B, N] (IGNORE_INDEX where not scored)."""
    return {"labels": text.pad([e.token_labels for e in examples], length=split.max_length,
                               pad_id=fd.IGNORE_INDEX)[0]}

  def loss(self, model, batch, max_global):
    """Per scored token."""
    labels = batch["labels"]
    real_BxN = labels != fd.IGNORE_INDEX
    nll_BxN = _ce(self.logits(model, batch, max_global)["logits"],
                  jnp.where(real_BxN, labels, 0))
    return jnp.sum(jnp.where(real_BxN, nll_BxN, 0.0)) / jnp.maximum(jnp.sum(real_BxN), 1)

  def outputs(self, logits, max_answer_length):
    """tags [B, N]: the best label of every position."""
    del max_answer_length
    return {"tags": jnp.argmax(logits["logits"], axis=-1).astype(jnp.int32)}

  def score(self, split, examples, ids, outputs):
    names = split.label_names
    predicted = [[int(tags[w]) if w >= 0 else None for w in e.words]
                 for e, tags in zip(examples, outputs["tags"])]
    gold = [[names.index(g) for g in e.gold] for e in examples]
    metrics = tagging_scores(gold, predicted, names.index("O") if "O" in names else None)
    spell = (lambda t: t) if split.int_labels else (lambda t: None if t is None else names[t])
    records = [{"id": i, "prediction": [spell(t) for t in p], "labels": [spell(t) for t in g]}
               for i, p, g in zip(ids, predicted, gold)]
    return metrics, records

  def num_labels(self, splits, source):
    """The tag count."""
    return len(splits[0].label_names)

  def check_labels(self, split, config):
    if len(split.label_names) != config.num_labels:
      raise ValueError(f"{split.path}: {len(split.label_names)} tags {list(split.label_names)} "
                       f"but the model has num_labels={config.num_labels}")


@register
class MultipleChoice(Kind):
  """multiple_choice: {"question": str, "candidates": [str], "text": str, "label": int}, or
  {"question": [int], "candidates": [[int]], "input_ids": [int], "label": int} (the label is the
  index of the right candidate), one row per candidate:
  `<s> question </s></s> candidate </s></s> document </s>`; global attention on `<s>`, the
  question and the candidate by default (the paper's WikiHop choice, §6).
  LongformerForMultipleChoice (each row's `<s>` pooled and scored). Metric: accuracy. Records
  {"id", "prediction", "label", "scores"} (one score per candidate).
  """
  name = "multiple_choice"
  model_class = modeling.LongformerForMultipleChoice
  default_global = "question"
  has_question = True
  required = {"question": (str, list), "candidates": list, "label": int}
  metrics = ("accuracy",)

  def featurise(self, reader, record, by_text):
    s = reader.specials
    question, question_tokens = reader.question_tokens(record, by_text)
    document, offsets = reader.content(record, by_text)
    candidates = record.fields["candidates"]
    if len(candidates) < 2:
      raise reader.error(record, "candidates", f"needs at least 2 candidates, got "
                         f"{len(candidates)}")
    rows, ends, keeps, needs = [], [], [], []
    for i, candidate in enumerate(candidates):
      if by_text:
        if not isinstance(candidate, str) or not candidate.strip():
          raise reader.error(record, "candidates", f"element {i} must be a non-empty string, "
                             f"got {candidate!r}")
        cand = reader.encode(record, "candidates", candidate)[0]
      else:
        cand = reader.ids(record, "candidates", candidate, what=f"element {i}")
      # <s> question </s></s> candidate </s></s> document </s>
      head = np.concatenate([[s.bos], question, [s.sep, s.sep], cand]).astype(np.int32)
      keep = reader.room(record, len(head) + 3, "candidates")
      rows.append(np.concatenate([head, [s.sep, s.sep], document[:keep], [s.eos]])
                  .astype(np.int32))
      ends.append(len(head))
      keeps.append(min(keep, len(document)))
      needs.append(len(head) - len(question) + question_tokens + 3 + len(document))
    label = reader.label(record, "label", below=len(candidates))
    evidence = _named_in(candidates[label], document, offsets,
                         record.fields["text"] if by_text else None, keeps[label])
    return fd.Example(record.line, tuple(rows), question_end=1 + len(question), label=label,
                      candidate_ends=tuple(ends), truncation=fd.Truncation(
                          max(needs), len(document), min(keeps),
                          prefix_cut=question_tokens > len(question), evidence=evidence))

  def split_fields(self, records, examples, label_names):
    return {"num_choices": max(len(e.input_ids) for e in examples)}

  def batch(self, split, rows, *, global_attention, specials):
    """input_ids, attention_mask, global_attention_mask [B, C, N] (C = split.num_choices), then
    `targets`. Missing candidates are `<s></s>` rows, masked out by choice_mask."""
    examples = [split.examples[i] for i in rows]
    c, n = split.num_choices, split.max_length
    filler = np.asarray([specials.bos, specials.eos], np.int32)
    seqs = [list(e.input_ids) + [filler] * (c - len(e.input_ids)) for e in examples]
    globals_BC = [g for e in examples for g in e.global_lengths(global_attention)
                  + (0,) * (c - len(e.input_ids))]
    arrays = fd.encoder_arrays([s for row in seqs for s in row], globals_BC, n, specials.pad)
    shape = (len(examples), c, n)
    return {**{name: x_BCxN.reshape(shape) for name, x_BCxN in arrays.items()},
            **self.targets(split, examples)}

  def targets(self, split, examples):
    """choice_mask [B, C] (1 for real candidates), labels [B]."""
    c = split.num_choices
    choice_BxC = np.asarray([[1] * len(e.input_ids) + [0] * (c - len(e.input_ids))
                             for e in examples], np.int32)
    return {"choice_mask": choice_BxC,
            "labels": np.asarray([e.label for e in examples], np.int32)}

  def logits(self, model, batch, max_global):
    """logits [B, C] (filler candidates: -1e9)."""
    out = _forward(model, batch, max_global)
    return {"logits": jnp.where(batch["choice_mask"] != 0, _float(out.logits), _NEG)}

  def score(self, split, examples, ids, outputs):
    logits = outputs["logits"]
    metrics, _, _, records = _choices(examples, ids, logits)
    for record, e, row in zip(records, examples, logits):
      record["scores"] = [float(x) for x in row[:len(e.input_ids)]]
    return metrics, records

  def num_labels(self, splits, source):
    """One logit per candidate: the config's value is kept (unused)."""
    return source.config.num_labels


def _named_in(candidate, document: np.ndarray, offsets: np.ndarray | None,
              content: str | None, keep: int) -> bool | None:
  """Whether the document's first `keep` tokens name the candidate (multiple choice's evidence):
  a text record's candidate is looked for in the text those tokens cover (case folded: a
  candidate tokenized alone need not match its tokens inside the text), an id record's as a run
  of its ids. None when the whole document never names it (no evidence to keep)."""
  if content is not None:
    where = content.casefold().find(candidate.strip().casefold())
    if where < 0:
      return None
    return keep > 0 and where + len(candidate.strip()) <= int(offsets[keep - 1, 1])
  run = np.asarray(candidate)
  windows = np.lib.stride_tricks.sliding_window_view(document, len(run)) if len(
      document) >= len(run) else np.zeros((0, len(run)), document.dtype)
  found = np.flatnonzero((windows == run[None, :]).all(axis=1))
  if not len(found):
    return None
  return bool(found[0] + len(run) <= keep)


def best_spans(start_BxN: jax.Array, end_BxN: jax.Array, max_answer_length: int
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(start [B], end [B], score [B]): the span start <= end < start + max_answer_length with the
  highest start_logit[start] + end_logit[end], over every pair of positions of the row.

  The sum is the log of the span's probability under independent start and end softmaxes, up to
  the row's two normalisers, which do not change the argmax. Every pair is scored (not the top-k
  starts and ends of HF's post-processing), so the answer is exact over the whole document;
  positions that cannot be chosen must hold -1e9 (`Kind.logits`). Cost B x N x A scores.
  """
  b, n = start_BxN.shape
  span = min(max_answer_length, n)
  # end_BxNxA[b, i, l] = end_logit[b, i + l] (-1e9 past the row's end): every span from i.
  end_padded = jnp.pad(end_BxN, ((0, 0), (0, span - 1)), constant_values=_NEG)
  index_NxA = jnp.arange(n)[:, None] + jnp.arange(span)[None, :]
  score_BxNxA = start_BxN[:, :, None] + end_padded[:, index_NxA]
  flat_BxNA = score_BxNxA.reshape(b, n * span)
  best_B = jnp.argmax(flat_BxNA, axis=-1)
  start_B, length_B = best_B // span, best_B % span
  return start_B, start_B + length_B, jnp.take_along_axis(flat_BxNA, best_B[:, None], 1)[:, 0]


def span_answer(example: fd.Example, start: int, end: int) -> str | tuple[int, ...]:
  """The answer of row positions start..end (inclusive): the context text they cover (text
  records, by the tokenizer's character offsets) or their token ids."""
  if example.offsets is None:
    return tuple(int(x) for x in example.input_ids[start:end + 1])
  first = example.context[0]
  chars = example.offsets[start - first:end - first + 1]
  return example.context_text[int(chars[0, 0]):int(chars[-1, 1])].strip()


# ----------------------------------------------------------------------------------------------
# Metrics


def macro_f1(gold: Sequence[int], predicted: Sequence[int]) -> float:
  """The mean over classes of 2 TP / (2 TP + FP + FN), over the classes that occur in the gold
  labels or the predictions (scikit-learn's average="macro")."""
  gold, predicted = np.asarray(gold), np.asarray(predicted)
  scores = []
  for c in np.union1d(gold, predicted):
    tp = np.sum((gold == c) & (predicted == c))
    wrong = np.sum((gold == c) != (predicted == c))  # FP + FN
    scores.append(2 * tp / (2 * tp + wrong))
  return float(np.mean(scores))


def tagging_scores(gold: Sequence[Sequence[int]], predicted: Sequence[Sequence[int | None]],
                   outside: int | None) -> dict[str, float]:
  """Tag accuracy over all words (a None prediction, a word cut off, counts as wrong); with an
  outside tag (`outside`, "O"), also entity-free micro precision, recall and F1 over words:
  a word's prediction is a positive when it is not O, a gold positive when its tag is not O,
  and a true positive when it is both and equals the gold tag (no spans are assembled, so a
  B-/I- scheme is scored per word, not per entity as seqeval does)."""
  g = np.asarray([t for row in gold for t in row], np.int64)
  p = np.asarray([-1 if t is None else t for row in predicted for t in row], np.int64)
  metrics = {"accuracy": float(np.mean(g == p)) if len(g) else 0.0}
  if outside is not None:
    predicted_pos = (p != outside) & (p >= 0)
    gold_pos = g != outside
    tp = int(np.sum(predicted_pos & gold_pos & (p == g)))
    precision = tp / max(int(np.sum(predicted_pos)), 1)
    recall = tp / max(int(np.sum(gold_pos)), 1)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    metrics.update(precision=precision, recall=recall, f1=f1)
  return metrics


def _f1(predicted: Sequence, gold: Sequence) -> float:
  common = collections.Counter(predicted) & collections.Counter(gold)
  same = sum(common.values())
  if same == 0:
    return 0.0
  precision, recall = same / len(predicted), same / len(gold)
  return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: Sequence, golds: Sequence[Sequence], *, normalize: bool = True,
                 normalizer: Callable[[str], str] = normalize_answer) -> dict[str, float]:
  """SQuAD's exact match and F1 (as TriviaQA's evaluation also takes them): per question, the
  best over its gold answers of EM (normalised strings equal) and of F1 (over the normalised
  strings' word multisets); then the mean over questions. `normalizer`: SQuAD's
  (`normalize_answer`) or TriviaQA's (`qa_metrics.normalize_triviaqa`). normalize=False compares
  token-id tuples as they are (id records)."""
  if len(predictions) != len(golds) or not predictions:
    raise ValueError(f"need as many predictions as gold answer lists, at least one: got "
                     f"{len(predictions)} and {len(golds)}")
  tokens = (lambda a: normalizer(a).split()) if normalize else tuple
  em = f1 = 0.0
  for prediction, gold in zip(predictions, golds):
    em += max(float(tokens(prediction) == tokens(g)) for g in gold)
    f1 += max(_f1(tokens(prediction), tokens(g)) for g in gold)
  return {"exact_match": em / len(predictions), "f1": f1 / len(predictions)}



__all__ = [
    "Classification", "KINDS", "Kind", "MODEL_CLASSES", "MultipleChoice", "QuestionAnswering",
    "SettingsKind", "Tagging", "best_spans", "get_kind", "macro_f1", "normalize_answer", "register",
    "span_answer", "squad_scores", "tagging_scores",
]
