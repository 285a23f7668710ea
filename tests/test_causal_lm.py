"""LongformerForCausalLM: causality by exact-zero gradients, dtypes, options, config errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longformer_jax import causal_lm
from longformer_jax.causal_lm import CharLMConfig, LongformerForCausalLM

TINY = CharLMConfig(num_layers=2, hidden=32, num_heads=4, mlp_dim=64, windows=(3, 5),
                    dilations=((1, 1, 1, 1), (1, 1, 2, 3)))


def _model(cfg=TINY, seed=0):
  return LongformerForCausalLM(cfg, rngs=nnx.Rngs(seed))


def _tokens(batch, seq, seed=1):
  return jax.random.randint(jax.random.key(seed), (batch, seq), 0, 256)


@pytest.mark.parametrize("attention", ["band", "full"])
def test_causality_exact_zero_gradients(attention):
  """d loss_t / d x_s == 0 exactly for every s > t; nonzero for some s <= t."""
  cfg = dataclasses.replace(TINY, attention=attention)
  model = _model(cfg)
  seq = 24
  tokens = _tokens(1, seq)
  x_1xLxE = model.embed(tokens).astype(jnp.float32)

  def nll_L(x):
    logits = model.from_embeddings(x)
    return causal_lm.next_byte_nll(logits[:, :-1], tokens[:, 1:])[0]

  # jac[t, s, :] = d nll_t / d x_s: one reverse pass per position, one compile.
  jac_LxLxE = np.asarray(jax.jit(jax.jacrev(nll_L))(x_1xLxE)[:, 0])
  for t in range(seq - 1):
    assert np.all(jac_LxLxE[t, t + 1:] == 0.0), f"position {t} depends on a later input"
    assert np.any(jac_LxLxE[t, :t + 1] != 0.0)


def test_band_receptive_field_matches_windows():
  """With windows (3, 5) and dilation <= 3 the output at t sees no input before t - 3 - 5*3."""
  model = _model()
  tokens = _tokens(1, 40)
  x = model.embed(tokens).astype(jnp.float32)
  t = 39
  grad_LxE = np.asarray(jax.jit(jax.grad(lambda x: model.from_embeddings(x)[0, t].sum()))(x)[0])
  reach = 3 + 5 * 3
  assert np.all(grad_LxE[:t - reach] == 0.0)
  assert np.any(grad_LxE[t - reach:] != 0.0)


def test_band_equals_full_when_window_covers_sequence():
  model = _model(dataclasses.replace(TINY, dilations=None))
  full = _model(dataclasses.replace(TINY, attention="full", dilations=None))
  tokens = _tokens(2, 12)
  band_out = jax.jit(lambda t: model(t, windows=(12, 12)))(tokens)
  np.testing.assert_allclose(band_out, jax.jit(lambda t: full(t))(tokens), atol=2e-5, rtol=2e-5)


def test_bf16_compute_is_finite_with_float32_params():
  cfg = dataclasses.replace(TINY, dtype="bfloat16")
  model = _model(cfg)
  tokens = _tokens(2, 32)
  params = nnx.state(model, nnx.Param)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))

  def loss(params):
    logits = nnx.merge(nnx.graphdef(model), params)(tokens[:, :-1])
    assert logits.dtype == jnp.float32
    return causal_lm.next_byte_nll(logits, tokens[:, 1:]).mean()

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  assert np.isfinite(float(value))
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  ref = jax.jit(loss)(nnx.state(_model(TINY), nnx.Param))
  assert abs(float(value) - float(ref)) < 0.05  # bf16 matmuls, same weights


def test_remat_gives_same_loss_and_grads():
  tokens = _tokens(2, 16)

  def loss_and_grads(cfg):
    model = _model(cfg)
    graphdef, params = nnx.split(model)
    f = lambda p: causal_lm.next_byte_nll(
        nnx.merge(graphdef, p)(tokens[:, :-1]), tokens[:, 1:]).mean()
    return jax.jit(jax.value_and_grad(f))(params)

  l0, g0 = loss_and_grads(TINY)
  l1, g1 = loss_and_grads(dataclasses.replace(TINY, remat=True))
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_untied_head_and_dropout():
  cfg = dataclasses.replace(TINY, tie_embeddings=False, dropout=0.5)
  model = _model(cfg)
  assert causal_lm.num_params(model) == causal_lm.num_params(_model()) + 32 * 256 + 256
  tokens = _tokens(1, 10)
  graphdef, state = nnx.split(model)
  run = jax.jit(lambda s, key: nnx.merge(graphdef, s)(tokens, dropout_key=key))
  a = run(state, None)
  np.testing.assert_array_equal(a, run(state, None))  # no key: deterministic
  b = run(state, jax.random.key(0))
  c = run(state, jax.random.key(1))
  assert not np.allclose(a, b) and not np.allclose(b, c)
  np.testing.assert_array_equal(b, run(state, jax.random.key(0)))


def test_logical_axes_on_every_matrix():
  specs = nnx.get_partition_spec(nnx.state(_model(), nnx.Param))
  names = {tuple(s) for s in jax.tree.leaves(specs)}
  assert ("vocab", "embed") in names and ("embed", "heads") in names
  assert ("embed", "mlp") in names and ("mlp", "embed") in names
  assert all(n for n in names)  # nothing left unannotated


def test_presets_follow_the_paper_layout():
  small, large = causal_lm.char_small(), causal_lm.char_large()
  assert (small.num_layers, small.hidden, small.num_heads) == (12, 512, 8)
  assert (large.num_layers, large.hidden, large.num_heads) == (30, 512, 8)
  assert (small.dropout, large.dropout) == (0.2, 0.4)  # paper Appendix B, Table 12
  for cfg in (small, large):
    assert cfg.windows[0] == 32 and cfg.windows[-1] == 512
    assert list(cfg.windows) == sorted(cfg.windows)
    half = cfg.num_layers // 2
    assert cfg.layer_dilation(half - 1) == (1,) * 8     # no dilation in the lower half
    assert cfg.layer_dilation(half) == (1,) * 6 + (2, 2)  # then growing, on 2 heads only
    assert cfg.layer_dilation(cfg.num_layers - 1) == (1,) * 6 + (4, 4)
  tiny = causal_lm.char_tiny()
  assert causal_lm.num_params(_model(tiny)) < 3_000_000


@pytest.mark.parametrize("field, value, match", [
    ("hidden", 30, "not divisible by num_heads"),
    ("windows", (3,), "one entry per layer"),
    ("windows", (3, -1), "non-negative"),
    ("dilations", ((1, 1, 1, 1), (1, 1, 0, 1)), r"dilations\[1\]"),
    ("attention", "sparse", "attention must be one of"),
    ("dtype", "int8", "dtype must be one of"),
    ("dropout", 1.0, "dropout must be in"),
])
def test_config_errors_name_the_bad_value(field, value, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(TINY, **{field: value})


def test_call_time_windows_are_checked():
  with pytest.raises(ValueError, match="one entry per layer"):
    _model()(_tokens(1, 8), windows=(4,))
