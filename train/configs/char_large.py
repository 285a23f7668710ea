"""char_large on enwik8: the paper's 30-layer model and 5-stage schedule (TPU VM slice).

Command, on every host of the slice (see docs/charlm.md for the gcloud launch):

    python -m train.charlm --config train/configs/char_large.py --workdir gs://BUCKET/char_large

Parameters and optimizer moments are sharded over the `fsdp` mesh axis (4 devices per group by
default) and every block is rematerialised, so the 23K-token last stage fits in 16 GB HBM per
chip. Rerunning the command resumes. Evaluation as for char_small (`python -m eval.bpc`).

Expected result: the paper reports 0.99 test BPC on enwik8 for this model size (relative
sinusoidal positions; rotary here). Not yet reproduced with this code.
"""

from longformer_jax import causal_lm
from longformer_jax.training import TrainConfig, paper_stages


def get_config() -> TrainConfig:
  model = causal_lm.char_large()
  return TrainConfig(
      model=model,
      dataset="enwik8",
      stages=paper_stages(model),
      weight_decay=0.01,
      clip_norm=0.25,
      microbatch_size=16,
      mesh_shape=(-1, 4),
      log_every=50,
      eval_every=5000,
      eval_tokens=1_000_000,
      checkpoint_every=2000,
      final_eval=dict(split="test", protocol="sliding", context=32256, stride=512,
                      batch_size=8),
  )
