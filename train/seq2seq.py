"""`python -m train.seq2seq` from a checkout: `longformer_jax.cli.train.seq2seq`, installed as the
`longformer-train-seq2seq` command (`--help` says what it does)."""

import sys

from longformer_jax.cli.train.seq2seq import main

if __name__ == "__main__":
  sys.exit(main())
