"""experiments/led_truncation.py: the data (markup stripped, paragraphs, pairs whose target is
the opening of every paragraph of the source, within the token budget; the share of the target
within BART's limit; the constant-output floor), the two arms differing only in the input length
(on sources BART's limit holds whole, they train and generate the same), and one --tiny run (2
arms, 2 seeds, a few steps) checked for its JSON, the verdict against the detectable difference
and the PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
import led_truncation as lt
import study as study_lib

SEEDS = [0, 1]
WORDS = " ".join(f"w{i}" for i in range(20))  # 20 words: the shortest prose paragraph


@pytest.mark.unit
def test_markup_is_stripped_and_paragraphs_kept():
  page = (f"<page><title>T</title><text xml:space=\"preserve\">{{{{Infobox|x={{{{y}}}}}}}}\n"
          f"'''Bold''' [[Target|shown]] and [[plain]] text<ref>cite</ref>. {WORDS}\n"
          f"== Heading with enough words {WORDS} ==\n* a list item {WORDS}\n"
          f"[[Category:Things]]\nshort line\n</text></page>"
          f"<page><title>R</title><text>#REDIRECT [[T]]</text></page>")
  (paragraphs,) = lt.articles(page.encode())
  assert paragraphs == [f"Bold shown and plain text . {WORDS}"]
  assert lt.opening(paragraphs[0], 3) == "Bold shown and"


def _paragraph_tokenizer(paragraphs):
  from longformer_jax.data import tokenized
  return tokenized.train_bpe(paragraphs, 300)


@pytest.mark.unit
@pytest.mark.parametrize("every_start", [False, True])
def test_pairs_fill_the_budget_and_target_every_paragraph(every_start):
  paragraphs = [f"P{i} starts here. " + WORDS for i in range(7)]
  tokenizer = _paragraph_tokenizer(paragraphs)
  p = {**lt.PRESETS["tiny"], "long_len": 130, "min_paragraphs": 2, "target_words": 2}
  lengths = [len(tokenizer.encode(x).ids) + 1 for x in paragraphs]
  pairs = lt.make_pairs(paragraphs, tokenizer, p, every_start=every_start)
  assert pairs
  firsts = []
  for pair in pairs:
    run = pair["source"].split(lt.PARAGRAPH_SEP)
    assert len(run) >= 2 and all(x in paragraphs for x in run)
    first = paragraphs.index(run[0])
    assert run == paragraphs[first:first + len(run)]  # consecutive, in order
    assert sum(lengths[paragraphs.index(x)] for x in run) <= p["long_len"] - 2
    # The run is as long as the budget allows: the next paragraph would not fit.
    if first + len(run) < len(paragraphs):
      assert sum(lengths[first:first + len(run) + 1]) > p["long_len"] - 2
    assert pair["target"] == lt.PARAGRAPH_SEP.join(
        f"P{paragraphs.index(x)} starts" for x in run)
    firsts.append(first)
  if every_start:  # a run from every paragraph that still has a second one to fill it
    assert firsts == list(range(len(pairs)))
  else:  # each paragraph in one run
    assert sum(len(x["source"].split(lt.PARAGRAPH_SEP)) for x in pairs) <= len(paragraphs)
    assert firsts == sorted(set(firsts))


@pytest.mark.unit
def test_evidence_within_limit_counts_the_target_words_bart_reads():
  paragraphs = ["Alpha beta gamma " + WORDS, "Delta epsilon zeta " + WORDS]
  tokenizer = _paragraph_tokenizer(paragraphs * 5)
  pair = {"source": lt.PARAGRAPH_SEP.join(paragraphs),
          "target": "Alpha beta\nDelta epsilon"}
  n_first = len(tokenizer.encode(paragraphs[0] + lt.PARAGRAPH_SEP,
                                 add_special_tokens=False).ids)
  n_all = len(tokenizer.encode(pair["source"], add_special_tokens=False).ids)
  # BART's limit: <s>, bart_positions - 2 tokens of text, </s>.
  assert lt.evidence_within_limit(pair, tokenizer, n_all + 2) == 1.0
  assert lt.evidence_within_limit(pair, tokenizer, n_first + 2) == 0.5
  n_alpha = len(tokenizer.encode("Alpha", add_special_tokens=False).ids)
  assert lt.evidence_within_limit(pair, tokenizer, n_alpha + 2) == 0.25
  assert lt.evidence_within_limit(pair, tokenizer, 2) == 0.0


@pytest.mark.unit
def test_constant_baseline_is_the_best_candidate():
  pytest.importorskip("rouge_score")
  train = [{"target": "The cat\nThe dog"}, {"target": "The cat\nIn the"}]
  references = ["The cat\nThe cat\nThe cat"] * 2
  best = lt.constant_baselines(train, references)
  assert best["output"].split() == ["The", "cat"] * 3
  assert best["rouge1"] == pytest.approx(1.0)
  assert best["candidates"] > 10


@pytest.mark.integration
def test_arms_differ_only_in_the_input_length(tmp_path):
  """On sources shorter than BART's limit both arms read the same tokens: the same LED, steps,
  pairs and order must then give the same losses and outputs (up to float rounding of the
  longer padded shapes). Any other difference between the arms (another start, other batches,
  the first arm's training leaking into the second's start) breaks it."""
  pytest.importorskip("transformers")
  from tokenizers import processors
  texts = [f"Line {i} of the text has words {WORDS}" for i in range(12)]
  tokenizer = _paragraph_tokenizer(texts)
  tokenizer.post_processor = processors.TemplateProcessing(
      single="<s> $A </s>", special_tokens=[("<s>", tokenizer.token_to_id("<s>")),
                                            ("</s>", tokenizer.token_to_id("</s>"))])
  p = {**lt.PRESETS["tiny"], "bart_positions": 48, "long_len": 96, "target_len": 8,
       "pretrain_steps": 0, "steps": 4}
  files = {}
  for name in ("train", "eval"):
    files[name] = tmp_path / f"{name}.jsonl"
    files[name].write_text("".join(
        json.dumps({"source": " ".join(t.split()[:8]), "target": " ".join(t.split()[:2])}) + "\n"
        for t in texts))
  data = {"tokenizer": tokenizer, "files": files, "training_texts": texts}
  assert max(len(tokenizer.encode(" ".join(t.split()[:8])).ids) for t in texts) < 48
  led, record = lt.initial_led(p, data, seed=0)
  assert record["losses"] == []  # pretrain_steps 0: none
  full = lt.train_and_score(p, "led_full", 0, led, data, lambda text: None)
  short = lt.train_and_score(p, "bart_limit", 0, led, data, lambda text: None)
  assert (full["source_tokens"], short["source_tokens"]) == (short["source_tokens"],) * 2
  np.testing.assert_allclose(full["losses"], short["losses"], rtol=1e-4)
  assert full["predictions"] == short["predictions"]
  assert lt.source_length(p, "led_full") == p["long_len"]
  assert lt.source_length(p, "bart_limit") == p["bart_positions"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  pytest.importorskip("transformers")
  out = tmp_path_factory.mktemp("led_truncation") / "led.json"
  assert lt.main(["--tiny", "--seeds", *map(str, SEEDS), "--out", str(out)]) == 0
  return out, json.loads(out.read_text())


@pytest.mark.integration
def test_tiny_run_schema_and_verdict(tiny):
  out, study = tiny
  assert {"study", "metric", "arms", "setup", "paper", "comparisons", "rouge_comparisons",
          "detectable_difference", "verdict"} <= set(study)
  assert list(study["arms"]) == list(lt.ARMS)
  p = lt.PRESETS["tiny"]
  for arm in study["arms"].values():
    assert arm["seeds"] == SEEDS and arm["values"] == arm["rouge1"]
    for kind in lt.ROUGE:
      assert len(arm[kind]) == len(SEEDS) and all(0.0 <= v <= 1.0 for v in arm[kind])
  # Only the input length differs: the whole source vs BART's positions.
  assert study["arms"]["bart_limit"]["source_tokens"] <= p["bart_positions"]
  assert study["arms"]["led_full"]["source_tokens"] > p["bart_positions"]
  assert set(study["train_losses"]["led_full"]) == {str(s) for s in SEEDS}
  # One pretrained BART per seed, shared by both arms; the data's facts, computed not trained.
  assert set(study["pretrain_losses"]) == {str(s) for s in SEEDS}
  assert all(len(v) == p["pretrain_steps"] for v in study["pretrain_losses"].values())
  facts = study["data_properties"]
  assert 0.0 <= facts["evidence_within_limit"]["mean"] <= 1.0
  assert len(facts["evidence_within_limit"]["per_pair"]) == study["setup"]["pairs"]["eval"]
  assert 0.0 <= facts["constant_output"]["rouge1"] <= 1.0
  example = study["example"]
  assert {"source_head", "target", *lt.ARMS} <= set(example)
  for arm in lt.ARMS:  # seed 0's output for the first held-out pair
    assert example[arm] == study["arms"][arm]["example_predictions"][0]
  assert study["setup"]["load_average_start"] is None or len(
      study["setup"]["load_average_start"].split()) == 3
  (c,) = study["comparisons"]
  full, short = study["arms"]["led_full"], study["arms"]["bart_limit"]
  assert c["difference"] == pytest.approx(full["mean"] - short["mean"])
  assert c["outcome"] == study_lib.outcome(c["difference"], c["detectable_difference"])
  for kind, k in study["rouge_comparisons"].items():
    assert k["difference"] == pytest.approx(np.mean(full[kind]) - np.mean(short[kind]))
    assert k["detectable_difference"] == pytest.approx(
        study_lib.detectable_difference(full[kind], short[kind]))
  assert "detectable" in study["verdict"]
  assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.unit
@pytest.mark.parametrize("argv, match", [
    (["--seeds", "0"], "at least 2 seeds"),
    (["--device", "tpu"], "--device"),
])
def test_bad_arguments(argv, match, tmp_path):
  with pytest.raises(ValueError, match=match):
    lt.main([*argv, "--out", str(tmp_path / "x.json")])
