"""Continued masked-LM pretraining of a Longformer (paper §5), then scoring the test split.

    # CPU: a tiny model from scratch on the bundled enwik8 sample (= --preset mlm_tiny)
    python -m train.mlm
    # the paper's run: roberta-base made long (positions copied), 65K steps of 64 x 4,096 tokens
    python -m train.mlm --preset mlm_paper --init ./roberta-base --data ./my-corpus/

Presets (`--preset`, or `--config FILE` with `get_config()`): mlm_tiny (the default, a first try on
a CPU), mlm_paper and mlm_paper_large (the paper's; only when named): train/configs/mlm_*.py.
`--init DIR` (with the --preset or --config of its schedule) starts from a RoBERTa directory
(config.json + weights; made long by copying its positions up to the longest stage's sequence
length, with the preset's window), an HF Longformer directory, or a project model checkpoint
(`checkpoint.save_model`); the model's shape comes from there, its compute settings (attention_impl,
dtype, remat) from the preset. Without `--init` the preset's model starts from its seed.

Text (`--data`, a shorthand for `--set dataset=`; default the preset's dataset): enwik8, text8,
enwik8_sample, text8_sample, tfds:NAME, a text file or a directory of *.txt files (split 90/5/5
by bytes); every non-empty line is a document. Tokenizer (`--tokenizer`: a tokenizer.json or a
directory with it or with vocab.json + merges.txt): default the workdir's tokenizer.json (a
resumed run; a failed start's, without a checkpoint, is replaced), else --init's directory's,
else a byte-level BPE of the model's vocabulary size trained on the training split. It is saved
as <workdir>/tokenizer.json. Token ids are cached under <data_dir>/mlm_tokens (or
~/.cache/longformer_jax/mlm_tokens).

`--set path=value` overrides any setting; `--print-config` shows the result. Rerunning resumes
from the newest checkpoint that verifies, and refuses to if the model, the data, the tokenizer,
the starting weights or the stages already trained differ. Exit status as every command's
(`longformer_jax.commands.run`); a bad `--init`, `--tokenizer` or `--data` (missing, empty, not
UTF-8) is status 2 before training. Writes <workdir>/metrics.jsonl, tensorboard/, curves.png,
checkpoints/, tokenizer.json and results.json (the final test MLM scores; eval.mlm: any step).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from longformer_jax.cli.settings import Command
from longformer_jax.commands.run import Plan, TrainCommand

DEFAULT_PRESET = "mlm_tiny"


def _inputs(parser):
  parser.add_argument("--init", default=None, metavar="DIR",
                      help="start from a RoBERTa, an HF Longformer or a model checkpoint")
  parser.add_argument("--tokenizer", default=None, metavar="PATH",
                      help="tokenizer.json, or a directory with it or vocab.json + merges.txt")
  parser.add_argument("--data", default=None, metavar="SOURCE",
                      help="text source (sets the config's dataset)")


class MLM(TrainCommand):

  def command(self):
    from longformer_jax.training import TrainConfig
    return Command("train.mlm", __doc__, TrainConfig, default=DEFAULT_PRESET,
                   presets="train/configs/mlm_*", inputs=_inputs)

  def default_workdir(self, parsed):
    args = parsed.args
    return Path("runs") / (Path(args.config).stem if args.config
                           else (args.preset or DEFAULT_PRESET))

  def train_config(self, parsed, workdir):
    from longformer_jax import training
    from longformer_jax.tasks import mlm
    args, cfg = parsed.args, parsed.config
    preset = None if args.config else (args.preset or DEFAULT_PRESET)
    if args.init is not None and not (args.config or args.preset):
      raise ValueError("--init continues a pretrained model: name its schedule (--preset "
                       "mlm_paper, the paper's, or a --config); the default trains from scratch")
    if preset in mlm.NEEDS_INIT and args.init is None:
      raise ValueError(f"preset {preset} continues a pretrained model (peak learning rate "
                       f"{cfg.stages[0].learning_rate}): give --init DIR (a RoBERTa), or train "
                       f"from scratch with --preset mlm_tiny or a --config")
    if args.data is not None:
      cfg = dataclasses.replace(cfg, dataset=args.data)
    mlm.check_final_eval(cfg)  # before a tokenizer is trained
    if args.init is None:
      return cfg
    # Made long to the longest stage, with the (overridden) preset's window; the model's shape
    # is the checkpoint's, and the model.* overrides apply to it again.
    self._init_model, self._init_kind = mlm.load_pretrained(
        args.init, max_positions=max(s.seq_len for s in cfg.stages),
        window=cfg.model.layer_windows[0])
    cfg = dataclasses.replace(
        cfg, model=mlm.keep_compute_settings(self._init_model.config, cfg.model))
    return training.apply_overrides(cfg, [a for a in args.set if a.startswith("model.")])

  def plan(self, parsed, cfg, workdir):
    from flax import nnx
    from longformer_jax.tasks import mlm
    from longformer_jax.training import sources
    from longformer_jax.training.config import keep_run_file
    args = parsed.args
    init_params = init_identity = None
    if args.init is not None:
      params = nnx.state(self._init_model, nnx.Param)
      mlm.check_params_fit(cfg.model, params)
      init_identity = {"kind": self._init_kind,
                       "params_sha256": sources.params_fingerprint(params)}
      init_params = lambda: nnx.state(self._init_model, nnx.Param)
    tokenizer = _tokenizer(args, cfg, workdir)
    task = mlm.MLMTask(tokenizer, init_identity=init_identity)
    task.check(cfg)
    # The splits the run reads, tokenized (and cached) now: a missing or empty source, or text
    # that is not UTF-8, is refused before training, not at the first evaluation.
    final = cfg.final_eval is not None and not args.skip_final_eval
    for split in dict.fromkeys(["train", "validation"]
                               + ([cfg.final_eval.get("split", "test")] if final else [])):
      task.ids(cfg, split)
    # Kept from the run's start on; a failed start's (no checkpoint) is replaced.
    keep_run_file(workdir, mlm.TOKENIZER_FILE, tokenizer.to_str(pretty=True))
    return Plan(task, {"preset": args.preset, "config": args.config, "init": args.init,
                       "dataset": cfg.dataset, "overrides": args.set},
                init_params=init_params)


def _tokenizer(args, cfg, workdir):
  """--tokenizer, else the workdir's (a started run's), else --init's directory's, else a BPE
  trained here. A started run's must be the one it trained with (`mlm.check_run_tokenizer`)."""
  from longformer_jax.data import tokenized
  from longformer_jax.data.tokenizer import load_tokenizer
  from longformer_jax.tasks import mlm
  from longformer_jax.training.config import sealed_run_record
  saved, sealed = workdir / mlm.TOKENIZER_FILE, sealed_run_record(workdir)  # None: not started
  if args.tokenizer is not None or (saved.exists() and sealed is not None):
    tokenizer = load_tokenizer(args.tokenizer or saved)
    mlm.check_run_tokenizer(tokenizer, sealed and sealed[1], args.tokenizer or saved)
    return tokenizer
  if args.init is not None:
    init = Path(args.init)
    if (init / "tokenizer.json").is_file() or (init / "vocab.json").is_file():
      return load_tokenizer(init)
    raise FileNotFoundError(f"--init {args.init} holds no tokenizer (tokenizer.json or "
                            f"vocab.json + merges.txt): give --tokenizer")
  texts = tokenized.text_of(cfg.dataset, "train", cfg.data_dir)
  print(f"training a byte-level BPE tokenizer ({cfg.model.vocab_size} ids) on the train split "
        f"of {cfg.dataset}")
  return tokenized.train_bpe(texts, cfg.model.vocab_size)


def main(argv: list[str] | None = None) -> int:
  return MLM().main(argv)


if __name__ == "__main__":
  sys.exit(main())
