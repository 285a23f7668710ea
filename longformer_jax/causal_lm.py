"""Autoregressive character-level Longformer (the paper's §4 language model), in Flax NNX.

A pre-LayerNorm decoder over bytes: causal band attention with a window per layer and a
dilation per head (through `longformer_jax.ops.longformer_attention`), rotary positions, a GELU
MLP, and a (tied or untied) byte embedding. `attention="full"` swaps the band for dense causal
attention with everything else unchanged, as a baseline.

Positions: the paper used Transformer-XL-style relative sinusoidal position terms. Rotary
embeddings are also relative (the score of q_i . k_j depends on i - j only), need no extra
per-layer parameters or the O(window) relative-bias bookkeeping in the attention kernel, and keep
the attention op a plain `softmax(q k^T) v` that every implementation (chunked einsums, Pallas,
cuDNN) already provides. Because nothing is tied to absolute positions, a model trained on short
sequences runs unchanged on longer ones (the staged schedule and the 32K-context evaluation rely
on this).

Parameters carry logical axis names (`vocab`, `embed`, `heads`, `mlp`, `norm`); the training code
maps them to mesh axes from outside (`longformer_jax.training.LOGICAL_RULES`).

Windows are a property of the *call*, not of the parameters: the staged schedule grows them
stage by stage, so `__call__` takes an optional `windows` tuple that overrides the config's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from longformer_jax import ops

_ATTENTIONS = ("band", "full")
_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class CharLMConfig:
  """Shape and behaviour of a `LongformerForCausalLM`. Presets: `char_tiny/small/large()`.

  windows: the ONE-SIDED causal window of each layer (query i sees keys i - d*t, t = 0..w).
  dilations: one tuple per layer with one dilation per head; None means no dilation anywhere.
  dtype: the compute dtype of matmuls; parameters, LayerNorm, softmax and logits stay float32.
  """
  vocab_size: int = 256
  num_layers: int = 12
  hidden: int = 512
  num_heads: int = 8
  mlp_dim: int = 2048
  windows: tuple[int, ...] = (32,) * 12
  dilations: tuple[tuple[int, ...], ...] | None = None
  attention: str = "band"
  attention_impl: str = "auto"
  tie_embeddings: bool = True
  dropout: float = 0.0
  rope_base: float = 10_000.0
  dtype: str = "float32"
  remat: bool = False

  def __post_init__(self):
    if self.vocab_size < 2:
      raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
    if self.num_layers < 1:
      raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
    if self.hidden % self.num_heads:
      raise ValueError(
          f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}")
    if (self.hidden // self.num_heads) % 2:
      raise ValueError(f"rotary positions need an even head_dim, got "
                       f"{self.hidden // self.num_heads} (hidden={self.hidden}, "
                       f"num_heads={self.num_heads})")
    _check_windows(self.windows, self.num_layers)
    if self.dilations is not None:
      _check_dilations(self.dilations, self.num_layers, self.num_heads)
    if self.attention not in _ATTENTIONS:
      raise ValueError(f"attention must be one of {_ATTENTIONS}, got {self.attention!r}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
    if self.dtype not in _DTYPES:
      raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")

  @property
  def head_dim(self) -> int:
    return self.hidden // self.num_heads

  def layer_dilation(self, layer: int) -> tuple[int, ...]:
    if self.dilations is None:
      return (1,) * self.num_heads
    return tuple(self.dilations[layer])


def _check_windows(windows: Sequence[int], num_layers: int) -> None:
  if len(windows) != num_layers:
    raise ValueError(f"windows needs one entry per layer ({num_layers}), got {len(windows)}: "
                     f"{tuple(windows)}")
  if any(int(w) != w or w < 0 for w in windows):
    raise ValueError(f"windows must be non-negative integers, got {tuple(windows)}")


def _check_dilations(dilations, num_layers: int, num_heads: int) -> None:
  if len(dilations) != num_layers:
    raise ValueError(f"dilations needs one tuple per layer ({num_layers}), got {len(dilations)}")
  for layer, per_head in enumerate(dilations):
    if len(per_head) != num_heads or any(int(d) != d or d < 1 for d in per_head):
      raise ValueError(f"dilations[{layer}] must hold {num_heads} integers >= 1, "
                       f"got {tuple(per_head)}")


def layer_windows(first: int, last: int, num_layers: int) -> tuple[int, ...]:
  """Windows growing linearly from the bottom layer to the top (the paper's layout), rounded."""
  if num_layers == 1:
    return (last,)
  step = (last - first) / (num_layers - 1)
  return tuple(int(round(first + step * i)) for i in range(num_layers))


def grouped_dilations(num_heads: int, groups: Sequence[tuple[int, int]], *,
                      dilated_heads: int = 2):
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


def char_tiny() -> CharLMConfig:
  """The CPU demo model: 4 layers, hidden 128, 0.8M parameters. Sized for ~10 minutes of 2 CPU
  cores: at that budget a smaller model seeing more bytes beats a larger one seeing fewer."""
  return CharLMConfig(
      num_layers=4, hidden=128, num_heads=4, mlp_dim=512,
      windows=layer_windows(32, 128, 4), dropout=0.0)


def char_small() -> CharLMConfig:
  """The paper's small char-LM (paper Appendix B, Table 12): 12 layers, 8 heads, hidden 512,
  dropout 0.2, pre-LayerNorm, GELU. First-stage windows 32 -> 512 from bottom to top layer (paper
  §4.2.2 and Table 4, "Increasing w (from 32 to 512)" with the phase-1 configuration; the paper
  does not say how the layers in between are spaced, linear here). Dilation on 2 heads of layers
  6-11, growing 2, 3, 4 (`_PAPER_DILATIONS_SMALL`). mlp_dim 2048 (4 x hidden) is not stated in
  the paper; it is Transformer-XL's enwik8 base inner size, which the paper says it follows."""
  return CharLMConfig(
      num_layers=12, hidden=512, num_heads=8, mlp_dim=2048,
      windows=layer_windows(32, 512, 12),
      dilations=grouped_dilations(8, _PAPER_DILATIONS_SMALL), dropout=0.2, dtype="bfloat16")


def char_large() -> CharLMConfig:
  """The paper's large char-LM (paper Appendix B, Table 12): 30 layers, dropout 0.4, dilation on
  2 heads of layers 15-29 (`_PAPER_DILATIONS_LARGE`); otherwise as `char_small`."""
  return CharLMConfig(
      num_layers=30, hidden=512, num_heads=8, mlp_dim=2048,
      windows=layer_windows(32, 512, 30),
      dilations=grouped_dilations(8, _PAPER_DILATIONS_LARGE), dropout=0.4, dtype="bfloat16",
      remat=True)


PRESETS = {"char_tiny": char_tiny, "char_small": char_small, "char_large": char_large}


def rotary(x_BxLxHxD: jax.Array, base: float) -> jax.Array:
  """Rotates pairs (x[:D/2], x[D/2:]) of every head by angle position * base^(-2k/D).

  Computed in float32: in bf16 the angles of far positions lose the low bits that carry the
  fine relative offsets.
  """
  seq, head_dim = x_BxLxHxD.shape[1], x_BxLxHxD.shape[-1]
  inv_freq_K = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angle_LxK = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq_K[None, :]
  cos_Lx1xK = jnp.cos(angle_LxK)[:, None, :]
  sin_Lx1xK = jnp.sin(angle_LxK)[:, None, :]
  x = x_BxLxHxD.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos_Lx1xK - x2 * sin_Lx1xK, x2 * cos_Lx1xK + x1 * sin_Lx1xK], -1)
  return out.astype(x_BxLxHxD.dtype)


def _dense(din, dout, axes, dtype, rngs, scale=1.0):
  init = nnx.initializers.variance_scaling(scale, "fan_in", "truncated_normal")
  return nnx.Linear(din, dout, dtype=dtype, param_dtype=jnp.float32,
                    kernel_init=nnx.with_partitioning(init, axes),
                    bias_init=nnx.with_partitioning(nnx.initializers.zeros, (axes[1],)),
                    rngs=rngs)


def _layer_norm(hidden, rngs):
  # Statistics in float32 whatever the compute dtype (dtype=float32): bf16 variances of a
  # residual stream with large outliers are the classic source of divergence.
  return nnx.LayerNorm(hidden, epsilon=1e-5, dtype=jnp.float32, param_dtype=jnp.float32,
                       scale_init=nnx.with_partitioning(nnx.initializers.ones, ("norm",)),
                       bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("norm",)),
                       rngs=rngs)


def _annotate_only():
  """Flax >= 0.12 places annotated variables on the active mesh at creation; here the logical
  names are only recorded, and the training code maps them to a mesh from outside."""
  if hasattr(nnx, "use_eager_sharding"):
    return nnx.use_eager_sharding(False)
  return contextlib.nullcontext()


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention with rotary positions over a dilated band (or dense)."""

  def __init__(self, cfg: CharLMConfig, layer: int, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.num_heads = cfg.num_heads
    self.head_dim = cfg.head_dim
    self.rope_base = cfg.rope_base
    self.attention = cfg.attention
    self.impl = cfg.attention_impl
    self.dilation = cfg.layer_dilation(layer)
    self.query = _dense(cfg.hidden, cfg.hidden, ("embed", "heads"), dtype, rngs)
    self.key = _dense(cfg.hidden, cfg.hidden, ("embed", "heads"), dtype, rngs)
    self.value = _dense(cfg.hidden, cfg.hidden, ("embed", "heads"), dtype, rngs)
    # Output projections start small (GPT-2's 1/sqrt(2 * layers)) so that the residual stream
    # of a deep pre-LN stack does not grow with depth at initialisation.
    self.out = _dense(cfg.hidden, cfg.hidden, ("heads", "embed"), dtype, rngs,
                      scale=1.0 / (2 * cfg.num_layers))

  def __call__(self, x_BxLxE: jax.Array, window: int) -> jax.Array:
    batch, seq, _ = x_BxLxE.shape
    split = lambda t: t.reshape(batch, seq, self.num_heads, self.head_dim)
    q_BxLxHxD = rotary(split(self.query(x_BxLxE)), self.rope_base)
    k_BxLxHxD = rotary(split(self.key(x_BxLxE)), self.rope_base)
    v_BxLxHxD = split(self.value(x_BxLxE))
    if self.attention == "full":
      o_BxLxHxD = jax.nn.dot_product_attention(q_BxLxHxD, k_BxLxHxD, v_BxLxHxD, is_causal=True)
    else:
      dilation = self.dilation if len(set(self.dilation)) > 1 else self.dilation[0]
      o_BxLxHxD = ops.longformer_attention(
          q_BxLxHxD, k_BxLxHxD, v_BxLxHxD, window=window, dilation=dilation, causal=True,
          impl=self.impl)
    return self.out(o_BxLxHxD.reshape(batch, seq, self.num_heads * self.head_dim))


class Block(nnx.Module):
  """x + attn(LN(x)), then x + mlp(LN(x)): pre-LayerNorm, dropout on each branch output."""

  def __init__(self, cfg: CharLMConfig, layer: int, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.ln_attn = _layer_norm(cfg.hidden, rngs)
    self.attn = CausalSelfAttention(cfg, layer, rngs=rngs)
    self.ln_mlp = _layer_norm(cfg.hidden, rngs)
    self.mlp_in = _dense(cfg.hidden, cfg.mlp_dim, ("embed", "mlp"), dtype, rngs)
    self.mlp_out = _dense(cfg.mlp_dim, cfg.hidden, ("mlp", "embed"), dtype, rngs,
                          scale=1.0 / (2 * cfg.num_layers))
    self.dropout = nnx.Dropout(cfg.dropout)

  def __call__(self, x_BxLxE, window: int, dropout_key: jax.Array | None):
    deterministic = dropout_key is None
    keys = jax.random.split(dropout_key, 2) if dropout_key is not None else (None, None)
    h = self.attn(self.ln_attn(x_BxLxE), window)
    # The residual stream stays float32: bf16 branch outputs are added to a float32 sum.
    x_BxLxE = x_BxLxE + self.dropout(h, deterministic=deterministic, rngs=keys[0])
    h = self.mlp_out(jax.nn.gelu(self.mlp_in(self.ln_mlp(x_BxLxE))))
    return x_BxLxE + self.dropout(h, deterministic=deterministic, rngs=keys[1])


class LongformerForCausalLM(nnx.Module):
  """Bytes in, next-byte logits out: `model(tokens_BxL) -> logits_BxLxV` (float32)."""

  def __init__(self, cfg: CharLMConfig, *, rngs: nnx.Rngs):
    with _annotate_only():
      self._build(cfg, rngs)

  def _build(self, cfg: CharLMConfig, rngs: nnx.Rngs):
    self.config = cfg
    dtype = jnp.dtype(cfg.dtype)
    self.embed = nnx.Embed(
        cfg.vocab_size, cfg.hidden, dtype=dtype, param_dtype=jnp.float32,
        embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed")),
        rngs=rngs)
    blocks = [Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)]
    # Flax 0.12 wants sub-modules in an nnx.List; older NNX took plain lists.
    self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks
    self.ln_final = _layer_norm(cfg.hidden, rngs)
    self.dropout = nnx.Dropout(cfg.dropout)
    if not cfg.tie_embeddings:
      self.head = _dense(cfg.hidden, cfg.vocab_size, ("embed", "vocab"), dtype, rngs)

  def __call__(self, tokens_BxL: jax.Array, *, windows: Sequence[int] | None = None,
               dropout_key: jax.Array | None = None) -> jax.Array:
    """windows: per-layer one-sided windows for this call (default: the config's).
    dropout_key: a PRNG key turns dropout on; None (the default) is deterministic."""
    x_BxLxE = self.embed(tokens_BxL.astype(jnp.int32)).astype(jnp.float32)
    return self.from_embeddings(x_BxLxE, windows=windows, dropout_key=dropout_key)

  def from_embeddings(self, x_BxLxE: jax.Array, *, windows: Sequence[int] | None = None,
                      dropout_key: jax.Array | None = None) -> jax.Array:
    """The network after the embedding lookup (differentiable w.r.t. its input: causality
    tests take gradients here)."""
    cfg = self.config
    windows = tuple(cfg.windows if windows is None else windows)
    _check_windows(windows, cfg.num_layers)
    if cfg.dropout == 0.0:
      dropout_key = None
    keys = [None] * (cfg.num_layers + 1)
    if dropout_key is not None:
      keys = list(jax.random.split(dropout_key, cfg.num_layers + 1))
    x_BxLxE = self.dropout(x_BxLxE, deterministic=keys[-1] is None, rngs=keys[-1])
    for block, window, key in zip(self.blocks, windows, keys):
      if cfg.remat:
        # Recompute each block's activations in the backward pass: memory O(layers * B*L*E)
        # instead of O(layers * B*L*(E + mlp)), the usual trade for the longest stages.
        x_BxLxE = _remat_block(window)(block, x_BxLxE, key)
      else:
        x_BxLxE = block(x_BxLxE, window, key)
    x_BxLxE = self.ln_final(x_BxLxE)
    if cfg.tie_embeddings:
      logits_BxLxV = self.embed.attend(x_BxLxE.astype(jnp.dtype(cfg.dtype)))
    else:
      logits_BxLxV = self.head(x_BxLxE)
    return logits_BxLxV.astype(jnp.float32)


def _remat_block(window: int):
  # The window is closed over, not passed: remat traces every argument, and the window must
  # stay a Python int (it fixes the band's shape).
  return nnx.remat(lambda block, x, key: block(x, window, key))


def next_byte_nll(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
  """Per-position cross-entropy in nats, float32 [B, L]."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits_BxLxV.astype(jnp.float32), targets_BxL.astype(jnp.int32))


def num_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
