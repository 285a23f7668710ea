"""`python -m eval.mlm`: the `longformer-eval-mlm` command."""
from longformer_jax.commands.eval_mlm import main

if __name__ == "__main__":
  raise SystemExit(main())
