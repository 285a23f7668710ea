"""experiments/distance_distractors.py: one `--tiny` run of the whole study (3 arms, 2 seeds, a
few steps, the cost panel at the training shape) checked for its JSON, the receptive-field
arithmetic and the PNG; the data generator checked row by row (the evidence exactly `d` before
the query, exactly `K` distractors with other keys); bad command lines."""

from __future__ import annotations

import json
import math
import pathlib
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
import distance_distractors as dd
import distance_task as dt

pytestmark = pytest.mark.integration  # whole study runs in a subprocess


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  out = tmp_path_factory.mktemp("distance_distractors") / "dd.json"
  assert dd.main(["--tiny", "--seeds", "0", "1", "--out", str(out)]) == 0
  return out, json.loads(out.read_text())


def test_tiny_run_schema_and_png(tiny):
  out, study = tiny
  assert study["study"] == "distance_distractors"
  assert isinstance(study["metric"], str) and study["metric"]
  p = dd.PRESETS["tiny"]
  assert list(study["arms"]) == ["local", "global", "full"]
  for arm in study["arms"].values():
    assert arm["seeds"] == [0, 1]
    assert len(arm["values"]) == 2 and all(0.0 <= v <= 1.0 for v in arm["values"])
    assert arm["mean"] == pytest.approx(np.mean(arm["values"]))
    assert arm["std"] == pytest.approx(np.std(arm["values"], ddof=1))
    assert set(arm["by_distance"]) == {str(d) for d in p["distances"]}
    assert set(arm["by_distractors"]) == {str(k) for k in p["distractors"]}
    assert set(arm["cells"]) == {f"d{d}_k{k}" for d in p["distances"]
                                 for k in p["distractors"]}
    assert set(arm["regions"]) == {"one_hop", "two_hops", "beyond_field"}
    for s in (arm["by_distance"]["1"], arm["cells"]["d1_k0"], arm["regions"]["one_hop"]["0"]):
      assert set(s) == {"values", "mean", "std"} and len(s["values"]) == 2
  assert study["setup"]["seeds"] == [0, 1] and study["setup"]["tiny"] is True
  assert study["chance"] == pytest.approx(1 / p["values"])
  assert study["verdict"] and all(isinstance(line, str) for line in study["verdict"])
  heuristic = study["nearest_pair_heuristic"]
  assert set(heuristic["cells"]) == set(study["arms"]["local"]["cells"])
  assert heuristic["cells"]["d1_k3"] == 1.0  # the evidence is always the nearest pair at d=1
  row = study["cell_comparisons"]["local"]["d4_k3"]
  assert {"above_chance", "below_full", "minus_full", "differs_from_nearest_pair"} <= set(row)
  # The cost panel: every arm at the preset's lengths, with bytes and times.
  assert set(study["cost"]) == {"local", "global", "full"}
  for c in study["cost"].values():
    assert c["lengths"] == list(p["cost_lengths"])
    assert all(b > 0 for b in c["temp_bytes"]) and all(s > 0 for s in c["seconds"])
  assert study["cost"]["local"]["time_relative"] == [1.0]
  assert [c["paper_says"] for c in study["comparisons"]] == [
      "global better than local", "full better than local"]
  assert set(study["detectable_difference"]["comparisons"]) == {
      c["paper_says"] for c in study["comparisons"]}
  png = out.with_suffix(".png")
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_receptive_field_arithmetic(tiny):
  _, study = tiny
  p = dd.PRESETS["tiny"]
  rf = study["receptive_field"]
  assert rf["local"] == p["layers"] * p["window"] * 1 == 8
  assert rf["global"] == rf["full"] == p["seq_len"] - 1
  assert study["regions"] == {"one_hop": [1, 4], "two_hops": [6, 8],
                              "beyond_field": [16, 31]}
  # The function itself: per-layer windows and the widest dilation of each layer.
  config = dt.model_config(p, "local", 64).replace(attention_window=(3, 5),
                                                   attention_dilation=((1, 2), (3, 1)))
  assert dt.receptive_field(config) == 3 * 2 + 5 * 3
  assert dt.model_config(p, "full", 64).attention_window == 64


@pytest.mark.parametrize("seq_len,distance,k", [(32, 1, 0), (32, 31, 3), (64, 10, 20),
                                                (128, 127, 31), (128, 5, 16)])
def test_rows_put_the_evidence_at_the_distance(seq_len, distance, k):
  vocab = dt.Vocab(keys=32, values=8, fillers=16)
  rows = dt.make_rows(np.random.default_rng(seq_len + distance + k), 50, seq_len, distance, k,
                      vocab)
  ids, types, labels = rows["input_ids"], rows["token_type_ids"], rows["labels"]
  assert ids.shape == types.shape == (50, seq_len) and labels.shape == (50,)
  query = seq_len - 1
  for row_ids, row_types, label in zip(ids, types, labels):
    q = row_ids[query]
    assert vocab.key0 <= q < vocab.key0 + vocab.keys and row_types[query] == 0
    pairs = np.flatnonzero(row_types > 0)
    assert len(pairs) == k + 1  # the evidence and exactly k distractors
    assert np.all((row_ids[pairs] >= vocab.key0) & (row_ids[pairs] < vocab.key0 + vocab.keys))
    assert len(set(row_ids[pairs])) == k + 1  # distinct keys
    evidence = np.flatnonzero((row_ids == q) & (row_types > 0))
    assert evidence.tolist() == [query - distance]  # one pair with the query's key, d before
    assert row_types[query - distance] == 1 + label
    others = np.delete(np.arange(seq_len), np.concatenate([pairs, [query]]))
    assert np.all(row_ids[others] >= vocab.filler0) and np.all(row_types[others] == 0)
  assert len(set(labels.tolist())) > 1


def test_nearest_pair_accuracy_matches_generated_rows():
  """The exact nearest-pair probability against rows drawn by the generator (which also checks
  that distractors are spread uniformly over the other positions)."""
  vocab = dt.Vocab(keys=16, values=4, fillers=8)
  seq_len, distance, k, n = 40, 6, 5, 2000
  rows = dt.make_rows(np.random.default_rng(7), n, seq_len, distance, k, vocab)
  before_query = rows["token_type_ids"][:, :-1]
  nearest = seq_len - 2 - np.argmax(before_query[:, ::-1] > 0, axis=1)
  is_evidence = nearest == seq_len - 1 - distance
  answer = before_query[np.arange(n), nearest] - 1
  p = math.comb(seq_len - 2 - (distance - 1), k) / math.comb(seq_len - 2, k)
  assert abs(is_evidence.mean() - p) < 4 * np.sqrt(p * (1 - p) / n)
  expected = dt.nearest_pair_accuracy(seq_len, distance, k, vocab.values)
  assert expected == pytest.approx(p + (1 - p) / 4)
  assert abs((answer == rows["labels"]).mean() - expected) < 4 * np.sqrt(0.25 / n)
  assert dt.nearest_pair_accuracy(seq_len, 1, k, 4) == 1.0
  assert dt.nearest_pair_accuracy(seq_len, 30, 0, 4) == 1.0


def test_training_mix_and_bad_cells():
  vocab = dt.Vocab(keys=8, values=4, fillers=8)
  batches = dt.RetrievalBatches(3, 64, 32, 5, vocab)
  first = next(batches)
  assert batches.state() == {"step": 1}
  batches.load_state({"step": 0})
  assert all(np.array_equal(first[name], x) for name, x in next(batches).items())
  counts = (first["token_type_ids"] > 0).sum(axis=1)
  assert counts.min() >= 1 and counts.max() <= 6
  for distance, k in ((0, 1), (32, 1), (5, 8), (5, -1)):
    with pytest.raises(ValueError):
      dt.check_cell(32, distance, k, vocab)


@pytest.mark.parametrize("argv", [["--seeds", "0"], ["--seeds", "0", "0"], ["--steps", "0"],
                                  ["--arms", "local", "dense"], ["--device", "tpu"],
                                  ["--seeds", "-1", "2"], ["--bogus"]])
def test_bad_arguments_raise_value_error(argv):
  with pytest.raises(ValueError):
    dd.main(argv)
