"""`python -m train.finetune`: the `longformer-train-finetune` command."""
from longformer_jax.commands.train_finetune import main

if __name__ == "__main__":
  raise SystemExit(main())
