"""experiments/coref_hotpot_vs_segments.py: the tasks' data and their groups (links or evidence
within one segment, or across), the arms' command lines, the starting checkpoint loading into the
coreference model, and one --tiny run (2 tasks x 2 arms x 2 seeds, a few steps, through
train.finetune in-process) checked for its JSON fields, its comparisons recomputed from the
per-seed values, and the PNG."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
from testing import assert_paired_task, run_tiny_study
import coref_hotpot_vs_segments as chs
import study as study_lib

SEEDS = [0, 1]
P = chs.PRESETS["tiny"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  presets = copy.deepcopy(P)
  return presets, chs.build_data(presets, tmp_path_factory.mktemp("data"))


@pytest.mark.unit
def test_coref_groups_follow_the_links_segments(data):
  from tokenizers import Tokenizer
  from longformer_jax.data import coref
  presets, d = data
  p, facts = presets["coref"], d["coref"]["facts"]
  assert {f["one_segment"] for f in facts.values()} == {True, False}  # both groups occur
  tokenizer = Tokenizer.from_file(str(d["coref"]["tokenizer"]))
  for document in coref.read_conll(d["coref"]["eval"]):
    # One token per word, and every document whole in its row: word w at row position w + 1.
    ids = tokenizer.encode(" ".join(document.tokens), add_special_tokens=False).ids
    assert len(ids) == len(document.tokens) <= p["max_length"] - 2
    assert document.clusters  # every document has links
    # Within one segment: every mention of every cluster in one segment of the row.
    within = all(len({(m + 1) // p["segment"] for span in cluster for m in span}) == 1
                 for cluster in document.clusters)
    assert facts[document.doc_key]["one_segment"] == within, document.doc_key
  assert d["coref"]["trivial"] == 0.0  # no singletons: every mention alone scores nothing


@pytest.mark.unit
def test_hotpot_groups_follow_the_supporting_sentences(data):
  presets, d = data
  p, facts = presets["hotpotqa"], d["hotpotqa"]["facts"]
  assert {f["one_segment"] for f in facts.values()} == {True, False}
  # A question part of 9 tokens ([q] .. [/q]): segment rows <s> [q] .. [/q] part </s>.
  prefix, part = 10, p["segment"] - 10 - 1
  np.testing.assert_array_equal(
      chs.segment_of("hotpotqa", p, np.array([prefix, prefix + part - 1, prefix + part]),
                     prefix), [0, 0, 1])
  length = presets["coref"]["segment"]
  np.testing.assert_array_equal(chs.segment_of("coref", presets["coref"],
                                               np.array([0, length - 1, length, 2 * length])),
                                [0, 0, 1, 2])
  assert d["hotpotqa"]["trivial"] == 0.0  # no evidence: joint F1 0
  for f in facts.values():
    assert f["record"]["supporting_facts"]  # the scorer's golds


@pytest.mark.unit
def test_the_arms_differ_only_in_the_segment_reading():
  for task in chs.TASKS:
    p = P[task]
    assert chs.arm_arguments(task, "longformer", p) == []
    segments = " ".join(chs.arm_arguments(task, "segments", p))
    assert str(p["segment"]) in segments and "global_attention=none" in segments
    assert f"model.attention_window={p['segment']}" in segments


@pytest.mark.unit
def test_the_starting_checkpoint_starts_the_coreference_model(tmp_path):
  """The short model made long (a masked LM checkpoint) is the encoder of a coreference run."""
  from flax import nnx
  from longformer_jax import checkpoint
  from longformer_jax.tasks import finetune as ft
  p = P["coref"]
  path = chs.svl.short_model_made_long(p, 0, tmp_path / "start")
  source = ft.load_source(str(path))
  assert source.config.vocab_size == p["vocab_size"]
  options = ft.FinetuneOptions(**{k: v for k, v in p["settings"].items()})
  kind = ft.get_kind("coref")
  model = kind.build_model(source.config, options, rngs=nnx.Rngs(1))
  params = ft.kind_params(kind, source, model)
  start = checkpoint.load_model(path)
  np.testing.assert_array_equal(
      params["longformer"]["embeddings"]["word_embeddings"]["embedding"],
      start.longformer.embeddings.word_embeddings.embedding[...])


@pytest.mark.integration
def test_tiny_run_writes_the_study(tmp_path):
  """2 tasks x 2 arms x 2 seeds of a few steps through train.finetune: every field the docs
  promise, each task's comparisons recomputed from its per-seed values, and the PNG."""
  out = tmp_path / "study.json"
  study = run_tiny_study(chs.main, out, SEEDS)
  assert study["study"] == "coref_hotpot_vs_segments" and set(study["tasks"]) == set(chs.TASKS)
  for task, entry in study["tasks"].items():
    assert entry["metric"] == chs.METRICS[task]
    assert_paired_task(entry, chs.ARMS, study_lib)
    for arm in entry["arms"].values():
      assert arm["seeds"] == SEEDS and len(arm["values"]) == 2
      assert all(0.0 <= v <= 1.0 for v in arm["values"])
      # Every held-out example is in one group, and both groups hold some.
      assert sum(arm["by_evidence"][g]["examples"] for g in chs.GROUPS) == P[task]["eval"]
      assert all(arm["by_evidence"][g]["examples"] for g in chs.GROUPS)
      assert set(arm["also"]) == set(chs.ALSO[task])
    assert set(entry["by_evidence_comparisons"]) == set(chs.GROUPS)
  assert study["setup"]["arms"]["hotpotqa"]["segments"][:2] == ["--baseline", "segments"]
  assert study["arms"] == study["tasks"]["coref"]["arms"]  # the headline: the first task's
  assert study["detectable_difference"]["design"] == "paired"
  # --replot rederives everything from the JSON alone.
  again = tmp_path / "again.json"
  again.write_text(out.read_text())
  assert chs.main(["--replot", "--out", str(again)]) == 0
  assert json.loads(again.read_text())["verdict"] == study["verdict"]
