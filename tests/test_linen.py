"""The Linen wrappers compute what the NNX models compute, with the same weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import meta

from testing import make_model_inputs as make_inputs, tiny_encoder_config
from longformer_jax import linen, modeling

pytestmark = pytest.mark.unit

CONFIG = tiny_encoder_config()


@pytest.mark.parametrize("model_class", [modeling.LongformerModel,
                                         modeling.LongformerForMaskedLM])
def test_linen_matches_nnx(model_class):
  x = make_inputs()
  args = [jnp.asarray(x[k]) for k in ("input_ids", "attention_mask", "global_attention_mask")]
  module = linen.to_linen(model_class, CONFIG)
  variables = module.init(jax.random.key(0), *args)
  assert set(variables) == {"params"}

  model = model_class(CONFIG, rngs=nnx.Rngs(1))
  model.eval()
  ours = model(*args)
  wrapped = module.apply(linen.linen_variables(model), *args)
  assert type(wrapped) is type(ours)
  for a, b in zip(jax.tree.leaves(wrapped), jax.tree.leaves(ours)):
    np.testing.assert_array_equal(a, b)

  # Variables from `init` carry the same tree as the NNX model's parameters.
  shapes = jax.tree.map(jnp.shape, linen.linen_variables(model)["params"])
  assert jax.tree.map(jnp.shape, meta.unbox(variables["params"])) == shapes


def test_linen_under_jit_with_dropout():
  """A classifier sets its own global mask, so it runs under jit with no max_global; dropout
  is on only with deterministic=False and a dropout key."""
  ids = jnp.asarray(make_inputs()["input_ids"])
  config = CONFIG.replace(num_hidden_layers=1, attention_window=4)  # a short compile
  module = linen.to_linen(modeling.LongformerForSequenceClassification, config)
  variables = module.init(jax.random.key(0), ids)
  logits = jax.jit(module.apply)(variables, ids).logits
  np.testing.assert_allclose(logits, module.apply(variables, ids).logits, atol=1e-6, rtol=0)
  train = linen.to_linen(modeling.LongformerForSequenceClassification, config,
                         deterministic=False)
  a, b = (jax.jit(train.apply)(variables, ids, rngs={"dropout": jax.random.key(s)}).logits
          for s in (1, 2))
  assert not np.allclose(a, b)
