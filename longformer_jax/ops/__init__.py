"""Pure functions: Longformer attention and the band kernels behind it.

Each fast path sits beside its plainly-correct reference:
  attention.py       `longformer_attention`, the public op (validation + composition)
  reference.py       dense reference of the whole op
  band_reference.py  dense reference of the band-kernel contract
  band_chunked.py    blocked-einsum band kernel
  band_pallas*.py    Pallas band kernels (GPU / TPU; interpret mode on CPU)
"""

from longformer_jax.ops.attention import IMPLS, longformer_attention, resolve_impl
from longformer_jax.ops.band_reference import EMPTY_LSE
from longformer_jax.ops.reference import longformer_attention_reference

__all__ = ["IMPLS", "EMPTY_LSE", "longformer_attention", "longformer_attention_reference",
           "resolve_impl"]
