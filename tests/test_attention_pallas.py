"""The whole attention-op suite of tests/test_attention.py rerun with the Pallas band kernel.

On CPU `impl="pallas"` runs the Triton-style kernel in Pallas interpret mode, forward and
gradients, float32 and 16-bit, with the same tolerances as the chunked path. Only the subclass
is defined here (importing the module, not the class, so pytest does not collect the chunked
suite twice).
"""

import test_attention


class TestPallas(test_attention.TestChunked):
  IMPL = "pallas"
