"""Training: golden first steps (with and without dropout and accumulation), learning, exact
resume across SIGTERM and stages, accumulation, non-finite loss, sharding on 4 simulated devices,
the run config round trip, another task through the same loop."""

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec as P

from longformer_jax.config import CharLMConfig, LongformerConfig
from longformer_jax.layers import LOGICAL_AXES
from longformer_jax.modeling import LongformerForMaskedLM
from longformer_jax.tasks import CharLMTask
from longformer_jax.training import (LOGICAL_RULES, NonFiniteLossError, RunMismatchError, Stage,
                                     Task, TrainConfig, Trainer, batch_sharding, make_mesh,
                                     paper_stages, read_run_config, train, write_run_config)
from longformer_jax.training.sharding import seq_axis

pytestmark = pytest.mark.integration

MODEL = CharLMConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                     intermediate_size=64, attention_window=(4, 8))
# A masked LM for `_MaskedLMTask`, and the path of its position table.
_SMALL_MLM = LongformerConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2,
                              num_attention_heads=2, intermediate_size=32,
                              max_position_embeddings=40, attention_window=4)
_POSITIONS = "longformer/embeddings/position_embeddings/embedding"


def _config(**kw) -> TrainConfig:
  base = dict(model=MODEL, stages=(Stage(seq_len=16, batch_size=4, steps=3, learning_rate=3e-3,
                                         warmup_steps=1),
                                   Stage(seq_len=32, batch_size=2, steps=3, learning_rate=1e-3,
                                         windows=(8, 16))),
              eval_every=10_000, checkpoint_every=2, async_checkpoints=True)
  base.update(kw)
  return TrainConfig(**base)


def _bytes(n=4096, seed=0):
  return np.random.default_rng(seed).integers(0, 256, n).astype(np.uint8)


def _run(cfg, workdir, data, **kw):
  losses = {}
  task = kw.pop("task", None) or CharLMTask(data)
  summary = train(cfg, workdir, task, progress=False,
                  step_hook=lambda step, m: losses.__setitem__(step, m["loss"]), **kw)
  return summary, losses


def _golden_steps(cfg, num_steps):
  """[loss, grad_norm] of each of `num_steps` steps on one fixed batch."""
  trainer = Trainer(cfg, task=CharLMTask())
  state = trainer.init_state()
  tokens = _bytes(4 * 17).reshape(4, 17).astype(np.int32)
  batch = trainer.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, 4)
  step = trainer.train_step(0)
  out = []
  for _ in range(num_steps):
    state, m = step(state, batch)
    out += [float(m["loss"]), float(m["grad_norm"])]
  assert int(state.step) == num_steps
  return out


@pytest.mark.golden
def test_golden_first_steps():
  """Hard-coded reference: catches silent changes to init, the optimizer, the loss or data."""
  cfg = _config(stages=(Stage(seq_len=16, batch_size=4, steps=2, learning_rate=1e-2),))
  np.testing.assert_allclose(_golden_steps(cfg, 2)[:3], GOLDEN, rtol=2e-5)


GOLDEN = [5.563892364501953, 1.2804957628250122, 5.275964260101318]


@pytest.mark.golden
def test_golden_steps_with_dropout_and_accumulation():
  """Pins the dropout keys (fold_in(seed, step), then fold_in(., microbatch)) and the
  accumulation; recorded before the training code was split into a package."""
  cfg = _config(model=dataclasses.replace(MODEL, hidden_dropout_prob=0.1), microbatch_size=2,
                stages=(Stage(seq_len=16, batch_size=4, steps=3, learning_rate=1e-2,
                              warmup_steps=1),))
  np.testing.assert_allclose(_golden_steps(cfg, 3), GOLDEN_DROPOUT, rtol=2e-5)


GOLDEN_DROPOUT = [5.559170246124268, 1.2821565866470337, 5.561490058898926, 1.4688578844070435,
                  5.309150695800781, 1.140488624572754]


def test_seeds_share_their_programs():
  """The seed is an argument of every program (init, model state, step), not a constant in it:
  runs that differ only in their seed (a study's seeds) lower to the same programs, so a
  persistent compilation cache compiles each once. The golden tests above pin that the seed
  still picks the same keys."""
  model = dataclasses.replace(MODEL, hidden_dropout_prob=0.1)
  trainers = [Trainer(_config(model=model, seed=seed), task=CharLMTask()) for seed in (0, 1)]
  tokens = jax.ShapeDtypeStruct((4, 16), jnp.int32)
  step = [t.lower_train_step(0, {"inputs": tokens, "targets": tokens}).as_text()
          for t in trainers]
  init = [jax.jit(t._init).lower(t.seed_array).as_text() for t in trainers]
  assert step[0] == step[1] and init[0] == init[1]
  # ... and the seed still picks the parameters.
  params = [jax.tree.leaves(t.init_state().params) for t in trainers]
  assert any(not np.array_equal(a, b) for a, b in zip(*params))


def test_loss_falls_on_a_tiny_corpus(tmp_path, capsys):
  corpus = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 100, np.uint8)
  cfg = _config(stages=(Stage(seq_len=32, batch_size=8, steps=40, learning_rate=1e-2,
                              warmup_steps=5),), checkpoint_every=25)
  _, losses = _run(cfg, tmp_path, corpus)
  assert losses[1] > 5.0           # ~ln 256 at initialisation
  assert losses[40] < 0.5 * losses[1], losses
  # Without a progress bar, one line per checkpoint (and evaluation) shows progress in a log.
  # A checkpoint written in the background is "saving" on its line and "saved" once on disk;
  # the final one is waited for.
  out = capsys.readouterr().out.splitlines()
  lines = [line for line in out if line.startswith("step ")]
  assert [line.split(":")[0] for line in lines] == ["step 25/40 (stage 0)", "step 40/40 (stage 0)"]
  assert lines[0].endswith(" tokens/s, saving step 25"), lines
  assert lines[1].startswith(f"step 40/40 (stage 0): loss {losses[40]:.4f}, train_bpc ")
  assert lines[1].endswith(" tokens/s, saved step 40"), lines
  assert out.index("saved step 25") < out.index(lines[1])


def test_tensorboard_is_never_handed_a_value_that_is_not_finite(tmp_path, monkeypatch):
  """tensorboardX warns on stderr ("NaN or Inf found in input tensor") for a value that is not
  finite, before the run's own error line: such values go to metrics.jsonl only."""
  import types
  from longformer_jax.training.metrics import MetricsLog
  scalars = []

  class SummaryWriter:
    def __init__(self, logdir):
      del logdir

    def add_scalar(self, name, value, step):
      scalars.append((name, value, step))

    def close(self):
      pass

  monkeypatch.setitem(sys.modules, "tensorboardX",
                      types.SimpleNamespace(SummaryWriter=SummaryWriter))
  log = MetricsLog(tmp_path, 0)
  log.write(4, train_loss=5.5, valid_bpc=float("nan"), grad_norm=float("inf"))
  log.close()
  assert scalars == [("train_loss", 5.5, 4)]
  [record] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert record["train_loss"] == 5.5 and math.isnan(record["valid_bpc"])
  assert record["grad_norm"] == math.inf


def test_resume_after_sigterm_equals_uninterrupted(tmp_path):
  data = _bytes()
  cfg = _config()
  full, losses_full = _run(cfg, tmp_path / "a", data)
  assert full["status"] == "done" and sorted(losses_full) == [1, 2, 3, 4, 5, 6]

  def preempt(step, _):
    if step == 4:  # inside the second stage, between checkpoints (every 2 steps)
      os.kill(os.getpid(), signal.SIGTERM)

  losses_a = {}
  summary = train(cfg, tmp_path / "b", CharLMTask(data), progress=False,
                  step_hook=lambda s, m: (losses_a.__setitem__(s, m["loss"]), preempt(s, m)))
  assert summary["status"] == "preempted" and summary["step"] == 4
  assert (tmp_path / "b" / "checkpoints" / "4").is_dir()

  resumed, losses_b = _run(cfg, tmp_path / "b", data)
  assert resumed["status"] == "done" and sorted(losses_b) == [5, 6]
  for step in range(1, 7):
    assert {**losses_a, **losses_b}[step] == losses_full[step], step  # bit-identical

  # The metrics log holds each step once, and the curves were drawn.
  records = [json.loads(l) for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
  steps = [r["step"] for r in records if "train_loss" in r]
  assert steps == [1, 2, 3, 4, 5, 6]
  assert (tmp_path / "b" / "curves.png").stat().st_size > 1000


class _Announced:
  """A task's batches that call `announce()` as each batch is taken (just before its step is
  dispatched)."""

  def __init__(self, batches, announce):
    self._batches, self._announce = batches, announce
    self.state, self.load_state = batches.state, batches.load_state

  def __next__(self):
    self._announce()
    return next(self._batches)


def test_the_host_dispatches_the_next_step_before_reading_a_loss(tmp_path):
  """Single process: step t+1's batch is fetched and its step dispatched before step t's
  metrics reach the host (step_hook), except where the host needs the step itself: an
  evaluation, a checkpoint (here step 3 and the end) or SIGTERM. The losses are those of the
  in-memory loop (`Trainer.fit`), which reads every step at once, bit for bit."""
  events = []

  class Recorded(CharLMTask):
    def batches(self, *args, **kwargs):
      return _Announced(super().batches(*args, **kwargs), lambda: events.append("batch"))

  data = _bytes()
  cfg = _config(stages=(Stage(seq_len=16, batch_size=4, steps=6, learning_rate=3e-3),),
                checkpoint_every=3)
  summary = train(cfg, tmp_path, Recorded(data), progress=False,
                  step_hook=lambda step, m: events.append((step, m["loss"])))
  assert summary["status"] == "done" and summary["step"] == 6
  order = [e if e == "batch" else e[0] for e in events]
  assert order == ["batch", "batch", 1, "batch", 2, 3, "batch", "batch", 4, "batch", 5, 6]
  trainer = Trainer(cfg, task=CharLMTask(data))
  _, fit = trainer.fit(trainer.init_state(None), 0)
  assert [e[1] for e in events if e != "batch"] == fit


class _Slow(CharLMTask):
  """A char-LM task whose steps are deliberately slow on the device (a chain of `matmuls`
  256 x 256 matrix products added to the loss times zero: the same loss and gradients, bit for
  bit), and that records when each batch is taken: just before its step is dispatched."""

  def __init__(self, data, matmuls):
    super().__init__(data)
    self.matmuls, self.fetched = matmuls, []

  def loss(self, model, batch, stage, dropout_key):
    x_CxC = jnp.full((256, 256), 1 / 256, jnp.float32) + batch["inputs"][0, 0] * 0
    x_CxC = jax.lax.fori_loop(0, self.matmuls, lambda _, x: jnp.tanh(x @ x), x_CxC)
    return super().loss(model, batch, stage, dropout_key) + 0 * jnp.sum(x_CxC)

  def batches(self, *args, **kwargs):
    return _Announced(super().batches(*args, **kwargs),
                      lambda: self.fetched.append(time.perf_counter()))


@pytest.mark.parametrize("read_every", [1, 3])
def test_the_host_dispatches_step_t_plus_1_while_step_t_runs(tmp_path, read_every):
  """Timestamps with a deliberately slow step (600 chained matrix products on the device): the
  host takes step t+1's batch and dispatches it while step t still runs, well before step t's
  loss reaches it (read when the step completes); with read_every=3 the host reads 3 steps at a
  time. The
  losses are those of the in-memory loop (`Trainer.fit`, which reads every step at once) bit
  for bit."""
  data, read = _bytes(), {}
  cfg = _config(stages=(Stage(seq_len=16, batch_size=4, steps=7, learning_rate=3e-3),),
                checkpoint_every=1000, read_every=read_every)
  task = _Slow(data, matmuls=600)
  summary = train(cfg, tmp_path, task, progress=False,
                  step_hook=lambda step, m: read.__setitem__(step, (time.perf_counter(),
                                                                    m["loss"])))
  assert summary["status"] == "done" and sorted(read) == list(range(1, 8))
  # task.fetched[t] is step t+1's batch. read[t] is when step t's loss reached the host: when
  # step t completed, or later.
  ahead = [read[t][0] - task.fetched[t] for t in range(1, 7)]
  if read_every == 1:
    step_s = min(read[t + 1][0] - read[t][0] for t in range(2, 6))
    assert step_s > 0.02, step_s  # the step is slow enough to tell dispatch from completion
    # Step t+1 was dispatched while step t ran: most of a step before t's loss was read.
    assert all(gap > 0.5 * step_s for gap in ahead[1:]), (ahead, step_s)
    assert ahead[0] > 0, ahead  # step 1's completion includes compiling step 1
  else:
    # Steps 1-3 are read once step 4 is dispatched, 4-6 once step 7 (the last, read at once).
    assert all(read[t][0] > task.fetched[3] for t in (1, 2, 3)), (read, task.fetched)
    assert all(read[t][0] > task.fetched[6] for t in (4, 5, 6)), (read, task.fetched)
    assert all(read[t][0] < task.fetched[4] for t in (1, 2, 3)), (read, task.fetched)
  trainer = Trainer(cfg, task=_Slow(data, matmuls=600))
  _, fit = trainer.fit(trainer.init_state(None), 0)
  assert [read[t][1] for t in range(1, 8)] == fit


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
  data = _bytes()
  cfg = _config(stages=(Stage(seq_len=16, batch_size=4, steps=2, learning_rate=1e-2),),
                checkpoint_every=1000)
  _, plain = _run(cfg, tmp_path / "a", data)
  _, accum = _run(dataclasses.replace(cfg, microbatch_size=2), tmp_path / "b", data)
  for step in plain:
    np.testing.assert_allclose(accum[step], plain[step], rtol=1e-5)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  # Three sane steps, then a learning rate that blows the parameters up: the update of step 4
  # gives finite parameters whose loss or gradients are not, so step 4 is not saved and step 3
  # is named; resuming from it at a sane rate finishes the run.
  stages = (Stage(seq_len=16, batch_size=4, steps=3, learning_rate=3e-3),
            Stage(seq_len=16, batch_size=4, steps=3, learning_rate=1e30))
  cfg = _config(stages=stages, checkpoint_every=1, clip_norm=1e30)
  with pytest.raises(NonFiniteLossError, match=r"step 4 .*last good checkpoint is step 3 "):
    _run(cfg, tmp_path, _bytes())
  saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert saved == [2, 3]
  fixed = dataclasses.replace(cfg, stages=(stages[0], dataclasses.replace(
      stages[1], learning_rate=1e-3)))
  summary, losses = _run(fixed, tmp_path, _bytes(), allow_changes=["stages.1.learning_rate"])
  assert summary["step"] == 6 and sorted(losses) == [4, 5, 6]
  assert all(np.isfinite(list(losses.values())))


@pytest.mark.parametrize("checkpoint_every, read_every, stopped", [
    (1, 1, "the update of step 1 diverged"), (4, 3, "loss is nan .* at step 2 ")])
def test_a_run_that_diverges_at_once_has_no_good_checkpoint(tmp_path, checkpoint_every,
                                                            read_every, stopped):
  # (1, 1): step 1's health check before its checkpoint. (4, 3): steps 1-3 are read together
  # after step 4 is dispatched; the first non-finite loss (step 2's: step 1's update diverged)
  # stops the run before step 4 is read and saved.
  cfg = _config(stages=(Stage(seq_len=16, batch_size=4, steps=6, learning_rate=1e30),),
                checkpoint_every=checkpoint_every, read_every=read_every, clip_norm=1e30)
  with pytest.raises(NonFiniteLossError, match=stopped + ".*No good checkpoint exists yet"):
    _run(cfg, tmp_path, _bytes())
  assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]


_MULTI_DEVICE = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from longformer_jax import checkpoint
    from longformer_jax.config import CharLMConfig
    from longformer_jax.tasks.charlm import CharLMTask, evaluate_bpc
    from longformer_jax.training import Stage, TrainConfig, Trainer, make_mesh
    assert jax.device_count() == 4, jax.devices()
    cfg = TrainConfig(model=CharLMConfig(num_hidden_layers=2, hidden_size=32,
                                         num_attention_heads=2, intermediate_size=64,
                                         attention_window=(4, 8)),
                      stages=(Stage(seq_len=16, batch_size=8, steps=3, learning_rate=1e-2),),
                      microbatch_size=4)
    tokens = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)
    out = {}
    # (data, fsdp) and (data, fsdp, seq): seq splits each 16-byte row into 2 or 4 pieces, shorter
    # than the 8-byte window of layer 2 reaches (halos spanning several shards). Pure data
    # parallelism, (4, 1), is left out for time: (2, 2) and (2, 1, 2) split the data too.
    for shape in [(1, 1), (2, 2), (1, 4), (1, 1, 4), (2, 1, 2), (1, 2, 2)]:
      devices = jax.devices()[:int(np.prod(shape))]
      trainer = Trainer(cfg, make_mesh(shape, devices), task=CharLMTask())
      state = trainer.init_state()
      # Checkpoint checksums of the sharded state equal those of the same values on one device.
      sharded_sums = checkpoint.checksums(state.params)
      host_sums = checkpoint.checksums(jax.device_get(state.params))
      step = trainer.train_step(0)
      losses = []
      for _ in range(3):
        batch = trainer.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, 8)
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
      emb = state.params["embed"]["embedding"]
      shard_shape = lambda x: list(x.addressable_shards[0].data.shape)
      out[str(shape)] = {"losses": losses, "emb_shard_shape": shard_shape(emb),
                         "checksums_equal": sharded_sums == host_sums,
                         "batch_shard_shape": shard_shape(batch["inputs"])}
      # Evaluation with the batch sharded over the same mesh (5 windows: padded to 8 rows).
      out[str(shape)]["bpc"] = evaluate_bpc(trainer.model(state.params), tokens.ravel()[:80],
                                            context=16, stride=16, batch_size=3,
                                            mesh=trainer.mesh)
    print(json.dumps(out))
""")


def test_four_simulated_devices_match_one_device():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).parents[1]))
  proc = subprocess.run([sys.executable, "-c", _MULTI_DEVICE], env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  ref = out["(1, 1)"]["losses"]
  for shape, result in out.items():
    np.testing.assert_allclose(result["losses"], ref, rtol=2e-6, err_msg=shape)
    np.testing.assert_allclose(result["bpc"], out["(1, 1)"]["bpc"], rtol=2e-6, err_msg=shape)
    assert result["checksums_equal"], shape
  # fsdp really shards the embedding's `embed` dimension (32 / 4 = 8 columns per device); seq
  # replicates it.
  assert out["(1, 4)"]["emb_shard_shape"] == [256, 8]
  assert out["(2, 2)"]["emb_shard_shape"] == [256, 16]
  assert out["(1, 1, 4)"]["emb_shard_shape"] == [256, 32]
  assert out["(1, 2, 2)"]["emb_shard_shape"] == [256, 16]
  # The batch's length is split over seq: a device holds 16 / 4 bytes of each of its rows.
  assert out["(1, 1, 4)"]["batch_shard_shape"] == [8, 4]
  assert out["(2, 1, 2)"]["batch_shard_shape"] == [4, 8]


def test_config_errors_name_the_bad_value():
  with pytest.raises(ValueError, match="stages is empty"):
    _config(stages=())
  with pytest.raises(ValueError, match="not a multiple of microbatch_size=3"):
    _config(microbatch_size=3)
  with pytest.raises(ValueError, match=r"stages\[0\].windows has 1 entries"):
    Trainer(_config(stages=(Stage(seq_len=16, batch_size=4, steps=1, learning_rate=1.0,
                                  windows=(3,)),)), task=CharLMTask())
  with pytest.raises(ValueError, match="attention_window of layer 1 must be an int >= 1"):
    Stage(seq_len=16, batch_size=4, steps=1, learning_rate=1.0, windows=(3, 0))
  with pytest.raises(ValueError, match="Stage.warmup_steps"):
    Stage(seq_len=16, batch_size=4, steps=1, learning_rate=1.0, warmup_steps=2)
  with pytest.raises(ValueError, match="does not use the 1 devices"):
    Trainer(_config(mesh_shape=(2, 1)), task=CharLMTask())
  with pytest.raises(ValueError, match=r"seq=4\) does not use the 1 devices"):
    Trainer(_config(mesh_shape=(1, 1, 4)), task=CharLMTask())
  for bad in [(1,), (1, 1, 1, 1), (1.5, 1), "(1, 1)", (True, 1)]:
    with pytest.raises(ValueError, match=r"\(data, fsdp\) or \(data, fsdp, seq\) ints, got "
                       + re.escape(repr(bad))):
      _config(mesh_shape=bad)
  for bad in [(-1, -1), (1, -1, -1), (0, 1), (1, 1, -2)]:
    with pytest.raises(ValueError, match=r"at most one of them, got " + re.escape(repr(bad))):
      _config(mesh_shape=bad)
  with pytest.raises(ValueError, match="trains a CharLMConfig model, got LongformerConfig"):
    Trainer(_config(model=LongformerConfig(num_hidden_layers=2, hidden_size=32,
                                           num_attention_heads=2, intermediate_size=64)),
            task=CharLMTask())


def test_logical_rules_cover_every_parameter_axis():
  assert set(LOGICAL_AXES) | {"batch", "length"} == {name for name, _ in LOGICAL_RULES}


def test_mesh_axes_and_batch_shardings():
  assert make_mesh((-1, 1)).shape == {"data": 1, "fsdp": 1, "seq": 1}
  assert make_mesh((1, 1, -1)).shape == {"data": 1, "fsdp": 1, "seq": 1}
  assert _config(mesh_shape=[2, 1, 4]).mesh_shape == (2, 1, 4)
  # The layout only needs the axis sizes: an abstract 8-device mesh.
  mesh = AbstractMesh((2, 1, 4), ("data", "fsdp", "seq"))
  spec = lambda shape, rules=LOGICAL_RULES: batch_sharding(mesh, rules, shape).spec
  batch = ("data", "fsdp")
  assert spec((8, 16)) == P(batch, "seq")          # [batch, length]: the length over seq
  assert spec((8,)) == P(batch)                    # [batch]: rows only
  assert spec((8, 3, 16)) == P(batch, None, None)  # not [batch, length]: rows only
  assert spec((8, 6)) == P(batch, None)            # a length that does not divide stays whole
  assert spec(()) == P()
  # Run configs written before the `length` rule existed keep whole sequences.
  old = tuple(r for r in LOGICAL_RULES if r[0] != "length")
  assert spec((8, 16), old) == P(batch, None)
  assert seq_axis(mesh) == "seq" and seq_axis(make_mesh((-1, 1))) is None


def test_run_config_round_trip(tmp_path):
  cfg = _config(model=CharLMConfig.small(), stages=paper_stages(CharLMConfig.small()),
                microbatch_size=16, mesh_shape=(-1, 4),
                final_eval=dict(split="test", context=512, stride=256))
  write_run_config(tmp_path, cfg)
  record = json.loads((tmp_path / "run_config.json").read_text())
  assert record["model_config_class"] == "CharLMConfig"
  assert record["model"]["dtype"] == "bfloat16"
  assert read_run_config(tmp_path) == cfg


class _MaskedLMTask(Task):
  """A second task through the same loop, sharding and checkpoints: masked-token prediction with
  `LongformerForMaskedLM`, whose dropout layers keep RNG streams (non-parameter state)."""

  def build_model(self, config, rngs, mesh=None, seq_axis=None):
    return LongformerForMaskedLM(config, rngs=rngs, mesh=mesh, seq_axis=seq_axis)

  def loss(self, model, batch, stage, dropout_key):
    nnx.reseed(model, default=dropout_key)  # the dropout layers draw from `default`
    logits = model(batch["input_ids"]).logits
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    return jnp.sum(nll * batch["weights"]) / jnp.maximum(jnp.sum(batch["weights"]), 1.0)

  def batches(self, cfg, stage_index, *, process_index, process_count):
    return _MaskedBatches(cfg.seed + stage_index, cfg.stages[stage_index])


class _MaskedBatches:
  """Random token rows, 25% of them masked (id 3); a function of (seed, step)."""

  def __init__(self, seed, stage):
    self.seed, self.stage, self.step = seed, stage, 0

  def __next__(self):
    rng = np.random.default_rng((self.seed, self.step))
    self.step += 1
    labels = rng.integers(4, 32, (self.stage.batch_size, self.stage.seq_len)).astype(np.int32)
    masked = rng.random(labels.shape) < 0.25
    return {"input_ids": np.where(masked, 3, labels).astype(np.int32), "labels": labels,
            "weights": masked.astype(np.float32)}

  def state(self):
    return {"step": self.step}

  def load_state(self, state):
    self.step = int(state["step"])


def _masked_lm_interrupted_and_resumed(cfg, tmp_path):
  """`cfg` on `_MaskedLMTask` run through in tmp_path/a, and in tmp_path/b stopped by SIGTERM
  after step 2 and resumed: (the uninterrupted losses, the interrupted run's and the resumed
  run's losses by step, the interrupted run's summary)."""
  full, losses_full = _run(cfg, tmp_path / "a", None, task=_MaskedLMTask())
  assert full["status"] == "done" and sorted(losses_full) == [1, 2, 3, 4]

  def preempt(step, _):
    if step == 2:
      os.kill(os.getpid(), signal.SIGTERM)

  losses = {}
  summary = train(cfg, tmp_path / "b", _MaskedLMTask(), progress=False,
                  step_hook=lambda s, m: (losses.__setitem__(s, m["loss"]), preempt(s, m)))
  _, losses_b = _run(cfg, tmp_path / "b", None, task=_MaskedLMTask())
  return losses_full, {**losses, **losses_b}, summary


def test_another_task_reuses_the_loop_and_resumes_exactly(tmp_path):
  cfg = _config(model=_SMALL_MLM, microbatch_size=2, checkpoint_every=1000,
                stages=(Stage(seq_len=16, batch_size=4, steps=4, learning_rate=1e-2),))
  losses_full, losses, summary = _masked_lm_interrupted_and_resumed(cfg, tmp_path)
  # Step 2's loss is read while step 3 runs (the host runs a step ahead): step 3 is saved.
  assert summary["status"] == "preempted" and summary["step"] == 3
  assert losses == losses_full  # bit-identical, dropout included
  assert read_run_config(tmp_path / "b").model == _SMALL_MLM


def test_fit_trains_in_memory_as_train_does(tmp_path):
  """`Trainer.fit` (no workdir) takes the same steps as `train` on the same batches: equal losses
  for the first stage; a non-finite loss stops it, naming the step."""
  cfg = _config(stages=_config().stages[:1])
  data = _bytes()
  _, losses_train = _run(cfg, tmp_path / "run", data)
  trainer = Trainer(cfg, task=CharLMTask(data))
  seen = []
  state, losses = trainer.fit(trainer.init_state(), on_step=lambda s, x: seen.append((s, x)))
  assert losses == [losses_train[s] for s in sorted(losses_train)]
  assert seen == list(enumerate(losses, start=1)) and int(state.step) == 3
  diverging = dataclasses.replace(cfg, stages=(dataclasses.replace(cfg.stages[0],
                                                                   learning_rate=1e30),))
  trainer = Trainer(diverging, task=CharLMTask(data))
  with pytest.raises(NonFiniteLossError, match=r"at step \d of fit\(\)"):
    trainer.fit(trainer.init_state())



def _params_after_fit(cfg):
  """{path: parameter} before and after `cfg`'s steps on `_MaskedLMTask`'s batches, and the
  losses."""
  from longformer_jax.training.schedule import param_path
  trainer = Trainer(cfg, task=_MaskedLMTask())
  state = trainer.init_state()
  flat = lambda params: {param_path(p): np.asarray(x)
                         for p, x in jax.tree_util.tree_leaves_with_path(params)}
  before = flat(state.params)
  state, losses = trainer.fit(state)
  return before, flat(state.params), losses, state


def test_trainable_freezes_every_other_parameter_bit_for_bit():
  cfg = _config(model=_SMALL_MLM, stages=(Stage(seq_len=16, batch_size=4, steps=3,
                                                learning_rate=1e-2),),
                trainable=_POSITIONS)
  before, after, _, state = _params_after_fit(cfg)
  assert _POSITIONS in before and len(before) > 20
  for path in before:
    if path == _POSITIONS:
      assert not np.array_equal(before[path], after[path])
    else:  # frozen: exactly the initial bits (no update, no weight decay)
      assert before[path].tobytes() == after[path].tobytes(), path
  # Adam's moments exist for the trained parameter only.
  moments = [x for x in jax.tree.leaves(state.opt_state) if getattr(x, "ndim", 0) >= 1]
  assert [m.shape for m in moments] == [before[_POSITIONS].shape] * 2
  # All trained: every parameter moves; a pattern matching every path is the same run.
  everything = dataclasses.replace(cfg, trainable=None)
  before_all, after_all, losses_all, _ = _params_after_fit(everything)
  assert all(not np.array_equal(before_all[p], after_all[p]) for p in before_all
             if "_global" not in p)  # no global tokens: the global projections get no gradient
  _, after_any, losses_any, _ = _params_after_fit(dataclasses.replace(cfg, trainable="."))
  assert losses_any == losses_all
  assert all(after_any[p].tobytes() == after_all[p].tobytes() for p in after_all)


def test_trainable_errors_name_the_pattern():
  with pytest.raises(ValueError, match=r"TrainConfig.trainable='\(' is not a regular expression"):
    _config(trainable="(")
  with pytest.raises(ValueError, match="TrainConfig.trainable is empty"):
    _config(trainable="")
  with pytest.raises(TypeError, match=r"TrainConfig.trainable must be a regular expression \(str\) "
                     r"or None, got \['position'\]"):
    _config(trainable=["position"])
  with pytest.raises(ValueError, match=r"trainable='positions_embedding' matches none of the "
                     r"model's \d+ parameters \(paths such as \['lm_head/bias'"):
    Trainer(_config(model=_SMALL_MLM, trainable="positions_embedding"), task=_MaskedLMTask())


def test_a_run_with_frozen_parameters_resumes_exactly(tmp_path):
  cfg = _config(model=_SMALL_MLM, trainable="position_embeddings|lm_head/bias",
                checkpoint_every=1000,
                stages=(Stage(seq_len=16, batch_size=4, steps=4, learning_rate=1e-2),))
  losses_full, losses, summary = _masked_lm_interrupted_and_resumed(cfg, tmp_path)
  assert summary["status"] == "preempted" and summary["step"] == 3
  assert losses == losses_full  # bit-identical
  assert read_run_config(tmp_path / "b").trainable == cfg.trainable
  # Which parameters train is part of the run: another pattern is another run.
  with pytest.raises(RunMismatchError, match=r"trainable: 'position_embeddings\|lm_head/bias' "
                     r"-> None"):
    _run(dataclasses.replace(cfg, trainable=None), tmp_path / "b", None, task=_MaskedLMTask())


def test_optimizer_state_is_sharded_like_its_parameters():
  """`optimizer_shardings` against optax.tree_map_params (the reference, for the optimizer it can
  see into), with each parameter's "sharding" its path; with frozen parameters, the moments of
  the trained ones only."""
  from longformer_jax.training.loop import optimizer_shardings
  from longformer_jax.training.schedule import make_optimizer, param_path
  _, params, _ = nnx.split(nnx.eval_shape(lambda: LongformerForMaskedLM(_SMALL_MLM,
                                                                       rngs=nnx.Rngs(0))),
                           nnx.Param, ...)
  names = jax.tree_util.tree_map_with_path(lambda path, _: param_path(path), params)
  optimizer = make_optimizer(_config(model=_SMALL_MLM))
  state = jax.eval_shape(optimizer.init, params)
  expected = optax.tree_map_params(optimizer, lambda _, s: s, state, names,
                                   transform_non_params=lambda _: "replicated")
  assert optimizer_shardings(state, names, "replicated") == expected
  assert len(set(jax.tree.leaves(expected))) == len(jax.tree.leaves(params)) + 1
  frozen = make_optimizer(_config(model=_SMALL_MLM, trainable=_POSITIONS))
  state = jax.eval_shape(frozen.init, params)
  got = jax.tree.leaves(optimizer_shardings(state, names, "replicated"))
  assert sorted(set(got)) == [_POSITIONS, "replicated"] and got.count(_POSITIONS) == 2
