"""`python -m train.finetune` from a checkout: `longformer_jax.cli.train.finetune`, installed as the
`longformer-train-finetune` command (`--help` says what it does)."""

import sys

from longformer_jax.cli.train.finetune import main

if __name__ == "__main__":
  sys.exit(main())
