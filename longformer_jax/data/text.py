"""Text datasets for fine-tuning: JSONL records, HF `tokenizers` tokenizers, padded id batches
and a resumable example order.

    >>> from longformer_jax.data import text
    >>> from longformer_jax.data.tokenizer import load_tokenizer
    >>> records = text.read_jsonl("train.jsonl", {"source": str, "target": str})
    >>> tokenizer = load_tokenizer("led-base-16384/tokenizer.json")         # no hub access
    >>> ids = text.encode(tokenizer, [r.fields["source"] for r in records], max_length=4096)
    >>> input_ids, mask = text.pad(ids[:8], length=4096, pad_id=1)           # int32 [8, 4096]
    >>> order = text.ExampleSampler(len(records), global_batch_size=8, seed=0)
    >>> rows = next(order)                                                   # indices of a batch

JSONL rules (`read_jsonl`): the file is UTF-8; every line that is not blank holds one JSON object;
each field of the schema is present and of its type (a `str` field must not be empty or only
whitespace; a bool is not an int); no string of a field holds a lone surrogate (a `\ud800` escape
without its pair: not text a tokenizer can encode); fields outside the schema are ignored; fields
named `unique` hold no value twice; the file holds at least one record. Any breach is a `JsonlError`
naming the file, the line (1-based) and the field.

The tokenizer is the `tokenizers` library's, read from local files (`load_tokenizer`, from
`longformer_jax.data.tokenizer`, which holds the tokenizer helpers and special tokens): nothing is
downloaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "ExampleSampler",
    "JsonlError",
    "Record",
    "check_record",
    "encode",
    "file_sha256",
    "pad",
    "read_jsonl",
]


class JsonlError(ValueError):
  """A JSONL file breaks the rules: `path`, `line` (1-based, None for the whole file) and
  `field` (None when the line as a whole is wrong) say where."""

  def __init__(self, path: str, line: int | None, field: str | None, problem: str):
    self.path, self.line, self.field, self.problem = path, line, field, problem
    where = path if line is None else f"{path}:{line}"
    what = "" if field is None else f" field {field!r}"
    super().__init__(f"{where}:{what} {problem}")


@dataclasses.dataclass(frozen=True)
class Record:
  """One JSONL record: the 1-based line it was read from and its fields (those of the schema,
  plus any optional ones present)."""

  line: int
  fields: dict[str, Any]


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
               list: "a list", dict: "an object"}


def _type_name(types: tuple[type, ...]) -> str:
  return " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)


def _check_field(path: str, line: int, name: str, value: Any, types: tuple[type, ...]) -> None:
  # JSON's true/false come back as bools, which are ints in Python: never accept one as a number.
  ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
  if float in types and isinstance(value, int) and not isinstance(value, bool):
    ok = True  # JSON does not tell 1 from 1.0
  if not ok:
    raise JsonlError(path, line, name,
                     f"must be {_type_name(types)}, got {json.dumps(value)[:80]}")
  if isinstance(value, str) and not value.strip():
    raise JsonlError(path, line, name, "is empty")
  surrogate = _lone_surrogate(value)
  if surrogate is not None:
    raise JsonlError(path, line, name, f"holds a lone surrogate {surrogate!a} (half of a "
                     f"UTF-16 pair, not text)")


def _lone_surrogate(value: Any) -> str | None:
  """The first lone surrogate of the strings in `value` (a JSON value), or None. JSON's \\u
  escapes are the only way one gets in: a UTF-8 file cannot hold one, and json.loads joins the
  halves of a pair."""
  if isinstance(value, str):
    try:
      value.encode("utf-8")  # at C speed; fails on a surrogate only
    except UnicodeEncodeError as e:
      return value[e.start]
  elif isinstance(value, (list, dict)):
    for item in (value.values() if isinstance(value, dict) else value):
      found = _lone_surrogate(item)
      if found is not None:
        return found
  return None


def read_jsonl(path: str | os.PathLike, schema: Mapping[str, type | tuple[type, ...]], *,
               optional: Mapping[str, type | tuple[type, ...]] | None = None,
               unique: Sequence[str] = ()) -> list[Record]:
  """The records of a JSONL file, checked against the rules of the module docstring.

  Args:
    path: a local file.
    schema: the fields every record must have, with their type(s), e.g.
      {"source": str, "target": str}.
    optional: fields a record may have, with their type(s), e.g. {"id": (str, int)}.
    unique: fields (of either kind) whose values must differ between records.

  Raises:
    FileNotFoundError: no such file.
    JsonlError: the file breaks a rule (file, line and field named).
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such file")
  seen: dict[str, dict[Any, int]] = {name: {} for name in unique}
  records = []
  with open(path, "rb") as f:
    for line_number, raw in enumerate(f, start=1):
      try:
        text = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise JsonlError(path, line_number, None,
                         f"is not UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})"
                         ) from None
      if not text.strip():
        continue
      try:
        obj = json.loads(text)
      except json.JSONDecodeError as e:
        raise JsonlError(path, line_number, None,
                         f"is not JSON ({e.msg} at column {e.colno})") from None
      except RecursionError:  # json's decoder recurses once per nested bracket
        raise JsonlError(path, line_number, None,
                         "nests JSON arrays or objects too deeply to be read (a record's "
                         "fields are strings, numbers and flat lists)") from None
      records.append(check_record(path, line_number, obj, schema, optional=optional,
                                  seen=seen))
  if not records:
    raise JsonlError(path, None, None, "holds no records")
  return records


def check_record(path: str, line: int, obj: Any, schema: Mapping[str, type | tuple[type, ...]],
                 *, optional: Mapping[str, type | tuple[type, ...]] | None = None,
                 seen: dict[str, dict[Any, int]] | None = None) -> Record:
  """One parsed JSON value as the `Record` at `line` of `path`, checked as `read_jsonl` checks a
  line (its schema, optional fields); `seen` ({field: {value: line}}, updated) finds repeats of
  the unique fields. For readers of other containers of records (a JSON array)."""
  expected = {k: v if isinstance(v, tuple) else (v,) for k, v in schema.items()}
  maybe = {k: v if isinstance(v, tuple) else (v,) for k, v in (optional or {}).items()}
  if not isinstance(obj, dict):
    raise JsonlError(path, line, None, f"must be a JSON object, got {type(obj).__name__}")
  fields = {}
  for name, types in expected.items():
    if name not in obj:
      raise JsonlError(path, line, name, f"is missing (the record has {sorted(obj)})")
    _check_field(path, line, name, obj[name], types)
    fields[name] = obj[name]
  for name, types in maybe.items():
    if name in obj:
      _check_field(path, line, name, obj[name], types)
      fields[name] = obj[name]
  for name, values in (seen or {}).items():
    if name in fields:
      first = values.setdefault(fields[name], line)
      if first != line:
        raise JsonlError(path, line, name, f"repeats {json.dumps(fields[name])[:80]} of line "
                         f"{first}")
  return Record(line, fields)


def file_sha256(path: str | os.PathLike) -> str:
  """The SHA-256 of a file's bytes, read in 1 MiB pieces."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Tokenizers


def encode(tokenizer, texts: Sequence[str], *, max_length: int,
           what: str = "texts") -> list[np.ndarray]:
  """Token ids (int32, one array per text) of `texts`, with the tokenizer's special tokens (its
  post-processor, e.g. BART's `<s> ... </s>`) and truncated to `max_length` ids the way HF does
  it: the text is cut, the special tokens are kept.

  The tokenizer's own truncation and padding settings are ignored (a copy is encoded). A
  tokenizer that fails while encoding is a ValueError naming its file and `what` it encoded
  (`tokenizer.encoding_errors`).
  """
  if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
    raise ValueError(f"max_length must be a positive int, got {max_length!r}")
  from longformer_jax.data.tokenizer import copy_tokenizer, encoding_errors

  tokenizer = copy_tokenizer(tokenizer)
  tokenizer.no_padding()
  try:
    tokenizer.enable_truncation(max_length)
    with encoding_errors(tokenizer, what):
      encodings = tokenizer.encode_batch(list(texts))
  except Exception as e:  # e.g. max_length shorter than the special tokens the template adds
    raise ValueError(f"cannot encode with max_length={max_length}: {e}") from None
  return [np.asarray(e.ids, np.int32) for e in encodings]


def pad(sequences: Sequence[np.ndarray], *, length: int, pad_id: int
        ) -> tuple[np.ndarray, np.ndarray]:
  """(ids, mask), int32 [len(sequences), length]: each sequence at the start of its row, then
  `pad_id`; mask 1 on the sequence, 0 on the padding. A sequence longer than `length` is a
  ValueError (truncate when encoding)."""
  ids_BxN = np.full((len(sequences), length), pad_id, np.int32)
  mask_BxN = np.zeros((len(sequences), length), np.int32)
  for row, seq in enumerate(sequences):
    if len(seq) > length:
      raise ValueError(f"sequence {row} has {len(seq)} ids, more than length={length}")
    ids_BxN[row, :len(seq)] = seq
    mask_BxN[row, :len(seq)] = 1
  return ids_BxN, mask_BxN


# ---------------------------------------------------------------------------------------------
# Example order


class ExampleSampler(Iterator[np.ndarray]):
  """A deterministic, resumable order over `num_examples` examples, in global batches split
  between processes: `next()` gives this process's example indices of the next batch.

  The order is a pure function of (seed, position): epoch e serves every example once, in an
  order drawn from NumPy's Philox generator keyed by (seed, e) and read as raw bits (stable
  across NumPy versions and machines), and the batches run on from one epoch into the next
  (a batch may span two), so no example is skipped and fewer examples than a batch work.
  Process p of P gets rows [p * b, (p + 1) * b) of each global batch, b = global_batch_size /
  P: the layout `jax.make_array_from_process_local_data` expects. `state()` is a dict of ints
  (the next step, and what fixes the order, checked by `load_state`).
  """

  _STATE_KEYS = ("step", "seed", "num_examples", "global_batch_size")

  def __init__(self, num_examples: int, *, global_batch_size: int, seed: int = 0,
               process_index: int = 0, process_count: int = 1):
    for name, value in (("num_examples", num_examples),
                        ("global_batch_size", global_batch_size)):
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not 0 <= seed < 2**64:
      raise ValueError(f"seed={seed} must be in [0, 2**64)")
    if not 0 <= process_index < process_count or global_batch_size % process_count:
      raise ValueError(f"process_index={process_index} must be in [0, process_count="
                       f"{process_count}), which must divide global_batch_size="
                       f"{global_batch_size}")
    self.num_examples, self.global_batch_size, self.seed = (int(num_examples),
                                                            int(global_batch_size), seed)
    self.local_batch_size = global_batch_size // process_count
    self.process_index = process_index
    self.step = 0
    self._cached: tuple[int, np.ndarray] | None = None

  def _order(self, epoch: int) -> np.ndarray:
    if self._cached is None or self._cached[0] != epoch:
      raw = np.random.Philox(key=(self.seed << 64) | epoch).random_raw(self.num_examples)
      self._cached = (epoch, np.argsort(raw, kind="stable"))
    return self._cached[1]

  def global_indices(self, step: int) -> np.ndarray:
    """The example indices of global batch `step`, [global_batch_size]."""
    if step < 0:
      raise ValueError(f"step={step} must be >= 0")
    positions = step * self.global_batch_size + np.arange(self.global_batch_size)
    epochs, within = np.divmod(positions, self.num_examples)
    return np.array([self._order(int(e))[i] for e, i in zip(epochs, within)], np.int64)

  def __next__(self) -> np.ndarray:
    first = self.process_index * self.local_batch_size
    out = self.global_indices(self.step)[first:first + self.local_batch_size]
    self.step += 1
    return out

  def __iter__(self) -> ExampleSampler:
    return self

  def state(self) -> dict[str, int]:
    return {"step": self.step, "seed": self.seed, "num_examples": self.num_examples,
            "global_batch_size": self.global_batch_size}

  def load_state(self, state: Mapping[str, Any]) -> None:
    """Continues from `state()` of a sampler over as many examples, with the same seed and
    batch size (the process layout may differ); ValueError naming any difference."""
    missing = [k for k in self._STATE_KEYS if k not in state]
    if missing:
      raise ValueError(f"sampler state lacks {missing}: got keys {sorted(state)}")
    saved, mine = {k: int(state[k]) for k in self._STATE_KEYS}, self.state()
    wrong = [f"{k}={saved[k]} (this sampler: {mine[k]})" for k in self._STATE_KEYS
             if k != "step" and saved[k] != mine[k]]
    if wrong:
      raise ValueError(f"sampler state is for another order: {', '.join(wrong)}")
    if saved["step"] < 0:
      raise ValueError(f"sampler state has step={saved['step']} < 0")
    self.step = saved["step"]
