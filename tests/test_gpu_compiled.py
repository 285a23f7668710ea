"""The COMPILED Triton kernels on a GPU, through the public op and one whole model step.

tests/test_band_pallas.py's `TestTritonBand` checks the compiled band kernel alone; this class
checks what users run: `longformer_attention(impl="pallas")` with dilation (1, ..., 2, 2) on two
heads, global tokens and padding, bidirectional and causal, forward and gradients (of q, k, v and
the global q, k, v) against `impl="reference"` at float32 (<= 1e-5 of max(1, |ref|)) and bf16
(<= 1e-2), that the program really contains the Triton kernels (not interpret mode, not an XLA
fallback), and one AdamW step of a small LongformerForMaskedLM on the kernels against the same
model on the dense reference.

Without a GPU every test skips with its reason in the summary (`-ra`, pyproject.toml), e.g.
"no GPU: jax.devices() is [CpuDevice(id=0)]". tests/conftest.py sets JAX_PLATFORMS=cpu unless it
is set: on a GPU machine run `JAX_PLATFORMS=cuda python -m pytest tests/test_gpu_compiled.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from longformer_jax import LongformerForMaskedLM, ops
from testing import (AttentionCase, assert_close, make_attention_inputs, make_model_inputs,
                     seed_of, tiny_encoder_config, tolerance)

pytestmark = pytest.mark.gpu

TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call of a compiled Pallas Triton kernel
# head_dim 64 (the base model's); seq 1000 is no multiple of the kernel blocks (padding path);
# the window is well inside the sequence, so dilation and band skipping both matter.
CASES = [
    AttentionCase(batch=2, seq=1000, heads=4, window=64, dilation=(1, 1, 2, 2), padding=True,
                  max_globals=3, head_dim=64),
    AttentionCase(batch=2, seq=1000, heads=4, window=64, dilation=(1, 1, 2, 2), causal=True,
                  padding=True, head_dim=64),
    AttentionCase(batch=1, seq=2048, heads=2, window=256, head_dim=64),
]


def gpu_devices_or_skip():
  devices = jax.devices()
  if devices[0].platform != "gpu":
    pytest.skip(f"no GPU: jax.devices() is {devices} (on a GPU machine run with "
                "JAX_PLATFORMS=cuda; tests/conftest.py defaults to cpu)")
  return devices


class TestCompiledOnGpu:

  @pytest.fixture(autouse=True)
  def _needs_gpu(self):
    gpu_devices_or_skip()

  @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
  @pytest.mark.parametrize("case", CASES, ids=str)
  def test_op_forward_and_gradients_match_reference(self, case, dtype):
    (q, k, v), kwargs = make_attention_inputs(case, seed_of(case, dtype), jnp.dtype(dtype))
    global_qkv = kwargs.pop("global_qkv", None)
    if global_qkv is not None:
      kwargs["max_global"] = case.max_globals
    cotangent = jax.random.normal(jax.random.key(seed_of(case, "cot")), q.shape, jnp.float32)

    def value_and_grads(impl):
      def loss(q, k, v, global_qkv):
        out = ops.longformer_attention(q, k, v, global_qkv=global_qkv, impl=impl, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out
      fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
      return fn, fn(q, k, v, global_qkv)

    # True float32 on both sides: XLA's dots (the reference, and the op's parts outside the
    # kernels) would otherwise run as TF32 on the GPU; the kernels set their own precision.
    with jax.default_matmul_precision("float32"):
      _, (grads_ref, out_ref) = value_and_grads("reference")
      pallas_fn, (grads_got, out) = value_and_grads("pallas")
      hlo = pallas_fn.lower(q, k, v, global_qkv).as_text()
    assert hlo.count(f"custom_call @{TRITON_CALL}") >= 3, "no compiled Triton kernel in the program"
    tol = tolerance(dtype)
    assert out.dtype == q.dtype
    assert_close(out, out_ref, tol, "out")
    names = ["dq", "dk", "dv"] + ([] if global_qkv is None else ["dq_g", "dk_g", "dv_g"])
    for name, g, g_ref in zip(names, jax.tree.leaves(grads_got), jax.tree.leaves(grads_ref)):
      assert_close(g, g_ref, tol, name)
    padding = ~np.asarray(kwargs["attention_mask"])
    np.testing.assert_array_equal(np.asarray(out, np.float32)[padding], 0.0)

  def test_model_training_step(self):
    """One AdamW step of a small MLM (head_dim 16) on the kernels against the same weights on the
    dense reference: loss and gradients agree in float32, and the step changes the weights."""
    inputs = {k: jnp.asarray(v) for k, v in make_model_inputs().items()}
    labels = jnp.where(inputs["attention_mask"] > 0, inputs["input_ids"], -100)

    def loss_fn(model):
      logits = model(inputs["input_ids"], inputs["attention_mask"],
                     inputs["global_attention_mask"], max_global=3).logits
      per_token = optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), jnp.maximum(labels, 0))
      return jnp.sum(per_token * (labels >= 0)) / jnp.sum(labels >= 0)

    results = {}
    with jax.default_matmul_precision("float32"):
      for impl in ("reference", "pallas"):
        model = LongformerForMaskedLM(tiny_encoder_config(attention_impl=impl),
                                      rngs=nnx.Rngs(0))
        loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model)
        results[impl] = (model, loss, grads)
    (_, loss_ref, grads_ref), (model, loss, grads) = results["reference"], results["pallas"]
    assert_close(loss, loss_ref, tolerance("float32"), "loss")
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
      assert_close(g, g_ref, 1e-4, "gradient")

    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))

    @nnx.jit
    def step(model, optimizer):
      loss, grads = nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)
      return loss

    assert np.isfinite(float(step(model, optimizer)))
    after = nnx.state(model, nnx.Param)
    changed = [not np.array_equal(a, np.asarray(b))
               for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))]
    assert any(changed), "the training step changed no weight"
