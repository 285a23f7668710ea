"""Long-range lookup among distractors: a path to the evidence vs a model that uses it.

Issue #13, study 3. A synthetic key-value lookup whose evidence sits at a controlled distance from
the query, among distractors of the same form. Each row is `seq_len` tokens of random filler
holding `K + 1` pairs with distinct keys; the last token is the query, a key id. The label is the
value of the pair whose key is the query's (the evidence); the other `K` pairs are distractors.
The evidence sits exactly `d` positions before the query, the distractors at random other
positions (nearer or farther). A pair is ONE position: its token id is the key, its token type
(`token_type_ids`, `type_vocab_size = values + 1`) is `1 + value`, so `d` is one number and the
lookup is a content match of the query against the keys. (A first version spelled pairs as two
tokens `KEY VAL`; with learned absolute positions a 2-layer model must then also learn to bind
neighbours, and after 800 steps of 32 x 256 tokens full attention had only a recency heuristic:
100% at d=1, 9% at d=128 with 16 distractors.) `LongformerForTokenClassification` classifies the
value from the query position's final state; chance is 1 / values.

Arms (the same model shape, data, steps and seeds; the library's models and Trainer):
  local   a sliding window of `window` per side in every layer, no global token;
  global  the same window plus global attention on the query token, as the paper makes the
          question global for QA (the query attends every token, every token attends it);
  full    a window as long as the row (LongformerConfig has no dense switch, a band covering the
          row is full attention), computed densely by the op's "reference" implementation: the
          same numbers as the band op and on this CPU half the time of the chunked band with
          window = seq_len (its key slab is 2.5 x seq_len wide). The cost panel shows both.

Each arm is trained once per seed on a mix (distance log-uniform in [1, seq_len - 1], distractor
count uniform in [0, max]) and scored on the same held-out rows at fixed distances and distractor
counts. The local arm's receptive field is one-sided, the sum over layers of window x dilation
(2 x 8 x 1 = 16 tokens at the cpu size): beyond it no path from the evidence to the query exists.
Inside it one does, but for window < d <= 2 x window the evidence must reach the query through
an intermediate token, which in layer 1 cannot know which key the query wants: it can carry
"the value near me" (enough without distractors) but not "the value of key q" among several.
That is the question the breakdown answers: where accuracy falls inside the field, not only
outside. As a reference the study also gives the exact accuracy of a rule that ignores keys and
answers with the value of the pair nearest the query (`nearest_pair_accuracy`). A second and a
third panel give the cost against sequence length: the compiled training step's temporary memory
(`compiled.memory_analysis().temp_size_in_bytes`) and its wall time, the variants timed side by
side (interleaved) in this process, relative to the local arm.

Sizes (`--device`): cpu (default): 128-token rows, window 8, 2 layers x 64 (4 heads), 1,500
steps of 16 rows. Full attention learns the key lookup only after ~600-900 steps (loss at ~1.2-1.3
until then, < 0.05 at 1,500); at 256 tokens a step costs about 3x more and after 400 steps of 16
rows full attention had not learned it, so 128 it is. One run takes 1.5-3 minutes on 2 shared
cores, the 9 runs plus the cost panel about 20 minutes. gpu: 1,024-token rows, window 32, hidden
128, 4,000 steps of 64 rows (not run yet). tiny: the test's (a few steps).

    python experiments/distance_distractors.py                 # cpu size, seeds 0 1 2
    python experiments/distance_distractors.py --device gpu    # the bigger preset on a GPU
    python experiments/distance_distractors.py --seeds 0 1 2 3 4 --steps 2000
    python experiments/distance_distractors.py --arms local --train-max-distance 16 --no-cost \
        --out /tmp/local_in_field.json      # diagnostic: train only on reachable rows

Writes experiments/results/distance_distractors.json ({"study", "metric", "arms": {name: {"seeds",
"values", "mean", "std", "by_distance", "by_distractors", "regions", "cells"}}, "setup",
"receptive_field", "nearest_pair_heuristic", "cost", "verdict"}) and distance_distractors.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

# --device gpu must see the GPU; anything else runs on the CPU (set before JAX reads it).
if not any(a in ("gpu", "--device=gpu") for a in sys.argv[1:]):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from longformer_jax import LongformerConfig
from longformer_jax.io import atomic_write, save_figure
from longformer_jax.modeling import LongformerForTokenClassification
from longformer_jax.training import Stage, Task, TrainConfig, Trainer

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("local", "global", "full")
# Cost-panel-only variant: the full arm's window on the band op ("auto": chunked on CPU).
FULL_BAND = "full_band"
FULL_IMPL = "reference"  # the full arm's attention implementation (see the module docstring)
EVAL_SEED = 10_000  # held-out rows: the same for every arm and seed
SPECIALS = 4  # ids 0-3: <s>, <pad> (1, the config's pad_token_id), </s>, unused

PRESETS = {
    "cpu": dict(seq_len=128, window=8, layers=2, hidden=64, heads=4, intermediate=256,
                keys=32, values=8, fillers=32, steps=1500, batch=16, lr=2e-3,
                distances=(1, 2, 4, 6, 8, 10, 12, 14, 16, 20, 24, 32, 64, 127),
                distractors=(0, 4, 16), eval_rows=128,
                cost_lengths=(256, 512, 1024, 2048), cost_batch=2, cost_reps=11,
                cost_band_full=True),
    "gpu": dict(seq_len=1024, window=32, layers=2, hidden=128, heads=4, intermediate=512,
                keys=64, values=16, fillers=64, steps=4000, batch=64, lr=1e-3,
                distances=(1, 8, 16, 24, 32, 40, 48, 56, 64, 80, 128, 256, 512, 1023),
                distractors=(0, 8, 32), eval_rows=256,
                cost_lengths=(1024, 2048, 4096, 8192, 16384), cost_batch=1, cost_reps=10,
                cost_band_full=True),
    # The test's: the cost panel at the training shape (its programs come from the cache).
    "tiny": dict(seq_len=32, window=4, layers=2, hidden=32, heads=2, intermediate=64,
                 keys=8, values=4, fillers=8, steps=3, batch=8, lr=2e-3,
                 distances=(1, 4, 6, 8, 16, 31), distractors=(0, 3), eval_rows=8,
                 cost_lengths=(32,), cost_batch=8, cost_reps=1, cost_band_full=False),
}


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


def train_config(p: dict, arm: str, seed: int, steps: int) -> TrainConfig:
  return TrainConfig(
      model=model_config(p, arm, p["seq_len"]), dataset="synthetic", seed=seed,
      stages=(Stage(seq_len=p["seq_len"], batch_size=p["batch"], steps=steps,
                    learning_rate=p["lr"], warmup_steps=max(steps // 10, 1),
                    end_learning_rate=0.0, decay_power=1.0),),
      weight_decay=0.01, adam_b2=0.98, adam_eps=1e-6)


def train_arm(p: dict, arm: str, seed: int, pbar=None):
  """One arm, one seed, with the project's Trainer; returns (model, task, [loss per step])."""
  task = RetrievalTask(arm, vocab_of(p), max(p["distractors"]), p["train_max_distance"])
  cfg = train_config(p, arm, seed, p["steps"])
  trainer = Trainer(cfg, task=task)
  losses = []

  def report(step, loss):
    del step
    losses.append(loss)
    if pbar is not None:
      pbar.update(1)
      pbar.set_postfix(arm=arm, seed=seed, loss=f"{np.mean(losses[-20:]):.3f}")

  state, losses = trainer.fit(trainer.init_state(), on_step=report)  # raises if it diverges
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
      state, metrics = compiled(state, batch, trainer.rest)  # warm-up
      jax.block_until_ready(metrics)
      runs[variant] = {"step": compiled, "state": state, "batch": batch, "rest": trainer.rest,
                       "times": []}
      out[variant]["lengths"].append(n)
      out[variant]["temp_bytes"].append(int(stats.temp_size_in_bytes))
      out[variant]["argument_bytes"].append(int(stats.argument_size_in_bytes))
    for rep in range(p["cost_reps"]):
      # Rotated each repetition: the first step after another variant's (e.g. after the dense
      # arm's large buffers are freed) runs slower, measured at ~1.5x here.
      for variant in variants[rep % len(variants):] + variants[:rep % len(variants)]:
        r = runs[variant]
        tick = time.perf_counter()
        r["state"], metrics = r["step"](r["state"], r["batch"], r["rest"])
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
# Summaries, verdict, plot


def _stats(values) -> dict:
  values = [float(v) for v in values]
  return {"values": values, "mean": float(np.mean(values)),
          "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0}


def regions(p: dict, rf: int) -> dict[str, list[int]]:
  """The measured distances by what the local arm's bands allow: one hop (d <= window), only
  through an intermediate token (window < d <= receptive field), no path (d > field)."""
  w = p["window"]
  return {"one_hop": [d for d in p["distances"] if d <= w],
          "two_hops": [d for d in p["distances"] if w < d <= rf],
          "beyond_field": [d for d in p["distances"] if d > rf]}


def summarize(p: dict, seeds, per_seed: list[dict], rf: int) -> dict:
  """An arm's accuracies, each as the seeds' values, mean and std: overall (every cell), per
  distance (mean over distractor counts), per distractor count, per region and count, per cell."""
  cells = list(per_seed[0])
  ks = p["distractors"]
  overall = [np.mean([acc[c] for c in cells]) for acc in per_seed]
  return {
      "seeds": list(seeds), **_stats(overall),
      "by_distance": {str(d): _stats([np.mean([acc[(d, k)] for k in ks]) for acc in per_seed])
                      for d in p["distances"]},
      "by_distractors": {str(k): _stats([np.mean([acc[(d, k)] for d in p["distances"]])
                                         for acc in per_seed]) for k in ks},
      "regions": {name: {str(k): _stats([np.mean([acc[(d, k)] for d in ds]) for acc in per_seed])
                         for k in ks}
                  for name, ds in regions(p, rf).items() if ds},
      "cells": {f"d{d}_k{k}": _stats([acc[(d, k)] for acc in per_seed]) for d, k in cells},
  }


def heuristic_summary(p: dict, rf: int) -> dict:
  """The nearest-pair heuristic's accuracy (`nearest_pair_accuracy`) on the held-out cells,
  averaged as `summarize` averages an arm."""
  ks = p["distractors"]
  acc = {(d, k): nearest_pair_accuracy(p["seq_len"], d, k, p["values"])
         for d in p["distances"] for k in ks}
  return {"description": "answer with the value of the pair nearest the query, ignoring keys "
                         "(exact probability, not trained)",
          "by_distance": {str(d): float(np.mean([acc[(d, k)] for k in ks]))
                          for d in p["distances"]},
          "regions": {name: {str(k): float(np.mean([acc[(d, k)] for d in ds])) for k in ks}
                      for name, ds in regions(p, rf).items() if ds},
          "cells": {f"d{d}_k{k}": a for (d, k), a in acc.items()}}


def differs(a: dict, b: dict | float, rows: int) -> tuple[float, float, bool]:
  """(a - b, the margin, whether it counts). A difference counts only when it exceeds the sum of
  the two seed standard deviations, and at least two binomial standard errors of `rows` held-out
  rows (so two arms both at 100% with no spread do not differ by a row or two). `b` may be a
  constant (chance)."""
  b_mean, b_std = (b, 0.0) if isinstance(b, float) else (b["mean"], b["std"])
  delta = a["mean"] - b_mean
  q = min(max((a["mean"] + b_mean) / 2, 0.05), 0.95)
  margin = max(a["std"] + b_std, 2 * math.sqrt(q * (1 - q) / rows))
  return delta, margin, abs(delta) > margin


def verdict(p: dict, arms: dict, rf: int, chance: float, heuristic: dict
            ) -> tuple[list[str], dict]:
  """Plain sentences from the numbers, and the comparisons they rest on."""
  w, ks = p["window"], p["distractors"]
  fmt = lambda s: f"{s['mean']:.2f} ± {s['std']:.2f}"
  regs = regions(p, rf)
  comparisons = {}
  for name in arms:
    comparisons[name] = {}
    for d in p["distances"]:
      for k in ks:
        s = arms[name]["cells"][f"d{d}_k{k}"]
        row = dict(zip(("minus_chance", "margin", "counts"), differs(s, chance, p["eval_rows"])))
        row = {"above_chance": row["counts"] and row["minus_chance"] > 0}
        if name != "full" and "full" in arms:
          delta, margin, counts = differs(s, arms["full"]["cells"][f"d{d}_k{k}"], p["eval_rows"])
          row.update(minus_full=round(delta, 4), margin=round(margin, 4),
                     below_full=counts and delta < 0, above_full=counts and delta > 0)
        delta, margin, counts = differs(s, float(heuristic["cells"][f"d{d}_k{k}"]),
                                        p["eval_rows"])
        row.update(minus_nearest_pair=round(delta, 4), nearest_pair_margin=round(margin, 4),
                   differs_from_nearest_pair=counts)
        comparisons[name][f"d{d}_k{k}"] = row
  lines = [f"Receptive field of the local arm: {p['layers']} layers x window {w} x dilation 1 = "
           f"{rf} tokens, one-sided; beyond it no path exists. Chance is {chance:.3f}. A "
           f"difference counts only when it exceeds the summed seed spread (and 2 binomial "
           f"standard errors of {p['eval_rows']} rows)."]
  if "full" in arms:
    full = arms["full"]
    worst = min(full["cells"], key=lambda c: full["cells"][c]["mean"])
    lines.append(f"Full attention: overall {fmt(full)}; its weakest cell is {worst} "
                 f"({fmt(full['cells'][worst])}).")
  if "local" in arms:
    local = arms["local"]
    if regs["beyond_field"]:
      r = local["regions"]["beyond_field"]
      above = [c for c, row in comparisons["local"].items()
               if int(c[1:].split("_")[0]) > rf and row["above_chance"]]
      lines.append(
          f"Local beyond the field (d > {rf}): "
          + ", ".join(f"K={k}: {fmt(r[str(k)])}" for k in ks)
          + (" - chance, as it must be (no path)." if not above else
             f" - ABOVE chance in {above}: a leak, check the data generator."))
    for name, what in (("one_hop", f"one hop (d <= window {w})"),
                       ("two_hops", f"inside the field but two hops away ({w} < d <= {rf})")):
      if not regs[name] or name not in local["regions"]:
        continue
      parts = []
      for k in ks:
        s = local["regions"][name][str(k)]
        text = f"K={k}: {fmt(s)}"
        if "full" in arms:
          f = arms["full"]["regions"][name][str(k)]
          delta, _, counts = differs(s, f, p["eval_rows"] * len(regs[name]))
          text += (f" vs full {fmt(f)} ({'below' if delta < 0 else 'above'} it)" if counts
                   else f" vs full {fmt(f)} (same within the spread)")
        parts.append(text)
      lines.append(f"Local, {what}: " + "; ".join(parts) + ".")
    if "full" in arms:
      falls = {}
      for k in ks:
        inside = [d for d in p["distances"] if d <= rf
                  and comparisons["local"][f"d{d}_k{k}"]["below_full"]]
        if inside:
          falls[k] = inside
      if falls:
        lines.append(
            "Where local accuracy falls below full attention INSIDE the receptive field: "
            + "; ".join(f"K={k} from d={ds[0]} (at {ds})" for k, ds in falls.items())
            + (". Distractor-free rows stay at full accuracy there" if 0 in ks and 0 not in falls
               else "") + ".")
      else:
        lines.append("Inside the receptive field local attention is never below full attention "
                     "beyond the spread.")
    infield = [f"d{d}_k{k}" for d in p["distances"] if d <= rf for k in ks if k > 0]
    same = [c for c in infield if not comparisons["local"][c]["differs_from_nearest_pair"]]
    worst = max(infield, key=lambda c: abs(comparisons["local"][c]["minus_nearest_pair"]),
                default=None)
    if worst is not None:
      gap = (f"largest gap {worst}: local {fmt(local['cells'][worst])} vs "
             f"{heuristic['cells'][worst]:.2f}")
      if len(same) >= 0.75 * len(infield):
        lines.append(
            f"Inside the field with distractors, local accuracy is what answering with the "
            f"NEAREST pair's value (keys ignored) gives, within the spread, in {len(same)} of "
            f"{len(infield)} cells ({gap}): the local model has a path to the evidence but "
            f"learned a recency rule, not the key lookup.")
      else:
        above = [c for c in infield if comparisons["local"][c]["differs_from_nearest_pair"]
                 and comparisons["local"][c]["minus_nearest_pair"] > 0]
        lines.append(
            f"Inside the field with distractors, local accuracy differs from the nearest-pair "
            f"rule (keys ignored) in {len(infield) - len(same)} of {len(infield)} cells, above "
            f"it in {len(above)} ({gap}).")
  if "global" in arms and "full" in arms:
    below = [c for c, row in comparisons["global"].items() if row["below_full"]]
    lines.append(f"Global attention on the query: overall {fmt(arms['global'])} vs full "
                 f"{fmt(arms['full'])}; "
                 + (f"below full in {len(below)} of {len(comparisons['global'])} cells: {below}."
                    if below else "never below full attention beyond the spread, at any distance "
                                  "or distractor count."))
  return lines, comparisons


_COLORS = {"local": "tab:red", "global": "tab:blue", "full": "tab:green", FULL_BAND: "tab:olive"}
_STYLES = (":", "--", "-.", (0, (1, 3)))


def plot(study: dict, path: Path) -> None:
  """Three panels: accuracy against distance per arm (mean ± sd over seeds of the mean over
  distractor counts; thin lines per count) with one window and the receptive field marked; the
  compiled step's temporary memory and its relative time against sequence length per arm."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  setup, arms, rf = study["setup"], study["arms"], study["receptive_field"]["local"]
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw=dict(width_ratios=[1.7, 1, 1]))
  ax = axes[0]
  distances = setup["distances"]
  for name, arm in arms.items():
    ax.errorbar(distances, [arm["by_distance"][str(d)]["mean"] for d in distances],
                yerr=[arm["by_distance"][str(d)]["std"] for d in distances],
                color=_COLORS[name], marker="o", markersize=4, capsize=3, linewidth=2,
                label=f"{name}: mean over K (± sd, {len(arm['seeds'])} seeds)")
    for k, style in zip(setup["distractors"], _STYLES):
      ax.plot(distances, [arm["cells"][f"d{d}_k{k}"]["mean"] for d in distances],
              color=_COLORS[name], linestyle=style, linewidth=0.9, alpha=0.7)
  for k, style in zip(setup["distractors"], _STYLES):
    ax.plot([], [], color="gray", linestyle=style, linewidth=0.9, label=f"K={k} distractors")
  ax.axvline(rf, color="black", linewidth=1.5,
             label=f"receptive field {rf} = {setup['layers']} x {setup['window']} x 1")
  ax.axvline(setup["window"], color="black", linewidth=1, linestyle="--",
             label=f"one window ({setup['window']})")
  heuristic = study.get("nearest_pair_heuristic")
  if heuristic:
    ax.plot(distances, [heuristic["by_distance"][str(d)] for d in distances], color="black",
            linestyle=(0, (4, 2)), marker="x", markersize=4, linewidth=1, alpha=0.8,
            label="nearest pair, keys ignored (exact, mean over K)")
  ax.axhline(study["chance"], color="gray", linewidth=1, linestyle=":", label="chance")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("distance from the evidence to the query (tokens)")
  ax.set_ylabel("held-out accuracy")
  ax.set_ylim(-0.02, 1.02)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="lower left")
  ax.set_title(f"key-value lookup, {setup['seq_len']}-token rows, {setup['steps']} steps",
               fontsize=10)
  cost = study.get("cost") or {}
  for name, c in cost.items():
    axes[1].plot(c["lengths"], [b / 2**20 for b in c["temp_bytes"]], color=_COLORS[name],
                 marker="o", label=name)
    axes[2].plot(c["lengths"], c["time_relative"], color=_COLORS[name], marker="o", label=name)
  for a in axes[1:]:
    a.set_xscale("log", base=2)
    a.set_xlabel("sequence length")
    a.grid(alpha=0.3)
    if cost:
      a.legend(fontsize=8)
  axes[1].set_yscale("log", base=2)
  axes[1].set_ylabel("compiled train step: temporary MiB")
  axes[1].set_title("memory (memory_analysis().temp_size_in_bytes)", fontsize=10)
  base = next(iter(cost.values()))["relative_to"] if cost else "local"
  axes[2].set_ylabel(f"step time / {base} arm's at that length")
  axes[2].set_title(f"time, arms interleaved ({setup['platform']}, {setup['cost_batch']} rows)",
                    fontsize=10)
  fig.tight_layout()
  save_figure(fig, path, dpi=110)


# ----------------------------------------------------------------------------------------------


class ArgumentError(ValueError):
  """A bad command line: `main(argv)` raises it (a ValueError); the script prints it."""


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    raise ArgumentError(message)


def parse_args(argv):
  """The arguments and the size preset (a dict). Raises ArgumentError (a ValueError) on
  anything bad."""
  parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--device", default="cpu",
                      help="size preset: cpu (default, 2 cores) or gpu (bigger)")
  parser.add_argument("--tiny", action="store_true",
                      help="the test's size (a few steps), whatever --device says")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                      help="one run per arm and seed (at least 2; default 0 1 2)")
  parser.add_argument("--steps", type=int, default=None,
                      help="training steps of every run (default: the preset's)")
  parser.add_argument("--arms", nargs="+", default=list(ARMS), help=f"a subset of {ARMS}")
  parser.add_argument("--train-max-distance", type=int, default=None,
                      help="train only on rows whose evidence is at most this far from the "
                           "query (default: seq_len - 1, every distance); a diagnostic")
  parser.add_argument("--no-cost", action="store_true", help="skip the memory/time panels")
  parser.add_argument("--out", default=str(RESULTS / "distance_distractors.json"),
                      help="results JSON; the PNG goes beside it")
  parser.add_argument("--replot", action="store_true",
                      help="only redraw the PNG from the JSON at --out")
  args = parser.parse_args(argv)
  if args.device not in ("cpu", "gpu"):
    raise ArgumentError(f"--device must be cpu or gpu, got {args.device!r}")
  if len(args.seeds) < 2:
    raise ArgumentError(f"--seeds needs at least 2 seeds for a spread, got {args.seeds}")
  if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
    raise ArgumentError(f"--seeds must be distinct ints >= 0, got {args.seeds}")
  if args.steps is not None and args.steps < 1:
    raise ArgumentError(f"--steps must be >= 1, got {args.steps}")
  if not set(args.arms) <= set(ARMS) or len(set(args.arms)) != len(args.arms):
    raise ArgumentError(f"--arms must be distinct names among {ARMS}, got {args.arms}")
  args.arms = [a for a in ARMS if a in args.arms]  # a fixed order: local first
  p = dict(PRESETS["tiny" if args.tiny else args.device])
  if args.steps is not None:
    p["steps"] = args.steps
  p["train_max_distance"] = args.train_max_distance or p["seq_len"] - 1
  if args.train_max_distance is not None and not 1 <= args.train_max_distance < p["seq_len"]:
    raise ArgumentError(f"--train-max-distance must be in [1, {p['seq_len'] - 1}], got "
                        f"{args.train_max_distance}")
  for d in p["distances"]:
    for k in p["distractors"]:
      check_cell(p["seq_len"], d, k, vocab_of(p))
  return args, p


def main(argv=None) -> int:
  args, p = parse_args(argv)
  out = Path(args.out)
  if args.replot:
    plot(json.loads(out.read_text()), out.with_suffix(".png"))
    return 0
  if args.device == "gpu" and jax.default_backend() != "gpu":
    raise ArgumentError(f"--device gpu, but JAX's backend is {jax.default_backend()!r}")
  from tqdm import tqdm
  start = time.perf_counter()
  log = lambda text: tqdm.write(f"[{time.perf_counter() - start:6.0f}s] {text}", file=sys.stderr)
  # Seeds and the cost panel repeat programs (the evaluation's, the cost panel's at the training
  # shape): a private persistent cache serves them, unless the caller set one.
  flags = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  old = {name: getattr(jax.config, name) for name in flags}
  cache = tempfile.TemporaryDirectory(prefix="distance_distractors_xla_")
  if old["jax_compilation_cache_dir"] is None:
    jax.config.update("jax_compilation_cache_dir", cache.name)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  try:
    study = run(args, p, log, start)
  finally:
    for name, value in old.items():
      jax.config.update(name, value)
    cache.cleanup()
  out.parent.mkdir(parents=True, exist_ok=True)
  atomic_write(out, json.dumps(study, indent=2) + "\n")
  plot(study, out.with_suffix(".png"))
  log(f"wrote {out} and {out.with_suffix('.png')} ({study['seconds']:.0f} s)")
  print(f"accuracy (mean ± sd over seeds {args.seeds}, mean over K = {list(p['distractors'])})")
  print(f"{'d':>5} " + "".join(f"{a:>14}" for a in study["arms"]))
  for d in p["distances"]:
    print(f"{d:>5} " + "".join(f"{s['by_distance'][str(d)]['mean']:>8.2f} ± "
                               f"{s['by_distance'][str(d)]['std']:.2f}"
                               for s in study["arms"].values()))
  for line in study["verdict"]:
    print("-", line)
  return 0


def run(args, p: dict, log, start: float) -> dict:
  from tqdm import tqdm
  chance = 1.0 / p["values"]
  local_rf = receptive_field(model_config(p, "local", p["seq_len"]))
  sets = eval_sets(p)
  log(f"{len(sets)} held-out cells x {p['eval_rows']} rows; {len(args.arms)} arms x "
      f"{len(args.seeds)} seeds x {p['steps']} steps of {p['batch']} x {p['seq_len']} tokens")
  per_arm = {arm: [] for arm in args.arms}
  losses = {arm: {} for arm in args.arms}
  seconds = {arm: 0.0 for arm in args.arms}
  with tqdm(total=len(args.arms) * len(args.seeds) * p["steps"], unit="step", desc="train",
            dynamic_ncols=True, mininterval=2.0, file=sys.stderr) as pbar:
    for seed in args.seeds:
      for arm in args.arms:
        tick = time.perf_counter()
        model, task, curve = train_arm(p, arm, seed, pbar)
        acc = evaluate(model, task, sets, batch_size=min(64, p["eval_rows"]))
        seconds[arm] += time.perf_counter() - tick
        per_arm[arm].append(acc)
        losses[arm][str(seed)] = [round(x, 4) for x in curve]
        log(f"{arm} seed {seed}: loss {np.mean(curve[-20:]):.3f} (last 20 steps), held-out "
            f"accuracy {np.mean(list(acc.values())):.3f}")
  arms = {arm: summarize(p, args.seeds, per_arm[arm], local_rf) for arm in args.arms}
  for arm in args.arms:
    arms[arm]["train_and_eval_seconds"] = round(seconds[arm], 1)
  cost = {}
  if not args.no_cost:
    variants = list(args.arms) + ([FULL_BAND] if p["cost_band_full"] and "full" in args.arms
                                  else [])
    log(f"cost: {variants} at lengths {list(p['cost_lengths'])}, {p['cost_batch']} rows")
    with tqdm(total=len(p["cost_lengths"]), unit="length", desc="cost", dynamic_ncols=True,
              file=sys.stderr) as pbar:
      cost = measure_cost(p, variants, pbar)
  heuristic = heuristic_summary(p, local_rf)
  lines, comparisons = verdict(p, arms, local_rf, chance, heuristic)
  return {
      "study": "distance_distractors",
      "metric": (f"held-out accuracy of the value predicted at the query position "
                 f"({p['values']} classes, chance {chance:.3f}); an arm's value per seed is the "
                 f"mean over {len(p['distances'])} distances x {len(p['distractors'])} distractor "
                 f"counts x {p['eval_rows']} rows"),
      "arms": arms,
      "chance": chance,
      "receptive_field": {
          "local": local_rf, "global": p["seq_len"] - 1, "full": p["seq_len"] - 1,
          "formula": "one-sided: sum over layers of window x widest dilation",
          "local_arithmetic": f"{p['layers']} layers x window {p['window']} x dilation 1 = "
                              f"{local_rf} tokens",
          "note": "global: the query attends every token in each layer (one hop); full: the "
                  "window covers the row"},
      "regions": regions(p, local_rf),
      "nearest_pair_heuristic": heuristic,
      "cost": cost,
      "verdict": lines,
      "comparisons": comparisons,
      "decision_rule": ("a difference between two means counts only when it exceeds the sum of "
                        "their seed standard deviations (ddof=1) and 2 binomial standard errors "
                        "of the held-out rows behind them; 'above chance' likewise against "
                        "1 / values"),
      "setup": {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in p.items()},
                "device": args.device, "tiny": args.tiny, "seeds": list(args.seeds),
                "arms": list(args.arms), "vocab_size": vocab_of(p).size,
                "model": "LongformerForTokenClassification (post-LN, learned positions), "
                         "logits at the query (last) position; pairs: key id + token type "
                         "1 + value",
                "training_mix": f"distance log-uniform in [1, {p['train_max_distance']}], "
                                "distractors uniform in [0, max]; AdamW, warm-up 10% then "
                                "linear decay to 0",
                "distance": "query position - evidence position",
                "full_arm": f"attention_window = seq_len, attention_impl={FULL_IMPL!r}",
                "full_band_cost_variant": "attention_window = seq_len, attention_impl='auto'",
                "global_arm": "global_attention_mask on the query token, max_global=1",
                "platform": jax.default_backend(), "devices": str(jax.devices()),
                "jax": jax.__version__},
      "train_losses": losses,
      "seconds": round(time.perf_counter() - start, 1),
  }


def cli() -> int:
  """`main`, with a bad command line as one `error:` line and status 2."""
  try:
    return main()
  except ArgumentError as e:
    print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(cli())
