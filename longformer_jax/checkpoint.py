"""Orbax checkpoints, the only module that reads or writes them: models and train states.

Model checkpoints (`save_model` / `load_model`): a directory with `params/` (an Orbax checkpoint
of the `nnx.Param` state) and `model.json` (the model and config classes and the config's
fields). No pickle anywhere. Any model in `longformer_jax` can be saved this way:
  * the model has a `config` attribute, a dataclass with `to_dict()`/`from_dict()` (or plain
    JSON-able fields, rebuilt by `ConfigClass(**fields)`);
  * it is built as `ModelClass(config, rngs=nnx.Rngs(seed), **model.init_kwargs)`, where the
    optional `init_kwargs` attribute holds the other constructor arguments as JSON values.
Only classes inside the `longformer_jax` package are imported when loading.

Train-state checkpoints (`checkpoint_manager`, `save_train_state`, `restore_train_state`): an
Orbax `CheckpointManager` directory (`<workdir>/checkpoints`) with one directory per step,
holding three items: `params/` (the same `nnx.Param` state as a model checkpoint's), `opt_state/`
(the optimizer state) and `meta/` (JSON: step, stage, data position, ...).

`load_params` reads the parameters of either kind, and only them: of a train-state checkpoint it
asks Orbax for the `params` item alone, so the optimizer state (twice the parameters' size with
Adam) is never read; evaluation needs nothing else.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from longformer_jax.io import atomic_write

_FORMAT_VERSION = 1
_PACKAGE = "longformer_jax"
MODEL_JSON = "model.json"
CHECKPOINTS = "checkpoints"  # the train-state checkpoints' directory inside a workdir


def _orbax_path(path: str | os.PathLike) -> epath.Path:
  """`path` as Orbax wants it: absolute when local; gs:// and other remote paths as they are."""
  path = epath.Path(path)
  return path if "://" in str(path) else path.absolute()


# ----------------------------------------------------------------------------------------------
# Models: parameters + model.json.


def _class_path(cls: type) -> str:
  return f"{cls.__module__}:{cls.__qualname__}"


def _import_class(path: str) -> type:
  module, _, name = path.partition(":")
  if module != _PACKAGE and not module.startswith(_PACKAGE + "."):
    raise ValueError(f"checkpoint names class {path!r}, outside the {_PACKAGE} package")
  obj = importlib.import_module(module)
  for part in name.split("."):
    obj = getattr(obj, part)
  return obj


def _config_to_dict(config) -> dict:
  if hasattr(config, "to_dict"):
    return config.to_dict()
  if dataclasses.is_dataclass(config):
    return dataclasses.asdict(config)
  raise TypeError(f"model.config must be a dataclass or have to_dict(); got {type(config)}")


def _config_from_dict(config_class: type, fields: dict):
  if hasattr(config_class, "from_dict"):
    return config_class.from_dict(fields)
  return config_class(**fields)


def save_model(path: str | os.PathLike, model: nnx.Module, *, force: bool = False) -> None:
  """Writes `model`'s parameters and config to the directory `path`.

  force=True replaces an existing checkpoint there; otherwise an existing one is an error.
  """
  path = _orbax_path(path)
  if not hasattr(model, "config"):
    raise TypeError(f"{type(model).__name__} has no `config` attribute; save_model needs one")
  meta = {
      "format_version": _FORMAT_VERSION,
      "model_class": _class_path(type(model)),
      "config_class": _class_path(type(model.config)),
      "config": _config_to_dict(model.config),
      "init_kwargs": dict(getattr(model, "init_kwargs", {})),
  }
  meta_json = json.dumps(meta, indent=2)  # fail on non-JSON fields before writing anything
  if path.exists() and not force:
    raise FileExistsError(f"{path} exists; pass force=True to replace it")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path / "params", nnx.state(model, nnx.Param), force=force)
  checkpointer.wait_until_finished()
  # model.json is written last: a directory that has it holds a complete checkpoint.
  atomic_write(path / MODEL_JSON, meta_json)


def load_model(path: str | os.PathLike, *, seed: int = 0) -> nnx.Module:
  """The model saved at `path`, with its parameters restored (no initialisation compute).

  seed: seeds the model's non-parameter state (dropout streams).
  """
  meta_file = _orbax_path(path) / MODEL_JSON
  if not meta_file.exists():
    raise FileNotFoundError(f"{path} is not a model checkpoint (no {MODEL_JSON})")
  meta = json.loads(meta_file.read_text())
  if meta.get("format_version") != _FORMAT_VERSION:
    raise ValueError(f"{meta_file}: format_version={meta.get('format_version')!r}, this code "
                     f"reads {_FORMAT_VERSION}")
  model_class = _import_class(meta["model_class"])
  config = _config_from_dict(_import_class(meta["config_class"]), meta["config"])
  kwargs = meta["init_kwargs"]
  return restore_model(lambda: model_class(config, rngs=nnx.Rngs(seed), **kwargs), path)


def restore_model(build: Callable[[], nnx.Module], path: str | os.PathLike, *,
                  step: int | None = None, shardings: Callable[[Any], Any] | None = None
                  ) -> nnx.Module:
  """`build()`'s model with the parameters of `path` (anything `load_params` reads).

  Nothing is initialised: the model is built abstractly (`nnx.eval_shape`) and its parameters
  come straight from the checkpoint. shardings: a function of the abstract parameters giving
  their shardings (e.g. `training.param_shardings` over a mesh); default: the default device.
  """
  graphdef, abstract_params, _ = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
  if shardings is not None:
    abstract_params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract_params, shardings(abstract_params))
  params = load_params(path, abstract_params, step=step)
  # The other state (RNG streams) is tiny; under jit the unused parameter initialisers are
  # dead code, so building it costs no initialisation compute.
  rest = jax.jit(lambda: nnx.split(build(), nnx.Param, ...)[2])()
  return nnx.merge(graphdef, params, rest)


def load_params(path: str | os.PathLike, abstract_params: Any, *, step: int | None = None):
  """The parameters (an `nnx.State` like `abstract_params`) saved under `path`, and only them.

  path: a model checkpoint (`save_model`), a train-state checkpoint directory (`<workdir>/
    checkpoints`), or a training workdir holding one; step: of a train-state checkpoint
    (default: the latest).
  abstract_params: the target: arrays or ShapeDtypeStructs, whose shardings (if any) the
    parameters are restored into.
  Either way only the `params` item is opened: the optimizer state of a train-state checkpoint
  is neither read nor needed (a checkpoint whose `opt_state/` is gone still loads).
  """
  path = _orbax_path(path)
  if (path / MODEL_JSON).exists():
    if step is not None:
      raise ValueError(f"{path} is a model checkpoint, which has no steps; got step={step}")
    params_dir = path / "params"
  else:
    directory = _checkpoints_dir(path)
    params_dir = directory / str(_existing_step(directory, step)) / "params"
  return ocp.StandardCheckpointer().restore(params_dir, abstract_params)


def latest_step(path: str | os.PathLike) -> int | None:
  """The latest step of the train-state checkpoints under `path` (a workdir or its
  checkpoints/ directory); None if there are none."""
  return max(_steps(_checkpoints_dir(_orbax_path(path))), default=None)


def _checkpoints_dir(path: epath.Path) -> epath.Path:
  return path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path


def _steps(directory: epath.Path) -> list[int]:
  """The finished (committed) steps of a checkpoints directory."""
  return ocp.path.step.checkpoint_steps(directory) if directory.is_dir() else []


def _existing_step(directory: epath.Path, step: int | None) -> int:
  steps = _steps(directory)
  if not steps:
    raise FileNotFoundError(f"no checkpoint under {directory}")
  step = max(steps) if step is None else step
  if step not in steps:
    raise FileNotFoundError(f"no checkpoint of step {step} under {directory}; "
                            f"steps: {sorted(steps)}")
  return step


# ----------------------------------------------------------------------------------------------
# Train states: params + opt_state + meta per step.


def checkpoint_manager(directory: str | os.PathLike, *, max_to_keep: int | None = None,
                       async_save: bool = False) -> ocp.CheckpointManager:
  """The train-state checkpoints in `directory` (a workdir's `checkpoints/`; created if
  missing), keeping the latest `max_to_keep` (None: all)."""
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save)
  return ocp.CheckpointManager(_orbax_path(directory), options=options)


def save_train_state(manager: ocp.CheckpointManager, step: int, params: Any, opt_state: Any,
                     meta: dict[str, Any]) -> None:
  """Saves step `step` (asynchronously if the manager is): params, optimizer state, JSON meta."""
  manager.save(step, args=ocp.args.Composite(
      params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
      meta=ocp.args.JsonSave(meta)), force=True)


def restore_train_state(manager: ocp.CheckpointManager, abstract_params: Any,
                        abstract_opt_state: Any, step: int | None = None
                        ) -> tuple[Any, Any, dict[str, Any]]:
  """(params, opt_state, meta) of `step` (default: the latest), straight into the targets'
  shardings."""
  step = _existing_step(epath.Path(manager.directory), step)
  restored = manager.restore(step, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(abstract_params),
      opt_state=ocp.args.StandardRestore(abstract_opt_state), meta=ocp.args.JsonRestore()))
  return restored["params"], restored["opt_state"], restored["meta"]
