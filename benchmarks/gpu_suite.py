"""Every GPU check and timing in one prepared run: correctness first, then speed.

  python benchmarks/gpu_suite.py --out $OUT --budget-s 420     # an H200 session, < 8 minutes
  python benchmarks/gpu_suite.py --tiny --out /tmp/suite        # CPU: every section at toy sizes
  python benchmarks/gpu_suite.py --sections a,b --out DIR       # a subset (letters below)

Sections, run in this order by default (most important first; `--sections` reorders):
  a  correctness: the COMPILED Pallas kernels on the device: `band_attention_pallas` against the
     dense band reference (benchmarks/pallas_gpu_check.py's check: float32 and bf16, forward and
     gradients with cotangents on out and lse, bidirectional and causal, padding holes, an
     all-masked row), and `longformer_attention(impl="pallas")` against `impl="reference"` with
     dilation (1, ..., 2, 2) on 2 heads, 2 global tokens and padding (bidirectional; causal:
     dilation only), float32 (<= 1e-5 of max(1, |ref|)) and bf16 (<= 1e-2), forward and the
     gradients of q, k, v and the global q, k, v.
  b  attention timings, fwd and fwd+bwd: 16k and 64k tokens, batch 1 and 8, 12 heads, head_dim
     64, window 256, bf16: ours with impl pallas and chunked, plain band bidirectional and causal,
     and dilation 2 on 2 heads + 1 global token (target: <= 1.25x the plain band); TFLOP/s on
     the attended pairs P (docs/design.md §2.5). Chunked outputs are checked against pallas.
  e  whole model (benchmarks/model.py): HF transformers in its own process, then ours, ours with
     lm_head=masked and the full-attention (cuDNN) model, at 4096 x 8 and 16384 x 2, bf16,
     tokens/s and MFU; a jax.profiler trace of our masked-head step with its top ops.
  d  cuDNN's sliding window: the 2026-11-30 run saw `jax.nn.dot_product_attention(
     implementation="cudnn", local_window_size=(256, 0))` (called WITHOUT is_causal) differ from
     ours by 2.89 at 64k. Both call forms (with and without is_causal=True) at 64k against an
     exact blockwise reference; their window semantics at small lengths against dense masked
     references (ours [i-w, i], one key fewer or more, left bound only, full causal,
     bidirectional band); for a form that matches ours when short but diverges when long, the
     smallest diverging length (powers of two, then bisection), the first row that goes wrong,
     and probes with 1 head and with batch 8, so that the verdict says whether it is a semantic
     difference or a cuDNN fault (e.g. an int32 overflow near N*N >= 2^31). A gradient check at
     4096. Standalone repro: benchmarks/cudnn_window_repro.py.
  c  peers, each output checked against ours on the SAME inputs before it is timed (a peer that
     disagrees is a failed row with its max |diff|, never timed): cuDNN causal sliding window
     (in this JAX process), torch flex_attention with a sliding-window block mask (bidirectional
     and causal) and HF LongformerSelfAttention (bidirectional; its q/k/v projections set to
     feature permutations, so it attends exactly the q, k, v ours gets), EVERY torch peer in its
     own child process (JAX's allocator keeps the GPU memory it took). Inputs are generated on
     the device by the same integer hash in JAX and in torch (bit-identical; a digest proves it);
     outputs are compared on the first and last 1024 rows and every 31st row.
  f  block-size sweep of the Pallas kernel (benchmarks/block_sweep.py) in what time is left.

Time: `--budget-s` (default 420) is a global deadline; each section gets a share of it (SHARES,
scaled) on a cumulative schedule, so time one section leaves unused goes to the next. Inside a
section, a row is started only if its estimated cost (the slowest of its kind so far) fits; rows
and sections that do not fit are recorded as skipped, with the reason. Every section runs in its
own child process (a kernel fault or OOM kills only that section; GPU memory is released between
sections) and appends each row to `<out>/gpu_suite_parts/<section>.jsonl` the moment it is
measured; the parent merges them into `<out>/gpu_suite.json`, `gpu_suite.md` and `gpu_suite.png`
(written atomically) after every section and every few seconds during one, so a crash or a kill
at any minute leaves everything measured so far on disk. Progress lines carry the elapsed time.

`--tiny` (CPU): every section at toy sizes, float32, Pallas in interpret mode, torch peers on CPU
where they run (flex_attention: forward only), cuDNN rows recorded as "skipped: no GPU" (section
d runs its code with XLA standing in for cuDNN, labelled so). Speed numbers from it mean nothing.
`--inject-peer-fault` perturbs ours before the first flex_attention check (tests: the row must
come out failed).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import datetime
import gc
import io
import itertools
import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib

BENCH = pathlib.Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

SECTION_NAMES = {"a": "correctness", "b": "attention", "e": "model", "d": "cudnn_window",
                 "c": "peers", "f": "block_sweep"}
DEFAULT_ORDER = "a,b,e,d,c,f"
TINY_ORDER = "e,a,b,c,d,f"  # two at a time on a CPU: the longest first
# Seconds of a 420-s budget per section (scaled to --budget-s), on a cumulative schedule.
SHARES = {"a": 45, "b": 80, "e": 150, "d": 35, "c": 90, "f": 20}
SHARE_BUDGET = 420
GRACE_S = 20  # a section is killed this long after its deadline
MERGE_EVERY_S = 5.0
PEER_ROWS_EDGE = 1024  # compared rows: the first and last 1024 and every 31st
PEER_ROWS_STRIDE = 31
CUDNN_BAD = 5e-2  # |diff| of a row that is wrong (bf16 rounding is ~1e-2; the fault was 2.89)


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Everything that differs between a GPU run and --tiny."""
  dtype: str
  reps: int
  band_check_small: bool                    # a: pallas_gpu_check's seq 192 instead of 2048
  op_check: tuple                           # a: (batch, seq, heads, head_dim, window)
  op_cases: tuple                           # a: (causal, dtype name) of the op checks
  attn_shapes: tuple                        # b: (seq, batch), in priority order
  attn_rows: tuple                          # b: (impl, variant), in priority order
  attn: tuple                               # b, c: (heads, head_dim, window)
  model_shapes: tuple                       # e: (seq, batch)
  model_rows: tuple                         # e: our rows (benchmarks/model.py), in priority order
  model_argv: tuple                         # e: extra benchmarks/model.py arguments
  model_first_estimate_s: float
  cudnn_long: int                           # d: the reproduction length
  cudnn_short: tuple                        # d: lengths of the semantics check
  cudnn_pow2: tuple                         # d: powers of two probed before bisecting
  cudnn_granularity: int
  cudnn_grad_seq: int
  peer_shapes: tuple                        # c: (seq, batch), in priority order
  sweep: dict                               # f: benchmarks/attention.py Shape fields
  first_row_estimate_s: float


GPU_SIZES = Sizes(
    dtype="bfloat16", reps=10, band_check_small=False, op_check=(2, 2048, 12, 64, 128),
    op_cases=((False, "float32"), (False, "bfloat16"), (True, "float32"), (True, "bfloat16")),
    attn_shapes=((16384, 1), (65536, 1), (16384, 8), (65536, 8)),
    attn_rows=tuple((impl, variant) for impl in ("pallas", "chunked")
                    for variant in ("bidir", "bidir dil2x2+1g", "causal")),
    attn=(12, 64, 256),
    model_shapes=((4096, 8), (16384, 2)), model_argv=("--reps", "5", "--warmup", "2"),
    model_rows=("longformer_jax_masked", "full_attention", "longformer_jax"),
    model_first_estimate_s=60.0, cudnn_long=65536, cudnn_short=(1024, 2048),
    cudnn_pow2=(4096, 8192, 16384, 32768, 65536), cudnn_granularity=256, cudnn_grad_seq=4096,
    peer_shapes=((16384, 1), (65536, 1), (65536, 8), (16384, 8)),
    sweep=dict(seq=16384, batch=2, heads=12, head_dim=64, window=256),
    first_row_estimate_s=10.0)
TINY_SIZES = Sizes(
    dtype="float32", reps=1, band_check_small=True, op_check=(2, 96, 4, 16, 8),
    op_cases=((False, "float32"), (True, "bfloat16")),
    attn_shapes=((256, 1),),
    attn_rows=(("pallas", "bidir"), ("pallas", "bidir dil2x2+1g"), ("chunked", "bidir")),
    attn=(4, 16, 32),
    model_shapes=((128, 2),), model_argv=("--small", "--reps", "1", "--warmup", "1"),
    model_rows=("longformer_jax_masked", "full_attention"),
    model_first_estimate_s=20.0, cudnn_long=512, cudnn_short=(128,), cudnn_pow2=(256, 512),
    cudnn_granularity=32, cudnn_grad_seq=128, peer_shapes=((256, 1),),
    sweep=dict(seq=128, batch=1, heads=2, head_dim=16, window=16),
    first_row_estimate_s=5.0)


def jax_backend() -> str:
  import jax
  return jax.default_backend()


def torch_child_env() -> dict:
  """On a CPU, one thread for torch children: torch's OpenMP threads spinning against the JAX
  processes made an HF step 15x slower on 2 cores. Nothing changes on a GPU."""
  return {"OMP_NUM_THREADS": "1"} if jax_backend() == "cpu" else {}


def elapsed_line(t0: float, where: str, msg: str) -> str:
  return f"[{time.time() - t0:7.1f}s] {where}: {msg}"


# ================================================================================================
# Inputs that JAX and torch generate bit-identically on the device (an integer hash of the flat
# index, int32 arithmetic that wraps the same way in both, 24 bits to a float exactly).

_HASH_MUL = 0x45D9F3B


def _seed_mix(seed: int) -> int:
  return (seed * 0x27D4EB2D + 0x165667B1) & 0x7FFFFFFF


def _check_hash_size(shape) -> int:
  n = math.prod(shape)
  if n >= 2**31:
    raise ValueError(f"shape {shape} has {n} elements; the hashed inputs take < 2^31")
  return n


def hashed_jax(shape, seed: int, dtype):
  """Uniform on [-2, 2) (std 1.15) in `dtype`, the same bits as `hashed_torch`."""
  import jax.numpy as jnp
  from jax import lax
  h = lax.iota(jnp.int32, _check_hash_size(shape)) ^ jnp.int32(_seed_mix(seed))
  for _ in range(2):
    h = (h * jnp.int32(_HASH_MUL)) & 0x7FFFFFFF
    h = h ^ (h >> 16)
  x = (h & 0xFFFFFF).astype(jnp.float32) * (2.0**-22) - 2.0  # exact in float32
  return x.reshape(shape).astype(dtype)


def hashed_torch(shape, seed: int, dtype, device):
  import torch
  h = torch.arange(_check_hash_size(shape), dtype=torch.int32, device=device) ^ _seed_mix(seed)
  for _ in range(2):
    h = (h * _HASH_MUL) & 0x7FFFFFFF
    h = h ^ (h >> 16)
  x = (h & 0xFFFFFF).to(torch.float32) * (2.0**-22) - 2.0
  return x.reshape(shape).to(dtype)


def digest(bit_arrays) -> str:
  """crc32 of the bit patterns (numpy unsigned ints) of a few elements of each input."""
  return f"{zlib.crc32(b''.join(a.astype('uint32').tobytes() for a in bit_arrays)):08x}"


def digest_jax(*arrays) -> str:
  """`digest` of the first and last 4096 elements of each (flattened) jax array."""
  import numpy as np
  bits = []
  for x in arrays:
    flat = x.reshape(-1)
    for piece in (np.asarray(flat[:4096]), np.asarray(flat[-4096:])):
      bits.append(piece.view(np.uint16 if piece.dtype.itemsize == 2 else np.uint32))
  return digest(bits)


def digest_torch(*tensors) -> str:
  """`digest_jax` of torch tensors."""
  import torch
  bits = []
  for x in tensors:
    flat = x.detach().reshape(-1)
    for piece in (flat[:4096], flat[-4096:]):
      as_int = piece.cpu().view(torch.int16 if piece.element_size() == 2 else torch.int32)
      bits.append(as_int.numpy().view("uint16" if piece.element_size() == 2 else "uint32"))
  return digest(bits)


def compared_rows(seq: int):
  """Sequence positions on which peer outputs are compared (numpy int64, sorted)."""
  import numpy as np
  edge = min(PEER_ROWS_EDGE, seq)
  return np.unique(np.concatenate([np.arange(edge), np.arange(seq - edge, seq),
                                   np.arange(0, seq, PEER_ROWS_STRIDE)]))


def compare_outputs(expected, got, tolerance: float) -> dict:
  """The peer check: max |got - expected| (float32 numpy arrays, same shape) against
  `tolerance` x max(1, max |expected|). Returns dict(max_abs_diff, limit, ok)."""
  import numpy as np
  if expected.shape != got.shape:
    return dict(max_abs_diff=None, limit=None, ok=False,
                error=f"shape {got.shape} != expected {expected.shape}")
  diff = np.abs(got.astype(np.float32) - expected.astype(np.float32))
  worst = float(np.max(diff)) if np.all(np.isfinite(got)) else float("inf")
  limit = tolerance * max(1.0, float(np.max(np.abs(expected))))
  return dict(max_abs_diff=worst, limit=limit, ok=worst <= limit)


def peer_tolerance(dtype_name: str) -> float:
  return 3e-2 if dtype_name in ("bfloat16", "float16") else 2e-4


# ================================================================================================
# Section-process helpers.


class Recorder:
  """Appends JSON lines to a section's part file (flushed per line) and prints progress."""

  def __init__(self, path: pathlib.Path, key: str, t0: float, deadline: float):
    self.path, self.key, self.t0, self.deadline = path, key, t0, deadline
    self.costs: dict[str, float] = {}

  def write(self, record: dict) -> None:
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps(record, default=_json_default) + "\n")
      f.flush()

  def row(self, **row) -> dict:
    self.write({"type": "row", **row})
    return row

  def note(self, **notes) -> None:
    self.write({"type": "note", **notes})

  def log(self, msg: str) -> None:
    print(elapsed_line(self.t0, SECTION_NAMES[self.key], msg), flush=True)

  def fits(self, kind: str, first_estimate_s: float) -> bool:
    """Whether a row of `kind` (estimated: the slowest of that kind so far) fits the deadline."""
    return time.time() + self.costs.get(kind, first_estimate_s) <= self.deadline

  def cost(self, kind: str, seconds: float) -> None:
    self.costs[kind] = max(self.costs.get(kind, 0.0), seconds)

  def skipped(self, reason: str = "skipped: section budget spent", **row) -> dict:
    self.log(f"{row} {reason}")
    return self.row(status="skipped", reason=reason, **row)


def _json_default(x):
  if hasattr(x, "tolist"):
    return x.tolist()
  if dataclasses.is_dataclass(x):
    return dataclasses.asdict(x)
  return str(x)


def _errors(got, want) -> dict:
  """Max |got - want| / max(1, max |want|) per named leaf (float32 numpy)."""
  import numpy as np
  out = {}
  for name, a, b in zip(got, got.values(), want.values()):
    if a is None:
      continue
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    out[name] = (float(np.max(np.abs(a - b))) / max(1.0, float(np.max(np.abs(b))))
                 if np.all(np.isfinite(a)) else float("inf"))
  return out


# ------------------------------------------------------------------------------------------------
# a: correctness


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
      errors = _errors(named(results["pallas"]), named(results["reference"]))
      ok = all(e <= tol for e in errors.values())
      padded_zero = bool(jnp.all(results["pallas"][1][1, seq - seq // 5:] == 0))
      rec.row(status="ok" if ok and padded_zero else "failed", tolerance=tol, errors=errors,
              padding_rows_zero=padded_zero, **what)
      rec.log(f"op {what['dtype']} causal={causal}: {'ok' if ok else 'FAILED'} {errors}")
    except Exception as e:
      traceback.print_exc()
      rec.row(status="failed", error=f"{type(e).__name__}: {str(e)[:400]}", **what)
    rec.cost("op", time.time() - started)


# ------------------------------------------------------------------------------------------------
# b: attention timings


def compile_aot(fn, args):
  """(fn compiled once ahead of time, its peak bytes or None): the one compile serves the
  output check and the timing."""
  import jax
  compiled = jax.jit(fn).lower(*args).compile()
  peak = None
  try:
    stats = compiled.memory_analysis()
    peak = int(stats.argument_size_in_bytes + stats.output_size_in_bytes
               + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
  except Exception:  # not every backend reports it
    pass
  return compiled, peak


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


# ------------------------------------------------------------------------------------------------
# e: whole model


def section_model(rec: Recorder, sizes: Sizes, args) -> None:
  import model as model_bench

  shapes = [f"{s}x{b}" for s, b in sizes.model_shapes]
  hf_dir = pathlib.Path(args.out) / "gpu_suite_parts" / "hf_model"
  shutil.rmtree(hf_dir, ignore_errors=True)
  command = [sys.executable, str(BENCH / "model.py"), "--rows", "hf_transformers", "--shapes",
             *shapes, *sizes.model_argv, "--out", str(hf_dir)]
  hf_budget = (rec.deadline - time.time()) * 0.4
  rec.log(f"HF child: {' '.join(command[1:])} (at most {hf_budget:.0f} s)")
  hf_result = {}
  hf = threading.Thread(target=lambda: hf_result.update(rc_tail=run_child(
      command, time.time() + hf_budget, rec.t0, "model/hf", env=torch_child_env())))
  hf.start()
  # On a GPU, HF runs alone and first, before this process has taken any GPU memory; on a CPU
  # (--tiny, numbers meaningless) it overlaps our rows to save wall time.
  if jax_backend() != "cpu":
    hf.join()

  def record_hf():
    hf.join()
    rc, tail = hf_result["rc_tail"]
    hf_rows = []
    for path in sorted(hf_dir.glob("model_*.json")):
      hf_rows = json.loads(path.read_text())
    for r in hf_rows:
      rec.row(kind="model", status="ok", **r)
    done = {(r["seq"], r["batch"]) for r in hf_rows}
    for seq, batch in sizes.model_shapes:
      if (seq, batch) not in done:
        rec.row(kind="model", row="hf_transformers", impl="hf_transformers_pytorch", seq=seq,
                batch=batch, status="failed", error=f"HF child rc={rc}: {tail[-600:]}")

  hf_recorded = not hf.is_alive()
  if hf_recorded:
    record_hf()
  margs = model_bench.parse_args([*sizes.model_argv, "--no-hf"])
  try:
    check = model_bench.check_full_attention(model_bench.make_config(margs, 128))
    rec.note(full_attention_check=check)
    rec.log(f"full-attention swap check: {check}")
  except Exception as e:
    rec.note(full_attention_check=f"{type(e).__name__}: {str(e)[:300]}")
  trace_dir = str(pathlib.Path(args.out) / "trace")
  # The masked head and the full-attention model at every shape first, then the full head.
  first = [row for row in sizes.model_rows if row != "longformer_jax"]
  order = [(row, shape) for shape in sizes.model_shapes for row in first]
  order += [("longformer_jax", shape) for shape in sizes.model_shapes
            if "longformer_jax" in sizes.model_rows]
  for row, (seq, batch) in order:
    what = dict(kind="model", row=row, impl=model_bench.impl_name(row, margs.impl), seq=seq,
                batch=batch)
    if not rec.fits("model", sizes.model_first_estimate_s):
      rec.skipped(**what)
      continue
    started = time.time()
    try:
      record = model_bench.measure_row(row, margs, seq, batch, trace_dir)
      if trace_dir:
        rec.log(model_bench.format_top_ops(record["trace"]))
        trace_dir = None
      rec.row(kind="model", status="ok", **record)
      mfu = "" if record["mfu"] is None else f", MFU {100 * record['mfu']:.1f}%"
      rec.log(f"{record['impl']} {seq} x {batch}: {record['ms_step']:.1f} ms/step, "
              f"{record['tokens_per_s']:,.0f} tokens/s{mfu}")
    except Exception as e:
      traceback.print_exc()
      rec.row(status="failed", error=f"{type(e).__name__}: {str(e)[:400]}", **what)
    gc.collect()  # the last row's model and optimizer state (nnx graphs hold cycles)
    rec.cost("model", time.time() - started)
  if not hf_recorded:
    record_hf()


# ------------------------------------------------------------------------------------------------
# d: cuDNN's sliding window


def window_candidates(window: int) -> dict:
  """Window semantics a sliding-window kernel might implement: (lo, hi) bounds on key - query
  (None: unbounded)."""
  return {"ours: causal band [i-w, i]": (-window, 0),
          "one key fewer: [i-w+1, i]": (-window + 1, 0),
          "one key more: [i-w-1, i]": (-window - 1, 0),
          "left bound only: [i-w, n)": (-window, None),
          "full causal: [0, i]": (None, 0),
          "bidirectional band: [i-w, i+w]": (-window, window)}


def dense_reference(q, k, v, lo, hi):
  """float32 attention of q, k, v with key - query in [lo, hi] (None: unbounded), dense."""
  import jax
  import jax.numpy as jnp
  n = q.shape[1]
  offset = jnp.arange(n)[None, :] - jnp.arange(n)[:, None]
  keep = jnp.ones((n, n), bool)
  if lo is not None:
    keep &= offset >= lo
  if hi is not None:
    keep &= offset <= hi
  with jax.default_matmul_precision("float32"):
    return jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                        mask=keep[None, None], implementation="xla")


def bisect_divergence(probe, good: int, bad: int, granularity: int):
  """Smallest multiple of `granularity` in (good, bad] at which probe(n) is False (diverges),
  given probe(good) True and probe(bad) False; `probe` is called O(log) times. Returns
  (n, [(n, ok), ...] probed)."""
  if not good < bad:
    raise ValueError(f"need good < bad, got good={good}, bad={bad}")
  if granularity < 1:
    raise ValueError(f"granularity={granularity} must be >= 1")
  probed = []
  lo, hi = good // granularity, -(-bad // granularity)  # in units of granularity
  while hi - lo > 1:
    mid = (lo + hi) // 2
    ok = probe(mid * granularity)
    probed.append((mid * granularity, ok))
    lo, hi = (mid, hi) if ok else (lo, mid)
  return min(hi * granularity, bad), probed


def cudnn_verdict(reproduce: dict, semantics: dict, divergence: dict, window: int) -> str:
  """One paragraph from the rows of section d (pure: unit-tested)."""
  lines = []
  for form, rep in reproduce.items():
    if rep.get("error"):
      lines.append(f"{form}: could not run ({rep['error'][:120]}).")
      continue
    match = semantics.get(form) or []
    ours = "ours: causal band [i-w, i]"
    head = f"{form}: max |diff| {rep['max_abs_diff']:.3g} at n={rep['seq']}"
    if match and ours not in match:
      lines.append(f"{head}. SEMANTIC difference: at short lengths it matches {match} (w={window}),"
                   " not our causal band, at every length.")
    elif not match:
      lines.append(f"{head}. At short lengths it matches none of the candidate windows.")
    elif rep["agrees"]:
      lines.append(f"{head}: agrees with our causal band at short and long lengths.")
    else:
      div = divergence.get(form) or {}
      n = div.get("first_bad_seq")
      if n is None:
        lines.append(f"{head}: matches our band when short, diverges when long (smallest "
                     "diverging length not found within the budget).")
        continue
      row = div.get("first_bad_row")
      facts = [f"n*n = {n * n:,} ({n * n / 2**31:.3f} x 2^31)"]
      if row is not None and row >= 0:
        facts.append(f"first wrong row {row} (row x n = {row * n / 2**31:.3f} x 2^31)")
      overflow = (n * n >= 2**31 > (n - div.get("granularity", 1)) ** 2
                  or (row is not None and row > 0 and row * n >= 2**31 > (row - 1) * n))
      lines.append(f"{head}: matches our causal band when short, first diverges at n = {n} "
                   f"({'; '.join(facts)}). A cuDNN FAULT, not a window semantic"
                   + (", consistent with int32 overflow of an n*n or row*n index." if overflow
                      else "."))
  return " ".join(lines)


def section_cudnn(rec: Recorder, sizes: Sizes, args) -> None:
  import jax
  import jax.numpy as jnp
  from cudnn_window_repro import blockwise_reference, cudnn_sliding

  gpu = jax.default_backend() == "gpu"
  implementation = "cudnn" if gpu else "xla"
  if not gpu:
    rec.note(skip_reason="skipped: no GPU (cuDNN). XLA stands in so that the code runs; its "
                         "numbers say nothing about cuDNN", stand_in="xla")
  heads, head_dim, window = sizes.attn
  forms = {"is_causal=True, local_window_size=(w, 0)": True,
           "local_window_size=(w, 0) without is_causal (as attention.py called it)": False}
  dtype = jnp.bfloat16 if gpu else jnp.float32

  def inputs(seq, batch=1, nheads=heads):
    return [hashed_jax((batch, seq, nheads, head_dim), s, dtype) for s in (11, 12, 13)]

  run_cudnn = jax.jit(cudnn_sliding, static_argnums=(3, 4, 5))
  run_ref = jax.jit(blockwise_reference, static_argnums=(3, 4))

  def probe(seq, is_causal, batch=1, nheads=heads, lo=-window, hi=0):
    """Row errors of the cuDNN call against the exact band [lo, hi] on the same inputs."""
    q, k, v = inputs(seq, batch, nheads)
    got = run_cudnn(q, k, v, window, is_causal, implementation).astype(jnp.float32)
    want = run_ref(q, k, v, -lo, hi)
    row_err = jnp.max(jnp.abs(got - want), axis=(0, 2, 3))
    bad = jnp.nonzero(row_err > CUDNN_BAD, size=1, fill_value=-1)[0][0]
    return dict(seq=seq, batch=batch, heads=nheads, max_abs_diff=float(row_err.max()),
                first_bad_row=int(bad), bad_rows=int(jnp.sum(row_err > CUDNN_BAD)),
                agrees=bool(row_err.max() <= CUDNN_BAD), implementation=implementation)

  def guarded(kind, fn, **what):
    if not rec.fits(kind, sizes.first_row_estimate_s):
      rec.skipped(kind=kind, **what)
      return None
    started = time.time()
    try:
      result = fn()
      rec.row(kind=kind, status="ok", **what, **result)
      return result
    except Exception as e:
      rec.row(kind=kind, status="failed", error=f"{type(e).__name__}: {str(e)[:400]}", **what)
      return dict(error=f"{type(e).__name__}: {str(e)[:400]}")
    finally:
      rec.cost(kind, time.time() - started)

  # 1. The reported observation, both call forms, at the long length.
  reproduce = {}
  for form, is_causal in forms.items():
    result = guarded("reproduce", lambda: probe(sizes.cudnn_long, is_causal), form=form)
    if result is not None:
      reproduce[form] = result
      if "error" not in result:
        rec.log(f"{form} at {sizes.cudnn_long}: max |diff| {result['max_abs_diff']:.4g}, "
                f"first bad row {result['first_bad_row']}")
  # 2. Window semantics at short lengths: which dense masked reference does each form match?
  semantics = {}
  # A small window too: there one key more or fewer moves the output far past bf16 rounding.
  for seq, w in itertools.product(sizes.cudnn_short, (window // 16, window)):
    q, k, v = inputs(seq)
    refs = {name: dense_reference(q, k, v, lo, hi)
            for name, (lo, hi) in window_candidates(w).items()}
    for form, is_causal in forms.items():
      def run(is_causal=is_causal):
        got = run_cudnn(q, k, v, w, is_causal, implementation).astype(jnp.float32)
        diffs = {name: float(jnp.max(jnp.abs(got - ref))) for name, ref in refs.items()}
        return dict(seq=seq, window=w, diffs=diffs,
                    matches=[name for name, d in diffs.items() if d <= CUDNN_BAD])
      result = guarded("semantics", run, form=form)
      if result and "matches" in result:
        previous = semantics.get(form)
        semantics[form] = (result["matches"] if previous is None
                           else [m for m in previous if m in result["matches"]])
        rec.log(f"semantics n={seq} w={w} {form}: matches {result['matches']}")
  # 3. Smallest diverging length of a form that is right when short and wrong when long.
  divergence = {}
  for form, is_causal in forms.items():
    rep = reproduce.get(form) or {}
    if rep.get("agrees", True) or "ours: causal band [i-w, i]" not in semantics.get(form, []):
      continue
    good, bad, first_row = max(sizes.cudnn_short), None, None
    for seq in sizes.cudnn_pow2:
      result = guarded("bisect", lambda: probe(seq, is_causal), form=form, stage="power of two")
      if result is None or "error" in result:
        break
      if result["agrees"]:
        good = seq
      else:
        bad, first_row = seq, result["first_bad_row"]
        break
    div = dict(granularity=sizes.cudnn_granularity, last_good_seq=good, first_bad_seq=bad,
               first_bad_row=first_row)
    if bad is not None and bad - good > sizes.cudnn_granularity:
      def check(seq):
        result = guarded("bisect", lambda: probe(seq, is_causal), form=form, stage="bisection")
        if result is None or "error" in result:
          raise TimeoutError("bisection cut by the budget")
        if not result["agrees"]:
          div["first_bad_row"] = result["first_bad_row"]
        return result["agrees"]
      try:
        # first_bad_row stays that of the last failing probe: the returned length itself.
        div["first_bad_seq"], _ = bisect_divergence(check, good, bad, sizes.cudnn_granularity)
      except TimeoutError:
        div["first_bad_seq"] = None
    divergence[form] = div
    rec.note(divergence={form: div})
    if div["first_bad_seq"]:
      n = div["first_bad_seq"]
      guarded("probe", lambda: probe(n, is_causal, 1, 1), form=form,
              question="1 head, batch 1 at the smallest diverging n: does it depend on heads?")
      guarded("probe", lambda: probe(div["last_good_seq"], is_causal, 8), form=form,
              question="batch 8 at the last good n: does it depend on the batch?")
  # 4. Gradients of the form that should be right, at a length where it agrees.
  def grads():
    q, k, v = inputs(sizes.cudnn_grad_seq)
    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)))
    got = jax.grad(loss(lambda q, k, v: cudnn_sliding(q, k, v, window, True, implementation)),
                   argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: blockwise_reference(q, k, v, window)),
                    argnums=(0, 1, 2))(q, k, v)
    errors = _errors(dict(zip(("dq", "dk", "dv"), got)), dict(zip(("dq", "dk", "dv"), want)))
    return dict(seq=sizes.cudnn_grad_seq, errors=errors,
                agrees=all(e <= 5e-2 for e in errors.values()))
  guarded("grad_check", grads, form="is_causal=True, local_window_size=(w, 0)")
  verdict = cudnn_verdict(reproduce, semantics, divergence, window)
  rec.note(verdict=("[stand-in: XLA, no GPU] " if not gpu else "") + verdict,
           semantics=semantics)
  rec.log(f"verdict: {verdict}")


# ------------------------------------------------------------------------------------------------
# c: peers


def section_peers(rec: Recorder, sizes: Sizes, args) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from attention import Shape
  from longformer_jax import ops

  gpu = jax.default_backend() == "gpu"
  heads, head_dim, window = sizes.attn
  dtype = jnp.dtype(sizes.dtype)
  tol = peer_tolerance(sizes.dtype)
  data_dir = pathlib.Path(tempfile.mkdtemp(prefix="gpu_suite_peers_"))
  embed = heads * head_dim
  perms = dict(k=(np.arange(embed) * 5 + 3) % embed, v=(np.arange(embed) * 7 + 1) % embed)
  ours = jax.jit(lambda q, k, v, causal: ops.longformer_attention(
      q, k, v, window=window, causal=causal, impl="pallas"), static_argnums=3)
  flex_cases, hf_cases = [], []
  injected = False
  try:
    # 1. Our outputs on the peers' inputs (pallas), saved on the compared rows.
    for seq, batch in sizes.peer_shapes:
      dims = (batch, seq, heads, head_dim)
      rows = compared_rows(seq)
      for mode in ("bidir", "causal"):
        if not rec.fits("expected", sizes.first_row_estimate_s):
          break
        started = time.time()
        q, k, v = (hashed_jax(dims, s, dtype) for s in (1, 2, 3))
        out = ours(q, k, v, mode == "causal")
        expected = np.array(out[:, rows], np.float32)  # a writable copy
        if args.inject_peer_fault and not injected:
          expected[0, 0, 0, 0] += 1.0  # the first flex check must now fail
          injected = True
        path = data_dir / f"flex_{mode}_{seq}x{batch}.npz"
        np.savez(path, rows=rows, expected=expected)
        flex_cases.append(dict(seq=seq, batch=batch, mode=mode, expected=str(path),
                               digest=digest_jax(q, k, v)))
        # 2. cuDNN (causal only: it has no right window), in this process, on the same inputs.
        what = dict(kind="peer", peer="jax_cudnn_sliding_window", mode=mode, seq=seq,
                    batch=batch, heads=heads, head_dim=head_dim, window=window,
                    dtype=sizes.dtype)
        if not gpu:
          rec.row(status="skipped", reason="skipped: no GPU", **what)
        elif mode == "bidir":
          rec.row(status="skipped", reason="unsupported: cuDNN's sliding window has no right "
                  "window (jax raises for right > 0 without is_causal)", **what)
        else:
          cudnn_row(rec, what, q, k, v, out, window, tol, sizes.reps,
                    Shape(seq=seq, batch=batch, heads=heads, head_dim=head_dim, window=window,
                          causal=True))
        if mode == "bidir":  # HF: q, k, v as feature permutations of one hidden state x
          x = q.reshape(batch, seq, embed)
          k_h, v_h = (x[..., perms[n]].reshape(dims) for n in ("k", "v"))
          out_h = ours(q, k_h, v_h, False)
          path = data_dir / f"hf_{seq}x{batch}.npz"
          np.savez(path, rows=rows, expected=np.asarray(out_h[:, rows], np.float32),
                   perm_k=perms["k"], perm_v=perms["v"])
          hf_cases.append(dict(seq=seq, batch=batch, mode=mode, expected=str(path),
                               digest=digest_jax(q)))
        del q, k, v, out
        rec.cost("expected", time.time() - started)
    # 3. The torch peers, each in its own process.
    common = dict(heads=heads, head_dim=head_dim, window=window, dtype=sizes.dtype,
                  reps=sizes.reps, tolerance=tol, part=str(rec.path), t0=rec.t0,
                  first_estimate_s=sizes.first_row_estimate_s * (3 if gpu else 1))
    children = (("torch_flex_attention", flex_cases), ("hf_LongformerSelfAttention", hf_cases))
    for index, (peer, cases) in enumerate(children):
      remaining = rec.deadline - time.time()
      # The first child may use at most 60% of what is left, so the second gets a turn.
      deadline = time.time() + (remaining * 0.6 if index == 0 else remaining)
      spec = dict(common, peer=peer, cases=cases, deadline=deadline)
      spec_path = data_dir / f"{peer}.json"
      spec_path.write_text(json.dumps(spec))
      rec.log(f"{peer}: child process, {len(cases)} cases, {deadline - time.time():.0f} s")
      rc, tail = run_child([sys.executable, __file__, "--torch-child", str(spec_path)],
                           deadline + GRACE_S / 2, rec.t0, f"peers/{peer}",
                           env=torch_child_env())
      if rc != 0:
        rec.row(kind="peer", peer=peer, status="failed",
                error=f"child process rc={rc}: {tail[-600:]}")
  finally:
    shutil.rmtree(data_dir, ignore_errors=True)


def cudnn_row(rec, what, q, k, v, ours_out, window, tol, reps, shape) -> None:
  import jax
  import jax.numpy as jnp
  from attention import median_ms
  fwd_fn = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, local_window_size=(window, 0), implementation="cudnn")
  grad_fn = jax.grad(lambda q, k, v: jnp.sum(fwd_fn(q, k, v).astype(jnp.float32)),
                     argnums=(0, 1, 2))
  try:
    fwd, _ = compile_aot(fwd_fn, (q, k, v))
    got = fwd(q, k, v).astype(jnp.float32)
    # compare_outputs on the device (the whole output: 64k x 8 would be 3 GB on the host)
    worst = float(jnp.max(jnp.abs(got - ours_out.astype(jnp.float32))))
    limit = tol * max(1.0, float(jnp.max(jnp.abs(ours_out.astype(jnp.float32)))))
    check = dict(max_abs_diff=worst, limit=limit, ok=bool(worst <= limit))
    if not check["ok"]:
      rec.row(status="failed", reason="output differs from ours", **check, **what)
      return
    grad, peak = compile_aot(grad_fn, (q, k, v))
    ms_fwd, ms_fwdbwd = median_ms(fwd, (q, k, v), reps), median_ms(grad, (q, k, v), reps)
    rec.row(status="ok", **check, **what, ms_fwd=ms_fwd, ms_fwdbwd=ms_fwdbwd, peak_bytes=peak,
            tflops_fwdbwd=round(shape.flops_fwdbwd() / (ms_fwdbwd * 1e-3) / 1e12, 3))
    rec.log(f"cuDNN causal {what['seq']} x {what['batch']}: fwd+bwd {ms_fwdbwd:.3f} ms")
  except Exception as e:
    rec.row(status="failed", error=f"{type(e).__name__}: {str(e)[:400]}", **what)


# ---------------------------------------------------------------- the torch child (no JAX here)


def torch_child(spec_path: str) -> None:
  import numpy as np
  import torch
  spec = json.loads(pathlib.Path(spec_path).read_text())
  cuda = torch.cuda.is_available()
  device = "cuda" if cuda else "cpu"
  tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
  rec = Recorder(pathlib.Path(spec["part"]), "c", spec["t0"], spec["deadline"])
  heads, head_dim, window = spec["heads"], spec["head_dim"], spec["window"]

  def sync():
    if cuda:
      torch.cuda.synchronize()

  def median_ms(fn):
    fn()
    sync()
    samples = []
    for _ in range(spec["reps"]):
      start = time.perf_counter()
      fn()
      sync()
      samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)

  for case in spec["cases"]:
    seq, batch, mode = case["seq"], case["batch"], case["mode"]
    what = dict(kind="peer", peer=spec["peer"], mode=mode, seq=seq, batch=batch, heads=heads,
                head_dim=head_dim, window=window, dtype=spec["dtype"], device=device)
    if not rec.fits("case", spec["first_estimate_s"]):
      rec.skipped(**what)
      continue
    started = time.time()
    try:
      data = np.load(case["expected"])
      dims = (batch, seq, heads, head_dim)
      if spec["peer"] == "torch_flex_attention":
        q, k, v = (hashed_torch(dims, s, tdtype, device) for s in (1, 2, 3))
        if digest_torch(q, k, v) != case["digest"]:
          raise AssertionError("torch's inputs are not JAX's (digest mismatch)")
        fwd, train, leaves = flex_peer(torch, q, k, v, window, mode == "causal", device)
      else:
        x = hashed_torch(dims, 1, tdtype, device)
        if digest_torch(x) != case["digest"]:
          raise AssertionError("torch's inputs are not JAX's (digest mismatch)")
        fwd, train, leaves = hf_layer_peer(torch, x.reshape(batch, seq, heads * head_dim), heads,
                                   window, data["perm_k"], data["perm_v"], device, tdtype)
      with torch.no_grad():
        got = fwd().reshape(dims)[:, torch.from_numpy(data["rows"]).to(device)]
      check = compare_outputs(data["expected"], got.float().cpu().numpy(), spec["tolerance"])
      if not check["ok"]:
        rec.row(status="failed", reason="output differs from ours", **check, **what)
        rec.log(f"{spec['peer']} {mode} {seq} x {batch}: FAILED the check, max |diff| "
                f"{check['max_abs_diff']}")
        continue
      row = dict(status="ok", **check, **what)
      with torch.no_grad():
        row["ms_fwd"] = median_ms(fwd)

      def fwd_bwd():
        for leaf in leaves:
          leaf.grad = None
        train().float().sum().backward()
      try:
        row["ms_fwdbwd"] = median_ms(fwd_bwd)
        pairs = (seq * (window + 1) - window * (window + 1) // 2 if mode == "causal"
                 else seq * (2 * window + 1) - window * (window + 1))
        row["tflops_fwdbwd"] = round(14 * pairs * head_dim * heads * batch
                                     / (row["ms_fwdbwd"] * 1e-3) / 1e12, 3)
      except Exception as e:  # e.g. no backward on CPU
        row["fwdbwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"
      if cuda:
        row["peak_bytes"] = int(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
      rec.row(**row)
      rec.log(f"{spec['peer']} {mode} {seq} x {batch}: max |diff| {check['max_abs_diff']:.3g}, "
              f"fwd {row['ms_fwd']:.3f} ms, fwd+bwd {row.get('ms_fwdbwd', 'n/a')} ms")
    except Exception as e:  # e.g. out of memory: recorded
      rec.row(status="failed", error=f"{type(e).__name__}: {str(e)[:400]}", **what)
      rec.log(f"{spec['peer']} {mode} {seq} x {batch} failed: {type(e).__name__}: {str(e)[:200]}")
    finally:
      if cuda:
        torch.cuda.empty_cache()
      rec.cost("case", time.time() - started)


def flex_peer(torch, q, k, v, window, causal, device):
  """flex_attention with a sliding-window block mask on [B, H, N, D] (compiled on CUDA)."""
  from torch.nn.attention.flex_attention import create_block_mask, flex_attention
  seq = q.shape[1]

  def sliding(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx <= window) & (q_idx - kv_idx >= (0 if causal else -window))

  mask = create_block_mask(sliding, None, None, seq, seq, device=device)
  flex = torch.compile(flex_attention, dynamic=False) if device == "cuda" else flex_attention
  plain = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
  # Inputs that require grad only for the training call: on CPU, flex_attention refuses them
  # (it has no CPU backward) even under no_grad.
  leaves = [x.clone().requires_grad_(True) for x in plain]
  return ((lambda: flex(*plain, block_mask=mask).transpose(1, 2)),
          (lambda: flex(*leaves, block_mask=mask).transpose(1, 2)), leaves)


def hf_layer_peer(torch, x, heads, window, perm_k, perm_v, device, tdtype):
  """HF's LongformerSelfAttention (no dropout) with its query projection the identity and its
  key/value projections feature permutations (exact in any dtype), on hidden states x."""
  import numpy as np
  from transformers import LongformerConfig
  from transformers.models.longformer.modeling_longformer import LongformerSelfAttention
  batch, seq, embed = x.shape
  cfg = LongformerConfig(hidden_size=embed, num_attention_heads=heads,
                         attention_window=[2 * window], num_hidden_layers=1,
                         attention_probs_dropout_prob=0.0)
  layer = LongformerSelfAttention(cfg, layer_id=0).to(device=device, dtype=tdtype)
  with torch.no_grad():
    for linear, perm in ((layer.query, np.arange(embed)), (layer.key, perm_k),
                         (layer.value, perm_v)):
      weight = torch.zeros(embed, embed, device=device, dtype=tdtype)
      weight[torch.arange(embed), torch.as_tensor(perm, device=device)] = 1
      linear.weight.copy_(weight)
      linear.bias.zero_()
  mask = torch.zeros(batch, seq, device=device, dtype=tdtype)  # HF: 0 = local attention
  is_masked, is_global = mask < 0, mask > 0
  leaf = x.detach().clone().requires_grad_(True)
  call = lambda: layer(leaf, attention_mask=mask, is_index_masked=is_masked,
                       is_index_global_attn=is_global, is_global_attn=False)[0]
  return call, call, [leaf]


# ------------------------------------------------------------------------------------------------
# f: block sweep


def section_sweep(rec: Recorder, sizes: Sizes, args) -> None:
  import block_sweep
  from attention import Shape
  budget = rec.deadline - time.time() - 5
  if budget < 5:
    rec.skipped(kind="sweep")
    return
  shape = Shape(**sizes.sweep)
  rec.log(f"sweep {shape} {sizes.dtype}, {budget:.0f} s")
  result = block_sweep.sweep(shape, sizes.dtype, budget_s=budget, reps=sizes.reps,
                             tiny=args.tiny, log=rec.log)
  for row in result.pop("rows"):
    rec.row(kind="sweep", status="ok" if row["ok"] else
            ("skipped" if (row["error"] or "").startswith("skipped") else "failed"), **row)
  rec.note(sweep=result)
  rec.log(f"best: {result['best_literal']} ({result['speedup']}x the default)")


SECTIONS = {"a": section_correctness, "b": section_attention, "e": section_model,
            "d": section_cudnn, "c": section_peers, "f": section_sweep}


def run_section(args) -> None:
  """Body of a section child process."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch children share the GPU
  key = args.run_section
  sizes = TINY_SIZES if args.tiny else GPU_SIZES
  path = pathlib.Path(args.out) / "gpu_suite_parts" / f"{key}.jsonl"
  rec = Recorder(path, key, args.t0, args.deadline)
  import jax
  rec.write(dict(type="meta", device=jax.devices()[0].device_kind, backend=jax.default_backend(),
                 jax=jax.__version__, started=time.time()))
  rec.log(f"started on {jax.devices()[0].device_kind}, {args.deadline - time.time():.0f} s")
  status = "done"
  try:
    SECTIONS[key](rec, sizes, args)
  except Exception as e:
    traceback.print_exc()
    status = "failed"
    rec.note(error=f"{type(e).__name__}: {str(e)[:600]}")
  rec.write(dict(type="done", status=status, finished=time.time()))


# ================================================================================================
# The parent: runs the sections, merges their parts into the report.


def run_child(command, kill_at: float, t0: float, label: str, new_session: bool = False,
              env: dict | None = None) -> tuple[int, str]:
  """Runs `command`, echoing its output, killing it at `kill_at` (with its process group when
  `new_session`: a section's children stay in the section's group and die with it).
  Returns (return code, last lines of output); the tail notes a kill."""
  tail = collections.deque(maxlen=40)
  proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=str(REPO), start_new_session=new_session, bufsize=1,
                          env=None if env is None else {**os.environ, **env})
  killed = threading.Event()

  def watchdog():
    while proc.poll() is None:
      if time.time() >= kill_at:
        killed.set()
        try:
          if new_session:
            os.killpg(proc.pid, 9)
          else:
            proc.kill()
        except ProcessLookupError:
          pass
        return
      time.sleep(0.5)

  threading.Thread(target=watchdog, daemon=True).start()
  for line in proc.stdout:
    line = line.rstrip("\n")
    tail.append(line)
    if not _is_noise(line):
      print(line, flush=True)
  rc = proc.wait()
  if killed.is_set():
    tail.append(f"killed by the suite at {kill_at - t0:.0f} s (budget)")
    print(elapsed_line(t0, label, "killed: past its deadline"), flush=True)
  return rc, "\n".join(tail)


def _is_noise(line: str) -> bool:
  """libtpu's complaints on machines without a TPU (a jax[tpu] install), nothing else."""
  return any(s in line for s in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES",
                                 "libtpu_init_utils", "Source Location Trace",
                                 "Logging before InitGoogle", "host bounds for accelerator"))


def read_part(path: pathlib.Path) -> dict:
  section = dict(rows=[], notes={}, meta=None, done=None)
  if not path.exists():
    return section
  for line in path.read_text(encoding="utf-8").splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue  # a line cut by a kill
    kind = record.pop("type", None)
    if kind == "row":
      section["rows"].append(record)
    elif kind == "note":
      for key, value in record.items():
        if isinstance(value, dict) and isinstance(section["notes"].get(key), dict):
          section["notes"][key].update(value)
        else:
          section["notes"][key] = value
    elif kind in ("meta", "done"):
      section[kind] = record
  return section


class Report:
  def __init__(self, args, order):
    self.out = pathlib.Path(args.out)
    self.parts = self.out / "gpu_suite_parts"
    self.order = order
    self.t0 = args.t0
    self.meta = dict(started=datetime.datetime.now().isoformat(timespec="seconds"),
                     argv=sys.argv[1:], budget_s=args.budget_s, tiny=args.tiny,
                     sections=[f"{k}: {SECTION_NAMES[k]}" for k in order],
                     python=sys.version.split()[0])
    self.state = {k: dict(name=SECTION_NAMES[k], status="pending") for k in order}

  def set(self, key, **fields):
    self.state[key].update(fields)

  def build(self) -> dict:
    sections = {}
    for key in self.order:
      part = read_part(self.parts / f"{key}.jsonl")
      entry = dict(self.state[key])
      entry.update(rows=part["rows"], notes=part["notes"])
      if part["meta"]:
        self.meta.setdefault("device", part["meta"]["device"])
        self.meta.setdefault("jax", part["meta"]["jax"])
      if entry["status"] in ("done", "running") and part["done"]:
        entry["status"] = part["done"]["status"]
      if entry["status"] == "done" and any(r.get("status") == "skipped" for r in entry["rows"]):
        entry["status"] = "partial"
      if part["notes"].get("skip_reason") and not entry.get("skip_reason"):
        entry["skip_reason"] = part["notes"]["skip_reason"]
      sections[SECTION_NAMES[key]] = entry
    summary = summarize(sections)
    return dict(meta=dict(self.meta, elapsed_s=round(time.time() - self.t0, 1)),
                summary=summary, sections=sections)

  def write(self, png: bool = False) -> dict:
    from longformer_jax.io import atomic_write
    report = self.build()
    atomic_write(self.out / "gpu_suite.json", json.dumps(report, indent=1, default=_json_default)
                 + "\n")
    atomic_write(self.out / "gpu_suite.md", markdown(report))
    if png:
      try:
        atomic_write(self.out / "gpu_suite.png", plot_png(report))
      except Exception as e:  # the numbers matter more
        print(f"PNG not written: {type(e).__name__}: {e}", flush=True)
    return report


def summarize(sections: dict) -> dict:
  """Ratios against the GPU targets (docs/pallas.md), from whatever rows exist."""
  summary = {}
  attn = [r for r in sections.get("attention", {}).get("rows", []) if r.get("status") == "ok"]
  by = {(r["impl"], r["variant"], r["seq"], r["batch"]): r for r in attn}
  ratios = []
  for (impl, variant, seq, batch), r in sorted(by.items()):
    plain = by.get((impl, "bidir", seq, batch))
    if variant.startswith("bidir dil") and plain:
      ratio = r["ms_fwdbwd"] / plain["ms_fwdbwd"]
      ratios.append(dict(impl=impl, seq=seq, batch=batch, ratio=round(ratio, 3),
                         target_met=ratio <= 1.25))
  summary["dilation_global_vs_plain_band_fwdbwd"] = ratios
  speedups = []
  for (impl, variant, seq, batch), r in sorted(by.items()):
    fast = by.get(("pallas", variant, seq, batch))
    if impl == "chunked" and fast:
      speedups.append(dict(variant=variant, seq=seq, batch=batch,
                           pallas_speedup=round(r["ms_fwdbwd"] / fast["ms_fwdbwd"], 3)))
  summary["pallas_vs_chunked_fwdbwd"] = speedups
  model = [r for r in sections.get("model", {}).get("rows", []) if r.get("status") == "ok"]
  ratios = []
  for r in model:
    for base_row in ("hf_transformers", "full_attention"):
      base = next((b for b in model if b.get("row") == base_row and b["seq"] == r["seq"]
                   and b["batch"] == r["batch"]), None)
      if base and r.get("row", "").startswith("longformer_jax"):
        ratios.append(dict(row=r["row"], vs=base_row, seq=r["seq"], batch=r["batch"],
                           tokens_per_s_ratio=round(r["tokens_per_s"] / base["tokens_per_s"], 3)))
  summary["model_tokens_per_s_ratios"] = ratios
  checks = [r for s in ("correctness",) for r in sections.get(s, {}).get("rows", [])]
  summary["correctness_ok"] = (all(r.get("status") == "ok" for r in checks) if checks
                               else None)
  peers = sections.get("peers", {}).get("rows", [])
  summary["peer_checks_failed"] = [
      dict(peer=r.get("peer"), mode=r.get("mode"), seq=r.get("seq"), batch=r.get("batch"),
           max_abs_diff=r.get("max_abs_diff"), error=r.get("error"))
      for r in peers if r.get("status") == "failed"]
  cudnn = sections.get("cudnn_window", {}).get("notes", {})
  if cudnn.get("verdict"):
    summary["cudnn_verdict"] = cudnn["verdict"]
  return summary


def _fmt(x, spec=".3f"):
  if x is None or x == "":
    return ""
  return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def markdown(report: dict) -> str:
  meta, sections, summary = report["meta"], report["sections"], report["summary"]
  out = [f"# GPU suite: {meta.get('device', '?')}, jax {meta.get('jax', '?')}, "
         f"{meta['started']}" + (" (--tiny: toy sizes, numbers mean nothing)" if meta["tiny"]
                                  else ""),
         "", f"Budget {meta['budget_s']} s, elapsed {meta['elapsed_s']} s. Only ratios between "
         "rows of this run mean anything.", "", "| section | status | seconds | rows | note |",
         "| --- | --- | --- | --- | --- |"]
  for name, s in sections.items():
    note = s.get("skip_reason") or s.get("error") or s.get("notes", {}).get("error") or ""
    out.append(f"| {name} | {s['status']} | {_fmt(s.get('seconds'), '.0f')} | "
               f"{len(s.get('rows', []))} | {str(note)[:160]} |")
  out += ["", "## Summary", "", "```", json.dumps(summary, indent=1), "```"]
  columns = {
      "correctness": ("kind", "impl", "dtype", "causal", "seq", "dilation", "globals", "status",
                      "errors", "error"),
      "attention": ("impl", "variant", "seq", "batch", "status", "ms_fwd", "ms_fwdbwd",
                    "tflops_fwdbwd", "peak_bytes", "max_abs_diff_vs_pallas", "error", "reason"),
      "model": ("impl", "seq", "batch", "status", "ms_step", "tokens_per_s",
                "model_tflops_per_s", "mfu", "peak_bytes", "error", "reason"),
      "cudnn_window": ("kind", "form", "stage", "seq", "window", "batch", "heads", "status",
                       "agrees", "max_abs_diff", "first_bad_row", "bad_rows", "matches", "errors",
                       "error", "question", "reason"),
      "peers": ("peer", "mode", "seq", "batch", "status", "max_abs_diff", "limit", "ms_fwd",
                "ms_fwdbwd", "tflops_fwdbwd", "fwdbwd_error", "error", "reason"),
      "block_sweep": ("stage", "block_sizes", "status", "ms_fwdbwd", "max_error", "error"),
  }
  for name, s in sections.items():
    out += ["", f"## {name}", ""]
    if s.get("skip_reason"):
      out += [f"Skip reason: {s['skip_reason']}", ""]
    cols = columns[name]
    rows = s.get("rows", [])
    if rows:
      out += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
      for r in rows:
        cells = []
        for c in cols:
          value = r.get(c)
          if c == "block_sizes" and isinstance(value, dict):
            value = "/".join(str(v) for v in value.values())
          if isinstance(value, dict):
            value = ", ".join(f"{k}: {_fmt(v, '.3g')}" for k, v in value.items())
          cells.append(_fmt(value, ".4g").replace("|", "/").replace("\n", " ")[:200])
        out.append("| " + " | ".join(cells) + " |")
    notes = {k: v for k, v in s.get("notes", {}).items() if k not in ("skip_reason",)}
    if name == "model":
      for r in rows:
        if r.get("trace"):
          import model as model_bench
          out += ["", "```", model_bench.format_top_ops(r["trace"]), "```"]
    if notes:
      out += ["", "```", json.dumps(notes, indent=1, default=_json_default)[:6000], "```"]
  return "\n".join(out) + "\n"


def _seq(row) -> str:
  return f"{row['seq'] // 1024}k" if row["seq"] >= 1024 else str(row["seq"])


def plot_png(report: dict) -> bytes:
  """Four panels: attention fwd+bwd ms, model tokens/s (MFU), peers vs ours, sweep."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  sections = report["sections"]
  fig, axes = plt.subplots(2, 2, figsize=(14, 9))
  ok = lambda name: [r for r in sections.get(name, {}).get("rows", []) if r.get("status") == "ok"]

  def bars(ax, labels, values, title, ylabel, notes=None):
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=6)
    ax.set(title=title, ylabel=ylabel)
    for i, note in enumerate(notes or []):
      ax.annotate(note, (i, values[i]), ha="center", va="bottom", fontsize=6)
    if not values:
      ax.text(0.5, 0.5, "no rows", ha="center", transform=ax.transAxes)

  attn = ok("attention")
  bars(axes[0, 0], [f"{r['impl']} {r['variant']} {_seq(r)} x{r['batch']}" for r in attn],
       [r["ms_fwdbwd"] for r in attn], "attention fwd+bwd (ours)", "ms")
  axes[0, 0].set_yscale("log")
  model = ok("model")
  bars(axes[0, 1], [f"{r.get('row', r['impl'])} {r['seq']}x{r['batch']}" for r in model],
       [r["tokens_per_s"] for r in model], "whole model, training step", "tokens/s",
       ["" if r.get("mfu") is None else f"{100 * r['mfu']:.0f}%" for r in model])
  peers = ok("peers")
  ours = {(r["mode"], r["seq"], r["batch"]): r["ms_fwdbwd"] for r in attn
          if r["impl"] == "pallas" and r["variant"] in ("bidir", "causal")}
  labels, values = [], []
  for r in peers:
    if r.get("ms_fwdbwd") and (r["mode"], r["seq"], r["batch"]) in ours:
      labels.append(f"{r['peer']} {r['mode']} {_seq(r)} x{r['batch']}")
      values.append(r["ms_fwdbwd"] / ours[(r["mode"], r["seq"], r["batch"])])
  bars(axes[1, 0], labels, values, "peers: fwd+bwd time / ours (pallas); > 1: ours faster",
       "ratio")
  sweep = ok("block_sweep")
  bars(axes[1, 1], ["/".join(str(v) for v in r["block_sizes"].values()) for r in sweep],
       [r["ms_fwdbwd"] for r in sweep], "Pallas block sweep (q/k, dkv q/k, dq q/k, warps/stages)",
       "fwd+bwd ms")
  meta = report["meta"]
  fig.suptitle(f"{meta.get('device', '?')} jax {meta.get('jax', '?')} {meta['started']}"
               + (" (--tiny: numbers mean nothing)" if meta["tiny"] else ""))
  fig.tight_layout()
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=100)
  plt.close(fig)
  return buffer.getvalue()


def orchestrate(args) -> dict:
  order = [k.strip() for k in args.sections.split(",") if k.strip()]
  unknown = [k for k in order if k not in SECTION_NAMES]
  if unknown or not order or len(set(order)) != len(order):
    raise ValueError(f"--sections {args.sections!r}: expected distinct letters from "
                     f"{sorted(SECTION_NAMES)} ({SECTION_NAMES})")
  args.t0 = time.time()
  out = pathlib.Path(args.out)
  parts = out / "gpu_suite_parts"
  parts.mkdir(parents=True, exist_ok=True)
  for key in order:
    (parts / f"{key}.jsonl").unlink(missing_ok=True)
  deadline = args.t0 + args.budget_s
  report = Report(args, order)
  lock = threading.Lock()

  def write(png: bool = False) -> dict:
    with lock:  # one writer at a time (matplotlib is not thread-safe either)
      return report.write(png)

  write()
  print(elapsed_line(args.t0, "suite", f"sections {' '.join(order)}, budget {args.budget_s:.0f} "
                     f"s, {args.jobs} at a time, out {out}"), flush=True)
  # One at a time: a cumulative schedule of the shares (what a section leaves goes to the next).
  # Several at a time (--tiny only): every section may run to the global deadline.
  schedule, cumulative = {}, 0.0
  for key in order:
    cumulative += SHARES[key] * args.budget_s / SHARE_BUDGET
    schedule[key] = args.t0 + cumulative if args.jobs == 1 else deadline

  def run_one(key):
    now = time.time()
    if now >= deadline - 5:
      with lock:
        report.set(key, status="skipped", skip_reason="skipped: global budget spent")
      return
    section_deadline = min(deadline, max(schedule[key], now + 10))
    with lock:
      report.set(key, status="running", started_s=round(now - args.t0, 1),
                 deadline_s=round(section_deadline - args.t0, 1))
    print(elapsed_line(args.t0, "suite", f"section {key} ({SECTION_NAMES[key]}) until "
                       f"{section_deadline - args.t0:.0f} s"), flush=True)
    command = [sys.executable, __file__, "--run-section", key, "--t0", repr(args.t0),
               "--deadline", repr(section_deadline), "--out", str(out)]
    command += ["--tiny"] * args.tiny + ["--inject-peer-fault"] * args.inject_peer_fault
    rc, tail = run_child(command, section_deadline + GRACE_S, args.t0, SECTION_NAMES[key],
                         new_session=True)
    seconds = round(time.time() - now, 1)
    with lock:
      if read_part(parts / f"{key}.jsonl")["done"]:
        report.set(key, status="done", seconds=seconds)
      else:
        killed = "killed by the suite" in tail
        report.set(key, status="timeout" if killed else "crashed", seconds=seconds, rc=rc,
                   error=("killed past its deadline" if killed else f"rc={rc}") + ": "
                   + tail[-1500:])
    write(png=True)

  stop = threading.Event()

  def merge_periodically():
    while not stop.wait(MERGE_EVERY_S):
      try:
        write()
      except Exception:  # the next merge will do
        pass

  merger = threading.Thread(target=merge_periodically, daemon=True)
  merger.start()
  try:
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
      for future in [pool.submit(run_one, key) for key in order]:
        future.result()
  finally:
    stop.set()
    merger.join()
  final = write(png=True)
  print(elapsed_line(args.t0, "suite", "done: " + ", ".join(
      f"{k}={s['status']}" for k, s in final["sections"].items())), flush=True)
  print(f"wrote {out / 'gpu_suite.json'}, {out / 'gpu_suite.md'}, {out / 'gpu_suite.png'}")
  print(json.dumps(final["summary"], indent=1))
  return final


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=os.environ.get("OUT") or str(BENCH / "results"))
  parser.add_argument("--budget-s", type=float, default=None,
                      help="global deadline in seconds (default 420; 900 with --tiny); "
                           "sections and rows that do not fit are skipped and recorded so")
  parser.add_argument("--jobs", type=int, default=None,
                      help="sections run at a time: 1 (default; timings need the device to "
                           "themselves); --tiny may run 2 (default there), on a CPU")
  parser.add_argument("--sections", default=None,
                      help=f"comma-separated letters, in order (default {DEFAULT_ORDER}; "
                           f"{TINY_ORDER} with --tiny): "
                           + ", ".join(f"{k}={v}" for k, v in SECTION_NAMES.items()))
  parser.add_argument("--tiny", action="store_true", help="toy sizes on CPU (see the docstring)")
  parser.add_argument("--inject-peer-fault", action="store_true",
                      help="perturb ours before the first flex_attention check (tests)")
  # Internal: a section's or a torch peer's child process.
  parser.add_argument("--run-section", choices=sorted(SECTION_NAMES), help=argparse.SUPPRESS)
  parser.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--torch-child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.budget_s is None:
    args.budget_s = 900.0 if args.tiny else 420.0
  if args.sections is None:
    args.sections = TINY_ORDER if args.tiny else DEFAULT_ORDER
  if not args.budget_s > 0:
    parser.error(f"--budget-s must be > 0, got {args.budget_s}")
  if args.jobs is None:
    args.jobs = 2 if args.tiny else 1
  if args.jobs < 1 or (args.jobs > 1 and not args.tiny):
    parser.error(f"--jobs {args.jobs}: 1, or more only with --tiny (timed sections need the "
                 "device to themselves)")
  if args.run_section and (args.t0 is None or args.deadline is None):
    parser.error("--run-section needs --t0 and --deadline")
  return args


def main(argv=None):
  args = parse_args(argv)
  if args.torch_child:
    torch_child(args.torch_child)
  elif args.run_section:
    run_section(args)
  else:
    try:
      orchestrate(args)
    except ValueError as e:
      sys.exit(f"error: {e}")


if __name__ == "__main__":
  main()
