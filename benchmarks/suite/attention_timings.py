"""Section b: attention timings of ours, forward and forward+backward, and TFLOP/s on the
attended pairs."""

from __future__ import annotations

import time

from .common import Recorder, Sizes, compile_aot, hashed_jax


def _attention_fns(impl: str, shape, num_global: int):
  """(forward, grad of sum(out)) of ours, taking (q, k, v, global_mask) as arguments (a global
  mask closed over as a constant makes XLA constant-fold its sort for seconds)."""
  import jax
  import jax.numpy as jnp
  from longformer_jax import ops

  def fwd(q, k, v, global_mask):
    kwargs = dict(window=shape.window, dilation=shape.dilation, causal=shape.causal, impl=impl)
    if num_global:
      kwargs.update(global_mask=global_mask, global_qkv=(q, k, v), max_global=num_global)
    return ops.longformer_attention(q, k, v, **kwargs)

  loss = lambda *a: jnp.sum(fwd(*a).astype(jnp.float32))
  return fwd, jax.grad(loss, argnums=(0, 1, 2))


def attention_inputs(shape, dtype):
  import jax.numpy as jnp
  dims = (shape.batch, shape.seq, shape.heads, shape.head_dim)
  q, k, v = (hashed_jax(dims, seed, dtype) for seed in (1, 2, 3))
  global_mask = jnp.zeros((shape.batch, shape.seq), bool).at[:, :shape.globals_].set(True)
  return q, k, v, global_mask


def time_attention(impl: str, shape, dtype, reps: int, expected=None,
                   tolerance: float = 0.0) -> tuple[dict, object]:
  """Times one of our rows; returns (row fields, forward output)."""
  import jax.numpy as jnp
  from attention import median_ms
  args = attention_inputs(shape, dtype)
  fwd_fn, grad_fn = _attention_fns(impl, shape, shape.globals_)
  fwd, _ = compile_aot(fwd_fn, args)
  out = fwd(*args)
  row = {}
  if expected is not None:
    row["max_abs_diff_vs_pallas"] = float(jnp.max(jnp.abs(out.astype(jnp.float32)
                                                          - expected.astype(jnp.float32))))
    if not row["max_abs_diff_vs_pallas"] <= tolerance:
      raise AssertionError(f"{impl} differs from pallas by {row['max_abs_diff_vs_pallas']}")
  grad, row["peak_bytes"] = compile_aot(grad_fn, args)
  row["ms_fwd"] = median_ms(fwd, args, reps)
  row["ms_fwdbwd"] = median_ms(grad, args, reps)
  row["tflops_fwdbwd"] = round(shape.flops_fwdbwd() / (row["ms_fwdbwd"] * 1e-3) / 1e12, 3)
  return row, out


def section_attention(rec: Recorder, sizes: Sizes, args) -> None:
  import jax
  from attention import Shape

  gpu = jax.default_backend() == "gpu"
  heads, head_dim, window = sizes.attn
  dilated = (1,) * (heads - 2) + (2, 2)
  variants = {"bidir": dict(), "bidir dil2x2+1g": dict(dilation=dilated, globals_=1),
              "causal": dict(causal=True)}
  tolerance = 3e-2 if sizes.dtype == "bfloat16" else 2e-4
  pallas_out = {}
  for impl in ("pallas", "chunked"):  # every pallas row first: they matter most
    for seq, batch in sizes.attn_shapes:
      for label, extra in variants.items():
        if (impl, label) not in sizes.attn_rows:
          continue
        shape = Shape(seq=seq, batch=batch, heads=heads, head_dim=head_dim, window=window,
                      **extra)
        what = dict(kind="attention", impl=impl, variant=label, mode=shape.mode, seq=seq,
                    batch=batch, heads=heads, head_dim=head_dim, window=window,
                    dilation=shape.dilation, globals=shape.globals_, dtype=sizes.dtype,
                    interpret=not gpu and impl == "pallas")
        if not rec.fits(impl, sizes.first_row_estimate_s):
          rec.skipped(**what)
          continue
        started = time.time()
        try:
          row, out = time_attention(impl, shape, sizes.dtype, sizes.reps,
                                    pallas_out.get((seq, batch, label)), tolerance)
          if impl == "pallas":
            pallas_out[(seq, batch, label)] = out
          rec.row(status="ok", **what, **row)
          rec.log(f"{impl:8s} {label:16s} {seq:6d} x {batch}: fwd {row['ms_fwd']:8.3f} ms, "
                  f"fwd+bwd {row['ms_fwdbwd']:8.3f} ms ({row['tflops_fwdbwd']} TFLOP/s on P)")
        except Exception as e:  # e.g. out of memory: recorded
          rec.row(status="failed", error=f"{type(e).__name__}: {str(e)[:400]}", **what)
          rec.log(f"{impl} {label} {seq} x {batch} failed: {type(e).__name__}: {str(e)[:200]}")
        rec.cost(impl, time.time() - started)
