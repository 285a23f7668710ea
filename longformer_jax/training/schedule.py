"""The learning-rate schedule of a staged run and the optimizer (AdamW after global-norm
clipping; with `TrainConfig.trainable`, for the parameters it names only)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import jax
import optax

from longformer_jax.training.config import Stage, TrainConfig


def _decay(stage: Stage, init: float, steps: int) -> optax.Schedule:
  """From `init` to the stage's end_learning_rate over `steps` steps, by its decay (cosine or
  polynomial); constant at `init` without an end_learning_rate."""
  end = stage.end_learning_rate
  if end is None:
    return optax.constant_schedule(init)
  if stage.decay_power is not None:
    return optax.polynomial_schedule(init, end, stage.decay_power, max(steps, 1))
  return optax.cosine_decay_schedule(init, max(steps, 1), alpha=end / init if init else 0.0)


def stage_schedule(stage: Stage) -> optax.Schedule:
  """One stage's rate, from the stage's first step: linear warm-up from 0, then constant or a
  cosine (or, with `decay_power`, polynomial) decay to `end_learning_rate`.

  A stage whose length changed after it started (`Stage.step_changes`) keeps the rates of the
  steps taken before each change; from the last of them (or from the end of the warm-up, if no
  decayed step was taken) the decay goes on, from the rate it had reached, to
  `end_learning_rate` at the stage's new end. The warm-up never moves."""
  warmup = stage.warmup_steps
  lengths = [steps for _, steps in stage.step_changes] + [stage.steps]
  schedule = _decay(stage, stage.learning_rate, lengths[0] - warmup)
  if warmup:
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, stage.learning_rate, warmup), schedule], [warmup])
  if stage.end_learning_rate is None:
    return schedule  # constant after the warm-up: nothing to re-base
  for (at, _), steps in zip(stage.step_changes, lengths[1:]):
    anchor = max(at - 1, warmup)  # the last step taken keeps its rate too
    rate = stage.learning_rate  # no step has decayed yet: from the peak
    if anchor > warmup:
      # A number of the schedule so far, also while a step that calls this is being traced.
      with jax.ensure_compile_time_eval():
        rate = float(schedule(anchor))
    schedule = optax.join_schedules([schedule, _decay(stage, rate, steps - anchor)], [anchor])
  return schedule


def continued_stages(cfg: TrainConfig, stored: Mapping[str, Any], step: int) -> TrainConfig:
  """`cfg` resuming at global `step` a run whose record is `stored` (`config_record`): each
  started stage keeps the run's `step_changes`, plus one for this resume when its `steps`
  differ from the run's; stages not started have none. (Which changes are allowed at all is
  `identity.check_resume`'s to say.)"""
  stages = []
  for i, (stage, start) in enumerate(zip(cfg.stages, cfg.stage_starts())):
    old = stored["stages"][i] if i < len(stored["stages"]) else None
    changes = ()
    if old is not None and start < step:
      changes = tuple(tuple(c) for c in old.get("step_changes", ()))
      if old["steps"] != stage.steps:
        changes += ((step - start, old["steps"]),)
    stages.append(dataclasses.replace(stage, step_changes=changes))
  return dataclasses.replace(cfg, stages=tuple(stages))


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
  """The whole run's schedule: each stage's, joined at the stage boundaries."""
  return optax.join_schedules([stage_schedule(s) for s in cfg.stages], cfg.stage_starts()[1:])


def param_path(path) -> str:
  """A parameter's path as `TrainConfig.trainable` matches it: its modules and name joined by
  "/", e.g. "longformer/embeddings/position_embeddings/embedding" (an nnx.Param's own "value"
  leaf left off)."""
  return jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value")


def trainable_labels(cfg: TrainConfig, params: Any) -> Any:
  """`params`' tree with "trainable" or "frozen" for each parameter (`cfg.trainable`: a regular
  expression searched for in `param_path`; None: all trainable). ValueError naming the pattern
  and a few paths when it matches no parameter (a typo would otherwise train nothing)."""
  if cfg.trainable is None:
    return jax.tree.map(lambda _: "trainable", params)
  pattern = re.compile(cfg.trainable)
  labels = jax.tree_util.tree_map_with_path(
      lambda path, _: "trainable" if pattern.search(param_path(path)) else "frozen", params)
  if "trainable" not in jax.tree.leaves(labels):
    paths = [param_path(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    raise ValueError(f"TrainConfig.trainable={cfg.trainable!r} matches none of the model's "
                     f"{len(paths)} parameters (paths such as {paths[:3]})")
  return labels


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  schedule = learning_rate_schedule(cfg)
  # Weight decay on matrices and embeddings only: decaying LayerNorm gains and biases toward 0
  # only hurts.
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  adamw = optax.chain(
      optax.clip_by_global_norm(cfg.clip_norm),
      optax.adamw(schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                  weight_decay=cfg.weight_decay, mask=decay_mask))
  if cfg.trainable is None:
    return adamw
  # Frozen parameters get zero updates and no state at all (multi_transform hands each branch
  # only its own parameters), and their gradients do not count in the clipping norm.
  return optax.multi_transform({"trainable": adamw, "frozen": optax.set_to_zero()},
                               lambda params: trainable_labels(cfg, params))
