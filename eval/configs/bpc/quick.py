"""quick: a quick look at a small run: 1,024-byte windows, each scoring its last 256.

    python -m eval.bpc --workdir runs/char_tiny --preset quick
"""

from longformer_jax.commands.eval_bpc import BpcConfig


def get_config() -> BpcConfig:
  return BpcConfig(context=1024, stride=256)
