"""Section a: the COMPILED Pallas kernels against their references (forward and gradients).
"""

from __future__ import annotations

import argparse
import time
import traceback

from .common import Recorder, Sizes, errors_of


def section_correctness(rec: Recorder, sizes: Sizes, args) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import pallas_gpu_check
  from longformer_jax import ops

  interpret = jax.default_backend() == "cpu"
  rec.log(f"band kernel vs dense reference ({'interpret mode' if interpret else 'compiled'})")
  for row in pallas_gpu_check.check_correctness(
      argparse.Namespace(small=sizes.band_check_small, window=256),
      dict(backend="triton", interpret=interpret)):
    rec.row(kind="band_kernel", status="ok" if row["ok"] else "failed", **row)

  batch, seq, heads, head_dim, window = sizes.op_check
  dilation = (1,) * (heads - 2) + (2, 2)
  for causal, dtype_name in sizes.op_cases:
    dtype = jnp.dtype(dtype_name)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    what = dict(kind="op", impl="pallas", dtype=jnp.dtype(dtype).name, causal=causal, seq=seq,
                heads=heads, head_dim=head_dim, window=window, dilation=dilation,
                globals=0 if causal else "2 in row 0, 1 in row 1", padding="row 1: last 20%")
    if not rec.fits("op", sizes.first_row_estimate_s * 2):
      rec.skipped(**what)
      continue
    started = time.time()
    try:
      rng = np.random.default_rng(7 + causal)
      q, k, v, qg, kg, vg, cot = (jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)),
                                              dtype) for _ in range(7))
      attention_mask = np.ones((batch, seq), bool)
      attention_mask[1, seq - seq // 5:] = False
      kwargs = dict(window=window, dilation=dilation, causal=causal,
                    attention_mask=jnp.asarray(attention_mask))
      global_qkv = None
      if not causal:
        global_mask = np.zeros((batch, seq), bool)
        global_mask[0, [0, seq // 2]] = True
        global_mask[1, 3] = True
        kwargs.update(global_mask=jnp.asarray(global_mask), max_global=2)
        global_qkv = (qg, kg, vg)

      def loss(impl, q, k, v, global_qkv):
        out = ops.longformer_attention(q, k, v, global_qkv=global_qkv, impl=impl, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out

      grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3, 4), has_aux=True), static_argnums=0)
      # True float32 for both (XLA's dots would otherwise be TF32 on the GPU); the kernels
      # set their own precision.
      with jax.default_matmul_precision("float32"):
        results = {impl: grad(impl, q, k, v, global_qkv) for impl in ("reference", "pallas")}
      named = lambda r: dict(out=r[1], dq=r[0][0], dk=r[0][1], dv=r[0][2],
                             **({} if causal else dict(dq_g=r[0][3][0], dk_g=r[0][3][1],
                                                       dv_g=r[0][3][2])))
      errors = errors_of(named(results["pallas"]), named(results["reference"]))
      ok = all(e <= tol for e in errors.values())
      padded_zero = bool(jnp.all(results["pallas"][1][1, seq - seq // 5:] == 0))
      rec.row(status="ok" if ok and padded_zero else "failed", tolerance=tol, errors=errors,
              padding_rows_zero=padded_zero, **what)
      rec.log(f"op {what['dtype']} causal={causal}: {'ok' if ok else 'FAILED'} {errors}")
    except Exception as e:
      traceback.print_exc()
      rec.row(status="failed", error=f"{type(e).__name__}: {str(e)[:400]}", **what)
    rec.cost("op", time.time() - started)
