"""What experiments/window_schedule.py and experiments/dilation.py share: char-LM arms on the
bundled text8_sample, each trained for every seed with the library's `Trainer` (`CharLMTask`, one
`Stage`) and scored with `tasks.charlm.evaluate_bpc` on the validation split; mean and sd over
seeds, the paper's claims checked against what the seeds can resolve (study.py's detectable
difference), the JSON, the PNG. The command line, the
per-seed summaries and the writing are experiments/study.py's.

Only the standard library and numpy are imported at the top: JAX (through `longformer_jax`) is
imported after the command line has chosen the platform (`--device`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import study as study_lib  # experiments/study.py

DATASET = "text8_sample"


@dataclasses.dataclass(frozen=True)
class Size:
  """One size preset: the model, the single training stage, the windows, the evaluation."""
  layers: int
  hidden: int
  heads: int
  seq_len: int
  batch: int
  steps: int
  learning_rate: float
  first_window: int      # one-sided window of the bottom layer of the "increasing" schedule
  last_window: int       # ... and of its top layer
  dilations: tuple[int, ...]  # dilation of the 2 dilated heads of the top len(dilations) layers
  eval_bytes: int | None  # validation bytes scored (None: the whole split)
  eval_batch: int = 16
  dtype: str = "float32"
  attention_impl: str = "auto"


SIZES = {
    # Tests: seconds (the dense reference attention compiles fastest).
    "tiny": Size(layers=2, hidden=32, heads=4, seq_len=64, batch=2, steps=2, learning_rate=3e-3,
                 first_window=4, last_window=12, dilations=(2,), eval_bytes=512, eval_batch=8,
                 attention_impl="reference"),
    # 2 CPU cores. Chosen before any arm was compared, from single runs of the increasing
    # windows only: for a fixed time one sequence per step and a narrow model learn fastest.
    "cpu": Size(layers=4, hidden=64, heads=4, seq_len=512, batch=1, steps=2500,
                learning_rate=5e-3, first_window=16, last_window=128, dilations=(2, 3),
                eval_bytes=65_536),
    # A GPU session: the paper's window range 32 -> 512 over 6 layers, 2,048 bytes.
    "gpu": Size(layers=6, hidden=256, heads=8, seq_len=2048, batch=16, steps=3000,
                learning_rate=2e-3, first_window=32, last_window=512, dilations=(2, 3, 4),
                eval_bytes=None, dtype="bfloat16"),
}


def make_parser(doc: str, study: str) -> argparse.ArgumentParser:
  return study_lib.make_parser(
      doc, study, device_help="one of ('cpu', 'gpu'): picks the size preset (cpu: 2 cores; gpu: "
                              "bigger); cpu also pins JAX to the CPU",
      replot_help="no training: recompute the comparisons, verdict and PNG from the per-seed "
                  "values in the JSON at --out")


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
  """The checked arguments (`study.parse_args`), with `args.size` (a `Size`) and
  `args.size_name`. Raises ValueError on anything bad."""
  args = study_lib.parse_args(parser, argv)
  size = SIZES[args.size_name]
  args.size = size if args.steps is None else dataclasses.replace(size, steps=args.steps)
  return args


# ----------------------------------------------------------------------------------------------
# Models and their attention cost


def model_config(size: Size, windows: Sequence[int], dilation=1):
  """The char LM of `size` with these per-layer one-sided windows and dilations."""
  from longformer_jax.config import CharLMConfig
  return CharLMConfig(num_hidden_layers=size.layers, hidden_size=size.hidden,
                      num_attention_heads=size.heads, intermediate_size=4 * size.hidden,
                      attention_window=tuple(windows), attention_dilation=dilation,
                      hidden_dropout_prob=0.0, dtype=size.dtype,
                      attention_impl=size.attention_impl)


def attention_cost(cfg) -> int:
  """Keys each query position scores, summed over layers and heads: a causal band of one-sided
  window w holds w + 1 keys whatever the dilation (dilation spreads them, it adds none)."""
  return sum(len(heads) * (w + 1) for w, heads in zip(cfg.layer_windows, cfg.layer_dilations))


def receptive_field(cfg) -> int:
  """How far back the top layer can see: the sum over layers of the widest reach w x d."""
  return sum(w * max(heads) for w, heads in zip(cfg.layer_windows, cfg.layer_dilations))


def describe_arm(cfg) -> dict:
  return {"windows": list(cfg.layer_windows),
          "dilations": [list(d) for d in cfg.layer_dilations],
          "attention_cost": attention_cost(cfg), "receptive_field": receptive_field(cfg)}


# ----------------------------------------------------------------------------------------------
# Training and scoring one arm for one seed


def train_and_score(cfg, size: Size, seed: int, data: dict, pbar, label: str) -> dict:
  """Trains `cfg` for `size.steps` steps with the library's Trainer and scores the validation
  bytes (sliding windows of seq_len, stride seq_len / 2). Returns {"bpc", "train_bpc" (per step),
  "train_seconds", "eval_seconds"}."""
  from longformer_jax.tasks.charlm import evaluate_bpc
  from longformer_jax.tasks import CharLMTask
  from longformer_jax.training import Stage, TrainConfig, Trainer
  train_cfg = TrainConfig(
      model=cfg, dataset=DATASET, seed=seed,
      stages=(Stage(seq_len=size.seq_len, batch_size=size.batch, steps=size.steps,
                    learning_rate=size.learning_rate, end_learning_rate=size.learning_rate / 40,
                    warmup_steps=min(100, max(1, size.steps // 10))),),
      weight_decay=0.01)
  trainer = Trainer(train_cfg, task=CharLMTask(data["train"], data["validation"]))
  state = trainer.init_state()
  start = time.perf_counter()
  train_bpc = []

  def report(step, loss):
    del step
    train_bpc.append(loss / math.log(2))
    pbar.update(1)
    pbar.set_postfix_str(f"{label} train bpc {np.mean(train_bpc[-20:]):.3f}", refresh=False)

  state, _ = trainer.fit(state, on_step=report)
  train_seconds = time.perf_counter() - start
  start = time.perf_counter()
  bpc = evaluate_bpc(trainer.model(state.params), data["eval"], context=size.seq_len,
                     stride=size.seq_len // 2, batch_size=size.eval_batch, protocol="sliding",
                     mesh=trainer.mesh)
  return {"bpc": bpc, "train_bpc": train_bpc, "train_seconds": train_seconds,
          "eval_seconds": time.perf_counter() - start}


# ----------------------------------------------------------------------------------------------
# Summaries and the verdict


def verdict(arms: dict, comparisons: list[dict], paper: dict, size: dict) -> str:
  """Which of the paper's claims the measured means confirm, contradict or cannot resolve
  (`study.RULE`, `study.detectable_difference`), and how far this scale is from the paper's."""
  groups = {"agree": [], "disagree": [], "open": []}
  for c in comparisons:
    groups[c["outcome"] if c["outcome"] in groups else "open"].append(c["paper_says"])
  n = len(comparisons)
  if len(groups["agree"]) == n:
    head = "The small-scale result agrees with the paper on every claim"
  elif groups["disagree"]:
    head = (f"The small-scale result disagrees with the paper on {len(groups['disagree'])} of "
            f"{n} claims ({', '.join(groups['disagree'])})")
  elif groups["agree"]:
    head = (f"The small-scale result agrees with the paper on {len(groups['agree'])} of {n} "
            f"claims ({', '.join(groups['agree'])}); the seeds cannot resolve the other"
            f"{'' if len(groups['open']) == 1 else 's'} ({', '.join(groups['open'])})")
  else:
    head = ("No difference reaches what the seeds can resolve at this scale: the result neither "
            "confirms nor contradicts the paper")
  parts = [f"{c['paper_says']}: {c['difference']:+.4f} bpc (detectable "
           f"{c['detectable_difference']:.4f}; paper {c['paper_difference']:+.2f}): "
           f"{c['outcome']}" for c in comparisons]
  means = [a["mean"] for a in arms.values()]
  scale = (f"Scale: these models reach {min(means):.3f}-{max(means):.3f} dev BPC after "
           f"{size['steps'] * size['batch'] * size['seq_len'] / 1e6:.1f}M training bytes "
           f"({size['size']} size, {size['layers']} layers x {size['hidden']}), the paper's "
           f"{min(paper.values()):.2f}-{max(paper.values()):.2f} after 150K steps of phase 1, so "
           f"the sizes of the differences are not comparable, only their signs")
  return f"{head}. " + "; ".join(parts) + f". {scale}. Rule: {study_lib.RULE}."


def summarize_study(study: dict, claims: Sequence[tuple[str, str]],
                    extra_verdict: Callable[[dict], str] | None = None) -> dict:
  """`study` with its comparisons, detectable difference and verdict (re)computed from its arms'
  per-seed values (lower BPC is better). extra_verdict(study): a study's own last sentence."""
  study_lib.summarize_claims(study, claims, higher_is_better=False)
  study["verdict"] = verdict(study["arms"], study["comparisons"], study["paper"]["values"],
                             study["setup"])
  if extra_verdict is not None:
    study["verdict"] += " " + extra_verdict(study)
  study["rule"] = study_lib.RULE
  return study


# ----------------------------------------------------------------------------------------------
# The study


def run_study(study: str, metric_note: str, args: argparse.Namespace, arms: dict, paper: dict,
              paper_source: str, claims: Sequence[tuple[str, str]], setup: dict,
              extra_verdict: Callable[[dict], str] | None = None) -> dict:
  """Trains every arm (name -> CharLMConfig) for every seed, writes <out>.json and <out>.png,
  prints the table and returns the study dict. paper: the paper's dev BPC of each arm;
  claims: (better, worse) pairs of arms, as the paper found them."""
  import jax
  from tqdm import tqdm
  from longformer_jax.data import load_split
  study_lib.check_backend(args.device)
  size = args.size
  start = time.perf_counter()
  study_lib.compilation_cache("charlm_study")
  data = {split: load_split(DATASET, split) for split in ("train", "validation")}
  data["eval"] = (data["validation"] if size.eval_bytes is None
                  else data["validation"][:size.eval_bytes + 1])
  results = {name: [] for name in arms}
  pbar = tqdm(total=len(args.seeds) * len(arms) * size.steps, unit="step", desc=study,
              dynamic_ncols=True, smoothing=0.05)
  try:
    for seed in args.seeds:
      for name, cfg in arms.items():
        r = train_and_score(cfg, size, seed, data, pbar, f"{name} s{seed}")
        results[name].append(r)
        pbar.write(f"[{time.perf_counter() - start:6.0f}s] {name:>10} seed {seed}: dev bpc "
                   f"{r['bpc']:.4f} (train {r['train_seconds']:.0f}s, eval "
                   f"{r['eval_seconds']:.0f}s)")
  finally:
    pbar.close()

  summary = {name: {**study_lib.summarize(args.seeds, [r["bpc"] for r in rs]),
                    **describe_arm(arms[name]),
                    "train_seconds": [round(r["train_seconds"], 1) for r in rs]}
             for name, rs in results.items()}
  every = max(size.steps // 50, 1)
  out = {
      "study": study,
      "metric": (f"dev BPC: bits per character on the first {len(data['eval']) - 1:,} "
                 f"predictions of {DATASET}'s validation split (tasks.charlm.evaluate_bpc, "
                 f"sliding windows of {size.seq_len} bytes moved {size.seq_len // 2} at a time); "
                 + metric_note),
      "arms": summary,
      "setup": {"size": args.size_name, **dataclasses.asdict(size), "seeds": list(args.seeds),
                "dataset": DATASET, "train_bytes": int(data["train"].size),
                "validation_bytes": int(data["validation"].size),
                "schedule": "linear warm-up (min(100, steps/10) steps), cosine decay to lr/40; "
                            "AdamW wd 0.01, b2 0.98, clip 1.0; no dropout",
                "params": _num_params(next(iter(arms.values()))),
                **setup, "jax": jax.__version__, "devices": str(jax.devices())},
      "paper": {"values": paper, "source": paper_source},
      "curves": {"every": every,
                 "train_bpc": {name: [[round(float(np.mean(r["train_bpc"][i:i + every])), 4)
                                       for i in range(0, size.steps, every)] for r in rs]
                               for name, rs in results.items()}},
      "seconds": round(time.perf_counter() - start, 1),
  }
  write(summarize_study(out, claims, extra_verdict), Path(args.out))
  return out


def write(study: dict, path: Path) -> None:
  """<path> (JSON) and its PNG; prints the table."""
  study_lib.write(study, path, plot)
  print(table(study))
  print(f"wrote {path} and {path.with_suffix('.png')} ({study['seconds'] / 60:.1f} minutes "
        f"to run)")


def _num_params(cfg) -> int:
  from flax import nnx
  from longformer_jax.causal_lm import LongformerForCausalLM, num_params
  return int(num_params(nnx.eval_shape(lambda: LongformerForCausalLM(cfg, rngs=nnx.Rngs(0)))))


def table(study: dict) -> str:
  width = max(len(name) for name in study["arms"])
  lines = [f"{study['study']}: {study['metric'].split(':')[0]}, mean ± sd over seeds "
           f"{study['setup']['seeds']}",
           f"{'arm':>{width}}  {'mean ± sd':>17}  {'paper':>5}  per seed"]
  for name, arm in study["arms"].items():
    lines.append(f"{name:>{width}}  {arm['mean']:.4f} ± {arm['std']:.4f}  "
                 f"{study['paper']['values'].get(name, float('nan')):5.2f}  "
                 + ", ".join(f"{v:.4f}" for v in arm["values"]))
  for c in study["comparisons"]:
    lines.append(f"  paper: {c['paper_says']}: measured difference {c['difference']:+.4f} "
                 f"(detectable {c['detectable_difference']:.4f}) -> {c['outcome']}")
  lines.append("verdict: " + study["verdict"])
  return "\n".join(lines)


def plot(study: dict, path: Path) -> None:
  """Left: training BPC (mean over seeds, smoothed) per arm; right: dev BPC bars (mean ± sd)
  with every seed's value as a point."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  arms, curves = study["arms"], study["curves"]
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4),
                                    gridspec_kw={"width_ratios": [3, 2]})
  for i, name in enumerate(arms):
    runs = np.array(curves["train_bpc"][name])
    x = (np.arange(runs.shape[1]) + 1) * curves["every"]
    mean = runs.mean(axis=0)
    left.plot(x, mean, color=colors[i % len(colors)], label=name)
    left.fill_between(x, runs.min(axis=0), runs.max(axis=0), color=colors[i % len(colors)],
                      alpha=0.15, linewidth=0)
  tail = np.concatenate([np.array(curves["train_bpc"][n])[:, len(x) // 3:].ravel()
                         for n in arms])
  left.set_ylim(np.min(tail) - 0.05, np.max(tail) + 0.05)
  left.set_xlabel("step")
  left.set_ylabel("training bits per character")
  left.set_title("training (mean of seeds; band: min-max)", fontsize=10)
  left.legend(fontsize=8)
  left.grid(alpha=0.3)
  for i, arm in enumerate(arms.values()):
    color = colors[i % len(colors)]
    right.bar(i, arm["mean"], yerr=arm["std"], color=color, alpha=0.5, capsize=6)
    jitter = np.linspace(-0.15, 0.15, len(arm["values"]))
    right.scatter(i + jitter, arm["values"], color=color, edgecolor="black", zorder=3, s=25)
  values = [v for arm in arms.values() for v in arm["values"]]
  pad = max(np.ptp(values), 0.01)
  right.set_ylim(min(values) - 2 * pad, max(values) + pad)
  right.set_xticks(range(len(arms)), list(arms), fontsize=9)
  right.set_ylabel("dev bits per character")
  right.set_title("final dev BPC (bar: mean ± sd; dots: seeds)", fontsize=10)
  right.grid(axis="y", alpha=0.3)
  setup = study["setup"]
  fig.suptitle(f"{study['study']}: {setup['size']} size, {setup['layers']} layers x "
               f"{setup['hidden']}, {setup['steps']} steps of {setup['batch']} x "
               f"{setup['seq_len']} bytes, {len(setup['seeds'])} seeds", fontsize=11)
  fig.tight_layout()
  study_lib.harness.write_png(path, fig, dpi=110)


def replot(args: argparse.Namespace, claims: Sequence[tuple[str, str]],
           extra_verdict: Callable[[dict], str] | None = None) -> int:
  """--replot: the comparisons, verdict, table and PNG anew from the per-seed values stored in
  the JSON at --out (no training)."""
  path = Path(args.out)
  write(summarize_study(json.loads(path.read_text()), claims, extra_verdict), path)
  return 0
