"""Matt Mahoney's Wikipedia text filter (the one that made text8), in Python.

`wikifil(xml)` turns a MediaWiki XML dump into lowercase letters a-z and single spaces, byte for
byte what Mahoney's Perl filter `wikifil.pl` (2006, public domain, described at
http://mattmahoney.net/dc/textdata.html) prints for the same input. text8 is the first 10^8 bytes
of that filter's output on enwik9.

How the Perl program sees its input, and therefore how this one must:

- The input is cut into records that END at each `>` byte (Perl's `$/ = ">"`), so an XML tag
  always closes its record and article text runs from one tag to the next.
- A record containing `<text ` switches text mode on; a record containing `#redirect` (any case,
  anywhere in the record) switches it off before the record is looked at, so a redirect page is
  dropped whole. In text mode a record containing `</text>` is still printed, then text mode ends.
- Every printed record goes through the same substitutions, each record on its own (a `[[...]]`
  link cut by a `>` is therefore not recognised), and is framed with spaces; after the
  letter-only pass the trailing space is removed, so records join with exactly one space between
  words and the output starts with a space.
- The input is bytes, not text: only ASCII letters change case, `\\d` means 0-9, `.` stops at
  `\\n`, and every other byte (UTF-8 included) just becomes a space.
"""

from __future__ import annotations

import re

__all__ = ["wikifil"]

_TEXT_START = b"<text "
_TEXT_END = b"</text>"
_REDIRECT = re.compile(rb"#redirect", re.IGNORECASE)

# `s/<.*>//` (once per record, not /g): drops from the first `<` that has a `>` later on its line
# to the last `>` of that line, i.e. the tag that ends the record.
_FIRST_TAG = re.compile(rb"<.*>")

# The substitutions applied in order to every record in text mode. Order matters: entities are
# decoded before markup is stripped (article text stores `<ref>` as `&lt;ref&gt;`), and link and
# template rules see brackets that later rules delete.
_ENTITIES = ((b"&amp;", b"&"), (b"&lt;", b"<"), (b"&gt;", b">"))
_MARKUP: tuple[tuple[re.Pattern[bytes], bytes], ...] = tuple(
    (re.compile(pattern, flags), replacement)
    for pattern, flags, replacement in (
        (rb"<ref[^<]*</ref>", 0, b""),  # references <ref ...> ... </ref>
        (rb"<[^>]*>", 0, b""),  # remaining (x)html tags
        (rb"\[http:[^\] ]*", 0, b"["),  # external link target; its visible text stays
        (rb"\|thumb", re.IGNORECASE, b""),  # image options: the caption stays
        (rb"\|left", re.IGNORECASE, b""),
        (rb"\|right", re.IGNORECASE, b""),
        (rb"\|\d+px", re.IGNORECASE, b""),
        (rb"\[\[image:[^\[\]]*\|", re.IGNORECASE, b""),
        (rb"\[\[category:([^|\]]*)[^\]]*\]\]", re.IGNORECASE, rb"[[\1]]"),  # category name only
        (rb"\[\[[a-z\-]*:[^\]]*\]\]", 0, b""),  # interlanguage links (case-sensitive in Perl too)
        (rb"\[\[[^|\]]*\|", 0, b"[["),  # piped link: keep the visible text
        (rb"\{\{[^}]*\}\}", 0, b""),  # {{templates}}
        (rb"\{[^}]*\}", 0, b""),  # {| tables |}
    )
)
_ENTITY_LEFTOVER = re.compile(rb"&[^;]*;")  # any other entity becomes a space
_DIGIT = re.compile(rb"[0-9]")
_DIGIT_WORDS = {
    str(d).encode(): f" {word} ".encode()
    for d, word in enumerate("zero one two three four five six seven eight nine".split())
}
_NOT_LETTER_RUN = re.compile(rb"[^a-z]+")  # `tr/a-z/ /cs`: each run of non-letters -> one space


def _records(xml: bytes) -> list[bytes]:
  """Splits like Perl's `$/ = ">"`: every record keeps its closing `>`; a tail without one is
  the last record."""
  parts = xml.split(b">")
  records = [part + b">" for part in parts[:-1]]
  if parts[-1]:
    records.append(parts[-1])
  return records


def _clean(record: bytes) -> bytes:
  """One record through the filter's substitutions; returns `' word word'` or `b''`."""
  record = _FIRST_TAG.sub(b"", record, count=1)
  for entity, char in _ENTITIES:
    record = record.replace(entity, char)
  for pattern, replacement in _MARKUP:
    record = pattern.sub(replacement, record)
  record = record.translate(None, b"[]")
  record = _ENTITY_LEFTOVER.sub(b" ", record)
  record = b" " + record.lower() + b" "  # bytes.lower() folds ASCII only, like Perl's tr/A-Z/a-z/
  record = _DIGIT.sub(lambda m: _DIGIT_WORDS[m.group()], record)
  record = _NOT_LETTER_RUN.sub(b" ", record)
  return record[:-1]  # Perl's `chop`: the framing space, so records join with one space


def wikifil(xml: bytes) -> bytes:
  """Filters MediaWiki XML to text8-style text: lowercase a-z and single spaces.

  Byte-identical to `perl wikifil.pl` on the same input (tested against its output on the
  bundled Wikipedia sample). Only the text of `<text ...>` elements is kept, redirect pages are
  dropped, markup is removed while link and caption text stays, digits are spelled out
  ("1984" -> "one nine eight four"), and every other character separates words.

  Args:
    xml: the raw bytes of a MediaWiki export (any encoding; only ASCII letters survive).

  Returns:
    ASCII bytes over `b" abcdefghijklmnopqrstuvwxyz"`, never two spaces in a row; a space comes
    first whenever anything is printed.
  """
  if not isinstance(xml, (bytes, bytearray, memoryview)):
    raise TypeError(f"wikifil expects bytes, got {type(xml).__name__}")
  out = []
  in_text = False
  for record in _records(bytes(xml)):
    if _TEXT_START in record:
      in_text = True
    if _REDIRECT.search(record):
      in_text = False
    if not in_text:
      continue
    if _TEXT_END in record:
      in_text = False  # this record is still printed
    out.append(_clean(record))
  return b"".join(out)
