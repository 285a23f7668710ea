"""Training metrics: a JSONL log (and TensorBoard when tensorboardX is installed), and the
curves plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from longformer_jax.io import atomic_write, save_figure


class MetricsLog:
  """JSONL (always), TensorBoard (when tensorboardX is installed); process 0 only writes.

  On resume, records after the restored step are dropped first: the resumed run logs them
  again, and the curves show each step once.
  """

  def __init__(self, workdir: Path, resume_step: int, enabled: bool = True):
    self.enabled = enabled
    self.path = workdir / "metrics.jsonl"
    self._tb = None
    if not enabled:
      return
    workdir.mkdir(parents=True, exist_ok=True)
    if self.path.exists():
      kept = [line for line in self.path.read_text().splitlines()
              if line.strip() and json.loads(line).get("step", 0) <= resume_step]
      atomic_write(self.path, "".join(f"{line}\n" for line in kept))
    self._file = open(self.path, "a", encoding="utf-8")
    try:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(str(workdir / "tensorboard"))
    except ImportError:
      print("note: tensorboardX is not installed; TensorBoard logs skipped "
            "(pip install tensorboardX); metrics.jsonl has everything.")

  def write(self, step: int, **scalars: float) -> None:
    if not self.enabled:
      return
    record = {"step": step, **{k: float(v) for k, v in scalars.items()}}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in scalars.items():
        self._tb.add_scalar(k, float(v), step)

  def close(self) -> None:
    if not self.enabled:
      return
    self._file.close()
    if self._tb is not None:
      self._tb.close()


def plot_curves(metrics_path: Path, png_path: Path, keys: Sequence[str] = ("train_loss",),
                ylabel: str = "loss") -> None:
  """The metrics `keys` against step (a line per key; keys starting with "valid" get markers),
  written atomically as a PNG."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  records = [json.loads(l) for l in metrics_path.read_text().splitlines() if l.strip()]
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
