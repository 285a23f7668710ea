"""The paper's dilation ablation (§4.2.2, Table 4 bottom) at CPU scale.

The paper's small char LM dilates 2 of its 8 heads in the upper layers, "a small amount of
increasing dilation", so that those heads reach distant bytes at no extra cost. After 150K steps
of phase 1 on text8 it reported dev BPC 1.21 without dilation and 1.20 with it.

Here two arms on the bundled text8_sample with the same windows (the increasing schedule of
experiments/window_schedule.py) and so the same attention cost (keys per query, summed over
layers and heads: dilation spreads a head's w + 1 keys, it adds none): `no_dilation`, and
`dilation_2_heads`, whose last 2 heads of the top layers have dilations growing with depth
(cpu size: 2 and 3 on the top 2 of 4 layers, as the paper's 2, 3, 4 on the top half; this
repository reads the paper's Table 12 "dilation 1" as keys 2 apart, `config.grouped_dilations`).
The cpu model has 4 heads, so 2 heads are half of a top layer's (the paper: 2 of 8). Dilation
widens the receptive field (sum over layers of the widest reach w x d): 288 -> 635 bytes at the
cpu size, against a context of 512. Every run uses the library's `Trainer` (`CharLMTask`, one
stage) and is scored with `tasks.charlm.evaluate_bpc` on the validation split; the seed sets the
initialisation and the batches, the same in both arms (so `no_dilation` repeats
window_schedule's `increasing` run for run).

Sizes (`--device`): cpu (default): 4 layers x 64 (4 heads), windows 16, 53, 91, 128, context
512, 2,500 steps of 1 x 512 bytes; gpu: 6 layers x 256 (8 heads),
windows 32 -> 512 over 2,048 bytes, dilations 2, 3, 4 on the top 3 layers, 3,000 steps of 16
sequences; --tiny: seconds, for the tests.

    python experiments/dilation.py                       # cpu size, seeds 0 1 2
    python experiments/dilation.py --device gpu --seeds 0 1 2 3 4

Writes experiments/results/dilation.json (the schema of window_schedule.json) and dilation.png.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import charlm_study
import study  # experiments/study.py

STUDY = "dilation"
# Paper Table 4 (bottom), text8 dev BPC after 150K steps of phase 1.
PAPER = {"no_dilation": 1.21, "dilation_2_heads": 1.20}
PAPER_SOURCE = ("Beltagy, Peters, Cohan 2020 (arXiv 2004.05150), Table 4 bottom: text8 dev BPC "
                "of the small model after 150K steps of phase 1")
CLAIMS = (("dilation_2_heads", "no_dilation"),)
DILATED_HEADS = 2


def dilations(size: charlm_study.Size) -> tuple[tuple[int, ...], ...]:
  """Per layer and head: 1 everywhere but the last 2 heads of the top len(size.dilations)
  layers, which get size.dilations (bottom to top)."""
  from longformer_jax.config import grouped_dilations
  if len(size.dilations) > size.layers or size.heads <= DILATED_HEADS:
    raise ValueError(f"cannot dilate {DILATED_HEADS} heads of the top {len(size.dilations)} "
                     f"layers of a {size.layers}-layer, {size.heads}-head model")
  groups = [(size.layers - len(size.dilations), 1)] + [(1, d) for d in size.dilations]
  return grouped_dilations(size.heads, [g for g in groups if g[0]],
                           dilated_heads=DILATED_HEADS)


def main(argv: Sequence[str] | None = None) -> int:
  args = charlm_study.parse_args(charlm_study.make_parser(__doc__, STUDY), argv)
  if args.replot:
    return charlm_study.replot(args, CLAIMS)
  from longformer_jax.config import growing_windows
  windows = growing_windows(args.size.first_window, args.size.last_window, args.size.layers)
  arms = {"no_dilation": charlm_study.model_config(args.size, windows),
          "dilation_2_heads": charlm_study.model_config(args.size, windows,
                                                        dilations(args.size))}
  costs = {charlm_study.attention_cost(cfg) for cfg in arms.values()}
  assert len(costs) == 1, f"the arms' attention costs differ: {costs}"
  charlm_study.run_study(
      STUDY, "arms differ only in the dilation of 2 heads of the top layers (same windows)",
      args, arms, PAPER, PAPER_SOURCE, CLAIMS,
      setup={"paper_setup": "12 layers x 512, 8 heads, windows 32..512, dilation on 2 heads of "
                            "layers 6-11, 150K steps of phase 1 on text8 (Table 4)"})
  return 0


if __name__ == "__main__":
  sys.exit(study.cli(main))
