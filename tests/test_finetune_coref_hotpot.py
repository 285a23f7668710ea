"""`train.finetune --task coref` and `--task hotpotqa` (`tasks.coref_kind`, `tasks.hotpotqa_kind`):
end to end on generated data (train, save, final evaluation, --eval-only of the saved run), the
official metric names and prediction files, the settings a run records, the readers of both
coreference formats, and the word mapping of the scores under an oracle.

The runs use the `tiny` model with one layer and the dense reference attention (the same
numbers, a program that compiles faster) for two steps in this process: they test the pipeline,
not learning (docs/finetune.md measures that)."""

import dataclasses
import json

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from longformer_jax.config import LongformerConfig
from longformer_jax.data import coref as coref_data
from longformer_jax.data import coref_generate
from longformer_jax.data import hotpotqa as hq
from longformer_jax.data import hotpotqa_generate
from longformer_jax.data.tokenizer import SpecialIds
from longformer_jax.tasks import coref_kind, hotpotqa_kind
from longformer_jax.tasks import hotpotqa as hotpot_task
from longformer_jax.tasks import finetune as ft
from longformer_jax.commands import train_finetune as cli

pytestmark = pytest.mark.integration

_SMALL = ("--set", "model.num_hidden_layers=1", "--set", "model.attention_impl=reference",
          "--steps", "2", "--batch-size", "2", "--learning-rate", "1e-3", "--no-progress")
_COREF_HEAD = ("--set", "coref_ffnn_size=16", "--set", "coref_max_span_width=4", "--set",
               "coref_feature_size=4", "--set", "coref_max_antecedents=6", "--set",
               "coref_dropout=0", "--set", "coref_mention_weight=1.0")
SPECIALS = SpecialIds(bos=0, pad=1, eos=2, sep=2)


def _word_tokenizer(words, path, extra=(), pre=None):
  vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", *extra,
                                       *sorted(set(words))])}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre or pre_tokenizers.WhitespaceSplit()
  tokenizer.save(str(path))
  return str(path)


def _results(workdir, prefix=""):
  with open(workdir / f"{prefix}results.json") as f:
    return json.load(f)


# ----------------------------------------------------------------------------------------------
# Coreference


@pytest.fixture(scope="module")
def coref_files(tmp_path_factory):
  root = tmp_path_factory.mktemp("coref_kind")
  paths = coref_generate.write_corpus(root, {"train": 4, "dev": 2}, seed=3, segment_length=32,
                                      num_words=30, num_entities=2, max_mentions=3, min_gap=8)
  words = [w for split in paths.values() for d in coref_data.read_conll(split["conll"])
           for w in d.tokens]
  return {**paths, "tokenizer": _word_tokenizer(words, root / "tokenizer.json")}


def test_coref_trains_saves_and_evaluates_again(coref_files, tmp_path, capsys):
  files, workdir = coref_files, tmp_path / "run"
  common = ["--task", "coref", "--tokenizer", files["tokenizer"], "--test",
            files["dev"]["conll"], "--workdir", str(workdir)]
  assert cli.main([*common, "--model", "tiny", "--train", files["train"]["conll"],
                   "--validation", files["dev"]["jsonlines"], "--max-length", "64", *_SMALL,
                   *_COREF_HEAD]) == 0
  results = _results(workdir)
  names = {f"{m}_{x}" for m in ("muc", "b3", "ceafe") for x in ("p", "r", "f1")} | {"conll_f1"}
  for split in ("validation", "test"):
    assert names <= set(results[split]) and results[split]["examples"] == 2
    assert all(0.0 <= results[split][k] <= 1.0 for k in names)
    # What the limit cut: the common block and coreference's own keys, and metrics by length.
    block = results[split]["truncation"]
    assert set(block) == {"max_length", "examples", "examples_truncated", "document_tokens_kept",
                          "evidence_within_limit", "mentions_within_limit",
                          "links_within_limit"}
    assert block["max_length"] == 64 and block["examples"] == 2
    assert sum(b["examples"] for b in results[split]["by_length"].values()) == 2
  # The jsonlines and the CoNLL file hold the same documents: the same scores.
  assert results["validation"] == results["test"]
  with open(workdir / "predictions_test.jsonl") as f:
    records = [json.loads(line) for line in f]
  gold = [[[list(m) for m in c] for c in d.clusters]
          for d in coref_data.read_conll(files["dev"]["conll"])]
  assert [r["gold"] for r in records] == gold
  with open(workdir / "run_config.json") as f:
    data = json.load(f)["data"]
  assert data["coref_ffnn_size"] == 16 and data["coref_mention_weight"] == 1.0
  assert "coref_segment_length" not in data and "baseline" not in data
  # A run recorded when the segment reading was coref_segment_length is read as the segment
  # baseline it was (a record without checkpoints: nothing to check it against).
  legacy = tmp_path / "legacy"
  legacy.mkdir()
  with open(workdir / "run_config.json") as f:
    record = json.load(f)
  record["data"]["coref_segment_length"] = 32
  (legacy / "run_config.json").write_text(json.dumps(record))
  _, options, _ = ft.run_settings(legacy, "coref")
  assert (options.baseline, options.segment_length) == ("segments", 32)
  record["data"]["coref_segment_length"] = None
  (legacy / "run_config.json").write_text(json.dumps(record))
  assert ft.run_settings(legacy, "coref")[1].baseline == "longformer"
  capsys.readouterr()

  # --eval-only restores the head's settings from the run and scores the same numbers; the
  # scoring convention may change, the architecture may not.
  assert cli.main([*common, "--eval-only", "--no-progress"]) == 0
  assert _results(workdir, "eval_")["test"] == results["test"]
  assert cli.main([*common, "--eval-only", "--no-progress", "--set",
                   "coref_singletons=false"]) == 0
  assert _results(workdir, "eval_")["changed_settings"] == {"coref_singletons": False}
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    cli.main([*common, "--eval-only", "--no-progress", "--set", "coref_ffnn_size=32"])
  err = capsys.readouterr().err.strip()
  assert exit_info.value.code == 2 and "coref_ffnn_size: 16 -> 32" in err, err


def _chunk_tokenizer(documents, path):
  """Words cut into pieces of up to 3 characters: most words are several tokens."""
  pre = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                 pre_tokenizers.Split(Regex(r"\S{1,3}"), "isolated")])
  pieces = [p for d in documents for w in d.tokens for p, _ in pre.pre_tokenize_str(w)]
  return _word_tokenizer(pieces, path, pre=pre)


def test_coref_oracle_links_score_one_through_the_word_mapping(coref_files, tmp_path):
  """The gold clusters as the model's links (each mention to the previous one of its cluster,
  spans in the row's tokens) decode to the gold words: every metric 1. Jsonlines regrouped into
  words equals the CoNLL reading."""
  from tokenizers import Tokenizer as T
  documents = coref_data.read_conll(coref_files["dev"]["conll"])
  tokenizer = T.from_file(_chunk_tokenizer(documents, tmp_path / "chunks.json"))
  options = ft.FinetuneOptions()
  kind = ft.get_kind("coref")
  read = lambda path: kind.read_split(path, tokenizer, max_length=512, specials=SPECIALS,
                                      vocab_size=tokenizer.get_vocab_size(), options=options)
  split = read(coref_files["dev"]["conll"])
  other = read(coref_files["dev"]["jsonlines"])
  for a, b in zip(split.examples, other.examples):
    assert np.array_equal(a.input_ids, b.input_ids) and a.gold_words == b.gold_words
  assert any(len(e.input_ids) > len(d.tokens) + 2 for e, d in zip(split.examples, documents))
  m = 16
  outputs = {name: np.zeros((len(split), m), np.int32) for name in ("starts", "ends")}
  outputs["links"] = np.full((len(split), m), -1, np.int32)
  outputs["span_mask"] = np.zeros((len(split), m), bool)
  for row, e in enumerate(split.examples):
    spans = sorted((s, c) for c, cluster in enumerate(e.gold_row) for s in cluster)
    last = {}
    for i, ((s, t), c) in enumerate(spans):
      outputs["starts"][row, i], outputs["ends"][row, i] = s, t
      outputs["span_mask"][row, i] = True
      outputs["links"][row, i] = last.get(c, -1)
      last[c] = i
  metrics, records = kind.score(split, split.examples, split.ids, outputs)
  assert metrics["conll_f1"] == 1.0 and metrics["muc_r"] == 1.0
  assert [r["clusters"] for r in records] == [r["gold"] for r in records]
  # The trivial predictor: no link (MUC 0), every mention right alone (B-cubed precision 1).
  trivial = coref_kind.trivial_scores(coref_files["dev"]["conll"])
  assert trivial["muc"]["f1"] == 0.0 and trivial["b3"]["p"] == 1.0 and trivial["b3"]["r"] < 1


def test_coref_settings_are_checked(coref_files):
  with pytest.raises(ValueError, match="coref_top_span_ratio must be"):
    ft.FinetuneOptions(coref_top_span_ratio=0.0)
  with pytest.raises(ValueError, match="hotpot_sp_threshold must be in"):
    ft.FinetuneOptions(hotpot_sp_threshold=1.5)
  kind = ft.get_kind("coref")
  # The segment settings coreference cannot read, named.
  for changes, message in (({"segment_length": 24}, "segment_length=24 must divide max_length=64"),
                           ({"segment_length": 32, "segment_overlap": 8},
                            "segment_overlap=8: --task coref reads segments that share no"),
                           ({"segment_length": 32, "segment_pool": "mean"},
                            "segment_pool='mean' pools classification segments")):
    with pytest.raises(ValueError, match=message):
      kind.read_split(coref_files["dev"]["conll"], None, max_length=64, specials=SPECIALS,
                      vocab_size=512, options=ft.FinetuneOptions(baseline="segments", **changes))
  # A split's kind carries the run's settings; kinds with equal settings are equal (the
  # evaluation's compiled function is cached by kind).
  tokenizer = Tokenizer.from_file(coref_files["tokenizer"])
  read = lambda **changes: kind.read_split(
      coref_files["dev"]["conll"], tokenizer, max_length=64, specials=SPECIALS, vocab_size=512,
      options=ft.FinetuneOptions(**changes))
  segmented = read(baseline="segments", segment_length=32, coref_mention_weight=0.5).kind
  assert segmented.run_settings == coref_kind.CorefSettings(mention_weight=0.5, segment_length=32)
  # segment_length alone (the Longformer's baseline) reads whole rows.
  assert read(segment_length=32).kind.run_settings.segment_length is None
  assert read().kind == kind and hash(read().kind) == hash(kind) and segmented != kind


# ----------------------------------------------------------------------------------------------
# HotpotQA


@pytest.fixture(scope="module")
def hotpot_files(tmp_path_factory):
  root = tmp_path_factory.mktemp("hotpot_kind")
  out = {}
  for split, n, seed in (("train", 4, 0), ("dev", 3, 1)):
    out[split] = str(root / f"{split}.json")
    hotpotqa_generate.write_hotpotqa(out[split], hotpotqa_generate.generate_records(
        n, seed=seed, num_paragraphs=3, sentences=(2, 2)))
  pre = pre_tokenizers.Whitespace()
  words = [w for split in ("train", "dev") for r in hq.read_hotpotqa(out[split])
           for t in (r.question, *(x for title, s in r.context for x in (title, *s)))
           for w, _ in pre.pre_tokenize_str(t)]
  out["tokenizer"] = _word_tokenizer(words, root / "tokenizer.json", hq.MARKER_TOKENS, pre)
  return out


def test_hotpotqa_trains_both_stages_and_evaluates_two_stage(hotpot_files, tmp_path, capsys):
  files, workdir = hotpot_files, tmp_path / "run"
  common = ["--task", "hotpotqa", "--tokenizer", files["tokenizer"], "--test", files["dev"],
            "--workdir", str(workdir)]
  assert cli.main([*common, "--model", "tiny", "--train", files["train"], "--validation",
                   files["dev"], "--max-length", "128", "--set", "hotpot_stage2_length=96",
                   *_SMALL]) == 0
  results = _results(workdir)
  names = {"em", "f1", "sp_em", "sp_f1", "joint_em", "joint_f1", "paragraph_recall"}
  assert names <= set(results["test"]) and results["test"]["examples"] == 3
  block = results["test"]["truncation"]
  assert block["max_length"] == 128 and block["examples"] == 3
  assert 0.0 <= block["evidence_within_limit"] <= 1.0
  assert sum(b["examples"] for b in results["test"]["by_length"].values()) == 3
  with open(workdir / "predictions_test.json") as f:
    official = json.load(f)
  ids = [r.id for r in hq.read_hotpotqa(files["dev"])]
  assert set(official) == {"answer", "sp"} and sorted(official["answer"]) == sorted(ids)
  with open(workdir / "predictions_test.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert all(len(r["paragraphs"]) == 2 for r in records)  # hotpot_top_k's default
  # The official file scores to results.json's numbers.
  from longformer_jax.tasks import hotpot_scores
  golds = [r.as_json() for r in hq.read_hotpotqa(files["dev"])]
  again = hotpot_scores(predictions=official, golds=golds)
  assert all(again[k] == pytest.approx(results["test"][k]) for k in again)
  capsys.readouterr()

  # --eval-only: the same numbers; k and the evidence threshold may change.
  assert cli.main([*common, "--eval-only", "--no-progress"]) == 0
  assert _results(workdir, "eval_")["test"] == results["test"]
  assert cli.main([*common, "--eval-only", "--no-progress", "--set", "hotpot_top_k=1",
                   "--set", "hotpot_sp_threshold=0.0"]) == 0
  changed = _results(workdir, "eval_")
  assert changed["changed_settings"] == {"hotpot_sp_threshold": 0.0, "hotpot_top_k": 1}
  with open(workdir / "eval_predictions_test.jsonl") as f:
    records = [json.loads(line) for line in f]
  # One paragraph read, every one of its sentences above threshold 0: all in the evidence.
  assert all(len(r["paragraphs"]) == 1 for r in records)
  context = {r.id: dict(r.context) for r in hq.read_hotpotqa(files["dev"])}
  assert all(len(r["sp"]) == len(context[r["id"]][r["paragraphs"][0]]) for r in records)


def test_hotpotqa_segment_baseline_trains_saves_and_evaluates_again(hotpot_files, tmp_path,
                                                                     capsys, monkeypatch):
  """--baseline segments: both stages read in segments of 48 tokens (rows of 128 and 96), the
  run records it, and --eval-only reads the same way (the same numbers)."""
  files, workdir = hotpot_files, tmp_path / "run"
  read = []  # the row shapes the segment reading traced: both stages, training and evaluation
  segment_outputs = hotpot_task.segment_outputs

  def counted(model, inputs, reading, **kwargs):
    read.append((inputs["input_ids"].shape[1], reading.segment_length))
    return segment_outputs(model, inputs, reading, **kwargs)

  monkeypatch.setattr(hotpot_task, "segment_outputs", counted)
  common = ["--task", "hotpotqa", "--tokenizer", files["tokenizer"], "--test", files["dev"],
            "--workdir", str(workdir)]
  assert cli.main([*common, "--model", "tiny", "--train", files["train"], "--max-length", "128",
                   "--set", "hotpot_stage2_length=96", "--set", "max_question_length=16",
                   "--baseline", "segments", "--segment-length", "48", *_SMALL]) == 0
  assert {(128, 48), (96, 48)} <= set(read)
  results = _results(workdir)
  names = {"em", "f1", "prec", "recall", "sp_em", "sp_f1", "sp_prec", "sp_recall", "joint_em",
           "joint_f1", "joint_prec", "joint_recall", "paragraph_recall"}
  assert names <= set(results["test"]) and results["test"]["examples"] == 3
  with open(workdir / "run_config.json") as f:
    data = json.load(f)["data"]
  assert (data["baseline"], data["segment_length"]) == ("segments", 48)
  with open(workdir / "predictions_test.json") as f:
    assert set(json.load(f)) == {"answer", "sp"}
  capsys.readouterr()
  assert cli.main([*common, "--eval-only", "--no-progress"]) == 0
  assert _results(workdir, "eval_")["test"] == results["test"]
  # The kind of an evaluation reads in segments: its settings carry the reading.
  tokenizer = Tokenizer.from_file(files["tokenizer"])
  options = ft.FinetuneOptions(baseline="segments", segment_length=48, max_question_length=16)
  split = ft.get_kind("hotpotqa").read_split(
      files["dev"], tokenizer, max_length=128, specials=SPECIALS, vocab_size=512,
      options=options)
  assert split.kind.run_settings.segments == hotpot_task.HotpotSegments(
      segment_length=48, prefix_width=18, global_mode="question")
  # Settings a segment reading of HotpotQA cannot have are refused on reading the files.
  for change, message in ((dict(segment_length=16), r"segment_length=16 leaves -4 document "
                                                    r"tokens"),
                          (dict(segment_pool="mean"), r"segment_pool='mean'")):
    with pytest.raises(ValueError, match=message):
      ft.get_kind("hotpotqa").read_split(
          files["dev"], tokenizer, max_length=128, specials=SPECIALS, vocab_size=512,
          options=dataclasses.replace(options, **change))


def test_hotpotqa_needs_the_markers(hotpot_files, tmp_path):
  words = ["who", "was"]
  tokenizer = Tokenizer.from_file(_word_tokenizer(words, tmp_path / "plain.json"))
  with pytest.raises(ValueError, match=r"needs the markers \['\[q\]'"):
    ft.get_kind("hotpotqa").read_split(
        hotpot_files["dev"], tokenizer, max_length=64, specials=SPECIALS, vocab_size=512,
        options=ft.FinetuneOptions())


def test_trivial_hotpot_predictor(hotpot_files):
  """The most frequent training answer for every question, no evidence."""
  import collections
  train = [r.answer for r in hq.read_hotpotqa(hotpot_files["train"])]
  answer = collections.Counter(train).most_common(1)[0][0]
  dev = [r.answer for r in hq.read_hotpotqa(hotpot_files["dev"])]
  scores = hotpotqa_kind.trivial_scores(hotpot_files["train"], hotpot_files["dev"])
  assert scores["em"] == pytest.approx(np.mean([a == answer for a in dev]))
  assert scores["sp_f1"] == 0.0 and scores["joint_f1"] == 0.0


def test_coref_segment_baseline_reads_rows_in_segments(coref_files):
  """--baseline segments --segment-length 32: the encoder reads each row as independent segments
  (with global attention on <s> too): a finite loss, not the whole row's, and the run records
  the baseline's settings."""
  from flax import nnx
  tokenizer = Tokenizer.from_file(coref_files["tokenizer"])
  config = LongformerConfig.tiny(num_hidden_layers=1, attention_impl="reference")
  losses = []
  for baseline in ("longformer", "segments"):
    options = ft.FinetuneOptions(baseline=baseline, segment_length=32, coref_ffnn_size=16,
                                 coref_max_span_width=4, coref_feature_size=4,
                                 coref_max_antecedents=6, coref_dropout=0.0)
    split = ft.get_kind("coref").read_split(
        coref_files["dev"]["conll"], tokenizer, max_length=64, specials=SPECIALS,
        vocab_size=config.vocab_size, options=options)
    task = ft.FinetuneTask("coref", split, global_attention="first", options=options)
    # Coreference reads its segments itself: the task's reading is its kind.
    assert task.reading is task.kind == split.kind
    assert task.kind.run_settings.segment_length == (32 if baseline == "segments" else None)
    identity = task.data_identity(None)
    assert "coref_segment_length" not in identity
    assert identity.get("segment_length") == (32 if baseline == "segments" else None)
    model = task.build_model(config, nnx.Rngs(0))
    batch = task.reading.batch(split, [0, 1], global_attention="first", specials=SPECIALS)
    losses.append(float(task.reading.loss(model, batch, 1)))
  assert all(np.isfinite(losses)) and losses[0] != losses[1], losses
