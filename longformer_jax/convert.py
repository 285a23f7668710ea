"""Conversion between HF transformers PyTorch checkpoints and the models of this package.

  from_hf(source)               HF Longformer (model object or local directory) -> our NNX model
  to_hf(model)                  our NNX model -> HF PyTorch model of the same class
  roberta_to_longformer(source) HF RoBERTa -> our Longformer, by the paper's recipe
                                (docs/design.md §5.3)

No network access: a directory must hold `config.json` and `model.safetensors` (or its sharded
index) or `pytorch_model.bin`. Reading safetensors needs only the `safetensors` package; torch is
needed for `.bin` files, model objects and `to_hf`. The HF total `attention_window` becomes the
one-sided window here, and back (the only place where the two meet).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from longformer_jax.config import LongformerConfig
from longformer_jax.modeling import MODEL_CLASSES, LongformerModel

# HF LongformerConfig defaults, for config.json files that leave fields out.
_HF_DEFAULTS = dict(
    vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
    intermediate_size=3072, hidden_act="gelu", hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1, max_position_embeddings=512, type_vocab_size=2,
    initializer_range=0.02, layer_norm_eps=1e-12, pad_token_id=1, bos_token_id=0,
    eos_token_id=2, sep_token_id=2, attention_window=512)

_BACKBONE = "longformer."
# Buffers that some (older) checkpoints save next to the weights; they hold no learned values.
_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")
# HF ties these names to the ones they map to; the copies must be equal.
_TIED = {"lm_head.decoder.weight": "longformer.embeddings.word_embeddings.weight",
         "lm_head.decoder.bias": "lm_head.bias"}

Path = tuple[str | int, ...]


# ----------------------------------------------------------------------------------------------
# Names: HF weight name -> path of our parameter.


def _param_names(model_class: type, config: LongformerConfig, pooler: bool) -> dict[str, Path]:
  """Every HF weight name of `model_class` (tied copies excluded) and our parameter path."""
  names: dict[str, Path] = {}

  def linear(hf: str, ours: Path):
    names[f"{hf}.weight"], names[f"{hf}.bias"] = ours + ("kernel",), ours + ("bias",)

  def norm(hf: str, ours: Path):
    names[f"{hf}.weight"], names[f"{hf}.bias"] = ours + ("scale",), ours + ("bias",)

  is_base = model_class is LongformerModel
  hf_pre, our_pre = ("", ()) if is_base else (_BACKBONE, ("longformer",))
  for table in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
    names[f"{hf_pre}embeddings.{table}.weight"] = our_pre + ("embeddings", table, "embedding")
  norm(f"{hf_pre}embeddings.LayerNorm", our_pre + ("embeddings", "layer_norm"))
  for i in range(config.num_hidden_layers):
    hf, ours = f"{hf_pre}encoder.layer.{i}", our_pre + ("layers", i)
    for proj in ("query", "key", "value", "query_global", "key_global", "value_global"):
      linear(f"{hf}.attention.self.{proj}", ours + ("attention", proj))
    linear(f"{hf}.attention.output.dense", ours + ("attention", "output"))
    norm(f"{hf}.attention.output.LayerNorm", ours + ("attention_norm",))
    linear(f"{hf}.intermediate.dense", ours + ("intermediate",))
    linear(f"{hf}.output.dense", ours + ("output",))
    norm(f"{hf}.output.LayerNorm", ours + ("output_norm",))
  if pooler:
    linear(f"{hf_pre}pooler.dense", our_pre + ("pooler",))
  head = model_class.__name__
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


def _has_pooler(model: nnx.Module) -> bool:
  encoder = model if isinstance(model, LongformerModel) else model.longformer
  return encoder.pooler is not None


def _is_backbone(name: str) -> bool:
  """Embeddings and encoder layers: what every task model shares (the pooler is a head part)."""
  name = name.removeprefix(_BACKBONE)
  return name.startswith(("embeddings.", "encoder."))


def _is_linear_weight(name: str, ndim: int) -> bool:
  # torch Linear.weight is [out, in]; our kernels are [in..., out...] (heads split out), so
  # these are transposed. Embedding tables are [rows, hidden] on both sides.
  return name.endswith(".weight") and ndim > 1 and "embeddings" not in name


def _to_ours(name: str, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  if _is_linear_weight(name, len(shape)):
    w = w.T
  if w.size != int(np.prod(shape)):
    raise ValueError(f"weight {name} has shape {w.shape}; the model expects {shape}")
  return w.reshape(shape)


def _to_hf(name: str, w: np.ndarray, hf_shape: tuple[int, ...]) -> np.ndarray:
  if _is_linear_weight(name, w.ndim):
    return w.reshape(hf_shape[::-1]).T
  return w.reshape(hf_shape)


# ----------------------------------------------------------------------------------------------
# Reading HF checkpoints.


def _torch_to_numpy(state_dict) -> dict[str, np.ndarray]:
  return {k: v.detach().cpu().float().numpy() for k, v in state_dict.items()
          if v.is_floating_point()}


def _read_dir(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  config_file = os.path.join(path, "config.json")
  if not os.path.isfile(config_file):
    raise FileNotFoundError(f"{path!r} has no config.json; expected an HF model directory")
  with open(config_file) as f:
    config = json.load(f)
  single = os.path.join(path, "model.safetensors")
  index = os.path.join(path, "model.safetensors.index.json")
  torch_bin = os.path.join(path, "pytorch_model.bin")
  if os.path.isfile(single) or os.path.isfile(index):
    from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
    if os.path.isfile(single):
      files = [single]
    else:
      with open(index) as f:
        files = sorted({os.path.join(path, s) for s in json.load(f)["weight_map"].values()})
    weights = {}
    for file in files:
      weights.update(load_file(file))
    weights = {k: np.asarray(v, np.float32) for k, v in weights.items()
               if np.issubdtype(v.dtype, np.floating)}
  elif os.path.isfile(torch_bin):
    import torch  # pylint: disable=import-outside-toplevel
    weights = _torch_to_numpy(torch.load(torch_bin, map_location="cpu", weights_only=True))
  else:
    raise FileNotFoundError(f"{path!r} holds neither model.safetensors (or its index) nor "
                            f"pytorch_model.bin")
  return config, weights


def _read(source) -> tuple[dict[str, Any], dict[str, np.ndarray], str | None]:
  """(HF config dict, float32 weights by HF name, architecture name or None)."""
  if isinstance(source, (str, os.PathLike)):
    config, weights = _read_dir(os.fspath(source))
    archs = config.get("architectures") or [None]
    return config, weights, archs[0]
  if hasattr(source, "state_dict") and hasattr(source, "config"):
    return source.config.to_dict(), _torch_to_numpy(source.state_dict()), type(source).__name__
  raise TypeError(f"expected an HF PyTorch model or a local directory, got {type(source)}")


def _infer_architecture(weights: dict[str, np.ndarray]) -> str:
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


def config_from_hf(hf_config: dict[str, Any], **changes) -> LongformerConfig:
  """Our config from an HF LongformerConfig dict (its total window halved to one-sided)."""
  c = {**_HF_DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None}}
  total = c["attention_window"]
  totals = [total] * c["num_hidden_layers"] if isinstance(total, int) else list(total)
  if any(t % 2 for t in totals):
    raise ValueError(f"HF attention_window={total!r} must be even (it is the total window)")
  windows = tuple(t // 2 for t in totals)
  num_labels = len(c["id2label"]) if c.get("id2label") else c.get("num_labels", 2)
  fields = {k: c[k] for k in _HF_DEFAULTS if k != "attention_window"}
  fields.update(attention_window=windows[0] if len(set(windows)) == 1 else windows,
                num_labels=num_labels)
  return LongformerConfig(**{**fields, **changes})


def config_to_hf(config: LongformerConfig, architecture: str | None = None):
  """An HF `transformers.LongformerConfig` (total windows) for our config."""
  import transformers  # pylint: disable=import-outside-toplevel
  if config.causal:
    raise ValueError("HF Longformer has no causal mode; this config has causal=True")
  if any(d != 1 for heads in config.layer_dilations for d in heads):
    raise ValueError(f"HF Longformer has no dilation; attention_dilation="
                     f"{config.attention_dilation!r}")
  fields = {k: getattr(config, k) for k in _HF_DEFAULTS if k != "attention_window"}
  return transformers.LongformerConfig(
      **fields, attention_window=[2 * w for w in config.layer_windows],
      num_labels=config.num_labels, architectures=[architecture] if architecture else None)


# ----------------------------------------------------------------------------------------------
# Building our model from HF weights.


def _align_prefix(weights: dict[str, np.ndarray], want_backbone_prefix: bool):
  """HF saves LongformerModel without the `longformer.` prefix its task models use."""
  out = {}
  for k, v in weights.items():
    if want_backbone_prefix and k.startswith(("embeddings.", "encoder.", "pooler.")):
      k = _BACKBONE + k
    elif not want_backbone_prefix:
      k = k.removeprefix(_BACKBONE)
    out[k] = v
  return out


def _check_tied(weights: dict[str, np.ndarray]) -> None:
  for copy, source in _TIED.items():
    if copy in weights and source in weights and not np.array_equal(weights[copy],
                                                                    weights[source]):
      raise ValueError(f"{copy} differs from {source}; untied LM decoders are not supported")


def _build(model_class: type, config: LongformerConfig, weights: dict[str, np.ndarray],
           same_task: bool, rngs: nnx.Rngs | None) -> nnx.Module:
  """Our model with `weights` (HF names) loaded; head parts may be fresh if the task differs."""
  weights = _align_prefix(weights, model_class is not LongformerModel)
  _check_tied(weights)
  # Multiple choice pools; the bare encoder has a pooler if the checkpoint has one.
  init_kwargs = {}
  if model_class is LongformerModel:
    init_kwargs["add_pooling_layer"] = any(k.startswith("pooler.") for k in weights)
  model = model_class(config, rngs=rngs or nnx.Rngs(0), **init_kwargs)
  names = _param_names(model_class, config, _has_pooler(model))
  ignored = {k for k in weights if k in _TIED or k.endswith(_BUFFERS)}
  missing = sorted(set(names) - set(weights))
  unexpected = sorted(set(weights) - set(names) - ignored)
  # A pooler is saved by every base model; task models without one drop it, as HF does.
  dropped = [k for k in unexpected if not _is_backbone(k) and (not same_task or "pooler." in k)]
  unexpected = [k for k in unexpected if k not in dropped]
  fresh = [k for k in missing if not same_task and not _is_backbone(k)]
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
    node[path[-1]] = jnp.asarray(_to_ours(hf_name, weights[hf_name], node[path[-1]].shape),
                                 config.param_dtype)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  return model


def from_hf(source, *, model_class: type | None = None, rngs: nnx.Rngs | None = None,
            **config_changes) -> nnx.Module:
  """Our NNX model with the weights and config of an HF PyTorch Longformer.

  Args:
    source: an HF `Longformer*` model object, or a local directory with `config.json` and
      `model.safetensors` / `pytorch_model.bin`.
    model_class: one of our model classes; default the checkpoint's own. With another task (e.g.
      `LongformerForSequenceClassification` from allenai/longformer-base-4096, a masked LM), the
      encoder is loaded, the new head is initialised from `rngs`, the old head is dropped, and a
      warning names both.
    rngs: initialises parts the checkpoint lacks and the dropout streams; default nnx.Rngs(0).
    **config_changes: fields of `LongformerConfig` to set, e.g. `attention_impl`, `dtype`,
      `remat`, `num_labels` for a new head.

  Raises ValueError on a model type other than "longformer", an unknown architecture, or
  missing/unexpected weights (named).
  """
  hf_config, weights, arch = _read(source)
  model_type = hf_config.get("model_type")
  if model_type != "longformer":
    hint = "; use roberta_to_longformer" if model_type == "roberta" else ""
    raise ValueError(f"from_hf converts Longformer checkpoints; got model_type={model_type!r}"
                     f"{hint}")
  return _from_weights(hf_config, weights, arch, model_class, rngs, config_changes)


def _from_weights(hf_config: dict[str, Any], weights: dict[str, np.ndarray], arch: str | None,
                  model_class: type | None, rngs: nnx.Rngs | None,
                  config_changes: dict[str, Any]) -> nnx.Module:
  """Shared by from_hf and roberta_to_longformer, once weights have Longformer names."""
  arch = arch or _infer_architecture(weights)
  if arch not in MODEL_CLASSES:
    raise ValueError(f"unknown architecture {arch!r}; known: {sorted(MODEL_CLASSES)}")
  target = model_class or MODEL_CLASSES[arch]
  if target not in MODEL_CLASSES.values():
    raise ValueError(f"model_class={target!r} is not one of {sorted(MODEL_CLASSES)}")
  config = config_from_hf(hf_config, **config_changes)
  return _build(target, config, weights, same_task=target.__name__ == arch, rngs=rngs)


def to_hf(model: nnx.Module):
  """The HF PyTorch model (same class name, eval mode) computing what `model` computes.

  Needs torch and transformers. Raises ValueError for what HF Longformer cannot express
  (causal mode, dilation).
  """
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  name = type(model).__name__
  if MODEL_CLASSES.get(name) is not type(model):
    raise TypeError(f"to_hf converts {sorted(MODEL_CLASSES)}; got {type(model)}")
  config = model.config
  hf_config = config_to_hf(config, architecture=name)
  hf_class = getattr(transformers, name)
  if name == "LongformerModel":
    hf_model = hf_class(hf_config, add_pooling_layer=model.pooler is not None)
  else:
    hf_model = hf_class(hf_config)
  hf_shapes = {k: tuple(v.shape) for k, v in hf_model.state_dict().items()}
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  state_dict = {}
  for hf_name, path in _param_names(type(model), config, _has_pooler(model)).items():
    value = params
    for key in path:
      value = value[key]
    w = _to_hf(hf_name, np.asarray(value, np.float32), hf_shapes[hf_name])
    state_dict[hf_name] = torch.from_numpy(np.array(w))  # a writable, contiguous copy
  for copy, source in _TIED.items():
    if copy in hf_shapes:
      state_dict[copy] = state_dict[source]
  hf_model.load_state_dict(state_dict, strict=True)
  return hf_model.eval()


# ----------------------------------------------------------------------------------------------
# Making RoBERTa long.


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
  hf_config, weights, arch = _read(source)
  if hf_config.get("model_type") != "roberta":
    raise ValueError(f"roberta_to_longformer converts RoBERTa checkpoints; got "
                     f"model_type={hf_config.get('model_type')!r}")
  if max_positions < 1 or window < 1:
    raise ValueError(f"max_positions={max_positions} and window={window} must be >= 1")
  weights = {("longformer." + k.removeprefix("roberta.")) if k.startswith("roberta.") else k: v
             for k, v in weights.items()}
  offset = hf_config.get("pad_token_id", _HF_DEFAULTS["pad_token_id"]) + 1
  for k in [k for k in weights if k.endswith(".attention.self.query.weight")]:
    for proj in ("query", "key", "value"):
      for leaf in ("weight", "bias"):
        local = k.replace(".query.weight", f".{proj}.{leaf}")
        weights[local.replace(f".{proj}.", f".{proj}_global.")] = weights[local].copy()
  pos_name = next(k for k in weights if k.endswith("embeddings.position_embeddings.weight"))
  old = weights[pos_name]
  learned = old[offset:]  # rows below the offset belong to padding (and an unused row 0)
  reps = -(-max_positions // len(learned))
  weights[pos_name] = np.concatenate([old[:offset], np.tile(learned, (reps, 1))[:max_positions]])
  long_config = dict(hf_config, model_type="longformer", attention_window=2 * window,
                     max_position_embeddings=max_positions + offset)
  arch = arch.replace("Roberta", "Longformer") if arch else None
  return _from_weights(long_config, weights, arch, None, rngs, config_changes)
