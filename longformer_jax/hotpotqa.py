"""HotpotQA's two-stage multi-task reader (paper §6) on `LongformerModel`: the model. Its loss,
the decoding of its outputs into HotpotQA's official prediction format and the two-stage
pipeline are `longformer_jax.tasks.hotpotqa`'s; the rows are `longformer_jax.data.hotpotqa`'s.

    >>> from longformer_jax import hotpotqa as model_lib
    >>> from longformer_jax.data import hotpotqa as hq
    >>> from longformer_jax.tasks import hotpotqa
    >>> model = model_lib.LongformerForHotpotQA(config, rngs=nnx.Rngs(0))
    >>> layouts = [hq.build_layout(r, encode, specials, markers, max_length=4096,
    ...                            paragraphs=hq.gold_paragraphs(r), max_paragraphs=2,
    ...                            max_sentences=40) for r in records]   # stage-2 training rows
    >>> batch = hq.stack_layouts(layouts)
    >>> out = model(**hotpotqa.model_inputs(batch), max_global=max_global)
    >>> loss, parts = hotpotqa.hotpot_loss(out, batch, weights=hotpotqa.STAGE2_WEIGHTS)
    >>> chosen = hotpotqa.stage1_selection(layouts, out.paragraph_logits, k=2)     # stage 1
    >>> preds = hotpotqa.predictions(layouts, hotpotqa.decode(out, max_answer_length=30),
    ...                              sp_threshold=0.5)                              # stage 2
    >>> longformer_jax.tasks.hotpot_scores(predictions=preds, golds=[r.as_json() for r in records])
    >>> preds, chosen, rows = hotpotqa.two_stage_predictions(stage1, stage2, records, encode,
    ...                                                      specials, markers, max_length=4096)

Stage 1 reads the question with all ten paragraphs and scores each [p] marker (paragraph
relevance); its top-k paragraphs (k = 2 by default) go to stage 2, which reads the question with
them and predicts, multi-task, the answer span (start / end logits over the titles and
sentences), the question type (span / yes / no, from <s>) and the supporting sentences (one
logit per [s] marker, read with its sentence's mean state). Both stages are this class,
trained with different loss weights (`STAGE1_WEIGHTS`, `STAGE2_WEIGHTS`).

Shape letters: B batch, N positions, E hidden, P paragraph slots, S sentence slots, A answer
occurrences, T question types (3).
"""

from __future__ import annotations


import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from longformer_jax.config import LongformerConfig
from longformer_jax.layers import dense
from longformer_jax.modeling import LongformerModel, _classifier, check_ids

__all__ = ["NEG_LOGIT", "NUM_TYPES", "HotpotQAOutput", "LongformerForHotpotQA"]

# Logits of positions and slots that cannot be chosen (float32: exp underflows to 0).
NEG_LOGIT = -1e9
NUM_TYPES = 3  # span / yes / no: data.hotpotqa.QUESTION_TYPES


@flax.struct.dataclass
class HotpotQAOutput:
  start_logits: jax.Array  # [B, N] float32, -1e9 outside the titles and sentences
  end_logits: jax.Array  # [B, N] float32, likewise
  type_logits: jax.Array  # [B, T] float32 (span, yes, no)
  sentence_logits: jax.Array  # [B, S] float32, -1e9 on empty slots
  paragraph_logits: jax.Array  # [B, P] float32, -1e9 on empty slots
  hidden_states: tuple[jax.Array, ...] | None = None
  attentions: tuple[jax.Array, ...] | None = None


class _FeedForward(nnx.Module):
  """dropout -> dense (in -> E) -> GELU -> dropout -> dense (E -> out): the two-layer head the
  paper puts on the <s>, [s] and [p] states (in = E, or 2E for a marker state beside its
  span's mean state)."""

  def __init__(self, config: LongformerConfig, num_out: int, rngs: nnx.Rngs, in_factor: int = 1):
    self.dense = dense(in_factor * config.hidden_size, config.hidden_size, ("embed", None),
                       init=nnx.initializers.normal(config.initializer_range),
                       dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
    self.dropout = nnx.Dropout(config.hidden_dropout_prob, rngs=rngs)
    self.out_proj = _classifier(config, num_out, rngs)

  def __call__(self, x_BxYxE: jax.Array) -> jax.Array:
    x_BxYxE = jax.nn.gelu(self.dense(self.dropout(x_BxYxE)), approximate=False)
    return self.out_proj(self.dropout(x_BxYxE))


def _gather(hidden_BxNxE: jax.Array, positions_BxY: jax.Array) -> jax.Array:
  """The states at `positions` [B, Y, E] (static Y; positions clipped into the row)."""
  n = hidden_BxNxE.shape[1]
  positions_BxY = jnp.clip(jnp.asarray(positions_BxY, jnp.int32), 0, n - 1)
  return jnp.take_along_axis(hidden_BxNxE, positions_BxY[:, :, None], axis=1)


def _pool(hidden_BxNxE: jax.Array, slots_BxN: jax.Array, count: int) -> jax.Array:
  """The mean state of each slot's positions [B, count, E] (slots_BxN: the slot of each
  position, -1 for none; an empty slot gives zeros). A one-hot contraction over N, so a
  sequence-sharded N reduces like any matmul."""
  one_hot_BxNxY = jax.nn.one_hot(jnp.asarray(slots_BxN, jnp.int32), count, dtype=jnp.float32)
  # Sums and counts in float32 (bfloat16 counts only to 256 exactly; a paragraph is longer).
  sums_BxYxE = jnp.einsum("bny,bne->bye", one_hot_BxNxY.astype(hidden_BxNxE.dtype),
                          hidden_BxNxE, preferred_element_type=jnp.float32)
  counts_BxY = jnp.sum(one_hot_BxNxY, axis=1)
  return (sums_BxYxE / jnp.maximum(counts_BxY, 1)[..., None]).astype(hidden_BxNxE.dtype)


def _masked(logits, mask):
  logits = logits.astype(jnp.float32)
  return logits if mask is None else jnp.where(jnp.asarray(mask) != 0, logits, NEG_LOGIT)


class LongformerForHotpotQA(nnx.Module):
  """The HotpotQA reader: answer start / end logits at every position, question-type logits from
  <s>, evidence logits at the [s] markers and relevance logits at the [p] markers (two-layer
  heads; the span head is one linear layer, as `LongformerForQuestionAnswering`'s, so its
  weights load from a QA checkpoint under the same name `qa_outputs`).

  A [s] (or [p]) slot is read as its marker's state beside the mean state of its sentence (its
  paragraph): every [s] marker is the same token, and a marker's state alone singles its own
  sentence out only through position-selective attention, which a model trained from scratch
  learns slowly (on the generated data a tiny model's evidence loss stayed at the label prior
  for hundreds of steps with the marker alone, and fell near 0 within 100 with the mean).

  Parameters: `longformer` (the encoder), `qa_outputs`, `type_head`, `sentence_head`,
  `paragraph_head`.
  """

  def __init__(self, config: LongformerConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None, seq_axis: str | None = None):
    self.config = config
    self.longformer = LongformerModel(config, add_pooling_layer=False, rngs=rngs, mesh=mesh,
                                      seq_axis=seq_axis)
    self.qa_outputs = _classifier(config, 2, rngs)
    self.type_head = _FeedForward(config, NUM_TYPES, rngs)
    self.sentence_head = _FeedForward(config, 1, rngs, in_factor=2)
    self.paragraph_head = _FeedForward(config, 1, rngs, in_factor=2)

  def __call__(self, input_ids, attention_mask=None, global_attention_mask=None, *,
               paragraph_positions, sentence_positions, token_paragraph, token_sentence,
               paragraph_mask=None, sentence_mask=None, context_mask=None,
               **kwargs) -> HotpotQAOutput:
    """Runs the reader on rows of `data.hotpotqa.build_layout` (`model_inputs(batch)` gives
    these arguments).

    Args:
      input_ids, attention_mask, global_attention_mask: [B, N], as `LongformerModel`'s (the
        layout's global mask: <s>, the question and every marker; under jit pass max_global).
      paragraph_positions [B, P], sentence_positions [B, S]: the [p] and [s] markers' positions
        (static P and S; empty slots hold any position and are masked).
      token_paragraph, token_sentence [B, N]: the [p] / [s] slot of each position (-1: none).
        A slot is represented by its marker's state beside the mean state of its span.
      paragraph_mask [B, P], sentence_mask [B, S]: 1 on real slots; empty ones get -1e9.
      context_mask [B, N]: 1 where an answer may start and end (the titles and sentences);
        elsewhere the span logits are -1e9. None: nowhere masked.
      **kwargs: the other arguments of `LongformerModel.__call__` (max_global, ...).
    """
    check_ids(input_ids, 2, "[batch, seq]")
    out = self.longformer(input_ids, attention_mask, global_attention_mask, **kwargs)
    return self.heads(out.last_hidden_state, paragraph_positions=paragraph_positions,
                      sentence_positions=sentence_positions, token_paragraph=token_paragraph,
                      token_sentence=token_sentence, paragraph_mask=paragraph_mask,
                      sentence_mask=sentence_mask, context_mask=context_mask,
                      hidden_states=out.hidden_states, attentions=out.attentions)

  def heads(self, hidden_BxNxE: jax.Array, *, paragraph_positions, sentence_positions,
            token_paragraph, token_sentence, paragraph_mask=None, sentence_mask=None,
            context_mask=None, hidden_states=None, attentions=None) -> HotpotQAOutput:
    """The heads on the encoder's states [B, N, E] at row positions (`__call__`'s arguments):
    the whole row's states, or the states a segment reading stitched back to row positions
    (`tasks.hotpotqa.segment_outputs`); the type head reads position 0 (`<s>`)."""
    logits_BxNx2 = self.qa_outputs(hidden_BxNxE)
    type_BxT = self.type_head(hidden_BxNxE[:, :1])[:, 0]
    s, p = jnp.shape(sentence_positions)[-1], jnp.shape(paragraph_positions)[-1]
    sentence_BxSx2E = jnp.concatenate([_gather(hidden_BxNxE, sentence_positions),
                                       _pool(hidden_BxNxE, token_sentence, s)], axis=-1)
    paragraph_BxPx2E = jnp.concatenate([_gather(hidden_BxNxE, paragraph_positions),
                                        _pool(hidden_BxNxE, token_paragraph, p)], axis=-1)
    sentence_BxS = self.sentence_head(sentence_BxSx2E)[..., 0]
    paragraph_BxP = self.paragraph_head(paragraph_BxPx2E)[..., 0]
    return HotpotQAOutput(
        start_logits=_masked(logits_BxNx2[..., 0], context_mask),
        end_logits=_masked(logits_BxNx2[..., 1], context_mask),
        type_logits=type_BxT.astype(jnp.float32),
        sentence_logits=_masked(sentence_BxS, sentence_mask),
        paragraph_logits=_masked(paragraph_BxP, paragraph_mask),
        hidden_states=hidden_states, attentions=attentions)
