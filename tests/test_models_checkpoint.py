"""Orbax checkpoints: models (parameters, config and constructor arguments come back) and train
states, whose parameters load without the optimizer state."""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from longformer_jax import checkpoint, modeling
from longformer_jax.causal_lm import LongformerForCausalLM
from longformer_jax.config import CharLMConfig, LongformerConfig
from longformer_jax.tasks.charlm import CharLMTask, evaluate_bpc, evaluate_run
from longformer_jax.training import Trainer, read_run_config
from testing import largest_chunk, truncate_checkpoint

# slow: in-process, but most of the cost is training runs, command lines and subprocesses.
pytestmark = [pytest.mark.unit, pytest.mark.slow]

CONFIG = LongformerConfig(vocab_size=64, hidden_size=64, num_hidden_layers=3,
                          num_attention_heads=4, intermediate_size=96, max_position_embeddings=40,
                          type_vocab_size=2, attention_window=(2, 4, 3),
                          attention_dilation=(1, (1, 2, 1, 2), 1), dtype="bfloat16", num_labels=5)


@pytest.mark.parametrize("model_class, kwargs", [
    (modeling.LongformerModel, dict(add_pooling_layer=False)),
    (modeling.LongformerForSequenceClassification, {}),
])
def test_save_and_load_round_trip(tmp_path, model_class, kwargs):
  model = model_class(CONFIG, rngs=nnx.Rngs(3), **kwargs)
  checkpoint.save_model(tmp_path / "ckpt", model)
  loaded = checkpoint.load_model(tmp_path / "ckpt")
  assert type(loaded) is model_class
  assert loaded.config == CONFIG
  saved = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
  restored = jax.tree_util.tree_flatten_with_path(
      nnx.to_pure_dict(nnx.state(loaded, nnx.Param)))[0]
  assert [p for p, _ in saved] == [p for p, _ in restored]
  for (_, a), (_, b) in zip(saved, restored):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  if model_class is modeling.LongformerModel:
    assert loaded.pooler is None


def test_save_refuses_to_overwrite_unless_forced(tmp_path):
  model = modeling.LongformerModel(CONFIG, rngs=nnx.Rngs(0))
  checkpoint.save_model(tmp_path / "ckpt", model)
  with pytest.raises(FileExistsError, match="pass force=True"):
    checkpoint.save_model(tmp_path / "ckpt", model)
  other = modeling.LongformerModel(CONFIG, rngs=nnx.Rngs(1))
  checkpoint.save_model(tmp_path / "ckpt", other, force=True)
  loaded = checkpoint.load_model(tmp_path / "ckpt")
  np.testing.assert_array_equal(loaded.pooler.kernel[...], other.pooler.kernel[...])
  with pytest.raises(FileNotFoundError, match="no model.json"):
    checkpoint.load_model(tmp_path / "nothing")
  with pytest.raises(TypeError, match="has no `config` attribute"):
    checkpoint.save_model(tmp_path / "linear", nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


def test_an_altered_model_checkpoint_is_refused(tmp_path):
  model = modeling.LongformerModel(CONFIG, rngs=nnx.Rngs(0))
  checkpoint.save_model(tmp_path / "ckpt", model)
  # One (float32) weight one ulp off, written by Orbax itself: it decodes, only the checksum
  # tells.
  kernel = model.pooler.kernel
  kernel[...] = kernel[...].at[0, 0].set(np.nextafter(kernel[0, 0], np.float32(1e9)))
  params = nnx.state(model, nnx.Param)
  writer = checkpoint.ocp.StandardCheckpointer()
  writer.save(tmp_path / "ckpt" / "params", params, force=True)
  writer.wait_until_finished()
  with pytest.raises(checkpoint.DamagedCheckpointError,
                     match=r"/params: checksum mismatch in pooler/kernel/value: written "):
    checkpoint.load_model(tmp_path / "ckpt")
  meta = tmp_path / "ckpt" / checkpoint.MODEL_JSON
  meta.write_text(meta.read_text().replace('"num_labels": 5', '"num_labels": 6'))
  with pytest.raises(checkpoint.DamagedCheckpointError, match="do not match their SHA-256"):
    checkpoint.load_model(tmp_path / "ckpt")


# ----------------------------------------------------------------------------------------------
# Train-state checkpoints: load_params reads the parameters only.

CHAR_MODEL = CharLMConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                          intermediate_size=64, attention_window=(4, 8))


def _assert_same_params(a, b):
  a, b = nnx.to_pure_dict(a), nnx.to_pure_dict(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def test_load_params_never_reads_the_optimizer_state(tmp_path, charlm_run):
  workdir = tmp_path / "run"
  shutil.copytree(charlm_run.workdir, workdir)  # the session's tiny run: checkpoints 2 to 8
  cfg = read_run_config(workdir)
  trainer = Trainer(cfg, task=CharLMTask())
  trained = {step: trainer.restore(workdir, step)[0].params for step in (6, 8)}
  # Step 8 loses its optimizer state, step 6's is overwritten with garbage.
  shutil.rmtree(workdir / "checkpoints" / "8" / "opt_state")
  for f in (workdir / "checkpoints" / "6" / "opt_state").rglob("*"):
    if f.is_file():
      f.write_bytes(b"not an orbax file")
  with pytest.raises(checkpoint.DamagedCheckpointError, match="^step 6 opt_state: "):
    trainer.restore(workdir, 6)

  target = trainer.abstract_state().params
  _assert_same_params(checkpoint.load_params(workdir, target), trained[8])  # the latest
  _assert_same_params(checkpoint.load_params(workdir / "checkpoints", target, step=6),
                      trained[6])
  # The evaluation entry points go through load_params: the run's model with the final windows.
  data = np.random.default_rng(1).integers(0, 256, 100).astype(np.uint8)
  result = evaluate_run(workdir, data, context=16, stride=8, batch_size=3)
  expected = evaluate_bpc(trainer.model(trained[8]), data, context=16, stride=8, batch_size=3,
                          windows=(3, 6))
  assert result["step"] == 8 and result["windows"] == [3, 6] and result["bytes"] == 100
  np.testing.assert_allclose(result["bpc"], expected, rtol=1e-6)
  with pytest.raises(FileNotFoundError, match="no checkpoint of step 7"):
    checkpoint.load_params(workdir, target, step=7)


def test_load_params_of_a_model_checkpoint(tmp_path):
  model = LongformerForCausalLM(CHAR_MODEL, rngs=nnx.Rngs(5))
  checkpoint.save_model(tmp_path / "ckpt", model)
  _, abstract, _ = nnx.split(nnx.eval_shape(
      lambda: LongformerForCausalLM(CHAR_MODEL, rngs=nnx.Rngs(0))), nnx.Param, ...)
  _assert_same_params(checkpoint.load_params(tmp_path / "ckpt", abstract),
                      nnx.state(model, nnx.Param))
  with pytest.raises(FileNotFoundError, match="no checkpoint under"):
    checkpoint.load_params(tmp_path / "nothing", abstract)


@pytest.mark.parametrize("damage", ["delete", "truncate", "empty"])
def test_a_damaged_data_file_is_found_before_orbax_reads(tmp_path, monkeypatch, capsys, damage):
  """A missing, cut or emptied data file is found by the sequential check, so Orbax's
  concurrent read (which would leave reads in flight when one fails) never starts. OCDBT reads a
  value whose data file is missing as an empty value: only decoding the arrays finds it."""
  model = LongformerForCausalLM(CHAR_MODEL, rngs=nnx.Rngs(0))
  checkpoint.save_model(tmp_path / "ckpt", model)
  chunk = largest_chunk(tmp_path / "ckpt" / "params")
  if damage == "delete":
    chunk.unlink()
  elif damage == "truncate":
    truncate_checkpoint(tmp_path / "ckpt" / "params")
  else:
    chunk.write_bytes(b"")
  orbax_reads = []
  restore = checkpoint.ocp.StandardCheckpointer.restore
  monkeypatch.setattr(checkpoint.ocp.StandardCheckpointer, "restore",
                      lambda self, *a, **k: orbax_reads.append(a) or restore(self, *a, **k))
  monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)  # writes to stderr
  with pytest.raises(checkpoint.DamagedCheckpointError, match="/params: "):
    checkpoint.load_model(tmp_path / "ckpt")
  assert orbax_reads == []
  gc.collect()
  assert capsys.readouterr().err == ""


def test_a_failed_read_leaves_nothing_behind_and_the_callers_futures_alone(tmp_path, monkeypatch,
                                                                          caplog, capsys):
  """A read of a damaged checkpoint fails in one DamagedCheckpointError. Orbax abandons the
  reads still in flight when the first one fails; they are collected with the failure, so
  nothing reports later ("Exception ignored in: <coroutine ...>" reached `sys.unraisablehook`
  at some later collection), and a future of the caller's own whose error nobody retrieved
  still reports it."""
  model = LongformerForCausalLM(CHAR_MODEL, rngs=nnx.Rngs(0))
  checkpoint.save_model(tmp_path / "ckpt", model)
  for f in (tmp_path / "ckpt" / "params").rglob("*"):
    if f.is_file() and f.parent.name == "d":  # every array chunk, cut to a third
      f.write_bytes(f.read_bytes()[:f.stat().st_size // 3])
  # Python's own hook (pytest's would turn reports into warnings): it writes to stderr.
  monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
  loop = asyncio.new_event_loop()
  try:
    mine = loop.create_future()
    mine.set_exception(ValueError("the caller's own error"))
    try:
      checkpoint.load_model(tmp_path / "ckpt")
      raise AssertionError("a damaged checkpoint loaded")
    except checkpoint.DamagedCheckpointError as e:
      assert "params: " in str(e)
    gc.collect()  # the error and what it held are gone: nothing of the read may report
    assert capsys.readouterr().err == ""
    with caplog.at_level(logging.ERROR, logger="asyncio"):
      del mine
      gc.collect()
    assert "the caller's own error" in caplog.text
  finally:
    loop.close()


def test_what_a_failed_orbax_call_abandoned_is_collected_with_it_and_reports_nothing(
    capsys, monkeypatch):
  """A read abandoned by a failed Orbax call, suspended on a loop that no longer runs and held
  only by the failure's traceback, as Orbax leaves them. Orbax's read turns the close of its
  coroutine into an error of its own, which Python reports ("Exception ignored in: <coroutine
  ...>") whenever the garbage collector gets to it: `_collect_abandoned` collects it with the
  failure, so nothing reaches stderr then or later."""

  async def read(gate):
    try:
      await gate
    except BaseException as e:
      raise Exception("Encountered error while reading array index") from e

  monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)  # writes to stderr
  loop = asyncio.new_event_loop()

  def failing_call():
    gate = loop.create_future()
    task = loop.create_task(read(gate))
    loop.run_until_complete(asyncio.sleep(0))  # the read starts and waits on the gate
    assert not task.done()
    raise RuntimeError("a failed read")

  try:
    try:
      failing_call()
    except RuntimeError as e:
      checkpoint._collect_abandoned(e)
    gc.collect()
  finally:
    loop.close()
  gc.collect()
  assert capsys.readouterr().err == ""
