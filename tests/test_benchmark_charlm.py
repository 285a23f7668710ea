"""benchmarks/charlm.py at its --tiny size: the trainer's char-LM step against the PyTorch byte LM
of the same shape, checked to be the same function before interleaved rounds time both."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import charlm as charlm_bench  # benchmarks/charlm.py

pytestmark = pytest.mark.unit


def test_tiny_run_checks_then_times_both_rows(tmp_path):
  result = charlm_bench.main(["--tiny", "--out", str(tmp_path)])
  path = Path(result["path"])
  written = json.loads(path.read_text())
  assert written["status"] == "ok" and written["config"] == "tiny"
  # The same model on both sides: equal parameter counts, and the same logits with our weights.
  params = written["params"]
  assert params["ours"] == params["torch"] > 0
  assert 0 <= written["agreement"]["max_abs_logit_diff"] <= charlm_bench.LOGIT_TOLERANCE
  model = written["model"]
  assert (model["layers"], model["hidden"], model["windows"]) == (2, 32, [8, 16])
  assert written["tokens_per_step"] == written["seq"] * written["batch"] == 64 * 2
  # From the same weights, the first training step's loss is the same on both sides.
  first = list(written["first_step_loss"].values())
  assert len(first) == 2 and first[0] == pytest.approx(first[1], abs=1e-4)
  summary = written["summary"]
  assert len(summary["rows"]) == 2
  for row in summary["rows"]:
    assert row["calls"] == 2 * 2  # rounds x calls
    assert 0 < row["fastest_ms"] <= row["median_ms"]
    assert row["tokens_per_s_fastest"] == pytest.approx(128 / (row["fastest_ms"] / 1e3), rel=1e-2)
  speedup = summary["speedup"]
  assert len(speedup["per_round"]) == 2 and speedup["min"] <= speedup["median"] <= speedup["max"]
  assert len(summary["load_before_after_per_round"]) == 2
  assert "parameters: ours 25,344, torch 25,344" in path.with_suffix(".md").read_text()
  assert path.with_suffix(".png").stat().st_size > 0


def test_the_peer_refuses_what_it_cannot_express():
  import torch
  cfg = charlm_bench.train_config(tiny=True)
  dilated = dataclasses.replace(cfg, model=cfg.model.replace(attention_dilation=2))
  with pytest.raises(ValueError, match="no dilation"):
    charlm_bench.build_torch_peer(torch, dilated)
