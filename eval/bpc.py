"""Bits per character of a trained char-LM checkpoint on a split, every character scored once.

    python -m eval.bpc --workdir runs/char_tiny --context 1024 --stride 256
    python -m eval.bpc --workdir gs://bucket/char_small --dataset enwik8 --split test  # paper

Protocols: "sliding" (the paper's: windows of --context bytes moved --stride at a time, each
scoring its last --stride predictions, the first window scoring all of its own) and "chunks"
(non-overlapping windows of --context bytes). The model and its final-stage attention windows
come from <workdir>/run_config.json, written by train/charlm.py. Prints the BPC and writes JSON
(default <workdir>/bpc_<dataset>_<split>_<protocol>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="the training run's directory")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  parser.add_argument("--dataset", default=None, help="default: the run's dataset")
  parser.add_argument("--data-dir", default=None)
  parser.add_argument("--split", default="test", choices=("train", "validation", "test"))
  parser.add_argument("--protocol", default="sliding", choices=("sliding", "chunks"))
  parser.add_argument("--context", type=int, default=32256)
  parser.add_argument("--stride", type=int, default=512)
  parser.add_argument("--score-last", type=int, default=None, help="must equal --stride")
  parser.add_argument("--batch-size", type=int, default=1, help="windows per forward pass")
  parser.add_argument("--max-bytes", type=int, default=None, help="score only a prefix")
  parser.add_argument("--output", default=None, help="JSON path")
  parser.add_argument("--no-progress", action="store_true")
  parser.add_argument("--distributed", default="auto", choices=("auto", "on", "off"))
  args = parser.parse_args(argv)

  import jax  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  from longformer_jax import training  # pylint: disable=g-import-not-at-top
  from longformer_jax.data import load_split  # pylint: disable=g-import-not-at-top
  from longformer_jax.evaluation import evaluate_bpc  # pylint: disable=g-import-not-at-top
  training.maybe_initialize_distributed(args.distributed)

  workdir = epath.Path(args.workdir)
  cfg, windows = training.read_run_config(workdir)
  dataset = args.dataset or cfg.dataset
  model = training.load_params(workdir, cfg, step=args.step)
  data = load_split(dataset, args.split, args.data_dir or cfg.data_dir)
  if args.max_bytes is not None:
    data = data[:args.max_bytes]
  mesh = training.make_mesh((-1, 1)) if jax.device_count() > 1 else None
  start = time.perf_counter()
  bpc = evaluate_bpc(model, data, context=args.context, stride=args.stride,
                     score_last=args.score_last, batch_size=args.batch_size,
                     protocol=args.protocol, windows=windows, mesh=mesh,
                     progress=not args.no_progress)
  result = {"bpc": bpc, "dataset": dataset, "split": args.split, "bytes": int(len(data)),
            "protocol": args.protocol, "context": args.context, "stride": args.stride,
            "windows": list(windows), "workdir": str(workdir), "step": args.step,
            "seconds": round(time.perf_counter() - start, 1)}
  if jax.process_index() == 0:
    print(f"{dataset} {args.split}: {bpc:.4f} bpc ({args.protocol}, context {args.context}, "
          f"stride {args.stride})")
    out = epath.Path(args.output or workdir / f"bpc_{dataset}_{args.split}_{args.protocol}.json")
    tmp = out.parent / f".{out.name}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
