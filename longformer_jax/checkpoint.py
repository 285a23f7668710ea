"""Orbax checkpoints, the only module that reads or writes them: models and train states, each
verified when read.

Model checkpoints (`save_model` / `load_model`): a directory with `params/` (an Orbax checkpoint
of the `nnx.Param` state) and `model.json` (the model and config classes, the config's fields and
the parameters' checksums). No pickle anywhere. Any model of `MODEL_CLASSES` can be saved:
  * the model has a `config` attribute, a dataclass with `to_dict()`/`from_dict()` (or plain
    JSON-able fields, rebuilt by `ConfigClass(**fields)`);
  * it is built as `ModelClass(config, rngs=nnx.Rngs(seed), **model.init_kwargs)`, where the
    optional `init_kwargs` attribute holds the other constructor arguments as JSON values.
Loading builds only the classes of `MODEL_CLASSES` (the library's models and their configs),
after checking every field of model.json by type and range: a checkpoint is data, and opening
one runs none of its own code (docs/checkpoints.md).

Train-state checkpoints (`TrainCheckpoints` writes them, `restore_train_state` reads them): an
Orbax `CheckpointManager` directory (`<workdir>/checkpoints`) with one directory per step, holding
three items: `params/` (the same `nnx.Param` state as a model checkpoint's), `opt_state/` (the
optimizer state) and `meta/` (JSON: step, stage, data position, the run's settings, and the
checksums of the other two items, sealed by a SHA-256 of the rest).

Verification. Every array's checksum is computed on its devices when it is saved (`checksums`: two
32-bit position-dependent hashes of its bits, exact integer sums, so the value does not depend on
the sharding or the mesh) and recomputed from what Orbax returns when it is read. A step whose
files are missing, truncated, undecodable or altered (a bit flip in a weight or an Adam moment)
fails to restore or to verify: `restore_train_state` and `load_params` then take the newest step
that does, warn in one line naming the skipped step and why, and never move or delete it. An
explicitly requested step that fails is an error (`DamagedCheckpointError`, one line). A resumed
run sets the damaged steps newer than the one it resumes from aside (`set_aside`: renamed,
never deleted or changed) so that it can save those steps again.

`load_params` reads the parameters of either kind, and only them: of a train-state checkpoint it
opens the `params` and `meta` items alone, so the optimizer state (twice the parameters' size
with Adam) is never read, and damage there does not stop an evaluation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import hashlib
import importlib
import io
import json
import logging
import os
import resource
import shutil
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from longformer_jax.io import atomic_write, read_json


@contextlib.contextmanager
def _root_logging_kept():
  """Undoes what absl does to an unconfigured program: its first log call (Orbax logs through
  absl, at import and on every save) runs `logging.basicConfig()`, adding a stderr handler to
  the root logger of the caller's whole program. Removed again here, when the root logger had
  no handler before; a program that configured logging itself is never touched."""
  root = logging.getLogger()
  unconfigured = not root.handlers
  try:
    yield
  finally:
    if unconfigured:
      for handler in list(root.handlers):
        if (type(handler) is logging.StreamHandler and handler.stream is sys.stderr
            and handler.formatter is not None
            and handler.formatter._fmt == logging.BASIC_FORMAT):
          root.removeHandler(handler)


with _root_logging_kept():
  import orbax.checkpoint as ocp

_FORMAT_VERSION = 2
MODEL_JSON = "model.json"
CHECKPOINTS = "checkpoints"  # the train-state checkpoints' directory inside a workdir
_ITEMS = ("params", "opt_state")  # the array items of a train state, checksummed in its meta


class CheckpointError(RuntimeError):
  """A checkpoint could not be written or read. The message is one line: what and why."""


class DamagedCheckpointError(CheckpointError):
  """A checkpoint exists but does not restore or does not match its checksums."""


class CheckpointSaveError(CheckpointError):
  """Writing a checkpoint failed (e.g. a full disk); the step is not saved."""


def _orbax_path(path: str | os.PathLike) -> epath.Path:
  """`path` as Orbax wants it: absolute when local; gs:// and other remote paths as they are."""
  path = epath.Path(path)
  return path if "://" in str(path) else path.absolute()


def _warn(message: str) -> None:
  """One line on stderr, from the first process only (all of them make the same decision)."""
  if jax.process_index() == 0:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def describe_error(error: BaseException, limit: int = 1000) -> str:
  """The first line of the innermost cause of `error`: what Orbax and TensorStore wrap in
  several layers (and specs of hundreds of lines) reduced to the line that says what failed."""
  while error.__cause__ is not None:
    error = error.__cause__
  lines = str(error).strip().splitlines()
  text = lines[0] if lines else ""
  text = f"{type(error).__name__}: {text}" if text else type(error).__name__
  return text if len(text) <= limit else text[:limit - 3] + "..."


# ----------------------------------------------------------------------------------------------
# Checksums.

_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: spreads consecutive positions over the words


def _fmix(h: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finaliser: every input bit flips each output bit with probability
  about 1/2, so one flipped bit anywhere changes the sum below."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
  """The bits of `x` as uint32 words (8-byte elements give a trailing axis of 2)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  size = x.dtype.itemsize
  if size in (1, 2):
    return jax.lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16).astype(
        jnp.uint32)
  if size in (4, 8):
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  raise TypeError(f"cannot checksum an array of dtype {x.dtype}")


def _position(shape: tuple[int, ...]) -> jax.Array:
  """Each element's flat index (mod 2**32), built from iotas rather than a reshape, so that a
  sharded array is never gathered."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(
        stride % 2**32)
    stride *= shape[axis]
  return index


def _leaf_checksum(x: jax.Array) -> jax.Array:
  words = _words(x)
  position = _fmix(_position(words.shape) * jnp.uint32(_GOLDEN) + jnp.uint32(1))
  # Two independent 32-bit sums (a 64-bit check). uint32 addition wraps and is associative, so
  # the partial sums of any sharding add up to the same value.
  first = jnp.sum(_fmix(words ^ position), dtype=jnp.uint32)
  second = jnp.sum(_fmix((words + jnp.uint32(_GOLDEN)) ^ _fmix(position)), dtype=jnp.uint32)
  return jnp.stack([first, second])


@jax.jit
def _tree_checksums(tree):
  return jax.tree.map(_leaf_checksum, tree)


def _key(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def checksums(tree: Any) -> dict[str, str]:
  """{leaf path: 16 hex digits} of every array in `tree`; exact on any sharding or mesh."""
  sums = _tree_checksums(tree)
  out = {}
  for path, pair in jax.tree_util.tree_flatten_with_path(sums)[0]:
    first, second = (int(v) for v in np.asarray(pair))
    out[_key(path)] = f"{first:08x}{second:08x}"
  return out


def verify_checksums(tree: Any, expected: Mapping[str, str], what: str) -> None:
  """Raises DamagedCheckpointError naming the first array of `tree` whose checksum differs from
  `expected` (or that is missing from it)."""
  actual = checksums(tree)
  if set(actual) != set(expected):
    missing = sorted(set(actual) ^ set(expected))
    raise DamagedCheckpointError(f"{what}: the arrays differ from those the checksums list "
                                 f"({len(missing)} names, e.g. {missing[0]!r})")
  bad = [name for name in actual if actual[name] != expected[name]]
  if bad:
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    raise DamagedCheckpointError(
        f"{what}: checksum mismatch in {bad[0]}{more}: written {expected[bad[0]]}, read "
        f"{actual[bad[0]]}")


def _seal(record: dict[str, Any]) -> dict[str, Any]:
  """`record` plus the SHA-256 of its canonical JSON, so that damage to it is detected too."""
  text = json.dumps(record, sort_keys=True, separators=(",", ":"))
  return {**record, "sha256": hashlib.sha256(text.encode()).hexdigest()}


def _unseal(record: Any, what: str) -> dict[str, Any]:
  if not isinstance(record, dict) or "sha256" not in record:
    raise DamagedCheckpointError(f"{what}: no checksum (not written by this version, or cut "
                                 "short)")
  rest = {k: v for k, v in record.items() if k != "sha256"}
  if _seal(rest)["sha256"] != record["sha256"]:
    raise DamagedCheckpointError(f"{what}: its contents do not match their SHA-256")
  return rest


# When a read or write fails inside Orbax, Orbax abandons the rest of it: its array reads and
# writes run under `asyncio.gather` on an event loop of its own, which it closes as soon as the
# first one fails, while the others are still in flight. Those report later, each with a
# traceback ("Event loop is closed" from TensorStore's completion callbacks, "Exception ignored
# in: <coroutine ...>" when an abandoned read is collected), and Orbax logs the failure, with its
# traceback, from every thread it passes through. None of it says more than the one line this
# module raises (`describe_error` of the same exception). What is done about it here, with
# public APIs only (docs/design.md §5.4, "Orbax failures"):
#   * the cause, for the failure that matters in practice: a save is not started when it cannot
#     fit (`_check_room`: the free space and the file-size limit), so a full disk never reaches
#     Orbax and nothing is abandoned;
#   * a failure inside Orbax all the same (a disk that fills during a save, a damaged file on
#     read): Orbax's threads are waited for through the manager's own API, and what the failure
#     abandoned is collected at once (`_collect_abandoned`) with its reports kept off stderr,
#     instead of surfacing at some later point of the caller's program;
#   * Orbax's ERROR log records are dropped while one of this module's reads or writes runs (a
#     `logging.Filter` on the absl logger, and on asyncio's for the abandoned tasks it reports),
#     added and removed with that scope: the caller's loggers are left as they were.
_quiet_lock = threading.Lock()
_quiet_depth = 0
_quiet_installed: tuple[logging.Filter, Any] | None = None


def _from_orbax(record: logging.LogRecord) -> bool:
  if f"{os.sep}orbax{os.sep}" in record.pathname:
    return True
  try:
    message = record.getMessage()
  except Exception:
    message = str(record.msg)
  return "orbax" in message or "Event loop is closed" in message


class _DropOrbaxErrors(logging.Filter):

  def filter(self, record: logging.LogRecord) -> bool:
    if record.name == "asyncio":  # a task or future Orbax abandoned ("... never retrieved")
      exc = record.exc_info[1] if record.exc_info else None
      return not (_from_orbax(record) or (exc is not None and _raised_in_orbax(exc)))
    # The failure is raised to the caller as a CheckpointError.
    return not (record.levelno >= logging.ERROR and _from_orbax(record))


def _raised_in_orbax(error: BaseException) -> bool:
  tb = error.__traceback__
  while tb is not None:
    if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


_QUIET_LOGGERS = ("absl", "asyncio")


def _enter_quiet() -> None:
  global _quiet_depth, _quiet_installed
  with _quiet_lock:
    _quiet_depth += 1
    if _quiet_depth > 1:
      return
    dropper = _DropOrbaxErrors()
    for name in _QUIET_LOGGERS:
      logging.getLogger(name).addFilter(dropper)
    root_logging = _root_logging_kept()
    root_logging.__enter__()
    _quiet_installed = (dropper, root_logging)


def _exit_quiet() -> None:
  global _quiet_depth, _quiet_installed
  with _quiet_lock:
    _quiet_depth -= 1
    if _quiet_depth > 0 or _quiet_installed is None:
      return
    dropper, root_logging = _quiet_installed
    _quiet_installed = None
    for name in _QUIET_LOGGERS:
      logging.getLogger(name).removeFilter(dropper)
    root_logging.__exit__(None, None, None)


@contextlib.contextmanager
def _orbax_quiet():
  """The scope of one read or write (see the comment above)."""
  _enter_quiet()
  try:
    yield
  finally:
    _exit_quiet()


def _collect_abandoned(error: BaseException) -> None:
  """Collects now what a failed Orbax read or write abandoned (the comment above), so that it
  does not report at some later point of the caller's program.

  The frames of `error`'s traceback hold the abandoned coroutines and tasks: their locals are
  cleared (file names and line numbers stay) and the garbage collector runs. What the abandoned
  work reports as it is collected (its error: Orbax's read turns the close of a coroutine into
  an error of its own) goes to a discarded stderr for the length of that one collection; the
  same error was raised to the caller in one line.
  """
  traceback.clear_frames(error.__traceback__)
  with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
    warnings.simplefilter("ignore")  # "coroutine ... was never awaited": nothing to add
    gc.collect()


def _check_room(directory: epath.Path, step: int, items: Mapping[str, Any]) -> None:
  """Raises CheckpointSaveError, before Orbax writes anything, when the checkpoint cannot fit:
  less free space on `directory`'s file system than its arrays' bytes (a full disk), or a
  file-size limit (`ulimit -f`) below the largest item. A write Orbax starts and cannot finish
  leaves work behind it (the comment above); a save that would fail is not started. Local
  directories only (a remote store reports no free space)."""
  if "://" in str(directory):
    return
  sizes = {name: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)
                     if hasattr(x, "dtype")) for name, tree in items.items()}
  needed = sum(sizes.values()) + _ROOM_MARGIN
  why = None
  free = shutil.disk_usage(directory).free
  if free < needed:
    why = (f"{os.strerror(errno.ENOSPC)} (the checkpoint needs about {needed:,} bytes, "
           f"{free:,} are free)")
  limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
  if limit != resource.RLIM_INFINITY and limit < max(sizes.values()):
    why = (f"{os.strerror(errno.EFBIG)} (its {max(sizes, key=sizes.get)} item needs about "
           f"{max(sizes.values()):,} bytes in a file; the file-size limit is {limit:,} bytes)")
  if why is not None:
    raise CheckpointSaveError(f"saving step {step} in {directory} failed: {why}")


# Room beyond the arrays' bytes: Orbax's metadata, the manifest, the meta item.
_ROOM_MARGIN = 1 << 20


def _read(what: str, fn: Callable[[], Any]) -> Any:
  """fn(), with any failure turned into a one-line DamagedCheckpointError."""
  with _orbax_quiet():
    try:
      return fn()
    except DamagedCheckpointError:
      raise
    except Exception as e:
      # Whatever Orbax, TensorStore or the file system raise for a broken file.
      _collect_abandoned(e)
      raise DamagedCheckpointError(f"{what}: {describe_error(e)}") from e


def _restore_item(what: str, item_dir: epath.Path, target: Any) -> Any:
  """The arrays of one checkpoint item (`params`, `opt_state`) restored into `target`, after
  `_check_readable`; any failure is a one-line DamagedCheckpointError."""
  _read(what, lambda: _check_readable(item_dir))
  return _read(what, lambda: ocp.StandardCheckpointer().restore(item_dir, target))


def _check_readable(item_dir: epath.Path) -> None:
  """Reads and decodes every array of a local OCDBT item, one array at a time, through
  TensorStore itself, before Orbax reads it.

  Why (the cause of the stray tracebacks described above, for reads): Orbax reads an item's
  arrays concurrently on an event loop of its own and closes that loop at the first failure,
  while the other reads are still in flight; their completion callbacks then find the loop closed
  and print "Event loop is closed" at some later point of the program. A truncated, missing or
  undecodable data file is found here instead, by one synchronous read at a time, so nothing is
  left in flight. The arrays are decoded, not only their stored values read: OCDBT reads a value
  whose data file is missing as an empty value, which only the decoder refuses (an empty
  compressed chunk). The values are read twice (the second time from the page cache); altered
  contents that still decode are caught after the restore by the checksums. Remote paths are
  left to Orbax."""
  if "://" in str(item_dir) or not (item_dir / "manifest.ocdbt").exists():
    return
  import tensorstore as ts
  context = ts.Context()  # one cache of the database's index for all of the item's arrays
  base = {"driver": "ocdbt", "base": f"file://{item_dir}/"}
  store = ts.KvStore.open(base, context=context).result()
  keys = [key.decode() for key in store.list().result()]
  # Each array is a prefix with its metadata key: zarr (v2) `.zarray` or zarr v3 `zarr.json`.
  arrays = {key[:-len(name)]: driver for key in keys
            for name, driver in _ARRAY_METADATA.items() if key.endswith("/" + name)}
  for prefix, driver in arrays.items():
    array = ts.open({"driver": driver, "kvstore": {**base, "path": prefix},
                     "fill_missing_data_reads": False}, context=context, open=True).result()
    array.read().result()
  for key in keys:  # any value outside the arrays, as Orbax would read it: its bytes
    if not any(key.startswith(prefix) for prefix in arrays):
      store.read(key).result()


# The metadata key of an array in an item's store -> the TensorStore driver that decodes it.
_ARRAY_METADATA = {".zarray": "zarr", "zarr.json": "zarr3"}


# ----------------------------------------------------------------------------------------------
# Models: parameters + model.json.


def _class_path(cls: type) -> str:
  return f"{cls.__module__}:{cls.__qualname__}"


# The classes a model.json may name: nothing else is ever imported or called when a checkpoint
# is loaded (a model.json is data, whoever wrote it; its seal is a checksum anyone can
# recompute, not a signature). Model class -> (its config class, the constructor arguments
# besides config and rngs that model.json may give, with their types). A new model class joins
# with one line here (or `register_model_class` from a program's own code).
_LONGFORMER = "longformer_jax.config:LongformerConfig"
_LED = "longformer_jax.config:LEDConfig"
MODEL_CLASSES: dict[str, tuple[str, dict[str, type]]] = {
    "longformer_jax.modeling:LongformerModel": (_LONGFORMER, {"add_pooling_layer": bool}),
    "longformer_jax.modeling:LongformerForMaskedLM": (_LONGFORMER, {}),
    "longformer_jax.modeling:LongformerForSequenceClassification": (_LONGFORMER, {}),
    "longformer_jax.modeling:LongformerForQuestionAnswering": (_LONGFORMER, {}),
    "longformer_jax.modeling:LongformerForTokenClassification": (_LONGFORMER, {}),
    "longformer_jax.modeling:LongformerForMultipleChoice": (_LONGFORMER, {}),
    "longformer_jax.causal_lm:LongformerForCausalLM": ("longformer_jax.config:CharLMConfig", {}),
    "longformer_jax.led:LEDModel": (_LED, {}),
    "longformer_jax.led:LEDForConditionalGeneration": (_LED, {}),
    "longformer_jax.led:LEDForQuestionAnswering": (_LED, {}),
    "longformer_jax.coref:LongformerForCoreference": ("longformer_jax.coref:CorefConfig", {}),
    "longformer_jax.hotpotqa:LongformerForHotpotQA": (_LONGFORMER, {}),
    "longformer_jax.wikihop:LongformerForWikiHop": (_LONGFORMER, {}),
}
# Classes registered at run time by `register_model_class` (the program's own objects).
_REGISTERED: dict[str, type] = {}


def register_model_class(model_class: type, config_class: type,
                         init_kwargs: Mapping[str, type] | None = None) -> None:
  """Lets `load_model` build `model_class` (with a `config_class` config and the constructor
  arguments `init_kwargs`, name -> type, that model.json may give) from now on in this
  program: how code adds a model class to what checkpoints may name. A model.json never can."""
  for cls in (model_class, config_class):
    if not isinstance(cls, type):
      raise TypeError(f"register_model_class takes classes, got {cls!r}")
  MODEL_CLASSES[_class_path(model_class)] = (_class_path(config_class),
                                             dict(init_kwargs or {}))
  _REGISTERED[_class_path(model_class)] = model_class
  _REGISTERED[_class_path(config_class)] = config_class


def _import_class(path: str) -> type:
  """The class `path` ("module:QualName") of `MODEL_CLASSES`, a model class or the config class
  of one; ValueError for any other name (the caller has checked it is one)."""
  if path in _REGISTERED:
    return _REGISTERED[path]
  allowed = set(MODEL_CLASSES) | {config for config, _ in MODEL_CLASSES.values()}
  if path not in allowed:
    raise ValueError(f"{path!r} is not a model or config class that checkpoints may name")
  module, _, name = path.partition(":")
  obj = importlib.import_module(module)  # a module of this package, named by the table above
  for part in name.split("."):
    obj = getattr(obj, part)
  if not isinstance(obj, type) or _class_path(obj) != path:
    raise ValueError(f"{path!r} does not name a class")  # a stale entry of the table
  return obj


def _check_model_meta(meta: Any, where: str) -> dict[str, Any]:
  """model.json's fields, each checked by type and range before anything is imported or built:
  ValueError naming `where` (the file) and the field."""
  expected = {"format_version", "model_class", "config_class", "config", "init_kwargs",
              "checksums"}
  if set(meta) != expected:
    extra, missing = sorted(set(meta) - expected), sorted(expected - set(meta))
    raise ValueError(f"{where}: not a model checkpoint's record: "
                     + "; ".join(filter(None, [extra and f"unknown fields {extra}",
                                               missing and f"missing fields {missing}"])))
  model_class = meta["model_class"]
  if not isinstance(model_class, str) or model_class not in MODEL_CLASSES:
    raise ValueError(f"{where}: model_class={model_class!r} is not one of the model classes "
                     f"checkpoints may name ({', '.join(sorted(MODEL_CLASSES))})")
  config_class, kwarg_types = MODEL_CLASSES[model_class]
  if meta["config_class"] != config_class:
    raise ValueError(f"{where}: config_class={meta['config_class']!r}; a {model_class} takes "
                     f"{config_class!r}")
  if not isinstance(meta["config"], dict):
    raise ValueError(f"{where}: config must be a JSON object of the config's fields, got "
                     f"{type(meta['config']).__name__}")
  kwargs = meta["init_kwargs"]
  if not isinstance(kwargs, dict):
    raise ValueError(f"{where}: init_kwargs must be a JSON object, got "
                     f"{type(kwargs).__name__}")
  for name, value in kwargs.items():
    if name not in kwarg_types:
      raise ValueError(f"{where}: init_kwargs.{name}: a {model_class} takes "
                       f"{sorted(kwarg_types) or 'none'}")
    if type(value) is not kwarg_types[name]:
      raise ValueError(f"{where}: init_kwargs.{name}={value!r} must be a "
                       f"{kwarg_types[name].__name__}")
  sums = meta["checksums"]
  if not (isinstance(sums, dict) and set(sums) == {"params"}
          and _is_checksum_table(sums["params"])):
    raise ValueError(f"{where}: checksums must be {{\"params\": {{array name: 16 hex digits}}}}")
  return meta


def _model_classes(meta: dict[str, Any], where: str) -> tuple[type, Any]:
  """(model class, config) of a checked model.json: the config built and validated (bounds
  included) before any model is."""
  model_class = _import_class(meta["model_class"])
  try:
    config = _config_from_dict(_import_class(meta["config_class"]), meta["config"])
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where}: config: {e}") from None
  return model_class, config


def _config_to_dict(config) -> dict:
  if hasattr(config, "to_dict"):
    return config.to_dict()
  if dataclasses.is_dataclass(config):
    return dataclasses.asdict(config)
  raise TypeError(f"model.config must be a dataclass or have to_dict(); got {type(config)}")


def _config_from_dict(config_class: type, fields: dict):
  if hasattr(config_class, "from_dict"):
    return config_class.from_dict(fields)
  return config_class(**fields)


def save_model(path: str | os.PathLike, model: nnx.Module, *, force: bool = False) -> None:
  """Writes `model`'s parameters and config to the directory `path`.

  force=True replaces an existing checkpoint there; otherwise an existing one is an error.
  """
  path = _orbax_path(path)
  if not hasattr(model, "config"):
    raise TypeError(f"{type(model).__name__} has no `config` attribute; save_model needs one")
  if MODEL_CLASSES.get(_class_path(type(model)), ("",))[0] != _class_path(type(model.config)):
    # What load_model would refuse to build is not written.
    raise TypeError(f"{_class_path(type(model))} with a {type(model.config).__name__} is not a "
                    "model class checkpoints may name (checkpoint.MODEL_CLASSES; "
                    "register_model_class adds one)")
  params = nnx.state(model, nnx.Param)
  meta = _seal({
      "format_version": _FORMAT_VERSION,
      "model_class": _class_path(type(model)),
      "config_class": _class_path(type(model.config)),
      "config": _config_to_dict(model.config),
      "init_kwargs": dict(getattr(model, "init_kwargs", {})),
      "checksums": {"params": checksums(params)},
  })
  meta_json = json.dumps(meta, indent=2)  # fail on non-JSON fields before writing anything
  if path.exists() and not force:
    raise FileExistsError(f"{path} exists; pass force=True to replace it")
  with _orbax_quiet():
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / "params", params, force=force)
    checkpointer.wait_until_finished()
  # model.json is written last: a directory that has it holds a complete checkpoint.
  atomic_write(path / MODEL_JSON, meta_json)


def _model_meta(path: epath.Path) -> dict[str, Any]:
  """The checked fields of `path`'s model.json (`_check_model_meta`); the file is opened only
  if it is a regular file (`io.read_json`: never a FIFO or a device)."""
  meta_file = path / MODEL_JSON
  if not meta_file.exists():
    raise FileNotFoundError(f"{path} is not a model checkpoint (no {MODEL_JSON})")
  local = "://" not in str(path)
  meta = read_json(str(meta_file), str(path) if local else None)
  if not isinstance(meta, dict):
    raise ValueError(f"{meta_file}: holds {type(meta).__name__}; expected a JSON object")
  if meta.get("format_version") != _FORMAT_VERSION:
    raise ValueError(f"{meta_file}: format_version={meta.get('format_version')!r}, this code "
                     f"reads {_FORMAT_VERSION}")
  return _check_model_meta(_unseal(meta, str(meta_file)), str(meta_file))


def load_model(path: str | os.PathLike, *, seed: int = 0) -> nnx.Module:
  """The model saved at `path`, with its parameters restored (no initialisation compute).

  seed: seeds the model's non-parameter state (dropout streams).
  Only the classes of `MODEL_CLASSES` are built, and every field of model.json is checked
  first (docs/checkpoints.md): loading a checkpoint runs no code of its own.
  """
  meta = _model_meta(_orbax_path(path))
  model_class, config = _model_classes(meta, str(_orbax_path(path) / MODEL_JSON))
  kwargs = meta["init_kwargs"]
  return restore_model(lambda: model_class(config, rngs=nnx.Rngs(seed), **kwargs), path)


def restore_model(build: Callable[[], nnx.Module], path: str | os.PathLike, *,
                  step: int | None = None, shardings: Callable[[Any], Any] | None = None
                  ) -> nnx.Module:
  """`build()`'s model with the parameters of `path` (anything `load_params` reads).

  Nothing is initialised: the model is built abstractly (`nnx.eval_shape`) and its parameters
  come straight from the checkpoint. shardings: a function of the abstract parameters giving
  their shardings (e.g. `training.param_shardings` over a mesh); default: the default device.
  """
  return restore_model_and_meta(build, path, step=step, shardings=shardings)[0]


def restore_model_and_meta(build: Callable[[], nnx.Module], path: str | os.PathLike, *,
                           step: int | None = None,
                           shardings: Callable[[Any], Any] | None = None
                           ) -> tuple[nnx.Module, int | None, dict[str, Any]]:
  """(model, step, meta): `restore_model`'s model, the step it came from (None for a model
  checkpoint) and the checkpoint's meta (`load_params_with_step`)."""
  graphdef, abstract_params, _ = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
  if shardings is not None:
    abstract_params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract_params, shardings(abstract_params))
  params, step, meta = load_params_with_step(path, abstract_params, step=step)
  # The other state (RNG streams) is tiny; under jit the unused parameter initialisers are
  # dead code, so building it costs no initialisation compute.
  rest = jax.jit(lambda: nnx.split(build(), nnx.Param, ...)[2])()
  return nnx.merge(graphdef, params, rest), step, meta


def load_params(path: str | os.PathLike, abstract_params: Any, *, step: int | None = None):
  """The parameters (an `nnx.State` like `abstract_params`) saved under `path`, verified, and
  only them.

  path: a model checkpoint (`save_model`), a train-state checkpoint directory (`<workdir>/
    checkpoints`), or a training workdir holding one; step: of a train-state checkpoint
    (default: the newest that restores and verifies; others are skipped with a warning).
  abstract_params: the target: arrays or ShapeDtypeStructs, whose shardings (if any) the
    parameters are restored into.
  Either way only the parameters (and the small JSON beside them) are opened: the optimizer
  state of a train-state checkpoint is neither read nor needed.
  """
  return load_params_with_step(path, abstract_params, step=step)[0]


def load_params_with_step(path: str | os.PathLike, abstract_params: Any, *,
                          step: int | None = None) -> tuple[Any, int | None, dict[str, Any]]:
  """(params, step, meta) as `load_params` reads them: the step is None for a model checkpoint,
  whose meta is its model.json; a train state's meta is its `meta` item."""
  path = _orbax_path(path)
  if (path / MODEL_JSON).exists():
    if step is not None:
      raise ValueError(f"{path} is a model checkpoint, which has no steps; got step={step}")
    meta = _model_meta(path)
    params = _restore_item(f"{path}/params", path / "params", abstract_params)
    verify_checksums(params, meta["checksums"]["params"], f"{path}/params")
    return params, None, meta
  directory = _checkpoints_dir(path)

  def restore(step):
    meta = read_meta(directory, step)
    params = _restore_item(f"step {step} params", directory / str(step) / "params",
                           abstract_params)
    verify_checksums(params, meta["checksums"]["params"], f"step {step} params")
    return params, step, meta

  return _newest_good(directory, step, restore)


def checkpoint_steps(path: str | os.PathLike) -> list[int]:
  """The committed steps of the train-state checkpoints under `path` (a workdir or its
  checkpoints/ directory), ascending; incomplete saves (Orbax's temporary directories) are not
  steps."""
  directory = _checkpoints_dir(_orbax_path(path))
  return sorted(ocp.path.step.checkpoint_steps(directory)) if directory.is_dir() else []


def incomplete_saves(path: str | os.PathLike) -> list[str]:
  """Names of the directories under `path`'s checkpoints that an interrupted save left behind."""
  directory = _checkpoints_dir(_orbax_path(path))
  if not directory.is_dir():
    return []
  return sorted(p.name for p in directory.iterdir() if ocp.path.step.is_tmp_checkpoint(p))


def _checkpoints_dir(path: epath.Path) -> epath.Path:
  return path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path


def _newest_good(directory: epath.Path, step: int | None, restore: Callable[[int], Any]):
  """restore(step) of the requested step, or else of the newest step for which it succeeds:
  each step that raises DamagedCheckpointError is skipped with a one-line warning."""
  steps = checkpoint_steps(directory)
  if not steps:
    raise FileNotFoundError(f"no checkpoint under {directory}")
  if step is not None:
    if step not in steps:
      raise FileNotFoundError(f"no checkpoint of step {step} under {directory}; steps: {steps}")
    return restore(step)
  failures = []
  for candidate in reversed(steps):
    try:
      return restore(candidate)
    except DamagedCheckpointError as e:
      failures.append(f"step {candidate}: {e}")
      _warn(f"skipping checkpoint step {candidate} in {directory} (left as it is): {e}")
  raise DamagedCheckpointError(f"no checkpoint under {directory} restores: "
                               + "; ".join(failures))


# ----------------------------------------------------------------------------------------------
# Train states: params + opt_state + meta per step.


def read_meta(path: str | os.PathLike, step: int) -> dict[str, Any]:
  """The verified `meta` item of train-state checkpoint `step` under `path` (a workdir or its
  checkpoints/ directory); DamagedCheckpointError if it is unreadable or altered."""
  directory = _checkpoints_dir(_orbax_path(path))
  what = f"step {step} meta"
  record = _read(what, lambda: ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(
      directory / str(step) / "meta"))
  meta = _unseal(record, what)
  sums = meta.get("checksums")
  if (meta.get("step") != step or not isinstance(sums, dict)
      or not all(_is_checksum_table(sums.get(item)) for item in _ITEMS)):
    raise DamagedCheckpointError(f"{what}: names step {meta.get('step')!r} or lacks the "
                                 "checksums of its arrays")
  return meta


def _is_checksum_table(table: Any) -> bool:
  """Whether `table` is {array name: 16 hex digits}, as `checksums` writes it."""
  return isinstance(table, dict) and all(
      isinstance(k, str) and isinstance(v, str) and len(v) == 16
      and all(c in "0123456789abcdef" for c in v) for k, v in table.items())


def restore_train_state(path: str | os.PathLike, abstract_params: Any, abstract_opt_state: Any,
                        *, step: int | None = None,
                        check_meta: Callable[[dict[str, Any]], None] | None = None
                        ) -> tuple[Any, Any, dict[str, Any]]:
  """(params, opt_state, meta) of train-state checkpoint `step` under `path` (a workdir or its
  checkpoints/ directory), straight into the targets' shardings and verified against the
  checksums saved with them.

  step: default: the newest that restores and verifies (damaged steps are skipped with a
    one-line warning and left as they are; `DamagedCheckpointError` when none does).
  check_meta(meta): called with each candidate's verified meta before its arrays are read
    (e.g. to refuse a resume whose settings differ); what it raises propagates.
  """
  directory = _checkpoints_dir(_orbax_path(path))

  def restore(step):
    meta = read_meta(directory, step)
    if check_meta is not None:
      check_meta(meta)
    step_dir = directory / str(step)
    out = {}
    for item, target in zip(_ITEMS, (abstract_params, abstract_opt_state)):
      what = f"step {step} {item}"
      out[item] = _restore_item(what, step_dir / item, target)
      verify_checksums(out[item], meta["checksums"][item], what)
    return out["params"], out["opt_state"], meta

  return _newest_good(directory, step, restore)


def set_aside(path: str | os.PathLike, steps: Sequence[int]) -> list[epath.Path]:
  """Moves the train-state checkpoints `steps` under `path` (a workdir or its checkpoints/
  directory) out of the run's checkpoints, each as it is: renamed to `step-<step>` (`.2`, `.3`,
  ... when that name is taken) in `<checkpoints>.damaged` beside it (`<workdir>/
  checkpoints.damaged`). Neither name is a step's, so no restore, `checkpoint_steps` or Orbax
  manager reads it again, and a run can save those steps anew. Nothing is deleted or changed;
  each move is one rename (atomic on a local file system). Returns the new paths, in the order
  of `steps`."""
  directory = _checkpoints_dir(_orbax_path(path))
  aside = directory.parent / f"{directory.name}.damaged"
  moved = []
  for step in steps:
    source, target, copy = directory / str(step), aside / f"step-{step}", 1
    try:
      aside.mkdir(parents=True, exist_ok=True)
      while target.exists():
        copy += 1
        target = aside / f"step-{step}.{copy}"
      source.rename(target)
    except OSError as e:
      raise CheckpointError(f"cannot move the damaged checkpoint step {step} of {directory} "
                            f"to {target}: {e.strerror or e}") from None
    moved.append(target)
  return moved


class TrainCheckpoints:
  """Writes the train-state checkpoints of a run (`<workdir>/checkpoints`).

  save(): checksums of the arrays are computed on their devices and sealed into the meta, then
    Orbax writes the step (in the background when async_save). A failed save raises
    `CheckpointSaveError` from `check()` (call it every step: the run stops at the next step),
    from the next `save()`, or from `wait()`.
  keep: how many of the newest checkpoints to keep (None: all).
  Incomplete saves left by an interrupted run (Orbax's temporary directories) are removed when
  this is created, with a one-line note.
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int | None = None,
               async_save: bool = False):
    self.directory = _orbax_path(directory)
    leftovers = incomplete_saves(self.directory)
    if leftovers:
      _warn(f"removing incomplete checkpoint directories an interrupted save left in "
            f"{self.directory}: {', '.join(leftovers)}")
    options = ocp.CheckpointManagerOptions(
        create=True, enable_async_checkpointing=async_save, cleanup_tmp_directories=True,
        preservation_policy=ocp.checkpoint_managers.LatestN(keep))
    _enter_quiet()  # until close(): background saves fail on Orbax's threads
    self._quiet = True
    try:
      self._manager = ocp.CheckpointManager(self.directory, options=options)
    except BaseException:
      self._leave_quiet()
      raise
    self._pending = None  # the step of a save that may still be running
    self._async = async_save

  def _leave_quiet(self) -> None:
    if self._quiet:
      self._quiet = False
      _exit_quiet()

  def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> bool:
    """Saves `step` (in the background when async_save; see the class docstring). Returns
    whether the step is already complete on disk (False: `check` or `wait` says when it is)."""
    self.wait()  # Orbax would wait for the previous save anyway; its failure is named here
    _check_room(self.directory, step, {"params": params, "opt_state": opt_state})
    meta = _seal({**meta, "step": step, "checksums": {
        "params": checksums(params), "opt_state": checksums(opt_state)}})
    try:
      self._manager.save(step, args=ocp.args.Composite(
          params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
          meta=ocp.args.JsonSave(meta)), force=True)
    except Exception as e:
      self._settle(e)
      raise CheckpointSaveError(f"saving step {step} in {self.directory} failed: "
                                f"{describe_error(e)}") from e
    if not self._async:
      return True  # Orbax's save returns once the step is written
    self._pending = step
    return False

  def check(self) -> int | None:
    """Raises CheckpointSaveError if a background save has failed; never waits for one that is
    still writing. Returns the step of a background save found complete now, else None."""
    if self._pending is not None and not self._manager.is_saving_in_progress():
      return self.wait()  # finished: returns at once, or raises its failure
    return None

  def wait(self) -> int | None:
    """Waits for a background save; CheckpointSaveError if it failed. Returns the step it
    completed, None if none was pending."""
    if self._pending is None:
      return None
    step, self._pending = self._pending, None
    try:
      self._manager.wait_until_finished()
      self._manager.check_for_errors()
    except Exception as e:
      self._settle(e)
      raise CheckpointSaveError(f"saving step {step} in {self.directory} failed: "
                                f"{describe_error(e)}") from e
    return step

  def _settle(self, error: BaseException) -> None:
    """After a failed save: every thread of it finished (the manager's own wait; a save that
    fails in its blocking part leaves the other items' threads running), then what it abandoned
    collected (`_collect_abandoned`)."""
    with contextlib.suppress(Exception):  # the failure, already in hand
      self._manager.wait_until_finished()
    _collect_abandoned(error)

  def close(self) -> None:
    """Waits for a background save and releases Orbax's resources (errors: as `wait`)."""
    try:
      try:
        self.wait()
      except BaseException:
        with contextlib.suppress(Exception):  # the failed save is the error to report
          self._manager.close()
        raise
      self._manager.close()
    finally:
      self._leave_quiet()
