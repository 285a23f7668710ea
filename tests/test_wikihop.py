"""WikiHop's own model as a fine-tuning kind (`--task wikihop`): QAngaroo's JSON and our JSONL
read alike, the row layout by hand, one chunk equal to the single row and two chunks to the sum of
their rows' scores, the segment baseline (the same chunk-and-sum in rows of segment_length), the
marker tokens grown into the vocabulary without changing old outputs, the order drawn anew every
epoch, and runs (whole rows and segments) that train, save, reload and score with --eval-only
through the command line.
"""

import json
import random

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers

from longformer_jax import checkpoint, modeling
from longformer_jax.commands import train_finetune as cli
from longformer_jax.config import LongformerConfig
from longformer_jax.data import finetune_data as fd
from longformer_jax.data import text
from longformer_jax.data import wikihop as wd
from longformer_jax.data.tokenizer import SpecialIds
from longformer_jax.tasks import finetune as ft
from longformer_jax.tasks import wikihop as wikihop_task

pytestmark = pytest.mark.integration

CONFIG = LongformerConfig.tiny(num_hidden_layers=1, attention_impl="reference")
SPECIALS = SpecialIds.of_config(CONFIG)
KIND = ft.get_kind("wikihop")


def _records(n, seed=0, support_length=(3, 9)):
  """Id records: 2 or 3 candidates (ids 40..42), three supports of random ids, the answer's id
  inside one of them."""
  rng = random.Random(seed)
  records = []
  for i in range(n):
    candidates = [[40 + c] for c in range(rng.choice((2, 3)))]
    label = rng.randrange(len(candidates))
    supports = [[rng.randrange(10, 30) for _ in range(rng.randrange(*support_length))]
                for _ in range(3)]
    supports[rng.randrange(3)].append(candidates[label][0])
    records.append({"id": f"r{i}", "query": [5, 6], "candidates": candidates,
                    "input_ids": supports, "answer": label})
  return records


def _split(path, max_length=24, kind=KIND, tokenizer=None):
  return fd.read_split(path, kind, tokenizer, max_length=max_length, specials=SPECIALS,
                       vocab_size=CONFIG.vocab_size)


def _write(path, records, *, array=False):
  with open(path, "w") as f:
    if array:
      json.dump(records, f)
    else:
      f.writelines(json.dumps(r) + "\n" for r in records)
  return str(path)


@pytest.fixture(scope="module")
def model():
  grown = CONFIG.replace(vocab_size=CONFIG.vocab_size + len(wd.MARKERS))
  m = KIND.model_class(grown, rngs=nnx.Rngs(0))
  m.eval()
  return m


# ----------------------------------------------------------------------------------------------
# Records and rows


def test_qangaroo_json_and_jsonl_read_alike_and_the_row_layout_by_hand(tmp_path):
  record = {"id": "WH_dev_0", "query": "w1 w2", "supports": ["w3 w4 Name0", "w5"],
            "candidates": ["Name0", "Name1 w6"], "answer": "Name1 w6"}
  vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", "w1", "w2", "w3", "w4",
                                       "w5", "w6", "Name0", "Name1"])}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  as_array = _split(_write(tmp_path / "dev.json", [record], array=True), tokenizer=tokenizer)
  as_lines = _split(_write(tmp_path / "dev.jsonl", [record]), tokenizer=tokenizer)
  q, end_q, ent, end_ent = wd.Q, wd.END_Q, wd.ENT, wd.END_ENT
  prefix = [0, q, 4, 5, end_q, ent, 10, end_ent, ent, 11, 9, end_ent]
  for split in (as_array, as_lines):
    [e] = split.examples
    assert split.by_text and split.ids == ("WH_dev_0",) and e.label == 1
    assert [list(r) for r in e.input_ids] == [prefix + [2, 6, 7, 10, 2, 2, 8, 2]]
    assert list(e.entity_positions) == [5, 8] and e.question_end == len(prefix)
    assert e.global_lengths("question") == (12,) and e.global_lengths("first") == (1,)
  # Chunks: 12 prefix tokens + 2 specials leave 2 support tokens a row at max_length 16.
  [e] = _split(_write(tmp_path / "dev.json", [record], array=True), max_length=16,
               tokenizer=tokenizer).examples
  assert [list(r[12:]) for r in e.input_ids] == [[2, 6, 7, 2], [2, 10, 2, 2], [2, 2, 8, 2]]
  assert all(list(r[:12]) == prefix for r in e.input_ids) and e.document_tokens == 6
  # Markers resolve to the last rows of the model's vocabulary.
  assert list(wd.resolve_markers(np.asarray([0, q, end_q, ent, end_ent]), 516)) == [
      0, 512, 513, 514, 515]


@pytest.mark.parametrize("change, array, where, problem", [
    ({"answer": "Name9"}, True, ":1: field 'answer'", "is 'Name9', not one of the candidates"),
    ({"candidates": ["Name0"], "answer": "Name0"}, False, ":1: field 'candidates'",
     "needs at least 2 candidates"),
    ({"supports": []}, True, ":1: field 'supports'", "is empty"),
    ({"query": 3}, True, ":1: field 'query'", "must be a string or a list"),
])
def test_bad_records_name_the_file_record_and_field(tmp_path, change, array, where, problem):
  record = {"query": "w1", "supports": ["w1 w2"], "candidates": ["Name0", "Name1"],
            "answer": "Name0", **change}
  tokenizer = Tokenizer(models.WordLevel({"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "w1": 4,
                                          "w2": 5, "Name0": 6, "Name1": 7}, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  path = _write(tmp_path / ("bad.json" if array else "bad.jsonl"), [record], array=array)
  with pytest.raises(text.JsonlError) as info:
    _split(path, tokenizer=tokenizer)
  assert f"{path}{where}" in str(info.value) and problem in str(info.value), str(info.value)
  broken = tmp_path / "broken.json"
  broken.write_text("[{\"query\": ")
  with pytest.raises(text.JsonlError, match="broken.json: is not JSON"):
    _split(str(broken))


# ----------------------------------------------------------------------------------------------
# Chunk-and-sum


def _row_scores(model, row, positions):
  """The candidates' scores of one row run alone: the bias-free linear map of the encoder's
  states at the [ent] markers."""
  ids = wd.resolve_markers(jnp.asarray(row)[None], model.config.vocab_size)
  glob = np.zeros((1, len(row)), np.int32)
  glob[0, :positions[-1] + 1] = 1
  states = model.longformer(ids, jnp.ones_like(ids), jnp.asarray(glob)).last_hidden_state
  kernel = model.candidate_scorer.kernel[...]
  return np.asarray(states[0, np.asarray(positions)] @ kernel)[:, 0]


def test_one_chunk_is_the_single_row_and_two_chunks_the_sum_of_their_rows(model, tmp_path):
  records = _records(2, support_length=(2, 3))
  records[1]["input_ids"] = [list(range(10, 30)), [11, 12, 40]]  # two chunks at max_length 32
  split = _split(_write(tmp_path / "r.jsonl", records), max_length=32)
  one, two = split.examples
  assert (len(one.input_ids), len(two.input_ids)) == (1, 2) and split.num_chunks == 2
  batch = KIND.batch(split, [0, 1], global_attention="question", specials=SPECIALS)
  logits = np.asarray(KIND.logits(model, batch, split.max_global("question"))["logits"])
  for row, e in enumerate((one, two)):
    c = len(e.candidates)
    expected = sum(_row_scores(model, r, e.entity_positions) for r in e.input_ids)
    np.testing.assert_allclose(logits[row, :c], expected, rtol=1e-6, atol=1e-6)
    assert (logits[row, c:] == -1e9).all()  # filler candidates
  # The loss is the cross-entropy of those logits.
  nll = [-(lg[e.label] - np.log(np.sum(np.exp(lg[:len(e.candidates)]))))
         for lg, e in zip(logits.astype(np.float64), (one, two))]
  assert float(KIND.loss(model, batch, split.max_global("question"))) == pytest.approx(
      np.mean(nll), rel=1e-5)


# ----------------------------------------------------------------------------------------------
# The segment baseline


def _segments(length, **options):
  return KIND.configured(ft.FinetuneOptions(baseline="segments", segment_length=length,
                                            **options))


def test_segment_baseline_is_chunk_and_sum_in_rows_of_segment_length(model, tmp_path):
  """One segment gives the single row's logits; two give the sum of the two rows' scores, each
  row the prefix and its segment of the supports (positions restarting); editing a support
  token of segment 2 leaves segment 1's states bit-identical, where the single row's change."""
  records = _records(2, support_length=(2, 3))
  records[1]["input_ids"] = [list(range(10, 30)), [11, 12, 40]]  # a stream of 25 tokens
  path = _write(tmp_path / "r.jsonl", records)
  whole = _split(path, max_length=64)
  one = _split(path, max_length=64, kind=_segments(48))
  two = _split(path, max_length=64, kind=_segments(32))
  assert [len(e.input_ids) for s in (whole, one, two) for e in s.examples] == [1, 1, 1, 1, 1, 2]
  assert two.max_length == 64 and two.kind.row_length(two.max_length) == 32
  kw = dict(global_attention="question", specials=SPECIALS)
  logits = {name: np.asarray(split.kind.logits(model, split.kind.batch(split, [0, 1], **kw),
                                               split.max_global("question"))["logits"])
            for name, split in (("whole", whole), ("one", one), ("two", two))}
  np.testing.assert_allclose(logits["one"], logits["whole"], rtol=1e-6, atol=1e-6)
  e = two.examples[1]
  p = e.question_end
  assert all(len(r) <= 32 and list(r[:p]) == list(e.input_ids[0][:p]) and r[p] == SPECIALS.sep
             and r[-1] == SPECIALS.eos for r in e.input_ids)
  assert [int(t) for r in e.input_ids for t in r[p + 1:-1]] == (
      list(range(10, 30)) + [SPECIALS.sep] * 2 + [11, 12, 40])
  c = len(e.candidates)
  expected = sum(_row_scores(model, r, e.entity_positions) for r in e.input_ids)
  np.testing.assert_allclose(logits["two"][1, :c], expected, rtol=1e-6, atol=1e-6)
  assert not np.allclose(logits["two"][1, :c], logits["whole"][1, :c], atol=1e-4)
  # A support token of segment 2 edited: segment 1 reads nothing of it.
  batch = two.kind.batch(two, [1], **kw)

  def states(ids_BxKxN, mask, glob):
    b, k, n = ids_BxKxN.shape
    ids = wd.resolve_markers(jnp.asarray(ids_BxKxN).reshape(b * k, n), model.config.vocab_size)
    return np.asarray(model.longformer(ids, jnp.asarray(mask).reshape(b * k, n),
                                       jnp.asarray(glob).reshape(b * k, n)).last_hidden_state)

  edited = batch["input_ids"].copy()
  edited[0, 1, p + 1] = 29 if edited[0, 1, p + 1] != 29 else 28
  before = states(batch["input_ids"], batch["attention_mask"], batch["global_attention_mask"])
  after = states(edited, batch["attention_mask"], batch["global_attention_mask"])
  np.testing.assert_array_equal(after[0], before[0])
  assert not np.array_equal(after[1], before[1])
  # The single row holds that token at the same place in the stream: its prefix sees it.
  row = whole.kind.batch(whole, [1], **kw)
  where = p + 1 + (len(e.input_ids[0]) - p - 2)
  assert row["input_ids"][0, 0, where] == batch["input_ids"][0, 1, p + 1]
  changed = row["input_ids"].copy()
  changed[0, 0, where] = edited[0, 1, p + 1]
  plain = states(row["input_ids"], row["attention_mask"], row["global_attention_mask"])
  moved = states(changed, row["attention_mask"], row["global_attention_mask"])
  assert not np.array_equal(plain[0, :p], moved[0, :p])


def test_segment_baseline_refuses_what_it_cannot_read(tmp_path):
  path = _write(tmp_path / "r.jsonl", _records(2))
  with pytest.raises(text.JsonlError, match="no room for the supports in segment_length=12 "
                                            r"\(raise segment_length or lower max_question"):
    _split(path, max_length=64, kind=_segments(12))
  with pytest.raises(ValueError, match="segment_overlap=4: --task wikihop reads"):
    _segments(32, segment_overlap=4)
  with pytest.raises(ValueError, match="segment_pool='mean' pools classification"):
    _segments(32, segment_pool="mean")
  assert KIND.configured(ft.FinetuneOptions()) is KIND


# ----------------------------------------------------------------------------------------------
# The marker tokens


def test_growing_the_vocabulary_keeps_old_outputs_bit_identical(tmp_path):
  """A run from a masked LM: fit_head grows the vocabulary by the four markers, kind_params
  loads the encoder and grows its table; rows of old ids give the source's states bit for bit,
  the old rows are the source's, and the new ones are new."""
  source_model = modeling.LongformerForMaskedLM(CONFIG, rngs=nnx.Rngs(1))
  checkpoint.save_model(tmp_path / "mlm", source_model)
  source = ft.load_source(str(tmp_path / "mlm"))
  cfg = ft.new_run_config(source, steps=1, batch_size=1, learning_rate=1e-3, max_length=24,
                          seed=0)
  split = _split(_write(tmp_path / "r.jsonl", _records(2)))
  cfg = ft.fit_head("wikihop", cfg, {"train": split}, source)
  assert cfg.model.vocab_size == CONFIG.vocab_size + 4
  grown = KIND.model_class(cfg.model, rngs=nnx.Rngs(5))
  with pytest.warns(UserWarning, match="newly initialised \\['candidate_scorer/kernel'\\]"):
    params = ft.kind_params(KIND, source, grown, seed=0)
  state = nnx.state(grown, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(grown, state)
  table = np.asarray(grown.longformer.embeddings.word_embeddings.embedding[...])
  old = np.asarray(source_model.longformer.embeddings.word_embeddings.embedding[...])
  np.testing.assert_array_equal(table[:CONFIG.vocab_size], old)
  assert not np.any(np.all(table[CONFIG.vocab_size:, None] == old[None], axis=-1))
  ids = jnp.asarray([[0, 7, 8, 9, 40, 2]])
  np.testing.assert_array_equal(
      np.asarray(grown.longformer(ids).last_hidden_state),
      np.asarray(source_model.longformer(ids).last_hidden_state))
  # A model of the kind already has the markers: nothing grows.
  checkpoint.save_model(tmp_path / "wikihop", grown)
  again = ft.load_source(str(tmp_path / "wikihop"))
  assert ft.fit_head("wikihop", cfg, {"train": split}, again).model.vocab_size == (
      cfg.model.vocab_size)
  # A model sized without the markers is refused.
  with pytest.raises(ValueError, match=r"adds the tokens \['\[q\]', '\[/q\]', '\[ent\]', "
                                       r"'\[/ent\]'\] to the vocabulary"):
    ft.kind_params(KIND, source, KIND.model_class(CONFIG, rngs=nnx.Rngs(0)))


# ----------------------------------------------------------------------------------------------
# A new order every epoch


def test_candidates_and_supports_are_laid_out_anew_every_epoch(tmp_path, monkeypatch):
  split = _split(_write(tmp_path / "r.jsonl", _records(3)), max_length=64)
  rows = [0, 1, 2]
  plain = KIND.batch(split, rows, global_attention="question", specials=SPECIALS)
  orders = {}
  for epoch in range(6):
    batch = KIND.batch(split, rows, global_attention="question", specials=SPECIALS,
                       epochs=[epoch] * 3, seed=7)
    again = KIND.batch(split, rows, global_attention="question", specials=SPECIALS,
                       epochs=[epoch] * 3, seed=7)
    assert all(np.array_equal(batch[k], again[k]) for k in batch)  # a pure function
    for row, e in enumerate(split.examples):
      ids = batch["input_ids"][row, 0]
      # The label points at the answer's candidate, wherever it went.
      answer = ids[batch["candidate_positions"][row, batch["labels"][row]] + 1]
      assert answer == e.candidates[e.label][0]
      # The same tokens, and the same prefix length (global attention) and chunk count.
      assert sorted(ids[ids != SPECIALS.pad]) == sorted(
          plain["input_ids"][row, 0][plain["input_ids"][row, 0] != SPECIALS.pad])
      assert batch["global_attention_mask"][row, 0].sum() == e.question_end
      orders.setdefault(row, set()).add(tuple(ids))
  assert all(len(seen) > 1 for seen in orders.values()), orders
  # The training batches know each row's epoch: 3 examples, batches of 2.
  seen = []
  batches = KIND.training_batches(
      split, rows, global_attention="question", specials=SPECIALS, global_batch_size=2, seed=7,
      process_index=0, process_count=1)
  monkeypatch.setattr(wikihop_task.WikiHop, "batch",
                      lambda self, s, r, **kw: seen.append((list(r), kw["epochs"])) or {})
  for _ in range(3):
    next(batches)
  order = [[int(i) for i in text.ExampleSampler(3, global_batch_size=2, seed=7).global_indices(
      step)] for step in range(3)]
  assert seen == list(zip(order, [[0, 0], [0, 1], [1, 1]]))


# ----------------------------------------------------------------------------------------------
# End to end through the command line


def test_wikihop_trains_saves_reloads_and_evaluates(tmp_path):
  """From a masked LM checkpoint (the vocabulary grows): train 2 steps, then --eval-only scores
  the saved run with the same accuracy and predictions; the saved model loads with the grown
  table."""
  checkpoint.save_model(tmp_path / "mlm",
                        modeling.LongformerForMaskedLM(CONFIG, rngs=nnx.Rngs(1)))
  train = _write(tmp_path / "train.json", _records(8), array=True)
  valid = _write(tmp_path / "valid.jsonl", _records(4, seed=1))
  workdir = tmp_path / "run"
  assert cli.main(["--task", "wikihop", "--model", str(tmp_path / "mlm"), "--train", train,
                   "--validation", valid, "--max-length", "24", "--batch-size", "2",
                   "--steps", "2", "--learning-rate", "1e-3", "--workdir", str(workdir),
                   "--no-progress"]) == 0
  results = json.loads((workdir / "results.json").read_text())
  assert set(results["validation"]) == {"accuracy", "examples", "truncation", "by_length"}
  # Every support is read and every query whole; the answer's id lies in one support.
  assert results["validation"]["truncation"] == {
      "max_length": 24, "examples": 4, "examples_truncated": 0.0, "document_tokens_kept": 1.0,
      "evidence_within_limit": 1.0}
  assert sum(b["examples"] for b in results["validation"]["by_length"].values()) == 4
  record = json.loads((workdir / "run_config.json").read_text())
  assert record["model"]["vocab_size"] == CONFIG.vocab_size + 4
  assert cli.main(["--task", "wikihop", "--eval-only", "--validation", valid, "--workdir",
                   str(workdir), "--no-progress"]) == 0
  evaluated = json.loads((workdir / "eval_results.json").read_text())
  assert evaluated["validation"] == results["validation"]
  assert ((workdir / "eval_predictions_validation.jsonl").read_text()
          == (workdir / "predictions_validation.jsonl").read_text())
  predictions = [json.loads(line) for line in
                 (workdir / "predictions_validation.jsonl").read_text().splitlines()]
  assert [p["id"] for p in predictions] == ["r0", "r1", "r2", "r3"]
  assert all(p["prediction"] == int(np.argmax(p["scores"])) and p["chunks"] >= 1
             and p["full_length"] > 0 and p["truncated"] is False for p in predictions)
  # The run reloads as a starting point with its grown table (no second growth).
  source = ft.load_source(str(workdir))
  assert source.model_class == "LongformerForWikiHop"
  assert source.params["longformer"]["embeddings"]["word_embeddings"]["embedding"].shape[0] == (
      CONFIG.vocab_size + 4)


def test_wikihop_segments_trains_saves_and_evaluates_the_same(tmp_path, capsys):
  """--baseline segments: rows of 20 tokens where the Longformer's are 32; the run records its
  settings, and --eval-only reads the checkpoint in the same segments, with the same results
  and predictions. A segment the prefix fills is refused in one line."""
  checkpoint.save_model(tmp_path / "mlm",
                        modeling.LongformerForMaskedLM(CONFIG, rngs=nnx.Rngs(1)))
  train = _write(tmp_path / "train.jsonl", _records(4))
  valid = _write(tmp_path / "valid.jsonl", _records(4, seed=1))
  workdir = tmp_path / "run"
  run = ["--task", "wikihop", "--model", str(tmp_path / "mlm"), "--train", train,
         "--validation", valid, "--max-length", "32", "--batch-size", "2", "--steps", "1",
         "--learning-rate", "1e-3", "--no-progress"]
  assert cli.main([*run, "--workdir", str(workdir), "--baseline", "segments",
                   "--segment-length", "20"]) == 0
  record = json.loads((workdir / "run_config.json").read_text())
  assert (record["data"]["baseline"], record["data"]["segment_length"]) == ("segments", 20)
  results = json.loads((workdir / "results.json").read_text())["validation"]
  assert results["truncation"]["examples_truncated"] == 0.0
  predictions = (workdir / "predictions_validation.jsonl").read_text()
  split = _split(valid, max_length=32, kind=_segments(20))
  assert [json.loads(line)["chunks"] for line in predictions.splitlines()] == [
      len(e.input_ids) for e in split.examples]
  rows = _split(valid, max_length=32)  # the Longformer's rows hold more of the supports
  assert sum(len(e.input_ids) for e in split.examples) > sum(len(e.input_ids)
                                                              for e in rows.examples)
  assert cli.main(["--task", "wikihop", "--eval-only", "--validation", valid, "--workdir",
                   str(workdir), "--no-progress"]) == 0
  evaluated = json.loads((workdir / "eval_results.json").read_text())
  assert evaluated["validation"] == results and evaluated["changed_settings"] == {}
  assert (workdir / "eval_predictions_validation.jsonl").read_text() == predictions
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    cli.main([*run, "--workdir", str(tmp_path / "short"), "--baseline", "segments",
              "--segment-length", "12"])
  err = capsys.readouterr().err.strip()
  assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
  assert err.startswith("train.finetune: error: ") and "segment_length=12" in err, err
