"""`wikifil` against outputs of Mahoney's `wikifil.pl` (perl 5.36): fixed inputs and the sample.

Every expected value below was produced by running the Perl filter on the input; the Perl
program itself is not part of this repository.
"""

import hashlib

import pytest

from longformer_jax.data import corpora, wikifil

pytestmark = pytest.mark.unit

T = b'<text xml:space="preserve">'

CASES = [
    ("plain", T + b"Hello, World!</text>", b" hello world"),
    (
        "outside_text_dropped",
        b"<title>Ignored</title>" + T + b"Kept</text><comment>not kept</comment>",
        b" kept",
    ),
    (
        "digits_spelled",
        T + b"In 1984 there were 7 cats.</text>",
        b" in one nine eight four there were seven cats",
    ),
    (
        "redirect_page_dropped",
        b"<page>" + T + b"#REDIRECT [[Other page]]</text></page>"
        + (b"<page>" + T + b"Real text</text></page>"),
        b" real text",
    ),
    ("piped_links", T + b"[[Anarchist|anarchists]] and [[Peace]]</text>", b" anarchists and peace"),
    (
        "category_name_kept",
        T + b"[[Category:Political culture|sort key]]</text>",
        b" political culture",
    ),
  # Interlanguage links are matched case-sensitively, as in the Perl program.
    ("interlanguage", T + b"[[de:Anarchismus]] [[De:Kept]] end</text>", b" de kept end"),
    ("image_caption_kept", T + b"[[Image:Cat.jpg|thumb|left|250px|A cat]]</text>", b" a cat"),
    (
        "templates_and_tables",
        T + b"{{Infobox|x=1}} before {| table |} after</text>",
        b" before after",
    ),
  # Entities are decoded first, so `&b  c&nbsp;` (a bare `&` up to the next `;`) becomes one
  # space.
    (
        "entities_and_refs",
        T + b"a&amp;b &lt;ref&gt;Cite 1&lt;/ref&gt; c&amp;nbsp;d &amp;quot;q&amp;quot;</text>",
        b" a d q",
    ),
    ("external_link_text_kept", T + b"[http://example.org Example site]</text>", b" example site"),
    ("non_ascii_separates", T + "Café Ünïcode Æ".encode() + b"</text>", b" caf n code"),
    ("wiki_markup", T + b"'''Bold''' ''it''\n== Head ==\n* item</text>", b" bold it head item"),
    ("empty", b"", b""),
    ("text_tag_needs_attributes", b"<text>not kept</text>", b""),
  # Perl reads records ending at '>': a raw '>' inside text starts a new record.
    ("record_cut_by_gt", T + b"a > b [[x|y]]</text>", b" a b y"),
]


@pytest.mark.parametrize("xml,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_fixed_inputs_match_perl(xml, expected):
  assert wikifil(xml) == expected


def test_sample_matches_perl_golden():
  out = wikifil(corpora.sample_xml())
  # `perl wikifil.pl enwiki-sample.xml | sha256sum`; the length is the sample README's figure.
  assert len(out) == 3_085_829
  assert hashlib.sha256(out).hexdigest() == (
      "0cf035b28f92b01ff2dd0880909f6087bfb48bc8b8c726b793bccdad5c56a13c"
  )
  assert set(out) <= set(b" abcdefghijklmnopqrstuvwxyz")
  assert b"  " not in out


def test_rejects_text():
  with pytest.raises(TypeError, match="str"):
    wikifil("<text a>x</text>")
