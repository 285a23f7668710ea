"""experiments/position_copy.py end to end at a toy size: the study's JSON (arms, seeds, paired
differences, verdict), its PNG, and bad arguments refused with the value named."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # whole study runs in a subprocess

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "position_copy.py"
TOY = ["--vocab", "300", "--hidden", "16", "--layers", "1", "--heads", "2", "--short-len", "8",
       "--short-steps", "3", "--short-batch", "4", "--long-len", "32", "--long-steps", "2",
       "--long-batch", "2", "--eval-tokens", "512"]


def _run(*args):
  return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                        cwd=ROOT, timeout=600, env=_ENV)


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
  assert study["detectable_difference"]["seeds_per_arm"] == 2
  assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.parametrize("args, message", [
    (["--short-len", "32", "--long-len", "16"], "must exceed --short-len"),
    (["--long-steps", "0"], "--long-steps must be >= 1, got 0"),
    (["--seeds", "1", "1"], "must be distinct"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
])
def test_bad_arguments_name_the_value(args, message, capsys):
  spec = importlib.util.spec_from_file_location("position_copy", SCRIPT)
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  with pytest.raises(SystemExit) as exit_info:  # parser.error: before anything is computed
    script.main(args)
  assert exit_info.value.code == 2 and message in capsys.readouterr().err
