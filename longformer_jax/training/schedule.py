"""The learning-rate schedule of a staged run and the optimizer (AdamW after global-norm
clipping)."""

from __future__ import annotations

import jax
import optax

from longformer_jax.training.config import Stage, TrainConfig


def stage_schedule(stage: Stage) -> optax.Schedule:
  """One stage's rate, from the stage's first step: linear warm-up from 0, then constant or a
  cosine (or, with `decay_power`, polynomial) decay to `end_learning_rate`."""
  peak = stage.learning_rate
  if stage.end_learning_rate is None:
    decay = optax.constant_schedule(peak)
  elif stage.decay_power is not None:
    decay = optax.polynomial_schedule(peak, stage.end_learning_rate, stage.decay_power,
                                      max(stage.steps - stage.warmup_steps, 1))
  else:
    decay = optax.cosine_decay_schedule(
        peak, max(stage.steps - stage.warmup_steps, 1), alpha=stage.end_learning_rate / peak)
  if not stage.warmup_steps:
    return decay
  warmup = optax.linear_schedule(0.0, peak, stage.warmup_steps)
  return optax.join_schedules([warmup, decay], [stage.warmup_steps])


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
  """The whole run's schedule: each stage's, joined at the stage boundaries."""
  return optax.join_schedules([stage_schedule(s) for s in cfg.stages], cfg.stage_starts()[1:])


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  schedule = learning_rate_schedule(cfg)
  # Weight decay on matrices and embeddings only: decaying LayerNorm gains and biases toward 0
  # only hurts.
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(cfg.clip_norm),
      optax.adamw(schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                  weight_decay=cfg.weight_decay, mask=decay_mask))
