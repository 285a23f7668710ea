"""Pure functions: Longformer attention and the band kernels behind it.

Each fast path sits beside its plainly-correct reference:
  attention.py       `longformer_attention`, the public op (validation + composition)
  reference.py       dense reference of the whole op
  band_reference.py  dense reference of the band-kernel contract
  band_chunked.py    blocked-einsum band kernel
  band_pallas.py     Pallas band kernels' dispatch: checks, padding, custom VJP,
                     `band_attention_pallas` (interpret mode on CPU)
  band_blocks.py     their shared block arithmetic (BlockSizes, band geometry, support checks)
  band_triton.py     Triton (GPU) kernels
  band_mosaic.py     Mosaic (TPU) kernels
  sequence_parallel.py  collectives of the op with the sequence split over a mesh axis

The shape alphabet, declared here once and followed by every tensor name in the package
(`q_BxNxHxD`, `scores_BxHxNxW`; docs/design.md §4):

  B  batch               N  sequence (tokens)      H  heads              D  head_dim
  E  hidden (embedding)  F  MLP inner width        V  vocabulary         G  global tokens per row
  W  window slots        Q  query-tile rows        K  key-tile rows      (Pallas / chunked tiles)
  C  choices (multiple choice)                     L  labels (classes)   M  microbatches
"""

from longformer_jax.ops.attention import IMPLS, longformer_attention, resolve_impl
from longformer_jax.ops.band_reference import EMPTY_LSE
from longformer_jax.ops.reference import longformer_attention_reference

__all__ = ["IMPLS", "EMPTY_LSE", "longformer_attention", "longformer_attention_reference",
           "resolve_impl"]
