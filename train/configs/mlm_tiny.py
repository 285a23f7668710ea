"""mlm_tiny: a tiny Longformer MLM from scratch on the bundled enwik8 sample, CPU-sized (the default
of train.mlm; `tasks.mlm.mlm_tiny` says what it measured).

    python -m train.mlm --preset mlm_tiny
"""

from longformer_jax.tasks.mlm import mlm_tiny
from longformer_jax.training import TrainConfig


def get_config() -> TrainConfig:
  return mlm_tiny()
