"""WikiHop's candidate scorer (paper §6) on `LongformerModel`: the model. The records and rows
are `longformer_jax.data.wikihop`'s; the fine-tuning kind (`--task wikihop`) is
`longformer_jax.tasks.wikihop`'s.

    >>> from longformer_jax import wikihop
    >>> model = wikihop.LongformerForWikiHop(config, rngs=nnx.Rngs(0))
    >>> out = model(input_ids_BxKxN, attention_mask_BxKxN, global_attention_mask_BxKxN,
    ...             candidate_positions=positions_BxC, candidate_mask=mask_BxC,
    ...             chunk_mask=chunks_BxK, max_global=max_global)
    >>> out.logits  # [B, C] float32: one score per candidate

One example is K rows (chunks), each `<s> [q] query [/q] [ent] c1 [/ent] ... </s> supports... </s>`
with the same prefix; a candidate's score in a row is a bias-free linear map of the state at its
`[ent]` marker, and its score for the example the sum over the example's rows.

Shape letters: B batch, K chunks (rows of one example), N positions, C candidates, E hidden.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from longformer_jax.config import LongformerConfig
from longformer_jax.layers import Dense, logical_axes
from longformer_jax.modeling import (
    LongformerLogitsOutput, LongformerModel, _check_like_ids, check_ids, check_model_ids)

__all__ = ["NEG_LOGIT", "LongformerForWikiHop"]

# Logits of candidate slots that hold no candidate (float32: exp underflows to 0).
NEG_LOGIT = -1e9


class LongformerForWikiHop(nnx.Module):
  """Scores the candidates of a WikiHop example, chunk-and-sum (allenai/longformer's
  wikihop.py): every row of the example is encoded on its own, each candidate scored at its
  `[ent]` marker by one bias-free linear layer (E -> 1), and the scores of an example's rows
  summed (in float32).

  Parameters: `longformer` (the encoder, no pooler) and `candidate_scorer` (kernel [E, 1]).
  """

  def __init__(self, config: LongformerConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None, seq_axis: str | None = None):
    self.config = config
    self.longformer = LongformerModel(config, add_pooling_layer=False, rngs=rngs, mesh=mesh,
                                      seq_axis=seq_axis)
    self.candidate_scorer = Dense(
        config.hidden_size, 1, axis=-1, feature_axes=(None,), use_bias=False,
        kernel_init=nnx.initializers.normal(config.initializer_range),
        kernel_metadata=logical_axes("embed", None), dtype=config.dtype,
        param_dtype=config.param_dtype, rngs=rngs)

  def __call__(self, input_ids, attention_mask=None, global_attention_mask=None, *,
               candidate_positions, candidate_mask=None, chunk_mask=None,
               **kwargs) -> LongformerLogitsOutput:
    """Candidate logits [B, C] (float32; -1e9 where candidate_mask is 0).

    Args:
      input_ids, attention_mask, global_attention_mask: [B, K, N], the rows of each example
        (the global mask: the prefix, `data.wikihop`; under jit also pass max_global).
      candidate_positions: [B, C] int, the position of each candidate's `[ent]` marker, the same
        in every row of an example (rows share the prefix).
      candidate_mask: [B, C], 1 on real candidates (None: all).
      chunk_mask: [B, K], 1 on real rows: filler rows add nothing to the sum (None: all).
      **kwargs: the other arguments of `LongformerModel.__call__` (max_global, ...).

    Hidden states and attentions come back flattened to [B*K, ...].
    """
    ids_BxKxN = check_ids(input_ids, 3, "[batch, chunks, seq]")
    b, k, n = ids_BxKxN.shape
    check_model_ids(self.config, ids_BxKxN)

    def flat(name, x):
      x = _check_like_ids(name, x, ids_BxKxN.shape)
      return None if x is None else x.reshape(b * k, n)

    out = self.longformer(ids_BxKxN.reshape(b * k, n), flat("attention_mask", attention_mask),
                          flat("global_attention_mask", global_attention_mask), **kwargs)
    positions_BxC = jnp.clip(jnp.asarray(candidate_positions, jnp.int32), 0, n - 1)
    c = positions_BxC.shape[1]
    positions_BKxC = jnp.broadcast_to(positions_BxC[:, None], (b, k, c)).reshape(b * k, c)
    states_BKxCxE = jnp.take_along_axis(out.last_hidden_state, positions_BKxC[:, :, None],
                                        axis=1)
    scores_BxKxC = self.candidate_scorer(states_BKxCxE)[..., 0].astype(jnp.float32).reshape(
        b, k, c)
    if chunk_mask is not None:
      scores_BxKxC = jnp.where(jnp.asarray(chunk_mask)[:, :, None] != 0, scores_BxKxC, 0.0)
    logits_BxC = jnp.sum(scores_BxKxC, axis=1)
    if candidate_mask is not None:
      logits_BxC = jnp.where(jnp.asarray(candidate_mask) != 0, logits_BxC, NEG_LOGIT)
    return LongformerLogitsOutput(logits_BxC, out.hidden_states, out.attentions)
