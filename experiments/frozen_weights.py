"""The paper's frozen-weights run (§5, Table 5) at CPU scale: after the position copy, does
continued MLM training need all the weights, or only the new position embeddings?

The paper makes RoBERTa long by copying its positions (experiments/position_copy.py), then
trains on 4,096-token documents. With every weight training it reaches 1.705 bits per masked
token after 65K steps; with RoBERTa's weights frozen and only the new position embeddings
training (which keeps RoBERTa's performance on short documents untouched but for the positions),
1.850. Here, for each seed, on position_copy.py's set-up (the same tokenizer, short model, copy
and long-length training, through its functions):

  1. the short RoBERTa is pretrained on `--short-len`-token rows and made `--long-len` tokens
     long by the paper's recipe;
  2. two arms continue the MLM training for `--long-steps` steps at `--long-len`, with the same
     seed, batches, masks and schedule: `all_weights`, and `positions_only`
     (`TrainConfig.trainable` = the position table: every other parameter frozen, no updates and
     no optimizer state);
  3. each trained model is scored on the held-out split in `--long-len`-token rows (the paper's
     measure) and in `--short-len`-token rows (what the frozen weights are meant to keep), as are
     the short model (short rows) and the copy before training (both).

Metric: held-out MLM bits per character (as position_copy.py). The sizes and flags are
position_copy.py's (`--device gpu` too).

Design and power, stated before the run. Both arms of a seed continue the same copied model on
the same batches, so the seeds' own spread (the short models of different seeds differ by up to
0.25 bpc) moves both arms alike: the claims are tested within seeds, by a paired t test on the
per-seed differences (`study.compare(design="paired")`). An earlier 3-seed run (per-seed
differences, long inputs +0.073, +0.042, +0.105; short +0.012, +0.021, +0.012) could not resolve
either claim with the two-sample rule (detectable 0.35 and 0.45, the short models' spread); its
differences have sds 0.031 (long) and 0.005 (short), with which 6 seeds detect 0.045 and 0.007
(`PLANNED`), below the differences it saw. So the default is seeds 0-5: 34 minutes measured on 2
cores shared with other jobs (load 5-7); the earlier run's 170 s a seed would make it 17.

    python experiments/frozen_weights.py                  # seeds 0-5
    python experiments/frozen_weights.py --device gpu

Writes experiments/results/frozen_weights.json (the studies' schema: {"study", "metric", "arms":
{name: {"seeds", "values", "mean", "std", ...}}, "setup", "comparisons",
"detectable_difference", "verdict", ...}) and frozen_weights.png.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import position_copy as base  # experiments/position_copy.py: the set-up (pins JAX to the CPU)
import study as study_lib  # experiments/study.py

import numpy as np
from flax import nnx

# The parameters the positions_only arm trains (`TrainConfig.trainable`, searched for in each
# parameter's path).
POSITIONS = r"^longformer/embeddings/position_embeddings/embedding$"
ARMS = {"all_weights": None, "positions_only": POSITIONS}

# Paper Table 5, MLM bits per masked token at 4,096 tokens, 65K steps (RoBERTa-base).
PAPER = {"unit": "MLM bits per masked token",
         "values": {"all_weights_long": 1.705, "positions_only_long": 1.850,
                    "copied_long": 1.957}}

# Both arms of a seed start from one copied model and see the same batches: compared within
# seeds (module docstring, "Design and power").
DESIGN = "paired"
SEEDS = tuple(range(6))
# Written before the run: the sd of the per-seed differences of the earlier 3-seed run, and what
# len(SEEDS) seeds detect with them (study.detectable_paired_difference_of_sd).
PLANNED = {"earlier_run_seeds": 3,
           "sd_of_differences_of_earlier_run": {"long": 0.031, "short": 0.005},
           "seeds": len(SEEDS)}

# The paper's claim (all weights train to a lower long-input BPC), and the reason it gives for
# freezing (the frozen model keeps short-input performance: it reports no number for it).
CLAIMS = (("all_weights_long", "positions_only_long"),
          ("positions_only_short", "all_weights_short"))


def verdict(study: dict) -> str:
  """Each claim's measured difference against the seeds' detectable difference (`study.RULE`),
  recomputed from the per-seed values, and how far each arm's short-input bpc moved from the
  short model's."""
  study_lib.summarize_claims(study, CLAIMS, higher_is_better=False, design=DESIGN)
  arms = study["arms"]
  long, short = study["comparisons"]
  drift = {arm: np.mean(np.subtract(arms[f"{arm}_short"]["values"],
                                    arms["short_model"]["values"]))
           for arm in ("copied", *ARMS)}
  per_seed = lambda c: ", ".join(f"{d:+.3f}" for d in c["paired_differences"])
  return (f"Long inputs: positions_only - all_weights = {long['difference']:+.3f} bpc (per seed "
          f"{per_seed(long)}), detectable difference {long['detectable_difference']:.3f}: "
          f"{long['outcome']} (paper: +0.145 bits/token, all weights better). Short inputs: "
          f"all_weights - positions_only = {short['difference']:+.3f} bpc (per seed "
          f"{per_seed(short)}), detectable difference {short['detectable_difference']:.3f}: "
          f"{short['outcome']} (the paper's reason for freezing, not a number it reports). "
          f"Short-input bpc minus the short model's, mean over seeds: "
          + ", ".join(f"{arm} {d:+.3f}" for arm, d in drift.items()) + ".")


def planned_power(seeds: int) -> dict:
  """`PLANNED` with what `seeds` seeds detect at the earlier run's sds of the differences."""
  sds = PLANNED["sd_of_differences_of_earlier_run"]
  return {**PLANNED, "seeds": seeds,
          **{f"detectable_{inputs}": study_lib.detectable_paired_difference_of_sd(sd, seeds)
             for inputs, sd in sds.items()}}


def plot(study: dict, path: Path) -> None:
  """Two panels, long and short inputs: each arm's per-seed bpc (a line per seed), mean ± sd, and
  the short model on short inputs."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  arms, setup = study["arms"], study["setup"]
  names = ("copied", *ARMS)
  labels = ["copied,\nbefore training", "all weights\ntrained", "positions only\ntrained"]
  fig, axes = plt.subplots(1, 2, figsize=(9, 4))
  for ax, inputs in zip(axes, ("long", "short")):
    values = np.array([arms[f"{n}_{inputs}"]["values"] for n in names])  # arms x seeds
    for seed_values in values.T:
      ax.plot(range(len(names)), seed_values, color="gray", alpha=0.6, marker="o", markersize=4)
    for x, n, color in zip(range(len(names)), names, ("tab:gray", "tab:blue", "tab:orange")):
      s = arms[f"{n}_{inputs}"]
      ax.errorbar(x, s["mean"], yerr=s["std"], color=color, marker="s", markersize=8,
                  capsize=6, linewidth=2, zorder=3)
    if inputs == "short":
      ax.axhline(arms["short_model"]["mean"], color="black", linestyle="--", linewidth=1,
                 label="the short model")
      ax.legend(fontsize=8)
    length = setup[f"{inputs}_len"]
    ax.set_title(f"{inputs} inputs ({length}-token rows)", fontsize=10)
    ax.set_xticks(range(len(names)), labels, fontsize=8)
    ax.set_xlim(-0.4, len(names) - 0.6)
    ax.grid(axis="y", alpha=0.3)
  axes[0].set_ylabel("held-out MLM bits per character")
  fig.suptitle(f"+{setup['long_steps']} MLM steps at {setup['long_len']} tokens, all weights vs "
               f"only the positions ({len(arms['short_model']['seeds'])} seeds, a line each; "
               f"squares: mean ± sd)", fontsize=10)
  fig.tight_layout()
  study_lib.harness.write_png(path, fig, dpi=120)


def main(argv=None) -> int:
  parser = base.size_parser(__doc__, "frozen_weights")
  parser.set_defaults(seeds=list(SEEDS))
  args = base.parse_sizes(parser, argv)
  if args.replot:
    out = Path(args.out)
    study = json.loads(out.read_text())
    study.update(paper=PAPER, verdict=verdict(study))
    study_lib.write(study, out, plot)
    print(study["verdict"])
    return 0
  start = time.perf_counter()
  study_lib.compilation_cache("frozen_weights")
  log = lambda text: print(f"[{time.perf_counter() - start:6.0f}s] {text}", flush=True)
  planned = planned_power(len(args.seeds))
  log(f"planned: {len(args.seeds)} seeds, paired, detect {planned['detectable_long']:.3f} (long) "
      f"and {planned['detectable_short']:.4f} (short) bpc at the earlier run's sds")
  log(f"training a {args.vocab}-id byte-level BPE on {base.DATASET} (train split)")
  data = base.Data(args.vocab)

  per_arm = {"short_model": []}
  per_arm.update({f"{arm}_{inputs}": [] for arm in ("copied", *ARMS)
                  for inputs in ("long", "short")})
  curves, configs, max_logit_diff = {}, {}, []
  moved = {arm: set() for arm in ARMS}  # the parameters training changed, over every seed
  for seed in args.seeds:
    short, short_losses = base.train_short(args, data, seed, log)
    per_arm["short_model"].append(data.score(short, args.short_len, args.eval_tokens))
    log(f"  short model at {args.short_len}: {per_arm['short_model'][-1]['bpc']:.3f} bpc")
    copied, difference = base.make_long(args, data, short)
    max_logit_diff.append(difference)
    models = {"copied": copied}
    curves[seed] = {"short": short_losses}
    for arm, trainable in ARMS.items():
      cfg = base.long_config(args, copied, seed, trainable=trainable)
      configs[arm] = cfg
      log(f"  {arm}: {args.long_steps} steps at {args.long_len}")
      models[arm], curves[seed][arm] = base.run_training(cfg, data.task(),
                                                         nnx.state(copied, nnx.Param))
    for arm, model in models.items():
      for inputs in ("long", "short"):
        length = getattr(args, f"{inputs}_len")
        per_arm[f"{arm}_{inputs}"].append(data.score(model, length, args.eval_tokens))
      log(f"  {arm}: {per_arm[f'{arm}_long'][-1]['bpc']:.3f} bpc at {args.long_len}, "
          f"{per_arm[f'{arm}_short'][-1]['bpc']:.3f} at {args.short_len}")
    for arm in ARMS:
      moved[arm].update(base.differing_parameters(copied, models[arm]))

  arms = {name: base.summarize(args.seeds, results) for name, results in per_arm.items()}
  a, b = (vars(configs[arm]) for arm in ARMS)
  study = {
      "study": "frozen_weights",
      "metric": (f"MLM bits per character on the first {args.eval_tokens:,} tokens of "
                 f"{base.DATASET}'s validation split (tasks.mlm); *_long in {args.long_len}-token "
                 f"rows, *_short and short_model in {args.short_len}-token rows"),
      "arms": arms,
      "setup": {**base.common_setup(args, data, max_logit_diff),
                "trainable": ARMS,
                # The two arms' TrainConfigs differ in these fields only.
                "arms_differ_in": sorted(k for k in a if a[k] != b[k]),
                "parameters_changed_by_training": {arm: len(p) for arm, p in moved.items()},
                "positions_only_changed": sorted(moved["positions_only"]),
                "design": DESIGN, "planned_power": planned},
      "paper": PAPER,
  }
  base.finish(study, curves, start, args.out, verdict, plot, log)
  for name, s in arms.items():
    print(f"{name:>22}: {s['mean']:.3f} ± {s['std']:.3f} bpc")
  print(study["verdict"])
  return 0


if __name__ == "__main__":
  sys.exit(main())
