"""The NNX models on their own: config, input checks, sharding names, padding invisibility, jit,
remat, mixed precision, attention probabilities, dropout and the default global masks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from testing import BATCH, SEQ, VOCAB, make_model_inputs as make_inputs, tiny_encoder_config
from longformer_jax import modeling
from longformer_jax.config import LongformerConfig

pytestmark = pytest.mark.unit

small_config = tiny_encoder_config


def inputs(seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """ids, attention mask, global mask [BATCH, SEQ] (padding and 3/1/0 global tokens)."""
  x = make_inputs(seed)
  return tuple(jnp.asarray(x[k]) for k in ("input_ids", "attention_mask",
                                           "global_attention_mask"))


def eval_model(cls=modeling.LongformerModel, seed: int = 0, **changes):
  model = cls(small_config(**changes), rngs=nnx.Rngs(seed))
  model.eval()
  return model


# ---------------------------------------------------------------------------------------------
# Config.


@pytest.mark.golden
def test_golden_masked_lm_logits():
  """Recorded with the code before the encoder and the char LM shared one attention module
  (commit 113f37c): initialisation and computation unchanged (bit for bit on CPU)."""
  config = LongformerConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=48,
                            max_position_embeddings=40, attention_window=(2, 3),
                            attention_dilation=(1, (1, 2, 1, 2)))
  model = modeling.LongformerForMaskedLM(config, rngs=nnx.Rngs(0))
  ids = jax.random.randint(jax.random.key(2), (2, 19), 3, 64)
  logits = model(ids, global_attention_mask=jnp.zeros((2, 19), bool).at[0, 4].set(True)).logits
  np.testing.assert_allclose(
      [float(jnp.sum(logits)), float(jnp.sum(jnp.abs(logits))), float(logits[0, 0, 5])],
      [4.128251075744629, 219.08590698242188, 0.10028688609600067], rtol=1e-6)


def test_masked_positions_pick_each_rows_targets_in_order():
  labels = np.full((3, 10), -100)
  labels[0, [7, 2, 5]] = [70, 20, 50]
  labels[1, :] = np.arange(10)  # more targets than P
  positions, picked, dropped = modeling.masked_positions(jnp.asarray(labels), 4)
  np.testing.assert_array_equal(positions, [[2, 5, 7, 0], [0, 1, 2, 3], [0, 0, 0, 0]])
  np.testing.assert_array_equal(picked, [[20, 50, 70, -100], [0, 1, 2, 3], [-100] * 4])
  np.testing.assert_array_equal(dropped, [0, 6, 0])
  positions, picked, _ = jax.jit(modeling.masked_positions, static_argnums=1)(labels, 12)
  assert positions.shape == (3, 12) and positions.dtype == jnp.int32
  np.testing.assert_array_equal(picked[1], list(range(10)) + [-100, -100])
  with pytest.raises(ValueError, match="max_predictions must be an int >= 1, got 0"):
    modeling.masked_positions(labels, 0)


def test_lm_head_at_the_masked_positions_equals_the_full_logits():
  """Logits at the prediction positions are the full logits' rows; the masked-LM loss and every
  gradient are the same computed either way (float32)."""
  config = tiny_encoder_config()
  model = modeling.LongformerForMaskedLM(config, rngs=nnx.Rngs(4))
  model.eval()  # the same dropout masks in both calls: none
  inputs = {k: jnp.asarray(v) for k, v in make_inputs(seed=5).items()}
  rng = np.random.default_rng(6)
  labels = np.where((rng.random((BATCH, SEQ)) < 0.3) & (inputs["attention_mask"] == 1),
                    rng.integers(4, VOCAB, (BATCH, SEQ)), -100)
  positions, picked, dropped = modeling.masked_positions(jnp.asarray(labels), SEQ)
  assert int(dropped.sum()) == 0

  def loss(logits, targets):
    weights = (targets >= 0).astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.maximum(targets, 0)[..., None],
                               axis=-1)[..., 0]
    return jnp.sum(nll * weights) / jnp.sum(weights)

  # One compiled program per call (eagerly every primitive compiles on its own); max_global=3:
  # the inputs' rows hold at most 3 global tokens.
  full_fn = lambda m: loss(m(**inputs, max_global=3).logits, jnp.asarray(labels))
  sparse_fn = lambda m: loss(m(**inputs, max_global=3, prediction_positions=positions).logits,
                             picked)
  full = nnx.jit(lambda m: m(**inputs, max_global=3).logits)(model)
  sparse = nnx.jit(lambda m: m(**inputs, max_global=3, prediction_positions=positions).logits
                   )(model)
  assert sparse.shape == (BATCH, SEQ, VOCAB)
  np.testing.assert_allclose(sparse, np.take_along_axis(np.asarray(full),
                                                        np.asarray(positions)[..., None], 1),
                             rtol=1e-5, atol=1e-5)
  (full_loss, full_grads), (sparse_loss, sparse_grads) = (
      nnx.jit(nnx.value_and_grad(fn))(model) for fn in (full_fn, sparse_fn))
  np.testing.assert_allclose(sparse_loss, full_loss, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(full_grads)),
                  jax.tree.leaves(nnx.to_pure_dict(sparse_grads))):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_config_normalises_and_round_trips():
  config = LongformerConfig(num_hidden_layers=2, attention_window=[4, 8],
                            attention_dilation=[1, [1, 1, 2, 2] * 3], dtype="bfloat16")
  assert config.attention_window == (4, 8)
  assert config.layer_dilations[1] == (1, 1, 2, 2) * 3
  assert config.dtype == jnp.bfloat16
  assert LongformerConfig.from_dict(config.to_dict()) == config
  assert hash(config) == hash(LongformerConfig.from_dict(config.to_dict()))
  assert config.replace(num_hidden_layers=2, attention_window=3).layer_windows == (3, 3)


@pytest.mark.parametrize("changes, error, match", [
    (dict(hidden_size=30), ValueError, "hidden_size=30 is not a multiple of num_attention_heads"),
    (dict(attention_window=(2, 3)), ValueError, "attention_window has 2 entries, expected 3"),
    (dict(attention_window=0), ValueError, r"attention_window of layer 0 must be an int >= 1"),
    (dict(attention_dilation=(1, (1, 2), 1)), ValueError, "attention_dilation of layer 1 has 2"),
    (dict(attention_dilation=0), ValueError, "must hold ints >= 1"),
    (dict(attention_impl="fast"), ValueError, "attention_impl='fast' is not one of"),
    (dict(hidden_act="gelu_fast"), ValueError, "hidden_act='gelu_fast'"),
    (dict(dtype="float33"), TypeError, "dtype='float33' is not a dtype"),
    (dict(num_hidden_layers=0), ValueError, "num_hidden_layers must be a positive int, got 0"),
])
def test_config_rejects_bad_values(changes, error, match):
  with pytest.raises(error, match=match):
    small_config(**changes)
  with pytest.raises(ValueError, match="unknown LongformerConfig fields: \\['windows'\\]"):
    LongformerConfig.from_dict({"windows": 3})


# ---------------------------------------------------------------------------------------------
# Inputs.


def test_bad_inputs_raise_clear_errors():
  model = eval_model()
  ids = inputs()[0][:2, :9]
  with pytest.raises(TypeError, match="integer token ids; got dtype float32"):
    model(ids.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"shape \[batch, seq\]; got shape \(9,\)"):
    model(ids[0])
  with pytest.raises(ValueError, match="input_ids has 39 tokens; the position table holds at "
                                       "most 38"):
    model(jnp.ones((1, 39), jnp.int32))
  with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 8\); expected the shape "
                                       r"of input_ids, \(2, 9\)"):
    model(ids, jnp.ones((2, 8)))
  with pytest.raises(ValueError, match="global_attention_mask has shape"):
    model(ids, None, jnp.ones((9,)))
  with pytest.raises(ValueError, match=r"shape \[batch, choices, seq\]"):
    eval_model(modeling.LongformerForMultipleChoice)(ids)
  with pytest.raises(ValueError, match="num_labels must be 2, got 3"):
    eval_model(modeling.LongformerForQuestionAnswering, num_labels=3)


def test_masks_hold_0_and_1_and_nonzero_counts_as_1_under_jit():
  """Concrete masks with another value than 0 and 1 are refused naming it and its position
  (HF's internal attention mask marks global tokens with 2: here it would be a local token);
  under jit they cannot be read, and any nonzero value counts as 1, as in the op."""
  model = eval_model(modeling.LongformerForSequenceClassification)
  ids, mask, global_mask = inputs()
  for name, value in (("attention_mask", 0.5), ("attention_mask", 2),
                      ("global_attention_mask", 2)):
    given = {"attention_mask": mask, "global_attention_mask": global_mask}
    given[name] = given[name].astype(jnp.float32).at[1, 4].set(value)
    with pytest.raises(ValueError, match=rf"{name} holds {float(value)!r} at \(1, 4\); "
                                         rf"expected 0 or 1 \(or bool\)"):
      model(ids, given["attention_mask"], given["global_attention_mask"])
  eager = model(ids, mask.astype(bool), global_mask).logits

  @nnx.jit
  def run(model, mask, global_mask):
    return model(ids, mask, global_mask, max_global=3).logits

  odd_mask = mask * jnp.array([2, 1, 7] + [1] * (SEQ - 3))  # nonzero: real
  np.testing.assert_allclose(run(model, odd_mask, global_mask * 2), eager, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name, value, where, table", [
    ("input_ids", -1, (1, 4), r"\[0, 64\) \(vocab_size=64\)"),
    ("input_ids", 64, (0, 2), r"\[0, 64\) \(vocab_size=64\)"),
    ("position_ids", -3, (2, 0), r"\[0, 40\) \(max_position_embeddings=40\)"),
    ("token_type_ids", 5, (1, 7), r"\[0, 2\) \(type_vocab_size=2\)"),
])
def test_ids_outside_their_table_are_refused_and_nan_under_jit(name, value, where, table):
  """A concrete id outside its embedding table is a ValueError naming the argument, the value,
  its position and the range (a plain lookup gave -1 the last row's embedding, -3 position 37's,
  type 5 type 0's, and NaN for id 64, without a word). Under jit the values cannot be read:
  the id's outputs are NaN (and those of the tokens of its row that attend to it), never
  another id's, and the other rows are untouched."""
  model = eval_model(modeling.LongformerForMaskedLM)
  ids = inputs()[0]
  given = {"input_ids": ids, "position_ids": jnp.broadcast_to(jnp.arange(2, SEQ + 2), ids.shape),
           "token_type_ids": jnp.zeros_like(ids)}
  given[name] = given[name].at[where].set(value)
  with pytest.raises(ValueError, match=rf"{name} holds {value} at position "
                                       rf"\({where[0]}, {where[1]}\); expected ids in {table}"):
    model(**given)
  with pytest.raises(ValueError, match=rf"{name} holds {value} at position"):  # NumPy ids too
    model(**{k: np.asarray(v) for k, v in given.items()})
  logits = nnx.jit(lambda model, given: model(**given).logits)(model, given)
  assert np.isnan(np.asarray(logits[where])).all()
  assert np.isfinite(np.asarray(jnp.delete(logits, where[0], axis=0))).all()
  with pytest.raises(ValueError, match=rf"{name} holds {value} at position "
                                       rf"\({where[0]}, 0, {where[1]}\)"):
    eval_model(modeling.LongformerForMultipleChoice)(
        **{k: v[:, None] for k, v in given.items()})


def test_padding_is_invisible():
  """Padding up to the longest input the position table holds (38 tokens, a multiple of no
  window) leaves the real tokens' outputs as they were: the op's internal padding never shows."""
  model = eval_model(modeling.LongformerForMaskedLM)
  ids, mask, global_mask = inputs()
  extra = model.config.max_sequence_length - SEQ
  pad = ((0, 0), (0, extra))
  short = model(ids, mask, global_mask).logits
  long = model(jnp.pad(ids, pad, constant_values=1), jnp.pad(mask, pad),
               jnp.pad(global_mask, pad)).logits
  assert long.shape == (BATCH, 38, VOCAB)
  real = np.asarray(mask, bool)
  np.testing.assert_allclose(long[:, :SEQ][real], short[real], atol=1e-5, rtol=0)


def test_default_global_masks():
  ids = jnp.array([[0, 7, 8, 2, 2, 9, 2, 1], [0, 7, 7, 7, 7, 7, 7, 7]])
  np.testing.assert_array_equal(modeling.sequence_classification_global_mask(ids)[:, :2],
                                [[True, False], [True, False]])
  np.testing.assert_array_equal(modeling.question_answering_global_mask(ids, 2),
                                [[1, 1, 1, 0, 0, 0, 0, 0], [0] * 8])
  np.testing.assert_array_equal(modeling.multiple_choice_global_mask(ids, 2),
                                [[0, 0, 0, 0, 0, 1, 1, 1], [0] * 8])


def test_shared_global_projections_are_separate_ones_holding_copies_of_the_band_projections():
  """global_projections="shared" computes global attention with the band's q/k/v: the same
  logits as "separate" projections set to copies of the band's, and gradients that are the sum
  of the band's and the global projections' gradients there (one weight used twice). The
  factor is seen: with copies made to differ, "separate" gives other logits."""
  ids, mask, global_mask = inputs()
  separate = eval_model(modeling.LongformerForMaskedLM)
  for layer in separate.longformer.layers:
    layer.attention.copy_local_to_global()
  shared = eval_model(modeling.LongformerForMaskedLM, global_projections="shared")
  assert shared.longformer.layers[0].attention.query_global is None
  band_only = nnx.filter_state(nnx.state(separate, nnx.Param),
                               lambda path, _: not str(path[-2]).endswith("_global"))
  # Every parameter of the shared model, and nothing else, is set from the separate one.
  assert (jax.tree.structure(nnx.to_pure_dict(band_only))
          == jax.tree.structure(nnx.to_pure_dict(nnx.state(shared, nnx.Param))))
  nnx.update(shared, band_only)
  assert int(np.sum(global_mask)) > 0
  np.testing.assert_allclose(shared(ids, mask, global_mask).logits,
                             separate(ids, mask, global_mask).logits, atol=1e-5, rtol=0)

  def loss(model):
    return jnp.sum(jnp.sin(model(ids, mask, global_mask).logits))

  g_sep = nnx.to_pure_dict(nnx.grad(loss)(separate))["longformer"]["layers"]
  g_sh = nnx.to_pure_dict(nnx.grad(loss)(shared))["longformer"]["layers"]
  for i in g_sh:
    for proj in ("query", "key", "value"):
      for leaf in ("kernel", "bias"):
        np.testing.assert_allclose(
            g_sh[i]["attention"][proj][leaf],
            g_sep[i]["attention"][proj][leaf] + g_sep[i]["attention"][f"{proj}_global"][leaf],
            atol=1e-5, rtol=1e-5)
  for layer in separate.longformer.layers:  # global rows' values no longer the band's
    layer.attention.value_global.kernel[...] = 50.0 * layer.attention.value_global.kernel[...]
  assert not np.allclose(shared(ids, mask, global_mask).logits,
                         separate(ids, mask, global_mask).logits, atol=1e-3)
  # Without global tokens the three settings compute the same function of the band weights.
  np.testing.assert_allclose(shared(ids, mask).logits, separate(ids, mask).logits, atol=1e-5,
                             rtol=0)


def test_global_projections_setting_is_checked():
  with pytest.raises(ValueError, match="global_projections must be one of .* got 'local'"):
    small_config(global_projections="local")
  ids, mask, global_mask = inputs()
  model = eval_model(global_projections="none")
  model(ids, mask)  # no global tokens: fine
  with pytest.raises(ValueError, match="global_projections='none'"):
    model(ids, mask, global_mask)
  with pytest.raises(ValueError, match="nothing to copy to: global_projections='shared'"):
    eval_model(global_projections="shared").layers[0].attention.copy_local_to_global()
  from longformer_jax import convert
  with pytest.raises(ValueError, match="separate global projections; this config has "
                                       "global_projections='shared'"):
    convert.config_to_hf_dict(small_config(global_projections="shared"))


# ---------------------------------------------------------------------------------------------
# Transformations.


def test_jit_needs_and_takes_max_global():
  model = eval_model(modeling.LongformerForQuestionAnswering, num_labels=2)
  ids, mask, _ = inputs()  # questions of 3, 5 and 2 tokens after <s>
  eager = model(ids, mask)

  @nnx.jit(static_argnames="max_global")
  def run(model, ids, mask, max_global=None):
    return model(ids, mask, max_global=max_global)

  jitted = run(model, ids, mask, max_global=6)
  np.testing.assert_allclose(jitted.start_logits, eager.start_logits, atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match="pass max_global"):
    run(model, ids, mask)


def test_remat_changes_nothing_but_memory():
  ids, mask, global_mask = inputs()

  @nnx.jit
  def loss_and_grads(model):
    def loss(model):
      return jnp.mean(model(ids, mask, global_mask, max_global=3).last_hidden_state ** 2)
    return nnx.value_and_grad(loss)(model)

  two_layers = dict(num_hidden_layers=2, attention_window=(2, 4))  # a shorter compile
  plain = eval_model(seed=1, **two_layers)
  remat = eval_model(seed=1, remat=True, **two_layers)
  (loss_a, grads_a), (loss_b, grads_b) = loss_and_grads(plain), loss_and_grads(remat)

  np.testing.assert_allclose(loss_a, loss_b, atol=1e-6, rtol=0)
  for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_bfloat16_compute_with_float32_params():
  ids, mask, global_mask = inputs()

  @nnx.jit
  def logits_and_grads(model):
    def total(model):
      logits = model(ids, mask, global_mask, max_global=3).logits
      return jnp.sum(logits.astype(jnp.float32)), logits
    return nnx.grad(total, has_aux=True)(model)

  one_layer = dict(num_hidden_layers=1, attention_window=4)  # a short compile
  f32 = eval_model(modeling.LongformerForSequenceClassification, seed=2, **one_layer)
  bf16 = eval_model(modeling.LongformerForSequenceClassification, seed=2, dtype=jnp.bfloat16,
                    **one_layer)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(bf16, nnx.Param)))
  grads, logits = logits_and_grads(bf16)
  assert logits.dtype == jnp.bfloat16
  # bf16 keeps ~3 significant digits; logits here are O(1).
  np.testing.assert_allclose(logits.astype(jnp.float32),
                             f32(ids, mask, global_mask).logits, atol=5e-2, rtol=0)
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


def test_attention_probabilities():
  """Dense per-layer probabilities: rows of real queries sum to 1 over the band and the global
  keys; padding rows are zero; the hidden states are those of the fast path."""
  model = eval_model(attention_dilation=((1, 1, 2, 2), 1, 1))
  ids, mask, global_mask = inputs()  # row 0: 23 tokens, globals 0, 5, 6; row 2: 9 tokens
  out = model(ids, mask, global_mask, output_attentions=True)
  fast = model(ids, mask, global_mask)
  np.testing.assert_allclose(out.last_hidden_state, fast.last_hidden_state, atol=1e-5, rtol=0)
  assert len(out.attentions) == 3
  probs = np.asarray(out.attentions[0])  # layer 0: window 2, dilations 1, 1, 2, 2
  assert probs.shape == (BATCH, 4, SEQ, SEQ)
  np.testing.assert_allclose(probs[0].sum(-1), 1, atol=1e-6)
  np.testing.assert_array_equal(probs[2, :, 9:], 0)  # padding queries
  np.testing.assert_array_equal(probs[2, :, :9, 9:], 0)  # padding keys
  assert (probs[0, :, 5] > 0).all()  # a global query sees everything
  assert (probs[0, :, :, 5] > 0).all()  # and everything sees it
  i, j = np.meshgrid(np.arange(SEQ), np.arange(SEQ), indexing="ij")
  local = ~np.isin(i, [0, 5, 6]) & ~np.isin(j, [0, 5, 6])
  assert (probs[0, 0][local & (np.abs(i - j) > 2)] == 0).all()  # outside the band
  assert (probs[0, 0][local & (np.abs(i - j) <= 2)] > 0).all()
  assert (probs[0, 2][local & (np.abs(i - j) % 2 == 1)] == 0).all()  # dilation 2: even offsets


def test_dropout_only_in_train_mode():
  model = modeling.LongformerModel(small_config(), rngs=nnx.Rngs(0, dropout=1))
  ids, mask, global_mask = inputs()
  first, second = (model(ids, mask, global_mask).last_hidden_state for _ in range(2))
  assert not np.allclose(first, second)  # fresh dropout masks each call
  model.eval()
  first, second = (model(ids, mask, global_mask).last_hidden_state for _ in range(2))
  np.testing.assert_array_equal(first, second)


# ---------------------------------------------------------------------------------------------
# Sharding.


def test_parameters_carry_logical_axis_names():
  model = nnx.eval_shape(lambda: modeling.LongformerForMaskedLM(small_config(),
                                                                rngs=nnx.Rngs(0)))
  specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  layer = specs["longformer"]["layers"][0]
  assert layer["attention"]["query"]["kernel"].get_value() == P("embed", "heads", "kv")
  assert layer["attention"]["output"]["kernel"].get_value() == P("heads", "kv", "embed")
  assert layer["intermediate"]["kernel"].get_value() == P("embed", "mlp")
  assert layer["output"]["kernel"].get_value() == P("mlp", "embed")
  embeddings = specs["longformer"]["embeddings"]
  assert embeddings["word_embeddings"]["embedding"].get_value() == P("vocab", "embed")
  assert specs["lm_head"]["bias"].get_value() == P("vocab",)


def test_parameters_are_sharded_by_rules_given_from_outside():
  mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
  rules = (("vocab", "model"), ("mlp", "model"), ("heads", "model"), ("embed", None),
           ("kv", None), ("norm", None))
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    model = modeling.LongformerForMaskedLM(small_config(), rngs=nnx.Rngs(0))
  kernel = model.longformer.layers[0].attention.query.kernel[...]
  assert kernel.sharding.spec == P(None, "model", None)
  word = model.longformer.embeddings.word_embeddings.embedding[...]
  assert word.sharding.spec == P("model", None)


_SEQUENCE_PARALLEL = textwrap.dedent("""
    import jax, numpy as np
    from flax import nnx
    from testing import assert_close, make_model_inputs, tiny_encoder_config
    from longformer_jax.modeling import LongformerForMaskedLM
    from longformer_jax.training import make_mesh
    assert jax.device_count() == 4, jax.devices()
    x = make_model_inputs()  # 3 rows of 23 tokens: padding, 3 / 1 / 0 global tokens
    args = [x["input_ids"], x["attention_mask"], x["global_attention_mask"]]

    def build(**kw):
      model = LongformerForMaskedLM(tiny_encoder_config(), rngs=nnx.Rngs(0), **kw)
      model.eval()
      return model

    # Jitted: eager shard_map dispatches every op of the pieces separately (minutes on 2 cores).
    run = nnx.jit(lambda m, *a: m(*a, max_global=3).logits)
    want = run(build(), *args)
    # Each row in 4 pieces of 6 tokens (23 padded to 24), fewer than window + 1: the band's keys
    # come from the neighbouring pieces, the global tokens' from every piece.
    model = build(mesh=make_mesh((1, 1, 4)), seq_axis="seq")
    assert_close(run(model, *args), want, 1e-5, "logits")
    # Training sees the same gradients: every parameter's, through halos and global tokens.
    cotangent = jax.random.normal(jax.random.key(1), want.shape)
    grad = nnx.jit(nnx.grad(lambda m, *a: (m(*a, max_global=3).logits * cotangent).sum()))
    want_grads = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grad(build(), *args)))
    grads = jax.tree.leaves(nnx.to_pure_dict(grad(model, *args)))
    assert len(grads) == len(want_grads) > 20
    for (path, g_want), g in zip(want_grads, grads):
      assert_close(g, g_want, 1e-5, jax.tree_util.keystr(path))
    # ... and the pieces did exchange halos (the sequence-parallel path ran, not a gathered one).
    graphdef, state = nnx.split(model)
    lowered = jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a, max_global=3).logits).lower(
        state, *args)
    assert "collective_permute" in lowered.as_text()
    print("ok")
""")


@pytest.mark.integration  # a subprocess on 4 simulated devices
def test_sequence_parallel_forward_equals_one_device():
  """A masked LM built with a mesh whose seq axis splits every sequence over 4 (simulated)
  devices gives the logits and parameter gradients of the model without a mesh: band halos,
  padding and global tokens across pieces."""
  root = Path(__file__).parents[1]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu", PYTHONPATH=f"{root}:{root / 'tests'}")
  proc = subprocess.run([sys.executable, "-c", _SEQUENCE_PARALLEL], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
