"""experiments/segments_vs_longformer.py: the tasks' data (the evidence wholly inside the first
segment or wholly beyond, as each example's facts say), the starting model (the short model's
positions copied over the long table, global projections copied from the local ones), and one
--tiny run (2 tasks x 2 arms x 2 seeds, a few steps, through train.finetune in-process) checked
for its JSON fields, its comparisons recomputed from the per-seed values, and the PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
from testing import assert_paired_task, run_tiny_study
import segments_vs_longformer as svl
import study as study_lib

SEEDS = [0, 1]
P = svl.PRESETS["tiny"]


@pytest.fixture(scope="module")
def text():
  return svl.filler_ids()


@pytest.mark.unit
def test_classification_evidence_is_wholly_inside_or_beyond_the_first_segment(text):
  capacity = svl.first_segment_capacity(P, "classification")
  assert capacity == P["segment"] - 2  # <s> segment </s>
  records = svl.classification_records(P, 200, np.random.default_rng(0), text, "x")
  assert {r["_first_segment"] for r in records} == {True, False}  # both kinds occur
  for r in records:
    ids = np.asarray(r["input_ids"])
    assert P["min_len"] <= len(ids) == r["_length"] <= P["max_len"]
    where = np.flatnonzero(ids >= svl.LABEL_ID)
    assert len(where) == P["copies"] and set(ids[where]) == {svl.LABEL_ID + r["label"]}
    assert where.max() - where.min() < P["cluster"]
    # Wholly inside (the baseline's classifier sees it) or wholly beyond (it cannot).
    assert (where.max() < capacity) == r["_first_segment"] == (where.min() < capacity)
    assert ids[ids < svl.LABEL_ID].max() <= svl.LETTER_ID + 25  # filler: text8 characters


@pytest.mark.unit
def test_qa_answer_is_the_span_after_the_asked_key(text):
  capacity = svl.first_segment_capacity(P, "qa")
  assert capacity == svl.segment_of(P, "qa") - 5  # <s> q </s></s> segment </s>, one question token
  records = svl.qa_records(P, 200, np.random.default_rng(0), text, "x")
  assert {r["_first_segment"] for r in records} == {True, False}
  for r in records:
    ids = np.asarray(r["input_ids"])
    keys = np.flatnonzero((ids >= svl.KEY_ID) & (ids < svl.KEY_ID + svl.NUM_KEYS))
    assert len(keys) == P["keys"] and len(set(ids[keys])) == P["keys"]
    (key_at,) = np.flatnonzero(ids == r["question"][0])
    (answer,) = r["answers"]
    assert (answer["start"], answer["end"]) == (key_at + 1, key_at + 2)
    assert ids[answer["start"]:answer["end"] + 1].max() < svl.KEY_ID  # the span is filler
    assert r["_first_segment"] == (answer["end"] < capacity)


@pytest.mark.unit
def test_the_starting_model_copies_the_short_positions_and_the_local_projections(tmp_path):
  from longformer_jax import checkpoint
  model = checkpoint.load_model(svl.short_model_made_long(P, 3, tmp_path / "start"))
  table = np.asarray(model.longformer.embeddings.position_embeddings.embedding[...])
  assert len(table) == P["max_length"] + 2
  rows = np.arange(P["max_length"])
  np.testing.assert_array_equal(table[2 + rows], table[2 + rows % P["segment"]])
  assert not np.array_equal(table[2], table[3])  # learned rows, not one row repeated
  for layer in model.longformer.layers:
    for proj in ("query", "key", "value"):
      np.testing.assert_array_equal(getattr(layer.attention, f"{proj}_global").kernel[...],
                                    getattr(layer.attention, proj).kernel[...])


@pytest.mark.integration
def test_tiny_run_writes_the_study(tmp_path):
  """2 tasks x 2 arms x 2 seeds of a few steps through train.finetune: every field the docs
  promise, each task's comparisons recomputed from its per-seed values, and the PNG."""
  out = tmp_path / "study.json"
  study = run_tiny_study(svl.main, out, SEEDS)
  assert study["study"] == "segments_vs_longformer" and study["setup"]["segment"] == 64
  assert set(study["tasks"]) == set(svl.TASKS)
  for entry in study["tasks"].values():
    assert_paired_task(entry, svl.ARMS, study_lib)
    for arm in entry["arms"].values():
      assert arm["seeds"] == SEEDS and len(arm["values"]) == 2
      # Every held-out example is in one evidence group and in one length bucket.
      assert sum(arm["by_evidence"][g]["examples"] for g in svl.GROUPS) == P["eval"]
      assert sum(b["examples"] for b in arm["by_length"].values()) == P["eval"]
      assert set(arm["by_length"]) == {f"<={P['bucket']}", f">{P['bucket']}"}
      assert arm["truncation"]["examples"] == P["eval"]
      assert arm["truncation"]["examples_truncated"] == 0  # rows hold every document
      # The groups recombine to the metric (means over examples).
      for i in range(2):
        total = sum(arm["by_evidence"][g]["values"][i] * arm["by_evidence"][g]["examples"]
                    for g in svl.GROUPS)
        assert total / P["eval"] == pytest.approx(arm["values"][i])
    for split in ("by_evidence_comparisons", "by_length_comparisons"):
      assert set(entry[split]) == set(entry["arms"]["segments"][split.removesuffix(
          "_comparisons")])
  assert study["arms"] == study["tasks"]["classification"]["arms"]
  assert study["detectable_difference"]["design"] == "paired"
  # --replot rederives everything from the JSON alone.
  again = tmp_path / "again.json"
  again.write_text(out.read_text())
  assert svl.main(["--replot", "--out", str(again)]) == 0
  assert json.loads(again.read_text())["verdict"] == study["verdict"]
