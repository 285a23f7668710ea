"""Helpers shared by the test files: reproducible seeds, per-dtype tolerances, one closeness
assertion, random attention inputs, the `GRID` parametrization hook of tests/conftest.py, and the
reference runs one session shares (`shared_run`; the char-LM run of conftest's `charlm_run`).

Only jax, numpy and pytest are imported here (no torch, no model code),
so any test may import it; torch-based helpers live in tests/hf_testing.py. Test modules import
helpers from here (`from testing import ...`: pyproject's pytest `pythonpath` puts tests/ on the
path), never from another test module.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest


ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# Seeds


def seed_of(*parts) -> int:
  """A seed in [0, 2**32) from `parts`, the same in every process: the crc32 of their `str`s
  joined by '/' (so `seed_of(case) == zlib.crc32(str(case).encode())`). Never use `hash()`:
  Python salts string hashes per process, so a failure could not be reproduced."""
  return zlib.crc32("/".join(str(part) for part in parts).encode())


# ---------------------------------------------------------------------------------------------
# Tolerances and comparison

# `assert_close` tolerance of a kernel against the reference run on the SAME inputs in the same
# dtype (error relative to max(1, max |reference|)).
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}
# `np.testing.assert_allclose` atol = rtol of a 16-bit run against the float32 reference run on
# the same (16-bit-rounded) inputs: the 16-bit arithmetic itself adds error, hence looser.
TOLERANCE_VS_FLOAT32 = {"bfloat16": 2e-2, "float16": 2e-2}


def tolerance(dtype, table=None) -> float:
  """`table[dtype]` (default `TOLERANCE`) for any spelling of the dtype (jnp.bfloat16,
  np.float32, 'float16', ...)."""
  return (TOLERANCE if table is None else table)[jnp.dtype(dtype).name]


def assert_close(actual, expected, tol: float, what: str):
  """Asserts `actual` is finite and max |actual - expected| <= tol * max(1, max |expected|),
  comparing in float32; `what` names the quantity in the failure message."""
  actual = np.asarray(jnp.asarray(actual, jnp.float32))
  expected = np.asarray(jnp.asarray(expected, jnp.float32))
  assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
  scale = max(1.0, float(np.max(np.abs(expected))))
  err = float(np.max(np.abs(actual - expected))) / scale
  assert err <= tol, f"{what}: max error {err:.3g} (relative to scale {scale:.3g}) > {tol}"


# ---------------------------------------------------------------------------------------------
# Random attention inputs


def random_normal(rng: np.random.Generator, shape, dtype, count: int):
  """`count` arrays ~ N(0, 1) of `shape`, drawn from `rng` in order, cast to `dtype`."""
  return [jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(count)]


def make_band_inputs(seed: int, batch: int, seq: int, heads: int, head_dim: int, dtype,
                     mask_kind: str):
  """Inputs of a band kernel: q, k, v ~ N(0, 1) [batch, seq, heads, head_dim] in `dtype`, and a
  [batch, seq] bool key_mask: 'all' real, 'holes' (~25% padding, scattered), or 'holes+empty'
  (holes, and batch row 0 with every key masked)."""
  rng = np.random.default_rng(seed)
  q, k, v = random_normal(rng, (batch, seq, heads, head_dim), dtype, 3)
  key_mask = np.ones((batch, seq), bool)
  if mask_kind != "all":
    key_mask &= rng.random((batch, seq)) > 0.25
  if mask_kind == "holes+empty":
    key_mask[0] = False
  return q, k, v, jnp.asarray(key_mask)


@dataclasses.dataclass(frozen=True)
class AttentionCase:
  """One configuration of `longformer_attention`; `str` is its test id (and its seed source)."""
  batch: int
  seq: int
  heads: int
  window: int
  dilation: int | tuple = 1
  causal: bool = False
  padding: bool = False
  max_globals: int = 0  # up to this many global tokens per row, a different count per row
  head_dim: int = 8

  def __str__(self):
    return "-".join(f"{k}{v}" for k, v in dataclasses.asdict(self).items())


def make_attention_inputs(case: AttentionCase, seed: int, dtype=jnp.float32):
  """Random q, k, v (+ global ones) and the op's keyword arguments for `case`: masks with a
  different padding length / global count per row. Returns ((q, k, v), kwargs), kwargs holding
  window, dilation, causal, attention_mask and, with globals, global_mask and global_qkv."""
  rng = np.random.default_rng(seed)
  shape = (case.batch, case.seq, case.heads, case.head_dim)
  q, k, v, q_g, k_g, v_g = random_normal(rng, shape, dtype, 6)
  lengths = [case.seq] + [int(rng.integers(1, case.seq + 1)) for _ in range(case.batch - 1)]
  if not case.padding:
    lengths = [case.seq] * case.batch
  attention_mask = np.arange(case.seq)[None, :] < np.array(lengths)[:, None]
  global_mask = np.zeros((case.batch, case.seq), bool)
  for b, length in enumerate(lengths):
    count = min(case.max_globals, length) - (b % 2 if case.max_globals else 0)
    if count > 0:
      global_mask[b, rng.choice(length, size=count, replace=False)] = True
  kwargs = dict(window=case.window, dilation=case.dilation, causal=case.causal,
                attention_mask=jnp.asarray(attention_mask))
  if case.max_globals:
    kwargs.update(global_mask=jnp.asarray(global_mask), global_qkv=(q_g, k_g, v_g))
  return (q, k, v), kwargs


def expected_keys(case: AttentionCase, attention_mask, global_mask, b: int, i: int, head: int):
  """docs/design.md §1 with Python sets: (local keys, global-projection keys) of query i."""
  real = {j for j in range(case.seq) if attention_mask[b, j]}
  if i not in real:
    return set(), set()
  if global_mask is not None and global_mask[b, i]:
    return set(), real
  d = case.dilation if isinstance(case.dilation, int) else case.dilation[head]
  steps = range(0, case.window + 1) if case.causal else range(-case.window, case.window + 1)
  band = {i - d * t for t in steps} if case.causal else {i + d * t for t in steps}
  globals_ = set() if global_mask is None else {j for j in real if global_mask[b, j]}
  return (band & real) | globals_, set()


# ---------------------------------------------------------------------------------------------
# The GRID hook (called by tests/conftest.py's pytest_generate_tests)

GRID_ARG = "grid_case"


def parametrize_grid(metafunc):
  """A test taking `grid_case` runs once per entry of its class's `GRID`, with id `str(entry)`,
  so a subclass that reruns a suite (another implementation, compiled vs interpret) can choose
  its own grid."""
  if GRID_ARG not in metafunc.fixturenames:
    return
  grid = getattr(metafunc.cls, "GRID", None)
  if grid is None:
    pytest.fail(f"{metafunc.function.__qualname__} takes `{GRID_ARG}`, but its class has no "
                "GRID attribute", pytrace=False)
  metafunc.parametrize(GRID_ARG, grid, ids=str)


# ---------------------------------------------------------------------------------------------
# Encoder models: the tiny shape and inputs shared by the model, Linen, conversion and HF parity
# tests (same shapes everywhere, so eager ops compiled for one test are reused by the next).

BATCH, SEQ, VOCAB = 3, 23, 64
SEP = 2
# head_dim 16: the smallest the Pallas kernels take, so every implementation runs on these.
ENCODER_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
                     num_attention_heads=4, intermediate_size=96, max_position_embeddings=40,
                     type_vocab_size=2, layer_norm_eps=1e-5)
# One-sided windows of the three layers (HF's totals: 4, 8, 6).
ENCODER_WINDOWS = (2, 4, 3)


def assert_study_claims(study: dict, study_lib, *, higher_is_better: bool | None) -> None:
  """Every comparison of a study's results JSON recomputed from its arms' per-seed values with
  experiments/study.py (`study_lib`): the difference of the means in the metric's better
  direction (not checked when higher_is_better is None), the detectable difference, the
  outcome."""
  assert study["comparisons"]
  for c in study["comparisons"]:
    better, worse = c["paper_says"].split(" better than ")
    a, b = study["arms"][better], study["arms"][worse]
    if higher_is_better is not None:
      sign = 1.0 if higher_is_better else -1.0
      assert c["difference"] == pytest.approx(sign * (a["mean"] - b["mean"]))
    if c.get("design", "independent") == "paired":
      assert c["paired_differences"] == pytest.approx(
          [(1.0 if c["difference"] * (a["mean"] - b["mean"]) >= 0 else -1.0) * (va - vb)
           for va, vb in zip(a["values"], b["values"])]), c["paper_says"]
      expected = study_lib.detectable_paired_difference(c["paired_differences"])
    else:
      expected = study_lib.detectable_difference(a["values"], b["values"])
    assert c["detectable_difference"] == pytest.approx(expected), c["paper_says"]
    assert c["outcome"] == study_lib.outcome(c["difference"], c["detectable_difference"])


def run_tiny_study(main, out, seeds, *args) -> dict:
  """Runs a study's `main` at its --tiny size with `seeds` (and `args`) writing `out`: its JSON
  (read back) with the study's name and verdict, and a PNG beside it."""
  assert main(["--tiny", "--seeds", *map(str, seeds), "--out", str(out), *args]) == 0
  assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  study = json.loads(out.read_text())
  assert study["verdict"] and study["setup"]["seeds"] == list(seeds)
  return study


def assert_paired_task(entry: dict, arms, study_lib) -> None:
  """A task of a paired study (its arms start each seed alike): the arms, and every comparison
  paired and recomputed from the per-seed values (`assert_study_claims`, higher is better)."""
  assert set(entry["arms"]) == set(arms)
  assert_study_claims(entry, study_lib, higher_is_better=True)
  assert entry["comparisons"][0]["design"] == "paired"
  assert entry["detectable_difference"]["design"] == "paired"


def tiny_encoder_config(**changes):
  """A `LongformerConfig` of ENCODER_SHAPE with windows ENCODER_WINDOWS, plus `changes`."""
  from longformer_jax.config import LongformerConfig
  return LongformerConfig(**{**ENCODER_SHAPE, "attention_window": ENCODER_WINDOWS, **changes})


def make_model_inputs(seed: int = 0) -> dict[str, np.ndarray]:
  """[BATCH, SEQ] inputs: rows of length 23, 17 and 9 (padding), <s> q </s></s> c </s> layout
  (so HF's QA/multiple-choice defaults apply), 3, 1 and 0 global tokens (row 1 also marks a
  padding token, which must be ignored), and random token types."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(4, VOCAB, (BATCH, SEQ))
  attention_mask = np.zeros((BATCH, SEQ), np.int64)
  for b, (length, question) in enumerate(zip([SEQ, 17, 9], [3, 5, 2])):
    ids[b, 0] = 0
    ids[b, [question + 1, question + 2, length - 1]] = SEP
    ids[b, length:] = 1  # pad token
    attention_mask[b, :length] = 1
  global_mask = np.zeros((BATCH, SEQ), np.int64)
  global_mask[0, [0, 5, 6]] = 1
  global_mask[1, [0, 20]] = 1
  return dict(input_ids=ids, attention_mask=attention_mask, global_attention_mask=global_mask,
              token_type_ids=rng.integers(0, 2, (BATCH, SEQ)))


# ---------------------------------------------------------------------------------------------
# Reference runs shared by the whole session


def shared_dir(tmp_path_factory) -> Path:
  """A directory of this test session that every xdist worker sees (the parent of the workers'
  base temp directories; pytest's base temp without xdist)."""
  base = tmp_path_factory.getbasetemp()
  return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_run(tmp_path_factory, name: str, make) -> Path:
  """The directory `name` of `shared_dir`, filled once per session by `make(directory)`: the
  first worker to ask makes it under a file lock while the others wait, so a reference run is
  trained once however many modules and workers read it. Read only: a test that changes a run
  copies it first. A `make` that fails leaves no directory (the next caller tries again)."""
  import fcntl
  import shutil
  root = shared_dir(tmp_path_factory)
  directory, done = root / name, root / f"{name}.done"
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not done.exists():
      shutil.rmtree(directory, ignore_errors=True)
      directory.mkdir()
      try:
        make(directory)
      except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
      done.touch()
  return directory


def shared_arrays(tmp_path_factory, name: str, compute) -> list[np.ndarray]:
  """The arrays `compute()` returns (a pytree), computed once per session under `name`
  (`shared_run`) and read back as a flat list: a reference result several test classes compare
  against, computed by whichever worker asks first."""
  def make(directory):
    leaves = [np.asarray(x) for x in jax.tree.leaves(compute())]
    np.savez(directory / "arrays.npz", *leaves)
  with np.load(shared_run(tmp_path_factory, name, make) / "arrays.npz") as arrays:
    return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


@dataclasses.dataclass(frozen=True)
class CharLMRun:
  """The session's tiny char-LM run (conftest's `charlm_run`): `python -m train.charlm --config
  config --data-file data --skip-final-eval` into `workdir`; `eval_data` is the last 400 bytes
  of `data`. Its stage's windows differ from the model's, so readers must take the run's."""
  workdir: Path
  config: Path
  data: Path
  eval_data: Path
  steps: int = 8
  checkpoints: tuple[int, ...] = (2, 4, 6, 8)


CHARLM_RUN_CONFIG = """
from longformer_jax.config import CharLMConfig
from longformer_jax.training import Stage, TrainConfig

def get_config():
  model = CharLMConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                       intermediate_size=64, attention_window=(4, 8))
  stages = (Stage(seq_len=16, batch_size=4, steps=8, learning_rate=3e-3, warmup_steps=1,
                  windows=(3, 6)),)
  return TrainConfig(model=model, dataset="enwik8_sample", stages=stages, eval_every=4,
                     eval_tokens=256, eval_batch_size=4, checkpoint_every=2,
                     keep_checkpoints=4, clip_norm=1.0)
"""


def charlm_command(config: Path, data: Path, workdir: Path, *args: str) -> list[str]:
  """The `python -m train.charlm` command line of a `CharLMRun`-like run."""
  return [sys.executable, "-m", "train.charlm", "--config", str(config), "--workdir",
          str(workdir), "--data-file", str(data), "--no-progress", "--skip-final-eval", *args]


def file_snapshot(path) -> dict[str, tuple[int, int]]:
  """(size, mtime) of every file under `path`, by path relative to it, but the workdir lock,
  which every job takes (and writes its pid into), whether its run is refused or not: equal
  snapshots of a directory before and after a move say that nothing in it changed."""
  from longformer_jax.commands.run import LOCK_FILE
  return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
          for p in Path(path).rglob("*") if p.is_file() and p.name != LOCK_FILE}


def largest_chunk(item_dir: Path) -> Path:
  """The largest array chunk file of a checkpoint item (e.g. <workdir>/checkpoints/8/params)."""
  return max((p for p in item_dir.rglob("*") if p.is_file() and p.parent.name == "d"),
             key=lambda p: p.stat().st_size)


def truncate_checkpoint(item_dir: Path) -> None:
  """Damages a checkpoint item as a write cut short would: its largest chunk file cut to a
  third (it no longer decodes)."""
  target = largest_chunk(item_dir)
  target.write_bytes(target.read_bytes()[:target.stat().st_size // 3])


def subprocess_env() -> dict[str, str]:
  """The environment of the command lines tests start: CPU, no libtpu start-up lines on
  stderr, no .pyc files (a test limiting the file size must hit the checkpoint)."""
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONDONTWRITEBYTECODE="1")


def make_charlm_run(directory: Path) -> CharLMRun:
  """Writes the run's inputs into `directory` and trains it (`shared_run`'s `make`)."""
  rng = np.random.default_rng(seed_of("charlm run data"))
  data = rng.integers(0, 256, 20_000).astype(np.uint8).tobytes()
  run = charlm_run_files(directory)
  run.data.write_bytes(data)
  run.eval_data.write_bytes(data[-400:])
  run.config.write_text(CHARLM_RUN_CONFIG)
  proc = subprocess.run(charlm_command(run.config, run.data, run.workdir), cwd=ROOT,
                        env=subprocess_env(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert [l for l in proc.stderr.splitlines() if l.strip()] == [], proc.stderr[-3000:]
  return run


def charlm_run_files(directory: Path) -> CharLMRun:
  return CharLMRun(workdir=directory / "run", config=directory / "config.py",
                   data=directory / "data.bin", eval_data=directory / "eval.bin")


# ---------------------------------------------------------------------------------------------
# Multi-device test modules


def rerun_on_devices(test_file: str, devices: int, timeout: int = 1500) -> None:
  """Runs the test module `test_file` in a subprocess with `devices` simulated CPU devices (the
  test process has one) and asserts that its cases ran and passed; prints pytest's summary."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
       test_file],
      cwd=Path(test_file).parent, env=env, capture_output=True, text=True, timeout=timeout)
  summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
  print(f"{devices}-device run of {Path(test_file).name}: {summary}")
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
  assert re.search(r"\d+ passed", summary) and "failed" not in summary, summary
