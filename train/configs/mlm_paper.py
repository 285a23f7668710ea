"""mlm_paper: the paper's continued MLM pretraining of roberta-base made long (paper §5): 65K steps
of 64 x 4,096 tokens; needs --init (a RoBERTa directory).

    python -m train.mlm --preset mlm_paper --init ./roberta-base --data ./my-corpus/
"""

from longformer_jax.tasks.mlm import mlm_paper
from longformer_jax.training import TrainConfig


def get_config() -> TrainConfig:
  return mlm_paper()
