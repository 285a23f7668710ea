"""File reading and writing shared by the training, evaluation and entry-point code."""

from __future__ import annotations

import json
import os
from typing import Any

from etils import epath


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
  """Writes `data` (text is UTF-8) to a temporary sibling, then renames it over `path`, so readers
  never see half a file. `path` may be local or any etils `epath` path (gs://...)."""
  path = epath.Path(path)
  tmp = path.parent / f".{path.name}.tmp{os.getpid()}"
  try:
    if isinstance(data, str):
      tmp.write_text(data, encoding="utf-8")
    else:
      tmp.write_bytes(data)
    tmp.replace(path)
  except BaseException:
    # A full disk or a kill leaves no half-written temporary behind (as far as it can).
    try:
      tmp.unlink()
    except OSError:
      pass
    raise


def check_writable(path: str | os.PathLike) -> None:
  """Raises ValueError naming `path` unless a file can be created beside it (made and removed):
  an output checked before minutes of work, not found unwritable after them."""
  path = epath.Path(path)
  if path.is_dir():  # a file cannot be renamed over it
    raise ValueError(f"cannot write the output {path}: it is a directory")
  probe = path.parent / f".{path.name}.write-check"
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    probe.write_text("")
    probe.unlink()
  except OSError as e:
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
