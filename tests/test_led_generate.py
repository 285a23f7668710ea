"""LED generation (`LEDForConditionalGeneration.generate`, longformer_jax.search): token for token
HF transformers' `generate` on a random LED built locally, for greedy decoding and beam search
(2, 3 and 4 beams, length penalties 1 and 2, every early_stopping value, n-gram blocking, forced
BOS / EOS, min_length); sampling reproducible; one compiled loop; clear errors.

The model: HF's initializer at std 0.6 (then `randomise_`), so that the tokens depend on the
input and the step and greedy choices are not near-ties, and `final_logits_bias` 4 on EOS (0
elsewhere), so that rows end at different steps (greedy here: after 4, 1 and 4 tokens, one row
never) and beams finish at different lengths. Encoder rows of 21, 15, 6 and 11 tokens with 2, 1,
0 and 1 global tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

_NEEDS = "LED generation is tested against PyTorch HF models: pip install -e '.[torch]'"
torch = pytest.importorskip("torch", reason=_NEEDS)
transformers = pytest.importorskip("transformers", reason=_NEEDS)

from hf_testing import randomise_
from longformer_jax import convert, led, search

pytestmark = pytest.mark.unit

VOCAB, EOS, PAD, START = 48, 2, 1, 2  # HF LEDConfig's token ids (eos = decoder start)
ENC_LEN, ENC_LENGTHS = 21, (21, 15, 6, 11)
MAX_NEW = 14
SMALL_LED = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=2, decoder_attention_heads=4, encoder_ffn_dim=48,
                 decoder_ffn_dim=40, max_encoder_position_embeddings=40,
                 max_decoder_position_embeddings=24, attention_window=[4, 8], init_std=0.6)


def _hf_model():
  torch.manual_seed(0)
  model = randomise_(transformers.LEDForConditionalGeneration(
      transformers.LEDConfig(**SMALL_LED)), 0)
  with torch.no_grad():
    model.final_logits_bias.zero_()
    model.final_logits_bias[0, EOS] = 4.0
  return model


HF_MODEL = _hf_model()
MODEL = convert.from_hf(HF_MODEL)


def _inputs() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  mask = np.arange(ENC_LEN)[None] < np.array(ENC_LENGTHS)[:, None]
  ids = np.where(mask, rng.integers(4, VOCAB, mask.shape), PAD)
  ids[:, 0] = 0  # <s>
  global_mask = np.zeros(mask.shape, np.int64)
  global_mask[0, [0, 5]] = 1
  global_mask[1, 0] = 1
  global_mask[3, 3] = 1
  return dict(input_ids=ids, attention_mask=mask.astype(np.int64),
              global_attention_mask=global_mask)


INPUTS = _inputs()


def hf_generate(**settings) -> np.ndarray:
  with torch.no_grad():
    out = HF_MODEL.generate(**{k: torch.tensor(v) for k, v in INPUTS.items()},
                            max_new_tokens=MAX_NEW, do_sample=False, **settings)
  return out.numpy()


def ours(global_attention_mask="given", **settings) -> np.ndarray:
  if isinstance(global_attention_mask, str):
    global_attention_mask = INPUTS["global_attention_mask"]
  return np.asarray(MODEL.generate(INPUTS["input_ids"], INPUTS["attention_mask"],
                                   global_attention_mask, max_new_tokens=MAX_NEW, **settings))


@pytest.mark.parametrize("settings", [
    dict(),
    dict(num_beams=2, forced_bos_token_id=7, forced_eos_token_id=EOS),
    dict(num_beams=2, length_penalty=2.0, early_stopping=True),
    dict(num_beams=4, early_stopping=True),
    dict(num_beams=4, length_penalty=2.0, no_repeat_ngram_size=2),
    dict(num_beams=3, length_penalty=2.0, early_stopping="never"),
], ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()) or "greedy")
def test_matches_hf_generate(settings):
  theirs, mine = hf_generate(**settings), ours(**settings)
  assert mine.dtype == np.int32
  assert mine.shape == theirs.shape
  np.testing.assert_array_equal(mine, theirs)


def test_greedy_rows_end_at_eos_then_pad_as_hf():
  """Default global attention (the first token of each row), n-gram blocking and min_length on
  greedy decoding; rows that end early are padded exactly as HF pads them."""
  first_token = np.zeros_like(INPUTS["global_attention_mask"])
  first_token[:, 0] = 1
  settings = dict(no_repeat_ngram_size=2, min_length=4)
  with torch.no_grad():
    theirs = HF_MODEL.generate(
        torch.tensor(INPUTS["input_ids"]), attention_mask=torch.tensor(INPUTS["attention_mask"]),
        global_attention_mask=torch.tensor(first_token), max_new_tokens=MAX_NEW,
        do_sample=False, **settings).numpy()
  mine = ours(global_attention_mask=None, **settings)
  np.testing.assert_array_equal(mine, theirs)

  greedy = ours()
  np.testing.assert_array_equal(greedy, hf_generate())
  assert greedy.shape == (4, 1 + MAX_NEW) and np.all(greedy[:, 0] == START)
  ends = [np.flatnonzero(row[1:] == EOS) for row in greedy]
  ended = [e[0] + 1 for e in ends if len(e)]
  # The data exercise it: rows end at different steps, one never does.
  assert len(set(ended)) >= 2 and any(len(e) == 0 for e in ends), greedy
  for row, end in zip(greedy, ends):
    if len(end):
      assert np.all(row[end[0] + 2:] == PAD), row


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
  a = ours(do_sample=True, temperature=1.5, seed=3)
  np.testing.assert_array_equal(a, ours(do_sample=True, temperature=1.5, seed=3))
  assert not np.array_equal(a, ours(do_sample=True, temperature=1.5, seed=4))
  assert a.dtype == np.int32 and a.min() >= 0 and a.max() < VOCAB and np.all(a[:, 0] == START)
  for row in a:  # padding after EOS, as greedy
    end = np.flatnonzero(row[1:] == EOS)
    if len(end):
      assert np.all(row[end[0] + 2:] == PAD), row
  np.testing.assert_array_equal(ours(do_sample=True, top_k=1, seed=5), ours())


def test_one_compiled_loop_no_retrace(monkeypatch):
  """The decoder step is traced once per compilation (a `while` loop, not unrolled), the lowered
  program holds the loop, and a second call with other inputs of the same shapes reuses the
  compiled program."""
  traces = []
  decode_step = led.LEDForConditionalGeneration.decode_step

  def counting_decode_step(self, ids, cache):
    traces.append(ids.shape)
    return decode_step(self, ids, cache)

  programs = []
  generate_fn = led._generate_fn

  def spy(graphdef, settings):
    run = generate_fn(graphdef, settings)

    def call(*args):
      programs.append((run, args))
      return run(*args)

    return call

  monkeypatch.setattr(led.LEDForConditionalGeneration, "decode_step", counting_decode_step)
  monkeypatch.setattr(led, "_generate_fn", spy)
  settings = dict(num_beams=2, max_new_tokens=9)  # not compiled by another test
  first = MODEL.generate(INPUTS["input_ids"], INPUTS["attention_mask"], **settings)
  assert traces == [(4 * 2, 1)]  # one trace of the step: [batch * beams, 1 token]
  other_ids = np.where(INPUTS["attention_mask"], (INPUTS["input_ids"] + 5) % VOCAB, PAD)
  MODEL.generate(other_ids, INPUTS["attention_mask"], **settings)
  assert len(traces) == 1 and first.shape[0] == 4
  run, args = programs[0]
  assert "stablehlo.while" in run.lower(*args).as_text()


def test_ngram_ban_equals_hf_processor():
  """`search.banned_ngram_tokens` (static shapes, cur_len traced) bans what HF's
  NoRepeatNGramLogitsProcessor bans on the first cur_len tokens; the tokens after them are
  ignored."""
  rng = np.random.default_rng(1)
  sequences = rng.integers(0, 5, (6, 16))  # 5 symbols: many repeated n-grams
  banned = jax.jit(search.banned_ngram_tokens, static_argnums=(2, 3))
  for size in (1, 2, 3):
    processor = transformers.NoRepeatNGramLogitsProcessor(size)
    for cur_len in range(1, 16):
      scores = processor(torch.tensor(sequences[:, :cur_len]), torch.zeros(6, 7))
      np.testing.assert_array_equal(
          np.asarray(banned(jnp.asarray(sequences), jnp.int32(cur_len), size, 7)),
          np.isneginf(scores.numpy()), err_msg=f"n={size}, cur_len={cur_len}")


def test_cache_sharing_and_reorder():
  """Beams share their item's cross-attention keys ([B, N, H, D], not B * K rows) and
  `reorder_rows` moves self-attention rows only."""
  encoder = jnp.ones((2, 5, MODEL.config.d_model))
  cache = MODEL.init_cache(encoder, max_length=6, num_beams=3)
  layer = cache.layers[0]
  assert cache.rows == 6 and layer.self_key.shape[0] == 6 and layer.cross_key.shape[0] == 2
  cache = cache.replace(layers=tuple(
      l.replace(self_key=l.self_key + jnp.arange(6.0)[:, None, None, None]) for l in cache.layers))
  moved = cache.reorder_rows(jnp.array([2, 2, 0, 5, 3, 3]))
  np.testing.assert_array_equal(np.asarray(moved.layers[1].self_key[:, 0, 0, 0]),
                                [2, 2, 0, 5, 3, 3])
  assert moved.layers[1].cross_key is cache.layers[1].cross_key


def _global_at(row: int, position: int) -> np.ndarray:
  mask = np.zeros((4, ENC_LEN), int)
  mask[row, position] = 1
  return mask


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_beams=0), "num_beams must be an int >= 1, got 0"),
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
    (dict(max_new_tokens=25), "max_new_tokens=25 exceeds the decoder's position table "
                              r"\(max_decoder_position_embeddings=24\)"),
    (dict(input_ids=np.full((1, 41), 5)), "input_ids has 41 tokens; the encoder's position "
                                          "table holds max_encoder_position_embeddings=40"),
    (dict(global_attention_mask=_global_at(2, 7)),
     r"marks 1 padding token\(s\), the first at row 2, position 7"),
    (dict(num_beams=2, do_sample=True), "do_sample=True with num_beams=2: beam sampling is not "
                                        "supported"),
    (dict(do_sample=True, temperature=0.0), "temperature must be > 0 with do_sample=True"),
    (dict(do_sample=True, top_k=49), r"top_k=49 exceeds the vocabulary \(vocab_size=48\)"),
    (dict(num_beams=2, early_stopping="sometimes"), "early_stopping must be True, False or "
                                                    "'never', got 'sometimes'"),
    (dict(num_beams=2, length_penalty=float("nan")), "length_penalty must be a finite number"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be an int >= 0, got -1"),
    (dict(min_length=30), "min_length=30 can never be reached: outputs hold at most "
                          "1 \\+ max_new_tokens=21 tokens"),
    (dict(forced_bos_token_id=48), r"forced_bos_token_id=48 is not a token id of the "
                                   r"vocabulary \(vocab_size=48\)"),
])
def test_bad_arguments_are_named(kwargs, match):
  """Raised before anything is compiled."""
  args = dict(input_ids=INPUTS["input_ids"], attention_mask=INPUTS["attention_mask"],
              max_new_tokens=20)
  with pytest.raises(ValueError, match=match):
    MODEL.generate(**{**args, **kwargs})
