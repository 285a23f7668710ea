"""Train the character-level Longformer LM, then score the test split.

    python -m train.charlm --config train/configs/char_tiny.py
    python -m train.charlm --config train/configs/char_small.py --workdir gs://... \\
        --set dataset=text8 --set stages.0.batch_size=64

Any config field can be overridden with `--set path=value` (dots walk into dataclasses, tuples
and dicts; each value is parsed to its field's type, see `longformer_jax.training.overrides`).
Rerunning the same command resumes from the newest checkpoint in the workdir that verifies
(damaged ones are skipped with a warning), and refuses to if the model, the data or the stages
already trained differ from the run's (`longformer_jax.training.identity`; `--allow-change FIELD`
for an optimiser or schedule setting). Exit status: 0 the schedule finished; 75
(`EXIT_PREEMPTED`) stopped by SIGTERM after saving its step; 1 the run failed (a one-line
`error:` on stderr: settings that differ from the run's, a diverging loss, a failed save, no
checkpoint that restores); 2 a bad command line or `--set`. Writes
<workdir>/metrics.jsonl, tensorboard/, curves.png, checkpoints/ and results.json (the final test
BPC).

Several processes (e.g. on one machine, or hosts that JAX cannot discover by itself) run the same
command with `--distributed on --coordinator-address HOST:PORT --num-processes P --process-id I`
(I = 0..P-1; process 0 listens on PORT), or with the environment variables JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID. `--data-file` trains on any file's bytes (no dataset).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from train.cli import EXIT_PREEMPTED, add_distributed_args, initialize_distributed, load_config


def split_of_file(path: str, split: str):
  """`split` ("train", "validation", "test") of a file's bytes: the first 90%, the next 5%, the
  rest, as the corpora are split."""
  import numpy as np
  from etils import epath
  from longformer_jax.data.corpora import split_bounds
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
  parser.add_argument("--allow-change", action="append", default=[], metavar="FIELD",
                      help="on resume, let this optimiser/schedule setting differ from the "
                           "run's, e.g. --allow-change stages.0.learning_rate (the model and "
                           "data of a run never change)")
  parser.add_argument("--no-progress", action="store_true", help="no progress bars")
  parser.add_argument("--skip-final-eval", action="store_true")
  parser.add_argument("--data-file", default=None,
                      help="train, validate and test on this file's bytes (split 90/5/5) "
                           "instead of the config's dataset")
  add_distributed_args(parser)
  args = parser.parse_args(argv)

  # Import JAX only now: --help works anywhere, and a pod slice initialises before any device use.
  import jax
  from etils import epath
  from longformer_jax import training
  from longformer_jax.checkpoint import CheckpointError
  initialize_distributed(args)

  cfg = load_config(args.config)
  try:
    cfg = training.apply_overrides(cfg, args.set)
  except (ValueError, TypeError) as e:
    # A usage error: argparse's status 2 and one line that names the field (no traceback, and
    # no usage text, which says nothing about the value).
    parser.exit(2, f"{parser.prog}: error: {e}\n")
  workdir = epath.Path(args.workdir or Path("runs") / Path(args.config).stem)
  is_main = jax.process_index() == 0
  if is_main:
    print(f"{jax.process_count()} process(es), devices: {jax.devices()}")
    print(f"workdir: {workdir}")
  mesh = training.make_mesh(cfg.mesh_shape)
  try:
    return _train_and_evaluate(args, cfg, workdir, mesh)
  except (training.RunMismatchError, training.NonFiniteLossError, CheckpointError) as e:
    # Expected failures of a run say all there is in one line (a traceback would bury it).
    if is_main:
      print(f"error: {e}", file=sys.stderr)
    return 1


def _train_and_evaluate(args: argparse.Namespace, cfg, workdir, mesh) -> int:
  import jax
  from longformer_jax import training
  from longformer_jax.io import atomic_write
  from longformer_jax.tasks import CharLMTask
  is_main = jax.process_index() == 0
  task = CharLMTask()
  if args.data_file is not None:
    task = CharLMTask(split_of_file(args.data_file, "train"),
                      split_of_file(args.data_file, "validation"))
  start = time.perf_counter()
  summary = training.train(cfg, workdir, task, mesh=mesh, progress=not args.no_progress,
                           allow_changes=args.allow_change)
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
    from longformer_jax.data import load_split
    from longformer_jax.tasks.charlm import describe, evaluate_run
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
