"""JSONL records of the fine-tuning tasks, featurised for a Longformer encoder: what every kind
of task shares. Each kind (`longformer_jax.tasks.finetune.KINDS`: classification, qa, token,
multiple_choice) owns its record layout and builds its rows with the `Reader` given here.

    >>> from longformer_jax.data import finetune_data as fd, tokenizer as tok
    >>> from longformer_jax.tasks import finetune as ft
    >>> split = fd.read_split("train.jsonl", ft.KINDS["qa"], tok.load_tokenizer("tokenizer.json"),
    ...                       max_length=4096, specials=tok.SpecialIds.of_config(config),
    ...                       vocab_size=config.vocab_size)

Records (one JSON object per line; `longformer_jax.data.text.read_jsonl`'s rules): the kind's
fields, either text (tokenized without the tokenizer's special tokens) or token ids (taken as they
are), one or the other in every record of a file, and an optional unique "id", a string or
integer, naming the record in the predictions (default its line). Neither holds a special id of
the model (`<s>`, `<pad>`, `</s>`: the rows get theirs below; a text that spells one is refused
too), and an id record's optional "attention_mask" (as HF tokenizers write it) must be all 1:
records hold real tokens only, and the rows are padded and masked when they are built. Rows get
the model's special tokens in RoBERTa's layout (HF's Longformer uses it): `<s> text </s>`,
segments joined by `</s></s>`. Sequences longer than `max_length` lose the end of their document
(questions are cut to `max_question_length` first). The global tokens of every layout are a
prefix of the row (`Example.global_lengths`): none ("none"), `<s>` ("first") or `<s>` through
the question (and the candidate) ("question").

A record that breaks the rules is a `text.JsonlError` naming the file, the line and the field.
Shape letters: B batch, C candidates, N tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from longformer_jax.data import text
from longformer_jax.data.tokenizer import SpecialIds, copy_tokenizer, encoding_errors

# Label of positions that are not scored (HF's ignore index).
IGNORE_INDEX = -100
# The most classes a head may have: labels are class ids below it, read before a head is sized
# (a label of 10**9 would otherwise size a head of 10**9 rows).
MAX_LABELS = 2**16
GLOBAL_MODES = ("default", "none", "first", "question")


# ----------------------------------------------------------------------------------------------
# Examples


@dataclasses.dataclass(frozen=True)
class Truncation:
  """What the length limit cut of one record (the "truncation" report of a split's results,
  `longformer_jax.tasks.truncation`).

  full_length: the tokens the record needs uncut, special tokens included (multiple choice: its
    longest candidate row).
  document_tokens: its document (context) tokens uncut; kept_tokens: those the row keeps
    (multiple choice: the fewest any candidate's row keeps).
  prefix_cut: the question lost tokens (max_question_length or the row's room).
  evidence: the evidence lies wholly inside what was kept (QA: an answer occurrence inside the
    kept context; multiple choice: the answer candidate inside the kept document; tagging: the
    first token of every word; coreference: every gold mention; HotpotQA: every supporting
    sentence); None where the record has none (classification, a candidate the document never
    names, a document without a gold mention or supporting fact).
  """
  full_length: int
  document_tokens: int
  kept_tokens: int
  prefix_cut: bool = False
  evidence: bool | None = None

  @property
  def truncated(self) -> bool:
    """Any document or question token was cut."""
    return self.prefix_cut or self.kept_tokens < self.document_tokens


@dataclasses.dataclass(frozen=True)
class Example:
  """One record, featurised.

  input_ids: int32 [N_i] (multiple choice: one array per candidate), special tokens included.
  question_end: the first position after the question (QA and multiple choice: 1 + its tokens),
    else 1 (after <s>).
  label: the class (classification) or the right candidate (multiple choice).
  token_labels: int32 [N_i], the label id of each word's first token, IGNORE_INDEX elsewhere.
  words: tagging: the position of each word's (or id's) first token, -1 if truncated away.
  gold: what predictions are scored against: the label names of the words (token), the answer
    texts or id tuples (qa).
  context: qa: (first, last + 1) positions of the context tokens in the row.
  offsets: qa text records: int32 [context tokens, 2], each context token's character span.
  context_text: qa text records: the context.
  target: qa: (start, end) positions of the first answer that survived truncation, else None.
  answer_spans: qa: (start, end) row positions (end inclusive) of every occurrence of every gold
    answer and alias inside the kept context, distinct, in row order (the all-occurrence loss).
  question_id: qa: the question the record is evidence for (several records may share one;
    they are scored together, `QuestionAnswering.score`), else None.
  candidate_ends: multiple choice: per candidate, the first position after it.
  truncation: what the length limit cut of the record (`Truncation`), None when the kind does
    not record it.
  """
  line: int
  input_ids: np.ndarray | tuple[np.ndarray, ...]
  question_end: int = 1
  label: int | None = None
  token_labels: np.ndarray | None = None
  words: np.ndarray | None = None
  gold: Any = None
  context: tuple[int, int] | None = None
  offsets: np.ndarray | None = None
  context_text: str | None = None
  target: tuple[int, int] | None = None
  answer_spans: tuple[tuple[int, int], ...] = ()
  question_id: Any = None
  candidate_ends: tuple[int, ...] | None = None
  truncation: Truncation | None = None

  def global_lengths(self, mode: str) -> tuple[int, ...]:
    """The global prefix of each row (one row; multiple choice: one per candidate)."""
    rows = self.candidate_ends or (self.question_end,)
    if mode == "none":
      return (0,) * len(rows)
    if mode == "first":
      return (1,) * len(rows)
    return rows  # "question": through the question (and the candidate)


class RecordLayout(Protocol):
  """What `read_split` needs of a kind of task (`longformer_jax.tasks.finetune.Kind`).

  name: the task's name. required: the fields of every record with their types.
  documents: the text field and "input_ids" with their types; a record holds exactly one.
  optional: the other fields a record may hold, with their types. read_records: the records of
  a file (`text.read_jsonl`'s arguments; JSONL unless the kind reads another format too).
  featurise: one record as an `Example`. split_fields: `FinetuneSplit` fields of the whole file
  beyond the common ones (label_names, int_labels, num_choices).
  """
  name: str
  required: Mapping[str, type | tuple[type, ...]]
  documents: Mapping[str, type | tuple[type, ...]]
  optional: Mapping[str, type | tuple[type, ...]]

  def read_records(self, path: str, schema: Mapping[str, Any], *, optional: Mapping[str, Any],
                   unique: Sequence[str]) -> list[text.Record]: ...

  def featurise(self, reader: Reader, record: text.Record, by_text: bool) -> Example: ...

  def split_fields(self, records: Sequence[text.Record], examples: Sequence[Example],
                   label_names: tuple[str, ...] | None) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class FinetuneSplit:
  """A JSONL file of one kind of task, featurised.

  kind: the task's kind (`RecordLayout`; `task` is its name). ids: each record's "id", else its
  line number. by_text: the records hold text (not ids).
  label_names: token task: the tag of each label id; int_labels: the file spells tags as ids.
  num_choices: multiple choice: the most candidates of a record (rows are padded to it).
  num_chunks: WikiHop: the most rows (chunks of the supports) of a record.
  """
  kind: RecordLayout
  path: str
  sha256: str
  ids: tuple[Any, ...]
  examples: tuple[Example, ...]
  max_length: int
  by_text: bool
  label_names: tuple[str, ...] | None = None
  int_labels: bool = False
  num_choices: int | None = None
  num_chunks: int | None = None

  @property
  def task(self) -> str:
    return self.kind.name

  def __len__(self) -> int:
    return len(self.examples)

  def max_global(self, mode: str) -> int:
    """The most global tokens of a row: the static bound the attention needs under jit."""
    return max((g for e in self.examples for g in e.global_lengths(mode)), default=0)


# ----------------------------------------------------------------------------------------------
# Reading


def read_split(path: str | os.PathLike, kind: RecordLayout, tokenizer, *, max_length: int,
               specials: SpecialIds, vocab_size: int, max_question_length: int = 128,
               label_names: Sequence[str] | None = None) -> FinetuneSplit:
  """The records of a JSONL file of the task `kind` (its docstring gives the layout),
  featurised.

  tokenizer: a `tokenizers.Tokenizer` (`data.tokenizer.load_tokenizer`); None when every record
    holds ids.
  specials: the model's special ids (`SpecialIds.of_config`).
  vocab_size: ids must be below it (the model's embedding table).
  label_names: token task: the tags in id order (`Tagging.label_names`); string labels must be
    among them, integer labels below their count.

  Raises `text.JsonlError` (file, line and field) for a record that breaks the rules, and
  ValueError for settings that leave no room (max_length too small).
  """
  if not isinstance(max_length, int) or max_length < 8:
    raise ValueError(f"max_length must be an int >= 8, got {max_length!r}")
  path = os.fspath(path)
  records = kind.read_records(path, kind.required, optional={
      **kind.documents, **kind.optional, "id": (str, int), "attention_mask": list},
      unique=("id",))
  names = None if label_names is None else tuple(label_names)
  reader = Reader(path, tokenizer, specials, vocab_size, max_length, max_question_length, names)
  by_text = reader.kinds(records, tuple(kind.documents))
  for r in records:
    reader.attention_mask(r)
  examples = tuple(kind.featurise(reader, r, by_text) for r in records)
  return FinetuneSplit(
      kind=kind, path=path, sha256=text.file_sha256(path),
      ids=tuple(r.fields.get("id", r.line) for r in records), examples=examples,
      max_length=max_length, by_text=by_text, **kind.split_fields(records, examples, names))


class Reader:
  """The pieces a kind featurises the records of one file with: checked ids, tokenized text,
  the question, the room left in a row, labels, and errors naming the file, line and field.

  path, specials, vocab_size, max_length, max_question_length: as `read_split`'s.
  label_names: the tags in id order (kinds with named labels), else None.
  """

  def __init__(self, path: str, tokenizer, specials: SpecialIds, vocab_size: int,
               max_length: int, max_question_length: int,
               label_names: tuple[str, ...] | None = None):
    self.path, self.specials, self.vocab_size = path, specials, vocab_size
    self.max_length, self.max_question_length = max_length, max_question_length
    self.label_names = label_names
    self.tokenizer = None
    if tokenizer is not None:
      # A copy whose own truncation and padding settings cannot interfere.
      self.tokenizer = copy_tokenizer(tokenizer)
      self.tokenizer.no_truncation()
      self.tokenizer.no_padding()

  def error(self, record: text.Record, field: str, problem: str) -> text.JsonlError:
    """The error of `record`'s `field` (raise it)."""
    return text.JsonlError(self.path, record.line, field, problem)

  def kinds(self, records, document_fields: tuple[str, ...]) -> bool:
    """Whether the file holds text records (else id records): one kind per file.
    document_fields: the text field(s) and "input_ids"; a record holds exactly one."""
    first = None
    for r in records:
      present = [f for f in document_fields if f in r.fields]
      if len(present) != 1:
        raise self.error(r, document_fields[0], f"a record holds exactly one of "
                         f"{list(document_fields)}, this one {present or 'none'}")
      by_text = present[0] != "input_ids"
      if first is None:
        first = (by_text, r.line)
      elif by_text != first[0]:
        kind = lambda t: "a text record" if t else "an input_ids record"
        raise self.error(r, present[0], f"is {kind(by_text)} but line {first[1]} is "
                         f"{kind(first[0])} (one kind per file)")
    if first[0] and self.tokenizer is None:
      raise ValueError(f"{self.path} holds text records: give a tokenizer (--tokenizer)")
    return first[0]

  def ids(self, record, field: str, value, *, what: str | None = None) -> np.ndarray:
    """A JSON list of token ids, checked: ints in the vocabulary, none of them a special id
    (the rows get their `<s>`, `</s>` and `<pad>` here, so one in a record would be a second
    one, or padding the model attends to)."""
    what = what or field
    if not isinstance(value, list) or not value:
      raise self.error(record, field, f"{what} must be a non-empty list of token ids")
    for i, x in enumerate(value):
      if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < self.vocab_size:
        raise self.error(record, field, f"{what}: element {i} must be a token id in [0, "
                         f"{self.vocab_size}) (the model's vocabulary), got {x!r}")
      if x in self._special_names:
        raise self.error(record, field, f"{what}: element {i} is {x}, the model's "
                         f"{self._special_names[x]}: records hold the ids of their text only "
                         f"(rows get <s> ... </s> and <pad> when they are built)")
    return np.asarray(value, np.int32)

  @functools.cached_property
  def _special_names(self) -> dict[int, str]:
    """{id: name} of the special ids no record may hold."""
    s = self.specials
    names = {s.sep: "separator (sep_token_id)", s.bos: "<s> (bos_token_id)",
             s.pad: "<pad> (pad_token_id)", s.eos: "</s> (eos_token_id)"}
    if s.mask is not None:
      names[s.mask] = "<mask>"
    return {**{i: "special token" for i in s.special}, **names}

  def attention_mask(self, record) -> None:
    """Checks a record's optional "attention_mask" (HF tokenizers write one beside input_ids):
    it goes with "input_ids", one value per id, each 1 (or true). A 0 (padding) is refused too:
    records hold real tokens only, and rows are padded (and masked) when they are built."""
    mask = record.fields.get("attention_mask")
    if mask is None:
      return
    ids = record.fields.get("input_ids")
    if ids is None:
      raise self.error(record, "attention_mask", "goes with \"input_ids\" (a text record's "
                       "mask is made from its tokens)")
    if len(mask) != len(ids):
      raise self.error(record, "attention_mask", f"has {len(mask)} values for {len(ids)} "
                       f"input_ids")
    for i, x in enumerate(mask):
      if x is True or (type(x) in (int, float) and x == 1):
        continue
      if x is False or (type(x) in (int, float) and x == 0):
        problem = ("padding in a record: drop the padded positions from input_ids and "
                   "attention_mask (rows are padded when they are built)")
      else:
        problem = "expected 1 or true (a mask holds 0 or 1; every id of a record is real)"
      raise self.error(record, "attention_mask", f"element {i} is {json.dumps(x)[:40]}: "
                       f"{problem}")

  def encode(self, record, field: str, content: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, character offsets [n, 2]) of a text, without special tokens (a text that spells
    one, e.g. a literal "</s>" the tokenizer reads as its special token, is an error)."""
    with encoding_errors(self.tokenizer, f"{self.path}:{record.line} field {field!r}"):
      enc = self.tokenizer.encode(content, add_special_tokens=False)
    ids = np.asarray(enc.ids, np.int32)
    if not len(ids):
      raise self.error(record, field, "tokenizes to no tokens")
    if int(ids.max()) >= self.vocab_size:
      raise self.error(record, field, f"tokenizes to id {int(ids.max())}, outside the model's "
                       f"vocabulary (vocab_size={self.vocab_size}): the tokenizer does not "
                       f"belong to this model")
    special = np.flatnonzero(np.isin(ids, list(self._special_names)))
    if len(special):
      i = int(special[0])
      raise self.error(record, field, f"token {i} is {enc.tokens[i]!r}, the model's "
                       f"{self._special_names[int(ids[i])]}: the text spells a special token "
                       f"(rows get <s> ... </s> and <pad> when they are built)")
    return ids, np.asarray(enc.offsets, np.int32).reshape(-1, 2)

  def content(self, record, by_text: bool, text_field: str = "text"
              ) -> tuple[np.ndarray, np.ndarray | None]:
    """(ids, character offsets or None) of the record's document: its text or its input_ids."""
    if by_text:
      return self.encode(record, text_field, record.fields[text_field])
    return self.ids(record, "input_ids", record.fields["input_ids"]), None

  def question(self, record, by_text: bool) -> np.ndarray:
    """The ids of the record's question (a string or ids, as the record), cut to
    max_question_length."""
    return self.question_tokens(record, by_text)[0]

  def question_tokens(self, record, by_text: bool) -> tuple[np.ndarray, int]:
    """(the question's ids cut to max_question_length, its tokens uncut)."""
    q = record.fields["question"]
    if by_text != isinstance(q, str):
      raise self.error(record, "question", "must be a string in text records and a list of "
                       "token ids in input_ids records")
    ids = self.encode(record, "question", q)[0] if by_text else self.ids(record, "question", q)
    return ids[:self.max_question_length], len(ids)

  def room(self, record, used: int, field: str) -> int:
    """The tokens left in a row after `used`, at least 1 (else an error on `field`)."""
    left = self.max_length - used
    if left < 1:
      raise self.error(record, field, f"leaves no room for the document in max_length="
                       f"{self.max_length} (the rest of the row takes {used} tokens: raise "
                       f"max_length or lower max_question_length)")
    return left

  def label(self, record, field: str, below: int | None = None) -> int:
    """The integer label of `field`, checked >= 0, < `below` and < MAX_LABELS."""
    value = record.fields[field]
    if value < 0 or (below is not None and value >= below):
      bound = "" if below is None else f" and < {below}"
      raise self.error(record, field, f"must be >= 0{bound}, got {value}")
    check_label_bound(self.path, record.line, field, value)
    return value


def check_label_bound(path: str, line: int, field: str, value: int) -> None:
  """A `text.JsonlError` for an integer class label >= MAX_LABELS."""
  if value >= MAX_LABELS:
    raise text.JsonlError(path, line, field, f"is {_short(value)}: a class id must be below "
                          f"{MAX_LABELS:,} (labels are the classes 0..K-1, K <= {MAX_LABELS:,})")


def check_dense_labels(path: str, line: int, field: str, largest: int, used) -> None:
  """A `text.JsonlError` at the largest label (`path`:`line`) when the integer labels `used`
  are not the dense range 0..largest: the head gets largest + 1 classes, and a class no record
  names is a row of the head trained only never to be chosen (a typo, or ids from another label
  set). Labels up to 1 pass: a classifier has at least two classes whatever its data names."""
  if largest < 2:
    return
  missing = sorted(set(range(largest + 1)) - set(used))
  if missing:
    shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
    raise text.JsonlError(path, line, field, f"is {largest}, but no record has the class(es) "
                          f"{shown}: labels must be the dense range 0..K-1 ({len(missing)} of "
                          f"0..{largest} unused); renumber them, or start from a classifier "
                          f"whose num_labels declares the classes")


def _short(value) -> str:
  digits = str(value)
  return digits if len(digits) <= 24 else f"{digits[:12]}... ({len(digits)} digits)"


def first_tokens(spans: Sequence[tuple[int, int]], offsets: np.ndarray) -> np.ndarray:
  """The index of the first token overlapping each character span (-1 for none)."""
  first = np.full(len(spans), -1, np.int64)
  for w, (a, b) in enumerate(spans):
    inside = np.flatnonzero((offsets[:, 0] < b) & (offsets[:, 1] > a))
    if len(inside):
      first[w] = inside[0]
  return first


# ----------------------------------------------------------------------------------------------
# Batches


def encoder_arrays(sequences: Sequence[np.ndarray], global_lengths: Sequence[int], n: int,
                   pad_id: int) -> dict[str, np.ndarray]:
  """input_ids, attention_mask, global_attention_mask, int32 [len(sequences), n]: each sequence
  padded with `pad_id`, global attention on its first global_lengths[i] tokens."""
  ids_BxN, mask_BxN = text.pad(sequences, length=n, pad_id=pad_id)
  return {"input_ids": ids_BxN, "attention_mask": mask_BxN,
          "global_attention_mask": _prefix_mask(global_lengths, n) * mask_BxN}


def _prefix_mask(lengths: Sequence[int], n: int) -> np.ndarray:
  """int32 [len(lengths), n]: 1 on the first lengths[i] positions of row i."""
  return (np.arange(n)[None, :] < np.asarray(lengths, np.int64)[:, None]).astype(np.int32)


__all__ = ["Example", "FinetuneSplit", "GLOBAL_MODES", "IGNORE_INDEX", "MAX_LABELS", "Reader",
           "RecordLayout", "Truncation", "check_dense_labels", "check_label_bound",
           "encoder_arrays", "first_tokens", "read_split"]
