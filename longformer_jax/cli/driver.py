"""The one driver of every entry point: its command line, its settings, its exit status.

Every training command (`TrainCommand`) takes its settings in one order, whatever the task:

  1. a config file (`--config path.py`, whose `get_config()` returns the command's settings) or
     a named preset (`--preset NAME`, `training.presets`; `--help` lists them). Its form is the
     command's:
       * a `TrainConfig` (train.charlm, train.mlm): the base config;
       * a mapping (train.finetune, train.seq2seq, whose TrainConfig is built from `--model`
         and the data): settings by name, e.g. {"task": "qa", "model": "tiny", "steps": 20,
         "max_length": 512, "stages.0.warmup_steps": 0}. A key that names one of the command's
         flags (its dest: max_length for --max-length) is that flag's default, checked as the
         flag is; any other key is a `--set` path, applied before the command line's. A setting
         that has a flag is best given by the flag's name, so that the flag overrides it.
  2. the command's flags (e.g. `--steps`, `--data`): given on the command line, they override
     the config or preset;
  3. `--set path=value` overrides, last (`training.apply_overrides`, parsed to the field types);
     a path whose first name is a field of the task's options (`TrainCommand.options_class`)
     sets that instead, so the task's settings beside the TrainConfig take `--set` the same way.

A config file may start from a preset and change it:
`return {**presets.get("finetune", "finetune_tiny"), "steps": 50}`.

`--print-config` prints the resolved settings as JSON ("config", "options", and "flags": the
command's own flags) and exits 0, writing nothing; `--help` lists every setting with its type
and default. Then, before any training: the mesh (it must fit the devices), the workdir (it must
be a directory that can be written; one job at a time, `workdir_lock`) and the command's inputs
(`TrainCommand.plan`), each refused in one line (status 2, or 1 for a workdir in use). Then the
run: `training.train` with the task, the task's final evaluation (`Task.final_evaluation`) and
results.json (with "checkpoint_step", the step whose weights the evaluation scored), each file
written whole or not at all by process 0. A workdir whose run has started
must hold the run's own files: its run_config.json is checked against the record sealed into its
newest checkpoint (`training.config.check_run_record`; status 2 naming the field that differs)
before anything is read. An evaluation without training (fine-tuning's --eval-only) writes
eval_results.json and eval_-prefixed predictions instead, never the training run's files.

The eval commands (`parse_settings`) take theirs in the same order. Their settings are their
flags, so a config file or preset (`--preset` where the command has presets: eval.bpc's "paper"
and "quick") is a mapping by flag name whose every key is a flag, e.g. {"context": 1024,
"stride": 256}; `--set NAME=VALUE` sets a flag by that name, VALUE parsed and checked as the
flag parses it. `--print-config` prints the resolved flags and exits 0, writing nothing;
`--help` lists the flags and the presets.

Exit status, the same for every command (eval commands too):

  0   done
  1   the run failed: one `error: ...` line on stderr (settings that differ from the run's, a
      diverging loss, a failed save, no checkpoint that restores, a damaged line in
      metrics.jsonl, a workdir in use by another job)
  2   a bad command line, setting or input: one `<prog>: error: ...` line naming it, before any
      training or evaluation starts
  75  preempted (SIGTERM) after saving its step, or during an evaluation (nothing of it is
      written): rerun the same command to resume
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import dataclasses
import errno
import importlib.util
import json
import os
import sys
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
# After SIGTERM once the step is saved (sysexits' EX_TEMPFAIL: "try again later").
EXIT_PREEMPTED = 75

# Exceptions that mean the command line, a setting or an input file is wrong: status 2.
USAGE_ERRORS = (ValueError, TypeError, FileNotFoundError, ImportError)


# ----------------------------------------------------------------------------------------------
# The command line


class Parser(argparse.ArgumentParser):
  """argparse, with every error in one line, `<prog>: error: <message>`, and status 2 (no usage
  text, which says nothing about the value)."""

  def __init__(self, prog: str, doc: str | None, **kwargs):
    super().__init__(prog=prog, description=doc,
                     formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

  def error(self, message: str) -> typing.NoReturn:
    self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _bounded(cast: Callable[[str], Any], ok: Callable[[Any], bool], rule: str):
  """An argparse type: `cast(text)`, refused unless `ok(value)`; errors name the value."""
  def parse(text: str):
    try:
      value = cast(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected {cast.__name__}, got {text!r}") from None
    if not ok(value):
      raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
    return value
  parse.__name__ = f"{cast.__name__} {rule}"
  return parse


# argparse types that name a bad value.
positive_int = _bounded(int, lambda v: v >= 1, ">= 1")
nonnegative_int = _bounded(int, lambda v: v >= 0, ">= 0")
positive_float = _bounded(float, lambda v: v > 0, "> 0")  # nan is not > 0


def load_config(path: str):
  """`get_config()` of a config file, imported by path (the command's settings: a TrainConfig
  or a mapping, module docstring)."""
  spec = importlib.util.spec_from_file_location(f"config_{Path(path).stem}", path)
  if spec is None or spec.loader is None:
    raise ValueError(f"cannot import a config from {path!r}")
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except FileNotFoundError:
    raise FileNotFoundError(f"--config {path}: no such file") from None
  if not callable(getattr(module, "get_config", None)):
    raise ValueError(f"--config {path} defines no get_config()")
  return module.get_config()


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


def _type_name(annotation: Any) -> str:
  if annotation is type(None):
    return "None"
  if isinstance(annotation, str):
    return annotation
  if isinstance(annotation, type) and not typing.get_args(annotation):
    return annotation.__name__
  if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
    return " | ".join(_type_name(a) for a in typing.get_args(annotation))
  return str(annotation).replace("typing.", "")


def settings_help(*groups: tuple[str, type]) -> str:
  """The fields of settings dataclasses, one line each (`prefix.name: type = default`), for a
  command's --help; groups: (path prefix, dataclass)."""
  lines = ["settings (--set PATH=VALUE; --print-config shows the resolved values):"]
  for prefix, cls in groups:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      if f.default is not dataclasses.MISSING:
        default = f" = {f.default!r}"
      elif f.default_factory is not dataclasses.MISSING:
        default = f" = {f.default_factory()!r}"
      else:
        default = ""
      lines.append(f"  {prefix}{f.name}: {_type_name(hints.get(f.name, f.type))}{default}")
  return "\n".join(lines)


def split_overrides(assignments: Sequence[str], options_class: type | None
                    ) -> tuple[list[str], list[str]]:
  """(assignments to `options_class`'s fields, the rest: TrainConfig's) of --set values."""
  if options_class is None:
    return [], list(assignments)
  names = {f.name for f in dataclasses.fields(options_class)}
  mine = [a for a in assignments if a.partition("=")[0].strip().split(".")[0] in names]
  return mine, [a for a in assignments if a not in mine]


# Flags of the driver itself that a config's mapping cannot set.
_NOT_SETTINGS = ("help", "config", "preset", "set", "print_config")


def _flag_value(action: argparse.Action, value: Any, origin: str) -> Any:
  """`value` as the flag of `action` stores it: parsed by its type (each item of a list flag,
  given as a list or as one string split at commas and spaces) and checked against its choices;
  a switch (store_true) takes true or false."""
  if value is None:
    return None
  if action.nargs == 0:
    if isinstance(value, str) and value.lower() in ("true", "false"):
      value = value.lower() == "true"
    if not isinstance(value, bool):
      raise ValueError(f"{origin}: {action.dest} takes true or false, got {value!r}")
    return value
  if action.nargs in ("+", "*"):
    items = (value.replace(",", " ").split() if isinstance(value, str)
             else list(value) if isinstance(value, (list, tuple)) else [value])
    if not items and action.nargs == "+":
      raise ValueError(f"{origin}: {action.dest} needs at least one value")
    return [_typed(action, v, origin) for v in items]
  return _typed(action, value, origin)


def _typed(action: argparse.Action, value: Any, origin: str) -> Any:
  """One value of a flag: parsed by its type, checked against its choices."""
  if action.type is not None:
    try:
      value = action.type(value if isinstance(value, str) else str(value))
    except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
      raise ValueError(f"{origin}: {action.dest}: {e}") from None
  if action.choices is not None and value not in action.choices:
    raise ValueError(f"{origin}: {action.dest} must be one of {tuple(action.choices)}, "
                     f"got {value!r}")
  return value


def flag_defaults(parser: argparse.ArgumentParser, settings: Any, origin: str,
                  set_paths: bool = True) -> tuple[dict[str, Any], list[str]]:
  """({flag dest: default}, `--set` assignments) of a mapping of settings (module docstring):
  a key naming a flag of `parser` is its default, parsed and checked as the flag is (its type,
  its choices); any other key is a --set path, its value written as --set takes it, or, without
  `set_paths` (a command whose settings are its flags), a ValueError naming the known ones."""
  if not isinstance(settings, Mapping):
    raise TypeError(f"{origin} gives a {type(settings).__name__}; expected a mapping of "
                    f"settings by flag name" + (" or --set path" if set_paths else ""))
  flags = {a.dest: a for a in parser._actions
           if a.option_strings and a.dest not in _NOT_SETTINGS}
  defaults, assignments = {}, []
  for key, value in settings.items():
    action = flags.get(key)
    if action is not None:
      defaults[key] = _flag_value(action, value, origin)
    elif set_paths:
      assignments.append(f"{key}={value if isinstance(value, str) else repr(value)}")
    else:
      raise ValueError(f"{origin}: {key!r} is not a setting of {parser.prog}; settings: "
                       f"{', '.join(flags)}")
  return defaults, assignments


def usage_error(parser: argparse.ArgumentParser, error: Exception) -> typing.NoReturn:
  """Exits with status 2 and one line naming the bad value (no traceback)."""
  parser.exit(EXIT_USAGE, f"{parser.prog}: error: {error}\n")


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


def print_json(value: Any) -> None:
  print(json.dumps(value, indent=2, default=str))


def printed_config(args: argparse.Namespace) -> bool:
  """With --print-config: prints the resolved settings (`parse_settings`) as JSON and returns
  True."""
  if not args.print_config:
    return False
  print_json({k: v for k, v in vars(args).items() if k not in _NOT_SETTINGS})
  return True


def parse_settings(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                   preset_task: str | None = None) -> argparse.Namespace:
  """The settings of a command whose settings are its flags (the eval commands), in the module
  docstring's order: `--config FILE` or `--preset NAME` (of `preset_task`'s presets, when it has
  any), a mapping by flag dest; then the flags; then `--set NAME=VALUE` (NAME a flag's dest,
  VALUE parsed as the flag parses it; `None` where the flag's default is None). A flag of a
  mutually exclusive group given by a later step replaces the group's value of an earlier one.
  Adds those flags and --print-config to `parser`; a bad setting exits with status 2."""
  from longformer_jax.training import presets
  source = parser.add_mutually_exclusive_group()
  source.add_argument("--config", default=None, metavar="FILE",
                      help="a config file whose get_config() returns a mapping of settings by "
                           "flag name (as --set takes them)")
  names = presets.names(preset_task) if preset_task else ()
  if names:
    listed = "; ".join(name + ": " + ", ".join(
        f"{k}={v}" for k, v in presets.get(preset_task, name).items()) for name in names)
    source.add_argument("--preset", default=None, metavar="NAME",
                        help=f"a named preset (settings by flag name): {listed}")
  parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                      help="set a setting, last; NAME is a flag without its -- and with _ for "
                           "- (--data-dir: data_dir)")
  parser.add_argument("--print-config", action="store_true",
                      help="print the resolved settings as JSON and exit; writes nothing")
  flags = {a.dest: a for a in parser._actions
           if a.option_strings and a.dest not in _NOT_SETTINGS}
  groups = [g for g in parser._mutually_exclusive_groups if g is not source]
  # Required flags may come from any step, so they are checked once all three have applied.
  required = [a for a in flags.values() if a.required] + [g for g in groups if g.required]
  for item in required:
    item.required = False
  unset = object()  # what the flags not on the command line keep, to tell them apart
  args = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(flags, unset)))
  steps = [{d: v for d, v in vars(args).items() if d in flags and v is not unset}]
  try:
    if args.config or getattr(args, "preset", None):
      given = (load_config(args.config) if args.config
               else presets.get(preset_task, args.preset))
      origin = f"--config {args.config}" if args.config else f"--preset {args.preset}"
      steps.insert(0, flag_defaults(parser, given, origin, set_paths=False)[0])
    for assignment in args.set:
      name, equals, text = (part.strip() for part in assignment.partition("="))
      if not equals:
        raise ValueError(f"--set {assignment}: expected NAME=VALUE")
      default = getattr(flags.get(name), "default", unset)
      steps.append(flag_defaults(parser, {name: None if text == "None" and default is None
                                          else text}, f"--set {assignment}", set_paths=False)[0])
  except USAGE_ERRORS as e:
    usage_error(parser, e)
  values = {d: a.default for d, a in flags.items()}
  for step in steps:
    for group in groups:
      if any(step.get(a.dest, a.default) != a.default for a in group._group_actions):
        values.update({a.dest: a.default for a in group._group_actions})
    values.update(step)
  for item in required:
    members = getattr(item, "_group_actions", [item])  # a flag, or a group: one of its flags
    if all(values[a.dest] == a.default for a in members):
      parser.error(f"{' or '.join(a.option_strings[0] for a in members)} needed (the flag, or "
                   f"a setting of --config{', --preset' if names else ''} or --set)")
  for group in groups:
    chosen = [a.option_strings[0] for a in group._group_actions if values[a.dest] != a.default]
    if len(chosen) > 1:
      parser.error(f"{' and '.join(chosen)} do not go together")
  return argparse.Namespace(**{**vars(args), **values})


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
  """One training entry point: its flags, how they resolve to settings, and its task.

  Subclasses set `prog`, `doc` and `preset_task` (the task module, `longformer_jax.tasks.<name>`,
  whose `training.presets` entries --preset names), and may set `default_preset` (without
  --config or --preset), `flag_settings` (--config and --preset give a mapping of settings by
  flag name, module docstring, instead of a TrainConfig), `required` (flag dests that must have
  a value once the config's defaults apply) and `options_class` (a frozen dataclass of the
  task's settings beside the TrainConfig).
  """

  prog: str
  doc: str
  preset_task: str
  default_preset: str | None = None
  flag_settings: bool = False
  required: tuple[str, ...] = ()
  options_class: type | None = None

  def add_arguments(self, parser: argparse.ArgumentParser) -> None:  # noqa: B027 (optional)
    """The command's own flags (shorthands for settings, inputs)."""

  def validate(self, parser: argparse.ArgumentParser,  # noqa: B027 (optional)
               args: argparse.Namespace) -> None:
    """Rejects flag combinations (`parser.error`)."""

  def base_options(self, args: argparse.Namespace, workdir) -> Any:
    """The task's settings before --set (default: `options_class()`)."""
    return None if self.options_class is None else self.options_class()

  def base_config(self, args: argparse.Namespace, options: Any, workdir):
    """The TrainConfig before shorthands and --set when no config file or preset gave one (a
    `flag_settings` command builds it from its flags; default: the default preset)."""
    from longformer_jax.training import presets
    if self.default_preset is None:
      raise ValueError("give --config FILE or --preset NAME")
    return presets.get(self.preset_task, self.default_preset)

  def shorthands(self, args: argparse.Namespace, cfg):
    """`cfg` with the command's shorthand flags applied (default: as it is)."""
    del args
    return cfg

  def finish_config(self, args: argparse.Namespace, cfg, options: Any, workdir):
    """The final TrainConfig, after --set (e.g. a model's shape from a checkpoint); default:
    `cfg`."""
    del args, options, workdir
    return cfg

  @abc.abstractmethod
  def default_workdir(self, args: argparse.Namespace) -> str:
    """runs/<name> when --workdir is not given."""

  @abc.abstractmethod
  def plan(self, args: argparse.Namespace, cfg, options: Any, workdir) -> Plan:
    """The task and what else the run needs; may read inputs and write into the workdir, but
    only after --print-config has had its say. Raises a `USAGE_ERRORS` naming a bad input."""

  # -- the driver

  def parser(self) -> Parser:
    from longformer_jax.training import Stage, TrainConfig, presets
    groups = [("", TrainConfig), ("stages.N.", Stage)]
    if self.options_class is not None:
      groups.append(("", self.options_class))
    parser = Parser(self.prog, self.doc, epilog=settings_help(*groups))
    importlib.import_module(f"longformer_jax.tasks.{self.preset_task}")  # registers the presets
    form = "a mapping of settings by flag name" if self.flag_settings else "a TrainConfig"
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", default=None, metavar="FILE",
                        help=f"a config file whose get_config() returns {form}")
    source.add_argument("--preset", default=None, metavar="NAME",
                        help=f"a named preset ({form}): "
                             f"{', '.join(presets.names(self.preset_task)) or 'none'}"
                             + (f" (default: {self.default_preset})" if self.default_preset
                                else ""))
    parser.add_argument("--workdir", default=None,
                        help="the run's directory (local or gs://); rerunning resumes it")
    parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                        help="set a setting (listed below), e.g. --set stages.0.steps=100")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved settings as JSON and exit; writes nothing")
    parser.add_argument("--allow-change", action="append", default=[], metavar="FIELD",
                        help="on resume, let this optimiser/schedule setting differ from the "
                             "run's, e.g. --allow-change stages.0.learning_rate (the model and "
                             "data of a run never change)")
    parser.add_argument("--skip-final-eval", action="store_true",
                        help="train only: no final evaluation")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    before = {a.dest for a in parser._actions}
    self.add_arguments(parser)
    self._flags = tuple(a.dest for a in parser._actions if a.dest not in before)
    add_distributed_args(parser)
    return parser

  def parse(self, parser: Parser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line with the config file's or preset's settings as defaults (step 1 of
    the module docstring); a bad one exits with status 2."""
    from longformer_jax.training import TrainConfig, presets
    args = parser.parse_args(argv)
    self._base = None
    origin = f"--config {args.config}" if args.config else f"--preset {args.preset}"
    try:
      given = (load_config(args.config) if args.config
               else presets.get(self.preset_task, args.preset) if args.preset else None)
      if given is None:
        pass
      elif not self.flag_settings:
        if not isinstance(given, TrainConfig):
          raise TypeError(f"{origin} gives a {type(given).__name__}; {self.prog} takes a "
                          f"TrainConfig")
        self._base = given
      else:
        defaults, assignments = flag_defaults(parser, given, origin)
        parser.set_defaults(**defaults)
        args = parser.parse_args(argv)
        args.set = assignments + args.set
    except USAGE_ERRORS as e:
      usage_error(parser, e)
    missing = [f"--{d.replace('_', '-')}" for d in self.required if getattr(args, d) is None]
    if missing:
      parser.error(f"{', '.join(missing)} needed (a flag, or a setting of --config/--preset)")
    self.validate(parser, args)
    return args

  def settings(self, args: argparse.Namespace, workdir) -> tuple[Any, Any]:
    """(TrainConfig, options) of the command line, in the module docstring's order."""
    from longformer_jax.training import apply_overrides
    option_sets, config_sets = split_overrides(args.set, self.options_class)
    options = self.base_options(args, workdir)
    if options is not None:
      options = apply_overrides(options, option_sets)
    if self._base is not None:
      cfg = self._base
    else:
      cfg = self.base_config(args, options, workdir)
    cfg = apply_overrides(self.shorthands(args, cfg), config_sets)
    return self.finish_config(args, cfg, options, workdir), options

  def resolve(self, argv: Sequence[str]) -> tuple[argparse.Namespace, Any, Any, Plan]:
    """(args, TrainConfig, options, plan) of a command line; nothing is trained (tests)."""
    from etils import epath
    parser = self.parser()
    args = self.parse(parser, argv)
    workdir = epath.Path(args.workdir or self.default_workdir(args))
    cfg, options = self.settings(args, workdir)
    return args, cfg, options, self.plan(args, cfg, options, workdir)

  def main(self, argv: Sequence[str] | None = None) -> int:
    parser = self.parser()
    args = self.parse(parser, argv)
    # A multi-process run (a pod slice) initialises before any device use.
    import jax
    from etils import epath
    from longformer_jax import training
    from longformer_jax.io import WriteError, check_writable
    from longformer_jax.training.config import check_run_record
    initialize_distributed(args)
    workdir = epath.Path(args.workdir or self.default_workdir(args))
    with contextlib.ExitStack() as held:
      try:
        cfg, options = self.settings(args, workdir)
        if args.print_config:
          record = {"workdir": str(workdir), "config": training.config_record(cfg)}
          if options is not None:
            record["options"] = dataclasses.asdict(options)
          record["flags"] = {name: getattr(args, name) for name in self._flags}
          print_json(record)
          return EXIT_OK
        # Everything that can be refused is, before the inputs are read and anything is
        # written: the mesh, then the workdir, held for the rest of the run.
        mesh = training.make_mesh(cfg.mesh_shape)
        held.enter_context(workdir_lock(workdir))
        # A resumed run's record as its checkpoints sealed it, before its inputs are read.
        check_run_record(workdir)
        plan = self.plan(args, cfg, options, workdir)
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
