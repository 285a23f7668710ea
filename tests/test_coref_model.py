"""The coreference model (`longformer_jax.coref`): its config, the span grid that feeds it against
brute force, coarse-to-fine against naive full antecedent scoring with no pruning, the loss
against a numpy enumeration, oracle scores through `predict_clusters` and `coref_scores`, jit
with gradients, and padding that changes nothing for the real tokens. Tiny shapes: most tests
run the head (`score_spans`) on random token states, two run the whole model."""

import fractions
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longformer_jax import coref
from longformer_jax.config import LongformerConfig
from longformer_jax.tasks import coref_scores

pytestmark = pytest.mark.unit

ENCODER = LongformerConfig.tiny(vocab_size=64, hidden_size=16, num_attention_heads=2,
                                intermediate_size=32, num_hidden_layers=1, attention_window=4,
                                max_position_embeddings=66)
W = 3
# Every candidate kept (ratio = W keeps up to N * W spans), every antecedent scored.
NO_PRUNING = coref.CorefConfig.tiny(encoder=ENCODER, max_span_width=W, top_span_ratio=float(W),
                                    max_antecedents=10_000, ffnn_size=8, feature_size=4)


@pytest.fixture(scope="module")
def model():
  return coref.LongformerForCoreference(NO_PRUNING, rngs=nnx.Rngs(0))


def _document(seed, n=10):
  """Random token states, sentences, a padding tail, speakers and a genre for one row."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(1, n, ENCODER.hidden_size)).astype(np.float32)
  sentence_ids = np.cumsum(rng.random(n) < 0.3)[None]
  mask = np.ones((1, n), bool)
  mask[0, n - 2:] = False
  speakers = rng.integers(0, 2, (1, n))
  return x, mask, sentence_ids, speakers, np.array([3])


def _brute_force_spans(sentence_ids, mask, max_width):
  n = len(sentence_ids)
  return [(s, e) for s in range(n) for e in range(s, min(s + max_width, n))
          if len(set(sentence_ids[s:e + 1])) == 1 and all(mask[s:e + 1])]


def _kept(out, b=0):
  mask = np.asarray(out.top_span_mask[b])
  return list(zip(np.asarray(out.top_span_starts[b])[mask].tolist(),
                  np.asarray(out.top_span_ends[b])[mask].tolist()))


# ----------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize("change, error, problem", [
    (dict(max_span_width=0), ValueError, "max_span_width must be a positive int, got 0"),
    (dict(max_antecedents=2.0), ValueError, "max_antecedents must be a positive int"),
    (dict(top_span_ratio=0.0), ValueError, "top_span_ratio must be a finite number > 0"),
    (dict(top_span_ratio=math.inf), ValueError, "top_span_ratio must be a finite number > 0"),
    (dict(top_span_ratio=1e-4), ValueError, "top_span_ratio must be at least 0.001"),
    (dict(ffnn_depth=-1), ValueError, "ffnn_depth must be an int >= 0, got -1"),
    (dict(dropout=1.0), ValueError, r"dropout must be in \[0, 1\), got 1.0"),
    (dict(use_speakers="yes"), ValueError, "use_speakers must be a bool"),
    (dict(encoder={"hidden_size": 8}), TypeError, "encoder must be a LongformerConfig, got dict"),
])
def test_config_refuses(change, error, problem):
  with pytest.raises(error, match=problem):
    coref.CorefConfig.tiny(**change)


def test_config_round_trips_through_json_and_sizes_k():
  config = coref.CorefConfig.tiny(use_speakers=False)
  again = coref.CorefConfig.from_dict(json.loads(json.dumps(config.to_dict())))
  assert again == config and again.encoder == config.encoder
  with pytest.raises(ValueError, match=r"unknown CorefConfig fields: \['width'\]"):
    coref.CorefConfig.from_dict({**config.to_dict(), "width": 3})
  base = coref.CorefConfig()
  assert (base.max_span_width, base.top_span_ratio, base.max_top_spans,
          base.max_antecedents) == (30, 0.4, 3900, 50)
  assert base.num_top_spans(4096) == 1638 and base.num_top_spans(100_000) == 3900
  assert NO_PRUNING.num_top_spans(10) == 10 * W  # every candidate
  # Kept counts are exact floors, the same on the host and under jit (0.7 * 10 is 6.99999988
  # in float32: a float product would keep 6).
  for ratio in (0.4, 0.7, 0.35, 1.0, 2.5):
    config = coref.CorefConfig.tiny(top_span_ratio=ratio, max_top_spans=3900)
    lengths = np.arange(0, 5000, 7, dtype=np.int32)
    expected = [min(int(math.floor(fractions.Fraction(str(ratio)) * n)), 3900) for n in lengths]
    assert [config.keep_count(int(n)) for n in lengths] == expected
    assert np.asarray(jax.jit(config.keep_count)(lengths)).tolist() == expected
  with pytest.raises(TypeError, match="takes a CorefConfig, got LongformerConfig"):
    coref.LongformerForCoreference(ENCODER, rngs=nnx.Rngs(0))
  assert coref.genre_id("nw/wsj/00/wsj_0001_0") == 3 and coref.genre_id("xx/a") == 0


# ----------------------------------------------------------------------------------------------
# The span grid and coarse-to-fine against naive scoring


@pytest.mark.parametrize("seed", range(3))
def test_span_grid_feeding_the_model_equals_brute_force(model, seed):
  x, mask, sentence_ids, _, _ = _document(seed)
  out = model.score_spans(jnp.asarray(x), jnp.asarray(mask), jnp.asarray(sentence_ids))
  expected = _brute_force_spans(sentence_ids[0].tolist(), mask[0].tolist(), W)
  assert _kept(out) == expected  # every valid span kept, sorted by start then end
  # The valid candidates are the grid's, at index start * W + width.
  valid = np.asarray(out.candidate_mention_scores[0]) > -1e8
  assert [(i // W, i // W + i % W) for i in np.flatnonzero(valid)] == expected
  # Kept spans first, and the mask marks exactly as many as there are valid spans.
  keep = np.asarray(out.top_span_mask[0])
  assert keep[:len(expected)].all() and not keep[len(expected):].any()


def _bucket(d):
  return d if d < 5 else min(int(math.floor(math.log2(d))) + 3, 9)


def _naive_scores(model, x, spans, sentence_speakers, genre):
  """{(i, j): score} of every pair j < i of `spans` (in order), one span at a time."""
  x = jnp.asarray(x[0])
  g = []
  for s, e in spans:
    weights = jax.nn.softmax(model.head_scorer(x[s:e + 1])[:, 0])
    head = jnp.sum(weights[:, None] * x[s:e + 1], axis=0)
    g.append(jnp.concatenate([x[s], x[e], model.width_embedding(jnp.array(e - s)), head]))
  g = jnp.stack(g)
  mention = model.mention_ffnn(g)
  source = model.coarse_projection(g)
  pairs, features = [], []
  for i in range(len(spans)):
    for j in range(i):
      same = int(sentence_speakers[spans[i][0]] == sentence_speakers[spans[j][0]])
      features.append(jnp.concatenate([
          g[i], g[j], g[i] * g[j], model.distance_embedding(jnp.array(_bucket(i - j))),
          model.speaker_embedding(jnp.array(same)), model.genre_embedding(jnp.array(genre))]))
      pairs.append((i, j))
  fine = model.antecedent_ffnn(jnp.stack(features))
  return {(i, j): float(mention[i] + mention[j] + source[i] @ g[j] + fine[p])
          for p, (i, j) in enumerate(pairs)}


@pytest.mark.parametrize("seed", range(2))
def test_coarse_to_fine_without_pruning_equals_full_antecedent_scoring(model, seed):
  x, mask, sentence_ids, speakers, genre = _document(seed)
  out = model.score_spans(jnp.asarray(x), jnp.asarray(mask), jnp.asarray(sentence_ids),
                          jnp.asarray(speakers), jnp.asarray(genre))
  spans = _kept(out)
  expected = _naive_scores(model, x, spans, speakers[0].tolist(), int(genre[0]))
  got = {}
  antecedents, ant_mask = np.asarray(out.antecedents[0]), np.asarray(out.antecedent_mask[0])
  scores = np.asarray(out.antecedent_scores[0])
  assert (scores[:, 0] == 0).all()  # the dummy
  assert (scores[:, 1:][~ant_mask] == -1e9).all()
  for i in range(len(spans)):
    for k in np.flatnonzero(ant_mask[i]):
      assert (i, int(antecedents[i, k])) not in got
      got[(i, int(antecedents[i, k]))] = float(scores[i, k + 1])
  assert sorted(got) == sorted(expected)  # every earlier span, none twice, no later one
  np.testing.assert_allclose([got[p] for p in sorted(got)], [expected[p] for p in sorted(got)],
                             rtol=1e-5, atol=1e-5)
  # The kept spans' mention scores are those of their candidates.
  np.testing.assert_array_equal(
      np.asarray(out.top_span_mention_scores[0]),
      np.asarray(out.candidate_mention_scores[0])[np.asarray(out.top_span_indices[0])])


# ----------------------------------------------------------------------------------------------
# The loss, and oracle scores


def _logsumexp(values):
  top = max(values)
  return top + math.log(sum(math.exp(v - top) for v in values))


def _numpy_loss(out, clusters):
  """The loss by enumeration: per kept span, its gold antecedents among the scored ones."""
  cluster_of = {tuple(span): c for c, cluster in enumerate(clusters) for span in cluster}
  kept = _kept(out)
  scores = np.asarray(out.antecedent_scores[0], np.float64)
  total = 0.0
  for i, span in enumerate(kept):
    gold = [0]
    if span in cluster_of:
      gold = [k + 1 for k, j in enumerate(np.asarray(out.antecedents[0, i]).tolist())
              if out.antecedent_mask[0, i, k] and cluster_of.get(kept[j]) == cluster_of[span]]
      gold = gold or [0]
    allowed = [0] + [k + 1 for k in np.flatnonzero(np.asarray(out.antecedent_mask[0, i]))]
    total += _logsumexp(scores[i, allowed]) - _logsumexp(scores[i, gold])
  return total


def test_loss_equals_numpy_enumeration():
  # Pruning on (ratio 0.5, 3 antecedents): some gold mentions are dropped, some gold
  # antecedents fall outside the top 3, and spans with none fall back to the dummy.
  config = NO_PRUNING.replace(top_span_ratio=0.5, max_antecedents=3)
  model = coref.LongformerForCoreference(config, rngs=nnx.Rngs(1))
  x, mask, sentence_ids, speakers, genre = _document(5, n=16)
  # Scale the states so the scores spread (the untrained FFNNs are nearly flat).
  out = model.score_spans(jnp.asarray(x * 10), jnp.asarray(mask), jnp.asarray(sentence_ids),
                          jnp.asarray(speakers), jnp.asarray(genre))
  kept = _kept(out)
  # Gold: clusters over the kept spans (so the gold antecedents are scored) and one mention
  # that was pruned, and a gold mention whose cluster has no kept antecedent.
  dropped = [span for span in _brute_force_spans(sentence_ids[0].tolist(), mask[0].tolist(), W)
             if span not in kept]
  clusters = [[kept[0], kept[2], kept[5]], [kept[1], kept[6]], [kept[3], dropped[-1]]]
  assert len(kept) == 7  # floor(0.5 * 14 real tokens)
  gold = {k: jnp.asarray(v)[None] for k, v in coref.gold_arrays(clusters, 12).items()}
  loss = coref.coref_loss(out, **gold)
  assert loss.shape == (1,)
  expected = _numpy_loss(out, clusters)
  np.testing.assert_allclose(float(loss[0]), expected, rtol=1e-5)
  # Labels: some span with a gold antecedent, and the dummy elsewhere.
  labels = np.asarray(coref.antecedent_labels(out, **gold)[0])
  assert labels[:, 1:].any() and labels[:, 0].any()
  assert (labels.sum(axis=1) >= 1).all()
  # The optional mention loss: binary cross-entropy of every valid candidate.
  candidates = _brute_force_spans(sentence_ids[0].tolist(), mask[0].tolist(), W)
  mention_scores = np.asarray(out.candidate_mention_scores[0], np.float64)
  gold_mentions = {tuple(span) for cluster in clusters for span in cluster}
  bce = sum(math.log1p(math.exp(-score if span in gold_mentions else score))
            for span in candidates
            for score in [mention_scores[span[0] * W + span[1] - span[0]]])
  with_mentions = coref.coref_loss(out, **gold, mention_weight=0.5)
  np.testing.assert_allclose(float(with_mentions[0]), expected + 0.5 * bce, rtol=1e-5)
  with pytest.raises(ValueError, match="hold 7 mentions, more than max_mentions=6"):
    coref.gold_arrays(clusters, 6)


def test_oracle_scores_give_conll_f1_one(model):
  x, mask, sentence_ids, _, _ = _document(7, n=14)
  out = model.score_spans(jnp.asarray(x), jnp.asarray(mask), jnp.asarray(sentence_ids))
  kept = _kept(out)
  # Three chains over spans of the grid (no singleton, as in OntoNotes).
  clusters = [[kept[0], kept[4], kept[9]], [kept[2], kept[7]], [kept[11], kept[-1]]]
  gold = {k: jnp.asarray(v)[None] for k, v in coref.gold_arrays(clusters, 10).items()}
  labels = coref.antecedent_labels(out, **gold)
  # Gold antecedents +20, other allowed ones -20, the dummy 0 (the model's), the rest -1e9.
  allowed = jnp.pad(out.antecedent_mask, ((0, 0), (0, 0), (1, 0)))
  oracle = out.replace(antecedent_scores=jnp.where(
      labels, 20.0, jnp.where(allowed, -20.0, -1e9)).at[:, :, 0].set(0.0))
  predicted = coref.predict_clusters(oracle)
  assert predicted == [sorted(sorted(c) for c in clusters)]
  for singletons in (True, False):
    assert coref_scores(golds=[clusters], predictions=predicted,
                        singletons=singletons)["conll_f1"] == pytest.approx(1.0)
  # The oracle's loss is near 0; the untrained scores' is not.
  assert float(coref.coref_loss(oracle, **gold)[0]) < 0.1
  assert float(coref.coref_loss(out, **gold)[0]) > 1.0
  # One link dropped: the score falls below 1.
  worse = oracle.replace(antecedent_scores=oracle.antecedent_scores.at[0, 9, 1:].set(-20.0))
  assert coref_scores(golds=[clusters], predictions=coref.predict_clusters(worse))[
      "conll_f1"] < 1.0


# ----------------------------------------------------------------------------------------------
# The whole model: jit, gradients, padding


PRUNED = NO_PRUNING.replace(top_span_ratio=0.4, max_antecedents=4)


def test_jit_gradients_and_padding_that_changes_nothing():
  model = coref.LongformerForCoreference(PRUNED, rngs=nnx.Rngs(2))
  rng = np.random.default_rng(3)
  n, pad = 20, 12
  ids = rng.integers(3, ENCODER.vocab_size, (1, n))
  sentences = np.repeat(np.arange(4), 5)[None]
  speakers = np.repeat(np.arange(2), 10)[None]
  clusters = [[(0, 1), (6, 6), (15, 16)], [(3, 3), (11, 12)]]
  gold = {k: jnp.asarray(v)[None] for k, v in coref.gold_arrays(clusters, 8).items()}

  @nnx.jit
  def forward(model, ids, mask, sentences, speakers):
    return model(ids, mask, sentences, speakers, jnp.array([1]))

  @nnx.jit
  def loss_and_grad(model, ids, mask, sentences, speakers):
    def loss_fn(model):
      out = model(ids, mask, sentences, speakers, jnp.array([1]))
      return coref.coref_loss(out, **gold)[0], out
    return nnx.value_and_grad(loss_fn, has_aux=True)(model)

  mask = np.ones((1, n), int)
  (loss, short), grads = loss_and_grad(model, ids, mask, sentences, speakers)
  assert np.isfinite(float(loss)) and float(loss) > 0
  leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
  assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
  # Gradients reach the head and the encoder.
  assert np.abs(np.asarray(grads.antecedent_ffnn.out.kernel[...])).sum() > 0
  assert np.abs(np.asarray(grads.longformer.embeddings.word_embeddings.embedding[...])).sum() > 0

  padded = forward(model, np.pad(ids, ((0, 0), (0, pad)), constant_values=ENCODER.pad_token_id),
                   np.pad(mask, ((0, 0), (0, pad))),
                   np.pad(sentences, ((0, 0), (0, pad)), mode="edge"),
                   np.pad(speakers, ((0, 0), (0, pad))))
  assert short.top_span_mask.shape == (1, 8) and padded.top_span_mask.shape == (1, 12)
  kept = int(np.sum(short.top_span_mask))
  assert kept == 8 and int(np.sum(padded.top_span_mask)) == kept  # floor(0.4 * 20) each
  for name in ("top_span_starts", "top_span_ends", "top_span_indices", "antecedents",
               "antecedent_mask"):
    np.testing.assert_array_equal(np.asarray(getattr(padded, name))[0, :kept],
                                  np.asarray(getattr(short, name))[0, :kept], err_msg=name)
  np.testing.assert_allclose(np.asarray(padded.antecedent_scores)[0, :kept],
                             np.asarray(short.antecedent_scores)[0, :kept], rtol=1e-5, atol=1e-5)
  # The real spans' mention scores (candidates index the same spans: start * W + width).
  np.testing.assert_allclose(np.asarray(padded.candidate_mention_scores)[0, :n * W],
                             np.asarray(short.candidate_mention_scores)[0], rtol=1e-5, atol=1e-5)
  # Spans never cover padding: every candidate ending at a padding token is invalid.
  index = np.arange((n + pad) * W)
  assert (np.asarray(padded.candidate_mention_scores)[0, index // W + index % W >= n]
          == -1e9).all()
  starts = np.asarray(padded.top_span_starts)[0, :kept]
  ends = np.asarray(padded.top_span_ends)[0, :kept]
  assert (ends < n).all() and (starts <= ends).all()


def test_segments_are_encoded_apart_and_stitched():
  model = coref.LongformerForCoreference(PRUNED, rngs=nnx.Rngs(4))
  ids = np.random.default_rng(4).integers(3, ENCODER.vocab_size, (1, 12))
  mask = np.ones((1, 12), bool)
  sentences = np.repeat(np.arange(3), 4)[None]

  @nnx.jit
  def run(model):
    states = jnp.concatenate([model.longformer(ids[:, :6]).last_hidden_state,
                              model.longformer(ids[:, 6:]).last_hidden_state], axis=1)
    return (model(ids, mask, sentences, segment_length=6),
            model.score_spans(states, jnp.asarray(mask), jnp.asarray(sentences)),
            model(ids, mask, sentences))

  out, expected, whole = run(model)
  np.testing.assert_array_equal(np.asarray(out.top_span_indices),
                                np.asarray(expected.top_span_indices))
  np.testing.assert_allclose(np.asarray(out.antecedent_scores),
                             np.asarray(expected.antecedent_scores), rtol=1e-5, atol=1e-5)
  # Whole rows differ from stitched segments (the segments do not see each other).
  assert not np.allclose(np.asarray(whole.candidate_mention_scores),
                         np.asarray(out.candidate_mention_scores))
  with pytest.raises(ValueError, match="segment_length must be a positive int dividing the row "
                     "length 12, got 5"):
    model(ids, mask, sentences, segment_length=5)
  with pytest.raises(ValueError, match=r"sentence_ids must have shape \(1, 12\)"):
    model(ids, mask, sentences[:, :6])


def test_a_saved_model_loads_back_through_the_allow_list(model, tmp_path):
  """The coreference model is on the checkpoint allow-list (checkpoint.MODEL_CLASSES): it saves
  and loads back, its nested encoder config included, with the same parameters."""
  from longformer_jax import checkpoint
  checkpoint.save_model(tmp_path / "coref", model)
  loaded = checkpoint.load_model(tmp_path / "coref")
  assert type(loaded) is coref.LongformerForCoreference and loaded.config == model.config
  want, got = nnx.to_flat_state(nnx.state(model, nnx.Param)), nnx.to_flat_state(
      nnx.state(loaded, nnx.Param))
  assert len(want) == len(got) > 10
  for (path, w), (same_path, g) in zip(want, got):
    assert path == same_path
    np.testing.assert_array_equal(np.asarray(g[...]), np.asarray(w[...]))
