"""Sequence-to-sequence fine-tuning of LED (`LEDForConditionalGeneration`) on (source, target)
text pairs: the task the shared training loop runs, where the model comes from, and the ROUGE
evaluation of generated outputs. `python -m train.seq2seq` is the command line; docs/seq2seq.md
the guide.

  Seq2SeqSplit, read_pairs   a JSONL file of {"source", "target"[, "id"]} records, tokenized
  GlobalAttention            which source tokens attend globally (default: the first, as HF
                             documents for LED and the paper does for summarization)
  Seq2SeqTask                the `Task`: teacher-forced cross-entropy over the real target tokens,
                             labels shifted right behind the decoder start token (HF's
                             `shift_tokens_right`), validation loss
  load_source                an LED to start from: HF LED or BART directory, project checkpoint or
                             training workdir, or a preset with fresh weights
  generate_split, rouge      generated outputs of a split and their ROUGE-1/2/L F-measures

Batches are {"input_ids", "attention_mask", "global_attention_mask"} int32 [B, N] (N =
max_source_length: every batch has the same shapes, so one compiled step serves the run) and
"labels" int32 [B, T] (T = max_target_length, IGNORE_INDEX on padding). Shape letters:
docs/design.md §4 (B batch, N source tokens, T target tokens, V vocabulary).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from longformer_jax import led
from longformer_jax.config import LEDConfig
from longformer_jax.data import text
from longformer_jax.data.tokenizer import special_token_ids, token_id
from longformer_jax.training.config import Stage, TrainConfig, check_int, final_eval_settings
from longformer_jax.training import examples
from longformer_jax.training.sharding import LOGICAL_RULES
from longformer_jax.training.sources import ModelSource
from longformer_jax.training.sources import load_source as load_source_of
from longformer_jax.training.task import Batches, FinalEvaluation, Task

# HF's label padding: positions whose label is this are not scored (and `shift_tokens_right`
# turns them into the pad token in the decoder input).
IGNORE_INDEX = -100
# The keyword arguments of `LEDForConditionalGeneration.generate` a run may set
# (`TrainConfig.final_eval`, besides `batch_size`).
GENERATE_ARGS = ("max_new_tokens", "num_beams", "do_sample", "temperature", "top_k", "top_p",
                 "length_penalty", "early_stopping", "no_repeat_ngram_size", "min_length",
                 "forced_bos_token_id", "forced_eos_token_id", "seed")
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


# ----------------------------------------------------------------------------------------------
# Data


@dataclasses.dataclass(frozen=True)
class GlobalAttention:
  """Which source tokens get global attention (they attend to every token and every token
  attends to them: docs/design.md §2).

  mode: "first" (the first token, `<s>` for BART tokenizers: HF's documented choice for LED and
    the paper's for summarization), "none" (band attention only), or "token" (every occurrence
    of `token_id`, e.g. a separator between the documents of a multi-document source).
  """
  mode: str = "first"
  token_id: int | None = None

  def __post_init__(self):
    if self.mode not in ("first", "none", "token"):
      raise ValueError(f"GlobalAttention.mode must be 'first', 'none' or 'token', got "
                       f"{self.mode!r}")
    if (self.mode == "token") != (self.token_id is not None):
      raise ValueError(f"GlobalAttention: token_id={self.token_id!r} goes with mode 'token' "
                       f"only (mode={self.mode!r})")

  @classmethod
  def parse(cls, spec: str, tokenizer=None) -> GlobalAttention:
    """From the command line's text: "first", "none" or "token:TOKEN" (TOKEN looked up in
    `tokenizer`)."""
    if spec in ("first", "none"):
      return cls(spec)
    if spec.startswith("token:") and len(spec) > len("token:"):
      if tokenizer is None:
        raise ValueError(f"global attention {spec!r} needs the tokenizer to find the token")
      return cls("token", token_id(tokenizer, spec[len("token:"):]))
    raise ValueError(f"global attention must be 'first', 'none' or 'token:TOKEN', got {spec!r}")

  def mask(self, ids_BxN: np.ndarray, mask_BxN: np.ndarray) -> np.ndarray:
    """The global attention mask, int32 [B, N] (all 0 for "none"; never 1 on padding). Always
    an array: `LEDForConditionalGeneration.generate` takes a missing one as "first"."""
    global_BxN = np.zeros(mask_BxN.shape, np.int32)
    if self.mode == "first":
      global_BxN[:, 0] = 1
    elif self.mode == "token":
      global_BxN[:] = ids_BxN == self.token_id
    return global_BxN * (mask_BxN != 0)

  def max_count(self, sources: Sequence[np.ndarray]) -> int:
    """The most global tokens of any source: the static bound the encoder needs under jit."""
    if self.mode == "none":
      return 0
    if self.mode == "first":
      return 1
    return max((int(np.sum(s == self.token_id)) for s in sources), default=0)


@dataclasses.dataclass(frozen=True)
class Seq2SeqSplit:
  """A JSONL file of pairs, tokenized.

  ids: each record's "id" (a string or integer), else its line number.
  sources, targets: int32 token ids, truncated to max_source_length / max_target_length; every
    target ends with the EOS token (appended when the tokenizer does not add it), so that the
    model learns to stop.
  references: the target texts, as the file has them (ROUGE references).
  sha256: of the file's bytes.
  """
  path: str
  ids: tuple[Any, ...]
  sources: tuple[np.ndarray, ...]
  targets: tuple[np.ndarray, ...]
  references: tuple[str, ...]
  sha256: str
  max_source_length: int
  max_target_length: int

  def __len__(self) -> int:
    return len(self.ids)


def read_pairs(path: str | os.PathLike, tokenizer, *, max_source_length: int,
               max_target_length: int, eos_token_id: int) -> Seq2SeqSplit:
  """The pairs of a JSONL file (`{"source": str, "target": str}` per line, optional "id": a
  string or integer, unique), tokenized with `tokenizer` (`text.encode`: its special tokens,
  truncated as HF truncates). Raises `text.JsonlError` naming the file, line and field of a
  record that breaks the rules (`longformer_jax.data.text`)."""
  path = os.fspath(path)
  if max_target_length < 2:
    raise ValueError(f"max_target_length={max_target_length} must be >= 2: a target holds at "
                     f"least one token and the EOS token")
  records = text.read_jsonl(path, {"source": str, "target": str}, optional={"id": (str, int)},
                            unique=("id",))
  sources = text.encode(tokenizer, [r.fields["source"] for r in records],
                        max_length=max_source_length, what=f"the sources of {path}")
  targets = []
  for ids in text.encode(tokenizer, [r.fields["target"] for r in records],
                         max_length=max_target_length, what=f"the targets of {path}"):
    if not len(ids) or ids[-1] != eos_token_id:
      ids = np.append(ids[:max_target_length - 1], np.int32(eos_token_id))
    targets.append(ids.astype(np.int32))
  return Seq2SeqSplit(
      path=path, ids=tuple(r.fields.get("id", r.line) for r in records), sources=tuple(sources),
      targets=tuple(targets), references=tuple(r.fields["target"] for r in records),
      sha256=text.file_sha256(path), max_source_length=max_source_length,
      max_target_length=max_target_length)


def encoder_batch(split: Seq2SeqSplit, rows: Sequence[int], *, pad_token_id: int,
                  global_attention: GlobalAttention) -> dict[str, np.ndarray]:
  """{"input_ids", "attention_mask", "global_attention_mask"}, int32 [len(rows), N]."""
  ids_BxN, mask_BxN = text.pad([split.sources[i] for i in rows],
                               length=split.max_source_length, pad_id=pad_token_id)
  return {"input_ids": ids_BxN, "attention_mask": mask_BxN,
          "global_attention_mask": global_attention.mask(ids_BxN, mask_BxN)}


def training_batch(split: Seq2SeqSplit, rows: Sequence[int], *, pad_token_id: int,
                   global_attention: GlobalAttention) -> dict[str, np.ndarray]:
  """`encoder_batch` plus "labels", int32 [len(rows), T]: the targets, IGNORE_INDEX after
  them."""
  labels_BxT, _ = text.pad([split.targets[i] for i in rows], length=split.max_target_length,
                           pad_id=IGNORE_INDEX)
  return {**encoder_batch(split, rows, pad_token_id=pad_token_id,
                          global_attention=global_attention), "labels": labels_BxT}


# ----------------------------------------------------------------------------------------------
# Loss


def target_nll(model: led.LEDForConditionalGeneration, batch: Mapping[str, jax.Array], *,
               max_global: int | None) -> tuple[jax.Array, jax.Array]:
  """(cross-entropy in nats float32 [B, T], real float32 [B, T]): the teacher-forced loss of
  every target token, 0 where the label is IGNORE_INDEX (`real` is 0 there).

  The decoder reads the labels shifted right behind the decoder start token (HF's
  `shift_tokens_right`, IGNORE_INDEX becoming the pad token). `final_logits_bias` gets no
  gradient: HF keeps it as a buffer that fine-tuning never changes (and its 1-D shape keeps it
  out of the weight decay, so it stays exactly as loaded).
  """
  c = model.config
  labels_BxT = batch["labels"]
  decoder_ids_BxT = led.shift_tokens_right(labels_BxT, c.pad_token_id, c.decoder_start_token_id)
  # max_global 0: no global token in any source ("none", or a separator that never occurs).
  out = model.led(batch["input_ids"], batch["attention_mask"], decoder_ids_BxT,
                  global_attention_mask=batch["global_attention_mask"] if max_global else None,
                  max_global=max_global or None)
  logits_BxTxV = model.led.shared.attend(out.last_hidden_state)
  logits_BxTxV = logits_BxTxV + jax.lax.stop_gradient(
      model.final_logits_bias[...]).astype(logits_BxTxV.dtype)
  real_BxT = labels_BxT != IGNORE_INDEX
  # Softmax in float32 whatever the compute dtype: a bf16 log-sum-exp over 50K logits is coarse.
  nll_BxT = optax.softmax_cross_entropy_with_integer_labels(
      logits_BxTxV.astype(jnp.float32), jnp.where(real_BxT, labels_BxT, 0))
  return jnp.where(real_BxT, nll_BxT, 0.0), real_BxT.astype(jnp.float32)


def evaluate_loss(model: led.LEDForConditionalGeneration, split: Seq2SeqSplit, *,
                  global_attention: GlobalAttention, batch_size: int = 8,
                  max_examples: int | None = None, mesh: Mesh | None = None,
                  rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> float:
  """Mean teacher-forced cross-entropy (nats) per real target token of the first
  `max_examples` pairs of `split` (default all), dropout off."""
  model = nnx.merge(*nnx.split(model))  # a copy to switch to evaluation mode
  model.eval()
  graphdef, state = nnx.split(model)
  scorer = examples.nll_sums_fn(target_nll, graphdef,
                                max_global=global_attention.max_count(split.sources))
  num = len(split) if max_examples is None else min(max_examples, len(split))
  total, count = 0.0, 0.0
  for rows, real in examples.row_batches(num, batch_size, mesh):
    batch = training_batch(split, rows, pad_token_id=model.config.pad_token_id,
                           global_attention=global_attention)
    batch["labels"][real:] = IGNORE_INDEX  # the filler rows are not scored
    s, c = scorer(state, examples.put_batch(batch, mesh, rules))
    total, count = total + float(s), count + float(c)  # summed on the host in float64
  return total / count


# ----------------------------------------------------------------------------------------------
# The task


class Seq2SeqTask(Task):
  """LED fine-tuning on (source, target) pairs.

  train, validation: tokenized splits (`read_pairs`); validation (optional) gives "valid_loss"
    every `eval_every` steps, on its first `eval_tokens // max_source_length` pairs (all of them
    when eval_tokens is None).
  global_attention: which source tokens attend globally.
  identity: JSON values naming everything else that fixes what the run computes (the tokenizer,
    the weights it starts from); stored with the run and compared on resume.

  Every stage trains on sources of `max_source_length` tokens: its seq_len must equal it.
  """

  plot_keys = ("train_loss", "valid_loss")
  plot_ylabel = "cross-entropy (nats per target token)"

  def __init__(self, train: Seq2SeqSplit, validation: Seq2SeqSplit | None = None, *,
               global_attention: GlobalAttention = GlobalAttention(),
               identity: Mapping[str, Any] | None = None, test: Seq2SeqSplit | None = None,
               tokenizer=None):
    splits = [s for s in (train, validation) if s is not None]
    lengths = {(s.max_source_length, s.max_target_length) for s in splits}
    if len(lengths) > 1:
      raise ValueError(f"the splits were tokenized with different (max_source_length, "
                       f"max_target_length): {sorted(lengths)}")
    self.train, self.validation, self.test = train, validation, test
    self.tokenizer = tokenizer
    self.global_attention = global_attention
    self.max_global = max(global_attention.max_count(s.sources) for s in splits)
    self._identity = dict(identity or {})

  def check(self, cfg: TrainConfig) -> None:
    c = cfg.model
    if not isinstance(c, LEDConfig):
      raise ValueError(f"the seq2seq task trains an LEDConfig model, got {type(c).__name__}")
    n, t = self.train.max_source_length, self.train.max_target_length
    for i, stage in enumerate(cfg.stages):
      if stage.seq_len != n:
        raise ValueError(f"stages[{i}].seq_len={stage.seq_len} differs from the sources' "
                         f"max_source_length={n}")
      if stage.windows is not None:
        raise ValueError(f"stages[{i}].windows={stage.windows}: the LED encoder trains with "
                         f"the model config's windows (set model.attention_window)")
    if n > c.max_encoder_position_embeddings:
      raise ValueError(f"max_source_length={n} exceeds the model's "
                       f"max_encoder_position_embeddings={c.max_encoder_position_embeddings}")
    if t > c.max_decoder_position_embeddings:
      raise ValueError(f"max_target_length={t} exceeds the model's "
                       f"max_decoder_position_embeddings={c.max_decoder_position_embeddings}")
    for split in (self.train, self.validation):
      if split is not None:
        check_token_ids(split, c.vocab_size)

  def data_identity(self, cfg: TrainConfig) -> dict[str, Any]:
    """The training file (SHA-256, pairs), the target length, the global tokens and the
    task's `identity` (the source length is the stages' seq_len)."""
    del cfg
    return {"train_sha256": self.train.sha256, "train_pairs": len(self.train),
            "max_target_length": self.train.max_target_length,
            "global_attention": dataclasses.asdict(self.global_attention), **self._identity}

  def build_model(self, config: LEDConfig, rngs: nnx.Rngs, mesh: Mesh | None = None,
                  seq_axis: str | None = None) -> led.LEDForConditionalGeneration:
    return led.LEDForConditionalGeneration(config, rngs=rngs, mesh=mesh, seq_axis=seq_axis)

  def loss(self, model, batch, stage: Stage, dropout_key: jax.Array) -> jax.Array:
    del stage
    # The model's dropout layers draw from their RNG streams: reseeded from the step's key, so
    # the masks change every step and a resumed run draws the same ones.
    nnx.reseed(model, default=dropout_key)
    nll_BxT, real_BxT = target_nll(model, batch, max_global=self.max_global)
    # Every real target token of the batch weighs the same (as HF's mean over labels != -100).
    return jnp.sum(nll_BxT) / jnp.maximum(jnp.sum(real_BxT), 1.0)

  def batches(self, cfg: TrainConfig, stage_index: int, *, process_index: int,
              process_count: int) -> Batches:
    make = functools.partial(training_batch, self.train, pad_token_id=cfg.model.pad_token_id,
                             global_attention=self.global_attention)
    return examples.ExampleBatches(
        make, range(len(self.train)), global_batch_size=cfg.stages[stage_index].batch_size,
        seed=cfg.seed + stage_index, process_index=process_index, process_count=process_count)

  def evaluate(self, model, cfg: TrainConfig, stage_index: int, mesh: Mesh) -> dict[str, float]:
    if self.validation is None:
      return {}
    limit = (None if cfg.eval_tokens is None
             else max(1, cfg.eval_tokens // cfg.stages[stage_index].seq_len))
    return {"valid_loss": evaluate_loss(
        model, self.validation, global_attention=self.global_attention,
        batch_size=cfg.eval_batch_size, max_examples=limit, mesh=mesh,
        rules=cfg.logical_rules)}


  def final_evaluation(self, cfg: TrainConfig, workdir, mesh: Mesh, *,
                       progress: bool = False) -> FinalEvaluation:
    """Outputs generated for the validation and test splits by the run's newest checkpoint
    (`cfg.final_eval`: `GENERATE_ARGS` and batch_size), scored with ROUGE; files
    predictions_<split>.jsonl. Needs the task's tokenizer."""
    model, step, _ = self.restore(cfg, workdir, mesh)
    generation = dict(cfg.final_eval or {})
    batch_size = generation.pop("batch_size", cfg.eval_batch_size)
    results, files, lines = {"generation": generation}, {}, []
    for name, split in (("validation", self.validation), ("test", self.test)):
      if split is None:
        continue
      predictions = generate_split(
          model, split, self.tokenizer, global_attention=self.global_attention,
          batch_size=batch_size, mesh=mesh, rules=cfg.logical_rules, progress=progress,
          **generation)
      scores = rouge(predictions, split.references)
      results[name] = {**scores, "pairs": len(split)}
      files[f"predictions_{name}.jsonl"] = predictions_jsonl(split, predictions)
      lines.append(f"{name}: " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
    return FinalEvaluation(results, files, tuple(lines), step=step)


def check_generation(cfg: TrainConfig) -> None:
  """ValueError (or TypeError) naming a `cfg.final_eval` setting that generation does not take
  or would refuse for the run's model (`led.generate_settings`), checked when the run is
  configured, not after training."""
  settings = final_eval_settings(cfg, ("batch_size", *GENERATE_ARGS))
  try:
    check_int("batch_size", settings.pop("batch_size", 1), minimum=1)
    led.generate_settings(cfg.model, **settings)
  except (TypeError, ValueError) as e:
    raise type(e)(f"final_eval: {e}") from None


def check_token_ids(split: Seq2SeqSplit, vocab_size: int) -> None:
  """ValueError naming the file and line of the first token id outside the model's vocabulary
  (a tokenizer larger than the model's embedding table)."""
  for row, ids in enumerate(split.sources + split.targets):
    if len(ids) and int(ids.max()) >= vocab_size:
      which = "source" if row < len(split) else "target"
      record = split.ids[row % len(split)]
      raise ValueError(f"{split.path}: the {which} of record {record!r} has token id "
                       f"{int(ids.max())}, outside the model's vocabulary (vocab_size="
                       f"{vocab_size}): the tokenizer does not belong to this model")


# ----------------------------------------------------------------------------------------------
# The model to start from


def load_source(spec: str, tokenizer=None, *, bart_positions: int = 16384,
                bart_window: int = 512) -> ModelSource:
  """The LED named by `spec`:

    * a local HF LED directory (config.json with model_type "led"): `convert.from_hf`, as an
      `LEDForConditionalGeneration` (an `LEDModel` checkpoint gets a fresh LM head, with a
      warning);
    * a local HF BART directory (model_type "bart"): `convert.bart_to_led` with
      `bart_positions` encoder positions and a one-sided window of `bart_window`;
    * a project model checkpoint (`checkpoint.save_model`, model.json) of an
      `LEDForConditionalGeneration`;
    * a project training workdir (run_config.json): its newest checkpoint that verifies;
    * a preset, "tiny", "base" or "large" (`LEDConfig.<preset>()`), with fresh weights: the
      vocabulary size and the ids of `<pad>`, `<s>` and `</s>` (also the decoder start token, as
      in BART) come from `tokenizer`.

  Raises FileNotFoundError / ValueError naming what is wrong.
  """
  from longformer_jax import convert

  def preset(name):
    if tokenizer is None:
      raise ValueError(f"the preset {name!r} takes its vocabulary from a tokenizer; give one")
    ids = special_token_ids(tokenizer, needed_by="the LED")
    return getattr(LEDConfig, name)(
        vocab_size=tokenizer.get_vocab_size(), pad_token_id=ids["<pad>"],
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], decoder_start_token_id=ids["</s>"])

  hf = {"led": functools.partial(convert.from_hf, model_class=led.LEDForConditionalGeneration),
        "bart": functools.partial(convert.bart_to_led, max_positions=bart_positions,
                                  window=bart_window)}

  def workdir_class(record, cfg):
    del record
    if not isinstance(cfg.model, LEDConfig):
      raise ValueError(f"{spec} is a run of a {type(cfg.model).__name__} model, not an LED")
    return led.LEDForConditionalGeneration

  return load_source_of(
      spec, LEDConfig, preset, hf, workdir_class,
      accept=lambda model: isinstance(model, led.LEDForConditionalGeneration),
      expected="an LEDForConditionalGeneration (fine-tuning needs one)")


# ----------------------------------------------------------------------------------------------
# Generation and ROUGE


def decode_generated(tokenizer, sequences_BxT: np.ndarray, eos_token_id: int) -> list[str]:
  """The texts of `generate`'s sequences: after the decoder start token, up to the first EOS,
  special tokens dropped."""
  texts = []
  for row in np.asarray(sequences_BxT)[:, 1:]:
    ends = np.flatnonzero(row == eos_token_id)
    row = row[:ends[0]] if len(ends) else row
    texts.append(tokenizer.decode(row.tolist(), skip_special_tokens=True).strip())
  return texts


def generate_split(model: led.LEDForConditionalGeneration, split: Seq2SeqSplit, tokenizer, *,
                   global_attention: GlobalAttention, batch_size: int = 8,
                   mesh: Mesh | None = None, rules: Sequence[tuple[str, Any]] = LOGICAL_RULES,
                   progress: bool = False, **generate_kwargs) -> list[str]:
  """The model's output text for every source of `split`, in order, from
  `model.generate(...)` (which turns dropout off) with `generate_kwargs` (`GENERATE_ARGS`, e.g.
  max_new_tokens, num_beams)."""
  unknown = sorted(set(generate_kwargs) - set(GENERATE_ARGS))
  if unknown:
    raise ValueError(f"unknown generation settings {unknown}; known: {list(GENERATE_ARGS)}")
  c = model.config
  outputs = []
  batches = examples.row_batches(len(split), batch_size, mesh)
  for rows, real in examples.progress(batches, len(batches), "generate", "batch", progress):
    batch = examples.put_batch(encoder_batch(split, rows, pad_token_id=c.pad_token_id,
                                   global_attention=global_attention), mesh, rules)
    sequences_BxT = model.generate(
        batch["input_ids"], attention_mask=batch["attention_mask"],
        global_attention_mask=batch["global_attention_mask"], **generate_kwargs)
    outputs += decode_generated(tokenizer, examples.to_host(sequences_BxT)[:real], c.eos_token_id)
  return outputs


def rouge(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
  """Mean ROUGE-1, ROUGE-2 and ROUGE-L F-measures over the pairs, with Porter stemming
  (Google's `rouge-score` package, as HF's summarization examples; its tokenizer keeps
  lowercased ASCII letters and digits only)."""
  if len(predictions) != len(references) or not predictions:
    raise ValueError(f"need as many predictions as references, at least one: got "
                     f"{len(predictions)} and {len(references)}")
  try:
    from rouge_score import rouge_scorer
  except ImportError as e:
    raise ImportError("ROUGE needs the rouge-score package (pip install rouge-score, or "
                      "longformer-jax[torch])") from e
  scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
  sums = dict.fromkeys(ROUGE_TYPES, 0.0)
  for prediction, reference in zip(predictions, references):
    for name, score in scorer.score(reference, prediction).items():
      sums[name] += score.fmeasure
  return {name: total / len(predictions) for name, total in sums.items()}


def predictions_jsonl(split: Seq2SeqSplit, predictions: Sequence[str]) -> str:
  """One JSON line per pair: {"id", "prediction", "reference"}."""
  return "".join(json.dumps({"id": i, "prediction": p, "reference": r}, ensure_ascii=False) + "\n"
                 for i, p, r in zip(split.ids, predictions, split.references, strict=True))
