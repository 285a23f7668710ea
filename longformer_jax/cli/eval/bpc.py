"""Bits per character of a trained char-LM checkpoint, every character scored once.

    python -m eval.bpc --workdir runs/char_tiny                      # the run's own context
    python -m eval.bpc --workdir runs/char_tiny --preset quick       # --context 1024 --stride 256
    python -m eval.bpc --workdir gs://bucket/char_small --preset paper   # 32,256 / 512
    python -m eval.bpc --workdir runs/char_tiny --file README.md --context 512 --stride 256

Data: without --file or --dataset, the run's own: the file a `--data-file` run trained on (its
record names it, and its training bytes must still be those the run recorded), else the run's
dataset; --split (default test) picks the split. Bytes outside the model's vocabulary are
refused, naming the first one and its position.

Protocols: "sliding" (the paper's: windows of --context bytes moved --stride at a time, each
scoring its last --stride predictions, the first window scoring all of its own) and "chunks"
(non-overlapping windows of --context bytes). Without --context the run's own is taken, and one
line says which: the context (and stride) of its final_eval, else its last stage's sequence length
(`tasks.charlm.run_context`); a stride not given is the final_eval's that goes with its context,
else half the context, at most 512. The paper's 32,256 / 512 is --preset paper. The model comes
from <workdir>/run_config.json, written by train.charlm, and the final stage's attention windows
from the settings saved with the checkpoint (a run may have been extended); only the parameters of
the checkpoint are read, and checked against the checksums saved with them: without --step the
newest checkpoint that restores and verifies is scored (a damaged one is skipped with a one-line
warning and left as it is); a damaged --step, or no usable checkpoint, is an error (exit status 1,
one line). The same function (`tasks.charlm.evaluate_run`) scores the test split after training.
Prints the BPC and writes JSON (default <workdir>/bpc_<dataset>_<split>_<protocol>.json, or
bpc_file_<name>_<protocol>.json with --file), after checking, before evaluating, that it can be
written. A result that is not finite (broken weights) is an error: exit status 1, no JSON. Exit
status: 0 done; 1 no run in --workdir, no usable checkpoint, a result that is not finite, or a
JSON that could not be written after all (a disk that filled: the line holds the result) (one
`error:` line); 2 a bad setting, a --file or --dataset that cannot be scored, an output that cannot
be written, or a run of another kind in --workdir (one `eval.bpc: error:` line naming it), each
checked before the evaluation starts.
"""

from __future__ import annotations

import math
import sys

from longformer_jax.cli.driver import (
    EXIT_FAILED, EXIT_OK, USAGE_ERRORS, Parser, add_distributed_args, fail,
    initialize_distributed, nonnegative_int, parse_settings, positive_int, printed_config,
    usage_error, write_result)
from longformer_jax.training import presets


def paper() -> dict:
  """The paper's evaluation (Longformer §4.2): 32,256-byte windows, each scoring its last 512."""
  return {"protocol": "sliding", "context": 32256, "stride": 512}


def quick() -> dict:
  """A quick look at a small run: 1,024-byte windows, each scoring its last 256."""
  return {"context": 1024, "stride": 256}


presets.register("eval.bpc", "paper", paper)
presets.register("eval.bpc", "quick", quick)


def main(argv: list[str] | None = None) -> int:
  parser = Parser("eval.bpc", __doc__)
  parser.add_argument("--workdir", required=True, help="the training run's directory")
  parser.add_argument("--step", type=nonnegative_int, default=None,
                      help="checkpoint step (default: latest)")
  source = parser.add_mutually_exclusive_group()
  source.add_argument("--dataset", default=None, help="default: the run's dataset")
  source.add_argument("--file", default=None, help="score this file's bytes instead of a split")
  parser.add_argument("--data-dir", default=None)
  parser.add_argument("--split", default=None, choices=("train", "validation", "test"),
                      help="of --dataset (default: test)")
  parser.add_argument("--protocol", default="sliding", choices=("sliding", "chunks"))
  parser.add_argument("--context", type=positive_int, default=None,
                      help="window bytes (default: the run's own, said in one line)")
  parser.add_argument("--stride", type=positive_int, default=None,
                      help="default: the run's with its context, else min(512, context / 2)")
  parser.add_argument("--score-last", type=positive_int, default=None, help="must equal --stride")
  parser.add_argument("--batch-size", type=positive_int, default=1, help="windows per forward pass")
  parser.add_argument("--max-bytes", type=positive_int, default=None, help="score only a prefix")
  parser.add_argument("--output", default=None, help="JSON path")
  parser.add_argument("--no-progress", action="store_true")
  add_distributed_args(parser)
  args = parse_settings(parser, argv, preset_task="eval.bpc")
  if args.file is not None and args.split is not None:
    parser.error("--split selects a split of --dataset; it does not go with --file")
  if printed_config(args):
    return EXIT_OK

  import jax
  import numpy as np
  from etils import epath
  from longformer_jax import training
  from longformer_jax.checkpoint import CheckpointError
  from longformer_jax.data import load_split
  from longformer_jax.tasks.charlm import (
      check_bpc_settings, check_bytes, describe, evaluate_run, run_data)
  from longformer_jax.tasks.runs import read_run
  from longformer_jax.io import check_writable
  initialize_distributed(args)

  # Everything is checked before any evaluation: the settings, the run, the data, the output.
  workdir = epath.Path(args.workdir)
  try:
    check_bpc_settings(context=args.context, stride=args.stride, score_last=args.score_last,
                       batch_size=args.batch_size, protocol=args.protocol)
    try:
      record, cfg = read_run(workdir, "charlm")
    except FileNotFoundError as e:
      return fail(e)  # no run there (status 1, as no checkpoint that restores)
    if args.file is None and args.dataset is None:
      # The run's own data: its --data-file, else its dataset (`run_data` checks which).
      data, source, name = run_data(record, cfg, args.split or "test", args.data_dir)
    elif args.file is not None:
      if not epath.Path(args.file).is_file():
        raise FileNotFoundError(f"--file {args.file}: no such file")
      data = np.frombuffer(epath.Path(args.file).read_bytes(), np.uint8)
      source = {"file": args.file}
      name = f"file_{epath.Path(args.file).name}"
    else:
      dataset, split = args.dataset or cfg.dataset, args.split or "test"
      data = load_split(dataset, split, args.data_dir or cfg.data_dir)
      source = {"dataset": dataset, "split": split}
      name = f"{dataset}_{split}"
    if args.max_bytes is not None:
      data = data[:args.max_bytes]
    check_bytes(data, cfg.model.vocab_size, args.file or name)
    if data.size < 2:
      raise ValueError(f"{args.file or name} holds {data.size} byte(s) to score; a prediction "
                       f"needs at least 2")
    out = epath.Path(args.output or workdir / f"bpc_{name}_{args.protocol}.json")
    if jax.process_index() == 0:
      check_writable(out)  # before minutes of evaluation, not after
  except USAGE_ERRORS as e:
    usage_error(parser, e)
  try:
    result = evaluate_run(workdir, data, step=args.step, mesh=training.make_mesh((-1, 1)),
                          context=args.context, stride=args.stride, score_last=args.score_last,
                          batch_size=args.batch_size, protocol=args.protocol,
                          progress=not args.no_progress)
  except (CheckpointError, FileNotFoundError) as e:
    # No checkpoint, or none that restores and verifies: one line, not Orbax's tracebacks.
    return fail(e)
  result = {**source, **result, "workdir": str(workdir)}
  if jax.process_index() == 0:
    print(f"{name}: {describe(result)}")
    if not math.isfinite(result["bpc"]):
      return fail(f"the result is not finite (bpc {result['bpc']}): the checkpoint's weights "
                  f"are not usable; nothing written")
    return write_result(out, result)
  return EXIT_OK if math.isfinite(result["bpc"]) else EXIT_FAILED


if __name__ == "__main__":
  sys.exit(main())
