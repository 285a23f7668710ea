"""finetune_tiny: the `tiny` model (fresh weights) on short records, CPU-sized: rows of 128 tokens
(longer records are cut), 150 steps of 8 records at learning rate 3e-3, the recipe docs/finetune.md
measures on toy data. --task and the files come from the command line:

    python -m train.finetune --preset finetune_tiny --task qa --train train.jsonl
"""

from longformer_jax.commands.train_finetune import FinetuneConfig


def get_config() -> FinetuneConfig:
  return FinetuneConfig(model="tiny", max_length=128, steps=150, batch_size=8,
                        learning_rate=3e-3)
