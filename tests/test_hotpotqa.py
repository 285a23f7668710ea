"""HotpotQA's reader pieces on tiny inputs: the record reader's errors, the row layout (marker
map, global mask, answer spans, truncation facts), the stage-1 -> stage-2 hand-off, the model's
heads and loss under jit, oracle predictions through the official scores, and the generator."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers

from longformer_jax import hotpotqa
from longformer_jax.tasks import hotpotqa as hotpot_task
from longformer_jax.config import LongformerConfig
from longformer_jax.data import hotpotqa as hq
from longformer_jax.data import hotpotqa_generate as gen
from longformer_jax.data.tokenizer import SpecialIds
from longformer_jax.tasks import hotpot_scores

pytestmark = pytest.mark.unit

SPECIALS = SpecialIds(bos=0, pad=1, eos=2, sep=2)
_PRE = pre_tokenizers.Whitespace()


def _tokenizer(texts):
  """A word-level tokenizer of `texts`' words: <s> 0, <pad> 1, </s> 2, <unk> 3, the markers 4-7."""
  words = sorted({w for t in texts for w, _ in _PRE.pre_tokenize_str(t)})
  vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", *hq.MARKER_TOKENS,
                                       *words])}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = _PRE
  return tokenizer


def _texts(records):
  return [t for r in records for t in
          [r.question, *(x for title, sents in r.context for x in (title, *sents))]]


HAND = hq.HotpotRecord(
    id="h1", question="who wrote it", answer="w4 w5",
    context=(("A", ("w1 w2 .", "w3 w4 w5 .")), ("B", ("w6 .", "w7 w8 .")), ("C", ("w9 .",))),
    supporting_facts=(("A", 1), ("B", 1), ("C", 0), ("C", 5)), source="hand: record 0")
HAND_TOKENIZER = _tokenizer(_texts([HAND]))
MARKERS = hq.MarkerIds.of_tokenizer(HAND_TOKENIZER)


def _hand(**kwargs):
  return hq.build_layout(HAND, hq.tokenizer_encoder(HAND_TOKENIZER), SPECIALS, MARKERS,
                         **{"max_length": 40, **kwargs})


@pytest.fixture(scope="module")
def generated():
  """Generated records, their tokenizer and stage-2 layouts of their gold paragraphs."""
  records = hq.parse_records(gen.generate_records(9, seed=3), "generated")
  tokenizer = _tokenizer(_texts(records))
  markers = hq.MarkerIds.of_tokenizer(tokenizer)
  encode = hq.tokenizer_encoder(tokenizer)

  def layout(r, paragraphs=None):
    # Stage 1 reads all ten paragraphs; stage 2 the two selected ones.
    shape = (dict(max_length=1024, max_paragraphs=10, max_sentences=50) if paragraphs is None
             else dict(max_length=256, max_paragraphs=2, max_sentences=10))
    return hq.build_layout(r, encode, SPECIALS, markers, paragraphs=paragraphs, **shape)

  stage2 = [layout(r, hq.gold_paragraphs(r)) for r in records]
  return dict(records=records, tokenizer=tokenizer, markers=markers, layout=layout,
              stage2=stage2)


# ----------------------------------------------------------------------------------------------
# Reading records


GOOD = {"_id": "a1", "question": "q?", "answer": "x", "supporting_facts": [["T", 0]],
        "context": [["T", ["x y."]], ["U", ["z."]]], "type": "bridge", "level": "easy"}


@pytest.mark.parametrize("change, field, problem", [
    ({"_id": 3}, "_id", "must be a string, got 3"),
    ({"answer": None}, "answer", "must be a string"),
    ({"context": []}, "context", "must be a non-empty list"),
    ({"context": [["T", "x y."]]}, "context", "element 0 must be [title (str), [sentence"),
    ({"context": [["T", ["a."]], ["T", ["b."]]]}, "context", "repeats the title 'T'"),
    ({"supporting_facts": [["T", "0"]]}, "supporting_facts", "element 0 must be [title (str), "
     "sentence id (int >= 0)]"),
    ({"supporting_facts": [["T", -1]]}, "supporting_facts", "element 0 must be"),
    ({"type": 1}, "type", "must be a string"),
])
def test_bad_records_name_file_record_and_field(change, field, problem):
  bad = {**GOOD, "_id": "a2", **change}
  with pytest.raises(ValueError) as info:
    hq.parse_records([GOOD, bad], "f.json")
  message = str(info.value)
  assert message.startswith("f.json: record 1") and f"field {field!r}" in message, message
  assert problem in message, message


def test_missing_fields_and_files(tmp_path):
  record = {k: v for k, v in GOOD.items() if k != "supporting_facts"}
  with pytest.raises(ValueError, match=r"f.json: record 0 \(_id 'a1'\): field "
                     r"'supporting_facts' is missing"):
    hq.parse_records([record], "f.json")
  # A test file (no gold) reads with gold=False.
  assert hq.parse_records([record], "f.json", gold=False)[0].supporting_facts is None
  with pytest.raises(ValueError, match="record 1 .*: field '_id' repeats record 0's"):
    hq.parse_records([GOOD, GOOD], "f.json")
  path = tmp_path / "bad.json"
  path.write_text("{not json")
  with pytest.raises(ValueError, match=f"{path}: not JSON"):
    hq.read_hotpotqa(path)
  path.write_text(json.dumps({"_id": "x"}))
  with pytest.raises(ValueError, match=f"{path}: expected a JSON list"):
    hq.read_hotpotqa(path)
  path.write_text(json.dumps([GOOD]))
  (record,) = hq.read_hotpotqa(path)
  assert record.as_json() == GOOD and record.source == f"{path}: record 0"


# ----------------------------------------------------------------------------------------------
# The layout


def test_hand_layout_marker_map_and_global_mask():
  layout = _hand()
  tokens = [HAND_TOKENIZER.id_to_token(int(i)) for i in layout.input_ids[layout.attention_mask
                                                                          == 1]]
  assert tokens == ("<s> [q] who wrote it [/q] [p] A [s] w1 w2 . [s] w3 w4 w5 . [p] B [s] w6 . "
                    "[s] w7 w8 . [p] C [s] w9 . </s>").split()
  assert set(layout.input_ids[len(tokens):].tolist()) == {SPECIALS.pad}
  # Marker map: each [p] slot -> (paragraph index, title); each [s] slot -> (title, sentence id),
  # and the tokens after each [s] are that sentence's.
  assert layout.paragraphs == ((0, "A"), (1, "B"), (2, "C"))
  assert layout.sentences == (("A", 0), ("A", 1), ("B", 0), ("B", 1), ("C", 0))
  context = dict(HAND.context)
  encode = hq.tokenizer_encoder(HAND_TOKENIZER)
  for slot, (title, sid) in enumerate(layout.sentences):
    pos = int(layout.sentence_positions[slot])
    assert layout.input_ids[pos] == MARKERS.s
    sentence = encode(context[title][sid])[0]
    assert layout.input_ids[pos + 1:pos + 1 + len(sentence)].tolist() == list(sentence)
    assert layout.pieces[layout.token_piece[pos + 1]] == context[title][sid]
  for slot, (index, title) in enumerate(layout.paragraphs):
    pos = int(layout.paragraph_positions[slot])
    assert layout.input_ids[pos] == MARKERS.p and HAND.context[index][0] == title
    assert HAND_TOKENIZER.id_to_token(int(layout.input_ids[pos + 1])) == title
  assert layout.paragraph_mask.tolist() == [1, 1, 1]
  assert layout.sentence_mask.tolist() == [1] * 5
  assert layout.paragraph_labels.tolist() == [1, 1, 1]
  assert layout.sentence_labels.tolist() == [0, 1, 0, 1, 1]
  # Global: <s>, [q], the 3 question tokens, [/q], 3 [p] and 5 [s]; nothing else.
  glob = np.flatnonzero(layout.global_attention_mask)
  markers = np.flatnonzero(np.isin(layout.input_ids, [MARKERS.q, MARKERS.q_end, MARKERS.p,
                                                      MARKERS.s]))
  assert len(markers) == 2 + 3 + 5 and set(markers) <= set(glob)
  assert glob.tolist() == sorted({0, 2, 3, 4, *markers.tolist()})
  assert layout.num_global == 1 + 2 + 3 + 3 + 5
  # The span of each slot the heads pool over: a sentence's marker and tokens; a paragraph's
  # marker, title and sentences.
  expect_s, expect_p = np.full(40, -1), np.full(40, -1)
  for slot, (a, b) in enumerate([(8, 12), (12, 17), (19, 22), (22, 26), (28, 31)]):
    expect_s[a:b] = slot
  for slot, (a, b) in enumerate([(6, 17), (17, 26), (26, 31)]):
    expect_p[a:b] = slot
  assert layout.token_sentence.tolist() == expect_s.tolist()
  assert layout.token_paragraph.tolist() == expect_p.tolist()
  # Local markers: only <s>, [q], the question and [/q] stay global.
  local = _hand(global_markers=False)
  assert np.flatnonzero(local.global_attention_mask).tolist() == [0, 1, 2, 3, 4, 5]
  assert (local.input_ids == layout.input_ids).all()
  # Answers may start and end only in titles and sentences.
  assert not layout.context_mask[glob].any() and layout.context_mask.sum() == 3 + 14


def test_hand_layout_answer_spans_and_truncation_facts():
  full = _hand()
  (start, end), = [(a, b) for a, b in zip(full.answer_starts, full.answer_ends) if a >= 0]
  assert hq.answer_text(full, int(start), int(end)) == "w4 w5"
  # 3 titles + 14 sentence tokens; uncut: <s> [q] 3 [/q] </s> (7) + 3 [p] + 5 [s] + 17 = 32.
  assert full.truncation == hq.Truncation(
      paragraphs=3, paragraphs_kept=3, sentences=5, sentences_kept=5, supporting=4,
      supporting_kept=3, answer_occurrences=1, question_tokens=3, question_kept=3,
      document_tokens=17, document_tokens_kept=17, full_length=32)
  assert full.truncation.complete and full.attention_mask.sum() == 32
  # ("C", 5) names a sentence the context lacks: never within the limit.
  assert not full.truncation.evidence_within_limit
  # max_length 24 (23 before </s>): <s> [q] q q q [/q] = 6, [p] A = 2, A's sentences 4 + 5 = 17,
  # [p] B + its first sentence 2 + 3 = 22; B's second (4) does not fit: the row ends there.
  cut = _hand(max_length=24, max_question_length=2, max_paragraphs=3, max_sentences=5)
  # Kept: titles A, B (2) and sentences 3 + 4 + 2 of the document's 17 tokens.
  assert cut.truncation == hq.Truncation(
      paragraphs=3, paragraphs_kept=2, sentences=5, sentences_kept=3, supporting=4,
      supporting_kept=1, answer_occurrences=1, question_tokens=3, question_kept=2,
      document_tokens=17, document_tokens_kept=11, full_length=32)
  assert not cut.truncation.complete
  assert cut.attention_mask.sum() == 22 and cut.input_ids[21] == SPECIALS.eos
  assert cut.sentences == (("A", 0), ("A", 1), ("B", 0))
  assert cut.paragraph_mask.tolist() == [1, 1, 0] and cut.sentence_mask.tolist() == [1, 1, 1, 0, 0]
  assert cut.sentence_labels.tolist() == [0, 1, 0, 0, 0]
  # A sentence slot limit ends the row too (static shapes); a yes/no answer has no span.
  two = _hand(max_sentences=2)
  assert two.sentences == (("A", 0), ("A", 1)) and two.truncation.paragraphs_kept == 1
  yes = hq.build_layout(hq.HotpotRecord(**{**HAND.__dict__, "answer": "yes"}),
                        hq.tokenizer_encoder(HAND_TOKENIZER), SPECIALS, MARKERS, max_length=40)
  assert yes.type_label == 1 and (yes.answer_starts == -1).all()
  # Whole tokens only ("w" starts many tokens and is none); case folded only when nothing
  # matches exactly.
  for answer, found in (("w4", ["w4"]), ("w", []), ("W4 W5", ["w4 w5"]), ("w2", ["w2"])):
    row = hq.build_layout(hq.HotpotRecord(**{**HAND.__dict__, "answer": answer}),
                          hq.tokenizer_encoder(HAND_TOKENIZER), SPECIALS, MARKERS, max_length=40)
    spans = [(a, b) for a, b in zip(row.answer_starts, row.answer_ends) if a >= 0]
    assert [hq.answer_text(row, a, b) for a, b in spans] == found, answer
  with pytest.raises(TypeError, match=r"must return \(ids, character offsets\)"):
    hq.build_layout(HAND, lambda text: [4, 5, 6], SPECIALS, MARKERS, max_length=40)
  with pytest.raises(ValueError, match=r"marker ids \(4, 5, 6, 7\) must be below the model's "
                     r"vocab_size=6"):
    _hand(vocab_size=6)
  with pytest.raises(ValueError, match=r"hand: record 0: question 'who wrote it' tokenizes to id "
                     r"\d+, outside the model's vocabulary \(vocab_size=12\)"):
    _hand(vocab_size=12)
  with pytest.raises(ValueError, match="max_length must be an int >= 8, got 4"):
    _hand(max_length=4)
  with pytest.raises(ValueError, match="hand: record 0: max_length=8 leaves no room"):
    _hand(max_length=8)
  with pytest.raises(ValueError, match=r"paragraphs \[0, 0\] must be distinct indices"):
    _hand(paragraphs=[0, 0])


def test_answer_spans_decode_to_the_answer(generated):
  span_rows = 0
  for record, layout in zip(generated["records"], generated["stage2"]):
    spans = [(int(a), int(b)) for a, b in zip(layout.answer_starts, layout.answer_ends) if a >= 0]
    if layout.type_label:
      assert not spans and record.answer in ("yes", "no")
      continue
    span_rows += 1
    # Every whole-word occurrence in the two gold paragraphs' titles and sentences.
    expected = sum(text.count(record.answer) for text in layout.pieces)
    assert len(spans) == expected >= 1
    assert all(hq.answer_text(layout, a, b) == record.answer for a, b in spans)
  assert span_rows >= 3


def test_text_spelling_a_marker_is_refused():
  record = hq.HotpotRecord(**{**HAND.__dict__, "question": "who [s] it"})
  tokenizer = _tokenizer(["who it"])
  tokenizer.add_special_tokens(list(hq.MARKER_TOKENS))
  with pytest.raises(ValueError, match=r"hand: record 0: question 'who \[s\] it' tokenizes to "
                     r"id \d+, the layout's \[s\]"):
    hq.build_layout(record, hq.tokenizer_encoder(tokenizer), SPECIALS,
                    hq.MarkerIds.of_tokenizer(tokenizer), max_length=40)


# ----------------------------------------------------------------------------------------------
# Stage 1 -> stage 2


def test_select_paragraphs():
  assert hq.select_paragraphs([0.1, 3.0, -1.0, 3.0, 2.0], k=2) == [1, 3]
  assert hq.select_paragraphs([0.1, 3.0, -1.0, 3.0, 2.0], k=3) == [1, 3, 4]
  assert hq.select_paragraphs([-np.inf, 0.0, -np.inf], k=2) == [0, 1]
  assert hq.select_paragraphs([1.0], k=2) == [0]
  with pytest.raises(ValueError, match="k .* must be an int >= 1, got 0"):
    hq.select_paragraphs([1.0], k=0)


def test_stage1_oracle_scores_hand_stage2_the_gold_paragraphs(generated):
  records = generated["records"]
  stage1 = [generated["layout"](r) for r in records]
  assert all(x.truncation.complete for x in stage1)
  # Oracle logits: +5 on the [p] of a supporting paragraph, -5 on the others; empty slots -1e9.
  logits = np.where(np.stack([x.paragraph_mask for x in stage1]) == 1,
                    np.where(np.stack([x.paragraph_labels for x in stage1]) == 1, 5.0, -5.0),
                    -1e9)
  chosen = hotpot_task.stage1_selection(stage1, logits, k=2,
                                     num_paragraphs=[len(r.context) for r in records])
  for record, pick, layout in zip(records, chosen, generated["stage2"]):
    assert pick == hq.gold_paragraphs(record) and len(pick) == 2
    assert [record.context[i][0] for i in pick] == [t for t, _ in record.context
                                                     if t in record.supporting_titles]
    assert {t for _, t in layout.paragraphs} == record.supporting_titles
    assert layout.truncation.supporting_kept == layout.truncation.supporting == 2
    assert layout.truncation.complete
  # A paragraph stage 1 did not read (truncated away) scores -inf: chosen only to fill k.
  short = hq.build_layout(records[0], hq.tokenizer_encoder(generated["tokenizer"]), SPECIALS,
                          generated["markers"], max_length=64, max_paragraphs=10,
                          max_sentences=50)
  read = [i for i, _ in short.paragraphs]
  assert 1 <= len(read) < 10
  scores = hq.paragraph_scores(short, np.arange(10.0), 10)
  assert np.isfinite(scores).sum() == len(read) and (scores[read] == np.arange(len(read))).all()


# ----------------------------------------------------------------------------------------------
# The model


def test_model_heads_jit_static_shapes_finite_gradients(generated):
  layouts = generated["stage2"][:3]
  batch = hq.stack_layouts(layouts)
  vocab = max(64, generated["tokenizer"].get_vocab_size())
  config = LongformerConfig.tiny(vocab_size=vocab, num_hidden_layers=1, hidden_size=32,
                                 num_attention_heads=2, intermediate_size=64,
                                 attention_window=16)
  model = hotpotqa.LongformerForHotpotQA(config, rngs=nnx.Rngs(0))
  max_global = max(x.num_global for x in layouts)

  @nnx.jit
  def step(model, batch):
    def loss_fn(model):
      out = model(**hotpot_task.model_inputs(batch), max_global=max_global)
      total, parts = hotpot_task.hotpot_loss(out, batch)
      return total, (out, parts)
    (total, (out, parts)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    return total, out, parts, grads

  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  total, out, parts, grads = step(model, batch)
  b, n = batch["input_ids"].shape
  assert out.start_logits.shape == out.end_logits.shape == (b, n)
  assert out.type_logits.shape == (b, 3)
  assert out.sentence_logits.shape == (b, 10) and out.paragraph_logits.shape == (b, 2)
  assert np.isfinite(float(total)) and all(np.isfinite(float(v)) for v in parts.values())
  assert float(total) == pytest.approx(sum(float(v) for v in parts.values()), rel=1e-5)
  # Masked positions hold -1e9: outside the titles and sentences, and empty sentence slots.
  assert (np.asarray(out.start_logits)[np.asarray(batch["context_mask"]) == 0] == -1e9).all()
  assert (np.asarray(out.sentence_logits)[np.asarray(batch["sentence_mask"]) == 0] == -1e9).all()
  leaves = jax.tree_util.tree_leaves(nnx.state(grads, nnx.Param))
  assert leaves and all(np.isfinite(np.asarray(g)).all() for g in leaves)
  for head in ("qa_outputs", "type_head", "sentence_head", "paragraph_head"):
    head_grads = jax.tree_util.tree_leaves(nnx.state(getattr(grads, head), nnx.Param))
    assert any(np.abs(np.asarray(g)).sum() > 0 for g in head_grads), head
  # Stage-1 weights train the paragraph head alone; the same static shapes run again.
  total1, parts1 = hotpot_task.hotpot_loss(out, batch, weights=hotpot_task.STAGE1_WEIGHTS)
  assert float(total1) == pytest.approx(float(parts1["paragraph"]))


def test_loss_parts_on_hand_logits():
  batch = {"answer_starts": np.array([[1, 3], [-1, -1]]), "answer_ends": np.array([[1, 3],
                                                                                   [-1, -1]]),
           "type_labels": np.array([0, 2]), "sentence_labels": np.array([[1, 0], [0, 0]]),
           "sentence_mask": np.array([[1, 1], [1, 0]]), "paragraph_labels": np.array([[1], [0]]),
           "paragraph_mask": np.array([[1], [1]])}
  zeros = jnp.zeros((2, 4))
  out = hotpotqa.HotpotQAOutput(start_logits=zeros, end_logits=zeros,
                                type_logits=jnp.zeros((2, 3)),
                                sentence_logits=jnp.array([[0.0, 0.0], [0.0, -1e9]]),
                                paragraph_logits=jnp.zeros((2, 1)))
  _, parts = hotpot_task.hotpot_loss(out, batch)
  # Uniform over 4 positions, two gold ones: -log(2/4) for start and end; row 2 has no span.
  assert float(parts["span"]) == pytest.approx(np.log(2.0))
  assert float(parts["type"]) == pytest.approx(np.log(3.0))
  assert float(parts["sentence"]) == pytest.approx(np.log(2.0))  # 3 real slots at p = 1/2
  assert float(parts["paragraph"]) == pytest.approx(np.log(2.0))


def test_oracle_predictions_score_one(generated):
  records, layouts = generated["records"], generated["stage2"]
  batch = hq.stack_layouts(layouts)
  b, n = batch["input_ids"].shape
  start = np.full((b, n), -1e9, np.float32)
  end = np.full((b, n), -1e9, np.float32)
  for row, layout in enumerate(layouts):
    if layout.type_label == 0:
      start[row, layout.answer_starts[0]] = end[row, layout.answer_ends[0]] = 10.0
  out = hotpotqa.HotpotQAOutput(
      start_logits=jnp.asarray(start), end_logits=jnp.asarray(end),
      type_logits=jax.nn.one_hot(batch["type_labels"], 3) * 10.0,
      sentence_logits=jnp.asarray(np.where(batch["sentence_mask"] == 1,
                                           20.0 * batch["sentence_labels"] - 10.0, -1e9)),
      paragraph_logits=jnp.zeros(batch["paragraph_mask"].shape))
  decoded = jax.jit(hotpot_task.decode, static_argnames="max_answer_length")(
      out, max_answer_length=8)
  preds = hotpot_task.predictions(layouts, decoded, sp_threshold=0.5)
  assert set(preds["answer"]) == {r.id for r in records}
  golds = [r.as_json() for r in records]
  scores = hotpot_scores(predictions=preds, golds=golds)
  assert scores["em"] == scores["sp_em"] == scores["joint_em"] == 1.0, scores
  assert scores["joint_f1"] == 1.0
  # A threshold above every probability predicts no evidence: sp_em falls to 0 (the threshold
  # is live), unless min_sentences asks for the best ones anyway.
  none = hotpot_task.predictions(layouts, decoded, sp_threshold=1.0)
  assert hotpot_scores(predictions=none, golds=golds)["sp_em"] == 0.0
  two = hotpot_task.predictions(layouts, decoded, sp_threshold=1.0, min_sentences=2)
  assert hotpot_scores(predictions=two, golds=golds)["sp_em"] == 1.0


# ----------------------------------------------------------------------------------------------
# The generator


def test_generated_records_pass_the_reader_with_gold_inside(tmp_path):
  path = tmp_path / "gen.json"
  assert gen.main(["--out", str(path), "--records", "12", "--seed", "5"]) == 0
  records = hq.read_hotpotqa(path)
  assert [r.as_json() for r in records] == gen.generate_records(12, seed=5)
  assert gen.generate_records(12, seed=6) != gen.generate_records(12, seed=5)
  # The filler records' words fit a word-level tokenizer in the tiny preset's 512 ids.
  many = hq.parse_records(gen.generate_records(300, seed=0), "many")
  assert _tokenizer(_texts(many)).get_vocab_size() < 450
  answers = {r.answer for r in records}
  assert {"yes", "no"} <= answers and {r.type for r in records} == {"bridge", "comparison"}
  for r in records:
    assert len(r.context) == 10 and len(r.supporting_facts) == 2
    context = dict(r.context)
    gold_titles = [t for t, _ in r.supporting_facts]
    assert len(set(gold_titles)) == 2
    for title, sid in r.supporting_facts:
      assert 0 <= sid < len(context[title])
    if r.answer not in ("yes", "no"):
      # The answer is in a supporting sentence (a bridge's birthplace, a comparison's name).
      assert any(r.answer in context[t][s] for t, s in r.supporting_facts), r


def test_generator_wiki_sentences_and_bad_arguments(capsys, tmp_path):
  sentences = gen.wiki_sentences(b" the cat sat on a mat and then it ran off far away to the sea",
                                 min_words=4, max_words=5)
  assert sentences and all(s[0].isupper() and s.endswith(".") for s in sentences)
  assert all(4 <= len(s.split()) <= 5 for s in sentences)
  with pytest.raises(ValueError, match="source must be one of"):
    gen.generate_records(2, source="web")
  with pytest.raises(ValueError, match="num_paragraphs must be an int >= 2"):
    gen.generate_records(2, num_paragraphs=1)
  assert gen.main(["--out", str(tmp_path / "x.json"), "--records", "0"]) == 2
  assert capsys.readouterr().err.startswith("error: n (records) must be an int >= 1, got 0")


def test_two_stage_pipeline_runs_and_hands_over_its_choice(generated):
  records, tokenizer = generated["records"][:3], generated["tokenizer"]
  config = LongformerConfig.tiny(vocab_size=max(64, tokenizer.get_vocab_size()),
                                 num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                 intermediate_size=64, attention_window=16)
  stage1 = hotpotqa.LongformerForHotpotQA(config, rngs=nnx.Rngs(1))
  stage2 = hotpotqa.LongformerForHotpotQA(config, rngs=nnx.Rngs(2))
  encode = hq.tokenizer_encoder(tokenizer)
  preds, chosen, rows2 = hotpot_task.two_stage_predictions(
      stage1, stage2, records, encode, SPECIALS, generated["markers"], max_length=512,
      stage2_max_length=256, k=2, batch_size=2, sp_threshold=0.0)
  # Stage 1's choice is its own top 2 (recomputed from its rows), and stage 2 reads exactly it.
  rows1 = hotpot_task.stage1_rows(records, encode, SPECIALS, generated["markers"], max_length=512)
  logits = hotpot_task.run_rows(stage1, rows1, batch_size=2)["paragraph_logits"]
  assert logits.shape == (3, 10)
  assert chosen == hotpot_task.stage1_selection(rows1, logits, k=2)
  for record, pick, row in zip(records, chosen, rows2):
    assert [i for i, _ in row.paragraphs] == pick and len(pick) == 2
    # Threshold 0: every sentence of the two chosen paragraphs is predicted evidence.
    titles = {record.context[i][0] for i in pick}
    assert preds["sp"][record.id] == [[t, j] for t, j in row.sentences]
    assert {t for t, _ in preds["sp"][record.id]} == titles
    assert isinstance(preds["answer"][record.id], str)
  scores = hotpot_scores(predictions=preds, golds=[r.as_json() for r in records])
  assert set(scores) >= {"em", "sp_em", "joint_f1"}


def test_slot_pooling_is_the_mean_of_each_span():
  hidden = np.arange(2 * 5 * 3, dtype=np.float32).reshape(2, 5, 3)
  slots = np.array([[-1, 0, 0, 1, -1], [2, 2, 2, -1, 0]])
  pooled = np.asarray(hotpotqa._pool(jnp.asarray(hidden), jnp.asarray(slots), 3))
  np.testing.assert_allclose(pooled[0], [hidden[0, 1:3].mean(0), hidden[0, 3], np.zeros(3)])
  np.testing.assert_allclose(pooled[1], [hidden[1, 4], np.zeros(3), hidden[1, :3].mean(0)])
