"""char_tiny on enwik8_sample: the CPU demo (`CharLMConfig.tiny()`; bundled data, no download,
2 cores).

Command (from the repository root):

    python -m train.charlm --config train/configs/char_tiny.py

Expected result (measured on 2 CPU cores, jax 0.12, other jobs lightly loading the machine):
test BPC 2.122 (valid 2.109) after 3,000 steps of 8 x 256 bytes (8.8 minutes of training on
quiet cores, ~12,000 tokens/s; 17 minutes at ~8,000 tokens/s when other jobs share them; compile
and valid evaluations included); the sliding-window test evaluation (context 512, stride 256:
the paper's protocol scaled down) takes 16-26 s more. The `xz -9e` figure
for the same test split, given its training part, is 2.14 bpc. Writes
runs/char_tiny/{metrics.jsonl,tensorboard/,curves.png,checkpoints/,results.json}.
"""

from longformer_jax.config import CharLMConfig
from longformer_jax.training import Stage, TrainConfig


def get_config() -> TrainConfig:
  model = CharLMConfig.tiny()
  return TrainConfig(
      model=model,
      dataset="enwik8_sample",
      # One stage: on 2 cores the paper's growing sequence lengths buy nothing but compile time.
      # Small batches: early in training the loss falls faster per byte seen with more, smaller
      # steps (measured, same 4.9M bytes: batch 8 x 2,400 steps at lr 4e-3 reached 2.18 test
      # BPC, batch 16 x 1,200 steps at lr 3e-3 2.20).
      stages=(Stage(seq_len=256, batch_size=8, steps=3000, learning_rate=4e-3,
                    end_learning_rate=1e-4, warmup_steps=100),),
      weight_decay=0.01,
      eval_every=750,
      eval_tokens=32_768,
      eval_batch_size=16,
      checkpoint_every=750,
      final_eval=dict(split="test", protocol="sliding", context=512, stride=256,
                      batch_size=16),
  )
