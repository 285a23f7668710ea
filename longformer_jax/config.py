"""`LongformerConfig`: the hyperparameters of a Longformer encoder, with `base` and `large` presets.

Field names follow HF transformers' `LongformerConfig` so that checkpoints map one to one, with one
deliberate difference: `attention_window` is ONE-SIDED here (a query sees `window` keys on each
side), while HF stores the total window. `longformer_jax.convert` halves/doubles it at the
boundary; nothing else in this package ever sees a total window (DESIGN.md §2).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from longformer_jax import ops
from longformer_jax.layers import activation

_IntOrTuple = int | tuple


@dataclasses.dataclass(frozen=True)
class LongformerConfig:
  """Hyperparameters of a Longformer encoder and its task heads.

  Defaults are allenai/longformer-base-4096. `attention_window` is one-sided: an int for every
  layer or a tuple with one int per layer. `attention_dilation` is an int for every layer and head,
  or a tuple with one entry per layer, each an int or a tuple with one int per head.
  `max_position_embeddings` counts RoBERTa's offset: positions start at `pad_token_id + 1`, so
  4098 holds 4096 tokens (see `max_sequence_length`).
  """

  vocab_size: int = 50265
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  intermediate_size: int = 3072
  hidden_act: str = "gelu"
  hidden_dropout_prob: float = 0.1
  # HF applies dropout to attention probabilities; the banded attention op never materialises
  # them, so this value is carried for checkpoint round trips but not applied (docs/models.md).
  attention_probs_dropout_prob: float = 0.1
  max_position_embeddings: int = 4098
  type_vocab_size: int = 1
  initializer_range: float = 0.02
  layer_norm_eps: float = 1e-5
  pad_token_id: int = 1
  bos_token_id: int = 0
  eos_token_id: int = 2
  sep_token_id: int = 2
  attention_window: _IntOrTuple = 256  # one-sided, per layer
  attention_dilation: _IntOrTuple = 1  # per layer, per head
  # Not in HF: causal band (no global tokens then), the op's implementation, compute and
  # parameter dtypes (bf16 compute with float32 parameters works), per-layer rematerialisation.
  causal: bool = False
  attention_impl: str = "auto"
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat: bool = False
  num_labels: int = 2  # classes of the classification heads (HF derives it from id2label)

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size", "max_position_embeddings", "type_vocab_size", "num_labels"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.hidden_size % self.num_attention_heads:
      raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of "
                       f"num_attention_heads={self.num_attention_heads}")
    activation(self.hidden_act)  # raises on a name it does not know
    if self.attention_impl not in ("auto",) + ops.IMPLS:
      raise ValueError(f"attention_impl={self.attention_impl!r} is not one of "
                       f"{('auto',) + ops.IMPLS}")
    if not 0 <= self.pad_token_id < self.vocab_size:
      raise ValueError(f"pad_token_id={self.pad_token_id} is outside the vocabulary "
                       f"(vocab_size={self.vocab_size})")
    # JSON and HF configs give lists; store tuples so the config stays hashable and comparable.
    for name in ("attention_window", "attention_dilation"):
      value = getattr(self, name)
      if isinstance(value, list):
        value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        object.__setattr__(self, name, value)
    # Canonical dtypes, so that 'bfloat16' and jnp.bfloat16 give equal configs.
    for name in ("dtype", "param_dtype"):
      try:
        object.__setattr__(self, name, jnp.dtype(getattr(self, name)))
      except TypeError as e:
        raise TypeError(f"{name}={getattr(self, name)!r} is not a dtype") from e
    # Evaluate the per-layer views once: they raise on bad windows/dilations.
    self.layer_windows  # pylint: disable=pointless-statement
    self.layer_dilations  # pylint: disable=pointless-statement

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_attention_heads

  @property
  def max_sequence_length(self) -> int:
    """The longest input the position table holds (RoBERTa positions start at pad_token_id+1)."""
    return self.max_position_embeddings - self.pad_token_id - 1

  @property
  def layer_windows(self) -> tuple[int, ...]:
    """One-sided window of every layer."""
    windows = _per_layer(self.attention_window, self.num_hidden_layers, "attention_window")
    for layer, w in enumerate(windows):
      if not isinstance(w, int) or isinstance(w, bool) or w < 1:
        raise ValueError(f"attention_window of layer {layer} must be an int >= 1 (one-sided), "
                         f"got {w!r}")
    return windows

  @property
  def layer_dilations(self) -> tuple[tuple[int, ...], ...]:
    """Dilation of every head of every layer: [num_hidden_layers][num_attention_heads]."""
    per_layer = _per_layer(self.attention_dilation, self.num_hidden_layers, "attention_dilation")
    dilations = []
    for layer, d in enumerate(per_layer):
      heads = _per_layer(d, self.num_attention_heads, f"attention_dilation of layer {layer}")
      for h in heads:
        if not isinstance(h, int) or isinstance(h, bool) or h < 1:
          raise ValueError(f"attention_dilation of layer {layer} must hold ints >= 1, got {d!r}")
      dilations.append(heads)
    return tuple(dilations)

  def replace(self, **changes) -> LongformerConfig:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready fields (dtypes as names); `from_dict` inverts it."""
    d = dataclasses.asdict(self)
    d["dtype"] = self.dtype.name
    d["param_dtype"] = self.param_dtype.name
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> LongformerConfig:
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
      raise ValueError(f"unknown LongformerConfig fields: {unknown}")
    return cls(**d)

  @classmethod
  def base(cls, **changes) -> LongformerConfig:
    """allenai/longformer-base-4096: 12 layers, hidden 768, 12 heads, window 256 per side."""
    return cls(**changes)

  @classmethod
  def large(cls, **changes) -> LongformerConfig:
    """allenai/longformer-large-4096: 24 layers, hidden 1024, 16 heads, window 256 per side."""
    shape = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                 intermediate_size=4096)
    return cls(**{**shape, **changes})


def _per_layer(value, n: int, name: str) -> tuple:
  """An int (or other scalar) repeated n times, or a length-n tuple checked."""
  if isinstance(value, tuple):
    if len(value) != n:
      raise ValueError(f"{name} has {len(value)} entries, expected {n}: {value!r}")
    return value
  return (value,) * n
