"""The whole attention-op suite of tests/test_attention.py rerun with the Pallas band kernel.

`longformer_attention(impl="pallas")` offers no switch between the compiled kernel and Pallas
interpret mode: it runs the kernel compiled on GPU/TPU and interpreted on CPU, as
`jax.default_backend()` dictates (longformer_jax/ops/attention.py). So, unlike
tests/test_band_pallas.py, there is one class here, which runs wherever the op runs: on CPU the
Triton-style kernel in interpret mode, forward and gradients, float32 and 16-bit, with the same
tolerances as the chunked path. Only the subclass is defined here (importing the module, not the
class, so pytest does not collect the chunked suite twice).
"""

import pytest

import test_attention

pytestmark = pytest.mark.usefixtures("quick_compilation")  # conftest.py


class TestPallas(test_attention.TestChunked):
  IMPL = "pallas"
