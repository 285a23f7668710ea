"""experiments/led_truncation.py: the data (markup stripped, paragraphs, pairs whose target is
the first sentence of every paragraph of the source, within the token budget), and one --tiny
run (2 arms, 2 seeds, a few steps) checked for its JSON, the arms differing only in the source
length, the verdict against the detectable difference and the PNG."""

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
  assert lt.first_sentence(paragraphs[0], 100) == "Bold shown and plain text ."
  assert lt.first_sentence("One two three. Four", 2) == "One two"


@pytest.mark.unit
def test_pairs_fill_the_budget_and_target_every_paragraph():
  from longformer_jax.data import tokenized
  paragraphs = [f"P{i} starts here. " + WORDS for i in range(7)]
  tokenizer = tokenized.train_bpe(paragraphs, 300)
  p = {**lt.PRESETS["tiny"], "long_len": 130, "min_paragraphs": 2}
  lengths = [len(tokenizer.encode(x).ids) + 1 for x in paragraphs]
  pairs = lt.make_pairs(paragraphs, tokenizer, p)
  assert pairs
  used = 0
  for pair in pairs:
    run = [x for x in paragraphs if x in pair["source"]]
    assert pair["source"] == " ".join(run) and len(run) >= 2
    assert sum(lengths[paragraphs.index(x)] for x in run) <= p["long_len"] - 2
    assert pair["target"] == " ".join(f"P{paragraphs.index(x)} starts here." for x in run)
    used += len(run)
  assert used <= len(paragraphs)


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
