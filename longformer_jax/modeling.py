"""Longformer models in flax.nnx: the encoder `LongformerModel` and its task heads.

They compute what HF transformers' classes of the same names compute (tests/test_models_parity.py
checks it at 1e-5 in float32), with these interface differences:
  * the attention window in `LongformerConfig` is one-sided;
  * inputs of any length up to `config.max_sequence_length`: the attention op pads internally, so
    no padding to a multiple of the window is visible to the caller, not even in hidden states;
  * `output_attentions=True` returns dense [batch, heads, seq, seq] float32 probabilities per
    layer (global rows included), computed by the O(seq^2) reference op: for small inputs. HF
    returns banded local and separate global tensors instead;
  * heads return logits, not losses;
  * `max_global` (a static int) bounds the global tokens per row when the model runs under jit
    with a global mask it cannot count while tracing (see `ops.longformer_attention`). Models
    that set global attention themselves (sequence classification) pass it for you.

Every model takes the constructor arguments `mesh` and `seq_axis` (default None): the device mesh
its activations are laid out on and the axis that splits sequences, handed to every attention
layer (`LongformerSelfAttention`). They are not part of the config, nor of `init_kwargs`: a
checkpoint is the same whatever mesh trained it.

Shape letters: the alphabet of `longformer_jax.ops`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from longformer_jax.config import LongformerConfig
from longformer_jax.encoder import LongformerEmbeddings, LongformerLayer
from longformer_jax.layers import attend, dense, layer_norm, logical_axes, maybe_remat
from longformer_jax.ops.validation import check_index_values, check_mask_values, is_traced
from longformer_jax.pretrained import HFCheckpointMixin


@flax.struct.dataclass
class LongformerModelOutput:
  last_hidden_state: jax.Array  # [B, N, E]
  pooler_output: jax.Array | None = None  # [B, E], tanh(dense(<s> state)), if the model pools
  hidden_states: tuple[jax.Array, ...] | None = None  # embeddings + every layer, each [B, N, E]
  attentions: tuple[jax.Array, ...] | None = None  # every layer, each [B, H, N, N] float32


@flax.struct.dataclass
class LongformerLogitsOutput:
  logits: jax.Array  # MLM [B, N, V]; sequence [B, L]; token [B, N, L]; multiple choice [B, C]
  hidden_states: tuple[jax.Array, ...] | None = None
  attentions: tuple[jax.Array, ...] | None = None


@flax.struct.dataclass
class LongformerQuestionAnsweringOutput:
  start_logits: jax.Array  # [B, N]
  end_logits: jax.Array  # [B, N]
  hidden_states: tuple[jax.Array, ...] | None = None
  attentions: tuple[jax.Array, ...] | None = None


def check_ids(input_ids, ndim: int, what: str) -> jax.Array:
  """`input_ids` as an integer array of `ndim` dimensions (`what` names them in the error)."""
  ids = jnp.asarray(input_ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"input_ids must hold integer token ids; got dtype {ids.dtype}")
  if ids.ndim != ndim:
    raise ValueError(f"input_ids must have shape {what}; got shape {ids.shape}")
  return ids


def check_model_ids(config: LongformerConfig, input_ids, token_type_ids=None,
                    position_ids=None) -> None:
  """ValueError for a concrete id outside its embedding table (`check_index_values`; traced ids
  are not checked)."""
  check_index_values("input_ids", input_ids, config.vocab_size,
                     f"vocab_size={config.vocab_size}")
  check_index_values("token_type_ids", token_type_ids, config.type_vocab_size,
                     f"type_vocab_size={config.type_vocab_size}")
  check_index_values("position_ids", position_ids, config.max_position_embeddings,
                     f"max_position_embeddings={config.max_position_embeddings}")


def _check_like_ids(name: str, x, shape: tuple[int, ...]) -> jax.Array | None:
  if x is None:
    return None
  x = jnp.asarray(x)
  if x.shape != shape:
    raise ValueError(f"{name} has shape {x.shape}; expected the shape of input_ids, {shape}")
  return x



def sequence_classification_global_mask(input_ids_BxN: jax.Array) -> jax.Array:
  """Global attention on the first token (<s>), as HF sets it for sequence classification."""
  return jnp.zeros(input_ids_BxN.shape, bool).at[:, 0].set(True)


def _first_index(input_ids_BxN, token_id: int):
  """Index of the first `token_id` in each row [B, 1], and whether the row has one [B, 1]."""
  is_token_BxN = input_ids_BxN == token_id
  return (jnp.argmax(is_token_BxN, axis=-1)[:, None],
          jnp.any(is_token_BxN, axis=-1, keepdims=True))


def question_answering_global_mask(input_ids_BxN: jax.Array, sep_token_id: int) -> jax.Array:
  """Global attention on the question: every token before the first </s> (HF's QA default).

  A row without </s> gets no global token (HF raises unless a row has exactly three).
  """
  first_sep_Bx1, has_sep_Bx1 = _first_index(input_ids_BxN, sep_token_id)
  return (jnp.arange(input_ids_BxN.shape[-1]) < first_sep_Bx1) & has_sep_Bx1


def multiple_choice_global_mask(input_ids_BxN: jax.Array, sep_token_id: int) -> jax.Array:
  """Global attention after the first </s></s> pair (HF's multiple-choice default).

  A row without </s> gets no global token.
  """
  first_sep_Bx1, has_sep_Bx1 = _first_index(input_ids_BxN, sep_token_id)
  return (jnp.arange(input_ids_BxN.shape[-1]) > first_sep_Bx1 + 1) & has_sep_Bx1


class LongformerModel(HFCheckpointMixin, nnx.Module):
  """The Longformer encoder: embeddings, `num_hidden_layers` layers, and an optional pooler."""

  def __init__(self, config: LongformerConfig, *, add_pooling_layer: bool = True,
               rngs: nnx.Rngs, mesh: jax.sharding.Mesh | None = None,
               seq_axis: str | None = None):
    self.config = config
    c = config
    dtypes = dict(dtype=c.dtype, param_dtype=c.param_dtype)
    self.embeddings = LongformerEmbeddings(
        c.vocab_size, c.hidden_size, c.max_position_embeddings, c.type_vocab_size,
        pad_token_id=c.pad_token_id, layer_norm_eps=c.layer_norm_eps,
        dropout_rate=c.hidden_dropout_prob, initializer_range=c.initializer_range, **dtypes,
        rngs=rngs)
    self.layers = nnx.List([
        LongformerLayer(
            c.hidden_size, c.num_attention_heads, c.intermediate_size, window=window,
            dilation=dilation, causal=c.causal, impl=c.attention_impl,
            global_projections=c.global_projections, hidden_act=c.hidden_act,
            layer_norm_eps=c.layer_norm_eps, dropout_rate=c.hidden_dropout_prob,
            initializer_range=c.initializer_range, **dtypes, rngs=rngs, mesh=mesh,
            seq_axis=seq_axis)
        for window, dilation in zip(c.layer_windows, c.layer_dilations)])
    self.pooler = (dense(c.hidden_size, c.hidden_size, ("embed", None),
                         init=nnx.initializers.normal(c.initializer_range), **dtypes, rngs=rngs)
                   if add_pooling_layer else None)

  @property
  def init_kwargs(self) -> dict[str, bool]:
    """Constructor arguments besides config and rngs (for `checkpoint.load_model`)."""
    return {"add_pooling_layer": self.pooler is not None}

  def __call__(self, input_ids, attention_mask=None, global_attention_mask=None,
               token_type_ids=None, position_ids=None, *, max_global: int | None = None,
               output_hidden_states: bool = False,
               output_attentions: bool = False) -> LongformerModelOutput:
    """Encodes token ids.

    Args:
      input_ids: [B, N] integer token ids, N <= config.max_sequence_length (unless position_ids
        are given).
      attention_mask: [B, N], 1 (or True) for real tokens, 0 for padding; default all real.
      global_attention_mask: [B, N], 1 for tokens with global attention; default none.
        Both masks hold 0 and 1 (or bools): another value (0.5, 2) is a ValueError naming it
        and its position when the mask is concrete; under jit it is not checked, and any
        nonzero value counts as 1 (`ops.validation.check_mask_values`).
      token_type_ids: [B, N]; default zeros.
      position_ids: [B, N]; default RoBERTa positions computed from the pad token.
        Every id must index its table: input_ids in [0, vocab_size), token_type_ids in
        [0, type_vocab_size), position_ids in [0, max_position_embeddings). A concrete id
        outside is a ValueError naming it and its position; under jit it is not checked and
        its embedding, and so the outputs of its row, are NaN (`layers.Embed`).
      max_global: static bound on global tokens per row, needed under jit with a global mask.
      output_hidden_states, output_attentions: also return those (see module docstring).
    """
    c = self.config
    ids_BxN = check_ids(input_ids, 2, "[batch, seq]")
    shape = ids_BxN.shape
    if position_ids is None and shape[1] > c.max_sequence_length:
      raise ValueError(
          f"input_ids has {shape[1]} tokens; the position table holds at most "
          f"{c.max_sequence_length} (max_position_embeddings={c.max_position_embeddings}, "
          f"positions start at pad_token_id + 1 = {c.pad_token_id + 1})")
    mask_BxN = _check_like_ids("attention_mask", attention_mask, shape)
    check_mask_values("attention_mask", attention_mask)
    mask_BxN = jnp.ones(shape, bool) if mask_BxN is None else mask_BxN != 0
    global_BxN = _check_like_ids("global_attention_mask", global_attention_mask, shape)
    check_mask_values("global_attention_mask", global_attention_mask)
    if global_BxN is not None:
      global_BxN = (global_BxN != 0) & mask_BxN  # a padding token is never global
      if max_global is None and not is_traced(global_BxN):
        # Counted here, outside remat and the layer loop, where the mask is still concrete.
        max_global = int(jnp.max(jnp.sum(global_BxN, axis=1), initial=0))
    token_type_ids = _check_like_ids("token_type_ids", token_type_ids, shape)
    position_ids = _check_like_ids("position_ids", position_ids, shape)
    check_model_ids(c, ids_BxN, token_type_ids, position_ids)

    hidden_BxNxE = self.embeddings(ids_BxN, token_type_ids, position_ids)

    def run_layer(layer, hidden_BxNxE, mask_BxN, global_BxN):
      return layer(hidden_BxNxE, mask_BxN, global_BxN, max_global=max_global,
                   output_attentions=output_attentions)

    run_layer = maybe_remat(run_layer, c.remat)
    all_hidden, all_probs = [hidden_BxNxE], []
    for layer in self.layers:
      hidden_BxNxE, probs = run_layer(layer, hidden_BxNxE, mask_BxN, global_BxN)
      all_hidden.append(hidden_BxNxE)
      all_probs.append(probs)
    pooled_BxE = None
    if self.pooler is not None:
      pooled_BxE = jnp.tanh(self.pooler(hidden_BxNxE[:, 0]))
    return LongformerModelOutput(
        last_hidden_state=hidden_BxNxE, pooler_output=pooled_BxE,
        hidden_states=tuple(all_hidden) if output_hidden_states else None,
        attentions=tuple(all_probs) if output_attentions else None)


class LongformerLMHead(nnx.Module):
  """dense -> gelu -> LayerNorm -> decoder tied to the word embeddings, plus a vocabulary bias."""

  def __init__(self, hidden_size: int, vocab_size: int, *, layer_norm_eps: float,
               initializer_range: float, dtype, param_dtype, rngs: nnx.Rngs):
    self.dense = dense(hidden_size, hidden_size, ("embed", None),
                       init=nnx.initializers.normal(initializer_range), dtype=dtype,
                       param_dtype=param_dtype, rngs=rngs)
    self.layer_norm = layer_norm(hidden_size, layer_norm_eps, dtype=dtype,
                                 param_dtype=param_dtype, rngs=rngs)
    self.bias = nnx.Param(jnp.zeros((vocab_size,), param_dtype), **logical_axes("vocab"))

  def __call__(self, hidden_BxNxE, table_VxE: jax.Array, dtype=None):
    """table: the word embeddings' (the tied decoder), passed as an array: a module is never a
    positional argument of another's call, which `nnx.tabulate` cannot display."""
    x_BxNxE = self.layer_norm(jax.nn.gelu(self.dense(hidden_BxNxE), approximate=False))
    logits_BxNxV = attend(x_BxNxE, table_VxE, dtype)
    return logits_BxNxV + self.bias[...].astype(logits_BxNxV.dtype)


class LongformerForMaskedLM(HFCheckpointMixin, nnx.Module):
  """Encoder + LM head whose decoder is the word embedding matrix (tied, as in HF)."""

  def __init__(self, config: LongformerConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None, seq_axis: str | None = None):
    self.config = config
    self.longformer = LongformerModel(config, add_pooling_layer=False, rngs=rngs, mesh=mesh,
                                      seq_axis=seq_axis)
    self.lm_head = LongformerLMHead(
        config.hidden_size, config.vocab_size, layer_norm_eps=config.layer_norm_eps,
        initializer_range=config.initializer_range, dtype=config.dtype,
        param_dtype=config.param_dtype, rngs=rngs)

  def __call__(self, input_ids, attention_mask=None, global_attention_mask=None, *,
               prediction_positions=None, **kwargs) -> LongformerLogitsOutput:
    """kwargs: the other arguments of `LongformerModel.__call__`. Returns logits [B, N, V], or
    [B, Y, V] at `prediction_positions`.

    prediction_positions: int [B, Y], the positions whose logits are wanted (an MLM batch's
      masked tokens: `masked_positions`). The LM head then runs on those Y rows only: its E x V
      decoder is 2 x 768 x 50,265 = 77M FLOPs per position, about a quarter of a base model's
      forward FLOPs by count, and the [B, N, V] logits are the largest activation of a training
      step, while the MLM loss reads 15% of the positions (paper §5 / RoBERTa's masking rate).
    """
    out = self.longformer(input_ids, attention_mask, global_attention_mask, **kwargs)
    hidden_BxNxE = out.last_hidden_state
    if prediction_positions is not None:
      hidden_BxNxE = jnp.take_along_axis(
          hidden_BxNxE, jnp.asarray(prediction_positions)[..., None], axis=1)
    word_embeddings = self.longformer.embeddings.word_embeddings
    logits = self.lm_head(hidden_BxNxE, word_embeddings.embedding[...], word_embeddings.dtype)
    return LongformerLogitsOutput(logits, out.hidden_states, out.attentions)


def masked_positions(labels_BxN: jax.Array, max_predictions: int
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The positions of each row's MLM targets (labels >= 0; -100 marks the others, as in HF), in
  a static shape for `LongformerForMaskedLM(prediction_positions=...)`.

  Returns (positions [B, Y], labels [B, Y], dropped [B]) with Y = max_predictions: each row's
  target positions in order, padded with position 0 and label -100 when it has fewer; `dropped`
  counts the targets of a row beyond Y, which are left out (pick Y as the masker's maximum, e.g.
  the number of positions it masks per row, so that it is always 0).
  """
  if not isinstance(max_predictions, int) or max_predictions < 1:
    raise ValueError(f"max_predictions must be an int >= 1, got {max_predictions!r}")
  labels_BxN = jnp.asarray(labels_BxN)
  n = labels_BxN.shape[-1]
  is_target_BxN = labels_BxN >= 0
  # Targets first, each group in position order: a stable sort on "not a target".
  order_BxN = jnp.argsort(~is_target_BxN, axis=-1, stable=True)
  positions_BxY = order_BxN[:, :max_predictions] if max_predictions <= n else jnp.pad(
      order_BxN, ((0, 0), (0, max_predictions - n)))
  count_B = jnp.sum(is_target_BxN, axis=-1)
  valid_BxY = jnp.arange(max_predictions)[None, :] < count_B[:, None]
  labels_BxY = jnp.where(valid_BxY, jnp.take_along_axis(labels_BxN, positions_BxY, axis=1), -100)
  positions_BxY = jnp.where(valid_BxY, positions_BxY, 0).astype(jnp.int32)
  return positions_BxY, labels_BxY, jnp.maximum(count_B - max_predictions, 0)


def _classifier(config: LongformerConfig, num_out: int, rngs: nnx.Rngs) -> nnx.LinearGeneral:
  return dense(config.hidden_size, num_out, ("embed", None),
               init=nnx.initializers.normal(config.initializer_range), dtype=config.dtype,
               param_dtype=config.param_dtype, rngs=rngs)


class LongformerClassificationHead(nnx.Module):
  """<s> state -> dropout -> dense -> tanh -> dropout -> out_proj (HF's layout)."""

  def __init__(self, config: LongformerConfig, *, rngs: nnx.Rngs):
    self.dense = _classifier(config, config.hidden_size, rngs)
    self.dropout = nnx.Dropout(config.hidden_dropout_prob, rngs=rngs)
    self.out_proj = _classifier(config, config.num_labels, rngs)

  def __call__(self, hidden_BxNxE):
    x_BxE = jnp.tanh(self.dense(self.dropout(hidden_BxNxE[:, 0])))
    return self.out_proj(self.dropout(x_BxE))


class LongformerForSequenceClassification(HFCheckpointMixin, nnx.Module):
  """Classifies the <s> state into `config.num_labels` classes.

  Without a global_attention_mask, <s> gets global attention (as in HF).
  """

  def __init__(self, config: LongformerConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None, seq_axis: str | None = None):
    self.config = config
    self.longformer = LongformerModel(config, add_pooling_layer=False, rngs=rngs, mesh=mesh,
                                      seq_axis=seq_axis)
    self.classifier = LongformerClassificationHead(config, rngs=rngs)

  def __call__(self, input_ids, attention_mask=None, global_attention_mask=None,
               **kwargs) -> LongformerLogitsOutput:
    """kwargs: the other arguments of `LongformerModel.__call__`. Returns logits [B, L]."""
    if global_attention_mask is None:
      global_attention_mask = sequence_classification_global_mask(
          check_ids(input_ids, 2, "[batch, seq]"))
      kwargs.setdefault("max_global", 1)
    out = self.longformer(input_ids, attention_mask, global_attention_mask, **kwargs)
    return LongformerLogitsOutput(self.classifier(out.last_hidden_state), out.hidden_states,
                                  out.attentions)


class LongformerForQuestionAnswering(HFCheckpointMixin, nnx.Module):
  """Start and end logits of an answer span.

  Without a global_attention_mask, the question (every token before the first </s>) gets global
  attention, as in HF; under jit also pass `max_global` (the longest question).
  """

  def __init__(self, config: LongformerConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None, seq_axis: str | None = None):
    if config.num_labels != 2:
      raise ValueError(f"question answering predicts start and end: num_labels must be 2, "
                       f"got {config.num_labels}")
    self.config = config
    self.longformer = LongformerModel(config, add_pooling_layer=False, rngs=rngs, mesh=mesh,
                                      seq_axis=seq_axis)
    self.qa_outputs = _classifier(config, 2, rngs)

  def __call__(self, input_ids, attention_mask=None, global_attention_mask=None,
               **kwargs) -> LongformerQuestionAnsweringOutput:
    """kwargs: the other arguments of `LongformerModel.__call__`."""
    if global_attention_mask is None:
      global_attention_mask = question_answering_global_mask(
          check_ids(input_ids, 2, "[batch, seq]"), self.config.sep_token_id)
    out = self.longformer(input_ids, attention_mask, global_attention_mask, **kwargs)
    logits_BxNx2 = self.qa_outputs(out.last_hidden_state)
    return LongformerQuestionAnsweringOutput(logits_BxNx2[..., 0], logits_BxNx2[..., 1],
                                             out.hidden_states, out.attentions)


class LongformerForTokenClassification(HFCheckpointMixin, nnx.Module):
  """Labels every token with one of `config.num_labels` classes."""

  def __init__(self, config: LongformerConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None, seq_axis: str | None = None):
    self.config = config
    self.longformer = LongformerModel(config, add_pooling_layer=False, rngs=rngs, mesh=mesh,
                                      seq_axis=seq_axis)
    self.dropout = nnx.Dropout(config.hidden_dropout_prob, rngs=rngs)
    self.classifier = _classifier(config, config.num_labels, rngs)

  def __call__(self, input_ids, attention_mask=None, global_attention_mask=None,
               **kwargs) -> LongformerLogitsOutput:
    """kwargs: the other arguments of `LongformerModel.__call__`. Returns logits [B, N, L]."""
    out = self.longformer(input_ids, attention_mask, global_attention_mask, **kwargs)
    logits = self.classifier(self.dropout(out.last_hidden_state))
    return LongformerLogitsOutput(logits, out.hidden_states, out.attentions)


class LongformerForMultipleChoice(HFCheckpointMixin, nnx.Module):
  """Scores C candidate sequences per example from their pooled states.

  Inputs are [B, C, N]; hidden states and attentions come back flattened to [B*C, ...] as in HF.
  Without a global_attention_mask, tokens after the first </s></s> pair get global attention (HF's
  default); under jit also pass `max_global`.
  """

  def __init__(self, config: LongformerConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None, seq_axis: str | None = None):
    self.config = config
    self.longformer = LongformerModel(config, add_pooling_layer=True, rngs=rngs, mesh=mesh,
                                      seq_axis=seq_axis)
    self.dropout = nnx.Dropout(config.hidden_dropout_prob, rngs=rngs)
    self.classifier = _classifier(config, 1, rngs)

  def __call__(self, input_ids, attention_mask=None, global_attention_mask=None,
               token_type_ids=None, position_ids=None, **kwargs) -> LongformerLogitsOutput:
    """kwargs: the other arguments of `LongformerModel.__call__`. Returns logits [B, C]."""
    ids_BxCxN = check_ids(input_ids, 3, "[batch, choices, seq]")
    batch, choices, seq = ids_BxCxN.shape

    def flat(name, x):
      x = _check_like_ids(name, x, ids_BxCxN.shape)
      return None if x is None else x.reshape(batch * choices, seq)

    # Checked here too, so that an error names a [batch, choice, seq] position.
    check_model_ids(self.config, ids_BxCxN,
                    *(_check_like_ids(name, x, ids_BxCxN.shape) for name, x in (
                        ("token_type_ids", token_type_ids), ("position_ids", position_ids))))
    ids_BCxN = ids_BxCxN.reshape(batch * choices, seq)
    global_BCxN = flat("global_attention_mask", global_attention_mask)
    if global_BCxN is None:
      global_BCxN = multiple_choice_global_mask(ids_BCxN, self.config.sep_token_id)
    out = self.longformer(ids_BCxN, flat("attention_mask", attention_mask), global_BCxN,
                          flat("token_type_ids", token_type_ids),
                          flat("position_ids", position_ids), **kwargs)
    logits_BCx1 = self.classifier(self.dropout(out.pooler_output))
    return LongformerLogitsOutput(logits_BCx1.reshape(batch, choices), out.hidden_states,
                                  out.attentions)


MODEL_CLASSES: dict[str, type[nnx.Module]] = {
    cls.__name__: cls for cls in (
        LongformerModel, LongformerForMaskedLM, LongformerForSequenceClassification,
        LongformerForQuestionAnswering, LongformerForTokenClassification,
        LongformerForMultipleChoice)}


__all__ = [
    "LongformerModel", "LongformerForMaskedLM", "LongformerForSequenceClassification",
    "LongformerForQuestionAnswering", "LongformerForTokenClassification",
    "LongformerForMultipleChoice", "LongformerModelOutput", "LongformerLogitsOutput",
    "LongformerQuestionAnsweringOutput", "MODEL_CLASSES", "sequence_classification_global_mask",
    "question_answering_global_mask", "multiple_choice_global_mask", "masked_positions",
]
