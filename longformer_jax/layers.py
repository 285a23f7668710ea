"""The layer helpers every model here is built from: dense maps, LayerNorm, embeddings, rotary
positions, activations, rematerialisation, and the logical axis names parameters carry.

Logical axis names (the one vocabulary; a training mesh maps them to mesh axes from outside with
`nnx.logical_axis_rules` or `longformer_jax.training.sharding`; without rules parameters are
replicated):

  vocab   V   rows of the embedding / columns of the LM head
  embed   E   the hidden width of the residual stream
  heads   H   attention heads
  kv      D   head_dim
  mlp     F   the MLP's inner width
  norm    E   LayerNorm scales and biases (kept apart from `embed`: tiny, usually replicated)

Shape letters follow `longformer_jax.ops` (docs/design.md §4).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

LOGICAL_AXES = ("vocab", "embed", "heads", "kv", "mlp", "norm")

_ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # HF "gelu" is the erf form.
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}

Initializer = Callable[..., jax.Array]


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
  """The activation function HF calls `name`."""
  if name not in _ACTIVATIONS:
    raise ValueError(f"hidden_act={name!r} is not one of {sorted(_ACTIVATIONS)}")
  return _ACTIVATIONS[name]


def logical_axes(*names: str | None) -> dict:
  """Variable metadata giving the logical axis name of each dimension.

  Flax shards a variable when it is created if a mesh is set (`jax.set_mesh`) and eager sharding
  is on, mapping the names to mesh axes by `nnx.logical_axis_rules`; otherwise the names are only
  recorded, for sharding from outside later (`nnx.get_partition_spec`).
  """
  for name in names:
    if name is not None and name not in LOGICAL_AXES:
      raise ValueError(f"logical axis {name!r} is not one of {LOGICAL_AXES}")
  mesh_set = not jax.sharding.get_abstract_mesh().empty
  return {"out_sharding": names, "eager_sharding": nnx.using_eager_sharding() and mesh_set}


def dense(in_features: int | Sequence[int], out_features: int | Sequence[int],
          axes: tuple[str | None, ...], *, init: Initializer, dtype, param_dtype,
          rngs: nnx.Rngs) -> nnx.LinearGeneral:
  """A linear map with a zero-initialised bias and logical axis names.

  `axes` names every kernel dimension, input dimensions first; the bias takes the output names.
  Several input dimensions (e.g. heads and head_dim) are contracted together. `init` sees the
  kernel flattened to [prod(in), prod(out)], so fan-in based initialisers count the true fan-in.
  """
  in_shape = tuple(in_features) if isinstance(in_features, Sequence) else (in_features,)
  return nnx.LinearGeneral(
      in_shape, out_features, axis=tuple(range(-len(in_shape), 0)),
      kernel_init=init, kernel_metadata=logical_axes(*axes),
      bias_metadata=logical_axes(*axes[len(in_shape):]),
      dtype=dtype, param_dtype=param_dtype, rngs=rngs)


def layer_norm(size: int, eps: float, *, dtype, param_dtype, rngs: nnx.Rngs,
               two_pass_variance: bool = True) -> nnx.LayerNorm:
  """LayerNorm over the last axis with statistics in float32 whatever `dtype` is.

  two_pass_variance: E[(x - E[x])^2], as torch computes it (HF parity at 1e-5 needs it:
  E[x^2] - E[x]^2 loses digits on small activations); False takes flax's one-pass form, about
  10% faster on the char LM's small widths, whose pre-LN residual stream does not need it.
  """
  return nnx.LayerNorm(size, epsilon=eps, use_fast_variance=not two_pass_variance, dtype=dtype,
                       param_dtype=param_dtype,
                       scale_metadata=logical_axes("norm"), bias_metadata=logical_axes("norm"),
                       rngs=rngs)


def embed(num: int, size: int, axes: tuple[str | None, str], *, stddev: float, dtype,
          param_dtype, rngs: nnx.Rngs) -> nnx.Embed:
  return nnx.Embed(num, size, embedding_init=nnx.initializers.normal(stddev),
                   embedding_metadata=logical_axes(*axes),
                   dtype=dtype, param_dtype=param_dtype, rngs=rngs)


def rotary(x_BxNxHxD: jax.Array, base: float, positions_N: jax.Array | None = None) -> jax.Array:
  """Rotates pairs (x[:D/2], x[D/2:]) of every head by angle position * base^(-2k/D).

  The score q_i . k_j of rotated vectors depends on i - j only (relative positions). Computed in
  float32: in bf16 the angles of far positions lose the low bits that carry the fine offsets.
  positions_N: the rows' positions (default 0..N-1; decoding rotates a new key at its own).
  """
  seq, head_dim = x_BxNxHxD.shape[1], x_BxNxHxD.shape[-1]
  if head_dim % 2:
    raise ValueError(f"rotary positions need an even head_dim, got {head_dim}")
  if positions_N is None:
    positions_N = jnp.arange(seq)
  # [D/2] frequencies; angles, cos and sin [N, 1, D/2] broadcast over batch and heads.
  inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angle = jnp.asarray(positions_N, jnp.float32)[:, None, None] * inv_freq[None, None, :]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x = x_BxNxHxD.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
  return out.astype(x_BxNxHxD.dtype)


def maybe_remat(layer_fn: Callable, enabled: bool) -> Callable:
  """`layer_fn(layer, *arrays)` recomputed in the backward pass when `enabled`.

  Memory O(layers * B*N*E) instead of O(layers * B*N*(E + F)): the usual trade for long
  sequences. Everything static (windows, flags, bounds) must be closed over by `layer_fn`, not
  passed: remat traces every argument, and a window must stay a Python int (it fixes shapes).
  """
  return nnx.remat(layer_fn) if enabled else layer_fn
