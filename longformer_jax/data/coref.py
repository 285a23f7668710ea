"""Coreference data: CoNLL-2012 files and the jsonlines of Joshi et al. (2019), read into one
small frozen `CorefDocument` per document.

    >>> from longformer_jax.data import coref
    >>> docs = coref.read_conll("dev.english.v4_gold_conll")      # words
    >>> docs = coref.read_jsonlines("dev.english.384.jsonlines")  # subtokens, [CLS]/[SEP] kept

CoNLL-2012 (`read_conll`): a document runs from `#begin document (KEY); part NNN` to
`#end document`; one token per line, whitespace-separated columns, the word in column 4 and the
coreference in the last column; a blank line ends a sentence. The coreference column is `-` or
parts joined by `|`: `(12` opens a mention of entity 12 at this token, `12)` closes the most
recently opened mention of 12, `(12)` is a one-token mention; mentions nest, and an entity's
mentions may nest in each other. Lines of 12 or more columns are CoNLL-2012's full layout, whose
column 10 is the speaker. Other lines starting with `#` are comments. The document's key is
`KEY_N` for part N (Joshi et al.'s key: `bc/cctv/00/cctv_0000_0`), its genre the key's first two
letters. Words are kept as the file spells them (OntoNotes' `/.` and `/?` included).

Joshi et al.'s jsonlines (`read_jsonlines`): one JSON object per line with `doc_key`,
`sentences` (the document's subtokens in segments, each a list of strings, `[CLS]` and `[SEP]`
included), `clusters` (lists of [start, end] subtoken spans, end inclusive, over the flattened
segments), `sentence_map` and `subtoken_map` (per subtoken, its sentence and its word), and
optionally `speakers` (the shape of `sentences`); other fields are ignored.

Breaches raise ValueError naming the file and line (`CoNLLError`, or the JSONL reader's
`JsonlError`, which also names the field) and what was expected.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from longformer_jax.data import text

Span = tuple[int, int]

__all__ = ["CoNLLError", "CorefDocument", "read_conll", "read_jsonlines"]


@dataclasses.dataclass(frozen=True)
class CorefDocument:
  """One coreference document.

  Attributes:
    doc_key: the document's key (`bc/cctv/00/cctv_0000_0`); `genre` is its first two letters.
    tokens: its words (CoNLL) or subtokens (jsonlines, segment markers included).
    sentence_ids: the sentence of each token (0-based, non-decreasing).
    speakers: the speaker of each token, or None when the file gives none.
    clusters: the gold clusters, each a tuple of (start, end) token spans (end inclusive),
      mentions sorted, clusters ordered by their first mention.
    word_ids: jsonlines only, the word of each subtoken (`subtoken_map`); None for CoNLL.
    segment_lengths: jsonlines only, the length of each segment of `sentences`; None for CoNLL.
    source: where it was read, "file:line" (its first line).
  """

  doc_key: str
  tokens: tuple[str, ...]
  sentence_ids: tuple[int, ...]
  speakers: tuple[str, ...] | None
  clusters: tuple[tuple[Span, ...], ...]
  word_ids: tuple[int, ...] | None = None
  segment_lengths: tuple[int, ...] | None = None
  source: str = ""

  @property
  def genre(self) -> str:
    return self.doc_key[:2]


class CoNLLError(ValueError):
  """A CoNLL file breaks the format: `path` and `line` (1-based; None for the whole file) say
  where."""

  def __init__(self, path: str, line: int | None, problem: str):
    self.path, self.line, self.problem = path, line, problem
    super().__init__(f"{path if line is None else f'{path}:{line}'}: {problem}")


def _sorted_clusters(clusters) -> tuple[tuple[Span, ...], ...]:
  return tuple(sorted(tuple(sorted(set(c))) for c in clusters if c))


# ----------------------------------------------------------------------------------------------
# CoNLL-2012

_BEGIN = re.compile(r"#begin document \((.*)\);\s*part\s+(\d+)\s*$")
_PART = re.compile(r"(\()?(\d+)(\))?$")


def _coref_parts(column: str, path: str, line: int) -> list[tuple[bool, int, bool]]:
  """The (opens, entity, closes) parts of a coreference column ("-" has none)."""
  if column == "-":
    return []
  parts = []
  for piece in column.split("|"):
    match = _PART.match(piece)
    if not match or not (match.group(1) or match.group(3)):
      raise CoNLLError(path, line, f"coreference column {column!r}: expected '-' or parts like "
                       f"'(12', '12)' or '(12)' joined by '|', got part {piece!r}")
    parts.append((bool(match.group(1)), int(match.group(2)), bool(match.group(3))))
  return parts


class _ConllDoc:
  """A document being read."""

  def __init__(self, key: str, line: int):
    self.key, self.line = key, line
    self.tokens: list[str] = []
    self.sentence_ids: list[int] = []
    self.speakers: list[str] | None = None
    self.columns: int | None = None
    self.sentence = 0
    self.in_sentence = False
    self.open: dict[int, list[tuple[int, int]]] = {}  # entity -> stack of (start, line)
    self.clusters: dict[int, list[Span]] = {}


def read_conll(path: str | os.PathLike) -> list[CorefDocument]:
  """The documents of a CoNLL-2012 file (the module docstring's rules).

  Raises:
    FileNotFoundError: no such file.
    CoNLLError: the file breaks a rule (file and line named): a token outside a document,
      nested or unclosed `#begin document`, a line with too few columns or a column count that
      changes within a document, a malformed coreference column, a mention closed that was never
      opened or left open at `#end document`, a key repeated, or no document at all.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such file")
  documents: list[CorefDocument] = []
  keys: dict[str, int] = {}
  doc: _ConllDoc | None = None
  with open(path, encoding="utf-8") as f:
    for number, raw in enumerate(f, start=1):
      line = raw.strip()
      if line.startswith("#begin document"):
        match = _BEGIN.match(line)
        if not match:
          raise CoNLLError(path, number, f"expected '#begin document (KEY); part N', got "
                           f"{line[:80]!r}")
        if doc is not None:
          raise CoNLLError(path, number, f"'#begin document' inside document {doc.key!r} "
                           f"(begun on line {doc.line}): expected '#end document' first")
        key = f"{match.group(1)}_{int(match.group(2))}"
        if key in keys:
          raise CoNLLError(path, number, f"document {key!r} repeats the one of line {keys[key]}")
        keys[key] = number
        doc = _ConllDoc(key, number)
      elif line.startswith("#end document"):
        if doc is None:
          raise CoNLLError(path, number, "'#end document' outside a document: expected "
                           "'#begin document' first")
        documents.append(_finish(doc, path, number))
        doc = None
      elif line.startswith("#"):
        continue
      elif not line:
        if doc is not None and doc.in_sentence:
          doc.sentence += 1
          doc.in_sentence = False
      else:
        if doc is None:
          raise CoNLLError(path, number, "a token line outside a document: expected "
                           "'#begin document (KEY); part N' before it")
        _token(doc, line.split(), path, number)
  if doc is not None:
    raise CoNLLError(path, None, f"document {doc.key!r} (begun on line {doc.line}) has no "
                     f"'#end document'")
  if not documents:
    raise CoNLLError(path, None, "holds no document (expected '#begin document' lines)")
  return documents


def _token(doc: _ConllDoc, columns: list[str], path: str, number: int) -> None:
  if len(columns) < 5:
    raise CoNLLError(path, number, f"expected at least 5 columns (document, part, word number, "
                     f"word, ..., coreference), got {len(columns)}")
  if doc.columns is None:
    doc.columns = len(columns)
    doc.speakers = [] if len(columns) >= 12 else None
  elif len(columns) != doc.columns:
    raise CoNLLError(path, number, f"expected {doc.columns} columns like the document's first "
                     f"token line, got {len(columns)}")
  position = len(doc.tokens)
  for opens, entity, closes in _coref_parts(columns[-1], path, number):
    if opens and closes:
      doc.clusters.setdefault(entity, []).append((position, position))
    elif opens:
      doc.open.setdefault(entity, []).append((position, number))
    else:
      if not doc.open.get(entity):
        raise CoNLLError(path, number, f"coreference {entity}) closes a mention of entity "
                         f"{entity} that no earlier '({entity}' opened")
      start, _ = doc.open[entity].pop()
      doc.clusters.setdefault(entity, []).append((start, position))
  doc.tokens.append(columns[3])
  doc.sentence_ids.append(doc.sentence)
  doc.in_sentence = True
  if doc.speakers is not None:
    doc.speakers.append(columns[9])


def _finish(doc: _ConllDoc, path: str, number: int) -> CorefDocument:
  left = [(line, entity) for entity, stack in doc.open.items() for _, line in stack]
  if left:
    line, entity = min(left)
    raise CoNLLError(path, line, f"mention '({entity}' of document {doc.key!r} is never closed "
                     f"(expected '{entity})' before '#end document' on line {number})")
  if not doc.tokens:
    raise CoNLLError(path, doc.line, f"document {doc.key!r} has no token lines")
  return CorefDocument(
      doc_key=doc.key, tokens=tuple(doc.tokens), sentence_ids=tuple(doc.sentence_ids),
      speakers=None if doc.speakers is None else tuple(doc.speakers),
      clusters=_sorted_clusters(doc.clusters.values()), source=f"{path}:{doc.line}")


# ----------------------------------------------------------------------------------------------
# Joshi et al.'s jsonlines

_SCHEMA = {"doc_key": str, "sentences": list, "clusters": list, "sentence_map": list,
           "subtoken_map": list}


def _int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def read_jsonlines(path: str | os.PathLike) -> list[CorefDocument]:
  """The documents of a jsonlines file of Joshi et al. (the module docstring's layout), one per
  line, tokens the subtokens of `sentences` flattened (segment markers included).

  Raises:
    FileNotFoundError: no such file.
    text.JsonlError (a ValueError): a line breaks the layout (file, line and field named): a
      field missing or of the wrong type, `sentences` not lists of strings, `speakers` not of
      its shape, `sentence_map` / `subtoken_map` not one non-decreasing int >= 0 per subtoken,
      a cluster mention not a [start, end] pair within the document, a mention in two clusters,
      or a `doc_key` repeated.
  """
  path = os.fspath(path)
  records = text.read_jsonl(path, _SCHEMA, optional={"speakers": list}, unique=("doc_key",))
  return [_jsonlines_document(path, r.line, r.fields) for r in records]


def _jsonlines_document(path: str, line: int, fields: dict[str, Any]) -> CorefDocument:
  def error(field, problem):
    return text.JsonlError(path, line, field, problem)

  segments = fields["sentences"]
  for i, segment in enumerate(segments):
    if not isinstance(segment, list) or not segment or not all(
        isinstance(t, str) for t in segment):
      raise error("sentences", f"segment {i} must be a non-empty list of subtoken strings")
  tokens = tuple(t for segment in segments for t in segment)
  if not tokens:
    raise error("sentences", "holds no subtoken")
  speakers = None
  if "speakers" in fields:
    speakers = fields["speakers"]
    if len(speakers) != len(segments) or any(
        not isinstance(s, list) or len(s) != len(seg) or not all(isinstance(x, str) for x in s)
        for s, seg in zip(speakers, segments)):
      raise error("speakers", f"must have the shape of 'sentences' (a string per subtoken in "
                  f"{len(segments)} segments of lengths {[len(s) for s in segments][:10]})")
    speakers = tuple(x for s in speakers for x in s)
  maps = {}
  for name in ("sentence_map", "subtoken_map"):
    values = fields[name]
    if (len(values) != len(tokens) or not all(_int(v) and v >= 0 for v in values)
        or any(b < a for a, b in zip(values, values[1:]))):
      raise error(name, f"must hold one int >= 0 per subtoken ({len(tokens)}), never "
                  f"decreasing, got {len(values)} values starting {values[:8]!r}")
    maps[name] = tuple(values)
  seen: dict[Span, int] = {}
  clusters = []
  for c, cluster in enumerate(fields["clusters"]):
    if not isinstance(cluster, list) or not cluster:
      raise error("clusters", f"cluster {c} must be a non-empty list of [start, end] spans")
    spans = []
    for m, span in enumerate(cluster):
      if (not isinstance(span, list) or len(span) != 2 or not all(_int(x) for x in span)
          or not 0 <= span[0] <= span[1] < len(tokens)):
        raise error("clusters", f"cluster {c} mention {m} must be [start, end] with 0 <= start "
                    f"<= end < {len(tokens)} (subtokens, end inclusive), got {span!r}"[:300])
      mention = (span[0], span[1])
      if mention in seen:
        raise error("clusters", f"cluster {c} mention {m} {list(mention)} is also in cluster "
                    f"{seen[mention]} (a mention belongs to one cluster)")
      seen[mention] = c
      spans.append(mention)
    clusters.append(spans)
  return CorefDocument(
      doc_key=fields["doc_key"], tokens=tokens, sentence_ids=maps["sentence_map"],
      speakers=speakers, clusters=_sorted_clusters(clusters), word_ids=maps["subtoken_map"],
      segment_lengths=tuple(len(s) for s in segments), source=f"{path}:{line}")
