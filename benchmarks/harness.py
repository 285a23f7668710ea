"""What the scripts in benchmarks/ and experiments/ share: their common arguments (--out, --device,
--tiny, --budget-s), pinning the platform before JAX starts, the persistent compilation cache,
the stamp of a result (platform, device, jax, date, commit), the summary of ours against a peer
timed side by side in interleaved rounds (`side_by_side`, its table and plot), and writing a
result as JSON, markdown and a PNG through `longformer_jax.io` (atomically: a kill never leaves
half a file).

It lives beside the scripts, not in the package: importing anything from `longformer_jax` imports
JAX, and a script must pin the platform (`pin_platform`, after parsing its command line) before
JAX is imported; the suite's torch child processes never import JAX at all. Only the standard
library is imported at the top. benchmarks/ scripts find it beside them; experiments/ scripts put
benchmarks/ on sys.path.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

REPO = pathlib.Path(__file__).resolve().parent.parent
BENCH_RESULTS = REPO / "benchmarks" / "results"
DEVICES = ("cpu", "gpu")

_CACHES: list[tempfile.TemporaryDirectory] = []


# ----------------------------------------------------------------------------------------------
# The command line


def default_out() -> str:
  """Where a benchmark writes when --out is not given: $OUT (a device session's output folder),
  else benchmarks/results."""
  return os.environ.get("OUT") or str(BENCH_RESULTS)


def common_arguments(parser: argparse.ArgumentParser, *, out: str | None,
                     out_help: str = "output directory", device: bool = False,
                     device_help: str | None = None, tiny_help: str | None = None,
                     budget_s: float | None | bool = False, budget_help: str | None = None
                     ) -> argparse.ArgumentParser:
  """Adds the arguments every script spells the same way: --out (default `out`), and where
  asked, --device (cpu or gpu, default cpu), --tiny (help `tiny_help`) and --budget-s (default
  `budget_s`; False leaves it out). Returns the parser."""
  parser.add_argument("--out", default=out, help=out_help)
  if device:
    parser.add_argument("--device", default="cpu",
                        help=device_help or f"one of {DEVICES}: picks the size preset; cpu also "
                                            "pins JAX to the CPU")
  if tiny_help is not None:
    parser.add_argument("--tiny", action="store_true", help=tiny_help)
  if budget_s is not False:
    parser.add_argument("--budget-s", type=float, default=budget_s,
                        help=budget_help or "wall-clock budget in seconds")
  return parser


def check_device(device: str) -> str:
  """`device` if it is one of DEVICES; raises ValueError naming it otherwise."""
  if device not in DEVICES:
    raise ValueError(f"--device must be one of {DEVICES}, got {device!r}")
  return device


def check_seeds(seeds: Sequence[int]) -> list[int]:
  """At least 2 distinct seeds >= 0 (a spread needs two); raises ValueError otherwise."""
  if len(seeds) < 2:
    raise ValueError(f"--seeds needs at least 2 seeds for a spread, got {list(seeds)}")
  if len(set(seeds)) != len(seeds):
    raise ValueError(f"--seeds has a repeated seed: {list(seeds)}")
  if min(seeds) < 0:
    raise ValueError(f"--seeds must be >= 0, got {list(seeds)}")
  return list(seeds)


def pin_platform(device: str) -> None:
  """For device "cpu", JAX runs on the CPU (unless the caller chose a platform): call it before
  JAX is imported. Any other device leaves JAX's choice alone."""
  if device == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def check_backend(device: str) -> None:
  """Raises ValueError when --device gpu was asked for but JAX has no GPU backend."""
  import jax
  if device == "gpu" and jax.default_backend() != "gpu":
    raise ValueError(f"--device gpu, but JAX's backend is {jax.default_backend()!r}")


# ----------------------------------------------------------------------------------------------
# The compilation cache


def compilation_cache(prefix: str = "bench_xla_") -> None:
  """XLA's persistent compilation cache in a temporary directory that lives as long as the
  process, so that repeated programs (every seed of an arm, every repetition of a row) compile
  once. A cache the process already has is kept: JAX reads the setting once per process, so a
  second directory would never be read, and deleting the first would break its writes."""
  import jax
  if jax.config.jax_compilation_cache_dir:
    return
  _CACHES.append(tempfile.TemporaryDirectory(prefix=prefix))
  jax.config.update("jax_compilation_cache_dir", _CACHES[-1].name)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# ----------------------------------------------------------------------------------------------
# The stamp of a result


def today() -> str:
  """The date a result carries (ISO, local time)."""
  return datetime.date.today().isoformat()


def commit() -> str | None:
  """The repository's HEAD commit (short), or None outside a git checkout."""
  try:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                            capture_output=True, timeout=10, check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  return (result.stdout.strip() or None) if result.returncode == 0 else None


def stamp() -> dict:
  """Where and when a result was measured: platform (JAX's backend), device kind, jax version,
  date, commit, python. Imports JAX."""
  import jax
  return dict(platform=jax.default_backend(), device=jax.devices()[0].device_kind,
              jax=jax.__version__, date=today(), commit=commit(),
              python=platform.python_version())


# ----------------------------------------------------------------------------------------------
# Two rows side by side in interleaved rounds (the rounds themselves: attention.py's
# `interleaved_rounds`)


def side_by_side(names: Sequence[str], times, loads, *, tokens_per_step: int | None = None,
                 ours: int = 0, peer: int = 1) -> dict:
  """Summary of interleaved rounds of two rows, ours and a peer, as `interleaved_rounds`
  returns them (times[row] = one list of seconds per round; loads = (1-minute load average
  before, after) per round).

  Each row: its fastest and median call over all rounds, its fastest call per round, and
  (with `tokens_per_step`) tokens/s at the fastest and median call. `speedup`: the peer's time
  over ours (= our tokens/s over the peer's, > 1: ours faster), per round from each row's
  fastest call in that round (both saw that round's load), with its median and range; also by
  the fastest and by the median calls overall.
  """
  if len(names) != len(times):
    raise ValueError(f"{len(names)} row names for {len(times)} rows of times")
  if not times[ours] or len(times[ours]) != len(times[peer]):
    raise ValueError(f"rows {ours} and {peer} need the same number of rounds (>= 1), got "
                     f"{len(times[ours])} and {len(times[peer])}")
  rows = []
  for name, rounds in zip(names, times):
    flat = [t for r in rounds for t in r]
    row = dict(row=name, fastest_ms=round(min(flat) * 1e3, 3),
               median_ms=round(statistics.median(flat) * 1e3, 3),
               per_round_fastest_ms=[round(min(r) * 1e3, 3) for r in rounds], calls=len(flat))
    if tokens_per_step is not None:
      row["tokens_per_s_fastest"] = round(tokens_per_step / min(flat), 1)
      row["tokens_per_s_median"] = round(tokens_per_step / statistics.median(flat), 1)
    rows.append(row)
  per_round = [min(p) / min(o) for o, p in zip(times[ours], times[peer])]
  a, b = rows[ours], rows[peer]
  speedup = dict(per_round=[round(x, 3) for x in per_round],
                 median=round(statistics.median(per_round), 3), min=round(min(per_round), 3),
                 max=round(max(per_round), 3),
                 by_fastest=round(b["fastest_ms"] / a["fastest_ms"], 3),
                 by_median=round(b["median_ms"] / a["median_ms"], 3))
  return dict(ours=names[ours], peer=names[peer], rows=rows, speedup=speedup,
              load_before_after_per_round=[list(x) for x in loads])


def side_by_side_markdown(summary: dict) -> str:
  """The rows of `side_by_side` as a markdown table, the speed-up and the loads under it."""
  tokens = "tokens_per_s_fastest" in summary["rows"][0]
  head = "| row | fastest ms | median ms | fastest ms per round |"
  head += " tokens/s (fastest / median) |" if tokens else ""
  lines = [head, "|" + " --- |" * (head.count("|") - 1)]
  for r in summary["rows"]:
    line = (f"| {r['row']} | {r['fastest_ms']:,.1f} | {r['median_ms']:,.1f} | "
            + ", ".join(f"{x:,.1f}" for x in r["per_round_fastest_ms"]) + " |")
    if tokens:
      line += f" {r['tokens_per_s_fastest']:,.0f} / {r['tokens_per_s_median']:,.0f} |"
    lines.append(line)
  s = summary["speedup"]
  loads = ", ".join(f"{a}->{b}" for a, b in summary["load_before_after_per_round"])
  lines += ["", f"{summary['peer']} takes {s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}] the "
                f"time of {summary['ours']} per round (median [range] over "
                f"{len(s['per_round'])} rounds, fastest call of each row in each round); "
                f"{s['by_fastest']:.2f}x by the fastest calls, {s['by_median']:.2f}x by the "
                f"medians. Load average (1 min) before->after each round: {loads}."]
  return "\n".join(lines)


def plot_side_by_side(path: str | os.PathLike, summary: dict, title: str) -> pathlib.Path:
  """The per-round speed-up (the peer's time over ours) with the load average beside it."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ratios = summary["speedup"]["per_round"]
  rounds = list(range(1, len(ratios) + 1))
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(rounds, ratios, "o-", label="the peer's time / ours (fastest call of each)")
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set(xlabel="round", ylabel="speed-up of ours (per round)", title=title)
  ax.set_xticks(rounds)
  load = ax.twinx()
  load.plot(rounds, [a for a, _ in summary["load_before_after_per_round"]], "s--", color="C1",
            alpha=0.6, label="load average before the round")
  load.set_ylabel("1-minute load average")
  fig.legend(loc="lower center", fontsize=7, ncol=2)
  fig.tight_layout(rect=(0, 0.08, 1, 1))
  return write_png(path, fig)


def warm_up(rows, steps: int) -> dict:
  """Runs each row's step `steps` times untimed (the first compiles; steps return a loss, a float
  or a 0-d array/tensor); returns each row's first loss. Non-finite losses stop the run."""
  first = {}
  for name, _, run in rows:
    started = time.perf_counter()
    losses = [run() for _ in range(max(steps, 1))]
    losses = [float(x.detach() if hasattr(x, "detach") else x) for x in losses]  # torch or jax
    if not all(math.isfinite(x) for x in losses):
      raise FloatingPointError(f"{name}: warm-up losses {losses}")
    first[name] = losses[0]
    print(f"  warm-up {name}: {time.perf_counter() - started:.1f} s, first loss {losses[0]:.4f}",
          flush=True)
  return first


def write_side_by_side(path: str | os.PathLike, result: dict, md: str, title: str) -> None:
  """Writes a side-by-side result as JSON, its markdown and the per-round plot, and prints them."""
  path = pathlib.Path(path)
  write_json(path, result)
  write_text(path.with_suffix(".md"), md)
  png = plot_side_by_side(path.with_suffix(".png"), result["summary"], title)
  print(md, flush=True)
  print_written(path, path.with_suffix(".md"), png)


# ----------------------------------------------------------------------------------------------
# The torch flex_attention peer (torch is imported by the caller: none here at import time)


def flex_sliding_window(torch, seq: int, window: int, *, causal: bool, device: str,
                        compile_attention: bool):
  """torch `flex_attention` with the block mask of our band on [B, H, N, D]: keys i-w..i+w, or
  i-w..i when causal. Returns (block_mask, flex), flex compiled when `compile_attention`.

  On CUDA the mask is made by a compiled `create_block_mask`, as torch's docs advise. Eager, it
  evaluates the mask on every query-key pair at once. At 65,536 tokens on an 80 GB H100 the
  peer asked for a 32 GiB temporary (8 bytes per pair) and ran out of memory."""
  from torch.nn.attention.flex_attention import create_block_mask, flex_attention

  def sliding(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx <= window) & (q_idx - kv_idx >= (0 if causal else -window))

  make_mask = torch.compile(create_block_mask) if device == "cuda" else create_block_mask
  mask = make_mask(sliding, None, None, seq, seq, device=device)
  flex = torch.compile(flex_attention, dynamic=False) if compile_attention else flex_attention
  return mask, flex


# ----------------------------------------------------------------------------------------------
# Writing results


def json_default(x):
  """JSON for what json cannot write: arrays as lists, dataclasses as dicts, else str."""
  if hasattr(x, "tolist"):
    return x.tolist()
  import dataclasses
  if dataclasses.is_dataclass(x):
    return dataclasses.asdict(x)
  return str(x)


def to_json(obj, *, indent: int | None = 1) -> str:
  """`obj` as JSON text ending in a newline; arrays become lists, dataclasses dicts, anything
  else its str."""
  return json.dumps(obj, indent=indent, default=json_default) + "\n"


def write_json(path: str | os.PathLike, obj, *, indent: int | None = 1) -> pathlib.Path:
  """Writes `to_json(obj)` to `path` atomically (its folder created). Returns the path."""
  from longformer_jax.io import atomic_write
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  atomic_write(path, to_json(obj, indent=indent))
  return path


def write_text(path: str | os.PathLike, text: str) -> pathlib.Path:
  """Writes `text` (a newline added if missing) to `path` atomically. Returns the path."""
  from longformer_jax.io import atomic_write
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  atomic_write(path, text if text.endswith("\n") else text + "\n")
  return path


def write_png(path: str | os.PathLike, fig, *, dpi: int = 110) -> pathlib.Path:
  """Writes a matplotlib figure as a PNG atomically and closes it. Returns the path."""
  from longformer_jax.io import save_figure
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  save_figure(fig, path, dpi=dpi)
  return path


def print_written(*paths: str | os.PathLike, file=None) -> None:
  print("wrote " + ", ".join(str(p) for p in paths), file=file or sys.stdout, flush=True)
