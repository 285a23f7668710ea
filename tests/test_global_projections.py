"""experiments/global_projections.py: one --tiny run (3 arms, 2 seeds, a few steps) checked for
its JSON, the arms' equal start (the same band weights, the global projections copies of the
local ones) and that they differ only in the factor, the verdict against the detectable
difference, the PNG; bad command lines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from testing import assert_study_claims

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
import global_projections as gp
import study as study_lib

pytestmark = pytest.mark.integration  # a whole (toy) study: a few training runs

SEEDS = [0, 1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  out = tmp_path_factory.mktemp("global_projections") / "gp.json"
  assert gp.main(["--tiny", "--seeds", *map(str, SEEDS), "--out", str(out)]) == 0
  return out, json.loads(out.read_text())


def test_schema_verdict_and_png(tiny):
  out, study = tiny
  assert {"study", "metric", "arms", "setup", "paper", "comparisons", "detectable_difference",
          "verdict"} <= set(study)
  assert study["study"] == "global_projections" and list(study["arms"]) == list(gp.ARMS)
  p = gp.PRESETS["tiny"]
  for name, arm in study["arms"].items():
    assert arm["seeds"] == SEEDS and len(arm["values"]) == len(SEEDS)
    assert all(0.0 <= v <= 1.0 for v in arm["values"])
    assert arm["mean"] == pytest.approx(np.mean(arm["values"]))
    assert set(arm["by_distance"]) == {str(d) for d in p["distances"]}
    # The metric is the mean over the cells beyond the local field.
    far = [f"d{d}_k{k}" for d in gp.beyond_field(p) for k in p["distractors"]]
    assert arm["values"] == pytest.approx(
        [np.mean([arm["cells"][c]["values"][i] for c in far]) for i in range(len(SEEDS))])
    assert (arm["global_attention"], arm["global_projections"]) == (
        gp.ARMS[name][0] == "global", gp.ARMS[name][1])
  assert study["setup"]["receptive_field"] == p["layers"] * p["window"] == 8
  assert [c["paper_says"] for c in study["comparisons"]] == [
      f"{a} better than {b}" for a, b in gp.CLAIMS]
  assert_study_claims(study, study_lib, higher_is_better=True)
  assert study["detectable_difference"]["seeds_per_arm"] == len(SEEDS)
  assert isinstance(study["verdict"], str) and "detectable" in study["verdict"]
  assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # --replot rederives the same comparisons from the stored values.
  assert gp.main(["--tiny", "--seeds", *map(str, SEEDS), "--out", str(out), "--replot"]) == 0
  assert json.loads(out.read_text())["comparisons"] == study["comparisons"]


def test_arms_start_equal_and_differ_only_in_the_factor(tiny):
  _, study = tiny
  arms = study["arms"]
  # The same band weights at step 0 in every arm, seed by seed.
  checksums = {name: arm["initial_band_checksum"] for name, arm in arms.items()}
  assert len({tuple(v) for v in checksums.values()}) == 1, checksums
  p = gp.PRESETS["tiny"]
  extra = p["layers"] * 3 * (p["hidden"] * p["hidden"] + p["hidden"])  # Q_g, K_g, V_g
  assert arms["separate"]["params"] == arms["shared"]["params"] + extra
  assert arms["shared"]["params"] == arms["no_global"]["params"]
  # The model configs differ in global_projections only.
  configs = {name: gp.arm_config(p, name).to_dict() for name in gp.ARMS}
  assert {c.pop("global_projections") for c in configs.values()} == {"separate", "shared",
                                                                     "none"}
  assert configs["separate"] == configs["shared"] == configs["no_global"]


def test_initial_params_copy_the_local_projections():
  p = gp.PRESETS["tiny"]
  starts = gp.initial_params(p, seed=3)
  separate, shared = starts["separate"], starts["shared"]
  assert starts["no_global"] is shared
  for i, layer in separate["longformer"]["layers"].items():
    att = layer["attention"]
    for proj in ("query", "key", "value"):
      for leaf in ("kernel", "bias"):
        np.testing.assert_array_equal(att[f"{proj}_global"][leaf], att[proj][leaf])
        np.testing.assert_array_equal(
            shared["longformer"]["layers"][i]["attention"][proj][leaf], att[proj][leaf])
    assert not any(k.endswith("_global") for k in shared["longformer"]["layers"][i]["attention"])
  assert gp.band_checksum(separate) == gp.band_checksum(shared)


@pytest.mark.parametrize("argv, match", [
    (["--seeds", "0"], "at least 2 seeds"),
    (["--steps", "0"], ">= 1"),
    (["--device", "tpu"], "--device"),
])
def test_bad_arguments(argv, match, tmp_path):
  with pytest.raises(ValueError, match=match):
    gp.main([*argv, "--out", str(tmp_path / "x.json")])
  assert not (tmp_path / "x.json").exists()
