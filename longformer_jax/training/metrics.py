"""Training metrics: a JSONL log (and TensorBoard when tensorboardX is installed), and the
curves plot."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from longformer_jax.io import WriteError, append_line, atomic_write, save_figure


class DamagedLogError(RuntimeError):
  """A line of an append-only JSONL log, other than its last, is not a JSON object; the message
  names the file and the line."""


def read_log(path: Path) -> tuple[list[dict[str, Any]], int]:
  """(records, torn) of an append-only JSONL log (one JSON object per line; blank lines are
  skipped).

  torn: the bytes of a torn last line, left out of the records: a last line without its newline
  (a write cut short, e.g. by a full disk or a kill) or that is not a JSON object; 0 when there
  is none. Any other line that is not a JSON object raises `DamagedLogError` naming path:line.
  """
  data = path.read_bytes()
  *lines, tail = data.split(b"\n")  # tail: what follows the last newline
  records, torn = [], len(tail)
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line.decode("utf-8"))
      if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object")
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
      if not tail and not any(rest.strip() for rest in lines[number:]):
        torn = len(data) - sum(len(l) + 1 for l in lines[:number - 1])  # from its start
        break
      reason = (f"column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError)
                else str(e))
      raise DamagedLogError(
          f"{path}:{number}: not a JSON record ({reason}); only a torn last line is dropped on "
          "resume: remove or repair this line") from None
    records.append(record)
  return records, torn


class MetricsLog:
  """JSONL (always), TensorBoard (when tensorboardX is installed); process 0 only writes.

  On resume, records after the restored step are dropped first: the resumed run logs them
  again, and the curves show each step once. A torn last line (`read_log`) is dropped with a
  one-line warning; a damaged line before it raises `DamagedLogError`. A write that fails (a
  full disk) raises `io.WriteError` naming the file.

  TensorBoard receives the finite values only: a NaN or infinite metric (a diverging run, which
  stops with its own error) is in metrics.jsonl, and tensorboardX would print a warning of its
  own for it.
  """

  def __init__(self, workdir: Path, resume_step: int, enabled: bool = True):
    self.enabled = enabled
    self.path = workdir / "metrics.jsonl"
    self._tb = None
    if not enabled:
      return
    workdir.mkdir(parents=True, exist_ok=True)
    if self.path.exists():
      records, torn = read_log(self.path)
      if torn:
        print(f"warning: {self.path}: dropped a torn last line ({torn} bytes), what a write "
              "cut short leaves (e.g. on a full disk)", file=sys.stderr, flush=True)
      kept = [r for r in records if r.get("step", 0) <= resume_step]
      atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in kept))
    try:
      self._file = open(self.path, "a", encoding="utf-8")
    except OSError as e:
      raise WriteError(self.path, e) from None
    try:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(str(workdir / "tensorboard"))
    except OSError as e:
      self._file.close()
      raise WriteError(workdir / "tensorboard", e) from None
    except ImportError:
      print("note: tensorboardX is not installed; TensorBoard logs skipped "
            "(pip install tensorboardX); metrics.jsonl has everything.")

  def write(self, step: int, **scalars: float) -> None:
    if not self.enabled:
      return
    record = {"step": step, **{k: float(v) for k, v in scalars.items()}}
    append_line(self._file, self.path, json.dumps(record))
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and math.isfinite(v):
          self._tb.add_scalar(k, v, step)

  def close(self) -> None:
    if not self.enabled:
      return
    try:
      self._file.close()
    except OSError:
      pass  # what did not reach the file was reported by `write`
    if self._tb is not None:
      self._tb.close()


def plot_curves(metrics_path: Path, png_path: Path, keys: Sequence[str] = ("train_loss",),
                ylabel: str = "loss") -> None:
  """The metrics `keys` against step (a line per key; keys starting with "valid" get markers),
  written atomically as a PNG."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  records, _ = read_log(metrics_path)
  fig, ax = plt.subplots(figsize=(7, 4))
  for key in keys:
    points = [(r["step"], r[key]) for r in records if key in r]
    valid = key.startswith("valid")
    if points:
      ax.plot(*zip(*points), label=key, marker="o" if valid else None,
              linewidth=2 if valid else 1)
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  save_figure(fig, png_path, dpi=120)
