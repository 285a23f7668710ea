"""What fine-tuning results report of the length limit: each kind's per-record truncation facts
on hand-built splits (the "truncation" block's fractions exact), the "by_length" buckets (the
kind's metrics on each bucket; means recombine to the split's), and the prediction records'
full_length and truncated. No model runs here: the outputs are written by hand."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from longformer_jax.config import LongformerConfig
from longformer_jax.data import finetune_data as fd
from longformer_jax.data.tokenizer import SpecialIds
from longformer_jax.tasks import finetune as ft
from longformer_jax.tasks import truncation

pytestmark = pytest.mark.unit

_SPECIALS = SpecialIds.of_config(LongformerConfig.tiny())


def _split(tmp_path, task, records, *, max_length, **kwargs):
  path = tmp_path / f"{task}.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  kind = ft.KINDS[task]
  return fd.read_split(path, kind, None, max_length=max_length, specials=_SPECIALS,
                       vocab_size=512, label_names=kind.label_names([path], None), **kwargs)


def _doc(n, start=10):
  return [start + i % 50 for i in range(n)]


def _block(split, outputs):
  return ft.length_report(split, len(split), outputs, length_buckets=(16,))["truncation"]


def test_classification_block_counts_cut_documents_and_has_no_evidence(tmp_path):
  # Rows of 10 keep 8 document tokens: documents of 5, 8, 12 and 30 tokens.
  split = _split(tmp_path, "classification",
                 [{"input_ids": _doc(n), "label": n % 2} for n in (5, 8, 12, 30)], max_length=10)
  block = _block(split, {"logits": np.zeros((4, 2), np.float32)})
  assert block == {"max_length": 10, "examples": 4, "examples_truncated": 2 / 4,
                   "document_tokens_kept": (5 + 8 + 8 + 8) / (5 + 8 + 12 + 30),
                   "evidence_within_limit": None}
  assert [e.truncation.full_length for e in split.examples] == [7, 10, 14, 32]


def test_qa_block_counts_question_cuts_and_answers_kept(tmp_path):
  # max_length 16 with a 2-token question: <s> q q </s></s> leaves 16 - 5 - 1 = 10 context tokens.
  records = [
      {"question": [5, 6], "input_ids": _doc(8), "answers": [{"start": 2, "end": 3}]},
      {"question": [5, 6], "input_ids": _doc(14), "answers": [{"start": 11, "end": 12}]},
      # Cut, but one of its two answers lies inside the kept context.
      {"question": [5, 6], "input_ids": _doc(14), "answers": [{"start": 12, "end": 13},
                                                               {"start": 3, "end": 3}]},
      # A question of 3 tokens cut to 2 (max_question_length): truncated, its context whole.
      {"question": [5, 6, 7], "input_ids": _doc(6), "answers": [{"start": 0, "end": 0}]},
      # An answer that ends just past the kept context is not inside it.
      {"question": [5, 6], "input_ids": _doc(11), "answers": [{"start": 8, "end": 10}]},
  ]
  split = _split(tmp_path, "qa", records, max_length=16, max_question_length=2)
  outputs = {"start": np.full(5, 5), "end": np.full(5, 5), "score": np.zeros(5)}
  block = _block(split, outputs)
  assert block == {"max_length": 16, "examples": 5, "examples_truncated": 4 / 5,
                   "document_tokens_kept": (8 + 10 + 10 + 6 + 10) / (8 + 14 + 14 + 6 + 11),
                   "evidence_within_limit": 3 / 5}
  # Full lengths: <s> question </s></s> context </s>, the question uncut.
  assert [e.truncation.full_length for e in split.examples] == [
      1 + 2 + 2 + 8 + 1, 1 + 2 + 2 + 14 + 1, 1 + 2 + 2 + 14 + 1, 1 + 3 + 2 + 6 + 1,
      1 + 2 + 2 + 11 + 1]
  _, records_out = ft.score(split, outputs)
  assert [(r["full_length"], r["truncated"]) for r in records_out] == [
      (14, False), (20, True), (20, True), (13, True), (17, True)]


def test_token_block_counts_words_cut(tmp_path):
  # Rows of 8 keep 6 tokens (ids: one word each).
  records = [{"input_ids": _doc(n), "labels": ["O"] * n} for n in (4, 6, 9)]
  split = _split(tmp_path, "token", records, max_length=8)
  tags = np.zeros((3, 8), np.int32)
  assert _block(split, {"tags": tags}) == {
      "max_length": 8, "examples": 3, "examples_truncated": 1 / 3,
      "document_tokens_kept": (4 + 6 + 6) / (4 + 6 + 9), "evidence_within_limit": 2 / 3}


def test_multiple_choice_block_looks_for_the_answer_in_the_kept_document(tmp_path):
  # max_length 16: <s> q </s></s> c </s></s> doc </s> keeps 16 - 8 = 8 document tokens (1-token
  # candidates; 7 with a 2-token one).
  records = [
      {"question": [5], "candidates": [[40], [41]], "input_ids": [40] + _doc(5), "label": 0},
      {"question": [5], "candidates": [[40], [41]], "input_ids": _doc(11) + [41], "label": 1},
      {"question": [5], "candidates": [[40], [41]], "input_ids": _doc(6), "label": 1},
      {"question": [5], "candidates": [[40, 42], [41]], "input_ids": _doc(7) + [40, 42],
       "label": 0},
  ]
  split = _split(tmp_path, "multiple_choice", records, max_length=16)
  facts = [e.truncation for e in split.examples]
  # The second never reaches its answer; the third's document never names it (no evidence);
  # the fourth's 2-token candidate leaves 7 document tokens: its answer ends at token 9.
  assert [f.evidence for f in facts] == [True, False, None, False]
  assert [f.kept_tokens for f in facts] == [6, 8, 6, 7]
  block = _block(split, {"logits": np.zeros((4, 2), np.float32)})
  assert block == {"max_length": 16, "examples": 4, "examples_truncated": 2 / 4,
                   "document_tokens_kept": (6 + 8 + 6 + 7) / (6 + 12 + 6 + 9),
                   "evidence_within_limit": 1 / 3}
  assert [f.full_length for f in facts] == [1 + 1 + 2 + 1 + 2 + 6 + 1, 1 + 1 + 2 + 1 + 2 + 12 + 1,
                                            1 + 1 + 2 + 1 + 2 + 6 + 1, 1 + 1 + 2 + 2 + 2 + 9 + 1]


def test_multiple_choice_text_records_find_the_answer_by_its_text(tmp_path):
  """Text records: the right candidate is looked for, case folded, in the characters the kept
  tokens cover (a candidate tokenized alone need not match its tokens inside the text)."""
  words = ["which", "city", "?", "paris", "rome", "Paris", "Rome"] + [f"w{i}" for i in range(9)]
  vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>"] + words)}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  records = [  # rows of 16: <s> which city ? </s></s> Paris </s></s> ... </s> keep 6 words
      {"question": "which city ?", "candidates": ["Paris", "Rome"], "text": "w1 paris w2",
       "label": 0},
      {"question": "which city ?", "candidates": ["Paris", "Rome"],
       "text": "w0 w1 w2 w3 w4 w5 w6 w7 rome", "label": 1},
      {"question": "which city ?", "candidates": ["Paris", "Rome"], "text": "w1 w2",
       "label": 1},
  ]
  path = tmp_path / "mc.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  split = fd.read_split(path, ft.KINDS["multiple_choice"], tokenizer, max_length=16,
                        specials=_SPECIALS, vocab_size=512)
  assert [e.truncation.evidence for e in split.examples] == [True, False, None]
  assert [e.truncation.kept_tokens for e in split.examples] == [3, 6, 2]


def test_wikihop_block_counts_query_cuts_and_the_answer_in_the_supports(tmp_path):
  """WikiHop reads every support (chunks, under the segment baseline too): no document token is
  lost, only a query cut by max_question_length truncates; the evidence is the answer named in a
  support (ids as a run inside one support; text, case folded), no evidence when none names it."""
  cands = [[40], [41, 42]]
  records = [  # max_question_length 2; rows of 24 tokens
      {"query": [5, 6], "candidates": cands, "input_ids": [[10, 40], [11]], "answer": 0},
      # A query of 3 tokens cut to 2; the answer's two ids in a row of one support.
      {"query": [5, 6, 7], "candidates": cands, "input_ids": [[12, 41, 42, 13]], "answer": 1},
      # The answer's ids split across two supports: not a run inside one, no evidence.
      {"query": [5], "candidates": cands, "input_ids": [[10, 41], [42, 11]], "answer": 1},
      # Supports of 30 tokens: three rows (chunks), every token read, the answer in the last.
      {"query": [5], "candidates": cands, "input_ids": [_doc(20), _doc(8) + [40]], "answer": 0},
      # The answer nowhere: no evidence.
      {"query": [5, 6], "candidates": cands, "input_ids": [[10, 11, 12]], "answer": 0},
  ]
  split = _split(tmp_path, "wikihop", records, max_length=24, max_question_length=2)
  facts = [e.truncation for e in split.examples]
  assert [f.evidence for f in facts] == [True, True, None, True, None]
  assert [f.truncated for f in facts] == [False, True, False, False, False]
  assert [len(e.input_ids) for e in split.examples] == [1, 1, 1, 3, 1]
  # <s> [q] query [/q] [ent] 40 [/ent] [ent] 41 42 [/ent] </s> supports (</s></s> between) </s>:
  # the prefix is 3 + 7 tokens beside the query, the uncut query counted.
  assert [f.full_length for f in facts] == [10 + 2 + 2 + 5, 10 + 3 + 2 + 4, 10 + 1 + 2 + 6,
                                            10 + 1 + 2 + 31, 10 + 2 + 2 + 3]
  assert [f.document_tokens for f in facts] == [f.kept_tokens for f in facts] == [3, 4, 4, 29, 3]
  logits = np.asarray([[1, 0], [0, 1], [1, 0], [1, 0], [0, 1]], np.float32)
  report = ft.length_report(split, 5, {"logits": logits}, length_buckets=(20,))
  assert report["truncation"] == {"max_length": 24, "examples": 5, "examples_truncated": 1 / 5,
                                  "document_tokens_kept": 1.0, "evidence_within_limit": 3 / 3}
  # Full lengths 19, 19, 19, 44, 17: the long one alone is past 20, and right.
  assert report["by_length"] == {"<=20": {"accuracy": 2 / 4, "examples": 4},
                                 ">20": {"accuracy": 1.0, "examples": 1}}
  _, predictions = ft.score(split, {"logits": logits})
  assert [(p["full_length"], p["truncated"]) for p in predictions] == [
      (f.full_length, f.truncated) for f in facts]
  # Text records: the answer's text, case folded, inside a support's text (tokenized alone, a
  # candidate need not match its tokens inside a sentence).
  tokenizer = _word_tokenizer(["q1", "paris", "rome", "Paris", "Rome", "w1", "w2"])
  text_records = [
      {"query": "q1", "candidates": ["paris", "rome"], "supports": ["w1 Paris", "w2"],
       "answer": "paris"},
      {"query": "q1", "candidates": ["paris", "rome"], "supports": ["w1 Paris"],
       "answer": "rome"},
  ]
  path = tmp_path / "wikihop_text.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in text_records))
  text_split = fd.read_split(path, ft.KINDS["wikihop"], tokenizer, max_length=24,
                             specials=_SPECIALS, vocab_size=512)
  assert [e.truncation.evidence for e in text_split.examples] == [True, None]


def test_by_length_means_recombine_to_the_split_metric(tmp_path):
  """Accuracy (classification) and EM / F1 (QA) are means over examples: the examples-weighted
  mean of the buckets is the split's metric; macro F1 is each bucket's own."""
  rng = np.random.default_rng(0)
  lengths = rng.integers(3, 40, size=12)
  split = _split(tmp_path, "classification",
                 [{"input_ids": _doc(int(n)), "label": int(i % 3)} for i, n in enumerate(lengths)],
                 max_length=32)
  logits = rng.normal(size=(12, 3)).astype(np.float32)
  metrics, _ = ft.score(split, {"logits": logits})
  report = ft.length_report(split, 12, {"logits": logits}, length_buckets=(20, 9))
  buckets = report["by_length"]
  assert list(buckets) == ["<=9", ">9", "<=20", ">20"]
  for boundary in (9, 20):
    pair = {k: buckets[k] for k in truncation.bucket_names(boundary)}
    assert sum(b["examples"] for b in pair.values()) == 12 and all(
        b["examples"] for b in pair.values())
    assert truncation.recombine(pair, "accuracy") == pytest.approx(metrics["accuracy"],
                                                                    rel=1e-12)
    short = np.flatnonzero(lengths + 2 <= boundary)
    gold = np.arange(12) % 3
    assert pair[f"<={boundary}"]["f1"] == ft.macro_f1(gold[short],
                                                       np.argmax(logits, -1)[short])

  # QA: EM and token F1 per question.
  records = []
  for _ in range(10):
    n = int(rng.integers(2, 30))
    records.append({"question": [5, 6], "input_ids": _doc(n),
                    "answers": [{"start": 0, "end": min(2, n - 1)}]})
  qa = _split(tmp_path, "qa", records, max_length=24)
  starts = 5 + rng.integers(0, 2, size=10)
  outputs = {"start": starts, "end": starts + rng.integers(0, 3, size=10),
             "score": np.zeros(10)}
  metrics, _ = ft.score(qa, outputs)
  assert 0 < metrics["exact_match"] < 1 and 0 < metrics["f1"] < 1
  pair = ft.length_report(qa, 10, outputs, length_buckets=(20,))["by_length"]
  assert pair["<=20"]["examples"] and pair[">20"]["examples"]
  for name in ("exact_match", "f1"):
    assert truncation.recombine(pair, name) == pytest.approx(metrics[name], rel=1e-12)


def test_length_buckets_are_checked():
  for bad in ((), (0,), (512, 512), ("512",), 512):
    with pytest.raises(ValueError, match="length_buckets must be distinct ints >= 1"):
      ft.FinetuneOptions(length_buckets=bad)


# ----------------------------------------------------------------------------------------------
# Coreference and HotpotQA: their own files, the same block


def _word_tokenizer(words, extra=(), pre=None):
  vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", *extra, *words])}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre or pre_tokenizers.WhitespaceSplit()
  return tokenizer


def _coref_split(tmp_path, **options):
  """Four jsonlines documents of words w0 w1 ..., one token each, read at max_length 12: the row
  keeps words 0..9 (a mention is kept when it ends before word 10)."""
  documents = [
      # 20 words: 3 of 5 mentions kept; links (0,0)<-(3,4) kept, (3,4)<-(12,12) and
      # (5,6)<-(9,10) not (the last mention of each ends past word 9).
      (20, [[[0, 0], [3, 4], [12, 12]], [[5, 6], [9, 10]]]),
      # 8 words, whole: 2 mentions, 1 link, all kept.
      (8, [[[1, 1], [4, 5]]]),
      # 15 words: (3,4) is kept but its antecedent (2,11) is not (nested: it starts earlier and
      # ends past the cut); (6,7) kept, (13,14) not: 2 of 4 mentions, 0 of 2 links.
      (15, [[[2, 11], [3, 4]], [[6, 7], [13, 14]]]),
      # 12 words and no mention: cut, no evidence.
      (12, []),
  ]
  path = tmp_path / "coref.jsonlines"
  path.write_text("".join(json.dumps({
      "doc_key": f"nw/{k}", "sentences": [[f"w{i}" for i in range(n)]],
      "sentence_map": [0] * n, "subtoken_map": list(range(n)), "clusters": clusters}) + "\n"
      for k, (n, clusters) in enumerate(documents)))
  tokenizer = _word_tokenizer([f"w{i}" for i in range(20)])
  return ft.get_kind("coref").read_split(path, tokenizer, max_length=12, specials=_SPECIALS,
                                         vocab_size=512, options=ft.FinetuneOptions(**options))


def _coref_oracle(split, m=8):
  """Each kept gold mention linked to the previous one of its cluster (row positions)."""
  outputs = {name: np.zeros((len(split), m), np.int32) for name in ("starts", "ends")}
  outputs["links"] = np.full((len(split), m), -1, np.int32)
  outputs["span_mask"] = np.zeros((len(split), m), bool)
  for row, e in enumerate(split.examples):
    last = {}
    for i, ((s, t), c) in enumerate(sorted((s, c) for c, cluster in enumerate(e.gold_row)
                                           for s in cluster)):
      outputs["starts"][row, i], outputs["ends"][row, i] = s, t
      outputs["span_mask"][row, i] = True
      outputs["links"][row, i] = last.get(c, -1)
      last[c] = i
  return outputs


def test_coref_block_counts_mentions_and_links_kept(tmp_path):
  split = _coref_split(tmp_path)
  outputs = _coref_oracle(split)
  report = ft.length_report(split, len(split), outputs, length_buckets=(12,))
  assert report["truncation"] == {
      "max_length": 12, "examples": 4, "examples_truncated": 3 / 4,
      "document_tokens_kept": (10 + 8 + 10 + 10) / (20 + 8 + 15 + 12),
      # Documents with every gold mention kept, among those with one.
      "evidence_within_limit": 1 / 3,
      "mentions_within_limit": (3 + 2 + 2) / (5 + 2 + 4),
      "links_within_limit": (1 + 1 + 0) / (3 + 1 + 2)}
  # full_length: the words and <s>, </s>; the 8-word document alone needs at most 12.
  assert [e.truncation.full_length for e in split.examples] == [22, 10, 17, 14]
  buckets = report["by_length"]
  assert [buckets[k]["examples"] for k in ("<=12", ">12")] == [1, 3]
  # CoNLL F1 is summed over each bucket's documents: the oracle of the whole short document
  # scores 1, the long ones miss the mentions cut away.
  assert buckets["<=12"]["conll_f1"] == 1.0 and buckets[">12"]["muc_r"] < 1.0
  metrics, records = ft.score(split, outputs)
  assert "mentions_within_limit" not in metrics  # said once, in the block
  assert [(r["full_length"], r["truncated"]) for r in records] == [
      (22, True), (10, False), (17, True), (14, True)]
  # The segment baseline's segments read what the row keeps: the same block.
  segments = _coref_split(tmp_path, baseline="segments", segment_length=4)
  assert segments.kind.run_settings.segment_length == 4
  assert ft.length_report(segments, 4, outputs)["truncation"] == report["truncation"]


def _hotpot_record(i, question, context, facts):
  return {"_id": f"r{i}", "question": question, "answer": "yes", "type": "comparison",
          "supporting_facts": facts, "context": context}


def test_hotpotqa_block_counts_supporting_sentences_in_stage_1(tmp_path):
  # Stage 1's row: <s> [q] question [/q] ([p] title ([s] sentence)...)... </s>; max_length 24
  # leaves 23 positions before </s>, and a paragraph ends the row at its first sentence that
  # does not fit. One token per word.
  records = [
      # 5 + 2 + 3 + 2 + 2 + 4 = 18 positions: whole; 8 document tokens (titles and words).
      _hotpot_record(0, "q1 q2", [["A", ["a1 a2", "a3"]], ["B", ["b1 b2 b3"]]],
                     [["A", 0], ["B", 0]]),
      # 5 + [p] C [s] c1..c6 [s] c7 c8 = 17; [p] D [s] d1..d7 needs 10 more: D is lost with its
      # supporting sentence. Kept 9 of 17 document tokens.
      _hotpot_record(1, "q1 q2", [["C", ["c1 c2 c3 c4 c5 c6", "c7 c8"]],
                                  ["D", ["d1 d2 d3 d4 d5 d6 d7"]]], [["C", 1], ["D", 0]]),
      # 6 + [p] E [s] e1 e2 [s] e3 e4 + [p] F [s] f1 = 18; F's second sentence (10) is lost, the
      # supporting ones are kept. Kept 7 of 16 document tokens.
      _hotpot_record(2, "q1 q2 q3", [["E", ["e1 e2", "e3 e4"]],
                                     ["F", ["f1", "f2 f3 f4 f5 f6 f7 f8 f9 f10"]]],
                     [["E", 0], ["F", 0]]),
      # A question of 4 tokens cut to max_question_length 3; the paragraphs whole (4 tokens).
      _hotpot_record(3, "q1 q2 q3 q4", [["G", ["g1"]], ["H", ["h1"]]], [["G", 0], ["H", 0]]),
  ]
  path = tmp_path / "hotpot.json"
  path.write_text(json.dumps(records))
  pre = pre_tokenizers.Whitespace()
  words = sorted({w for r in records for t in (r["question"], *(x for title, s in r["context"]
                                                                 for x in (title, *s)))
                  for w, _ in pre.pre_tokenize_str(t)})
  from longformer_jax.data import hotpotqa as hq
  tokenizer = _word_tokenizer(words, hq.MARKER_TOKENS, pre)
  split = ft.get_kind("hotpotqa").read_split(
      path, tokenizer, max_length=24, specials=_SPECIALS, vocab_size=512,
      options=ft.FinetuneOptions(max_question_length=3))
  assert [e.stage1.truncation.document_tokens_kept for e in split.examples] == [8, 9, 7, 4]
  # Answers: yes, no, yes, no against "yes" gold; evidence: the first supporting sentence.
  answers = np.array(["yes", "no", "yes", "no"], object)
  facts = np.empty(4, object)
  for i, r in enumerate(records):
    facts[i] = [list(r["supporting_facts"][0])]
  outputs = {"answer": answers, "sp": facts, "chosen": np.array([[0, 1]] * 4, np.int32)}
  report = ft.length_report(split, 4, outputs, length_buckets=(20,))
  assert report["truncation"] == {
      "max_length": 24, "examples": 4, "examples_truncated": 3 / 4,
      "document_tokens_kept": (8 + 9 + 7 + 4) / (8 + 17 + 16 + 4),
      "evidence_within_limit": 3 / 4}
  # Uncut: <s> [q] question [/q] </s>, a marker per title and sentence, the document tokens.
  assert [e.truncation.full_length for e in split.examples] == [
      4 + 2 + 5 + 8, 4 + 2 + 5 + 17, 4 + 3 + 6 + 16, 4 + 4 + 4 + 4]
  metrics, records_out = ft.score(split, outputs)
  assert "evidence_within_limit" not in metrics  # said once, in the block
  assert [(r["full_length"], r["truncated"]) for r in records_out] == [
      (19, False), (28, True), (29, True), (16, True)]
  buckets = report["by_length"]
  assert [buckets[k]["examples"] for k in ("<=20", ">20")] == [2, 2]  # records 0, 3; 1, 2
  assert buckets["<=20"]["em"] == 0.5 and buckets[">20"]["em"] == 0.5
  for name in ("em", "sp_f1", "joint_f1"):  # means over records: they recombine
    assert truncation.recombine(buckets, name) == pytest.approx(metrics[name], rel=1e-12)
