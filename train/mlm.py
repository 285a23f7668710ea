"""`python -m train.mlm` from a checkout: `longformer_jax.cli.train.mlm`, installed as the
`longformer-train-mlm` command (`--help` says what it does)."""

import sys

from longformer_jax.cli.train.mlm import main

if __name__ == "__main__":
  sys.exit(main())
