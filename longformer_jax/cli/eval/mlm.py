"""MLM loss, bits per masked token and bits per character of a checkpoint or a pretrained model.

    python -m eval.mlm --workdir runs/mlm_tiny                       # newest checkpoint, test
    python -m eval.mlm --workdir runs/mlm_tiny --split validation --step 200
    # a model as loaded, no training (e.g. RoBERTa right after its positions are copied):
    python -m eval.mlm --init ./roberta-base --data ./corpus.txt --seq-len 4096 --window 256

Definitions (`longformer_jax.tasks.mlm`): the split is packed in order into rows of <s> +
tokens + </s>; 15% of the tokens are masked as in training, with masks keyed by the seed and the
row only (the same targets at every evaluation); loss = mean -ln p over the masked targets;
bits per token = loss / ln 2 (the paper's Table 5 "BPC"); bpc = total bits over the UTF-8 bytes
of the masked tokens.

With --workdir the model, tokenizer (<workdir>/tokenizer.json), data, seed, masking rate and
sequence length are the run's (--split, --step, --max-tokens, --batch-size choose what is scored).
With --init the model comes from a RoBERTa directory (made long by copying its positions to
--seq-len, one-sided --window), an HF Longformer directory or a model checkpoint; --tokenizer
defaults to --init's. Prints one line and writes JSON (default <workdir>/mlm_<split>.json, or
--output), both naming the checkpoint step scored ("step") with --workdir. Exit status: 0; 1 no
checkpoint that restores, or a result that is not finite; 2 a bad argument or input, or a --workdir
that holds another kind of run (one line saying what it is and which command scores it), before any
evaluation.
"""

from __future__ import annotations

import argparse
import math
import sys

from longformer_jax.cli.driver import (
    EXIT_OK, Parser, fail, nonnegative_int, positive_int, parse_settings, printed_config,
    usage_error, write_result)


def main(argv: list[str] | None = None) -> int:
  parser = Parser("eval.mlm", __doc__)
  what = parser.add_mutually_exclusive_group(required=True)
  what.add_argument("--workdir", default=None, help="a train.mlm run")
  what.add_argument("--init", default=None, metavar="DIR", help="a pretrained model directory")
  parser.add_argument("--step", type=nonnegative_int, default=None,
                      help="checkpoint step (default: latest)")
  parser.add_argument("--split", default="test", choices=("train", "validation", "test"))
  parser.add_argument("--max-tokens", type=positive_int, default=None,
                      help="score only the first tokens")
  parser.add_argument("--batch-size", type=positive_int, default=8,
                      help="sequences per forward pass")
  parser.add_argument("--data", default=None, help="with --init: the text source")
  parser.add_argument("--tokenizer", default=None, help="with --init (default: --init's)")
  parser.add_argument("--seq-len", type=positive_int, default=None,
                      help="with --init: tokens per row")
  parser.add_argument("--window", type=positive_int, default=256,
                      help="with --init of a RoBERTa: the one-sided attention window")
  parser.add_argument("--seed", type=nonnegative_int, default=0,
                      help="with --init: the masks' seed")
  parser.add_argument("--output", default=None, help="JSON path")
  parser.add_argument("--no-progress", action="store_true")
  args = parse_settings(parser, argv)
  if args.init is not None and (args.data is None or args.seq_len is None
                                or args.output is None):
    parser.error("--init needs --data, --seq-len and --output (no workdir to write to)")
  if args.workdir is not None and any(v is not None for v in (args.data, args.tokenizer,
                                                                 args.seq_len)):
    parser.error("--data, --tokenizer and --seq-len go with --init; a run has its own")
  if printed_config(args):
    return EXIT_OK

  from etils import epath
  from longformer_jax.checkpoint import CheckpointError
  from longformer_jax.io import check_writable
  from longformer_jax.tasks import mlm
  try:
    out = epath.Path(args.output or epath.Path(args.workdir) / f"mlm_{args.split}.json")
    check_writable(out)  # before the evaluation, not after
    if args.workdir is not None:
      result = mlm.evaluate_mlm_run(args.workdir, split=args.split, step=args.step,
                                    max_tokens=args.max_tokens, batch_size=args.batch_size,
                                    progress=not args.no_progress)
    else:
      result = _evaluate_init(args, mlm)
  except (ValueError, TypeError, FileNotFoundError) as e:
    usage_error(parser, e)
  except CheckpointError as e:
    return fail(e)
  print(f"{result['dataset']} {mlm.describe(result)}")
  if not math.isfinite(result["loss"]):
    return fail(f"the result is not finite (loss {result['loss']}); nothing written")
  return write_result(out, result)


def _evaluate_init(args: argparse.Namespace, mlm) -> dict:
  """evaluate_mlm of a model as loaded from --init."""
  from longformer_jax.data import tokenized
  from longformer_jax.data.tokenizer import load_tokenizer
  model, kind = mlm.load_pretrained(args.init, max_positions=args.seq_len, window=args.window)
  tokenizer = load_tokenizer(args.tokenizer or args.init)
  result = mlm.MLMTask(tokenizer).score(
      model, tokenized.token_ids(args.data, args.split, tokenizer), seq_len=args.seq_len,
      seed=args.seed, max_tokens=args.max_tokens, batch_size=args.batch_size,
      progress=not args.no_progress)
  return {**result, "split": args.split, "dataset": args.data, "init": args.init, "kind": kind}


if __name__ == "__main__":
  sys.exit(main())
