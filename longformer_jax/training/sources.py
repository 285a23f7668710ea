"""Where the weights of a run come from: any model directory, whatever wrote it, opened the one
way every entry point does (`train.mlm`, `train.finetune`, `train.seq2seq`: `load_source`,
`ModelSource`, with the presets of `MODEL_PRESETS`), and the checksum
that names those weights in a run's identity (a resume from other weights is refused).

    kind, model = sources.open_model_dir(path, {"longformer": convert.from_hf}, workdir_class)
    identity = {"kind": kind, "params_sha256": sources.params_fingerprint(host_params)}
    source = sources.load_source(spec, LongformerConfig, preset_config, hf, workdir_class)

Nothing is downloaded: an HF model is a local directory (`save_pretrained`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from longformer_jax.io import links_root, read_json_object
from longformer_jax.training.config import TrainConfig

__all__ = ["MODEL_PRESETS", "ModelSource", "host_params", "load_source", "open_model_dir",
           "params_fingerprint"]

# The model presets a `--model` may name instead of a directory: fresh weights of a config
# family's `tiny`, `base` or `large` shape.
MODEL_PRESETS = ("tiny", "base", "large")


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """A model to start a run from: its config, its weights (a pure dict of host arrays in its own
  class's structure; None for a preset, initialised from the run's seed), the name of that class
  (None for a preset), and the JSON identity of both (`kind`, and the weights' checksum: a
  resume from other weights is refused)."""
  config: Any
  params: dict[str, Any] | None
  model_class: str | None
  identity: dict[str, Any]


def load_source(spec: str, config_class: type, preset: Callable[[str], Any],
                hf: Mapping[str, Callable[[str], nnx.Module]],
                workdir_class: Callable[[dict[str, Any], TrainConfig], type[nnx.Module]],
                accept: Callable[[nnx.Module], bool] | None = None,
                expected: str | None = None) -> ModelSource:
  """The model named by `spec`: a preset of `MODEL_PRESETS` (`preset(name)` gives its config;
  fresh weights), else a directory (`open_model_dir` with `hf` and `workdir_class`) whose model
  has a `config_class` config and passes `accept` (default: any). Raises FileNotFoundError /
  ValueError naming what is wrong (`expected`: what the model should be, for the message)."""
  if spec in MODEL_PRESETS and not os.path.exists(spec):
    return ModelSource(preset(spec), None, None, {"kind": "preset", "preset": spec})
  if not os.path.isdir(spec):
    raise FileNotFoundError(f"--model {spec!r} is neither a preset {MODEL_PRESETS} nor a "
                            f"directory")
  kind, model = open_model_dir(spec, hf, workdir_class)
  if (not isinstance(getattr(model, "config", None), config_class)
      or (accept is not None and not accept(model))):
    raise ValueError(f"{spec} holds a {type(model).__name__}; expected "
                     f"{expected or 'a model of a ' + config_class.__name__}")
  params = host_params(model)
  identity = {"kind": kind, "params_sha256": params_fingerprint(params)}
  return ModelSource(model.config, params, type(model).__name__, identity)


def open_model_dir(spec: str | os.PathLike, hf: Mapping[str, Callable[[str], nnx.Module]],
                   workdir_class: Callable[[dict[str, Any], TrainConfig], type[nnx.Module]]
                   ) -> tuple[str, nnx.Module]:
  """(kind, model) of a model directory (nothing is downloaded):

    "hf_<type>"   an HF directory (config.json): `hf[model_type](spec)`
    "checkpoint"  a project model checkpoint (model.json): `checkpoint.load_model`
    "workdir"     a training workdir (run_config.json): its newest checkpoint that verifies, in
                  the class `workdir_class(run record, TrainConfig)` names (which raises
                  ValueError for a run of another model family)

  Raises FileNotFoundError / ValueError naming the directory and what it holds.
  """
  from longformer_jax import checkpoint
  from longformer_jax.training.config import config_from_record, read_run_record
  spec = os.fspath(spec)
  if not os.path.isdir(spec):
    raise FileNotFoundError(f"{spec} is not a model directory: no such directory")
  if os.path.lexists(os.path.join(spec, "config.json")):  # a FIFO is refused, not skipped
    model_type = read_json_object(os.path.join(spec, "config.json"),
                                  links_root(spec)).get("model_type")
    if not isinstance(model_type, str) or model_type not in hf:
      raise ValueError(f"{spec}/config.json has model_type={model_type!r}; expected one of "
                       f"{sorted(hf)}")
    return f"hf_{model_type}", hf[model_type](spec)
  if os.path.lexists(os.path.join(spec, checkpoint.MODEL_JSON)):
    return "checkpoint", checkpoint.load_model(spec)
  if os.path.lexists(os.path.join(spec, "run_config.json")):
    record = read_run_record(spec)
    cfg = config_from_record(record, f"{spec}/run_config.json")
    model_class = workdir_class(record, cfg)
    return "workdir", checkpoint.restore_model(
        lambda: model_class(cfg.model, rngs=nnx.Rngs(0)), spec)
  raise FileNotFoundError(f"{spec} holds no config.json (HF), {checkpoint.MODEL_JSON} "
                          f"(project model checkpoint) or run_config.json (training workdir)")


def host_params(model: nnx.Module) -> dict[str, Any]:
  """The model's parameters as a pure dict of host numpy arrays."""
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def params_fingerprint(params: Any) -> str:
  """SHA-256 of parameters (a pure dict or an nnx.State; host or device arrays): every array's
  path, dtype, shape and bytes, computed on the host (about 1 GB/s; nothing is compiled)."""
  if isinstance(params, nnx.State):
    params = nnx.to_pure_dict(params)
  digest = hashlib.sha256()
  for path, x in sorted((jax.tree_util.keystr(p), x)
                        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]):
    x = np.ascontiguousarray(x)
    digest.update(f"{path} {x.dtype} {x.shape}\n".encode())
    digest.update(x.tobytes())
  return digest.hexdigest()
