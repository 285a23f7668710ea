"""`python -m eval.sample`: the `longformer-eval-sample` command."""
from longformer_jax.commands.eval_sample import main

if __name__ == "__main__":
  raise SystemExit(main())
