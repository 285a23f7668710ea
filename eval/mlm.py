"""`python -m eval.mlm` from a checkout: `longformer_jax.cli.eval.mlm`, installed as the
`longformer-eval-mlm` command (`--help` says what it does)."""

import sys

from longformer_jax.cli.eval.mlm import main

if __name__ == "__main__":
  sys.exit(main())
