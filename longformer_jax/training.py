"""Staged, mesh-sharded training of `LongformerForCausalLM` with exact Orbax resume.

The loop in one paragraph (`train`):
  1. Mesh (data, fsdp) from the config; parameter shardings from the model's logical axis names
     and `TrainConfig.logical_rules`; the batch is split over both axes.
  2. Resume order: the latest checkpoint under `<workdir>/checkpoints` gives the train state
     (float32 params, optimizer state, step) restored straight into its shardings, and the
     metadata (stage, the stage's sampler state). Without one, parameters are initialised
     already sharded (jit with out_shardings), never materialised on one device.
  3. For each stage from the current one: a sampler over the train split (seed + stage index),
     moved to the stage-local step; one jit-compiled step per stage (sequence length and windows
     are static shapes); the state is donated.
  4. Every step: the loss reaches the host (progress bar, JSONL, TensorBoard); a non-finite
     loss stops the run *before* anything is saved (`NonFiniteLossError`), so the last
     checkpoint stays the last good one. Checkpoints every `checkpoint_every` steps, at stage
     ends and at the end, asynchronously; SIGTERM (a preempted TPU VM) saves and returns.

Everything random is a function of (seed, step): initialisation, the sampler's batches and the
dropout keys (`fold_in(seed, step)`), so a resumed run computes bit-identical losses.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from etils import epath
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from longformer_jax.causal_lm import CharLMConfig, LongformerForCausalLM, next_byte_nll

log = logging.getLogger(__name__)

# Logical axis -> mesh axes. FSDP shards the `embed` dimension of every matrix (each device
# holds 1/fsdp of the weights and optimizer moments; XLA all-gathers them per layer); the batch
# is split over both axes, so an fsdp group also divides the data.
LOGICAL_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("vocab", None),
    ("heads", None),
    ("mlp", None),
    ("norm", None),
)


class NonFiniteLossError(RuntimeError):
  """The loss became NaN or inf; nothing was saved after the last good checkpoint."""


@dataclasses.dataclass(frozen=True)
class Stage:
  """One phase of the staged schedule.

  seq_len: tokens per training sequence; batch_size: sequences per optimizer step (global);
  steps: optimizer steps in this stage; learning_rate: peak (and constant) rate of the stage;
  end_learning_rate: if set, cosine decay from learning_rate to it over the stage;
  warmup_steps: linear warm-up from 0 at the start of the stage;
  windows: per-layer one-sided windows for this stage (None: the model config's).
  """
  seq_len: int
  batch_size: int
  steps: int
  learning_rate: float
  end_learning_rate: float | None = None
  warmup_steps: int = 0
  windows: tuple[int, ...] | None = None

  def __post_init__(self):
    for name in ("seq_len", "batch_size", "steps"):
      if getattr(self, name) < 1:
        raise ValueError(f"Stage.{name} must be >= 1, got {getattr(self, name)}")
    if self.learning_rate <= 0:
      raise ValueError(f"Stage.learning_rate must be > 0, got {self.learning_rate}")
    if not 0 <= self.warmup_steps <= self.steps:
      raise ValueError(f"Stage.warmup_steps must be in [0, steps={self.steps}], "
                       f"got {self.warmup_steps}")

  def schedule(self) -> optax.Schedule:
    peak = self.learning_rate
    if self.end_learning_rate is None:
      decay = optax.constant_schedule(peak)
    else:
      decay = optax.cosine_decay_schedule(
          peak, max(self.steps - self.warmup_steps, 1), alpha=self.end_learning_rate / peak)
    if not self.warmup_steps:
      return decay
    warmup = optax.linear_schedule(0.0, peak, self.warmup_steps)
    return optax.join_schedules([warmup, decay], [self.warmup_steps])


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything `train` needs. Config files in train/configs/ build one with `get_config()`.

  mesh_shape: (data, fsdp) device counts; -1 takes the devices left over.
  microbatch_size: sequences per gradient-accumulation step (global); None: no accumulation.
  eval_tokens: valid-split bytes scored (non-overlapping windows of the stage's seq_len) at
    each evaluation; None: the whole split.
  final_eval: keyword arguments of `evaluate_bpc` for the test-split evaluation that
    `train/charlm.py` runs after training (None: skip).
  """
  model: CharLMConfig
  stages: tuple[Stage, ...]
  dataset: str = "enwik8"
  data_dir: str | None = None
  seed: int = 0
  weight_decay: float = 0.01
  clip_norm: float = 1.0
  adam_b1: float = 0.9
  adam_b2: float = 0.98
  adam_eps: float = 1e-8
  microbatch_size: int | None = None
  mesh_shape: tuple[int, int] = (-1, 1)
  logical_rules: tuple[tuple[str, Any], ...] = LOGICAL_RULES
  log_every: int = 1
  eval_every: int = 500
  eval_tokens: int | None = 65_536
  eval_batch_size: int = 8
  checkpoint_every: int = 1000
  keep_checkpoints: int = 2
  async_checkpoints: bool = True
  final_eval: dict[str, Any] | None = None

  def __post_init__(self):
    if not self.stages:
      raise ValueError("TrainConfig.stages is empty: give at least one Stage")
    for i, stage in enumerate(self.stages):
      if stage.windows is not None and len(stage.windows) != self.model.num_layers:
        raise ValueError(f"stages[{i}].windows has {len(stage.windows)} entries for a "
                         f"{self.model.num_layers}-layer model: {stage.windows}")
      if self.microbatch_size is not None and stage.batch_size % self.microbatch_size:
        raise ValueError(f"stages[{i}].batch_size={stage.batch_size} is not a multiple of "
                         f"microbatch_size={self.microbatch_size}")
    if len(self.mesh_shape) != 2 or any(d == 0 or d < -1 for d in self.mesh_shape):
      raise ValueError(f"mesh_shape must be (data, fsdp) with positive sizes or -1, "
                       f"got {self.mesh_shape}")
    for name in ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints"):
      if getattr(self, name) < 1:
        raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")

  @property
  def total_steps(self) -> int:
    return sum(s.steps for s in self.stages)

  def stage_starts(self) -> list[int]:
    return [sum(s.steps for s in self.stages[:i]) for i in range(len(self.stages))]

  def stage_at(self, step: int) -> int:
    """Index of the stage that runs global step `step` (the last stage past the end)."""
    for i, start in enumerate(self.stage_starts()):
      if step < start + self.stages[i].steps:
        return i
    return len(self.stages) - 1

  def stage_windows(self, i: int) -> tuple[int, ...]:
    return self.stages[i].windows or self.model.windows


# Paper Appendix B, Table 12, "#Steps per phase (small)" and "(large)". The appendix says each
# count is where that phase's validation BPC stopped improving, not a fixed budget.
PAPER_STEPS_SMALL = (430_000, 50_000, 50_000, 35_000, 5_000)
PAPER_STEPS_LARGE = (350_000, 25_000, 10_000, 5_000, 5_000)


def paper_stages(model: CharLMConfig, *, first_seq_len: int = 2048, last_seq_len: int = 23_040,
                 first_lr: float = 2.5e-4, batch_sizes: Sequence[int] = (32, 32, 16, 16, 16),
                 steps: Sequence[int] | None = None, warmup_fraction: float = 0.1,
                 max_warmup_steps: int = 10_000) -> tuple[Stage, ...]:
  """The paper's 5 phases (paper §4.2 and Appendix B, Table 12).

  §4.2: each phase doubles the window sizes and the sequence length and halves the learning
  rate, from 2,048 tokens to 23,040 in phase 5 (Table 12: "gpu memory limit", so the doubling
  is capped there). Table 12: phase-1 LR 0.00025 (phase 5: 0.000015625 = 2.5e-4 / 2**4), batch
  sizes 32, 32, 16, 16, 16, steps `PAPER_STEPS_SMALL` or, for a 30-layer model,
  `PAPER_STEPS_LARGE` (when `steps` is None), warm-up "10% of the phase steps with maximum 10K
  steps", LR constant within each phase. Table 12 does not say whether phases 2-5 warm up too;
  "of the phase steps" is read here as every phase (10K, 5K, 5K, 3.5K, 500 steps for small).

  Windows start at the model config's (32 -> 512 bottom to top for char_small/large, as in
  §4.2.2 and Table 4) and reach 512 -> 8,192 in phase 5. Table 12 itself prints "32 (bottom
  layer) - 8,192 (top layer)" for phase 1 and leaves phase 5's top value blank; 8,192 is the
  phase-5 top under the doubling rule (and larger than the 2,048-token phase-1 sequence), so
  that row is taken as misplaced. Phases 2-4 lengths/windows are not listed; they follow §4.2.
  """
  if steps is None:
    steps = PAPER_STEPS_LARGE if model.num_layers == 30 else PAPER_STEPS_SMALL
  if len(batch_sizes) != len(steps):
    raise ValueError(f"batch_sizes {tuple(batch_sizes)} and steps {tuple(steps)} differ in length")
  stages = []
  for i, (batch, n) in enumerate(zip(batch_sizes, steps)):
    seq = min(first_seq_len * 2**i, last_seq_len)
    stages.append(Stage(
        seq_len=seq, batch_size=batch, steps=n, learning_rate=first_lr / 2**i,
        warmup_steps=min(int(warmup_fraction * n), max_warmup_steps),
        windows=tuple(min(w * 2**i, seq) for w in model.windows)))
  return tuple(stages)


# ----------------------------------------------------------------------------------------------
# Train state, shardings, the step.


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  step: jax.Array       # int32 scalar: optimizer steps taken
  params: Any           # nnx.State of float32 master weights
  opt_state: Any


def make_mesh(mesh_shape: tuple[int, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  data, fsdp = mesh_shape
  if data == -1 and fsdp == -1:
    raise ValueError(f"at most one mesh dimension may be -1, got {mesh_shape}")
  if data == -1:
    data = len(devices) // fsdp
  if fsdp == -1:
    fsdp = len(devices) // data
  if data * fsdp != len(devices):
    raise ValueError(f"mesh_shape {mesh_shape} -> (data={data}, fsdp={fsdp}) does not use the "
                     f"{len(devices)} devices")
  return Mesh(np.array(devices).reshape(data, fsdp), ("data", "fsdp"))


def logical_to_mesh(spec: P, rules: Sequence[tuple[str, Any]]) -> P:
  table = dict(rules)
  for name in spec:
    if name is not None and name not in table:
      raise ValueError(f"logical axis {name!r} has no rule in {tuple(table)}")
  return P(*(None if name is None else table[name] for name in spec))


def param_shardings(abstract_params, mesh: Mesh, rules) -> Any:
  """NamedShardings (same tree as the params) from the logical axis annotations."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, logical_to_mesh(spec, rules)),
                      nnx.get_partition_spec(abstract_params))


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
  """The whole run's schedule: each stage's, joined at the stage boundaries."""
  return optax.join_schedules([s.schedule() for s in cfg.stages], cfg.stage_starts()[1:])


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  schedule = learning_rate_schedule(cfg)
  # Weight decay on matrices and embeddings only: decaying LayerNorm gains and biases toward 0
  # only hurts.
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(cfg.clip_norm),
      optax.adamw(schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                  weight_decay=cfg.weight_decay, mask=decay_mask))


class Trainer:
  """The pieces `train` assembles, usable on their own (tests, notebooks): mesh, shardings,
  initial state, one jitted step per stage."""

  def __init__(self, cfg: TrainConfig, mesh: Mesh | None = None):
    self.cfg = cfg
    self.mesh = mesh if mesh is not None else make_mesh(cfg.mesh_shape)
    fsdp = self.mesh.shape["fsdp"]
    if cfg.model.hidden % fsdp:
      raise ValueError(f"hidden={cfg.model.hidden} is not divisible by the fsdp axis ({fsdp})")
    self.optimizer = make_optimizer(cfg)
    abstract_model = nnx.eval_shape(lambda: LongformerForCausalLM(cfg.model, rngs=nnx.Rngs(0)))
    self.graphdef, abstract_params = nnx.split(abstract_model)
    self.param_shardings = param_shardings(abstract_params, self.mesh, cfg.logical_rules)
    replicated = NamedSharding(self.mesh, P())
    abstract_opt = jax.eval_shape(self.optimizer.init, abstract_params)
    # Optimizer moments mirror the parameters (and are sharded like them); counts replicate.
    opt_shardings = optax.tree_map_params(
        self.optimizer, lambda _, s: s, abstract_opt, self.param_shardings,
        transform_non_params=lambda _: replicated)
    self.state_shardings = TrainState(step=replicated, params=self.param_shardings,
                                      opt_state=opt_shardings)
    self.batch_sharding = NamedSharding(
        self.mesh, P(logical_to_mesh(P("batch"), cfg.logical_rules)[0], None))
    self._steps = {}

  def abstract_state(self) -> TrainState:
    """ShapeDtypeStructs with shardings: the restore target of a checkpoint."""
    shapes = jax.eval_shape(self._init)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, self.state_shardings)

  def _init(self) -> TrainState:
    model = LongformerForCausalLM(self.cfg.model, rngs=nnx.Rngs(self.cfg.seed))
    params = nnx.state(model)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=self.optimizer.init(params))

  def init_state(self) -> TrainState:
    return jax.jit(self._init, out_shardings=self.state_shardings)()

  def model(self, params) -> LongformerForCausalLM:
    return nnx.merge(self.graphdef, params)

  def loss(self, params, inputs_BxL, targets_BxL, windows, dropout_key) -> jax.Array:
    logits_BxLxV = self.model(params)(inputs_BxL, windows=windows, dropout_key=dropout_key)
    return jnp.mean(next_byte_nll(logits_BxLxV, targets_BxL))

  def _train_step(self, state: TrainState, inputs_BxL, targets_BxL, *, windows, accum):
    step_key = jax.random.fold_in(jax.random.key(self.cfg.seed), state.step)
    grad_fn = jax.value_and_grad(self.loss)
    if accum == 1:
      loss, grads = grad_fn(state.params, inputs_BxL, targets_BxL, windows, step_key)
    else:
      batch, seq = inputs_BxL.shape
      # Microbatch m takes rows m, m + accum, ...: every device keeps its own rows (the batch is
      # sharded in contiguous blocks), so no data moves between devices.
      def split(x):
        x_MxBxL = x.reshape(batch // accum, accum, seq).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(
            x_MxBxL, NamedSharding(self.mesh, P(None, *self.batch_sharding.spec)))

      def body(carry, xs):
        loss_sum, grad_sum = carry
        m, inputs, targets = xs
        loss, grads = grad_fn(state.params, inputs, targets, windows,
                              jax.random.fold_in(step_key, m))
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

      zeros = jax.tree.map(jnp.zeros_like, state.params)
      (loss, grads), _ = jax.lax.scan(
          body, (jnp.zeros((), jnp.float32), zeros),
          (jnp.arange(accum), split(inputs_BxL), split(targets_BxL)))
      loss = loss / accum
      grads = jax.tree.map(lambda g: g / accum, grads)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": _global_norm(grads),
               "learning_rate": learning_rate_schedule(self.cfg)(state.step)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  def train_step(self, stage_index: int) -> Callable:
    """The jitted step of a stage: (state, inputs, targets) -> (state, metrics); donates state."""
    if stage_index not in self._steps:
      stage = self.cfg.stages[stage_index]
      accum = 1 if self.cfg.microbatch_size is None else (
          stage.batch_size // self.cfg.microbatch_size)
      fn = lambda state, x, y: self._train_step(
          state, x, y, windows=self.cfg.stage_windows(stage_index), accum=accum)
      replicated = NamedSharding(self.mesh, P())
      self._steps[stage_index] = jax.jit(
          fn, in_shardings=(self.state_shardings, self.batch_sharding, self.batch_sharding),
          out_shardings=(self.state_shardings, replicated), donate_argnums=0)
    return self._steps[stage_index]

  def global_batch(self, local_BxL: np.ndarray, global_batch: int) -> jax.Array:
    return jax.make_array_from_process_local_data(
        self.batch_sharding, local_BxL, (global_batch, local_BxL.shape[1]))


# ----------------------------------------------------------------------------------------------
# Metrics.


def _atomic_write(path, write: Callable[[Any], None]) -> None:
  """Write to a temporary sibling, then rename over `path` (readers never see half a file)."""
  path = epath.Path(path)
  tmp = path.parent / f".{path.name}.tmp{os.getpid()}"
  write(tmp)
  tmp.replace(path)


class MetricsLog:
  """JSONL (always), TensorBoard (when tensorboardX is installed); process 0 only writes.

  On resume, records after the restored step are dropped first: the resumed run logs them
  again, and the curves show each step once.
  """

  def __init__(self, workdir: Path, resume_step: int, enabled: bool = True):
    self.enabled = enabled
    self.path = workdir / "metrics.jsonl"
    self._tb = None
    if not enabled:
      return
    workdir.mkdir(parents=True, exist_ok=True)
    if self.path.exists():
      kept = [line for line in self.path.read_text().splitlines()
              if line.strip() and json.loads(line).get("step", 0) <= resume_step]
      _atomic_write(self.path, lambda p: p.write_text("".join(f"{l}\n" for l in kept)))
    self._file = open(self.path, "a", encoding="utf-8")
    try:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb = SummaryWriter(str(workdir / "tensorboard"))
    except ImportError:
      print("note: tensorboardX is not installed; TensorBoard logs skipped "
            "(pip install tensorboardX); metrics.jsonl has everything.")

  def write(self, step: int, **scalars: float) -> None:
    if not self.enabled:
      return
    record = {"step": step, **{k: float(v) for k, v in scalars.items()}}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in scalars.items():
        self._tb.add_scalar(k, float(v), step)

  def close(self) -> None:
    if not self.enabled:
      return
    self._file.close()
    if self._tb is not None:
      self._tb.close()


def plot_curves(metrics_path: Path, png_path: Path) -> None:
  """Train and valid BPC against step, written atomically."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  records = [json.loads(l) for l in metrics_path.read_text().splitlines() if l.strip()]
  fig, ax = plt.subplots(figsize=(7, 4))
  for key, label in (("train_bpc", "train"), ("valid_bpc", "valid")):
    pts = [(r["step"], r[key]) for r in records if key in r]
    if pts:
      ax.plot(*zip(*pts), label=label, marker="o" if key == "valid_bpc" else None,
              linewidth=1 if key == "train_bpc" else 2)
  ax.set_xlabel("step")
  ax.set_ylabel("bits per character")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=120)
  _atomic_write(png_path, lambda p: p.write_bytes(buffer.getvalue()))
  plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Checkpoints.


def checkpoint_manager(directory, cfg: TrainConfig):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  options = ocp.CheckpointManagerOptions(
      max_to_keep=cfg.keep_checkpoints, create=True,
      enable_async_checkpointing=cfg.async_checkpoints)
  directory = epath.Path(directory)
  if not _is_remote(directory):
    directory = directory.absolute()  # Orbax wants absolute paths
  return ocp.CheckpointManager(directory, options=options)


def _is_remote(path) -> bool:
  return "://" in str(path)


def save_checkpoint(manager, state: TrainState, meta: dict) -> None:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  step = int(meta["step"])
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)


def restore_checkpoint(manager, abstract_state: TrainState, step: int | None = None):
  """(state, meta) of `step` (default: the latest), straight into the target's shardings."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  step = manager.latest_step() if step is None else step
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
  return restored["state"], restored["meta"]


def load_params(directory: str | os.PathLike, cfg: TrainConfig, step: int | None = None,
                mesh: Mesh | None = None) -> LongformerForCausalLM:
  """The model of a checkpoint (default: the latest) under `<workdir>/checkpoints`."""
  directory = epath.Path(directory)
  if (directory / "checkpoints").is_dir():
    directory = directory / "checkpoints"
  trainer = Trainer(cfg, mesh)
  manager = checkpoint_manager(directory, dataclasses.replace(cfg, async_checkpoints=False))
  if manager.latest_step() is None:
    raise FileNotFoundError(f"no checkpoint under {directory}")
  state, _ = restore_checkpoint(manager, trainer.abstract_state(), step)
  manager.close()
  return trainer.model(state.params)


def _tuples(x):
  if isinstance(x, list):
    return tuple(_tuples(v) for v in x)
  if isinstance(x, dict):
    return {k: _tuples(v) for k, v in x.items()}
  return x


def write_run_config(workdir, cfg: TrainConfig) -> None:
  """<workdir>/run_config.json: what eval/bpc.py needs to rebuild the model of a checkpoint."""
  record = dataclasses.asdict(cfg)
  record["final_windows"] = list(cfg.stage_windows(len(cfg.stages) - 1))
  workdir.mkdir(parents=True, exist_ok=True)
  _atomic_write(workdir / "run_config.json",
                lambda p: p.write_text(json.dumps(record, indent=2) + "\n"))


def read_run_config(workdir: str | os.PathLike) -> tuple[TrainConfig, tuple[int, ...]]:
  """(TrainConfig, final-stage windows) from <workdir>/run_config.json."""
  path = epath.Path(workdir) / "run_config.json"
  if not path.exists():
    raise FileNotFoundError(f"{path} not found: is {workdir} a train/charlm.py workdir?")
  record = json.loads(path.read_text())
  windows = tuple(record.pop("final_windows"))
  final_eval = record.pop("final_eval")
  record = _tuples(record)
  record["model"] = CharLMConfig(**record["model"])
  record["stages"] = tuple(Stage(**s) for s in record["stages"])
  return TrainConfig(**record, final_eval=final_eval), windows


# ----------------------------------------------------------------------------------------------
# The loop.


def maybe_initialize_distributed(mode: str = "auto") -> None:
  """`jax.distributed.initialize()` before any device use: "on" (every host of a multi-host TPU
  slice runs the same command; JAX finds its peers from the TPU metadata), "off", or "auto":
  on when the environment names a cluster (several TPU workers, a coordinator address, or a
  multi-task SLURM job)."""
  if mode not in ("auto", "on", "off"):
    raise ValueError(f"distributed mode must be 'auto', 'on' or 'off', got {mode!r}")
  if mode == "auto":
    mode = "on" if ("," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
                    or os.environ.get("JAX_COORDINATOR_ADDRESS")
                    or int(os.environ.get("SLURM_NTASKS", "1")) > 1) else "off"
  if mode == "on":
    jax.distributed.initialize()


class _Preemption:
  """Turns SIGTERM into a flag checked between steps (the default action would kill the process
  in the middle of an async checkpoint)."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handler)
    except ValueError:  # not the main thread: nothing to install
      self._previous = None
    return self

  def _handler(self, signum, frame):
    del signum, frame
    self.requested = True

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def _load_data(cfg: TrainConfig, split: str) -> np.ndarray:
  from longformer_jax.data import load_split  # pylint: disable=g-import-not-at-top
  return load_split(cfg.dataset, split, cfg.data_dir)


def train(cfg: TrainConfig, workdir: str | os.PathLike, *,
          train_data: np.ndarray | None = None, valid_data: np.ndarray | None = None,
          mesh: Mesh | None = None, progress: bool = True, logdir: str | os.PathLike | None = None,
          step_hook: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, Any]:
  """Runs (or resumes) the staged schedule of `cfg` in `workdir`; returns a summary dict.

  train_data / valid_data: byte arrays (default: `cfg.dataset`'s train and validation splits).
  step_hook(step, metrics): called on every host after each step (tests use it to record losses
    or to raise SIGTERM).
  logdir: local directory for metrics.jsonl, tensorboard/ and curves.png (default: the workdir
    when it is local, else runs/<workdir name>: JSONL appends need a local file system).
  Returns {"status": "done" | "preempted", "step", "last_loss", "valid_bpc", ...}.
  """
  from longformer_jax.data import BatchSampler  # pylint: disable=g-import-not-at-top

  workdir = epath.Path(workdir)
  if logdir is None:
    logdir = Path("runs") / workdir.name if _is_remote(workdir) else Path(workdir)
  logdir = Path(logdir)
  is_main = jax.process_index() == 0
  trainer = Trainer(cfg, mesh)
  train_data = _load_data(cfg, "train") if train_data is None else np.asarray(train_data)
  if valid_data is None and cfg.eval_every <= cfg.total_steps:
    valid_data = _load_data(cfg, "validation")
  if valid_data is not None and cfg.eval_tokens is not None:
    valid_data = np.asarray(valid_data)[:cfg.eval_tokens + 1]

  manager = checkpoint_manager(workdir / "checkpoints", cfg)
  if manager.latest_step() is not None:
    state, meta = restore_checkpoint(manager, trainer.abstract_state())
    step = int(meta["step"])
    sampler_state = meta["sampler"]
    if is_main:
      print(f"resumed from step {step} (stage {meta['stage']}) in {workdir / 'checkpoints'}")
  else:
    state, step, sampler_state = trainer.init_state(), 0, None
  metrics_log = MetricsLog(logdir, step, enabled=is_main)
  if is_main:
    write_run_config(workdir, cfg)
  summary = {"status": "done", "step": step, "last_loss": None, "valid_bpc": None}

  def meta_for(stage_index, sampler):
    return {"step": step, "stage": stage_index, "sampler": sampler.state(),
            "dataset": cfg.dataset}

  def checkpoint(stage_index, sampler):
    if manager.latest_step() != step:
      save_checkpoint(manager, state, meta_for(stage_index, sampler))

  pbar = None
  if progress and is_main:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    pbar = tqdm(total=cfg.total_steps, initial=step, unit="step", dynamic_ncols=True)

  try:
    with _Preemption() as preemption:
      for stage_index in range(cfg.stage_at(step), len(cfg.stages)):
        stage = cfg.stages[stage_index]
        stage_start = cfg.stage_starts()[stage_index]
        if step >= stage_start + stage.steps:
          continue
        sampler = BatchSampler(
            train_data, seq_len=stage.seq_len, global_batch_size=stage.batch_size,
            seed=cfg.seed + stage_index, process_index=jax.process_index(),
            process_count=jax.process_count())
        if sampler_state is not None and step > stage_start:
          sampler.load_state(sampler_state)
        else:
          sampler.step = step - stage_start
        train_step = trainer.train_step(stage_index)
        tokens_per_step = stage.batch_size * stage.seq_len
        tick = time.perf_counter()
        while step < stage_start + stage.steps:
          inputs, targets = next(sampler)
          state, metrics = train_step(
              state, trainer.global_batch(inputs, stage.batch_size),
              trainer.global_batch(targets, stage.batch_size))
          loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
          # A finite loss with non-finite gradients would save NaN parameters: stop on either.
          if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            manager.wait_until_finished()
            raise NonFiniteLossError(
                f"loss is {loss} (gradient norm {grad_norm}) at step {step + 1} (stage {stage_index}, seq_len "
                f"{stage.seq_len}); stopped without saving. The last good checkpoint is step "
                f"{manager.latest_step()} in {workdir / 'checkpoints'}: lower the learning rate "
                f"or raise warm-up and resume from it.")
          step += 1
          now = time.perf_counter()
          tokens_per_s = tokens_per_step / max(now - tick, 1e-9)
          tick = now
          host = {"loss": loss, "bpc": loss / math.log(2),
                  "grad_norm": grad_norm, "tokens_per_s": tokens_per_s}
          summary["last_loss"] = loss
          if step % cfg.log_every == 0 or step == cfg.total_steps:
            metrics_log.write(step, train_loss=loss, train_bpc=host["bpc"],
                              grad_norm=host["grad_norm"], tokens_per_s=tokens_per_s,
                              learning_rate=float(metrics["learning_rate"]), stage=stage_index)
          if pbar is not None:
            pbar.update(1)
            pbar.set_postfix(stage=stage_index, loss=f"{loss:.3f}", bpc=f"{host['bpc']:.3f}",
                             tok_s=f"{tokens_per_s:,.0f}")
          if step_hook is not None:
            step_hook(step, host)
          if valid_data is not None and (step % cfg.eval_every == 0
                                         or step == cfg.total_steps):
            summary["valid_bpc"] = _valid_bpc(trainer, state, cfg, stage_index, valid_data)
            metrics_log.write(step, valid_bpc=summary["valid_bpc"])
            if pbar is not None:
              pbar.write(f"step {step}: valid bpc {summary['valid_bpc']:.4f}")
            tick = time.perf_counter()  # evaluation time is not training throughput
          summary["step"] = step
          if preemption.requested or _preempted_elsewhere(manager, step):
            checkpoint(stage_index, sampler)
            summary["status"] = "preempted"
            if is_main:
              print(f"\nSIGTERM: saved step {step} in {workdir / 'checkpoints'}; exiting.")
            return summary
          if step % cfg.checkpoint_every == 0 or step == stage_start + stage.steps:
            checkpoint(stage_index, sampler)
      return summary
  finally:
    if pbar is not None:
      pbar.close()
    manager.wait_until_finished()
    manager.close()
    metrics_log.close()
    if is_main and metrics_log.path.exists():
      plot_curves(metrics_log.path, logdir / "curves.png")


def _preempted_elsewhere(manager, step: int) -> bool:
  # On a multi-host slice the hosts must agree on the step at which to save; JAX's preemption
  # sync service (started by jax.distributed.initialize) tells every host the same step.
  if jax.process_count() == 1:
    return False
  return bool(manager.reached_preemption(step))


def _valid_bpc(trainer: Trainer, state: TrainState, cfg: TrainConfig, stage_index: int,
               data: np.ndarray) -> float:
  from longformer_jax.evaluation import evaluate_bpc  # pylint: disable=g-import-not-at-top
  stage = cfg.stages[stage_index]
  return evaluate_bpc(trainer.model(state.params), data, context=stage.seq_len,
                      stride=stage.seq_len, batch_size=cfg.eval_batch_size, protocol="chunks",
                      windows=cfg.stage_windows(stage_index), mesh=trainer.mesh)


def _global_norm(tree) -> jax.Array:
  # optax.tree.norm from optax 0.2.5 on; optax.global_norm (deprecated) before it.
  tree_lib = getattr(optax, "tree", None)
  if tree_lib is not None and hasattr(tree_lib, "norm"):
    return tree_lib.norm(tree)
  return optax.global_norm(tree)
