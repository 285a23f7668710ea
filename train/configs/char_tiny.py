"""char_tiny on enwik8_sample: the CPU demo (`CharLMConfig.tiny()`; bundled data, no download,
2 cores).

Command (from the repository root):

    python -m train.charlm --config train/configs/char_tiny.py

What it trains: 3,000 steps of 8 x 256 bytes, then the sliding-window test evaluation
(context 512, stride 256: the paper's protocol scaled down). Its test BPC lands near 2.1, a
little better than `xz -9e` on the same test split given its training part (2.14 bpc). Writes
runs/char_tiny/{metrics.jsonl,tensorboard/,curves.png,checkpoints/,results.json}.
"""

from longformer_jax.tasks.charlm import char_tiny
from longformer_jax.training import TrainConfig


def get_config() -> TrainConfig:
  # `--preset char_tiny` is this file. To change a setting here rather
  # than with --set, replace it, e.g.:
  #   return dataclasses.replace(char_tiny(), eval_every=1000)
  return char_tiny()
