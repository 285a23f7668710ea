"""mlm_paper_large: mlm_paper's schedule for roberta-large made long; needs --init.

    python -m train.mlm --preset mlm_paper_large --init ./roberta-large --data ./my-corpus/
"""

from longformer_jax.tasks.mlm import mlm_paper
from longformer_jax.training import TrainConfig


def get_config() -> TrainConfig:
  return mlm_paper(large=True)
