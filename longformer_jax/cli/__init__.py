"""The command-line entry points, installed as `longformer-*` commands ([project.scripts]) and
run from a checkout as `python -m train.<name>` / `python -m eval.<name>` (thin shims):

  driver   what every command shares: settings, --print-config, exit status, results.json
  train    charlm, mlm, finetune, seq2seq: train a task, then its final evaluation
  eval     bpc, mlm, sample, export: score, sample from or export a trained run
"""
