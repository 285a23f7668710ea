"""`python -m train.charlm`: the `longformer-train-charlm` command."""
from longformer_jax.commands.train_charlm import main

if __name__ == "__main__":
  raise SystemExit(main())
