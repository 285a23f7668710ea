"""char_small on enwik8: the paper's 12-layer model (`CharLMConfig.small()`) and 5-stage schedule
(TPU VM or GPUs).

Command, on every host of a TPU VM slice (see docs/charlm.md for the gcloud launch):

    python -m train.charlm --config train/configs/char_small.py --workdir gs://BUCKET/char_small

Rerunning the same command resumes from the latest checkpoint (preemptions included). text8:
add `--set dataset=text8`. Then the paper's evaluation (context 32,256, stride 512):

    python -m eval.bpc --workdir gs://BUCKET/char_small --split test

Expected result: the paper reports 1.00 test BPC on enwik8 and 1.10 on text8 for this model
size (with relative sinusoidal positions; this code uses rotary ones). Not yet reproduced with
this code: the schedule is ~570K steps of 32 x 2K-23K tokens.
"""

from longformer_jax.config import CharLMConfig
from longformer_jax.training import TrainConfig, paper_stages


def get_config() -> TrainConfig:
  model = CharLMConfig.small()
  return TrainConfig(
      model=model,
      dataset="enwik8",
      stages=paper_stages(model),
      weight_decay=0.01,
      clip_norm=0.25,
      # Sequences per accumulation step over all devices; the stage batch (32 or 16) must be a
      # multiple. Lower it if a stage does not fit in memory.
      microbatch_size=16,
      mesh_shape=(-1, 1),
      log_every=50,
      eval_every=5000,
      eval_tokens=1_000_000,
      checkpoint_every=2000,
      final_eval=dict(split="test", protocol="sliding", context=32256, stride=512,
                      batch_size=8),
  )
