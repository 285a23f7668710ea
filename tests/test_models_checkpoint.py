"""Orbax save/restore of models: parameters, config and constructor arguments come back."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from longformer_jax import checkpoint, modeling
from longformer_jax.config import LongformerConfig

CONFIG = LongformerConfig(vocab_size=64, hidden_size=64, num_hidden_layers=3,
                          num_attention_heads=4, intermediate_size=96, max_position_embeddings=40,
                          type_vocab_size=2, attention_window=(2, 4, 3),
                          attention_dilation=(1, (1, 2, 1, 2), 1), dtype="bfloat16", num_labels=5)


@pytest.mark.parametrize("model_class, kwargs", [
    (modeling.LongformerModel, dict(add_pooling_layer=False)),
    (modeling.LongformerForSequenceClassification, {}),
])
def test_save_and_load_round_trip(tmp_path, model_class, kwargs):
  model = model_class(CONFIG, rngs=nnx.Rngs(3), **kwargs)
  checkpoint.save_model(tmp_path / "ckpt", model)
  loaded = checkpoint.load_model(tmp_path / "ckpt")
  assert type(loaded) is model_class
  assert loaded.config == CONFIG
  saved = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
  restored = jax.tree_util.tree_flatten_with_path(
      nnx.to_pure_dict(nnx.state(loaded, nnx.Param)))[0]
  assert [p for p, _ in saved] == [p for p, _ in restored]
  for (_, a), (_, b) in zip(saved, restored):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  if model_class is modeling.LongformerModel:
    assert loaded.pooler is None


def test_save_refuses_to_overwrite_unless_forced(tmp_path):
  model = modeling.LongformerModel(CONFIG, rngs=nnx.Rngs(0))
  checkpoint.save_model(tmp_path / "ckpt", model)
  with pytest.raises(FileExistsError, match="pass force=True"):
    checkpoint.save_model(tmp_path / "ckpt", model)
  other = modeling.LongformerModel(CONFIG, rngs=nnx.Rngs(1))
  checkpoint.save_model(tmp_path / "ckpt", other, force=True)
  loaded = checkpoint.load_model(tmp_path / "ckpt")
  np.testing.assert_array_equal(loaded.pooler.kernel[...], other.pooler.kernel[...])
  with pytest.raises(FileNotFoundError, match="no model.json"):
    checkpoint.load_model(tmp_path / "nothing")
  with pytest.raises(TypeError, match="has no `config` attribute"):
    checkpoint.save_model(tmp_path / "linear", nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
