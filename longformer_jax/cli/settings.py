"""One settings form for every command: a frozen dataclass per command, filled in one order.

Each command (`Command`) names its config class, a frozen dataclass: the TrainConfig for
train.charlm and train.mlm, a small class of its own for the others (fine-tuning's holds the
task's options as a nested field). Its settings are resolved in this order, each step over the
one before:

  1. the config: `--config FILE`, a Python file whose `get_config()` returns an instance of the
     config class; or `--preset NAME`, the config file NAME.py of the command's preset folder
     (train/configs/, eval/configs/: the presets are these files and nothing else); else the
     command's default;
  2. the command's flags for config fields (`--max-length 512` sets max_length), when given;
  3. `--set PATH=VALUE`, last: a dotted path into the config (`stages.0.steps=5`,
     `options.global_attention=none`), parsed to the field's declared type
     (`training.apply_overrides`). Two conveniences of our own: a field of the nested options may
     be named bare (`global_attention=none`), and a command that builds a TrainConfig later (from
     a model it loads) takes the paths that name no field of its config as paths of that
     TrainConfig, applied once it is built (`Parsed.later`).

The config's own checks run once, on the final values. A flag or a `--set` path that is wrong
ends the command with one `<prog>: error: ...` line and status 2; `--print-config` prints the
resolved settings as JSON and exits 0. Inputs that are not settings (--workdir, data files)
are plain flags that a command adds itself (`Command.inputs`).

Why the standard library's argparse and a path walker of our own (`training.overrides`) rather
than a CLI library: the command line users have (`--set stages.-1.windows=...`, `--config FILE`,
one-line errors with status 2) is not what tyro, draccus or ml_collections' config_flags spell.
None indexes a tuple of dataclasses (`stages.0.steps`); tyro refuses a value for a field typed
`Any` (the models' dtypes) and reports errors in boxes; draccus reads YAML or JSON config files,
not a Python `get_config()`, and decodes values by YAML's rules (`yes` is no bool there); absl's
flags, on which config_flags stands, are process-global state. So the library here is the
standard one, with the smallest piece of our own on top.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

EXIT_USAGE = 2
# The checkout's root: train/configs/ and eval/configs/ hold the presets.
ROOT = Path(__file__).resolve().parents[2]


class Parser(argparse.ArgumentParser):
  """argparse, with every error in one line, `<prog>: error: <message>`, and status 2."""

  def __init__(self, prog: str, doc: str | None, **kwargs):
    super().__init__(prog=prog, description=doc,
                     formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

  def error(self, message: str) -> typing.NoReturn:
    self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def nonnegative_int(text: str) -> int:
  """An argparse type for an input such as --step: an int >= 0, else an error naming it."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}") from None
  if value < 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
  return value


def add_step(parser: argparse.ArgumentParser) -> None:
  """The --step input of the commands that read a run's checkpoint."""
  parser.add_argument("--step", type=nonnegative_int, default=None,
                      help="checkpoint step (default: latest)")


def check_bounds(config: Any, lows: Mapping[str, int]) -> None:
  """A command config's range checks: each named field, unless None, an int at least its low
  bound (a ValueError naming the field and value otherwise)."""
  for name, low in lows.items():
    value = getattr(config, name)
    if value is not None and value < low:
      raise ValueError(f"{name} must be >= {low}, got {value}")


def check_learning_rate(value: float) -> None:
  if not (value > 0 and math.isfinite(value)):
    raise ValueError(f"learning_rate must be a finite number > 0, got {value}")


@dataclasses.dataclass(frozen=True)
class Command:
  """What a command's settings are.

  prog, doc: its name (train.finetune) and --help text.
  config_class: the frozen dataclass of its settings.
  flags: {config field (a dotted path for a nested one): help}; each gets a flag of its own,
    `--name` of its last name.
  default: the config without --config or --preset (None: one of them is needed), or the name
    of the preset that is the default.
  presets: the preset folder's name pattern, relative to the checkout (train/configs/char_*).
  options: a nested field of the config whose fields --set may name bare.
  later: the config class a command builds after its settings (TrainConfig) and that takes the
    --set paths naming no field of `config_class`; None: such a path is an error.
  inputs: adds the command's plain flags (not settings) to the parser.
  """
  prog: str
  doc: str
  config_class: type
  flags: Mapping[str, str] = dataclasses.field(default_factory=dict)
  default: Callable[[], Any] | str | None = None
  presets: str | None = None
  options: str | None = None
  later: type | None = None
  inputs: Callable[[argparse.ArgumentParser], None] | None = None

  def default_config(self) -> Any:
    if isinstance(self.default, str):
      return load_config(self.preset_file(self.default))
    return self.default()

  def preset_names(self) -> tuple[str, ...]:
    if self.presets is None:
      return ()
    folder, _, pattern = self.presets.rpartition("/")
    return tuple(sorted(p.stem for p in (ROOT / folder).glob(f"{pattern}.py")))

  def preset_file(self, name: str) -> Path:
    if name not in self.preset_names():
      raise ValueError(f"unknown preset {name!r}; presets: {list(self.preset_names())}"
                       + ("" if (ROOT / "train").is_dir() else
                          " (the presets are the config files of a checkout: give --config)"))
    return ROOT / self.presets.rpartition("/")[0] / f"{name}.py"


@dataclasses.dataclass(frozen=True)
class Parsed:
  """A command line resolved: the config, the plain flags, the --set paths of the config built
  later, and where the config came from (`origin`: the config file or preset, else None)."""
  config: Any
  args: argparse.Namespace
  later: tuple[str, ...] = ()
  origin: str | None = None
  command: Command | None = None

  def inputs(self) -> dict[str, Any]:
    """The plain flags' values (the command line's other than its settings)."""
    settings = set(_SOURCE) | set(self.command.flags if self.command else ())
    return {k: v for k, v in vars(self.args).items() if k not in settings}

  def printed(self) -> bool:
    """With --print-config: prints the settings and inputs as JSON and returns True."""
    if self.args.print_config:
      print_json({"settings": as_json(self.config), "inputs": self.inputs()})
    return self.args.print_config


# The flags that say where the settings come from (not settings themselves).
_SOURCE = ("config", "preset", "set", "print_config")


def load_config(path: str | Path):
  """`get_config()` of a config file, imported by path."""
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


def parser(command: Command) -> Parser:
  """The command's parser: the config source, its config flags, --set, --print-config and its
  inputs; --help lists every setting with its type and default."""
  groups = _nested(command.config_class)
  if command.options:
    groups.append((f"{command.options}.", _field_types(command.config_class)[command.options]))
  if command.later is not None:
    groups += _nested(command.later)
  p = Parser(command.prog, command.doc, epilog=settings_help(groups))
  source = p.add_mutually_exclusive_group()
  source.add_argument("--config", default=None, metavar="FILE",
                      help=f"a config file whose get_config() returns a "
                           f"{command.config_class.__name__}")
  if command.presets:
    source.add_argument("--preset", default=None, metavar="NAME",
                        help=f"a config file of {command.presets.rpartition('/')[0]}/: "
                             + "; ".join(_preset_line(command, n) for n in command.preset_names())
                             + (f" (default: {command.default})"
                                if isinstance(command.default, str) else ""))
  p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                 help="set a setting (listed below), last; e.g. --set stages.0.steps=100")
  p.add_argument("--print-config", action="store_true",
                 help="print the resolved settings as JSON and exit; writes nothing")
  group = p.add_argument_group("settings with a flag (a --set of the same path)")
  for name, help_text in command.flags.items():
    flag, annotation = _flag(name), _annotation(command.config_class, name)
    if annotation is bool:
      group.add_argument(flag, dest=name, action="store_const", const="true",
                         default=argparse.SUPPRESS, help=help_text)
    else:
      tuple_like = typing.get_origin(_unoptional(annotation)) is tuple
      group.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=help_text,
                         nargs="+" if tuple_like else None,
                         metavar=name.rpartition(".")[2].upper())
  if command.inputs is not None:
    command.inputs(p)
  return p


def parse(command: Command, argv: Sequence[str] | None) -> tuple[Parser, Parsed]:
  """The settings of a command line, in the module docstring's order; a bad one exits with
  status 2 and one line."""
  p = parser(command)
  args = p.parse_args(argv)
  preset = getattr(args, "preset", None)
  try:
    if args.config or preset:
      origin = f"--config {args.config}" if args.config else f"--preset {preset}"
      base = load_config(args.config or command.preset_file(preset))
      if not isinstance(base, command.config_class):
        raise TypeError(f"{origin} gives a {type(base).__name__}; {command.prog} takes a "
                        f"{command.config_class.__name__}")
    elif command.default is None:
      raise ValueError("give --config FILE or --preset NAME")
    else:
      origin, base = None, command.default_config()
    given = [(name, getattr(args, name)) for name in command.flags if hasattr(args, name)]
    # A flag of several values is one tuple (the trailing comma makes one value a tuple too).
    flagged = [(f"{name}=" + (",".join(value) + "," if isinstance(value, list) else value),
                _flag(name)) for name, value in given]
    mine, later = _route(command, args.set)
    from longformer_jax.training import apply_overrides
    config = apply_overrides(base, flagged + mine)
  except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
    p.error(str(e))
  return p, Parsed(config, args, tuple(later), origin, command)


def _route(command: Command, sets: Sequence[str]) -> tuple[list[str], list[str]]:
  """(--set assignments of the config, --set paths of the config built later)."""
  fields = _field_types(command.config_class)
  bare = (set(_field_types(fields[command.options])) if command.options else set())
  mine, later = [], []
  for assignment in sets:
    path = assignment.partition("=")[0].strip()
    head = path.split(".")[0]
    if "." in path and head in fields and not _has_fields(fields[head]) and command.later:
      later.append(assignment)  # model.dropout: a path of the TrainConfig's model, not `model`
    elif head in fields or not (head in bare or command.later):
      mine.append(assignment)
    elif head in bare:
      mine.append(f"{command.options}.{assignment.strip()}")
    else:
      later.append(assignment)
  return mine, later


def _has_fields(annotation: Any) -> bool:
  """Whether a field of this type has parts a dotted path can name."""
  return any(dataclasses.is_dataclass(a) or typing.get_origin(a) in (tuple, dict)
             or a in (tuple, dict) for a in (typing.get_args(annotation) or (annotation,)))


def print_json(value: Any) -> None:
  print(json.dumps(value, indent=2, default=str))


def as_json(config: Any) -> Any:
  """A config as JSON values (dataclasses as dicts, dtypes by name)."""
  if dataclasses.is_dataclass(config):
    return {f.name: as_json(getattr(config, f.name)) for f in dataclasses.fields(config)}
  if isinstance(config, (tuple, list)):
    return [as_json(v) for v in config]
  if isinstance(config, dict):
    return {k: as_json(v) for k, v in config.items()}
  return config if isinstance(config, (int, float, str, bool, type(None))) else str(config)


def settings_help(groups: Sequence[tuple[str, type]]) -> str:
  """The fields of settings dataclasses, one line each (`prefix.name: type = default`)."""
  from longformer_jax.training.overrides import type_name
  lines = ["settings (--set PATH=VALUE; --print-config shows the resolved values):"]
  for prefix, cls in groups:
    for f in dataclasses.fields(cls):
      if f.default is not dataclasses.MISSING:
        default = f" = {f.default!r}"
      elif f.default_factory is not dataclasses.MISSING:
        default = f" = {f.default_factory()!r}"
      else:
        default = ""
      lines.append(f"  {prefix}{f.name}: {type_name(_field_types(cls)[f.name])}{default}")
  return "\n".join(lines)


def _preset_line(command: Command, name: str) -> str:
  """A preset and, for a config of flags, its settings that differ from the defaults."""
  config = load_config(command.preset_file(name))
  default = command.default_config() if command.default else None
  changed = [f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config)
             if f.name in command.flags and getattr(config, f.name) != getattr(default, f.name,
                                                                               None)]
  return f"{name}: {', '.join(changed)}" if changed else name


def _flag(path: str) -> str:
  """The flag of a config field: its last name, `-` for `_` (options.segment_length:
  --segment-length)."""
  return "--" + path.rpartition(".")[2].replace("_", "-")


def _annotation(cls: type, path: str) -> Any:
  """The declared type of a dotted path of dataclass fields."""
  for name in path.split("."):
    annotation = _field_types(cls)[name]
    cls = annotation
  return annotation


def _nested(cls: type) -> list[tuple[str, type]]:
  """(prefix, class) of a config and, for a TrainConfig, its stages, for --help."""
  from longformer_jax.training import Stage, TrainConfig
  return [("", cls)] + ([("stages.N.", Stage)] if cls is TrainConfig else [])


def _field_types(cls: type) -> dict[str, Any]:
  from longformer_jax.training.overrides import field_types
  return field_types(cls)


def _unoptional(annotation: Any) -> Any:
  args = [a for a in typing.get_args(annotation) if a is not type(None)]
  return args[0] if typing.get_origin(annotation) in (typing.Union, _UnionType) and len(
      args) == 1 else annotation


_UnionType = type(int | None)


def usage_error(p: argparse.ArgumentParser, error: Exception) -> typing.NoReturn:
  """Exits with status 2 and one line naming the bad value (no traceback)."""
  p.exit(EXIT_USAGE, f"{p.prog}: error: {error}\n")

