"""Continued masked-LM pretraining of a Longformer (paper §5), then scoring the test split.

    # the paper's run: roberta-base made long (positions copied), 65K steps of 64 x 4,096 tokens
    python -m train.mlm --init ./roberta-base --data ./my-corpus/ --workdir gs://bucket/lf-base
    # CPU: a tiny model from scratch on the bundled enwik8 sample, its own byte-level BPE
    python -m train.mlm --preset mlm_tiny

Presets (`--preset`, default mlm_paper; or `--config FILE` with `get_config()`): mlm_paper,
mlm_paper_large, mlm_tiny (`longformer_jax.tasks.mlm`). `--init DIR` starts from a RoBERTa
directory (config.json + weights; made long by copying its positions up to the longest stage's
sequence length, with the preset's window), an HF Longformer directory, or a project model
checkpoint (`checkpoint.save_model`); the model's shape comes from there, its compute settings
(attention_impl, dtype, remat) from the preset. Without `--init` the preset's model starts from
its seed.

Text (`--data`, default the preset's dataset): enwik8, text8, enwik8_sample, text8_sample,
tfds:NAME, a text file or a directory of *.txt files (split 90/5/5 by bytes); every non-empty
line is a document. Tokenizer (`--tokenizer`: a tokenizer.json or a directory with it or with
vocab.json + merges.txt): default the workdir's tokenizer.json (a resumed run), else --init's
directory's, else a byte-level BPE of the model's vocabulary size trained on the training split.
It is saved as <workdir>/tokenizer.json. Token ids are cached under <data_dir>/mlm_tokens (or
~/.cache/longformer_jax/mlm_tokens).

Any config field can be overridden with `--set path=value`. Rerunning the same command resumes
from the newest checkpoint that verifies, and refuses to if the model, the data, the tokenizer,
the starting weights or the stages already trained differ. Exit status: 0 the schedule finished;
75 stopped by SIGTERM after saving; 1 the run failed (one-line `error:`); 2 a bad command line,
`--set`, `--init`, `--tokenizer` or `--data` (one line). Writes <workdir>/metrics.jsonl,
tensorboard/, curves.png, checkpoints/, tokenizer.json and results.json (the final test MLM loss,
bits per masked token and bits per character; `python -m eval.mlm` scores any checkpoint).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from train.cli import EXIT_PREEMPTED, add_distributed_args, initialize_distributed, load_config


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  source = parser.add_mutually_exclusive_group()
  source.add_argument("--preset", default=None,
                      help="mlm_paper (default), mlm_paper_large or mlm_tiny")
  source.add_argument("--config", default=None, help="a config file with get_config()")
  parser.add_argument("--workdir", default=None, help="default: runs/<preset or config name>")
  parser.add_argument("--init", default=None, metavar="DIR",
                      help="start from a RoBERTa, an HF Longformer or a model checkpoint")
  parser.add_argument("--tokenizer", default=None, metavar="PATH",
                      help="tokenizer.json, or a directory with it or vocab.json + merges.txt")
  parser.add_argument("--data", default=None, metavar="SOURCE",
                      help="text source (sets the config's dataset)")
  parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                      help="override a config field, e.g. --set stages.0.steps=100")
  parser.add_argument("--allow-change", action="append", default=[], metavar="FIELD",
                      help="on resume, let this optimiser/schedule setting differ from the run's")
  parser.add_argument("--no-progress", action="store_true", help="no progress bars")
  parser.add_argument("--skip-final-eval", action="store_true")
  add_distributed_args(parser)
  args = parser.parse_args(argv)

  # Import JAX only now: --help works anywhere, and a pod slice initialises before any device use.
  import jax
  from etils import epath
  from longformer_jax import training
  from longformer_jax.checkpoint import CheckpointError
  initialize_distributed(args)
  name = Path(args.config).stem if args.config else (args.preset or "mlm_paper")
  workdir = epath.Path(args.workdir or Path("runs") / name)
  try:
    cfg, task, init_model = _setup(args, workdir)
  except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
    # A usage error: argparse's status 2 and one line that names the value (no traceback).
    parser.exit(2, f"{parser.prog}: error: {e}\n")
  is_main = jax.process_index() == 0
  if is_main:
    print(f"{jax.process_count()} process(es), devices: {jax.devices()}")
    print(f"workdir: {workdir}")
  try:
    return _train_and_evaluate(args, cfg, task, init_model, workdir)
  except (training.RunMismatchError, training.NonFiniteLossError, CheckpointError) as e:
    if is_main:
      print(f"error: {e}", file=sys.stderr)
    return 1


def _setup(args: argparse.Namespace, workdir):
  """(cfg, task, starting model or None) from the command line; raises ValueError (and the
  like) naming a bad value."""
  from flax import nnx
  from longformer_jax import training
  from longformer_jax.tasks import mlm
  from longformer_jax.training import sources
  preset = None if args.config else (args.preset or "mlm_paper")
  cfg = load_config(args.config) if args.config else mlm.preset(preset)
  if preset in mlm.NEEDS_INIT and args.init is None:
    raise ValueError(f"preset {preset} continues a pretrained model (peak learning rate "
                     f"{cfg.stages[0].learning_rate}): give --init DIR (a RoBERTa), or train "
                     f"from scratch with --preset mlm_tiny or a --config")
  if args.data is not None:
    cfg = dataclasses.replace(cfg, dataset=args.data)
  cfg = training.apply_overrides(cfg, args.set)
  init_model = init_identity = None
  if args.init is not None:
    # Made long to the longest stage, with the (overridden) preset's window; the model's shape
    # is the checkpoint's, and the model.* overrides apply to it again.
    init_model, kind = mlm.load_pretrained(
        args.init, max_positions=max(s.seq_len for s in cfg.stages),
        window=cfg.model.layer_windows[0])
    cfg = dataclasses.replace(cfg, model=mlm.keep_compute_settings(init_model.config, cfg.model))
    cfg = training.apply_overrides(cfg, [a for a in args.set if a.startswith("model.")])
    init_params = nnx.state(init_model, nnx.Param)
    mlm.check_params_fit(cfg.model, init_params)
    init_identity = {"kind": kind, "params_sha256": sources.params_fingerprint(init_params)}
  tokenizer = _tokenizer(args, cfg, workdir)
  task = mlm.MLMTask(tokenizer, init_identity=init_identity)
  task.check(cfg)
  if not (workdir / mlm.TOKENIZER_FILE).exists():
    import jax
    from longformer_jax.io import atomic_write
    if jax.process_index() == 0:
      workdir.mkdir(parents=True, exist_ok=True)
      atomic_write(workdir / mlm.TOKENIZER_FILE, tokenizer.to_str(pretty=True))
  return cfg, task, init_model


def _tokenizer(args: argparse.Namespace, cfg, workdir):
  """--tokenizer, else the workdir's, else --init's directory's, else a BPE trained here."""
  from longformer_jax.data import text, tokenized
  from longformer_jax.tasks import mlm
  if args.tokenizer is not None:
    return text.load_tokenizer(args.tokenizer)
  saved = workdir / mlm.TOKENIZER_FILE
  if saved.exists():
    return text.load_tokenizer(saved)
  if args.init is not None:
    init = Path(args.init)
    if (init / "tokenizer.json").is_file() or (init / "vocab.json").is_file():
      return text.load_tokenizer(init)
    raise FileNotFoundError(f"--init {args.init} holds no tokenizer (tokenizer.json or "
                            f"vocab.json + merges.txt): give --tokenizer")
  print(f"training a byte-level BPE tokenizer ({cfg.model.vocab_size} ids) on the train split "
        f"of {cfg.dataset}")
  return tokenized.train_bpe(tokenized.text_of(cfg.dataset, "train", cfg.data_dir),
                             cfg.model.vocab_size)


def _train_and_evaluate(args: argparse.Namespace, cfg, task, init_model, workdir) -> int:
  import jax
  from flax import nnx
  from longformer_jax import training
  from longformer_jax.io import atomic_write
  from longformer_jax.tasks import mlm
  is_main = jax.process_index() == 0
  mesh = training.make_mesh(cfg.mesh_shape)
  start = time.perf_counter()
  init_params = None if init_model is None else (lambda: nnx.state(init_model, nnx.Param))
  summary = training.train(cfg, workdir, mesh=mesh, progress=not args.no_progress, task=task,
                           allow_changes=args.allow_change, init_params=init_params)
  if summary["status"] != "done":
    return EXIT_PREEMPTED  # saved; rerun the same command to resume
  results = {"preset": args.preset, "config": args.config, "init": args.init,
             "dataset": cfg.dataset, "overrides": args.set, "steps": summary["step"],
             "final_train_loss": summary["last_loss"],
             **{k: v for k, v in summary.items() if k.startswith("valid_")},
             "train_minutes_this_run": round((time.perf_counter() - start) / 60, 2)}
  if cfg.final_eval is not None and not args.skip_final_eval:
    result = mlm.evaluate_mlm_run(workdir, mesh=mesh, progress=not args.no_progress,
                                  **cfg.final_eval)
    results["eval"] = result
    if is_main:
      bpc = f", {result['bpc']:.4f} bpc" if "bpc" in result else ""
      print(f"{cfg.dataset} {result['split']}: loss {result['loss']:.4f}, "
            f"{result['bits_per_token']:.4f} bits per masked token{bpc}")
  if is_main:
    path = workdir / "results.json"
    atomic_write(path, json.dumps(results, indent=2) + "\n")
    print(f"{json.dumps(results, indent=2)}\nwrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
