"""`python -m eval.bpc`: the `longformer-eval-bpc` command."""
from longformer_jax.commands.eval_bpc import main

if __name__ == "__main__":
  raise SystemExit(main())
