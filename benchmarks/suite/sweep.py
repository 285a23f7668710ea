"""Section f: the Pallas block-size sweep (benchmarks/block_sweep.py) in what time is left.
"""

from __future__ import annotations

import time

from .common import Recorder, Sizes


def section_sweep(rec: Recorder, sizes: Sizes, args) -> None:
  import block_sweep
  from attention import Shape
  budget = rec.deadline - time.time() - 5
  if budget < 5:
    rec.skipped(kind="sweep")
    return
  shape = Shape(**sizes.sweep)
  rec.log(f"sweep {shape} {sizes.dtype}, {budget:.0f} s")
  result = block_sweep.sweep(shape, sizes.dtype, budget_s=budget, reps=sizes.reps,
                             tiny=args.tiny, log=rec.log)
  for row in result.pop("rows"):
    rec.row(kind="sweep", status="ok" if row["ok"] else
            ("skipped" if (row["error"] or "").startswith("skipped") else "failed"), **row)
  rec.note(sweep=result)
  rec.log(f"best: {result['best_literal']} ({result['speedup']}x the default)")
