"""WikiHop's own model as a fine-tuning kind (`--task wikihop`, paper §6): the query and every
candidate in one row, global attention on that prefix, each candidate scored at its `[ent]`
marker (`longformer_jax.wikihop.LongformerForWikiHop`), chunk-and-sum when the supports do not
fit one row, the four marker tokens new rows of the vocabulary, and the candidates and supports
laid out in a new order every epoch. The records and rows are `longformer_jax.data.wikihop`'s.
Importing `longformer_jax.tasks.finetune` registers the kind.

The segment baseline (`FinetuneOptions` baseline "segments", the paper's RoBERTa reading of
WikiHop): the same chunk-and-sum with rows of `segment_length` tokens, each row the prefix and
one segment of the supports, read on its own (positions restart, global attention on each row's
prefix as the run's mode says), the candidates' scores summed over the segments. The kind reads
it itself (`Kind.reads_segments`): the model, its parameters and the batches are the
Longformer's, only the rows are shorter.

What the length limit cut (`fd.Truncation`): nothing of the supports (every chunk is read, in
either reading), so only a query cut by max_question_length counts; the evidence is the answer
candidate named in a kept support (`_named_in`, as multiple choice: a text record's answer text,
case folded, inside a support's text; an id record's answer ids as a run inside a support's).

Shape letters: B batch, K chunks, N positions, C candidates.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from longformer_jax.data import finetune_data as fd
from longformer_jax.data import text
from longformer_jax.data import wikihop as wd
from longformer_jax.tasks.finetune_kinds import (
    SettingsKind, _choices, check_segment_settings, _float, _named_in, register)
from longformer_jax.training import examples as example_batches
from longformer_jax.wikihop import LongformerForWikiHop

__all__ = ["WikiHop", "WikiHopSettings"]


@dataclasses.dataclass(frozen=True)
class WikiHopSettings:
  """What of the run's `FinetuneOptions` the kind reads: segment_length from baseline
  "segments" (the rows' length), None for rows of max_length."""
  segment_length: int | None = None

  @classmethod
  def of(cls, options) -> WikiHopSettings:
    """The settings of `options`; ValueError for a segment setting WikiHop cannot honour (its
    segments share no token and pool nothing: each is scored at its own markers)."""
    if options.baseline != "segments":
      return cls()
    check_segment_settings(
        options, "wikihop", overlap="its supports in segments that share no token "
        "(chunk-and-sum)", pool="sums its candidates' scores over the segments")
    return cls(segment_length=options.segment_length)


@register
class WikiHop(SettingsKind):
  """wikihop: QAngaroo's records (`data.wikihop`: a JSON array or JSONL, text or ids) as
  `<s> [q] query [/q] [ent] c1 [/ent] ... </s> supports </s>` rows, chunked when the supports
  exceed max_length (each chunk with the prefix, candidate scores summed over chunks); global
  attention on the whole prefix by default ("first": `<s>` only). LongformerForWikiHop: a
  bias-free linear score at each candidate's `[ent]`. Metric: accuracy. Records {"id",
  "prediction", "label", "scores", "chunks"} (candidate indices in the file's order, one score per
  candidate, the rows read).

  The markers `[q] [/q] [ent] [/ent]` (`new_tokens`) are the last four rows of the model's
  vocabulary: a run from a model without them grows its table (`convert.extend_vocabulary`: new
  rows from the table's statistics, old rows bit-identical), and saves and reloads the grown
  model. Training lays each example out in a new order of its candidates and supports every
  epoch (seeded by the run's seed, the epoch and the example); evaluation in the file's order.
  """
  name = "wikihop"
  model_class = LongformerForWikiHop
  default_global = "question"
  has_question = True
  required = {"query": (str, list), "candidates": list, "answer": (str, int)}
  documents = {"supports": list, "input_ids": list}
  metrics = ("accuracy",)
  new_tokens = wd.MARKERS
  reads_segments = True
  settings_class = WikiHopSettings

  def configured(self, options):
    """The kind reading the rows `options` asks for (`WikiHopSettings.of`): itself for rows of
    max_length."""
    settings = WikiHopSettings.of(options)
    return self if settings == self.run_settings else type(self)(settings)

  def row_length(self, max_length: int) -> int:
    """The length of the example's rows: segment_length under the segment baseline, else the
    run's max_length."""
    return self.run_settings.segment_length or max_length

  @property
  def _row_setting(self) -> str:
    return "segment_length" if self.run_settings.segment_length else "max_length"

  def read_records(self, path, schema, *, optional, unique):
    """QAngaroo's JSON array or JSONL (`data.wikihop.read_records`)."""
    return wd.read_records(path, schema, optional=optional, unique=unique)

  def featurise(self, reader, record, by_text):
    fields = record.fields
    query = fields["query"]
    if by_text != isinstance(query, str):
      raise reader.error(record, "query", "must be a string in text records and a list of token "
                         "ids in input_ids records")
    full_query = (reader.encode(record, "query", query)[0] if by_text
                  else reader.ids(record, "query", query))
    query = full_query[:reader.max_question_length]
    candidates = fields["candidates"]
    if len(candidates) < 2:
      raise reader.error(record, "candidates", f"needs at least 2 candidates, got "
                         f"{len(candidates)}")
    cands = tuple(self._piece(reader, record, "candidates", i, c, by_text)[0]
                  for i, c in enumerate(candidates))
    supports = fields["supports" if by_text else "input_ids"]
    if not supports:
      raise reader.error(record, "supports" if by_text else "input_ids",
                         "is empty (a record needs at least one support)")
    pieces = [self._piece(reader, record, "supports" if by_text else "input_ids", i, d, by_text)
              for i, d in enumerate(supports)]
    docs = tuple(ids for ids, _ in pieces)
    answer = fields["answer"]
    if by_text:
      if answer not in candidates:
        raise reader.error(record, "answer", f"is {answer!r}, not one of the candidates "
                           f"{candidates[:10]}"[:300])
      label = candidates.index(answer)
    elif not isinstance(answer, int):
      raise reader.error(record, "answer", f"must be the right candidate's index in input_ids "
                         f"records, got {answer!r}"[:300])
    else:
      label = reader.label(record, "answer", below=len(candidates))
    try:
      rows = wd.layout(query, cands, docs, reader.specials,
                       max_length=self.row_length(reader.max_length), name=self._row_setting)
    except ValueError as e:
      raise reader.error(record, "candidates", f"{e} (raise {self._row_setting} or lower "
                         f"max_question_length)") from None
    # Every support is read (chunks, not a cut): only the query loses tokens.
    support_tokens = sum(len(d) for d in docs)
    named = [_named_in(candidates[label] if by_text else cands[label], ids, offsets,
                       text_ if by_text else None, len(ids))
             for (ids, offsets), text_ in zip(pieces, supports)]
    evidence = (True if any(named) else False if any(n is not None for n in named) else None)
    truncation = fd.Truncation(
        full_length=rows.prefix_length + len(full_query) - len(query) + 2
        + rows.document_tokens, document_tokens=support_tokens, kept_tokens=support_tokens,
        prefix_cut=len(full_query) > len(query), evidence=evidence)
    return wd.WikiHopExample(
        record.line, rows.rows, question_end=rows.prefix_length, label=label,
        gold=candidates[label], query=query, candidates=cands, supports=docs,
        entity_positions=rows.entity_positions, document_tokens=rows.document_tokens,
        truncation=truncation)

  @staticmethod
  def _piece(reader, record, field: str, i: int, value, by_text: bool
             ) -> tuple[np.ndarray, np.ndarray | None]:
    """(ids, character offsets or None) of one candidate or support (a non-empty string, or
    ids)."""
    if not by_text:
      return reader.ids(record, field, value, what=f"element {i}"), None
    if not isinstance(value, str) or not value.strip():
      raise reader.error(record, field, f"element {i} must be a non-empty string, got "
                         f"{value!r}"[:300])
    return reader.encode(record, field, value)

  def split_fields(self, records, examples, label_names):
    return {"num_choices": max(len(e.candidates) for e in examples),
            "num_chunks": max(len(e.input_ids) for e in examples)}

  # Arrays.

  def batch(self, split, rows, *, global_attention, specials, epochs=None, seed=0):
    """input_ids, attention_mask, global_attention_mask [B, K, N] (K = split.num_chunks; marker
    placeholders negative, `data.wikihop.resolve_markers`), then `targets`. Filler rows (an
    example with fewer chunks) are `<s></s>`, masked out by chunk_mask.

    epochs: None (the file's order), or per row the training epoch: the example's candidates
    and supports are laid out in an order drawn from (seed, epoch, example index).
    """
    laid = [self._layout(split, i, specials, None if epochs is None else (seed, epochs[j], i))
            for j, i in enumerate(rows)]
    k, n = split.num_chunks, self.row_length(split.max_length)
    filler = np.asarray([specials.bos, specials.eos], np.int32)
    seqs, globals_BK = [], []
    for e, (layout, _) in zip((split.examples[i] for i in rows), laid):
      seqs += list(layout.rows) + [filler] * (k - len(layout.rows))
      globals_BK += [e.global_lengths(global_attention)[0]] * len(layout.rows)
      globals_BK += [0] * (k - len(layout.rows))
    arrays = fd.encoder_arrays(seqs, globals_BK, n, specials.pad)
    shape = (len(rows), k, n)
    return {**{name: x.reshape(shape) for name, x in arrays.items()},
            **self._targets(split, laid)}

  @staticmethod
  def _file_order(e: wd.WikiHopExample) -> tuple[wd.Layout, int]:
    return wd.Layout(e.input_ids, e.question_end, e.entity_positions, e.document_tokens), e.label

  def _layout(self, split, index: int, specials, key) -> tuple[wd.Layout, int]:
    """(layout, label) of example `index`: the file's order (key None), else the order drawn
    from key = (seed, epoch, index)."""
    e = split.examples[index]
    if key is None:
      return self._file_order(e)
    rng = np.random.default_rng([int(x) for x in key])
    order = rng.permutation(len(e.candidates))
    supports = [e.supports[s] for s in rng.permutation(len(e.supports))]
    layout = wd.layout(e.query, [e.candidates[c] for c in order], supports, specials,
                       max_length=self.row_length(split.max_length))
    return layout, int(np.flatnonzero(order == e.label)[0])

  def _targets(self, split, laid) -> dict[str, np.ndarray]:
    c, k = split.num_choices, split.num_chunks
    positions_BxC = np.zeros((len(laid), c), np.int32)
    candidates_BxC = np.zeros((len(laid), c), np.int32)
    chunks_BxK = np.zeros((len(laid), k), np.int32)
    for row, (layout, _) in enumerate(laid):
      count = len(layout.entity_positions)
      positions_BxC[row, :count] = layout.entity_positions
      candidates_BxC[row, :count] = 1
      chunks_BxK[row, :len(layout.rows)] = 1
    return {"candidate_positions": positions_BxC, "candidate_mask": candidates_BxC,
            "chunk_mask": chunks_BxK,
            "labels": np.asarray([label for _, label in laid], np.int32)}

  def targets(self, split, examples):
    """candidate_positions, candidate_mask [B, C], chunk_mask [B, K], labels [B] (the file's
    order)."""
    return self._targets(split, [self._file_order(e) for e in examples])

  def training_batches(self, split, rows, *, global_attention, specials, seed, **sampler_args):
    """`batch` of each training batch with its rows' epochs: a new order every epoch."""
    return _EpochBatches(
        lambda batch_rows, epochs: self.batch(split, batch_rows,
                                              global_attention=global_attention,
                                              specials=specials, epochs=epochs, seed=seed),
        rows, seed=seed, **sampler_args)

  # The model.

  def logits(self, model, batch, max_global):
    """logits [B, C] (filler candidates: -1e9), the markers resolved against the model's
    vocabulary."""
    out = model(wd.resolve_markers(jnp.asarray(batch["input_ids"]), model.config.vocab_size),
                batch["attention_mask"], batch["global_attention_mask"],
                candidate_positions=batch["candidate_positions"],
                candidate_mask=batch["candidate_mask"], chunk_mask=batch["chunk_mask"],
                max_global=max_global)
    return {"logits": _float(out.logits)}

  def score(self, split, examples, ids, outputs):
    logits = outputs["logits"]
    metrics, _, _, records = _choices(examples, ids, logits)
    for record, e, row in zip(records, examples, logits):
      record["scores"] = [float(x) for x in row[:len(e.candidates)]]
      record["chunks"] = len(e.input_ids)
    return metrics, records

  def num_labels(self, splits, source):
    """One score per candidate: the config's value is kept (unused)."""
    return source.config.num_labels


class _EpochBatches(example_batches.ExampleBatches):
  """`ExampleBatches` whose `make` also gets each row's epoch (the sampler's position in the
  example stream, divided by the number of examples)."""

  def __next__(self) -> dict[str, np.ndarray]:
    step = self.step
    local = text.ExampleSampler.__next__(self)
    first = step * self.global_batch_size + self.process_index * self.local_batch_size
    epochs = (first + np.arange(len(local))) // self.num_examples
    return self._make([self._rows[i] for i in local], [int(x) for x in epochs])
