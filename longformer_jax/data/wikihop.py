"""WikiHop (QAngaroo) records and the paper's row layout for them (allenai/longformer's
wikihop.py): what `longformer_jax.tasks.wikihop` (`--task wikihop`) reads and builds.

Records: QAngaroo's JSON file (one JSON array of objects, as the dataset ships it) or JSONL (one
object a line), either with the fields

    {"id": str, "query": str, "supports": [str], "candidates": [str], "answer": str}

(the answer one of the candidates) or, as token ids, {"query": [int], "input_ids": [[int]]
(the supports), "candidates": [[int]], "answer": int (the right candidate's index)}. Errors of a
JSON array name the record by its 1-based position in the array where a JSONL error names the
line.

Rows. One example is one row, `<s> [q] query [/q] [ent] c1 [/ent] ... [ent] cC [/ent] </s>
d1 </s></s> d2 </s></s> ... dS </s>`, or, when the supports do not fit, several rows (chunks):
the supports' token stream (`d1 </s></s> d2 ...`) cut into pieces that fill the row after the
prefix, each row `prefix </s> piece </s>`. The four markers are new tokens at the end of the
model's vocabulary (`convert.extend_vocabulary`): rows hold them as the placeholders -4..-1
(`MARKERS` in order), counted from the table's end, and `resolve_markers` turns them into the
ids of the model they run on. Global attention covers the prefix (`<s>` through the last
`[/ent]`).

Shape letters: B batch, K chunks, N positions, C candidates.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from longformer_jax.data import finetune_data as fd
from longformer_jax.data import text
from longformer_jax.data.tokenizer import SpecialIds

__all__ = ["MARKERS", "Layout", "WikiHopExample", "layout", "read_records", "resolve_markers"]

MARKERS = ("[q]", "[/q]", "[ent]", "[/ent]")
# The placeholders rows hold for the markers: -4..-1, the last rows of the vocabulary.
Q, END_Q, ENT, END_ENT = range(-len(MARKERS), 0)


def resolve_markers(ids, vocab_size: int):
  """`ids` (numpy or jax) with the marker placeholders (negative) as ids of a model whose
  vocabulary of `vocab_size` ends with the markers: -k -> vocab_size - k."""
  return ids + (ids < 0) * vocab_size


# ----------------------------------------------------------------------------------------------
# Reading


def read_records(path: str | os.PathLike, schema: Mapping[str, Any], *,
                 optional: Mapping[str, Any] | None = None, unique: Sequence[str] = ()
                 ) -> list[text.Record]:
  """The records of QAngaroo's JSON file (a JSON array of objects) or of a JSONL file, checked
  as `text.read_jsonl` checks a line; a JSON array's records are numbered from 1 in the array
  (the "line" of an error). Raises FileNotFoundError, or `text.JsonlError` naming the file,
  record and field."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such file")
  with open(path, "rb") as f:
    start = f.read(64).lstrip()
  if not start.startswith(b"["):
    return text.read_jsonl(path, schema, optional=optional, unique=unique)
  try:
    with open(path, encoding="utf-8") as f:
      array = json.load(f)
  except UnicodeDecodeError as e:
    raise text.JsonlError(path, None, None, f"is not UTF-8 (byte {e.start})") from None
  except json.JSONDecodeError as e:
    raise text.JsonlError(path, None, None, f"is not JSON ({e.msg} at line {e.lineno} column "
                          f"{e.colno})") from None
  if not isinstance(array, list) or not array:
    raise text.JsonlError(path, None, None, "holds no records (expected a JSON array of "
                          "objects, QAngaroo's format, or JSONL)")
  seen: dict[str, dict[Any, int]] = {name: {} for name in unique}
  return [text.check_record(path, i, obj, schema, optional=optional, seen=seen)
          for i, obj in enumerate(array, start=1)]


# ----------------------------------------------------------------------------------------------
# Rows


@dataclasses.dataclass(frozen=True)
class Layout:
  """The rows of one example in one order of its candidates and supports.

  rows: int32 [N_k] per chunk (marker placeholders negative). prefix_length: the prefix's
  tokens (`<s>` through the last `[/ent]`: the global ones). entity_positions: int32 [C], each
  candidate's `[ent]` position in every row. document_tokens: the supports' stream (supports and
  their separators).
  """
  rows: tuple[np.ndarray, ...]
  prefix_length: int
  entity_positions: np.ndarray
  document_tokens: int


def layout(query: np.ndarray, candidates: Sequence[np.ndarray], supports: Sequence[np.ndarray],
           specials: SpecialIds, *, max_length: int, name: str = "max_length") -> Layout:
  """The rows of an example (module docstring), rows of at most `max_length` tokens: the query,
  the candidates and the supports in the order given. ValueError when the prefix leaves no room
  for a support token (naming the row length as `name`: max_length, or the segment baseline's
  segment_length)."""
  prefix, positions = [specials.bos, Q, *query, END_Q], []
  for candidate in candidates:
    positions.append(len(prefix))
    prefix += [ENT, *candidate, END_ENT]
  stream: list[int] = []
  for i, support in enumerate(supports):
    stream += ([specials.sep, specials.sep] if i else []) + list(support)
  room = max_length - len(prefix) - 2  # </s> after the prefix, </s> at the end
  if room < 1:
    raise ValueError(f"the query and {len(candidates)} candidates take {len(prefix)} tokens: no "
                     f"room for the supports in {name}={max_length}")
  pieces = [stream[i:i + room] for i in range(0, len(stream), room)] or [[]]
  rows = tuple(np.asarray(prefix + [specials.sep] + piece + [specials.eos], np.int32)
               for piece in pieces)
  return Layout(rows, len(prefix), np.asarray(positions, np.int32), len(stream))


@dataclasses.dataclass(frozen=True)
class WikiHopExample(fd.Example):
  """An `fd.Example` of WikiHop: its rows (`input_ids`, in the file's order; `question_end`,
  the prefix length; `label`, the right candidate) and the parts they were built from, which
  training lays out again in a new order every epoch.

  query: int32 [Q]. candidates, supports: int32 arrays in the file's order. entity_positions:
  int32 [C] (`Layout`). document_tokens: the supports' stream length.
  """
  query: np.ndarray | None = None
  candidates: tuple[np.ndarray, ...] = ()
  supports: tuple[np.ndarray, ...] = ()
  entity_positions: np.ndarray | None = None
  document_tokens: int = 0

  def global_lengths(self, mode: str) -> tuple[int, ...]:
    """Every row's global prefix: none, `<s>` ("first") or the whole prefix ("question")."""
    length = {"none": 0, "first": 1}.get(mode, self.question_end)
    return (length,) * len(self.input_ids)
