"""`Task`: what the training loop needs to know about one kind of model and data.

The loop (`training.loop`), the sharding, the checkpoints and the metrics are the same for every
model; a task supplies the rest (`longformer_jax.tasks`: CharLMTask, MLMTask, FinetuneTask,
Seq2SeqTask), e.g. a masked LM:

    class MLMTask(Task):
      def build_model(self, config, rngs, mesh=None, seq_axis=None):
        return LongformerForMaskedLM(config, rngs=rngs, mesh=mesh, seq_axis=seq_axis)
      def loss(self, model, batch, stage, dropout_key):
        ...  # mean masked-token cross-entropy of batch["input_ids"], batch["labels"]
      def batches(self, cfg, stage_index, *, process_index, process_count):
        ...  # an iterator of {"input_ids": ..., "labels": ...} with state()/load_state()
      def final_evaluation(self, cfg, workdir, mesh, *, progress=False):
        ...  # the test split's metrics of the run's newest checkpoint (`self.restore`)

Batches are dicts of NumPy arrays whose leading axis is this process's rows of the global batch
(`stage.batch_size / process_count` of them); the loop assembles the global batch and splits it
over the mesh's `batch` axes, and the length of [batch, length] arrays over its seq axis.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from longformer_jax.training.config import Stage, TrainConfig

Batch = Mapping[str, np.ndarray]


class Batches(Protocol):
  """An endless, resumable iterator of batches: `state()` is a JSON-able dict saved with each
  checkpoint; `load_state(state)` continues exactly from it."""

  def __next__(self) -> Batch: ...

  def state(self) -> dict[str, Any]: ...

  def load_state(self, state: Mapping[str, Any]) -> None: ...


@dataclasses.dataclass(frozen=True)
class FinalEvaluation:
  """What a task's final evaluation reports: `results`, merged into the run's results.json;
  `files` (name -> text), written beside it, each whole or not at all; `lines`, printed; `step`:
  the checkpoint step whose weights were scored (None: weights of no run's checkpoint), which
  the entry point writes into results.json as "checkpoint_step" and prints."""
  results: dict[str, Any]
  files: dict[str, str] = dataclasses.field(default_factory=dict)
  lines: tuple[str, ...] = ()
  step: int | None = None


def restore(build_model: Callable[..., nnx.Module], cfg: TrainConfig, workdir, mesh: Mesh, *,
            step: int | None = None) -> tuple[nnx.Module, int, dict[str, Any]]:
  """(model, step, meta) of a run's checkpoint `step` (default: the newest that restores and
  verifies; damaged ones are skipped with a warning): `build_model(cfg.model, rngs=, mesh=,
  seq_axis=)` built for `mesh`, with the checkpoint's parameters and nothing else (no optimizer
  state), sharded by the run's logical rules; meta: the settings saved with the checkpoint."""
  from longformer_jax import checkpoint
  from longformer_jax.training.sharding import param_shardings, seq_axis
  return checkpoint.restore_model_and_meta(
      lambda: build_model(cfg.model, rngs=nnx.Rngs(cfg.seed), mesh=mesh, seq_axis=seq_axis(mesh)),
      workdir, step=step,
      shardings=lambda params: param_shardings(params, mesh, cfg.logical_rules))


class Task(abc.ABC):
  """The model-specific part of training. Everything random must be a function of its arguments
  (the loop passes per-step keys and stage indices) for exact resume."""

  # Metrics drawn in <logdir>/curves.png, and the y axis label.
  plot_keys: tuple[str, ...] = ("train_loss",)
  plot_ylabel: str = "loss"

  def check(self, cfg: TrainConfig) -> None:  # noqa: B027 (optional to override)
    """Raises ValueError when `cfg` is not a run this task can train (default: accepts all)."""

  def data_identity(self, cfg: TrainConfig) -> dict[str, Any]:
    """JSON values that change whenever the training data does (e.g. its size and SHA-256),
    stored with the run and compared on resume (`training.identity`; default: none)."""
    del cfg
    return {}

  @abc.abstractmethod
  def build_model(self, config: Any, rngs: nnx.Rngs, mesh: Mesh | None = None,
                  seq_axis: str | None = None) -> nnx.Module:
    """A freshly initialised model of `config` (`TrainConfig.model`).

    mesh, seq_axis: the training mesh and the axis that splits sequences (None: whole
    sequences), for the model's attention (the `mesh` and `seq_axis` of the models'
    constructors).
    """

  @abc.abstractmethod
  def loss(self, model: nnx.Module, batch: Mapping[str, jax.Array], stage: Stage,
           dropout_key: jax.Array) -> jax.Array:
    """The scalar training loss of `batch` (traced under jit; `stage` is static)."""

  @abc.abstractmethod
  def batches(self, cfg: TrainConfig, stage_index: int, *, process_index: int,
              process_count: int) -> Batches:
    """The training batches of a stage, from the stage's first step."""

  def evaluate(self, model: nnx.Module, cfg: TrainConfig, stage_index: int,
               mesh: Mesh) -> dict[str, float]:
    """Validation metrics (keys starting with "valid_") every `cfg.eval_every` steps and at the
    end (default: none)."""
    del model, cfg, stage_index, mesh
    return {}

  def train_metrics(self, loss: float) -> dict[str, float]:
    """Metrics derived from a step's loss, logged next to `train_loss` (default: none)."""
    del loss
    return {}

  def restore(self, cfg: TrainConfig, workdir, mesh: Mesh, *, step: int | None = None
              ) -> tuple[nnx.Module, int, dict[str, Any]]:
    """(model, step, meta) of this run's checkpoint (`restore` with `build_model`)."""
    return restore(self.build_model, cfg, workdir, mesh, step=step)

  def final_evaluation(self, cfg: TrainConfig, workdir, mesh: Mesh, *,
                       progress: bool = False) -> FinalEvaluation:
    """What the entry point runs after training (and with --eval-only): the run's checkpoint
    scored on held-out data, as `cfg.final_eval` says, naming the step scored (default:
    nothing)."""
    del cfg, workdir, mesh, progress
    return FinalEvaluation({})


def dict_batches(batches: Iterator[tuple[np.ndarray, ...]], names: tuple[str, ...]) -> Batches:
  """Adapts an iterator of tuples that has state()/load_state() to one of dicts."""
  return _DictBatches(batches, names)


class _DictBatches:

  def __init__(self, batches, names):
    self._batches, self._names = batches, names

  def __next__(self) -> Batch:
    return dict(zip(self._names, next(self._batches), strict=True))

  def __iter__(self):
    return self

  def state(self) -> dict[str, Any]:
    return self._batches.state()

  def load_state(self, state) -> None:
    self._batches.load_state(state)
