"""paper: the paper's evaluation (Longformer §4.2): 32,256-byte windows, each scoring its last 512.

    python -m eval.bpc --workdir gs://bucket/char_small --preset paper
"""

from longformer_jax.commands.eval_bpc import BpcConfig


def get_config() -> BpcConfig:
  return BpcConfig(protocol="sliding", context=32256, stride=512)
