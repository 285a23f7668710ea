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
