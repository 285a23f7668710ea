"""Pure functions: Longformer attention and the band kernels behind it.

Each fast path sits beside its plainly-correct reference:
  attention.py       `longformer_attention`, the public op: validates, then one call per concern
  validation.py      its argument checks
  dispatch.py        implementation and platform choice, the band kernel of each
  compose.py         the composition around a band kernel on whole sequences
  global_tokens.py   global slots, the log-sum-exp merge, the dense pass of the global rows
  sharded.py         the op on a mesh: mesh layouts and its own shard_map
  sequence_parallel.py  the composition of one shard of a split sequence, and its collectives
  reference.py       dense reference of the whole op
  band_reference.py  dense reference of the band-kernel contract
  band_chunked.py    blocked-einsum band kernel
  band_pallas.py     Pallas band kernels' dispatch: checks, padding, custom VJP,
                     `band_attention_pallas` (interpret mode on CPU)
  band_blocks.py     their shared block arithmetic (BlockSizes, band geometry, support checks)
  band_triton.py     Triton (GPU) kernels
  band_mosaic.py     Mosaic (TPU) kernels

The shape alphabet, declared here once for the whole package (docs/design.md §4 points here).
A tensor whose shape matters is named with its shape as a suffix, one capital letter per axis
joined by `x`: `q_BxNxHxD`, `lse_BxHxN`, `s_QxK`. Each letter has one meaning:

  B  batch (rows of a batch)
  N  sequence: a row's tokens (the encoder / source side of a seq2seq model)
  T  target tokens: a decoder's positions (seq2seq targets, the tokens of one decoder call, the
     positions of a generated sequence)
  P  prompt tokens (the prefix a generation call starts from)
  H  attention heads            D  head_dim (per-head feature width)
  E  hidden size (embedding)    F  MLP inner width                V  vocabulary
  G  global tokens per row (the global slots of docs/design.md §2.1)
  W  window slots (the band positions of one query, `scores_BxHxNxW`)
  Q  queries: rows of a query tile (Pallas / chunked query blocks)
  K  keys: rows of a key tile (the chunked path's too), the key set of a dense softmax (LED's
     cross- and self-attention), the slots of a decoding cache
  S  sequence shards (devices of the mesh axis the sequence is split over)
  C  candidates: the choices of a multiple-choice row, the tokens top-k / top-p sampling keeps,
     a beam-search step's candidate hypotheses
  J  beams (hypotheses beam search keeps per batch item)
  R  rows of a flattened or packed batch (batch x beams; the rows a token stream is packed into)
  I  entries an index array picks (the output axis of a gather)
  Y  predicted positions (the masked positions an MLM head scores per row)
  A  answer span lengths (extractive QA: spans of 1..max_answer_length tokens from a start)
  L  labels (classes)           M  microbatches (gradient accumulation)

A literal number is a fixed size (`m_Qx128`: a row statistic replicated over the 128 TPU lanes;
`logits_BxTx2`) and `1` a broadcast axis (`mask_Bx1x1xN`). Letters written together are one
flattened axis (`scores_BxJV`: beams x vocabulary; `lse_BxHxSG`: shards x globals). `___` stands
for any trailing axes (`x_BxJx___`). A lowercase letter is an axis whose size is the quantity of
that name in the code around it (`windows_RxTxn`: n = ngram_size tokens); lowercase letters in
formulas are sizes (`n` tokens, `w` window, `d` dilation, `h` heads).
"""

from longformer_jax.ops.attention import IMPLS, longformer_attention, resolve_impl
from longformer_jax.ops.band_reference import EMPTY_LSE
from longformer_jax.ops.reference import longformer_attention_reference

__all__ = ["IMPLS", "EMPTY_LSE", "longformer_attention", "longformer_attention_reference",
           "resolve_impl"]
