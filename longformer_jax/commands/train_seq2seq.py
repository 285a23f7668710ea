"""Fine-tune an LED on (source, target) pairs, then score generated outputs with ROUGE.

    python -m train.seq2seq --model ./led-base-16384 --tokenizer ./led-base-16384/tokenizer.json \\
        --train train.jsonl --validation valid.jsonl --test test.jsonl \\
        --max-source-length 4096 --max-target-length 256 --steps 2000 --batch-size 4 \\
        --workdir runs/my_summaries --num-beams 4
    python -m train.seq2seq --preset seq2seq_tiny --tokenizer tokenizer.json --train train.jsonl

--model: a local HF LED directory, a local HF BART directory (made long by `convert.bart_to_led`:
--bart-positions, --bart-window), a project checkpoint (`checkpoint.save_model` directory) or
training workdir, or a preset (`tiny`, `base`, `large`: fresh weights, vocabulary from the
tokenizer). Data: JSONL, one {"source": ..., "target": ...} object per line (an optional "id",
string or integer, names the pair in the predictions); a line that breaks the rules is an error
naming the file, the line and the field. Tokenized with the `tokenizers` library from a local
tokenizer.json (no hub access).

Training runs the shared loop (`longformer_jax.training`, `Seq2SeqTask`): AdamW, one stage of
--steps at --learning-rate (`--set stages.0.warmup_steps=100 --set stages.0.end_learning_rate=0` for
warm-up and a cosine decay), dropout from the model's config, global attention on the first source
token (--global-attention). The flags --steps, --batch-size, --learning-rate, --seed, --max-source-
length (stages.0.seq_len), --num-beams and --max-new-tokens (final_eval) are fields of the command's
`Seq2SeqConfig`; `--set path=value` sets one of them or any setting of the TrainConfig built from
them (e.g. `--set eval_every=200`, `--set model.dropout=0.0`, `--set mesh_shape=[1,4]`) and
`--print-config` shows the result. `--preset NAME` (train/configs/seq2seq_*) or `--config FILE`
(whose get_config() returns a Seq2SeqConfig) gives defaults that the flags override, and `--set`
comes last (`longformer_jax.cli.settings`). Rerunning the same command resumes from the newest
checkpoint that verifies, and refuses to if the model, the data, the tokenizer or the stages already
trained differ (`--allow-change FIELD` for an optimiser or schedule setting). At the end, outputs
are generated for --validation and --test (greedy, or beam search with --num-beams, at most --max-
new-tokens tokens) and scored with ROUGE-1/2/L F-measures (stemmed, `rouge-score`).

Writes into --workdir: checkpoints/, run_config.json, metrics.jsonl, curves.png,
predictions_<split>.jsonl (one {"id", "prediction", "reference"} per pair) and results.json
({"validation": {"rouge1", "rouge2", "rougeL", "pairs"}, "test": {...}, ...}), each file written
whole or not at all. Exit status: 0 done; 75 stopped by SIGTERM after saving its step (rerun to
resume); 1 the run failed, or another job holds the workdir (one `error:` line); 2 a bad command
line, --set (final_eval's generation settings included), model, tokenizer, data file, mesh or
workdir (one line, before training).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from longformer_jax.cli import settings
from longformer_jax.cli.settings import Command
from longformer_jax.commands.run import Plan, TrainCommand


@dataclasses.dataclass(frozen=True)
class Seq2SeqConfig:
  """The settings of a seq2seq run, each with a flag of its own (`--max-source-length`)."""
  model: str | None = None
  max_source_length: int = 1024
  max_target_length: int = 128
  steps: int = 1000
  batch_size: int = 8
  learning_rate: float = 3e-5
  seed: int = 0
  num_beams: int = 1
  max_new_tokens: int | None = None
  global_attention: str = "first"
  bart_positions: int = 16384
  bart_window: int = 512
  # `path=value` settings of the TrainConfig built from these (`eval_every=200`), applied
  # before the command line's --set.
  train_overrides: tuple[str, ...] = ()

  def __post_init__(self):
    settings.check_bounds(self, dict.fromkeys(
        ("max_source_length", "max_target_length", "steps", "batch_size", "num_beams",
         "max_new_tokens", "bart_positions", "bart_window"), 1))
    settings.check_learning_rate(self.learning_rate)


FLAGS = {
    "model": "HF LED or BART directory, project checkpoint or workdir, or a preset (tiny, "
             "base, large)",
    "max_source_length": "source tokens (longer sources are cut; shorter ones padded)",
    "max_target_length": "target tokens, EOS included (longer targets are cut)",
    "steps": "optimizer steps", "batch_size": "pairs per step (global)",
    "learning_rate": "peak learning rate",
    "seed": "batch order, dropout, fresh weights of a preset",
    "num_beams": "beam search width at the end (1: greedy)",
    "max_new_tokens": "longest generated output (default: --max-target-length)",
    "global_attention": "source tokens with global attention: 'first' (default), 'none', or "
                        "'token:TOKEN' (every occurrence of TOKEN)",
    "bart_positions": "encoder positions of an LED made from a BART directory",
    "bart_window": "one-sided attention window of an LED made from a BART directory",
}


def _inputs(parser):
  parser.add_argument("--tokenizer", default=None,
                      help="a tokenizer.json (or a directory holding one)")
  parser.add_argument("--train", default=None, help="training pairs (JSONL)")
  parser.add_argument("--validation", default=None,
                      help="validation pairs (JSONL): loss during training, ROUGE at the end")
  parser.add_argument("--test", default=None, help="test pairs (JSONL): ROUGE at the end")


class Seq2Seq(TrainCommand):

  def command(self):
    from longformer_jax.training import TrainConfig
    return Command("train.seq2seq", __doc__, Seq2SeqConfig, FLAGS, default=Seq2SeqConfig,
                   presets="train/configs/seq2seq_*", later=TrainConfig, inputs=_inputs)

  def validate(self, parser, parsed):
    missing = [flag for flag, value in (("--model", parsed.config.model),
                                        ("--tokenizer", parsed.args.tokenizer),
                                        ("--train", parsed.args.train)) if value is None]
    if missing:
      parser.error(f"{', '.join(missing)} needed (a flag, or a setting of --config/--preset)")

  def default_workdir(self, parsed):
    return Path("runs") / f"seq2seq_{Path(parsed.args.train).stem}"

  def train_config(self, parsed, workdir):
    from longformer_jax import training
    from longformer_jax.data.tokenizer import check_tokenizer, load_tokenizer
    from longformer_jax.tasks import seq2seq
    from longformer_jax.training import Stage, TrainConfig
    c = parsed.config
    self.tokenizer = load_tokenizer(parsed.args.tokenizer)
    self.source = seq2seq.load_source(c.model, self.tokenizer, bart_positions=c.bart_positions,
                                      bart_window=c.bart_window)
    cfg = training.apply_overrides(TrainConfig(
        model=self.source.config, dataset="jsonl", seed=c.seed,
        stages=(Stage(seq_len=c.max_source_length, batch_size=c.batch_size, steps=c.steps,
                      learning_rate=c.learning_rate),),
        final_eval=dict(num_beams=c.num_beams,
                        max_new_tokens=c.max_new_tokens or c.max_target_length)),
        c.train_overrides + parsed.later)
    seq2seq.check_generation(cfg)
    check_tokenizer(self.tokenizer, cfg.model)
    return cfg

  def plan(self, parsed, cfg, workdir):
    from longformer_jax.data import text
    from longformer_jax.data.tokenizer import tokenizer_file
    from longformer_jax.tasks import seq2seq
    args, c = parsed.args, parsed.config
    lengths = dict(max_source_length=c.max_source_length,
                   max_target_length=c.max_target_length, eos_token_id=cfg.model.eos_token_id)
    splits = {name: seq2seq.read_pairs(path, self.tokenizer, **lengths)
              for name, path in (("train", args.train), ("validation", args.validation),
                                 ("test", args.test)) if path is not None}
    identity = {"tokenizer_sha256": text.file_sha256(tokenizer_file(args.tokenizer)),
                "init": self.source.identity}
    task = seq2seq.Seq2SeqTask(
        splits["train"], splits.get("validation"),
        global_attention=seq2seq.GlobalAttention.parse(c.global_attention, self.tokenizer),
        identity=identity, test=splits.get("test"), tokenizer=self.tokenizer)
    for name in ("validation", "test"):
      if name in splits:
        seq2seq.check_token_ids(splits[name], cfg.model.vocab_size)
    params = self.source.params
    return Plan(task, {"model": c.model},
                init_params=None if params is None else lambda: params,
                lines=(", ".join(f"{name} {len(split):,} pairs"
                                 for name, split in splits.items()),))


def main(argv: list[str] | None = None) -> int:
  return Seq2Seq().main(argv)


if __name__ == "__main__":
  sys.exit(main())
