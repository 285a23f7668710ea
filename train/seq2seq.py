"""Fine-tune an LED on (source, target) pairs, then score generated outputs with ROUGE.

    python -m train.seq2seq --model ./led-base-16384 --tokenizer ./led-base-16384/tokenizer.json \\
        --train train.jsonl --validation valid.jsonl --test test.jsonl \\
        --max-source-length 4096 --max-target-length 256 --steps 2000 --batch-size 4 \\
        --workdir runs/my_summaries --num-beams 4

--model: a local HF LED directory, a local HF BART directory (made long by `convert.bart_to_led`:
--bart-positions, --bart-window), a project checkpoint (`checkpoint.save_model` directory) or
training workdir, or a preset (`tiny`, `base`, `large`: fresh weights, vocabulary from the
tokenizer). Data: JSONL, one {"source": ..., "target": ...} object per line (an optional "id",
string or integer, names the pair in the predictions); a line that breaks the rules is an error
naming the file, the line and the field. Tokenized with the `tokenizers` library from a local
tokenizer.json (no hub access).

Training runs the shared loop (`longformer_jax.training`, `Seq2SeqTask`): AdamW, one stage of
--steps at --learning-rate (`--set stages.0.warmup_steps=100 --set stages.0.end_learning_rate=0`
for warm-up and a cosine decay), dropout from the model's config, global attention on the first
source token (--global-attention). Any TrainConfig field can be set with `--set path=value`
(e.g. `--set eval_every=200`, `--set model.dropout=0.0`, `--set mesh_shape=[1,4]`). Rerunning the
same command resumes from the newest checkpoint that verifies, and refuses to if the model, the
data, the tokenizer or the stages already trained differ (`--allow-change FIELD` for an optimiser
or schedule setting). At the end, outputs are generated for --validation and --test (greedy, or
beam search with --num-beams, at most --max-new-tokens tokens) and scored with ROUGE-1/2/L
F-measures (stemmed, `rouge-score`).

Writes into --workdir: checkpoints/, run_config.json, metrics.jsonl, curves.png,
predictions_<split>.jsonl (one {"id", "prediction", "reference"} per pair) and results.json
({"validation": {"rouge1", "rouge2", "rougeL", "pairs"}, "test": {...}, ...}), each file written
whole or not at all. Exit status: 0 done; 75 stopped by SIGTERM after saving its step (rerun to
resume); 1 the run failed (one `error:` line: settings that differ from the run's, a diverging
loss, a failed save); 2 a bad command line, --set, model, tokenizer or data file (one line).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from train.cli import (EXIT_PREEMPTED, add_distributed_args, initialize_distributed,
                       positive_float, positive_int)

SPLITS = ("validation", "test")


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", required=True,
                      help="HF LED or BART directory, project checkpoint or workdir, or a "
                           "preset (tiny, base, large)")
  parser.add_argument("--tokenizer", required=True,
                      help="a tokenizer.json (or a directory holding one)")
  parser.add_argument("--train", required=True, help="training pairs (JSONL)")
  parser.add_argument("--validation", default=None,
                      help="validation pairs (JSONL): loss during training, ROUGE at the end")
  parser.add_argument("--test", default=None, help="test pairs (JSONL): ROUGE at the end")
  parser.add_argument("--max-source-length", type=positive_int, default=1024,
                      help="source tokens (longer sources are cut; shorter ones padded)")
  parser.add_argument("--max-target-length", type=positive_int, default=128,
                      help="target tokens, EOS included (longer targets are cut)")
  parser.add_argument("--steps", type=positive_int, default=1000, help="optimizer steps")
  parser.add_argument("--batch-size", type=positive_int, default=8, help="pairs per step (global)")
  parser.add_argument("--learning-rate", type=positive_float, default=3e-5)
  parser.add_argument("--seed", type=int, default=0,
                      help="batch order, dropout, fresh weights of a preset")
  parser.add_argument("--workdir", default=None,
                      help="default: runs/seq2seq_<name of the --train file>")
  parser.add_argument("--num-beams", type=positive_int, default=1,
                      help="beam search width at the end (1: greedy)")
  parser.add_argument("--max-new-tokens", type=positive_int, default=None,
                      help="longest generated output (default: --max-target-length)")
  parser.add_argument("--global-attention", default="first",
                      help="source tokens with global attention: 'first' (default), 'none', or "
                           "'token:TOKEN' (every occurrence of TOKEN)")
  parser.add_argument("--bart-positions", type=positive_int, default=16384,
                      help="encoder positions of an LED made from a BART directory")
  parser.add_argument("--bart-window", type=positive_int, default=512,
                      help="one-sided attention window of an LED made from a BART directory")
  parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                      help="override a TrainConfig field, e.g. --set eval_every=100")
  parser.add_argument("--allow-change", action="append", default=[], metavar="FIELD",
                      help="on resume, let this optimiser/schedule setting differ from the "
                           "run's, e.g. --allow-change stages.0.learning_rate")
  parser.add_argument("--no-progress", action="store_true", help="no progress bars")
  add_distributed_args(parser)
  return parser, parser.parse_args(argv)


def build(args: argparse.Namespace):
  """(TrainConfig, Seq2SeqTask, ModelSource, tokenizer, {split: Seq2SeqSplit}) from the command
  line; ValueError, TypeError or FileNotFoundError naming what is wrong."""
  from longformer_jax.data import text
  from longformer_jax.training import Stage, TrainConfig, apply_overrides
  from longformer_jax.tasks import seq2seq
  tokenizer = text.load_tokenizer(args.tokenizer)
  source = seq2seq.load_source(args.model, tokenizer, bart_positions=args.bart_positions,
                               bart_window=args.bart_window)
  max_new_tokens = args.max_new_tokens or args.max_target_length
  cfg = TrainConfig(
      model=source.config, dataset="jsonl", seed=args.seed,
      stages=(Stage(seq_len=args.max_source_length, batch_size=args.batch_size,
                    steps=args.steps, learning_rate=args.learning_rate),),
      final_eval=dict(num_beams=args.num_beams, max_new_tokens=max_new_tokens))
  cfg = apply_overrides(cfg, args.set)
  _check_generation(cfg)
  seq2seq.check_tokenizer(tokenizer, cfg.model)
  lengths = dict(max_source_length=args.max_source_length,
                 max_target_length=args.max_target_length, eos_token_id=cfg.model.eos_token_id)
  splits = {name: seq2seq.read_pairs(path, tokenizer, **lengths)
            for name, path in (("train", args.train), ("validation", args.validation),
                               ("test", args.test)) if path is not None}
  identity = {"tokenizer_sha256": text.file_sha256(text.tokenizer_file(args.tokenizer)),
              "init": source.identity}
  task = seq2seq.Seq2SeqTask(
      splits["train"], splits.get("validation"),
      global_attention=seq2seq.GlobalAttention.parse(args.global_attention, tokenizer),
      identity=identity)
  task.check(cfg)
  for name in SPLITS:
    if name in splits:
      seq2seq.check_token_ids(splits[name], cfg.model.vocab_size)
  return cfg, task, source, tokenizer, splits


def _check_generation(cfg) -> None:
  from longformer_jax.tasks.seq2seq import GENERATE_ARGS
  settings = dict(cfg.final_eval or {})
  unknown = sorted(set(settings) - set(GENERATE_ARGS) - {"batch_size"})
  if unknown:
    raise ValueError(f"final_eval has unknown generation settings {unknown}; known: "
                     f"{['batch_size', *GENERATE_ARGS]}")
  new, most = settings.get("max_new_tokens", 1), cfg.model.max_decoder_position_embeddings
  if not isinstance(new, int) or not 1 <= new <= most:
    raise ValueError(f"max_new_tokens={new!r} must be an int in [1, "
                     f"max_decoder_position_embeddings={most}]")


def main(argv: list[str] | None = None) -> int:
  parser, args = parse_args(argv)
  # Import JAX only now: --help works anywhere, and a pod slice initialises before any device use.
  import jax
  from etils import epath
  from longformer_jax import training
  from longformer_jax.checkpoint import CheckpointError
  initialize_distributed(args)
  try:
    cfg, task, source, tokenizer, splits = build(args)
  except (ValueError, TypeError, FileNotFoundError) as e:
    # A usage or data error: argparse's status 2 and one line naming the file, line and field
    # or the setting (no traceback, and no usage text, which says nothing about the value).
    parser.exit(2, f"{parser.prog}: error: {e}\n")
  workdir = epath.Path(args.workdir or Path("runs") / f"seq2seq_{Path(args.train).stem}")
  is_main = jax.process_index() == 0
  if is_main:
    print(f"{jax.process_count()} process(es), devices: {jax.devices()}")
    print(f"workdir: {workdir}")
    print(", ".join(f"{name} {len(split):,} pairs" for name, split in splits.items()))
  mesh = training.make_mesh(cfg.mesh_shape)
  try:
    return _train_and_evaluate(args, cfg, task, source, tokenizer, splits, workdir, mesh)
  except (training.RunMismatchError, training.NonFiniteLossError, CheckpointError) as e:
    # Expected failures of a run say all there is in one line (a traceback would bury it).
    if is_main:
      print(f"error: {e}", file=sys.stderr)
    return 1


def _train_and_evaluate(args, cfg, task, source, tokenizer, splits, workdir, mesh) -> int:
  import jax
  from flax import nnx
  from longformer_jax import checkpoint, training
  from longformer_jax.io import atomic_write
  from longformer_jax.tasks import seq2seq
  from longformer_jax.training.sharding import seq_axis
  is_main = jax.process_index() == 0
  start = time.perf_counter()
  summary = training.train(cfg, workdir, mesh=mesh, task=task, progress=not args.no_progress,
                           allow_changes=args.allow_change,
                           init_params=None if source.params is None else lambda: source.params)
  train_minutes = (time.perf_counter() - start) / 60
  if summary["status"] != "done":
    return EXIT_PREEMPTED
  # The trained weights: the checkpoint saved at the last step (the newest that verifies).
  model = checkpoint.restore_model(
      lambda: task.build_model(cfg.model, nnx.Rngs(cfg.seed), mesh=mesh,
                               seq_axis=seq_axis(mesh)),
      workdir, shardings=lambda params: training.param_shardings(params, mesh,
                                                                 cfg.logical_rules))
  generation = dict(cfg.final_eval or {})
  batch_size = generation.pop("batch_size", cfg.eval_batch_size)
  results = {"model": args.model, "steps": summary["step"],
             "final_train_loss": summary["last_loss"], "valid_loss": summary.get("valid_loss"),
             "generation": generation, "train_minutes_this_run": round(train_minutes, 2)}
  for name in SPLITS:
    if name not in splits:
      continue
    split = splits[name]
    predictions = seq2seq.generate_split(
        model, split, tokenizer, global_attention=task.global_attention, batch_size=batch_size,
        mesh=mesh, rules=cfg.logical_rules, progress=not args.no_progress, **generation)
    scores = seq2seq.rouge(predictions, split.references)
    results[name] = {**scores, "pairs": len(split)}
    if is_main:
      atomic_write(workdir / f"predictions_{name}.jsonl",
                   seq2seq.predictions_jsonl(split, predictions))
      print(f"{name}: " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
  if is_main:
    atomic_write(workdir / "results.json", json.dumps(results, indent=2) + "\n")
    print(f"wrote {workdir / 'results.json'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
