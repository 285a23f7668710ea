"""Linen wrappers of the NNX models, for projects written with `flax.linen`.

    module = to_linen(LongformerForMaskedLM, config)
    variables = module.init(jax.random.key(0), input_ids)
    logits = module.apply(variables, input_ids).logits

The wrapped model takes the same call arguments and returns the same outputs as the NNX model.
`linen_variables(model)` turns an NNX model's weights (e.g. from `convert.from_hf`) into variables
for `apply`. Dropout is off unless `deterministic=False`; then `apply` needs
`rngs={"dropout": key}`.
"""

from __future__ import annotations

from flax import linen as nn
from flax import nnx
from flax.nnx import bridge


def _build(model_class: type, config, deterministic: bool, *, rngs: nnx.Rngs, **kwargs):
  if "dropout" not in rngs and "default" not in rngs:
    # Linen's `init` passes only a "params" key, but every nnx.Dropout takes a stream when it is
    # built; when dropout is off that stream is never drawn from.
    rngs = nnx.Rngs(dropout=0, **{name: stream() for name, stream in rngs.items()})
  model = model_class(config, rngs=rngs, **kwargs)
  # `deterministic` is static module state that the bridge rebuilds on every call, so it is set
  # here, at construction, rather than by `model.eval()` afterwards.
  model.set_attributes(deterministic=deterministic, raise_if_not_found=False)
  return model


def to_linen(model_class: type, config, *, deterministic: bool = True, name: str | None = None,
             **kwargs) -> nn.Module:
  """A Linen module computing `model_class(config, **kwargs)` (any model of this package)."""
  return bridge.to_linen(_build, model_class, config, deterministic, name=name, **kwargs)


def linen_variables(model: nnx.Module) -> dict:
  """{"params": ...} for `apply` of the `to_linen` module of the same class and config."""
  return {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param))}
