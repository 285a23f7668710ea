"""`python -m train.mlm`: the `longformer-train-mlm` command."""
from longformer_jax.commands.train_mlm import main

if __name__ == "__main__":
  raise SystemExit(main())
