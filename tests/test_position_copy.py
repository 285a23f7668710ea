"""experiments/position_copy.py and experiments/frozen_weights.py end to end at a toy size: the
studies' JSON (arms, seeds, paired differences, the short model's position dependence, what the
arms differ in, verdict), their PNGs, and bad arguments refused with the value named; their
verdicts on made-up values far apart and within the spread."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from testing import assert_study_claims

pytestmark = pytest.mark.integration  # whole study runs in a subprocess

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "position_copy.py"
FROZEN = ROOT / "experiments" / "frozen_weights.py"
TOY = ["--vocab", "300", "--hidden", "16", "--layers", "1", "--heads", "2", "--short-len", "8",
       "--short-steps", "3", "--short-batch", "4", "--long-len", "32", "--long-steps", "2",
       "--long-batch", "2", "--eval-tokens", "512"]


def _run(*args, script=SCRIPT):
  return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                        cwd=ROOT, timeout=600, env=_ENV)


def _load(script):
  spec = importlib.util.spec_from_file_location(script.stem, script)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _check_comparisons(study):
  """Each claim's difference, detectable difference (two-sample or, for a paired design, from
  the per-seed differences) and outcome are the harness's, from the arms' per-seed values (lower
  bpc is better)."""
  assert_study_claims(study, _load(ROOT / "experiments" / "study.py"), higher_is_better=False)
  assert study["detectable_difference"]["seeds_per_arm"] == 2


# A bare environment (the script must not depend on the caller's), plus the test run's
# compilation cache and optimisation level (tests/conftest.py).
_ENV = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin",
        **{k: v for k, v in os.environ.items() if k.startswith("JAX_PERSISTENT_CACHE")
           or k in ("JAX_COMPILATION_CACHE_DIR", "JAX_DISABLE_MOST_OPTIMIZATIONS")}}


def test_toy_study_writes_every_arm_seed_and_the_verdict(tmp_path):
  out = tmp_path / "position_copy.json"
  run = _run(*TOY, "--seeds", "0", "1", "--out", str(out))
  assert run.returncode == 0, run.stderr[-3000:]
  study = json.loads(out.read_text())
  assert study["study"] == "position_copy" and study["setup"]["device"] == "cpu"
  assert set(study["arms"]) == {"short_model", "copied_before", "random_before", "copied_after",
                                "random_after"}
  for arm in study["arms"].values():
    assert arm["seeds"] == [0, 1] and len(arm["values"]) == 2
    assert all(v > 0 for v in arm["values"])
    assert arm["mean"] == pytest.approx(sum(arm["values"]) / 2)
  for when in ("before", "after"):  # random - copied, per seed, from the arms' own values
    assert study["paired_differences"][when]["values"] == pytest.approx(
        [r - c for r, c in zip(study["arms"][f"random_{when}"]["values"],
                               study["arms"][f"copied_{when}"]["values"])])
  assert "detectable difference" in study["verdict"] and study["paper"]["random_before"] == 10.299
  assert [c["paper_says"] for c in study["comparisons"]] == [
      "copied_before better than random_before", "copied_after better than random_after"]
  _check_comparisons(study)
  # The arms differ in the position table only; the short model's reliance on word order.
  assert study["setup"]["arms_differ_in"] == [
      "longformer/embeddings/position_embeddings/embedding"]
  dependence = study["position_dependence"]
  assert dependence["seeds"] == [0, 1]
  assert dependence["ordered"] == pytest.approx(study["arms"]["short_model"]["values"])
  assert dependence["shuffled_minus_ordered"] == pytest.approx(
      [s - o for o, s in zip(dependence["ordered"], dependence["shuffled"])])
  assert out.with_suffix(".png").stat().st_size > 10_000


def test_toy_frozen_weights_study(tmp_path):
  out = tmp_path / "frozen_weights.json"
  run = _run(*TOY, "--seeds", "0", "1", "--out", str(out), script=FROZEN)
  assert run.returncode == 0, run.stderr[-3000:]
  study = json.loads(out.read_text())
  assert study["study"] == "frozen_weights"
  assert set(study["arms"]) == {"short_model", "copied_long", "copied_short", "all_weights_long",
                                "all_weights_short", "positions_only_long",
                                "positions_only_short"}
  for arm in study["arms"].values():
    assert arm["seeds"] == [0, 1] and len(arm["values"]) == 2 and all(v > 0 for v in arm["values"])
  _check_comparisons(study)
  assert [c["paper_says"] for c in study["comparisons"]] == [
      "all_weights_long better than positions_only_long",
      "positions_only_short better than all_weights_short"]
  # The arms' training configs differ in which parameters train, and only the positions moved.
  assert study["setup"]["arms_differ_in"] == ["trainable"]
  assert study["setup"]["positions_only_changed"] == [
      "longformer/embeddings/position_embeddings/embedding"]
  assert study["setup"]["parameters_changed_by_training"]["all_weights"] > 20
  assert "detectable difference" in study["verdict"]
  assert out.with_suffix(".png").stat().st_size > 10_000


def _arms(**values):
  return {name: {"seeds": [0, 1, 2], "values": v, "mean": sum(v) / 3,
                 "std": float(np.std(v, ddof=1))} for name, v in values.items()}


@pytest.mark.parametrize("gap, outcome", [(2.0, "agree"), (-2.0, "disagree"),
                                          (0.01, "cannot resolve")])
def test_verdicts_weigh_the_gap_against_the_spread(gap, outcome):
  spread = [0.0, 0.05, -0.05]
  base = [3.0 + s for s in spread]
  worse = [3.0 + gap + s for s in spread]
  copy = _load(SCRIPT)
  study = {"arms": _arms(short_model=base, copied_before=base, random_before=worse,
                         copied_after=base, random_after=worse),
           "paired_differences": {w: {"values": [gap] * 3} for w in ("before", "after")},
           "paper": copy.PAPER}
  assert f": {outcome}" in copy.verdict(study)
  assert [c["outcome"][:len(outcome)] for c in study["comparisons"]] == [outcome] * 2
  # frozen_weights compares within seeds (paired): its spread is that of the per-seed
  # differences, here gap + (0.05, -0.1, 0.05) (a constant gap would have none).
  frozen = _load(FROZEN)
  other = [3.0 + s for s in (spread[1], spread[2], spread[0])]
  study = {"arms": _arms(short_model=base, copied_long=base, copied_short=base,
                         all_weights_long=other, positions_only_long=worse,
                         positions_only_short=other, all_weights_short=worse),
           "paper": frozen.PAPER}
  assert f": {outcome}" in frozen.verdict(study)
  assert {c["design"] for c in study["comparisons"]} == {"paired"}
  assert [c["outcome"][:len(outcome)] for c in study["comparisons"]] == [outcome] * 2


@pytest.mark.parametrize("args, message", [
    (["--short-len", "32", "--long-len", "16"], "must exceed --short-len"),
    (["--long-steps", "0"], "--long-steps must be >= 1, got 0"),
    (["--seeds", "1", "1"], "must be distinct"),
    (["--seeds", "1"], "at least two"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
])
@pytest.mark.parametrize("script", [SCRIPT, FROZEN], ids=lambda p: p.stem)
def test_bad_arguments_name_the_value(script, args, message, capsys):
  with pytest.raises(SystemExit) as exit_info:  # parser.error: before anything is computed
    _load(script).main(args)
  assert exit_info.value.code == 2 and message in capsys.readouterr().err
