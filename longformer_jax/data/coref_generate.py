"""Generated coreference documents, gold by construction, in the real formats: CoNLL-2012 files and
the jsonlines of Joshi et al. (2019), which `data.coref`'s readers read back. Test data that can
ship: OntoNotes is licensed.

    >>> from longformer_jax.data import coref_generate
    >>> docs = coref_generate.generate_documents(8, seed=0, num_words=2048)
    >>> coref_generate.write_conll("dev.english.v4_gold_conll", docs)
    >>> coref_generate.write_jsonlines("dev.english.512.jsonlines", docs, segment_length=512)

A document is filler text (the words of the bundled Wikipedia sample, `text8_sample`, from a
random offset, or a fixed list of filler words) cut into sentences of 8 to 24 words ending in
".", with `num_entities` made-up people woven in. Each person has a two-word name
(`Alba Korvin`) and a role (`engineer`) unique in its document. The first mention is the full
name followed by the appositive ", the engineer ," (the appositive is context, not a mention, as
in OntoNotes); later mentions are the full name, the surname, or "the engineer" (a mention
resolved only through the first mention's context). A person is mentioned 2 to
`max_mentions` times; consecutive mentions of one person are at least `min_gap` filler words
apart (beyond a local attention window), so with documents longer than a segment most links
cross segment boundaries (`link_stats` counts them). Mentions never overlap; there are no
singletons (OntoNotes' convention). Speakers alternate in blocks of sentences; the genre is the
document key's first two letters.

Everything is drawn from `numpy.random.default_rng(seed)`: one seed, one corpus.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from longformer_jax.data.coref import CorefDocument
from longformer_jax.io import atomic_write

__all__ = [
    "FILLER", "ROLES", "SOURCES", "conll_text", "generate_documents", "jsonlines_record",
    "link_stats", "write_conll", "write_corpus", "write_jsonlines",
]

SOURCES = ("text8_sample", "filler")
ROLES = ("engineer", "painter", "senator", "chemist", "pilot", "farmer", "banker", "sailor",
         "teacher", "doctor", "poet", "judge", "miner", "baker", "tailor", "mayor", "monk",
         "actor", "nurse", "singer", "lawyer", "builder", "cook", "weaver")
FILLER = ("the", "of", "and", "in", "a", "to", "was", "is", "for", "as", "on", "with", "by",
          "river", "city", "north", "old", "new", "small", "great", "year", "later", "early",
          "land", "road", "hill", "market", "church", "bridge", "village", "winter", "summer",
          "trade", "coast", "valley", "built", "known", "found", "near", "after", "before",
          "many", "some", "long", "first", "second", "part", "stone", "field", "house")
_SYLLABLES = ("al", "ba", "kor", "vin", "mel", "to", "ran", "dis", "sa", "len", "mor", "ta",
              "bri", "gan", "ves", "lo", "nor", "ith", "cal", "den", "fa", "rel", "qui", "zo")
_SPEAKERS = ("Speaker#1", "Speaker#2")


@functools.cache
def _sample_words() -> tuple[str, ...]:
  from longformer_jax.data import corpora  # the bundled sample, decompressed when asked for
  return tuple(corpora.sample_stream("text8_sample").decode("ascii").split())


def _filler(rng: np.random.Generator, source: str, num_words: int) -> list[str]:
  """num_words filler words: a random stretch of the Wikipedia sample, or draws from FILLER."""
  if source == "filler":
    return [str(w) for w in rng.choice(FILLER, num_words)]
  words = _sample_words()
  start = int(rng.integers(0, max(1, len(words) - num_words)))
  return [words[(start + i) % len(words)] for i in range(num_words)]


def _names(rng: np.random.Generator, count: int) -> list[tuple[str, str]]:
  """`count` distinct (first, last) names of 2 or 3 syllables each, surnames distinct too."""
  names, surnames = [], set()
  while len(names) < count:
    first, last = ("".join(rng.choice(_SYLLABLES, int(rng.integers(2, 4)))).capitalize()
                   for _ in range(2))
    if last not in surnames and first != last:
      surnames.add(last)
      names.append((first, last))
  return names


def _check_int(name: str, value, low: int) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < low:
    raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def generate_documents(num_documents: int, *, seed: int = 0, num_words: int = 2048,
                       num_entities: int = 6, max_mentions: int = 5, min_gap: int = 300,
                       source: str = "filler", genre: str = "nw",
                       key_prefix: str = "generated") -> list[CorefDocument]:
  """`num_documents` documents as the module docstring describes them, word-level (CoNLL's
  view: `CorefDocument` with `word_ids` and `segment_lengths` None), keys
  `{genre}/{key_prefix}/00/{key_prefix}_{i:04d}_0`.

  Args:
    num_words: filler words per document (mentions and appositives come on top).
    num_entities: people per document (at most len(ROLES)).
    max_mentions: the most mentions of one person (at least 2 each).
    min_gap: the fewest filler words between consecutive mentions of one person.
    source: "filler" (a fixed word list) or "text8_sample" (the bundled Wikipedia text).
    genre: two letters, the key's first (OntoNotes': bc, bn, mz, nw, pt, tc, wb).

  Raises:
    ValueError: a count out of range, an unknown source, a genre not two lowercase letters, or
      documents too short for the mentions asked for (num_words must hold every person's
      mentions min_gap apart).
  """
  _check_int("num_documents", num_documents, 1)
  _check_int("num_entities", num_entities, 1)
  _check_int("max_mentions", max_mentions, 2)
  _check_int("min_gap", min_gap, 1)
  _check_int("num_words", num_words, 1)
  _check_int("seed", seed, 0)
  if num_entities > len(ROLES):
    raise ValueError(f"num_entities must be at most {len(ROLES)} (one role each), got "
                     f"{num_entities}")
  if not (len(genre) == 2 and genre.isalpha() and genre.islower()):
    raise ValueError(f"genre must be two lowercase letters (as 'nw'), got {genre!r}")
  if num_words <= min_gap * (max_mentions - 1) + 1:
    raise ValueError(f"num_words={num_words} cannot hold {max_mentions} mentions {min_gap} "
                     f"words apart: need more than {min_gap * (max_mentions - 1) + 1}")
  if source not in SOURCES:
    raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
  rng = np.random.default_rng(seed)
  return [_document(rng, source, f"{genre}/{key_prefix}/00/{key_prefix}_{i:04d}_0",
                    num_words, num_entities, max_mentions, min_gap)
          for i in range(num_documents)]


def _document(rng, source, key, num_words, num_entities, max_mentions, min_gap
              ) -> CorefDocument:
  filler = _filler(rng, source, num_words)
  # Insertion points: before filler word p. Each person's points are min_gap apart.
  taken: set[int] = set()
  people = []
  names = _names(rng, num_entities)
  roles = rng.choice(len(ROLES), num_entities, replace=False)
  for e in range(num_entities):
    count = int(rng.integers(2, max_mentions + 1))
    for _ in range(100):  # a few redraws keep points of different people apart
      first = int(rng.integers(0, num_words - min_gap * (count - 1)))
      spare = num_words - first - min_gap * (count - 1)
      extra = np.sort(rng.integers(0, spare, count - 1))
      points = [first] + [first + min_gap * (k + 1) + int(extra[k]) for k in range(count - 1)]
      if not taken.intersection(points):
        break
    else:
      continue  # too crowded: this person is left out
    taken.update(points)
    people.append((names[e], ROLES[roles[e]], points))
  inserts: dict[int, tuple[int, list[str], int]] = {}  # point -> (person, words, mention length)
  for person, ((first_name, last_name), role, points) in enumerate(people):
    for k, point in enumerate(points):
      if k == 0:
        mention, context = [first_name, last_name], [",", "the", role, ","]
      else:
        form = int(rng.integers(0, 3))
        mention = [[first_name, last_name], [last_name], ["the", role]][form]
        context = []
      inserts[point] = (person, mention + context, len(mention))
  # Assemble: sentences of 8 to 24 filler words, mentions inserted before their filler word.
  tokens: list[str] = []
  sentence_ids: list[int] = []
  speakers: list[str] = []
  clusters: list[list[tuple[int, int]]] = [[] for _ in people]
  sentence, left, speaker, block = 0, int(rng.integers(8, 25)), 0, int(rng.integers(2, 6))

  def add(word):
    tokens.append(word)
    sentence_ids.append(sentence)
    speakers.append(_SPEAKERS[speaker])

  for p, word in enumerate(filler):
    if p in inserts:
      person, inserted, length = inserts[p]
      clusters[person].append((len(tokens), len(tokens) + length - 1))
      for w in inserted:
        add(w)
    add(word)
    left -= 1
    if left == 0 or p == num_words - 1:
      add(".")
      sentence += 1
      left = int(rng.integers(8, 25))
      block -= 1
      if block == 0:
        speaker, block = 1 - speaker, int(rng.integers(2, 6))
  return CorefDocument(
      doc_key=key, tokens=tuple(tokens), sentence_ids=tuple(sentence_ids),
      speakers=tuple(speakers),
      clusters=tuple(sorted(tuple(c) for c in clusters if len(c) > 1)))


def link_stats(document: CorefDocument, *, segment_length: int = 512, window: int = 256
               ) -> dict[str, int]:
  """The document's links (each mention to the previous one of its cluster): how many there
  are, how many span more than `window` tokens (start to start), and how many join tokens of
  different `segment_length`-token segments (in `document.tokens` positions)."""
  links = far = crossing = 0
  for cluster in document.clusters:
    for (s0, _), (s1, _) in zip(cluster, cluster[1:]):
      links += 1
      far += s1 - s0 > window
      crossing += s0 // segment_length != s1 // segment_length
  return {"links": links, "beyond_window": far, "crossing_segments": crossing}


# ----------------------------------------------------------------------------------------------
# CoNLL-2012


def _coref_column(clusters: Sequence[Sequence[tuple[int, int]]], n: int) -> list[str]:
  parts: list[list[str]] = [[] for _ in range(n)]
  # Openings in order of decreasing length and closings of increasing length, so that nested
  # mentions of one entity close in the right order (the generator's never nest).
  spans = sorted(((s, e, c) for c, cluster in enumerate(clusters) for s, e in cluster),
                 key=lambda m: (m[0], -m[1]))
  for s, e, c in spans:
    if s == e:
      parts[s].append(f"({c})")
    else:
      parts[s].append(f"({c}")
  for s, e, c in sorted(spans, key=lambda m: (m[1], -m[0])):
    if s != e:
      parts[e].append(f"{c})")
  return ["|".join(p) if p else "-" for p in parts]


def _split_key(doc_key: str) -> tuple[str, int]:
  base, _, part = doc_key.rpartition("_")
  if not base or not part.isdigit():
    raise ValueError(f"doc_key {doc_key!r} must end in '_N' (the part number), as "
                     f"'nw/generated/00/generated_0000_0'")
  return base, int(part)


def conll_text(documents: Sequence[CorefDocument]) -> str:
  """The documents in CoNLL-2012's 12-column layout (document, part, word number, word, POS,
  parse, lemma, frameset, sense, speaker, named entities, coreference), sentences separated by
  blank lines, each document between `#begin document (KEY); part NNN` and `#end document`.
  Keys are `doc_key` less its `_N` part suffix. Words must hold no whitespace."""
  lines = []
  for doc in documents:
    base, part = _split_key(doc.doc_key)
    if any(not w or any(ch.isspace() for ch in w) for w in doc.tokens):
      raise ValueError(f"document {doc.doc_key!r}: a CoNLL word must be non-empty and hold no "
                       f"whitespace")
    coref = _coref_column(doc.clusters, len(doc.tokens))
    lines.append(f"#begin document ({base}); part {part:03d}")
    number = 0
    for i, word in enumerate(doc.tokens):
      if i and doc.sentence_ids[i] != doc.sentence_ids[i - 1]:
        lines.append("")
        number = 0
      speaker = doc.speakers[i] if doc.speakers is not None else "-"
      lines.append(f"{base}  {part}  {number}  {word}  XX  *  -  -  -  {speaker}  *  {coref[i]}")
      number += 1
    lines += ["", "#end document"]
  return "\n".join(lines) + "\n"


def write_conll(path: str | os.PathLike, documents: Sequence[CorefDocument]) -> None:
  """`conll_text(documents)` written atomically to `path`."""
  atomic_write(path, conll_text(documents))


# ----------------------------------------------------------------------------------------------
# Joshi et al.'s jsonlines


def jsonlines_record(document: CorefDocument, *, segment_length: int = 512,
                     subtokenize: Callable[[str], Sequence[str]] | None = None,
                     cls: str = "[CLS]", sep: str = "[SEP]") -> dict:
  """One word-level document as a jsonlines record of Joshi et al.: its words split into
  subtokens by `subtokenize` (default: each word one subtoken), cut into segments of at most
  `segment_length` subtokens with `cls` and `sep` included, at a sentence end when one fits,
  else at a word end; `clusters` in subtokens of the flattened segments (a mention from its
  first word's first subtoken to its last word's last one); `sentence_map` / `subtoken_map` per
  subtoken (a marker takes its segment's first or last subtoken's); `speakers` "[SPL]" at the
  markers (Joshi et al.'s filler)."""
  _check_int("segment_length", segment_length, 3)
  pieces = [list(subtokenize(w)) if subtokenize else [w] for w in document.tokens]
  for w, p in zip(document.tokens, pieces):
    if not p or not all(isinstance(s, str) and s for s in p):
      raise ValueError(f"subtokenize({w!r}) must give non-empty strings, got {p!r}")
  # Subtokens in document order: (word, sentence, piece).
  flat = [(i, document.sentence_ids[i], s) for i, p in enumerate(pieces) for s in p]
  capacity = segment_length - 2
  segments, start = [], 0
  while start < len(flat):
    end = min(start + capacity, len(flat))
    if end < len(flat):
      sentence_ends = [j for j in range(start + 1, end + 1) if flat[j][1] != flat[j - 1][1]]
      word_ends = [j for j in range(start + 1, end + 1) if flat[j][0] != flat[j - 1][0]]
      end = (sentence_ends or word_ends or [end])[-1]
    segments.append((start, end))
    start = end
  sentences, speakers, sentence_map, subtoken_map = [], [], [], []
  first_of_word, last_of_word = {}, {}
  position = 0
  for start, end in segments:
    chunk = flat[start:end]
    sentences.append([cls] + [s for _, _, s in chunk] + [sep])
    speakers.append(["[SPL]"] + [document.speakers[w] if document.speakers else "-"
                                 for w, _, _ in chunk] + ["[SPL]"])
    sentence_map += [chunk[0][1]] + [s for _, s, _ in chunk] + [chunk[-1][1]]
    subtoken_map += [chunk[0][0]] + [w for w, _, _ in chunk] + [chunk[-1][0]]
    for k, (w, _, _) in enumerate(chunk):
      first_of_word.setdefault(w, position + 1 + k)
      last_of_word[w] = position + 1 + k
    position += len(chunk) + 2
  clusters = [[[first_of_word[s], last_of_word[e]] for s, e in cluster]
              for cluster in document.clusters]
  return {"doc_key": document.doc_key, "sentences": sentences, "speakers": speakers,
          "clusters": clusters, "sentence_map": sentence_map, "subtoken_map": subtoken_map}


def write_jsonlines(path: str | os.PathLike, documents: Sequence[CorefDocument], **kwargs
                    ) -> None:
  """The documents' `jsonlines_record(document, **kwargs)`, one JSON object a line, written
  atomically to `path`."""
  atomic_write(path, "".join(json.dumps(jsonlines_record(d, **kwargs)) + "\n"
                             for d in documents))


def write_corpus(directory: str | os.PathLike, num_documents: Mapping[str, int], *,
                 seed: int = 0, segment_length: int = 512, **generate_kwargs) -> dict[str, dict]:
  """A generated corpus in both formats: per split (`{"train": 32, "dev": 8}`),
  `{split}.english.v4_gold_conll` and `{split}.english.{segment_length}.jsonlines` in
  `directory` (created if missing), each split from its own seed (seed + its position), keys
  prefixed by the split. Returns the paths written, by split and format."""
  os.makedirs(directory, exist_ok=True)
  written = {}
  for k, (split, count) in enumerate(num_documents.items()):
    docs = generate_documents(count, seed=seed + k, key_prefix=split, **generate_kwargs)
    conll = os.path.join(directory, f"{split}.english.v4_gold_conll")
    jsonl = os.path.join(directory, f"{split}.english.{segment_length}.jsonlines")
    write_conll(conll, docs)
    write_jsonlines(jsonl, docs, segment_length=segment_length)
    written[split] = {"conll": conll, "jsonlines": jsonl}
  return written
