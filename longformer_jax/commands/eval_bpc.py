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

import dataclasses
import math
import sys

from longformer_jax.cli import settings
from longformer_jax.commands.run import (
    EXIT_FAILED, EXIT_OK, USAGE_ERRORS, add_distributed_args, fail, initialize_distributed,
    usage_error, write_result)


@dataclasses.dataclass(frozen=True)
class BpcConfig:
  """How eval.bpc scores (module docstring); each field has a flag of its own (`--score-last`)."""
  protocol: str = "sliding"
  context: int | None = None
  stride: int | None = None
  score_last: int | None = None
  batch_size: int = 1
  max_bytes: int | None = None
  dataset: str | None = None
  split: str | None = None
  data_dir: str | None = None

  def __post_init__(self):
    settings.check_bounds(self, dict.fromkeys(
        ("context", "stride", "score_last", "batch_size", "max_bytes"), 1))
    for name, known in (("protocol", ("sliding", "chunks")),
                        ("split", (None, "train", "validation", "test"))):
      if getattr(self, name) not in known:
        raise ValueError(f"{name} must be one of {known}, got {getattr(self, name)!r}")


FLAGS = {
    "protocol": "sliding (the paper's) or chunks",
    "context": "window bytes (default: the run's own, said in one line)",
    "stride": "default: the run's with its context, else min(512, context / 2)",
    "score_last": "must equal --stride", "batch_size": "windows per forward pass",
    "max_bytes": "score only a prefix", "dataset": "default: the run's dataset",
    "split": "of --dataset (default: test)", "data_dir": "where the datasets are",
}


def _inputs(parser):
  parser.add_argument("--workdir", required=True, help="the training run's directory")
  settings.add_step(parser)
  parser.add_argument("--file", default=None, help="score this file's bytes instead of a split")
  parser.add_argument("--output", default=None, help="JSON path")
  parser.add_argument("--no-progress", action="store_true")
  add_distributed_args(parser)


COMMAND = settings.Command("eval.bpc", __doc__, BpcConfig, FLAGS, default=BpcConfig,
                           presets="eval/configs/bpc/*", inputs=_inputs)


def main(argv: list[str] | None = None) -> int:
  parser, parsed = settings.parse(COMMAND, argv)
  args, c = parsed.args, parsed.config
  if args.file is not None and c.dataset is not None:
    if hasattr(args, "dataset"):
      parser.error("--dataset and --file do not go together")
    c = dataclasses.replace(c, dataset=None)  # --file replaces the config's dataset
  if args.file is not None and c.split is not None:
    parser.error("--split selects a split of --dataset; it does not go with --file")
  if dataclasses.replace(parsed, config=c).printed():
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
    check_bpc_settings(context=c.context, stride=c.stride, score_last=c.score_last,
                       batch_size=c.batch_size, protocol=c.protocol)
    try:
      record, cfg = read_run(workdir, "charlm")
    except FileNotFoundError as e:
      return fail(e)  # no run there (status 1, as no checkpoint that restores)
    if args.file is None and c.dataset is None:
      # The run's own data: its --data-file, else its dataset (`run_data` checks which).
      data, source, name = run_data(record, cfg, c.split or "test", c.data_dir)
    elif args.file is not None:
      if not epath.Path(args.file).is_file():
        raise FileNotFoundError(f"--file {args.file}: no such file")
      data = np.frombuffer(epath.Path(args.file).read_bytes(), np.uint8)
      source = {"file": args.file}
      name = f"file_{epath.Path(args.file).name}"
    else:
      dataset, split = c.dataset or cfg.dataset, c.split or "test"
      data = load_split(dataset, split, c.data_dir or cfg.data_dir)
      source = {"dataset": dataset, "split": split}
      name = f"{dataset}_{split}"
    if c.max_bytes is not None:
      data = data[:c.max_bytes]
    check_bytes(data, cfg.model.vocab_size, args.file or name)
    if data.size < 2:
      raise ValueError(f"{args.file or name} holds {data.size} byte(s) to score; a prediction "
                       f"needs at least 2")
    out = epath.Path(args.output or workdir / f"bpc_{name}_{c.protocol}.json")
    if jax.process_index() == 0:
      check_writable(out)  # before minutes of evaluation, not after
  except USAGE_ERRORS as e:
    usage_error(parser, e)
  try:
    result = evaluate_run(workdir, data, step=args.step, mesh=training.make_mesh((-1, 1)),
                          context=c.context, stride=c.stride, score_last=c.score_last,
                          batch_size=c.batch_size, protocol=c.protocol,
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
