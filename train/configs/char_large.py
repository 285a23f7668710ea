"""char_large on enwik8: the paper's 30-layer model (`CharLMConfig.large()`) and 5-stage schedule
(TPU VM slice); every other setting as char_small.

Command, on every host of the slice (see docs/charlm.md for the gcloud launch):

    python -m train.charlm --config train/configs/char_large.py --workdir gs://BUCKET/char_large

Parameters and optimizer moments are sharded over the `fsdp` mesh axis (4 devices per group by
default) and every block is rematerialised, so the 23K-token last stage fits in 16 GB HBM per
chip. Rerunning the command resumes. Evaluation as for char_small (`python -m eval.bpc`).

Expected result: the paper reports 0.99 test BPC on enwik8 for this model size (relative
sinusoidal positions; rotary here). Not yet reproduced with this code.
"""

from longformer_jax.tasks.charlm import char_large
from longformer_jax.training import TrainConfig


def get_config() -> TrainConfig:
  # `--preset char_large` is this file. To change a setting here rather
  # than with --set, replace it, e.g.:
  #   return dataclasses.replace(char_large(), eval_every=1000)
  return char_large()
