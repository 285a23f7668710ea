"""Conversion between HF transformers checkpoints and the models of this package.

  from_hf(source)               HF Longformer or LED (model object, local directory or HF Hub
                                id) -> our NNX model; `Class.from_pretrained` runs it
  to_hf(model)                  our NNX model -> HF PyTorch model of the same class
  hf_state_dict(model)          our NNX model -> its weights by HF name, in HF's shapes
  config_to_hf_dict(config)     our config -> the `config.json` dict HF reads
  roberta_to_longformer(source) HF RoBERTa -> our Longformer, by the paper's recipe
                                (docs/design.md §5.3)
  bart_to_led(source)           HF BART -> our LED, by the paper's recipe (paper §6)

A directory holds `config.json` and `model.safetensors` (or its sharded index) or
`pytorch_model.bin`; `model.save_pretrained(directory)` writes the first two. Reading and writing
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
import operator
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from longformer_jax import led, modeling
from longformer_jax.config import LEDConfig, LongformerConfig
from longformer_jax.io import read_json
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


def _to_ours(name: str, w: np.ndarray, shape: tuple[int, ...], is_kernel: bool) -> np.ndarray:
  # torch Linear.weight is [out, in]; our kernels are [in..., out...] (heads split out), so
  # they are transposed. Embedding tables are [rows, hidden] on both sides.
  if is_kernel:
    w = w.T
  if w.size != int(np.prod(shape)):
    raise ValueError(f"weight {name} has shape {w.shape}; the model expects {shape}")
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
  return {k: v.detach().cpu().float().numpy() for k, v in state_dict.items()
          if v.is_floating_point()}


def _read_dir(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  config_file = os.path.join(path, "config.json")
  if not os.path.isfile(config_file):
    raise FileNotFoundError(f"{path!r} has no config.json; expected an HF model directory")
  config = read_json(config_file)
  single = os.path.join(path, "model.safetensors")
  index = os.path.join(path, "model.safetensors.index.json")
  torch_bin = os.path.join(path, "pytorch_model.bin")
  if os.path.isfile(single) or os.path.isfile(index):
    from safetensors.numpy import load_file
    if os.path.isfile(single):
      files = [single]
    else:
      files = sorted({os.path.join(path, s) for s in read_json(index)["weight_map"].values()})
    weights = {}
    for file in files:
      try:
        weights.update(load_file(file))
      except Exception as e:  # safetensors' SafetensorError (truncated, not safetensors), OSError
        raise ValueError(f"{file} is not a readable safetensors file (truncated or damaged?): "
                         f"{e}") from None
    weights = {k: np.asarray(v, np.float32) for k, v in weights.items()
               if np.issubdtype(v.dtype, np.floating)}
  elif os.path.isfile(torch_bin):
    import pickle
    import torch
    try:
      state_dict = torch.load(torch_bin, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
      raise ValueError(f"{torch_bin} is not a readable PyTorch checkpoint (truncated or "
                       f"damaged?): {e}") from None
    weights = _torch_to_numpy(state_dict)
  else:
    raise FileNotFoundError(f"{path!r} holds neither model.safetensors (or its index) nor "
                            f"pytorch_model.bin")
  return config, weights


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


def _read(source, revision: str | None = None,
          cache_dir=None) -> tuple[dict[str, Any], dict[str, np.ndarray], str | None]:
  """(HF config dict, float32 weights by HF name, architecture name or None)."""
  if isinstance(source, (str, os.PathLike)):
    path = os.fspath(source)
    if isinstance(source, str) and not os.path.isdir(path):
      path = _hub_snapshot(source, revision, cache_dir)
    config, weights = _read_dir(path)
    archs = config.get("architectures") or [None]
    return config, weights, archs[0]
  if hasattr(source, "state_dict") and hasattr(source, "config"):
    return source.config.to_dict(), _torch_to_numpy(source.state_dict()), type(source).__name__
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


def _one_sided_windows(total, num_layers: int) -> int | tuple[int, ...]:
  """HF's total `attention_window` (an int or one per layer) as our one-sided value(s)."""
  totals = [total] * num_layers if isinstance(total, int) else list(total)
  if any(t % 2 for t in totals):
    raise ValueError(f"HF attention_window={total!r} must be even (it is the total window)")
  windows = tuple(t // 2 for t in totals)
  return windows[0] if len(set(windows)) == 1 else windows


def _longformer_config_from_hf(hf_config: dict[str, Any], **changes) -> LongformerConfig:
  c = {**_HF_DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None}}
  num_labels = len(c["id2label"]) if c.get("id2label") else c.get("num_labels", 2)
  fields = {k: c[k] for k in _HF_DEFAULTS if k != "attention_window"}
  fields.update(attention_window=_one_sided_windows(c["attention_window"],
                                                    c["num_hidden_layers"]),
                num_labels=num_labels)
  return LongformerConfig(**{**fields, **changes})


def _led_config_from_hf(hf_config: dict[str, Any], **changes) -> LEDConfig:
  c = {**_HF_LED_DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None}}
  fields = {k: c[k] for k in _HF_LED_DEFAULTS if k != "attention_window"}
  fields["attention_window"] = _one_sided_windows(c["attention_window"], c["encoder_layers"])
  return LEDConfig(**{**fields, **changes})


def config_from_hf(hf_config: dict[str, Any], **changes) -> LongformerConfig | LEDConfig:
  """Our config from an HF LongformerConfig or LEDConfig dict (by its `model_type`; Longformer
  when it has none), the total window halved to one-sided."""
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
           same_task: bool, rngs: nnx.Rngs | None) -> nnx.Module:
  """Our model with `weights` (HF names) loaded; head parts may be fresh if the task differs."""
  weights = _align_prefix(family, weights, model_class is not family.base)
  _untie(weights, _tied(family, model_class))
  # Multiple choice pools; the bare encoder has a pooler if the checkpoint has one.
  init_kwargs = {}
  if model_class is LongformerModel:
    init_kwargs["add_pooling_layer"] = any(k.startswith("pooler.") for k in weights)
  model = model_class(config, rngs=rngs or nnx.Rngs(0), **init_kwargs)
  names = family.param_names(model)
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
  if dropped or fresh:
    warnings.warn(f"{model_class.__name__}: newly initialised {fresh}; unused checkpoint "
                  f"weights {dropped}", stacklevel=4)  # points at the caller of from_hf

  state = nnx.state(model, nnx.Param)
  params = nnx.to_pure_dict(state)
  for hf_name, path in names.items():
    if hf_name in fresh:
      continue
    node = params
    for key in path[:-1]:
      node = node[key]
    shape = node[path[-1]].shape
    w = weights[hf_name] if hf_name in weights else np.zeros(shape, np.float32)
    node[path[-1]] = jnp.asarray(_to_ours(hf_name, w, shape, path[-1] == "kernel"),
                                 config.param_dtype)
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
  hf_config, weights, arch = _read(source, revision, cache_dir)
  model_type = hf_config.get("model_type")
  if model_type not in _FAMILIES:
    hint = {"roberta": "; use roberta_to_longformer", "bart": "; use bart_to_led"}.get(
        model_type, "")
    raise ValueError(f"from_hf converts Longformer and LED checkpoints; got "
                     f"model_type={model_type!r}{hint}")
  return _from_weights(_FAMILIES[model_type], hf_config, weights, arch, model_class, rngs,
                       config_changes)


def _from_weights(family: _Family, hf_config: dict[str, Any], weights: dict[str, np.ndarray],
                  arch: str | None, model_class: type | None, rngs: nnx.Rngs | None,
                  config_changes: dict[str, Any]) -> nnx.Module:
  """Shared by from_hf, roberta_to_longformer and bart_to_led, once weights have the family's
  HF names."""
  arch = arch or family.infer_architecture(weights)
  if arch not in family.classes:
    raise ValueError(f"unknown architecture {arch!r}; known: {sorted(family.classes)}")
  target = model_class or family.classes[arch]
  if target not in family.classes.values():
    raise ValueError(f"model_class={target!r} is not one of {sorted(family.classes)}")
  config = family.config_from_hf(hf_config, **config_changes)
  return _build(family, target, config, weights, same_task=target.__name__ == arch, rngs=rngs)


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
  hf_config, weights, arch = _read(source)
  if hf_config.get("model_type") != model_type:
    raise ValueError(f"{recipe} converts {name} checkpoints; got "
                     f"model_type={hf_config.get('model_type')!r}")
  if max_positions < 1 or window < 1:
    raise ValueError(f"max_positions={max_positions} and window={window} must be >= 1")
  return hf_config, weights, arch


def _copied_positions(table: np.ndarray, offset: int, rows: int) -> np.ndarray:
  """`rows` positions from a learned table whose first `offset` rows are not positions: row i is
  the learned row i mod (learned rows), the table copied over and over (paper §5 and §6)."""
  learned = table[offset:]
  return learned[np.arange(rows) % len(learned)]


def _copy_local_to_global(weights: dict[str, np.ndarray], query_suffix: str) -> None:
  """Every layer's global projections start as copies of its local ones (paper §3.1, §5): the
  keys ending in `query_suffix` (`<layer>.query.weight`) name the layers."""
  for k in [k for k in weights if k.endswith(query_suffix)]:
    for proj in ("query", "key", "value"):
      for leaf in ("weight", "bias"):
        local = k.replace(".query.weight", f".{proj}.{leaf}")
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
  hf_config, weights, arch = _read_short(source, "roberta", "roberta_to_longformer", "RoBERTa",
                                         max_positions, window)
  weights = {("longformer." + k.removeprefix("roberta.")) if k.startswith("roberta.") else k: v
             for k, v in weights.items()}
  offset = hf_config.get("pad_token_id", _HF_DEFAULTS["pad_token_id"]) + 1
  _copy_local_to_global(weights, ".attention.self.query.weight")
  pos_name = next(k for k in weights if k.endswith("embeddings.position_embeddings.weight"))
  old = weights[pos_name]
  # Rows below the offset belong to padding (and an unused row 0): kept as they are.
  weights[pos_name] = np.concatenate([old[:offset], _copied_positions(old, offset,
                                                                      max_positions)])
  long_config = dict(hf_config, model_type="longformer", attention_window=2 * window,
                     max_position_embeddings=max_positions + offset)
  arch = arch.replace("Roberta", "Longformer") if arch else None
  return _from_weights(_FAMILIES["longformer"], long_config, weights, arch, None, rngs,
                       config_changes)


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
  hf_config, weights, arch = _read_short(source, "bart", "bart_to_led", "BART", max_positions,
                                         window)
  if hf_config.get("scale_embedding"):
    raise ValueError("this BART has scale_embedding=True (token embeddings times sqrt(d_model)); "
                     "LED does not scale them, and the table is tied to the LM head")
  led_weights = {}
  for k, v in weights.items():
    k = "led." + k.removeprefix("model.") if k.startswith("model.") else k
    k = _BART_ENCODER_ATTENTION.sub(lambda m: f"{m[1]}.{_BART_TO_LED_PROJECTION[m[2]]}.", k)
    led_weights[k] = v
  _copy_local_to_global(led_weights, ".longformer_self_attn.query.weight")
  table_rows = {}
  for part in ("encoder", "decoder"):
    name = next(k for k in led_weights if k.endswith(f"{part}.embed_positions.weight"))
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
                       config_changes)
