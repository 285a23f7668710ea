"""The study machinery every seeded study shares (experiments/charlm_study.py's char-LM studies and
experiments/distance_distractors.py): the command line (--seeds, --steps, --device, --tiny, --out,
--replot), a bad command line as one `error:` line, an arm's per-seed values with their mean and
sd, the paper's claims compared with what the seeds can resolve (`detectable_difference`,
`compare`), and the results written as JSON with its PNG beside it. The results schema is
{"study", "metric", "arms": {name: {"seeds", "values", "mean", "std", ...}}, "setup",
"comparisons", "detectable_difference", "verdict", ...}.

Only the standard library and numpy are imported at the top: JAX is imported after the command
line has chosen the platform (`parse_args` pins the CPU for --device cpu).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import harness  # benchmarks/harness.py

RESULTS = Path(__file__).resolve().parent / "results"

# Every study's comparisons: a two-sided two-sample t test at ALPHA, sized for POWER.
ALPHA = 0.05
POWER = 0.8
DETECTABLE_FORMULA = (
    "detectable difference = (t(1 - alpha/2, df) + t(power, df)) x s_pooled x sqrt(1/n_a + 1/n_b),"
    " df = n_a + n_b - 2, s_pooled^2 = ((n_a - 1) sd_a^2 + (n_b - 1) sd_b^2) / df (sd over seeds,"
    " ddof=1), t the Student t quantile; alpha 0.05 two-sided, power 0.8: the smallest true "
    "difference of two arms' means that a two-sample t test at these seed counts finds 80% of "
    "the time")
# Studies whose arms start, per seed, from the same weights and train on the same batches compare
# within each seed: a paired t test on the per-seed differences, whose spread leaves out what the
# seeds move together (experiments/frozen_weights.py: both arms continue one copied model).
PAIRED_FORMULA = (
    "detectable difference = (t(1 - alpha/2, n - 1) + t(power, n - 1)) x sd_d / sqrt(n), sd_d the"
    " sd (ddof=1) of the n per-seed differences of the two arms (same seed: same start and "
    "batches), t the Student t quantile; alpha 0.05 two-sided, power 0.8: the smallest true mean "
    "difference that a paired t test on these seeds finds 80% of the time")
DESIGNS = ("independent", "paired")
RULE = ("agree / disagree: the measured difference of the means is at least the detectable "
        "difference and goes the paper's way / the other way; cannot resolve: it is smaller (the "
        "seeds cannot tell it from no difference with the power asked)")


class ArgumentError(ValueError):
  """A bad command line (raised by `parse_args`, so `main(argv)` raises ValueError)."""


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    raise ArgumentError(message)


def make_parser(doc: str, study: str, *, device_help: str | None = None,
                replot_help: str = "no training: redo the summary and the PNG from the JSON at "
                                   "--out") -> argparse.ArgumentParser:
  """The arguments of every study: --seeds, --steps, --device, --tiny, --out (default
  experiments/results/<study>.json), --replot. A study adds its own."""
  parser = _Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                      help="one run per seed and arm (at least 2; default 0 1 2)")
  parser.add_argument("--steps", type=int, default=None,
                      help="training steps of every run (default: the size preset's)")
  harness.common_arguments(
      parser, out=str(RESULTS / f"{study}.json"), out_help="results JSON; the PNG goes beside it",
      device=True, device_help=device_help,
      tiny_help="a toy size for tests (a few steps; overrides --device's preset)")
  parser.add_argument("--replot", action="store_true", help=replot_help)
  return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
  """The checked arguments, with `args.size_name` ("tiny" or the device). Raises ArgumentError
  (a ValueError) on anything bad. Pins JAX to the CPU for --device cpu (before JAX is
  imported here)."""
  args = parser.parse_args(argv)
  try:
    harness.check_device(args.device)
    harness.check_seeds(args.seeds)
  except ValueError as e:
    raise ArgumentError(str(e)) from None
  if args.steps is not None and args.steps < 1:
    raise ArgumentError(f"--steps must be >= 1, got {args.steps}")
  args.size_name = "tiny" if args.tiny else args.device
  harness.pin_platform(args.device)
  return args


def parse_preset(doc: str, study: str, argv: Sequence[str] | None, presets: dict[str, dict],
                 arguments: Callable[[argparse.ArgumentParser], None] | None = None
                 ) -> tuple[argparse.Namespace, dict]:
  """The common arguments (`make_parser`, `parse_args`) of a study whose sizes are dicts, and a
  copy of the preset the command line picked (`args.size_name`), its "steps" set by --steps.
  `arguments(parser)` adds the study's own arguments."""
  parser = make_parser(
      doc, study, device_help="size preset: cpu (default, 2 cores) or gpu (bigger); cpu also "
                              "pins JAX to the CPU",
      replot_help="no training: recompute the comparisons, verdict and PNG from the per-seed "
                  "values in the JSON at --out")
  if arguments is not None:
    arguments(parser)
  args = parse_args(parser, argv)
  p = dict(presets[args.size_name])
  if args.steps is not None:
    p["steps"] = args.steps
  return args, p


def check_backend(device: str) -> None:
  """Raises ArgumentError when --device gpu was asked for and JAX has no GPU."""
  try:
    harness.check_backend(device)
  except ValueError as e:
    raise ArgumentError(str(e)) from None


def cli(main: Callable[[Sequence[str] | None], int]) -> int:
  """Runs `main`; a bad command line is one `error:` line and status 2 (argparse's)."""
  try:
    return main(None)
  except ArgumentError as e:
    print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
    return 2


def stats(values: Sequence[float]) -> dict:
  """{"values", "mean", "std"} (sd with ddof=1; 0 for a single value)."""
  values = [float(v) for v in values]
  return {"values": values, "mean": float(np.mean(values)),
          "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0}


def summarize(seeds: Sequence[int], values: Sequence[float]) -> dict:
  """An arm's entry: {"seeds", "values", "mean", "std"}."""
  return {"seeds": list(seeds), **stats(values)}


def detectable_difference(values_a: Sequence[float], values_b: Sequence[float], *,
                          alpha: float = ALPHA, power: float = POWER) -> float:
  """The smallest difference of two arms' means that a two-sided two-sample t test at level
  `alpha` detects with probability `power`, given these per-seed values (`DETECTABLE_FORMULA`):

      (t(1 - alpha/2, df) + t(power, df)) * s_pooled * sqrt(1/n_a + 1/n_b),
      df = n_a + n_b - 2,  s_pooled^2 = ((n_a - 1) sd_a^2 + (n_b - 1) sd_b^2) / df.

  With 3 seeds per arm (df 4) that is (2.776 + 0.941) * sqrt(2/3) = 3.035 pooled sds.
  Raises ValueError with fewer than 2 values in an arm or alpha/power outside (0, 1)."""
  a, b = np.asarray(values_a, np.float64), np.asarray(values_b, np.float64)
  if a.size < 2 or b.size < 2:
    raise ValueError(f"a detectable difference needs at least 2 values per arm, got {a.size} and "
                     f"{b.size}")
  df = a.size + b.size - 2
  pooled = np.sqrt(((a.size - 1) * np.var(a, ddof=1) + (b.size - 1) * np.var(b, ddof=1)) / df)
  return float(_sd_factor(a.size, b.size, alpha, power) * pooled)


def detectable_difference_of_sd(sd: float, n_a: int, n_b: int, *, alpha: float = ALPHA,
                                power: float = POWER) -> float:
  """`detectable_difference` for arms of n_a and n_b seeds whose pooled seed sd is `sd`: what a
  study states before it runs, from the sd of an earlier run."""
  if n_a < 2 or n_b < 2:
    raise ValueError(f"a detectable difference needs at least 2 seeds per arm, got {n_a} and "
                     f"{n_b}")
  return float(_sd_factor(n_a, n_b, alpha, power) * sd)


def detectable_paired_difference(differences: Sequence[float], *, alpha: float = ALPHA,
                                 power: float = POWER) -> float:
  """The smallest mean of per-seed differences that a two-sided paired t test at level `alpha`
  detects with probability `power`, given these differences (`PAIRED_FORMULA`):

      (t(1 - alpha/2, n - 1) + t(power, n - 1)) * sd_d / sqrt(n).

  With 6 seeds (df 5) that is (2.571 + 0.920) / sqrt(6) = 1.425 sds of the differences.
  Raises ValueError with fewer than 2 differences or alpha/power outside (0, 1)."""
  d = np.asarray(differences, np.float64)
  if d.size < 2:
    raise ValueError(f"a paired detectable difference needs at least 2 per-seed differences, got "
                     f"{d.size}")
  return detectable_paired_difference_of_sd(float(np.std(d, ddof=1)), d.size, alpha=alpha,
                                            power=power)


def detectable_paired_difference_of_sd(sd: float, n: int, *, alpha: float = ALPHA,
                                       power: float = POWER) -> float:
  """`detectable_paired_difference` for n seeds whose per-seed differences have sd `sd`: what a
  paired study states before it runs, from the differences of an earlier run."""
  from scipy import stats as scipy_stats  # a dependency of jax
  if n < 2:
    raise ValueError(f"a paired detectable difference needs at least 2 seeds, got {n}")
  _check_levels(alpha, power)
  t = scipy_stats.t.ppf(1 - alpha / 2, n - 1) + scipy_stats.t.ppf(power, n - 1)
  return float(t * sd / np.sqrt(n))


def _check_levels(alpha: float, power: float) -> None:
  if not (0 < alpha < 1 and 0 < power < 1):
    raise ValueError(f"alpha and power must be in (0, 1), got alpha={alpha}, power={power}")


def _sd_factor(n_a: int, n_b: int, alpha: float, power: float) -> float:
  """The detectable difference in pooled seed sds: (t(1 - alpha/2, df) + t(power, df)) x
  sqrt(1/n_a + 1/n_b)."""
  from scipy import stats as scipy_stats  # a dependency of jax
  _check_levels(alpha, power)
  df = n_a + n_b - 2
  t = scipy_stats.t.ppf(1 - alpha / 2, df) + scipy_stats.t.ppf(power, df)
  return float(t * np.sqrt(1 / n_a + 1 / n_b))


def outcome(difference: float, detectable: float) -> str:
  """The verdict on one claim: 'agree' or 'disagree' when |difference| >= detectable
  (difference > 0: the paper's direction), else 'cannot resolve (detectable difference X)'."""
  if abs(difference) >= detectable and difference != 0:
    return "agree" if difference > 0 else "disagree"
  return f"cannot resolve (detectable difference {detectable:.3g})"


def compare(arms: dict, claims: Sequence[tuple[str, str]], *, higher_is_better: bool,
            paper: dict | None = None, design: str = "independent") -> list[dict]:
  """One entry per paper claim (better, worse): the measured difference of the means in the
  metric's better direction (> 0: the paper's), the per-seed differences (same seed, same
  batches and initialisation), the detectable difference, and the outcome. `paper`: the paper's
  value per arm, when it gives numbers (its difference is stored beside ours). `design`:
  "independent" (two-sample t on the arms' seed spreads) or "paired" (paired t on the per-seed
  differences; the two arms must hold the same seeds in the same order)."""
  if design not in DESIGNS:
    raise ValueError(f"design={design!r}: expected one of {DESIGNS}")
  out = []
  for better, worse in claims:
    a, b = arms[better], arms[worse]
    sign = 1.0 if higher_is_better else -1.0
    paired = [sign * (va - vb) for va, vb in zip(a["values"], b["values"])]
    if design == "paired":
      if list(a["seeds"]) != list(b["seeds"]):
        raise ValueError(f"a paired comparison needs the same seeds in both arms: {better} has "
                         f"{a['seeds']}, {worse} has {b['seeds']}")
      detectable = detectable_paired_difference(paired)
    else:
      detectable = detectable_difference(a["values"], b["values"])
    entry = {"paper_says": f"{better} better than {worse}",
             "difference": sign * (a["mean"] - b["mean"]),
             "paired_differences": paired, "design": design,
             "detectable_difference": detectable}
    if paper and better in paper and worse in paper:
      entry["paper_difference"] = round(sign * (paper[better] - paper[worse]), 4)
    entry["outcome"] = outcome(entry["difference"], detectable)
    out.append(entry)
  return out


def power_summary(arms: dict, comparisons: Sequence[dict], design: str = "independent") -> dict:
  """The study's "detectable_difference" block: the formula and its settings, each claim's
  detectable difference, and "value": independent design, the detectable difference of two arms
  at the study's seed count whose seed sd is the one pooled over every arm; paired design, the
  largest of the claims' (each from the sd of its own per-seed differences, "sd_of_differences")."""
  n = min(len(arm["values"]) for arm in arms.values())
  pooled = float(np.sqrt(np.mean([np.var(arm["values"], ddof=1) for arm in arms.values()])))
  block = {"design": design, "pooled_seed_sd": pooled, "seeds_per_arm": n, "alpha": ALPHA,
           "power": POWER, "rule": RULE,
           "comparisons": {c["paper_says"]: c["detectable_difference"] for c in comparisons}}
  if design == "paired":
    return {"value": max(c["detectable_difference"] for c in comparisons), **block,
            "formula": PAIRED_FORMULA,
            "sd_of_differences": {c["paper_says"]: float(np.std(c["paired_differences"], ddof=1))
                                  for c in comparisons}}
  return {"value": _sd_factor(n, n, ALPHA, POWER) * pooled, **block,
          "formula": DETECTABLE_FORMULA}


def summarize_claims(study: dict, claims: Sequence[tuple[str, str]], *,
                     higher_is_better: bool, design: str = "independent") -> dict:
  """`study` with "comparisons" and "detectable_difference" (re)derived from its arms' per-seed
  values (so an old results JSON gains them without training anything); `design` as in
  `compare`."""
  paper = study.get("paper", {})
  paper = paper.get("values", paper) if isinstance(paper, dict) else None
  study["comparisons"] = compare(study["arms"], claims, higher_is_better=higher_is_better,
                                 paper=paper, design=design)
  study["detectable_difference"] = power_summary(study["arms"], study["comparisons"], design)
  return study


def claims_sentence(comparisons: Sequence[dict], unit: str = "") -> str:
  """One sentence per claim: the difference, the detectable difference, the outcome."""
  return "; ".join(f"{c['paper_says']}: {c['difference']:+.4f}{unit} (detectable "
                   f"{c['detectable_difference']:.4f}): {c['outcome']}" for c in comparisons)


def run_or_replot(args: argparse.Namespace, study: str, run: Callable, summarize: Callable,
                  plot: Callable[[dict, Path], None]) -> dict:
  """What a study's `main` does once its arguments are parsed. --replot: `summarize` the JSON
  at --out (its claims rederived from the stored per-seed values) and write it back with its
  PNG. Otherwise: check the backend, turn on the compilation cache, `run(log, start)` for the
  study dict (log(text) prints a timed line through tqdm), `summarize` it and write it. Returns
  the study."""
  out = Path(args.out)
  if args.replot:
    result = summarize(json.loads(out.read_text()))
    write(result, out, plot)
    return result
  check_backend(args.device)
  from tqdm import tqdm
  start = time.perf_counter()
  log = lambda text: tqdm.write(f"[{time.perf_counter() - start:6.0f}s] {text}", file=sys.stderr)
  compilation_cache(study)  # every seed repeats every arm's programs
  result = summarize(run(log, start))
  write(result, out, plot)
  log(f"wrote {out} and {out.with_suffix('.png')} ({result['seconds']:.0f} s)")
  return result


def compilation_cache(study: str) -> None:
  """Every seed of an arm compiles the same programs: the persistent cache serves the repeats."""
  harness.compilation_cache(f"{study}_xla_")


def write(study: dict, path: str | Path, plot: Callable[[dict, Path], None]) -> Path:
  """Writes the study's JSON to `path` and `plot(study, <path>.png)` beside it. Returns the
  path."""
  path = Path(path)
  harness.write_json(path, study, indent=2)
  plot(study, path.with_suffix(".png"))
  return path
