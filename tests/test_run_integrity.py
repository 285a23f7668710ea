"""Run integrity, by fault injection on the real command lines (`python -m train.charlm`,
`python -m eval.bpc` in subprocesses): kill -9 at several points (mid-save, twice in a row,
between checkpoints), truncated, deleted and bit-flipped checkpoint files (weights, optimizer
state, meta), a run that diverges with a checkpoint every step, a failed save (a real EFBIG write
error from RLIMIT_FSIZE, as a full disk gives ENOSPC), and resumes whose settings differ.
Plus the pieces underneath: checksums, the resume rules of `training.identity`.

Every run here trains the same tiny model on the same random bytes, so the uninterrupted run
(`reference`: the session's shared `charlm_run`, tests/conftest.py) is what every interrupted or
damaged run must reproduce bit for bit.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orbax.checkpoint as ocp

from longformer_jax import checkpoint
from longformer_jax.tasks.charlm import CharLMTask, evaluate_run, split_of_file
from longformer_jax.training import (RunMismatchError, Trainer, check_resume,
                                     config_from_record, config_record, read_run_config)
from testing import (charlm_command, file_snapshot, largest_chunk, seed_of, subprocess_env,
                     truncate_checkpoint)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]

# Three sane steps, then a learning rate that blows the parameters up (with a checkpoint every
# step), on the shared run's model.
DIVERGING = '''
from longformer_jax.config import CharLMConfig
from longformer_jax.training import Stage, TrainConfig

def get_config():
  model = CharLMConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                       intermediate_size=64, attention_window=(4, 8))
  stages = (Stage(seq_len=16, batch_size=4, steps=3, learning_rate=3e-3),
            Stage(seq_len=16, batch_size=4, steps=3, learning_rate=1e30))
  return TrainConfig(model=model, dataset="enwik8_sample", stages=stages, eval_every=4,
                     eval_tokens=256, eval_batch_size=4, checkpoint_every=1,
                     keep_checkpoints=4, clip_norm=1e30)
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory, charlm_run):
  """This module's directory: the shared run's inputs (sane.py is its config, data.bin and
  eval.bin its bytes), other bytes, and the diverging config."""
  base = tmp_path_factory.mktemp("integrity")
  shutil.copyfile(charlm_run.data, base / "data.bin")
  shutil.copyfile(charlm_run.eval_data, base / "eval.bin")
  shutil.copyfile(charlm_run.config, base / "sane.py")
  rng = random.Random(seed_of("integrity data"))
  (base / "other.bin").write_bytes(bytes(rng.randrange(256) for _ in range(20_000)))
  (base / "diverging.py").write_text(DIVERGING)
  return base


def _train_command(files, workdir, *args, config="sane"):
  return charlm_command(files / f"{config}.py", files / "data.bin", workdir, *args)


def _run(command, **kw) -> subprocess.CompletedProcess:
  return subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                        timeout=600, **kw)


def _train(files, workdir, *args, config="sane", **kw):
  return _run(_train_command(files, workdir, *args, config=config), **kw)


def _bpc(workdir, *args, window=("--context", "16", "--stride", "8")):
  return _run([sys.executable, "-m", "eval.bpc", "--workdir", str(workdir), "--file",
               str(Path(workdir).parent / "eval.bin"), *window, "--no-progress", *args])


def _stderr_lines(proc) -> list[str]:
  return [line for line in proc.stderr.splitlines() if line.strip()]


def _losses(workdir) -> dict[int, float]:
  records = [json.loads(l) for l in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
  losses = {r["step"]: r["train_loss"] for r in records if "train_loss" in r}
  assert len(losses) == sum("train_loss" in r for r in records), "a step was logged twice"
  return losses


def _meta(workdir, step) -> dict:
  return checkpoint.read_meta(workdir, step)


@pytest.fixture(scope="module")
def reference(files, charlm_run):
  """The uninterrupted run (the session's `charlm_run`, copied here): checkpoints 2, 4, 6, 8."""
  workdir = files / "reference"
  shutil.copytree(charlm_run.workdir, workdir)
  assert checkpoint.checkpoint_steps(workdir) == [2, 4, 6, 8]
  return workdir


def _copy(reference, name) -> Path:
  target = reference.parent / name
  shutil.rmtree(target, ignore_errors=True)
  shutil.copytree(reference, target)
  return target


def _flip_bits(path: Path, count: int, seed: int) -> None:
  data = bytearray(path.read_bytes())
  rng = random.Random(seed)
  for _ in range(count):
    i = rng.randrange(len(data) // 4, 3 * len(data) // 4)
    data[i] ^= 1 << rng.randrange(8)
  path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------------------------
# kill -9


def _kill_when(command, ready, timeout=300) -> str:
  """Starts `command`, SIGKILLs it as soon as `ready()` holds (checked every millisecond) and
  returns what it wrote to stderr until then."""
  with subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE, text=True) as proc:
    deadline = time.time() + timeout
    try:
      while not ready():
        assert proc.poll() is None, "the run ended before the moment to kill it came"
        assert time.time() < deadline, "timed out waiting for the moment to kill the run"
        time.sleep(0.001)
      proc.send_signal(signal.SIGKILL)
    finally:
      proc.wait()
    return proc.stderr.read()


def _saving(workdir, step, again=False):
  """True while step's save is being written. again: a leftover of that name from a killed run
  is there at first; wait for the new run to remove it and start its own save."""
  path = Path(workdir) / "checkpoints" / f"{step}.orbax-checkpoint-tmp"
  gone = [not again]

  def ready():
    exists = path.exists()
    gone[0] = gone[0] or not exists
    return gone[0] and exists
  return ready


def _logged(workdir, step):
  def ready():
    path = Path(workdir) / "metrics.jsonl"
    return path.exists() and f'"step": {step},' in path.read_text()
  return ready


def test_kill_9_mid_save_twice_and_between_checkpoints_resumes_bit_identically(files,
                                                                               reference):
  workdir = files / "killed"
  command = _train_command(files, workdir)
  _kill_when(command, _saving(workdir, 4))        # mid-save of step 4
  assert checkpoint.checkpoint_steps(workdir) == [2]
  assert checkpoint.incomplete_saves(workdir) == ["4.orbax-checkpoint-tmp"]
  stderr = _kill_when(command, _saving(workdir, 4, again=True))  # again, in the resumed run
  assert checkpoint.checkpoint_steps(workdir) == [2]
  # What the first kill left was removed, and said so, before the second save began.
  assert stderr.splitlines()[0] == (
      f"warning: removing incomplete checkpoint directories an interrupted save left in "
      f"{workdir / 'checkpoints'}: 4.orbax-checkpoint-tmp")
  # Between checkpoints: step 7 done, step 6 on disk.
  _kill_when(command, lambda: _logged(workdir, 7)() and (workdir / "checkpoints" / "6").exists())
  assert checkpoint.checkpoint_steps(workdir) == [2, 4, 6]
  assert checkpoint.incomplete_saves(workdir) == []
  proc = _train(files, workdir)
  assert proc.returncode == 0, proc.stderr
  assert _losses(workdir) == _losses(reference)   # every step's loss, bit for bit
  for step in (6, 8):
    assert _meta(workdir, step)["checksums"] == _meta(reference, step)["checksums"]


# ----------------------------------------------------------------------------------------------
# Damaged checkpoints


def _damage(workdir: Path, kind: str, item: str = "params", step: int = 8) -> None:
  item_dir = workdir / "checkpoints" / str(step) / item
  if kind == "truncate":
    truncate_checkpoint(item_dir)
  elif kind == "delete":
    largest_chunk(item_dir).unlink()
  elif kind == "flip":
    # In the compressed chunks: the file may no longer decode, or decode to other values.
    _flip_bits(largest_chunk(item_dir), 64, seed_of(workdir.name))
  elif kind == "altered":
    # One weight one ulp off, written by Orbax itself: it decodes perfectly, and only the
    # checksums can tell.
    trainer = Trainer(read_run_config(workdir), task=CharLMTask())
    target = trainer.abstract_state().params if item == "params" else (
        trainer.abstract_state().opt_state)
    tree = ocp.StandardCheckpointer().restore(item_dir, target)
    leaves, treedef = jax.tree.flatten(tree)
    i = next(i for i, x in enumerate(leaves) if x.dtype == jnp.float32 and x.size > 1)
    corner = (0,) * leaves[i].ndim
    leaves[i] = leaves[i].at[corner].set(np.nextafter(leaves[i][corner], np.float32(np.inf)))
    writer = ocp.StandardCheckpointer()
    writer.save(item_dir, jax.tree.unflatten(treedef, leaves), force=True)
    writer.wait_until_finished()
  elif kind == "meta":
    path = next(p for p in item_dir.rglob("*") if p.is_file() and p.name == "metadata")
    path.write_text(path.read_text().replace('"stage": 0', '"stage": 1'))
  else:
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["truncate", "delete", "flip", "altered"])
def test_damaged_weights_are_skipped_by_evaluation(files, reference, kind):
  workdir = _copy(reference, f"damaged_params_{kind}")
  _damage(workdir, kind)

  proc = _bpc(workdir)
  assert proc.returncode == 0, proc.stderr
  assert len(_stderr_lines(proc)) == 1, proc.stderr
  [warning] = _stderr_lines(proc)
  assert warning.startswith(f"warning: skipping checkpoint step 8 in {workdir / 'checkpoints'} "
                            "(left as it is): step 8 params: ")
  if kind == "altered":
    assert "checksum mismatch in " in warning
  result = json.loads(next(workdir.glob("bpc_file_*.json")).read_text())
  data = np.frombuffer((files / "eval.bin").read_bytes(), np.uint8)
  expected = evaluate_run(reference, data, step=6, context=16, stride=8)
  assert result["step"] == 6 and result["bpc"] == expected["bpc"]

  # Asked for by step: an error in one line, nothing written.
  proc = _bpc(workdir, "--step", "8", "--output", str(workdir / "step8.json"))
  assert proc.returncode == 1
  [error] = _stderr_lines(proc)
  assert error.startswith("error: step 8 params: ")
  assert not (workdir / "step8.json").exists()


def _set_aside_line(workdir, step) -> str:
  return (f"warning: moved the damaged checkpoint step {step} out of {workdir / 'checkpoints'} "
          f"to {workdir / 'checkpoints.damaged' / f'step-{step}'}, as it was (this run saves "
          "that step again)")


def test_resume_sets_a_damaged_newest_checkpoint_aside_saves_its_step_again_and_scores_it(
    files, reference):
  # Resumed from step 6, the run moves the damaged step 8 aside as it is, trains steps 7 and 8
  # again, saves step 8 (the uninterrupted run's, bit for bit) and its final evaluation scores
  # it. (Every kind of damage takes the code path of evaluation above; one is enough here.)
  workdir = _copy(reference, "damaged_params_resume")
  _damage(workdir, "altered")
  before = file_snapshot(workdir / "checkpoints" / "8")
  command = [a for a in _train_command(files, workdir) if a != "--skip-final-eval"]
  proc = _run(command + ["--set", "final_eval={'split': 'test', 'batch_size': 16}"])
  assert proc.returncode == 0, proc.stderr
  lines = _stderr_lines(proc)
  assert lines[0].startswith("warning: skipping checkpoint step 8")
  assert lines[1:] == [_set_aside_line(workdir, 8)]
  assert "resumed from step 6" in proc.stdout
  assert file_snapshot(workdir / "checkpoints.damaged" / "step-8") == before
  assert checkpoint.checkpoint_steps(workdir) == [2, 4, 6, 8]
  assert _meta(workdir, 8)["checksums"] == _meta(reference, 8)["checksums"]
  assert _losses(workdir) == _losses(reference)
  # The final evaluation names the step it scored, and takes the run's own context (its last
  # stage's 16 bytes; the config's final_eval sets none), saying so.
  results = json.loads((workdir / "results.json").read_text())
  assert results["checkpoint_step"] == 8 and results["eval"]["step"] == 8
  assert (results["eval"]["context"], results["eval"]["stride"]) == (16, 8)
  assert "evaluated checkpoint step 8\n" in proc.stdout
  assert "context 16, stride 8: the run's last stage's seq_len (step 8)\n" in proc.stdout
  expected = evaluate_run(reference, split_of_file(files / "data.bin", "test"), step=8,
                          context=16, stride=8, batch_size=16)
  assert results["test_bpc"] == expected["bpc"]


@pytest.mark.parametrize("kind", ["flip", "altered"])
def test_damaged_optimizer_state_blocks_resume_but_not_evaluation(files, reference, kind):
  workdir = _copy(reference, f"damaged_opt_state_{kind}")
  _damage(workdir, kind, item="opt_state")
  # eval.bpc without --context: the run's own (its last stage's 16 bytes, stride 8), said in
  # one line.
  proc = _bpc(workdir, window=())
  assert proc.returncode == 0 and _stderr_lines(proc) == [], proc.stderr
  assert "context 16, stride 8: the run's last stage's seq_len (step 8)\n" in proc.stdout
  result = json.loads(next(workdir.glob("bpc_file_*.json")).read_text())
  assert (result["step"], result["context"], result["stride"]) == (8, 16, 8)
  proc = _train(files, workdir)  # the run has finished; a resume still restores first
  assert proc.returncode == 0, proc.stderr
  # Resumed from step 6, it sets the damaged step 8 aside and trains and saves it again.
  [warning, moved] = _stderr_lines(proc)
  assert warning.startswith("warning: skipping checkpoint step 8 in ") and (
      "(left as it is): step 8 opt_state: " in warning)
  if kind == "altered":
    assert "step 8 opt_state: checksum mismatch in " in warning
  assert moved == _set_aside_line(workdir, 8)
  assert _losses(workdir) == _losses(reference)
  assert _meta(workdir, 8)["checksums"] == _meta(reference, 8)["checksums"]


def test_set_aside_gives_each_damaged_step_a_name_of_its_own(tmp_path):
  # Directories that look like steps (Orbax counts a plain directory named by a number).
  for step in (6, 8):
    (tmp_path / "checkpoints" / str(step) / "params").mkdir(parents=True)
    (tmp_path / "checkpoints" / str(step) / "params" / "data").write_text(str(step))
  earlier = tmp_path / "checkpoints.damaged" / "step-8"  # set aside by an earlier run
  earlier.mkdir(parents=True)
  assert checkpoint.checkpoint_steps(tmp_path) == [6, 8]
  moved = checkpoint.set_aside(tmp_path, [8])
  assert [str(p) for p in moved] == [str(tmp_path / "checkpoints.damaged" / "step-8.2")]
  assert checkpoint.checkpoint_steps(tmp_path) == [6]
  assert (tmp_path / "checkpoints.damaged" / "step-8.2" / "params" / "data").read_text() == "8"
  assert checkpoint.checkpoint_steps(tmp_path / "checkpoints.damaged") == []  # no step names
  assert earlier.is_dir() and not any(earlier.iterdir())


def test_damaged_meta_is_skipped(files, reference):
  workdir = _copy(reference, "damaged_meta")
  _damage(workdir, "meta", item="meta")
  proc = _bpc(workdir)
  assert proc.returncode == 0, proc.stderr
  [warning] = _stderr_lines(proc)
  assert warning.endswith("step 8 meta: its contents do not match their SHA-256")


def test_no_checkpoint_that_restores_is_one_error(files, reference):
  workdir = _copy(reference, "all_damaged")
  for step in checkpoint.checkpoint_steps(workdir):
    _damage(workdir, "delete", step=step)
  for proc in (_bpc(workdir), _train(files, workdir)):
    assert proc.returncode == 1
    lines = _stderr_lines(proc)
    assert len(lines) == 5 and all(l.startswith("warning: skipping") for l in lines[:4])
    assert lines[4].startswith(f"error: no checkpoint under {workdir / 'checkpoints'} restores:")
  assert checkpoint.checkpoint_steps(workdir) == [2, 4, 6, 8]


# ----------------------------------------------------------------------------------------------
# Divergence, failed saves


def test_a_diverging_run_names_a_checkpoint_that_really_is_good(files):
  workdir = files / "diverging"
  proc = _train(files, workdir, config="diverging")
  assert proc.returncode == 1
  [error] = _stderr_lines(proc)
  assert error.startswith("error: the update of step 4 diverged (its parameters give loss ")
  assert f"The last good checkpoint is step 3 in {workdir / 'checkpoints'}." in error
  assert checkpoint.checkpoint_steps(workdir) == [1, 2, 3]
  proc = _bpc(workdir)
  assert proc.returncode == 0, proc.stderr
  result = json.loads(next(workdir.glob("bpc_file_*.json")).read_text())
  assert result["step"] == 3 and np.isfinite(result["bpc"]) and result["bpc"] < 9
  # Resumed at a sane rate (asked for), the run finishes.
  proc = _train(files, workdir, "--set", "stages.1.learning_rate=1e-3", "--set",
                "clip_norm=1.0", "--allow-change", "stages.1.learning_rate", "--allow-change",
                "clip_norm", config="diverging")
  assert proc.returncode == 0, proc.stderr
  assert ("settings changed on resume: clip_norm: 1e+30 -> 1.0; stages.1.learning_rate: 1e+30 "
          "-> 0.001") in proc.stdout


def test_a_run_that_diverges_at_once_says_no_checkpoint_exists(files):
  workdir = files / "diverging_at_once"
  proc = _train(files, workdir, "--set", "stages.0.learning_rate=1e30", config="diverging")
  assert proc.returncode == 1
  [error] = _stderr_lines(proc)
  assert "the update of step 1 diverged" in error
  assert "No good checkpoint exists yet (none was saved before step 1)." in error
  assert checkpoint.checkpoint_steps(workdir) == []


def test_a_failed_save_stops_the_run_at_the_next_step(files, reference):
  workdir = files / "full_disk"
  # A write past 16 KB fails with EFBIG, as a full disk fails with ENOSPC (SIGXFSZ, which would
  # kill the process instead, is ignored). The run's small files stay below it; every
  # checkpoint does not. Set by the shell: a fork of this (threaded) process could deadlock.
  # The persistent compilation cache is off in that process: the limit would truncate the
  # entries it writes, which every later run of the session would then read.
  proc = _run(["bash", "-c", 'trap "" XFSZ; ulimit -f 16; export JAX_ENABLE_COMPILATION_CACHE='
               'false; exec "$@"', "limit",
               *_train_command(files, workdir)])
  assert proc.returncode == 1
  *plot, error = _stderr_lines(proc)
  # The curves plot, drawn as the run stops, cannot be written either: a warning, after which
  # the run's error is still the last word.
  assert all(line.startswith("warning: could not write ") for line in plot)
  assert error.startswith(f"error: saving step 2 in {workdir / 'checkpoints'} failed: ")
  assert "File too large (its " in error  # refused before Orbax writes: nothing left behind
  assert "saved step" not in proc.stdout, proc.stdout  # never said to be saved
  # Stopped at the first step after the background write failed: step 3 when it failed during
  # step 3 (logged up to 2), else in step 4's save at the latest. Never trained past the next
  # checkpoint as if the save had worked (test_save_failure_is_seen_at_the_next_check: exactly
  # when).
  assert max(_losses(workdir)) in (2, 3, 4)
  assert checkpoint.checkpoint_steps(workdir) == []
  # A save that cannot fit is not started: no incomplete save is left to remove.
  assert checkpoint.incomplete_saves(workdir) == []
  # Disk space back: the run starts over and matches.
  proc = _train(files, workdir)
  assert proc.returncode == 0, proc.stderr
  assert _stderr_lines(proc) == []
  assert _losses(workdir) == _losses(reference)


def _full_disk(monkeypatch, name: str, helper: str = "_write") -> None:
  """Writes of the file `name` fail as on a full disk (ENOSPC), in the helper every write of its
  kind goes through (`io._write`: whole files, atomically; `io._append`: appends)."""
  from longformer_jax import io as lj_io
  real = getattr(lj_io, helper)

  def write(target, data):
    path = Path(getattr(target, "name", target))
    if path.name in (name, f".{name}.tmp{os.getpid()}"):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(target, data)
  monkeypatch.setattr(lj_io, helper, write)


def _main(files, workdir, *args, final_eval=False) -> int:
  """train.charlm's main in this process, on the shared run's command line (its final
  evaluation on the test split with `final_eval`)."""
  from longformer_jax.commands import train_charlm as charlm
  command = _train_command(files, workdir, *args)[3:]
  if final_eval:
    command = [a for a in command if a != "--skip-final-eval"] + [
        "--set", "final_eval={'split': 'test', 'batch_size': 16}"]
  return charlm.main(command)


def test_a_rerun_of_a_finished_run_never_removes_a_result(files, reference, capsys, monkeypatch):
  """Rerunning a finished run's command: nothing new computed, results.json left as it is (it
  used to lose final_train_loss and valid_bpc); the final evaluation adds test_bpc to the rest,
  and survives a full disk in the error line; a later rerun without it keeps it."""
  workdir = _copy(reference, "rerun")
  results = workdir / "results.json"
  before = results.read_bytes()
  old = json.loads(before)
  assert {"final_train_loss", "valid_bpc", "steps"} <= set(old)
  capsys.readouterr()
  assert _main(files, workdir) == 0
  out, err = capsys.readouterr()
  assert err == "" and f"nothing new was computed: {results} left as it is\n" in out
  assert results.read_bytes() == before

  # The final evaluation on a full disk: one line holding the test BPC; results.json as it was.
  with monkeypatch.context() as patch:
    _full_disk(patch, "results.json")
    assert _main(files, workdir, final_eval=True) == 1
  [error] = capsys.readouterr().err.splitlines()
  prefix = (f"error: cannot write {results}: No space left on device; this run's results, not "
            "written: ")
  assert error.startswith(prefix), error
  lost = json.loads(error.removeprefix(prefix))
  assert lost["checkpoint_step"] == 8 and np.isfinite(lost["test_bpc"])
  assert results.read_bytes() == before
  assert [p.name for p in workdir.iterdir() if ".tmp" in p.name] == []

  # Disk space back: the same evaluation joins the earlier results.
  assert _main(files, workdir, final_eval=True) == 0
  new = json.loads(results.read_text())
  assert new["test_bpc"] == lost["test_bpc"] and new["checkpoint_step"] == 8
  assert {k: new[k] for k in ("steps", "final_train_loss", "valid_bpc")} == {
      k: old[k] for k in ("steps", "final_train_loss", "valid_bpc")}
  after = results.read_bytes()
  assert _main(files, workdir) == 0  # --skip-final-eval again: the test BPC stays
  assert results.read_bytes() == after


def test_a_full_disk_while_resuming_or_logging_is_one_error_and_loses_nothing(
    files, reference, capsys, monkeypatch):
  """metrics.jsonl's rewrite on resume, then its appends, fail as on a full disk: one error
  line each (status 1), the log and the checkpoints as they were (no step past the failure
  saved)."""
  workdir = _copy(reference, "full_disk_log")
  shutil.rmtree(workdir / "checkpoints" / "8")  # resumes from step 6
  log = workdir / "metrics.jsonl"
  before, checkpoints = log.read_bytes(), file_snapshot(workdir / "checkpoints")
  capsys.readouterr()
  with monkeypatch.context() as patch:
    _full_disk(patch, "metrics.jsonl")
    assert _main(files, workdir) == 1
  assert capsys.readouterr().err == f"error: cannot write {log}: No space left on device\n"
  assert log.read_bytes() == before
  with monkeypatch.context() as patch:
    _full_disk(patch, "metrics.jsonl", helper="_append")
    assert _main(files, workdir) == 1
  assert capsys.readouterr().err == f"error: cannot write {log}: No space left on device\n"
  assert file_snapshot(workdir / "checkpoints") == checkpoints
  assert max(_losses(workdir)) == 6


# ----------------------------------------------------------------------------------------------
# A torn metrics log, a failed start


def test_a_torn_last_log_line_is_dropped_and_a_damaged_one_is_an_error(files, reference):
  # The disk filled after checkpoint 6, while step 8's record was being written: the run died
  # with half a line at the end of metrics.jsonl and no checkpoint 8.
  workdir = _copy(reference, "torn_log")
  shutil.rmtree(workdir / "checkpoints" / "8")
  log = workdir / "metrics.jsonl"
  lines = log.read_text().splitlines(keepends=True)
  kept = [l for l in lines if json.loads(l)["step"] <= 7]
  step_8 = next(l for l in lines if json.loads(l)["step"] == 8)
  torn = step_8[:len(step_8) // 2]

  # A damaged line that is not the last one: one error naming it, nothing written.
  log.write_text("".join(kept[:2]) + kept[2][:20] + "\n" + "".join(kept[3:]) + torn)
  before = file_snapshot(workdir)
  proc = _train(files, workdir)
  assert proc.returncode == 1
  [error] = _stderr_lines(proc)
  assert error.startswith(f"error: {log}:3: not a JSON record (column ")
  assert file_snapshot(workdir) == before

  # A torn last line: dropped with one warning; the run resumes from step 6 and every loss is
  # the uninterrupted run's, each logged once.
  log.write_text("".join(kept) + torn)
  proc = _train(files, workdir)
  assert proc.returncode == 0, proc.stderr
  assert _stderr_lines(proc) == [
      f"warning: {log}: dropped a torn last line ({len(torn)} bytes), what a write cut short "
      "leaves (e.g. on a full disk)"]
  assert "resumed from step 6" in proc.stdout
  assert _losses(workdir) == _losses(reference)


def test_a_failed_start_leaves_the_workdir_to_the_next_one(files, reference):
  # A learning rate that overflows at once: the run fails after writing its record (and logging
  # its first step), before any checkpoint. (Inputs that cannot work are refused before the
  # record is written: a failed start is a failure of the run itself.)
  workdir = files / "failed_start"
  proc = _train(files, workdir, "--set", "stages.0.learning_rate=1e30")
  assert proc.returncode == 1 and "No good checkpoint exists yet" in proc.stderr, proc.stderr
  assert (workdir / "run_config.json").exists() and not checkpoint.checkpoint_steps(workdir)
  assert _losses(workdir)  # the failed start's steps, dropped by the next run
  # The command with a sane learning rate, which differs from the failed start's record: that
  # record is replaced (said in one line), and the run is the uninterrupted one.
  proc = _train(files, workdir)
  assert proc.returncode == 0, proc.stderr
  assert _stderr_lines(proc) == [
      f"warning: {workdir / 'run_config.json'} is the record of a run that saved no checkpoint "
      "(a failed start); replaced by this run's settings"]
  # The record is the uninterrupted run's, but for where its data file lies (the same bytes:
  # `data.data_file` is a location, free to differ, identity.FREE_KEYS).
  record, want = (json.loads((w / "run_config.json").read_text()) for w in (workdir, reference))
  assert record["data"].pop("data_file") == os.path.abspath(files / "data.bin")
  want["data"].pop("data_file")
  assert record == want
  assert _losses(workdir) == _losses(reference)


# ----------------------------------------------------------------------------------------------
# Resumes with other settings


def test_a_resume_with_another_model_or_data_is_refused_before_anything_is_written(files,
                                                                                    reference):
  workdir = _copy(reference, "mismatch")
  before = file_snapshot(workdir)
  # Refused from the settings alone, before any array is read (the head count also changes
  # the weights' shapes; a change that would not, e.g. the activation, is refused the same way).
  proc = _train(files, workdir, "--set", "model.num_attention_heads=4", "--set", "seed=1")
  assert proc.returncode == 1
  [error] = _stderr_lines(proc)
  assert error == (
      f"error: cannot resume {workdir}: these settings differ from the run's at step 8: "
      "model.num_attention_heads: 2 -> 4; seed: 0 -> 1. The model, the data and the stages "
      "already trained are fixed within a run; start a new run in another workdir.")
  command = _train_command(files, workdir)
  command[command.index("--data-file") + 1] = str(files / "other.bin")
  [error] = _stderr_lines(_run(command))
  assert "data.train_sha256: '" in error and "data.train_bytes" not in error
  proc = _train(files, workdir, "--set", "stages.0.learning_rate=1e-2")
  [error] = _stderr_lines(proc)
  assert error.endswith("To change stages.0.learning_rate on purpose, allow it (--allow-change "
                        "FIELD, or train(..., allow_changes=[...])).")
  assert file_snapshot(workdir) == before   # run_config.json, metrics, checkpoints: untouched
  # Extending the run is allowed; run_config.json keeps the settings the run started with.
  proc = _train(files, workdir, "--set", "stages.0.steps=10")
  assert proc.returncode == 0, proc.stderr
  assert "settings changed on resume: stages.0.steps: 8 -> 10" in proc.stdout
  assert (workdir / "run_config.json").read_bytes() == (reference / "run_config.json").read_bytes()
  assert _meta(workdir, 10)["run"]["stages"][0]["steps"] == 10


def test_an_edited_run_config_is_refused_by_its_readers_before_any_work(files, reference,
                                                                       capsys):
  """run_config.json is written once, when the run starts, and every checkpoint seals the run's
  record: a change to what fixes the run (here the dilation, which scores other numbers: before,
  eval.bpc scored with it silently) is refused in one line, status 2, by eval.bpc, eval.sample
  and a resume, before anything is read or written. A change to how the run is executed or
  reported (eval_every) is not one."""
  from longformer_jax.commands import eval_bpc as bpc, eval_sample as sample
  from longformer_jax.commands import train_charlm as charlm
  from longformer_jax.tasks.runs import read_run
  workdir = _copy(reference, "edited")
  path = workdir / "run_config.json"
  record = json.loads(path.read_text())
  path.write_text(json.dumps({**record, "model": {**record["model"], "attention_dilation": 2}}))
  before = file_snapshot(workdir)
  for prog, main, args in (
      ("eval.bpc", bpc.main, ["--workdir", str(workdir), "--file", str(files / "eval.bin"),
                              "--context", "16", "--stride", "8", "--no-progress"]),
      ("eval.sample", sample.main, ["--workdir", str(workdir), "--prompt", "ab",
                                    "--max-new-tokens", "2"]),
      ("train.charlm", charlm.main,
       _train_command(files, workdir, "--set", "stages.0.steps=10")[3:])):
    with pytest.raises(SystemExit) as exit_info:
      main(args)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"{prog}: error: {path} is not the run's record: model.attention_dilation is 2 there, 1 "
        "in the run's record (sealed into checkpoint step 8). It was changed after the run "
        "started; put the run's values back\n")
  assert file_snapshot(workdir) == before
  path.write_text(json.dumps({**record, "eval_every": 1}))
  assert read_run(workdir, "charlm")[0]["eval_every"] == 1


def test_sigterm_during_the_final_evaluation_exits_75_and_writes_nothing(files, reference, capsys,
                                                                        monkeypatch):
  """SIGTERM after training, while the final evaluation runs (before, the default action ended
  the process with status 143 and no word): status 75 and one line; neither results.json (the
  reference run's, written without a final evaluation) nor the checkpoints change, so the same
  command evaluates again."""
  import os
  from longformer_jax.commands import train_charlm as charlm
  from longformer_jax.tasks.charlm import CharLMTask
  workdir = _copy(reference, "sigterm-eval")
  results = (workdir / "results.json").read_bytes()
  before, handler = file_snapshot(workdir / "checkpoints"), signal.getsignal(signal.SIGTERM)

  def final_evaluation(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # the handler raises before this ends
    raise AssertionError("SIGTERM did not interrupt the final evaluation")

  monkeypatch.setattr(CharLMTask, "final_evaluation", final_evaluation)
  command = [a for a in _train_command(files, workdir)[3:] if a != "--skip-final-eval"]
  assert charlm.main(command) == 75
  assert capsys.readouterr().err.splitlines()[-1] == (
      "SIGTERM during the final evaluation (training is saved at step 8): nothing written; "
      "rerun the same command to evaluate")
  assert (workdir / "results.json").read_bytes() == results
  assert file_snapshot(workdir / "checkpoints") == before
  assert signal.getsignal(signal.SIGTERM) == handler  # the command's handler is gone again


def _record(**changes):
  from longformer_jax.config import CharLMConfig
  from longformer_jax.training import Stage, TrainConfig
  stages = changes.pop("stages", (Stage(16, 4, 10, 1e-3), Stage(32, 2, 10, 5e-4)))
  cfg = TrainConfig(model=CharLMConfig.tiny(), stages=stages, **changes)
  return {**config_record(cfg), "data": {"train_sha256": "ab"}}


def test_resume_rules():
  from longformer_jax.training import Stage
  stored = _record()
  # Free: how the run is executed and reported.
  assert check_resume(stored, _record(eval_every=7, mesh_shape=(1, 1), microbatch_size=2,
                                      checkpoint_every=3, async_checkpoints=False), step=15) == []
  # Free too: where a --data-file was (its bytes' SHA-256 is the data), recorded or not.
  moved = {**stored, "data": {**stored["data"], "data_file": "/elsewhere/data.bin"}}
  assert check_resume(stored, moved, step=15) == check_resume(moved, stored, step=15) == []
  # Allowed: the current stage's length (not below the step reached), later stages.
  stages = (Stage(16, 4, 10, 1e-3), Stage(32, 2, 30, 5e-4), Stage(64, 1, 5, 1e-4))
  assert check_resume(stored, _record(stages=stages), step=15) == [
      "stages.1.steps: 10 -> 30", "stages.2 added"]
  with pytest.raises(RunMismatchError, match=r"stages.1.steps: 10 -> 4 \(step 15 is past"):
    check_resume(stored, _record(stages=(stages[0], Stage(32, 2, 4, 5e-4))), step=15)
  with pytest.raises(RunMismatchError, match=r"stages.0.steps: 10 -> 12 \(step 15 is past"):
    check_resume(stored, _record(stages=(Stage(16, 4, 12, 1e-3), stages[1])), step=15)
  # A stage not started yet may change in anything.
  later = (stages[0], Stage(64, 8, 3, 1e-2, windows=(8, 8, 8, 8)))
  assert check_resume(stored, _record(stages=later), step=10)[0] == "stages.1.seq_len: 32 -> 64"
  # On request only: the optimiser and the schedule of started stages.
  faster = (stages[0], Stage(32, 2, 10, 1e-3))
  with pytest.raises(RunMismatchError, match="allow it"):
    check_resume(stored, _record(stages=faster, clip_norm=0.5), step=15)
  assert check_resume(stored, _record(stages=faster, clip_norm=0.5), step=15,
                      allow=["stages.1.learning_rate", "clip_norm"]) == [
      "clip_norm: 1.0 -> 0.5", "stages.1.learning_rate: 0.0005 -> 0.001"]
  # Never: the model, the data, the seed, the shape of started stages; one message for all.
  other = _record(seed=3, stages=(stages[0], Stage(32, 4, 10, 5e-4)))
  other["data"] = {"train_sha256": "cd"}
  with pytest.raises(RunMismatchError) as e:
    check_resume(stored, other, step=15, allow=["stages.1.learning_rate"])
  assert ("data.train_sha256: 'ab' -> 'cd'; seed: 0 -> 3; stages.1.batch_size: 2 -> 4"
          in str(e.value))
  with pytest.raises(RunMismatchError, match="cannot allow changes to model.hidden_size"):
    check_resume(stored, stored, step=15, allow=["model.hidden_size"])


def test_which_parameters_train_is_part_of_the_run():
  stored = _record(trainable="position_embeddings")
  assert check_resume(stored, _record(trainable="position_embeddings"), step=5) == []
  for other in (None, "embeddings"):
    with pytest.raises(RunMismatchError,
                       match=f"trainable: 'position_embeddings' -> {other!r}"):
      check_resume(stored, _record(trainable=other), step=5)
  # A record from before the field existed ran with every parameter trained.
  old = _record()
  del old["trainable"]
  assert check_resume(old, _record(), step=5) == []
  with pytest.raises(RunMismatchError, match="trainable: None -> 'embeddings'"):
    check_resume(old, _record(trainable="embeddings"), step=5)


def test_a_stage_whose_length_changes_keeps_the_rates_of_the_steps_taken():
  from longformer_jax.training import Stage, learning_rate_schedule
  from longformer_jax.training.schedule import continued_stages, stage_schedule
  rates = lambda stage, n: np.array([float(stage_schedule(stage)(c)) for c in range(n)])
  polynomial = Stage(16, 4, 10, 1e-3, end_learning_rate=0.0, warmup_steps=2, decay_power=2.0)
  cosine = Stage(16, 4, 10, 1e-3, end_learning_rate=1e-4, warmup_steps=2)
  for stage in (polynomial, cosine):
    # Resumed at step 6 with 20 steps: steps 0-5 keep their rates; from step 5 (the last one
    # taken) the decay goes on, from its rate, to the end rate at step 20.
    longer = dataclasses.replace(stage, steps=20, step_changes=((6, 10),))
    before, after = rates(stage, 10), rates(longer, 25)
    np.testing.assert_array_equal(after[:6], before[:6])
    decay = dataclasses.replace(stage, learning_rate=float(before[5]), warmup_steps=0, steps=15)
    np.testing.assert_allclose(after[5:], rates(decay, 20), rtol=1e-6)
    assert after[20] == pytest.approx(stage.end_learning_rate) and after[6] < before[5]
    # Shorter (not below the step reached), then longer again: each change starts from there.
    both = dataclasses.replace(stage, steps=30, step_changes=((6, 10), (7, 8)))
    shorter = rates(dataclasses.replace(stage, steps=8, step_changes=((6, 10),)), 8)
    np.testing.assert_array_equal(rates(both, 7), shorter[:7])
    assert rates(both, 31)[30] == pytest.approx(stage.end_learning_rate)
    # Resumed in the warm-up: no step has decayed yet; the warm-up stays, the decay is longer.
    np.testing.assert_array_equal(
        rates(dataclasses.replace(stage, steps=20, step_changes=((2, 10),)), 22),
        rates(dataclasses.replace(stage, steps=20), 22))
  constant = Stage(16, 4, 10, 1e-3, warmup_steps=2)
  np.testing.assert_array_equal(
      rates(dataclasses.replace(constant, steps=20, step_changes=((6, 10),)), 22),
      rates(dataclasses.replace(constant, steps=20), 22))

  # The loop's part: a resume keeps the run's changes and adds one for each started stage
  # whose length differs (stage-local step, steps before); a stage not started has none.
  second = Stage(32, 2, 10, 5e-4, end_learning_rate=0.0)
  stored = _record(stages=(Stage(16, 4, 10, 1e-3, step_changes=((4, 6),)), second))
  cfg = config_from_record(_record(stages=(Stage(16, 4, 10, 1e-3),
                                           dataclasses.replace(second, steps=30),
                                           Stage(64, 1, 5, 1e-4))))
  resumed = continued_stages(cfg, stored, step=15)
  assert [s.step_changes for s in resumed.stages] == [((4, 6),), ((5, 10),), ()]
  assert check_resume(stored, config_record(resumed) | {"data": stored["data"]}, step=15) == [
      "stages.1.steps: 10 -> 30", "stages.2 added"]
  np.testing.assert_array_equal(  # the second stage's 5 steps taken keep their rates
      [float(learning_rate_schedule(resumed)(c)) for c in range(15)],
      [float(learning_rate_schedule(config_from_record(stored))(c)) for c in range(15)])


# ----------------------------------------------------------------------------------------------
# Checksums


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "uint8", "bool", "key"])
def test_checksums_see_every_bit_and_every_position(dtype):
  rng = np.random.default_rng(seed_of("checksum", dtype))
  if dtype == "key":
    x = jax.random.split(jax.random.key(0), 12).reshape(3, 4)
    data = jax.random.key_data(x)
  else:
    data = jnp.asarray(rng.integers(0, 2, (3, 4, 5)) if dtype == "bool"
                       else rng.normal(size=(3, 4, 5)) * 100).astype(dtype)
    x = data
  base = checkpoint.checksums({"x": x})["x"]
  assert len(base) == 16 and checkpoint.checksums({"x": x}) == {"x": base}  # deterministic
  words = np.asarray(jax.lax.bitcast_convert_type(data, jnp.uint8) if data.dtype.itemsize > 1
                     else data.astype(jnp.uint8))
  flat = words.reshape(-1).copy()
  # The first bit, one inside, the last (of a bool: its value bit).
  for bit in (0, 8, 8 * flat.size - 8) if dtype == "bool" else (0, 5, 8 * flat.size - 1):
    flipped = flat.copy()
    flipped[bit // 8] ^= np.uint8(1 << bit % 8)
    y = flipped.reshape(words.shape)
    y = jax.lax.bitcast_convert_type(jnp.asarray(y), data.dtype) if data.dtype.itemsize > 1 \
        else jnp.asarray(y).astype(data.dtype)
    if dtype == "key":
      y = jax.random.wrap_key_data(y)
    assert checkpoint.checksums({"x": y})["x"] != base, bit
  swapped = jnp.asarray(np.asarray(data)[:, ::-1]) if dtype != "key" else None
  if swapped is not None and not np.array_equal(np.asarray(swapped), np.asarray(data)):
    assert checkpoint.checksums({"x": swapped})["x"] != base


def test_verify_checksums_names_the_damaged_array():
  tree = {"a": jnp.arange(6.0), "b": {"c": jnp.ones((2, 3))}}
  sums = checkpoint.checksums(tree)
  assert set(sums) == {"a", "b/c"}
  checkpoint.verify_checksums(tree, sums, "x")
  broken = {"a": tree["a"], "b": {"c": tree["b"]["c"].at[1, 2].set(1.0000001)}}
  with pytest.raises(checkpoint.DamagedCheckpointError,
                     match=r"^x: checksum mismatch in b/c: written [0-9a-f]{16}, read "):
    checkpoint.verify_checksums(broken, sums, "x")


class _FailedSaves:
  """Stands in for Orbax's CheckpointManager: every save fails in the background, as the
  full-disk run above does, and is finished at once."""

  def __init__(self):
    self.saved = []

  def save(self, step, args, force):
    del args, force
    self.saved.append(step)

  def is_saving_in_progress(self):
    return False

  def wait_until_finished(self):
    raise ValueError("OUT_OF_RANGE: Error writing ... File too large [os_error_code='27']\n"
                     "(a TensorStore spec of many lines)")

  def check_for_errors(self):
    pass

  def close(self):
    pass


def test_save_failure_is_seen_at_the_next_check(tmp_path):
  writer = checkpoint.TrainCheckpoints(tmp_path / "checkpoints", async_save=True)
  writer._manager.close()
  writer._manager = _FailedSaves()
  tree = {"w": jnp.ones(3)}
  writer.save(2, tree, tree, {"step": 2})
  with pytest.raises(checkpoint.CheckpointSaveError) as e:
    writer.check()  # the first step after the failure
  assert str(e.value) == (f"saving step 2 in {tmp_path / 'checkpoints'} failed: ValueError: "
                          "OUT_OF_RANGE: Error writing ... File too large [os_error_code='27']")
  writer.check()  # reported once
  writer.close()
