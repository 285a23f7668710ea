"""The study machinery every seeded study shares (experiments/charlm_study.py's char-LM studies and
experiments/distance_distractors.py): the command line (--seeds, --steps, --device, --tiny, --out,
--replot), a bad command line as one `error:` line, an arm's per-seed values with their mean and
sd, and the results written as JSON with its PNG beside it. The results schema is
{"study", "metric", "arms": {name: {"seeds", "values", "mean", "std", ...}}, "setup", ...}.

Only the standard library and numpy are imported at the top: JAX is imported after the command
line has chosen the platform (`parse_args` pins the CPU for --device cpu).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import harness  # benchmarks/harness.py

RESULTS = Path(__file__).resolve().parent / "results"


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
