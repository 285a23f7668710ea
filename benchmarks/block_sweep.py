"""Block-size sweep of the Pallas (Triton) band kernel: forward+backward time per `BlockSizes`.

  python benchmarks/block_sweep.py                          # seq 16384, batch 2, 12 heads, bf16
  python benchmarks/block_sweep.py --causal --budget-s 90 --out DIR
  python benchmarks/block_sweep.py --tiny                   # CPU, interpret mode: a smoke run

`longformer_jax.ops.band_pallas.band_attention_pallas(..., block_sizes=BlockSizes(...))` is timed
forward+backward (median of `--reps` after a warm-up) by coordinate descent from the device's
default (`BlockSizes.for_device`, fitted to shared memory as the op does):
  1. launch: num_warps x num_stages (shared by all three kernels);
  2. forward: (block_q, block_k);
  3. dK/dV kernel: (block_q_dkv, block_k_dkv);
  4. dQ kernel: (block_q_dq, block_k_dq);
each stage keeping the best so far (--tiny: the default and one forward candidate). Every
candidate's output, lse and gradients are checked against the default's (max error relative to
max(1, |default|) <= 2e-2 in 16-bit, 1e-4 in float32) before its time counts; a candidate
that fails to compile or launch, or whose shared memory estimate
(`BlockSizes.fit_gpu_shared_memory`) exceeds the device's, is recorded with its reason.
The sweep stops at `--budget-s` (the remaining candidates are recorded as skipped).

TFLOP/s are counted on the attended pairs P (docs/design.md §2.5). Prints a table and the best
`BlockSizes` as a Python literal to paste into `BlockSizes.for_device`; writes
`<out>/block_sweep_<device>_<date>.json`. `sweep()` is what benchmarks/gpu_suite.py calls.
Interpret mode (CPU) times nothing meaningful: it only proves the script runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # benchmarks/harness.py
from attention import Shape, median_ms
from longformer_jax.ops import band_pallas
from longformer_jax.ops.band_pallas import BlockSizes

TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
# (stage, fields it varies, candidate values).
STAGES = (
    ("launch", ("num_warps", "num_stages"), ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3))),
    ("forward", ("block_q", "block_k"),
     ((64, 32), (64, 64), (64, 128), (128, 32), (128, 64), (128, 128))),
    ("dkv", ("block_q_dkv", "block_k_dkv"),
     ((32, 64), (64, 64), (64, 128), (32, 128), (128, 64), (128, 128))),
    ("dq", ("block_q_dq", "block_k_dq"),
     ((64, 32), (64, 64), (128, 32), (128, 64), (128, 128))),
)
TINY_STAGES = (("forward", ("block_q", "block_k"), ((32, 16),)),)


def check_shape(shape: Shape, dtype: str) -> None:
  """Raises ValueError for what the sweep cannot take (it times the plain band kernel)."""
  for name in ("seq", "batch", "heads", "head_dim"):
    if not isinstance(getattr(shape, name), int) or getattr(shape, name) < 1:
      raise ValueError(f"{name}={getattr(shape, name)!r} must be an int >= 1")
  if not isinstance(shape.window, int) or shape.window < 0:
    raise ValueError(f"window={shape.window!r} must be an int >= 0 (one-sided)")
  if shape.dilation != 1 or shape.globals_:
    raise ValueError("the sweep times the band kernel alone: no dilation, no global tokens")
  if dtype not in TOLERANCE:
    raise ValueError(f"dtype={dtype!r}: expected one of {sorted(TOLERANCE)}")


def default_blocks(shape: Shape, dtype: str, interpret: bool) -> BlockSizes:
  """What `band_attention_pallas` picks by itself for this shape and device."""
  if interpret:
    return BlockSizes.for_device("cpu")
  kind = jax.devices()[0].device_kind
  blocks = BlockSizes.for_device(kind)
  limit = (163 if "a100" in kind.lower() else 227) * 1024
  return blocks.fit_gpu_shared_memory(_kernel_head_dim(shape.head_dim), jnp.dtype(dtype), limit)


def _kernel_head_dim(head_dim: int) -> int:
  """The head_dim the Triton kernel runs at (zero-padded up to a native one)."""
  native = getattr(band_pallas, "kernel_head_dim", None)
  return native(head_dim, "triton") if native else head_dim


def _functions(shape: Shape, blocks: BlockSizes, interpret: bool):
  """(jitted value-and-grad of a scalar loss over out and lse, its args)."""
  def loss(q, k, v, mask):
    out, lse = band_pallas.band_attention_pallas(
        q, k, v, mask, window=shape.window, causal=shape.causal, block_sizes=blocks,
        interpret=interpret, backend="triton")
    return jnp.sum(out.astype(jnp.float32)) + 1e-3 * jnp.sum(lse), (out, lse)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _inputs(shape: Shape, dtype: str):
  keys = jax.random.split(jax.random.key(0), 4)
  qkv = [jax.random.normal(k_, (shape.batch, shape.seq, shape.heads, shape.head_dim),
                           jnp.dtype(dtype)) for k_ in keys[:3]]
  mask = jax.random.uniform(keys[3], (shape.batch, shape.seq)) > 0.05  # a few padding holes
  return (*qkv, mask)


def _max_error(got, want) -> float:
  worst = 0.0
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    keep = b > -1e29  # lse of rows with no key (EMPTY_LSE) would swamp the scale
    a, b = a[keep], b[keep]
    if not np.all(np.isfinite(a)):
      return float("inf")
    worst = max(worst, float(np.max(np.abs(a - b), initial=0.0))
                / max(1.0, float(np.max(np.abs(b), initial=0.0))))
  return worst


def sweep(shape: Shape = Shape(seq=16384, batch=2), dtype: str = "bfloat16", *,
          budget_s: float = 120.0, reps: int = 10, interpret: bool | None = None,
          tiny: bool = False, log=print) -> dict:
  """Runs the coordinate-descent sweep of the band kernel at `shape` (benchmarks/attention.py's
  Shape: seq, batch, heads, head_dim, window, causal) in `dtype`; returns dict(shape, default,
  best, best_literal, speedup, rows, complete). Each row: stage, block_sizes, ms_fwdbwd,
  max_error, ok, error."""
  check_shape(shape, dtype)
  if budget_s <= 0:
    raise ValueError(f"budget_s={budget_s} must be > 0")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  deadline = time.time() + budget_s
  args = _inputs(shape, dtype)
  default = default_blocks(shape, dtype, interpret)
  tol = TOLERANCE[dtype]
  rows, measured = [], {}
  cost_s = [0.0]  # the slowest candidate so far: a candidate is started only if one more fits

  def measure(stage: str, blocks: BlockSizes) -> float | None:
    if blocks in measured:
      return measured[blocks]
    row = dict(stage=stage, block_sizes=dataclasses.asdict(blocks), ms_fwdbwd=None,
               max_error=None, ok=False, error=None)
    rows.append(row)
    if time.time() + cost_s[0] > deadline:
      row["error"] = "skipped: sweep budget spent"
      return None
    if not interpret and blocks.fit_gpu_shared_memory(
        _kernel_head_dim(shape.head_dim), jnp.dtype(dtype)) != blocks:
      row["error"] = "exceeds the device's shared memory (fit_gpu_shared_memory estimate)"
      measured[blocks] = None
      return None
    started = time.time()
    try:
      fn = _functions(shape, blocks, interpret)
      (_, outputs), grads = fn(*args)
      row["max_error"] = _max_error((outputs, grads), reference)
      row["ok"] = row["max_error"] <= tol
      if not row["ok"]:
        row["error"] = f"differs from the default's outputs by {row['max_error']:.3g} > {tol}"
      else:
        row["ms_fwdbwd"] = round(median_ms(fn, args, reps), 4)
        row["tflops_fwdbwd"] = round(shape.flops_fwdbwd() / (row["ms_fwdbwd"] * 1e-3) / 1e12, 2)
    except Exception as e:  # compile/launch failure: recorded
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    cost_s[0] = max(cost_s[0], time.time() - started)
    measured[blocks] = row["ms_fwdbwd"]
    log(f"  {stage:8s} {blocks}  "
        + (f"{row['ms_fwdbwd']:9.3f} ms" if row["ms_fwdbwd"] is not None else row["error"]))
    return row["ms_fwdbwd"]

  (_, reference_outputs), reference_grads = _functions(shape, default, interpret)(*args)
  reference = (reference_outputs, reference_grads)
  best, best_ms = default, measure("default", default)
  complete = best_ms is not None
  for stage, fields, values in (TINY_STAGES if tiny else STAGES):
    for value in values:
      candidate = dataclasses.replace(best, **dict(zip(fields, value)))
      ms = measure(stage, candidate)
      if ms is None and rows[-1]["error"] == "skipped: sweep budget spent":
        complete = False
      if ms is not None and (best_ms is None or ms < best_ms):
        best, best_ms = candidate, ms
  default_ms = measured.get(default)
  return dict(shape=dict(dataclasses.asdict(shape), dtype=dtype), interpret=interpret,
              device=jax.devices()[0].device_kind, default=dataclasses.asdict(default),
              default_ms_fwdbwd=default_ms, best=dataclasses.asdict(best), best_ms_fwdbwd=best_ms,
              best_literal=repr(best),
              speedup=None if not (default_ms and best_ms) else round(default_ms / best_ms, 3),
              complete=complete, rows=rows)


def table(result: dict) -> str:
  lines = ["| stage | block_q, block_k | dkv q, k | dq q, k | warps | stages | fwd+bwd ms | "
           "TFLOP/s (P) | max err | note |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in result["rows"]:
    b = r["block_sizes"]
    ms = "" if r["ms_fwdbwd"] is None else f"{r['ms_fwdbwd']:.3f}"
    err = "" if r["max_error"] is None else f"{r['max_error']:.2g}"
    lines.append(f"| {r['stage']} | {b['block_q']}, {b['block_k']} | {b['block_q_dkv']}, "
                 f"{b['block_k_dkv']} | {b['block_q_dq']}, {b['block_k_dq']} | "
                 f"{b['num_warps']} | {b['num_stages']} | {ms} | {r.get('tflops_fwdbwd') or ''} | "
                 f"{err} | {r['error'] or ''} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seq", type=int, default=16384)
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--window", type=int, default=256, help="one-sided")
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--dtype", default=None, choices=sorted(TOLERANCE),
                      help="default: bfloat16 on a GPU, float32 on CPU")
  parser.add_argument("--reps", type=int, default=10)
  harness.common_arguments(
      parser, out=harness.default_out(), budget_s=120.0,
      tiny_help="seq 128, 2 heads, head_dim 16, window 16, blocks 16/32 (CPU smoke)")
  args = parser.parse_args(argv)
  dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
  shape = (Shape(seq=128, batch=1, heads=2, head_dim=16, window=16, causal=args.causal)
           if args.tiny else Shape(args.seq, args.batch, args.heads, args.head_dim, args.window,
                                   args.causal))
  try:
    check_shape(shape, dtype)
  except ValueError as e:
    parser.error(str(e))
  print(f"block sweep: {shape} {dtype} on {jax.devices()[0].device_kind}, budget "
        f"{args.budget_s:.0f} s", flush=True)
  result = sweep(shape, dtype, budget_s=args.budget_s, reps=1 if args.tiny else args.reps,
                 tiny=args.tiny)
  slug = result["device"].replace(" ", "_").replace("/", "_")
  path = harness.write_json(pathlib.Path(args.out) / f"block_sweep_{slug}_{harness.today()}.json",
                            result)
  print(table(result))
  print(f"\ndefault {result['default_ms_fwdbwd']} ms, best {result['best_ms_fwdbwd']} ms "
        f"(x{result['speedup']}){'' if result['complete'] else ' (sweep cut by the budget)'}")
  print(f"best, for BlockSizes.for_device:\n  {result['best_literal']}")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
