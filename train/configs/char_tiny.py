"""char_tiny on enwik8_sample: the CPU demo (bundled data, no download, 2 cores).

Command (from the repository root):

    python -m train.charlm --config train/configs/char_tiny.py

Expected result: test BPC about TBD (the `xz -9e` figure for the same split, given its
training part, is 2.14) after about TBD minutes of training on 2 CPU cores; the sliding-window
test evaluation (context 512, stride 256: the paper's protocol scaled down) takes about TBD
more minutes. Writes runs/char_tiny/{metrics.jsonl,tensorboard/,curves.png,results.json}.
"""

from longformer_jax import causal_lm
from longformer_jax.training import Stage, TrainConfig


def get_config() -> TrainConfig:
  model = causal_lm.char_tiny()
  return TrainConfig(
      model=model,
      dataset="enwik8_sample",
      # One stage: on 2 cores the paper's growing sequence lengths buy nothing but compile time.
      stages=(Stage(seq_len=256, batch_size=16, steps=1200, learning_rate=3e-3,
                    end_learning_rate=1e-4, warmup_steps=60),),
      weight_decay=0.01,
      eval_every=300,
      eval_tokens=32_768,
      eval_batch_size=16,
      checkpoint_every=300,
      final_eval=dict(split="test", protocol="sliding", context=512, stride=256,
                      batch_size=16),
  )
