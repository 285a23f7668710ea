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
token (--global-attention). The flags --steps, --batch-size, --learning-rate, --seed,
--max-source-length (stages.0.seq_len), --num-beams and --max-new-tokens (final_eval) are shorthands
for settings; any setting can be set with `--set path=value` (e.g. `--set eval_every=200`, `--set
model.dropout=0.0`, `--set mesh_shape=[1,4]`) and `--print-config` shows the result. `--preset NAME`
or `--config FILE` (whose get_config() returns settings by flag name or --set path, e.g. {"model":
"tiny", "steps": 300}) gives defaults that the flags override, and `--set` comes last
(`longformer_jax.cli.driver`). Rerunning the same command resumes from the newest checkpoint that
verifies, and refuses to if the model, the data, the tokenizer or the stages already trained differ
(`--allow-change FIELD` for an optimiser or schedule setting). At the end, outputs are generated for
--validation and --test (greedy, or beam search with --num-beams, at most --max-new-tokens tokens)
and scored with ROUGE-1/2/L F-measures (stemmed, `rouge-score`).

Writes into --workdir: checkpoints/, run_config.json, metrics.jsonl, curves.png,
predictions_<split>.jsonl (one {"id", "prediction", "reference"} per pair) and results.json
({"validation": {"rouge1", "rouge2", "rougeL", "pairs"}, "test": {...}, ...}), each file written
whole or not at all. Exit status: 0 done; 75 stopped by SIGTERM after saving its step (rerun to
resume); 1 the run failed, or another job holds the workdir (one `error:` line); 2 a bad command
line, --set (final_eval's generation settings included), model, tokenizer, data file, mesh or
workdir (one line, before training).
"""

from __future__ import annotations

import sys
from pathlib import Path

from longformer_jax.cli.driver import Plan, TrainCommand, positive_float, positive_int


class Seq2Seq(TrainCommand):
  prog = "train.seq2seq"
  doc = __doc__
  preset_task = "seq2seq"
  flag_settings = True
  required = ("model", "tokenizer", "train")

  def add_arguments(self, parser):
    parser.add_argument("--model", default=None,
                        help="HF LED or BART directory, project checkpoint or workdir, or a "
                             "preset (tiny, base, large)")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer.json (or a directory holding one)")
    parser.add_argument("--train", default=None, help="training pairs (JSONL)")
    parser.add_argument("--validation", default=None,
                        help="validation pairs (JSONL): loss during training, ROUGE at the end")
    parser.add_argument("--test", default=None, help="test pairs (JSONL): ROUGE at the end")
    parser.add_argument("--max-source-length", type=positive_int, default=1024,
                        help="source tokens (longer sources are cut; shorter ones padded)")
    parser.add_argument("--max-target-length", type=positive_int, default=128,
                        help="target tokens, EOS included (longer targets are cut)")
    parser.add_argument("--steps", type=positive_int, default=1000, help="optimizer steps")
    parser.add_argument("--batch-size", type=positive_int, default=8,
                        help="pairs per step (global)")
    parser.add_argument("--learning-rate", type=positive_float, default=3e-5)
    parser.add_argument("--seed", type=int, default=0,
                        help="batch order, dropout, fresh weights of a preset")
    parser.add_argument("--num-beams", type=positive_int, default=1,
                        help="beam search width at the end (1: greedy)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=None,
                        help="longest generated output (default: --max-target-length)")
    parser.add_argument("--global-attention", default="first",
                        help="source tokens with global attention: 'first' (default), 'none', "
                             "or 'token:TOKEN' (every occurrence of TOKEN)")
    parser.add_argument("--bart-positions", type=positive_int, default=16384,
                        help="encoder positions of an LED made from a BART directory")
    parser.add_argument("--bart-window", type=positive_int, default=512,
                        help="one-sided attention window of an LED made from a BART directory")

  def default_workdir(self, args):
    return Path("runs") / f"seq2seq_{Path(args.train).stem}"

  def base_config(self, args, options, workdir):
    from longformer_jax.data.tokenizer import load_tokenizer
    from longformer_jax.tasks import seq2seq
    from longformer_jax.training import Stage, TrainConfig
    self.tokenizer = load_tokenizer(args.tokenizer)
    self.source = seq2seq.load_source(args.model, self.tokenizer,
                                      bart_positions=args.bart_positions,
                                      bart_window=args.bart_window)
    return TrainConfig(
        model=self.source.config, dataset="jsonl", seed=args.seed,
        stages=(Stage(seq_len=args.max_source_length, batch_size=args.batch_size,
                      steps=args.steps, learning_rate=args.learning_rate),),
        final_eval=dict(num_beams=args.num_beams,
                        max_new_tokens=args.max_new_tokens or args.max_target_length))

  def finish_config(self, args, cfg, options, workdir):
    from longformer_jax.data.tokenizer import check_tokenizer
    from longformer_jax.tasks import seq2seq
    seq2seq.check_generation(cfg)
    check_tokenizer(self.tokenizer, cfg.model)
    return cfg

  def plan(self, args, cfg, options, workdir):
    from longformer_jax.data import text
    from longformer_jax.data.tokenizer import tokenizer_file
    from longformer_jax.tasks import seq2seq
    lengths = dict(max_source_length=args.max_source_length,
                   max_target_length=args.max_target_length, eos_token_id=cfg.model.eos_token_id)
    splits = {name: seq2seq.read_pairs(path, self.tokenizer, **lengths)
              for name, path in (("train", args.train), ("validation", args.validation),
                                 ("test", args.test)) if path is not None}
    identity = {"tokenizer_sha256": text.file_sha256(tokenizer_file(args.tokenizer)),
                "init": self.source.identity}
    task = seq2seq.Seq2SeqTask(
        splits["train"], splits.get("validation"),
        global_attention=seq2seq.GlobalAttention.parse(args.global_attention, self.tokenizer),
        identity=identity, test=splits.get("test"), tokenizer=self.tokenizer)
    for name in ("validation", "test"):
      if name in splits:
        seq2seq.check_token_ids(splits[name], cfg.model.vocab_size)
    params = self.source.params
    return Plan(task, {"model": args.model},
                init_params=None if params is None else lambda: params,
                lines=(", ".join(f"{name} {len(split):,} pairs"
                                 for name, split in splits.items()),))


def main(argv: list[str] | None = None) -> int:
  return Seq2Seq().main(argv)


if __name__ == "__main__":
  sys.exit(main())
