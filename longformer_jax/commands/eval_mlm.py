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

import dataclasses
import math
import sys

from longformer_jax.cli import settings
from longformer_jax.commands.run import EXIT_OK, fail, usage_error, write_result


@dataclasses.dataclass(frozen=True)
class MLMEvalConfig:
  """How eval.mlm scores; each field has a flag of its own (`--max-tokens`)."""
  split: str = "test"
  max_tokens: int | None = None
  batch_size: int = 8
  seq_len: int | None = None
  window: int = 256
  seed: int = 0

  def __post_init__(self):
    settings.check_bounds(self, dict(max_tokens=1, batch_size=1, seq_len=1, window=1, seed=0))
    if self.split not in ("train", "validation", "test"):
      raise ValueError(f"split must be one of train, validation, test, got {self.split!r}")


FLAGS = {
    "split": "train, validation or test", "max_tokens": "score only the first tokens",
    "batch_size": "sequences per forward pass", "seq_len": "with --init: tokens per row",
    "window": "with --init of a RoBERTa: the one-sided attention window",
    "seed": "with --init: the masks' seed",
}


def _inputs(parser):
  what = parser.add_mutually_exclusive_group(required=True)
  what.add_argument("--workdir", default=None, help="a train.mlm run")
  what.add_argument("--init", default=None, metavar="DIR", help="a pretrained model directory")
  settings.add_step(parser)
  parser.add_argument("--data", default=None, help="with --init: the text source")
  parser.add_argument("--tokenizer", default=None, help="with --init (default: --init's)")
  parser.add_argument("--output", default=None, help="JSON path")
  parser.add_argument("--no-progress", action="store_true")


COMMAND = settings.Command("eval.mlm", __doc__, MLMEvalConfig, FLAGS, default=MLMEvalConfig,
                           inputs=_inputs)


def main(argv: list[str] | None = None) -> int:
  parser, parsed = settings.parse(COMMAND, argv)
  args, c = parsed.args, parsed.config
  if args.init is not None and (args.data is None or c.seq_len is None
                                or args.output is None):
    parser.error("--init needs --data, --seq-len and --output (no workdir to write to)")
  if args.workdir is not None and any(v is not None for v in (args.data, args.tokenizer,
                                                                 c.seq_len)):
    parser.error("--data, --tokenizer and --seq-len go with --init; a run has its own")
  if parsed.printed():
    return EXIT_OK

  from etils import epath
  from longformer_jax.checkpoint import CheckpointError
  from longformer_jax.io import check_writable
  from longformer_jax.tasks import mlm
  try:
    out = epath.Path(args.output or epath.Path(args.workdir) / f"mlm_{c.split}.json")
    check_writable(out)  # before the evaluation, not after
    if args.workdir is not None:
      result = mlm.evaluate_mlm_run(args.workdir, split=c.split, step=args.step,
                                    max_tokens=c.max_tokens, batch_size=c.batch_size,
                                    progress=not args.no_progress)
    else:
      result = _evaluate_init(args, c, mlm)
  except (ValueError, TypeError, FileNotFoundError) as e:
    usage_error(parser, e)
  except CheckpointError as e:
    return fail(e)
  print(f"{result['dataset']} {mlm.describe(result)}")
  if not math.isfinite(result["loss"]):
    return fail(f"the result is not finite (loss {result['loss']}); nothing written")
  return write_result(out, result)


def _evaluate_init(args, c: MLMEvalConfig, mlm) -> dict:
  """evaluate_mlm of a model as loaded from --init."""
  from longformer_jax.data import tokenized
  from longformer_jax.data.tokenizer import load_tokenizer
  model, kind = mlm.load_pretrained(args.init, max_positions=c.seq_len, window=c.window)
  tokenizer = load_tokenizer(args.tokenizer or args.init)
  result = mlm.MLMTask(tokenizer).score(
      model, tokenized.token_ids(args.data, c.split, tokenizer), seq_len=c.seq_len,
      seed=c.seed, max_tokens=c.max_tokens, batch_size=c.batch_size,
      progress=not args.no_progress)
  return {**result, "split": c.split, "dataset": args.data, "init": args.init, "kind": kind}


if __name__ == "__main__":
  sys.exit(main())
