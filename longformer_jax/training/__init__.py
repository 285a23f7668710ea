"""The training engine: staged, mesh-sharded training with exact Orbax resume, for any `Task`
(the tasks live in `longformer_jax.tasks`; the entry points, `longformer_jax.cli`, run them).

  config     Stage, TrainConfig, paper_stages, run_config.json
  identity   what a run is fixed to: check_resume, RunMismatchError, RunFileError (a file
             around the checkpoints that is not the run's)
  overrides  apply_overrides: `--set path=value` changes of a config, parsed to the field types
  schedule   the learning-rate schedule and the optimizer
  sharding   the (data, fsdp, seq) mesh, logical axis rules, parameter and batch shardings
  metrics    metrics.jsonl (read_log: a torn last line left out) / TensorBoard, the curves
             plot
  task       Task: what a model family supplies (model, loss, batches, validation, restore,
             final evaluation)
  sources    where a run's starting weights come from: ModelSource, load_source, checksums
  examples   whole examples: ExampleBatches for training; row batches, placement, the jitted
             NLL scorer and progress for evaluation on a mesh
  loop       TrainState, Trainer, train()
"""

from longformer_jax.training.config import (
    PAPER_STEPS_LARGE, PAPER_STEPS_SMALL, Stage, TrainConfig, config_from_record, config_record,
    paper_stages, read_run_config, write_run_config)
from longformer_jax.training.identity import RunFileError, RunMismatchError, check_resume
from longformer_jax.training.loop import (
    NonFiniteLossError, Trainer, TrainState, maybe_initialize_distributed, train)
from longformer_jax.training.metrics import DamagedLogError, MetricsLog, plot_curves, read_log
from longformer_jax.training.overrides import apply_overrides
from longformer_jax.training.schedule import learning_rate_schedule, make_optimizer
from longformer_jax.training.sharding import (
    LOGICAL_RULES, batch_sharding, logical_to_mesh, make_mesh, param_shardings)
from longformer_jax.training.task import Batches, FinalEvaluation, Task

__all__ = [
    "Batches", "DamagedLogError", "FinalEvaluation", "LOGICAL_RULES", "MetricsLog",
    "NonFiniteLossError", "PAPER_STEPS_LARGE", "PAPER_STEPS_SMALL", "RunFileError",
    "RunMismatchError", "Stage",
    "Task", "TrainConfig", "TrainState", "Trainer", "apply_overrides", "batch_sharding",
    "check_resume", "config_from_record", "config_record", "learning_rate_schedule",
    "logical_to_mesh", "make_mesh", "make_optimizer", "maybe_initialize_distributed",
    "paper_stages", "param_shardings", "plot_curves", "read_log", "read_run_config", "train",
    "write_run_config",
]
