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
--max-length tokens (default: the model's positions); these flags and --batch-size, --seed are
shorthands for settings. `--set path=value` sets any setting: a TrainConfig field (`--set
model.hidden_dropout_prob=0.1`, `--set eval_every=200`, `--set stages.0.warmup_steps=0`) or a
fine-tuning option (`FinetuneOptions`: global_attention=default|none|first|question,
max_answer_length, max_question_length, label_names, roberta_positions, roberta_window);
`--print-config` shows them all. Rerunning the same command resumes from the newest checkpoint
that verifies, and refuses to if the model, the data, the tokenizer, the global attention or the
stages already trained differ (`--allow-change FIELD` for an optimiser or schedule setting).
--eval-only trains nothing: it scores the parameters of --workdir's newest checkpoint (else of
--model) with the run's settings.

Writes into --workdir: checkpoints/, run_config.json, metrics.jsonl, curves.png,
predictions_<split>.jsonl and results.json ({"validation": {metrics, "examples"}, "test": ...}),
each file written whole or not at all. Exit status: 0 done; 75 stopped by SIGTERM after saving
its step (rerun to resume); 1 the run failed (one `error:` line); 2 a bad command line, --set,
model, tokenizer or data file (one line naming it).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from longformer_jax.cli.driver import (
    Plan, TrainCommand, nonnegative_int, positive_float, positive_int)
from longformer_jax.tasks.finetune import KINDS, FinetuneOptions

TASKS = tuple(KINDS)


class Finetune(TrainCommand):
  prog = "train.finetune"
  doc = __doc__
  config_files = False
  options_class = FinetuneOptions

  def add_arguments(self, parser):
    parser.add_argument("--task", required=True, choices=TASKS)
    parser.add_argument("--model", default=None,
                        help="HF Longformer or RoBERTa directory, project checkpoint or "
                             "workdir, or a preset (tiny, base, large); not needed with "
                             "--eval-only on a workdir that has checkpoints")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer.json (or a directory holding one); needed for text "
                             "records")
    parser.add_argument("--train", default=None, help="training records (JSONL)")
    parser.add_argument("--validation", default=None,
                        help="validation records (JSONL): metrics during training and at the "
                             "end")
    parser.add_argument("--test", default=None, help="test records (JSONL): metrics at the end")
    parser.add_argument("--max-length", type=positive_int, default=None,
                        help="tokens per row (longer records are cut; default: the model's "
                             "positions, or the run's with --eval-only)")
    parser.add_argument("--steps", type=positive_int, default=1000, help="optimizer steps")
    parser.add_argument("--batch-size", type=positive_int, default=8,
                        help="records per step (global)")
    parser.add_argument("--learning-rate", type=positive_float, default=3e-5)
    parser.add_argument("--seed", type=nonnegative_int, default=0,
                        help="batch order, dropout, the new head, fresh weights of a preset")
    parser.add_argument("--eval-only", action="store_true",
                        help="train nothing: score --validation/--test with the parameters of "
                             "--workdir's newest checkpoint (else of --model)")

  def validate(self, parser, args):
    if not args.eval_only and (args.train is None or args.model is None):
      parser.error("training needs --train and --model (or use --eval-only)")
    if args.eval_only and args.validation is None and args.test is None:
      parser.error("--eval-only needs --validation or --test")

  def default_workdir(self, args):
    return Path("runs") / f"finetune_{args.task}_{Path(args.train or 'eval').stem}"

  def _from_workdir(self, args, workdir) -> bool:
    from longformer_jax import checkpoint
    return args.eval_only and bool(checkpoint.checkpoint_steps(workdir / checkpoint.CHECKPOINTS))

  def base_options(self, args, workdir):
    from longformer_jax.data import text
    self.tokenizer = None if args.tokenizer is None else text.load_tokenizer(args.tokenizer)
    self.from_workdir = self._from_workdir(args, workdir)
    if not self.from_workdir:
      return FinetuneOptions()
    # The run's own settings; --set may still change the evaluation's (e.g. global_attention).
    from longformer_jax.training.config import read_run_record
    self.record = read_run_record(workdir)
    data = self.record.get("data") or {}
    if data.get("task") != args.task:
      raise ValueError(f"{workdir} is a run of task {data.get('task')!r}, not {args.task!r}")
    return FinetuneOptions(
        global_attention=data["global_attention"],
        max_question_length=data["max_question_length"],
        label_names=None if data["label_names"] is None else tuple(data["label_names"]))

  def base_config(self, args, options, workdir):
    from longformer_jax.tasks import finetune
    from longformer_jax.training import Stage, TrainConfig
    from longformer_jax.training.config import config_from_record
    self.source = None
    if self.from_workdir:
      return config_from_record(self.record, f"{workdir}/run_config.json")
    if args.model is None:
      raise ValueError(f"{workdir} has no checkpoint to evaluate: give --model")
    self.source = finetune.load_source(args.model, self.tokenizer, options=options)
    return TrainConfig(
        model=self.source.config, dataset="jsonl", seed=args.seed,
        stages=(Stage(seq_len=args.max_length or self.source.config.max_sequence_length,
                      batch_size=args.batch_size, steps=args.steps,
                      learning_rate=args.learning_rate, warmup_steps=args.steps // 10,
                      end_learning_rate=0.0, decay_power=1.0),))

  def shorthands(self, args, cfg):
    if self.from_workdir and args.max_length is not None:
      cfg = dataclasses.replace(cfg, stages=(dataclasses.replace(
          cfg.stages[0], seq_len=args.max_length),) + cfg.stages[1:])
    return cfg

  def finish_config(self, args, cfg, options, workdir):
    from longformer_jax.data import finetune_data as fd
    from longformer_jax.data.tokenizer import SpecialIds, check_tokenizer
    from longformer_jax.tasks.finetune import KINDS
    kind = KINDS[args.task]
    if self.tokenizer is not None:
      check_tokenizer(self.tokenizer, cfg.model)
    label_names = options.label_names
    if not self.from_workdir:
      label_names = kind.label_names([p for p in (args.train, args.validation, args.test) if p],
                                     label_names)
    # --eval-only reads no training file.
    paths = {"train": None if args.eval_only else args.train, "validation": args.validation,
             "test": args.test}
    self.splits = {
        name: fd.read_split(path, kind, self.tokenizer, max_length=cfg.stages[0].seq_len,
                            specials=SpecialIds.of_config(cfg.model),
                            vocab_size=cfg.model.vocab_size,
                            max_question_length=options.max_question_length,
                            label_names=label_names)
        for name, path in paths.items() if path is not None}
    if not self.from_workdir and not any(a.partition("=")[0].strip() == "model.num_labels"
                                         for a in args.set):
      size = kind.num_labels(list(self.splits.values()), self.source)
      cfg = dataclasses.replace(cfg, model=cfg.model.replace(num_labels=size))
    for split in self.splits.values():
      kind.check_labels(split, cfg.model)
    return cfg

  def plan(self, args, cfg, options, workdir):
    from longformer_jax.data import text
    from longformer_jax.tasks import finetune
    mode = finetune.KINDS[args.task].resolve_global(options.global_attention)
    splits = self.splits
    lines = (", ".join(f"{name} {len(split):,} records" for name, split in splits.items())
             + f"; global attention: {mode}",)
    if args.eval_only:
      if not self.from_workdir and self.source.params is None:
        raise ValueError(f"nothing to evaluate: {workdir} has no checkpoint and --model "
                         f"{args.model} is a preset (fresh weights)")
      origin = ({"workdir": str(workdir)} if self.from_workdir else {"model": args.model})
      return Plan(None, {"task": args.task, **origin, "global_attention": mode,
                         "eval_only": True},
                  evaluate=lambda mesh: self._evaluate(args, cfg, options, mode, workdir, mesh),
                  lines=lines)
    identity = {"init": self.source.identity}
    if self.tokenizer is not None:
      identity["tokenizer_sha256"] = text.file_sha256(text.tokenizer_file(args.tokenizer))
    task = finetune.FinetuneTask(args.task, splits["train"], splits.get("validation"),
                                 global_attention=mode, options=options, identity=identity,
                                 test=splits.get("test"))
    task.check(cfg)
    if task.skipped:
      lines += (f"{task.skipped} training records have no answer inside --max-length: not "
                f"trained on",)

    def init_params():
      # Only for a new run: the encoder from --model, the head anew where the source has none.
      from flax import nnx
      return finetune.initial_params(self.source, task.build_model(cfg.model, nnx.Rngs(cfg.seed)))

    return Plan(task, {"task": args.task, "model": args.model, "global_attention": mode},
                init_params=None if self.source.params is None else init_params, lines=lines)

  def _evaluate(self, args, cfg, options, mode, workdir, mesh):
    """--eval-only: the workdir's newest checkpoint, else --model's weights, scored."""
    from longformer_jax.tasks import finetune
    return finetune.evaluate_only(
        args.task, cfg, None if self.from_workdir else self.source, workdir, mesh,
        {"validation": self.splits.get("validation"), "test": self.splits.get("test")},
        global_attention=mode, options=options, progress=not args.no_progress)


def main(argv: list[str] | None = None) -> int:
  return Finetune().main(argv)


if __name__ == "__main__":
  sys.exit(main())
