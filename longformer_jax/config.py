"""Model configurations: `LongformerConfig` (the HF-compatible encoder), `CharLMConfig` (the
paper's character-level LM) and `LEDConfig` (the encoder-decoder of paper §6), with named presets.

The first two share one vocabulary (`TransformerConfig`); `LEDConfig` has HF's LED names
(`d_model`, `encoder_layers`, ...). All take HF transformers' field names, so checkpoints map one to
one, with one deliberate difference: `attention_window` is ONE-SIDED here (a query sees `window`
keys on each side), while HF stores the total window. `longformer_jax.convert` halves and
doubles it at the boundary; nothing else in this package ever sees a total window
(docs/design.md §3).

Every config checks its fields when it is built, by type and range, before anything is sized
from them: sizes within the `MAX_*` bounds below, `layer_norm_eps` finite and > 0, probabilities
in [0, 1). A config read from a file (model.json, an HF config.json, a run record) gets the same
checks as one written in code (docs/checkpoints.md).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from longformer_jax import ops
from longformer_jax.attention import GLOBAL_PROJECTIONS
from longformer_jax.layers import activation

_IntOrTuple = int | tuple

# Bounds on the sizes a config may ask for, checked before anything is allocated from them (a
# config read from a file may say num_hidden_layers=10**9). Far above any real model: the
# largest HF vocabularies hold ~256k tokens, Longformer and LED hold 4k-16k positions.
MAX_LAYERS = 1024  # per stack (encoder, decoder)
MAX_HEADS = 1024
MAX_WIDTH = 1 << 18  # hidden_size / d_model and the feed-forward sizes
MAX_VOCAB = 1 << 22  # vocab_size, type_vocab_size and token ids
MAX_POSITIONS = 1 << 22  # position tables, windows and dilations
MAX_LABELS = 1 << 16  # classes of a classification head


class _FrozenConfig:
  """What every frozen dataclass config here shares: canonical field values, `replace`, and JSON
  round trips (`to_dict` / `from_dict`, used by `longformer_jax.checkpoint`)."""

  def _check_types(self) -> None:
    """Every field of the type of its default, before anything is sized from it: a config read
    from a file (model.json, an HF config.json, a run record) may hold anything JSON can."""
    for field in dataclasses.fields(self):
      value, default = getattr(self, field.name), field.default
      if field.type == "_IntOrTuple":
        continue  # an int or one per layer: checked by `layer_windows` / `layer_dilations`
      if isinstance(default, bool):
        ok, expected = isinstance(value, bool), "true or false"
      elif isinstance(default, int):
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "an int"
      elif isinstance(default, float):
        ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
              and math.isfinite(value))
        expected = "a finite number"
      elif isinstance(default, str):
        ok, expected = isinstance(value, str), "a string"
      else:
        continue  # dtypes: checked by `_canonicalize`
      if not ok:
        raise ValueError(f"{field.name}={value!r} must be {expected}")

  def _canonicalize(self, sequence_fields: tuple[str, ...]) -> None:
    """Called by `__post_init__`: JSON and HF configs give lists, stored as tuples so the config
    stays hashable and comparable; dtypes become `jnp.dtype`s, so that 'bfloat16' and
    jnp.bfloat16 give equal configs."""
    for name in sequence_fields:
      value = getattr(self, name)
      if isinstance(value, list):
        value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        object.__setattr__(self, name, value)
    for name in ("dtype", "param_dtype"):
      value = getattr(self, name)
      if isinstance(value, (dict, list, tuple)):  # jnp.dtype would read a JSON dict or list
        raise TypeError(f"{name}={value!r} is not a dtype")
      try:
        object.__setattr__(self, name, jnp.dtype(value))
      except (TypeError, ValueError) as e:
        raise TypeError(f"{name}={value!r} is not a dtype") from e
      if not jnp.issubdtype(getattr(self, name), jnp.floating):
        raise ValueError(f"{name}={getattr(self, name).name} must be a floating dtype "
                         "(float32, bfloat16, float16)")

  def replace(self, **changes):
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready fields (dtypes as names); `from_dict` inverts it."""
    d = dataclasses.asdict(self)
    d["dtype"] = self.dtype.name
    d["param_dtype"] = self.param_dtype.name
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]):
    if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
      raise ValueError(f"a {cls.__name__} must be a JSON object of its fields, got "
                       f"{type(d).__name__}")
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
      raise ValueError(f"unknown {cls.__name__} fields: {unknown}")
    return cls(**d)


@dataclasses.dataclass(frozen=True)
class TransformerConfig(_FrozenConfig):
  """The fields every model here has. Subclasses add their own and choose other defaults.

  attention_window: one-sided; an int for every layer or one int per layer.
  attention_dilation: an int for every layer and head, or one entry per layer, each an int or
    one int per head.
  dtype: compute dtype of the matmuls; param_dtype: dtype of the parameters (bf16 compute with
    float32 parameters works). Softmax and LayerNorm statistics are float32 whatever `dtype` is.
  remat: recompute each layer's activations in the backward pass (memory for compute).
  """

  vocab_size: int = 50265
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  intermediate_size: int = 3072
  hidden_act: str = "gelu"
  hidden_dropout_prob: float = 0.1
  layer_norm_eps: float = 1e-5
  initializer_range: float = 0.02
  attention_window: _IntOrTuple = 256
  attention_dilation: _IntOrTuple = 1
  attention_impl: str = "auto"
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat: bool = False

  def __post_init__(self):
    self._check_types()
    for name, maximum in (("vocab_size", MAX_VOCAB), ("hidden_size", MAX_WIDTH),
                          ("num_hidden_layers", MAX_LAYERS),
                          ("num_attention_heads", MAX_HEADS),
                          ("intermediate_size", MAX_WIDTH)):
      _check_positive_int(name, getattr(self, name), maximum)
    _check_eps("layer_norm_eps", self.layer_norm_eps)
    _check_real("initializer_range", self.initializer_range, minimum=0)
    if self.hidden_size % self.num_attention_heads:
      raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of "
                       f"num_attention_heads={self.num_attention_heads}")
    activation(self.hidden_act)  # raises on a name it does not know
    if not 0.0 <= self.hidden_dropout_prob < 1.0:
      raise ValueError(f"hidden_dropout_prob must be in [0, 1), got {self.hidden_dropout_prob}")
    if self.attention_impl not in ("auto",) + ops.IMPLS:
      raise ValueError(f"attention_impl={self.attention_impl!r} is not one of "
                       f"{('auto',) + ops.IMPLS}")
    self._canonicalize(("attention_window", "attention_dilation"))
    # Evaluate the per-layer views once: they raise on bad windows/dilations.
    _ = self.layer_windows, self.layer_dilations

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_attention_heads

  @property
  def layer_windows(self) -> tuple[int, ...]:
    """One-sided window of every layer."""
    return check_windows(_per_layer(self.attention_window, self.num_hidden_layers,
                                    "attention_window"), self.num_hidden_layers)

  @property
  def layer_dilations(self) -> tuple[tuple[int, ...], ...]:
    """Dilation of every head of every layer: [num_hidden_layers][num_attention_heads]."""
    per_layer = _per_layer(self.attention_dilation, self.num_hidden_layers, "attention_dilation")
    dilations = []
    for layer, d in enumerate(per_layer):
      heads = _per_layer(d, self.num_attention_heads, f"attention_dilation of layer {layer}")
      for h in heads:
        if not isinstance(h, int) or isinstance(h, bool) or not 1 <= h <= MAX_POSITIONS:
          raise ValueError(f"attention_dilation of layer {layer} must hold ints >= 1 (at most "
                           f"{MAX_POSITIONS}), got {d!r}")
      dilations.append(heads)
    return tuple(dilations)


@dataclasses.dataclass(frozen=True)
class LongformerConfig(TransformerConfig):
  """Hyperparameters of a Longformer encoder and its task heads (HF's `LongformerConfig`).

  Defaults are allenai/longformer-base-4096 (`base()`); `large()` is allenai/longformer-large-4096
  and `tiny()` a test size. `max_position_embeddings` counts RoBERTa's offset:
  positions start at `pad_token_id + 1`, so 4098 holds 4096 tokens (see `max_sequence_length`).
  """

  # HF applies dropout to attention probabilities; the banded attention op never materialises
  # them, so this value is carried for checkpoint round trips but not applied (docs/models.md).
  attention_probs_dropout_prob: float = 0.1
  max_position_embeddings: int = 4098
  type_vocab_size: int = 1
  pad_token_id: int = 1
  bos_token_id: int = 0
  eos_token_id: int = 2
  sep_token_id: int = 2
  # Not in HF: a causal band (no global tokens then).
  causal: bool = False
  num_labels: int = 2  # classes of the classification heads (HF derives it from id2label)
  # Not in HF: "separate" (HF's and the paper's §3.1: global attention has its own q/k/v),
  # "shared" (global attention through the band's q/k/v: an ablation) or "none".
  global_projections: str = "separate"

  def __post_init__(self):
    super().__post_init__()
    for name, maximum in (("max_position_embeddings", MAX_POSITIONS),
                          ("type_vocab_size", MAX_VOCAB), ("num_labels", MAX_LABELS)):
      _check_positive_int(name, getattr(self, name), maximum)
    if not 0.0 <= self.attention_probs_dropout_prob < 1.0:
      raise ValueError(f"attention_probs_dropout_prob must be in [0, 1), got "
                       f"{self.attention_probs_dropout_prob}")
    for name in ("bos_token_id", "eos_token_id", "sep_token_id"):
      if not 0 <= getattr(self, name) < self.vocab_size:
        raise ValueError(f"{name}={getattr(self, name)} is outside the vocabulary "
                         f"(vocab_size={self.vocab_size})")
    if self.global_projections not in GLOBAL_PROJECTIONS:
      raise ValueError(f"global_projections must be one of {GLOBAL_PROJECTIONS}, got "
                       f"{self.global_projections!r}")
    if not 0 <= self.pad_token_id < self.vocab_size:
      raise ValueError(f"pad_token_id={self.pad_token_id} is outside the vocabulary "
                       f"(vocab_size={self.vocab_size})")

  @property
  def max_sequence_length(self) -> int:
    """The longest input the position table holds (RoBERTa positions start at pad_token_id+1)."""
    return self.max_position_embeddings - self.pad_token_id - 1

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

  @classmethod
  def tiny(cls, **changes) -> LongformerConfig:
    """A model for tests and demos: 2 layers, hidden 64, 4 heads, intermediate 128, one-sided
    window 32, vocabulary 512, positions for 4,096 tokens, no dropout."""
    shape = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, attention_window=32, max_position_embeddings=4098,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return cls(**{**shape, **changes})


_ATTENTIONS = ("band", "full")


@dataclasses.dataclass(frozen=True)
class CharLMConfig(TransformerConfig):
  """Shape and behaviour of a `LongformerForCausalLM` (paper §4). Presets: `tiny/small/large()`.

  attention_window: the ONE-SIDED causal window of each layer (query i sees keys i - d*t,
    t = 0..w); the staged schedule overrides it per stage at call time.
  attention: "band" (Longformer) or "full" (dense causal attention, a baseline).
  Parameters, LayerNorm, softmax, the residual stream and logits stay float32 whatever `dtype`
  (the matmuls' compute dtype) is.
  """

  vocab_size: int = 256
  hidden_size: int = 512
  num_hidden_layers: int = 12
  num_attention_heads: int = 8
  intermediate_size: int = 2048
  hidden_act: str = "gelu_new"  # jax.nn.gelu's default, the tanh approximation
  hidden_dropout_prob: float = 0.0
  attention_window: _IntOrTuple = 32
  attention: str = "band"
  tie_word_embeddings: bool = True
  rope_base: float = 10_000.0

  def __post_init__(self):
    super().__post_init__()
    if self.vocab_size < 2:
      raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
    if self.head_dim % 2:
      raise ValueError(f"rotary positions need an even head_dim, got {self.head_dim} "
                       f"(hidden_size={self.hidden_size}, "
                       f"num_attention_heads={self.num_attention_heads})")
    if self.attention not in _ATTENTIONS:
      raise ValueError(f"attention must be one of {_ATTENTIONS}, got {self.attention!r}")
    _check_real("rope_base", self.rope_base, above=1)

  @classmethod
  def tiny(cls, **changes) -> CharLMConfig:
    """The CPU demo model: 4 layers, hidden 128, 0.8M parameters. Sized for ~10 minutes of 2 CPU
    cores: at that budget a smaller model seeing more bytes beats a larger one seeing fewer."""
    return cls(**{**dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
                         intermediate_size=512, attention_window=growing_windows(32, 128, 4)),
                  **changes})

  @classmethod
  def small(cls, **changes) -> CharLMConfig:
    """The paper's small char-LM (paper Appendix B, Table 12): 12 layers, 8 heads, hidden 512,
    dropout 0.2, pre-LayerNorm, GELU. First-stage windows 32 -> 512 from bottom to top layer
    (paper §4.2.2 and Table 4, "Increasing w (from 32 to 512)" with the phase-1 configuration;
    the paper does not say how the layers in between are spaced, linear here). Dilation on 2
    heads of layers 6-11, growing 2, 3, 4 (`_PAPER_DILATIONS_SMALL`). intermediate_size 2048
    (4 x hidden) is not stated in the paper; it is Transformer-XL's enwik8 base inner size, which
    the paper says it follows."""
    return cls(**{**dict(num_hidden_layers=12, attention_window=growing_windows(32, 512, 12),
                         attention_dilation=grouped_dilations(8, _PAPER_DILATIONS_SMALL),
                         hidden_dropout_prob=0.2, dtype=jnp.bfloat16),
                  **changes})

  @classmethod
  def large(cls, **changes) -> CharLMConfig:
    """The paper's large char-LM (paper Appendix B, Table 12): 30 layers, dropout 0.4, dilation
    on 2 heads of layers 15-29 (`_PAPER_DILATIONS_LARGE`); otherwise as `small`."""
    return cls(**{**dict(num_hidden_layers=30, attention_window=growing_windows(32, 512, 30),
                         attention_dilation=grouped_dilations(8, _PAPER_DILATIONS_LARGE),
                         hidden_dropout_prob=0.4, dtype=jnp.bfloat16, remat=True),
                  **changes})


@dataclasses.dataclass(frozen=True)
class LEDConfig(_FrozenConfig):
  """Hyperparameters of the Longformer-Encoder-Decoder (paper §6; HF's `LEDConfig` field names).

  Defaults are allenai/led-base-16384 (`base()`); `large()` is allenai/led-large-16384 and
  `tiny()` a test size. LED is BART with Longformer self-attention in the encoder: the encoder
  layers are `LongformerLayer`s (post-LN, global tokens with their own projections), the decoder
  is BART's (causal self-attention, cross-attention). Positions are learned, with no offset rows
  (BART keeps 2), and token embeddings are not scaled.

  attention_window: ONE-SIDED window of every ENCODER layer (an int, or one per encoder layer);
    HF's is the total (led-base: 1024 there, 512 here). The decoder attends densely.
  max_encoder_position_embeddings / max_decoder_position_embeddings: the longest encoder input
    and decoder input (position i uses row i).
  attention_dropout and activation_dropout (0.0 in the allenai checkpoints) are carried for
    checkpoint round trips but not applied; `dropout` is (on every residual branch and the
    embeddings, as in HF).
  attention_impl, dtype, param_dtype, remat: ours, as in `TransformerConfig`.
  """

  vocab_size: int = 50265
  d_model: int = 768
  encoder_layers: int = 6
  decoder_layers: int = 6
  encoder_attention_heads: int = 12
  decoder_attention_heads: int = 12
  encoder_ffn_dim: int = 3072
  decoder_ffn_dim: int = 3072
  max_encoder_position_embeddings: int = 16384
  max_decoder_position_embeddings: int = 1024
  activation_function: str = "gelu"
  dropout: float = 0.1
  attention_dropout: float = 0.0
  activation_dropout: float = 0.0
  init_std: float = 0.02
  pad_token_id: int = 1
  bos_token_id: int = 0
  eos_token_id: int = 2
  decoder_start_token_id: int = 2
  attention_window: _IntOrTuple = 512
  attention_impl: str = "auto"
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat: bool = False

  def __post_init__(self):
    self._check_types()
    for name, maximum in (("vocab_size", MAX_VOCAB), ("d_model", MAX_WIDTH),
                          ("encoder_layers", MAX_LAYERS), ("decoder_layers", MAX_LAYERS),
                          ("encoder_attention_heads", MAX_HEADS),
                          ("decoder_attention_heads", MAX_HEADS),
                          ("encoder_ffn_dim", MAX_WIDTH), ("decoder_ffn_dim", MAX_WIDTH),
                          ("max_encoder_position_embeddings", MAX_POSITIONS),
                          ("max_decoder_position_embeddings", MAX_POSITIONS)):
      _check_positive_int(name, getattr(self, name), maximum)
    _check_real("init_std", self.init_std, minimum=0)
    for name in ("encoder_attention_heads", "decoder_attention_heads"):
      if self.d_model % getattr(self, name):
        raise ValueError(f"d_model={self.d_model} is not a multiple of "
                         f"{name}={getattr(self, name)}")
    activation(self.activation_function)  # raises on a name it does not know
    for name in ("dropout", "attention_dropout", "activation_dropout"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < self.vocab_size:
        raise ValueError(f"{name}={value!r} is not a token id of the vocabulary "
                         f"(vocab_size={self.vocab_size})")
    if self.attention_impl not in ("auto",) + ops.IMPLS:
      raise ValueError(f"attention_impl={self.attention_impl!r} is not one of "
                       f"{('auto',) + ops.IMPLS}")
    self._canonicalize(("attention_window",))
    _ = self.layer_windows

  @property
  def layer_windows(self) -> tuple[int, ...]:
    """One-sided window of every encoder layer."""
    return check_windows(_per_layer(self.attention_window, self.encoder_layers,
                                    "attention_window"), self.encoder_layers)

  @classmethod
  def base(cls, **changes) -> LEDConfig:
    """allenai/led-base-16384: BART-base (6 + 6 layers, d_model 768, 12 heads, ffn 3072) with
    16,384 encoder positions (BART's 1,024 copied 16 times, paper §6) and a window of 512 per
    side (HF: attention_window 1024); 1,024 decoder positions."""
    return cls(**changes)

  @classmethod
  def large(cls, **changes) -> LEDConfig:
    """allenai/led-large-16384: BART-large (12 + 12 layers, d_model 1024, 16 heads, ffn 4096),
    positions and windows as `base`."""
    shape = dict(d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                 decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096)
    return cls(**{**shape, **changes})

  @classmethod
  def tiny(cls, **changes) -> LEDConfig:
    """A test model: 2 + 2 layers, d_model 64, 4 heads (head_dim 16, the smallest the Pallas
    kernels take), encoder windows 2 and 4, 64 encoder and 32 decoder positions."""
    shape = dict(vocab_size=64, d_model=64, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=96,
                 decoder_ffn_dim=80, max_encoder_position_embeddings=64,
                 max_decoder_position_embeddings=32, attention_window=(2, 4))
    return cls(**{**shape, **changes})


def growing_windows(first: int, last: int, num_layers: int) -> tuple[int, ...]:
  """Windows growing linearly from the bottom layer to the top (the paper's layout), rounded."""
  if num_layers == 1:
    return (last,)
  step = (last - first) / (num_layers - 1)
  return tuple(int(round(first + step * i)) for i in range(num_layers))


def grouped_dilations(num_heads: int, groups: Sequence[tuple[int, int]], *,
                      dilated_heads: int = 2) -> tuple[tuple[int, ...], ...]:
  """Per-layer dilations from (num_layers, dilation) runs listed bottom to top: each run's
  `dilation` on the last `dilated_heads` heads of its layers, 1 on the other heads."""
  out = []
  for num_layers, dilation in groups:
    out += [(1,) * (num_heads - dilated_heads) + (dilation,) * dilated_heads] * num_layers
  return tuple(out)


# Paper Appendix B, Table 12: "Dilation (small model) 0 (layers 0-5), 1 (layers 6-7), 2 (layers
# 8-9), 3 (layers 10-11)", large "0 (0-14), 1 (15-19), 2 (20-24), 3 (25-29)", on "2 heads only".
# The table's 0 is "no dilation", so its numbers are read as the gap between attended keys and
# the dilation here (keys i - d*t, d = 1 is contiguous) is that number + 1. The paper does not
# state its unit; the other reading (d = 1, 2, 3) would leave layers 6-7 / 15-19 undilated.
_PAPER_DILATIONS_SMALL = ((6, 1), (2, 2), (2, 3), (2, 4))
_PAPER_DILATIONS_LARGE = ((15, 1), (5, 2), (5, 3), (5, 4))


def check_windows(windows: Sequence[int], num_layers: int) -> tuple[int, ...]:
  """`windows` as a tuple, after checking it holds one one-sided window >= 1 per layer."""
  windows = tuple(windows)
  if len(windows) != num_layers:
    raise ValueError(f"windows need one entry per layer ({num_layers}), got {len(windows)}: "
                     f"{windows}")
  for layer, w in enumerate(windows):
    if not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= MAX_POSITIONS:
      raise ValueError(f"attention_window of layer {layer} must be an int >= 1 (one-sided, at "
                       f"most {MAX_POSITIONS}), got {w!r}")
  return windows


def _check_positive_int(name: str, value, maximum: int | None = None) -> None:
  """An int in [1, maximum], checked before anything is sized from it."""
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")
  if maximum is not None and value > maximum:
    raise ValueError(f"{name}={value!r} is over this library's bound of {maximum}")


def _check_real(name: str, value, *, minimum: float | None = None,
                above: float | None = None) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
    raise ValueError(f"{name} must be a finite number, got {value!r}")
  if minimum is not None and value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
  if above is not None and value <= above:
    raise ValueError(f"{name} must be > {above}, got {value!r}")


def _check_eps(name: str, value) -> None:
  """A LayerNorm epsilon: finite and > 0 (0 divides by zero on a constant input, a negative one
  makes every output NaN)."""
  if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
      or value <= 0):
    raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _per_layer(value, n: int, name: str) -> tuple:
  """An int (or other scalar) repeated n times, or a length-n tuple checked."""
  if isinstance(value, tuple):
    if len(value) != n:
      raise ValueError(f"{name} has {len(value)} entries, expected {n}: {value!r}")
    return value
  return (value,) * n
