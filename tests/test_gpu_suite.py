"""benchmarks/gpu_suite.py on CPU: the whole prepared GPU run at toy sizes, and its pieces.

One run of `gpu_suite.py --tiny --inject-peer-fault` (a subprocess, every section, Pallas in
interpret mode, torch peers on CPU; ~2 CPU-minutes) backs most tests here: every section has rows
or a recorded skip reason, the markdown and PNG exist, the injected disagreement comes out as a
failed, untimed peer row, the whole-model rows include the full-attention one (with model FLOPs;
MFU null on CPU) and a profiler trace read back, and the block sweep prints a pasteable literal.
The pure pieces (the peer check, the inputs JAX and torch generate, the bisection, the cuDNN
verdict, the model FLOP count) are tested directly.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from suite import common
from suite.cudnn_window import bisect_divergence, cudnn_verdict

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

SECTIONS = ("correctness", "attention", "model", "cudnn_window", "peers", "block_sweep")


def run_suite(out: pathlib.Path, *extra: str, timeout: int = 900) -> subprocess.CompletedProcess:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run(
      [sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), "--out", str(out), *extra],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  out = tmp_path_factory.mktemp("suite")
  run_suite(out, "--tiny", "--inject-peer-fault")
  report = json.loads((out / "gpu_suite.json").read_text())
  return out, report


def rows(report, section, **match):
  return [r for r in report["sections"][section]["rows"]
          if all(r.get(k) == v for k, v in match.items())]


def test_every_section_has_results_or_a_skip_reason(tiny):
  _, report = tiny
  assert set(report["sections"]) == set(SECTIONS)
  for name, section in report["sections"].items():
    measured = [r for r in section["rows"] if r.get("status") in ("ok", "failed")]
    assert section["status"] in ("done", "partial"), (name, section)
    assert measured or section.get("skip_reason"), name
  # What could not run on a CPU says so.
  assert "no GPU" in report["sections"]["cudnn_window"]["skip_reason"]
  cudnn_peers = rows(report, "peers", peer="jax_cudnn_sliding_window")
  assert cudnn_peers and all(r["status"] == "skipped" and "no GPU" in r["reason"]
                             for r in cudnn_peers)


def test_report_files(tiny):
  out, report = tiny
  markdown = (out / "gpu_suite.md").read_text()
  for name in SECTIONS:
    assert f"## {name}" in markdown
  assert (out / "gpu_suite.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert report["summary"]["correctness_ok"] is True
  assert all(r["status"] == "ok" for r in report["sections"]["correctness"]["rows"])


def test_a_peer_that_disagrees_is_a_failed_untimed_row(tiny):
  _, report = tiny
  (bad,) = rows(report, "peers", peer="torch_flex_attention", mode="bidir")
  assert bad["status"] == "failed" and bad["max_abs_diff"] >= 0.5 and "ms_fwd" not in bad
  # The other checks, on the same inputs, pass: the inputs and the comparison are right.
  (causal,) = rows(report, "peers", peer="torch_flex_attention", mode="causal")
  (hf,) = rows(report, "peers", peer="hf_LongformerSelfAttention")
  for row in (causal, hf):
    assert row["status"] == "ok" and row["max_abs_diff"] <= row["limit"] and row["ms_fwd"] > 0
  assert report["summary"]["peer_checks_failed"] == [dict(
      peer="torch_flex_attention", mode="bidir", seq=bad["seq"], batch=bad["batch"],
      max_abs_diff=bad["max_abs_diff"], error=None)]


def test_model_rows_with_full_attention_flops_and_trace(tiny):
  _, report = tiny
  by_row = {r["row"]: r for r in rows(report, "model", status="ok")}
  assert {"hf_transformers", "longformer_jax_masked", "full_attention"} <= set(by_row)
  full = by_row["full_attention"]
  assert "implementation=xla" in full["impl"] and full["attention"].startswith("full")
  for r in by_row.values():
    assert r["model_flops_per_step"] > 0 and r["mfu"] is None  # no peak known for a CPU
  # The full-attention model has no global projections: fewer parameters than the band one.
  assert full["params"] < by_row["longformer_jax_masked"]["params"]
  (traced,) = [r for r in by_row.values() if r.get("trace")]
  assert traced["trace"].get("ops") or traced["trace"].get("error")
  assert report["sections"]["model"]["notes"]["full_attention_check"]["band_vs_full_xla"] < 1e-3


def test_attention_and_cudnn_sections(tiny):
  _, report = tiny
  attention = rows(report, "attention", status="ok")
  assert {r["impl"] for r in attention} == {"pallas", "chunked"}
  assert report["summary"]["dilation_global_vs_plain_band_fwdbwd"]
  notes = report["sections"]["cudnn_window"]["notes"]
  assert notes["stand_in"] == "xla" and "agrees with our causal band" in notes["verdict"]


def test_block_sweep_prints_a_pasteable_literal(tiny):
  from longformer_jax.ops.band_pallas import BlockSizes
  _, report = tiny
  sweep = report["sections"]["block_sweep"]["notes"]["sweep"]
  best = eval(sweep["best_literal"], {"BlockSizes": BlockSizes})
  assert isinstance(best, BlockSizes) and best == BlockSizes(**sweep["best"])
  assert len(rows(report, "block_sweep", status="ok")) >= 2


def test_budget_skips_are_recorded(tmp_path):
  run_suite(tmp_path, "--tiny", "--sections", "f,d", "--budget-s", "1", timeout=120)
  report = json.loads((tmp_path / "gpu_suite.json").read_text())
  for name in ("block_sweep", "cudnn_window"):
    assert report["sections"][name]["status"] == "skipped"
    assert "budget" in report["sections"][name]["skip_reason"]


# ------------------------------------------------------------------------------------------------
# The pieces.

def run_model_section(tmp_path, sizes, seconds_left):
  """Section e in this process, with `seconds_left` before its deadline: its part file's
  records."""
  import argparse
  import time
  from suite.model_timings import section_model
  path = tmp_path / "e.jsonl"
  now = time.time()
  section_model(common.Recorder(path, "e", now, now + seconds_left), sizes,
                argparse.Namespace(out=str(tmp_path)))
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_model_section_spends_no_time_on_what_cannot_finish(tmp_path, monkeypatch):
  """Too little time for the HF child: it is not started, and says why; no row of ours fits,
  so the full-attention swap check (the first full-attention row's precondition) never runs."""
  import dataclasses
  import model as model_bench
  monkeypatch.setattr(model_bench, "check_full_attention", lambda config: pytest.fail("ran"))
  sizes = dataclasses.replace(common.TINY_SIZES, hf_child_min_s=100.0)
  records = run_model_section(tmp_path, sizes, seconds_left=10.0)
  hf = [r for r in records if r.get("row") == "hf_transformers"]
  assert len(hf) == len(sizes.model_shapes)
  assert all(r["status"] == "skipped" and "HF child needs about 100 s" in r["reason"]
             for r in hf)
  ours = [r for r in records if r.get("type") == "row" and r.get("row") != "hf_transformers"]
  assert ours and all(r["status"] == "skipped" and "budget" in r["reason"] for r in ours)
  assert not [r for r in records if r.get("type") == "note"]
  assert not (tmp_path / "gpu_suite_parts" / "hf_model").exists()


def test_a_failed_swap_check_fails_the_full_attention_rows_untimed(tmp_path, monkeypatch):
  import dataclasses
  import model as model_bench
  monkeypatch.setattr(model_bench, "check_full_attention",
                      lambda config: {"band_vs_full_xla": 0.5})
  monkeypatch.setattr(model_bench, "measure_row", lambda *a, **k: pytest.fail("timed"))
  sizes = dataclasses.replace(common.TINY_SIZES, hf_child_min_s=1e9,
                              model_rows=("full_attention",), model_shapes=((128, 2), (256, 2)))
  records = run_model_section(tmp_path, sizes, seconds_left=600.0)
  full = [r for r in records if r.get("row") == "full_attention"]
  assert len(full) == 2 and all(r["status"] == "failed" and "not the one it claims" in r["reason"]
                                for r in full)
  assert [r["full_attention_check"] for r in records if r.get("type") == "note"] == [
      {"band_vs_full_xla": 0.5}]  # checked once


def test_the_chosen_sections_share_the_whole_budget():
  from suite.runner import section_deadlines
  # One section alone runs to the deadline (it once got 45/420 of it and was cut short).
  assert section_deadlines(["a"], 100.0, 250.0, jobs=1) == {"a": 350.0}
  every = section_deadlines(list("abdcfe"), 0.0, 420.0, jobs=1)
  assert list(every) == list("abdcfe")
  assert list(every.values()) == sorted(every.values())  # cumulative
  assert every["e"] == pytest.approx(420.0)
  assert every["a"] == pytest.approx(420.0 * common.SHARES["a"] / sum(common.SHARES.values()))
  # Two of them: in the ratio of their shares.
  two = section_deadlines(["c", "d"], 0.0, 90.0, jobs=1)
  assert two["c"] == pytest.approx(90.0 * common.SHARES["c"] / (common.SHARES["c"]
                                                                + common.SHARES["d"]))
  assert section_deadlines(["c", "d"], 5.0, 90.0, jobs=2) == {"c": 95.0, "d": 95.0}



def test_compare_outputs_flags_a_perturbed_output():
  expected = np.random.default_rng(0).standard_normal((2, 50, 3, 8)).astype(np.float32)
  assert common.compare_outputs(expected, expected + 1e-6, 2e-4)["ok"]
  perturbed = expected.copy()
  perturbed[1, 7, 2, 3] += 0.5
  check = common.compare_outputs(expected, perturbed, 2e-4)
  assert not check["ok"] and check["max_abs_diff"] == pytest.approx(0.5, rel=1e-5)
  nan = expected.copy()
  nan[0, 0, 0, 0] = np.nan
  assert not common.compare_outputs(expected, nan, 2e-4)["ok"]
  assert not common.compare_outputs(expected, expected[:, :10], 2e-4)["ok"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_and_torch_generate_the_same_inputs(dtype):
  torch = pytest.importorskip("torch")
  import jax.numpy as jnp
  shape = (2, 300, 3, 16)
  x = common.hashed_jax(shape, 5, jnp.dtype(dtype))
  t = common.hashed_torch(shape, 5, getattr(torch, dtype), "cpu")
  np.testing.assert_array_equal(np.asarray(x, np.float32), t.float().numpy())
  assert common.digest_jax(x) == common.digest_torch(t)
  assert common.digest_jax(x) != common.digest_jax(common.hashed_jax(shape, 6, jnp.dtype(dtype)))
  values = np.asarray(x, np.float32)
  assert -2.0 <= values.min() and values.max() <= 2.0 and 1.0 < values.std() < 1.3  # bf16 rounds up


def test_bisect_divergence_finds_the_first_bad_length():
  calls = []

  def probe(n):
    calls.append(n)
    return n * n < 2**31  # an int32 overflow of n * n: first bad at n = 46341

  first, probed = bisect_divergence(probe, 32768, 65536, 1)
  assert first == 46341 and len(calls) == len(probed) <= 16
  first, _ = bisect_divergence(probe, 32768, 65536, 128)
  assert first == 46464  # the smallest multiple of 128 at or past it
  with pytest.raises(ValueError, match="good < bad"):
    bisect_divergence(probe, 100, 100, 1)


def test_cudnn_verdict():
  ours = "ours: causal band [i-w, i]"
  form = "is_causal=True"
  long_bad = {form: dict(seq=65536, max_abs_diff=2.89, agrees=False)}
  fault = cudnn_verdict(long_bad, {form: [ours]}, {form: dict(
      first_bad_seq=46464, first_bad_row=46300, granularity=128)}, 256)
  assert "cuDNN FAULT" in fault and "int32 overflow" in fault and "46464" in fault
  semantic = cudnn_verdict(long_bad, {form: ["one key more: [i-w-1, i]"]}, {}, 256)
  assert "SEMANTIC" in semantic
  fine = cudnn_verdict({form: dict(seq=65536, max_abs_diff=0.01, agrees=True)},
                                 {form: [ours]}, {}, 256)
  assert "agrees with our causal band" in fine


def test_model_flops_of_the_base_model():
  """benchmarks/model.py's count against one written out by hand (docs in its docstring)."""
  import model as model_bench
  from longformer_jax import LongformerConfig
  config = LongformerConfig.base()
  seq, batch, e, inner, vocab, layers, w = 4096, 8, 768, 3072, 50265, 12, 256
  layer = 7 * (e * e + e) + 2 * 2 * e + (e * inner + inner) + (inner * e + e)  # 7: q k v o, global
  head = (e * e + e) + 2 * e + vocab + vocab * e  # dense, LayerNorm, bias, tied decoder
  pairs = seq * (2 * w + 1) - w * (w + 1) + 2 * seq  # band + one global token
  want = 6 * batch * seq * (layers * layer + head) + 12 * batch * 12 * 64 * layers * pairs
  got = model_bench.model_flops(config, "longformer_jax", seq, batch, seq)
  assert got["total_flops"] == want
  full = model_bench.model_flops(config, "full_attention", seq, batch, seq)
  assert full["attention_flops"] == 12 * batch * 12 * 64 * layers * seq * seq
  assert full["dense_flops"] == want - 12 * batch * 12 * 64 * layers * pairs - (
      6 * batch * seq * layers * 3 * (e * e + e))  # no global projections
