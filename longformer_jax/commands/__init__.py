"""The command-line programs, one module each, installed as `longformer-<kind>-<name>`
([project.scripts]) and run from a checkout as `python -m train.<name>` / `python -m eval.<name>`:

  train_charlm, train_mlm, train_finetune, train_seq2seq   train a task, then its final evaluation
  eval_bpc, eval_mlm, eval_sample, eval_export             score, sample from or export a run
  run      what they share: exit status, the workdir lock, results.json, the training driver

Their settings are resolved by `longformer_jax.cli.settings` (docs/usage.md).
"""
