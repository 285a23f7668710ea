"""Train the character-level Longformer LM, then score the test split.

    python -m train.charlm --config train/configs/char_tiny.py
    python -m train.charlm --config train/configs/char_small.py --workdir gs://... \\
        --set dataset=text8 --set stages.0.batch_size=64

Any config field can be overridden with `--set path=value` (dots walk into dataclasses, tuples
and dicts; values are Python literals, else strings). Rerunning the same command resumes from the
latest checkpoint in the workdir; a run stopped by SIGTERM saves its step and exits with status
75 (`EXIT_PREEMPTED`), 0 meaning the schedule finished. Writes <workdir>/metrics.jsonl, tensorboard/, curves.png,
checkpoints/ and results.json (the final test BPC).

Several processes (e.g. on one machine, or hosts that JAX cannot discover by itself) run the same
command with `--distributed on --coordinator-address HOST:PORT --num-processes P --process-id I`
(I = 0..P-1; process 0 listens on PORT), or with the environment variables JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID. `--data-file` trains on any file's bytes (no dataset).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any


# Exit status after SIGTERM once the step is saved (sysexits' EX_TEMPFAIL: "try again later").
EXIT_PREEMPTED = 75


def load_config(path: str):
  """`get_config()` of a config file, imported by path."""
  spec = importlib.util.spec_from_file_location(f"charlm_config_{Path(path).stem}", path)
  if spec is None or spec.loader is None:
    raise ValueError(f"cannot import a config from {path!r}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _parse_value(text: str) -> Any:
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def override(obj: Any, path: str, value: Any) -> Any:
  """A copy of `obj` with the field at dotted `path` set to `value`."""
  head, _, rest = path.partition(".")
  if dataclasses.is_dataclass(obj):
    names = {f.name for f in dataclasses.fields(obj)}
    if head not in names:
      raise ValueError(f"unknown field {head!r} in {type(obj).__name__}; fields: {sorted(names)}")
    new = override(getattr(obj, head), rest, value) if rest else value
    return dataclasses.replace(obj, **{head: new})
  if isinstance(obj, tuple):
    if not head.lstrip("-").isdigit() or not -len(obj) <= int(head) < len(obj):
      raise ValueError(f"index {head!r} is not in a tuple of length {len(obj)}")
    i = int(head) % len(obj)
    new = override(obj[i], rest, value) if rest else value
    return obj[:i] + (new,) + obj[i + 1:]
  if isinstance(obj, dict):
    new = override(obj[head], rest, value) if rest else value
    return {**obj, head: new}
  raise ValueError(f"cannot set {path!r} inside a {type(obj).__name__}")


def apply_overrides(cfg, assignments: list[str]):
  for item in assignments:
    path, eq, text = item.partition("=")
    if not eq:
      raise ValueError(f"--set expects path=value, got {item!r}")
    value = _parse_value(text)
    if isinstance(value, list):
      value = tuple(value)
    cfg = override(cfg, path.strip(), value)
  return cfg


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
  """--distributed and the three values `training.maybe_initialize_distributed` passes on."""
  parser.add_argument("--distributed", default="auto", choices=("auto", "on", "off"),
                      help="jax.distributed.initialize(): 'on' in every process of a "
                           "multi-process run; 'auto' does it when the arguments or the "
                           "environment name a cluster")
  parser.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                      help="process 0's address (default: $JAX_COORDINATOR_ADDRESS; found "
                           "automatically on TPU slices, SLURM and Open MPI)")
  parser.add_argument("--num-processes", type=int, default=None,
                      help="processes in the run (default: $JAX_NUM_PROCESSES or detected)")
  parser.add_argument("--process-id", type=int, default=None,
                      help="this process, 0..num_processes-1 (default: $JAX_PROCESS_ID or "
                           "detected)")


def initialize_distributed(args: argparse.Namespace) -> None:
  """`training.maybe_initialize_distributed` with the flags of `add_distributed_args`."""
  from longformer_jax import training  # pylint: disable=g-import-not-at-top
  training.maybe_initialize_distributed(
      args.distributed, coordinator_address=args.coordinator_address,
      num_processes=args.num_processes, process_id=args.process_id)


def split_of_file(path: str, split: str):
  """`split` ("train", "validation", "test") of a file's bytes: the first 90%, the next 5%, the
  rest, as the corpora are split."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  from etils import epath
  from longformer_jax.data.corpora import split_bounds
  # pylint: enable=g-import-not-at-top
  data = np.frombuffer(epath.Path(path).read_bytes(), np.uint8)
  start, stop = split_bounds(len(data))[split]
  return data[start:stop].copy()


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True, help="a train/configs/*.py file")
  parser.add_argument("--workdir", default=None, help="default: runs/<config name>")
  parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                      help="override a config field, e.g. --set stages.0.steps=100")
  parser.add_argument("--no-progress", action="store_true", help="no progress bars")
  parser.add_argument("--skip-final-eval", action="store_true")
  parser.add_argument("--data-file", default=None,
                      help="train, validate and test on this file's bytes (split 90/5/5) "
                           "instead of the config's dataset")
  add_distributed_args(parser)
  args = parser.parse_args(argv)

  # Import JAX only now: --help works anywhere, and a pod slice initialises before any device use.
  import jax  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  from longformer_jax import training  # pylint: disable=g-import-not-at-top
  from longformer_jax.io import atomic_write  # pylint: disable=g-import-not-at-top
  initialize_distributed(args)

  cfg = apply_overrides(load_config(args.config), args.set)
  workdir = epath.Path(args.workdir or Path("runs") / Path(args.config).stem)
  is_main = jax.process_index() == 0
  if is_main:
    print(f"{jax.process_count()} process(es), devices: {jax.devices()}")
    print(f"workdir: {workdir}")
  mesh = training.make_mesh(cfg.mesh_shape)
  data = {}
  if args.data_file is not None:
    data = {"train_data": split_of_file(args.data_file, "train"),
            "valid_data": split_of_file(args.data_file, "validation")}
  start = time.perf_counter()
  summary = training.train(cfg, workdir, mesh=mesh, progress=not args.no_progress, **data)
  train_minutes = (time.perf_counter() - start) / 60
  if summary["status"] != "done":
    # Preempted: the checkpoint is saved; rerun the same command to resume. Not 0, so that a
    # scheduler can tell a preempted run from a finished one.
    return EXIT_PREEMPTED
  results = {"config": args.config, "overrides": args.set, "data_file": args.data_file,
             "steps": summary["step"],
             "final_train_loss": summary["last_loss"], "valid_bpc": summary.get("valid_bpc"),
             "train_minutes_this_run": round(train_minutes, 2)}
  if cfg.final_eval is not None and not args.skip_final_eval:
    # pylint: disable=g-import-not-at-top
    from longformer_jax.data import load_split
    from longformer_jax.evaluation import describe, evaluate_run
    # pylint: enable=g-import-not-at-top
    eval_args = dict(cfg.final_eval)
    split = eval_args.pop("split", "test")
    if args.data_file is not None:
      source, data = args.data_file, split_of_file(args.data_file, split)
    else:
      source, data = cfg.dataset, load_split(cfg.dataset, split, cfg.data_dir)
    result = evaluate_run(workdir, data, mesh=mesh, progress=not args.no_progress, **eval_args)
    results.update({f"{split}_bpc": result["bpc"],
                    "eval": {"dataset": source, "split": split, **result}})
    if is_main:
      print(f"{source} {split}: {describe(result)}")
  if is_main:
    atomic_write(workdir / "results.json", json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
