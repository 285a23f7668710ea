"""Long-range lookup among distractors: a path to the evidence vs a model that uses it.

A synthetic key-value lookup whose evidence sits at a controlled distance from the query, among
distractors of the same form (the data, the task and the models: experiments/distance_task.py).
Each row is `seq_len` tokens of random filler holding `K + 1` pairs with distinct keys; the last
token is the query, a key id. The label is the value of the pair whose key is the query's (the
evidence); the other `K` pairs are distractors. The evidence sits exactly `d` positions before
the query, the distractors at random other positions (nearer or farther). A pair is ONE position
(its token id is the key, its token type `1 + value`), so `d` is one number and the lookup is a
content match of the query against the keys; with pairs spelled as two tokens a 2-layer model
with learned absolute positions must also learn to bind neighbours.
`LongformerForTokenClassification` classifies the value from the query position's final state;
chance is 1 / values.

Arms (the same model shape, data, steps and seeds; the library's models and Trainer):
  local   a sliding window of `window` per side in every layer, no global token;
  global  the same window plus global attention on the query token, as the paper makes the
          question global for QA (the query attends every token, every token attends it);
  full    a window as long as the row (LongformerConfig has no dense switch, a band covering the
          row is full attention), computed densely by the op's "reference" implementation: the
          same numbers as the band op, cheaper on a CPU than the chunked band with
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
steps of 16 rows (full attention learns the key lookup late in training; longer rows need more
steps than a CPU run affords). gpu: 1,024-token rows, window 32, hidden 128, 4,000 steps of 64
rows. tiny: the test's (a few steps).

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

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import study as study_lib  # experiments/study.py

# --device gpu must see the GPU; anything else runs on the CPU (set before JAX is imported).
study_lib.harness.pin_platform(
    "gpu" if any(a in ("gpu", "--device=gpu") for a in sys.argv[1:]) else "cpu")

import jax
import numpy as np

from distance_task import (ARMS, FULL_BAND, FULL_IMPL, check_cell, distance_axes, eval_sets,
                           evaluate, measure_cost, model_config, nearest_pair_accuracy,
                           receptive_field, train_arm, vocab_of)

STUDY = "distance_distractors"
# Overall held-out accuracy, (better, worse): a global token or full attention reaches the
# evidence beyond the local field (the paper's reason for global attention, §3.1).
CLAIMS = (("global", "local"), ("full", "local"))

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
# Summaries, verdict, plot


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
  stats = study_lib.stats
  return {
      **study_lib.summarize(seeds, overall),
      "by_distance": {str(d): stats([np.mean([acc[(d, k)] for k in ks]) for acc in per_seed])
                      for d in p["distances"]},
      "by_distractors": {str(k): stats([np.mean([acc[(d, k)] for d in p["distances"]])
                                        for acc in per_seed]) for k in ks},
      "regions": {name: {str(k): stats([np.mean([acc[(d, k)] for d in ds]) for acc in per_seed])
                         for k in ks}
                  for name, ds in regions(p, rf).items() if ds},
      "cells": {f"d{d}_k{k}": stats([acc[(d, k)] for acc in per_seed]) for d, k in cells},
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
  distance_axes(ax, setup, legend_size=7)
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
  study_lib.harness.write_png(path, fig, dpi=110)


# ----------------------------------------------------------------------------------------------


def with_claims(study: dict) -> dict:
  """`study` with "comparisons" (the overall accuracy of the arm pairs in `CLAIMS`, against the
  detectable difference of the seeds) and "detectable_difference" derived from its per-seed
  values, and the verdict's last line saying so. A results JSON of an older version (per-cell
  comparisons under "comparisons") gets them moved to "cell_comparisons"."""
  if "cell_comparisons" not in study:
    study["cell_comparisons"] = study.pop("comparisons")
  claims = [c for c in CLAIMS if set(c) <= set(study["arms"])]
  if claims:
    study_lib.summarize_claims(study, claims, higher_is_better=True)
    head = "Overall accuracy against what the seeds can resolve (two-sample): "
    study["verdict"] = [line for line in study["verdict"] if not line.startswith(head)] + [
        head + study_lib.claims_sentence(study["comparisons"]) + "."]
  return study


def parse_args(argv):
  """The arguments and the size preset (a dict). Raises study.ArgumentError (a ValueError) on
  anything bad."""
  parser = study_lib.make_parser(
      __doc__, STUDY, device_help="size preset: cpu (default, 2 cores) or gpu (bigger)",
      replot_help="only redraw the PNG from the JSON at --out")
  parser.add_argument("--arms", nargs="+", default=list(ARMS), help=f"a subset of {ARMS}")
  parser.add_argument("--train-max-distance", type=int, default=None,
                      help="train only on rows whose evidence is at most this far from the "
                           "query (default: seq_len - 1, every distance); a diagnostic")
  parser.add_argument("--no-cost", action="store_true", help="skip the memory/time panels")
  args = study_lib.parse_args(parser, argv)
  if not set(args.arms) <= set(ARMS) or len(set(args.arms)) != len(args.arms):
    raise study_lib.ArgumentError(f"--arms must be distinct names among {ARMS}, got {args.arms}")
  args.arms = [a for a in ARMS if a in args.arms]  # a fixed order: local first
  p = dict(PRESETS[args.size_name])
  if args.steps is not None:
    p["steps"] = args.steps
  p["train_max_distance"] = args.train_max_distance or p["seq_len"] - 1
  if args.train_max_distance is not None and not 1 <= args.train_max_distance < p["seq_len"]:
    raise study_lib.ArgumentError(f"--train-max-distance must be in [1, {p['seq_len'] - 1}], got "
                        f"{args.train_max_distance}")
  for d in p["distances"]:
    for k in p["distractors"]:
      check_cell(p["seq_len"], d, k, vocab_of(p))
  return args, p


def main(argv=None) -> int:
  args, p = parse_args(argv)
  # Seeds and the cost panel repeat programs (the evaluation's, the cost panel's at the training
  # shape): the persistent cache serves them.
  study = study_lib.run_or_replot(args, STUDY, lambda log, start: run(args, p, log, start),
                                  with_claims, plot)
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
  lines, cell_comparisons = verdict(p, arms, local_rf, chance, heuristic)
  return {
      "study": STUDY,
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
      "cell_comparisons": cell_comparisons,
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


if __name__ == "__main__":
  sys.exit(study_lib.cli(main))
