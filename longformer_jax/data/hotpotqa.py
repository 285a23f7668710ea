"""HotpotQA (distractor setting): its JSON records, and the rows of the paper's two-stage reader.

    >>> from longformer_jax.data import hotpotqa as hq
    >>> records = hq.read_hotpotqa("hotpot_dev_distractor_v1.json")
    >>> markers = hq.MarkerIds(q=512, q_end=513, p=514, s=515)   # the four new vocabulary rows
    >>> encode = hq.tokenizer_encoder(tokenizer)                  # text -> (ids, char offsets)
    >>> row = hq.build_layout(records[0], encode, specials, markers, max_length=4096)  # stage 1
    >>> keep = hq.select_paragraphs(scores, k=2)                  # its [p] scores -> paragraphs
    >>> row2 = hq.build_layout(records[0], encode, specials, markers, max_length=4096,
    ...                        paragraphs=keep)                  # stage 2

Records (a JSON list of objects, HotpotQA's release format): `_id` (str), `question` (str),
`answer` (str; "yes" / "no" for the closed comparison questions), `supporting_facts` ([[title,
sentence id], ...]), `context` ([[title, [sentence, ...]], ...]: ten paragraphs in the distractor
setting), and optionally `type` ("bridge" / "comparison") and `level`. The test set has no
answer nor supporting facts: `read_hotpotqa(..., gold=False)` reads it.

Row layout (`build_layout`), the paper's with RoBERTa's `<s>` and `</s>` around it:
`<s> [q] question [/q] [p] title [s] sentence [s] sentence ... [p] title [s] ... </s>`. The four
markers are new vocabulary entries whose ids the caller gives (`MarkerIds`). Global attention on
`<s>` (the question type is read there), the question and every [q] / [/q] / [p] / [s] marker.
A row that does not fit `max_length` keeps whole sentences in reading order and ends at the first
one that does not fit (a paragraph's `[p] title` is kept only with its first sentence); what was
lost is in `Layout.truncation`.

Shape letters: N row positions, P paragraph slots, S sentence slots, A answer occurrences.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from longformer_jax.data.tokenizer import SpecialIds

__all__ = [
    "MARKER_TOKENS", "QUESTION_TYPES", "HotpotRecord", "Layout", "MarkerIds", "Truncation",
    "answer_text", "build_layout", "gold_paragraphs", "paragraph_scores", "parse_records",
    "question_type", "read_hotpotqa", "select_paragraphs", "stack_layouts", "tokenizer_encoder",
]

# The new vocabulary entries of the layout, in MarkerIds' field order.
MARKER_TOKENS = ("[q]", "[/q]", "[p]", "[s]")
# The question-type head's classes: an answer span, or the closed answers of comparisons.
QUESTION_TYPES = ("span", "yes", "no")

# text -> (token ids [n], character offsets [n, 2]) without special tokens.
Encoder = Callable[[str], tuple[Sequence[int], Sequence[Sequence[int]]]]


# ----------------------------------------------------------------------------------------------
# Records


@dataclasses.dataclass(frozen=True)
class HotpotRecord:
  """One HotpotQA record.

  id: `_id`. context: ((title, (sentence, ...)), ...) in the file's order. supporting_facts:
  ((title, sentence id), ...) as the file lists them (None in a test file without gold); answer:
  None likewise. source: "file: record i" (where errors point).
  """
  id: str
  question: str
  context: tuple[tuple[str, tuple[str, ...]], ...]
  answer: str | None = None
  supporting_facts: tuple[tuple[str, int], ...] | None = None
  type: str | None = None
  level: str | None = None
  source: str = ""

  @property
  def supporting_titles(self) -> frozenset[str]:
    return frozenset(t for t, _ in self.supporting_facts or ())

  def as_json(self) -> dict[str, Any]:
    """The record in HotpotQA's format (what `hotpot_scores` takes as a gold record)."""
    out: dict[str, Any] = {"_id": self.id, "question": self.question}
    if self.answer is not None:
      out["answer"] = self.answer
    if self.supporting_facts is not None:
      out["supporting_facts"] = [[t, i] for t, i in self.supporting_facts]
    out["context"] = [[t, list(s)] for t, s in self.context]
    if self.type is not None:
      out["type"] = self.type
    if self.level is not None:
      out["level"] = self.level
    return out


def question_type(answer: str) -> int:
  """The question-type label of an answer: 1 "yes", 2 "no" (HotpotQA spells them so), else 0 (a
  span of the context)."""
  a = answer.strip().lower()
  return 1 if a == "yes" else 2 if a == "no" else 0


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def parse_records(data: Any, source: str = "<records>", *, gold: bool = True
                  ) -> list[HotpotRecord]:
  """HotpotQA records from the file's decoded JSON (a list of objects), checked.

  source: names the file in errors. gold: the records carry answer and supporting_facts.
  Raises ValueError naming the file, the record (index and `_id`), the field and what was
  expected; a repeated `_id` too.
  """
  if not isinstance(data, list):
    raise ValueError(f"{source}: expected a JSON list of HotpotQA records, got "
                     f"{type(data).__name__}")
  records, seen = [], {}
  for i, r in enumerate(data):
    where = f"{source}: record {i}"
    if not isinstance(r, Mapping):
      raise ValueError(f"{where}: expected an object, got {type(r).__name__}")
    if isinstance(r.get("_id"), str):
      where += f" (_id {r['_id']!r})"

    def bad(field: str, problem: str, where=where):
      return ValueError(f"{where}: field {field!r} {problem}"[:500])

    required = ("_id", "question", "context") + (("answer", "supporting_facts") if gold else ())
    for field in required:
      if field not in r:
        raise bad(field, "is missing (a HotpotQA record has _id, question, answer, "
                  "supporting_facts and context)")
    for field in ("_id", "question") + (("answer",) if gold else ()):
      if not isinstance(r[field], str):
        raise bad(field, f"must be a string, got {r[field]!r}")
    if not r["question"].strip():
      raise bad("question", "is empty")
    if r["_id"] in seen:
      raise bad("_id", f"repeats record {seen[r['_id']]}'s")
    seen[r["_id"]] = i
    context = r["context"]
    if not isinstance(context, list) or not context:
      raise bad("context", "must be a non-empty list of [title, [sentence, ...]] paragraphs")
    paragraphs = []
    for j, p in enumerate(context):
      if (not isinstance(p, list) or len(p) != 2 or not isinstance(p[0], str)
          or not isinstance(p[1], list) or not all(isinstance(s, str) for s in p[1])):
        raise bad("context", f"element {j} must be [title (str), [sentence (str), ...]], got "
                  f"{p!r}")
      paragraphs.append((p[0], tuple(p[1])))
    titles = [t for t, _ in paragraphs]
    if len(set(titles)) != len(titles):
      repeated = next(t for t in titles if titles.count(t) > 1)
      raise bad("context", f"repeats the title {repeated!r} (supporting facts name paragraphs "
                "by title)")
    facts = None
    if "supporting_facts" in r:
      sf = r["supporting_facts"]
      if not isinstance(sf, list):
        raise bad("supporting_facts", f"must be a list of [title, sentence id] pairs, got {sf!r}")
      for j, f in enumerate(sf):
        if (not isinstance(f, list) or len(f) != 2 or not isinstance(f[0], str)
            or not _is_int(f[1]) or f[1] < 0):
          raise bad("supporting_facts", f"element {j} must be [title (str), sentence id (int "
                    f">= 0)], got {f!r}")
      # A fact naming a sentence the context lacks is kept (the released training set has a
      # few); it counts as a supporting fact outside the row (`Truncation`).
      facts = tuple((f[0], f[1]) for f in sf)
    for field in ("type", "level"):
      if field in r and not isinstance(r[field], str):
        raise bad(field, f"must be a string, got {r[field]!r}")
    records.append(HotpotRecord(
        id=r["_id"], question=r["question"], context=tuple(paragraphs),
        answer=r.get("answer"), supporting_facts=facts, type=r.get("type"),
        level=r.get("level"), source=f"{source}: record {i}"))
  return records


def read_hotpotqa(path: str | os.PathLike, *, gold: bool = True) -> list[HotpotRecord]:
  """The records of a HotpotQA JSON file (`parse_records`' checks; ValueError naming the file
  when it is not JSON)."""
  path = os.fspath(path)
  with open(path, encoding="utf-8") as f:
    try:
      data = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not JSON ({e})") from None
  return parse_records(data, path, gold=gold)


# ----------------------------------------------------------------------------------------------
# Rows


@dataclasses.dataclass(frozen=True)
class MarkerIds:
  """The ids of the layout's four marker tokens (new vocabulary entries): [q], [/q], [p], [s]."""
  q: int
  q_end: int
  p: int
  s: int

  def __post_init__(self):
    ids = (self.q, self.q_end, self.p, self.s)
    if not all(_is_int(i) and i >= 0 for i in ids) or len(set(ids)) != 4:
      raise ValueError(f"marker ids must be four distinct ints >= 0 ([q], [/q], [p], [s]), got "
                       f"{ids}")

  @classmethod
  def of_tokenizer(cls, tokenizer) -> MarkerIds:
    """The ids of MARKER_TOKENS in a `tokenizers.Tokenizer` (ValueError naming a missing one:
    add them with `tokenizer.add_special_tokens(list(MARKER_TOKENS))`)."""
    from longformer_jax.data.tokenizer import token_id
    return cls(*(token_id(tokenizer, t) for t in MARKER_TOKENS))


def tokenizer_encoder(tokenizer) -> Encoder:
  """`encode(text) -> (ids, character offsets)` of a `tokenizers.Tokenizer`, no special tokens
  added (the markers and <s> / </s> are placed by `build_layout`)."""
  def encode(text: str):
    enc = tokenizer.encode(text, add_special_tokens=False)
    return enc.ids, enc.offsets
  return encode


@dataclasses.dataclass(frozen=True)
class Truncation:
  """What of a record a row holds.

  paragraphs, sentences: those read / those of the paragraphs the row was asked to read.
  supporting, supporting_kept: the record's supporting facts (distinct (title, sentence id)) and
    those whose whole sentence is in the row; a fact naming a sentence the context lacks is
    counted but never kept.
  answer_occurrences: the answer's token spans in the row (0 for yes / no).
  question_tokens, question_kept: the question's tokens and those kept (`max_question_length`).
  document_tokens, document_tokens_kept: the title and sentence tokens of the paragraphs asked
    for, and those in the row (markers, question and specials excluded).
  full_length: the row's length uncut (specials and markers included).
  """
  paragraphs: int
  paragraphs_kept: int
  sentences: int
  sentences_kept: int
  supporting: int
  supporting_kept: int
  answer_occurrences: int
  question_tokens: int
  question_kept: int
  document_tokens: int
  document_tokens_kept: int
  full_length: int

  @property
  def complete(self) -> bool:
    """Nothing of the question or the paragraphs asked for was cut."""
    return (self.document_tokens_kept == self.document_tokens
            and self.question_kept == self.question_tokens)

  @property
  def evidence_within_limit(self) -> bool:
    """Every supporting fact's sentence is in the row (a stage-2 row also loses the facts of
    the paragraphs stage 1 did not select)."""
    return self.supporting_kept == self.supporting


@dataclasses.dataclass(frozen=True)
class Layout:
  """One record as a static-length row.

  input_ids, attention_mask, global_attention_mask: int32 [N] (N = max_length, padded with <pad>).
  context_mask: int32 [N], 1 on the title and sentence tokens (where an answer may start and end).
  paragraph_positions [P], paragraph_mask [P], paragraph_labels [P]: the [p] marker of each
    paragraph slot, whether the slot holds one, and whether its paragraph supports the answer
    (its title is among the supporting facts'). Empty slots: position 0, mask 0, label 0.
  sentence_positions [S], sentence_mask [S], sentence_labels [S]: likewise the [s] markers, and
    whether the sentence is a supporting fact.
  answer_starts, answer_ends: int32 [A], every occurrence of the answer in the row's titles and
    sentences (row positions, end inclusive; whole tokens only; ignoring case when no occurrence
    matches exactly), -1 padded; none for yes / no answers.
  type_label: `question_type` of the answer (0 without gold).
  paragraphs: the marker map of the [p] slots: (paragraph index in the record's context, title).
  sentences: the marker map of the [s] slots: (title, sentence id).
  token_sentence, token_paragraph: int32 [N], the [s] / [p] slot each row position belongs to
    (a sentence: its marker and tokens; a paragraph: its marker, title and sentences), -1
    elsewhere.
  pieces, token_piece, token_chars: the texts of the row (the titles and sentences), and for
    every row position the piece it came from (-1: none) and its character span in it (decoding).
  """
  id: str
  input_ids: np.ndarray
  attention_mask: np.ndarray
  global_attention_mask: np.ndarray
  context_mask: np.ndarray
  paragraph_positions: np.ndarray
  paragraph_mask: np.ndarray
  paragraph_labels: np.ndarray
  sentence_positions: np.ndarray
  sentence_mask: np.ndarray
  sentence_labels: np.ndarray
  answer_starts: np.ndarray
  answer_ends: np.ndarray
  type_label: int
  paragraphs: tuple[tuple[int, str], ...]
  sentences: tuple[tuple[str, int], ...]
  token_sentence: np.ndarray
  token_paragraph: np.ndarray
  pieces: tuple[str, ...]
  token_piece: np.ndarray
  token_chars: np.ndarray
  truncation: Truncation

  @property
  def num_global(self) -> int:
    return int(self.global_attention_mask.sum())


def _encode(encode: Encoder, text: str, record: HotpotRecord, field: str,
            forbidden: Mapping[int, str]) -> tuple[np.ndarray, np.ndarray]:
  result = encode(text)
  if not isinstance(result, (tuple, list)) or len(result) != 2:
    raise TypeError(f"encode({text[:40]!r}) must return (ids, character offsets), got "
                    f"{type(result).__name__}: wrap a tokenizers.Tokenizer with "
                    f"tokenizer_encoder")
  ids, offsets = result
  ids = np.asarray(ids, np.int64).reshape(-1)
  offsets = np.asarray(offsets, np.int64).reshape(-1, 2)
  if len(offsets) != len(ids):
    raise ValueError(f"the encoder returned {len(ids)} ids and {len(offsets)} offsets for "
                     f"{text[:40]!r} (one (start, end) per id expected)")
  clash = [int(i) for i in ids if int(i) in forbidden]
  if clash:
    raise ValueError(f"{record.source}: {field} {text[:60]!r} tokenizes to id {clash[0]}, the "
                     f"layout's {forbidden[clash[0]]}: the text spells a special or marker token")
  return ids, offsets


def _occurrences(text: str, answer: str, fold: bool = False) -> list[tuple[int, int]]:
  """Character spans of every occurrence of `answer` in `text` (overlapping ones too); fold:
  ignoring case (where lower-casing keeps the text's length, so the spans stay valid)."""
  if fold:
    if len(text.lower()) != len(text):
      return []
    text, answer = text.lower(), answer.lower()
  spans, start = [], text.find(answer)
  while start >= 0 and answer:
    spans.append((start, start + len(answer)))
    start = text.find(answer, start + 1)
  return spans


def _token_span(text: str, offsets: np.ndarray, a: int, b: int) -> tuple[int, int] | None:
  """(first, last) token of characters [a, b) when the tokens cover exactly them, give or take
  whitespace inside a boundary token (byte-level BPE counts a word's leading space); None when
  the span starts or ends inside a word's token ("Paris" inside "Parisian")."""
  inside = np.flatnonzero((offsets[:, 0] < b) & (offsets[:, 1] > a))
  if not len(inside):
    return None
  first, last = int(inside[0]), int(inside[-1])
  if text[offsets[first, 0]:a].strip() or text[b:offsets[last, 1]].strip():
    return None
  return first, last


def build_layout(record: HotpotRecord, encode: Encoder, specials: SpecialIds, markers: MarkerIds,
                 *, max_length: int, paragraphs: Sequence[int] | None = None,
                 max_question_length: int = 64, max_paragraphs: int | None = None,
                 max_sentences: int | None = None, max_answers: int = 8,
                 vocab_size: int | None = None, global_markers: bool = True) -> Layout:
  """The row of `record` (the module docstring's layout), with its labels and marker map.

  encode: text -> (ids, character offsets), no special tokens (`tokenizer_encoder`).
  specials: <s>, </s>, <pad> ids. markers: the four marker ids.
  paragraphs: indices into `record.context` to read, in this order (stage 2: the selected ones,
    `select_paragraphs`); None reads all (stage 1).
  max_question_length: question tokens kept. max_paragraphs, max_sentences: the [p] / [s] slots
    (static shapes across a batch; default: this record's paragraphs, and its sentences); a row
    ends before a paragraph or sentence that finds no slot. max_answers: answer occurrences kept
    (the first ones in reading order). vocab_size: the model's; ids (markers included) must be
    below it (None: not checked).
  global_markers: the [p] and [s] markers attend globally (the paper's layout); False leaves
    them local (<s>, [q], the question and [/q] stay global), each marker then reading its own
    neighbourhood through the band.

  Raises ValueError: a paragraph index out of range or repeated, a question with no token, a
  text that tokenizes to a special or marker id or to an id outside vocab_size, or a max_length
  with no room for one sentence.
  """
  for name, value, least in (("max_length", max_length, 8), ("max_question_length",
                                                            max_question_length, 1),
                             ("max_answers", max_answers, 1)):
    if not _is_int(value) or value < least:
      raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
  if vocab_size is not None and max(dataclasses.astuple(markers)) >= vocab_size:
    raise ValueError(f"marker ids {dataclasses.astuple(markers)} must be below the model's "
                     f"vocab_size={vocab_size}: grow its embedding table for the new tokens")
  n_context = len(record.context)
  order = list(range(n_context)) if paragraphs is None else [int(i) for i in paragraphs]
  if any(not 0 <= i < n_context for i in order) or len(set(order)) != len(order):
    raise ValueError(f"{record.source}: paragraphs {list(order)} must be distinct indices into "
                     f"its {n_context} context paragraphs")
  max_paragraphs = len(order) if max_paragraphs is None else max_paragraphs
  if max_sentences is None:
    max_sentences = sum(len(record.context[i][1]) for i in order)
  forbidden = {specials.bos: "<s>", specials.eos: "</s>", specials.pad: "<pad>",
               specials.sep: "</s>", markers.q: "[q]", markers.q_end: "[/q]", markers.p: "[p]",
               markers.s: "[s]"}

  encoded: dict[str, tuple[np.ndarray, np.ndarray]] = {}

  def tokens(text: str, field: str) -> tuple[np.ndarray, np.ndarray]:
    if text not in encoded:  # each text is sized first, then appended: encode it once
      encoded[text] = _encode(encode, text, record, field, forbidden)
      ids = encoded[text][0]
      if vocab_size is not None and len(ids) and int(ids.max()) >= vocab_size:
        raise ValueError(f"{record.source}: {field} {text[:60]!r} tokenizes to id "
                         f"{int(ids.max())}, outside the model's vocabulary (vocab_size="
                         f"{vocab_size}): the tokenizer does not belong to this model")
    return encoded[text]

  q_ids, _ = tokens(record.question, "question")
  if not len(q_ids):
    raise ValueError(f"{record.source}: the question {record.question[:60]!r} tokenizes to no "
                     f"tokens")
  q_kept = q_ids[:max_question_length]
  ids = [specials.bos, markers.q, *q_kept.tolist(), markers.q_end]
  glob = [1] * len(ids)
  pieces: list[str] = []
  token_piece = [-1] * len(ids)
  token_chars = [(0, 0)] * len(ids)
  context = [0] * len(ids)
  p_slots: list[tuple[int, int, str]] = []  # (position, paragraph index, title)
  s_slots: list[tuple[int, str, int]] = []  # (position, title, sentence id)
  budget = max_length - 1  # </s> ends the row

  def append(marker: int, text: str, field: str):
    tok, off = tokens(text, field)
    position = len(ids)
    ids.append(marker)
    glob.append(int(global_markers))
    token_piece.append(-1)
    token_chars.append((0, 0))
    context.append(0)
    piece = len(pieces)
    pieces.append(text)
    ids.extend(tok.tolist())
    glob.extend([0] * len(tok))
    token_piece.extend([piece] * len(tok))
    token_chars.extend(map(tuple, off.tolist()))
    context.extend([1] * len(tok))
    return position

  def size(text: str, field: str) -> int:
    return 1 + len(tokens(text, field)[0])

  stopped = False
  sentences_total = sum(len(record.context[i][1]) for i in order)
  for i in order:
    title, sentences = record.context[i]
    if stopped or not sentences:
      continue
    head = size(title, "context title")
    first = size(sentences[0], "context sentence")
    if (len(p_slots) >= max_paragraphs or len(s_slots) >= max_sentences
        or len(ids) + head + first > budget):
      stopped = True
      continue
    p_slots.append((append(markers.p, title, "context title"), i, title))
    for j, sentence in enumerate(sentences):
      if (len(s_slots) >= max_sentences
          or len(ids) + size(sentence, "context sentence") > budget):
        stopped = True
        break
      s_slots.append((append(markers.s, sentence, "context sentence"), title, j))
  if not s_slots and sentences_total:
    raise ValueError(f"{record.source}: max_length={max_length} leaves no room for one sentence "
                     f"after the question ({len(ids) + 1} tokens with <s>, markers and </s>): "
                     f"raise max_length or lower max_question_length")
  ids.append(specials.eos)
  glob.append(0)
  token_piece.append(-1)
  token_chars.append((0, 0))
  context.append(0)
  length = len(ids)

  def row(values, fill=0):
    out = np.full(max_length, fill, np.int32)
    out[:length] = values
    return out

  # Each [s] slot's span: its marker and its sentence's tokens; each [p] slot's: its marker, its
  # title and all its sentences (markers included). The heads pool over these.
  token_sentence = np.full(max_length, -1, np.int32)
  token_paragraph = np.full(max_length, -1, np.int32)
  bounds = sorted([p for p, _, _ in p_slots] + [p for p, _, _ in s_slots] + [length - 1])
  for slot, (pos, _, _) in enumerate(s_slots):
    token_sentence[pos:bounds[bounds.index(pos) + 1]] = slot
  p_bounds = [p for p, _, _ in p_slots] + [length - 1]
  for slot, (pos, _, _) in enumerate(p_slots):
    token_paragraph[pos:p_bounds[slot + 1]] = slot

  def slots(values, count):
    out = np.zeros(count, np.int32)
    out[:len(values)] = values
    return out

  gold_facts = set(record.supporting_facts or ())
  titles = record.supporting_titles
  kept_facts = {(t, j) for _, t, j in s_slots}

  # Every occurrence of the answer in the row's titles and sentences, in reading order.
  starts, ends = [], []
  answer = record.answer
  type_label = question_type(answer) if answer is not None else 0
  if answer is not None and type_label == 0 and answer.strip():
    piece_arr, chars_arr = np.asarray(token_piece), np.asarray(token_chars)
    # Exact occurrences; only when there is none, occurrences ignoring case (HotpotQA has a few
    # answers cased otherwise than their context).
    for fold in (False, True):
      for piece, text in enumerate(pieces):
        positions = np.flatnonzero(piece_arr == piece)
        for a, b in _occurrences(text, answer.strip(), fold):
          span = _token_span(text, chars_arr[positions], a, b)
          if span is not None:
            starts.append(int(positions[span[0]]))
            ends.append(int(positions[span[1]]))
      if starts:
        break
  occurrences = len(starts)
  starts, ends = starts[:max_answers], ends[:max_answers]

  # What the row would hold uncut: every title and sentence of the paragraphs asked for.
  document = [len(tokens(text, field)[0]) for i in order if record.context[i][1]
              for text, field in ((record.context[i][0], "context title"),
                                  *((x, "context sentence") for x in record.context[i][1]))]
  truncation = Truncation(
      paragraphs=len(order), paragraphs_kept=len(p_slots), sentences=sentences_total,
      sentences_kept=len(s_slots), supporting=len(gold_facts),
      supporting_kept=len(gold_facts & kept_facts), answer_occurrences=occurrences,
      question_tokens=len(q_ids), question_kept=len(q_kept), document_tokens=sum(document),
      document_tokens_kept=int(sum(context)),
      full_length=4 + len(q_ids) + len(document) + sum(document))
  return Layout(
      id=record.id, input_ids=row(ids, specials.pad), attention_mask=row([1] * length),
      global_attention_mask=row(glob), context_mask=row(context),
      paragraph_positions=slots([p for p, _, _ in p_slots], max_paragraphs),
      paragraph_mask=slots([1] * len(p_slots), max_paragraphs),
      paragraph_labels=slots([int(t in titles) for _, _, t in p_slots], max_paragraphs),
      sentence_positions=slots([p for p, _, _ in s_slots], max_sentences),
      sentence_mask=slots([1] * len(s_slots), max_sentences),
      sentence_labels=slots([int((t, j) in gold_facts) for _, t, j in s_slots], max_sentences),
      answer_starts=np.asarray(starts + [-1] * (max_answers - len(starts)), np.int32),
      answer_ends=np.asarray(ends + [-1] * (max_answers - len(ends)), np.int32),
      type_label=type_label, paragraphs=tuple((i, t) for _, i, t in p_slots),
      sentences=tuple((t, j) for _, t, j in s_slots), pieces=tuple(pieces),
      token_sentence=token_sentence, token_paragraph=token_paragraph,
      token_piece=row(token_piece, -1), token_chars=np.asarray(
          token_chars + [(0, 0)] * (max_length - length), np.int32),
      truncation=truncation)


def answer_text(layout: Layout, start: int, end: int) -> str:
  """The text of row positions start..end (inclusive): the characters their tokens cover in
  the title or sentence they came from, pieces joined by a space when the span crosses one
  (positions outside the titles and sentences are skipped)."""
  parts: list[tuple[int, int, int]] = []  # (piece, first char, last char)
  for pos in range(max(start, 0), min(end, len(layout.input_ids) - 1) + 1):
    piece = int(layout.token_piece[pos])
    if piece < 0:
      continue
    a, b = (int(x) for x in layout.token_chars[pos])
    if parts and parts[-1][0] == piece:
      parts[-1] = (piece, parts[-1][1], b)
    else:
      parts.append((piece, a, b))
  return " ".join(layout.pieces[p][a:b].strip() for p, a, b in parts).strip()


# ----------------------------------------------------------------------------------------------
# The stage-1 -> stage-2 hand-off


def paragraph_scores(layout: Layout, slot_scores: Sequence[float], num_paragraphs: int
                     ) -> np.ndarray:
  """float64 [num_paragraphs]: each context paragraph's stage-1 score, from the scores of the
  row's [p] slots (`layout.paragraphs` maps slot -> paragraph); -inf for a paragraph the row
  did not read (truncated away)."""
  out = np.full(num_paragraphs, -np.inf)
  for slot, (index, _) in enumerate(layout.paragraphs):
    out[index] = float(slot_scores[slot])
  return out


def gold_paragraphs(record: HotpotRecord) -> list[int]:
  """The indices of the paragraphs the supporting facts name, in context order: what stage 2
  reads when it is trained (stage 1's choice replaces them at evaluation)."""
  titles = record.supporting_titles
  return [i for i, (title, _) in enumerate(record.context) if title in titles]


def select_paragraphs(scores: Sequence[float], k: int = 2) -> list[int]:
  """The indices of the k best paragraphs by score (ties: the earlier paragraph), in context
  order (the order stage 2 reads them in); all of them when there are fewer than k. A -inf
  paragraph (one stage 1 did not read) is chosen only to fill k."""
  if not isinstance(k, int) or isinstance(k, bool) or k < 1:
    raise ValueError(f"k (paragraphs handed to stage 2) must be an int >= 1, got {k!r}")
  scores = np.asarray(scores, np.float64)
  order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
  return sorted(order[:k])


# ----------------------------------------------------------------------------------------------
# Batches


_ROW_FIELDS = ("input_ids", "attention_mask", "global_attention_mask", "context_mask",
               "token_sentence", "token_paragraph")
_SLOT_FIELDS = ("paragraph_positions", "paragraph_mask", "paragraph_labels",
                "sentence_positions", "sentence_mask", "sentence_labels", "answer_starts",
                "answer_ends")


def stack_layouts(layouts: Sequence[Layout]) -> dict[str, np.ndarray]:
  """The arrays of a batch, each [B, ...]: the row fields [B, N], the slot fields [B, P] / [B, S]
  / [B, A], and type_labels [B]. The layouts must share N, P, S and A (build them with the same
  max_length, max_paragraphs, max_sentences and max_answers)."""
  if not layouts:
    raise ValueError("stack_layouts needs at least one layout")
  out = {}
  for name in _ROW_FIELDS + _SLOT_FIELDS:
    shapes = {getattr(x, name).shape for x in layouts}
    if len(shapes) != 1:
      raise ValueError(f"the layouts' {name} have shapes {sorted(shapes)}: build them with the "
                       f"same max_length / max_paragraphs / max_sentences / max_answers")
    out[name] = np.stack([getattr(x, name) for x in layouts])
  out["type_labels"] = np.asarray([x.type_label for x in layouts], np.int32)
  return out
