"""experiments/window_schedule.py and experiments/dilation.py at their --tiny size (a few steps,
2 seeds, in this process): the results JSON's schema and arms, the equal attention cost of the
arms (recomputed here from the windows and dilations the JSON records), the PNG; and the
ValueErrors of bad command lines. The harness's detectable difference and verdict logic
(experiments/study.py) on toy values, and every committed results JSON carrying it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
from testing import assert_study_claims
import dilation
import study as study_lib
import window_schedule

pytestmark = pytest.mark.unit

SEEDS = [0, 1]


def run_tiny(module, tmp_path: Path, *extra: str) -> dict:
  out = tmp_path / f"{module.STUDY}.json"
  assert module.main(["--tiny", "--seeds", *map(str, SEEDS), "--out", str(out), *extra]) == 0
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
  assert_study_claims(study, study_lib, higher_is_better=False)  # lower BPC is better
  assert study["detectable_difference"]["seeds_per_arm"] == len(SEEDS)
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
  study = run_tiny(dilation, tmp_path, "--windows", "2", "6")  # the 2-layer tiny model
  check_schema(study, "dilation", {"no_dilation", "dilation_2_heads"})
  plain, dilated = study["arms"]["no_dilation"], study["arms"]["dilation_2_heads"]
  assert plain["windows"] == dilated["windows"] == [2, 6]
  assert all(d == 1 for heads in plain["dilations"] for d in heads)
  top = dilated["dilations"][-1]
  assert top[:-2] == [1] * (len(top) - 2) and min(top[-2:]) > 1  # the last 2 heads only
  assert dilated["dilations"][0] == [1] * len(top)  # the bottom layer is never dilated
  assert dilated["receptive_field"] > plain["receptive_field"]


def test_dilation_refuses_windows_that_shrink(tmp_path):
  with pytest.raises(ValueError, match=r"--windows 3 2: expected 1 <= FIRST <= LAST"):
    dilation.main(["--tiny", "--windows", "3", "2", "--out", str(tmp_path / "x.json")])
  assert not (tmp_path / "x.json").exists()


def test_dilation_states_its_power_before_it_runs():
  # The planned detectable difference is the harness's formula at the earlier run's sd: with
  # 8 seeds per arm and sd 0.015, (2.1448 + 0.8681) x sqrt(2/8) x 0.015 = 0.02260 (t tables).
  assert len(dilation.SEEDS) == 8 and dilation.PILOT["seed"] not in dilation.SEEDS
  planned = study_lib.detectable_difference_of_sd(
      dilation.PLANNED["pooled_seed_sd_of_earlier_run"], 8, 8)
  assert planned == pytest.approx(0.02260, abs=2e-5)
  assert planned < dilation.paper_sized_effect(2.50)  # a 1% effect at 2.50 BPC is resolvable
  # The same formula as detectable_difference on values whose pooled sd is 1.
  assert study_lib.detectable_difference_of_sd(1.0, 3, 3) == pytest.approx(
      study_lib.detectable_difference([1.0, 2.0, 3.0], [5.0, 6.0, 7.0]))
  with pytest.raises(ValueError, match="at least 2 seeds per arm"):
    study_lib.detectable_difference_of_sd(1.0, 1, 3)


@pytest.mark.parametrize("difference, detectable, says", [
    (0.030, 0.021, "the paper's direction, confirmed"),
    (-0.030, 0.021, "the opposite of the paper"),
    (0.005, 0.021, "does not give a gain of the paper's size"),
    (0.005, 0.037, "cannot test the paper's claim"),
])
def test_dilation_power_verdict(difference, detectable, says):
  """At a mean of 2.40 BPC an effect of the paper's size is 0.024: a detectable difference below
  it lets the outcome speak; one above it cannot test the claim, whatever was measured."""
  outcome = study_lib.outcome(difference, detectable)
  toy = {"arms": {"no_dilation": {"mean": 2.40}, "dilation_2_heads": {"mean": 2.40}},
         "comparisons": [{"difference": difference, "detectable_difference": detectable,
                          "outcome": outcome}]}
  assert says in dilation.power_verdict(toy)


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


# ----------------------------------------------------------------------------------------------
# The detectable difference and the verdict logic (experiments/study.py)


def test_detectable_difference_against_a_hand_computed_value():
  # 3 seeds per arm, sd 1 in both: df 4, t(0.975, 4) = 2.7764, t(0.8, 4) = 0.9410 (tables),
  # (2.7764 + 0.9410) x 1 x sqrt(2/3) = 3.0352.
  assert study_lib.detectable_difference([1.0, 2.0, 3.0], [5.0, 6.0, 7.0]) == pytest.approx(
      3.0352, abs=1e-4)
  # Unequal spreads and counts: 3 and 4 seeds with sums of squared deviations 2 and 8, so
  # s_pooled^2 = (2 + 8) / 5 = 2, df 5; t(0.975, 5) = 2.5706, t(0.8, 5) = 0.9195:
  # 3.4901 x sqrt(2) x sqrt(1/3 + 1/4) = 3.7698.
  assert study_lib.detectable_difference([0.0, 1.0, 2.0], [0.0, 2.0, 4.0, 2.0]) == pytest.approx(
      3.7698, abs=1e-3)
  # It scales with the spread and falls with more seeds.
  assert study_lib.detectable_difference([0, 2, 4], [0, 2, 4]) == pytest.approx(
      2 * study_lib.detectable_difference([0, 1, 2], [0, 1, 2]))
  assert (study_lib.detectable_difference([0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 1, 2])
          < study_lib.detectable_difference([0, 1, 2], [0, 1, 2]))


@pytest.mark.parametrize("values, alpha, match", [
    ([1.0], 0.05, "at least 2 values per arm"),
    ([1.0, 2.0], 1.5, "alpha and power must be in"),
])
def test_detectable_difference_refuses_bad_input(values, alpha, match):
  with pytest.raises(ValueError, match=match):
    study_lib.detectable_difference(values, [1.0, 2.0, 3.0], alpha=alpha)


def toy_arms(better: list[float], worse: list[float]) -> dict:
  return {"a": study_lib.summarize([0, 1, 2], better), "b": study_lib.summarize([0, 1, 2], worse)}


@pytest.mark.parametrize("higher_is_better", [True, False])
def test_verdict_far_above_the_spread_agrees_or_disagrees(higher_is_better):
  sign = 1 if higher_is_better else -1
  high, low = [10.0, 10.1, 9.9], [5.0, 5.1, 4.9]  # 5 apart, detectable ~0.3
  (c,) = study_lib.compare(toy_arms(high if sign > 0 else low, low if sign > 0 else high),
                           [("a", "b")], higher_is_better=higher_is_better)
  assert c["difference"] == pytest.approx(5.0) and c["outcome"] == "agree"
  assert c["detectable_difference"] == pytest.approx(0.3035, abs=1e-3)
  (c,) = study_lib.compare(toy_arms(low if sign > 0 else high, high if sign > 0 else low),
                           [("a", "b")], higher_is_better=higher_is_better)
  assert c["difference"] == pytest.approx(-5.0) and c["outcome"] == "disagree"


def test_verdict_inside_the_spread_cannot_resolve():
  # Means 0.2 apart with a seed sd of 1: the seeds resolve only ~3.
  (c,) = study_lib.compare(toy_arms([1.2, 0.2, 2.2], [1.0, 0.0, 2.0]), [("a", "b")],
                           higher_is_better=True)
  assert c["difference"] == pytest.approx(0.2)
  assert c["outcome"] == "cannot resolve (detectable difference 3.04)"
  assert study_lib.outcome(0.0, 0.0).startswith("cannot resolve")  # no spread, no difference
  assert study_lib.outcome(0.1, 0.0) == "agree"  # no spread at all: any difference resolves


def test_power_summary_pools_the_seed_sd_over_the_arms():
  arms = toy_arms([1.0, 2.0, 3.0], [1.0, 3.0, 5.0])  # sd 1 and 2: pooled sqrt(2.5)
  block = study_lib.summarize_claims({"arms": arms, "paper": {}}, [("a", "b")],
                                     higher_is_better=True)["detectable_difference"]
  assert block["pooled_seed_sd"] == pytest.approx(np.sqrt(2.5))
  assert block["value"] == pytest.approx(3.0352 * np.sqrt(2.5), abs=1e-3)
  assert block["comparisons"] == {"a better than b": pytest.approx(block["value"])}
  assert (block["alpha"], block["power"], block["seeds_per_arm"]) == (0.05, 0.8, 3)


def test_paired_detectable_difference_against_a_hand_computed_value():
  # Differences 1, 2, 3: sd 1, n 3, df 2; t(0.975, 2) = 4.3027, t(0.8, 2) = 1.0607 (tables):
  # 5.3634 / sqrt(3) = 3.0965.
  assert study_lib.detectable_paired_difference([1.0, 2.0, 3.0]) == pytest.approx(3.0965,
                                                                                 abs=1e-3)
  # 6 seeds: (2.5706 + 0.9195) / sqrt(6) = 1.4248 sds of the differences.
  assert study_lib.detectable_paired_difference_of_sd(1.0, 6) == pytest.approx(1.4248, abs=1e-3)
  with pytest.raises(ValueError, match="at least 2 per-seed differences"):
    study_lib.detectable_paired_difference([1.0])


def test_a_paired_design_resolves_what_the_seeds_move_together():
  """Seeds far apart (sd 1) that move both arms alike, the arms 0.2 apart in every seed: the
  two-sample rule cannot resolve it, the paired one agrees; a claim the other way disagrees."""
  better, worse = [1.2, 0.21, 2.19], [1.0, 0.0, 2.0]
  arms = toy_arms(better, worse)
  (independent,) = study_lib.compare(arms, [("a", "b")], higher_is_better=True)
  (paired,) = study_lib.compare(arms, [("a", "b")], higher_is_better=True, design="paired")
  assert independent["outcome"].startswith("cannot resolve")
  assert paired["design"] == "paired" and paired["outcome"] == "agree"
  assert paired["detectable_difference"] == pytest.approx(
      study_lib.detectable_paired_difference([0.2, 0.21, 0.19]))
  (reverse,) = study_lib.compare(arms, [("b", "a")], higher_is_better=True, design="paired")
  assert reverse["outcome"] == "disagree"
  block = study_lib.power_summary(arms, [paired], "paired")
  assert block["design"] == "paired" and block["value"] == paired["detectable_difference"]
  assert block["sd_of_differences"]["a better than b"] == pytest.approx(0.01)


def test_a_paired_design_needs_the_same_seeds():
  arms = {"a": study_lib.summarize([0, 1, 2], [1.0, 2.0, 3.0]),
          "b": study_lib.summarize([0, 1, 3], [1.0, 2.0, 3.0])}
  with pytest.raises(ValueError, match="same seeds in both arms"):
    study_lib.compare(arms, [("a", "b")], higher_is_better=True, design="paired")
  with pytest.raises(ValueError, match="design='matched'"):
    study_lib.compare(arms, [("a", "b")], higher_is_better=True, design="matched")


def test_every_committed_study_has_its_detectable_difference():
  """The results JSON of every study states what its seeds can resolve, recomputable from its
  per-seed values."""
  paths = sorted((REPO / "experiments" / "results").glob("*.json"))
  assert paths
  for path in paths:
    study = json.loads(path.read_text())
    block = study["detectable_difference"]
    assert block["alpha"] == study_lib.ALPHA and block["power"] == study_lib.POWER, path.name
    assert_study_claims(study, study_lib, higher_is_better=None)
