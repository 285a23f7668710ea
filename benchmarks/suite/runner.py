"""Running the suite: every section in its own child process under a global budget (the parent),
and the body of one section (the child).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import sys
import threading
import time
import traceback

from .common import (GPU_SIZES, GRACE_S, MERGE_EVERY_S, SCRIPT, SECTION_NAMES, SHARES,
                     TINY_SIZES, Recorder, elapsed_line, run_child)
from .attention_timings import section_attention
from .correctness import section_correctness
from .cudnn_window import section_cudnn
from .model_timings import section_model
from .peers import section_peers
from .report import Report, read_part
from .sweep import section_sweep


SECTIONS = {"a": section_correctness, "b": section_attention, "e": section_model,
            "d": section_cudnn, "c": section_peers, "f": section_sweep}


def run_section(args) -> None:
  """Body of a section child process."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch children share the GPU
  key = args.run_section
  sizes = TINY_SIZES if args.tiny else GPU_SIZES
  path = pathlib.Path(args.out) / "gpu_suite_parts" / f"{key}.jsonl"
  rec = Recorder(path, key, args.t0, args.deadline)
  import jax
  rec.write(dict(type="meta", device=jax.devices()[0].device_kind, backend=jax.default_backend(),
                 jax=jax.__version__, started=time.time()))
  rec.log(f"started on {jax.devices()[0].device_kind}, {args.deadline - time.time():.0f} s")
  status = "done"
  try:
    SECTIONS[key](rec, sizes, args)
  except Exception as e:
    traceback.print_exc()
    status = "failed"
    rec.note(error=f"{type(e).__name__}: {str(e)[:600]}")
  rec.write(dict(type="done", status=status, finished=time.time()))


def section_deadlines(order: list[str], t0: float, budget_s: float, jobs: int) -> dict:
  """Each section's deadline. One at a time: a cumulative schedule of the chosen sections'
  shares, which fill the budget (so `--sections a` gets all of it, and what a section leaves
  goes to the next). Several at a time (--tiny only): every section may run to the end."""
  total_share = sum(SHARES[key] for key in order)
  schedule, cumulative = {}, 0.0
  for key in order:
    cumulative += SHARES[key] * budget_s / total_share
    schedule[key] = t0 + (cumulative if jobs == 1 else budget_s)
  return schedule


def orchestrate(args) -> dict:
  order = [k.strip() for k in args.sections.split(",") if k.strip()]
  unknown = [k for k in order if k not in SECTION_NAMES]
  if unknown or not order or len(set(order)) != len(order):
    raise ValueError(f"--sections {args.sections!r}: expected distinct letters from "
                     f"{sorted(SECTION_NAMES)} ({SECTION_NAMES})")
  args.t0 = time.time()
  out = pathlib.Path(args.out)
  parts = out / "gpu_suite_parts"
  parts.mkdir(parents=True, exist_ok=True)
  for key in order:
    (parts / f"{key}.jsonl").unlink(missing_ok=True)
  deadline = args.t0 + args.budget_s
  report = Report(args, order)
  lock = threading.Lock()

  def write(png: bool = False) -> dict:
    with lock:  # one writer at a time (matplotlib is not thread-safe either)
      return report.write(png)

  write()
  print(elapsed_line(args.t0, "suite", f"sections {' '.join(order)}, budget {args.budget_s:.0f} "
                     f"s, {args.jobs} at a time, out {out}"), flush=True)
  schedule = section_deadlines(order, args.t0, args.budget_s, args.jobs)

  def run_one(key):
    now = time.time()
    if now >= deadline - 5:
      with lock:
        report.set(key, status="skipped", skip_reason="skipped: global budget spent")
      return
    section_deadline = min(deadline, max(schedule[key], now + 10))
    with lock:
      report.set(key, status="running", started_s=round(now - args.t0, 1),
                 deadline_s=round(section_deadline - args.t0, 1))
    print(elapsed_line(args.t0, "suite", f"section {key} ({SECTION_NAMES[key]}) until "
                       f"{section_deadline - args.t0:.0f} s"), flush=True)
    command = [sys.executable, str(SCRIPT), "--run-section", key, "--t0", repr(args.t0),
               "--deadline", repr(section_deadline), "--out", str(out)]
    command += ["--tiny"] * args.tiny + ["--inject-peer-fault"] * args.inject_peer_fault
    rc, tail = run_child(command, section_deadline + GRACE_S, args.t0, SECTION_NAMES[key],
                         new_session=True)
    seconds = round(time.time() - now, 1)
    with lock:
      if read_part(parts / f"{key}.jsonl")["done"]:
        report.set(key, status="done", seconds=seconds)
      else:
        killed = "killed by the suite" in tail
        report.set(key, status="timeout" if killed else "crashed", seconds=seconds, rc=rc,
                   error=("killed past its deadline" if killed else f"rc={rc}") + ": "
                   + tail[-1500:])
    write(png=True)

  stop = threading.Event()

  def merge_periodically():
    while not stop.wait(MERGE_EVERY_S):
      try:
        write()
      except Exception:  # the next merge will do
        pass

  merger = threading.Thread(target=merge_periodically, daemon=True)
  merger.start()
  try:
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
      for future in [pool.submit(run_one, key) for key in order]:
        future.result()
  finally:
    stop.set()
    merger.join()
  final = write(png=True)
  print(elapsed_line(args.t0, "suite", "done: " + ", ".join(
      f"{k}={s['status']}" for k, s in final["sections"].items())), flush=True)
  print(f"wrote {out / 'gpu_suite.json'}, {out / 'gpu_suite.md'}, {out / 'gpu_suite.png'}")
  print(json.dumps(final["summary"], indent=1))
  return final
