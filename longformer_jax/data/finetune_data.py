"""JSONL examples of the four fine-tuning tasks, featurised for a Longformer encoder.

    >>> from longformer_jax.data import finetune_data as fd, text
    >>> specials = fd.Specials.of(config)                    # <s>, </s>, <pad> of the model
    >>> split = fd.read_split("train.jsonl", "qa", text.load_tokenizer("tokenizer.json"),
    ...                       max_length=4096, specials=specials)
    >>> batch = fd.batch(split, rows=[0, 1, 2, 3], global_attention="question",
    ...                  pad_id=config.pad_token_id)                 # int32 arrays, [4, 4096]

Records (one JSON object per line; `longformer_jax.data.text.read_jsonl`'s rules, and an optional
unique "id", a string or integer, naming the record in the predictions; default its line):

  classification   {"text": str | "input_ids": [int], "label": int}
  token            {"text": str | "input_ids": [int], "labels": [str] or [int]}: one label per
                   whitespace-separated word of "text", or per id of "input_ids"
  qa               {"question": str, "context": str, "answers": [{"text": str,
                   "answer_start": int}]} (character offsets into the context), or
                   {"question": [int], "input_ids": [int], "answers": [{"start": int,
                   "end": int}]} (token offsets into input_ids, end inclusive)
  multiple_choice  {"question": str, "candidates": [str], "text": str, "label": int}, or
                   {"question": [int], "candidates": [[int]], "input_ids": [int], "label": int}
                   (the label is the index of the right candidate)

Text is tokenized without the tokenizer's special tokens and id records are taken as they are;
both then get the model's special tokens in RoBERTa's layout (HF's Longformer uses it), so that
every record of a task has the same structure whatever its kind:

  classification, token   <s> text </s>
  qa                      <s> question </s></s> context </s>
  multiple_choice         <s> question </s></s> candidate </s></s> document </s>   (one row per
                          candidate)

Sequences longer than `max_length` lose the end of their text / context / document (questions
are cut to `max_question_length` first). The global tokens of every layout are a prefix of the
row (`global_length`): `<s>` ("first"), `<s>` and the question ("question", QA), `<s>`, the
question and the candidate ("question", multiple choice), or none.

A record that breaks these rules is a `text.JsonlError` naming the file, the line and the field.
Shape letters: B batch, C candidates, N tokens.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from longformer_jax.data import text

TASKS = ("classification", "qa", "token", "multiple_choice")
# Label of positions that are not scored (HF's ignore index).
IGNORE_INDEX = -100
# Where the task puts global attention unless told otherwise (paper §3.1: "[CLS] for
# classification, all question tokens for QA"; §6 for multiple choice: the question and the
# candidates). Token tagging: none, as HF's LongformerForTokenClassification.
DEFAULT_GLOBAL = {"classification": "first", "qa": "question", "token": "none",
                  "multiple_choice": "question"}
GLOBAL_MODES = ("default", "none", "first", "question")


@dataclasses.dataclass(frozen=True)
class Specials:
  """The model's special token ids (`LongformerConfig` fields)."""
  bos: int
  sep: int
  eos: int
  pad: int

  @classmethod
  def of(cls, config) -> Specials:
    return cls(bos=config.bos_token_id, sep=config.sep_token_id, eos=config.eos_token_id,
               pad=config.pad_token_id)


# ----------------------------------------------------------------------------------------------
# Examples


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
  candidate_ends: multiple choice: per candidate, the first position after it.
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
  candidate_ends: tuple[int, ...] | None = None

  def global_lengths(self, mode: str) -> tuple[int, ...]:
    """The global prefix of each row (one row; multiple choice: one per candidate)."""
    rows = self.candidate_ends or (self.question_end,)
    if mode == "none":
      return (0,) * len(rows)
    if mode == "first":
      return (1,) * len(rows)
    return rows  # "question": through the question (and the candidate)


@dataclasses.dataclass(frozen=True)
class FinetuneSplit:
  """A JSONL file of one task, featurised.

  ids: each record's "id", else its line number. by_text: the records hold text (not ids).
  label_names: token task: the tag of each label id; int_labels: the file spells tags as ids.
  num_choices: multiple choice: the most candidates of a record (rows are padded to it).
  """
  task: str
  path: str
  sha256: str
  ids: tuple[Any, ...]
  examples: tuple[Example, ...]
  max_length: int
  by_text: bool
  label_names: tuple[str, ...] | None = None
  int_labels: bool = False
  num_choices: int | None = None

  def __len__(self) -> int:
    return len(self.examples)

  def max_global(self, mode: str) -> int:
    """The most global tokens of a row: the static bound the attention needs under jit."""
    return max((g for e in self.examples for g in e.global_lengths(mode)), default=0)


def resolve_global(task: str, mode: str) -> str:
  """`mode` ("default", "none", "first", "question") as the mode the task uses."""
  if mode not in GLOBAL_MODES:
    raise ValueError(f"global_attention must be one of {GLOBAL_MODES}, got {mode!r}")
  mode = DEFAULT_GLOBAL[task] if mode == "default" else mode
  if mode == "question" and task not in ("qa", "multiple_choice"):
    raise ValueError(f"global_attention='question' needs a question: task {task!r} has none "
                     f"(use 'first' or 'none')")
  return mode


# ----------------------------------------------------------------------------------------------
# Reading


_SCHEMAS = {
    "classification": ({"label": int}, {"text": str, "input_ids": list}),
    "token": ({"labels": list}, {"text": str, "input_ids": list}),
    "qa": ({"question": (str, list), "answers": list}, {"context": str, "input_ids": list}),
    "multiple_choice": ({"question": (str, list), "candidates": list, "label": int},
                        {"text": str, "input_ids": list}),
}


def read_split(path: str | os.PathLike, task: str, tokenizer, *, max_length: int,
               specials: Specials, vocab_size: int, max_question_length: int = 128,
               label_names: Sequence[str] | None = None) -> FinetuneSplit:
  """The records of a JSONL file of `task` (module docstring), featurised.

  tokenizer: a `tokenizers.Tokenizer` (`text.load_tokenizer`); None when every record holds ids.
  vocab_size: ids must be below it (the model's embedding table).
  label_names: token task: the tags in id order (see `tag_names`); string labels must be among
    them, integer labels below their count.

  Raises `text.JsonlError` (file, line and field) for a record that breaks the rules, and
  ValueError for settings that leave no room (max_length too small).
  """
  if task not in TASKS:
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")
  if not isinstance(max_length, int) or max_length < 8:
    raise ValueError(f"max_length must be an int >= 8, got {max_length!r}")
  path = os.fspath(path)
  required, document = _SCHEMAS[task]
  records = text.read_jsonl(path, required, optional={**document, "id": (str, int)},
                            unique=("id",))
  reader = _Reader(path, tokenizer, specials, vocab_size, max_length, max_question_length)
  by_text = reader.kinds(records, tuple(document))
  if task == "token":
    if label_names is None:
      raise ValueError("the token task needs label_names (tag_names of the splits)")
    examples = [reader.token(r, by_text, tuple(label_names)) for r in records]
  else:
    examples = [getattr(reader, task)(r, by_text) for r in records]
  num_choices = (max(len(e.input_ids) for e in examples) if task == "multiple_choice" else None)
  return FinetuneSplit(
      task=task, path=path, sha256=text.file_sha256(path),
      ids=tuple(r.fields.get("id", r.line) for r in records), examples=tuple(examples),
      max_length=max_length, by_text=by_text,
      label_names=tuple(label_names) if task == "token" else None,
      int_labels=task == "token" and any(isinstance(t, int) for r in records
                                         for t in r.fields["labels"]),
      num_choices=num_choices)


def tag_names(paths: Sequence[str | os.PathLike]) -> tuple[tuple[str, ...], bool]:
  """(names, from_ints): the tags of the token task's files, in id order: their string labels
  sorted (with "O" first when present), or "0".."K" for integer labels (then from_ints)."""
  strings, largest = set(), -1
  for path in paths:
    for record in text.read_jsonl(path, {"labels": list}):
      for i, label in enumerate(record.fields["labels"]):
        if isinstance(label, str) and label.strip():
          strings.add(label)
        elif isinstance(label, int) and not isinstance(label, bool) and label >= 0:
          largest = max(largest, label)
        else:
          raise text.JsonlError(os.fspath(path), record.line, "labels",
                                f"element {i} must be a non-empty string or an integer >= 0, "
                                f"got {label!r}")
      if strings and largest >= 0:
        raise text.JsonlError(os.fspath(path), record.line, "labels",
                              "mixes string and integer labels (the files must use one kind)")
  if strings:
    return tuple(sorted(strings, key=lambda s: (s != "O", s))), False
  return tuple(str(i) for i in range(largest + 1)), True


class _Reader:
  """Featurises the records of one file (one method per task)."""

  def __init__(self, path, tokenizer, specials: Specials, vocab_size: int, max_length: int,
               max_question_length: int):
    self.path, self.specials, self.vocab_size = path, specials, vocab_size
    self.max_length, self.max_question_length = max_length, max_question_length
    self.tokenizer = None
    if tokenizer is not None:
      import tokenizers
      # A copy whose own truncation and padding settings cannot interfere.
      self.tokenizer = tokenizers.Tokenizer.from_str(tokenizer.to_str())
      self.tokenizer.no_truncation()
      self.tokenizer.no_padding()

  def error(self, record, field: str, problem: str) -> text.JsonlError:
    return text.JsonlError(self.path, record.line, field, problem)

  def kinds(self, records, document_fields: tuple[str, ...]) -> bool:
    """Whether the file holds text records (else id records): one kind per file."""
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

  # Pieces.

  def ids(self, record, field: str, value, *, what: str | None = None) -> np.ndarray:
    """A JSON list of token ids, checked (ints in the vocabulary)."""
    what = what or field
    if not isinstance(value, list) or not value:
      raise self.error(record, field, f"{what} must be a non-empty list of token ids")
    for i, x in enumerate(value):
      if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < self.vocab_size:
        raise self.error(record, field, f"{what}: element {i} must be a token id in [0, "
                         f"{self.vocab_size}) (the model's vocabulary), got {x!r}")
    return np.asarray(value, np.int32)

  def encode(self, record, field: str, content: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, character offsets [n, 2]) of a text, without special tokens."""
    enc = self.tokenizer.encode(content, add_special_tokens=False)
    ids = np.asarray(enc.ids, np.int32)
    if not len(ids):
      raise self.error(record, field, "tokenizes to no tokens")
    if int(ids.max()) >= self.vocab_size:
      raise self.error(record, field, f"tokenizes to id {int(ids.max())}, outside the model's "
                       f"vocabulary (vocab_size={self.vocab_size}): the tokenizer does not "
                       f"belong to this model")
    return ids, np.asarray(enc.offsets, np.int32).reshape(-1, 2)

  def content(self, record, by_text: bool, text_field: str = "text"
              ) -> tuple[np.ndarray, np.ndarray | None]:
    if by_text:
      return self.encode(record, text_field, record.fields[text_field])
    return self.ids(record, "input_ids", record.fields["input_ids"]), None

  def question(self, record, by_text: bool) -> np.ndarray:
    q = record.fields["question"]
    if by_text != isinstance(q, str):
      raise self.error(record, "question", "must be a string in text records and a list of "
                       "token ids in input_ids records")
    ids = self.encode(record, "question", q)[0] if by_text else self.ids(record, "question", q)
    return ids[:self.max_question_length]

  def room(self, record, used: int, field: str) -> int:
    left = self.max_length - used
    if left < 1:
      raise self.error(record, field, f"leaves no room for the document in max_length="
                       f"{self.max_length} (the rest of the row takes {used} tokens: raise "
                       f"max_length or lower max_question_length)")
    return left

  def label(self, record, field: str, below: int | None = None) -> int:
    value = record.fields[field]
    if value < 0 or (below is not None and value >= below):
      bound = "" if below is None else f" and < {below}"
      raise self.error(record, field, f"must be >= 0{bound}, got {value}")
    return value

  # Tasks.

  def classification(self, record, by_text: bool) -> Example:
    s = self.specials
    ids, _ = self.content(record, by_text)
    ids = ids[:self.max_length - 2]
    row = np.concatenate([[s.bos], ids, [s.eos]]).astype(np.int32)
    return Example(record.line, row, label=self.label(record, "label"))

  def token(self, record, by_text: bool, names: tuple[str, ...]) -> Example:
    s = self.specials
    labels = record.fields["labels"]
    if by_text:
      content = record.fields["text"]
      # Words are the whitespace-separated pieces; each one's first token carries its label.
      spans = [m.span() for m in re.finditer(r"\S+", content)]
      ids, offsets = self.encode(record, "text", content)
      first = _first_tokens(spans, offsets)
      unit = "words (the text split on whitespace)"
    else:
      ids = self.ids(record, "input_ids", record.fields["input_ids"])
      first = np.arange(len(ids))
      unit = "input_ids"
    if len(labels) != len(first):
      raise self.error(record, "labels", f"has {len(labels)} labels for {len(first)} {unit}")
    label_ids = []
    for i, label in enumerate(labels):
      index = names.index(label) if isinstance(label, str) and label in names else (
          label if isinstance(label, int) and not isinstance(label, bool)
          and 0 <= label < len(names) else None)
      if index is None:
        raise self.error(record, "labels", f"element {i} is {label!r}, not one of the "
                         f"{len(names)} labels {list(names)[:20]}")
      label_ids.append(index)
    keep = self.max_length - 2
    row = np.concatenate([[s.bos], ids[:keep], [s.eos]]).astype(np.int32)
    # Positions in the row: +1 for <s>; words whose first token was cut away are -1.
    words = np.where((first >= 0) & (first < keep), first + 1, -1).astype(np.int32)
    token_labels = np.full(len(row), IGNORE_INDEX, np.int32)
    token_labels[words[words >= 0]] = np.asarray(label_ids, np.int32)[words >= 0]
    return Example(record.line, row, token_labels=token_labels, words=words,
                   gold=tuple(names[i] for i in label_ids))

  def qa(self, record, by_text: bool) -> Example:
    s = self.specials
    question = self.question(record, by_text)
    ids, offsets = self.content(record, by_text, "context")
    answers = record.fields["answers"]
    if not answers:
      raise self.error(record, "answers", "is empty (a record needs at least one answer)")
    spans, gold = [], []
    for i, answer in enumerate(answers):
      span, answer_gold = self.answer(record, i, answer, by_text, ids, offsets)
      spans.append(span)
      gold.append(answer_gold)
    head = 1 + len(question) + 2  # <s> question </s></s>
    keep = min(len(ids), self.room(record, head + 1, "question"))
    row = np.concatenate([[s.bos], question, [s.sep, s.sep], ids[:keep], [s.eos]])
    # The first answer whose tokens all survived truncation is the training target (the paper's
    # TriviaQA loss sums over every occurrence; one span keeps HF's simpler loss).
    target = next(((head + a, head + b) for a, b in spans if b < keep), None)
    return Example(record.line, row.astype(np.int32), question_end=1 + len(question),
                   gold=tuple(gold), context=(head, head + keep),
                   offsets=None if offsets is None else offsets[:keep],
                   context_text=record.fields["context"] if by_text else None, target=target)

  def answer(self, record, i: int, answer, by_text: bool, ids: np.ndarray,
             offsets: np.ndarray | None) -> tuple[tuple[int, int], Any]:
    """((first, last) context token of an answer, its gold value)."""
    keys = ("text", "answer_start") if by_text else ("start", "end")
    types = (str, int) if by_text else (int, int)
    if not isinstance(answer, dict) or any(
        not isinstance(answer.get(k), t) or isinstance(answer.get(k), bool)
        for k, t in zip(keys, types)):
      raise self.error(record, "answers", f"element {i} must be an object with "
                       f"{' and '.join(repr(k) for k in keys)} "
                       f"({', '.join(t.__name__ for t in types)}), got {answer!r}"[:300])
    if not by_text:
      a, b = answer["start"], answer["end"]
      if not 0 <= a <= b < len(ids):
        raise self.error(record, "answers", f"element {i}: start={a}, end={b} must satisfy 0 "
                         f"<= start <= end < {len(ids)} (token offsets into input_ids, end "
                         f"inclusive)")
      return (a, b), tuple(int(x) for x in ids[a:b + 1])
    context, answer_text, start = record.fields["context"], answer["text"], answer["answer_start"]
    if not answer_text.strip() or context[start:start + len(answer_text)] != answer_text:
      raise self.error(record, "answers", f"element {i}: the context at answer_start={start} "
                       f"reads {context[start:start + len(answer_text)]!r}, not the answer "
                       f"{answer_text!r}")
    end = start + len(answer_text)
    inside = np.flatnonzero((offsets[:, 0] < end) & (offsets[:, 1] > start))
    if not len(inside):
      raise self.error(record, "answers", f"element {i}: no token of the context covers "
                       f"characters [{start}, {end})")
    return (int(inside[0]), int(inside[-1])), answer_text

  def multiple_choice(self, record, by_text: bool) -> Example:
    s = self.specials
    question = self.question(record, by_text)
    document, _ = self.content(record, by_text)
    candidates = record.fields["candidates"]
    if len(candidates) < 2:
      raise self.error(record, "candidates", f"needs at least 2 candidates, got "
                       f"{len(candidates)}")
    rows, ends = [], []
    for i, candidate in enumerate(candidates):
      if by_text:
        if not isinstance(candidate, str) or not candidate.strip():
          raise self.error(record, "candidates", f"element {i} must be a non-empty string, "
                           f"got {candidate!r}")
        cand = self.encode(record, "candidates", candidate)[0]
      else:
        cand = self.ids(record, "candidates", candidate, what=f"element {i}")
      # <s> question </s></s> candidate </s></s> document </s>
      head = np.concatenate([[s.bos], question, [s.sep, s.sep], cand]).astype(np.int32)
      keep = self.room(record, len(head) + 3, "candidates")
      rows.append(np.concatenate([head, [s.sep, s.sep], document[:keep], [s.eos]])
                  .astype(np.int32))
      ends.append(len(head))
    return Example(record.line, tuple(rows), question_end=1 + len(question),
                   label=self.label(record, "label", below=len(candidates)),
                   candidate_ends=tuple(ends))


def _first_tokens(spans: Sequence[tuple[int, int]], offsets: np.ndarray) -> np.ndarray:
  """The index of the first token overlapping each character span (-1 for none)."""
  first = np.full(len(spans), -1, np.int64)
  for w, (a, b) in enumerate(spans):
    inside = np.flatnonzero((offsets[:, 0] < b) & (offsets[:, 1] > a))
    if len(inside):
      first[w] = inside[0]
  return first


# ----------------------------------------------------------------------------------------------
# Batches


def batch(split: FinetuneSplit, rows: Sequence[int], *, global_attention: str,
          pad_id: int, bos_id: int | None = None, eos_id: int | None = None
          ) -> dict[str, np.ndarray]:
  """The padded arrays of `split`'s examples `rows` (int32; N = split.max_length):

    all tasks         input_ids, attention_mask, global_attention_mask [B, N]
                      (multiple choice: [B, C, N], C = split.num_choices)
    classification    labels [B]
    token             labels [B, N] (IGNORE_INDEX where not scored)
    qa                context_mask [B, N] (where an answer may start and end);
                      start_positions, end_positions [B] (-1: no answer survived truncation)
    multiple_choice   choice_mask [B, C] (1 for real candidates), labels [B]

  global_attention: "none", "first" or "question" (`resolve_global`). Multiple choice fills
  missing candidates with `<s></s>` rows (bos_id, eos_id), masked out by choice_mask.
  """
  examples = [split.examples[i] for i in rows]
  n = split.max_length
  if split.task == "multiple_choice":
    c = split.num_choices
    filler = np.asarray([bos_id, eos_id], np.int32)
    seqs = [list(e.input_ids) + [filler] * (c - len(e.input_ids)) for e in examples]
    ids_BCxN, mask_BCxN = text.pad([s for row in seqs for s in row], length=n, pad_id=pad_id)
    globals_BC = [g for e in examples for g in e.global_lengths(global_attention)
                  + (0,) * (c - len(e.input_ids))]
    global_BCxN = _prefix_mask(globals_BC, n) * mask_BCxN
    choice_BxC = np.asarray([[1] * len(e.input_ids) + [0] * (c - len(e.input_ids))
                             for e in examples], np.int32)
    shape = (len(examples), c, n)
    return {"input_ids": ids_BCxN.reshape(shape), "attention_mask": mask_BCxN.reshape(shape),
            "global_attention_mask": global_BCxN.reshape(shape), "choice_mask": choice_BxC,
            "labels": np.asarray([e.label for e in examples], np.int32)}
  ids_BxN, mask_BxN = text.pad([e.input_ids for e in examples], length=n, pad_id=pad_id)
  global_BxN = _prefix_mask([e.global_lengths(global_attention)[0] for e in examples],
                            n) * mask_BxN
  out = {"input_ids": ids_BxN, "attention_mask": mask_BxN, "global_attention_mask": global_BxN}
  if split.task == "classification":
    out["labels"] = np.asarray([e.label for e in examples], np.int32)
  elif split.task == "token":
    out["labels"] = text.pad([e.token_labels for e in examples], length=n,
                             pad_id=IGNORE_INDEX)[0]
  else:
    context_BxN = np.zeros((len(examples), n), np.int32)
    for row, e in enumerate(examples):
      context_BxN[row, e.context[0]:e.context[1]] = 1
    targets = [e.target or (-1, -1) for e in examples]
    out.update(context_mask=context_BxN,
               start_positions=np.asarray([t[0] for t in targets], np.int32),
               end_positions=np.asarray([t[1] for t in targets], np.int32))
  return out


def _prefix_mask(lengths: Sequence[int], n: int) -> np.ndarray:
  """int32 [len(lengths), n]: 1 on the first lengths[i] positions of row i."""
  return (np.arange(n)[None, :] < np.asarray(lengths, np.int64)[:, None]).astype(np.int32)


__all__ = ["DEFAULT_GLOBAL", "Example", "FinetuneSplit", "GLOBAL_MODES", "IGNORE_INDEX",
           "Specials", "TASKS", "batch", "read_split", "resolve_global", "tag_names"]
