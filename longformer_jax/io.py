"""File reading and writing shared by the training, evaluation and entry-point code."""

from __future__ import annotations

import json
import os
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


def read_json(path: str | os.PathLike) -> Any:
  """The JSON value of a file (local or `epath`); ValueError naming the file when it is not
  JSON (e.g. truncated), FileNotFoundError when it does not exist."""
  try:
    return json.loads(epath.Path(path).read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path} is not valid JSON ({e})") from None


def save_figure(fig, path: str | os.PathLike, *, dpi: int = 120) -> None:
  """Writes a matplotlib figure as a PNG with `atomic_write` (never half a plot on disk) and
  closes it."""
  import io
  import matplotlib.pyplot as plt
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=dpi)
  plt.close(fig)
  atomic_write(path, buffer.getvalue())
