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

Settings (`longformer_jax.cli.settings`): `--preset NAME` (train/configs/finetune_*.py) or
`--config FILE` (whose get_config() returns a `FinetuneConfig`, e.g. FinetuneConfig(task="qa",
model="tiny", steps=20)), then the flags, then `--set path=value`: a FinetuneConfig field, a
`FinetuneOptions` one (`options.global_attention=none`, or bare: `global_attention=none`), else a
field of the TrainConfig built from the model (`stages.0.warmup_steps=0`).
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

import dataclasses
import sys
from pathlib import Path

from longformer_jax.cli import settings
from longformer_jax.cli.settings import Command
from longformer_jax.commands.run import Plan, TrainCommand
from longformer_jax.tasks.finetune import KINDS, FinetuneOptions


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
  """The settings of a fine-tuning run (each has a flag of its own, `--max-length`, but options):
  the task kind, the model to start from, the rows' length (None: the model's positions), the
  schedule (AdamW, linear warm-up over the first 10% of the steps, linear decay to 0), the seed
  (batch order, dropout, the new head, a preset's fresh weights), the task's options, and
  settings of the TrainConfig built from them."""
  task: str | None = None
  model: str | None = None
  max_length: int | None = None
  steps: int = 1000
  batch_size: int = 8
  learning_rate: float = 3e-5
  seed: int = 0
  options: FinetuneOptions = FinetuneOptions()
  # `path=value` settings of the TrainConfig built from the model (`stages.0.warmup_steps=0`),
  # applied before the command line's --set.
  train_overrides: tuple[str, ...] = ()

  def __post_init__(self):
    if self.task is not None and self.task not in KINDS:
      raise ValueError(f"task must be one of {tuple(KINDS)}, got {self.task!r}")
    settings.check_bounds(self, dict(max_length=1, steps=1, batch_size=1, seed=0))
    settings.check_learning_rate(self.learning_rate)


FLAGS = {
    "task": f"the task kind: {', '.join(KINDS)}",
    "model": "HF Longformer/RoBERTa directory, checkpoint, workdir or preset (tiny, base, "
             "large); not with --eval-only of a trained workdir",
    "max_length": "tokens per row, longer records cut (default: the model's positions; the "
                  "run's with --eval-only)",
    "steps": "optimizer steps", "batch_size": "records per step (global)",
    "learning_rate": "peak learning rate",
    "seed": "batch order, dropout, the new head, fresh weights of a preset",
    "options.baseline": "longformer (rows read whole) or segments (the paper's RoBERTa "
                        "baseline: the kept tokens read in independent segments)",
    "options.segment_length": "with --baseline segments: tokens per segment row (default 512)",
    "options.segment_overlap": "with --baseline segments: document tokens segments share",
    "options.segment_pool": "with --baseline segments, classification: first (the first "
                            "segment's <s>) or mean",
    "options.length_buckets": "the results' by_length boundaries, e.g. 512 4096 (default 512)",
}


def _inputs(parser):
  parser.add_argument("--tokenizer", default=None,
                      help="a tokenizer.json (or its directory), for text records")
  parser.add_argument("--train", default=None, help="training records (JSONL)")
  parser.add_argument("--validation", default=None, help="validation records (JSONL)")
  parser.add_argument("--test", default=None, help="test records (JSONL): metrics at the end")
  parser.add_argument("--eval-only", action="store_true",
                      help="score --validation/--test with --workdir's newest checkpoint "
                           "(else --model)")


class Finetune(TrainCommand):

  def command(self):
    return Command("train.finetune", __doc__, FinetuneConfig, FLAGS, default=FinetuneConfig,
                   presets="train/configs/finetune_*", options="options",
                   later=_train_config_class(), inputs=_inputs)

  def validate(self, parser, parsed):
    args, config = parsed.args, parsed.config
    if config.task is None:
      parser.error("--task needed (the flag, or a setting of --config, --preset or --set)")
    if not args.eval_only and (args.train is None or config.model is None):
      parser.error("training needs --train and --model (or use --eval-only)")
    if args.eval_only and args.validation is None and args.test is None:
      parser.error("--eval-only needs --validation or --test")

  def default_workdir(self, parsed):
    return (Path("runs")
            / f"finetune_{parsed.config.task}_{Path(parsed.args.train or 'eval').stem}")

  def train_config(self, parsed, workdir):
    from longformer_jax import checkpoint, training
    from longformer_jax.data.tokenizer import check_tokenizer, load_tokenizer
    from longformer_jax.tasks import finetune
    args, config = parsed.args, parsed.config
    self.source = self.run = None
    self.eval_changes = {}
    options = config.options
    if args.eval_only and checkpoint.checkpoint_steps(workdir / checkpoint.CHECKPOINTS):
      # The run's settings, length, tokenizer; --set may change only how it is evaluated.
      self.run, run_options, self.tokenizer = finetune.run_settings(
          workdir, config.task, config.max_length, args.tokenizer)
      options = training.apply_overrides(run_options, _option_sets(args.set))
      cfg = training.apply_overrides(self.run, config.train_overrides + parsed.later)
      self.eval_changes = finetune.eval_only_changes(self.run, cfg, run_options, options)
    else:
      self.tokenizer = None if args.tokenizer is None else load_tokenizer(args.tokenizer)
      if config.model is None:
        raise ValueError(f"{workdir} has no checkpoint to evaluate: give --model")
      self.source = finetune.load_source(config.model, self.tokenizer, options=options)
      cfg = training.apply_overrides(finetune.new_run_config(
          self.source, steps=config.steps, batch_size=config.batch_size,
          learning_rate=config.learning_rate, max_length=config.max_length, seed=config.seed,
          warmup_steps=finetune.started_warmup(workdir)), config.train_overrides + parsed.later)
    self.options = options
    if self.tokenizer is not None:
      check_tokenizer(self.tokenizer, cfg.model)
    files = {"train": None if args.eval_only else args.train, "validation": args.validation,
             "test": args.test}
    # A new run's labels are its training file's; a trained run's, its own (options).
    self.splits = finetune.read_splits(config.task, files, self.tokenizer, cfg, options,
                                       new_run=self.run is None)
    sized = any(a.partition("=")[0].strip() == "model.num_labels"
                for a in config.train_overrides + parsed.later)
    return finetune.fit_head(config.task, cfg, self.splits, None if sized else self.source)

  def printed(self, parsed):
    return {**super().printed(parsed), "options": dataclasses.asdict(self.options)}

  def plan(self, parsed, cfg, workdir):
    from longformer_jax.tasks import finetune
    args, task_name, options = parsed.args, parsed.config.task, self.options
    mode = KINDS[task_name].resolve_global(options.global_attention)
    lines = (", ".join(f"{name} {len(split):,} records" for name, split in self.splits.items())
             + f"; global attention: {mode}",)
    if args.eval_only:
      evaluate = finetune.evaluation_only(
          task_name, cfg, self.source, workdir, self.splits, global_attention=mode,
          options=options, progress=not args.no_progress)
      origin = ({"workdir": str(workdir), "changed_settings": self.eval_changes}
                if self.run is not None else {"model": parsed.config.model})
      return Plan(None, {"task": task_name, **origin, "global_attention": mode,
                         "eval_only": True}, evaluate=evaluate, lines=lines)
    task = finetune.training_task(task_name, self.splits, cfg, source=self.source,
                                  tokenizer=args.tokenizer, global_attention=mode,
                                  options=options)
    finetune.keep_tokenizer(workdir, args.tokenizer)  # --eval-only's default
    if task.skipped:
      lines += (f"{task.skipped} training records have no answer inside --max-length: not "
                f"trained on",)
    init_params = (None if self.source.params is None
                   else lambda: finetune.starting_params(self.source, task, cfg))
    return Plan(task, {"task": task_name, "model": parsed.config.model,
                       "global_attention": mode}, init_params=init_params, lines=lines)


def _train_config_class():
  from longformer_jax.training import TrainConfig
  return TrainConfig


def _option_sets(assignments):
  """The --set assignments of the options, as paths inside them (bare or `options.`)."""
  names = {f.name for f in dataclasses.fields(FinetuneOptions)}
  paths = [a.strip().removeprefix("options.") for a in assignments]
  return [a for a in paths if a.partition("=")[0].split(".")[0] in names]


def main(argv: list[str] | None = None) -> int:
  return Finetune().main(argv)


if __name__ == "__main__":
  sys.exit(main())
