"""Coreference as a fine-tuning kind: `train.finetune --task coref` trains
`coref.LongformerForCoreference` (the coarse-to-fine span-ranking head on the encoder) on
CoNLL-2012 files or Joshi et al.'s jsonlines (`data.coref`), and scores it with MUC, B-cubed,
CEAF-phi4 and the CoNLL F1 (`tasks.coref_metrics.coref_scores`).

Documents, words and rows. A document is read as words: CoNLL's words as the file spells them; a
jsonlines document's subtokens regrouped into words by `subtoken_map` (its `[CLS]` / `[SEP]`
segment markers dropped, a word the concatenation of its subtokens with WordPiece's "##" and
byte-level BPE's "Ġ" continuation marks removed), its clusters remapped to word spans. The words
joined by single spaces are tokenized by the run's tokenizer and each token assigned to the word
its characters fall in. The row is `<s> tokens </s>`, cut to max_length (the document's end is
lost); `<s>` and `</s>` are sentences of their own, so no candidate span joins them to a word.
Gold mentions kept whole by the cut are the training targets; scoring is against the whole
document's gold (a mention cut away counts as missed), with predicted spans mapped back to words
(first token's word to last token's word).

The segment baseline (`FinetuneOptions` baseline "segments", Joshi et al.'s reading): the encoder
reads the row as max_length / segment_length independent segments (positions restart, no `<s>`
added per segment), the head the stitched states; the segments read exactly what the row keeps.
segment_length must divide max_length; segment_overlap and segment_pool="mean" are refused.

Metrics (fractions in [0, 1], each over the split's documents, numerators and denominators
summed): muc_p, muc_r, muc_f1, b3_p, b3_r, b3_f1, ceafe_p, ceafe_r, ceafe_f1, conll_f1 (the mean
of the three F1s). What the cut lost is each document's `fd.Truncation` (evidence: every gold
mention kept) and the split's `truncation_extras`: mentions_within_limit and links_within_limit.
Settings: the `coref_*` fields of `finetune.FinetuneOptions`, and its baseline settings.

Shape letters: B documents, N row positions, G gold mention slots, M kept spans, K antecedents.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from longformer_jax import coref as coref_lib
from longformer_jax import coref_spans
from longformer_jax.config import LongformerConfig
from longformer_jax.data import coref as coref_data
from longformer_jax.data import finetune_data as fd
from longformer_jax.data import text
from longformer_jax.data.tokenizer import SpecialIds, copy_tokenizer, encoding_errors
from longformer_jax.tasks.coref_metrics import METRICS, coref_scores
from longformer_jax.tasks.finetune_kinds import SettingsKind, check_segment_settings, register

__all__ = ["CorefExample", "CorefSettings", "CorefSplit", "Coreference", "document_words",
           "read_documents", "trivial_scores"]

# Segment markers of jsonlines files (BERT's and RoBERTa's spellings): not words.
_MARKERS = frozenset({"[CLS]", "[SEP]", "<s>", "</s>"})
_JSONLINES_SUFFIXES = (".jsonlines", ".jsonl")


@dataclasses.dataclass(frozen=True)
class CorefSettings:
  """What of the run's `FinetuneOptions` the kind's steps read (from its coref_* fields;
  segment_length from baseline "segments", None for whole rows)."""
  mention_weight: float = 0.0
  segment_length: int | None = None
  singletons: bool = True

  @classmethod
  def of(cls, options) -> CorefSettings:
    return cls(mention_weight=float(options.coref_mention_weight),
               segment_length=(options.segment_length if options.baseline == "segments"
                               else None),
               singletons=options.coref_singletons)


@dataclasses.dataclass(frozen=True)
class CorefExample:
  """One document, featurised.

  input_ids, sentence_ids, speaker_ids: int32 [N_i], the row `<s> tokens </s>`.
  token_words: int32 [N_i], the word of each row position (-1 for <s> and </s>).
  gold_words: the document's gold clusters in word spans (what predictions are scored against).
  gold_row: the gold clusters in row positions, mentions the cut kept whole (training targets).
  genre: the genre id (`coref.genre_id` of the key). mentions, mentions_kept: gold mentions in
  the document and those the row keeps whole. links, links_kept: gold links (each mention after
  the first of its cluster with its closest preceding mention, in (start, end) order) in the
  document and those with both mentions kept.
  truncation: what the cut lost (`fd.Truncation`: no question; evidence, every gold mention
  kept, None for a document without one).
  """
  line: int
  input_ids: np.ndarray
  sentence_ids: np.ndarray
  speaker_ids: np.ndarray
  token_words: np.ndarray
  gold_words: tuple[tuple[tuple[int, int], ...], ...]
  gold_row: tuple[tuple[tuple[int, int], ...], ...]
  genre: int
  mentions: int
  mentions_kept: int
  links: int
  links_kept: int
  truncation: fd.Truncation

  def global_lengths(self, mode: str) -> tuple[int, ...]:
    """"first": `<s>` global; "none": no global token (the paper's coreference setting)."""
    return (1,) if mode == "first" else (0,)


@dataclasses.dataclass(frozen=True)
class CorefSplit(fd.FinetuneSplit):
  """A coreference file, featurised: `fd.FinetuneSplit` with max_mentions, the gold mention
  slots of its batches (the most gold mentions a row holds, at least 1)."""
  max_mentions: int = 1


def read_documents(path: str | os.PathLike) -> list[coref_data.CorefDocument]:
  """The documents of a coreference file: Joshi et al.'s jsonlines when its name ends in
  .jsonlines or .jsonl, else CoNLL-2012 (`data.coref`)."""
  path = os.fspath(path)
  if path.endswith(_JSONLINES_SUFFIXES):
    return coref_data.read_jsonlines(path)
  return coref_data.read_conll(path)


def _strip(subtoken: str, first: bool) -> str:
  if not first and subtoken.startswith("##"):
    return subtoken[2:]
  return subtoken[1:] if subtoken.startswith("Ġ") and len(subtoken) > 1 else subtoken


def document_words(document: coref_data.CorefDocument
                   ) -> tuple[list[str], list[int], list[str] | None, list[list[tuple[int, int]]]]:
  """(words, sentence id of each word, speaker of each word or None, clusters in word spans) of
  a document: CoNLL's as they are; a jsonlines document regrouped by its subtoken map (the
  module docstring). ValueError naming the document when a mention starts or ends on a segment
  marker."""
  if document.word_ids is None:
    return (list(document.tokens), list(document.sentence_ids),
            None if document.speakers is None else list(document.speakers),
            [list(c) for c in document.clusters])
  words: list[str] = []
  sentences: list[int] = []
  speakers: list[str] | None = [] if document.speakers is not None else None
  word_of: dict[int, int] = {}  # subtoken -> word index
  last_map = None
  for i, (token, word) in enumerate(zip(document.tokens, document.word_ids)):
    if token in _MARKERS:
      continue
    if word != last_map:
      words.append(_strip(token, True))
      sentences.append(document.sentence_ids[i])
      if speakers is not None:
        speakers.append(document.speakers[i])
      last_map = word
    else:
      words[-1] += _strip(token, False)
    word_of[i] = len(words) - 1
  clusters = []
  for cluster in document.clusters:
    spans = []
    for start, end in cluster:
      if start not in word_of or end not in word_of:
        raise ValueError(f"{document.source}: document {document.doc_key!r}: mention "
                         f"[{start}, {end}] starts or ends on a segment marker "
                         f"{document.tokens[start]!r} / {document.tokens[end]!r}")
      spans.append((word_of[start], word_of[end]))
    clusters.append(sorted(set(spans)))
  return words, sentences, speakers, clusters


def _featurise(document: coref_data.CorefDocument, line: int, tokenizer, specials: SpecialIds,
               max_length: int, vocab_size: int, path: str) -> CorefExample:
  words, sentence_of_word, speakers, clusters = document_words(document)
  if not words:
    raise ValueError(f"{document.source}: document {document.doc_key!r} has no word")
  starts, pieces, position = [], [], 0
  for word in words:
    starts.append(position)
    pieces.append(word)
    position += len(word) + 1
  joined = " ".join(pieces)
  with encoding_errors(tokenizer, f"{path}: document {document.doc_key!r}"):
    enc = tokenizer.encode(joined, add_special_tokens=False)
  ids = np.asarray(enc.ids, np.int64)
  offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
  special = {specials.bos, specials.eos, specials.pad, specials.sep, *specials.special}
  bad = [i for i, x in enumerate(ids.tolist()) if x in special or x >= vocab_size]
  if bad:
    i = bad[0]
    raise ValueError(f"{document.source}: document {document.doc_key!r}: token {i} "
                     f"({enc.tokens[i]!r}) is id {int(ids[i])}, a special id or outside the "
                     f"model's vocabulary (vocab_size={vocab_size})")
  # The word each token's characters fall in (its first non-space character's).
  token_word = np.asarray([bisect.bisect_right(starts, int(a)) - 1 for a, _ in offsets],
                          np.int64)
  first_token = np.full(len(words), -1, np.int64)
  last_token = np.full(len(words), -1, np.int64)
  for t, w in enumerate(token_word.tolist()):
    if first_token[w] < 0:
      first_token[w] = t
    last_token[w] = t
  lost = np.flatnonzero(first_token < 0)
  if len(lost):
    raise ValueError(f"{document.source}: document {document.doc_key!r}: word {int(lost[0])} "
                     f"{words[int(lost[0])]!r} tokenizes to no token")
  keep = min(len(ids), max_length - 2)
  row = np.concatenate([[specials.bos], ids[:keep], [specials.eos]]).astype(np.int32)
  # Sentences: <s> is 0, words' sentences from 1 on (renumbered densely), </s> one past them.
  dense = {s: k + 1 for k, s in enumerate(sorted(set(sentence_of_word)))}
  token_sentence = [dense[sentence_of_word[w]] for w in token_word[:keep].tolist()]
  sentence_ids = np.asarray([0, *token_sentence, len(dense) + 1], np.int32)
  names: dict[str, int] = {}
  token_speaker = ([names.setdefault(speakers[w], len(names) + 1)
                    for w in token_word[:keep].tolist()] if speakers is not None
                   else [0] * keep)
  speaker_ids = np.asarray([0, *token_speaker, 0], np.int32)
  token_words = np.asarray([-1, *token_word[:keep].tolist(), -1], np.int32)
  gold_row = []
  for cluster in clusters:
    spans = [(int(first_token[s]) + 1, int(last_token[e]) + 1) for s, e in cluster
             if last_token[e] < keep]
    if spans:
      gold_row.append(tuple(spans))
  mentions = sum(len(c) for c in clusters)
  mentions_kept = sum(len(c) for c in gold_row)
  kept = lambda span: bool(last_token[span[1]] < keep)
  links = [(a, b) for cluster in clusters for a, b in zip(sorted(cluster), sorted(cluster)[1:])]
  return CorefExample(
      line=line, input_ids=row, sentence_ids=sentence_ids, speaker_ids=speaker_ids,
      token_words=token_words, gold_words=tuple(tuple(c) for c in clusters),
      gold_row=tuple(gold_row), genre=coref_lib.genre_id(document.doc_key),
      mentions=mentions, mentions_kept=mentions_kept, links=len(links),
      links_kept=sum(kept(a) and kept(b) for a, b in links),
      truncation=fd.Truncation(full_length=len(ids) + 2, document_tokens=len(ids),
                               kept_tokens=keep,
                               evidence=mentions_kept == mentions if mentions else None))


def _check_segments(options, max_length: int) -> None:
  """ValueError naming the segment setting coreference cannot read (module docstring)."""
  segment = options.segment_length
  if max_length % segment:
    raise ValueError(f"segment_length={segment} must divide max_length={max_length} (--task "
                     f"coref --baseline segments reads the row as max_length / segment_length "
                     f"segments)")
  check_segment_settings(
      options, "coref", overlap="segments that share no token (Joshi et al.'s independent "
      "segments)", pool="pools none")


@register
class Coreference(SettingsKind):
  """coref: CoNLL-2012 or jsonlines documents (the module docstring); LongformerForCoreference
  (its `CorefConfig` from the coref_* options) with no global attention by default. Records
  {"id" (the document key), "clusters" (predicted, word spans [start, end], end inclusive),
  "gold"}."""
  name = "coref"
  model_class = coref_lib.LongformerForCoreference
  default_global = "none"
  required = {}
  metrics = (*(f"{m}_{x}" for m in METRICS for x in ("p", "r", "f1")), "conll_f1")
  option_fields: ClassVar[tuple[str, ...]] = (
      "coref_max_span_width", "coref_top_span_ratio", "coref_max_top_spans",
      "coref_max_antecedents", "coref_ffnn_size", "coref_ffnn_depth", "coref_feature_size",
      "coref_use_speakers", "coref_dropout", "coref_mention_weight")
  reads_segments = True

  settings_class = CorefSettings

  # Records.

  def featurise(self, reader, record, by_text):
    raise TypeError("coreference files are read whole by Coreference.read_split, not as "
                    "JSONL records")

  def read_split(self, path, tokenizer, *, max_length, specials, vocab_size, options,
                 label_names=None):
    """The documents of `path` (`read_documents`) as rows of max_length tokens; the split's
    kind carries the run's settings (`CorefSettings.of(options)`). Under baseline "segments"
    ValueError for a segment setting the kind cannot honour (module docstring)."""
    del label_names
    if not isinstance(max_length, int) or max_length < 8:
      raise ValueError(f"max_length must be an int >= 8, got {max_length!r}")
    if options.baseline == "segments":
      _check_segments(options, max_length)
    if tokenizer is None:
      raise ValueError(f"{os.fspath(path)}: coreference documents are words: give a tokenizer "
                       f"(--tokenizer)")
    path = os.fspath(path)
    documents = read_documents(path)
    tokenizer = copy_tokenizer(tokenizer)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    examples = tuple(_featurise(d, k + 1, tokenizer, specials, max_length, vocab_size, path)
                     for k, d in enumerate(documents))
    return CorefSplit(
        kind=type(self)(CorefSettings.of(options)), path=path, sha256=text.file_sha256(path),
        ids=tuple(d.doc_key for d in documents), examples=examples, max_length=max_length,
        by_text=True, max_mentions=max([1, *(e.mentions_kept for e in examples)]))

  def truncation_extras(self, examples):
    """mentions_within_limit (gold mentions kept whole over all gold mentions) and
    links_within_limit (gold links with both mentions kept over all gold links), counts summed
    over the documents; None when there is none."""
    ratio = lambda kept, total: kept / total if total else None
    return {"mentions_within_limit": ratio(sum(e.mentions_kept for e in examples),
                                           sum(e.mentions for e in examples)),
            "links_within_limit": ratio(sum(e.links_kept for e in examples),
                                        sum(e.links for e in examples))}

  def build_model(self, config, options, *, rngs, mesh=None, seq_axis=None):
    """LongformerForCoreference on `config` with the head of the coref_* options."""
    head = coref_lib.CorefConfig(
        encoder=config, max_span_width=options.coref_max_span_width,
        top_span_ratio=options.coref_top_span_ratio, max_top_spans=options.coref_max_top_spans,
        max_antecedents=options.coref_max_antecedents, ffnn_size=options.coref_ffnn_size,
        ffnn_depth=options.coref_ffnn_depth, feature_size=options.coref_feature_size,
        use_speakers=options.coref_use_speakers, dropout=options.coref_dropout)
    return coref_lib.LongformerForCoreference(head, rngs=rngs, mesh=mesh, seq_axis=seq_axis)

  # Arrays.

  def batch(self, split, rows, *, global_attention, specials):
    """input_ids, attention_mask, global_attention_mask, sentence_ids, speaker_ids [B, N],
    genre_ids [B], then `targets`."""
    examples = [split.examples[i] for i in rows]
    n = split.max_length
    arrays = fd.encoder_arrays([e.input_ids for e in examples],
                               [e.global_lengths(global_attention)[0] for e in examples], n,
                               specials.pad)
    # Padding continues the last sentence (non-decreasing ids; masked, so in no span).
    sentence_BxN = text.pad([e.sentence_ids for e in examples], length=n, pad_id=0)[0]
    for b, e in enumerate(examples):
      sentence_BxN[b, len(e.sentence_ids):] = e.sentence_ids[-1]
    return {**arrays, "sentence_ids": sentence_BxN,
            "speaker_ids": text.pad([e.speaker_ids for e in examples], length=n, pad_id=0)[0],
            "genre_ids": np.asarray([e.genre for e in examples], np.int32),
            **self.targets(split, examples)}

  def targets(self, split, examples):
    """gold_starts, gold_ends, gold_cluster_ids [B, G] (`coref.gold_arrays`, G =
    split.max_mentions)."""
    gold = [coref_lib.gold_arrays(e.gold_row, split.max_mentions) for e in examples]
    return {name: np.stack([g[name] for g in gold])
            for name in ("gold_starts", "gold_ends", "gold_cluster_ids")}

  # The model.

  def _output(self, model, batch, max_global) -> coref_lib.CorefOutput:
    segment = self.run_settings.segment_length
    global_BxN = batch["global_attention_mask"]
    if segment is not None:  # the encoder reads [B * N / segment, segment] rows
      global_BxN = global_BxN.reshape(-1, segment)
    return model(batch["input_ids"], batch["attention_mask"], batch["sentence_ids"],
                 batch["speaker_ids"], batch["genre_ids"], segment_length=segment,
                 global_attention_mask=global_BxN, max_global=max_global)

  def logits(self, model, batch, max_global):
    """The kept spans and their antecedent scores (`CorefOutput`'s fields `outputs` keeps)."""
    out = self._output(model, batch, max_global)
    return {"starts": out.top_span_starts, "ends": out.top_span_ends,
            "span_mask": out.top_span_mask, "antecedents": out.antecedents,
            "scores": out.antecedent_scores}

  def loss(self, model, batch, max_global):
    """`coref.coref_loss` (summed over a document's kept spans), the mean over documents."""
    out = self._output(model, batch, max_global)
    return jnp.mean(coref_lib.coref_loss(
        out, gold_starts=batch["gold_starts"], gold_ends=batch["gold_ends"],
        gold_cluster_ids=batch["gold_cluster_ids"],
        mention_weight=self.run_settings.mention_weight))

  def outputs(self, logits, max_answer_length):
    """starts, ends, span_mask [E, M], antecedents [E, M, K] and each kept span's best
    antecedent "links" [E, M] (-1: none, the dummy)."""
    del max_answer_length
    links = jax.vmap(coref_spans.argmax_antecedents)(logits["scores"], logits["antecedents"])
    return {"starts": logits["starts"], "ends": logits["ends"],
            "span_mask": logits["span_mask"],
            "links": jnp.where(logits["span_mask"], links, -1)}

  def score(self, split, examples, ids, outputs):
    predictions = []
    for e, starts, ends, links in zip(examples, outputs["starts"], outputs["ends"],
                                      outputs["links"]):
      clusters = coref_spans.clusters_from_antecedents(starts, ends, links)
      words = []
      for cluster in clusters:
        spans = sorted({(int(e.token_words[s]), int(e.token_words[t])) for s, t in cluster
                        if e.token_words[s] >= 0 and e.token_words[t] >= 0})
        if spans:
          words.append(spans)
      predictions.append(words)
    golds = [[list(c) for c in e.gold_words] for e in examples]
    scores = coref_scores(golds=golds, predictions=predictions,
                          singletons=self.run_settings.singletons)
    metrics = {f"{m}_{x}": scores[m][x] for m in METRICS for x in ("p", "r", "f1")}
    metrics["conll_f1"] = scores["conll_f1"]
    records = [{"id": i, "clusters": [[list(s) for s in c] for c in p],
                "gold": [[list(s) for s in c] for c in g]}
               for i, p, g in zip(ids, predictions, golds)]
    return metrics, records

  # The head.

  def num_labels(self, splits, source):
    """No labels: the config's value is kept (unused)."""
    return source.config.num_labels

  def check_labels(self, split, config: LongformerConfig):
    del split, config


def trivial_scores(path: str | os.PathLike, *, singletons: bool = True) -> dict[str, Any]:
  """The scores of the trivial predictor on a coreference file: every gold mention its own
  cluster (no links): the baseline the docs report beside a trained model."""
  documents = read_documents(path)
  golds = [[list(c) for c in document_words(d)[3]] for d in documents]
  predictions = [[[m] for c in g for m in c] for g in golds]
  return coref_scores(golds=golds, predictions=predictions, singletons=singletons)

