"""experiments/window_schedule.py and experiments/dilation.py at their --tiny size (a few steps,
2 seeds, in this process): the results JSON's schema and arms, the equal attention cost of the
arms (recomputed here from the windows and dilations the JSON records), the PNG; and the
ValueErrors of bad command lines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
import dilation
import window_schedule

pytestmark = pytest.mark.unit

SEEDS = [0, 1]


def run_tiny(module, tmp_path: Path) -> dict:
  out = tmp_path / f"{module.STUDY}.json"
  assert module.main(["--tiny", "--seeds", *map(str, SEEDS), "--out", str(out)]) == 0
  png = out.with_suffix(".png")
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  return json.loads(out.read_text())


def cost(arm: dict) -> int:
  """Keys scored per query, summed over layers and heads: a causal band of one-sided window w
  holds w + 1 keys whatever the dilation."""
  return sum(len(heads) * (w + 1) for w, heads in zip(arm["windows"], arm["dilations"]))


def check_schema(study: dict, name: str, arms: set[str]) -> None:
  assert {"study", "metric", "arms", "setup", "paper", "verdict"} <= set(study)
  assert study["study"] == name
  assert set(study["arms"]) == arms
  assert set(study["paper"]["values"]) == arms
  assert isinstance(study["verdict"], str) and study["verdict"]
  for arm in study["arms"].values():
    assert arm["seeds"] == SEEDS
    assert len(arm["values"]) == len(SEEDS)
    assert all(np.isfinite(arm["values"]))
    assert arm["mean"] == pytest.approx(np.mean(arm["values"]))
    assert arm["std"] == pytest.approx(np.std(arm["values"], ddof=1))
  for c in study["comparisons"]:
    assert c["exceeds_spread"] == (abs(c["difference"]) > c["spread"])
  costs = {name: cost(arm) for name, arm in study["arms"].items()}
  assert len(set(costs.values())) == 1, f"attention costs differ: {costs}"
  assert all(arm["attention_cost"] == costs[name] for name, arm in study["arms"].items())


def test_window_schedule(tmp_path):
  study = run_tiny(window_schedule, tmp_path)
  check_schema(study, "window_schedule", {"increasing", "fixed", "decreasing"})
  arms = study["arms"]
  up, flat, down = (arms[n]["windows"] for n in ("increasing", "fixed", "decreasing"))
  assert up == sorted(up) and up[0] < up[-1]
  assert down == up[::-1]
  assert max(flat) - min(flat) <= 1
  assert sum(up) == sum(flat) == sum(down)
  assert all(d == 1 for arm in arms.values() for heads in arm["dilations"] for d in heads)
  assert len(study["comparisons"]) == 3


def test_dilation(tmp_path):
  study = run_tiny(dilation, tmp_path)
  check_schema(study, "dilation", {"no_dilation", "dilation_2_heads"})
  plain, dilated = study["arms"]["no_dilation"], study["arms"]["dilation_2_heads"]
  assert plain["windows"] == dilated["windows"]
  assert all(d == 1 for heads in plain["dilations"] for d in heads)
  top = dilated["dilations"][-1]
  assert top[:-2] == [1] * (len(top) - 2) and min(top[-2:]) > 1  # the last 2 heads only
  assert dilated["dilations"][0] == [1] * len(top)  # the bottom layer is never dilated
  assert dilated["receptive_field"] > plain["receptive_field"]


@pytest.mark.parametrize("module", [window_schedule, dilation])
@pytest.mark.parametrize("argv, match", [
    (["--seeds", "0"], "at least 2 seeds"),
    (["--seeds", "0", "0"], "repeated"),
    (["--seeds", "0", "-1"], ">= 0"),
    (["--steps", "0"], ">= 1"),
    (["--steps", "many"], "invalid int"),
    (["--device", "tpu"], "--device"),
    (["--no-such-flag"], "unrecognized"),
])
def test_bad_arguments(module, argv, match, tmp_path):
  with pytest.raises(ValueError, match=match):
    module.main([*argv, "--out", str(tmp_path / "x.json")])
  assert not (tmp_path / "x.json").exists()
