"""Fine-tune a Longformer on a classification, QA, tagging or multiple-choice JSONL dataset, then
score its validation and test splits.

    python -m train.finetune --task classification --model ./longformer-base-4096 \\
        --tokenizer ./longformer-base-4096/tokenizer.json --train train.jsonl \\
        --validation valid.jsonl --test test.jsonl --max-length 4096 --steps 2000 \\
        --batch-size 8 --learning-rate 3e-5 --workdir runs/my_classifier
    python -m train.finetune --task classification --eval-only --workdir runs/my_classifier \\
        --tokenizer ./longformer-base-4096/tokenizer.json --test test.jsonl

--task: classification (global attention on <s>), qa (extractive, global attention on the
question), token (tagging) or multiple_choice (one row per candidate, global attention on the
question and the candidate). --model: a local HF Longformer or RoBERTa directory (RoBERTa is made
long by `convert.roberta_to_longformer`), a project checkpoint (`checkpoint.save_model`) or
training workdir, or a preset (`tiny`: 2 layers, hidden 64, window 32, 512 ids, 4,096 positions;
`base`, `large`: fresh weights). The task's head is initialised anew unless the checkpoint has one
of the same task and size. Data: JSONL, one record per line with "text" (tokenized by
--tokenizer, a local tokenizer.json) or "input_ids", and the task's fields (docs/finetune.md,
`longformer_jax.data.finetune_data`); a record that breaks the rules is an error naming the file,
the line and the field.

Training runs the shared loop (`longformer_jax.training`, `FinetuneTask`): AdamW, --steps at
--learning-rate with a linear warm-up over the first 10% and a linear decay to 0, rows of
--max-length tokens (default: the model's positions). `--set path=value` sets the fine-tuning
options (`FinetuneOptions`: global_attention=default|none|first|question, max_answer_length,
max_question_length, label_names, roberta_positions, roberta_window) and any TrainConfig field
(`--set model.hidden_dropout_prob=0.1`, `--set eval_every=200`, `--set stages.0.warmup_steps=0`).
Rerunning the same command resumes from the newest checkpoint that verifies, and refuses to if
the model, the data, the tokenizer, the global attention or the stages already trained differ
(`--allow-change FIELD` for an optimiser or schedule setting). --eval-only trains nothing: it
scores the parameters of --workdir's newest checkpoint (else of --model) with the run's settings.

Writes into --workdir: checkpoints/, run_config.json, metrics.jsonl, curves.png,
predictions_<split>.jsonl and results.json ({"validation": {metrics, "examples"}, "test": ...}),
each file written whole or not at all. Exit status: 0 done; 75 stopped by SIGTERM after saving
its step (rerun to resume); 1 the run failed (one `error:` line: settings that differ from the
run's, a diverging loss, a failed save); 2 a bad command line, --set, model, tokenizer or data file
(one line naming it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from train.cli import (EXIT_PREEMPTED, add_distributed_args, initialize_distributed,
                       positive_float, positive_int)

SPLITS = ("validation", "test")
TASKS = ("classification", "qa", "token", "multiple_choice")


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--task", required=True, choices=TASKS)
  parser.add_argument("--model", default=None,
                      help="HF Longformer or RoBERTa directory, project checkpoint or workdir, "
                           "or a preset (tiny, base, large); not needed with --eval-only on a "
                           "workdir that has checkpoints")
  parser.add_argument("--tokenizer", default=None,
                      help="a tokenizer.json (or a directory holding one); needed for text "
                           "records")
  parser.add_argument("--train", default=None, help="training records (JSONL)")
  parser.add_argument("--validation", default=None,
                      help="validation records (JSONL): metrics during training and at the end")
  parser.add_argument("--test", default=None, help="test records (JSONL): metrics at the end")
  parser.add_argument("--max-length", type=positive_int, default=None,
                      help="tokens per row (longer records are cut; default: the model's "
                           "positions, or the run's with --eval-only)")
  parser.add_argument("--steps", type=positive_int, default=1000, help="optimizer steps")
  parser.add_argument("--batch-size", type=positive_int, default=8,
                      help="records per step (global)")
  parser.add_argument("--learning-rate", type=positive_float, default=3e-5)
  parser.add_argument("--seed", type=int, default=0,
                      help="batch order, dropout, the new head, fresh weights of a preset")
  parser.add_argument("--workdir", default=None,
                      help="default: runs/finetune_<task>_<name of the --train file>")
  parser.add_argument("--eval-only", action="store_true",
                      help="train nothing: score --validation/--test with the parameters of "
                           "--workdir's newest checkpoint (else of --model)")
  parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                      help="a fine-tuning option or TrainConfig field, e.g. --set "
                           "global_attention=none, --set eval_every=100")
  parser.add_argument("--allow-change", action="append", default=[], metavar="FIELD",
                      help="on resume, let this optimiser/schedule setting differ from the "
                           "run's, e.g. --allow-change stages.0.learning_rate")
  parser.add_argument("--no-progress", action="store_true", help="no progress bars")
  add_distributed_args(parser)
  args = parser.parse_args(argv)
  if not args.eval_only and (args.train is None or args.model is None):
    parser.error("training needs --train and --model (or use --eval-only)")
  if args.eval_only and args.validation is None and args.test is None:
    parser.error("--eval-only needs --validation or --test")
  if args.seed < 0:
    parser.error(f"--seed must be >= 0, got {args.seed}")
  return parser, args


@dataclasses.dataclass
class Run:
  """What the command line describes."""
  cfg: Any                   # TrainConfig
  options: Any               # FinetuneOptions
  global_attention: str      # resolved: "none", "first" or "question"
  splits: dict[str, Any]     # name -> FinetuneSplit
  task: Any = None           # FinetuneTask (training)
  source: Any = None         # ModelSource (training, or --eval-only without a checkpoint)
  from_workdir: bool = False  # --eval-only: of the workdir's newest checkpoint


def split_overrides(assignments: list[str]) -> tuple[list[str], list[str]]:
  """(FinetuneOptions assignments, TrainConfig assignments) of the --set values."""
  from longformer_jax.tasks.finetune import FinetuneOptions
  names = {f.name for f in dataclasses.fields(FinetuneOptions)}
  mine = [a for a in assignments if a.partition("=")[0].strip().split(".")[0] in names]
  return mine, [a for a in assignments if a not in mine]


def _read_splits(args, cfg, tokenizer, options, label_names) -> dict[str, Any]:
  from longformer_jax.data import finetune_data as fd
  from longformer_jax.data.tokenizer import SpecialIds
  from longformer_jax.tasks.finetune import KINDS
  # --eval-only reads no training file.
  paths = {"train": None if args.eval_only else args.train, "validation": args.validation,
           "test": args.test}
  return {name: fd.read_split(path, KINDS[args.task], tokenizer, max_length=cfg.stages[0].seq_len,
                              specials=SpecialIds.of_config(cfg.model),
                              vocab_size=cfg.model.vocab_size,
                              max_question_length=options.max_question_length,
                              label_names=label_names)
          for name, path in paths.items() if path is not None}


def build(args: argparse.Namespace, workdir) -> Run:
  """The run the command line describes; ValueError, TypeError or FileNotFoundError naming what
  is wrong."""
  from longformer_jax import checkpoint
  from longformer_jax.data import text
  from longformer_jax.training import Stage, TrainConfig, apply_overrides
  from longformer_jax.tasks import finetune
  from longformer_jax.training.config import config_from_record, read_run_record
  from longformer_jax.data.tokenizer import check_tokenizer
  option_sets, config_sets = split_overrides(args.set)
  kind = finetune.KINDS[args.task]
  tokenizer = None if args.tokenizer is None else text.load_tokenizer(args.tokenizer)
  if args.eval_only and checkpoint.checkpoint_steps(workdir / checkpoint.CHECKPOINTS):
    # The run's own settings; --set may still change the evaluation's (e.g. global_attention).
    record = read_run_record(workdir)
    data = record.get("data") or {}
    if data.get("task") != args.task:
      raise ValueError(f"{workdir} is a run of task {data.get('task')!r}, not {args.task!r}")
    cfg = apply_overrides(config_from_record(record, f"{workdir}/run_config.json"), config_sets)
    options = apply_overrides(finetune.FinetuneOptions(
        global_attention=data["global_attention"],
        max_question_length=data["max_question_length"],
        label_names=None if data["label_names"] is None else tuple(data["label_names"])),
        option_sets)
    if args.max_length is not None:
      cfg = dataclasses.replace(cfg, stages=(dataclasses.replace(
          cfg.stages[0], seq_len=args.max_length),) + cfg.stages[1:])
    if tokenizer is not None:
      check_tokenizer(tokenizer, cfg.model)
    splits = _read_splits(args, cfg, tokenizer, options, options.label_names)
    for split in splits.values():
      kind.check_labels(split, cfg.model)
    return Run(cfg, options, kind.resolve_global(options.global_attention), splits,
               from_workdir=True)

  if args.model is None:
    raise ValueError(f"{workdir} has no checkpoint to evaluate: give --model")
  options = apply_overrides(finetune.FinetuneOptions(), option_sets)
  mode = kind.resolve_global(options.global_attention)
  source = finetune.load_source(args.model, tokenizer, options=options)
  label_names = kind.label_names([p for p in (args.train, args.validation, args.test) if p],
                                 options.label_names)
  max_length = args.max_length or source.config.max_sequence_length
  cfg = TrainConfig(
      model=source.config, dataset="jsonl", seed=args.seed,
      stages=(Stage(seq_len=max_length, batch_size=args.batch_size, steps=args.steps,
                    learning_rate=args.learning_rate, warmup_steps=args.steps // 10,
                    end_learning_rate=0.0, decay_power=1.0),))
  cfg = apply_overrides(cfg, config_sets)
  if tokenizer is not None:
    check_tokenizer(tokenizer, cfg.model)
  splits = _read_splits(args, cfg, tokenizer, options, label_names)
  if not any(a.partition("=")[0].strip() == "model.num_labels" for a in config_sets):
    size = kind.num_labels(list(splits.values()), source)
    cfg = dataclasses.replace(cfg, model=cfg.model.replace(num_labels=size))
  for split in splits.values():
    kind.check_labels(split, cfg.model)
  if args.eval_only:
    if source.params is None:
      raise ValueError(f"nothing to evaluate: {workdir} has no checkpoint and --model "
                       f"{args.model} is a preset (fresh weights)")
    return Run(cfg, options, mode, splits, source=source)
  identity = {"init": source.identity}
  if tokenizer is not None:
    identity["tokenizer_sha256"] = text.file_sha256(text.tokenizer_file(args.tokenizer))
  task = finetune.FinetuneTask(args.task, splits["train"], splits.get("validation"),
                               global_attention=mode, options=options, identity=identity)
  task.check(cfg)
  return Run(cfg, options, mode, splits, task=task, source=source)


def main(argv: list[str] | None = None) -> int:
  parser, args = parse_args(argv)
  # Import JAX only now: --help works anywhere, and a pod slice initialises before any device use.
  import jax
  from etils import epath
  from longformer_jax import training
  from longformer_jax.checkpoint import CheckpointError
  initialize_distributed(args)
  default = Path("runs") / f"finetune_{args.task}_{Path(args.train or 'eval').stem}"
  workdir = epath.Path(args.workdir or default)
  try:
    run = build(args, workdir)
  except (ValueError, TypeError, FileNotFoundError) as e:
    # A usage or data error: argparse's status 2 and one line naming the file, line and field
    # or the setting (no traceback, and no usage text, which says nothing about the value).
    parser.exit(2, f"{parser.prog}: error: {e}\n")
  is_main = jax.process_index() == 0
  if is_main:
    print(f"{jax.process_count()} process(es), devices: {jax.devices()}")
    print(f"workdir: {workdir}")
    print(", ".join(f"{name} {len(split):,} records" for name, split in run.splits.items())
          + f"; global attention: {run.global_attention}")
    if run.task is not None and run.task.skipped:
      print(f"{run.task.skipped} training records have no answer inside --max-length: not "
            f"trained on")
  mesh = training.make_mesh(run.cfg.mesh_shape)
  try:
    if args.eval_only:
      return _evaluate_only(args, run, workdir, mesh)
    return _train_and_evaluate(args, run, workdir, mesh)
  except (training.RunMismatchError, training.NonFiniteLossError, CheckpointError) as e:
    # Expected failures of a run say all there is in one line (a traceback would bury it).
    if is_main:
      print(f"error: {e}", file=sys.stderr)
    return 1


def _build_fn(args, cfg, mesh):
  """A function that builds the task's model for `mesh` (fresh parameters from the seed)."""
  from flax import nnx
  from longformer_jax.tasks.finetune import MODEL_CLASSES
  from longformer_jax.training.sharding import seq_axis
  return lambda: MODEL_CLASSES[args.task](cfg.model, rngs=nnx.Rngs(cfg.seed), mesh=mesh,
                                          seq_axis=seq_axis(mesh))


def _restore(args, run: Run, workdir, mesh):
  """(model, step) of the workdir's newest checkpoint that verifies, in the run's shardings."""
  from longformer_jax import checkpoint, training
  model, step, _ = checkpoint.restore_model_and_meta(
      _build_fn(args, run.cfg, mesh), workdir,
      shardings=lambda params: training.param_shardings(params, mesh, run.cfg.logical_rules))
  return model, step


def _initial_model(args, run: Run, mesh):
  """The task's model with the source's weights (`finetune.initial_params`), laid out on the
  mesh as a trained run's parameters are."""
  import jax
  from flax import nnx
  from longformer_jax import training
  from longformer_jax.tasks import finetune
  model = _build_fn(args, run.cfg, mesh)()
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, finetune.initial_params(run.source, model))
  nnx.update(model, jax.device_put(
      state, training.param_shardings(state, mesh, run.cfg.logical_rules)))
  return model


def _train_and_evaluate(args, run: Run, workdir, mesh) -> int:
  from flax import nnx
  from longformer_jax import training
  from longformer_jax.tasks import finetune
  cfg, task = run.cfg, run.task

  def init_params():
    # Only for a new run: the encoder from --model, the head anew where the source has none.
    model = task.build_model(cfg.model, nnx.Rngs(cfg.seed))
    return finetune.initial_params(run.source, model)

  start = time.perf_counter()
  summary = training.train(cfg, workdir, mesh=mesh, task=task, progress=not args.no_progress,
                           allow_changes=args.allow_change,
                           init_params=None if run.source.params is None else init_params)
  train_minutes = (time.perf_counter() - start) / 60
  if summary["status"] != "done":
    return EXIT_PREEMPTED
  # The trained weights: the checkpoint saved at the last step (the newest that verifies).
  model, step = _restore(args, run, workdir, mesh)
  results = {"task": args.task, "model": args.model, "steps": summary["step"],
             "checkpoint_step": step, "final_train_loss": summary["last_loss"],
             "global_attention": run.global_attention,
             "train_minutes_this_run": round(train_minutes, 2)}
  return _score_splits(args, run, model, results, workdir, mesh)


def _evaluate_only(args, run: Run, workdir, mesh) -> int:
  if run.from_workdir:
    model, step = _restore(args, run, workdir, mesh)
    origin = {"workdir": str(workdir), "checkpoint_step": step}
  else:
    model, origin = _initial_model(args, run, mesh), {"model": args.model}
  results = {"task": args.task, **origin, "global_attention": run.global_attention,
             "eval_only": True}
  return _score_splits(args, run, model, results, workdir, mesh)


def _score_splits(args, run: Run, model, results: dict[str, Any], workdir, mesh) -> int:
  """Scores --validation and --test, then writes predictions_<split>.jsonl and results.json."""
  import jax
  from longformer_jax.io import atomic_write
  from longformer_jax.tasks import finetune
  is_main = jax.process_index() == 0
  files = {}
  for name in SPLITS:
    if name not in run.splits:
      continue
    split = run.splits[name]
    outputs = finetune.predict(
        model, split, global_attention=run.global_attention,
        max_answer_length=run.options.max_answer_length, batch_size=run.cfg.eval_batch_size,
        mesh=mesh, rules=run.cfg.logical_rules, progress=not args.no_progress)
    metrics, records = finetune.score(split, outputs)
    results[name] = metrics
    files[f"predictions_{name}.jsonl"] = "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                 for r in records)
    if is_main:
      print(f"{name}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                    for k, v in metrics.items()))
  files["results.json"] = json.dumps(results, indent=2) + "\n"
  if is_main:
    workdir.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():  # each whole or not at all
      atomic_write(workdir / name, content)
    print(f"wrote {', '.join(files)} in {workdir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
