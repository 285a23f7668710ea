"""Orbax save/restore of a model of this package: its parameters plus what rebuilds it.

A checkpoint directory holds `params/` (an Orbax checkpoint of the `nnx.Param` state) and
`model.json` (the model and config classes and the config's fields). No pickle anywhere.

The protocol, which any model in `longformer_jax` can meet (the training code reuses it):
  * the model has a `config` attribute, a dataclass with `to_dict()`/`from_dict()` (or plain
    JSON-able fields, rebuilt by `ConfigClass(**fields)`);
  * it is built as `ModelClass(config, rngs=nnx.Rngs(seed), **model.init_kwargs)`, where the optional
    `init_kwargs` attribute holds the other constructor arguments as JSON values.
Only classes inside the `longformer_jax` package are imported when loading.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

_FORMAT_VERSION = 1
_PACKAGE = "longformer_jax"


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
  path = os.path.abspath(os.fspath(path))
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
  if os.path.exists(path) and not force:
    raise FileExistsError(f"{path} exists; pass force=True to replace it")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.join(path, "params"), nnx.state(model, nnx.Param), force=force)
  checkpointer.wait_until_finished()
  # model.json is written last: a directory that has it holds a complete checkpoint.
  with open(os.path.join(path, "model.json"), "w") as f:
    f.write(meta_json)


def load_model(path: str | os.PathLike, *, seed: int = 0) -> nnx.Module:
  """The model saved at `path`, with its parameters restored (no initialisation compute).

  seed: seeds the model's non-parameter state (dropout streams).
  """
  path = os.path.abspath(os.fspath(path))
  meta_file = os.path.join(path, "model.json")
  if not os.path.isfile(meta_file):
    raise FileNotFoundError(f"{path} is not a model checkpoint (no model.json)")
  with open(meta_file) as f:
    meta = json.load(f)
  if meta.get("format_version") != _FORMAT_VERSION:
    raise ValueError(f"{meta_file}: format_version={meta.get('format_version')!r}, this code "
                     f"reads {_FORMAT_VERSION}")
  model_class = _import_class(meta["model_class"])
  config = _config_from_dict(_import_class(meta["config_class"]), meta["config"])
  kwargs = meta["init_kwargs"]

  def build():
    return model_class(config, rngs=nnx.Rngs(seed), **kwargs)

  graphdef, abstract_params, _ = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
  params = ocp.StandardCheckpointer().restore(os.path.join(path, "params"), abstract_params)
  # The other state (RNG streams) is tiny; under jit the unused parameter initialisers are
  # dead code, so building it costs no initialisation compute.
  rest = jax.jit(lambda: nnx.split(build(), nnx.Param, ...)[2])()
  return nnx.merge(graphdef, params, rest)
