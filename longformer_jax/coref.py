"""Coreference resolution on the Longformer encoder: the coarse-to-fine span-ranking model of Lee
et al. (2018), as Joshi et al. (2019) put it on BERT, with static shapes throughout (no
data-dependent Python loop, no gather of a data-dependent size), so a step compiles once per
padded length.

  CorefConfig               the encoder's config and the head's hyperparameters
  LongformerForCoreference  encoder + span scorer: kept spans, their antecedents and scores
  CorefOutput               what the model returns
  coref_loss                the marginal log-likelihood of the gold antecedents, per document
                            (optionally plus a mention-detection loss: `mention_weight`)
  antecedent_labels         which antecedents (dummy included) are gold
  gold_arrays               a document's gold clusters as the padded arrays the loss reads
  predict_clusters          clusters of the argmax links (transitive closure), per document

The model, per document of N tokens (no global attention):
  1. every span of up to W = max_span_width tokens within a sentence (`coref_spans.span_grid`:
     C = N * W candidates in a fixed layout, a validity mask for the rest);
  2. g = [x_start; x_end; width embedding; head], head = the softmax-weighted mean of the span's
     token states under a learned token score (online softmax over widths: no [C, W, E] tensor);
  3. mention score s_m = FFNN(g);
  4. the top floor(top_span_ratio * real tokens) spans by s_m (capped by max_top_spans) kept with
     `lax.top_k` over a static k (from the padded length) and a mask beyond each document's
     own count, then sorted by start, then end;
  5. coarse score s_m(i) + s_m(j) + g_i^T W_c g_j for kept j before i, and the top
     K = max_antecedents of them per span by `lax.top_k`;
  6. final score = coarse + FFNN([g_i; g_j; g_i * g_j; phi]), phi = the embeddings of the
     distance bucket (in kept spans, `coref_spans.distance_buckets`), same speaker (when
     `use_speakers` and speaker ids are given) and genre (when genre ids are given); a feature
     not given contributes zeros;
  7. a dummy antecedent ("no antecedent") scored 0 in column 0.
Left out from the reference code: the non-crossing constraint of its span pruning, higher-order
inference (coref_depth > 1) and the segment-distance feature. Memory: span embeddings and the
mention FFNN cover all C = N * W grid entries, valid or not (the reference keeps only valid
ones); at N = 4,096, W = 30, hidden 768 and FFNN width 3,000 that is about 1.1 GB of span
embeddings and 1.5 GB of FFNN activations per document in float32, and the pairwise FFNN input
[M, K, 3 U + 3 features] about 2.3 GB at M = 1,638, K = 50.

Shape letters: the alphabet of `longformer_jax.ops`, with `coref_spans`'s meanings (N tokens,
W widths, M kept spans, K antecedents per kept span), C candidate spans (N * W), U the span
embedding width (3 E + feature_size) and G gold mentions.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longformer_jax import coref_spans
from longformer_jax.config import LongformerConfig
from longformer_jax.layers import dense, embed
from longformer_jax.modeling import LongformerModel, check_ids
from longformer_jax.ops.validation import check_mask_values

__all__ = [
    "GENRES", "CorefConfig", "CorefOutput", "LongformerForCoreference", "antecedent_labels",
    "coref_loss", "genre_id", "gold_arrays", "predict_clusters",
]

# OntoNotes' genres, the first two letters of a document key (`bc/cctv/00/cctv_0000_0`).
GENRES = ("bc", "bn", "mz", "nw", "pt", "tc", "wb")

# The score of an antecedent that cannot be chosen (float32: exp underflows to exactly 0).
_NEG = -1e9


def genre_id(doc_key: str, genres: Sequence[str] = GENRES) -> int:
  """The index of a document's genre (its key's first two letters) in `genres`; 0 when the key
  names none of them (Joshi et al.'s fallback)."""
  genre = doc_key[:2]
  return genres.index(genre) if genre in genres else 0


def _positive_int(name: str, value: Any) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"CorefConfig.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class CorefConfig:
  """The coreference model's hyperparameters. Defaults are Joshi et al.'s BERT-base settings
  (independent.py / experiments.conf) as the Longformer paper reuses them; `tiny()` is a test
  size.

  Attributes:
    encoder: the Longformer encoder's config.
    max_span_width: W, the longest candidate span in tokens (30).
    top_span_ratio: spans kept per real token (0.4; `keep_count`); values above 1 are allowed
      (W keeps every candidate: no pruning).
    max_top_spans: the cap on kept spans per document (3,900).
    max_antecedents: K, the antecedents scored finely per kept span (50).
    ffnn_size, ffnn_depth: the hidden width and number of hidden layers of the mention and
      pairwise FFNNs (3,000 and 1).
    feature_size: the width of the width, distance, speaker and genre embeddings (20).
    num_genres: rows of the genre embedding (7: `GENRES`).
    use_speakers: a same-speaker feature in the pairwise score.
    dropout: the dropout rate of the head (0.3); the encoder's is `encoder.hidden_dropout_prob`.
  """

  encoder: LongformerConfig = dataclasses.field(default_factory=LongformerConfig)
  max_span_width: int = 30
  top_span_ratio: float = 0.4
  max_top_spans: int = 3900
  max_antecedents: int = 50
  ffnn_size: int = 3000
  ffnn_depth: int = 1
  feature_size: int = 20
  num_genres: int = len(GENRES)
  use_speakers: bool = True
  dropout: float = 0.3

  def __post_init__(self):
    if not isinstance(self.encoder, LongformerConfig):
      raise TypeError(f"CorefConfig.encoder must be a LongformerConfig, got "
                      f"{type(self.encoder).__name__}")
    for name in ("max_span_width", "max_top_spans", "max_antecedents", "ffnn_size",
                 "feature_size", "num_genres"):
      _positive_int(name, getattr(self, name))
    if (not isinstance(self.ffnn_depth, int) or isinstance(self.ffnn_depth, bool)
        or self.ffnn_depth < 0):
      raise ValueError(f"CorefConfig.ffnn_depth must be an int >= 0, got {self.ffnn_depth!r}")
    ratio = self.top_span_ratio
    if (not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not math.isfinite(ratio)
        or ratio <= 0):
      raise ValueError(f"CorefConfig.top_span_ratio must be a finite number > 0 (spans kept per "
                       f"token), got {ratio!r}")
    if ratio < 1e-3:
      raise ValueError(f"CorefConfig.top_span_ratio must be at least 0.001 (read as a fraction "
                       f"of denominator <= 1000), got {ratio!r}")
    if not isinstance(self.use_speakers, bool):
      raise ValueError(f"CorefConfig.use_speakers must be a bool, got {self.use_speakers!r}")
    if (not isinstance(self.dropout, (int, float)) or isinstance(self.dropout, bool)
        or not 0 <= self.dropout < 1):
      raise ValueError(f"CorefConfig.dropout must be in [0, 1), got {self.dropout!r}")

  @property
  def span_embedding_size(self) -> int:
    """U: [x_start; x_end; width embedding; head]."""
    return 3 * self.encoder.hidden_size + self.feature_size

  @property
  def dtype(self):
    return self.encoder.dtype

  @property
  def param_dtype(self):
    return self.encoder.param_dtype

  def keep_count(self, num_tokens):
    """min(floor(top_span_ratio * num_tokens), max_top_spans): the spans a document of that many
    real tokens keeps, for a Python int or an int array (under jit too). The ratio is read as
    the nearest fraction p / q with q <= 1000 and the product taken in exact integer
    arithmetic, so the host and the compiled step agree on every length (0.4 is 2 / 5)."""
    ratio = fractions.Fraction(self.top_span_ratio).limit_denominator(1000)
    p, q = ratio.numerator, ratio.denominator
    # (n // q) * p + (n % q) * p // q == floor(n * p / q), with no product past int32.
    count = (num_tokens // q) * p + (num_tokens % q) * p // q
    return (min(count, self.max_top_spans) if isinstance(count, int)
            else jnp.minimum(count, self.max_top_spans))

  def num_top_spans(self, num_tokens: int) -> int:
    """The static k of a padded length N: min(keep_count(N), N * W), at least 1."""
    return max(1, min(self.keep_count(num_tokens), num_tokens * self.max_span_width))

  def replace(self, **changes) -> CorefConfig:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready fields, the encoder's as its own `to_dict`; `from_dict` inverts it."""
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["encoder"] = self.encoder.to_dict()
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> CorefConfig:
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
      raise ValueError(f"unknown CorefConfig fields: {unknown}")
    d = dict(d)
    if isinstance(d.get("encoder"), dict):
      d["encoder"] = LongformerConfig.from_dict(d["encoder"])
    return cls(**d)

  @classmethod
  def tiny(cls, **changes) -> CorefConfig:
    """A model for tests and demos: `LongformerConfig.tiny()`, spans up to 5 tokens, 10
    antecedents, FFNNs of width 32, features of width 8, no dropout."""
    shape = dict(encoder=LongformerConfig.tiny(), max_span_width=5, max_antecedents=10,
                 ffnn_size=32, feature_size=8, dropout=0.0)
    return cls(**{**shape, **changes})


@flax.struct.dataclass
class CorefOutput:
  """The model's kept spans and their scored antecedents (float32 scores).

  Kept spans come sorted by start, then end; entries past a document's own count (or that are
  not valid spans) have top_span_mask False. Antecedents that cannot be chosen (not before the
  span, or masked) have antecedent_mask False and score -1e9.
  """

  top_span_starts: jax.Array  # int32 [B, M], token index (end inclusive below)
  top_span_ends: jax.Array  # int32 [B, M]
  top_span_indices: jax.Array  # int32 [B, M], candidate index start * W + (end - start)
  top_span_mask: jax.Array  # bool [B, M]
  top_span_mention_scores: jax.Array  # float32 [B, M]
  antecedents: jax.Array  # int32 [B, M, K], indices into the kept spans
  antecedent_mask: jax.Array  # bool [B, M, K]
  antecedent_scores: jax.Array  # float32 [B, M, K + 1], column 0 the dummy (0)
  candidate_mention_scores: jax.Array  # float32 [B, C], -1e9 where the span is not valid
  max_span_width: int = flax.struct.field(pytree_node=False)  # W: candidate c is the span
  # c // W .. c // W + c % W
  hidden_states: tuple[jax.Array, ...] | None = None
  attentions: tuple[jax.Array, ...] | None = None


class _FFNN(nnx.Module):
  """depth x (dense -> ReLU -> dropout), then a dense map to one score."""

  def __init__(self, in_size: int, config: CorefConfig, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(config.encoder.initializer_range)
    kw = dict(init=init, dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
    sizes = [in_size] + [config.ffnn_size] * config.ffnn_depth
    self.hidden = nnx.List([dense(a, b, (None, None), **kw) for a, b in zip(sizes, sizes[1:])])
    self.dropout = nnx.Dropout(config.dropout, rngs=rngs)
    self.out = dense(sizes[-1], 1, (None, None), **kw)

  def __call__(self, x):
    for layer in self.hidden:
      x = self.dropout(jax.nn.relu(layer(x)))
    return self.out(x)[..., 0]


def _gather(x_BxI, index_BxJ):
  """x_BxI...[b, index[b, ...]]: rows of a batched array by batched indices of any shape."""
  flat = index_BxJ.reshape(index_BxJ.shape[0], -1)
  picked = jnp.take_along_axis(x_BxI, flat.reshape(flat.shape + (1,) * (x_BxI.ndim - 2)),
                               axis=1)
  return picked.reshape(index_BxJ.shape + x_BxI.shape[2:])


class LongformerForCoreference(nnx.Module):
  """The Longformer encoder and the coarse-to-fine span-ranking head (the module docstring)."""

  def __init__(self, config: CorefConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None, seq_axis: str | None = None):
    if not isinstance(config, CorefConfig):
      raise TypeError(f"LongformerForCoreference takes a CorefConfig, got "
                      f"{type(config).__name__}")
    self.config = config
    c = config
    e, f, u = c.encoder.hidden_size, c.feature_size, c.span_embedding_size
    self.longformer = LongformerModel(c.encoder, add_pooling_layer=False, rngs=rngs, mesh=mesh,
                                      seq_axis=seq_axis)
    init = nnx.initializers.normal(c.encoder.initializer_range)
    dtypes = dict(dtype=c.dtype, param_dtype=c.param_dtype)
    features = dict(stddev=c.encoder.initializer_range, **dtypes, rngs=rngs)
    self.dropout = nnx.Dropout(c.dropout, rngs=rngs)
    self.head_scorer = dense(e, 1, ("embed", None), init=init, **dtypes, rngs=rngs)
    self.width_embedding = embed(c.max_span_width, f, (None, None), **features)
    self.mention_ffnn = _FFNN(u, c, rngs=rngs)
    self.coarse_projection = dense(u, u, (None, None), init=init, **dtypes, rngs=rngs)
    self.distance_embedding = embed(coref_spans.NUM_DISTANCE_BUCKETS, f, (None, None),
                                    **features)
    self.speaker_embedding = (embed(2, f, (None, None), **features) if c.use_speakers
                              else None)
    self.genre_embedding = embed(c.num_genres, f, (None, None), **features)
    self.antecedent_ffnn = _FFNN(3 * u + f * (2 + c.use_speakers), c, rngs=rngs)

  @property
  def init_kwargs(self) -> dict[str, Any]:
    """Constructor arguments besides config and rngs (for `checkpoint.load_model`): none."""
    return {}

  def __call__(self, input_ids, attention_mask=None, sentence_ids=None, speaker_ids=None,
               genre_ids=None, *, segment_length: int | None = None,
               output_hidden_states: bool = False, output_attentions: bool = False,
               **encoder_kwargs) -> CorefOutput:
    """Scores the spans of a batch of documents.

    Args:
      input_ids: int [B, N], one document per row (padded).
      attention_mask: [B, N], 1 for real tokens, 0 for padding (and for tokens no span may
        cover, such as segment markers); default all real. Spans never cover a masked token.
      sentence_ids: int [B, N], each token's sentence, non-decreasing along a row (not checked
        under jit); default one sentence per row.
      speaker_ids: int [B, N], each token's speaker (any ids; equal ids = same speaker), read
        when config.use_speakers; default none (the feature is zeros).
      genre_ids: int [B], each document's genre in [0, num_genres); default none (zeros).
      segment_length: encode each row as N / segment_length independent segments (the
        segment baseline: the states are stitched back before the head); None encodes whole
        rows.
      output_hidden_states, output_attentions, **encoder_kwargs: `LongformerModel.__call__`'s.
    """
    ids_BxN = check_ids(input_ids, 2, "[batch, seq]")
    b, n = ids_BxN.shape
    check_mask_values("attention_mask", attention_mask)
    mask_BxN = (jnp.ones((b, n), bool) if attention_mask is None
                else jnp.asarray(attention_mask) != 0)
    sentence_BxN = (jnp.zeros((b, n), jnp.int32) if sentence_ids is None
                    else jnp.asarray(sentence_ids))
    for name, x, shape in (("attention_mask", mask_BxN, (b, n)),
                           ("sentence_ids", sentence_BxN, (b, n)),
                           ("speaker_ids", speaker_ids, (b, n)), ("genre_ids", genre_ids, (b,))):
      if x is not None and jnp.shape(x) != shape:
        raise ValueError(f"{name} must have shape {shape} like input_ids [batch, seq] "
                         f"(genre_ids: [batch]), got {jnp.shape(x)}")

    if segment_length is None:
      out = self.longformer(ids_BxN, mask_BxN.astype(jnp.int32), **encoder_kwargs,
                            output_hidden_states=output_hidden_states,
                            output_attentions=output_attentions)
      x_BxNxE = out.last_hidden_state
    else:
      if not isinstance(segment_length, int) or segment_length < 1 or n % segment_length:
        raise ValueError(f"segment_length must be a positive int dividing the row length {n}, "
                         f"got {segment_length!r}")
      s = n // segment_length
      out = self.longformer(ids_BxN.reshape(b * s, segment_length),
                            mask_BxN.reshape(b * s, segment_length).astype(jnp.int32),
                            **encoder_kwargs, output_hidden_states=output_hidden_states,
                            output_attentions=output_attentions)
      x_BxNxE = out.last_hidden_state.reshape(b, n, -1)
    return dataclasses.replace(
        self.score_spans(x_BxNxE, mask_BxN, sentence_BxN, speaker_ids, genre_ids),
        hidden_states=out.hidden_states, attentions=out.attentions)

  # The head, on token states.

  def span_embeddings(self, x_BxNxE: jax.Array, starts_BxC: jax.Array, ends_BxC: jax.Array
                      ) -> jax.Array:
    """g [B, C, U] of the grid's spans (C = N * W, entry i * W + w the span i..i + w; entries
    running past the row see padding: they are invalid spans)."""
    c = self.config
    w = c.max_span_width
    b, n, e = x_BxNxE.shape
    # The attention-weighted head by an online softmax over widths: step w adds token i + w to
    # the span starting at i, so only [B, N, E] is carried and [B, N, W, E] stored.
    logit_BxN = self.head_scorer(x_BxNxE)[..., 0].astype(jnp.float32)
    x_pad = jnp.pad(x_BxNxE.astype(jnp.float32), ((0, 0), (0, w), (0, 0)))
    logit_pad = jnp.pad(logit_BxN, ((0, 0), (0, w)))

    def add_token(carry, step):
      max_BxN, num_BxNxE, den_BxN = carry
      a_BxN = jax.lax.dynamic_slice_in_dim(logit_pad, step, n, axis=1)
      t_BxNxE = jax.lax.dynamic_slice_in_dim(x_pad, step, n, axis=1)
      new_max = jnp.maximum(max_BxN, a_BxN)
      scale, weight = jnp.exp(max_BxN - new_max), jnp.exp(a_BxN - new_max)
      num_BxNxE = num_BxNxE * scale[..., None] + weight[..., None] * t_BxNxE
      den_BxN = den_BxN * scale + weight
      return (new_max, num_BxNxE, den_BxN), num_BxNxE / den_BxN[..., None]

    init = (jnp.full((b, n), -jnp.inf), jnp.zeros((b, n, e)), jnp.zeros((b, n)))
    _, head_WxBxNxE = jax.lax.scan(add_token, init, jnp.arange(w))
    head_BxCxE = jnp.transpose(head_WxBxNxE, (1, 2, 0, 3)).reshape(b, n * w, e)
    widths_BxC = jnp.clip(ends_BxC - starts_BxC, 0, w - 1)
    return jnp.concatenate([
        _gather(x_BxNxE, starts_BxC), _gather(x_BxNxE, ends_BxC),
        self.width_embedding(widths_BxC).astype(x_BxNxE.dtype),
        head_BxCxE.astype(x_BxNxE.dtype)], axis=-1)

  def score_spans(self, x_BxNxE: jax.Array, mask_BxN: jax.Array, sentence_BxN: jax.Array,
                  speaker_ids=None, genre_ids=None) -> CorefOutput:
    """The head on token states x [B, N, E] (the `__call__` arguments of the same names)."""
    c = self.config
    b, n, _ = x_BxNxE.shape
    w = c.max_span_width
    x_BxNxE = self.dropout(x_BxNxE)
    starts_BxC, ends_BxC, valid_BxC = jax.vmap(
        lambda s, m: coref_spans.span_grid(s, w, m))(sentence_BxN, mask_BxN)
    g_BxCxU = self.dropout(self.span_embeddings(x_BxNxE, starts_BxC, ends_BxC))
    mention_BxC = jnp.where(valid_BxC, self.mention_ffnn(g_BxCxU).astype(jnp.float32), _NEG)

    # Pruning: the top k by mention score (k static), kept while within the document's own
    # count and valid, then re-sorted by candidate index (= by start, then end) with the
    # dropped ones last.
    k = c.num_top_spans(n)
    keep_count_B = c.keep_count(jnp.sum(mask_BxN, axis=1, dtype=jnp.int32))
    top_score_BxM, top_index_BxM = jax.lax.top_k(mention_BxC, k)
    keep_BxM = ((jnp.arange(k)[None, :] < keep_count_B[:, None])
                & _gather(valid_BxC, top_index_BxM))
    order_BxM = jnp.argsort(jnp.where(keep_BxM, top_index_BxM, top_index_BxM + n * w), axis=1)
    top_index_BxM = jnp.take_along_axis(top_index_BxM, order_BxM, axis=1).astype(jnp.int32)
    top_score_BxM = jnp.take_along_axis(top_score_BxM, order_BxM, axis=1)
    keep_BxM = jnp.take_along_axis(keep_BxM, order_BxM, axis=1)
    top_starts_BxM = _gather(starts_BxC, top_index_BxM)
    top_ends_BxM = _gather(ends_BxC, top_index_BxM)
    g_BxMxU = _gather(g_BxCxU, top_index_BxM)

    # Coarse scores of every earlier kept span, and the top K of them.
    i_M = jnp.arange(k)
    pair_ok_BxMxM = (keep_BxM[:, :, None] & keep_BxM[:, None, :]
                     & (i_M[None, :, None] > i_M[None, None, :]))
    source_BxMxU = self.dropout(self.coarse_projection(g_BxMxU))
    bilinear_BxMxM = jnp.einsum("biu,bju->bij", source_BxMxU, g_BxMxU).astype(jnp.float32)
    coarse_BxMxM = top_score_BxM[:, :, None] + top_score_BxM[:, None, :] + bilinear_BxMxM
    coarse_BxMxM = jnp.where(pair_ok_BxMxM, coarse_BxMxM, _NEG)
    kk = min(c.max_antecedents, k)
    coarse_BxMxK, ant_BxMxK = jax.lax.top_k(coarse_BxMxM, kk)
    ant_BxMxK = ant_BxMxK.astype(jnp.int32)
    ant_mask_BxMxK = jnp.take_along_axis(pair_ok_BxMxM, ant_BxMxK, axis=2)

    # Fine scores: FFNN([g_i; g_j; g_i * g_j; phi]).
    g_i = jnp.broadcast_to(g_BxMxU[:, :, None], (b, k, kk, g_BxMxU.shape[-1]))
    g_j = _gather(g_BxMxU, ant_BxMxK)
    offsets_BxMxK = i_M[None, :, None] - ant_BxMxK
    phi = [self.distance_embedding(coref_spans.distance_buckets(offsets_BxMxK))]
    f = c.feature_size
    if self.speaker_embedding is not None:
      if speaker_ids is None:
        phi.append(jnp.zeros((b, k, kk, f), x_BxNxE.dtype))
      else:
        speaker_BxM = _gather(jnp.asarray(speaker_ids), top_starts_BxM)
        same_BxMxK = speaker_BxM[:, :, None] == _gather(speaker_BxM, ant_BxMxK)
        phi.append(self.speaker_embedding(same_BxMxK.astype(jnp.int32)))
    if genre_ids is None:
      phi.append(jnp.zeros((b, k, kk, f), x_BxNxE.dtype))
    else:
      genre_BxF = self.genre_embedding(jnp.asarray(genre_ids, jnp.int32))
      phi.append(jnp.broadcast_to(genre_BxF[:, None, None], (b, k, kk, f)))
    phi = self.dropout(jnp.concatenate([p.astype(x_BxNxE.dtype) for p in phi], axis=-1))
    pair_BxMxKxP = jnp.concatenate([g_i, g_j, g_i * g_j, phi], axis=-1)
    fine_BxMxK = self.antecedent_ffnn(pair_BxMxKxP).astype(jnp.float32)
    scores_BxMxK = jnp.where(ant_mask_BxMxK, coarse_BxMxK + fine_BxMxK, _NEG)
    scores_BxMxK1 = jnp.concatenate([jnp.zeros((b, k, 1), jnp.float32), scores_BxMxK], axis=-1)
    return CorefOutput(
        top_span_starts=top_starts_BxM, top_span_ends=top_ends_BxM,
        top_span_indices=top_index_BxM, top_span_mask=keep_BxM,
        top_span_mention_scores=top_score_BxM, antecedents=ant_BxMxK,
        antecedent_mask=ant_mask_BxMxK, antecedent_scores=scores_BxMxK1,
        candidate_mention_scores=mention_BxC, max_span_width=w)


# ----------------------------------------------------------------------------------------------
# Gold, loss and decoding


def gold_arrays(clusters: Sequence[Sequence[Sequence[int]]], max_mentions: int
                ) -> dict[str, np.ndarray]:
  """One document's gold clusters as the padded int32 arrays `coref_loss` reads, each [G]:
  gold_starts, gold_ends (end inclusive) and gold_cluster_ids (1, 2, ... by cluster; 0 pads).

  Raises:
    ValueError: more mentions than `max_mentions`, or a mention not a [start, end] pair of
      ints with 0 <= start <= end.
  """
  spans = [(span, c + 1) for c, cluster in enumerate(clusters) for span in cluster]
  if len(spans) > max_mentions:
    raise ValueError(f"the gold clusters hold {len(spans)} mentions, more than "
                     f"max_mentions={max_mentions}")
  out = {name: np.zeros(max_mentions, np.int32)
         for name in ("gold_starts", "gold_ends", "gold_cluster_ids")}
  for g, (span, cluster_id) in enumerate(spans):
    if (len(span) != 2 or not all(isinstance(v, (int, np.integer)) for v in span)
        or not 0 <= span[0] <= span[1]):
      raise ValueError(f"gold mention {g} must be a [start, end] pair of ints with 0 <= start "
                       f"<= end, got {span!r}")
    out["gold_starts"][g], out["gold_ends"][g] = span
    out["gold_cluster_ids"][g] = cluster_id
  return out


def antecedent_labels(output: CorefOutput, gold_starts, gold_ends, gold_cluster_ids
                      ) -> jax.Array:
  """bool [B, M, K + 1]: the gold antecedents of each kept span. Antecedent k + 1 is gold when
  it may be chosen and its span and the kept span are gold mentions of one cluster; the dummy
  (column 0) is gold when no other is (also for spans that are no gold mention).

  gold_starts, gold_ends, gold_cluster_ids: int [B, G] (`gold_arrays` per row), id 0 padding.
  """
  cluster_BxM = _gold_cluster_of(output.top_span_starts, output.top_span_ends, gold_starts,
                                 gold_ends, gold_cluster_ids)
  cluster_BxM = jnp.where(output.top_span_mask, cluster_BxM, 0)
  same_BxMxK = ((_gather(cluster_BxM, output.antecedents) == cluster_BxM[:, :, None])
                & (cluster_BxM[:, :, None] > 0) & output.antecedent_mask)
  dummy_BxMx1 = ~jnp.any(same_BxMxK, axis=2, keepdims=True)
  return jnp.concatenate([dummy_BxMx1, same_BxMxK], axis=2)


def _gold_cluster_of(starts, ends, gold_starts, gold_ends, gold_cluster_ids) -> jax.Array:
  """The gold cluster id (0: none) of each span (starts, ends [B, I])."""
  ids_BxG = jnp.asarray(gold_cluster_ids)
  match_BxIxG = ((starts[:, :, None] == jnp.asarray(gold_starts)[:, None, :])
                 & (ends[:, :, None] == jnp.asarray(gold_ends)[:, None, :])
                 & (ids_BxG[:, None, :] > 0))
  return jnp.max(jnp.where(match_BxIxG, ids_BxG[:, None, :], 0), axis=2, initial=0)


def coref_loss(output: CorefOutput, *, gold_starts, gold_ends, gold_cluster_ids,
               mention_weight: float = 0.0) -> jax.Array:
  """float32 [B]: per document, the sum over kept spans i of logsumexp(all scores of i) -
  logsumexp(scores of the gold antecedents of i) (`antecedent_labels`; the dummy when none):
  the negative marginal log-likelihood of the gold antecedents (Lee et al. 2017), the
  reference's loss.

  mention_weight: when > 0, adds that weight times the binary cross-entropy of every valid
  candidate's mention score against "is a gold mention" (summed over candidates): not in Lee et
  al. or Joshi et al., whose loss reaches mention scores only through the kept spans' pairs;
  it helps a small model from scratch, which can otherwise learn to prune every gold mention
  (the antecedent loss alone is then near 0: every kept span's gold is the dummy).
  """
  labels_BxMxK1 = antecedent_labels(output, gold_starts, gold_ends, gold_cluster_ids)
  scores = output.antecedent_scores.astype(jnp.float32)
  gold_lse_BxM = jax.nn.logsumexp(jnp.where(labels_BxMxK1, scores, _NEG), axis=2)
  loss_BxM = jax.nn.logsumexp(scores, axis=2) - gold_lse_BxM
  loss_B = jnp.sum(jnp.where(output.top_span_mask, loss_BxM, 0.0), axis=1)
  if mention_weight:
    w = output.max_span_width
    index_BxC = jnp.broadcast_to(jnp.arange(output.candidate_mention_scores.shape[1]),
                                 output.candidate_mention_scores.shape)
    starts_BxC = index_BxC // w
    gold_BxC = _gold_cluster_of(starts_BxC, starts_BxC + index_BxC % w, gold_starts, gold_ends,
                                gold_cluster_ids) > 0
    mention_BxC = output.candidate_mention_scores
    valid_BxC = mention_BxC > _NEG / 2
    bce_BxC = jax.nn.softplus(jnp.where(gold_BxC, -mention_BxC, mention_BxC))
    loss_B = loss_B + mention_weight * jnp.sum(jnp.where(valid_BxC, bce_BxC, 0.0), axis=1)
  return loss_B


def predict_clusters(output: CorefOutput) -> list[list[list[tuple[int, int]]]]:
  """Per document, the clusters of the argmax links: each kept span's best antecedent (the dummy
  wins ties: no link), clusters the transitive closure (`coref_spans`), each a sorted list of
  (start, end) token spans (end inclusive), ordered by their first span; spans linked to none
  form no cluster. The format `tasks.coref_scores(predictions=...)` takes."""
  scores = np.asarray(output.antecedent_scores, np.float32)
  antecedents = np.asarray(output.antecedents)
  mask = np.asarray(output.top_span_mask)
  starts, ends = np.asarray(output.top_span_starts), np.asarray(output.top_span_ends)
  documents = []
  for b in range(scores.shape[0]):
    links = np.where(mask[b], np.asarray(
        coref_spans.argmax_antecedents(scores[b], antecedents[b])), -1)
    clusters = coref_spans.clusters_from_antecedents(starts[b], ends[b], links)
    documents.append([list(cluster) for cluster in clusters])
  return documents
