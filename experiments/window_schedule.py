"""The paper's window-schedule ablation (§4.2.2, Table 4 top) at CPU scale.

The paper trained its small char LM for 150K steps of the phase-1 configuration on text8 and
reported dev BPC for three ways of laying the one-sided windows over the 12 layers:

    decreasing w (512 -> 32)   1.24
    fixed w (= 230)            1.23     (the average of the other two's windows)
    increasing w (32 -> 512)   1.21     (the layout the paper then uses)

Here the same three arms on the bundled text8_sample (2.8M training bytes), each with the same
total attention cost: the same sum of windows over the layers (so the same number of keys per
query, and the same receptive field, sum of the windows). `increasing` is
`config.growing_windows(first, last, layers)`, `decreasing` its reverse, `fixed` the sum spread
evenly (any remainder on the top layers). No dilation. Every run uses the library's `Trainer`
(`CharLMTask`, one stage) and is scored with `tasks.charlm.evaluate_bpc` on the validation split;
the seed sets the initialisation and the batches, the same in every arm.

Sizes (`--device`): cpu (default): 4 layers x 64 (4 heads), windows 16, 53, 91, 128 against
72 x 4 and 128 ... 16, context 512, 2,500 steps of 1 x 512 bytes (1.3M bytes); gpu: 6 layers x
256 (8 heads), windows 32 -> 512 over 2,048 bytes, 3,000 steps of 16 sequences; --tiny: seconds,
for the tests.

    python experiments/window_schedule.py                       # cpu size, seeds 0 1 2
    python experiments/window_schedule.py --device gpu --seeds 0 1 2 3 4

Writes experiments/results/window_schedule.json ({"study", "metric", "arms": {name: {"seeds",
"values", "mean", "std", "windows", "attention_cost", ...}}, "comparisons", "setup", "paper",
"verdict", "curves"}) and window_schedule.png (training curves and the final bars).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import charlm_study
import study  # experiments/study.py

STUDY = "window_schedule"
# Paper Table 4 (top), text8 dev BPC after 150K steps of phase 1.
PAPER = {"decreasing": 1.24, "fixed": 1.23, "increasing": 1.21}
PAPER_SOURCE = ("Beltagy, Peters, Cohan 2020 (arXiv 2004.05150), Table 4 top: text8 dev BPC of "
                "the small model after 150K steps of phase 1")
# (better, worse) in the paper.
CLAIMS = (("increasing", "decreasing"), ("increasing", "fixed"), ("fixed", "decreasing"))


def schedules(size: charlm_study.Size) -> dict[str, tuple[int, ...]]:
  """The three arms' per-layer windows, all with the same sum."""
  from longformer_jax.config import growing_windows
  increasing = growing_windows(size.first_window, size.last_window, size.layers)
  total, layers = sum(increasing), size.layers
  fixed = tuple(total // layers + (i >= layers - total % layers) for i in range(layers))
  return {"decreasing": increasing[::-1], "fixed": fixed, "increasing": increasing}


def main(argv: Sequence[str] | None = None) -> int:
  args = charlm_study.parse_args(charlm_study.make_parser(__doc__, STUDY), argv)
  if args.replot:
    return charlm_study.replot(args, CLAIMS)
  arms = {name: charlm_study.model_config(args.size, windows)
          for name, windows in schedules(args.size).items()}
  costs = {charlm_study.attention_cost(cfg) for cfg in arms.values()}
  assert len(costs) == 1, f"the arms' attention costs differ: {costs}"
  charlm_study.run_study(
      STUDY, "arms differ only in how the windows are laid over the layers (same sum)", args,
      arms, PAPER, PAPER_SOURCE, CLAIMS,
      setup={"paper_setup": "12 layers x 512, windows 32..512 (fixed 230), 150K steps of "
                            "phase 1 on text8 (Table 4)"})
  return 0


if __name__ == "__main__":
  sys.exit(study.cli(main))
