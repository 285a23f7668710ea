"""HF <-> NNX conversion: exact round trips, directory loading, task changes, errors, and the
RoBERTa-to-Longformer recipe at parity with the RoBERTa it came from."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

_NEEDS = "conversion is tested against PyTorch HF models: pip install -e '.[torch]'"
torch = pytest.importorskip("torch", reason=_NEEDS)
transformers = pytest.importorskip("transformers", reason=_NEEDS)
safetensors_numpy = pytest.importorskip("safetensors.numpy", reason=_NEEDS)

from hf_testing import random_longformer, random_roberta
from testing import make_model_inputs as make_inputs
from longformer_jax import convert, modeling
from longformer_jax.config import LongformerConfig

pytestmark = pytest.mark.unit

HF_CLASSES = [transformers.LongformerModel, transformers.LongformerForMaskedLM,
              transformers.LongformerForSequenceClassification,
              transformers.LongformerForQuestionAnswering,
              transformers.LongformerForTokenClassification,
              transformers.LongformerForMultipleChoice]


def params_of(model) -> dict:
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def assert_same_params(a, b):
  flat_a = jax.tree_util.tree_flatten_with_path(params_of(a))[0]
  flat_b = jax.tree_util.tree_flatten_with_path(params_of(b))[0]
  assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
  for (path, x), (_, y) in zip(flat_a, flat_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


@pytest.mark.parametrize("hf_class", HF_CLASSES, ids=lambda c: c.__name__)
def test_round_trip_is_exact(hf_class):
  num_labels = 2 if hf_class is transformers.LongformerForQuestionAnswering else 3
  hf_model = random_longformer(hf_class, num_labels=num_labels)
  ours = convert.from_hf(hf_model)
  assert type(ours).__name__ == hf_class.__name__
  assert ours.config.layer_windows == (2, 4, 3)  # HF totals 4, 8, 6 halved
  back = convert.to_hf(ours)
  assert type(back) is hf_class
  assert list(back.config.attention_window) == [4, 8, 6]
  theirs, again = hf_model.state_dict(), back.state_dict()
  assert theirs.keys() == again.keys()
  for k in theirs:
    assert torch.equal(theirs[k], again[k]), k
  ours_again = convert.from_hf(back)
  assert ours_again.config == ours.config
  assert_same_params(ours, ours_again)


def test_base_model_without_pooler_round_trips():
  hf_model = random_longformer(transformers.LongformerModel, seed=1)
  ours = convert.from_hf(hf_model)
  no_pooler = modeling.LongformerModel(ours.config, add_pooling_layer=False, rngs=nnx.Rngs(0))
  back = convert.to_hf(no_pooler)
  assert back.pooler is None
  assert_same_params(no_pooler, convert.from_hf(back, model_class=modeling.LongformerModel))


def test_from_directory(tmp_path):
  """save_pretrained's safetensors and a torch pytorch_model.bin both load, identically."""
  hf_model = random_longformer(transformers.LongformerForMaskedLM, seed=2)
  hf_model.save_pretrained(tmp_path / "st")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  torch.save(hf_model.state_dict(), bin_dir / "pytorch_model.bin")
  (bin_dir / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
  from_object = convert.from_hf(hf_model)
  for directory in (tmp_path / "st", str(bin_dir)):
    loaded = convert.from_hf(directory)
    assert isinstance(loaded, modeling.LongformerForMaskedLM)
    assert loaded.config == from_object.config
    assert_same_params(loaded, from_object)


def test_allenai_style_checkpoint(tmp_path):
  """As allenai/longformer-base-4096 ships: a pytorch_model.bin with a position_ids buffer and a
  pooler the masked LM does not use, a config without `architectures` and with legacy keys."""
  hf_model = random_longformer(transformers.LongformerForMaskedLM, seed=6)
  state = dict(hf_model.state_dict())
  state["longformer.embeddings.position_ids"] = torch.arange(40)[None]
  state["longformer.pooler.dense.weight"] = torch.zeros(64, 64)
  state["longformer.pooler.dense.bias"] = torch.zeros(64)
  torch.save(state, tmp_path / "pytorch_model.bin")
  config = hf_model.config.to_dict()
  config.update(architectures=None, attention_mode="longformer", ignore_attention_mask=False)
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.warns(UserWarning, match=r"unused checkpoint weights \['longformer\.pooler"):
    model = convert.from_hf(tmp_path)
  assert isinstance(model, modeling.LongformerForMaskedLM)
  assert_same_params(model, convert.from_hf(hf_model))


def test_masked_lm_checkpoint_into_classifier():
  """Fine-tuning start: the encoder is loaded, the new head is fresh, the LM head is dropped,
  and a warning names both."""
  hf_model = random_longformer(transformers.LongformerForMaskedLM, seed=3)
  with pytest.warns(UserWarning, match=r"classifier\.out_proj\.weight.*lm_head\.dense\.weight"):
    clf = convert.from_hf(hf_model, model_class=modeling.LongformerForSequenceClassification,
                          num_labels=5, rngs=nnx.Rngs(7))
  assert clf.config.num_labels == 5
  mlm = convert.from_hf(hf_model)
  assert_same_params(clf.longformer, mlm.longformer)
  logits = clf(jnp.asarray(make_inputs()["input_ids"])).logits
  assert logits.shape == (3, 5)


def _save_weights(directory, weights, config):
  directory.mkdir()
  safetensors_numpy.save_file(weights, directory / "model.safetensors")
  (directory / "config.json").write_text(json.dumps(config))


def test_missing_and_unexpected_weights_are_named(tmp_path):
  hf_model = random_longformer(transformers.LongformerForMaskedLM, seed=4)
  weights = {k: v.numpy() for k, v in hf_model.state_dict().items()}
  config = hf_model.config.to_dict()
  missing = dict(weights)
  del missing["longformer.encoder.layer.1.attention.self.key_global.bias"]
  _save_weights(tmp_path / "missing", missing, config)
  with pytest.raises(ValueError, match=r"missing weights \['longformer\.encoder\.layer\.1\."
                                       r"attention\.self\.key_global\.bias'\]"):
    convert.from_hf(tmp_path / "missing")
  _save_weights(tmp_path / "unexpected", {**weights, "longformer.extra.weight": weights[
      "lm_head.bias"]}, config)
  with pytest.raises(ValueError, match=r"unexpected weights \['longformer\.extra\.weight'\]"):
    convert.from_hf(tmp_path / "unexpected")
  wrong_shape = {**weights, "lm_head.dense.weight": np.zeros((3, 3), np.float32)}
  _save_weights(tmp_path / "shape", wrong_shape, config)
  with pytest.raises(ValueError, match=r"lm_head\.dense\.weight has shape \(3, 3\)"):
    convert.from_hf(tmp_path / "shape")


def test_bad_sources_are_rejected(tmp_path):
  with pytest.raises(ValueError, match="model_type='roberta'; use roberta_to_longformer"):
    convert.from_hf(random_roberta(transformers.RobertaModel))
  with pytest.raises(TypeError, match="HF PyTorch model, a local directory or an HF Hub id"):
    convert.from_hf(42)
  with pytest.raises(FileNotFoundError, match="no config.json"):
    convert.from_hf(tmp_path)
  hf_model = random_longformer(transformers.LongformerModel)
  hf_model.save_pretrained(tmp_path / "m")
  config = json.loads((tmp_path / "m" / "config.json").read_text())
  config["architectures"] = ["LongformerForPoetry"]
  (tmp_path / "m" / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="unknown architecture 'LongformerForPoetry'"):
    convert.from_hf(tmp_path / "m")
  os.remove(tmp_path / "m" / "model.safetensors")
  with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
    convert.from_hf(tmp_path / "m")


def test_to_hf_rejects_what_hf_cannot_express():
  base = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=32, max_position_embeddings=20, attention_window=2)
  dilated = modeling.LongformerModel(LongformerConfig(**base, attention_dilation=(1, (1, 2))),
                                     rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="no dilation"):
    convert.to_hf(dilated)
  causal = modeling.LongformerModel(LongformerConfig(**base, causal=True), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="no causal mode"):
    convert.to_hf(causal)


def test_roberta_to_longformer_matches_roberta():
  """Positions copied in blocks, global = local projections: with a window that covers the
  input, the Longformer MLM computes the RoBERTa MLM's logits, global tokens or not."""
  roberta = random_roberta(transformers.RobertaForMaskedLM, seed=5)
  model = convert.roberta_to_longformer(roberta, max_positions=40, window=16)
  model.eval()
  assert isinstance(model, modeling.LongformerForMaskedLM)
  assert model.config.max_sequence_length == 40

  old = roberta.roberta.embeddings.position_embeddings.weight.detach().numpy()  # 2 + 16 rows
  new = np.asarray(model.longformer.embeddings.position_embeddings.embedding[...])
  np.testing.assert_array_equal(new[:18], old)
  np.testing.assert_array_equal(new[18:34], old[2:])
  np.testing.assert_array_equal(new[34:], old[2:10])  # 2 + 40 rows: the last block is cut
  attention = model.longformer.layers[1].attention
  for local, global_ in ((attention.query, attention.query_global),
                         (attention.value, attention.value_global)):
    np.testing.assert_array_equal(np.asarray(local.kernel[...]), np.asarray(global_.kernel[...]))

  inputs = make_inputs(6)
  ids, mask = inputs["input_ids"][:, :16], inputs["attention_mask"][:, :16]
  with torch.no_grad():
    theirs = roberta(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
  real = mask.astype(bool)  # RoBERTa's padding positions attend normally; ours output zero
  for global_mask in (None, np.eye(3, 16, dtype=np.int64)):
    ours = model(jnp.asarray(ids), jnp.asarray(mask), global_mask).logits
    np.testing.assert_allclose(np.asarray(ours)[real], theirs[real], atol=1e-5, rtol=0)
  # Usable at once on inputs longer than RoBERTa's table.
  long_ids = jnp.asarray(np.tile(ids[:1], (1, 3))[:, :40])
  assert np.isfinite(np.asarray(model(long_ids).logits)).all()


def test_roberta_to_longformer_rejects_longformer():
  with pytest.raises(ValueError, match="model_type='longformer'"):
    convert.roberta_to_longformer(random_longformer(transformers.LongformerModel))
