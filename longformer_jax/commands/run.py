"""How every command runs: its exit status, the workdir it holds, the results it writes, and the
training commands' one driver (`TrainCommand`). The settings come first (`longformer_jax.cli`).

Exit status, the same for every command:

  0   done
  1   the run failed: one `error: ...` line on stderr (settings that differ from the run's, a
      diverging loss, a failed save, no checkpoint that restores, a damaged line in
      metrics.jsonl, a workdir in use by another job)
  2   a bad command line, setting or input: one `<prog>: error: ...` line naming it, before any
      training or evaluation starts
  75  preempted (SIGTERM) after saving its step, or during an evaluation (nothing of it is
      written): rerun the same command to resume

A training command, once its settings are resolved: the mesh (it must fit the devices), the
workdir (a directory that can be written; one job at a time, `workdir_lock`) and the command's
inputs (`TrainCommand.plan`) are each refused in one line before any training. A workdir whose
run has started must hold the run's own files: its run_config.json is checked against the record
sealed into its newest checkpoint (`training.config.check_run_record`). Then `training.train`, the
task's final evaluation and results.json (`write_results`), each file written whole or not at all
by process 0. An evaluation without training (fine-tuning's --eval-only) writes
eval_results.json and eval_-prefixed files instead, never the training run's.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import dataclasses
import errno
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from longformer_jax.cli import settings
from longformer_jax.cli.settings import usage_error

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
# After SIGTERM once the step is saved (sysexits' EX_TEMPFAIL: "try again later").
EXIT_PREEMPTED = 75

# Exceptions that mean the command line, a setting or an input file is wrong: status 2.
USAGE_ERRORS = (ValueError, TypeError, FileNotFoundError, ImportError)



def add_distributed_args(parser: argparse.ArgumentParser) -> None:
  """--distributed and the three values `training.maybe_initialize_distributed` passes on."""
  group = parser.add_argument_group("distributed (several processes)")
  group.add_argument("--distributed", default="auto", choices=("auto", "on", "off"),
                     help="jax.distributed.initialize(): 'on' in every process of a "
                          "multi-process run; 'auto' does it when the arguments or the "
                          "environment name a cluster")
  group.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                     help="process 0's address (default: $JAX_COORDINATOR_ADDRESS; found "
                          "automatically on TPU slices, SLURM and Open MPI)")
  group.add_argument("--num-processes", type=int, default=None,
                     help="processes in the run (default: $JAX_NUM_PROCESSES or detected)")
  group.add_argument("--process-id", type=int, default=None,
                     help="this process, 0..num_processes-1 (default: $JAX_PROCESS_ID or "
                          "detected)")


def initialize_distributed(args: argparse.Namespace) -> None:
  """`training.maybe_initialize_distributed` with the flags of `add_distributed_args`."""
  from longformer_jax import training
  training.maybe_initialize_distributed(
      args.distributed, coordinator_address=args.coordinator_address,
      num_processes=args.num_processes, process_id=args.process_id)


def fail(error: Exception | str) -> int:
  """One `error:` line on stderr (process 0) and status 1: an expected failure of a run says
  all there is in one line (a traceback would bury it)."""
  import jax
  if jax.process_index() == 0:
    print(f"error: {error}", file=sys.stderr)
  return EXIT_FAILED


def run_errors() -> tuple[type[Exception], ...]:
  """Exceptions that end a run with status 1 (`fail`)."""
  from longformer_jax import training
  from longformer_jax.checkpoint import CheckpointError
  from longformer_jax.io import WriteError
  return (training.RunMismatchError, training.NonFiniteLossError, CheckpointError,
          training.DamagedLogError, WriteError)


def write_files(workdir, files: dict[str, str]) -> None:
  """Writes each file into `workdir` whole or not at all (process 0 only), in order (results.json
  last: a run whose results.json is new has all its files); `io.WriteError` names the file that
  could not be written."""
  import jax
  from longformer_jax.io import WriteError, atomic_write
  if jax.process_index() != 0:
    return
  try:
    workdir.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise WriteError(workdir, e) from None
  for name, content in files.items():
    atomic_write(workdir / name, content)
  print(f"wrote {', '.join(files)} in {workdir}")


def write_result(path, result: Mapping[str, Any]) -> int:
  """An evaluation command's JSON `result` written to `path` whole (process 0 only), and said so.
  Returns the exit status: 0, or 1 with one `error:` line holding the result when the file
  cannot be written (e.g. a full disk), so that the numbers are not lost."""
  import jax
  from longformer_jax.io import WriteError, atomic_write
  if jax.process_index() != 0:
    return EXIT_OK
  try:
    atomic_write(path, json.dumps(result, indent=2) + "\n")
  except WriteError as e:
    return fail(f"{e}; the result, not written: {json.dumps(result)}")
  print(f"wrote {path}")
  return EXIT_OK


RESULTS = "results.json"


def write_results(workdir, computed: dict[str, Any], *, record: Mapping[str, Any] = (),
                  files: Mapping[str, str] = (), replace: bool = False,
                  name: str = RESULTS) -> int:
  """Writes what a command computed: `files` (e.g. predictions), then `name` (results.json),
  the one way every training command (and an evaluation without training) records its results.

  computed: this run's results (numbers, the scored step); record: what the run is (its config,
  its model), written with them. A rerun never removes a result: results.json keeps every entry
  it had that this run did not compute again (a rerun of a finished run that only evaluates adds
  the evaluation's, one that skips it keeps the earlier one), unless `replace`. When nothing was
  computed, no file is written and the file is left as it is (said in one line).
  Returns the exit status: 0, or 1 with one `error:` line when a file cannot be written (e.g. a
  full disk), holding this run's results so that none is lost.
  """
  import jax
  from longformer_jax.io import WriteError, read_json
  path = workdir / name
  if not computed and not files:
    if jax.process_index() == 0:
      print(f"nothing new was computed: {path} left as it is")
    return EXIT_OK
  previous = {}
  if not replace and jax.process_index() == 0 and path.exists():
    try:
      previous = read_json(path)
    except (ValueError, OSError) as e:
      previous = e
    if not isinstance(previous, dict):
      why = previous if isinstance(previous, Exception) else f"{path} is not a JSON object"
      print(f"warning: {why}; replaced by this run's results", file=sys.stderr, flush=True)
      previous = {}
  results = {**previous, **record, **computed}
  try:
    write_files(workdir, {**files, name: json.dumps(results, indent=2) + "\n"})
  except WriteError as e:
    return fail(f"{e}; this run's results, not written: {json.dumps(computed)}")
  return EXIT_OK


class EvaluationInterrupted(Exception):
  """SIGTERM arrived while a command evaluated (`sigterm_interrupts`)."""


@contextlib.contextmanager
def sigterm_interrupts(what: str):
  """SIGTERM inside the block raises `EvaluationInterrupted` (the default action would end the
  process with status 143 and no word): the caller exits 75 like a preempted training run. The
  training loop keeps its own handler (it finishes the step and saves); this one covers the
  evaluation around it, where nothing is half-written because results are written only at the
  end, whole. Outside the main thread (no handler can be installed) the block runs as it is."""
  import signal

  def interrupt(signum, frame):
    del signum, frame
    raise EvaluationInterrupted(f"SIGTERM during {what}")

  try:
    previous = signal.signal(signal.SIGTERM, interrupt)
  except ValueError:  # not the main thread
    yield
    return
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


# The workdir's lock file (`workdir_lock`).
LOCK_FILE = ".lock"


class WorkdirInUseError(RuntimeError):
  """Another job holds the workdir's lock (`workdir_lock`)."""


@contextlib.contextmanager
def workdir_lock(workdir):
  """Holds the workdir for one job for the block: process 0 takes an exclusive `fcntl.flock` on
  <workdir>/.lock (made with the workdir when missing), so two jobs never train into one
  workdir. The lock belongs to the open file, so the OS releases it when the job ends, however
  it ends: a killed job leaves no stale lock. A remote workdir (gs://...) is not locked (flock
  needs a local file system).

  Raises ValueError naming the workdir when it is a file or cannot be created or written, and
  `WorkdirInUseError` when another job holds it. A workdir this call created is removed again
  when the block fails before anything but the lock file is in it (a refused input leaves no
  trace)."""
  import fcntl
  import jax
  if "://" in str(workdir) or jax.process_index() != 0:
    yield
    return
  from longformer_jax.io import WriteError, append_line
  path = Path(os.fspath(workdir))
  if path.exists() and not path.is_dir():
    raise ValueError(f"--workdir {workdir} is a file, not a directory")
  created = not path.exists()

  def remove_if_created():
    # A workdir this call made, holding nothing but the lock, is removed again: no trace.
    if created and path.is_dir() and [p.name for p in path.iterdir()] in ([], [LOCK_FILE]):
      (path / LOCK_FILE).unlink(missing_ok=True)
      path.rmdir()

  try:
    path.mkdir(parents=True, exist_ok=True)
    lock = open(path / LOCK_FILE, "a+")
  except OSError as e:
    remove_if_created()
    if e.errno in _DISK_FULL:  # a failure (status 1), not a bad --workdir
      raise WriteError(path / LOCK_FILE, e) from None
    raise ValueError(f"--workdir {workdir} cannot be written: {e.strerror or e}") from None
  try:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      lock.seek(0)
      holder = lock.read().strip()
      raise WorkdirInUseError(
          f"--workdir {workdir} is in use by another job{f' (pid {holder})' if holder else ''};"
          f" one job at a time trains in a workdir: wait for it to end, or give another "
          f"--workdir") from None
    lock.seek(0)
    lock.truncate()
    append_line(lock, path / LOCK_FILE, str(os.getpid()))  # for a second job's message
    yield
  except BaseException:
    _close_quietly(lock)
    remove_if_created()
    raise
  finally:
    _close_quietly(lock)  # releases the lock (closing twice is allowed)


def _close_quietly(file) -> None:
  """Closes `file`; a flush that fails again (the pid of a lock on a full disk) was reported."""
  try:
    file.close()
  except OSError:
    pass


# The errors of a write that found no room: a full disk, a quota, a file-size limit.
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)



# ----------------------------------------------------------------------------------------------
# Training commands


# An evaluation without training (`Plan.evaluate`) writes its files under this prefix
# (eval_results.json, eval_predictions_test.jsonl), never over those of the training run.
EVAL_PREFIX = "eval_"
EVAL_RESULTS = f"{EVAL_PREFIX}results.json"


@dataclasses.dataclass
class Plan:
  """What a training command runs once its settings are resolved.

  task: the `Task` trained (None with `evaluate`).
  results: the first entries of results.json (what the run is: the config, the model, ...).
  init_params: the starting parameters, for `training.train` (None: from the seed).
  evaluate: instead of training, a function of the mesh giving a `FinalEvaluation` (e.g.
    fine-tuning's --eval-only); its files are written as eval_results.json and eval_<name>
    (`EVAL_PREFIX`), after checking, before it runs, that they can be.
  lines: printed before the run (process 0).
  """
  task: Any = None
  results: dict[str, Any] = dataclasses.field(default_factory=dict)
  init_params: Callable[[], Any] | None = None
  evaluate: Callable[[Any], Any] | None = None
  lines: tuple[str, ...] = ()



class TrainCommand(abc.ABC):
  """One training entry point: its settings (`command`), the TrainConfig they make, its task.

  Every training command takes, beside its settings, --workdir, --allow-change,
  --skip-final-eval, --no-progress and the distributed flags."""

  @abc.abstractmethod
  def command(self) -> settings.Command:
    """The command's settings (`cli.settings.Command`; its `inputs` adds its plain flags)."""

  def validate(self, parser: argparse.ArgumentParser,  # noqa: B027 (optional)
               parsed: settings.Parsed) -> None:
    """Rejects combinations of settings and inputs (`parser.error`)."""

  @abc.abstractmethod
  def train_config(self, parsed: settings.Parsed, workdir):
    """The run's TrainConfig (e.g. built from a model it loads, with `parsed.later` applied).
    Raises a `USAGE_ERRORS` naming a bad setting or input."""

  @abc.abstractmethod
  def default_workdir(self, parsed: settings.Parsed) -> str:
    """runs/<name> when --workdir is not given."""

  @abc.abstractmethod
  def plan(self, parsed: settings.Parsed, cfg, workdir) -> Plan:
    """The task and what else the run needs; may read inputs and write into the workdir, but
    only after --print-config has had its say. Raises a `USAGE_ERRORS` naming a bad input."""

  # -- the driver

  def parse(self, argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, settings.Parsed]:
    command = self.command()
    own = command.inputs

    def inputs(parser: argparse.ArgumentParser) -> None:
      parser.add_argument("--workdir", default=None,
                          help="the run's directory (local or gs://); rerunning resumes it")
      parser.add_argument("--allow-change", action="append", default=[], metavar="FIELD",
                          help="on resume, let this optimiser/schedule setting differ from the "
                               "run's, e.g. --allow-change stages.0.learning_rate (the model and "
                               "data of a run never change)")
      parser.add_argument("--skip-final-eval", action="store_true",
                          help="train only: no final evaluation")
      parser.add_argument("--no-progress", action="store_true", help="no progress bars")
      if own is not None:
        own(parser)
      add_distributed_args(parser)

    parser, parsed = settings.parse(dataclasses.replace(command, inputs=inputs), argv)
    self.validate(parser, parsed)
    return parser, parsed

  def resolve(self, argv: Sequence[str]) -> tuple[settings.Parsed, Any, Plan]:
    """(settings, TrainConfig, plan) of a command line; nothing is trained (tests)."""
    from etils import epath
    parser, parsed = self.parse(argv)
    workdir = epath.Path(parsed.args.workdir or self.default_workdir(parsed))
    cfg = self.train_config(parsed, workdir)
    return parsed, cfg, self.plan(parsed, cfg, workdir)

  def main(self, argv: Sequence[str] | None = None) -> int:
    parser, parsed = self.parse(argv)
    args = parsed.args
    # A multi-process run (a pod slice) initialises before any device use.
    import jax
    from etils import epath
    from longformer_jax import training
    from longformer_jax.io import WriteError, check_writable
    from longformer_jax.training.config import check_run_record
    initialize_distributed(args)
    workdir = epath.Path(args.workdir or self.default_workdir(parsed))
    with contextlib.ExitStack() as held:
      try:
        cfg = self.train_config(parsed, workdir)
        if args.print_config:
          settings.print_json({"workdir": str(workdir), "config": training.config_record(cfg),
                               **self.printed(parsed)})
          return EXIT_OK
        # Everything that can be refused is, before the inputs are read and anything is
        # written: the mesh, then the workdir, held for the rest of the run.
        mesh = training.make_mesh(cfg.mesh_shape)
        held.enter_context(workdir_lock(workdir))
        # A resumed run's record as its checkpoints sealed it, before its inputs are read.
        check_run_record(workdir)
        plan = self.plan(parsed, cfg, workdir)
        if plan.task is not None:
          plan.task.check(cfg)  # e.g. final_eval's settings: refused now, not after training
        elif jax.process_index() == 0:
          check_writable(workdir / EVAL_RESULTS)  # before the evaluation, not after
      except USAGE_ERRORS as e:
        usage_error(parser, e)
      except (WorkdirInUseError, WriteError) as e:
        return fail(e)
      if jax.process_index() == 0:
        print(f"{jax.process_count()} process(es), devices: {jax.devices()}")
        print(f"workdir: {workdir}")
        for line in plan.lines:
          print(line)
      try:
        return self._run(args, cfg, plan, workdir, mesh)
      except run_errors() as e:
        return fail(e)
      except EvaluationInterrupted as e:
        if jax.process_index() == 0:
          print(f"{e}: nothing written; rerun the same command to evaluate", file=sys.stderr)
        return EXIT_PREEMPTED

  def printed(self, parsed: settings.Parsed) -> dict[str, Any]:
    """What --print-config shows beside the TrainConfig: the command's own settings (when they
    are not the TrainConfig) and its inputs."""
    from longformer_jax.training import TrainConfig
    shown = {} if isinstance(parsed.config, TrainConfig) else {
        "settings": settings.as_json(parsed.config)}
    return {**shown, "inputs": parsed.inputs()}

  def _run(self, args, cfg, plan: Plan, workdir, mesh) -> int:
    import jax
    from longformer_jax import training
    progress = not args.no_progress
    computed = {}  # what this run computed (results.json keeps the rest of what it had)
    if plan.evaluate is not None:
      with sigterm_interrupts("the evaluation"):
        evaluation = plan.evaluate(mesh)
    else:
      start = time.perf_counter()
      summary = training.train(cfg, workdir, plan.task, mesh=mesh, progress=progress,
                               allow_changes=args.allow_change, init_params=plan.init_params)
      if summary["status"] != "done":
        # Saved; rerun the same command to resume. Not 0, so that a scheduler can tell a
        # preempted run from a finished one.
        return EXIT_PREEMPTED
      if summary["last_loss"] is not None:  # this run trained (a finished run's rerun did not)
        computed.update({"steps": summary["step"], "final_train_loss": summary["last_loss"],
                         "train_minutes_this_run":
                             round((time.perf_counter() - start) / 60, 2)})
      computed.update({k: v for k, v in summary.items() if k.startswith("valid_")})
      evaluation = None
      if not args.skip_final_eval:
        with sigterm_interrupts(f"the final evaluation (training is saved at step "
                                f"{summary['step']})"):
          evaluation = plan.task.final_evaluation(cfg, workdir, mesh, progress=progress)
      if computed or evaluation is not None:
        computed = {"steps": summary["step"], **computed}
    files = {}
    if evaluation is not None:
      if evaluation.step is not None:
        computed["checkpoint_step"] = evaluation.step
      computed.update(evaluation.results)
      files.update(evaluation.files)
      if jax.process_index() == 0:
        if evaluation.step is not None:
          print(f"evaluated checkpoint step {evaluation.step}")
        for line in evaluation.lines:
          print(line)
    if plan.evaluate is not None:  # never the training run's files; always a new evaluation
      return write_results(workdir, computed, record=plan.results, replace=True,
                           files={f"{EVAL_PREFIX}{name}": text for name, text in files.items()},
                           name=EVAL_RESULTS)
    return write_results(workdir, computed, record=plan.results, files=files)
