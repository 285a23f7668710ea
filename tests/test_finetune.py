"""`python -m train.finetune` (classification, QA, tagging, multiple choice): end to end on tiny
data written here, resume, evaluation from parameters only, file:line:field errors, the metrics
and span decoding against brute force, and a long-range task that only global attention solves.

Every run uses the `tiny` preset and trains a few steps in this process (`train.finetune.main`);
a compilation cache private to this module makes the runs that repeat a program read it back.
"""

import json
import os
import re
import random

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers

from longformer_jax import checkpoint
from longformer_jax.config import LongformerConfig
from longformer_jax.data import finetune_data as fd
from longformer_jax.data.tokenizer import SpecialIds, load_tokenizer
from longformer_jax.tasks import finetune as ft
from longformer_jax.tasks import truncation
from longformer_jax.commands import train_finetune as cli
from testing import file_snapshot, truncate_checkpoint

pytestmark = pytest.mark.integration


# ----------------------------------------------------------------------------------------------
# Data written by the tests


def _write_jsonl(path, records):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  """A word-level tokenizer.json (<s>=0, <pad>=1, </s>=2, as the tiny preset's ids) and
  train/valid JSONL files of each task with text records (multiple choice: id records)."""
  root = tmp_path_factory.mktemp("finetune_data")
  words = ([f"w{i}" for i in range(60)] + ["good", "bad", "which", "number", "?"]
           + [f"n{i}" for i in range(10)] + [f"Name{i}" for i in range(5)])
  vocab = {token: i for i, token in enumerate(["<s>", "<pad>", "</s>", "<unk>"] + words)}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  tokenizer.save(str(root / "tokenizer.json"))
  rng = random.Random(0)
  filler = lambda n: [f"w{rng.randrange(60)}" for _ in range(n)]
  out = {"tokenizer": str(root / "tokenizer.json"), "root": root}
  for split, n in (("train", 16), ("valid", 6)):
    cls, tag, qa, mc = [], [], [], []
    for _ in range(n):
      label = rng.randrange(2)
      ws = filler(12)
      ws.insert(rng.randrange(12), ["bad", "good"][label])
      cls.append({"text": " ".join(ws), "label": label})
      ws, tags = filler(10), ["O"] * 10
      for k in rng.sample(range(10), 2):
        ws[k], tags[k] = f"Name{rng.randrange(5)}", "B-PER"
      tag.append({"text": " ".join(ws), "labels": tags})
      ws, k, answer = filler(20), rng.randrange(20), f"n{rng.randrange(10)}"
      ws[k] = answer
      qa.append({"question": "which number ?", "context": " ".join(ws),
                 "answers": [{"text": answer, "answer_start": sum(len(w) + 1 for w in ws[:k])}]})
      candidates = [[40 + c] for c in range(rng.choice((2, 3)))]  # 2 or 3 candidates
      label = rng.randrange(len(candidates))
      document = [rng.randrange(10, 30) for _ in range(15)]
      document.insert(rng.randrange(15), candidates[label][0])
      mc.append({"question": [5, 6], "candidates": candidates, "input_ids": document,
                 "label": label})
    for name, records in (("classification", cls), ("token", tag), ("qa", qa),
                          ("multiple_choice", mc)):
      out[name, split] = _write_jsonl(root / f"{name}_{split}.jsonl", records)
  return out


# The end-to-end runs test the pipeline, not the model: one layer, the plain dense reference
# attention (the same numbers as the band op, and a program that compiles faster), and a constant
# learning rate, so that a run extended from 2 to 4 steps compiles the same training step. The
# long-range test trains the tiny preset as it is.
_ONE_LAYER = ("--set", "model.num_hidden_layers=1", "--set", "model.attention_impl=reference")
_SMALL = (*_ONE_LAYER, "--set", "stages.0.end_learning_rate=none", "--set",
          "stages.0.decay_power=none")


def _command(data, task, workdir, *extra, small=_SMALL):
  return ["--task", task, "--model", "tiny", "--tokenizer", data["tokenizer"],
          "--train", data[task, "train"], "--validation", data[task, "valid"],
          "--test", data[task, "valid"], "--max-length", "48", "--batch-size", "4",
          "--learning-rate", "1e-3", "--workdir", str(workdir), "--no-progress", *small, *extra]


def _read_results(workdir, prefix=""):
  """results.json and the predictions (prefix "eval_": the files of --eval-only)."""
  with open(workdir / f"{prefix}results.json") as f:
    results = json.load(f)
  predictions = {}
  for split in ("validation", "test"):
    with open(workdir / f"{prefix}predictions_{split}.jsonl") as f:
      predictions[split] = [json.loads(line) for line in f]
  return results, predictions


def _refused(capsys, argv, *message):
  """`argv` exits with status 2 and one `train.finetune: error:` line holding `message`."""
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  err = capsys.readouterr().err.strip()
  assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
  assert err.startswith("train.finetune: error: ") and all(m in err for m in message), err


def _learning_rates(workdir):
  with open(workdir / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  return {r["step"]: r["learning_rate"] for r in records if "learning_rate" in r}


# ----------------------------------------------------------------------------------------------
# End to end


def test_classification_trains_resumes_and_evaluates_from_parameters(data, tmp_path, capsys):
  workdir = tmp_path / "run"
  assert cli.main(_command(data, "classification", workdir, "--steps", "2")) == 0
  # The same command with more steps resumes from the saved step 2.
  assert cli.main(_command(data, "classification", workdir, "--steps", "4")) == 0
  assert "resumed from step 2" in capsys.readouterr().out
  results, predictions = _read_results(workdir)
  assert results["steps"] == 4 and results["checkpoint_step"] == 4
  assert results["global_attention"] == "first"
  for split in ("validation", "test"):
    assert set(results[split]) == {"accuracy", "f1", "examples", "truncation", "by_length"}
    assert results[split]["examples"] == 6 and 0 <= results[split]["accuracy"] <= 1
    assert results[split]["truncation"]["evidence_within_limit"] is None  # classification
    assert [set(p) for p in predictions[split]] == [
        {"id", "prediction", "label", "full_length", "truncated"}] * 6
    accuracy = np.mean([p["prediction"] == p["label"] for p in predictions[split]])
    assert results[split]["accuracy"] == pytest.approx(accuracy)

  # Evaluation from the parameters alone, with the run's settings, its length and the copy of
  # its tokenizer it keeps, reproduces the results, in files of its own: the training run's
  # stay as they are.
  kept = {name: (workdir / name).read_bytes() for name in os.listdir(workdir)
          if name.endswith((".json", ".jsonl"))}
  assert (workdir / "tokenizer.json").read_bytes() == open(data["tokenizer"], "rb").read()
  eval_only = ["--task", "classification", "--eval-only", "--workdir", str(workdir),
               "--validation", data["classification", "valid"], "--test",
               data["classification", "valid"], "--no-progress"]
  assert cli.main(eval_only) == 0
  again, again_predictions = _read_results(workdir, "eval_")
  assert again["checkpoint_step"] == 4 and again["eval_only"]
  assert again["validation"] == results["validation"] and again["test"] == results["test"]
  assert again_predictions == predictions
  assert {name: (workdir / name).read_bytes() for name in kept} == kept
  assert again["changed_settings"] == {}
  # Settings that change only how the checkpoint is evaluated are taken and recorded.
  assert cli.main([*eval_only, "--set", "global_attention=none", "--set",
                   "eval_batch_size=2"]) == 0
  assert _read_results(workdir, "eval_")[0]["changed_settings"] == {
      "eval_batch_size": 2, "global_attention": "none"}

  # What differs from the run is refused in one line before anything is evaluated or written:
  # another tokenizer, given or in the workdir, another length, an output that cannot be
  # written, an edited run_config.json (a window of 2 scores other numbers).
  other_tokenizer = tmp_path / "other_tokenizer.json"
  other_tokenizer.write_text(open(data["tokenizer"]).read().replace('"w0"', '"w00"'))
  os.remove(workdir / "eval_results.json")
  _refused(capsys, [*eval_only, "--tokenizer", str(other_tokenizer)],
           f"the tokenizer {other_tokenizer} has sha256 ", "the run recorded ",
           "not the one the run in")
  _refused(capsys, [*eval_only, "--max-length", "32"],
           "max_length=32 is not the run's 48 (its stages.0.seq_len)")
  # A --set that changes the model or how the data is read scored the checkpoint with another
  # model (exit 0, nothing recorded): refused, naming it.
  _refused(capsys, [*eval_only, "--set", "model.layer_norm_eps=10.0"],
           "--eval-only scores the run's own model", "model.layer_norm_eps: 1e-05 -> 10.0")
  _refused(capsys, [*eval_only, "--set", "max_question_length=5"],
           "max_question_length: 128 -> 5")
  _refused(capsys, [*eval_only, "--set", "model.num_labels=3"], "model.num_labels: 2 -> 3")
  os.replace(workdir / "tokenizer.json", tmp_path / "kept.json")
  (workdir / "tokenizer.json").write_bytes(other_tokenizer.read_bytes())
  _refused(capsys, eval_only, f"the tokenizer {workdir / 'tokenizer.json'} has sha256 ")
  os.replace(tmp_path / "kept.json", workdir / "tokenizer.json")
  (workdir / "eval_results.json").mkdir()
  _refused(capsys, eval_only, f"cannot write the output {workdir / 'eval_results.json'}: it "
                              "is a directory")
  (workdir / "eval_results.json").rmdir()
  record = json.loads((workdir / "run_config.json").read_text())
  record["model"]["attention_window"] = 2
  (workdir / "run_config.json").write_text(json.dumps(record))
  _refused(capsys, eval_only, f"{workdir / 'run_config.json'} is not the run's record: "
           "model.attention_window is 2 there, 32 in the run's record (sealed into "
           "checkpoint step 4)")
  # A resume is refused the same way, before anything is read or written.
  _refused(capsys, _command(data, "classification", workdir, "--steps", "6"),
           "model.attention_window is 2 there")
  assert not (workdir / "eval_results.json").exists()
  assert {name: (workdir / name).read_bytes() for name in kept} == {
      **kept, "run_config.json": (workdir / "run_config.json").read_bytes()}
  (workdir / "run_config.json").write_bytes(kept["run_config.json"])  # the run's record again

  # The run's classes are its training labels (0 and 1): a file with another is refused.
  other_label = _write_jsonl(tmp_path / "other_label.jsonl", [{"text": "w1 good", "label": 2}])
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--task", "classification", "--eval-only", "--workdir", str(workdir),
              "--tokenizer", data["tokenizer"], "--test", other_label, "--no-progress"])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and err.count("\n") == 1, err
  assert f"{other_label}:1: field 'label' is 2, not one of the model's num_labels=2" in err

  # A damaged newest checkpoint: the rerun moves it aside as it is, resumes from step 2, saves
  # step 4 again (it verifies) and scores it: the results of the undamaged run.
  truncate_checkpoint(workdir / "checkpoints" / "4" / "params")
  damaged = file_snapshot(workdir / "checkpoints" / "4")
  capsys.readouterr()
  assert cli.main(_command(data, "classification", workdir, "--steps", "4")) == 0
  out, err = capsys.readouterr()
  aside = workdir / "checkpoints.damaged" / "step-4"
  assert err.splitlines()[-1] == (
      f"warning: moved the damaged checkpoint step 4 out of {workdir / 'checkpoints'} to "
      f"{aside}, as it was (this run saves that step again)")
  assert "resumed from step 2" in out and "evaluated checkpoint step 4\n" in out
  assert file_snapshot(aside) == damaged
  assert checkpoint.checkpoint_steps(workdir)[-1] == 4 and checkpoint.read_meta(workdir, 4)
  retrained, retrained_predictions = _read_results(workdir)
  assert retrained["checkpoint_step"] == 4
  assert retrained["validation"] == results["validation"] and retrained["test"] == results["test"]
  assert retrained_predictions == predictions

  # The workdir as --model of another run: its encoder and its head (same task and size) load.
  other = tmp_path / "from_model"
  assert cli.main(_command(data, "classification", other, "--eval-only", "--model",
                           str(workdir))) == 0
  loaded, loaded_predictions = _read_results(other, "eval_")
  assert loaded["model"] == str(workdir) and loaded["test"] == results["test"]
  assert loaded_predictions == predictions


def test_more_steps_extend_a_finished_run_on_its_own_schedule(data, tmp_path, capsys):
  # The default schedule: warm-up over the first 10% of --steps, linear decay to 0.
  workdir = tmp_path / "run"
  command = lambda steps: _command(data, "classification", workdir, "--steps", str(steps),
                                   "--skip-final-eval", small=_ONE_LAYER)
  assert cli.main(command(10)) == 0
  first = _learning_rates(workdir)
  assert first[1] == 0 and first[2] == pytest.approx(1e-3) and first[10] > 0  # warm-up: 1 step
  # Twice the steps: the warm-up (1 step, not 2) and the rates of the steps taken stay, and the
  # decay goes on from the last of them to 0 over the 11 steps from it (no jump back up).
  assert cli.main(command(20)) == 0
  out = capsys.readouterr().out
  assert "resumed from step 10" in out and "stages.0.steps: 10 -> 20" in out
  rates = _learning_rates(workdir)
  assert {s: rates[s] for s in first} == first
  for step in range(11, 21):
    assert rates[step] == pytest.approx(first[10] * (1 - (step - 10) / 11), rel=1e-5), step


@pytest.mark.parametrize("task", ["qa", "token", "multiple_choice"])
def test_task_end_to_end(data, tmp_path, task):
  workdir = tmp_path / task
  assert cli.main(_command(data, task, workdir, "--steps", "2", "--set",
                           "length_buckets=[20]")) == 0
  results, predictions = _read_results(workdir)
  metrics = {"qa": {"exact_match", "f1"}, "token": {"accuracy", "precision", "recall", "f1"},
             "multiple_choice": {"accuracy"}}[task]
  with open(data[task, "valid"]) as f:
    records = [json.loads(line) for line in f]
  for split in ("validation", "test"):
    assert set(results[split]) == metrics | {"examples", "truncation", "by_length"}
    assert all(0 <= results[split][k] <= 1 for k in metrics)
    assert len(predictions[split]) == len(records)
    # Every record fits the rows of 48 tokens: nothing was cut, every answer, candidate and word
    # lies inside what was kept.
    assert results[split]["truncation"] == {
        "max_length": 48, "examples": len(records), "examples_truncated": 0.0,
        "document_tokens_kept": 1.0, "evidence_within_limit": 1.0}
    by_length = results[split]["by_length"]
    assert set(by_length) == {"<=20", ">20"}
    assert sum(b["examples"] for b in by_length.values()) == len(records)
    # Bucket means recombine to the split's (tagging's metrics are over words, not examples).
    mean_metrics = {"qa": ("exact_match", "f1"), "multiple_choice": ("accuracy",)}.get(task, ())
    for name in mean_metrics:
      assert truncation.recombine(by_length, name) == pytest.approx(results[split][name],
                                                                     rel=1e-12)
    full = [p["full_length"] for p in predictions[split]]
    assert by_length["<=20"]["examples"] == sum(n <= 20 for n in full)
    assert not any(p["truncated"] for p in predictions[split])
  for p, r in zip(predictions["test"], records):
    if task == "qa":  # a span of the context, at most max_answer_length tokens
      assert p["prediction"] in r["context"] and 0 <= p["end"] - p["start"] < 30
      assert p["answers"] == [a["text"] for a in r["answers"]]
    elif task == "token":  # a tag per word
      assert len(p["prediction"]) == len(r["text"].split()) == len(p["labels"])
      assert set(p["prediction"]) <= {"O", "B-PER"} and p["labels"] == r["labels"]
    else:  # a score per candidate (2 or 3: the rows are padded to 3)
      assert len(p["scores"]) == len(r["candidates"]) and p["label"] == r["label"]
      assert p["prediction"] == int(np.argmax(p["scores"]))


def test_segment_baseline_trains_saves_and_evaluates_only(data, tmp_path, capsys):
  """A run of the segment baseline (QA: contexts of 20 tokens in segments of 16, a 3-token
  question: 3 segments each) records its settings: --eval-only reads the checkpoint the same
  way and reproduces its results; reading it otherwise is refused."""
  workdir = tmp_path / "segments"
  segments = ("--set", "baseline=segments", "--set", "segment_length=16")
  assert cli.main(_command(data, "qa", workdir, "--steps", "2", *segments)) == 0
  results, predictions = _read_results(workdir)
  record = json.loads((workdir / "run_config.json").read_text())
  assert {k: record["data"][k] for k in ("baseline", "segment_length", "segment_overlap",
                                         "segment_pool")} == {
      "baseline": "segments", "segment_length": 16, "segment_overlap": 0,
      "segment_pool": "first"}
  for split in ("validation", "test"):
    # The segments read what the row of 48 tokens keeps: every context whole.
    assert results[split]["truncation"]["document_tokens_kept"] == 1.0
    assert results[split]["truncation"]["evidence_within_limit"] == 1.0
  with open(data["qa", "valid"]) as f:
    contexts = [json.loads(line)["context"] for line in f]
  assert all(p["prediction"] in c for p, c in zip(predictions["test"], contexts))
  eval_only = ["--task", "qa", "--eval-only", "--workdir", str(workdir), "--validation",
               data["qa", "valid"], "--test", data["qa", "valid"], "--no-progress"]
  assert cli.main(eval_only) == 0
  again, again_predictions = _read_results(workdir, "eval_")
  assert again["validation"] == results["validation"] and again["test"] == results["test"]
  assert again_predictions == predictions and again["changed_settings"] == {}
  _refused(capsys, [*eval_only, "--set", "baseline=longformer"],
           "baseline: 'segments' -> 'longformer'")
  _refused(capsys, [*eval_only, "--set", "segment_length=32"], "segment_length: 16 -> 32")
  # Segments too short for the question are refused before anything runs.
  _refused(capsys, _command(data, "qa", tmp_path / "short", "--steps", "1", "--set",
                            "baseline=segments", "--set", "segment_length=7"),
           "segment_length=7 leaves 0 document tokens per segment")


_TEXT, _IDS = {"text": "w1 w2", "label": 0}, {"input_ids": [4, 5], "label": 0}


@pytest.mark.parametrize("first, line, field, problem", [
    (_TEXT, {"text": "w1 w2"}, "label", "is missing"),
    (_TEXT, {"text": "w1 w2", "label": "1"}, "label", "must be an integer"),
    (_TEXT, {"text": "w1", "input_ids": [4], "label": 0}, "text", "exactly one of"),
    (_TEXT, _IDS, "input_ids", "is an input_ids record but line 1 is a text record"),
    (_IDS, {"input_ids": [4, 999], "label": 0}, "input_ids",
     "element 1 must be a token id in [0, 512)"),
    (_TEXT, {"text": "w1 w2", "label": -1}, "label", "must be >= 0"),
    (_TEXT, "{not json", None, "is not JSON"),
])
def test_bad_jsonl_names_file_line_and_field(data, tmp_path, capsys, first, line, field,
                                             problem):
  path = str(tmp_path / "bad.jsonl")
  with open(path, "w") as f:
    f.write(json.dumps(first) + "\n")
    f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
  command = _command(data, "classification", tmp_path / "run", "--steps", "1")
  command[command.index("--train") + 1] = path
  with pytest.raises(SystemExit) as exit_info:
    cli.main(command)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  where = f"{path}:2:" + ("" if field is None else f" field {field!r}")
  assert where in err and problem in err and len(err.splitlines()) == 1, err
  assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("task, record, field, problem", [
    ("qa", {"question": "which ?", "context": "w1 n2 w3",
            "answers": [{"text": "n2", "answer_start": 0}]}, "answers", "reads 'w1'"),
    ("token", {"text": "w1 w2 w3", "labels": ["O", "O"]}, "labels", "has 2 labels for 3 words"),
    ("multiple_choice", {"question": [5], "candidates": [[40], [41]], "input_ids": [7],
                         "label": 2}, "label", "must be >= 0 and < 2"),
])
def test_task_fields_are_checked(data, tmp_path, capsys, task, record, field, problem):
  path = _write_jsonl(tmp_path / "bad.jsonl", [record])
  command = _command(data, task, tmp_path / "run", "--steps", "1")
  command[command.index("--train") + 1] = path
  with pytest.raises(SystemExit) as exit_info:
    cli.main(command)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert f"{path}:1: field {field!r}" in err and problem in err, err


# ----------------------------------------------------------------------------------------------
# Long range: the label is only visible through global attention


def _far_label_records(n, seed, *, length=126, far=80, copies=16):
  """Random ids (10..499) with the label's token (500 + label) at `copies` random positions
  >= `far` (row positions >= far + 1 after <s>): beyond the 2 x 32 = 64 positions that <s>
  reaches through the tiny preset's two local windows."""
  rng = np.random.default_rng(seed)
  records = []
  for _ in range(n):
    ids = rng.integers(10, 500, size=length)
    label = int(rng.integers(2))
    ids[rng.choice(np.arange(far, length), copies, replace=False)] = 500 + label
    records.append({"input_ids": ids.tolist(), "label": label})
  return records


def test_far_token_reaches_s_only_through_global_attention():
  """Exact, untrained: <s>'s logits change with a token at position 100 when <s> is global, and
  not at all (bit for bit) when no token is (2 layers x window 32 = 64 positions of reach)."""
  model = ft.MODEL_CLASSES["classification"](LongformerConfig.tiny(), rngs=nnx.Rngs(0))
  model.eval()
  ids_2xN = np.random.default_rng(0).integers(10, 500, size=(2, 128)).astype(np.int32)
  ids_2xN[:, 0] = 0
  ids_2xN[1] = ids_2xN[0]
  ids_2xN[1, 100] = 7  # row 1: row 0 with one far token changed
  for global_length, differs in ((1, True), (0, False)):
    batch = {"input_ids": ids_2xN, "attention_mask": np.ones_like(ids_2xN),
             "global_attention_mask": np.repeat(
                 (np.arange(128) < global_length)[None].astype(np.int32), 2, axis=0)}
    logits_2xL = nnx.jit(lambda m, b, g=global_length: ft.KINDS["classification"].logits(
        m, b, g)["logits"])(model, batch)
    assert bool(jnp.any(logits_2xL[0] != logits_2xL[1])) == differs


def test_long_range_label_is_learned_only_with_global_attention(tmp_path):
  """TRAINED COMPARISON (three 80-step runs of the tiny preset, the slow part of this module):
  the label sits beyond <s>'s local reach; with global attention on <s> (the classification
  default) the validation accuracy reaches ~1, with `--set global_attention=none` it stays at
  chance (the majority class share), whatever the training does. So does the paper's segment
  baseline, `--baseline segments --segment-length 64` (its first segment, whose `<s>` the
  classifier reads, holds document positions 0..61; every label copy is at >= 80) with `<s>`
  global inside its rows: the logits cannot see the label.

  The runs use the `reference` attention: the same function as the default band op (the test
  above checks the band op's reach exactly), in a program that compiles faster. 16 copies of the
  label token make the task reliable: accuracy 1.0 for --seed 0, 1, 2, 3 at 80 steps (one copy
  takes 50 to over 100 steps to learn, depending on the seed)."""
  train = _write_jsonl(tmp_path / "train.jsonl", _far_label_records(480, 0))
  valid = _write_jsonl(tmp_path / "valid.jsonl", _far_label_records(128, 1))
  accuracy = {}
  arms = {"default": ["--set", "global_attention=default"],
          "none": ["--set", "global_attention=none"],
          "segments": ["--baseline", "segments", "--segment-length", "64"]}
  for mode, extra in arms.items():
    workdir = tmp_path / mode
    assert cli.main(["--task", "classification", "--model", "tiny", "--train", train,
                     "--validation", valid, "--max-length", "128", "--steps", "80",
                     "--batch-size", "8", "--learning-rate", "5e-3", "--workdir", str(workdir),
                     "--no-progress", *extra, "--set", "model.attention_impl=reference"]) == 0
    with open(workdir / "results.json") as f:
      accuracy[mode] = json.load(f)["validation"]["accuracy"]
  labels = [r["label"] for r in _far_label_records(128, 1)]
  majority = max(np.mean(labels), 1 - np.mean(labels))
  print(f"long-range validation accuracy {accuracy} (majority class {majority:.3f})")
  assert accuracy["default"] >= 0.95, accuracy
  assert accuracy["none"] <= majority + 0.1, (accuracy, majority)
  assert accuracy["segments"] <= majority + 0.1, (accuracy, majority)


def test_initial_params_load_the_encoder_and_start_a_new_head(tmp_path):
  from longformer_jax import checkpoint, modeling
  config = LongformerConfig.tiny(num_hidden_layers=1)
  checkpoint.save_model(tmp_path / "mlm",
                        modeling.LongformerForMaskedLM(config, rngs=nnx.Rngs(1)))
  source = ft.load_source(str(tmp_path / "mlm"))
  assert source.model_class == "LongformerForMaskedLM" and source.identity["kind"] == "checkpoint"
  model = ft.MODEL_CLASSES["multiple_choice"](source.config, rngs=nnx.Rngs(0))
  with pytest.warns(UserWarning, match=r"newly initialised \['classifier/bias', "
                    r"'classifier/kernel', 'longformer/pooler/bias', 'longformer/pooler/kernel'\]"
                    r"; unused starting weights \['lm_head/"):
    params = ft.initial_params(source, model)
  np.testing.assert_array_equal(params["longformer"]["layers"][0]["output"]["kernel"],
                                source.params["longformer"]["layers"][0]["output"]["kernel"])
  # Another architecture is refused, naming the arrays that do not fit.
  narrow = ft.MODEL_CLASSES["classification"](config.replace(intermediate_size=32),
                                              rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"longformer/layers/0/intermediate/bias \(128,\) "
                                       r"\(model: \(32,\)\)"):
    ft.initial_params(source, narrow)


# ----------------------------------------------------------------------------------------------
# Decoding and metrics


def test_best_spans_is_the_brute_force_argmax():
  rng = np.random.default_rng(0)
  b, n, max_len = 3, 40, 5
  start, end = rng.normal(size=(2, b, n)).astype(np.float32)
  context = np.zeros((b, n), bool)
  context[0, 5:30], context[1, 10:12], context[2, 39:] = True, True, True
  start, end = np.where(context, start, -1e9), np.where(context, end, -1e9)
  got = [np.asarray(x) for x in ft.best_spans(jnp.asarray(start), jnp.asarray(end), max_len)]
  for row in range(b):
    pairs = [(i, j) for i in range(n) for j in range(i, min(i + max_len, n))
             if context[row, i] and context[row, j]]
    i, j = max(pairs, key=lambda p: start[row, p[0]] + end[row, p[1]])
    assert (got[0][row], got[1][row]) == (i, j)
    assert got[2][row] == pytest.approx(start[row, i] + end[row, j])


def test_squad_scores_normalise_and_take_the_best_gold_answer():
  assert ft.normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
  scores = ft.squad_scores(["the Eiffel Tower", "Paris France"],
                           [["Eiffel Tower", "tower"], ["Paris"]])
  assert scores["exact_match"] == pytest.approx(0.5)
  # Second: precision 1/2, recall 1 -> F1 2/3.
  assert scores["f1"] == pytest.approx((1 + 2 / 3) / 2)
  ids = ft.squad_scores([(5, 6)], [[(5, 6, 7)]], normalize=False)
  assert ids["exact_match"] == 0 and ids["f1"] == pytest.approx(0.8)


def test_classification_and_tagging_metrics():
  # 2 TP / (2 TP + FP + FN): class 0 TP 1, FP 2, FN 1 -> 2/5; class 1 TP 1, FP 1, FN 1 -> 1/2;
  # class 2 FN 1 -> 0.
  assert ft.macro_f1([0, 0, 1, 1, 2], [0, 1, 1, 0, 0]) == pytest.approx((0.4 + 0.5 + 0) / 3)
  gold = [[0, 1, 1, 0], [2, 0]]
  predicted = [[0, 1, 2, 1], [2, None]]  # None: a word cut off by max_length
  m = ft.tagging_scores(gold, predicted, outside=0)
  assert m["accuracy"] == pytest.approx(3 / 6)
  # Predicted non-O: 4 (2 right), gold non-O: 3 (2 found).
  assert (m["precision"], m["recall"]) == (pytest.approx(2 / 4), pytest.approx(2 / 3))
  assert set(ft.tagging_scores(gold, predicted, outside=None)) == {"accuracy"}


# ----------------------------------------------------------------------------------------------
# The registry of kinds


# One id record per kind, and what its prediction record says the gold answer is.
_RECORDS = {
    "classification": ({"input_ids": [4, 5, 6], "label": 1}, "label", 1),
    "qa": ({"question": [5, 6], "input_ids": [7, 8, 9, 10], "answers": [{"start": 1, "end": 2}]},
           "answers", [(8, 9)]),
    "token": ({"input_ids": [4, 5, 6], "labels": ["O", "B-PER", "O"]}, "labels",
              ["O", "B-PER", "O"]),
    "multiple_choice": ({"question": [5], "candidates": [[40], [41], [42]],
                         "input_ids": [7, 8, 40], "label": 2}, "label", 2),
    "wikihop": ({"query": [5], "candidates": [[40], [41]], "input_ids": [[7, 8], [41]],
                 "answer": 1}, "label", 1),
}
# Kinds that read their datasets' own files, not JSONL records
# (tests/test_finetune_coref_hotpot.py).
_FILE_KINDS = ("coref", "hotpotqa")


def test_every_kind_reads_a_record_and_scores_it_through_its_head(tmp_path):
  """The one registry: the command line's tasks, the heads and the kinds agree; each kind reads
  a record, sizes its head, checks its labels, computes a finite loss and scores a prediction
  record that gives the record's gold answer back, with the metrics it declares."""
  with pytest.raises(ValueError, match=re.escape(f"task must be one of {tuple(ft.KINDS)}")):
    cli.FinetuneConfig(task="poetry")  # the command line's tasks
  assert tuple(ft.KINDS) == tuple(ft.MODEL_CLASSES)
  # (The kinds of their own modules register as they are imported: the order is not checked.)
  assert set(ft.KINDS) == set(_RECORDS) | set(_FILE_KINDS)
  config = LongformerConfig.tiny(num_hidden_layers=1, attention_impl="reference")
  specials = SpecialIds.of_config(config)
  for name, kind in ft.KINDS.items():
    assert kind.name == name and ft.get_kind(name) is kind
    assert ft.MODEL_CLASSES[name] is kind.model_class
    with pytest.raises(ValueError, match="registered already"):
      ft.register(type(kind))
    if name in _FILE_KINDS:
      continue
    record, field, gold = _RECORDS[name]
    path = _write_jsonl(tmp_path / f"{name}.jsonl", [record])
    split = fd.read_split(path, kind, None, max_length=16, specials=specials, vocab_size=512,
                          label_names=kind.label_names([path], None))
    assert split.task == name and len(split) == 1 and not split.by_text
    size = kind.num_labels([split], ft.ModelSource(config, None, None, {}))
    model_config = config.replace(num_labels=size)
    kind.check_labels(split, model_config)
    model = kind.model_class(model_config, rngs=nnx.Rngs(0))
    model.eval()
    mode = kind.resolve_global("default")
    batch = kind.batch(split, [0], global_attention=mode, specials=specials)
    assert np.isfinite(float(kind.loss(model, batch, split.max_global(mode))))
    logits = kind.logits(model, batch, split.max_global(mode))
    outputs = {k: np.asarray(x) for k, x in kind.outputs(logits, 30).items()}
    metrics, records = ft.score(split, outputs)
    assert set(metrics) == set(kind.metrics) | {"examples"} and metrics["examples"] == 1
    assert list(records[0])[0] == "id" and records[0]["id"] == 1
    assert (list(map(tuple, records[0][field])) if name == "qa" else records[0][field]) == gold
  with pytest.raises(ValueError, match=r"task must be one of \('classification', 'qa'"):
    ft.get_kind("summarization")
  with pytest.raises(ValueError, match="needs a question: task 'token'"):
    ft.KINDS["token"].resolve_global("question")


def test_qa_targets_and_offsets_recover_the_answer(data):
  split = fd.read_split(data["qa", "valid"], ft.KINDS["qa"], ft_tokenizer(data), max_length=48,
                        specials=SpecialIds.of_config(LongformerConfig.tiny()), vocab_size=512)
  for e in split.examples:
    assert ft.span_answer(e, *e.target) == e.gold[0]
    assert list(e.global_lengths("question")) == [1 + 3]  # <s> which number ?
  # A context cut before its answer leaves no training target (the record is not trained on).
  short = fd.read_split(data["qa", "valid"], ft.KINDS["qa"], ft_tokenizer(data), max_length=10,
                        specials=SpecialIds.of_config(LongformerConfig.tiny()), vocab_size=512)
  assert any(e.target is None for e in short.examples)


def ft_tokenizer(data):
  return load_tokenizer(data["tokenizer"])


# ----------------------------------------------------------------------------------------------
# TriviaQA's form of QA: aliases, the normaliser, the all-occurrence loss, one answer per question

_TRIVIAQA_CASES = [("rock and roll", "rock-and-roll"), ("U S", "U.S."), ("New_York", "New York"),
                   ("\u2018Hamlet\u2019", "Hamlet")]


def _qa_split(path, options=ft.FinetuneOptions(), tokenizer=None, max_length=32):
  config = LongformerConfig.tiny()
  return fd.read_split(path, ft.get_kind("qa").configured(options), tokenizer,
                       max_length=max_length, specials=SpecialIds.of_config(config),
                       vocab_size=config.vocab_size)


def test_triviaqa_normaliser_scores_em_1_through_the_qa_kind():
  """Each prediction, the context text its span covers, against its gold alias: EM 1 under
  --set qa_normalizer=triviaqa, 0 under SQuAD's (the default)."""
  examples, outputs = [], {"start": [], "end": [], "score": []}
  for gold, predicted in _TRIVIAQA_CASES:
    context = f"x {predicted} y"
    examples.append(fd.Example(1, np.zeros(5, np.int32), gold=(gold,), context=(1, 4),
                               offsets=np.asarray([[0, 1], [2, 2 + len(predicted)],
                                                   [3 + len(predicted), 4 + len(predicted)]],
                                                  np.int32), context_text=context))
    outputs["start"].append(2)
    outputs["end"].append(2)
    outputs["score"].append(0.0)
  outputs = {k: np.asarray(v) for k, v in outputs.items()}
  for name, expected in (("triviaqa", 1.0), ("squad", 0.0)):
    kind = ft.get_kind("qa").configured(ft.FinetuneOptions(qa_normalizer=name))
    split = fd.FinetuneSplit(kind, "hand", "", tuple(range(4)), tuple(examples), 8, True)
    metrics, records = kind.score(split, examples, split.ids, outputs)
    assert metrics["exact_match"] == expected, (name, metrics)
    assert [r["prediction"] for r in records] == [p for _, p in _TRIVIAQA_CASES]
  with pytest.raises(ValueError, match="qa_normalizer must be one of"):
    ft.FinetuneOptions(qa_normalizer="bleu")
  with pytest.raises(ValueError, match="qa_loss must be one of"):
    ft.FinetuneOptions(qa_loss="sum")


def test_aliases_give_every_occurrence_and_the_or_loss_is_logsumexp(tmp_path):
  """An id record with aliases only (no "answers") is read: every occurrence of every alias in
  the kept context is an answer span; the kind's all-occurrence loss equals a numpy
  logsumexp reference on its own logits; the default loss takes the first occurrence."""
  records = [
      {"question": [5, 6], "input_ids": [7, 40, 41, 9, 40, 41, 8, 42, 7, 40, 41],
       "aliases": [[40, 41], [42]]},                     # [40 41] twice in range, [42] once
      {"question": [5], "input_ids": [9, 9, 43, 9], "answers": [{"start": 2, "end": 2}],
       "aliases": [[9]]},                                # answers and aliases together
  ]
  path = _write_jsonl(tmp_path / "aliases.jsonl", records)
  options = ft.FinetuneOptions(qa_loss="all_occurrences")
  split = _qa_split(path, options, max_length=16)
  first, second = split.examples
  head = 1 + 2 + 2  # <s> q q </s></s>
  keep = 16 - head - 1  # 10 context tokens: the last [40 41] is cut
  assert first.context == (head, head + keep)
  assert first.answer_spans == tuple((head + a, head + b) for a, b in [(1, 2), (4, 5), (7, 7)])
  assert first.target == (head + 1, head + 2) and first.gold == ((40, 41), (42,))
  assert second.target == (4 + 2, 4 + 2)  # the given answer comes first
  assert second.answer_spans == tuple((4 + i, 4 + i) for i in (0, 1, 2, 3))
  kind = split.kind
  assert kind.settings() == {"qa_loss": "all_occurrences"}
  config = LongformerConfig.tiny(num_hidden_layers=1, attention_impl="reference")
  model = kind.model_class(config, rngs=nnx.Rngs(0))
  model.eval()
  batch = kind.batch(split, [0, 1], global_attention="question",
                     specials=SpecialIds.of_config(config))
  assert batch["answer_starts"].shape == (2, kind.MAX_OCCURRENCES)
  max_global = split.max_global("question")
  logits = {k: np.asarray(v, np.float64) for k, v in kind.logits(model, batch,
                                                                 max_global).items()}

  def lse(x):
    return np.log(np.sum(np.exp(x - x.max()))) + x.max()

  reference = []
  for row, e in enumerate(split.examples):
    starts = sorted({a for a, _ in e.answer_spans})
    ends = sorted({b for _, b in e.answer_spans})
    s, t = logits["start_logits"][row], logits["end_logits"][row]
    reference.append(0.5 * ((lse(s) - lse(s[starts])) + (lse(t) - lse(t[ends]))))
  got = float(kind.loss(model, batch, max_global))
  assert got == pytest.approx(np.mean(reference), rel=1e-5, abs=1e-6)
  # The default loss: the first span's cross-entropy.
  plain = ft.get_kind("qa")
  batch = plain.batch(_qa_split(path, max_length=16), [0, 1], global_attention="question",
                      specials=SpecialIds.of_config(config))
  first_only = np.mean([0.5 * ((lse(logits["start_logits"][r]) - logits["start_logits"][r][a])
                               + (lse(logits["end_logits"][r]) - logits["end_logits"][r][b]))
                        for r, (a, b) in enumerate([first.target, second.target])])
  assert float(plain.loss(model, batch, max_global)) == pytest.approx(first_only, rel=1e-5)
  # A record with neither answers nor aliases is refused, naming the field.
  bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question": [5], "input_ids": [7]}])
  with pytest.raises(fd.text.JsonlError, match=r"bad.jsonl:1: field 'answers' is missing "
                     r"\(a record needs \"answers\" or \"aliases\"\)"):
    _qa_split(bad)


def test_text_aliases_match_case_insensitively_at_word_boundaries(data, tmp_path):
  record = {"question": "which number ?", "context": "w1 N3 w2 n3 w4 n33",
            "aliases": ["n3"]}
  split = _qa_split(_write_jsonl(tmp_path / "a.jsonl", [record]), tokenizer=ft_tokenizer(data))
  e = split.examples[0]
  head = 1 + 3 + 2
  # "N3" is not a word of the tokenizer (<unk>) but its characters match; "n33" does not.
  assert e.answer_spans == ((head + 1, head + 1), (head + 3, head + 3))
  assert [ft.span_answer(e, a, b) for a, b in e.answer_spans] == ["N3", "n3"]


def test_records_of_one_question_give_one_answer_the_best_scoring_span(tmp_path):
  """Three evidence documents of question "q1" and one lone record: "q1" is answered by the
  span of its highest-scoring document; the metrics are per question."""
  records = [
      {"id": "a", "question_id": "q1", "question": [5], "input_ids": [7, 40, 8],
       "aliases": [[40]]},
      {"id": "b", "question_id": "q1", "question": [5], "input_ids": [9, 41, 8],
       "aliases": [[40]]},
      {"id": "c", "question_id": "q1", "question": [5], "input_ids": [40, 9, 9],
       "aliases": [[40]]},
      {"id": "d", "question": [6], "input_ids": [7, 42], "answers": [{"start": 1, "end": 1}]},
  ]
  split = _qa_split(_write_jsonl(tmp_path / "q.jsonl", records), max_length=16)
  head = 1 + 1 + 2
  # a predicts 7 (wrong, score 1.0), b predicts 41 (wrong, score 3.0, the best of q1), c predicts
  # 40 (right, score 2.0); d predicts 42 (right).
  outputs = {"start": np.asarray([head, head + 1, head, head + 1]),
             "end": np.asarray([head, head + 1, head, head + 1]),
             "score": np.asarray([1.0, 3.0, 2.0, 0.5])}
  metrics, predictions = ft.score(split, outputs)
  assert metrics == {"exact_match": 0.5, "f1": 0.5, "questions": 2, "examples": 4}
  assert [p.get("question_prediction") for p in predictions] == [(41,)] * 3 + [None]
  assert [p["prediction"] for p in predictions] == [(7,), (41,), (40,), (42,)]
  # c scoring highest instead answers q1 right.
  outputs["score"] = np.asarray([1.0, 2.0, 3.0, 0.5])
  assert ft.score(split, outputs)[0]["exact_match"] == 1.0
