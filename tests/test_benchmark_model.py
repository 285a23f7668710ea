"""benchmarks/model.py: the op profile of a CPU trace sums every host thread's op events (XLA's
CPU runtime runs most of a step's thunks, the dots among them, on its intra-op pool's threads,
not on the executing thread), and `--vs-hf-rounds` times ours against HF side by side in
interleaved rounds after the logits check."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import model as model_bench  # benchmarks/model.py

pytestmark = pytest.mark.unit


def _event(name, start, duration, op=True):
  stats = [("hlo_op", name), ("hlo_module", "jit_step")] if op else [("_src", "runtime")]
  return types.SimpleNamespace(name=name, start_ns=float(start), duration_ns=float(duration),
                               stats=stats)


def _line(name, events):
  return types.SimpleNamespace(name=name, events=events)


def test_host_op_times_counts_each_piece_once_with_its_exclusive_time():
  """A while thunk's body ops nested in it on the same thread count once (the while keeps only
  its own time); a fusion split over two threads counts once per piece; python frames, the
  thread pool's bookkeeping and 'end:' markers count nothing."""
  execute = _line("tf_XLAExecute/1", [
      _event("ThunkExecutor::Execute", 0, 1000, op=False),
      _event("while.3", 0, 100),
      _event("dot.1", 10, 30),
      _event("add.2", 50, 20),
      _event("end: while.3", 100, 0, op=False)])
  pool = [_line(f"tf_XLAEigen/{i}", [_event("ThreadpoolListener::StartRegion", 0, 0, op=False),
                                     _event("fusion.4", 200, 40 + i)]) for i in (1, 2)]
  python = _line("python", [_event("$train_step", 0, 5000, op=False)])
  data = types.SimpleNamespace(planes=[
      types.SimpleNamespace(name="/host:CPU", lines=[python, execute, *pool]),
      types.SimpleNamespace(name="Task Environment", lines=[])])
  totals, threads = model_bench.host_op_times(data)
  assert totals == {"while.3": [1, 50.0], "dot.1": [1, 30.0], "add.2": [1, 20.0],
                    "fusion.4": [2, 83.0]}
  assert threads == {"/host:CPU: tf_XLAExecute/1": 100.0, "/host:CPU: tf_XLAEigen/1": 41.0,
                     "/host:CPU: tf_XLAEigen/2": 42.0}


def test_top_ops_of_a_real_cpu_trace_covers_the_pool_threads(tmp_path):
  """The small model's traced training step: op time on threads other than tf_XLAExecute is
  summed (the old profile read tf_XLAExecute alone), matmul work is among the ops, and the
  total is the sum over the threads named in `source`."""
  args = model_bench.parse_args(["--small", "--no-hf", "--seq", "128", "--batch", "1",
                                 "--reps", "1", "--warmup", "1", "--out", str(tmp_path)])
  record = model_bench.measure_row("longformer_jax", args, 128, 1, str(tmp_path / "trace"))
  trace = record["trace"]
  assert not trace.get("error"), trace
  threads = trace["threads"]
  pool = {name: ms for name, ms in threads.items() if "tf_XLAExecute" not in name}
  assert pool and sum(pool.values()) > 0, threads  # work on the intra-op pool's threads
  assert trace["total_ms"] == pytest.approx(sum(threads.values()), rel=1e-3, abs=1e-2)
  assert "CPU time summed over threads" in trace["source"]
  assert "tf_XLAEigen" in trace["source"] and "tf_XLAExecute" in trace["source"]
  # The trace's matmuls are among its ops (all of them: under load the top 15 of a model this
  # small can be elementwise fusions): XLA CPU's dot thunks or its YNNPACK dot fusions.
  every_op = model_bench.top_ops(str(tmp_path / "trace"), count=10**6, steps=3)["ops"]
  assert sum(op["ms"] for op in every_op) == pytest.approx(trace["total_ms"], rel=1e-2)
  assert any(op["name"].startswith(("dot", "ynn_fusion", "custom-call", "convolution"))
             for op in every_op), [op["name"] for op in every_op]
  assert "CPU time summed over threads" in model_bench.format_top_ops(trace)


def test_vs_hf_rounds_small(tmp_path):
  """`--vs-hf-rounds` at the small size: the logits check ran and passed, both models hold the
  same parameters, and every round timed both rows with its load average recorded."""
  result = model_bench.main(["--vs-hf-rounds", "2", "--small", "--seq", "128", "--batch", "1",
                             "--warmup", "1", "--out", str(tmp_path)])
  path = Path(result["path"])
  written = json.loads(path.read_text())
  assert written["status"] == "ok"
  agreement = written["agreement"]
  assert agreement["passed"] and 0 <= agreement["max_abs_diff"] <= 1e-3
  assert agreement["tolerance"] == model_bench.CHECK_TOLERANCE
  assert written["params"]["ours"] == written["params"]["hf"] > 0
  summary = written["summary"]
  assert [r["row"] for r in summary["rows"]] == ["longformer_jax(attention_impl=auto)",
                                                 "hf_transformers_pytorch"]
  for row in summary["rows"]:
    assert 0 < row["fastest_ms"] <= row["median_ms"]
    assert len(row["per_round_fastest_ms"]) == 2 and row["tokens_per_s_fastest"] > 0
  speedup = summary["speedup"]
  assert len(speedup["per_round"]) == 2 and speedup["min"] <= speedup["median"] <= speedup["max"]
  ours, hf = summary["rows"]
  assert speedup["per_round"][0] == pytest.approx(
      hf["per_round_fastest_ms"][0] / ours["per_round_fastest_ms"][0], rel=1e-2)
  assert len(summary["load_before_after_per_round"]) == 2
  assert written["model"]["layers"] == 2 and written["seq"] == 128
  assert "| row | fastest ms | median ms |" in path.with_suffix(".md").read_text()
  assert path.with_suffix(".png").stat().st_size > 0


def test_vs_hf_arguments():
  args = model_bench.parse_args(["--vs-hf-rounds", "3"])
  assert (args.preset, args.seq, args.batch) == ("6x512", 4096, 1)
  config = model_bench.make_config(args)
  assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
          config.intermediate_size, config.attention_window) == (6, 512, 8, 2048, 256)
  assert model_bench.parse_args([]).preset == "base"
  for bad in (["--vs-hf-rounds", "0"], ["--vs-hf-rounds", "2", "--no-hf"],
              ["--vs-hf-rounds", "2", "--calls", "0"]):
    with pytest.raises(SystemExit) as e:
      model_bench.parse_args(bad)
    assert e.value.code == 2


def test_side_by_side_ratios_per_round():
  """harness.side_by_side, which both side-by-side scripts report through: per round the peer's
  fastest call over ours, each row's fastest and median over all calls."""
  import harness
  ours = [[0.10, 0.12], [0.20, 0.30]]  # seconds: round 1, round 2
  peer = [[0.31, 0.30], [0.45, 0.50]]
  summary = harness.side_by_side(["ours", "peer"], [ours, peer], [(1.0, 1.5), (1.5, 2.0)],
                                 tokens_per_step=100)
  assert summary["speedup"]["per_round"] == [3.0, 2.25]
  assert (summary["speedup"]["min"], summary["speedup"]["max"]) == (2.25, 3.0)
  assert summary["speedup"]["median"] == pytest.approx(2.625)
  a, b = summary["rows"]
  assert (a["fastest_ms"], a["median_ms"], a["per_round_fastest_ms"]) == (100.0, 160.0,
                                                                          [100.0, 200.0])
  assert b["tokens_per_s_fastest"] == pytest.approx(100 / 0.30, rel=1e-3)
  assert summary["speedup"]["by_fastest"] == 3.0
  assert summary["load_before_after_per_round"] == [[1.0, 1.5], [1.5, 2.0]]
  assert "peer takes 2.62x [2.25-3.00]" in harness.side_by_side_markdown(summary)
  with pytest.raises(ValueError, match="same number of rounds"):
    harness.side_by_side(["ours", "peer"], [ours, peer[:1]], [(1.0, 1.0)])
