"""The paper's position-copy claim (§5, Table 5) at CPU scale, end to end.

The paper makes RoBERTa long by copying its 512 learned position embeddings over the 4,096 new
ones, and reports MLM BPC (bits per masked token) 1.957 right after the copy against 10.299 with
randomly initialised new positions, 1.753 after 2K more MLM steps. Here, for each seed:

  1. a byte-level BPE (`--vocab` ids) is trained on the bundled enwik8_sample's train split (once);
  2. a tiny RoBERTa-style masked LM (our `LongformerForMaskedLM` with `--short-len` positions and a
     window covering them: full attention, i.e. a RoBERTa) is pretrained on `--short-len`-token
     sequences for `--short-steps` steps, then exported as an HF `RobertaForMaskedLM` (checked to
     compute the same logits);
  3. it is made long (`--long-len` tokens, one-sided window `--window`) two ways: by the paper's
     recipe, `convert.roberta_to_longformer` (positions copied, global projections copied), and
     the same with every position row drawn anew from N(0, initializer_range) (HF's
     initialisation of an embedding table);
  4. both are scored on the held-out (validation) split in `--long-len`-token rows, then trained
     for `--long-steps` more MLM steps on `--long-len`-token sequences and scored again.

Metric: bits per character of the masked tokens (`tasks.mlm`: total -log2 p over the masked
targets / their UTF-8 bytes); bits per masked token (the paper's unit) and the loss are stored
too. Every model is scored on the same targets (masks keyed by row, seed 0). Training uses the
project's `Trainer` and `MLMTask` (the sharded step, the masking, the schedule); the seed sets the
short model's initialisation, its batches and masks, the random position table and the continued
training's batches.

Sizes. The effect needs a short model that relies on word order, and a tiny post-LN RoBERTa
learns to slowly: with many learned positions and few steps it stays a bag-of-words model
(copied = random). Fewer positions and more, smaller steps help, so the default is a 16-token
RoBERTa made 128 tokens long: the paper's 8x (512 -> 4,096), with its window of half the original
length per side. The vocabulary matters most: with a 300-id BPE (nearly bytes: a masked token is
well predicted from its neighbours, if the model knows which they are) and 1,600 steps, the short
model's held-out bpc rose by 1.67 when its position ids were shuffled within each row (seed 0);
with 512 ids, by 0.33 (`position_dependence`, stored in the JSON; a higher learning rate, 4e-3,
did not train at all). Learning to use the positions is a sudden drop of the loss that comes
later in some seeds than in others: at 1,600 steps seed 1 had not made it (shuffling cost 0.04),
at 3,200 (the default) it had (2.1).

    python experiments/position_copy.py                  # 3 seeds
    python experiments/position_copy.py --seeds 0 1 2 3 4
    python experiments/position_copy.py --device gpu     # 4x the lengths, 4 layers, hidden 256

Writes experiments/results/position_copy.json ({"study", "metric", "arms": {name: {"seeds",
"values", "mean", "std", ...}}, "position_dependence", "paired_differences", "setup",
"comparisons", "detectable_difference", "verdict", ...}) and position_copy.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import numpy as np
from flax import nnx

from longformer_jax import LongformerConfig, convert
from longformer_jax.data import tokenized
from longformer_jax.data.tokenizer import special_ids
from longformer_jax.training import Stage, TrainConfig, Trainer
from longformer_jax.tasks.mlm import MLMTask
import study as study_lib  # experiments/study.py

RESULTS = Path(__file__).resolve().parent / "results"
DATASET = "enwik8_sample"
EVAL_SEED = 0  # the held-out masks: the same targets for every model and seed


def short_config(args, vocab_size: int) -> LongformerConfig:
  """A RoBERTa-style model: learned positions for `short_len` tokens, attention over all of them
  (a window as long as the sequence is full attention)."""
  return LongformerConfig(
      vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
      num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
      max_position_embeddings=args.short_len + 2, attention_window=args.short_len,
      hidden_dropout_prob=0.0, type_vocab_size=1)


def run_training(cfg: TrainConfig, task: MLMTask, params=None, log=None):
  """`cfg`'s single stage with the project's Trainer, in memory (`Trainer.fit`: no checkpoints;
  the model is scored in this process); returns (trained model, [loss per step])."""
  trainer = Trainer(cfg, task=task)
  steps = cfg.stages[0].steps
  losses = []

  def report(step, loss):
    losses.append(loss)
    if log is not None and step % max(steps // 4, 1) == 0:
      log(f"    step {step}/{steps}: loss {np.mean(losses[-20:]):.3f}")

  state, losses = trainer.fit(trainer.init_state(params), on_step=report)
  return trainer.model(state.params), losses


def to_roberta(model):
  """Our short model as an HF `RobertaForMaskedLM` (the same weights: a Longformer whose window
  covers its positions is a RoBERTa with global projections it never uses)."""
  import transformers
  c = model.config
  roberta = transformers.RobertaForMaskedLM(transformers.RobertaConfig(
      vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
      num_attention_heads=c.num_attention_heads, intermediate_size=c.intermediate_size,
      hidden_act=c.hidden_act, hidden_dropout_prob=c.hidden_dropout_prob,
      attention_probs_dropout_prob=0.0, max_position_embeddings=c.max_position_embeddings,
      type_vocab_size=c.type_vocab_size, initializer_range=c.initializer_range,
      layer_norm_eps=c.layer_norm_eps, pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id,
      eos_token_id=c.eos_token_id))
  weights = convert.to_hf(model).state_dict()
  roberta.load_state_dict(
      {("roberta." + k.removeprefix("longformer.")) if k.startswith("longformer.") else k: v
       for k, v in weights.items() if "_global" not in k}, strict=True)
  return roberta.eval()


def check_same_logits(model, roberta, ids_BxN: np.ndarray) -> float:
  """Max |difference| of the two models' logits on `ids_BxN` (both in inference mode)."""
  import torch
  model.eval()
  ours = np.asarray(model(ids_BxN).logits)
  with torch.no_grad():
    theirs = roberta(torch.as_tensor(ids_BxN, dtype=torch.long)).logits.numpy()
  return float(np.max(np.abs(ours - theirs)))


def with_random_positions(model, seed: int):
  """`model` (a copy) with every position row (after RoBERTa's padding rows) drawn from
  N(0, initializer_range): the paper's "random" arm."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  pure = nnx.to_pure_dict(params)
  table = np.array(pure["longformer"]["embeddings"]["position_embeddings"]["embedding"])
  offset = model.config.pad_token_id + 1
  rng = np.random.default_rng(seed)
  table[offset:] = rng.normal(0.0, model.config.initializer_range, table[offset:].shape)
  pure["longformer"]["embeddings"]["position_embeddings"]["embedding"] = table
  params = jax.tree.map(lambda x: x, params)
  nnx.replace_by_pure_dict(params, pure)
  return nnx.merge(graphdef, params, rest)


class ShuffledPositions(nnx.Module):
  """`model` scored with the position ids of each row's real tokens permuted at random (a fixed,
  seeded permutation per batch row; padding keeps its id): how much the model relies on word
  order. `keys_BxN`: the uniform draws whose ranks are the permutation, one row per batch row."""

  def __init__(self, model, keys_BxN: np.ndarray):
    self.model = model
    self.keys_BxN = nnx.Variable(jax.numpy.asarray(keys_BxN, jax.numpy.float32))

  def __call__(self, input_ids_BxN, attention_mask_BxN=None, **kwargs):
    jnp = jax.numpy
    pad = self.model.config.pad_token_id
    real_BxN = input_ids_BxN != pad
    # Real tokens (a packed row's prefix) rank first: their ranks are a permutation of 0..n-1.
    keys_BxN = jnp.where(real_BxN, self.keys_BxN[...], 2.0)
    rank_BxN = jnp.argsort(jnp.argsort(keys_BxN, axis=1), axis=1)
    position_ids_BxN = jnp.where(real_BxN, rank_BxN + pad + 1, pad)
    return self.model(input_ids_BxN, attention_mask_BxN, position_ids=position_ids_BxN,
                      **kwargs)


def position_dependence(task: MLMTask, model, stream: np.ndarray, *, seq_len: int,
                        max_tokens: int, seed: int) -> dict:
  """Held-out MLM bpc of `model` in `seq_len`-token rows with its positions as they are and with
  each row's position ids shuffled (`ShuffledPositions`, permutations drawn from `seed`): the
  same rows, masks and targets. All rows go in one batch, so every row has its own permutation."""
  rows = len(tokenized.pack(np.asarray(stream)[:max_tokens], seq_len, task.specials))
  keys_BxN = np.random.default_rng(seed).random((rows, seq_len))
  ordered, shuffled = (task.score(m, stream, seq_len=seq_len, seed=EVAL_SEED, batch_size=rows,
                                  max_tokens=max_tokens)["bpc"]
                       for m in (model, ShuffledPositions(model, keys_BxN)))
  return {"ordered": ordered, "shuffled": shuffled}


def summarize(seeds, results: list[dict]) -> dict:
  values = [r["bpc"] for r in results]
  return {**study_lib.summarize(seeds, values),
          "min": float(np.min(values)), "max": float(np.max(values)),
          "bits_per_token": [r["bits_per_token"] for r in results],
          "loss": [r["loss"] for r in results]}


def plot(study: dict, path: Path) -> None:
  """Two panels (before / after the continued training): each seed's pair of long models (copied,
  random) joined by a line, the means with their standard deviations, and the short model."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  arms, setup = study["arms"], study["setup"]
  fig, axes = plt.subplots(1, 2, figsize=(8, 4), sharey=True)
  titles = {"before": f"made long to {setup['long_len']} tokens",
            "after": f"+{setup['long_steps']} MLM steps at {setup['long_len']}"}
  short = arms["short_model"]
  for ax, (when, title) in zip(axes, titles.items()):
    copied, random = arms[f"copied_{when}"], arms[f"random_{when}"]
    for a, b in zip(copied["values"], random["values"]):  # one line per seed
      ax.plot([0, 1], [a, b], color="gray", alpha=0.6, marker="o", markersize=4)
    for x, s, color in ((0, copied, "tab:blue"), (1, random, "tab:red")):
      ax.errorbar(x, s["mean"], yerr=s["std"], color=color, marker="s", markersize=8,
                  capsize=6, linewidth=2, zorder=3)
    ax.axhline(short["mean"], color="black", linestyle="--", linewidth=1,
               label=f"short model at {setup['short_len']} tokens")
    ax.set_xticks([0, 1], ["positions\ncopied", "positions\nrandom"])
    ax.set_xlim(-0.4, 1.4)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
  axes[0].set_ylabel("held-out MLM bits per character")
  axes[0].legend(fontsize=8, loc="upper left")
  fig.suptitle(f"Copied vs random positions ({len(short['seeds'])} seeds, a line each; squares: "
               f"mean ± sd)",
               fontsize=11)
  fig.tight_layout()
  study_lib.harness.write_png(path, fig, dpi=120)


# Sizes per device (`--device`); any of them can still be set by its own flag. The GPU size is
# 4x longer everywhere (a 64-token RoBERTa made 512 long, 8x as in the paper), 4 layers, hidden
# 256, and trains 4x as many steps.
DEVICE_SIZES = {
    "cpu": {},
    "gpu": dict(vocab=300, hidden=256, layers=4, heads=4, short_len=64, short_steps=12800,
                short_batch=64, long_len=512, long_steps=600, long_batch=16,
                eval_tokens=262_144),
}


# Paper Table 5 (RoBERTa-base made 4,096 long), MLM bits per masked token.
PAPER = {"unit": "MLM bits per masked token", "random_before": 10.299, "copied_before": 1.957,
         "copied_after_2k_steps": 1.753, "copied_after_65k_steps": 1.705}


# The paper's claim, before and after the continued training: copied beats random (lower bpc).
CLAIMS = (("copied_before", "random_before"), ("copied_after", "random_after"))


def verdict(study: dict) -> str:
  """Whether copied positions beat random ones, before and after training (`study.RULE`: agree
  or disagree only when the difference reaches the detectable difference of the seeds).
  Recomputes `study`'s comparisons and detectable difference from its per-seed values."""
  study_lib.summarize_claims(study, CLAIMS, higher_is_better=False)
  lines = []
  for c, when in zip(study["comparisons"], ("before", "after")):
    paired = study["paired_differences"][when]["values"]
    lines.append(f"{when} training: random - copied = {c['difference']:+.3f} bpc, detectable "
                 f"difference {c['detectable_difference']:.3f}: {c['outcome']}; per seed "
                 f"{', '.join(f'{d:+.3f}' for d in paired)}")
  # Both arms are scored on the same targets, so this ratio is also that of bits per token.
  arms = study["arms"]
  ratio = arms["random_before"]["mean"] / arms["copied_before"]["mean"]
  paper = PAPER["random_before"] / PAPER["copied_before"]
  return "; ".join(lines) + (f". Before training, random / copied = {ratio:.2f} (paper: "
                             f"{paper:.2f}).")


def size_parser(doc: str, study: str) -> argparse.ArgumentParser:
  """The command line of the studies built on this set-up (this one, experiments/
  frozen_weights.py): --device's size preset, every size flag, --seeds, --out, --replot."""
  parser = argparse.ArgumentParser(description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--device", choices=sorted(DEVICE_SIZES), default="cpu",
                      help="the size preset (the flags below override its values)")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--vocab", type=int, default=300, help="BPE vocabulary size")
  parser.add_argument("--hidden", type=int, default=128)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--short-len", type=int, default=16)
  parser.add_argument("--short-steps", type=int, default=3200)
  parser.add_argument("--short-batch", type=int, default=32)
  parser.add_argument("--short-lr", type=float, default=2e-3)
  parser.add_argument("--long-len", type=int, default=128)
  parser.add_argument("--window", type=int, default=None,
                      help="one-sided window of the long model (default short-len / 2: the "
                           "paper's 512-token RoBERTa got a 512 total window)")
  parser.add_argument("--long-steps", type=int, default=150)
  parser.add_argument("--long-batch", type=int, default=4)
  parser.add_argument("--long-lr", type=float, default=5e-4)
  parser.add_argument("--eval-tokens", type=int, default=32_768,
                      help="held-out tokens scored (the validation split's first)")
  study_lib.harness.common_arguments(parser, out=str(RESULTS / f"{study}.json"),
                                     out_help="results JSON; the PNG goes beside it")
  parser.add_argument("--replot", action="store_true",
                      help="only redraw the PNG from the JSON at --out")
  return parser


def parse_sizes(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
  """`parser`'s arguments with --device's preset as the defaults; a bad value is a
  `parser.error` naming it (before anything is computed)."""
  device, _ = parser.parse_known_args(argv)
  parser.set_defaults(**DEVICE_SIZES[device.device])
  args = parser.parse_args(argv)
  for name in ("vocab", "hidden", "layers", "heads", "short_len", "short_steps", "short_batch",
               "long_len", "long_steps", "long_batch", "eval_tokens"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if len(set(args.seeds)) != len(args.seeds) or len(args.seeds) < 2:
    # Two at least: the verdict weighs the difference against the spread over seeds.
    parser.error(f"--seeds must be distinct and at least two, got {args.seeds}")
  if args.long_len <= args.short_len:
    parser.error(f"--long-len ({args.long_len}) must exceed --short-len ({args.short_len}): the "
                 f"model is made longer")
  args.window = args.window or args.short_len // 2
  return args


class Data:
  """The BPE tokenizer (`vocab` ids, trained on the train split) and both splits' token ids; the
  MLM task and the held-out scorer every model of these studies goes through."""

  def __init__(self, vocab: int):
    self.tokenizer = tokenized.train_bpe(tokenized.text_of(DATASET, "train"), vocab)
    self.streams = {split: tokenized.encode_documents(self.tokenizer,
                                                      tokenized.text_of(DATASET, split),
                                                      special_ids(self.tokenizer).eos)
                    for split in ("train", "validation")}
    self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

  def task(self) -> MLMTask:
    return MLMTask(self.tokenizer, train_ids=self.streams["train"],
                   valid_ids=self.streams["validation"])

  def score(self, model, seq_len: int, max_tokens: int) -> dict:
    """Held-out MLM scores of `model` in `seq_len`-token rows (masks keyed by EVAL_SEED)."""
    return self.task().score(model, self.streams["validation"], seq_len=seq_len, seed=EVAL_SEED,
                             batch_size=max(1, 2048 // seq_len), max_tokens=max_tokens)

  def setup(self) -> dict:
    return {"dataset": DATASET, "tokenizer_ids": self.vocab_size,
            "train_tokens": int(self.streams["train"].size),
            "validation_tokens": int(self.streams["validation"].size)}


def train_short(args, data: Data, seed: int, log):
  """The short RoBERTa of seed `seed`, pretrained on `args.short_len`-token rows; returns (model,
  losses)."""
  log(f"seed {seed}: pretraining the short model ({args.short_steps} steps of "
      f"{args.short_batch} x {args.short_len} tokens)")
  cfg = TrainConfig(
      model=short_config(args, data.vocab_size), dataset=DATASET, seed=seed,
      stages=(Stage(seq_len=args.short_len, batch_size=args.short_batch, steps=args.short_steps,
                    learning_rate=args.short_lr, warmup_steps=max(args.short_steps // 10, 1),
                    end_learning_rate=0.0, decay_power=1.0),),
      weight_decay=0.01, adam_b2=0.98, adam_eps=1e-6)
  return run_training(cfg, data.task(), log=log)


def make_long(args, data: Data, short):
  """`short` made `args.long_len` tokens long by the paper's recipe (through HF's RoBERTa, checked
  to compute `short`'s logits); returns (long model, max |logit difference| of the export)."""
  roberta = to_roberta(short)
  probe = np.asarray(tokenized.pack(data.streams["validation"][:args.short_len * 2],
                                    args.short_len, special_ids(data.tokenizer))[:2])
  difference = check_same_logits(short, roberta, probe)
  return (convert.roberta_to_longformer(roberta, max_positions=args.long_len,
                                        window=args.window), difference)


def long_config(args, model, seed: int, trainable: str | None = None) -> TrainConfig:
  """The continued MLM training at `args.long_len` (`trainable`: `TrainConfig.trainable`)."""
  return TrainConfig(
      model=model.config, dataset=DATASET, seed=seed,
      stages=(Stage(seq_len=args.long_len, batch_size=args.long_batch, steps=args.long_steps,
                    learning_rate=args.long_lr, warmup_steps=max(args.long_steps // 10, 1),
                    end_learning_rate=0.0, decay_power=3.0),),
      weight_decay=0.01, adam_b2=0.98, adam_eps=1e-6, trainable=trainable)


def differing_parameters(a, b) -> list[str]:
  """Paths (`schedule.param_path`) of the parameters whose values differ between models a and b
  (of the same structure)."""
  from longformer_jax.training.schedule import param_path
  flat = lambda m: {param_path(p): np.asarray(x) for p, x
                    in jax.tree_util.tree_leaves_with_path(nnx.state(m, nnx.Param))}
  fa, fb = flat(a), flat(b)
  return sorted(p for p in fa if not np.array_equal(fa[p], fb[p]))


def dependence_summary(seeds, results: list[dict]) -> dict:
  """The short models' reliance on word order: ordered and shuffled bpc per seed
  (`position_dependence`), and shuffled - ordered."""
  ordered, shuffled = ([r[k] for r in results] for k in ("ordered", "shuffled"))
  gaps = [s - o for o, s in zip(ordered, shuffled)]
  return {"seeds": list(seeds), "ordered": ordered, "shuffled": shuffled,
          "shuffled_minus_ordered": gaps, "mean_shuffled_minus_ordered": float(np.mean(gaps)),
          "how": "held-out MLM bpc of the short model in short_len-token rows, its position ids "
                 "as they are vs each row's real-token position ids permuted at random (numpy "
                 "seed = the study seed; the same rows, masks and targets)"}


def common_setup(args, data: Data, max_logit_diff: list[float]) -> dict:
  """The setup every study on this set-up records: its arguments, the data, the HF export check,
  the software and devices."""
  return {**{k: v for k, v in vars(args).items() if k not in ("out", "replot")}, **data.setup(),
          "short_model_vs_hf_roberta_max_logit_difference": max(max_logit_diff),
          "jax": jax.__version__, "devices": str(jax.devices())}


def finish(study: dict, curves: dict, start: float, out, verdict, plot, log) -> Path:
  """`study` completed with the training curves, the run time and `verdict(study)`, written to
  `out` with its PNG (`plot`)."""
  study["train_losses"] = {str(seed): {k: [round(x, 4) for x in v] for k, v in c.items()}
                           for seed, c in curves.items()}
  study["seconds"] = round(time.perf_counter() - start, 1)
  study["verdict"] = verdict(study)
  out = study_lib.write(study, out, plot)
  log(f"wrote {out} and {out.with_suffix('.png')}")
  return out


def main(argv=None) -> int:
  parser = size_parser(__doc__, "position_copy")
  args = parse_sizes(parser, argv)
  if args.replot:
    out = Path(args.out)
    study = json.loads(out.read_text())
    study.update(paper=PAPER, verdict=verdict(study))  # derived from the stored values
    study_lib.write(study, out, plot)
    print(study["verdict"])
    return 0
  start = time.perf_counter()
  study_lib.compilation_cache("position_copy")  # every arm and seed compiles the same programs
  log = lambda text: print(f"[{time.perf_counter() - start:6.0f}s] {text}", flush=True)

  log(f"training a {args.vocab}-id byte-level BPE on {DATASET} (train split)")
  data = Data(args.vocab)
  log(f"{data.streams['train'].size:,} train and {data.streams['validation'].size:,} validation "
      f"tokens")

  per_arm = {name: [] for name in ("short_model", "copied_before", "random_before",
                                   "copied_after", "random_after")}
  curves, max_logit_diff, dependence, differ = {}, [], [], set()
  for seed in args.seeds:
    short, short_losses = train_short(args, data, seed, log)
    per_arm["short_model"].append(data.score(short, args.short_len, args.eval_tokens))
    dependence.append(position_dependence(data.task(), short, data.streams["validation"],
                                          seq_len=args.short_len, max_tokens=args.eval_tokens,
                                          seed=seed))
    log(f"  short model at {args.short_len}: {dependence[-1]['ordered']:.3f} bpc, "
        f"{dependence[-1]['shuffled']:.3f} with its positions shuffled")

    copied, difference = make_long(args, data, short)
    max_logit_diff.append(difference)
    arms = {"copied": copied, "random": with_random_positions(copied, seed)}
    differ.update(differing_parameters(arms["copied"], arms["random"]))
    curves[seed] = {"short": short_losses}
    for arm, model in arms.items():
      per_arm[f"{arm}_before"].append(data.score(model, args.long_len, args.eval_tokens))
      log(f"  {arm} positions at {args.long_len}, before: "
          f"{per_arm[f'{arm}_before'][-1]['bpc']:.3f} bpc")
      trained, losses = run_training(long_config(args, model, seed), data.task(),
                                     nnx.state(model, nnx.Param))
      curves[seed][arm] = losses
      per_arm[f"{arm}_after"].append(data.score(trained, args.long_len, args.eval_tokens))
      log(f"  {arm} positions at {args.long_len}, after {args.long_steps} steps: "
          f"{per_arm[f'{arm}_after'][-1]['bpc']:.3f} bpc")

  arms = {name: summarize(args.seeds, results) for name, results in per_arm.items()}
  study = {
      "study": "position_copy",
      "metric": (f"MLM bits per character on the first {args.eval_tokens:,} tokens of "
                 f"{DATASET}'s validation split: sum of -log2 p over the masked tokens / their "
                 f"UTF-8 bytes (tasks.mlm); short_model in {args.short_len}-token rows, the "
                 f"others in {args.long_len}-token rows"),
      "arms": arms,
      "position_dependence": dependence_summary(args.seeds, dependence),
      # Per seed, the same short model made long both ways: random minus copied (bpc).
      "paired_differences": {
          when: {"seeds": list(args.seeds),
                 "values": [r["bpc"] - c["bpc"] for r, c in zip(per_arm[f"random_{when}"],
                                                               per_arm[f"copied_{when}"])]}
          for when in ("before", "after")},
      "setup": {**common_setup(args, data, max_logit_diff),
                "masked_targets_scored": per_arm["copied_before"][0]["masked_tokens"],
                "random_positions": "every position row drawn from N(0, initializer_range)",
                "arms_differ_in": sorted(differ)},
      "paper": PAPER,
  }
  finish(study, curves, start, args.out, verdict, plot, log)
  for name, s in arms.items():
    print(f"{name:>14}: {s['mean']:.3f} ± {s['std']:.3f} bpc "
          f"({np.mean(s['bits_per_token']):.3f} bits per masked token)")
  for when, d in study["paired_differences"].items():
    print(f"random - copied, {when}: {', '.join(f'{v:+.3f}' for v in d['values'])} bpc")
  print(f"shuffled - ordered positions (short model): "
        f"{', '.join(f'{v:+.3f}' for v in study['position_dependence']['shuffled_minus_ordered'])}"
        f" bpc")
  return 0


if __name__ == "__main__":
  sys.exit(main())
