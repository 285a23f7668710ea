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

On a mesh with Explicit axes (`jax.make_mesh`'s default) every op's output sharding is part of
its type, and JAX asks for it where it is ambiguous (a gather from a sharded table, a contraction
over a sharded dimension). `Dense` and `Embed` give it: activations keep the batch (and sequence)
sharding of their input, a projection's heads / mlp / vocab outputs keep its kernel's sharding of
those dimensions, and the residual stream's `embed` dimension stays whole (weights sharded over
`embed`, as with FSDP, are gathered for the product). On Auto meshes and without a mesh they are
flax's `LinearGeneral` and `Embed`, unchanged.

Shape letters: the alphabet of `longformer_jax.ops`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

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


# ---------------------------------------------------------------------------------------------
# Explicit sharding: output shardings where JAX cannot infer them.


def explicit_mesh(*arrays) -> jax.sharding.AbstractMesh | None:
  """The mesh with Explicit axes that one of `arrays` is typed on (inside jit too), or None
  (no mesh, or only Auto axes: then XLA chooses every layout and nothing needs naming)."""
  for x in arrays:
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if (mesh is not None and not mesh.empty
        and any(t == AxisType.Explicit for t in mesh.axis_types)):
      return mesh
  return None


def _axes_of(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _spec_entry(axes: Sequence[str]):
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def spec_of(x) -> tuple:
  """x's PartitionSpec, one entry per dimension."""
  spec = tuple(jax.typeof(x).sharding.spec)
  return spec + (None,) * (jnp.ndim(x) - len(spec))


def contraction_sharding(mesh, kept_spec: Sequence, feature_spec: Sequence) -> NamedSharding:
  """The sharding of a product whose leading dimensions are an input's (`kept_spec`: its batch,
  sequence, ... entries) and whose trailing ones are a weight's features (`feature_spec`): the
  features keep the weight's mesh axes, less those the leading dimensions already use (a mesh
  axis shards one dimension at most), so a product over a sharded contraction is summed across
  devices into this layout."""
  used = {a for entry in kept_spec for a in _axes_of(entry)}
  features = [_spec_entry([a for a in _axes_of(entry) if a not in used])
              for entry in feature_spec]
  return NamedSharding(mesh, P(*kept_spec, *features))


class Dense(nnx.LinearGeneral):
  """`nnx.LinearGeneral` contracting the input's last dimensions, which on an Explicit mesh names
  its output sharding (`contraction_sharding`); output dimensions named `embed` (the residual
  stream) come out whole."""

  def __init__(self, *args, feature_axes: tuple[str | None, ...], **kwargs):
    super().__init__(*args, **kwargs)
    self.feature_axes = feature_axes

  def __call__(self, inputs: jax.Array) -> jax.Array:
    kernel = self.kernel[...]
    mesh = explicit_mesh(inputs, kernel)
    if mesh is None:
      return super().__call__(inputs)
    bias = self.bias[...] if self.bias is not None else None
    inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
    n_in, n_out = len(self.in_features), len(self.out_features)
    features = [None if name == "embed" else entry
                for name, entry in zip(self.feature_axes, spec_of(kernel)[n_in:])]
    out_sharding = contraction_sharding(mesh, spec_of(inputs)[:-n_in], features)
    contract = (tuple(range(inputs.ndim - n_in, inputs.ndim)), tuple(range(n_in)))
    out = jax.lax.dot_general(inputs, kernel, (contract, ((), ())), precision=self.precision,
                              out_sharding=out_sharding)
    if bias is not None:
      bias = jax.sharding.reshard(bias, NamedSharding(mesh, P(*out_sharding.spec[-n_out:])))
      out = out + bias
    return out


class Embed(nnx.Embed):
  """`nnx.Embed` whose lookup and `attend` name their output sharding on an Explicit mesh: the
  ids' sharding with the feature dimension whole, and the query's with the vocabulary sharded
  as the table's rows."""

  def __call__(self, inputs: jax.Array) -> jax.Array:
    """Rows of the table for integer ids. An id outside [0, num_embeddings) gives a NaN row,
    negative ids included (a plain `take` wraps -1 around to the last row, and a one-row table
    broadcasts whatever the id): the models check concrete ids first and raise
    (`ops.validation.check_index_values`); under jit this NaN is what is left to say it."""
    inputs = jnp.asarray(inputs)
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError(f"Embed takes integer ids, got dtype {inputs.dtype}")
    table = self.embedding[...]
    mesh = explicit_mesh(inputs, table)
    (table,) = self.promote_dtype((table,), dtype=self.dtype, inexact=False)
    inputs = jnp.where(inputs < 0, self.num_embeddings, inputs)  # out of range, not wrapped
    if mesh is None:
      return jnp.take(table, inputs, axis=0, mode="fill")  # NaN rows for ids out of range
    # A gather from a table sharded over rows (vocab) or features (embed) has no unique output
    # layout: the rows come out with the ids' sharding and whole features. mode="fill" as
    # `jnp.take`, which the unsharded path uses.
    out_sharding = NamedSharding(mesh, P(*spec_of(inputs), None))
    return table.at[inputs].get(mode="fill", out_sharding=out_sharding)

  def attend(self, query: jax.Array) -> jax.Array:
    return attend(query, self.embedding[...], self.dtype)


def attend(query: jax.Array, table_VxE: jax.Array, dtype=None) -> jax.Array:
  """`query @ table.T` in `dtype` (as `nnx.Embed.attend`): a tied output layer. On an Explicit
  mesh the vocabulary comes out sharded as the table's rows."""
  query, table_VxE = nnx.nn.dtypes.promote_dtype((query, table_VxE), dtype=dtype)
  mesh = explicit_mesh(query, table_VxE)
  if mesh is None:
    return jnp.dot(query, table_VxE.T)
  return jnp.dot(query, table_VxE.T, out_sharding=table_logits_sharding(mesh, query, table_VxE))


def table_logits_sharding(mesh, query: jax.Array, table_VxE: jax.Array) -> NamedSharding:
  """The sharding of `query @ table.T` on an Explicit mesh: the query's leading dimensions, the
  vocabulary as the table's rows."""
  return contraction_sharding(mesh, spec_of(query)[:-1], spec_of(table_VxE)[:1])


def dense(in_features: int | Sequence[int], out_features: int | Sequence[int],
          axes: tuple[str | None, ...], *, init: Initializer, dtype, param_dtype,
          rngs: nnx.Rngs) -> Dense:
  """A linear map with a zero-initialised bias and logical axis names.

  `axes` names every kernel dimension, input dimensions first; the bias takes the output names.
  Several input dimensions (e.g. heads and head_dim) are contracted together. `init` sees the
  kernel flattened to [prod(in), prod(out)], so fan-in based initialisers count the true fan-in.
  """
  in_shape = tuple(in_features) if isinstance(in_features, Sequence) else (in_features,)
  return Dense(
      in_shape, out_features, axis=tuple(range(-len(in_shape), 0)),
      feature_axes=tuple(axes[len(in_shape):]),
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
          param_dtype, rngs: nnx.Rngs) -> Embed:
  return Embed(num, size, embedding_init=nnx.initializers.normal(stddev),
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
