"""Conversion between HF transformers checkpoints and the models of this package.

  from_hf(source)               HF Longformer or LED (model object, local directory or HF Hub
                                id) -> our NNX model; `Class.from_pretrained` runs it
  to_hf(model)                  our NNX model -> HF PyTorch model of the same class
  hf_state_dict(model)          our NNX model -> its weights by HF name, in HF's shapes
  save_pretrained(model, dir)   our NNX model -> an HF checkpoint directory, no torch
                                (`model.save_pretrained(dir)` runs it)
  config_to_hf_dict(config)     our config -> the `config.json` dict HF reads
  roberta_to_longformer(source) HF RoBERTa -> our Longformer, by the paper's recipe
                                (docs/design.md §5.3)
  bart_to_led(source)           HF BART -> our LED, by the paper's recipe (paper §6)
  extend_vocabulary(model, n)   a copy of our model with n new token ids (marker tokens), the
                                new embedding rows drawn from the table's statistics

A directory holds `config.json` and `model.safetensors` (or its sharded index) or
`pytorch_model.bin`; `save_pretrained` writes the first two. Reading and writing
safetensors needs only the `safetensors` package; torch is needed for `.bin` files, model objects
and `to_hf`. A string that is not a local directory is an HF Hub id, fetched (safetensors files
only, unless the repo has none and torch is installed) with `huggingface_hub.snapshot_download`
into the HF cache, so `HF_HUB_CACHE` and `HF_HUB_OFFLINE` apply. The HF total `attention_window`
becomes the one-sided window here, and back (the only place where the two meet).

Each HF model type is a `_Family`: our classes, the prefix of the backbone in task models, the
tied weights, the weight names and the config mapping. Everything else (reading, checking,
loading, writing back) is one code path for all of them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import operator
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longformer_jax import led, modeling
from longformer_jax.config import MAX_LAYERS, MAX_POSITIONS, LEDConfig, LongformerConfig
from longformer_jax import pretrained
from longformer_jax.io import (
    atomic_write, inside, links_root, open_regular, read_json_object, regular_file)
from longformer_jax.modeling import LongformerModel

# HF LongformerConfig defaults, for config.json files that leave fields out.
_HF_DEFAULTS = dict(
    vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
    intermediate_size=3072, hidden_act="gelu", hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1, max_position_embeddings=512, type_vocab_size=2,
    initializer_range=0.02, layer_norm_eps=1e-12, pad_token_id=1, bos_token_id=0,
    eos_token_id=2, sep_token_id=2, attention_window=512)
# HF LEDConfig defaults, likewise; also every LEDConfig field HF has.
_HF_LED_DEFAULTS = dict(
    vocab_size=50265, d_model=1024, encoder_layers=12, decoder_layers=12,
    encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=4096,
    decoder_ffn_dim=4096, max_encoder_position_embeddings=16384,
    max_decoder_position_embeddings=1024, activation_function="gelu", dropout=0.1,
    attention_dropout=0.0, activation_dropout=0.0, init_std=0.02, pad_token_id=1,
    bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, attention_window=512)

# Buffers that some (older) checkpoints save next to the weights; they hold no learned values.
_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")

Path = tuple[str | int, ...]
# The HF names of a `LongformerLayer`'s parts, in Longformer and in LED (encoder) checkpoints.
_LONGFORMER_LAYER = dict(
    attention="attention.self", attention_output="attention.output.dense",
    attention_norm="attention.output.LayerNorm", intermediate="intermediate.dense",
    output="output.dense", output_norm="output.LayerNorm")
_LED_ENCODER_LAYER = dict(
    attention="self_attn.longformer_self_attn", attention_output="self_attn.output",
    attention_norm="self_attn_layer_norm", intermediate="fc1", output="fc2",
    output_norm="final_layer_norm")


@dataclasses.dataclass(frozen=True)
class _Family:
  """How the checkpoints of one HF model type map onto our classes."""
  model_type: str
  classes: dict[str, type]  # ours, by name: HF's class of the same name is the counterpart
  base: type  # the backbone class, which HF saves without `prefix`
  prefix: str  # the backbone's attribute in the task models, with the dot
  backbone: tuple[str, ...]  # name starts of the weights every task model shares
  base_only: tuple[str, ...]  # name starts of the base model's own head parts (saved unprefixed)
  tied: dict[str, str]  # HF names (task-model form) of copies -> the weight they copy
  param_names: Callable[[nnx.Module], dict[str, Path]]  # HF weight name -> our parameter path
  config_from_hf: Callable[..., Any]
  infer_architecture: Callable[[dict[str, np.ndarray]], str]
  zero_if_missing: tuple[str, ...] = ()  # buffers HF fills with zeros when a checkpoint lacks them
  unsqueezed: tuple[str, ...] = ()  # weights HF stores with a leading axis of 1 ([1, V] for [V])


# ----------------------------------------------------------------------------------------------
# Names: HF weight name -> path of our parameter.


def _linear(names: dict[str, Path], hf: str, ours: Path) -> None:
  names[f"{hf}.weight"], names[f"{hf}.bias"] = ours + ("kernel",), ours + ("bias",)


def _norm(names: dict[str, Path], hf: str, ours: Path) -> None:
  names[f"{hf}.weight"], names[f"{hf}.bias"] = ours + ("scale",), ours + ("bias",)


def _longformer_layer_names(names: dict[str, Path], hf_parts: dict[str, str], hf: str,
                            ours: Path) -> None:
  """The weights of one `LongformerLayer` (ours) whose parts HF calls `hf_parts` under `hf`."""
  for proj in ("query", "key", "value", "query_global", "key_global", "value_global"):
    _linear(names, f"{hf}.{hf_parts['attention']}.{proj}", ours + ("attention", proj))
  _linear(names, f"{hf}.{hf_parts['attention_output']}", ours + ("attention", "output"))
  for part in ("intermediate", "output"):
    _linear(names, f"{hf}.{hf_parts[part]}", ours + (part,))
  for part in ("attention_norm", "output_norm"):
    _norm(names, f"{hf}.{hf_parts[part]}", ours + (part,))


def _longformer_param_names(model: nnx.Module) -> dict[str, Path]:
  """Every HF weight name of a Longformer model (tied copies excluded) and our parameter path."""
  config, names = model.config, {}
  linear, norm = functools.partial(_linear, names), functools.partial(_norm, names)
  is_base = isinstance(model, LongformerModel)
  hf_pre, our_pre = ("", ()) if is_base else ("longformer.", ("longformer",))
  for table in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
    names[f"{hf_pre}embeddings.{table}.weight"] = our_pre + ("embeddings", table, "embedding")
  norm(f"{hf_pre}embeddings.LayerNorm", our_pre + ("embeddings", "layer_norm"))
  for i in range(config.num_hidden_layers):
    _longformer_layer_names(names, _LONGFORMER_LAYER, f"{hf_pre}encoder.layer.{i}",
                            our_pre + ("layers", i))
  if _has_pooler(model):
    linear(f"{hf_pre}pooler.dense", our_pre + ("pooler",))
  head = type(model).__name__
  if head == "LongformerForMaskedLM":
    linear("lm_head.dense", ("lm_head", "dense"))
    norm("lm_head.layer_norm", ("lm_head", "layer_norm"))
    names["lm_head.bias"] = ("lm_head", "bias")
  elif head == "LongformerForSequenceClassification":
    linear("classifier.dense", ("classifier", "dense"))
    linear("classifier.out_proj", ("classifier", "out_proj"))
  elif head == "LongformerForQuestionAnswering":
    linear("qa_outputs", ("qa_outputs",))
  elif head in ("LongformerForTokenClassification", "LongformerForMultipleChoice"):
    linear("classifier", ("classifier",))
  return names


def _led_param_names(model: nnx.Module) -> dict[str, Path]:
  """Every HF weight name of an LED model (tied copies excluded) and our parameter path: the
  encoder layers are `LongformerLayer`s, the decoder keeps HF's names."""
  config, names = model.config, {}
  linear, norm = functools.partial(_linear, names), functools.partial(_norm, names)
  hf_pre, our_pre = ("", ()) if isinstance(model, led.LEDModel) else ("led.", ("led",))
  names[f"{hf_pre}shared.weight"] = our_pre + ("shared", "embedding")
  for part, num_layers in (("encoder", config.encoder_layers),
                           ("decoder", config.decoder_layers)):
    hf_part, our_part = f"{hf_pre}{part}", our_pre + (part,)
    names[f"{hf_part}.embed_positions.weight"] = our_part + ("embed_positions", "embedding")
    norm(f"{hf_part}.layernorm_embedding", our_part + ("layernorm_embedding",))
    for i in range(num_layers):
      hf, ours = f"{hf_part}.layers.{i}", our_part + ("layers", i)
      if part == "encoder":
        _longformer_layer_names(names, _LED_ENCODER_LAYER, hf, ours)
      else:
        for attention in ("self_attn", "encoder_attn"):
          for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear(f"{hf}.{attention}.{proj}", ours + (attention, proj))
          norm(f"{hf}.{attention}_layer_norm", ours + (f"{attention}_layer_norm",))
        for hf_name in ("fc1", "fc2"):
          linear(f"{hf}.{hf_name}", ours + (hf_name,))
        norm(f"{hf}.final_layer_norm", ours + ("final_layer_norm",))
  if isinstance(model, led.LEDForConditionalGeneration):
    names["final_logits_bias"] = ("final_logits_bias",)  # HF: [1, V]; ours: [V]
  elif isinstance(model, led.LEDForQuestionAnswering):
    linear("qa_outputs", ("qa_outputs",))
  return names


def _has_pooler(model: nnx.Module) -> bool:
  encoder = model if isinstance(model, LongformerModel) else model.longformer
  return encoder.pooler is not None


def _is_backbone(family: _Family, name: str) -> bool:
  """What every task model of the family shares (a pooler is a head part)."""
  return name.removeprefix(family.prefix).startswith(family.backbone)


def _hf_shape(shape: tuple[int, ...], leaf: str, out_ndim: int, unsqueezed: bool
              ) -> tuple[int, ...]:
  """The shape HF stores our parameter `leaf` of `shape` in (`_to_hf`'s output shape)."""
  if leaf == "kernel":
    return (math.prod(shape[len(shape) - out_ndim:]), math.prod(shape[:len(shape) - out_ndim]))
  if leaf == "bias":
    return (math.prod(shape),)
  return (1,) + tuple(shape) if unsqueezed else tuple(shape)


def _to_ours(w: np.ndarray, shape: tuple[int, ...], is_kernel: bool) -> np.ndarray:
  # torch Linear.weight is [out, in]; our kernels are [in..., out...] (heads split out), so
  # they are transposed. Embedding tables are [rows, hidden] on both sides. The caller has
  # checked that `w` has exactly HF's shape for `shape` (`_hf_shape`).
  if is_kernel:
    w = w.T
  return w.reshape(shape)


def _to_hf(w: np.ndarray, leaf: str, out_ndim: int) -> np.ndarray:
  """The inverse of `_to_ours` for parameter `leaf` of a module: a kernel [in..., out...] with
  `out_ndim` output dimensions becomes torch's [prod(out), prod(in)], a bias (per head [H, D])
  torch's [prod(out)]; tables and LayerNorm scales keep their shapes."""
  if leaf == "kernel":
    return w.reshape(int(np.prod(w.shape[:w.ndim - out_ndim])), -1).T
  if leaf == "bias":
    return w.reshape(-1)
  return w


# ----------------------------------------------------------------------------------------------
# Reading HF checkpoints.


def _torch_to_numpy(state_dict) -> dict[str, np.ndarray]:
  """Floating tensors (float16 and bfloat16 included) as float32, as HF loads them into a
  float32 model; other tensors (buffers such as position_ids) as they are, so that a weight
  stored as integers is named, not silently missing."""
  return {k: v.detach().cpu().float().numpy() if v.is_floating_point() else v.detach().cpu().numpy()
          for k, v in state_dict.items()}


def _as_float32(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Floating arrays of any width (float16, bfloat16, float64) converted to float32, exactly
  where float32 holds the value (the model's own dtype is applied when it is built); others
  kept as they are (`_build` refuses one that is a weight)."""
  return {k: np.asarray(v, np.float32) if jnp.issubdtype(v.dtype, jnp.floating) else v
          for k, v in weights.items()}


def _read_safetensors(file: str, root: str) -> dict[str, np.ndarray]:
  """The tensors of one safetensors file, opened only if it is a regular file inside `root`.
  safetensors' own numpy loader has no bfloat16; `safe_open` reads it through ml_dtypes."""
  from safetensors import safe_open
  file = regular_file(file, root)
  try:
    with safe_open(file, framework="numpy") as f:
      return {name: f.get_tensor(name) for name in f.keys()}
  except Exception as e:  # safetensors' SafetensorError (truncated, not safetensors), OSError
    raise ValueError(f"{file} is not a readable safetensors file (truncated or damaged?): "
                     f"{e}") from None


def _shard_files(index: str, path: str, root: str) -> list[str]:
  """The weight files a sharded checkpoint's index names: each a plain relative name inside
  the checkpoint's directory (never an absolute path, `..`, or a symlink out of it)."""
  weight_map = read_json_object(index, root).get("weight_map")
  if not isinstance(weight_map, dict) or not weight_map:
    raise ValueError(f"{index}: weight_map must be a JSON object of weight name -> file name, "
                     f"got {type(weight_map).__name__ if weight_map is not None else 'none'}")
  files = set()
  for name, file in weight_map.items():
    try:
      files.add(inside(file, path))
    except ValueError as e:
      raise ValueError(f"{index}: weight_map[{name!r}]: {e}") from None
  return sorted(files)


def _read_dir(path: str, root: str | None = None
              ) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, str]]:
  """(config dict, weights by HF name, the file each weight came from) of a checkpoint
  directory. Every file is opened only if it is a regular file inside `root` (default: `path`;
  `io.links_root`: an HF cache snapshot's files are symlinks into the repo's folder)."""
  root = root or path
  config_file = os.path.join(path, "config.json")
  if not os.path.lexists(config_file):
    raise FileNotFoundError(f"{path!r} has no config.json; expected an HF model directory")
  config = read_json_object(config_file, root)
  single = os.path.join(path, "model.safetensors")
  index = os.path.join(path, "model.safetensors.index.json")
  torch_bin = os.path.join(path, "pytorch_model.bin")
  weights, origin = {}, {}
  if os.path.lexists(single) or os.path.lexists(index):
    files = [single] if os.path.lexists(single) else _shard_files(index, path, root)
    for file in files:
      tensors = _read_safetensors(file, root)
      weights.update(tensors)
      origin.update(dict.fromkeys(tensors, file))
    weights = _as_float32(weights)
  elif os.path.lexists(torch_bin):
    import pickle
    import torch
    try:
      with open_regular(torch_bin, root) as f:
        state_dict = torch.load(f, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
      raise ValueError(f"{torch_bin} is not a readable PyTorch checkpoint (truncated or "
                       f"damaged?): {e}") from None
    if not isinstance(state_dict, dict):
      raise ValueError(f"{torch_bin} holds {type(state_dict).__name__}, not a state dict")
    weights = _torch_to_numpy(state_dict)
    origin = dict.fromkeys(weights, torch_bin)
  else:
    raise FileNotFoundError(f"{path!r} holds neither model.safetensors (or its index) nor "
                            f"pytorch_model.bin")
  origin[""] = path  # what names a weight that has been renamed since
  return config, weights, origin


# What an HF Hub id fetches: the config and the safetensors weights (one file, or shards and their
# index); a repo without safetensors weights gets its pytorch_model.bin fetched, if torch is there.
_HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json"]
_HUB_TORCH_FILES = ["config.json", "pytorch_model.bin"]


def _hub_snapshot(repo_id: str, revision: str | None, cache_dir) -> str:
  """The local directory of HF Hub model `repo_id` in the HF cache (fetched unless cached)."""
  at = f" at revision {revision!r}" if revision else ""
  try:
    import huggingface_hub
  except ImportError as e:
    raise ImportError(f"{repo_id!r} is not a local directory; fetching it from the HF Hub needs "
                      f"huggingface_hub (pip install huggingface_hub)") from e

  def fetch(patterns: list[str]) -> str:
    try:
      return huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                               allow_patterns=patterns)
    except (OSError, ValueError) as e:
      # Offline without a cached copy, no such repo or revision, no network, a malformed id:
      # huggingface_hub's messages do not all name the repo.
      raise FileNotFoundError(f"{repo_id!r} is not a local directory, and the HF Hub model "
                              f"{repo_id!r}{at} could not be fetched: {type(e).__name__}: {e}"
                              ) from e

  path = fetch(_HUB_FILES)
  if any(os.path.isfile(os.path.join(path, f))
         for f in ("model.safetensors", "model.safetensors.index.json")):
    return path
  try:
    import torch  # noqa: F401 (only whether it imports)
  except ImportError as e:
    raise FileNotFoundError(f"the HF Hub model {repo_id!r}{at} has no safetensors weights, and "
                            f"reading a pytorch_model.bin needs torch") from e
  return fetch(_HUB_TORCH_FILES)


@dataclasses.dataclass(frozen=True)
class _Source:
  """Where a checkpoint came from, for messages: its config's file and each weight's."""
  config: str  # "<dir>/config.json", or a description of a model object
  files: dict[str, str]  # HF weight name -> file ("": the directory)

  def file_of(self, name: str, family: _Family | None = None) -> str:
    names = [name] + ([name.removeprefix(family.prefix), family.prefix + name] if family else [])
    for candidate in names:
      if candidate in self.files:
        return self.files[candidate]
    return self.files.get("", self.config)


def _read(source, revision: str | None = None, cache_dir=None
          ) -> tuple[dict[str, Any], dict[str, np.ndarray], str | None, _Source]:
  """(HF config dict, weights by HF name (floating ones float32), architecture name or None,
  where they came from)."""
  if isinstance(source, (str, os.PathLike)):
    path = os.fspath(source)
    if isinstance(source, str) and not os.path.isdir(path):
      path = _hub_snapshot(source, revision, cache_dir)
    config, weights, files = _read_dir(path, links_root(path))
    config_file = os.path.join(path, "config.json")
    archs = config.get("architectures") or [None]
    if not (isinstance(archs, list) and all(a is None or isinstance(a, str) for a in archs)):
      raise ValueError(f"{config_file}: architectures={archs!r} must be a list of class names")
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
      raise ValueError(f"{config_file}: model_type={model_type!r} must be a string")
    return config, weights, archs[0], _Source(config_file, files)
  if hasattr(source, "state_dict") and hasattr(source, "config"):
    return (source.config.to_dict(), _torch_to_numpy(source.state_dict()),
            type(source).__name__, _Source(f"the config of {type(source).__name__}", {}))
  raise TypeError(f"expected an HF PyTorch model, a local directory or an HF Hub id, got "
                  f"{type(source)}")


def _infer_longformer_architecture(weights: dict[str, np.ndarray]) -> str:
  """The Longformer class a checkpoint without `architectures` was saved from."""
  if any(k.startswith("lm_head.") for k in weights):
    return "LongformerForMaskedLM"
  if "qa_outputs.weight" in weights:
    return "LongformerForQuestionAnswering"
  if "classifier.out_proj.weight" in weights:
    return "LongformerForSequenceClassification"
  if "classifier.weight" in weights:
    return ("LongformerForMultipleChoice" if weights["classifier.weight"].shape[0] == 1
            else "LongformerForTokenClassification")
  return "LongformerModel"


def _infer_led_architecture(weights: dict[str, np.ndarray]) -> str:
  """The LED class a checkpoint without `architectures` was saved from."""
  if "final_logits_bias" in weights or "lm_head.weight" in weights:
    return "LEDForConditionalGeneration"
  if "qa_outputs.weight" in weights:
    return "LEDForQuestionAnswering"
  return "LEDModel"


# ----------------------------------------------------------------------------------------------
# Configs: the total window halved on the way in and doubled on the way out (docs/design.md §3).


def _one_sided_windows(total, num_layers, layers_field: str) -> int | tuple[int, ...]:
  """HF's total `attention_window` (an int or one per layer) as our one-sided value(s). The
  layer count is checked first: a list of `num_layers` entries is made from it."""
  if not isinstance(num_layers, int) or isinstance(num_layers, bool) or not (
      1 <= num_layers <= MAX_LAYERS):
    raise ValueError(f"{layers_field}={num_layers!r} must be an int in [1, {MAX_LAYERS}]")
  is_int = lambda t: isinstance(t, int) and not isinstance(t, bool)
  if not (is_int(total) or isinstance(total, list) and all(is_int(t) for t in total)):
    raise ValueError(f"attention_window={total!r} must be an int or a list of ints")
  totals = [total] * num_layers if is_int(total) else list(total)
  if any(t % 2 for t in totals):
    raise ValueError(f"HF attention_window={total!r} must be even (it is the total window)")
  windows = tuple(t // 2 for t in totals)
  return windows[0] if len(set(windows)) == 1 else windows


def _hf_fields(hf_config: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
  """HF's defaults overridden by the config's own values (null: the default)."""
  return {**defaults, **{k: v for k, v in hf_config.items() if v is not None}}


def _longformer_config_from_hf(hf_config: dict[str, Any], **changes) -> LongformerConfig:
  c = _hf_fields(hf_config, _HF_DEFAULTS)
  id2label = c.get("id2label")
  if id2label is not None and not isinstance(id2label, dict):
    raise ValueError(f"id2label={id2label!r} must be a JSON object of class id -> name")
  num_labels = len(id2label) if id2label else c.get("num_labels", 2)
  fields = {k: c[k] for k in _HF_DEFAULTS if k != "attention_window"}
  fields.update(attention_window=_one_sided_windows(
      c["attention_window"], c["num_hidden_layers"], "num_hidden_layers"), num_labels=num_labels)
  return LongformerConfig(**{**fields, **changes})


def _led_config_from_hf(hf_config: dict[str, Any], **changes) -> LEDConfig:
  c = _hf_fields(hf_config, _HF_LED_DEFAULTS)
  fields = {k: c[k] for k in _HF_LED_DEFAULTS if k != "attention_window"}
  fields["attention_window"] = _one_sided_windows(c["attention_window"], c["encoder_layers"],
                                                  "encoder_layers")
  return LEDConfig(**{**fields, **changes})


def _checked_config(family: _Family, hf_config: dict[str, Any], source: _Source,
                    changes: dict[str, Any]):
  """`family.config_from_hf(hf_config, **changes)`, a refusal naming what is wrong: the
  checkpoint's config file (each value is checked against the config's bounds before anything
  is allocated) or, when the file alone is fine, the caller's changes."""
  try:
    return family.config_from_hf(hf_config, **changes)
  except (TypeError, ValueError) as e:
    error = e
  if changes:
    try:
      family.config_from_hf(hf_config)
    except (TypeError, ValueError):
      pass
    else:
      raise ValueError(f"config changes {sorted(changes)}: {error}") from None
  raise ValueError(f"{source.config}: {error}") from None


def config_from_hf(hf_config: dict[str, Any], **changes) -> LongformerConfig | LEDConfig:
  """Our config from an HF LongformerConfig or LEDConfig dict (by its `model_type`; Longformer
  when it has none), the total window halved to one-sided."""
  if not isinstance(hf_config, dict):
    raise ValueError(f"an HF config must be a JSON object, got {type(hf_config).__name__}")
  family = _FAMILIES["led" if hf_config.get("model_type") == "led" else "longformer"]
  return family.config_from_hf(hf_config, **changes)


def config_to_hf_dict(config: LongformerConfig | LEDConfig,
                      architecture: str | None = None) -> dict[str, Any]:
  """The `config.json` of the HF LongformerConfig or LEDConfig for our config (total windows,
  `architectures` when given), as HF's `save_pretrained` writes it. Needs no transformers.

  Raises ValueError for what HF Longformer cannot express (causal mode, dilation).
  """
  if isinstance(config, LEDConfig):
    fields = {k: getattr(config, k) for k in _HF_LED_DEFAULTS}
    fields.update(model_type="led", is_encoder_decoder=True)
  else:
    if config.causal:
      raise ValueError("HF Longformer has no causal mode; this config has causal=True")
    if config.global_projections != "separate":
      raise ValueError(f"HF Longformer always has separate global projections; this config has "
                       f"global_projections={config.global_projections!r}")
    if any(d != 1 for heads in config.layer_dilations for d in heads):
      raise ValueError(f"HF Longformer has no dilation; attention_dilation="
                       f"{config.attention_dilation!r}")
    fields = {k: getattr(config, k) for k in _HF_DEFAULTS}
    # HF stores the number of classes as the label names (its defaults: LABEL_i).
    labels = [f"LABEL_{i}" for i in range(config.num_labels)]
    fields.update(model_type="longformer", id2label=dict(enumerate(labels)),
                  label2id={label: i for i, label in enumerate(labels)})
  # The weights are written in float32; `torch_dtype` is read by every transformers version
  # (newer ones write `dtype` and read both).
  fields.update(attention_window=[2 * w for w in config.layer_windows], tie_word_embeddings=True,
                torch_dtype="float32")
  if architecture:
    fields["architectures"] = [architecture]
  return json.loads(json.dumps(fields, sort_keys=True))  # JSON's types: string id2label keys


def config_to_hf(config: LongformerConfig | LEDConfig, architecture: str | None = None):
  """An HF `transformers.LongformerConfig` or `LEDConfig`: `config_to_hf_dict` read as HF reads a
  config.json. Raises as `config_to_hf_dict` does."""
  import transformers
  hf_class = transformers.LEDConfig if isinstance(config, LEDConfig) else (
      transformers.LongformerConfig)
  return hf_class.from_dict(config_to_hf_dict(config, architecture))


_FAMILIES = {
    "longformer": _Family(
        model_type="longformer", classes=modeling.MODEL_CLASSES, base=LongformerModel,
        prefix="longformer.", backbone=("embeddings.", "encoder."), base_only=("pooler.",),
        tied={"lm_head.decoder.weight": "longformer.embeddings.word_embeddings.weight",
              "lm_head.decoder.bias": "lm_head.bias"},
        param_names=_longformer_param_names, config_from_hf=_longformer_config_from_hf,
        infer_architecture=_infer_longformer_architecture),
    "led": _Family(
        model_type="led", classes=led.MODEL_CLASSES, base=led.LEDModel, prefix="led.",
        backbone=("shared.", "encoder.", "decoder."), base_only=(),
        tied={"led.encoder.embed_tokens.weight": "led.shared.weight",
              "led.decoder.embed_tokens.weight": "led.shared.weight",
              "lm_head.weight": "led.shared.weight"},
        param_names=_led_param_names, config_from_hf=_led_config_from_hf,
        infer_architecture=_infer_led_architecture, zero_if_missing=("final_logits_bias",),
        unsqueezed=("final_logits_bias",)),
}
_ALL_CLASSES = sorted(name for family in _FAMILIES.values() for name in family.classes)


def _family_of(model: nnx.Module) -> _Family:
  for family in _FAMILIES.values():
    if family.classes.get(type(model).__name__) is type(model):
      return family
  raise TypeError(f"HF checkpoints exist for {_ALL_CLASSES}; got {type(model)}")


# ----------------------------------------------------------------------------------------------
# Building our model from HF weights.


def _tied(family: _Family, model_class: type) -> dict[str, str]:
  """The family's tied names as `model_class` saves them (the base model without the prefix)."""
  if model_class is not family.base:
    return family.tied
  return {k.removeprefix(family.prefix): v.removeprefix(family.prefix)
          for k, v in family.tied.items()}


def _align_prefix(family: _Family, weights: dict[str, np.ndarray], want_backbone_prefix: bool):
  """HF saves the base model without the prefix (`longformer.`, `led.`) its task models use."""
  out = {}
  for k, v in weights.items():
    if want_backbone_prefix and k.startswith(family.backbone + family.base_only):
      k = family.prefix + k
    elif not want_backbone_prefix:
      k = k.removeprefix(family.prefix)
    out[k] = v
  return out


def _untie(weights: dict[str, np.ndarray], tied: dict[str, str]) -> None:
  """Drops the tied copies (keeping a copy whose original the file left out), after checking
  that they equal what they copy."""
  for copy, source in tied.items():
    if copy not in weights:
      continue
    value = weights.pop(copy)
    if source not in weights:
      weights[source] = value
    elif not np.array_equal(value, weights[source]):
      raise ValueError(f"{copy} differs from {source}; untied LM decoders and embeddings are not "
                       f"supported")


def _build(family: _Family, model_class: type, config, weights: dict[str, np.ndarray],
           same_task: bool, rngs: nnx.Rngs | None, source: _Source) -> nnx.Module:
  """Our model with `weights` (HF names) loaded; head parts may be fresh if the task differs.
  Every weight must have exactly the shape HF stores the model's parameter in (a transposed
  or flattened matrix is refused, as transformers refuses it) and a floating dtype."""
  weights = _align_prefix(family, weights, model_class is not family.base)
  _untie(weights, _tied(family, model_class))
  # Multiple choice pools; the bare encoder has a pooler if the checkpoint has one.
  init_kwargs = {}
  if model_class is LongformerModel:
    init_kwargs["add_pooling_layer"] = any(k.startswith("pooler.") for k in weights)
  # Checked against the abstract model (no memory): a config whose sizes the weights do not
  # have is refused before anything of its size is allocated.
  abstract = nnx.eval_shape(lambda: model_class(config, rngs=nnx.Rngs(0), **init_kwargs))
  names = family.param_names(abstract)
  ignored = {k for k in weights if k.endswith(_BUFFERS)}
  missing = sorted(set(names) - set(weights) - set(family.zero_if_missing))
  unexpected = sorted(set(weights) - set(names) - ignored)
  # A pooler is saved by every base model; task models without one drop it, as HF does.
  dropped = [k for k in unexpected
             if not _is_backbone(family, k) and (not same_task or "pooler." in k)]
  unexpected = [k for k in unexpected if k not in dropped]
  fresh = [k for k in missing if not same_task and not _is_backbone(family, k)]
  missing = [k for k in missing if k not in fresh]
  if missing or unexpected:
    raise ValueError(f"checkpoint does not match {model_class.__name__}: missing weights "
                     f"{missing}, unexpected weights {unexpected}")
  abstract_params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
  for hf_name, path in names.items():
    if hf_name in fresh or hf_name not in weights:
      continue
    parent = functools.reduce(operator.getitem, path[:-1], abstract_params)
    shape = tuple(parent[path[-1]].shape)
    out_ndim = len(parent["bias"].shape) if path[-1] == "kernel" else 0
    expected = _hf_shape(shape, path[-1], out_ndim, hf_name in family.unsqueezed)
    w = weights[hf_name]
    if not jnp.issubdtype(w.dtype, jnp.floating):
      raise ValueError(f"{source.file_of(hf_name, family)}: tensor {hf_name} has dtype "
                       f"{w.dtype}; a weight must be floating (float32, float16, bfloat16)")
    if tuple(w.shape) != expected:
      raise ValueError(f"{source.file_of(hf_name, family)}: tensor {hf_name} has shape "
                       f"{tuple(w.shape)}; {model_class.__name__} expects {expected}")
  if dropped or fresh:
    warnings.warn(f"{model_class.__name__}: newly initialised {fresh}; unused checkpoint "
                  f"weights {dropped}", stacklevel=4)  # points at the caller of from_hf

  model = model_class(config, rngs=rngs or nnx.Rngs(0), **init_kwargs)
  state = nnx.state(model, nnx.Param)
  params = nnx.to_pure_dict(state)
  for hf_name, path in names.items():
    if hf_name in fresh:
      continue
    node = functools.reduce(operator.getitem, path[:-1], params)
    shape = node[path[-1]].shape
    if hf_name in weights:
      w = _to_ours(weights[hf_name], shape, path[-1] == "kernel")
    else:  # zero_if_missing
      w = np.zeros(shape, np.float32)
    node[path[-1]] = jnp.asarray(w, config.param_dtype)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  return model


def from_hf(source, *, model_class: type | None = None, revision: str | None = None,
            cache_dir: str | os.PathLike | None = None, rngs: nnx.Rngs | None = None,
            **config_changes) -> nnx.Module:
  """Our NNX model with the weights and config of an HF Longformer or LED checkpoint.

  Args:
    source: an HF `Longformer*` or `LED*` model object, a local directory with `config.json`
      and `model.safetensors` / `pytorch_model.bin`, or an HF Hub id (any other string, e.g.
      "allenai/longformer-base-4096"), fetched into the HF cache unless it is there already.
    model_class: one of our model classes of the same family; default the checkpoint's own.
      With another task (e.g. `LongformerForSequenceClassification` from
      allenai/longformer-base-4096, a masked LM), the backbone is loaded, the new head is
      initialised from `rngs`, the old head is dropped, and a warning names both.
    revision: of a Hub id: a branch, tag or commit hash; default "main".
    cache_dir: of a Hub id: the HF cache to use; default HF's (`HF_HUB_CACHE`).
    rngs: initialises parts the checkpoint lacks and the dropout streams; default nnx.Rngs(0).
    **config_changes: fields of `LongformerConfig` / `LEDConfig` to set, e.g. `attention_impl`,
      `dtype`, `remat`, `num_labels` for a new head.

  Raises ValueError on a model type other than "longformer" or "led", an unknown architecture,
  or missing/unexpected weights (named); FileNotFoundError, naming it, for a Hub id that cannot
  be fetched (with `HF_HUB_OFFLINE=1`: one that is not in the cache).
  """
  hf_config, weights, arch, where = _read(source, revision, cache_dir)
  model_type = hf_config.get("model_type")
  if not isinstance(model_type, str) or model_type not in _FAMILIES:
    hint = {"roberta": "; use roberta_to_longformer", "bart": "; use bart_to_led"}.get(
        model_type, "")
    raise ValueError(f"from_hf converts Longformer and LED checkpoints; got "
                     f"model_type={model_type!r}{hint}")
  return _from_weights(_FAMILIES[model_type], hf_config, weights, arch, model_class, rngs,
                       config_changes, where)


def _from_weights(family: _Family, hf_config: dict[str, Any], weights: dict[str, np.ndarray],
                  arch: str | None, model_class: type | None, rngs: nnx.Rngs | None,
                  config_changes: dict[str, Any], source: _Source) -> nnx.Module:
  """Shared by from_hf, roberta_to_longformer and bart_to_led, once weights have the family's
  HF names."""
  arch = arch or family.infer_architecture(weights)
  if arch not in family.classes:
    raise ValueError(f"unknown architecture {arch!r}; known: {sorted(family.classes)}")
  target = model_class or family.classes[arch]
  if target not in family.classes.values():
    raise ValueError(f"model_class={target!r} is not one of {sorted(family.classes)}")
  config = _checked_config(family, hf_config, source, config_changes)
  return _build(family, target, config, weights, same_task=target.__name__ == arch, rngs=rngs,
                source=source)


def hf_state_dict(model: nnx.Module) -> dict[str, np.ndarray]:
  """`model`'s weights by HF name, float32, in HF's shapes: what HF's `save_pretrained` writes
  for the same class (tied copies left out, LED's `final_logits_bias` included).

  Raises TypeError for a class HF has no counterpart of.
  """
  family = _family_of(model)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  state = {}
  for hf_name, path in family.param_names(model).items():
    parent = functools.reduce(operator.getitem, path[:-1], params)
    # Every kernel is an nnx.LinearGeneral's, [in..., out...], next to its bias [out...].
    out_ndim = parent["bias"].ndim if path[-1] == "kernel" else 0
    w = _to_hf(np.asarray(parent[path[-1]], np.float32), path[-1], out_ndim)
    state[hf_name] = np.ascontiguousarray(w[None] if hf_name in family.unsqueezed else w)
  return state


def save_pretrained(model: nnx.Module, directory: str | os.PathLike) -> None:
  """Writes `directory/config.json` and `directory/model.safetensors` as HF's `save_pretrained`
  writes them for the HF class of `model`'s name (float32 weights, tied copies left out), so that
  transformers' `from_pretrained(directory)` loads it and `from_hf` here loads it back bit for
  bit (also as `model.save_pretrained(directory)`).

  The directory is created if missing; each file is replaced atomically, and other files (a
  tokenizer, say) are left alone. Raises ValueError, before writing anything, for what HF cannot
  express (dilation, causal=True).
  """
  from safetensors.numpy import save
  config = config_to_hf_dict(model.config, type(model).__name__)  # raises first
  weights = hf_state_dict(model)
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  # transformers refuses safetensors files without format "pt". The config goes last: a new
  # directory is not a checkpoint (no config.json) until both files are complete.
  atomic_write(os.path.join(directory, "model.safetensors"),
               save(weights, metadata={"format": "pt"}))
  atomic_write(os.path.join(directory, "config.json"),
               json.dumps(config, indent=2, sort_keys=True) + "\n")


def to_hf(model: nnx.Module):
  """The HF PyTorch model (same class name, eval mode) computing what `model` computes.

  Needs torch and transformers. Raises ValueError for what HF Longformer cannot express
  (causal mode, dilation).
  """
  import torch
  import transformers
  family = _family_of(model)
  name = type(model).__name__
  hf_config = config_to_hf(model.config, architecture=name)
  # LongformerModel's init_kwargs is HF's {"add_pooling_layer": ...}; the others have none.
  hf_model = getattr(transformers, name)(hf_config, **getattr(model, "init_kwargs", {}))
  hf_names = hf_model.state_dict().keys()
  # torch.from_numpy needs writable arrays: copies.
  state_dict = {k: torch.from_numpy(np.array(v)) for k, v in hf_state_dict(model).items()}
  for copy, source in _tied(family, type(model)).items():
    if copy in hf_names:
      state_dict[copy] = state_dict[source]
  hf_model.load_state_dict(state_dict, strict=True)
  return hf_model.eval()


# ----------------------------------------------------------------------------------------------
# Making RoBERTa and BART long.


def _read_short(source, model_type: str, recipe: str, name: str, max_positions: int,
                window: int):
  """`_read` for a recipe that makes a short model long, after checking the source's type and
  the requested sizes."""
  for what, value in (("max_positions", max_positions), ("window", window)):
    if not isinstance(value, int) or isinstance(value, bool) or not (
        1 <= value <= MAX_POSITIONS):
      raise ValueError(f"{what}={value!r} must be an int in [1, {MAX_POSITIONS}]")
  hf_config, weights, arch, where = _read(source)
  if hf_config.get("model_type") != model_type:
    raise ValueError(f"{recipe} converts {name} checkpoints; got "
                     f"model_type={hf_config.get('model_type')!r}")
  return hf_config, weights, arch, where


def _weight(weights: dict[str, np.ndarray], suffix: str, source: _Source, what: str,
            ndim: int | None = None) -> str:
  """The name of the one weight ending in `suffix` (a `ndim`-dimensional floating tensor);
  ValueError naming the checkpoint and what is missing otherwise."""
  found = [k for k in weights if k.endswith(suffix)]
  if len(found) != 1:
    raise ValueError(f"{source.files.get('', source.config)}: "
                     + (f"no {what} ({suffix})" if not found else
                        f"{len(found)} tensors end in {suffix}: {found}"))
  w = weights[found[0]]
  if ndim is not None and (w.ndim != ndim or not jnp.issubdtype(w.dtype, jnp.floating)):
    raise ValueError(f"{source.file_of(found[0])}: tensor {found[0]} ({what}) has shape "
                     f"{w.shape} and dtype {w.dtype}; expected a {ndim}-d floating tensor")
  return found[0]


def _copied_positions(table: np.ndarray, offset: int, rows: int) -> np.ndarray:
  """`rows` positions from a learned table whose first `offset` rows are not positions: row i is
  the learned row i mod (learned rows), the table copied over and over (paper §5 and §6)."""
  learned = table[offset:]
  return learned[np.arange(rows) % len(learned)]


def _check_offset(table: np.ndarray, offset, name: str, source: _Source) -> None:
  if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < len(table):
    raise ValueError(f"{source.file_of(name)}: the position table {name} has {len(table)} "
                     f"rows, none of them a learned position after the offset {offset!r}")


def _copy_local_to_global(weights: dict[str, np.ndarray], query_suffix: str,
                          source: _Source) -> None:
  """Every layer's global projections start as copies of its local ones (paper §3.1, §5): the
  keys ending in `query_suffix` (`<layer>.query.weight`) name the layers."""
  for k in [k for k in weights if k.endswith(query_suffix)]:
    for proj in ("query", "key", "value"):
      for leaf in ("weight", "bias"):
        local = k.replace(".query.weight", f".{proj}.{leaf}")
        if local not in weights:
          raise ValueError(f"{source.files.get('', source.config)}: no tensor {local} (the "
                           f"layer of {k} lacks its {proj} {leaf})")
        weights[local.replace(f".{proj}.", f".{proj}_global.")] = weights[local].copy()


def roberta_to_longformer(source, max_positions: int = 4096, window: int = 256, *,
                          rngs: nnx.Rngs | None = None, **config_changes) -> nnx.Module:
  """A Longformer made from an HF RoBERTa by the paper's recipe (docs/design.md §5.3).

  The learned positions are copied repeatedly into a table for `max_positions` tokens, and every
  layer's global projections start as copies of its local ones. The task head maps by name
  (RobertaForMaskedLM -> LongformerForMaskedLM, and so on), so a masked LM is usable at once: on
  inputs the original positions cover, with `window` >= their length, it computes what the
  RoBERTa computes.

  Args:
    source: an HF `Roberta*` model object or a local directory.
    max_positions: tokens the new position table holds.
    window: one-sided attention window of every layer.
    **config_changes: other `LongformerConfig` fields.
  """
  hf_config, weights, arch, where = _read_short(
      source, "roberta", "roberta_to_longformer", "RoBERTa", max_positions, window)
  renamed = {("longformer." + k.removeprefix("roberta.")) if k.startswith("roberta.") else k: k
             for k in weights}
  weights = {k: weights[v] for k, v in renamed.items()}
  where = _Source(where.config, {**where.files, **{
      k: where.files[v] for k, v in renamed.items() if v in where.files}})
  pad = hf_config.get("pad_token_id", _HF_DEFAULTS["pad_token_id"])
  _copy_local_to_global(weights, ".attention.self.query.weight", where)
  pos_name = _weight(weights, "embeddings.position_embeddings.weight", where,
                     "position table", ndim=2)
  offset = pad + 1 if isinstance(pad, int) and not isinstance(pad, bool) else pad
  _check_offset(weights[pos_name], offset, pos_name, where)
  old = weights[pos_name]
  # Rows below the offset belong to padding (and an unused row 0): kept as they are.
  weights[pos_name] = np.concatenate([old[:offset], _copied_positions(old, offset,
                                                                      max_positions)])
  long_config = dict(hf_config, model_type="longformer", attention_window=2 * window,
                     max_position_embeddings=max_positions + offset)
  arch = arch.replace("Roberta", "Longformer") if arch else None
  return _from_weights(_FAMILIES["longformer"], long_config, weights, arch, None, rngs,
                       config_changes, where)


# HF's BartLearnedPositionalEmbedding keeps 2 rows before position 0 (a fairseq legacy); LED's
# tables start at position 0.
_BART_POSITION_OFFSET = 2
# BART encoder self-attention -> LED's Longformer attention (output projection included).
_BART_ENCODER_ATTENTION = re.compile(r"^(.*encoder\.layers\.\d+\.self_attn)\.(q|k|v|out)_proj\.")
_BART_TO_LED_PROJECTION = {"q": "longformer_self_attn.query", "k": "longformer_self_attn.key",
                           "v": "longformer_self_attn.value", "out": "output"}


def bart_to_led(source, max_positions: int = 16384, window: int = 512, *,
                rngs: nnx.Rngs | None = None, **config_changes) -> nnx.Module:
  """An LED made from an HF BART by the paper's recipe (paper §6), as allenai/led-base-16384
  was made from facebook/bart-base.

  The encoder's learned positions are copied repeatedly into a table for `max_positions` tokens
  (LED position i takes BART's position i mod BART's table size; BART's two offset rows are
  dropped), every encoder layer's global projections start as copies of its local q/k/v, and the
  decoder's positions are BART's without the offset rows. The class maps by name
  (BartForConditionalGeneration -> LEDForConditionalGeneration, BartModel -> LEDModel,
  BartForQuestionAnswering -> LEDForQuestionAnswering). The result is usable at once: on encoder
  inputs BART's positions cover, with `window` >= their length, it computes what the BART
  computes, global tokens or not.

  Args:
    source: an HF `Bart*` model object or a local directory.
    max_positions: encoder tokens the new position table holds.
    window: one-sided attention window of every encoder layer.
    **config_changes: other `LEDConfig` fields.
  """
  hf_config, weights, arch, where = _read_short(source, "bart", "bart_to_led", "BART",
                                                max_positions, window)
  if hf_config.get("scale_embedding"):
    raise ValueError("this BART has scale_embedding=True (token embeddings times sqrt(d_model)); "
                     "LED does not scale them, and the table is tied to the LM head")
  led_weights, files = {}, {"": where.files.get("", where.config)}
  for k, v in weights.items():
    original = k
    k = "led." + k.removeprefix("model.") if k.startswith("model.") else k
    k = _BART_ENCODER_ATTENTION.sub(lambda m: f"{m[1]}.{_BART_TO_LED_PROJECTION[m[2]]}.", k)
    led_weights[k] = v
    if original in where.files:
      files[k] = where.files[original]
  where = _Source(where.config, files)
  _copy_local_to_global(led_weights, ".longformer_self_attn.query.weight", where)
  table_rows = {}
  for part in ("encoder", "decoder"):
    name = _weight(led_weights, f"{part}.embed_positions.weight", where,
                   f"{part} position table", ndim=2)
    _check_offset(led_weights[name], _BART_POSITION_OFFSET, name, where)
    bart_rows = len(led_weights[name]) - _BART_POSITION_OFFSET
    table_rows[part] = max_positions if part == "encoder" else bart_rows
    led_weights[name] = _copied_positions(led_weights[name], _BART_POSITION_OFFSET,
                                          table_rows[part])
  led_config = {k: hf_config[k] for k in _HF_LED_DEFAULTS if k in hf_config}
  led_config.update(model_type="led", attention_window=2 * window,
                    max_encoder_position_embeddings=table_rows["encoder"],
                    max_decoder_position_embeddings=table_rows["decoder"])
  arch = arch.replace("Bart", "LED") if arch else None
  return _from_weights(_FAMILIES["led"], led_config, led_weights, arch, None, rngs,
                       config_changes, where)


# ----------------------------------------------------------------------------------------------
# New tokens.


def extend_vocabulary(model: nnx.Module, num_new: int, *, seed: int = 0) -> nnx.Module:
  """A copy of `model` whose vocabulary has `num_new` more ids, `vocab_size .. vocab_size +
  num_new - 1` (new marker tokens, as WikiHop's `[q] [/q] [ent] [/ent]`); `model` is unchanged.

  Every parameter with a vocabulary axis (its logical axis "vocab": the word embedding table,
  tied to the LM head's decoder, and an LM head's bias or LED's `final_logits_bias`) grows along
  it. The old entries are bit-identical, so every input of old ids gives the same outputs and
  the same old-id logits as before. New rows of a table are drawn, per feature, from a normal
  with the mean and standard deviation of that feature over the old rows (float32 statistics,
  stored in the parameter's dtype); new entries of a bias take the old entries' mean. The config
  (every module's `config`) gets the new `vocab_size`, so `checkpoint.save_model` and
  `load_model` round-trip the grown model as they do any other. The new arrays are on the
  default device: reshard a model laid out on a mesh afterwards.

  Args:
    model: one of our models with a `config` holding `vocab_size`.
    num_new: ids to add, >= 1.
    seed: seeds the new rows (the same seed gives the same rows).
  """
  if not isinstance(num_new, int) or isinstance(num_new, bool) or num_new < 1:
    raise ValueError(f"num_new must be an int >= 1, got {num_new!r}")
  config = getattr(model, "config", None)
  if not isinstance(getattr(config, "vocab_size", None), int):
    raise TypeError(f"extend_vocabulary needs a model whose config has vocab_size; got "
                    f"{type(model).__name__}")
  old_size = config.vocab_size
  new_config = config.replace(vocab_size=old_size + num_new)  # checks the bound
  grown = nnx.clone(model)
  nodes = list(nnx.iter_graph(grown))
  key = jax.random.key(seed)
  changed = []
  for i, (path, node) in enumerate(nodes):
    if not isinstance(node, nnx.Param):
      continue
    axes = tuple(node.get_metadata().get("out_sharding") or ())
    if "vocab" not in axes:
      continue
    axis = axes.index("vocab")
    old = node[...]
    name = ".".join(map(str, path))
    if old.shape[axis] != old_size:
      raise ValueError(f"parameter {name} has {old.shape[axis]} entries along its vocabulary "
                       f"axis; the config says vocab_size={old_size}")
    stats = jnp.asarray(old, jnp.float32)
    mean = jnp.mean(stats, axis=axis, keepdims=True)
    new_shape = old.shape[:axis] + (num_new,) + old.shape[axis + 1:]
    if old.ndim == 1:
      new = jnp.broadcast_to(mean, new_shape)
    else:
      noise = jax.random.normal(jax.random.fold_in(key, i), new_shape, jnp.float32)
      new = mean + jnp.std(stats, axis=axis, keepdims=True) * noise
    node.set_value(jnp.concatenate([old, new.astype(old.dtype)], axis=axis))
    changed.append(name)
  if not changed:
    raise TypeError(f"{type(model).__name__} has no parameter with a vocabulary axis")
  for _, node in nodes:
    if isinstance(node, nnx.Module):
      if getattr(node, "config", None) == config:
        node.config = new_config
      if isinstance(node, nnx.Embed) and node.num_embeddings == old_size and (
          node.embedding.shape[0] == old_size + num_new):
        node.num_embeddings = old_size + num_new
  return grown


# The models' `save_pretrained` / `from_pretrained` methods (pretrained.HFCheckpointMixin).
pretrained.register_hf_io(save=save_pretrained, load=from_hf)
