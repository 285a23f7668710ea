"""LED (paper §6): our NNX models against HF transformers' PyTorch LED at 1e-5 in float32, exact
round trips, cached decoding equal to the full decoder, BART made long equal to the BART, and
clear errors on bad inputs.

Random-weight HF models built locally: three encoder layers with different windows (HF totals 4,
16, 8), encoder inputs whose length (21) is a multiple of none of them, padding (rows of 21, 15
and 6 tokens), and 2, 1 and 0 global tokens per row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

_NEEDS = "LED is tested against PyTorch HF models: pip install -e '.[torch]'"
torch = pytest.importorskip("torch", reason=_NEEDS)
transformers = pytest.importorskip("transformers", reason=_NEEDS)

from hf_testing import randomise_
from longformer_jax import LEDConfig, convert, led
from longformer_jax.layers import LOGICAL_AXES

# Tiny models: compile time dominates (conftest.py).
pytestmark = pytest.mark.unit

ATOL = 1e-5
VOCAB, BATCH, ENC_LEN, DEC_LEN = 48, 3, 21, 7
ENC_LENGTHS, DEC_LENGTHS = (21, 15, 6), (7, 7, 5)
HF_WINDOWS = [4, 16, 8]  # HF totals: one-sided 2, 8, 4 here
SMALL_LED = dict(vocab_size=VOCAB, d_model=32, encoder_layers=3, decoder_layers=2,
                 encoder_attention_heads=2, decoder_attention_heads=4, encoder_ffn_dim=48,
                 decoder_ffn_dim=40, max_encoder_position_embeddings=40,
                 max_decoder_position_embeddings=24, attention_window=HF_WINDOWS)
# The same shapes as our config: models of the tests share compiled code.
CONFIG = convert.config_from_hf({**SMALL_LED, "model_type": "led"})


def random_led(hf_class, seed: int = 0):
  torch.manual_seed(seed)
  model = randomise_(hf_class(transformers.LEDConfig(**SMALL_LED)), seed)
  if hasattr(model, "final_logits_bias"):  # a buffer: randomise_ leaves it at zero
    with torch.no_grad():
      model.final_logits_bias.normal_()
  return model


def random_bart(seed: int = 0):
  """An HF BartForConditionalGeneration whose position tables hold 16 tokens."""
  torch.manual_seed(seed)
  fields = {k: v for k, v in SMALL_LED.items() if not k.startswith(("max_", "attention_"))}
  model = transformers.BartForConditionalGeneration(
      transformers.BartConfig(**fields, max_position_embeddings=16))
  return randomise_(model, seed)


def make_inputs(seed: int = 0) -> dict[str, np.ndarray]:
  """Encoder rows of 21, 15 and 6 real tokens with 2, 1, 0 global tokens; decoder rows of 7, 7
  and 5 real tokens."""
  rng = np.random.default_rng(seed)
  enc_mask = np.arange(ENC_LEN)[None] < np.array(ENC_LENGTHS)[:, None]
  dec_mask = np.arange(DEC_LEN)[None] < np.array(DEC_LENGTHS)[:, None]
  ids = np.where(enc_mask, rng.integers(4, VOCAB, (BATCH, ENC_LEN)), 1)
  ids[:, 0] = 0
  global_mask = np.zeros((BATCH, ENC_LEN), np.int64)
  global_mask[0, [0, 5]] = 1
  global_mask[1, 0] = 1
  dec_ids = np.where(dec_mask, rng.integers(4, VOCAB, (BATCH, DEC_LEN)), 1)
  dec_ids[:, 0] = 2
  return dict(input_ids=ids, attention_mask=enc_mask.astype(np.int64),
              global_attention_mask=global_mask, decoder_input_ids=dec_ids,
              decoder_attention_mask=dec_mask.astype(np.int64))


@functools.partial(nnx.jit, static_argnames="output_hidden_states")
def forward(model, inputs: dict, output_hidden_states: bool = False):
  """One compilation per model structure and input shapes, shared by the tests (cheaper on CPU
  than running the ops one by one)."""
  return model(**inputs, max_global=2, output_hidden_states=output_hidden_states)


def run_both(hf_model, inputs, **kwargs):
  """(HF output, our model converted from it, our output)."""
  with torch.no_grad():
    theirs = hf_model(**{k: torch.tensor(v) for k, v in inputs.items()}, **kwargs)
  model = convert.from_hf(hf_model)
  model.eval()
  return theirs, model, forward(model, {k: jnp.asarray(v) for k, v in inputs.items()}, **kwargs)


def assert_close(ours, theirs, real=None):
  ours, theirs = np.asarray(ours), theirs.detach().numpy()
  if real is not None:  # padding positions are not compared
    ours, theirs = ours[real], theirs[real]
  np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)


def params_of(model) -> list:
  return jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]


def assert_round_trip(hf_model, ours):
  """to_hf gives HF's state dict bit for bit, and from_hf gives our parameters back."""
  back = convert.to_hf(ours)
  assert type(back) is type(hf_model)
  assert list(back.config.attention_window) == HF_WINDOWS
  np.testing.assert_equal({k: v.numpy() for k, v in back.state_dict().items()},
                          {k: v.numpy() for k, v in hf_model.state_dict().items()})
  ours_again = convert.from_hf(back)
  assert ours_again.config == ours.config
  for (path, x), (path_again, y) in zip(params_of(ours), params_of(ours_again), strict=True):
    assert path == path_again
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


def test_model_matches_hf_and_round_trips():
  hf_model = random_led(transformers.LEDModel)
  inputs = make_inputs()
  theirs, model, ours = run_both(hf_model, inputs, output_hidden_states=True)
  assert model.config.layer_windows == (2, 8, 4)
  enc_real = inputs["attention_mask"].astype(bool)
  dec_real = inputs["decoder_attention_mask"].astype(bool)
  assert_close(ours.encoder_last_hidden_state, theirs.encoder_last_hidden_state, enc_real)
  assert_close(ours.last_hidden_state, theirs.last_hidden_state, dec_real)
  for a, b in zip(ours.encoder_hidden_states, theirs.encoder_hidden_states, strict=True):
    assert_close(a, b, enc_real)
  for a, b in zip(ours.decoder_hidden_states, theirs.decoder_hidden_states, strict=True):
    assert_close(a, b, dec_real)
  assert_round_trip(hf_model, model)


def test_conditional_generation_matches_hf_and_round_trips():
  """LM logits: the tied shared embedding plus final_logits_bias."""
  hf_model = random_led(transformers.LEDForConditionalGeneration, seed=1)
  inputs = make_inputs(1)
  theirs, model, ours = run_both(hf_model, inputs)
  assert isinstance(model, led.LEDForConditionalGeneration)
  assert_close(ours.logits, theirs.logits, inputs["decoder_attention_mask"].astype(bool))
  assert_round_trip(hf_model, model)


def test_question_answering_matches_hf_and_round_trips():
  """Without decoder inputs both decode input_ids shifted right; the span logits come from the
  decoder."""
  hf_model = random_led(transformers.LEDForQuestionAnswering, seed=2)
  inputs = make_inputs(2)
  del inputs["decoder_input_ids"], inputs["decoder_attention_mask"]
  theirs, model, ours = run_both(hf_model, inputs)
  assert ours.start_logits.shape == (BATCH, ENC_LEN)
  assert_close(ours.start_logits, theirs.start_logits)
  assert_close(ours.end_logits, theirs.end_logits)
  assert_round_trip(hf_model, model)


def test_cached_decoding_equals_full_decoder():
  """A prompt prefilled at once, then one token per jit-compiled step, through the static cache:
  the logits of the full (teacher-forced) decoder, to 1e-5."""
  model = convert.from_hf(random_led(transformers.LEDForConditionalGeneration, seed=1))
  model.eval()
  inputs = {k: jnp.asarray(v) for k, v in make_inputs(3).items()}
  # Cached decoding has no decoder padding (generation decodes every row to the same length).
  inputs["decoder_attention_mask"] = jnp.ones_like(inputs["decoder_attention_mask"])
  full = forward(model, inputs)

  cache = model.init_cache(full.encoder_last_hidden_state, inputs["attention_mask"],
                           max_length=10)
  assert cache.max_length == 10 and int(cache.index) == 0
  step = nnx.jit(lambda model, ids, cache: model.decode_step(ids, cache))
  dec_ids = inputs["decoder_input_ids"]
  logits, cache = step(model, dec_ids[:, :3], cache)
  pieces = [logits]
  for t in range(3, DEC_LEN):
    logits, cache = step(model, dec_ids[:, t:t + 1], cache)
    pieces.append(logits)
  assert int(cache.index) == DEC_LEN
  np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, axis=1)),
                             np.asarray(full.logits), atol=ATOL, rtol=0)

  # The same step inside one compiled lax.while_loop (the cache index traced): greedy decoding,
  # whose every token is the argmax of the full decoder run on the tokens before it.
  greedy = nnx.jit(functools.partial(greedy_decode, max_length=DEC_LEN + 1))
  tokens = greedy(model, inputs["input_ids"], inputs["attention_mask"],
                  inputs["global_attention_mask"])
  teacher_forced = forward(model, dict(inputs, decoder_input_ids=tokens[:, :-1])).logits
  np.testing.assert_array_equal(np.asarray(jnp.argmax(teacher_forced, axis=-1)),
                                np.asarray(tokens[:, 1:]))


def greedy_decode(model, input_ids, attention_mask, global_attention_mask, *, max_length: int):
  """[B, max_length] tokens: the decoder start token, then greedy choices, in a while_loop."""
  encoded = model.encode(input_ids, attention_mask, global_attention_mask, max_global=2)
  cache = model.init_cache(encoded.last_hidden_state, attention_mask, max_length=max_length)
  start = jnp.full((input_ids.shape[0], 1), model.config.decoder_start_token_id, jnp.int32)
  out = jnp.zeros((input_ids.shape[0], max_length), jnp.int32).at[:, :1].set(start)

  def step(carry):
    tokens, cache, out = carry
    logits, cache = model.decode_step(tokens, cache)
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tokens, cache, jax.lax.dynamic_update_slice(out, tokens, (0, cache.index))

  return jax.lax.while_loop(lambda carry: carry[1].index < max_length - 1, step,
                            (start, cache, out))[2]


def test_bart_to_led_matches_bart():
  """Positions copied (no offset rows), global = local projections: on inputs BART's table
  covers, with a window that covers them, the LED computes the BART's logits, global tokens or
  not."""
  bart = random_bart(seed=4)
  model = convert.bart_to_led(bart, max_positions=40, window=16)
  model.eval()
  assert isinstance(model, led.LEDForConditionalGeneration)
  c = model.config
  assert (c.max_encoder_position_embeddings, c.max_decoder_position_embeddings) == (40, 16)
  assert c.layer_windows == (16, 16, 16)

  old = bart.model.encoder.embed_positions.weight.detach().numpy()  # 2 offset rows + 16
  new = np.asarray(model.led.encoder.embed_positions.embedding[...])
  np.testing.assert_array_equal(new, np.concatenate([old[2:], old[2:], old[2:10]]))
  old_dec = bart.model.decoder.embed_positions.weight.detach().numpy()
  np.testing.assert_array_equal(np.asarray(model.led.decoder.embed_positions.embedding[...]),
                                old_dec[2:])
  attention = model.led.encoder.layers[1].attention
  for local, global_ in ((attention.key, attention.key_global),
                         (attention.value, attention.value_global)):
    np.testing.assert_array_equal(np.asarray(local.kernel[...]), np.asarray(global_.kernel[...]))

  inputs = make_inputs(4)
  global_mask = inputs.pop("global_attention_mask")[:, :16]
  for k in ("input_ids", "attention_mask"):  # rows of 16, 15 and 6 tokens: BART's table holds 16
    inputs[k] = inputs[k][:, :16]
  with torch.no_grad():
    theirs = bart(**{k: torch.tensor(v) for k, v in inputs.items()})
  args = {k: jnp.asarray(v) for k, v in inputs.items()}
  for mask in (np.zeros_like(global_mask), global_mask):
    ours = forward(model, dict(args, global_attention_mask=jnp.asarray(mask)))
    assert_close(ours.logits, theirs.logits, inputs["decoder_attention_mask"].astype(bool))
    assert_close(ours.encoder_last_hidden_state, theirs.encoder_last_hidden_state,
                 inputs["attention_mask"].astype(bool))


def test_checkpoint_directory_and_other_sources(tmp_path):
  """save_pretrained output loads like the model object; a checkpoint without the
  final_logits_bias buffer (HF tolerates that) loads it as zeros; BART and LED checkpoints are
  told apart."""
  hf_model = random_led(transformers.LEDForConditionalGeneration, seed=5)
  hf_model.save_pretrained(tmp_path / "led")
  from_dir, from_object = convert.from_hf(tmp_path / "led"), convert.from_hf(hf_model)
  assert from_dir.config == from_object.config
  for (path, x), (_, y) in zip(params_of(from_dir), params_of(from_object), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))

  state = {k: v for k, v in hf_model.state_dict().items() if k != "final_logits_bias"}
  torch.save(state, tmp_path / "pytorch_model.bin")
  (tmp_path / "config.json").write_text((tmp_path / "led" / "config.json").read_text())
  no_bias = convert.from_hf(tmp_path)
  np.testing.assert_array_equal(np.asarray(no_bias.final_logits_bias[...]), 0.0)

  with pytest.raises(ValueError, match="model_type='bart'; use bart_to_led"):
    convert.from_hf(random_bart())
  with pytest.raises(ValueError, match="bart_to_led converts BART checkpoints; got "
                                       "model_type='led'"):
    convert.bart_to_led(hf_model)


def test_bad_inputs_raise_clear_errors():
  """Each error is raised before any compute and names the values."""
  model = led.LEDForConditionalGeneration(CONFIG, rngs=nnx.Rngs(0))
  dec = jnp.full((1, 4), 5)
  with pytest.raises(ValueError, match="input_ids has 41 tokens; .*"
                                       "max_encoder_position_embeddings=40"):
    model(jnp.full((1, 41), 5), decoder_input_ids=dec)
  encoded = jnp.zeros((1, 8, CONFIG.d_model))
  with pytest.raises(ValueError, match="decoder_input_ids has 25 tokens; .*"
                                       "max_decoder_position_embeddings=24"):
    model.led.decode(jnp.full((1, 25), 5), encoded)
  mask = jnp.ones((2, 8), int).at[1, 6:].set(0)
  global_mask = jnp.zeros((2, 8), int).at[1, 7].set(1)
  with pytest.raises(ValueError, match="marks 1 padding token.*row 1, position 7"):
    model(jnp.full((2, 8), 5), mask, decoder_input_ids=dec, global_attention_mask=global_mask)
  with pytest.raises(ValueError, match=r"attention_mask holds 2 at \(1, 3\); expected 0 or 1"):
    model(jnp.full((2, 8), 5), mask.at[1, 3].set(2), decoder_input_ids=dec)
  with pytest.raises(ValueError, match=r"decoder_attention_mask holds 0.5 at \(0, 1\)"):
    model(jnp.full((1, 8), 5), decoder_input_ids=dec,
          decoder_attention_mask=jnp.ones((1, 4)).at[0, 1].set(0.5))
  with pytest.raises(ValueError, match=rf"input_ids holds -1 at position \(0, 2\); expected "
                                       rf"ids in \[0, {VOCAB}\) \(vocab_size={VOCAB}\)"):
    model(jnp.full((1, 8), 5).at[0, 2].set(-1), decoder_input_ids=dec)
  with pytest.raises(ValueError, match=rf"decoder_input_ids holds {VOCAB} at position \(0, 3\)"):
    model(jnp.full((1, 8), 5), decoder_input_ids=dec.at[0, 3].set(VOCAB))
  with pytest.raises(ValueError, match=rf"input_ids holds {VOCAB + 7} at position \(0, 0\)"):
    model.generate(jnp.full((1, 8), 5).at[0, 0].set(VOCAB + 7), max_new_tokens=2)
  with pytest.raises(ValueError, match="max_length=25 must be an int in \\[1, "
                                       "max_decoder_position_embeddings=24\\]"):
    model.init_cache(encoded, max_length=25)
  cache = model.init_cache(encoded, max_length=4).replace(index=jnp.asarray(3, jnp.int32))
  with pytest.raises(ValueError, match="2 new decoder tokens at position 3 do not fit the "
                                       "cache's max_length=4"):
    model.decode_step(dec[:, :2], cache)
  with pytest.raises(ValueError, match="decoder_input_ids has batch 2; the cache was built for "
                                       "batch 1"):
    model.decode_step(jnp.full((2, 1), 5), cache)


def test_config_presets_and_validation():
  """base and large have allenai/led-{base,large}-16384's shapes: the parameter count of the HF
  model built from their config (on torch's meta device: no memory)."""
  for preset, layers, width in ((LEDConfig.base(), 6, 768), (LEDConfig.large(), 12, 1024)):
    assert (preset.encoder_layers, preset.decoder_layers, preset.d_model) == (layers, layers,
                                                                             width)
    assert preset.layer_windows == (512,) * layers  # HF's attention_window 1024
    assert (preset.max_encoder_position_embeddings,
            preset.max_decoder_position_embeddings) == (16384, 1024)
    ours = nnx.eval_shape(lambda p=preset: led.LEDForConditionalGeneration(p, rngs=nnx.Rngs(0)))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(ours, nnx.Param)))
    with torch.device("meta"):
      hf_model = transformers.LEDForConditionalGeneration(convert.config_to_hf(preset))
    # HF's final_logits_bias is a buffer, ours a parameter.
    assert count == sum(p.numel() for p in hf_model.parameters()) + preset.vocab_size
  tiny = LEDConfig.tiny()
  assert LEDConfig.from_dict(tiny.to_dict()) == tiny
  with pytest.raises(ValueError, match="d_model=64 is not a multiple of decoder_attention_heads=5"):
    LEDConfig.tiny(decoder_attention_heads=5)
  with pytest.raises(ValueError, match="attention_window has 3 entries, expected 2"):
    LEDConfig.tiny(attention_window=(2, 2, 2))
  with pytest.raises(ValueError, match="decoder_start_token_id=64 is not a token id"):
    LEDConfig.tiny(decoder_start_token_id=64)
  with pytest.raises(ValueError, match="attention_dropout must be in"):
    LEDConfig.tiny(attention_dropout=1.0)


def test_logical_axes_bf16_and_remat():
  """Every parameter names its dimensions in the shared vocabulary; remat wraps every encoder and
  decoder layer of the gradient (JAX recomputes them: same values); bf16 compute stays close to
  float32."""
  config = CONFIG
  model = led.LEDForConditionalGeneration(config, rngs=nnx.Rngs(0))
  model.eval()
  for path, spec in jax.tree_util.tree_flatten_with_path(
      nnx.get_partition_spec(nnx.state(model, nnx.Param)),
      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]:
    assert all(name is None or name in LOGICAL_AXES for name in spec), path
  inputs = {k: jnp.asarray(v) for k, v in make_inputs(6).items()}

  def loss(model):
    return jnp.mean(model(**inputs, max_global=2).logits ** 2)

  def remat_count(jaxpr) -> int:
    """The remat (checkpoint) equations in `jaxpr` and the jaxprs nested in it."""
    count = 0
    for eqn in jaxpr.eqns:
      count += eqn.primitive.name.startswith(("remat", "checkpoint"))
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds its Jaxpr
          count += remat_count(sub) if hasattr(sub, "eqns") else 0
    return count

  for remat, expected in ((False, 0), (True, config.encoder_layers + config.decoder_layers)):
    m = led.LEDForConditionalGeneration(config.replace(remat=remat), rngs=nnx.Rngs(0))
    assert remat_count(nnx.jit(nnx.grad(loss)).trace(m).traced.jaxpr.jaxpr) == expected

  bf16 = led.LEDForConditionalGeneration(config.replace(dtype=jnp.bfloat16), rngs=nnx.Rngs(0))
  bf16.eval()
  half = forward(bf16, inputs).logits
  assert half.dtype == jnp.bfloat16
  full = np.asarray(forward(model, inputs).logits)
  np.testing.assert_allclose(np.asarray(half, np.float32), full,
                             atol=3e-2 * np.abs(full).max(), rtol=0)
