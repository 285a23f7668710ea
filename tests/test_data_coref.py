"""Coreference data and span arithmetic: the CoNLL-2012 and jsonlines readers (`data.coref`) on
tiny hand-written files, what they refuse (naming file and line), and the span grid, distance
buckets and clusters from antecedent links (`coref_spans`) against brute force."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from longformer_jax import coref_spans
from longformer_jax.data import coref, coref_generate, text
from longformer_jax.tasks import coref_scores

pytestmark = pytest.mark.unit


# ----------------------------------------------------------------------------------------------
# CoNLL-2012

def _line(word, coref_column, speaker="Speaker#1", key="bc/test/00/test_0000", part=0, n=0):
  # The 12-column layout: document, part, word number, word, POS, parse, lemma, frameset, sense,
  # speaker, named entities, coreference.
  return f"{key}  {part}  {n}  {word}  NN  *  -  -  -  {speaker}  *  {coref_column}\n"


# Sentence 0: John(0) saw(1) his(2) sister(3) .(4)       John = (0); his = (0) and the start of
#   "his sister" = (1 ...
# Sentence 1: She(5) left(6) the(7) house(8) of(9) John(10) .(11)   "the house of John" = (2
#   ... 2), its John = (0)
# Sentence 2: a(12) friend(13) of(14) friends(15)   entity 4 nests in itself: (12..15) holds
#   (14..15), both closed at token 15 ("4)|4)")
DOC = ("#begin document (bc/test/00/test_0000); part 000\n"
       + _line("John", "(0)") + _line("saw", "-") + _line("his", "(1|(0)")
       + _line("sister", "1)") + _line(".", "-") + "\n"
       + _line("She", "(1)", "Speaker#2") + _line("left", "-", "Speaker#2")
       + _line("the", "(2", "Speaker#2") + _line("house", "-", "Speaker#2")
       + _line("of", "-", "Speaker#2") + _line("John", "(0)|2)", "Speaker#2")
       + _line(".", "-", "Speaker#2") + "\n"
       + _line("a", "(4") + _line("friend", "-") + _line("of", "(4") + _line("friends", "4)|4)")
       + "\n#end document\n")
# A second part with the short layout (no speaker column) and no mention.
SHORT = ("# a comment\n#begin document (nw/test/00/test_0001); part 001\n"
         "nw/test/00/test_0001 1 0 Rain NN -\nnw/test/00/test_0001 1 1 fell VBD -\n\n"
         "#end document\n")


def test_read_conll(tmp_path):
  path = tmp_path / "test.gold_conll"
  path.write_text(DOC + SHORT)
  first, second = coref.read_conll(path)
  assert first.doc_key == "bc/test/00/test_0000_0" and first.genre == "bc"
  assert first.tokens == ("John", "saw", "his", "sister", ".", "She", "left", "the", "house",
                          "of", "John", ".", "a", "friend", "of", "friends")
  assert first.sentence_ids == (0,) * 5 + (1,) * 7 + (2,) * 4
  assert first.speakers == ("Speaker#1",) * 5 + ("Speaker#2",) * 7 + ("Speaker#1",) * 4
  assert first.clusters == (((0, 0), (2, 2), (10, 10)), ((2, 3), (5, 5)), ((7, 10),),
                            ((12, 15), (14, 15)))
  assert first.word_ids is None and first.segment_lengths is None
  assert first.source == f"{path}:1"
  assert second.doc_key == "nw/test/00/test_0001_1" and second.tokens == ("Rain", "fell")
  assert second.speakers is None and second.clusters == () and second.sentence_ids == (0, 0)
  # The gold read back scores 1 against itself.
  assert coref_scores(golds=[first.clusters], predictions=[first.clusters])["conll_f1"] == 1.0


BEGIN = "#begin document (bc/x); part 000\n"


@pytest.mark.parametrize("content, line, problem", [
    (BEGIN + _line("a", "(3") + _line("b", "12)") + "#end document\n", 3,
     "coreference 12) closes a mention of entity 12 that no earlier '(12' opened"),
    (BEGIN + _line("a", "-") + _line("b", "(5") + "\n#end document\n", 3,
     "mention '(5' of document 'bc/x_0' is never closed (expected '5)' before '#end document' "
     "on line 5)"),
    (BEGIN + _line("a", "(x)") + "#end document\n", 2,
     "coreference column '(x)': expected '-' or parts like '(12', '12)' or '(12)' joined by "
     "'|', got part '(x)'"),
    (BEGIN + _line("a", "(1)||(2)") + "#end document\n", 2, "got part ''"),
    (BEGIN + _line("a", "7") + "#end document\n", 2, "got part '7'"),
    (_line("a", "-"), 1, "a token line outside a document"),
    (BEGIN + _line("a", "-") + "#end document\n#end document\n", 4,
     "'#end document' outside a document"),
    (BEGIN + _line("a", "-") + BEGIN, 3, "'#begin document' inside document 'bc/x_0' (begun on "
     "line 1)"),
    (BEGIN + _line("a", "-") + "bc/x 0 1 b -\n#end document\n", 3,
     "expected 12 columns like the document's first token line, got 5"),
    (BEGIN + "bc/x 0 1 b\n#end document\n", 2, "expected at least 5 columns"),
    ("#begin document bc/x part 0\n", 1, "expected '#begin document (KEY); part N'"),
    (BEGIN + _line("a", "-") + "#end document\n" + BEGIN, 4, "document 'bc/x_0' repeats the one "
     "of line 1"),
    (BEGIN + "#end document\n", 1, "document 'bc/x_0' has no token lines"),
])
def test_read_conll_refuses(tmp_path, content, line, problem):
  path = tmp_path / "bad.conll"
  path.write_text(content)
  with pytest.raises(ValueError) as info:
    coref.read_conll(path)
  assert str(info.value).startswith(f"{path}:{line}: ") and problem in str(info.value), (
      str(info.value))


@pytest.mark.parametrize("content, problem", [
    (BEGIN + _line("a", "-"), "document 'bc/x_0' (begun on line 1) has no '#end document'"),
    ("# nothing\n\n", "holds no document"),
])
def test_read_conll_refuses_whole_files(tmp_path, content, problem):
  path = tmp_path / "bad.conll"
  path.write_text(content)
  with pytest.raises(coref.CoNLLError, match=f"^{path}: ") as info:
    coref.read_conll(path)
  assert problem in str(info.value)
  with pytest.raises(FileNotFoundError, match="no such file"):
    coref.read_conll(tmp_path / "absent.conll")


# ----------------------------------------------------------------------------------------------
# Joshi et al.'s jsonlines

RECORD = {
    "doc_key": "bc/test/00/test_0000_0",
    "sentences": [["[CLS]", "john", "saw", "his", "sister", "[SEP]"],
                  ["[CLS]", "she", "left", "[SEP]"]],
    "speakers": [["[SPL]", "a", "a", "a", "a", "[SPL]"], ["[SPL]", "b", "b", "[SPL]"]],
    "clusters": [[[3, 4], [7, 7]], [[1, 1], [3, 3]]],
    "sentence_map": [0, 0, 0, 0, 0, 0, 1, 1, 1, 1],
    "subtoken_map": [0, 0, 1, 2, 3, 3, 4, 4, 5, 5],
    "pronouns": [],
}


def _write(tmp_path, records):
  path = tmp_path / "test.jsonlines"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


def test_read_jsonlines(tmp_path):
  no_speakers = {k: v for k, v in RECORD.items() if k != "speakers"} | {"doc_key": "nw/y_0"}
  path = _write(tmp_path, [RECORD, no_speakers])
  doc, other = coref.read_jsonlines(path)
  assert doc.doc_key == "bc/test/00/test_0000_0" and doc.genre == "bc"
  assert doc.tokens == ("[CLS]", "john", "saw", "his", "sister", "[SEP]", "[CLS]", "she",
                        "left", "[SEP]")
  assert doc.sentence_ids == (0,) * 6 + (1,) * 4
  assert doc.speakers == ("[SPL]", "a", "a", "a", "a", "[SPL]", "[SPL]", "b", "b", "[SPL]")
  assert doc.clusters == (((1, 1), (3, 3)), ((3, 4), (7, 7)))
  assert doc.word_ids == (0, 0, 1, 2, 3, 3, 4, 4, 5, 5) and doc.segment_lengths == (6, 4)
  assert doc.source == f"{path}:1"
  assert other.speakers is None and other.source == f"{path}:2"
  with pytest.raises(dataclasses.FrozenInstanceError):
    doc.tokens = ()


@pytest.mark.parametrize("change, field, problem", [
    ({"sentence_map": [0, 0, 0]}, "sentence_map", "must hold one int >= 0 per subtoken (10)"),
    ({"subtoken_map": [0, 0, 1, 2, 3, 3, 4, 4, 5, 4]}, "subtoken_map", "never decreasing"),
    ({"clusters": [[[3, 10]]]}, "clusters", "cluster 0 mention 0 must be [start, end] with 0 <= "
     "start <= end < 10"),
    ({"clusters": [[[1, 1]], [[2, 2], [1, 1]]]}, "clusters", "cluster 1 mention 1 [1, 1] is also "
     "in cluster 0"),
    ({"clusters": [[]]}, "clusters", "cluster 0 must be a non-empty list"),
    ({"speakers": [["a"] * 6, ["b"] * 3]}, "speakers", "must have the shape of 'sentences'"),
    ({"sentences": [["[CLS]", 3]]}, "sentences", "segment 0 must be a non-empty list of subtoken "
     "strings"),
    ({"clusters": {}}, "clusters", "must be a list"),
])
def test_read_jsonlines_refuses(tmp_path, change, field, problem):
  path = _write(tmp_path, [RECORD, RECORD | {"doc_key": "other"} | change])
  with pytest.raises(text.JsonlError) as info:
    coref.read_jsonlines(path)
  assert str(info.value).startswith(f"{path}:2: field {field!r}") and problem in str(info.value), (
      str(info.value))
  assert isinstance(info.value, ValueError)


def test_read_jsonlines_refuses_a_repeated_key(tmp_path):
  path = _write(tmp_path, [RECORD, RECORD])
  with pytest.raises(ValueError, match=f"^{path}:2: field 'doc_key' repeats"):
    coref.read_jsonlines(path)


# ----------------------------------------------------------------------------------------------
# Span arithmetic


def _brute_force_spans(sentence_ids, max_width, mask=None):
  n = len(sentence_ids)
  mask = [True] * n if mask is None else mask
  return [(s, e) for s in range(n) for e in range(s, min(s + max_width, n))
          if len(set(sentence_ids[s:e + 1])) == 1 and all(mask[s:e + 1])]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_width", [1, 3, 6])
def test_span_grid_equals_brute_force_enumeration(seed, max_width):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(1, 20))
  sentence_ids = np.cumsum(rng.random(n) < 0.3).tolist()  # non-decreasing, random breaks
  for mask in (None, (rng.random(n) < 0.8).tolist()):
    starts, ends, valid = coref_spans.span_grid(np.asarray(sentence_ids), max_width,
                                                None if mask is None else np.asarray(mask))
    assert starts.shape == ends.shape == valid.shape == (n * max_width,)
    got = [(int(s), int(e)) for s, e, v in zip(starts, ends, valid) if v]
    assert got == _brute_force_spans(sentence_ids, max_width, mask)
    assert int(np.max(np.asarray(ends))) <= n - 1


def test_span_grid_under_jit_and_by_hand():
  grid = jax.jit(coref_spans.span_grid, static_argnums=1)
  # Two sentences [0, 0, 0 | 1, 1], width 2: (0,0) (0,1) (1,1) (1,2) (2,2) | (3,3) (3,4) (4,4).
  starts, ends, valid = grid(np.array([0, 0, 0, 1, 1]), 2)
  assert np.asarray(valid).tolist() == [1, 1, 1, 1, 1, 0, 1, 1, 1, 0]
  assert np.asarray(starts).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
  assert np.asarray(ends).tolist() == [0, 1, 1, 2, 2, 3, 3, 4, 4, 4]
  with pytest.raises(ValueError, match="max_width must be a positive int, got 0"):
    coref_spans.span_grid(np.zeros(3, int), 0)
  with pytest.raises(ValueError, match=r"token_mask must be one flag per token \[3\]"):
    coref_spans.span_grid(np.zeros(3, int), 2, np.ones(4, bool))


def test_distance_buckets():
  edges = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 7: 5, 8: 6, 15: 6, 16: 7, 31: 7, 32: 8, 63: 8,
           64: 9, 65: 9, 1000: 9}
  got = coref_spans.distance_buckets(np.array(list(edges)))
  assert np.asarray(got).tolist() == list(edges.values())
  # Every distance 0..300 against the definition min(floor(log2 d) + 3, 9) for d >= 5.
  d = np.arange(301)
  expected = np.where(d < 5, d, np.minimum(np.floor(np.log2(np.maximum(d, 1))) + 3, 9))
  np.testing.assert_array_equal(np.asarray(coref_spans.distance_buckets(d)), expected)
  assert coref_spans.distance_buckets(np.ones((2, 3), np.int32)).shape == (2, 3)
  assert coref_spans.NUM_DISTANCE_BUCKETS == 10


def test_argmax_antecedents():
  neg = -np.inf
  scores = np.array([[0.0, neg, neg],      # nothing to link to: the dummy
                     [0.0, 2.0, neg],      # candidate 0 -> mention 0
                     [0.0, -1.0, 0.5],     # candidate 1 -> mention 0
                     [0.0, 0.0, -3.0]])    # a tie with the dummy: the dummy wins
  antecedents = np.array([[0, 0], [0, 0], [1, 0], [2, 1]])
  assert np.asarray(coref_spans.argmax_antecedents(scores, antecedents)).tolist() == [
      -1, 0, 0, -1]


def test_clusters_from_antecedents_is_the_transitive_closure():
  starts, ends = [0, 2, 4, 6, 8, 10], [0, 3, 4, 6, 9, 10]
  # 1 -> 0, 3 -> 1 (so 3 joins 0 and 1), 4 -> 2, 5 alone.
  clusters = coref_spans.clusters_from_antecedents(starts, ends, [-1, 0, -1, 1, 2, -1])
  assert clusters == (((0, 0), (2, 3), (6, 6)), ((4, 4), (8, 9)))
  # Closure through a later link: 2 -> 0 and 2 -> ... 3 -> 2, 4 -> 3: one cluster of four.
  assert coref_spans.clusters_from_antecedents(starts[:5], ends[:5], [-1, -1, 0, 2, 3]) == (
      ((0, 0), (4, 4), (6, 6), (8, 9)),)
  # Every brute-force closure on small random forests: a mention's cluster is everything that
  # reaches the same first mention by following links.
  rng = np.random.default_rng(0)
  for _ in range(20):
    m = int(rng.integers(1, 9))
    links = [-1 if i == 0 or rng.random() < 0.4 else int(rng.integers(0, i)) for i in range(m)]

    def first(i):
      while links[i] != -1:
        i = links[i]
      return i

    groups = {}
    for i in range(m):
      groups.setdefault(first(i), []).append((i, i))
    expected = tuple(sorted(tuple(g) for g in groups.values() if len(g) > 1))
    assert coref_spans.clusters_from_antecedents(range(m), range(m), links) == expected
  # Predicted clusters feed the metrics directly.
  assert coref_scores(golds=[clusters], predictions=[clusters])["conll_f1"] == 1.0


@pytest.mark.parametrize("starts, ends, antecedents, problem", [
    ([0, 1], [0, 1], [-1, 1], "mention 1: antecedent 1 must be -1 (none) or the index of another"),
    ([0, 1], [0, 1], [-1, 2], "mention 1: antecedent 2"),
    ([0, 1], [0], [-1, 0], "got 2 starts, 1 ends and 2 antecedents"),
])
def test_clusters_from_antecedents_refuses(starts, ends, antecedents, problem):
  with pytest.raises(ValueError) as info:
    coref_spans.clusters_from_antecedents(starts, ends, antecedents)
  assert problem in str(info.value)



# ----------------------------------------------------------------------------------------------
# Generated documents (`data.coref_generate`)


def _generated(**changes):
  kwargs = dict(seed=3, num_words=1200, num_entities=4, max_mentions=4, min_gap=300)
  return coref_generate.generate_documents(2, **{**kwargs, **changes})


def test_generated_documents_round_trip_through_conll(tmp_path):
  docs = _generated()
  path = tmp_path / "gen.v4_gold_conll"
  coref_generate.write_conll(path, docs)
  back = coref.read_conll(path)
  assert [dataclasses.replace(d, source="") for d in back] == docs
  assert back[0].doc_key == "nw/generated/00/generated_0000_0" and back[0].genre == "nw"
  assert set(back[0].speakers) == {"Speaker#1", "Speaker#2"}
  with pytest.raises(ValueError, match="must end in '_N'"):
    coref_generate.conll_text([dataclasses.replace(docs[0], doc_key="nw/x")])


def _pieces(word):
  # A word-piece split: chunks of 3 characters, continuations marked "##".
  return [word[:3]] + ["##" + word[i:i + 3] for i in range(3, len(word), 3)]


@pytest.mark.parametrize("subtokenize", [None, _pieces])
def test_generated_documents_round_trip_through_jsonlines(tmp_path, subtokenize):
  docs = _generated()
  path = tmp_path / "gen.128.jsonlines"
  coref_generate.write_jsonlines(path, docs, segment_length=128, subtokenize=subtokenize)
  for doc, back in zip(docs, coref.read_jsonlines(path)):
    assert back.doc_key == doc.doc_key and len(back.segment_lengths) > 9
    assert max(back.segment_lengths) <= 128
    start = 0
    for length in back.segment_lengths:
      segment = back.tokens[start:start + length]
      assert segment[0] == "[CLS]" and segment[-1] == "[SEP]"
      # Segments end at sentence ends: the next segment starts a new sentence.
      if start + length < len(back.tokens):
        assert back.sentence_ids[start + length + 1] > back.sentence_ids[start + length - 2]
      start += length
    real = [i for i, t in enumerate(back.tokens) if t not in ("[CLS]", "[SEP]")]
    split = subtokenize or (lambda w: [w])
    assert [back.tokens[i] for i in real] == [p for w in doc.tokens for p in split(w)]
    assert [doc.sentence_ids[back.word_ids[i]] for i in real] == [back.sentence_ids[i]
                                                                  for i in real]
    assert [back.speakers[i] for i in real] == [doc.speakers[back.word_ids[i]] for i in real]
    # Subtoken clusters map back to the word clusters, and cover whole words.
    words = tuple(tuple((back.word_ids[s], back.word_ids[e]) for s, e in c)
                  for c in back.clusters)
    assert words == doc.clusters
    for cluster in back.clusters:
      for s, e in cluster:
        assert back.word_ids[s - 1] != back.word_ids[s] or back.tokens[s - 1] == "[CLS]"
        assert back.word_ids[e + 1] != back.word_ids[e] or back.tokens[e + 1] == "[SEP]"


def test_generated_gold_by_construction():
  docs = _generated()
  assert docs == _generated() and docs != _generated(seed=4)  # seeded
  for doc in docs:
    assert len(doc.clusters) == 4
    names, roles = set(), set()
    covered: set[int] = set()
    for cluster in doc.clusters:
      assert 2 <= len(cluster) <= 4
      first = doc.tokens[cluster[0][0]:cluster[0][1] + 1]
      assert len(first) == 2 and first[0][0].isupper()  # the full name
      appositive = doc.tokens[cluster[0][1] + 1:cluster[0][1] + 5]
      assert appositive[:2] == (",", "the") and appositive[3] == ","
      role = appositive[2]
      assert role in coref_generate.ROLES and role not in roles and first not in names
      roles.add(role)
      names.add(first)
      for s, e in cluster:
        assert doc.tokens[s:e + 1] in (first, first[1:], ("the", role))
        assert doc.sentence_ids[s] == doc.sentence_ids[e]
        assert covered.isdisjoint(range(s, e + 1))  # mentions never overlap
        covered.update(range(s, e + 1))
      # Consecutive mentions are at least min_gap words apart.
      assert all(b[0] - a[0] >= 300 for a, b in zip(cluster, cluster[1:]))
    stats = coref_generate.link_stats(doc, segment_length=512, window=256)
    assert stats["links"] == sum(len(c) - 1 for c in doc.clusters)
    assert stats["beyond_window"] == stats["links"] and stats["crossing_segments"] > 0
    # The gold against itself scores 1.
    assert coref_scores(golds=[doc.clusters], predictions=[doc.clusters])["conll_f1"] == 1.0
  # The Wikipedia sample as filler: its words, lowercase, beyond the fixed list.
  wiki = _generated(source="text8_sample")[0]
  filler = [w for w in wiki.tokens if w.islower()]
  assert len(set(filler) - set(coref_generate.FILLER)) > 100


@pytest.mark.parametrize("change, problem", [
    (dict(num_entities=0), "num_entities must be an int >= 1, got 0"),
    (dict(num_entities=99), "num_entities must be at most 24"),
    (dict(max_mentions=1), "max_mentions must be an int >= 2, got 1"),
    (dict(num_words=600), "num_words=600 cannot hold 4 mentions 300 words apart"),
    (dict(source="wiki"), "source must be one of"),
    (dict(genre="NW"), "genre must be two lowercase letters"),
])
def test_generate_documents_refuses(change, problem):
  with pytest.raises(ValueError, match=problem):
    _generated(**change)


def test_write_corpus(tmp_path):
  written = coref_generate.write_corpus(tmp_path / "corpus", {"train": 2, "dev": 1}, seed=5,
                                        num_words=700, min_gap=200, max_mentions=3)
  assert sorted(written) == ["dev", "train"]
  train = coref.read_conll(written["train"]["conll"])
  dev = coref.read_jsonlines(written["dev"]["jsonlines"])
  assert [d.doc_key for d in train] == ["nw/train/00/train_0000_0", "nw/train/00/train_0001_0"]
  assert [d.doc_key for d in dev] == ["nw/dev/00/dev_0000_0"]
  assert written["dev"]["jsonlines"].endswith("dev.english.512.jsonlines")
