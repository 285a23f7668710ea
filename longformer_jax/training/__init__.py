"""Staged, mesh-sharded training with exact Orbax resume (train/charlm.py runs it).

  config     Stage, TrainConfig, paper_stages, run_config.json
  schedule   the learning-rate schedule and the optimizer
  sharding   the (data, fsdp, seq) mesh, logical axis rules, parameter and batch shardings
  metrics    metrics.jsonl / TensorBoard and the curves plot
  task       Task: what a model family supplies (model, loss, batches, validation)
  charlm     CharLMTask: the character-level LM
  loop       TrainState, Trainer, train()
"""

from longformer_jax.training.charlm import CharLMTask
from longformer_jax.training.config import (
    PAPER_STEPS_LARGE, PAPER_STEPS_SMALL, Stage, TrainConfig, paper_stages, read_run_config,
    write_run_config)
from longformer_jax.training.loop import (
    NonFiniteLossError, Trainer, TrainState, maybe_initialize_distributed, train)
from longformer_jax.training.metrics import MetricsLog, plot_curves
from longformer_jax.training.schedule import learning_rate_schedule, make_optimizer
from longformer_jax.training.sharding import (
    LOGICAL_RULES, batch_sharding, logical_to_mesh, make_mesh, param_shardings)
from longformer_jax.training.task import Batches, Task

__all__ = [
    "LOGICAL_RULES", "PAPER_STEPS_LARGE", "PAPER_STEPS_SMALL", "Batches", "CharLMTask",
    "MetricsLog", "NonFiniteLossError", "Stage", "Task", "TrainConfig", "TrainState", "Trainer",
    "batch_sharding", "learning_rate_schedule", "logical_to_mesh", "make_mesh", "make_optimizer",
    "maybe_initialize_distributed", "paper_stages", "param_shardings", "plot_curves",
    "read_run_config", "train", "write_run_config",
]
