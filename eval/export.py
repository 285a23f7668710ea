"""`python -m eval.export`: the `longformer-eval-export` command."""
from longformer_jax.commands.eval_export import main

if __name__ == "__main__":
  raise SystemExit(main())
