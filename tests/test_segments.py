"""The segment baseline's model-level pieces: the layout that cuts documents into segments and
stitches states back (`longformer_jax.segments`), vocabulary extension for marker tokens
(`convert.extend_vocabulary`), and the truncation record and length buckets of fine-tuning
results (`tasks.truncation`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longformer_jax import checkpoint, convert, led, modeling, segments
from longformer_jax.config import LEDConfig, LongformerConfig
from longformer_jax.tasks import truncation

pytestmark = pytest.mark.unit

BOS, PAD, EOS, SEP = 0, 1, 2, 2


class Specials:
  bos, pad, eos, sep = BOS, PAD, EOS, SEP


def _config(**changes) -> LongformerConfig:
  # Windows that reach across a whole 60-token row, so that the long path links the segments.
  return LongformerConfig.tiny(**{"num_hidden_layers": 2, "attention_window": 64,
                                  "max_position_embeddings": 130, **changes})


@pytest.fixture(scope="module")
def qa_model():
  return modeling.LongformerForQuestionAnswering(_config(), rngs=nnx.Rngs(0))


def _docs(lengths, n, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(4, 500, (len(lengths), n)).astype(np.int32)
  mask = (np.arange(n)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
  return np.where(mask == 1, ids, PAD), mask


def _row(prefix, doc):
  """The plain row `<s> prefix </s></s> doc </s>` (`<s> doc </s>` without a prefix)."""
  head = [BOS] + (list(prefix) + [SEP, SEP] if prefix is not None else [])
  return np.asarray(head + list(doc) + [EOS], np.int32)


# Model calls under jit: one compile per row length, not one per operation of an eager call.
# The global mask is traced there, so each call names its bound on global tokens (max_global).
_call = nnx.jit(lambda model, ids, max_global: model(ids, max_global=max_global),
                static_argnames="max_global")
_encode = nnx.jit(lambda encoder, ids, glob, max_global: encoder(
    ids, None, glob, max_global=max_global).last_hidden_state, static_argnames="max_global")


def _encode_alone(encoder, row, global_length=0):
  """One row through the encoder on its own, unpadded: [len(row), E]."""
  ids = jnp.asarray(row)[None]
  glob = None
  if global_length:
    glob = (jnp.arange(len(row)) < global_length)[None].astype(jnp.int32)
  return np.asarray(_encode(encoder, ids, glob, max_global=global_length or None)[0])


# ----------------------------------------------------------------------------------------------
# The layout, without a model.


def test_layout_rows_by_hand():
  # Example 0: 13 document tokens, a 3-token prefix, rows of 12: room 12 - (1 + 3 + 2) - 1 = 5,
  # stride 5 - 2 = 3 with overlap 2: segments [0, 5), [3, 8), [6, 11), [9, 13).
  # Example 1: 9 tokens, 1-token prefix: room 7, stride 5: [0, 7), [5, 9), then 2 empty rows.
  doc = np.arange(10, 23, dtype=np.int32)[None].repeat(2, 0)
  mask = np.ones_like(doc)
  mask[1, 9:] = 0
  layout = segments.segment_layout(doc, mask, prefix_ids=[[5, 6, 7], [5, 9, 9]],
                                   prefix_mask=[[1, 1, 1], [1, 0, 0]], specials=Specials,
                                   segment_length=12, overlap=2, global_mode="question")
  assert layout.num_segments == 4
  ids = np.asarray(layout.input_ids).reshape(2, 4, 12)
  np.testing.assert_array_equal(ids[0, 1], [0, 5, 6, 7, 2, 2, 13, 14, 15, 16, 17, 2])
  np.testing.assert_array_equal(ids[0, 3], [0, 5, 6, 7, 2, 2, 19, 20, 21, 22, 2, 1])
  np.testing.assert_array_equal(ids[1, 1], [0, 5, 2, 2, 15, 16, 17, 18, 2, 1, 1, 1])
  np.testing.assert_array_equal(np.asarray(layout.attention_mask).reshape(2, 4, 12)[1, 1],
                                [1] * 9 + [0] * 3)
  np.testing.assert_array_equal(np.asarray(layout.global_attention_mask).reshape(2, 4, 12)[1, 0],
                                [1, 1] + [0] * 10)
  np.testing.assert_array_equal(layout.segment_mask, [[1, 1, 1, 1], [1, 1, 0, 0]])
  np.testing.assert_array_equal(layout.lengths, [[5, 5, 5, 4], [7, 4, 0, 0]])
  # Position p of example 0 lies in the segments starting at 0, 3, 6, 9; the most central wins
  # (min(tokens before, tokens after) in the segment): p=3 -> min(3,1)=1 in s0 vs min(0,4)=0 in s1.
  np.testing.assert_array_equal(layout.source, [[0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3],
                                                [0, 0, 0, 0, 0, 0, 1, 1, 1, -1, -1, -1, -1]])
  # Stitching the rows' own ids gives the document back.
  np.testing.assert_array_equal(segments.stitch(layout.input_ids, layout), doc * mask)
  # Every shape is static: the layout traces under jit and gives the same rows and map.
  traced = jax.jit(lambda d, m, p, pm: segments.segment_layout(
      d, m, prefix_ids=p, prefix_mask=pm, specials=Specials, segment_length=12, overlap=2,
      global_mode="question"))(doc, mask, np.asarray([[5, 6, 7], [5, 9, 9]]),
                               np.asarray([[1, 1, 1], [1, 0, 0]]))
  for name in ("input_ids", "attention_mask", "global_attention_mask", "source", "kept"):
    np.testing.assert_array_equal(getattr(traced, name), getattr(layout, name), err_msg=name)


def test_overlap_ties_go_to_the_earlier_segment():
  # 9 tokens, prefix 3, rows of 12, overlap 3: room 5, stride 2: [0,5), [2,7), [4,9).
  # p=3: min(3,1)=1 in s0, min(1,3)=1 in s1: a tie, s0. p=4: 0 / 2 / 0 -> s1.
  # p=5: min(3,1)=1 in s1, min(1,3)=1 in s2: s1. p=6: 0 in s1, 2 in s2 -> s2.
  layout = segments.segment_layout(np.arange(10, 19)[None], prefix_ids=[[5, 6, 7]],
                                   specials=Specials, segment_length=12, overlap=3)
  np.testing.assert_array_equal(layout.source, [[0, 0, 0, 0, 1, 1, 2, 2, 2]])
  np.testing.assert_array_equal(layout.row_positions, [[6, 7, 8, 9, 8, 9, 8, 9, 10]])


def test_a_prefix_without_separator_and_global_document_tokens():
  # separate_prefix=False: <s> prefix segment </s>, room 8 - 1 - 3 - 1 = 3 per row; document
  # position 4 (id 14, in segment 1) is global there, besides <s> and the prefix.
  global_N = np.zeros((1, 9), np.int32)
  global_N[0, 4] = 1
  layout = segments.segment_layout(np.arange(10, 19)[None], prefix_ids=[[5, 6, 7]],
                                   specials=Specials, segment_length=8, separate_prefix=False,
                                   global_mode="question", document_global=global_N)
  np.testing.assert_array_equal(layout.input_ids, [[BOS, 5, 6, 7, 10, 11, 12, EOS],
                                                   [BOS, 5, 6, 7, 13, 14, 15, EOS],
                                                   [BOS, 5, 6, 7, 16, 17, 18, EOS]])
  np.testing.assert_array_equal(layout.global_attention_mask, [[1, 1, 1, 1, 0, 0, 0, 0],
                                                               [1, 1, 1, 1, 0, 1, 0, 0],
                                                               [1, 1, 1, 1, 0, 0, 0, 0]])
  np.testing.assert_array_equal(layout.heads, [4])
  np.testing.assert_array_equal(layout.row_positions, [[4, 5, 6, 4, 5, 6, 4, 5, 6]])
  with pytest.raises(ValueError, match=r"document_global has shape \(1, 3\)"):
    segments.segment_layout(np.arange(10, 19)[None], specials=Specials, segment_length=8,
                            document_global=np.zeros((1, 3)))
  with pytest.raises(ValueError, match=r"after <s>, a prefix of up to 3 tokens and </s>"):
    segments.segment_layout([[5, 6]], prefix_ids=[[7, 8, 9]], specials=Specials,
                            segment_length=6, overlap=1, separate_prefix=False)


def test_max_segments_cuts_and_counts_what_was_read():
  # Rows of 6 without a prefix read 4 tokens each; 2 segments at most read 8 of 13 and 8 of 9.
  doc, mask = _docs([13, 9], 13)
  layout = segments.segment_layout(doc, mask, specials=Specials, segment_length=6,
                                   max_segments=2)
  stats = segments.reading_stats(layout)
  np.testing.assert_array_equal(stats["document_tokens"], [13, 9])
  np.testing.assert_array_equal(stats["kept_tokens"], [8, 8])
  np.testing.assert_array_equal(stats["segments_needed"], [4, 3])
  np.testing.assert_array_equal(stats["segments_read"], [2, 2])
  np.testing.assert_array_equal(layout.kept[0], [1] * 8 + [0] * 5)
  logits = segments.document_logits(jnp.ones(layout.input_ids.shape), layout)
  assert float(logits[0, 8]) == np.finfo(np.float32).min and float(logits[0, 7]) == 1.0


def test_pool_and_sum_over_segments():
  doc, mask = _docs([10, 3], 10)
  layout = segments.segment_layout(doc, mask, specials=Specials, segment_length=6)
  # Example 0 reads 3 segments, example 1 one (its other two rows are empty and masked out).
  rows = jnp.arange(2 * 3 * 6, dtype=jnp.float32).reshape(6, 6)
  np.testing.assert_array_equal(segments.pool(rows, layout, "first"), [0.0, 18.0])
  np.testing.assert_array_equal(segments.pool(rows, layout, "mean"), [6.0, 18.0])
  scores = jnp.asarray([[[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]],
                        [[3.0, 4.0], [50.0, 60.0], [70.0, 80.0]]])
  np.testing.assert_array_equal(segments.sum_over_segments(scores, layout),
                                [[111.0, 222.0], [3.0, 4.0]])
  with pytest.raises(ValueError, match="segment pool"):
    segments.pool(rows, layout, "max")


def test_bad_settings_are_refused():
  with pytest.raises(ValueError, match="leaves 1 document tokens"):
    segments.segment_layout([[5, 6]], prefix_ids=[[7, 8, 9]], specials=Specials,
                            segment_length=8, overlap=1)
  with pytest.raises(ValueError, match="real token after padding"):
    segments.segment_layout([[5, 6]], [[0, 1]], specials=Specials, segment_length=8)
  with pytest.raises(ValueError, match="global_mode"):
    segments.segment_layout([[5, 6]], specials=Specials, global_mode="all")


# ----------------------------------------------------------------------------------------------
# Through an encoder.


def test_one_segment_equals_the_plain_encoder(qa_model):
  """A document that fits one segment: the segment path's states, QA logits and pooled <s> are
  the plain encoder's on the plain row (float32, 1e-6)."""
  encoder = qa_model.longformer
  doc, mask = _docs([20, 11], 20, seed=1)
  prefix, prefix_mask = np.asarray([[7, 8, 9, 10], [11, 12, 0, 0]]), np.asarray(
      [[1, 1, 1, 1], [1, 1, 0, 0]])
  out = segments.encode_segments(encoder, doc, mask, prefix_ids=prefix,
                                 prefix_mask=prefix_mask, specials=Specials, segment_length=40,
                                 global_mode="question")
  assert out.layout.num_segments == 1
  logits = qa_model.qa_outputs(out.row_states.reshape(-1, 40, 64))
  start = segments.document_logits(logits[..., 0], out.layout)
  for b, (d, q) in enumerate([(20, 4), (11, 2)]):
    row = _row(prefix[b, :q], doc[b, :d])
    plain = _call(qa_model, jnp.asarray(row)[None], max_global=len(row))  # global: the question
    states = _encode_alone(encoder, row, global_length=1 + q)
    np.testing.assert_allclose(out.last_hidden_state[b, :d], states[q + 3:q + 3 + d], atol=1e-6)
    np.testing.assert_allclose(out.prefix_states[b, 0, :q], states[1:1 + q], atol=1e-6)
    np.testing.assert_allclose(start[b, :d], plain.start_logits[0, q + 3:q + 3 + d], atol=1e-6)
    assert not np.asarray(out.last_hidden_state[b, d:]).any()
  # Classification rows (no prefix): the first segment's <s> is the plain row's.
  cls = modeling.LongformerForSequenceClassification(_config(), rngs=nnx.Rngs(1))
  out = segments.encode_segments(cls.longformer, doc, mask, specials=Specials,
                                 segment_length=24, global_mode="first")
  pooled = segments.pool(out.row_states, out.layout)
  for b, d in enumerate([20, 11]):
    row = _row(None, doc[b, :d])
    np.testing.assert_allclose(pooled[b], _encode_alone(cls.longformer, row, 1)[0], atol=1e-6)
    np.testing.assert_allclose(cls.classifier(pooled[b][None, None])[0],
                               _call(cls, jnp.asarray(row)[None], max_global=1).logits[0],
                               atol=1e-6)


def test_batched_segments_equal_each_segment_alone(qa_model):
  """All segments of all examples as one batch = each segment built by hand and run alone."""
  encoder = qa_model.longformer
  doc, mask = _docs([37, 16], 37, seed=2)
  prefix = np.asarray([[7, 8, 9], [10, 11, 12]])
  seg = segments.SegmentEncoder(encoder, specials=Specials, segment_length=20)
  out = seg(doc, mask, prefix_ids=prefix)
  room = 20 - 3 - 3 - 1  # 13 document tokens per segment
  assert out.layout.num_segments == 3
  for b, d in enumerate([37, 16]):
    for s, start in enumerate(range(0, d, room)):
      piece = doc[b, start:min(start + room, d)]
      alone = _encode_alone(encoder, _row(prefix[b], piece))
      n = len(alone)
      np.testing.assert_allclose(out.row_states[b, s, :n], alone, atol=1e-6)
      np.testing.assert_allclose(out.last_hidden_state[b, start:start + len(piece)],
                                 alone[6:6 + len(piece)], atol=1e-6)
    assert np.asarray(out.layout.segment_mask[b]).sum() == math.ceil(d / room)


def test_editing_segment_two_leaves_segment_one_alone(qa_model):
  """A segment sees nothing of another: an edit in segment 2 leaves segment 1's states
  bit-identical; the long encoder on the whole row changes them."""
  encoder = qa_model.longformer
  doc, _ = _docs([34], 34, seed=3)
  prefix = np.asarray([[7, 8, 9]])
  edited = doc.copy()
  edited[0, 20] = 499 if doc[0, 20] != 499 else 498  # segment 2 holds positions 17 .. 33
  run = lambda d: segments.encode_segments(encoder, d, prefix_ids=prefix, specials=Specials,
                                           segment_length=24, global_mode="question")
  a, b = run(doc), run(edited)
  np.testing.assert_array_equal(a.row_states[0, 0], b.row_states[0, 0])
  np.testing.assert_array_equal(a.last_hidden_state[0, :17], b.last_hidden_state[0, :17])
  assert not np.array_equal(a.last_hidden_state[0, 17:], b.last_hidden_state[0, 17:])
  # The Longformer path: the same document in one row, global attention on the question.
  long_a = _encode_alone(encoder, _row(prefix[0], doc[0]), 4)
  long_b = _encode_alone(encoder, _row(prefix[0], edited[0]), 4)
  assert np.abs(long_a[6:6 + 17] - long_b[6:6 + 17]).max() > 1e-4


def test_overlap_stitching_takes_the_most_central_segment(qa_model):
  encoder = qa_model.longformer
  doc, _ = _docs([9], 9, seed=4)
  out = segments.encode_segments(encoder, doc, prefix_ids=[[5, 6, 7]], specials=Specials,
                                 segment_length=12, overlap=3)
  # Hand-worked in test_overlap_ties_go_to_the_earlier_segment: sources 0 0 0 0 1 1 2 2 2,
  # segments starting at 0, 2, 4, document tokens from row position 6.
  for p, (s, start) in enumerate([(0, 0)] * 4 + [(1, 2)] * 2 + [(2, 4)] * 3):
    np.testing.assert_array_equal(out.last_hidden_state[0, p], out.row_states[0, s, 6 + p - start])
  # Overlapping segments give different states for a shared token: the choice matters.
  assert not np.allclose(out.row_states[0, 0, 6 + 3], out.row_states[0, 1, 6 + 1])


# ----------------------------------------------------------------------------------------------
# Vocabulary extension.


def test_extend_vocabulary_keeps_old_outputs_and_round_trips(tmp_path):
  model = modeling.LongformerForMaskedLM(_config(), rngs=nnx.Rngs(0))
  grown = convert.extend_vocabulary(model, 4, seed=1)
  assert model.config.vocab_size == 512 and grown.config.vocab_size == 516
  assert grown.longformer.config.vocab_size == 516
  old_table = np.asarray(model.longformer.embeddings.word_embeddings.embedding[...])
  table = np.asarray(grown.longformer.embeddings.word_embeddings.embedding[...])
  np.testing.assert_array_equal(table[:512], old_table)
  np.testing.assert_array_equal(grown.lm_head.bias[...][:512], model.lm_head.bias[...])
  # New rows: drawn per feature from the old rows' mean and std; the bias takes its mean.
  assert np.abs(table[512:].mean(0) - old_table.mean(0)).max() < 4 * old_table.std(0).max()
  assert 0 < table[512:].std() < 3 * old_table.std()
  np.testing.assert_allclose(grown.lm_head.bias[...][512:], model.lm_head.bias[...].mean())
  ids = jnp.asarray([[0, 5, 6, 7, 300, 2]])
  np.testing.assert_array_equal(grown.longformer(ids).last_hidden_state,
                                model.longformer(ids).last_hidden_state)
  # The old ids' logits: the same dot products over a longer vocabulary (a matmul of another
  # shape may sum in another order, hence 1e-6 rather than bit equality).
  np.testing.assert_allclose(grown(ids).logits[..., :512], model(ids).logits, atol=1e-6, rtol=0)
  new_ids = jnp.asarray([[0, 512, 5, 515, 2]])
  assert grown(new_ids).logits.shape == (1, 5, 516)
  checkpoint.save_model(tmp_path / "grown", grown)
  loaded = checkpoint.load_model(tmp_path / "grown")
  assert loaded.config.vocab_size == 516
  np.testing.assert_array_equal(loaded(new_ids).logits, grown(new_ids).logits)
  with pytest.raises(ValueError, match="num_new"):
    convert.extend_vocabulary(model, 0)
  # LED: the shared table (encoder, decoder and LM head) and final_logits_bias grow together.
  led_model = led.LEDForConditionalGeneration(LEDConfig.tiny(), rngs=nnx.Rngs(0))
  led_grown = convert.extend_vocabulary(led_model, 3)
  v = led_model.config.vocab_size
  assert led_grown.config.vocab_size == led_grown.led.config.vocab_size == v + 3
  assert led_grown.led.shared.embedding.shape[0] == led_grown.final_logits_bias.shape[0] == v + 3
  np.testing.assert_array_equal(led_grown.led.shared.embedding[...][:v],
                                led_model.led.shared.embedding[...])


# ----------------------------------------------------------------------------------------------
# Truncation records and length buckets.


def test_truncation_block_fractions_are_exact():
  # 4 examples: the 2nd loses 30 document tokens, the 3rd only question tokens, the 4th none.
  block = truncation.truncation_block(
      max_length=128, document_tokens=[100, 200, 50, 10], kept_tokens=[100, 170, 50, 10],
      prefix_cut=[False, False, True, False], evidence_kept=[True, False, None, True])
  assert block == {"max_length": 128, "examples": 4, "examples_truncated": 2 / 4,
                   "document_tokens_kept": 330 / 360, "evidence_within_limit": 2 / 3}
  assert truncation.truncation_block(max_length=8, document_tokens=[3], kept_tokens=[3]) == {
      "max_length": 8, "examples": 1, "examples_truncated": 0.0, "document_tokens_kept": 1.0,
      "evidence_within_limit": None}
  with pytest.raises(ValueError, match="exceeds"):
    truncation.truncation_block(max_length=8, document_tokens=[3], kept_tokens=[4])


def test_bucket_means_recombine_and_macro_f1_does_not():
  lengths = [100, 600, 512, 513, 20, 9000, 300, 700]
  # 0/1 accuracy in buckets of 4 and 4: the means are exact binary fractions.
  accuracy = [1, 0, 1, 1, 0, 1, 1, 0]
  buckets = truncation.by_length(lengths, 512, {"accuracy": accuracy})
  assert buckets == {"<=512": {"accuracy": 3 / 4, "examples": 4},
                     ">512": {"accuracy": 2 / 4, "examples": 4}}
  assert truncation.recombine(buckets, "accuracy") == np.mean(accuracy)
  # Arbitrary per-example values (F1 per answer): equal up to the rounding of the bucket means.
  f1 = np.random.default_rng(0).random(8)
  buckets = truncation.by_length(lengths, 512, {"f1": f1})
  assert abs(truncation.recombine(buckets, "f1") - math.fsum(f1) / 8) <= 4 * np.spacing(1.0)
  # Macro F1 is not a mean of per-example values: its buckets do not recombine to it.
  gold = np.asarray([0, 1, 0, 1, 1, 1, 0, 0])
  pred = np.asarray([0, 1, 1, 1, 0, 1, 0, 1])

  def macro_f1(idx):
    f1s = []
    for c in (0, 1):
      tp = np.sum((pred[idx] == c) & (gold[idx] == c))
      fp, fn = np.sum((pred[idx] == c) & (gold[idx] != c)), np.sum((pred[idx] != c)
                                                                    & (gold[idx] == c))
      f1s.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return {"macro_f1": float(np.mean(f1s))}

  split = truncation.by_length_with(lengths, 512, macro_f1)
  assert split["<=512"]["examples"] == 4 and split[">512"]["examples"] == 4
  overall = macro_f1(np.arange(8))["macro_f1"]
  assert abs(truncation.recombine(split, "macro_f1") - overall) > 0.01
