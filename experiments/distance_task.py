"""The task of experiments/distance_distractors.py: a key-value lookup whose evidence sits at a
controlled distance from the query, among distractors of the same form, as a `Task` of the
project's Trainer; the arms' models, training one arm for one seed, the held-out accuracy, and
the cost of a training step against sequence length.

A row is `seq_len` tokens of random filler holding `K + 1` pairs with distinct keys; the last token
is the query, a key id. A pair is ONE position: its token id is the key, its token type
(`token_type_ids`, `type_vocab_size = values + 1`) is `1 + value`. The label is the value of the
pair whose key is the query's (the evidence, exactly `d` positions before the query); the other
`K` pairs are distractors at random other positions. `LongformerForTokenClassification`
classifies the value from the query position's final state.

A study's sizes are a dict `p` (experiments/distance_distractors.py's PRESETS).
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from longformer_jax import LongformerConfig
from longformer_jax.modeling import LongformerForTokenClassification
from longformer_jax.training import Stage, Task, TrainConfig, Trainer

ARMS = ("local", "global", "full")
# Cost-panel-only variant: the full arm's window on the band op ("auto": chunked on CPU).
FULL_BAND = "full_band"
FULL_IMPL = "reference"  # the full arm's attention implementation (see the module docstring)
EVAL_SEED = 10_000  # held-out rows: the same for every arm and seed
SPECIALS = 4  # ids 0-3: <s>, <pad> (1, the config's pad_token_id), </s>, unused


# ----------------------------------------------------------------------------------------------
# The data


@dataclasses.dataclass(frozen=True)
class Vocab:
  """Token ids: 4 specials, then `keys` key ids, then `fillers` filler ids. Token types: 0 for
  fillers and the query, `1 + value` for a pair (`values` of them)."""
  keys: int
  values: int
  fillers: int

  @property
  def key0(self) -> int:
    return SPECIALS

  @property
  def filler0(self) -> int:
    return SPECIALS + self.keys

  @property
  def size(self) -> int:
    return self.filler0 + self.fillers


def vocab_of(p: dict) -> Vocab:
  return Vocab(p["keys"], p["values"], p["fillers"])


def check_cell(seq_len: int, distance: int, num_distractors: int, vocab: Vocab) -> None:
  """Raises ValueError unless rows of `seq_len` tokens can hold this distance and count."""
  if isinstance(distance, bool) or not isinstance(distance, (int, np.integer)) or not (
      1 <= distance <= seq_len - 1):
    raise ValueError(f"distance {distance!r} must be an int in [1, seq_len - 1 = {seq_len - 1}] "
                     f"(the query is the last of {seq_len} tokens)")
  if isinstance(num_distractors, bool) or not isinstance(num_distractors, (int, np.integer)) or (
      not 0 <= num_distractors <= vocab.keys - 1):
    raise ValueError(f"{num_distractors!r} distractors need as many keys besides the query's: "
                     f"{vocab.keys} keys allow 0 to {vocab.keys - 1}")
  if num_distractors + 2 > seq_len:
    raise ValueError(f"{num_distractors} distractor pairs, the evidence and the query do not fit "
                     f"in {seq_len} tokens")


def make_row(rng: np.random.Generator, seq_len: int, distance: int, num_distractors: int,
             vocab: Vocab) -> tuple[np.ndarray, np.ndarray, int]:
  """One row: token ids and token types (int32 [seq_len] each) and its label.

  The query (a key id, type 0) is the last token. The evidence pair (the query's key, type
  `1 + value`) sits exactly `distance` positions before it; `num_distractors` other pairs, each
  with its own key (never the query's), take random other positions before the query. Every
  other position is a filler id of type 0. The label is the evidence's value.
  """
  ids = vocab.filler0 + rng.integers(0, vocab.fillers, seq_len)
  types = np.zeros(seq_len, np.int64)
  keys = rng.permutation(vocab.keys)[:num_distractors + 1]  # keys[0]: the query's
  values = rng.integers(0, vocab.values, num_distractors + 1)
  query = seq_len - 1
  evidence = query - distance
  others = np.delete(np.arange(query), evidence)
  places = np.concatenate([[evidence], rng.choice(others, num_distractors, replace=False)])
  ids[places] = vocab.key0 + keys
  types[places] = 1 + values
  ids[query] = vocab.key0 + keys[0]
  return ids.astype(np.int32), types.astype(np.int32), int(values[0])


def _stack(rows) -> dict[str, np.ndarray]:
  return {"input_ids": np.stack([r[0] for r in rows]),
          "token_type_ids": np.stack([r[1] for r in rows]),
          "labels": np.asarray([r[2] for r in rows], np.int32)}


def make_rows(rng: np.random.Generator, n: int, seq_len: int, distance: int,
              num_distractors: int, vocab: Vocab) -> dict[str, np.ndarray]:
  """`n` rows at one (distance, distractor count): {"input_ids", "token_type_ids"} [n, seq_len]
  and "labels" [n]."""
  check_cell(seq_len, distance, num_distractors, vocab)
  return _stack([make_row(rng, seq_len, distance, num_distractors, vocab) for _ in range(n)])


def training_cell(rng: np.random.Generator, max_distance: int, max_distractors: int
                  ) -> tuple[int, int]:
  """A training row's (distance, distractor count): the distance log-uniform in
  [1, max_distance] (as many rows at 1-2 as at 64-128), the count uniform in
  [0, max_distractors]."""
  distance = int(np.clip(np.floor(np.exp(rng.uniform(0.0, math.log(max_distance + 1)))), 1,
                         max_distance))
  return distance, int(rng.integers(0, max_distractors + 1))


class RetrievalBatches:
  """Endless training batches, a function of (seed, step): {"input_ids", "token_type_ids"}
  [B, N] and "labels" [B], with the `state()`/`load_state()` of the loop's `Batches`."""

  def __init__(self, seed: int, batch_size: int, seq_len: int, max_distractors: int,
               vocab: Vocab, max_distance: int | None = None):
    self._seed, self._batch, self._seq_len = seed, batch_size, seq_len
    self._max_distractors, self._vocab = max_distractors, vocab
    self._max_distance = seq_len - 1 if max_distance is None else min(max_distance, seq_len - 1)
    self._step = 0

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([self._seed, self._step])
    self._step += 1
    return _stack([make_row(rng, self._seq_len,
                            *training_cell(rng, self._max_distance, self._max_distractors),
                            self._vocab)
                   for _ in range(self._batch)])

  def state(self) -> dict[str, int]:
    return {"step": self._step}

  def load_state(self, state) -> None:
    self._step = int(state["step"])


def nearest_pair_accuracy(seq_len: int, distance: int, num_distractors: int, values: int
                          ) -> float:
  """Accuracy of answering with the value of the pair NEAREST the query, ignoring keys: the
  evidence is the nearest pair unless one of the `num_distractors` (uniform over the seq_len - 2
  other positions) lands among the `distance - 1` nearer positions; otherwise the nearest
  distractor's value is right by chance (1 / values)."""
  p = math.comb(seq_len - 2 - (distance - 1), num_distractors) / math.comb(seq_len - 2,
                                                                          num_distractors)
  return p + (1 - p) / values


# ----------------------------------------------------------------------------------------------
# The task and the arms


class RetrievalTask(Task):
  """The lookup as a `Task` of the project's Trainer: a token-classification model, the
  cross-entropy of the query position's logits, and (arm "global") the query token global."""

  def __init__(self, arm: str, vocab: Vocab, max_distractors: int,
               max_distance: int | None = None):
    if arm not in ARMS + (FULL_BAND,):
      raise ValueError(f"arm must be one of {ARMS + (FULL_BAND,)}, got {arm!r}")
    self.arm, self.vocab, self.max_distractors = arm, vocab, max_distractors
    self.max_distance = max_distance  # of the training rows (None: seq_len - 1)

  def check(self, cfg: TrainConfig) -> None:
    if not isinstance(cfg.model, LongformerConfig):
      raise ValueError(f"the lookup trains a LongformerConfig, got {type(cfg.model).__name__}")
    if cfg.model.num_labels != self.vocab.values:
      raise ValueError(f"num_labels={cfg.model.num_labels}, but there are {self.vocab.values} "
                       f"values")
    if cfg.model.type_vocab_size != self.vocab.values + 1:
      raise ValueError(f"type_vocab_size={cfg.model.type_vocab_size}: pairs need "
                       f"values + 1 = {self.vocab.values + 1} token types")

  def build_model(self, config, rngs, mesh=None, seq_axis=None):
    return LongformerForTokenClassification(config, rngs=rngs, mesh=mesh, seq_axis=seq_axis)

  def query_logits(self, model, input_ids, token_type_ids) -> jax.Array:
    """[B, values] float32 logits of the query (last) position."""
    kwargs = {}
    if self.arm == "global":
      kwargs = dict(global_attention_mask=jnp.zeros(input_ids.shape, bool).at[:, -1].set(True),
                    max_global=1)
    out = model(input_ids, token_type_ids=token_type_ids, **kwargs)
    return out.logits[:, -1].astype(jnp.float32)

  def loss(self, model, batch, stage, dropout_key):
    del stage, dropout_key  # no dropout in these models
    logits = self.query_logits(model, batch["input_ids"], batch["token_type_ids"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]))

  def batches(self, cfg, stage_index, *, process_index, process_count):
    del process_index
    stage = cfg.stages[stage_index]
    return RetrievalBatches(cfg.seed + 1000 * stage_index, stage.batch_size // process_count,
                            stage.seq_len, self.max_distractors, self.vocab, self.max_distance)


def model_config(p: dict, arm: str, seq_len: int) -> LongformerConfig:
  """The arm's model for rows of `seq_len`: local and global share the window; full attention
  (and the cost panel's full_band) gets a window as long as the row."""
  full = arm in ("full", FULL_BAND)
  return LongformerConfig(
      vocab_size=vocab_of(p).size, hidden_size=p["hidden"], num_hidden_layers=p["layers"],
      num_attention_heads=p["heads"], intermediate_size=p["intermediate"],
      max_position_embeddings=seq_len + 2, type_vocab_size=p["values"] + 1,
      attention_window=seq_len if full else p["window"], attention_dilation=1,
      attention_impl=FULL_IMPL if arm == "full" else "auto",
      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=p["values"])


def receptive_field(config: LongformerConfig) -> int:
  """How far (one-sided, in tokens) information travels through the bands of one forward pass:
  every layer adds its window times its widest dilation."""
  return sum(w * max(d) for w, d in zip(config.layer_windows, config.layer_dilations))


def train_config(p: dict, arm: str, seed: int, steps: int,
                 model: LongformerConfig | None = None) -> TrainConfig:
  """The arm's training run (model: another model than `model_config`'s for the arm)."""
  return TrainConfig(
      model=model or model_config(p, arm, p["seq_len"]), dataset="synthetic", seed=seed,
      stages=(Stage(seq_len=p["seq_len"], batch_size=p["batch"], steps=steps,
                    learning_rate=p["lr"], warmup_steps=max(steps // 10, 1),
                    end_learning_rate=0.0, decay_power=1.0),),
      weight_decay=0.01, adam_b2=0.98, adam_eps=1e-6)


def train_arm(p: dict, arm: str, seed: int, pbar=None, *, model: LongformerConfig | None = None,
              params=None):
  """One arm, one seed, with the project's Trainer; returns (model, task, [loss per step]).
  model: the model's config (default `model_config`'s for the arm); params: its initial
  parameters (default: drawn from the seed)."""
  task = RetrievalTask(arm, vocab_of(p), max(p["distractors"]), p["train_max_distance"])
  cfg = train_config(p, arm, seed, p["steps"], model)
  trainer = Trainer(cfg, task=task)
  losses = []

  def report(step, loss):
    del step
    losses.append(loss)
    if pbar is not None:
      pbar.update(1)
      pbar.set_postfix(arm=arm, seed=seed, loss=f"{np.mean(losses[-20:]):.3f}")

  state, losses = trainer.fit(trainer.init_state(params), on_step=report)  # raises if diverging
  return trainer.model(state.params), task, losses


def eval_sets(p: dict) -> dict[tuple[int, int], dict[str, np.ndarray]]:
  """The held-out rows of every (distance, distractor count), the same for every model."""
  out = {}
  for i, d in enumerate(p["distances"]):
    for j, k in enumerate(p["distractors"]):
      rng = np.random.default_rng([EVAL_SEED, i, j])
      out[(d, k)] = make_rows(rng, p["eval_rows"], p["seq_len"], d, k, vocab_of(p))
  return out


def evaluate(model, task: RetrievalTask, sets, batch_size: int) -> dict[tuple[int, int], float]:
  """Accuracy of the query's argmax on each held-out cell (rows in batches of `batch_size`)."""
  predict = nnx.jit(lambda m, ids, types: jnp.argmax(task.query_logits(m, ids, types), axis=-1))
  out = {}
  for cell, rows in sets.items():
    n, hits = len(rows["labels"]), 0
    for s in range(0, n, batch_size):
      chunk = {k: v[s:s + batch_size] for k, v in rows.items()}
      real = len(chunk["labels"])
      if real < batch_size:  # one compiled shape: pad with copies of the first row
        chunk = {k: np.concatenate([v, np.repeat(v[:1], batch_size - real, 0)])
                 for k, v in chunk.items()}
      pred = np.asarray(predict(model, jnp.asarray(chunk["input_ids"]),
                                jnp.asarray(chunk["token_type_ids"])))
      hits += int(np.sum(pred[:real] == chunk["labels"][:real]))
    out[cell] = hits / n
  return out


# ----------------------------------------------------------------------------------------------
# Cost against sequence length


def measure_cost(p: dict, variants, pbar=None) -> dict:
  """Per variant and length: the compiled training step's temporary bytes and its wall time.

  At each length every variant's step is compiled (`Trainer.lower_train_step`), run once, then timed
  `cost_reps` times with the variants interleaved (in a rotating order), so that a busy moment of a
  shared machine hits all of them; the median is kept. The step is the Trainer's: forward, backward
  and the AdamW update of `cost_batch` rows. Times are relative to the first variant's.
  """
  out = {v: {"lengths": [], "temp_bytes": [], "argument_bytes": [], "seconds": []}
         for v in variants}
  for n in p["cost_lengths"]:
    runs = {}
    for variant in variants:
      q = {**p, "seq_len": n, "batch": p["cost_batch"]}
      task = RetrievalTask(variant, vocab_of(p), min(max(p["distractors"]), n - 2))
      # The training runs' schedule and seed 0: at the training shape the programs are theirs.
      trainer = Trainer(train_config(q, variant, 0, p["steps"]), task=task)
      batch = next(task.batches(trainer.cfg, 0, process_index=0, process_count=1))
      compiled = trainer.lower_train_step(0, {
          name: jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in batch.items()}).compile()
      stats = compiled.memory_analysis()
      state = trainer.init_state()
      batch = trainer.global_batch(batch, p["cost_batch"])
      state, metrics = compiled(state, batch, trainer.rest, trainer.seed_array)  # warm-up
      jax.block_until_ready(metrics)
      runs[variant] = {"step": compiled, "state": state, "batch": batch,
                       "model_state": (trainer.rest, trainer.seed_array), "times": []}
      out[variant]["lengths"].append(n)
      out[variant]["temp_bytes"].append(int(stats.temp_size_in_bytes))
      out[variant]["argument_bytes"].append(int(stats.argument_size_in_bytes))
    for rep in range(p["cost_reps"]):
      # Rotated each repetition: the first step after another variant's (e.g. after the dense
      # arm's large buffers are freed) runs slower.
      for variant in variants[rep % len(variants):] + variants[:rep % len(variants)]:
        r = runs[variant]
        tick = time.perf_counter()
        r["state"], metrics = r["step"](r["state"], r["batch"], *r["model_state"])
        jax.block_until_ready(metrics)
        r["times"].append(time.perf_counter() - tick)
    for variant in variants:
      out[variant]["seconds"].append(float(np.median(runs[variant]["times"])))
    del runs
    if pbar is not None:
      pbar.update(1)
      pbar.set_postfix(length=n)
  base = out[variants[0]]
  for v in variants:
    out[v]["time_relative"] = [s / b for s, b in zip(out[v]["seconds"], base["seconds"])]
    out[v]["temp_relative"] = [t / max(b, 1) for t, b in zip(out[v]["temp_bytes"],
                                                             base["temp_bytes"])]
    out[v]["relative_to"] = variants[0]
  return out


# ----------------------------------------------------------------------------------------------
# Plotting


def distance_axes(ax, setup: dict, *, legend_size: int) -> None:
  """The accuracy-against-distance panel's axes: log2 distances, accuracy in [0, 1], grid,
  legend, and a title naming the rows and steps of `setup`."""
  ax.set_xscale("log", base=2)
  ax.set_xlabel("distance from the evidence to the query (tokens)")
  ax.set_ylabel("held-out accuracy")
  ax.set_ylim(-0.02, 1.02)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=legend_size, loc="lower left")
  ax.set_title(f"key-value lookup, {setup['seq_len']}-token rows, {setup['steps']} steps",
               fontsize=10)
