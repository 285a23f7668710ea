"""What a training run is: `Stage`s of a schedule, the `TrainConfig`, the paper's char-LM stages,
and the run config JSON (`<workdir>/run_config.json`) that rebuilds the config from a workdir."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
from collections.abc import Sequence
from typing import Any

from etils import epath

from longformer_jax import checkpoint
from longformer_jax import config as model_configs
from longformer_jax.config import CharLMConfig, check_windows
from longformer_jax.io import atomic_write, read_json, read_json_object
from longformer_jax.training.sharding import LOGICAL_RULES, check_mesh_shape


@dataclasses.dataclass(frozen=True)
class Stage:
  """One phase of the staged schedule.

  seq_len: tokens per training sequence; batch_size: sequences per optimizer step (global);
  steps: optimizer steps in this stage; learning_rate: peak (and constant) rate of the stage;
  end_learning_rate: if set, cosine decay from learning_rate to it over the stage;
  warmup_steps: linear warm-up from 0 at the start of the stage;
  windows: per-layer one-sided attention windows for this stage (None: the model config's);
  decay_power: with end_learning_rate, a polynomial decay of this power after the warm-up
    instead of the cosine: end + (peak - end) * (1 - t)^power, t from 0 to 1 over the rest of
    the stage (the Longformer MLM schedule is power 3, paper §5).
  step_changes: kept by the training loop, not set by hand: one (step, steps) pair for each
    resume that changed `steps` after the stage had started, oldest first (the stage-local step
    it resumed at, and the stage's steps until then). The steps already taken keep their rates;
    the decay goes on from the last of them (`schedule.stage_schedule`).
  """
  seq_len: int
  batch_size: int
  steps: int
  learning_rate: float
  end_learning_rate: float | None = None
  warmup_steps: int = 0
  windows: tuple[int, ...] | None = None
  decay_power: float | None = None
  step_changes: tuple[tuple[int, int], ...] = ()

  def __post_init__(self):
    for name in ("seq_len", "batch_size", "steps"):
      _check_int(self, name, minimum=1)
    _check_int(self, "warmup_steps")
    _check_real(self, "learning_rate", above=0)
    if self.end_learning_rate is not None:
      _check_real(self, "end_learning_rate", minimum=0)
    if self.decay_power is not None:
      _check_real(self, "decay_power", above=0)
      if self.end_learning_rate is None:
        raise ValueError(f"Stage.decay_power={self.decay_power} needs end_learning_rate (the "
                         f"rate it decays to)")
    if not 0 <= self.warmup_steps <= self.steps:
      raise ValueError(f"Stage.warmup_steps must be in [0, steps={self.steps}], "
                       f"got {self.warmup_steps}")
    if self.windows is not None:
      object.__setattr__(self, "windows", check_windows(self.windows, len(self.windows)))
    changes = self.step_changes
    if not (isinstance(changes, tuple) and all(
        isinstance(c, tuple) and len(c) == 2 and all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1 for v in c)
        for c in changes)):
      raise ValueError(f"Stage.step_changes must be (step, steps) pairs of ints >= 1, got "
                       f"{changes!r}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything `train` needs. Config files in train/configs/ build one with `get_config()`.

  model: the model's config (any config class of `longformer_jax.config`; the task checks that
    it is one it can train, e.g. `CharLMConfig` for the char LM).
  mesh_shape: (data, fsdp) or (data, fsdp, seq) device counts (seq: how many pieces each
    sequence is split into; 1 when omitted); one of them may be -1: the devices left over.
  microbatch_size: sequences per gradient-accumulation step (global); None: no accumulation.
  eval_tokens: validation tokens scored at each evaluation; None: the whole split.
  read_every: the host reads the finished steps' metrics (loss, gradient norm) in groups of this
    many steps, while the next step runs; 1: step t's while step t+1 runs. More lets the host
    queue more steps where dispatch is slow (a TPU pod); a non-finite loss then stops the run up
    to this many steps later, still before anything of it is saved. Evaluated, checkpointed and
    interrupted steps are read at once.
  trainable: a regular expression naming the parameters that train (searched for in each
    parameter's path, e.g. "longformer/embeddings/position_embeddings/embedding"; see
    `schedule.param_path`); the others are frozen: no updates, no optimizer state. None: all
    train.
  final_eval: keyword arguments of the evaluation that the entry point runs after training
    (`Task.final_evaluation`, e.g. `tasks.charlm.evaluate_run`'s plus `split`); None: skip it.
  """
  model: Any
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
  mesh_shape: tuple[int, ...] = (-1, 1)
  logical_rules: tuple[tuple[str, Any], ...] = LOGICAL_RULES
  log_every: int = 1
  read_every: int = 1
  eval_every: int = 500
  eval_tokens: int | None = 65_536
  eval_batch_size: int = 8
  checkpoint_every: int = 1000
  keep_checkpoints: int = 2
  async_checkpoints: bool = True
  final_eval: dict[str, Any] | None = None
  trainable: str | None = None

  def __post_init__(self):
    if not self.stages:
      raise ValueError("TrainConfig.stages is empty: give at least one Stage")
    for i, stage in enumerate(self.stages):
      if not isinstance(stage, Stage):
        raise TypeError(f"TrainConfig.stages[{i}] must be a Stage, got {stage!r}")
    if not isinstance(self.dataset, str):
      raise TypeError(f"TrainConfig.dataset must be a str, got {self.dataset!r}")
    _check_int(self, "seed", minimum=0)  # the batch sampler's seeds are non-negative
    for name in ("log_every", "read_every", "eval_every", "checkpoint_every", "keep_checkpoints",
                 "eval_batch_size"):
      _check_int(self, name, minimum=1)
    for name in ("microbatch_size", "eval_tokens"):  # None: no accumulation / the whole split
      if getattr(self, name) is not None:
        _check_int(self, name, minimum=1)
    _check_real(self, "weight_decay", minimum=0)
    _check_real(self, "clip_norm", above=0)
    for name in ("adam_b1", "adam_b2"):
      _check_real(self, name, minimum=0, below=1)
    _check_real(self, "adam_eps", above=0)
    if not isinstance(self.async_checkpoints, bool):
      raise TypeError(f"TrainConfig.async_checkpoints must be a bool, got "
                      f"{self.async_checkpoints!r}")
    for i, stage in enumerate(self.stages):
      if self.microbatch_size is not None and stage.batch_size % self.microbatch_size:
        raise ValueError(f"stages[{i}].batch_size={stage.batch_size} is not a multiple of "
                         f"microbatch_size={self.microbatch_size}")
    object.__setattr__(self, "mesh_shape", check_mesh_shape(self.mesh_shape))
    _check_pattern(self, "trainable")

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
    """The per-layer windows of stage `i` (-1: the last): its own, else the model config's."""
    return self.stages[i].windows or self.model.layer_windows


def final_eval_settings(cfg: TrainConfig, known: Sequence[str]) -> dict[str, Any]:
  """`cfg.final_eval` as a dict ({} for None), for a task's `check`: TypeError unless it is a
  dict, ValueError naming the settings outside `known` (those the task's final evaluation
  takes)."""
  settings = cfg.final_eval
  if settings is None:
    return {}
  if not isinstance(settings, dict):
    raise TypeError(f"final_eval must be a dict of settings or None, got {settings!r}")
  unknown = sorted(set(settings) - set(known))
  if unknown:
    raise ValueError(f"final_eval has unknown settings {unknown}; known: {list(known)}")
  return dict(settings)


def check_int(name: str, value: Any, *, minimum: int | None = None) -> None:
  """TypeError naming `name` unless `value` is an int (NumPy's too; a bool or an integral float
  is not), ValueError unless it is >= `minimum`."""
  if not isinstance(value, numbers.Integral) or isinstance(value, bool):
    raise TypeError(f"{name} must be an int, got {value!r}")
  if minimum is not None and value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


def _check_int(cfg, name: str, *, minimum: int | None = None) -> None:
  """`check_int` of `cfg.<name>`, named `<class>.<name>`."""
  check_int(f"{type(cfg).__name__}.{name}", getattr(cfg, name), minimum=minimum)


def _check_pattern(cfg, name: str) -> None:
  """Raises unless `cfg.<name>` is None or a non-empty string that compiles as a regular
  expression."""
  value = getattr(cfg, name)
  where = f"{type(cfg).__name__}.{name}"
  if value is None:
    return
  if not isinstance(value, str):
    raise TypeError(f"{where} must be a regular expression (str) or None, got {value!r}")
  if not value:
    raise ValueError(f"{where} is empty: give a pattern, or None to train every parameter")
  try:
    re.compile(value)
  except re.error as e:
    raise ValueError(f"{where}={value!r} is not a regular expression: {e}") from None


def _check_real(cfg, name: str, *, minimum: float | None = None, above: float | None = None,
                below: float | None = None) -> None:
  """Raises unless `cfg.<name>` is a finite real number (not a bool) in the given bounds
  (`minimum` inclusive, `above` and `below` exclusive)."""
  value = getattr(cfg, name)
  where = f"{type(cfg).__name__}.{name}"
  if not isinstance(value, numbers.Real) or isinstance(value, bool):
    raise TypeError(f"{where} must be a real number, got {value!r}")
  if not math.isfinite(value):
    raise ValueError(f"{where} must be finite, got {value!r}")
  bounds = []
  if minimum is not None:
    bounds.append((value >= minimum, f">= {minimum}"))
  if above is not None:
    bounds.append((value > above, f"> {above}"))
  if below is not None:
    bounds.append((value < below, f"< {below}"))
  if not all(ok for ok, _ in bounds):
    raise ValueError(f"{where} must be {' and '.join(text for _, text in bounds)}, "
                     f"got {value!r}")


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

  Windows start at the model config's (32 -> 512 bottom to top for CharLMConfig.small/large, as
  in §4.2.2 and Table 4) and reach 512 -> 8,192 in phase 5. Table 12 itself prints "32 (bottom
  layer) - 8,192 (top layer)" for phase 1 and leaves phase 5's top value blank; 8,192 is the
  phase-5 top under the doubling rule (and larger than the 2,048-token phase-1 sequence), so
  that row is taken as misplaced. Phases 2-4 lengths/windows are not listed; they follow §4.2.
  """
  if steps is None:
    steps = PAPER_STEPS_LARGE if model.num_hidden_layers == 30 else PAPER_STEPS_SMALL
  if len(batch_sizes) != len(steps):
    raise ValueError(f"batch_sizes {tuple(batch_sizes)} and steps {tuple(steps)} differ in length")
  stages = []
  for i, (batch, n) in enumerate(zip(batch_sizes, steps)):
    seq = min(first_seq_len * 2**i, last_seq_len)
    stages.append(Stage(
        seq_len=seq, batch_size=batch, steps=n, learning_rate=first_lr / 2**i,
        warmup_steps=min(int(warmup_fraction * n), max_warmup_steps),
        windows=tuple(min(w * 2**i, seq) for w in model.layer_windows)))
  return tuple(stages)


# ----------------------------------------------------------------------------------------------
# <workdir>/run_config.json

RUN_CONFIG = "run_config.json"


def config_record(cfg: TrainConfig) -> dict[str, Any]:
  """`cfg` as JSON values: the model config by `to_dict()` plus the name of its class in
  `longformer_jax.config` (`model_config_class`), stages as dicts. `config_from_record`
  inverts it; run_config.json and every checkpoint's meta hold one."""
  record = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
  record["model_config_class"] = type(cfg.model).__name__
  record["model"] = cfg.model.to_dict()
  record["stages"] = [dataclasses.asdict(s) for s in cfg.stages]
  return json.loads(json.dumps(record))  # tuples as lists: what a JSON file gives back


# The model config classes a run record may name (`model_config_class`); nothing else is
# looked up from a record.
RECORD_CONFIG_CLASSES = {cls.__name__: cls for cls in (
    model_configs.LongformerConfig, model_configs.CharLMConfig, model_configs.LEDConfig)}


def config_from_record(record: dict[str, Any], where: str = "run record") -> TrainConfig:
  """The `TrainConfig` of a `config_record` (other keys, e.g. the data fingerprint, ignored).

  The record is data from a file: its model config class must be one of
  `RECORD_CONFIG_CLASSES`, and every field is checked by type and range (the configs' and
  `Stage`'s own checks) before anything is built from it; ValueError naming `where` and the
  field otherwise."""
  if not isinstance(record, dict):
    raise ValueError(f"{where}: a run record must be a JSON object, got "
                     f"{type(record).__name__}")
  record = dict(record)
  record.pop("data", None)
  for name in ("model_config_class", "model", "final_eval", "stages"):
    if name not in record:
      raise ValueError(f"{where}: not a run record (no {name!r})")
  name = record.pop("model_config_class")
  config_class = RECORD_CONFIG_CLASSES.get(name) if isinstance(name, str) else None
  if config_class is None:
    raise ValueError(f"{where}: model_config_class={name!r} is not one of "
                     f"{sorted(RECORD_CONFIG_CLASSES)}")
  try:
    model = config_class.from_dict(record.pop("model"))
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where}: model: {e}") from None
  final_eval = record.pop("final_eval")
  if final_eval is not None and not (isinstance(final_eval, dict)
                                     and all(isinstance(k, str) for k in final_eval)):
    raise ValueError(f"{where}: final_eval must be a JSON object or null, got {final_eval!r}")
  stages = record.get("stages")
  if not (isinstance(stages, list) and all(isinstance(s, dict) for s in stages)):
    raise ValueError(f"{where}: stages must be a list of JSON objects, got {stages!r}")
  known = {f.name for f in dataclasses.fields(TrainConfig)} - {"model", "final_eval"}
  unknown = sorted(set(record) - known)
  if unknown:
    raise ValueError(f"{where}: unknown fields {unknown}")
  record = _tuples(record)
  try:
    record["stages"] = tuple(_stage_from_dict(s) for s in record["stages"])
    return TrainConfig(model=model, final_eval=final_eval, **record)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where}: {e}") from None


def _stage_from_dict(fields: dict[str, Any]) -> Stage:
  unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(Stage)})
  if unknown:
    raise ValueError(f"unknown Stage fields {unknown}")
  return Stage(**fields)


def write_run_config(workdir: str | os.PathLike, cfg: TrainConfig | dict[str, Any], *,
                     replace: bool = False) -> bool:
  """Writes <workdir>/run_config.json (`config_record(cfg)`, or a record given as a dict) unless
  it exists: a run's stored settings are written once, when it starts, and never rewritten
  (`training.identity`). replace: write it even so (`train` replaces the record of a failed
  start, a run that saved no checkpoint). Returns whether it wrote the file."""
  record = cfg if isinstance(cfg, dict) else config_record(cfg)
  workdir = epath.Path(workdir)
  if (workdir / RUN_CONFIG).exists() and not replace:
    return False
  workdir.mkdir(parents=True, exist_ok=True)
  atomic_write(workdir / RUN_CONFIG, json.dumps(record, indent=2) + "\n")
  return True


def run_started(workdir: str | os.PathLike) -> bool:
  """Whether the run in `workdir` has started: it has a checkpoint. From then on its
  run_config.json, and what a command keeps beside it (the MLM tokenizer), are the run's; before
  that they are a failed start's, which the next start replaces."""
  return bool(checkpoint.checkpoint_steps(epath.Path(workdir) / checkpoint.CHECKPOINTS))


def keep_run_file(workdir: str | os.PathLike, name: str, data: bytes | str) -> None:
  """Writes <workdir>/<name>, a file the run keeps beside its record (e.g. its tokenizer, whose
  SHA-256 the record holds), unless the run has started: from its first checkpoint on the file
  is the run's and stays as it is (a failed start's is replaced). Process 0 writes."""
  import jax
  if run_started(workdir) or jax.process_index() != 0:
    return
  workdir = epath.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  atomic_write(workdir / name, data)


def sealed_run_record(workdir: str | os.PathLike) -> tuple[int, dict[str, Any]] | None:
  """(step, run record) of the newest checkpoint of the run in `workdir` whose meta reads and
  matches its SHA-256 (`checkpoint.read_meta`); None when there is none."""
  directory = epath.Path(workdir) / checkpoint.CHECKPOINTS
  for step in reversed(checkpoint.checkpoint_steps(directory)):
    try:
      return step, checkpoint.read_meta(directory, step)["run"]
    except checkpoint.DamagedCheckpointError:
      continue  # the restore that follows reports it
  return None


def check_run_record(workdir: str | os.PathLike,
                     record: dict[str, Any] | None = None) -> None:
  """Raises `identity.RunFileError` when <workdir>/run_config.json (or `record`, its contents)
  differs in what fixes the run from the record sealed into the run's newest checkpoint
  (`identity.check_record_file`): the file is written once, when the run starts, and what
  rebuilds the run's model from it (evaluation, a resume, `--model WORKDIR`) must not take
  edited settings. Nothing to check before the first checkpoint, or without the file."""
  from longformer_jax.training import identity
  path = epath.Path(workdir) / RUN_CONFIG
  sealed = sealed_run_record(workdir) if path.exists() or record is not None else None
  if sealed is not None:
    identity.check_record_file(read_json(path) if record is None else record, sealed[1],
                               path=str(path), step=sealed[0])


def read_run_record(workdir: str | os.PathLike) -> dict[str, Any]:
  """The JSON record of <workdir>/run_config.json (FileNotFoundError naming it if missing),
  checked against the run's checkpoints (`check_run_record`)."""
  path = epath.Path(workdir) / RUN_CONFIG
  if not path.exists():
    raise FileNotFoundError(f"{path} not found: is {workdir} a training workdir?")
  record = read_json_object(path, None if "://" in str(path) else workdir)
  check_run_record(workdir, record)
  return record


def started_record(workdir: str | os.PathLike) -> dict[str, Any] | None:
  """The record of the run in `workdir` (`read_run_record`) if the run has started (it has a
  checkpoint and its run_config.json); None for a new workdir or a failed start."""
  if not (run_started(workdir) and (epath.Path(workdir) / RUN_CONFIG).exists()):
    return None
  return read_run_record(workdir)


def read_run_config(workdir: str | os.PathLike) -> TrainConfig:
  """The `TrainConfig` of <workdir>/run_config.json (written by `train` when the run started)."""
  return config_from_record(read_run_record(workdir),
                            str(epath.Path(workdir) / RUN_CONFIG))


def _tuples(x):
  """JSON lists back to the tuples the frozen configs hold."""
  if isinstance(x, list):
    return tuple(_tuples(v) for v in x)
  if isinstance(x, dict):
    return {k: _tuples(v) for k, v in x.items()}
  return x
