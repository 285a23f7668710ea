"""Staged, mesh-sharded training of any model a `Task` describes, with exact Orbax resume.

The loop in one paragraph (`train`):
  1. Mesh (data, fsdp, seq) from the config; parameter shardings from the model's logical axis
     names and `TrainConfig.logical_rules`; the batch is split over data and fsdp, the length of
     [batch, length] arrays over seq; the task builds its model with the mesh, so the attention
     op runs per shard (and sequence-parallel when seq > 1).
  2. Resume (`_resume`): the run's settings (`training.identity`) are checked against those saved
     with the newest checkpoint under `<workdir>/checkpoints` that restores and verifies (damaged
     ones are skipped with a warning), before anything is written; its train state (float32
     params and optimizer state, restored straight into their shardings; the step) and metadata
     (stage, the stage's batch iterator state) continue the run. A stage whose length changed
     keeps the learning rates of the steps it took (`schedule.continued_stages`). Without a
     checkpoint, parameters are initialised already sharded (jit with out_shardings), never
     materialised on one device, and run_config.json is written: once, unless it is a failed
     start's (a record without any checkpoint), which is replaced with a warning. metrics.jsonl
     keeps the records up to the step resumed from (a torn last line is dropped with a warning,
     `metrics.read_log`). Then the damaged checkpoints newer than the step resumed from are set
     aside as they are (`checkpoint.set_aside`: to <workdir>/checkpoints.damaged, with a
     warning), so that the run saves those steps again and its final step is the one scored.
  3. For each stage from the current one: the task's batch iterator for the stage, moved to the
     stage-local step (`load_state`); one jit-compiled step per stage (sequence length and
     windows are static shapes); the state is donated.
  4. Every step (`_Loop`): the loss reaches the host (`_MetricsReader`: progress bar, JSONL,
     step_hook) late: the host dispatches step t+1 before it reads step t's metrics (`read_every`
     steps at a time), so the device never waits for the host between steps; a step whose state
     the host needs, an evaluation, a checkpoint or SIGTERM, is read at once. A non-finite loss
     or gradient norm stops the run before anything is saved (`NonFiniteLossError`). The task's
     validation metrics every `eval_every` steps and at the end. Checkpoints every
     `checkpoint_every` steps, at stage ends and at the end, asynchronously (`_Saver`), each only
     after a health check (`Trainer.health`: the new parameters' loss and gradient on the step's
     batch are finite, and so is the whole state), so the newest checkpoint is always one the run
     can go on from. A background save that failed stops the run at the next read
     (`checkpoint.CheckpointSaveError`). SIGTERM (a preempted TPU VM) saves and returns. With
     several processes all of them save and return after the same step, whichever of them got the
     signal, agreed on host to host (JAX's preemption sync point), not by a collective every step
     (`_Preemption`).

Everything random is a function of (seed, step): initialisation, the batches (the task's
iterators are) and the dropout keys (`fold_in(seed, step)`, then `fold_in(., microbatch)`), so a
resumed run computes bit-identical losses. The seed is an argument of the compiled programs, not
a constant in them: runs that differ only in their seed share their programs (and a persistent
compilation cache's entries).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from longformer_jax import checkpoint
from longformer_jax.training import identity
from longformer_jax.training.config import (RUN_CONFIG, Stage, TrainConfig, check_run_record,
                                             config_record, read_run_record, write_run_config)
from longformer_jax.training.metrics import DamagedLogError, MetricsLog, plot_curves
from longformer_jax.training.schedule import (continued_stages, learning_rate_schedule,
                                               make_optimizer)
from longformer_jax.training.sharding import (batch_sharding, make_mesh, param_shardings,
                                               row_group, seq_axis)
from longformer_jax.training.task import Task


def _flat(pure: Mapping[str, Any]) -> dict[str, Any]:
  """{"a/b/c": leaf} of a nested dict of parameters."""
  return {jax.tree_util.keystr(path, simple=True, separator="/"): x
          for path, x in jax.tree_util.tree_flatten_with_path(pure)[0]}


class NonFiniteLossError(RuntimeError):
  """The loss, the gradients or the parameters became NaN or inf; nothing was saved after the
  last good checkpoint, which the message names."""


_RETRY = ("Resume with a lower learning rate or more warm-up (changes to a started stage need "
          "--allow-change stages.N.learning_rate, or train(..., allow_changes=[...])).")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  step: jax.Array       # int32 scalar: optimizer steps taken
  params: Any           # nnx.State of the float32 nnx.Param master weights
  opt_state: Any


def optimizer_shardings(abstract_opt: Any, param_shardings: Any, replicated: NamedSharding
                        ) -> Any:
  """The shardings of an optimizer state: Adam's moments mirror the parameters (all of them, or
  with `TrainConfig.trainable` the trained ones only, the frozen ones left out), so each state
  leaf whose path ends with a parameter's path is sharded like that parameter; the others
  (counts) are replicated. (optax.tree_map_params cannot see inside the per-label states of the
  partitioned optimizer that freezing uses.)"""
  by_path = {tuple(path): s for path, s in jax.tree_util.tree_leaves_with_path(param_shardings)}

  def sharding(path, _):
    for start in range(len(path)):  # the longest suffix first: a parameter's whole path
      if tuple(path[start:]) in by_path:
        return by_path[tuple(path[start:])]
    return replicated

  return jax.tree_util.tree_map_with_path(sharding, abstract_opt)


class Trainer:
  """The pieces `train` assembles, usable on their own (tests, notebooks): mesh, shardings,
  initial state, one jitted step per stage, checkpoint save/restore.

  task: what is trained (a `Task`, e.g. `tasks.CharLMTask()`).
  """

  def __init__(self, cfg: TrainConfig, mesh: Mesh | None = None, *, task: Task):
    if not isinstance(task, Task):
      raise TypeError(f"task must be a training.Task (e.g. tasks.CharLMTask()), got "
                      f"{type(task).__name__}")
    self.cfg = cfg
    self.task = task
    self.task.check(cfg)
    self.mesh = mesh if mesh is not None else make_mesh(cfg.mesh_shape)
    self.optimizer = make_optimizer(cfg)
    # The seed enters every program as an argument (its key's data), never as a constant, so
    # runs that differ only in their seed (a study's seeds) trace the same programs, and a
    # persistent compilation cache compiles them once.
    self._seed_data = np.asarray(jax.random.key_data(jax.random.key(cfg.seed)))
    self._seed_array = None
    # The seq axis is named to the model only when it splits sequences: with one piece there is
    # nothing to exchange, and the op's plain per-shard path (the numbers of a mesh without a seq
    # axis) is the cheaper one.
    self._build = lambda seed_data: self.task.build_model(
        cfg.model, nnx.Rngs(jax.random.wrap_key_data(seed_data)), mesh=self.mesh,
        seq_axis=seq_axis(self.mesh))
    self.graphdef, abstract_params, _ = nnx.split(
        nnx.eval_shape(lambda: self._build(self._seed_data)), nnx.Param, ...)
    self._abstract_params = abstract_params
    self.param_shardings = param_shardings(abstract_params, self.mesh, cfg.logical_rules)
    self.replicated = NamedSharding(self.mesh, P())
    abstract_opt = jax.eval_shape(self.optimizer.init, abstract_params)
    opt_shardings = optimizer_shardings(abstract_opt, self.param_shardings, self.replicated)
    self.state_shardings = TrainState(step=self.replicated, params=self.param_shardings,
                                      opt_state=opt_shardings)
    self._rest = None
    self._steps = {}
    self._jitted_fns = {}

  def _build_rest(self, seed_data):
    return nnx.split(self._build(seed_data), nnx.Param, ...)[2]

  @property
  def seed_array(self) -> jax.Array:
    """The seed's key data, replicated over the mesh: the programs' seed argument. Made on first
    use, like `rest`."""
    if self._seed_array is None:
      self._seed_array = jax.make_array_from_callback(
          self._seed_data.shape, self.replicated, lambda _: self._seed_data)
    return self._seed_array

  @property
  def rest(self):
    """The model's other state (e.g. the RNG streams of nnx.Dropout layers): not trained and not
    checkpointed, a function of the seed. Built on first use, so that a Trainer on a mesh of
    devices that cannot run (ahead-of-time compilation, `lower_train_step`) never runs it."""
    if self._rest is None:
      self._rest = jax.jit(self._build_rest, in_shardings=self.replicated,
                           out_shardings=self.replicated)(self.seed_array)
    return self._rest

  def abstract_state(self) -> TrainState:
    """ShapeDtypeStructs with shardings: the restore target of a checkpoint."""
    shapes = jax.eval_shape(self._init, self._seed_data)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, self.state_shardings)

  def _init(self, seed_data) -> TrainState:
    return self._init_from(nnx.state(self._build(seed_data), nnx.Param))

  def init_state(self, params: Any = None) -> TrainState:
    """Step 0: the parameters initialised from the seed, or `params` (e.g. pretrained weights
    to fine-tune), and a fresh optimizer state, each in its sharding.

    params: the model's parameters as `nnx.state(model, nnx.Param)` or its pure dict, from a
      model of the same structure (host or device arrays; cast to the parameter dtypes). A
      missing, extra or differently shaped array is a ValueError naming it.
    """
    if params is None:
      return jax.jit(self._init, in_shardings=self.replicated,
                     out_shardings=self.state_shardings)(self.seed_array)
    want_pure = nnx.to_pure_dict(self._abstract_params)
    given_pure = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
    want, given = _flat(want_pure), _flat(given_pure)
    if set(given) != set(want):
      raise ValueError(f"the initial parameters do not match the model's: missing "
                       f"{sorted(set(want) - set(given))[:5]}, unexpected "
                       f"{sorted(set(given) - set(want))[:5]}")
    for name, x in given.items():
      if tuple(x.shape) != want[name].shape:
        raise ValueError(f"initial parameter {name} has shape {tuple(x.shape)}; the model's "
                         f"is {want[name].shape}")
    # Cast on the host, then each device receives only its shards of every array.
    target = jax.tree.map(lambda x: x, self._abstract_params)
    nnx.replace_by_pure_dict(target, jax.tree.map(lambda x, t: np.asarray(x, t.dtype),
                                                  given_pure, want_pure))
    params = jax.device_put(target, self.param_shardings)
    return jax.jit(self._init_from, out_shardings=self.state_shardings,
                   donate_argnums=0)(params)

  def _init_from(self, params) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=self.optimizer.init(params))

  def model(self, params) -> nnx.Module:
    return nnx.merge(self.graphdef, params, self.rest)

  def _loss_and_grads(self, params, rest, batch, step_key, *, stage: Stage, accum: int):
    """The mean loss of `batch` and its gradients, over `accum` microbatches."""
    # nnx's transform, not jax's: models whose layers keep RNG streams (nnx.Dropout(rngs=...))
    # advance them inside the loss, which jax.value_and_grad refuses.
    grad_fn = nnx.value_and_grad(lambda params, rest, batch, key: self.task.loss(
        nnx.merge(self.graphdef, params, rest), batch, stage, key))
    if accum == 1:
      return grad_fn(params, rest, batch, step_key)
    # Microbatch m takes rows m, m + accum, ...: every device keeps its own rows (the batch is
    # sharded in contiguous blocks), so no data moves between devices.
    def split(x):
      x_MxB = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
      return jax.lax.with_sharding_constraint(
          x_MxB, NamedSharding(self.mesh, P(None, *self.batch_sharding(x.shape).spec)))

    def body(carry, xs):
      loss_sum, grad_sum = carry
      m, microbatch = xs
      # The Variables anew at this trace level (nnx transforms refuse outer ones).
      params_m, rest_m = jax.tree.map(lambda x: x, (params, rest))
      loss, grads = grad_fn(params_m, rest_m, microbatch, jax.random.fold_in(step_key, m))
      return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (loss, grads), _ = jax.lax.scan(
        body, (jnp.zeros((), jnp.float32), zeros),
        (jnp.arange(accum), jax.tree.map(split, batch)))
    return loss / accum, jax.tree.map(lambda g: g / accum, grads)

  @staticmethod
  def _step_key(seed_data: jax.Array, step: jax.Array) -> jax.Array:
    return jax.random.fold_in(jax.random.wrap_key_data(seed_data), step)

  def _train_step(self, state: TrainState, batch, rest, seed_data, *, stage: Stage, accum: int):
    loss, grads = self._loss_and_grads(state.params, rest, batch,
                                       self._step_key(seed_data, state.step),
                                       stage=stage, accum=accum)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
               "learning_rate": learning_rate_schedule(self.cfg)(state.step)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  def _health(self, state: TrainState, batch, rest, seed_data, *, stage: Stage, accum: int):
    # The computation the next step would start with, on this step's batch: a state whose loss
    # or gradients overflow would stop the run at its next step, so it is not a good checkpoint.
    loss, grads = self._loss_and_grads(state.params, rest, batch,
                                       self._step_key(seed_data, state.step),
                                       stage=stage, accum=accum)
    leaves = [x for x in jax.tree.leaves((state.params, state.opt_state))
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
    return {"loss": loss, "grad_norm": optax.tree.norm(grads), "finite": finite}

  def health(self, stage_index: int, state: TrainState, batch) -> dict[str, float]:
    """Whether `state` is fit to be saved: {"loss", "grad_norm"} of its parameters on `batch`
    (this step's), and "finite": 1.0 if every parameter and optimizer value is finite, else 0.
    Costs one forward and backward pass; the state is not donated."""
    shapes = tuple((name, tuple(x.shape)) for name, x in batch.items())
    out = self._jitted(stage_index, shapes, health=True)(state, batch, self.rest,
                                                         self.seed_array)
    return {k: float(v) for k, v in out.items()}

  def batch_sharding(self, shape: tuple[int, ...]) -> NamedSharding:
    """The sharding of a global batch array of `shape` (`sharding.batch_sharding`)."""
    return batch_sharding(self.mesh, self.cfg.logical_rules, shape)

  def _jitted(self, stage_index: int, shapes: tuple[tuple[str, tuple[int, ...]], ...], *,
              health: bool = False):
    # The batch's shardings depend on its arrays' shapes (only [batch, length] arrays are split
    # over seq), which the task decides: one jit per stage and batch layout (and one for the
    # health check of saved states).
    key = (stage_index, shapes, health)
    if key not in self._jitted_fns:
      stage = self.cfg.stages[stage_index]
      accum = 1 if self.cfg.microbatch_size is None else (
          stage.batch_size // self.cfg.microbatch_size)
      in_shardings = (self.state_shardings,
                      {name: self.batch_sharding(shape) for name, shape in shapes},
                      self.replicated, self.replicated)
      if health:
        self._jitted_fns[key] = jax.jit(
            functools.partial(self._health, stage=stage, accum=accum),
            in_shardings=in_shardings, out_shardings=self.replicated)
      else:
        self._jitted_fns[key] = jax.jit(
            functools.partial(self._train_step, stage=stage, accum=accum),
            in_shardings=in_shardings, out_shardings=(self.state_shardings, self.replicated),
            donate_argnums=0)
    return self._jitted_fns[key]

  def train_step(self, stage_index: int) -> Callable:
    """The jitted step of a stage: (state, global batch) -> (state, metrics); donates state."""
    if stage_index not in self._steps:
      def step(state, batch):
        shapes = tuple((name, tuple(x.shape)) for name, x in batch.items())
        return self._jitted(stage_index, shapes)(state, batch, self.rest, self.seed_array)
      self._steps[stage_index] = step
    return self._steps[stage_index]

  def lower_train_step(self, stage_index: int, batch: Mapping[str, jax.ShapeDtypeStruct]):
    """The stage's step lowered on abstract state, batch and model state: ahead-of-time
    compilation, e.g. for a TPU slice from a CPU host (`.compile().memory_analysis()`;
    docs/design.md §5.1). Nothing is allocated or run. The compiled step is called as
    `compiled(state, batch, trainer.rest, trainer.seed_array)`.

    batch: name -> ShapeDtypeStruct of each global batch array (shardings are added here).
    """
    shapes = tuple((name, tuple(x.shape)) for name, x in batch.items())
    abstract_batch = {name: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                 sharding=self.batch_sharding(x.shape))
                      for name, x in batch.items()}
    abstract_rest = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated),
        jax.eval_shape(self._build_rest, self._seed_data))
    abstract_seed = jax.ShapeDtypeStruct(self._seed_data.shape, self._seed_data.dtype,
                                         sharding=self.replicated)
    return self._jitted(stage_index, shapes).lower(self.abstract_state(), abstract_batch,
                                                        abstract_rest, abstract_seed)

  def fit(self, state: TrainState, stage_index: int = 0, *, steps: int | None = None,
          on_step: Callable[[int, float], None] | None = None) -> tuple[TrainState, list[float]]:
    """Trains a stage in memory from `state`: `steps` steps (default: the stage's) of the task's
    batches for this process, with no workdir, checkpoint or metrics file (studies, tests,
    notebooks; `train` is the resumable, checkpointed run). `on_step(step, loss)` is called
    after every step (1-based). Returns (state, the loss of every step).

    Raises NonFiniteLossError at the first loss that is not finite.
    """
    stage = self.cfg.stages[stage_index]
    batches = self.task.batches(self.cfg, stage_index, process_index=jax.process_index(),
                                process_count=jax.process_count())
    step_fn = self.train_step(stage_index)
    losses = []
    for step in range(1, (stage.steps if steps is None else steps) + 1):
      state, metrics = step_fn(state, self.global_batch(next(batches), stage.batch_size))
      losses.append(float(metrics["loss"]))
      if not math.isfinite(losses[-1]):
        raise NonFiniteLossError(f"stage {stage_index}: loss {losses[-1]} at step {step} of "
                                 f"fit() (nothing is saved by fit). {_RETRY}")
      if on_step is not None:
        on_step(step, losses[-1])
    return state, losses

  def global_batch(self, local: Mapping[str, np.ndarray], global_batch_size: int
                   ) -> dict[str, jax.Array]:
    """This process's rows of every batch array -> the global arrays, split over the mesh.

    Processes split the batch dimension only: a process's local arrays are [the rows of its
    `row_group`, full length, ...], and each device takes its piece of the length from them.
    """
    out = {}
    for name, x in local.items():
      shape = (global_batch_size, *x.shape[1:])
      out[name] = jax.make_array_from_process_local_data(self.batch_sharding(shape), x, shape)
    return out

  def restore(self, path, step: int | None = None, check_meta=None
              ) -> tuple[TrainState, dict[str, Any]]:
    """(state, meta) of checkpoint `step` under `path` (a workdir or its checkpoints/; default:
    the newest that restores and verifies), straight into the state's shardings
    (`checkpoint.restore_train_state`; check_meta: as there)."""
    target = self.abstract_state()
    params, opt_state, meta = checkpoint.restore_train_state(
        path, target.params, target.opt_state, step=step, check_meta=check_meta)
    step_array = jax.make_array_from_callback(
        (), self.replicated, lambda _: np.asarray(meta["step"], np.int32))
    return TrainState(step=step_array, params=params, opt_state=opt_state), meta


def maybe_initialize_distributed(mode: str = "auto", *, coordinator_address: str | None = None,
                                 num_processes: int | None = None,
                                 process_id: int | None = None) -> None:
  """`jax.distributed.initialize(...)` before any device use.

  mode: "on" (every process of the run calls it with the same command), "off", or "auto": on when
  the arguments or the environment name a cluster (a coordinator address, several TPU workers, or
  a multi-task SLURM job).

  On a TPU slice, under SLURM or Open MPI, JAX finds its peers itself and the other arguments stay
  None. Elsewhere (e.g. several processes on one machine) give all three, as arguments or as the
  environment variables JAX_COORDINATOR_ADDRESS ("host:port" of process 0), JAX_NUM_PROCESSES and
  JAX_PROCESS_ID. jax 0.12 reads only the first of these itself (and finds the other two only
  from a detected cluster), so this function reads the other two.
  """
  if mode not in ("auto", "on", "off"):
    raise ValueError(f"distributed mode must be 'auto', 'on' or 'off', got {mode!r}")
  env = os.environ
  coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
  if num_processes is None and env.get("JAX_NUM_PROCESSES"):
    num_processes = _env_int("JAX_NUM_PROCESSES")
  if process_id is None and env.get("JAX_PROCESS_ID"):
    process_id = _env_int("JAX_PROCESS_ID")
  if mode == "auto":
    mode = "on" if ("," in env.get("TPU_WORKER_HOSTNAMES", "") or coordinator_address
                    or int(env.get("SLURM_NTASKS", "1")) > 1) else "off"
  if mode == "off":
    return
  if _platforms_include_cpu():
    # Collectives between CPU processes need an implementation: gloo (over TCP, through the
    # distributed client) is jax 0.12's default but was none in older versions, where every
    # cross-process computation fails. Named explicitly so the CPU runs do not depend on it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = dict(coordinator_address=coordinator_address, num_processes=num_processes,
                process_id=process_id)
  jax.distributed.initialize(**{k: v for k, v in kwargs.items() if v is not None})


def _env_int(name: str) -> int:
  text = os.environ[name]
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"environment variable {name}={text!r} is not an integer") from None


def _platforms_include_cpu() -> bool:
  # Read from the config (JAX_PLATFORMS), not from jax.devices(): that would start the backends,
  # after which jax.distributed.initialize refuses to run. Unset: any platform, the CPU included.
  platforms = jax.config.jax_platforms
  return not platforms or "cpu" in platforms.split(",")


def _stored_record(workdir) -> dict[str, Any] | None:
  """<workdir>/run_config.json's record, None if it is not valid JSON."""
  try:
    return read_run_record(workdir)
  except ValueError:
    return None


class _Preemption:
  """SIGTERM (a preempted TPU VM) as a stop after a step that every process agrees on.

  The processes of a run take every step together, so they must stop after the same step: one
  that saved and returned alone would leave the others waiting in the next step's collectives.
  SIGTERM reaches them at different moments (or only some of them), so each one's notice is
  agreed on before it acts, without a device collective, which would make the host wait for
  every step and so never run ahead of the device:
    * one process: a Python handler turns SIGTERM into a flag checked between steps (the default
      action would kill the process in the middle of an async checkpoint);
    * several: JAX's preemption sync point (`multihost_utils.reached_preemption_sync_point`,
      host to host through the coordination service of `jax.distributed`). Its SIGTERM handler,
      installed by `jax.distributed.initialize`, is C code that a Python handler would replace,
      so none is installed; it tells every process of the notice (its notifier polls for
      SIGTERM, so a few steps may pass first) and names the same step on all of them;
    * several with JAX's preemption service off (`jax_enable_preemption_service=False`): the flag,
      OR-ed over the processes by a collective at checkpoint steps only.
  """

  def __init__(self):
    self.requested = False
    self._previous = None
    self._sync_point = False

  def __enter__(self):
    if jax.process_count() > 1:
      from jax._src import distributed
      self._sync_point = getattr(distributed.global_state, "preemption_sync_manager",
                                 None) is not None
      if self._sync_point:
        return self
      print("warning: JAX's preemption service is off (jax_enable_preemption_service): SIGTERM "
            "is acted on at the next checkpoint step", file=sys.stderr, flush=True)
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handler)
    except ValueError:  # not the main thread: nothing to install
      self._previous = None
    return self

  def _handler(self, signum, frame):
    del signum, frame
    self.requested = True

  def stop_after(self, step: int, *, checkpoint_step: bool) -> bool:
    """Whether the run stops after `step`: the same answer at the same step on every process
    (every process calls this after every step it dispatches, in order)."""
    if jax.process_count() == 1:
      return self.requested
    from jax.experimental import multihost_utils
    if self._sync_point:
      return multihost_utils.reached_preemption_sync_point(step)
    if not checkpoint_step:
      return False
    return bool(np.any(multihost_utils.process_allgather(np.asarray([self.requested]))))

  def noticed(self) -> bool:
    """One process: whether SIGTERM came (what `stop_after` answers); several: False (the
    processes act only on a step they agreed on)."""
    return self.requested and jax.process_count() == 1

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def _sync_processes(name: str) -> None:
  """Waits until every process of the run reaches this point (a collective; nothing with one
  process): what process 0 alone did to the shared workdir is then there for all of them."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


@dataclasses.dataclass
class _Start:
  """What a run goes on from (`_resume`)."""
  cfg: TrainConfig         # with the stages' step changes of a resumed run (`continued_stages`)
  trainer: Trainer
  record: dict[str, Any]   # the run's settings: run_config.json and every checkpoint's "run"
  state: TrainState
  step: int
  meta: dict[str, Any] | None  # the resumed checkpoint's metadata; None: a new run
  accepted: list[str]      # the settings changes accepted on resume
  damaged: list[int]       # the checkpoints newer than `step`, which did not restore
  failed_start: bool       # run_config.json is a failed start's, replaced by this run's


class _ResumeCheck:
  """`check_meta` of the restore: refuses a checkpoint whose settings differ before its arrays
  are read, and keeps, of the one that passed last (the one restored), what was accepted and
  the continued stages."""

  def __init__(self, cfg: TrainConfig, record: dict[str, Any], allow: Sequence[str],
               where: str):
    self.cfg = self._requested = cfg
    self._record, self._allow, self._where = record, allow, where
    self.accepted: list[str] = []

  def __call__(self, meta: dict[str, Any]) -> None:
    self.accepted = identity.check_resume(meta["run"], self._record, step=meta["step"],
                                          allow=self._allow, where=self._where)
    self.cfg = continued_stages(self._requested, meta["run"], meta["step"])


def _resume(cfg: TrainConfig, workdir: epath.Path, task: Task, trainer: Trainer,
            allow_changes: Sequence[str], init_params: Callable[[], Any] | None) -> _Start:
  """The run's identity and state, before anything is written: the settings are those of the
  checkpoint resumed from. A run that never saved has none: nothing of it is kept."""
  data_identity = task.data_identity(cfg)
  record = {**config_record(cfg), "data": data_identity}
  checkpoints_dir = workdir / checkpoint.CHECKPOINTS
  steps = checkpoint.checkpoint_steps(checkpoints_dir)
  if not steps:
    failed_start = ((workdir / RUN_CONFIG).exists()
                    and _stored_record(workdir) != json.loads(json.dumps(record)))
    state = trainer.init_state(None if init_params is None else init_params())
    return _Start(cfg, trainer, record, state, 0, None, [], [], failed_start)
  check_run_record(workdir)  # an edited run_config.json: refused before anything is read
  check = _ResumeCheck(cfg, record, allow_changes, where=f" {workdir}")
  state, meta = trainer.restore(checkpoints_dir, check_meta=check)
  step = int(meta["step"])
  if check.cfg != cfg:  # the stages carry the run's step changes: the schedule differs
    cfg = check.cfg
    trainer = Trainer(cfg, trainer.mesh, task=task)
    record = {**config_record(cfg), "data": data_identity}
  return _Start(cfg, trainer, record, state, step, meta, check.accepted,
                [s for s in steps if s > step], False)


def _announce(start: _Start, workdir: epath.Path) -> None:
  """Process 0: says how the run starts and writes run_config.json (when the run starts, never
  rewritten once the run has a checkpoint)."""
  if start.meta is not None:
    print(f"resumed from step {start.step} (stage {start.meta['stage']}) in "
          f"{workdir / checkpoint.CHECKPOINTS}")
  if start.accepted:
    print(f"settings changed on resume: {'; '.join(start.accepted)}")
  if start.failed_start:
    print(f"warning: {workdir / RUN_CONFIG} is the record of a run that saved no checkpoint "
          "(a failed start); replaced by this run's settings", file=sys.stderr, flush=True)
  write_run_config(workdir, start.record, replace=start.failed_start)


def _set_aside(checkpoints_dir: epath.Path, damaged: list[int], is_main: bool) -> None:
  """Moves the damaged checkpoints newer than the step resumed from out of the run's (once
  every check of the resume has passed: a refused resume moves nothing), so that the run saves
  those steps again."""
  if is_main:
    moved = checkpoint.set_aside(checkpoints_dir, damaged)
    several = len(moved) > 1
    print(f"warning: moved the damaged checkpoint step{'s' if several else ''} "
          f"{', '.join(map(str, damaged))} out of {checkpoints_dir} to "
          f"{', '.join(map(str, moved))}, as {'they were' if several else 'it was'} (this "
          f"run saves {'them' if several else 'that step'} again)", file=sys.stderr,
          flush=True)
  _sync_processes("longformer_jax: damaged checkpoints set aside")


class _Saver:
  """Checkpoints a step once, only if its state is one the run can go on from (docs/charlm.md,
  "Run integrity"), so the last saved step is the last good one, which a failed step's error
  names. Says "saved step N" (process 0, without a progress bar) once the step is on disk."""

  def __init__(self, writer: checkpoint.TrainCheckpoints, trainer: Trainer,
               record: dict[str, Any], checkpoints_dir: epath.Path, last_saved: int | None, *,
               say_saved: bool):
    self.writer, self._trainer, self._record = writer, trainer, record
    self.checkpoints_dir, self._say_saved = checkpoints_dir, say_saved
    self.last_saved = last_saved  # every saved step passed its health check: the last good one

  def good_checkpoint(self, failed_step: int) -> str:
    if self.last_saved is None:
      return f"No good checkpoint exists yet (none was saved before step {failed_step})."
    return f"The last good checkpoint is step {self.last_saved} in {self.checkpoints_dir}."

  def confirm(self, saved_step: int | None) -> None:
    # A background save is said to be saved when the writer finds it complete (a failed one
    # stops the run with its error instead).
    if saved_step is not None and self._say_saved:
      print(f"saved step {saved_step}", flush=True)

  def check(self) -> None:
    """A background save that failed stops the run now."""
    self.confirm(self.writer.check())

  def save(self, step: int, stage_index: int, state: TrainState, batches, batch
           ) -> bool | None:
    """Saves `step` (once): None if it was saved already, else whether the save is complete
    (False: written in the background, `confirm`ed later)."""
    if self.last_saved == step:
      return None
    health = self._trainer.health(stage_index, state, batch)
    if not (health["finite"] and math.isfinite(health["loss"])
            and math.isfinite(health["grad_norm"])):
      self.writer.wait()
      raise NonFiniteLossError(
          f"the update of step {step} diverged (its parameters give loss {health['loss']:.4g}, "
          f"gradient norm {health['grad_norm']:.4g}"
          f"{'' if health['finite'] else ', non-finite values in the state'}); not saved. "
          f"{self.good_checkpoint(step)} {_RETRY}")
    self.confirm(self.writer.wait())  # the previous save (Orbax would wait for it anyway)
    complete = self.writer.save(step, state.params, state.opt_state, {
        "step": step, "stage": stage_index, "sampler": batches.state(), "run": self._record})
    self.last_saved = step
    return complete


class _MetricsReader:
  """Reads finished steps' metrics on the host late: the host dispatches step t+1 before it
  reads step t's (`read_every` steps at a time, in one device_get), so the device never waits
  for the host between steps. Logs each (metrics.jsonl, progress bar, step_hook) and stops the
  run at the first non-finite loss or gradient norm (`NonFiniteLossError`), before anything of
  it is saved (saves read their step first)."""

  def __init__(self, cfg: TrainConfig, task: Task, saver: _Saver, metrics_log: MetricsLog,
               pbar, step_hook: Callable[[int, dict[str, float]], None] | None, step: int):
    self._cfg, self._task, self._saver, self._log = cfg, task, saver, metrics_log
    self._pbar, self._step_hook = pbar, step_hook
    self._pending: list[tuple[int, int, Any]] = []  # (step, stage index, metrics) not read yet
    self._tick = time.perf_counter()  # the throughput's clock
    self.step, self.loss = step, None  # the last step read and its loss

  def restart_clock(self) -> None:
    """Time from now is training (e.g. after an evaluation, which is not)."""
    self._tick = time.perf_counter()

  def add(self, step: int, stage_index: int, metrics: Any) -> None:
    """A dispatched step; the earlier ones are read first when `read_every` are waiting."""
    if len(self._pending) >= self._cfg.read_every:
      self.read()
    self._pending.append((step, stage_index, metrics))

  def read(self) -> tuple[float, dict[str, float], float]:
    """Reads and logs every waiting step. Returns (the last step's loss, its derived metrics,
    tokens/s over the steps read since the clock's last tick)."""
    read, self._pending, cfg = self._pending, [], self._cfg
    values = jax.device_get([{k: metrics[k] for k in ("loss", "grad_norm", "learning_rate")}
                             for _, _, metrics in read])
    self._saver.check()
    now = time.perf_counter()
    tokens = sum(cfg.stages[i].batch_size * cfg.stages[i].seq_len for _, i, _ in read)
    tokens_per_s = tokens / max(now - self._tick, 1e-9)
    self._tick = now
    for (at_step, stage_index, _), value in zip(read, values):
      loss, grad_norm = float(value["loss"]), float(value["grad_norm"])
      # A finite loss with non-finite gradients would save NaN parameters: stop on either.
      if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        self._saver.writer.wait()
        raise NonFiniteLossError(
            f"loss is {loss} (gradient norm {grad_norm}) at step {at_step} (stage "
            f"{stage_index}, seq_len {cfg.stages[stage_index].seq_len}); stopped without "
            f"saving. {self._saver.good_checkpoint(at_step)} {_RETRY}")
      derived = self._task.train_metrics(loss)
      self.loss, self.step = loss, at_step
      if at_step % cfg.log_every == 0 or at_step == cfg.total_steps:
        self._log.write(at_step, train_loss=loss, **derived, grad_norm=grad_norm,
                        tokens_per_s=tokens_per_s,
                        learning_rate=float(value["learning_rate"]), stage=stage_index)
      if self._pbar is not None:
        self._pbar.update(1)
        self._pbar.set_postfix(stage=stage_index, loss=f"{loss:.3f}",
                               **{k: f"{v:.3f}" for k, v in derived.items()},
                               tok_s=f"{tokens_per_s:,.0f}")
      if self._step_hook is not None:
        self._step_hook(at_step, {"loss": loss, "grad_norm": grad_norm,
                                  "tokens_per_s": tokens_per_s, **derived})
    return loss, derived, tokens_per_s


class _Loop:
  """The stages from the step the run starts at: per step, dispatch, hand the metrics to the
  reader, and at an evaluation, checkpoint or stop, read them, evaluate, save."""

  def __init__(self, start: _Start, task: Task, saver: _Saver, reader: _MetricsReader,
               metrics_log: MetricsLog, pbar, *, log_lines: bool):
    self._cfg, self._trainer, self._task = start.cfg, start.trainer, task
    self._saver, self._reader, self._log, self._pbar = saver, reader, metrics_log, pbar
    self._log_lines = log_lines  # a line per evaluation and checkpoint shows progress in a log
    self.valid: dict[str, float] = {}  # the last validation metrics

  def run(self, start: _Start, preemption: _Preemption) -> str:
    """Trains to the end ("done") or to an agreed stop after SIGTERM ("preempted")."""
    cfg, state, step = self._cfg, start.state, start.step
    for stage_index in range(cfg.stage_at(step), len(cfg.stages)):
      stage = cfg.stages[stage_index]
      stage_start = cfg.stage_starts()[stage_index]
      if step >= stage_start + stage.steps:
        continue
      # Processes holding the same rows (a seq axis across hosts) read the same rows.
      shape = (stage.batch_size, stage.seq_len)
      group, groups = row_group(self._trainer.batch_sharding(shape), shape)
      batches = self._task.batches(cfg, stage_index, process_index=group, process_count=groups)
      if step > stage_start:  # resumed inside this stage: the saved state is this stage's
        batches.load_state(start.meta["sampler"])
      train_step = self._trainer.train_step(stage_index)
      self._reader.restart_clock()
      while step < stage_start + stage.steps:
        batch = self._trainer.global_batch(next(batches), stage.batch_size)
        state, metrics = train_step(state, batch)  # returns at dispatch; the device runs on
        step += 1
        self._reader.add(step, stage_index, metrics)
        due_eval = cfg.eval_every <= cfg.total_steps and (step % cfg.eval_every == 0
                                                          or step == cfg.total_steps)
        due_save = step % cfg.checkpoint_every == 0 or step == stage_start + stage.steps
        stop = preemption.stop_after(step, checkpoint_step=due_save)
        if (due_eval or due_save or stop) and self._step_end(
            step, stage_index, state, batches, batch, due_eval=due_eval, due_save=due_save,
            stop=stop, preemption=preemption):
          return "preempted"
    self._saver.confirm(self._saver.writer.wait())
    return "done"

  def _step_end(self, step: int, stage_index: int, state: TrainState, batches, batch, *,
                due_eval: bool, due_save: bool, stop: bool,
                preemption: _Preemption) -> bool:
    """A step whose state the host needs: its metrics read at once, then the evaluation and
    the checkpoint that are due. Returns whether the run stops (saved) after it."""
    loss, derived, tokens_per_s = self._reader.read()
    stop = stop or preemption.noticed()  # a SIGTERM that came while the host read
    valid = self._evaluate(step, stage_index, state) if due_eval else None
    if stop:
      self._saver.save(step, stage_index, state, batches, batch)
      self._saver.writer.wait()  # the step is on disk before the process reports it and exits
      # Every process says so: its log shows the step it agreed on.
      print(f"\nSIGTERM: saved step {step} in {self._saver.checkpoints_dir}; exiting.",
            flush=True)
      return True
    saved = None
    if due_save:
      saved = self._saver.save(step, stage_index, state, batches, batch)
      if saved is False and step == self._cfg.total_steps:
        saved = self._saver.writer.wait() is not None  # nothing left to overlap the write with
    if self._log_lines and (valid is not None or saved is not None):
      done = [f"step {step}/{self._cfg.total_steps} (stage {stage_index}): loss {loss:.4f}",
              *(f"{k} {v:.4f}" for k, v in {**derived, **(valid or {})}.items()),
              f"{tokens_per_s:,.0f} tokens/s"]
      if saved is not None:
        done.append(f"saved step {step}" if saved else f"saving step {step}")
      print(", ".join(done), flush=True)
    return False

  def _evaluate(self, step: int, stage_index: int, state: TrainState) -> dict[str, float]:
    valid = self._task.evaluate(self._trainer.model(state.params), self._cfg, stage_index,
                                self._trainer.mesh)
    self.valid.update(valid)
    if valid:
      self._log.write(step, **valid)
      if self._pbar is not None:
        self._pbar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in valid.items()))
    self._reader.restart_clock()  # evaluation time is not training throughput
    return valid


def _close(writer, metrics_log: MetricsLog, pbar, logdir: Path, task: Task, is_main: bool
           ) -> None:
  """Closes what the run opened and plots its curves."""
  if pbar is not None:
    pbar.close()
  metrics_log.close()
  if is_main and metrics_log.path.exists():
    # A plot that fails (e.g. on the disk that failed a save) must not hide the run's error.
    try:
      plot_curves(metrics_log.path, logdir / "curves.png", task.plot_keys, task.plot_ylabel)
    except (OSError, DamagedLogError) as e:
      why = e.strerror if isinstance(e, OSError) and e.strerror else e
      print(f"warning: could not write {logdir / 'curves.png'}: {why}", file=sys.stderr)
  writer.close()


def train(cfg: TrainConfig, workdir: str | os.PathLike, task: Task, *,
          mesh: Mesh | None = None, progress: bool = True, logdir: str | os.PathLike | None = None,
          step_hook: Callable[[int, dict[str, float]], None] | None = None,
          allow_changes: Sequence[str] = (),
          init_params: Callable[[], Any] | None = None) -> dict[str, Any]:
  """Runs (or resumes) the staged schedule of `cfg` in `workdir`; returns a summary dict.

  task: what is trained (`longformer_jax.tasks`: e.g. `CharLMTask(train_bytes, valid_bytes)`).
  progress: a progress bar on process 0; False: a line on stdout at every evaluation and every
    checkpoint instead (the step, the losses and metrics, the speed), for logs.
  step_hook(step, metrics): called on every host once a step's metrics are read (after the
    next step is dispatched; tests use it to record losses or to raise SIGTERM, which then
    saves the step running).
  logdir: local directory for metrics.jsonl, tensorboard/ and curves.png (default: the workdir
    when it is local, else runs/<workdir name>: JSONL appends need a local file system).
  allow_changes: dotted names of optimiser/schedule settings that may differ from the run's on
    resume (`training.identity`); the model and the data never may.
  init_params: returns the parameters a new run starts from (`Trainer.init_state`), e.g.
    pretrained weights to fine-tune; called only when the run starts, not on resume. Default:
    initialised from the seed. Name the weights in `task.data_identity`, so that a resume with
    other ones is refused.
  Returns {"status": "done" | "preempted", "step", "last_loss", and the last validation
  metrics, e.g. "valid_bpc"}.
  Raises `identity.RunMismatchError` and `identity.RunFileError` (an edited run_config.json;
  both before anything is written), `NonFiniteLossError`,
  `checkpoint.CheckpointError` (a failed save, no checkpoint that restores, or a damaged one
  that cannot be set aside),
  `metrics.DamagedLogError` (a line of metrics.jsonl other than its last is damaged): one-line
  messages.
  """
  workdir = epath.Path(workdir)
  if logdir is None:
    logdir = Path("runs") / workdir.name if "://" in str(workdir) else Path(workdir)
  logdir = Path(logdir)
  is_main = jax.process_index() == 0
  start = _resume(cfg, workdir, task, Trainer(cfg, mesh, task=task), allow_changes, init_params)
  checkpoints_dir = workdir / checkpoint.CHECKPOINTS
  if is_main:
    _announce(start, workdir)
  metrics_log = MetricsLog(logdir, start.step, enabled=is_main)
  try:
    if start.damaged:
      _set_aside(checkpoints_dir, start.damaged, is_main)
    writer = checkpoint.TrainCheckpoints(checkpoints_dir, keep=start.cfg.keep_checkpoints,
                                         async_save=start.cfg.async_checkpoints)
  except BaseException:
    metrics_log.close()
    raise
  pbar = None
  if progress and is_main:
    from tqdm import tqdm
    pbar = tqdm(total=start.cfg.total_steps, initial=start.step, unit="step", dynamic_ncols=True)
  saver = _Saver(writer, start.trainer, start.record, checkpoints_dir,
                 None if start.meta is None else start.step, say_saved=is_main and pbar is None)
  reader = _MetricsReader(start.cfg, task, saver, metrics_log, pbar, step_hook, start.step)
  loop = _Loop(start, task, saver, reader, metrics_log, pbar, log_lines=is_main and pbar is None)
  try:
    with _Preemption() as preemption:
      status = loop.run(start, preemption)
    return {"status": status, "step": reader.step, "last_loss": reader.loss, **loop.valid}
  finally:
    _close(writer, metrics_log, pbar, logdir, task, is_main)
