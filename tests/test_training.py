"""Training: golden first steps, learning, exact resume across SIGTERM and stages, accumulation,
non-finite loss, sharding on 4 simulated devices."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from longformer_jax.causal_lm import CharLMConfig
from longformer_jax.training import NonFiniteLossError, Stage, TrainConfig, Trainer, train

MODEL = CharLMConfig(num_layers=2, hidden=32, num_heads=2, mlp_dim=64, windows=(4, 8))


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
  summary = train(cfg, workdir, train_data=data, progress=False,
                  step_hook=lambda step, m: losses.__setitem__(step, m["loss"]), **kw)
  return summary, losses


def test_golden_first_steps():
  """Hard-coded reference: catches silent changes to init, the optimizer, the loss or data."""
  cfg = _config(stages=(Stage(seq_len=16, batch_size=4, steps=2, learning_rate=1e-2),))
  trainer = Trainer(cfg)
  state = trainer.init_state()
  tokens = _bytes(4 * 17).reshape(4, 17).astype(np.int32)
  x, y = trainer.global_batch(tokens[:, :-1], 4), trainer.global_batch(tokens[:, 1:], 4)
  step = trainer.train_step(0)
  state, m1 = step(state, x, y)
  state, m2 = step(state, x, y)
  np.testing.assert_allclose(
      [float(m1["loss"]), float(m1["grad_norm"]), float(m2["loss"])],
      GOLDEN, rtol=2e-5)
  assert int(state.step) == 2


GOLDEN = [5.563892364501953, 1.2804957628250122, 5.275964260101318]


def test_loss_falls_on_a_tiny_corpus(tmp_path):
  corpus = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 100, np.uint8)
  cfg = _config(stages=(Stage(seq_len=32, batch_size=8, steps=40, learning_rate=1e-2,
                              warmup_steps=5),), checkpoint_every=1000)
  _, losses = _run(cfg, tmp_path, corpus)
  assert losses[1] > 5.0           # ~ln 256 at initialisation
  assert losses[40] < 0.5 * losses[1], losses


def test_resume_after_sigterm_equals_uninterrupted(tmp_path):
  data = _bytes()
  cfg = _config()
  full, losses_full = _run(cfg, tmp_path / "a", data)
  assert full["status"] == "done" and sorted(losses_full) == [1, 2, 3, 4, 5, 6]

  def preempt(step, _):
    if step == 4:  # inside the second stage, between checkpoints (every 2 steps)
      os.kill(os.getpid(), signal.SIGTERM)

  losses_a = {}
  summary = train(cfg, tmp_path / "b", train_data=data, progress=False,
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


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
  data = _bytes()
  cfg = _config(stages=(Stage(seq_len=16, batch_size=4, steps=2, learning_rate=1e-2),),
                checkpoint_every=1000)
  _, plain = _run(cfg, tmp_path / "a", data)
  _, accum = _run(dataclasses.replace(cfg, microbatch_size=2), tmp_path / "b", data)
  for step in plain:
    np.testing.assert_allclose(accum[step], plain[step], rtol=1e-5)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  cfg = _config(stages=(Stage(seq_len=16, batch_size=4, steps=6, learning_rate=1e30),),
                checkpoint_every=1, clip_norm=1e30)
  with pytest.raises(NonFiniteLossError, match=r"last good checkpoint is step \d"):
    _run(cfg, tmp_path, _bytes())
  saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert saved and saved[-1] < 6


_MULTI_DEVICE = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from longformer_jax.causal_lm import CharLMConfig
    from longformer_jax.evaluation import evaluate_bpc
    from longformer_jax.training import Stage, TrainConfig, Trainer, make_mesh
    assert jax.device_count() == 4, jax.devices()
    cfg = TrainConfig(model=CharLMConfig(num_layers=2, hidden=32, num_heads=2, mlp_dim=64,
                                         windows=(4, 8)),
                      stages=(Stage(seq_len=16, batch_size=8, steps=3, learning_rate=1e-2),),
                      microbatch_size=4)
    tokens = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)
    out = {}
    for shape in [(1, 1), (4, 1), (2, 2), (1, 4)]:
      devices = jax.devices()[:shape[0] * shape[1]]
      trainer = Trainer(cfg, make_mesh(shape, devices))
      state = trainer.init_state()
      step = trainer.train_step(0)
      losses = []
      for _ in range(3):
        state, m = step(state, trainer.global_batch(tokens[:, :-1], 8),
                        trainer.global_batch(tokens[:, 1:], 8))
        losses.append(float(m["loss"]))
      emb = state.params["embed"]["embedding"]
      out[str(shape)] = {"losses": losses, "emb_shards": len(emb.addressable_shards),
                         "emb_shard_shape": list(emb.addressable_shards[0].data.shape)}
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
  # fsdp really shards the embedding's `embed` dimension (32 / 4 = 8 columns per device).
  assert out["(1, 4)"]["emb_shard_shape"] == [256, 8]
  assert out["(2, 2)"]["emb_shard_shape"] == [256, 16]
  assert out["(4, 1)"]["emb_shard_shape"] == [256, 32]


def test_config_errors_name_the_bad_value():
  with pytest.raises(ValueError, match="stages is empty"):
    _config(stages=())
  with pytest.raises(ValueError, match="not a multiple of microbatch_size=3"):
    _config(microbatch_size=3)
  with pytest.raises(ValueError, match=r"stages\[0\].windows has 1 entries"):
    _config(stages=(Stage(seq_len=16, batch_size=4, steps=1, learning_rate=1.0, windows=(3,)),))
  with pytest.raises(ValueError, match="Stage.warmup_steps"):
    Stage(seq_len=16, batch_size=4, steps=1, learning_rate=1.0, warmup_steps=2)
  with pytest.raises(ValueError, match="does not use the 1 devices"):
    Trainer(_config(mesh_shape=(2, 1)))
