"""HotpotQA's segment baseline (`tasks.hotpotqa.segment_states` / `segment_outputs`): a row that
fits one segment reads as the whole row, the batched segments equal each segment read alone
(a loop reference of the stitching), and a segment never sees another's tokens. The command-line
run is in tests/test_finetune_coref_hotpot.py."""

import dataclasses

import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers

from longformer_jax import hotpotqa
from longformer_jax.config import LongformerConfig
from longformer_jax.data import hotpotqa as hq
from longformer_jax.data.tokenizer import SpecialIds
from longformer_jax.tasks import hotpotqa as hotpot_task

pytestmark = pytest.mark.unit

SPECIALS = SpecialIds(bos=0, pad=1, eos=2, sep=2)
_CONTEXT = (("A", ("w1 w2 .", "w3 w4 w5 .")), ("B", ("w6 .", "w7 w8 .")), ("C", ("w9 .",)))
RECORDS = (
    hq.HotpotRecord(id="h1", question="who wrote it", answer="w4 w5", context=_CONTEXT,
                    supporting_facts=(("A", 1), ("B", 1)), source="hand: record 0"),
    # A shorter question: every row has its own prefix length, so its own segment boundaries.
    hq.HotpotRecord(id="h2", question="who", answer="yes", context=_CONTEXT,
                    supporting_facts=(("C", 0),), source="hand: record 1"),
)
MAX_LENGTH = 40  # HAND's rows need 32 tokens and 30: both fit whole


def _tokenizer():
  pre = pre_tokenizers.Whitespace()
  texts = [t for r in RECORDS for t in (r.question, *(x for title, s in r.context
                                                      for x in (title, *s)))]
  words = sorted({w for t in texts for w, _ in pre.pre_tokenize_str(t)})
  vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", *hq.MARKER_TOKENS,
                                       *words])}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre
  return tokenizer


TOKENIZER = _tokenizer()


def _inputs(mode="question"):
  markers = hq.MarkerIds.of_tokenizer(TOKENIZER)
  layouts = [hq.build_layout(r, hq.tokenizer_encoder(TOKENIZER), SPECIALS, markers,
                             max_length=MAX_LENGTH, max_paragraphs=3, max_sentences=5,
                             max_question_length=6) for r in RECORDS]
  batch = hq.stack_layouts(layouts)
  if mode == "first":
    batch["global_attention_mask"] = np.zeros_like(batch["global_attention_mask"])
    batch["global_attention_mask"][:, 0] = 1
  return hotpot_task.model_inputs(batch), layouts


@pytest.fixture(scope="module")
def model():
  config = LongformerConfig.tiny(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                 intermediate_size=64, attention_window=8)
  model = hotpotqa.LongformerForHotpotQA(config, rngs=nnx.Rngs(0))
  model.eval()
  return model


def _reading(segment_length, mode="question", overlap=0):
  # prefix_width: [q] question [/q] with max_question_length=6.
  return hotpot_task.HotpotSegments(segment_length=segment_length, overlap=overlap,
                                    prefix_width=8, global_mode=mode)


def _max_global(inputs):
  return int(np.asarray(inputs["global_attention_mask"]).sum(axis=1).max())


def _outputs_close(got, want, atol):
  for field in ("start_logits", "end_logits", "type_logits", "sentence_logits",
                "paragraph_logits"):
    np.testing.assert_allclose(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)),
                               atol=atol, rtol=0, err_msg=field)


@pytest.mark.parametrize("mode", ["question", "first"])
@pytest.mark.parametrize("segment_length", [MAX_LENGTH, 34])
def test_a_row_that_fits_one_segment_reads_as_the_whole_row(model, segment_length, mode):
  """<s> [q] question [/q] document </s> is the row itself: the same outputs (float32)."""
  inputs, _ = _inputs(mode)
  max_global = _max_global(inputs)
  whole = model(**inputs, max_global=max_global)
  fn = nnx.jit(hotpot_task.segment_outputs, static_argnames=("reading", "max_global"))
  got = fn(model, inputs, reading=_reading(segment_length, mode), max_global=max_global)
  _outputs_close(got, whole, atol=2e-6)
  # The static segment count covers a longer question: the second segment is read empty.
  _, read, out = hotpot_task.segment_states(model, inputs, _reading(segment_length, mode),
                                            max_global=max_global)
  assert out.layout.num_segments == 2
  assert np.asarray(out.layout.segment_mask).tolist() == [[True, False], [True, False]]


def _loop_reference(model, inputs, reading, max_global):
  """The states at row positions, each segment row built and encoded alone, by hand."""
  ids = np.asarray(inputs["input_ids"])
  glob = np.asarray(inputs["global_attention_mask"])
  real = np.asarray(inputs["attention_mask"]).sum(axis=1)
  hidden = np.zeros((*ids.shape, model.config.hidden_size), np.float32)
  length = reading.segment_length
  rows_read = 0
  for b in range(ids.shape[0]):
    head = int(np.flatnonzero(np.asarray(inputs["token_paragraph"])[b] >= 0)[0])
    room = length - head - 1  # <s> [q] question [/q] segment </s>
    document = ids[b, head:real[b] - 1]
    for s, start in enumerate(range(0, len(document), room)):
      piece = document[start:start + room]
      row = np.full(length, SPECIALS.pad, np.int32)
      row[:head] = ids[b, :head]
      row[head:head + len(piece)] = piece
      row[head + len(piece)] = SPECIALS.eos
      row_global = np.zeros(length, np.int32)
      row_global[:head] = glob[b, :head]
      row_global[head:head + len(piece)] = glob[b, head + start:head + start + len(piece)]
      mask = (np.arange(length) <= head + len(piece)).astype(np.int32)
      states = np.asarray(model.longformer(row[None], mask[None], row_global[None],
                                           max_global=max_global).last_hidden_state[0])
      if s == 0:
        hidden[b, :head] = states[:head]
      hidden[b, head + start:head + start + len(piece)] = states[head:head + len(piece)]
      rows_read += 1
  return hidden, rows_read


def test_batched_segments_equal_each_segment_read_alone(model):
  inputs, _ = _inputs()
  max_global = _max_global(inputs)
  reading = _reading(16)  # 9 and 11 document tokens a segment: 3 segments each
  fn = nnx.jit(hotpot_task.segment_states, static_argnames=("reading", "max_global"))
  hidden, read, out = fn(model, inputs, reading=reading, max_global=max_global)
  want, rows_read = _loop_reference(model, inputs, reading, max_global)
  assert rows_read == int(np.asarray(out.layout.segment_mask).sum()) == 6
  assert out.layout.num_segments > 3  # static: room for the longest question; the rest empty
  np.testing.assert_allclose(np.asarray(hidden), want, atol=2e-6, rtol=0)
  # Every real row position but </s> holds a read state; </s> and padding hold zeros.
  real = np.asarray(inputs["attention_mask"]) != 0
  ends = real.sum(axis=1) - 1
  expected = real.copy()
  expected[np.arange(len(ends)), ends] = False
  assert (np.asarray(read) == expected).all()
  assert (np.asarray(hidden)[~expected] == 0).all()
  # The heads read the stitched states as they read a whole row's.
  outputs = hotpot_task.segment_outputs(model, inputs, reading, max_global=max_global)
  context = np.asarray(inputs["context_mask"]) != 0
  reference = model.heads(want, **{k: v for k, v in inputs.items()
                                   if k not in ("input_ids", "attention_mask",
                                                "global_attention_mask")})
  _outputs_close(outputs, reference, atol=2e-6)
  assert (np.asarray(outputs.start_logits)[~context] == hotpotqa.NEG_LOGIT).all()


def test_a_token_of_segment_two_leaves_segment_one_bit_identical(model):
  inputs, _ = _inputs()
  max_global = _max_global(inputs)
  reading = _reading(16)
  fn = nnx.jit(hotpot_task.segment_states, static_argnames=("reading", "max_global"))
  hidden, _, out = fn(model, inputs, reading=reading, max_global=max_global)
  # Row 0: <s> [q] who wrote it [/q] (head 6), 9 document tokens a segment; its second segment
  # holds row positions 15..23. Edit a word there (not a marker), in a copy.
  ids = np.array(inputs["input_ids"])
  head, room = 6, 9
  position = head + room + 1  # the "." ending "w3 w4 w5 ."
  assert ids[0, position] not in hq.MarkerIds.of_tokenizer(TOKENIZER).__dict__.values()
  ids[0, position] = TOKENIZER.token_to_id("w9")
  edited = dict(inputs, input_ids=ids)
  hidden2, _, out2 = fn(model, edited, reading=reading, max_global=max_global)
  rows, rows2 = np.asarray(out.row_states), np.asarray(out2.row_states)
  assert np.array_equal(rows[0, 0], rows2[0, 0])  # segment 1: bit-identical
  assert np.array_equal(rows[1], rows2[1])  # the other example too
  assert not np.allclose(rows[0, 1], rows2[0, 1])  # segment 2 read the edit
  h, h2 = np.asarray(hidden), np.asarray(hidden2)
  assert np.array_equal(h[0, :head + room], h2[0, :head + room])
  assert not np.allclose(h[0, head + room:head + 2 * room], h2[0, head + room:head + 2 * room])


def test_segment_settings_are_checked():
  with pytest.raises(ValueError, match=r"segment_length=12 leaves 2 document tokens .* "
                                       r"segment_overlap=2"):
    hotpot_task.HotpotSegments(segment_length=12, overlap=2, prefix_width=8)
  with pytest.raises(ValueError, match="global_mode must be one of"):
    hotpot_task.HotpotSegments(global_mode="all")
  reading = hotpot_task.HotpotSegments()
  assert dataclasses.replace(reading, global_mode="first") != reading
  assert hash(reading) == hash(hotpot_task.HotpotSegments())  # a static jit argument


def test_the_run_reads_hotpotqa_through_its_own_segment_reading():
  from longformer_jax.tasks import finetune as ft
  from longformer_jax.tasks import hotpotqa_kind
  options = ft.FinetuneOptions(baseline="segments", segment_length=64, max_question_length=16,
                               global_attention="first")
  kind = hotpotqa_kind.HotpotQA(hotpotqa_kind.HotpotSettings.of(options))
  assert kind.run_settings.segments == hotpot_task.HotpotSegments(
      segment_length=64, prefix_width=18, global_mode="first")
  assert options.reading(kind, "first") is kind  # the kind reads its own segments
  # Whole rows: no segment settings.
  assert hotpotqa_kind.HotpotSettings.of(ft.FinetuneOptions()).segments is None
  assert hotpotqa_kind.HotpotSettings.of(
      dataclasses.replace(options, global_attention="default")).segments.global_mode == "question"
