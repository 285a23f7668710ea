"""`python -m eval.bpc` from a checkout: `longformer_jax.cli.eval.bpc`, installed as the
`longformer-eval-bpc` command (`--help` says what it does)."""

import sys

from longformer_jax.cli.eval.bpc import main

if __name__ == "__main__":
  sys.exit(main())
