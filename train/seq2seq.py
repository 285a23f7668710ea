"""`python -m train.seq2seq`: the `longformer-train-seq2seq` command."""
from longformer_jax.commands.train_seq2seq import main

if __name__ == "__main__":
  raise SystemExit(main())
