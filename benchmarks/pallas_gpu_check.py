"""One prepared GPU check of the Pallas band kernel: correctness first, then timings.

On a GPU, from the repository root:

  python benchmarks/pallas_gpu_check.py            # writes pallas_gpu_check.json to $OUT or
                                                   # benchmarks/results/
  python benchmarks/pallas_gpu_check.py --out DIR

What it does, in order (each step prints as it goes and lands in the JSON):
1. correctness: forward and gradients (q, k, v under random cotangents for out AND lse) of
   `band_attention_pallas(backend='triton')` against the dense `band_attention_reference`, at
   seq 2048, float32 (tolerance 1e-5 of max(1, |ref|); IEEE float32 matmuls) and bfloat16 (1e-2),
   bidirectional and causal, with padding holes and one all-masked batch row;
2. timings (median of 10 after warm-up, milliseconds): forward and forward+backward of the
   Pallas kernel (bidir and causal) at seq 4096 / 16384 / 65536, batch 1, 12 heads, head_dim 64,
   window 256 each side, bf16; and `jax.nn.dot_product_attention(implementation='cudnn')` with a
   causal left window of 256 (the cuDNN peer of docs/design.md §6); TFLOP/s counted on the attended
   pairs P (docs/design.md §2.5), peak device memory where the backend reports it;
3. a small block-size sweep of the bidirectional fwd+bwd at seq 16384 (for BlockSizes defaults).

CPU smoke path (no GPU): `python benchmarks/pallas_gpu_check.py --interpret --small` runs the same
steps at toy sizes in interpret mode (and XLA instead of cuDNN) to prove the script works.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # benchmarks/harness.py
from longformer_jax.ops.band_pallas import BlockSizes, band_attention_pallas
from longformer_jax.ops.band_reference import band_attention_reference


def attended_pairs(seq, window, causal):
  window = min(window, seq - 1)
  if causal:
    return seq * (window + 1) - window * (window + 1) // 2
  return seq * (2 * window + 1) - window * (window + 1)


def time_ms(fn, args, iters):
  jax.block_until_ready(fn(*args))  # compile + warm-up
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append((time.perf_counter() - start) * 1e3)
  return statistics.median(samples)


def peak_bytes():
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def inputs(seed, batch, seq, heads, head_dim, dtype, holes):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), dtype)
             for _ in range(3))
  mask = np.ones((batch, seq), bool)
  if holes:
    mask &= rng.random((batch, seq)) > 0.25
    mask[0] = False
  return q, k, v, jnp.asarray(mask)


def check_correctness(args, pallas_kw):
  """Yields one row per (dtype, causal) check as it finishes, so a caller under a deadline keeps
  the checks that ran."""
  seq = 192 if args.small else 2048
  heads = 2 if args.small else 4
  for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
    for causal in (False, True):
      q, k, v, mask = inputs(0, 2, seq, heads, 64, dtype, holes=True)
      window = 40 if args.small else args.window
      kernel = jax.jit(lambda q, k, v, m: band_attention_pallas(
          q, k, v, m, window=window, causal=causal, **pallas_kw))
      reference = jax.jit(lambda q, k, v, m: band_attention_reference(
          q, k, v, m, window=window, causal=causal))
      (out, lse), vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, mask), q, k, v)
      rng = np.random.default_rng(1)
      cot = (jnp.asarray(rng.standard_normal(out.shape), dtype),
             jnp.asarray(rng.standard_normal(lse.shape), jnp.float32))
      got = (out, lse) + tuple(vjp(cot))
      # The reference in true float32 (XLA may otherwise pick TF32 matmuls on the GPU).
      with jax.default_matmul_precision("float32"):
        (out_r, lse_r), vjp_r = jax.vjp(lambda q, k, v: reference(q, k, v, mask), q, k, v)
        want = (out_r, lse_r) + tuple(vjp_r(cot))
      errors = {}
      for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if name == "lse":  # rows with no key (EMPTY_LSE = -1e30) would swamp the scale
          has_key = b > -1e29
          errors["lse_empty_rows_exact"] = float(np.all(a[~has_key] == b[~has_key]))
          a, b = a[has_key], b[has_key]
        errors[name] = (float(np.max(np.abs(a - b))) / max(1.0, float(np.max(np.abs(b))))
                        if np.all(np.isfinite(a)) else float("inf"))
      ok = errors.pop("lse_empty_rows_exact") == 1.0 and all(e <= tol for e in errors.values())
      row = dict(check="correctness", dtype=jnp.dtype(dtype).name, causal=causal, seq=seq,
                 window=window, tolerance=tol, errors=errors, ok=ok)
      print(json.dumps(row), flush=True)
      yield row


def pallas_fns(window, causal, pallas_kw):
  def fwd(q, k, v, m):
    return band_attention_pallas(q, k, v, m, window=window, causal=causal, **pallas_kw)[0]

  def loss(q, k, v, m):
    out, lse = band_attention_pallas(q, k, v, m, window=window, causal=causal, **pallas_kw)
    return jnp.sum(out.astype(jnp.float32)) + 1e-3 * jnp.sum(lse)

  return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def dpa_fns(window, implementation):
  def fwd(q, k, v, m):
    del m
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(window, 0),
                                        implementation=implementation)

  def loss(q, k, v, m):
    return jnp.sum(fwd(q, k, v, m).astype(jnp.float32))

  return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def timing_row(impl, mode, fns, args, shape, window, iters):
  batch, seq, heads, head_dim = shape
  q, k, v, mask = inputs(2, batch, seq, heads, head_dim, args.dtype, holes=False)
  row = dict(device=jax.devices()[0].device_kind, date=harness.today(),
             impl=impl, mode=mode, seq=seq, batch=batch, heads=heads, head_dim=head_dim,
             window=window, dilation=1, globals=0)
  try:
    fwd, grad = fns
    row["ms_fwd"] = time_ms(fwd, (q, k, v, mask), iters)
    row["ms_fwdbwd"] = time_ms(grad, (q, k, v, mask), iters)
    pairs = attended_pairs(seq, window, mode == "causal")
    row["tflops_fwdbwd"] = 14 * pairs * head_dim * heads * batch / (row["ms_fwdbwd"] * 1e-3) / 1e12
    row["peak_bytes"] = peak_bytes()
  except Exception as e:
    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    traceback.print_exc()
  print(json.dumps(row), flush=True)
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  harness.common_arguments(parser, out=harness.default_out())
  parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
  parser.add_argument("--small", action="store_true", help="toy sizes (CPU smoke run)")
  parser.add_argument("--window", type=int, default=256)
  parser.add_argument("--no-sweep", action="store_true")
  args = parser.parse_args()
  args.dtype = jnp.bfloat16
  gpu = jax.default_backend() == "gpu"
  pallas_kw = dict(backend="triton", interpret=args.interpret)
  started = time.time()
  result = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, argv=sys.argv[1:])

  result["correctness"] = list(check_correctness(args, pallas_kw))

  if args.small:
    seqs, heads, window, iters = (256,), 2, 32, 1
  else:
    seqs, heads, window, iters = (4096, 16384, 65536), 12, args.window, 10
  rows = []
  for seq in seqs:
    shape = (1, seq, heads, 64)
    for mode in ("bidir", "causal"):
      rows.append(timing_row("pallas", mode, pallas_fns(window, mode == "causal", pallas_kw),
                             args, shape, window, iters))
    implementation = "cudnn" if gpu else "xla"
    rows.append(timing_row(f"jax_dpa_{implementation}", "causal", dpa_fns(window, implementation),
                           args, shape, window, iters))
  result["timings"] = rows

  if not args.no_sweep:
    seq = 256 if args.small else 16384
    candidates = ([BlockSizes(32, 32, 32, 32, 32, 32)] if args.small else [
        BlockSizes(128, 64, 64, 64, 64, 64, num_warps=4, num_stages=3),
        BlockSizes(128, 128, 64, 64, 64, 64, num_warps=8, num_stages=2),
        BlockSizes(64, 64, 32, 64, 64, 32, num_warps=4, num_stages=2),
        BlockSizes(128, 64, 128, 64, 64, 128, num_warps=8, num_stages=3),
    ])
    sweep = []
    for blocks in candidates:
      row = timing_row("pallas", "bidir",
                       pallas_fns(window, False, dict(pallas_kw, block_sizes=blocks)),
                       args, (1, seq, heads, 64), window, iters)
      row["block_sizes"] = blocks.__dict__
      sweep.append(row)
    result["block_sweep"] = sweep

  result["seconds"] = time.time() - started
  path = harness.write_json(pathlib.Path(args.out) / ("pallas_gpu_check_small.json" if args.small
                                                      else "pallas_gpu_check.json"), result)
  print(f"wrote {path} in {result['seconds']:.0f} s; correctness ok: "
        f"{all(r['ok'] for r in result['correctness'])}")


if __name__ == "__main__":
  main()
