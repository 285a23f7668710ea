"""The segment baseline of the paper's fine-tuning comparison (§6): an encoder reads a document in
segments, each on its own, and the states are stitched back to document positions.

A document of B examples, ids [B, N] with a mask (each row's real tokens first), and an optional
prefix (the question, [B, Q] with a mask) become S segments per example, each one row of length L
(`segment_length`, 512 by default: a RoBERTa's positions):

    <s> prefix </s></s> segment </s> <pad>...      (with a prefix)
    <s> segment </s> <pad>...                      (without one: the plain classification row)
    <s> prefix segment </s> <pad>...               (`separate_prefix=False`: a prefix that ends
                                                    with its own marker, HotpotQA's
                                                    `[q] question [/q]`)

All rows of a batch go through the encoder as one batch [B*S, L] (example b's segments are rows
b*S .. b*S + S - 1). Every row is a sequence of its own: its positions restart (RoBERTa positions
come from the row's pad tokens), and no token of one segment sees any token of another. Run with
a short model (an HF RoBERTa, one of ours) this is the paper's baseline; run with a long model it
is that model denied any reach across segments.

Each example's segments are as long as its row allows: `room = L - (1 + q + 2) - 1` document
tokens with a q-token prefix (`L - (1 + q) - 1` with `separate_prefix=False`, `L - 2` without a
prefix). With `overlap` k, consecutive segments share k tokens (segment s starts at
`s * (room - k)`); each document position then takes its state from the segment where it is most
central: the one maximising min(tokens before it, tokens after it) within the segment, the
earlier segment on a tie. Without overlap every position lies in exactly one segment. Shapes
are static: S is what the longest document of N tokens needs with the longest prefix of Q
tokens, capped at `max_segments`; an example needs fewer segments (its other rows are read as
empty segments and masked out, `segment_mask`), and with `max_segments` the segments past the
cap are not read: their tokens are cut (`kept`, `kept_tokens`), the truncation a fine-tuning
result reports.

What the task heads use:
  * `stitch(rows, layout)`: any per-row-position values [B*S, L, ...] (states, logits) at
    document positions [B, N, ...]; not-kept positions get `fill`.
  * `document_logits`: per-row logits (QA start or end) over the stitched document, not-kept
    positions at the dtype's lowest value: one softmax per example across all its segments, and
    the best span over the stitched document, are then the caller's.
  * `prefix_states`: the prefix's states per segment [B, S, Q, ...].
  * `pool`: classification on the first segment's `<s>` ("first", the default) or the mean of
    every read segment's `<s>` ("mean"); the paper does not say which its baseline used.
  * `sum_over_segments`: per-segment scores [B, S, ...] (multiple choice, WikiHop's candidates)
    summed over the read segments.

`segment_layout` and the functions above are pure (jit-able, every shape static); `encode_segments`
runs any encoder callable on a layout; `SegmentEncoder` is a thin NNX wrapper holding the
encoder and the settings. Shape letters: B batch, N document tokens, Q prefix tokens, S segments
per example, L row length, E hidden size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longformer_jax.ops.validation import is_traced

GLOBAL_MODES = ("none", "first", "question")
POOL_MODES = ("first", "mean")


class Specials(Protocol):
  """The special ids rows are built with: `data.tokenizer.SpecialIds` (e.g.
  `SpecialIds.of_config(model.config)`) or anything with these attributes."""
  bos: int
  eos: int
  sep: int
  pad: int


@flax.struct.dataclass
class SegmentLayout:
  """Where every document token goes: the rows to encode and the map back.

  input_ids, attention_mask, global_attention_mask: int32 [B*S, L], the encoder's input.
  segment_mask: bool [B, S], the segment is read (it exists for the example and is within
    `max_segments`).
  starts, lengths: int32 [B, S], each segment's first document position and document tokens.
  heads: int32 [B], the row position of the first document token (1 + q + 2; 1 + q without
    the `</s></s>` separator; 1 without a prefix).
  prefix_lengths: int32 [B], q (0 without a prefix).
  document_lengths: int32 [B], the document's real tokens.
  segments_needed: int32 [B], the segments the whole document needs (may exceed S with
    `max_segments`).
  source: int32 [B, N], the segment each document position takes its state from, -1 where the
    position is not kept (cut, or padding).
  kept: bool [B, N], the position is a real document token that a read segment holds.
  num_segments (S), segment_length (L), has_prefix, prefix_width (Q, 0 without a prefix):
    static.
  """
  input_ids: jax.Array
  attention_mask: jax.Array
  global_attention_mask: jax.Array
  segment_mask: jax.Array
  starts: jax.Array
  lengths: jax.Array
  heads: jax.Array
  prefix_lengths: jax.Array
  document_lengths: jax.Array
  segments_needed: jax.Array
  source: jax.Array
  kept: jax.Array
  num_segments: int = flax.struct.field(pytree_node=False, default=1)
  segment_length: int = flax.struct.field(pytree_node=False, default=512)
  has_prefix: bool = flax.struct.field(pytree_node=False, default=False)
  prefix_width: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def kept_tokens(self) -> jax.Array:
    """int32 [B]: the document tokens the segments read (their union, overlap counted once)."""
    return jnp.sum(self.kept, axis=1, dtype=jnp.int32)

  @property
  def row_positions(self) -> jax.Array:
    """int32 [B, N]: the row position of each kept document position's state (in its `source`
    segment), 0 where not kept."""
    starts_BxN = jnp.take_along_axis(self.starts, jnp.maximum(self.source, 0), axis=1)
    pos_N = jnp.arange(self.source.shape[1], dtype=jnp.int32)
    return jnp.where(self.kept, self.heads[:, None] + pos_N[None, :] - starts_BxN, 0)


def _int(name: str, value, minimum: int) -> int:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
  return int(value)


def _ids(name: str, x, ndim: int = 2) -> jax.Array:
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must hold integer token ids; got dtype {x.dtype}")
  if x.ndim != ndim:
    raise ValueError(f"{name} must have shape [batch, tokens]; got shape {x.shape}")
  return x.astype(jnp.int32)


def _lengths(name: str, mask, shape: tuple[int, int]) -> jax.Array:
  """Real tokens per row of `mask` [B, T] (default all real); a concrete mask must hold its real
  tokens first (0/1 values, no 1 after a 0)."""
  if mask is None:
    return jnp.full((shape[0],), shape[1], jnp.int32)
  mask = jnp.asarray(mask)
  if mask.shape != shape:
    raise ValueError(f"{name} has shape {mask.shape}; expected {shape}, the shape of its ids")
  if not is_traced(mask):
    m = np.asarray(mask)
    if not np.isin(m, (0, 1)).all():
      raise ValueError(f"{name} must hold 0 and 1 (or bools)")
    if (np.diff(m.astype(np.int8), axis=1) > 0).any():
      row = int(np.flatnonzero((np.diff(m.astype(np.int8), axis=1) > 0).any(axis=1))[0])
      raise ValueError(f"{name} row {row} has a real token after padding: each row's real "
                       "tokens must come first")
  return jnp.sum(mask != 0, axis=1, dtype=jnp.int32)


def segments_for(document_tokens: int, room: int, overlap: int = 0) -> int:
  """Segments of `room` document tokens, consecutive ones sharing `overlap`, that read
  `document_tokens` tokens (at least 1)."""
  stride = room - overlap
  return 1 + max(0, -(-(document_tokens - room) // stride))


def segment_layout(document_ids, document_mask=None, *, prefix_ids=None, prefix_mask=None,
                   specials: Specials, segment_length: int = 512, overlap: int = 0,
                   max_segments: int | None = None, global_mode: str = "none",
                   separate_prefix: bool = True, document_global=None) -> SegmentLayout:
  """The rows that read `document_ids` in segments, and the map back (module docstring).

  Args:
    document_ids: int [B, N], each example's document tokens (no special tokens), real ones
      first.
    document_mask: [B, N] 0/1, 1 for real tokens; default all real.
    prefix_ids: int [B, Q], what precedes every segment (the question; for multiple choice the
      question `</s></s>` the candidate), or None for rows without a prefix.
    prefix_mask: [B, Q] 0/1; default all real.
    specials: `bos`, `eos`, `sep`, `pad` ids (`Specials`).
    segment_length: L, the length of a row, special tokens and prefix included.
    overlap: document tokens consecutive segments share (0: none).
    max_segments: read at most this many segments per example (the rest is cut); default all.
    global_mode: the global tokens of every row: "none", "first" (`<s>`), or "question"
      (`<s>` and the prefix, as the data layer's mode of that name).
    separate_prefix: `</s></s>` between the prefix and the segment (True, RoBERTa's pair row);
      False puts the segment right after the prefix, so that a document that fits one segment
      is read in the very row a whole-row reader reads (HotpotQA's `<s> [q] question [/q]
      [p] ...`).
    document_global: [B, N] 0/1, document tokens that attend globally in the segment that holds
      them (HotpotQA's [p] / [s] markers), besides global_mode's; default none.
  """
  ids_BxN = _ids("document_ids", document_ids)
  batch, n = ids_BxN.shape
  d_B = _lengths("document_mask", document_mask, (batch, n))
  has_prefix = prefix_ids is not None
  if has_prefix:
    prefix_BxQ = _ids("prefix_ids", prefix_ids)
    if prefix_BxQ.shape[0] != batch:
      raise ValueError(f"prefix_ids has {prefix_BxQ.shape[0]} rows for {batch} documents")
    q_B = _lengths("prefix_mask", prefix_mask, prefix_BxQ.shape)
  elif prefix_mask is not None:
    raise ValueError("prefix_mask was given without prefix_ids")
  else:
    prefix_BxQ, q_B = jnp.zeros((batch, 1), jnp.int32), jnp.zeros((batch,), jnp.int32)
  q_max = prefix_BxQ.shape[1] if has_prefix else 0
  length = _int("segment_length", segment_length, 1)
  overlap = _int("overlap", overlap, 0)
  if max_segments is not None:
    max_segments = _int("max_segments", max_segments, 1)
  if global_mode not in GLOBAL_MODES:
    raise ValueError(f"global_mode must be one of {GLOBAL_MODES}, got {global_mode!r}")
  if not isinstance(separate_prefix, bool):
    raise TypeError(f"separate_prefix must be a bool, got {separate_prefix!r}")
  if document_global is not None:
    document_global = jnp.asarray(document_global)
    if document_global.shape != (batch, n):
      raise ValueError(f"document_global has shape {document_global.shape}; expected "
                       f"{(batch, n)}, the shape of document_ids")
  specials_of = {}
  for name in ("bos", "eos", "sep", "pad"):
    value = getattr(specials, name, None)
    specials_of[name] = _int(f"specials.{name}", value, 0)
  # The worst case (the longest prefix) sets the static number of segments.
  separated = has_prefix and separate_prefix
  extra = 3 if separated else 1  # <s> </s></s> or <s>, before the segment
  room_min = length - extra - q_max - 1
  if room_min < overlap + 1:
    before = "<s>"
    if has_prefix:
      before = f"<s>, a prefix of up to {q_max} tokens" + (", </s></s>" if separated else "")
    raise ValueError(f"segment_length={length} leaves {room_min} document tokens per segment "
                     f"after {before} and </s>; it must leave more than overlap={overlap}")
  num_segments = segments_for(n, room_min, overlap)
  if max_segments is not None:
    num_segments = min(num_segments, max_segments)
  s_S = jnp.arange(num_segments, dtype=jnp.int32)
  j_L = jnp.arange(length, dtype=jnp.int32)

  head_B = extra + q_B  # the row position of the first document token
  room_B = length - head_B - 1
  stride_B = room_B - overlap
  needed_B = 1 + jnp.maximum(0, -(-(d_B - room_B) // stride_B))
  segment_mask_BxS = s_S[None, :] < needed_B[:, None]
  starts_BxS = s_S[None, :] * stride_B[:, None]
  lengths_BxS = jnp.where(segment_mask_BxS,
                          jnp.clip(d_B[:, None] - starts_BxS, 0, room_B[:, None]), 0)

  # The rows [B, S, L], position by position.
  j = j_L[None, None, :]
  head = head_B[:, None, None]
  end = head + lengths_BxS[:, :, None]  # the row position of </s>
  doc_index = starts_BxS[:, :, None] + j - head
  doc_tokens = jnp.take_along_axis(ids_BxN[:, None, :].repeat(num_segments, 1),
                                   jnp.clip(doc_index, 0, n - 1), axis=2)
  prefix_tokens = jnp.take_along_axis(
      prefix_BxQ[:, None, :], jnp.clip(j - 1, 0, prefix_BxQ.shape[1] - 1), axis=2)
  q = q_B[:, None, None]
  ids = jnp.full((batch, num_segments, length), specials_of["pad"], jnp.int32)
  ids = jnp.where((j >= head) & (j < end), doc_tokens, ids)
  ids = jnp.where(j == end, specials_of["eos"], ids)
  if has_prefix:
    ids = jnp.where((j >= 1) & (j <= q), prefix_tokens, ids)
  if separated:
    ids = jnp.where((j == q + 1) | (j == q + 2), specials_of["sep"], ids)
  ids = jnp.where(j == 0, specials_of["bos"], ids)
  mask = (j <= end).astype(jnp.int32)
  if global_mode == "none":
    global_ = jnp.zeros_like(mask)
  elif global_mode == "first":
    global_ = jnp.broadcast_to(j == 0, mask.shape).astype(jnp.int32)
  else:
    global_ = jnp.broadcast_to(j <= q, mask.shape).astype(jnp.int32)
  if document_global is not None:
    doc_global = jnp.take_along_axis(
        (document_global != 0).astype(jnp.int32)[:, None, :].repeat(num_segments, 1),
        jnp.clip(doc_index, 0, n - 1), axis=2)
    global_ = jnp.where((j >= head) & (j < end), global_ | doc_global, global_)

  # Each document position's segment: the read one where it is most central (earliest on ties).
  p_N = jnp.arange(n, dtype=jnp.int32)
  p = p_N[None, :, None]
  starts = starts_BxS[:, None, :]
  ends = starts + lengths_BxS[:, None, :]  # one past the segment's last document position
  inside_BxNxS = (p >= starts) & (p < ends) & segment_mask_BxS[:, None, :]
  centrality = jnp.where(inside_BxNxS, jnp.minimum(p - starts, ends - 1 - p), -1)
  kept_BxN = jnp.any(inside_BxNxS, axis=2)
  source_BxN = jnp.where(kept_BxN, jnp.argmax(centrality, axis=2).astype(jnp.int32), -1)

  rows = batch * num_segments
  return SegmentLayout(
      input_ids=ids.reshape(rows, length), attention_mask=mask.reshape(rows, length),
      global_attention_mask=global_.reshape(rows, length), segment_mask=segment_mask_BxS,
      starts=starts_BxS, lengths=lengths_BxS.astype(jnp.int32), heads=head_B.astype(jnp.int32),
      prefix_lengths=q_B, document_lengths=d_B, segments_needed=needed_B.astype(jnp.int32),
      source=source_BxN, kept=kept_BxN, num_segments=num_segments, segment_length=length,
      has_prefix=has_prefix, prefix_width=q_max)


def _by_segment(rows, layout: SegmentLayout) -> jax.Array:
  """[B*S, L, ...] or [B, S, L, ...] values as [B, S, L, ...]."""
  rows = jnp.asarray(rows)
  b, s, length = layout.segment_mask.shape[0], layout.num_segments, layout.segment_length
  if rows.ndim >= 3 and rows.shape[:3] == (b, s, length):
    return rows
  if rows.ndim < 2 or rows.shape[:2] != (b * s, length):
    raise ValueError(f"expected per-row values [B*S, L, ...] with S={s}, L={length} (or "
                     f"[B, S, L, ...]); got shape {rows.shape}")
  return rows.reshape(b, s, *rows.shape[1:])


def stitch(rows, layout: SegmentLayout, *, fill=0) -> jax.Array:
  """Per-row-position values (states [B*S, L, E], logits [B*S, L], or [B, S, L, ...]) at
  document positions [B, N, ...]: each position's from its `layout.source` segment (the most
  central one), `fill` where the position is not kept."""
  rows_BxSxLx = _by_segment(rows, layout)
  b, s, length = rows_BxSxLx.shape[:3]
  trailing = rows_BxSxLx.shape[3:]
  flat = rows_BxSxLx.reshape(b, s * length, *trailing)
  index_BxN = jnp.maximum(layout.source, 0) * length + layout.row_positions
  index = index_BxN.reshape(*index_BxN.shape, *(1,) * len(trailing))
  out = jnp.take_along_axis(flat, index, axis=1)
  kept = layout.kept.reshape(*layout.kept.shape, *(1,) * len(trailing))
  return jnp.where(kept, out, jnp.asarray(fill, out.dtype))


def document_logits(row_logits, layout: SegmentLayout) -> jax.Array:
  """Per-row logits [B*S, L] (a QA head's start or end) over the stitched document [B, N], the
  positions not kept at the dtype's lowest value: a softmax over axis 1 is then one softmax per
  example across all its segments (the paper's baseline), and no span starts or ends outside
  what was read."""
  logits = jnp.asarray(row_logits)
  low = jnp.finfo(logits.dtype).min if jnp.issubdtype(logits.dtype, jnp.floating) else 0
  return stitch(logits, layout, fill=low)


def prefix_states(rows, layout: SegmentLayout) -> jax.Array:
  """The prefix's values in every segment, [B, S, Q, ...] (zeros past each prefix's length)."""
  if not layout.has_prefix:
    raise ValueError("this layout has no prefix")
  rows_BxSxLx = _by_segment(rows, layout)
  width = layout.prefix_width
  out = rows_BxSxLx[:, :, 1:1 + width]  # the prefix occupies row positions 1 .. q
  valid_BxQ = jnp.arange(width)[None, :] < layout.prefix_lengths[:, None]
  valid = valid_BxQ.reshape(valid_BxQ.shape[0], 1, width, *(1,) * (out.ndim - 3))
  return jnp.where(valid, out, jnp.zeros((), out.dtype))


def segment_starts(rows, layout: SegmentLayout) -> jax.Array:
  """Every segment's `<s>` value [B, S, ...] (position 0 of its row)."""
  return _by_segment(rows, layout)[:, :, 0]


def pool(rows, layout: SegmentLayout, mode: str = "first") -> jax.Array:
  """The classification input [B, ...] from the rows' `<s>` values: the first segment's
  ("first", the default), or the mean over the read segments ("mean")."""
  if mode not in POOL_MODES:
    raise ValueError(f"segment pool must be one of {POOL_MODES}, got {mode!r}")
  firsts_BxSx = segment_starts(rows, layout)
  if mode == "first":
    return firsts_BxSx[:, 0]
  return sum_over_segments(firsts_BxSx, layout) / jnp.sum(
      layout.segment_mask, axis=1).reshape(-1, *(1,) * (firsts_BxSx.ndim - 2)).astype(
          firsts_BxSx.dtype)


def sum_over_segments(scores, layout: SegmentLayout) -> jax.Array:
  """Per-segment scores [B, S, ...] (or [B*S, ...]) summed over each example's read segments
  [B, ...] (multiple choice and WikiHop: a candidate's score is its sum over the chunks)."""
  scores = jnp.asarray(scores)
  s = layout.num_segments
  if scores.shape[:2] != layout.segment_mask.shape:
    if scores.ndim < 1 or scores.shape[0] != layout.segment_mask.size:
      raise ValueError(f"expected per-segment scores [B, S, ...] or [B*S, ...] with S={s}; got "
                       f"shape {scores.shape}")
    scores = scores.reshape(scores.shape[0] // s, s, *scores.shape[1:])
  read = layout.segment_mask.reshape(*layout.segment_mask.shape, *(1,) * (scores.ndim - 2))
  return jnp.sum(jnp.where(read, scores, jnp.zeros((), scores.dtype)), axis=1)


def reading_stats(layout: SegmentLayout) -> dict[str, np.ndarray]:
  """What the segments read, per example (numpy, for the truncation report):
  `document_tokens` (the real tokens), `kept_tokens` (those a read segment holds),
  `segments_needed`, `segments_read`."""
  return {"document_tokens": np.asarray(layout.document_lengths),
          "kept_tokens": np.asarray(layout.kept_tokens),
          "segments_needed": np.asarray(layout.segments_needed),
          "segments_read": np.asarray(jnp.sum(layout.segment_mask, axis=1, dtype=jnp.int32))}


# ----------------------------------------------------------------------------------------------
# Running an encoder on the segments.


@flax.struct.dataclass
class SegmentOutput:
  """What `encode_segments` returns.

  last_hidden_state: [B, N, E], the stitched document states (zeros where not kept).
  row_states: [B, S, L, E], every row's states (for heads that read other positions).
  prefix_states: [B, S, Q, E] or None (no prefix).
  segment_starts: [B, S, E], every segment's `<s>` state.
  layout: the `SegmentLayout` (kept, segment_mask, the map back).
  """
  last_hidden_state: jax.Array
  row_states: jax.Array
  prefix_states: jax.Array | None
  segment_starts: jax.Array
  layout: SegmentLayout


def _states(out) -> jax.Array:
  return out.last_hidden_state if hasattr(out, "last_hidden_state") else jnp.asarray(out)


def encode_segments(encoder: Callable[..., Any], document_ids, document_mask=None, *,
                    prefix_ids=None, prefix_mask=None, specials: Specials,
                    segment_length: int = 512, overlap: int = 0, max_segments: int | None = None,
                    global_mode: str = "none", separate_prefix: bool = True,
                    document_global=None, **encoder_kwargs) -> SegmentOutput:
  """Runs `encoder` on the segments of a document (`segment_layout`'s arguments) as one batch.

  encoder: called as `encoder(input_ids [B*S, L], attention_mask [B*S, L],
    global_attention_mask [B*S, L] or None, **encoder_kwargs)`, returning states [B*S, L, E] or
    an object with `last_hidden_state` (a `LongformerModel`, a model's `.longformer`). With
    global tokens, `max_global` (1, 1 + Q, or L with `document_global`) is passed unless
    encoder_kwargs sets it.
  """
  layout = segment_layout(document_ids, document_mask, prefix_ids=prefix_ids,
                          prefix_mask=prefix_mask, specials=specials,
                          segment_length=segment_length, overlap=overlap,
                          max_segments=max_segments, global_mode=global_mode,
                          separate_prefix=separate_prefix, document_global=document_global)
  global_mask = None
  if global_mode != "none" or document_global is not None:
    global_mask = layout.global_attention_mask
    bound = {"none": 0, "first": 1, "question": 1 + layout.prefix_width}[global_mode]
    encoder_kwargs.setdefault(
        "max_global", layout.segment_length if document_global is not None else bound)
  states = _states(encoder(layout.input_ids, layout.attention_mask, global_mask,
                           **encoder_kwargs))
  rows_BxSxLxE = _by_segment(states, layout)
  prefix = prefix_states(rows_BxSxLxE, layout) if layout.has_prefix else None
  return SegmentOutput(last_hidden_state=stitch(rows_BxSxLxE, layout), row_states=rows_BxSxLxE,
                       prefix_states=prefix, segment_starts=rows_BxSxLxE[:, :, 0],
                       layout=layout)


@dataclasses.dataclass(frozen=True)
class _SpecialIds:
  bos: int
  eos: int
  sep: int
  pad: int


class SegmentEncoder(nnx.Module):
  """An encoder that reads documents in segments (`encode_segments`): holds the encoder (e.g. a
  task model's `.longformer`) and the layout settings; its parameters are the encoder's.

      seg = SegmentEncoder(model.longformer, specials=SpecialIds.of_config(model.config),
                           segment_length=512)
      out = seg(document_ids, document_mask, prefix_ids=question_ids, prefix_mask=question_mask)
      logits_BxN = document_logits(model.qa_outputs(out.row_states)[..., 0], out.layout)
  """

  def __init__(self, encoder: nnx.Module, *, specials: Specials, segment_length: int = 512,
               overlap: int = 0, max_segments: int | None = None, global_mode: str = "none",
               separate_prefix: bool = True):
    self.encoder = encoder
    self.settings = dict(specials=_SpecialIds(*(int(getattr(specials, k))
                                                for k in ("bos", "eos", "sep", "pad"))),
                         segment_length=segment_length, overlap=overlap,
                         max_segments=max_segments, global_mode=global_mode,
                         separate_prefix=separate_prefix)

  def __call__(self, document_ids, document_mask=None, *, prefix_ids=None, prefix_mask=None,
               document_global=None, **encoder_kwargs) -> SegmentOutput:
    return encode_segments(self.encoder, document_ids, document_mask, prefix_ids=prefix_ids,
                           prefix_mask=prefix_mask, document_global=document_global,
                           **self.settings, **encoder_kwargs)


__all__ = ["GLOBAL_MODES", "POOL_MODES", "SegmentEncoder", "SegmentLayout", "SegmentOutput",
           "document_logits", "encode_segments", "pool", "prefix_states", "reading_stats",
           "segment_layout", "segment_starts", "segments_for", "stitch", "sum_over_segments"]
