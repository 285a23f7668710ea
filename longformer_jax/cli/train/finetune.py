"""Fine-tune a Longformer on a classification, QA, tagging or multiple-choice JSONL dataset, then
score its validation and test splits (docs/finetune.md).

    python -m train.finetune --task classification --model ./longformer-base-4096 \\
        --tokenizer ./longformer-base-4096/tokenizer.json --train train.jsonl \\
        --validation valid.jsonl --test test.jsonl --max-length 4096 --steps 2000 \\
        --batch-size 8 --learning-rate 3e-5 --workdir runs/my_classifier
    python -m train.finetune --preset finetune_tiny --task qa --train train.jsonl

--task: classification, qa, token (tagging) or multiple_choice. --model: a local HF Longformer
or RoBERTa directory, a project checkpoint or training workdir, or a model preset (tiny, base,
large: fresh weights). Records: JSONL with "text" (tokenized by --tokenizer) or "input_ids" and
the task's fields. docs/finetune.md says more of each.

Settings (`longformer_jax.cli.driver`): `--preset NAME` or `--config FILE` (whose get_config()
returns settings by flag name or --set path, e.g. {"task": "qa", "model": "tiny", "steps": 20}),
then the flags, then `--set path=value` (a TrainConfig field or a `FinetuneOptions` one).
Training: AdamW, --steps at --learning-rate, linear warm-up over the first 10% and linear decay
to 0, rows of --max-length tokens (default: the model's positions); rerunning resumes, and more
--steps extend a run: its warm-up stays, and the decay goes on from the last step taken.

Writes into --workdir (each file whole or not at all): checkpoints/, run_config.json,
tokenizer.json (--tokenizer's), metrics.jsonl, curves.png, predictions_<split>.jsonl, results.json;
--eval-only (the run's model, length, tokenizer and data settings; a --set that changes them is
refused, one that changes only how it is evaluated, e.g. global_attention or eval_batch_size, is
recorded under "changed_settings") eval_results.json and eval_*.
Exit status: 0 done; 75 stopped by SIGTERM after saving its step (rerun to resume); 1 the run
failed, or another job holds the workdir (one `error:` line); 2 a bad command line, setting,
model, tokenizer, data file, mesh or workdir (one line, before training).
"""

from __future__ import annotations

import sys
from pathlib import Path

from longformer_jax.cli.driver import (
    Plan, TrainCommand, nonnegative_int, positive_float, positive_int)
from longformer_jax.tasks.finetune import KINDS, FinetuneOptions


class Finetune(TrainCommand):
  prog = "train.finetune"
  doc = __doc__
  preset_task = "finetune"
  flag_settings = True
  required = ("task",)
  options_class = FinetuneOptions

  def add_arguments(self, parser):
    parser.add_argument("--task", default=None, choices=tuple(KINDS))
    parser.add_argument("--model", default=None,
                        help="HF Longformer/RoBERTa directory, checkpoint, workdir or preset "
                             "(tiny, base, large); not with --eval-only of a trained workdir")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer.json (or its directory), for text records")
    parser.add_argument("--train", default=None, help="training records (JSONL)")
    parser.add_argument("--validation", default=None, help="validation records (JSONL)")
    parser.add_argument("--test", default=None, help="test records (JSONL): metrics at the end")
    parser.add_argument("--max-length", type=positive_int, default=None,
                        help="tokens per row, longer records cut (default: the model's "
                             "positions; the run's with --eval-only)")
    parser.add_argument("--steps", type=positive_int, default=1000, help="optimizer steps")
    parser.add_argument("--batch-size", type=positive_int, default=8,
                        help="records per step (global)")
    parser.add_argument("--learning-rate", type=positive_float, default=3e-5)
    parser.add_argument("--seed", type=nonnegative_int, default=0,
                        help="batch order, dropout, the new head, fresh weights of a preset")
    parser.add_argument("--eval-only", action="store_true",
                        help="score --validation/--test with --workdir's newest checkpoint "
                             "(else --model)")

  def validate(self, parser, args):
    if not args.eval_only and (args.train is None or args.model is None):
      parser.error("training needs --train and --model (or use --eval-only)")
    if args.eval_only and args.validation is None and args.test is None:
      parser.error("--eval-only needs --validation or --test")

  def default_workdir(self, args):
    return Path("runs") / f"finetune_{args.task}_{Path(args.train or 'eval').stem}"

  def base_options(self, args, workdir):
    from longformer_jax import checkpoint
    from longformer_jax.data.tokenizer import load_tokenizer
    from longformer_jax.tasks import finetune
    self.source = self.run = self.run_options = None
    self.eval_changes = {}
    if args.eval_only and checkpoint.checkpoint_steps(workdir / checkpoint.CHECKPOINTS):
      # The run's settings, length, tokenizer; --set may change only how it is evaluated
      # (`finetune.eval_only_changes`, checked in finish_config).
      self.run, options, self.tokenizer = finetune.run_settings(
          workdir, args.task, args.max_length, args.tokenizer)
      self.run_options = options
      return options
    self.tokenizer = None if args.tokenizer is None else load_tokenizer(args.tokenizer)
    return FinetuneOptions()

  def base_config(self, args, options, workdir):
    from longformer_jax.tasks import finetune
    if self.run is not None:
      return self.run
    if args.model is None:
      raise ValueError(f"{workdir} has no checkpoint to evaluate: give --model")
    self.source = finetune.load_source(args.model, self.tokenizer, options=options)
    return finetune.new_run_config(
        self.source, steps=args.steps, batch_size=args.batch_size,
        learning_rate=args.learning_rate, max_length=args.max_length, seed=args.seed,
        warmup_steps=finetune.started_warmup(workdir))

  def finish_config(self, args, cfg, options, workdir):
    from longformer_jax.data.tokenizer import check_tokenizer
    from longformer_jax.tasks import finetune
    if self.run is not None:
      self.eval_changes = finetune.eval_only_changes(self.run, cfg, self.run_options, options)
    if self.tokenizer is not None:
      check_tokenizer(self.tokenizer, cfg.model)
    files = {"train": None if args.eval_only else args.train, "validation": args.validation,
             "test": args.test}
    # A new run's labels are its training file's; a trained run's, its own (options).
    self.splits = finetune.read_splits(args.task, files, self.tokenizer, cfg, options,
                                       new_run=self.run is None)
    sized = any(a.partition("=")[0].strip() == "model.num_labels" for a in args.set)
    return finetune.fit_head(args.task, cfg, self.splits, None if sized else self.source)

  def plan(self, args, cfg, options, workdir):
    from longformer_jax.tasks import finetune
    mode = KINDS[args.task].resolve_global(options.global_attention)
    lines = (", ".join(f"{name} {len(split):,} records" for name, split in self.splits.items())
             + f"; global attention: {mode}",)
    if args.eval_only:
      evaluate = finetune.evaluation_only(
          args.task, cfg, self.source, workdir, self.splits, global_attention=mode,
          options=options, progress=not args.no_progress)
      origin = ({"workdir": str(workdir), "changed_settings": self.eval_changes}
                if self.run is not None else {"model": args.model})
      return Plan(None, {"task": args.task, **origin, "global_attention": mode,
                         "eval_only": True}, evaluate=evaluate, lines=lines)
    task = finetune.training_task(args.task, self.splits, cfg, source=self.source,
                                  tokenizer=args.tokenizer, global_attention=mode,
                                  options=options)
    finetune.keep_tokenizer(workdir, args.tokenizer)  # --eval-only's default
    if task.skipped:
      lines += (f"{task.skipped} training records have no answer inside --max-length: not "
                f"trained on",)
    init_params = (None if self.source.params is None
                   else lambda: finetune.starting_params(self.source, task, cfg))
    return Plan(task, {"task": args.task, "model": args.model, "global_attention": mode},
                init_params=init_params, lines=lines)


def main(argv: list[str] | None = None) -> int:
  return Finetune().main(argv)


if __name__ == "__main__":
  sys.exit(main())
