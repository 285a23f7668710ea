"""Fine-tuning a Longformer encoder on four kinds of task (paper §6): the `Task` the shared loop
runs, where the weights come from, and the evaluation with each task's metrics.
`python -m train.finetune` is the command line; docs/finetune.md the guide.

  FinetuneOptions   the settings outside `TrainConfig` (global attention, answer length, tags)
  FinetuneTask      the `Task`: cross-entropy of the task's head, batches in `ExampleSampler`
                    order, validation metrics every `eval_every` steps
  load_source       the encoder to start from (HF Longformer or RoBERTa directory, project
                    checkpoint or workdir, or a preset) and `initial_params`, which puts its
                    weights into the task's model (a new head is initialised from the seed)
  predict, score    the model's outputs for a split, then its metrics and prediction records

Tasks, heads (`longformer_jax.modeling`) and metrics:

  classification   LongformerForSequenceClassification on <s>: accuracy, macro F1
  qa               LongformerForQuestionAnswering: the best span start <= end < start + L over
                   every pair of context positions (`best_spans`); exact match and F1 against
                   the best-matching gold answer, after SQuAD's normalisation (`squad_scores`)
  token            LongformerForTokenClassification on each word's first token: accuracy over
                   words; with an "O" tag, also micro precision/recall/F1 over the words whose
                   gold or predicted tag is not "O" (`tagging_scores`)
  multiple_choice  LongformerForMultipleChoice, one row per candidate: accuracy

Every metric is a fraction in [0, 1] (the SQuAD script prints 100x). Shape letters: the
alphabet of `longformer_jax.ops`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import re
import string
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax import traverse_util
from jax.sharding import Mesh

from longformer_jax import modeling
from longformer_jax.config import LongformerConfig
from longformer_jax.data import finetune_data as fd
from longformer_jax.data import text
from longformer_jax.training.config import Stage, TrainConfig
from longformer_jax.training.sharding import LOGICAL_RULES
from longformer_jax.training.task import Batches, Task
from longformer_jax.training import examples
from longformer_jax.training.sources import host_params, open_model_dir, params_fingerprint

MODEL_CLASSES: dict[str, type[nnx.Module]] = {
    "classification": modeling.LongformerForSequenceClassification,
    "qa": modeling.LongformerForQuestionAnswering,
    "token": modeling.LongformerForTokenClassification,
    "multiple_choice": modeling.LongformerForMultipleChoice,
}
PRESETS = ("tiny", "base", "large")
# Logits of positions and candidates that cannot be chosen (float32: exp underflows to 0).
_NEG = -1e9


@dataclasses.dataclass(frozen=True)
class FinetuneOptions:
  """The settings of a fine-tuning run outside `TrainConfig` (`--set name=value`).

  global_attention: "default" (the task's: `<s>` for classification, the question for QA, the
    question and the candidate for multiple choice, none for tagging), "none", "first" (`<s>`)
    or "question" (QA and multiple choice).
  max_question_length: question tokens kept (QA, multiple choice).
  max_answer_length: the longest answer span decoded, in tokens (QA; evaluation only).
  label_names: token task: the tags in id order (default: the tags of the files, sorted with
    "O" first; "0".."K" for integer tags). An "O" among them turns on the F1 metrics.
  roberta_positions, roberta_window: the position table and one-sided window of a Longformer
    made from a RoBERTa directory (`convert.roberta_to_longformer`).
  """
  global_attention: str = "default"
  max_question_length: int = 128
  max_answer_length: int = 30
  label_names: tuple[str, ...] | None = None
  roberta_positions: int = 4096
  roberta_window: int = 256

  def __post_init__(self):
    if self.global_attention not in fd.GLOBAL_MODES:
      raise ValueError(f"global_attention must be one of {fd.GLOBAL_MODES}, got "
                       f"{self.global_attention!r}")
    for name in ("max_question_length", "max_answer_length", "roberta_positions",
                 "roberta_window"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if self.label_names is not None and (
        not self.label_names or len(set(self.label_names)) != len(self.label_names)):
      raise ValueError(f"label_names must be distinct names, got {self.label_names!r}")


def tiny_config(**changes) -> LongformerConfig:
  """The `tiny` preset, for tests and demos: 2 layers, hidden 64, 4 heads, intermediate 128,
  one-sided window 32, vocabulary 512, positions for 4,096 tokens, no dropout."""
  shape = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=128, attention_window=32, max_position_embeddings=4098,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
  return LongformerConfig(**{**shape, **changes})


# ----------------------------------------------------------------------------------------------
# Forward passes and losses


def _float(x: jax.Array) -> jax.Array:
  # Softmax and span scores in float32 whatever the compute dtype.
  return x.astype(jnp.float32)


def task_logits(model: nnx.Module, task: str, batch: Mapping[str, jax.Array],
                max_global: int) -> dict[str, jax.Array]:
  """The head's float32 logits, positions that cannot be chosen pushed to -1e9:

    classification  logits [B, L];  token  logits [B, N, L]
    qa              start_logits, end_logits [B, N] (outside the context: -1e9)
    multiple_choice logits [B, C] (filler candidates: -1e9)

  max_global: the static bound on global tokens per row (0: the batch's all-zero
  global_attention_mask switches global attention off, also the heads' own defaults).
  """
  out = model(batch["input_ids"], batch["attention_mask"], batch["global_attention_mask"],
              max_global=max_global)
  if task == "qa":
    context_BxN = batch["context_mask"] != 0
    return {"start_logits": jnp.where(context_BxN, _float(out.start_logits), _NEG),
            "end_logits": jnp.where(context_BxN, _float(out.end_logits), _NEG)}
  if task == "multiple_choice":
    return {"logits": jnp.where(batch["choice_mask"] != 0, _float(out.logits), _NEG)}
  return {"logits": _float(out.logits)}


def task_loss(model: nnx.Module, task: str, batch: Mapping[str, jax.Array],
              max_global: int) -> jax.Array:
  """The mean cross-entropy (nats) of the batch: per example for classification and multiple
  choice, per scored token for tagging, and (start + end) / 2 per example for QA (HF's)."""
  logits = task_logits(model, task, batch, max_global)
  ce = optax.softmax_cross_entropy_with_integer_labels
  if task == "qa":
    return 0.5 * jnp.mean(ce(logits["start_logits"], batch["start_positions"])
                          + ce(logits["end_logits"], batch["end_positions"]))
  labels = batch["labels"]
  if task == "token":
    real_BxN = labels != fd.IGNORE_INDEX
    nll_BxN = ce(logits["logits"], jnp.where(real_BxN, labels, 0))
    return jnp.sum(jnp.where(real_BxN, nll_BxN, 0.0)) / jnp.maximum(jnp.sum(real_BxN), 1)
  return jnp.mean(ce(logits["logits"], labels))


def best_spans(start_BxN: jax.Array, end_BxN: jax.Array, max_answer_length: int
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(start [B], end [B], score [B]): the span start <= end < start + max_answer_length with the
  highest start_logit[start] + end_logit[end], over every pair of positions of the row.

  The sum is the log of the span's probability under independent start and end softmaxes, up to
  the row's two normalisers, which do not change the argmax. Every pair is scored (not the top-k
  starts and ends of HF's post-processing), so the answer is exact over the whole document;
  positions that cannot be chosen must hold -1e9 (`task_logits`). Cost B x N x A scores.
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


# ----------------------------------------------------------------------------------------------
# The task


class _ExampleBatches(text.ExampleSampler):
  """The training `Batches`: the sampler's order over `rows` (the examples trained on), each
  batch as `make(rows of the batch)`'s arrays; state()/load_state() are the sampler's."""

  def __init__(self, make: Callable[[list[int]], dict[str, np.ndarray]], rows: Sequence[int],
               **sampler_args):
    super().__init__(len(rows), **sampler_args)
    self._make, self._rows = make, list(rows)

  def __next__(self) -> dict[str, np.ndarray]:
    return self._make([self._rows[i] for i in super().__next__()])


class FinetuneTask(Task):
  """Fine-tuning a Longformer task head (module docstring) on a `FinetuneSplit`.

  task: one of `fd.TASKS`. train, validation: featurised splits (`fd.read_split`); validation
    (optional) gives "valid_<metric>" every `eval_every` steps, on its first
    `eval_tokens // max_length` examples (all when eval_tokens is None).
  global_attention: "none", "first" or "question" (`fd.resolve_global`).
  options: for the evaluation (max_answer_length).
  identity: JSON values naming everything else that fixes what the run computes (tokenizer,
    starting weights); stored with the run and compared on resume.

  QA records whose answers all fall beyond max_length are not trained on (`skipped`).
  """

  plot_keys = ("train_loss",)
  plot_ylabel = "cross-entropy (nats)"

  def __init__(self, task: str, train: fd.FinetuneSplit,
               validation: fd.FinetuneSplit | None = None, *, global_attention: str,
               options: FinetuneOptions = FinetuneOptions(),
               identity: Mapping[str, Any] | None = None):
    if task not in fd.TASKS:
      raise ValueError(f"task must be one of {fd.TASKS}, got {task!r}")
    for split in (train, validation):
      if split is not None and split.task != task:
        raise ValueError(f"{split.path} was read for task {split.task!r}, not {task!r}")
    self.task, self.train, self.validation = task, train, validation
    self.global_attention = fd.resolve_global(task, global_attention)
    self.options = options
    self.rows = [i for i, e in enumerate(train.examples) if task != "qa" or e.target is not None]
    self.skipped = len(train) - len(self.rows)
    if not self.rows:
      raise ValueError(f"{train.path}: no answer of any record lies inside max_length="
                       f"{train.max_length}: nothing to train on")
    self.max_global = train.max_global(self.global_attention)
    self._identity = dict(identity or {})

  def check(self, cfg: TrainConfig) -> None:
    c = cfg.model
    if not isinstance(c, LongformerConfig):
      raise ValueError(f"fine-tuning trains a LongformerConfig model, got {type(c).__name__}")
    if c.causal:
      raise ValueError("fine-tuning needs a bidirectional encoder (model.causal=False)")
    n = self.train.max_length
    if n > c.max_sequence_length:
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
        check_labels(split, c)

  def data_identity(self, cfg: TrainConfig) -> dict[str, Any]:
    """The task, the training file (SHA-256, examples), the global tokens, the tags and the
    given `identity` (the sequence length is the stages' seq_len)."""
    del cfg
    return {"task": self.task, "train_sha256": self.train.sha256,
            "train_examples": len(self.train), "global_attention": self.global_attention,
            "max_question_length": self.options.max_question_length,
            "label_names": self.train.label_names, **self._identity}

  def build_model(self, config: LongformerConfig, rngs: nnx.Rngs, mesh: Mesh | None = None,
                  seq_axis: str | None = None) -> nnx.Module:
    return MODEL_CLASSES[self.task](config, rngs=rngs, mesh=mesh, seq_axis=seq_axis)

  def loss(self, model, batch, stage: Stage, dropout_key: jax.Array) -> jax.Array:
    del stage
    # Dropout streams reseeded from the step's key: new masks every step, the same on resume.
    nnx.reseed(model, default=dropout_key)
    return task_loss(model, self.task, batch, self.max_global)

  def batches(self, cfg: TrainConfig, stage_index: int, *, process_index: int,
              process_count: int) -> Batches:
    make = functools.partial(fd.batch, self.train, global_attention=self.global_attention,
                             **_batch_ids(cfg.model))
    return _ExampleBatches(lambda rows: make(rows=rows), self.rows,
                           global_batch_size=cfg.stages[stage_index].batch_size,
                           seed=cfg.seed + stage_index, process_index=process_index,
                           process_count=process_count)

  def evaluate(self, model, cfg: TrainConfig, stage_index: int, mesh: Mesh) -> dict[str, float]:
    if self.validation is None:
      return {}
    limit = (None if cfg.eval_tokens is None
             else max(1, cfg.eval_tokens // cfg.stages[stage_index].seq_len))
    outputs = predict(model, self.validation, global_attention=self.global_attention,
                      max_answer_length=self.options.max_answer_length,
                      batch_size=cfg.eval_batch_size, max_examples=limit, mesh=mesh,
                      rules=cfg.logical_rules)
    metrics, _ = score(self.validation, outputs)
    return {f"valid_{k}": v for k, v in metrics.items() if k != "examples"}


def _batch_ids(config: LongformerConfig) -> dict[str, int]:
  return dict(pad_id=config.pad_token_id, bos_id=config.bos_token_id,
              eos_id=config.eos_token_id)


def check_labels(split: fd.FinetuneSplit, config: LongformerConfig) -> None:
  """ValueError (a `text.JsonlError` naming the file and line) when a label does not fit the
  model's head: classification labels >= num_labels, tag sets of another size, QA heads that
  do not predict 2 logits."""
  if split.task == "classification":
    for e in split.examples:
      if e.label >= config.num_labels:
        raise text.JsonlError(split.path, e.line, "label", f"is {e.label}, but the model has "
                              f"num_labels={config.num_labels} classes (0..."
                              f"{config.num_labels - 1})")
  elif split.task == "token" and len(split.label_names) != config.num_labels:
    raise ValueError(f"{split.path}: {len(split.label_names)} tags {list(split.label_names)} "
                     f"but the model has num_labels={config.num_labels}")
  elif split.task == "qa" and config.num_labels != 2:
    raise ValueError(f"question answering predicts start and end: model.num_labels must be 2, "
                     f"got {config.num_labels}")


# ----------------------------------------------------------------------------------------------
# Evaluation


@functools.lru_cache(maxsize=16)
def _outputs_fn(graphdef, task: str, max_global: int, max_answer_length: int):
  """One jitted forward pass per model structure and setting: evaluating every N steps reuses
  the compilation."""

  @jax.jit
  def outputs(state, batch):
    logits = task_logits(nnx.merge(graphdef, state), task, batch, max_global)
    if task == "qa":
      start_B, end_B, score_B = best_spans(logits["start_logits"], logits["end_logits"],
                                           max_answer_length)
      return {"start": start_B, "end": end_B, "score": score_B}
    if task == "token":
      return {"tags": jnp.argmax(logits["logits"], axis=-1).astype(jnp.int32)}
    return {"logits": logits["logits"]}

  return outputs


def predict(model: nnx.Module, split: fd.FinetuneSplit, *, global_attention: str,
            max_answer_length: int = 30, batch_size: int = 8, max_examples: int | None = None,
            mesh: Mesh | None = None, rules: Sequence[tuple[str, Any]] = LOGICAL_RULES,
            progress: bool = False) -> dict[str, np.ndarray]:
  """The model's outputs (dropout off) for the first `max_examples` examples of `split`
  (default all), one row each: "logits" [E, L] or [E, C] (classification, multiple choice),
  "tags" [E, N] (token), "start", "end" (row positions) and "score" [E] (qa)."""
  model = nnx.merge(*nnx.split(model))  # a copy to switch to evaluation mode
  model.eval()
  graphdef, state = nnx.split(model)
  mode = fd.resolve_global(split.task, global_attention)
  fn = _outputs_fn(graphdef, split.task, split.max_global(mode), max_answer_length)
  num = len(split) if max_examples is None else min(max_examples, len(split))
  ids = _batch_ids(model.config)
  parts = collections.defaultdict(list)
  batches = examples.row_batches(num, batch_size, mesh)
  for rows, real in examples.progress(batches, len(batches), f"eval {split.task}", "batch",
                                     progress):
    batch = fd.batch(split, rows, global_attention=mode, **ids)
    out = fn(state, examples.put_batch(batch, mesh, rules))
    for name, x in out.items():
      parts[name].append(examples.to_host(x)[:real])
  return {name: np.concatenate(xs) for name, xs in parts.items()}


def score(split: fd.FinetuneSplit, outputs: Mapping[str, np.ndarray]
          ) -> tuple[dict[str, float], list[dict[str, Any]]]:
  """(metrics, prediction records) of `predict`'s outputs for the first examples of `split`.

  Records (one JSON object per example, "id" first):
    classification   {"id", "prediction", "label"}
    multiple_choice  {"id", "prediction", "label", "scores"} (one score per candidate)
    token            {"id", "prediction", "labels"}: a tag per word (or id), as the file spells
                     tags; null for words cut off by max_length (scored as wrong)
    qa               {"id", "prediction", "answers", "start", "end", "score"}: the answer text
                     (id records: its token ids) and its context token offsets (end inclusive)
  """
  task = split.task
  num = len(next(iter(outputs.values())))
  scored, ids = split.examples[:num], split.ids[:num]
  if task in ("classification", "multiple_choice"):
    logits = outputs["logits"]
    predicted = [int(i) for i in np.argmax(logits, axis=-1)]
    gold = [e.label for e in scored]
    metrics = {"accuracy": float(np.mean(np.equal(predicted, gold)))}
    if task == "classification":
      metrics["f1"] = macro_f1(gold, predicted)
    records = [{"id": i, "prediction": p, "label": g} for i, p, g in zip(ids, predicted, gold)]
    if task == "multiple_choice":
      for record, e, row in zip(records, scored, logits):
        record["scores"] = [float(x) for x in row[:len(e.input_ids)]]
  elif task == "token":
    names = split.label_names
    predicted = [[int(tags[w]) if w >= 0 else None for w in e.words]
                 for e, tags in zip(scored, outputs["tags"])]
    gold = [[names.index(g) for g in e.gold] for e in scored]
    metrics = tagging_scores(gold, predicted, names.index("O") if "O" in names else None)
    spell = (lambda t: t) if split.int_labels else (lambda t: None if t is None else names[t])
    records = [{"id": i, "prediction": [spell(t) for t in p], "labels": [spell(t) for t in g]}
               for i, p, g in zip(ids, predicted, gold)]
  else:
    records, answers, golds = [], [], []
    for i, e, start, end, s in zip(ids, scored, outputs["start"], outputs["end"],
                                   outputs["score"]):
      answer = span_answer(e, int(start), int(end))
      answers.append(answer)
      golds.append(e.gold)
      first = e.context[0]
      records.append({"id": i, "prediction": answer, "answers": list(e.gold),
                      "start": int(start) - first, "end": int(end) - first, "score": float(s)})
    metrics = squad_scores(answers, golds, normalize=split.by_text)
  return {**metrics, "examples": num}, records


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


def normalize_answer(s: str) -> str:
  """SQuAD v1.1's answer normalisation (its official evaluate script): lower case, punctuation
  removed, the articles a/an/the removed, whitespace collapsed."""
  s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
  s = re.sub(r"\b(a|an|the)\b", " ", s)
  return " ".join(s.split())


def _f1(predicted: Sequence, gold: Sequence) -> float:
  common = collections.Counter(predicted) & collections.Counter(gold)
  same = sum(common.values())
  if same == 0:
    return 0.0
  precision, recall = same / len(predicted), same / len(gold)
  return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: Sequence, golds: Sequence[Sequence], *, normalize: bool = True
                 ) -> dict[str, float]:
  """SQuAD's exact match and F1 (as TriviaQA's evaluation also takes them): per question, the
  best over its gold answers of EM (normalised strings equal) and of F1 (over the normalised
  strings' word multisets); then the mean over questions. normalize=False compares token-id
  tuples as they are (id records)."""
  if len(predictions) != len(golds) or not predictions:
    raise ValueError(f"need as many predictions as gold answer lists, at least one: got "
                     f"{len(predictions)} and {len(golds)}")
  tokens = (lambda a: normalize_answer(a).split()) if normalize else tuple
  em = f1 = 0.0
  for prediction, gold in zip(predictions, golds):
    em += max(float(tokens(prediction) == tokens(g)) for g in gold)
    f1 += max(_f1(tokens(prediction), tokens(g)) for g in gold)
  return {"exact_match": em / len(predictions), "f1": f1 / len(predictions)}


# ----------------------------------------------------------------------------------------------
# The model to start from


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """An encoder to fine-tune: its config, its weights (a pure dict of host arrays in its own
  class's structure; None for a preset, initialised from the run's seed), the name of that
  class, and the JSON identity of both (a resume from other weights is refused)."""
  config: LongformerConfig
  params: dict[str, Any] | None
  model_class: str | None
  identity: dict[str, Any]


def load_source(spec: str, tokenizer=None, *, options: FinetuneOptions = FinetuneOptions()
                ) -> ModelSource:
  """The Longformer named by `spec`:

    * a local HF Longformer directory (config.json, model_type "longformer"): `convert.from_hf`
      (allenai/longformer-base-4096 is a LongformerForMaskedLM: its encoder is used);
    * a local HF RoBERTa directory: `convert.roberta_to_longformer` (options.roberta_positions,
      options.roberta_window), the paper's recipe;
    * a project model checkpoint (`checkpoint.save_model`, model.json) of any Longformer class;
    * a project training workdir (run_config.json) of a LongformerConfig model: a fine-tuning
      run (its task's class) or an MLM run (LongformerForMaskedLM), its newest good checkpoint;
    * a preset, "tiny" (`tiny_config`), "base" or "large" (`LongformerConfig.base()/.large()`),
      with fresh weights; the ids of <s>, </s> and <pad> come from `tokenizer` when it has them.

  Raises FileNotFoundError / ValueError naming what is wrong.
  """
  from longformer_jax import convert
  if spec in PRESETS and not os.path.exists(spec):
    ids = {}
    if tokenizer is not None:
      for token, fields in (("<s>", ("bos_token_id",)), ("</s>", ("eos_token_id", "sep_token_id")),
                            ("<pad>", ("pad_token_id",))):
        if tokenizer.token_to_id(token) is not None:
          ids.update(dict.fromkeys(fields, tokenizer.token_to_id(token)))
    make = tiny_config if spec == "tiny" else getattr(LongformerConfig, spec)
    return ModelSource(make(**ids), None, None, {"kind": "preset", "preset": spec})
  if not os.path.isdir(spec):
    raise FileNotFoundError(f"--model {spec!r} is neither a preset {PRESETS} nor a directory")
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

  kind, model = open_model_dir(spec, hf, workdir_class)
  if not isinstance(getattr(model, "config", None), LongformerConfig):
    raise ValueError(f"{spec} holds a {type(model).__name__}, not a Longformer encoder")
  params = host_params(model)
  identity = {"kind": kind, "params_sha256": params_fingerprint(params)}
  return ModelSource(model.config, params, type(model).__name__, identity)


def num_labels(task: str, splits: Sequence[fd.FinetuneSplit], source: ModelSource) -> int:
  """The size of the task's head: 2 for QA (start, end), the tag count for tagging, and for
  classification the source's own head size when it is a classifier whose classes cover the
  labels, else the largest label + 1 (at least 2). Multiple choice scores one logit per
  candidate: the config's value is kept (unused)."""
  if task == "qa":
    return 2
  if task == "token":
    return len(splits[0].label_names)
  if task == "multiple_choice":
    return source.config.num_labels
  largest = max(e.label for split in splits for e in split.examples)
  if source.model_class == MODEL_CLASSES[task].__name__ and largest < source.config.num_labels:
    return source.config.num_labels
  return max(2, largest + 1)


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
    "FinetuneOptions", "FinetuneTask", "MODEL_CLASSES", "ModelSource", "PRESETS", "best_spans",
    "check_labels", "initial_params", "load_source", "macro_f1", "normalize_answer",
    "num_labels", "predict",
    "score", "span_answer", "squad_scores", "tagging_scores", "task_logits", "task_loss",
    "tiny_config",
]
