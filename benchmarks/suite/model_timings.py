"""Section e: whole-model training steps (benchmarks/model.py): HF in its own process, then ours.
Time goes only to what can finish: the HF child is not started with less than
`Sizes.hf_child_min_s`, and the full-attention swap check runs only before a full-attention row
that fits (a failed check fails those rows, untimed).
"""

from __future__ import annotations

import gc
import json
import pathlib
import shutil
import sys
import threading
import time
import traceback

from .common import BENCH, Recorder, Sizes, jax_backend, run_child, torch_child_env


def section_model(rec: Recorder, sizes: Sizes, args) -> None:
  import model as model_bench

  shapes = [f"{s}x{b}" for s, b in sizes.model_shapes]
  hf_dir = pathlib.Path(args.out) / "gpu_suite_parts" / "hf_model"
  shutil.rmtree(hf_dir, ignore_errors=True)
  command = [sys.executable, str(BENCH / "model.py"), "--rows", "hf_transformers", "--shapes",
             *shapes, *sizes.model_argv, "--out", str(hf_dir)]
  hf_budget = (rec.deadline - time.time()) * 0.4
  hf_result = {}
  hf = threading.Thread(target=lambda: hf_result.update(rc_tail=run_child(
      command, time.time() + hf_budget, rec.t0, "model/hf", env=torch_child_env())))
  # A child that cannot reach its first row in its time is not started: the time goes to ours.
  hf_started = hf_budget >= sizes.hf_child_min_s
  if hf_started:
    rec.log(f"HF child: {' '.join(command[1:])} (at most {hf_budget:.0f} s)")
    hf.start()
    # On a GPU, HF runs alone and first, before this process has taken any GPU memory; on a
    # CPU (--tiny, numbers meaningless) it overlaps our rows to save wall time.
    if jax_backend() != "cpu":
      hf.join()
  else:
    for seq, batch in sizes.model_shapes:
      rec.row(kind="model", row="hf_transformers", impl="hf_transformers_pytorch", seq=seq,
              batch=batch, status="skipped",
              reason=f"skipped: section budget: the HF child needs about "
              f"{sizes.hf_child_min_s:.0f} s (imports, the logits agreement check, its steps), "
              f"{hf_budget:.0f} s were its share")

  def record_hf():
    hf.join()
    rc, tail = hf_result["rc_tail"]
    hf_rows = []
    for path in sorted(hf_dir.glob("model_*.json")):
      hf_rows = json.loads(path.read_text())
    for r in hf_rows:
      rec.row(kind="model", status="ok", **r)
    done = {(r["seq"], r["batch"]) for r in hf_rows}
    for seq, batch in sizes.model_shapes:
      if (seq, batch) not in done:
        rec.row(kind="model", row="hf_transformers", impl="hf_transformers_pytorch", seq=seq,
                batch=batch, status="failed", error=f"HF child rc={rc}: {tail[-600:]}")

  hf_recorded = not (hf_started and hf.is_alive())
  if hf_started and hf_recorded:
    record_hf()
  margs = model_bench.parse_args([*sizes.model_argv, "--no-hf"])
  trace_dir = str(pathlib.Path(args.out) / "trace")
  # The masked head and the full-attention model at every shape first, then the full head.
  first = [row for row in sizes.model_rows if row != "longformer_jax"]
  order = [(row, shape) for shape in sizes.model_shapes for row in first]
  order += [("longformer_jax", shape) for shape in sizes.model_shapes
            if "longformer_jax" in sizes.model_rows]
  swap_check = None  # the full-attention rows' precondition, run before the first of them
  for row, (seq, batch) in order:
    what = dict(kind="model", row=row, impl=model_bench.impl_name(row, margs.impl), seq=seq,
                batch=batch)
    checking = row == "full_attention" and swap_check is None
    # The check before the first full-attention row costs about as much as a row (56 s on an
    # H100): both must fit.
    if not rec.fits("model", sizes.model_first_estimate_s * (2 if checking else 1)):
      rec.skipped(**what)
      continue
    if checking:
      try:
        swap_check = model_bench.check_full_attention(model_bench.make_config(margs, 128))
        rec.log(f"full-attention swap check: {swap_check}")
      except Exception as e:
        swap_check = f"{type(e).__name__}: {str(e)[:300]}"
      rec.note(full_attention_check=swap_check)
    if row == "full_attention" and not (isinstance(swap_check, dict)
                                        and model_bench.full_attention_check_ok(swap_check)):
      # Like a peer that disagrees: a failed row, never timed.
      rec.row(status="failed", reason="the full-attention model is not the one it claims "
              f"(swap check: {swap_check})", **what)
      continue
    started = time.time()
    try:
      record = model_bench.measure_row(row, margs, seq, batch, trace_dir)
      if trace_dir:
        rec.log(model_bench.format_top_ops(record["trace"]))
        trace_dir = None
      rec.row(kind="model", status="ok", **record)
      mfu = "" if record["mfu"] is None else f", MFU {100 * record['mfu']:.1f}%"
      rec.log(f"{record['impl']} {seq} x {batch}: {record['ms_step']:.1f} ms/step, "
              f"{record['tokens_per_s']:,.0f} tokens/s{mfu}")
    except Exception as e:
      traceback.print_exc()
      rec.row(status="failed", error=f"{type(e).__name__}: {str(e)[:400]}", **what)
    gc.collect()  # the last row's model and optimizer state (nnx graphs hold cycles)
    rec.cost("model", time.time() - started)
  if not hf_recorded:
    record_hf()
