"""`python -m eval.export` from a checkout: `longformer_jax.cli.eval.export`, installed as the
`longformer-eval-export` command (`--help` says what it does)."""

import sys

from longformer_jax.cli.eval.export import main

if __name__ == "__main__":
  sys.exit(main())
