"""`python -m train.charlm` from a checkout: `longformer_jax.cli.train.charlm`, installed as the
`longformer-train-charlm` command (`--help` says what it does)."""

import sys

from longformer_jax.cli.train.charlm import main

if __name__ == "__main__":
  sys.exit(main())
