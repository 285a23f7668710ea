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

from longformer_jax.tasks.charlm import char_small
from longformer_jax.training import TrainConfig


def get_config() -> TrainConfig:
  # `--preset char_small` is this file. To change a setting here rather
  # than with --set, replace it, e.g.:
  #   return dataclasses.replace(char_small(), eval_every=1000)
  return char_small()
