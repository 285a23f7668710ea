"""File reading and writing shared by the training, evaluation and entry-point code."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from etils import epath


class WriteError(OSError):
  """A file could not be written (a full disk, a read-only path, a file-size limit). The message
  is one line: the file and why, e.g. "cannot write runs/x/results.json: No space left on
  device"."""

  def __init__(self, path: str | os.PathLike, error: OSError):
    super().__init__(error.errno, error.strerror)
    self.filename = str(path)
    self.message = f"cannot write {path}: {error.strerror or error}"

  def __str__(self) -> str:
    return self.message


def _write(path: epath.Path, data: bytes) -> None:
  """The bytes of a new file: every file the library writes whole goes through here."""
  path.write_bytes(data)


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
  """Writes `data` (text is UTF-8) to a temporary sibling, then renames it over `path`, so readers
  never see half a file. `path` may be local or any etils `epath` path (gs://...). A failed
  write (e.g. a full disk) raises `WriteError` naming `path` and leaves `path` as it was."""
  path = epath.Path(path)
  tmp = path.parent / f".{path.name}.tmp{os.getpid()}"
  try:
    _write(tmp, data.encode("utf-8") if isinstance(data, str) else data)
    tmp.replace(path)
  except BaseException as e:
    # A full disk or a kill leaves no half-written temporary behind (as far as it can).
    try:
      tmp.unlink()
    except OSError:
      pass
    if isinstance(e, OSError) and not isinstance(e, (WriteError, FileNotFoundError)):
      raise WriteError(path, e) from None
    raise


def append_line(file, path: str | os.PathLike, line: str) -> None:
  """Appends `line` and a newline to the open text `file` (that of `path`) and flushes it; a
  failed write raises `WriteError` naming `path` (what is left is at most a torn last line,
  which the log readers drop)."""
  try:
    _append(file, line + "\n")
  except OSError as e:
    raise WriteError(path, e) from None


def _append(file, text: str) -> None:
  """Appends to an open file: every append the library makes goes through here."""
  file.write(text)
  file.flush()


def check_writable(path: str | os.PathLike) -> None:
  """Raises ValueError naming `path` unless a file with a byte in it can be created beside it
  (made and removed): an output checked before minutes of work, not found unwritable after them
  (a disk that fills meanwhile still fails the write itself: `WriteError`)."""
  path = epath.Path(path)
  if path.is_dir():  # a file cannot be renamed over it
    raise ValueError(f"cannot write the output {path}: it is a directory")
  probe = path.parent / f".{path.name}.write-check"
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    # One byte, not an empty file: an empty file needs no space, so it is made on a full disk.
    _write(probe, b"\n")
    probe.unlink()
  except OSError as e:
    try:
      probe.unlink()  # made, but the byte did not fit
    except OSError:
      pass
    why = (f"{path.parent} is a file" if path.parent.exists() and not path.parent.is_dir()
           else e.strerror or e)
    raise ValueError(f"cannot write the output {path}: {why}") from None


def inside(path: str | os.PathLike, directory: str | os.PathLike) -> str:
  """`directory/path` for a `path` read from a file of `directory` (an index's shard name, a
  record's file name), after checking that it stays there: a relative path without `..`
  whose real location (symlinks followed) is inside the real `directory`. ValueError naming
  both otherwise."""
  name = path if isinstance(path, str) else None
  if (name is None or not name or os.path.isabs(name) or "\0" in name
      or ".." in name.replace("\\", "/").split("/")):
    raise ValueError(f"{os.fspath(directory)}: the file name {path!r} is not a relative path "
                     "inside the directory")
  joined = os.path.join(os.fspath(directory), name)
  _check_inside(joined, directory)
  return joined


def _check_inside(path: str, directory: str | os.PathLike) -> None:
  root = os.path.realpath(directory)
  real = os.path.realpath(path)
  if os.path.commonpath([root, real]) != root:
    raise ValueError(f"{path} leads outside {os.fspath(directory)} (to {real}); a checkpoint's "
                     "files must stay inside its directory")


def links_root(directory: str | os.PathLike) -> str:
  """The folder the files of a model `directory` may lead into (by symlinks): the directory
  itself, or for a snapshot of the HF cache (`<cache>/models--org--name/snapshots/<revision>`,
  whose files link into the repo's `blobs/`) that repo's folder."""
  directory = os.path.abspath(os.fspath(directory))
  snapshots = os.path.dirname(directory)
  repo = os.path.dirname(snapshots)
  if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith(
      "models--"):
    return repo
  return directory


def open_regular(path: str | os.PathLike, directory: str | os.PathLike | None = None):
  """`path` opened for binary reading, only if it is a regular file (inside `directory`, when
  given, symlinks followed). A FIFO, a device, a socket or a directory is refused with a
  ValueError naming it, and never blocks: the file is opened with O_NONBLOCK (which opening a
  FIFO obeys) and checked with fstat before anything is read. What every loader of a model
  directory opens its files with (configs, weights, index files, records).
  FileNotFoundError when it does not exist."""
  path = os.fspath(path)
  if directory is not None:
    _check_inside(path, directory)
  flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
  try:
    fd = os.open(path, flags)
  except IsADirectoryError:
    raise ValueError(f"{path} is a directory, not a file") from None
  try:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
      what = ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode)
              or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else
              "a directory" if stat.S_ISDIR(mode) else "not a regular file")
      raise ValueError(f"{path} is {what}, not a regular file; refused")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")
  except BaseException:
    os.close(fd)
    raise


def regular_file(path: str | os.PathLike, directory: str | os.PathLike | None = None) -> str:
  """`path`, after `open_regular`'s checks (for a library that opens the file by name itself,
  e.g. safetensors' memory map): its real path, so a symlink swapped afterwards changes
  nothing."""
  with open_regular(path, directory):
    return os.path.realpath(path)


def read_json(path: str | os.PathLike, directory: str | os.PathLike | None = None) -> Any:
  """The JSON value of a file (local or `epath`); ValueError naming the file when it is not
  JSON (e.g. truncated, or nested too deep to parse), FileNotFoundError when it does not exist.
  A local file is opened with `open_regular` (inside `directory` when given): a FIFO or a
  device is refused, never waited on."""
  try:
    if "://" in os.fspath(path):
      text = epath.Path(path).read_text()
    else:
      with open_regular(path, directory) as f:
        text = f.read().decode("utf-8")
    return json.loads(text)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path} is not valid JSON ({e})") from None
  except RecursionError:
    raise ValueError(f"{path} is not valid JSON (nested too deep to parse)") from None


def read_json_object(path: str | os.PathLike,
                     directory: str | os.PathLike | None = None) -> dict[str, Any]:
  """`read_json` of a file that must hold a JSON object (a config, a record, an index):
  ValueError naming the file and what it holds otherwise."""
  value = read_json(path, directory)
  if not isinstance(value, dict):
    raise ValueError(f"{path} holds {type(value).__name__ if value is not None else 'null'}; "
                     "expected a JSON object")
  return value


def save_figure(fig, path: str | os.PathLike, *, dpi: int = 120) -> None:
  """Writes a matplotlib figure as a PNG with `atomic_write` (never half a plot on disk) and
  closes it."""
  import io
  import matplotlib.pyplot as plt
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=dpi)
  plt.close(fig)
  atomic_write(path, buffer.getvalue())
