"""`python -m eval.sample` from a checkout: `longformer_jax.cli.eval.sample`, installed as the
`longformer-eval-sample` command (`--help` says what it does)."""

import sys

from longformer_jax.cli.eval.sample import main

if __name__ == "__main__":
  sys.exit(main())
