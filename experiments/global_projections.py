"""The paper's separate projections for global attention (§3.1) at CPU scale.

The paper gives global attention its own linear projections Q_g, K_g, V_g, initialised as copies
of the local Q, K, V, and calls them "critical for best performance on downstream tasks" (§3.1;
its WikiHop ablation, §6: dev accuracy 73.8 with them, 72.2 without, 65.5 without them and
without global attention). Here a long-range task where the
evidence lies beyond the reach of the local windows, so that only global attention can carry it
to the answer: the key-value lookup of experiments/distance_task.py (a query token, the last of
the row, asks for the value of its key; the evidence pair sits `d` tokens before it among `K`
distractor pairs of the same form), the query token global, as the paper makes the question
global for QA. Three arms, equal in everything but the factor:

  separate   global attention on the query through its own Q_g, K_g, V_g, which start as copies
             of the local Q, K, V (`LongformerSelfAttention.copy_local_to_global`): the paper's;
  shared     global attention on the query through the local Q, K, V
             (`LongformerConfig(global_projections="shared")`): the ablation;
  no_global  no global attention (`global_projections="none"`, no global mask).

For each seed ONE model is drawn (the separate arm's, its global projections set to copies of the
local ones) and every arm starts from it: shared and no_global take the same band weights without
the global copies. So at step 0 separate and shared compute the same function, and the arms
differ only in whether the global projections may move apart from the local ones (and whether
there is global attention at all). Each arm then trains on the same batches (seed-keyed) for the
same steps with the library's `Trainer` (`distance_task.RetrievalTask`). The models are trained
from scratch, not fine-tuned from a pretrained encoder: the paper's claim is about fine-tuning
RoBERTa; this checks the mechanism at a scale a CPU can train.

Metric: held-out accuracy on rows whose evidence is BEYOND the local receptive field (distance
> layers x window; no band path reaches the query), mean over those distances and the distractor
counts. Training rows mix all distances (log-uniform in [1, seq_len - 1]) and 0 to max
distractors. The claims are checked against the detectable difference of the seeds
(experiments/study.py).

Sizes (`--device`): cpu (default): 128-token rows, window 8 (field 16), 2 layers x 64 (4 heads),
1,500 steps of 16 rows, 3 seeds: 21 minutes measured on 2 cores shared with another job; gpu:
1,024-token rows, window 32, hidden 128, 4,000 steps of 64 rows; --tiny: seconds, for the
tests.

    python experiments/global_projections.py                    # cpu size, seeds 0 1 2
    python experiments/global_projections.py --device gpu --seeds 0 1 2 3 4

Writes experiments/results/global_projections.json ({"study", "metric", "arms": {name: {"seeds",
"values", "mean", "std", "by_distance", "cells", "global_attention", "global_projections",
"params", "initial_band_checksum", ...}}, "comparisons", "detectable_difference", "setup",
"paper", "verdict"}) and global_projections.png.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import study as study_lib  # experiments/study.py

STUDY = "global_projections"
# arm -> (the task's arm: global mask on the query or not, LongformerConfig.global_projections)
ARMS = {"separate": ("global", "separate"), "shared": ("global", "shared"),
        "no_global": ("local", "none")}
# (better, worse) as the paper has it: separate projections beat shared ones (§3.1 and the WikiHop
# ablation of §6), and global attention beats none when the evidence is out of the windows' reach.
CLAIMS = (("separate", "shared"), ("separate", "no_global"), ("shared", "no_global"))
PAPER_SOURCE = ("Beltagy, Peters, Cohan 2020 (arXiv 2004.05150v2) §3.1: the separate global "
                "projections are 'critical for best performance on downstream tasks'; §6, the "
                "WikiHop ablation: dev accuracy of the base model fine-tuned at 4,096 tokens")
# The WikiHop ablation's dev accuracy (the arms' analogues: the paper's "no linear proj." and
# "no linear proj. no global atten.").
PAPER = {"values": {"separate": 73.8, "shared": 72.2, "no_global": 65.5},
         "unit": "WikiHop dev accuracy (%)", "source": PAPER_SOURCE}

PRESETS = {
    "cpu": dict(seq_len=128, window=8, layers=2, hidden=64, heads=4, intermediate=256,
                keys=32, values=8, fillers=32, steps=1500, batch=16, lr=2e-3,
                distances=(4, 8, 16, 24, 32, 48, 64, 96, 127), distractors=(0, 4, 16),
                eval_rows=128),
    "gpu": dict(seq_len=1024, window=32, layers=2, hidden=128, heads=4, intermediate=512,
                keys=64, values=16, fillers=64, steps=4000, batch=64, lr=1e-3,
                distances=(16, 32, 64, 96, 128, 256, 512, 768, 1023), distractors=(0, 8, 32),
                eval_rows=256),
    "tiny": dict(seq_len=32, window=4, layers=2, hidden=32, heads=2, intermediate=64,
                 keys=8, values=4, fillers=8, steps=3, batch=8, lr=2e-3,
                 distances=(4, 8, 16, 31), distractors=(0, 3), eval_rows=8),
}


def parse_args(argv: Sequence[str] | None):
  """The arguments and the size preset (a dict). Raises study.ArgumentError on anything bad."""
  args, p = study_lib.parse_preset(__doc__, STUDY, argv, PRESETS)
  p["train_max_distance"] = p["seq_len"] - 1
  return args, p


def beyond_field(p: dict) -> list[int]:
  """The measured distances no band path covers: beyond layers x window (dilation 1)."""
  return [d for d in p["distances"] if d > p["layers"] * p["window"]]


def arm_config(p: dict, arm: str):
  """The arm's model: distance_task's local model with the arm's global projections."""
  import distance_task
  return distance_task.model_config(p, "local", p["seq_len"]).replace(
      global_projections=ARMS[arm][1])


def initial_params(p: dict, seed: int) -> dict[str, dict]:
  """Every arm's starting parameters for `seed` (pure dicts): one model of the separate arm with
  its global projections set to copies of the local ones; the other arms take its parameters
  without the global projections."""
  from flax import nnx
  from longformer_jax.modeling import LongformerForTokenClassification
  model = LongformerForTokenClassification(arm_config(p, "separate"), rngs=nnx.Rngs(seed))
  for layer in model.longformer.layers:
    layer.attention.copy_local_to_global()
  full = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  band = nnx.to_pure_dict(nnx.filter_state(
      nnx.state(model, nnx.Param), lambda path, _: not str(path[-2]).endswith("_global")))
  return {arm: full if projections == "separate" else band
          for arm, (_, projections) in ARMS.items()}


def band_checksum(params: dict) -> float:
  """A fingerprint of the parameters every arm has (all but the global projections): the sum
  of their absolute values in float64. Equal across arms of a seed: the same starting point."""
  import jax
  leaves = jax.tree_util.tree_leaves_with_path(params)
  return float(sum(np.abs(np.asarray(x, np.float64)).sum() for path, x in leaves
                   if not any(str(getattr(k, "key", k)).endswith("_global") for k in path)))


def num_params(params: dict) -> int:
  import jax
  return int(sum(np.size(x) for x in jax.tree.leaves(params)))


def summarize_arm(p: dict, seeds: Sequence[int], per_seed: list[dict]) -> dict:
  """An arm's accuracies: the metric per seed (mean over the cells beyond the field), and per
  distance (mean over distractor counts) and per cell, each as values, mean and sd."""
  far = beyond_field(p)
  ks = p["distractors"]
  stats = study_lib.stats
  return {
      **study_lib.summarize(seeds, [np.mean([acc[(d, k)] for d in far for k in ks])
                                    for acc in per_seed]),
      "by_distance": {str(d): stats([np.mean([acc[(d, k)] for k in ks]) for acc in per_seed])
                      for d in p["distances"]},
      "cells": {f"d{d}_k{k}": stats([acc[(d, k)] for acc in per_seed])
                for d in p["distances"] for k in ks}}


def verdict(study: dict) -> str:
  """The claims against the seeds' detectable difference, in one paragraph."""
  arms, setup = study["arms"], study["setup"]
  fmt = lambda a: f"{a['mean']:.3f} ± {a['std']:.3f}"
  head = (f"Accuracy beyond the local field (d > {setup['receptive_field']}), chance "
          f"{setup['chance']:.3f}: " + ", ".join(f"{n} {fmt(a)}" for n, a in arms.items()))
  claims = study_lib.claims_sentence(study["comparisons"])
  sep = study["comparisons"][0]
  if sep["outcome"] == "agree":
    end = ("Separate global projections beat global attention through the local ones, as the "
           "paper says")
  elif sep["outcome"] == "disagree":
    end = ("Global attention through the local projections beats separate ones: the opposite "
           "of the paper's claim")
  else:
    end = ("Whether separate global projections beat shared ones is not resolved at this "
           "scale: the difference is below what the seeds can detect")
  return (f"{head}. {claims}. {end}. The models are trained from one shared start, not "
          f"fine-tuned from a pretrained encoder as in the paper. Rule: {study_lib.RULE}.")


def summarize_study(study: dict) -> dict:
  study_lib.summarize_claims(study, CLAIMS, higher_is_better=True)
  study["verdict"] = verdict(study)
  return study


_COLORS = {"separate": "tab:blue", "shared": "tab:orange", "no_global": "tab:red"}


def plot(study: dict, path: Path) -> None:
  """Left: accuracy against distance per arm (mean over distractor counts, ± sd over seeds),
  the local field marked; right: the metric per arm (bar: mean ± sd; dots: seeds)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import distance_task
  setup, arms = study["setup"], study["arms"]
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2),
                                    gridspec_kw={"width_ratios": [3, 2]})
  distances = setup["distances"]
  for name, arm in arms.items():
    left.errorbar(distances, [arm["by_distance"][str(d)]["mean"] for d in distances],
                  yerr=[arm["by_distance"][str(d)]["std"] for d in distances],
                  color=_COLORS[name], marker="o", markersize=4, capsize=3, label=name)
  left.axvline(setup["receptive_field"], color="black", linewidth=1,
               label=f"local field {setup['receptive_field']}")
  left.axhline(setup["chance"], color="gray", linestyle=":", linewidth=1, label="chance")
  distance_task.distance_axes(left, setup, legend_size=8)
  for i, (name, arm) in enumerate(arms.items()):
    right.bar(i, arm["mean"], yerr=arm["std"], color=_COLORS[name], alpha=0.5, capsize=6)
    right.scatter(i + np.linspace(-0.15, 0.15, len(arm["values"])), arm["values"],
                  color=_COLORS[name], edgecolor="black", zorder=3, s=25)
  right.axhline(setup["chance"], color="gray", linestyle=":", linewidth=1)
  right.set_xticks(range(len(arms)), list(arms))
  right.set_ylim(0, 1.05)
  right.set_ylabel(f"accuracy beyond the field (d > {setup['receptive_field']})")
  first = study["comparisons"][0]  # separate vs shared: the paper's claim
  right.set_title(f"bar: mean ± sd; dots: seeds\nseparate - shared {first['difference']:+.3f}, "
                  f"detectable {first['detectable_difference']:.3f}", fontsize=10)
  right.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  study_lib.harness.write_png(path, fig, dpi=110)


def run(args, p: dict, log, start: float) -> dict:
  import jax
  from tqdm import tqdm
  import distance_task
  far = beyond_field(p)
  if not far:
    raise ValueError(f"no measured distance lies beyond the local field "
                     f"{p['layers'] * p['window']}: {p['distances']}")
  for d in p["distances"]:
    for k in p["distractors"]:
      distance_task.check_cell(p["seq_len"], d, k, distance_task.vocab_of(p))
  sets = distance_task.eval_sets(p)
  per_arm = {arm: [] for arm in ARMS}
  extra = {arm: {"seconds": 0.0, "checksum": [], "params": None} for arm in ARMS}
  losses = {arm: {} for arm in ARMS}
  with tqdm(total=len(ARMS) * len(args.seeds) * p["steps"], unit="step", desc=STUDY,
            dynamic_ncols=True, mininterval=2.0, file=sys.stderr) as pbar:
    for seed in args.seeds:
      starts = initial_params(p, seed)
      for arm, (task_arm, _) in ARMS.items():
        tick = time.perf_counter()
        model, task, curve = distance_task.train_arm(
            p, task_arm, seed, pbar, model=arm_config(p, arm), params=starts[arm])
        acc = distance_task.evaluate(model, task, sets, batch_size=min(64, p["eval_rows"]))
        extra[arm]["seconds"] += time.perf_counter() - tick
        extra[arm]["checksum"].append(band_checksum(starts[arm]))
        extra[arm]["params"] = num_params(starts[arm])
        per_arm[arm].append(acc)
        losses[arm][str(seed)] = [round(x, 4) for x in curve]
        log(f"{arm} seed {seed}: loss {np.mean(curve[-20:]):.3f} (last 20 steps), accuracy "
            f"beyond the field {np.mean([acc[(d, k)] for d in far for k in p['distractors']]):.3f}")
  arms = {}
  for arm, (task_arm, projections) in ARMS.items():
    arms[arm] = {**summarize_arm(p, args.seeds, per_arm[arm]),
                 "global_attention": task_arm == "global", "global_projections": projections,
                 "params": extra[arm]["params"],
                 "initial_band_checksum": extra[arm]["checksum"],
                 "train_and_eval_seconds": round(extra[arm]["seconds"], 1)}
  rf = p["layers"] * p["window"]
  seconds = round(time.perf_counter() - start, 1)
  return {
      "study": STUDY,
      "metric": (f"held-out accuracy of the value predicted at the query position "
                 f"({p['values']} classes) on rows whose evidence is beyond the local receptive "
                 f"field (d in {far} > {rf}), mean over those distances x distractor counts "
                 f"{list(p['distractors'])} x {p['eval_rows']} rows"),
      "arms": arms,
      "paper": PAPER,
      "setup": {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in p.items()},
                "size": args.size_name, "device": args.device, "seeds": list(args.seeds),
                "receptive_field": rf, "chance": 1.0 / p["values"],
                "beyond_field": far,
                "task": "experiments/distance_task.py's key-value lookup, the query token "
                        "global (max_global=1) in the separate and shared arms",
                "start": "one model per seed; global projections = copies of the local ones; "
                         "shared and no_global start from the same band weights",
                "training_mix": f"distance log-uniform in [1, {p['train_max_distance']}], "
                                "distractors uniform in [0, max]; AdamW, warm-up 10% then "
                                "linear decay to 0",
                "seconds": seconds, "minutes": round(seconds / 60, 1),
                "platform": jax.default_backend(), "devices": str(jax.devices()),
                "jax": jax.__version__, **study_lib.harness.stamp()},
      "train_losses": losses,
      "seconds": seconds,
  }


def main(argv: Sequence[str] | None = None) -> int:
  args, p = parse_args(argv)
  study = study_lib.run_or_replot(args, STUDY, lambda log, start: run(args, p, log, start),
                                  summarize_study, plot)
  for name, arm in study["arms"].items():
    print(f"{name:>10}: {arm['mean']:.3f} ± {arm['std']:.3f}  per seed "
          + ", ".join(f"{v:.3f}" for v in arm["values"]))
  print(study["verdict"])
  return 0


if __name__ == "__main__":
  sys.exit(study_lib.cli(main))
