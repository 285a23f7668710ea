"""Generated HotpotQA records (distractor setting) in the official JSON format, gold by
construction: test and demo data that can ship (HotpotQA's own is CC BY-SA and not bundled).

    >>> from longformer_jax.data import hotpotqa_generate as gen
    >>> records = gen.generate_records(200, seed=0)                # filler sentences
    >>> records = gen.generate_records(200, seed=0, source="wiki")  # bundled Wikipedia sample
    >>> gen.write_hotpotqa("train.json", records)

    python -m longformer_jax.data.hotpotqa_generate --out train.json --records 200 --seed 0

Each record asks one of three questions, in equal shares by default:
  * bridge ("Where was the director of <film> born?"): the film's paragraph names its director,
    the director's paragraph names the birthplace (the answer, a span);
  * comparison by span ("Who was born first, <A> or <B>?"): the two people's paragraphs give
    their birth years; the answer is a name;
  * comparison by yes / no ("Are <A> and <B> of the same nationality?"): their paragraphs give
    their countries; the answers alternate "yes" and "no".
The two gold paragraphs hold the key sentences at random places among filler sentences; the
other paragraphs (ten in all by default) are distractors in the same templates about other
people and films, so that the question, not the template, tells the gold ones apart. The
supporting facts are the key sentences. Filler sentences are drawn from a small word list
("filler") or cut from the bundled Wikipedia sample's text8 stream ("wiki").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Sequence
from typing import Any

from longformer_jax.io import atomic_write

__all__ = ["QUESTION_KINDS", "SOURCES", "generate_records", "main", "wiki_sentences",
           "write_hotpotqa"]

QUESTION_KINDS = ("bridge", "comparison_span", "comparison_yes_no")
SOURCES = ("filler", "wiki")

# Names are two words of two syllables each: 144 words make 20,736 names, and the whole
# vocabulary of the "filler" records stays under 400 words (a word-level tokenizer of them fits
# the tiny preset's 512 ids).
_SYLLABLES = ("ar", "bel", "cor", "dan", "el", "fen", "gar", "hal", "mor", "nel", "ros", "tor")
_YEARS = (1900, 1999)
_PLACES = (("Lyon", "France"), ("Porto", "Portugal"), ("Graz", "Austria"), ("Turin", "Italy"),
           ("Leeds", "England"), ("Bergen", "Norway"), ("Utrecht", "Netherlands"),
           ("Cork", "Ireland"), ("Krakow", "Poland"), ("Seville", "Spain"),
           ("Gothenburg", "Sweden"), ("Tampere", "Finland"), ("Aarhus", "Denmark"),
           ("Brno", "Czechia"), ("Ghent", "Belgium"), ("Basel", "Switzerland"))
_PROFESSIONS = ("painter", "composer", "novelist", "architect", "physicist", "sculptor",
                "poet", "engineer", "historian", "photographer")
_ADJECTIVES = ("Silver", "Hidden", "Northern", "Quiet", "Broken", "Golden", "Last", "Distant",
               "Crimson", "Winter")
_NOUNS = ("Harbor", "Garden", "Road", "River", "Letter", "Mirror", "Island", "Tower", "Voyage",
          "Summer")
_FILLER = ("the", "city", "river", "was", "known", "for", "its", "old", "market", "and", "a",
           "long", "history", "of", "trade", "many", "people", "visited", "during", "summer",
           "local", "school", "built", "new", "bridge", "near", "station", "small", "museum",
           "opened", "later", "region", "became", "famous", "music", "festival", "every",
           "year", "farmers", "grew", "wheat", "in", "valley", "north", "south", "road",
           "connected", "two", "villages", "after", "war", "church", "stood", "on", "hill")


def _name(rng: random.Random, used: set[str]) -> str:
  """A made-up person's name, not in `used` (added to it)."""
  while True:
    parts = [rng.choice(_SYLLABLES) + rng.choice(_SYLLABLES) for _ in range(2)]
    name = " ".join(p.capitalize() for p in parts)
    if name not in used:
      used.add(name)
      return name


def _film(rng: random.Random, used: set[str]) -> str:
  while True:
    title = f"The {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    if title not in used:
      used.add(title)
      return title


def wiki_sentences(stream: bytes, *, min_words: int = 8, max_words: int = 16,
                   limit: int = 20000, seed: int = 0) -> list[str]:
  """Sentences cut from a text8-style stream (lower-case words separated by spaces, e.g. the
  bundled sample's `corpora.sample_stream("text8_sample")`): consecutive runs of min_words to
  max_words words, capitalised and ended with a full stop, at most `limit` of them."""
  words = stream.decode("ascii").split()
  rng = random.Random(seed)
  out, i = [], 0
  while i < len(words) and len(out) < limit:
    n = rng.randint(min_words, max_words)
    chunk = words[i:i + n]
    i += n
    if len(chunk) >= min_words:
      text = " ".join(chunk)
      out.append(text[0].upper() + text[1:] + ".")
  return out


class _Filler:
  """Filler sentences: random word-list sentences, or a pool cut from the Wikipedia sample."""

  def __init__(self, rng: random.Random, source: str):
    self.rng = rng
    self.pool: list[str] | None = None
    if source == "wiki":
      from longformer_jax.data import corpora
      self.pool = wiki_sentences(corpora.sample_stream("text8_sample"))

  def __call__(self) -> str:
    if self.pool is not None:
      return self.rng.choice(self.pool)
    words = [self.rng.choice(_FILLER) for _ in range(self.rng.randint(6, 12))]
    return " ".join(words).capitalize() + "."


def _paragraph(rng: random.Random, filler: _Filler, key: str, size: int) -> tuple[list[str], int]:
  """`size` sentences with `key` at a random place among filler; (sentences, key's index)."""
  at = rng.randrange(size)
  sentences = [key if i == at else filler() for i in range(size)]
  return sentences, at


def generate_records(n: int, *, seed: int = 0, source: str = "filler",
                     num_paragraphs: int = 10, sentences: tuple[int, int] = (3, 5),
                     kinds: Sequence[str] = QUESTION_KINDS) -> list[dict[str, Any]]:
  """`n` HotpotQA records (dicts in the official format), the same for the same arguments.

  source: "filler" or "wiki" (see the module docstring). num_paragraphs: per record (>= 2: the
  two gold ones and distractors). sentences: (fewest, most) sentences per paragraph.
  kinds: the question kinds drawn from, in turn (QUESTION_KINDS).
  """
  if not isinstance(n, int) or isinstance(n, bool) or n < 1:
    raise ValueError(f"n (records) must be an int >= 1, got {n!r}")
  if source not in SOURCES:
    raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
  if not isinstance(num_paragraphs, int) or num_paragraphs < 2:
    raise ValueError(f"num_paragraphs must be an int >= 2 (two gold paragraphs), got "
                     f"{num_paragraphs!r}")
  if not (len(sentences) == 2 and 1 <= sentences[0] <= sentences[1]):
    raise ValueError(f"sentences must be (fewest, most) with 1 <= fewest <= most, got "
                     f"{sentences!r}")
  unknown = [k for k in kinds if k not in QUESTION_KINDS]
  if not kinds or unknown:
    raise ValueError(f"kinds must be a non-empty selection of {QUESTION_KINDS}, got "
                     f"{list(kinds)!r}")
  rng = random.Random(seed)
  filler = _Filler(rng, source)
  records, closed = [], 0
  for i in range(n):
    kind = kinds[i % len(kinds)]
    used: set[str] = set()
    size = lambda: rng.randint(*sentences)

    def person(name: str, place=None, year=None):
      place = place or rng.choice(_PLACES)
      year = year or rng.randint(*_YEARS)
      city, country = place
      key = f"{name} (born {year} in {city}, {country}) was a {rng.choice(_PROFESSIONS)}."
      return (name, *_paragraph(rng, filler, key, size())), place, year

    gold: list[tuple[str, list[str], int]] = []
    if kind == "bridge":
      film, director = _film(rng, used), _name(rng, used)
      key = f"{film} is a {rng.randint(*_YEARS)} film directed by {director}."
      gold.append((film, *_paragraph(rng, filler, key, size())))
      (p, place, _) = person(director)
      gold.append(p)
      question = f"Where was the director of {film} born?"
      answer = place[0]
    elif kind == "comparison_span":
      a, b = _name(rng, used), _name(rng, used)
      year_a = rng.randint(*_YEARS)
      year_b = rng.choice([y for y in range(_YEARS[0], _YEARS[1] + 1) if y != year_a])
      (pa, _, _), (pb, _, _) = person(a, year=year_a), person(b, year=year_b)
      gold += [pa, pb]
      question = f"Who was born first, {a} or {b}?"
      answer = a if year_a < year_b else b
    else:
      a, b = _name(rng, used), _name(rng, used)
      place_a = rng.choice(_PLACES)
      # Alternate yes and no: balanced classes whatever n (a run of one answer would let the
      # most frequent answer look like a model).
      same = closed % 2 == 0
      closed += 1
      place_b = (rng.choice([p for p in _PLACES if p[1] == place_a[1]]) if same else
                 rng.choice([p for p in _PLACES if p[1] != place_a[1]]))
      (pa, _, _), (pb, _, _) = person(a, place=place_a), person(b, place=place_b)
      gold += [pa, pb]
      question = f"Are {a} and {b} of the same nationality?"
      answer = "yes" if same else "no"
    paragraphs = [(title, sents) for title, sents, _ in gold]
    while len(paragraphs) < num_paragraphs:
      if rng.random() < 0.3:
        film = _film(rng, used)
        key = f"{film} is a {rng.randint(*_YEARS)} film directed by {_name(rng, used)}."
        paragraphs.append((film, _paragraph(rng, filler, key, size())[0]))
      else:
        (title, sents, _), _, _ = person(_name(rng, used))
        paragraphs.append((title, sents))
    rng.shuffle(paragraphs)
    records.append({
        "_id": f"{rng.getrandbits(96):024x}",
        "question": question,
        "answer": answer,
        "supporting_facts": [[title, at] for title, _, at in gold],
        "context": [[title, sents] for title, sents in paragraphs],
        "type": "bridge" if kind == "bridge" else "comparison",
        "level": "medium",
    })
  return records


def write_hotpotqa(path: str | os.PathLike, records: Sequence[dict[str, Any]]) -> None:
  """Writes records as HotpotQA's JSON list (atomically)."""
  atomic_write(path, json.dumps(list(records), ensure_ascii=False) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m longformer_jax.data.hotpotqa_generate",
      description="Writes generated HotpotQA records (distractor setting, official JSON).")
  parser.add_argument("--out", required=True, help="the JSON file to write")
  parser.add_argument("--records", type=int, default=200, help="how many records (default 200)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--source", choices=SOURCES, default="filler",
                      help="filler sentences: a word list, or the bundled Wikipedia sample")
  parser.add_argument("--paragraphs", type=int, default=10, help="per record (default 10)")
  args = parser.parse_args(argv)
  try:
    records = generate_records(args.records, seed=args.seed, source=args.source,
                               num_paragraphs=args.paragraphs)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  try:
    write_hotpotqa(args.out, records)
  except OSError as e:
    print(f"error: cannot write {args.out}: {e}", file=sys.stderr)
    return 1
  print(f"wrote {len(records)} records to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
