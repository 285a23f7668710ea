"""BPC evaluation: every character scored exactly once; the batched sliding protocol equals a
brute-force evaluation that runs the model separately for every position."""

import dataclasses
import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

from longformer_jax.causal_lm import LongformerForCausalLM, next_byte_nll
from longformer_jax.config import CharLMConfig
from longformer_jax.tasks.charlm import evaluate_bpc, evaluate_nll, window_plan

pytestmark = pytest.mark.unit

MODEL = CharLMConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                     intermediate_size=64, attention_window=(4, 8))


def _coverage(num_bytes, plan):
  counts = np.zeros(num_bytes - 1, int)
  for w in plan:
    assert w.start <= w.score_from < w.end <= num_bytes - 1
    counts[w.score_from:w.end] += 1
  return counts


@pytest.mark.parametrize("protocol", ["sliding", "chunks"])
@pytest.mark.parametrize("num_bytes, context, stride", [
    (2, 4, 2), (5, 4, 2), (50, 16, 4), (51, 16, 4), (64, 16, 16), (100, 7, 3), (1000, 64, 1),
    (32256 * 2 + 777, 32256, 512),   # the paper's protocol on a split that ends mid-stride
])
def test_every_character_scored_exactly_once(protocol, num_bytes, context, stride):
  plan = window_plan(num_bytes, context, stride, protocol)
  np.testing.assert_array_equal(_coverage(num_bytes, plan), 1)
  for w in plan:
    assert w.end - w.start <= context
    if protocol == "sliding" and w.start > 0:
      # After the first window, every scored position sees >= context - stride bytes of history.
      assert w.score_from - w.start >= context - stride
      assert w.end - w.start == context


def _brute_force_nll(model, data, context, stride, protocol):
  """Per position p (predicting data[p + 1]): run the model on exactly the bytes the protocol
  gives as history, one forward pass per position, and take that position's logit. The history
  is right-padded to `context` bytes (one compile); padding after p cannot change the logit at p
  (causality, tested in test_causal_lm.py)."""
  positions = len(data) - 1
  run = jax.jit(lambda x, i: model(x[None])[0, i])
  total = 0.0
  for p in range(positions):
    if protocol == "chunks":
      start = (p // context) * context
    elif p < context:
      start = 0                    # the first window scores all of its positions
    else:                          # the window ending at the first end >= p + 1
      end = min(context + math.ceil((p + 1 - context) / stride) * stride, positions)
      start = end - context
    history = np.zeros(context, np.int32)
    history[:p + 1 - start] = data[start:p + 1]
    logits = run(history, p - start)
    total += float(next_byte_nll(logits[None], data[p + 1:p + 2].astype(np.int32))[0])
  return total


@pytest.mark.parametrize("protocol", ["sliding", "chunks"])
def test_batched_protocol_equals_brute_force(protocol):
  model = LongformerForCausalLM(MODEL, rngs=nnx.Rngs(0))
  data = np.random.default_rng(0).integers(0, 256, 43).astype(np.uint8)
  context, stride = 12, 5
  total, count = evaluate_nll(model, data, context=context, stride=stride, batch_size=3,
                              protocol=protocol)
  assert count == len(data) - 1
  expected = _brute_force_nll(model, data, context, stride, protocol)
  np.testing.assert_allclose(total, expected, rtol=1e-5)


def test_bpc_is_batch_size_invariant_and_in_bits():
  model = LongformerForCausalLM(MODEL, rngs=nnx.Rngs(0))
  data = np.random.default_rng(1).integers(0, 256, 200).astype(np.uint8)
  a = evaluate_bpc(model, data, context=32, stride=8, batch_size=1)
  b = evaluate_bpc(model, data, context=32, stride=8, batch_size=7)
  np.testing.assert_allclose(a, b, rtol=1e-6)
  assert 7.0 < a < 9.0  # an untrained byte model is near log2(256) = 8 bits


def test_bad_arguments_name_the_values():
  model = LongformerForCausalLM(MODEL, rngs=nnx.Rngs(0))
  data = np.zeros(100, np.uint8)
  with pytest.raises(ValueError, match="score_last=256 differs from stride=512"):
    evaluate_bpc(model, data, context=1024, stride=512, score_last=256)
  with pytest.raises(ValueError, match="protocol must be one of"):
    evaluate_bpc(model, data, context=16, stride=4, protocol="strided")
  with pytest.raises(ValueError, match=r"stride must be in \[1, context=16\], got 32"):
    evaluate_bpc(model, data, context=16, stride=32)
  with pytest.raises(ValueError, match="at least 2 bytes"):
    evaluate_bpc(model, data[:1], context=16, stride=4)


def test_cli_checks_its_output_first_and_fails_on_a_non_finite_result(tmp_path, monkeypatch,
                                                                      capsys):
  """eval.bpc: an unwritable --output is refused (one line, status 2) before any evaluation; a
  NaN result exits 1 and writes nothing (a checkpoint with broken weights must not look like a
  result)."""
  from longformer_jax.commands import eval_bpc as bpc
  from longformer_jax.training import write_run_config
  import longformer_jax.tasks.charlm as evaluation
  write_run_config(tmp_path / "run", evaluation.char_tiny())  # the run's record, no checkpoint
  text = tmp_path / "text.txt"
  text.write_bytes(b"some bytes to score")
  calls = []

  def fake_evaluate_run(workdir, data, **kwargs):
    calls.append(len(data))
    return {"bpc": value, "protocol": kwargs["protocol"], "context": kwargs["context"],
            "stride": kwargs["stride"], "bytes": len(data), "step": 7}

  monkeypatch.setattr(evaluation, "evaluate_run", fake_evaluate_run)
  args = ["--workdir", str(tmp_path / "run"), "--file", str(text), "--no-progress"]
  blocker = tmp_path / "not_a_directory"
  blocker.write_text("")
  value = 1.5
  with pytest.raises(SystemExit) as exit_info:
    bpc.main(args + ["--output", str(blocker / "out.json")])
  assert exit_info.value.code == 2 and not calls
  assert capsys.readouterr().err == (f"eval.bpc: error: cannot write the output "
                                     f"{blocker / 'out.json'}: {blocker} is a file\n")
  out = tmp_path / "out.json"
  assert bpc.main(args + ["--output", str(out)]) == 0 and out.exists() and calls == [19]
  out.unlink()
  value = math.nan
  assert bpc.main(args + ["--output", str(out)]) == 1
  assert not out.exists()


# ---------------------------------------------------------------------------------------------
# The data eval.bpc scores


def test_bpc_scores_the_runs_own_data_file_by_default(charlm_run, tmp_path, capsys):
  """A run trained with --data-file was scored on its config's dataset (enwik8_sample) when
  eval.bpc had no --file: now its record names the file, and the file's test split is scored."""
  from longformer_jax.commands import eval_bpc as bpc
  out = tmp_path / "out.json"
  assert bpc.main(["--workdir", str(charlm_run.workdir), "--max-bytes", "64", "--context", "16",
                   "--output", str(out), "--no-progress"]) == 0
  result = json.loads(out.read_text())
  assert result["data_file"] == str(charlm_run.data.resolve()) and result["split"] == "test"
  assert "dataset" not in result and result["bytes"] == 64
  from longformer_jax.tasks.charlm import split_of_file
  expected = evaluate_bpc(restore_run_model(charlm_run.workdir), split_of_file(
      str(charlm_run.data), "test")[:64], context=16, stride=8, windows=(3, 6))
  assert result["bpc"] == pytest.approx(expected, rel=1e-5)


def restore_run_model(workdir):
  from longformer_jax.tasks.charlm import restore_run
  return restore_run(workdir)[0]


def test_run_data_refuses_a_file_that_is_not_the_one_the_run_trained_on(tmp_path):
  """The record's file, changed since (or gone), is refused naming it, not scored."""
  from longformer_jax.tasks.charlm import char_tiny, run_data, split_of_file
  import hashlib
  data = tmp_path / "data.bin"
  data.write_bytes(bytes(range(256)) * 8)
  train = split_of_file(str(data), "train")
  record = {"data": {"data_file": str(data), "train_bytes": len(train),
                     "train_sha256": hashlib.sha256(train.tobytes()).hexdigest()}}
  got, source, name = run_data(record, char_tiny(), "validation")
  assert source == {"data_file": str(data), "split": "validation"}
  assert name == "file_data.bin_validation"
  np.testing.assert_array_equal(got, split_of_file(str(data), "validation"))
  data.write_bytes(bytes(range(256))[::-1] * 8)
  with pytest.raises(ValueError, match=f"the --data-file {data} is not the data the run trained "
                                       f"on: its train split has 1,843 bytes and another SHA-256"):
    run_data(record, char_tiny(), "test")
  data.unlink()
  with pytest.raises(FileNotFoundError, match=f"the run trained on --data-file {data}, which is "
                                              f"not there now"):
    run_data(record, char_tiny(), "test")


def test_bytes_outside_the_vocabulary_are_refused_before_scoring(tmp_path, capsys):
  """A model of 128 bytes scoring byte 200 gave NaN and "the checkpoint's weights are not
  usable": refused naming the byte and its position (exit 2, before any checkpoint is read)."""
  from longformer_jax.commands import eval_bpc as bpc
  from longformer_jax.tasks.charlm import char_tiny
  from longformer_jax.training import write_run_config
  cfg = char_tiny()
  write_run_config(tmp_path / "run",
                   dataclasses.replace(cfg, model=cfg.model.replace(vocab_size=128)))
  text = tmp_path / "text.bin"
  text.write_bytes(b"plain ascii " + bytes([200]) + b" then more")
  with pytest.raises(SystemExit) as exit_info:
    bpc.main(["--workdir", str(tmp_path / "run"), "--file", str(text), "--no-progress"])
  assert exit_info.value.code == 2
  assert capsys.readouterr().err == (
      f"eval.bpc: error: {text} holds byte 200 at position 12 (1 bytes >= 128); the model's "
      f"vocabulary is bytes 0..127 (vocab_size=128): pick data it can read, or a model with "
      f"vocab_size=256\n")
  model = LongformerForCausalLM(MODEL.replace(vocab_size=128), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="the data to score holds byte 200 at position 12"):
    evaluate_bpc(model, np.frombuffer(text.read_bytes(), np.uint8), context=8, stride=4)


def test_cli_output_on_a_full_disk_is_refused_first_or_keeps_the_result_in_its_error(
    tmp_path, monkeypatch, capsys):
  """eval.bpc on a full disk: the output check writes a byte, so it fails before any evaluation
  (an empty probe file is made even on a full disk); a disk that fills during the evaluation
  fails the write itself: one `error:` line holding the result, status 1, no file."""
  import errno
  import os
  from longformer_jax import io as lj_io
  from longformer_jax.commands import eval_bpc as bpc
  from longformer_jax.training import write_run_config
  import longformer_jax.tasks.charlm as evaluation
  write_run_config(tmp_path / "run", evaluation.char_tiny())
  text = tmp_path / "text.txt"
  text.write_bytes(b"some bytes to score")
  calls, real_write = [], lj_io._write
  full = [".out.json.write-check", ".out.json.tmp"]  # names whose writes find no room

  def write(path, data):
    if any(path.name.startswith(name) for name in full):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real_write(path, data)

  def fake_evaluate_run(workdir, data, **kwargs):
    calls.append(len(data))
    return {"bpc": 1.5, "protocol": kwargs["protocol"], "context": 16, "stride": 8,
            "bytes": len(data), "step": 7}

  monkeypatch.setattr(evaluation, "evaluate_run", fake_evaluate_run)
  monkeypatch.setattr(lj_io, "_write", write)
  out = tmp_path / "out.json"
  args = ["--workdir", str(tmp_path / "run"), "--file", str(text), "--no-progress", "--output",
          str(out)]
  with pytest.raises(SystemExit) as exit_info:
    bpc.main(args)
  assert exit_info.value.code == 2 and not calls
  assert capsys.readouterr().err == (f"eval.bpc: error: cannot write the output {out}: No space "
                                     "left on device\n")
  full.remove(".out.json.write-check")  # the check finds room; the output, later, does not
  assert bpc.main(args) == 1 and calls == [19]
  [error] = capsys.readouterr().err.splitlines()
  prefix = f"error: cannot write {out}: No space left on device; the result, not written: "
  assert error.startswith(prefix), error
  assert json.loads(error.removeprefix(prefix))["bpc"] == 1.5
  assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "text.txt"]  # no file, no probe
