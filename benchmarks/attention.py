"""Band attention speed and memory, every implementation side by side in one process.

  python benchmarks/attention.py                      # ours vs dense, batch 1, seq 1K..64K
  python benchmarks/attention.py --peers   # + pallas, cuDNN, torch flex / HF (if importable)
  python benchmarks/attention.py --seqs 1024 4096 --reps 3 --out benchmarks/results
  python benchmarks/attention.py --op-table --seqs 4096 16384 --rounds 5   # like with like

`--op-table` times every row in interleaved rounds in one process (each round runs every row
`--calls` times, in a rotated order) and reports, per row, the fastest call (the least disturbed
by load) with the median beside it, the ratio to the chunked path per round (fastest call of each
row in that round) with its range over rounds, the load average before and after each round, and
an achieved rate: useful flops (forward 4*B*H*N*(2w+1)*D, forward + backward 2.5 times that)
over the time, beside a jitted 2048 x 2048 float32 `jnp.dot` timed in the same rounds. Rows:
the chunked path, its forward with the loop taking one query block a step instead of
`FORWARD_UNROLL` (patched while tracing; under differentiation it always takes one), the OLD
chunked path (`benchmarks/chunked_old.py`, the same op with the old band kernel patched in), on
CPU the chunked path and the matmul compiled with XLA:CPU's YNNPACK fusions off (`YNNPACK_OFF`;
the rates stay over the default matmul's), the dense reference and
`jax.nn.dot_product_attention` with a local window (where the n x n arrays fit), compiled
PyTorch `flex_attention` with a sliding-window block mask (forward only on CPU: it has no CPU
backward), and a layer row on each side with the SAME q/k/v projections: ours
(three [768 x 768] projections + the op) and HF `LongformerSelfAttention` (whose forward
includes its projections). Besides the JSON and the markdown it draws each table's per-round
ratios (PNG, `plot_op_table`).

Shapes follow docs/design.md §6: 12 heads, head_dim 64, one-sided window 256. Each implementation's
output is checked against the chunked path before it is timed. Times are medians of `--reps`
runs after a warm-up; only ratios between rows of the SAME run are meaningful (shared machines
drift). TFLOP/s are counted on the attended pairs P (docs/design.md §2.5), never on computed tiles.
Peak memory is XLA's compiled footprint (arguments + outputs + temporaries) for JAX rows, and
the allocator's peak for torch rows on GPU.

Writes `<out>/attention_<device>_<date>.json` (a list of rows with keys device, date, impl, mode,
seq, batch, heads, head_dim, window, dilation, globals, ms_fwd, ms_fwdbwd, tflops_fwdbwd,
peak_bytes) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
import contextlib
import math

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # benchmarks/harness.py
from longformer_jax import ops
from longformer_jax.ops.band_chunked import default_block


@dataclasses.dataclass(frozen=True)
class Shape:
  seq: int
  batch: int = 1
  heads: int = 12
  head_dim: int = 64
  window: int = 256
  causal: bool = False
  dilation: tuple | int = 1
  globals_: int = 0

  @property
  def mode(self):
    return "causal" if self.causal else "bidir"

  def attended_pairs(self) -> int:
    """P per head and batch row (docs/design.md §2.5), ignoring dilation's edge effects."""
    n, w = self.seq, min(self.window, self.seq - 1)
    if self.causal:
      return n * (w + 1) - w * (w + 1) // 2
    return n * (2 * w + 1) - w * (w + 1)

  def flops_fwdbwd(self) -> float:
    return 14.0 * self.attended_pairs() * self.head_dim * self.heads * self.batch


def median_ms(fn: Callable, args, reps: int) -> float:
  jax.block_until_ready(fn(*args))  # compile + warm-up
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def compiled_peak_bytes(fn: Callable, args) -> int | None:
  try:
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
  except Exception:  # Not every backend reports it.
    return None
  if stats is None:
    return None
  return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
             + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


# ------------------------------------------------------------------------------------------------
# JAX implementations: each maps (shape) -> f(q, k, v) -> out, all [batch, seq, heads, head_dim].


def ours(impl: str):
  def make(shape: Shape):
    kwargs = dict(window=shape.window, dilation=shape.dilation, causal=shape.causal, impl=impl)
    if shape.globals_:
      gm = jnp.zeros((shape.batch, shape.seq), bool).at[:, :shape.globals_].set(True)
      return lambda q, k, v: ops.longformer_attention(q, k, v, global_mask=gm,
                                                      global_qkv=(q, k, v), **kwargs)
    return lambda q, k, v: ops.longformer_attention(q, k, v, **kwargs)
  return make


def xla_dense(shape: Shape):
  """jax.nn.dot_product_attention with a (two-sided) local window: XLA builds an n x n mask."""
  if shape.dilation not in (1, (1,) * shape.heads) or shape.globals_:
    return None
  left, right = shape.window, 0 if shape.causal else shape.window
  return lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, local_window_size=(left, right), implementation="xla")


def cudnn_causal(shape: Shape):
  """cuDNN's sliding window: causal only (docs/design.md §5.2), GPU only."""
  if (not shape.causal or jax.default_backend() != "gpu" or shape.globals_
      or shape.dilation not in (1, (1,) * shape.heads)):
    return None
  return lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, local_window_size=(shape.window, 0), implementation="cudnn")


def dense_fits(shape: Shape, budget_bytes: float) -> bool:
  # fwd+bwd keeps a few float32 [batch, heads, seq, seq] arrays alive.
  return 4 * 4 * shape.batch * shape.heads * shape.seq**2 < budget_bytes


def bench_jax(name: str, make, shape: Shape, dtype, reps: int, reference_out=None,
              tolerance: float = 0.0):
  fn = make(shape)
  if fn is None:
    return None
  keys = jax.random.split(jax.random.key(0), 3)
  args = [jax.random.normal(k_, (shape.batch, shape.seq, shape.heads, shape.head_dim), dtype)
          for k_ in keys]
  fwd = jax.jit(fn)
  out = fwd(*args)
  if reference_out is not None:
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference_out.astype(jnp.float32))))
    if not err <= tolerance:
      raise AssertionError(f"{name} differs from the chunked path by {err} at {shape}")
  loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32))
  fwdbwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  row = dict(impl=name, ms_fwd=median_ms(fwd, args, reps),
             ms_fwdbwd=median_ms(fwdbwd, args, reps),
             peak_bytes=compiled_peak_bytes(jax.grad(loss, argnums=(0, 1, 2)), args))
  return row, out


# ------------------------------------------------------------------------------------------------
# Torch peers (only with --peers and torch importable).


def torch_peers(shape: Shape, dtype_name: str, reps: int):
  try:
    import torch
  except ImportError:
    print("  (torch not importable: torch peers skipped)")
    return []
  device = "cuda" if torch.cuda.is_available() else "cpu"
  tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
  rows = []

  def time_torch(fn, make_inputs):
    def once():
      inputs = make_inputs()
      out = fn(*inputs)
      out.float().sum().backward()
    def fwd_only():
      with torch.no_grad():
        fn(*make_inputs())
    res = {}
    for key, f in (("ms_fwd", fwd_only), ("ms_fwdbwd", once)):
      f()
      samples = []
      for _ in range(reps):
        if device == "cuda":
          torch.cuda.synchronize()
        start = time.perf_counter()
        f()
        if device == "cuda":
          torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
      res[key] = statistics.median(samples)
    if device == "cuda":
      res["peak_bytes"] = int(torch.cuda.max_memory_allocated())
      torch.cuda.reset_peak_memory_stats()
    return res

  b, n, h, d, w = shape.batch, shape.seq, shape.heads, shape.head_dim, shape.window
  if shape.dilation in (1, (1,) * h) and not shape.globals_:
    try:
      mask, flex = harness.flex_sliding_window(torch, n, w, causal=shape.causal, device=device,
                                               compile_attention=device == "cuda")
      make = lambda: [torch.randn(b, h, n, d, device=device, dtype=tdtype, requires_grad=True)
                      for _ in range(3)]
      rows.append(dict(impl="torch_flex_attention",
                       **time_torch(lambda q, k, v: flex(q, k, v, block_mask=mask), make)))
    except Exception as e:  # Report, don't hide: the row says why it is missing.
      print(f"  torch flex_attention failed: {type(e).__name__}: {e}")
  if not shape.causal and shape.dilation in (1, (1,) * h):  # HF has no dilation
    try:
      from transformers import LongformerConfig
      from transformers.models.longformer.modeling_longformer import LongformerSelfAttention
      cfg = LongformerConfig(hidden_size=h * d, num_attention_heads=h,
                             attention_window=[2 * w], num_hidden_layers=1)
      layer = LongformerSelfAttention(cfg, layer_id=0).to(device=device, dtype=tdtype)
      mask = torch.zeros(b, n, device=device)
      mask[:, :shape.globals_] = 1  # HF: >0 global, 0 local, <0 padding
      is_masked, is_global = mask < 0, mask > 0
      def hf(x):
        return layer(x, attention_mask=mask, is_index_masked=is_masked,
                     is_index_global_attn=is_global, is_global_attn=bool(shape.globals_))[0]
      make = lambda: [torch.randn(b, n, h * d, device=device, dtype=tdtype, requires_grad=True)]
      rows.append(dict(impl="hf_LongformerSelfAttention(incl_qkv_proj)", **time_torch(hf, make)))
    except Exception as e:
      print(f"  HF LongformerSelfAttention failed: {type(e).__name__}: {e}")
  return rows


# ------------------------------------------------------------------------------------------------


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seqs", type=int, nargs="+",
                      default=[1024, 2048, 4096, 8192, 16384, 32768, 65536])
  parser.add_argument("--batches", type=int, nargs="+", default=[1])
  parser.add_argument("--modes", nargs="+", default=["bidir", "causal"],
                      choices=["bidir", "causal"])
  parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                      help="default: float32 on CPU, bfloat16 on accelerators")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--peers", action="store_true",
                      help="add pallas, cuDNN, dilation/global variants and torch peers")
  parser.add_argument("--dense-budget-gb", type=float, default=None,
                      help="skip dense rows whose n x n arrays exceed this (default: 1/3 of RAM "
                           "on CPU, 1/2 of device memory elsewhere)")
  parser.add_argument("--op-table", action="store_true",
                      help="interleaved rounds of the op table (see the module docstring)")
  parser.add_argument("--rounds", type=int, default=5, help="--op-table: interleaved rounds")
  parser.add_argument("--calls", type=int, default=2, help="--op-table: calls per row per round")
  parser.add_argument("--no-torch", action="store_true", help="--op-table: skip the torch rows")
  harness.common_arguments(parser, out=harness.default_out())
  args = parser.parse_args(argv)
  if args.op_table:
    return op_table(args)

  backend = jax.default_backend()
  device = jax.devices()[0].device_kind
  dtype_name = args.dtype or ("float32" if backend == "cpu" else "bfloat16")
  dtype = jnp.dtype(dtype_name)
  if args.dense_budget_gb is not None:
    budget = args.dense_budget_gb * 2**30
  elif backend == "cpu":
    budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 3
  else:
    budget = 0.5 * (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 16 * 2**30)
  tolerance = 2e-2 if dtype == jnp.bfloat16 else 2e-4
  today = harness.today()
  print(f"device={device} backend={backend} dtype={dtype_name} jax={jax.__version__} "
        f"date={today}")

  shapes = []
  for mode in args.modes:
    for batch in args.batches:
      for seq in args.seqs:
        shapes.append(Shape(seq=seq, batch=batch, causal=mode == "causal"))
        if args.peers and mode == "bidir":
          shapes.append(Shape(seq=seq, batch=batch, dilation=(2, 2) + (1,) * 10, globals_=1))

  impls = [("chunked", ours("chunked")), ("reference", ours("reference")),
           ("xla_dense_local_window", xla_dense)]
  if args.peers:
    impls += [("pallas", ours("pallas")), ("cudnn_sliding_window", cudnn_causal)]

  rows = []
  for shape in shapes:
    print(f"{shape.mode} seq={shape.seq} batch={shape.batch} dilation={shape.dilation} "
          f"globals={shape.globals_}", flush=True)
    chunked_out = None
    for name, make in impls:
      if name in ("reference", "xla_dense_local_window") and not dense_fits(shape, budget):
        continue
      if name == "pallas" and backend == "cpu":
        continue  # interpret mode times nothing useful
      try:
        result = bench_jax(name, make, shape, dtype, args.reps, chunked_out, tolerance)
      except Exception as e:  # One failing implementation must not lose the others' rows.
        print(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}")
        continue
      if result is None:
        continue
      row, out = result
      if name == "chunked":
        chunked_out = out
      rows.append(row | {"shape": shape})
      print(f"  {name:28s} fwd {row['ms_fwd']:9.2f} ms  fwd+bwd {row['ms_fwdbwd']:9.2f} ms",
            flush=True)
    if args.peers:
      for row in torch_peers(shape, dtype_name, args.reps):
        rows.append(row | {"shape": shape})
        print(f"  {row['impl']:28s} fwd {row['ms_fwd']:9.2f} ms  fwd+bwd "
              f"{row['ms_fwdbwd']:9.2f} ms", flush=True)

  records = []
  for row in rows:
    shape = row.pop("shape")
    records.append(dict(
        device=device, date=today, dtype=dtype_name, impl=row["impl"], mode=shape.mode,
        seq=shape.seq, batch=shape.batch, heads=shape.heads, head_dim=shape.head_dim,
        window=shape.window, dilation=shape.dilation, globals=shape.globals_,
        ms_fwd=round(row["ms_fwd"], 3), ms_fwdbwd=round(row["ms_fwdbwd"], 3),
        tflops_fwdbwd=round(shape.flops_fwdbwd() / (row["ms_fwdbwd"] * 1e-3) / 1e12, 4),
        peak_bytes=row.get("peak_bytes")))

  slug = device.replace(" ", "_").replace("/", "_")
  path = harness.write_json(pathlib.Path(args.out) / f"attention_{slug}_{today}.json", records)
  png = plot(records, path.with_suffix(".png"))
  print(f"\nwrote {path} and {png}\n")
  print(markdown_table(records))


def plot(records, path: pathlib.Path) -> pathlib.Path:
  """fwd+bwd time and peak memory per token against seq, one line per (impl, mode)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
  series = {}
  for r in records:
    if r["batch"] == records[0]["batch"]:
      label = f"{r['impl']} {r['mode']}" + (" dil+global" if r["globals"] else "")
      series.setdefault(label, []).append(r)
  for label, rows in sorted(series.items()):
    rows.sort(key=lambda r: r["seq"])
    seqs = [r["seq"] for r in rows]
    style = "--" if "causal" in label else "-"
    ax_t.plot(seqs, [r["ms_fwdbwd"] for r in rows], style, marker="o", label=label)
    if all(r["peak_bytes"] for r in rows):
      ax_m.plot(seqs, [r["peak_bytes"] / 2**10 / (r["seq"] * r["batch"]) for r in rows], style,
                marker="o", label=label)
  ax_t.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="fwd+bwd ms",
           title=f"{records[0]['device']} {records[0]['dtype']} batch {records[0]['batch']}")
  ax_m.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="peak KB per token",
           title="peak memory per token (flat = linear)")
  for ax in (ax_t, ax_m):
    ax.grid(True, which="both", alpha=0.3)
  ax_t.legend(fontsize=7)
  fig.tight_layout()
  return harness.write_png(path, fig, dpi=110)


def markdown_table(records) -> str:
  """fwd+bwd ms (and peak MB/token) per implementation and sequence length."""
  lines = ["| mode | batch | impl | seq | fwd ms | fwd+bwd ms | TFLOP/s (P) | peak MB | "
           "peak KB/token | vs chunked fwd+bwd |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  chunked = {(r["mode"], r["batch"], r["seq"], str(r["dilation"]), r["globals"]): r["ms_fwdbwd"]
             for r in records if r["impl"] == "chunked"}
  for r in records:
    key = (r["mode"], r["batch"], r["seq"], str(r["dilation"]), r["globals"])
    peak = r["peak_bytes"]
    ratio = r["ms_fwdbwd"] / chunked[key] if key in chunked else float("nan")
    mode = r["mode"] + ("" if r["dilation"] == 1 else " dil2x2") + (
        f" +{r['globals']}g" if r["globals"] else "")
    lines.append(
        f"| {mode} | {r['batch']} | {r['impl']} | {r['seq']} | {r['ms_fwd']:.2f} | "
        f"{r['ms_fwdbwd']:.2f} | {r['tflops_fwdbwd']:.3f} | "
        f"{'' if peak is None else f'{peak / 2**20:.0f}'} | "
        f"{'' if peak is None else f'{peak / 2**10 / (r['seq'] * r['batch']):.1f}'} | "
        f"{ratio:.2f}x |")
  return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# --op-table: interleaved rounds, like with like.


def useful_flops_fwd(shape: Shape) -> float:
  """4*B*H*N*(2w+1)*D (causal: w+1 keys a query): the forward's useful flops as the op table
  counts them."""
  w = min(shape.window, shape.seq - 1)
  keys = w + 1 if shape.causal else 2 * w + 1
  return 4.0 * shape.batch * shape.heads * shape.seq * keys * shape.head_dim


@contextlib.contextmanager
def old_chunked_kernel():
  """The op with the pre-rewrite band kernel (benchmarks/chunked_old.py) patched in (tracing)."""
  import chunked_old
  from longformer_jax.ops import dispatch  # the module that hands the op its band kernel
  saved = dispatch.band_attention_chunked
  dispatch.band_attention_chunked = chunked_old.band_attention_chunked
  try:
    yield
  finally:
    dispatch.band_attention_chunked = saved


@contextlib.contextmanager
def one_block_a_step():
  """The op with the chunked kernel's undifferentiated forward loop taking one query block a step
  (`band_chunked.FORWARD_UNROLL` = 1, as under differentiation) while tracing."""
  from longformer_jax.ops import band_chunked
  saved = band_chunked.FORWARD_UNROLL
  band_chunked.FORWARD_UNROLL = 1
  try:
    yield
  finally:
    band_chunked.FORWARD_UNROLL = saved


def _jax_runner(fn, args):
  return lambda: jax.block_until_ready(fn(*args))


# XLA:CPU hands dots and row reductions to the YNNPACK library by default (jax 0.12), and some
# projects turn that off (`XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=`); dots then run on
# Eigen. The op table compiles the matmul and the chunked path
# that way too, per program (`compiler_options`), in the same rounds: what the setting costs each.
YNNPACK_OFF = {"xla_cpu_experimental_ynn_fusion_type": ""}
YNNPACK_OFF_SUFFIX = ", XLA:CPU YNNPACK fusions off"


def compile_with(fn, args, options: dict):
  """`fn` jitted and compiled for `args` with XLA `options`; None (the reason printed) where the
  backend does not take them."""
  try:
    return jax.jit(fn).lower(*args).compile(compiler_options=options)
  except Exception as e:  # an option this backend or jax version does not know
    print(f"  skipped {options}: {type(e).__name__}: {str(e)[:200]}")
    return None


def jax_op_rows(shape: Shape, dtype, budget: float):
  """(name, kind, runner) for the JAX rows of one shape (kind 'fwd' or 'fwdbwd'), and the
  compiled fwd+bwd temporaries of the chunked kernels in KB per token (XLA's memory_analysis;
  None where the backend reports none)."""
  keys = jax.random.split(jax.random.key(0), 4)
  dims = (shape.batch, shape.seq, shape.heads, shape.head_dim)
  q, k, v = (jax.random.normal(k_, dims, dtype) for k_ in keys[:3])
  cotangent = jax.random.normal(keys[3], dims, dtype)  # a random cotangent, not sum()
  rows, temporaries = [], {}
  makers = [("chunked", ours("chunked"), None),
            ("chunked_one_block_a_step", ours("chunked"), one_block_a_step),
            ("chunked_old", ours("chunked"), old_chunked_kernel)]
  if jax.default_backend() == "cpu":
    makers.append(("chunked" + YNNPACK_OFF_SUFFIX, ours("chunked"), YNNPACK_OFF))
  if dense_fits(shape, budget):
    makers += [("reference", ours("reference"), None), ("xla_dense_local_window", xla_dense, None)]
  check = None
  for name, make, patch in makers:
    fn = make(shape)
    if fn is None:
      continue
    fwd = jax.jit(fn)
    fwdbwd = jax.jit(lambda q, k, v, fn=fn: jax.vjp(fn, q, k, v)[1](cotangent))
    if isinstance(patch, dict):  # XLA options: the same functions, compiled with them
      fwd, fwdbwd = (compile_with(f, (q, k, v), patch) for f in (fwd, fwdbwd))
      if fwd is None or fwdbwd is None:
        continue
      patch = None
    with patch() if patch else contextlib.nullcontext():
      out = jax.block_until_ready(fwd(q, k, v))  # compiles inside the patch
      jax.block_until_ready(fwdbwd(q, k, v))
      if name.startswith("chunked"):
        compiled = fwdbwd if isinstance(fwdbwd, jax.stages.Compiled) else (
            fwdbwd.lower(q, k, v).compile())
        stats = compiled.memory_analysis()
        temporaries[name] = (None if stats is None else
                             round(stats.temp_size_in_bytes / (shape.batch * shape.seq) / 1024, 1))
    if check is None:
      check = out
    else:
      err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - check.astype(jnp.float32))))
      if not err <= (2e-2 if dtype == jnp.bfloat16 else 2e-4):
        raise AssertionError(f"{name} differs from the chunked path by {err} at {shape}")
    rows.append((name, "fwd", _jax_runner(fwd, (q, k, v))))
    if patch is not one_block_a_step:  # under differentiation the same program as chunked's
      rows.append((name, "fwdbwd", _jax_runner(fwdbwd, (q, k, v))))
  return rows, temporaries


def dots_only(shape: Shape):
  """The chunked kernel's matmuls alone, in its layout and loops (one key span of
  block + 2w keys per query block): forward 2 dots a block, fwd+bwd 7 (the forward's 2, then
  the recomputed scores, dP, dQ, dK^T, dV^T), no masking, softmax or other elementwise work. Its
  time is what the op would take if everything but its dots were free: the ceiling of this
  design on the machine, to read the op's achieved rate against. Returns the jitted
  (forward, fwdbwd) and their arguments: q_b [blocks, B, H, Q, D], k_t and v_t [B, H, N', D],
  dout_b like q_b."""
  w = min(shape.window, shape.seq - 1)
  block = default_block(w)
  blocks = -(-shape.seq // block)
  span = block + (w if shape.causal else 2 * w)
  keys = jax.random.split(jax.random.key(2), 4)
  q_b = jax.random.normal(keys[0], (blocks, shape.batch, shape.heads, block, shape.head_dim))
  dout_b = jax.random.normal(keys[1], q_b.shape)
  k_t, v_t = (jax.random.normal(k_, (shape.batch, shape.heads, blocks * block + span - block,
                                     shape.head_dim)) for k_ in keys[2:])
  take = lambda x, n: lax.dynamic_slice_in_dim(x, n * block, span, axis=x.ndim - 2)

  def forward(q_b, k_t, v_t):
    def one(args):
      q, n = args
      s = jnp.einsum("bhqd,bhkd->bhqk", q, take(k_t, n))
      return jnp.einsum("bhqk,bhkd->bhqd", s, take(v_t, n))
    return lax.map(one, (q_b, jnp.arange(blocks)))

  def fwdbwd(q_b, k_t, v_t, dout_b):
    out_b = forward(q_b, k_t, v_t)

    def one(carry, xs):
      dk, dv = carry
      q, dout, n = xs
      p = jnp.einsum("bhqd,bhkd->bhqk", q, take(k_t, n))
      dp = jnp.einsum("bhqd,bhkd->bhqk", dout, take(v_t, n))
      dq = jnp.einsum("bhqk,bhkd->bhqd", dp, take(k_t, n))
      dk_span = jnp.einsum("bhdq,bhqk->bhdk", jnp.swapaxes(q, -1, -2), dp)
      dv_span = jnp.einsum("bhdq,bhqk->bhdk", jnp.swapaxes(dout, -1, -2), p)
      add = lambda acc, g: lax.dynamic_update_slice_in_dim(
          acc, lax.dynamic_slice_in_dim(acc, n * block, span, axis=3) + g, n * block, axis=3)
      return (add(dk, dk_span), add(dv, dv_span)), dq

    zeros = jnp.zeros(k_t.shape[:2] + k_t.shape[3:] + k_t.shape[2:3])
    (dk, dv), dq = lax.scan(one, (zeros, zeros), (q_b, dout_b, jnp.arange(blocks)))
    return out_b, dq, dk, dv

  return jax.jit(forward), jax.jit(fwdbwd), (q_b, k_t, v_t, dout_b)


def dots_only_rows(shape: Shape):
  """(name, kind, runner) rows of `dots_only`, compiled."""
  fwd, both, (q_b, k_t, v_t, dout_b) = dots_only(shape)
  jax.block_until_ready((fwd(q_b, k_t, v_t), both(q_b, k_t, v_t, dout_b)))
  name = "chunked's dots alone (no softmax: the design's ceiling)"
  return [(name, "fwd", _jax_runner(fwd, (q_b, k_t, v_t))),
          (name, "fwdbwd", _jax_runner(both, (q_b, k_t, v_t, dout_b)))]


def jax_layer_row(shape: Shape, dtype):
  """Ours as a layer: the same three [H*D x H*D] q/k/v projections as HF's, then the op."""
  hidden = shape.heads * shape.head_dim
  keys = jax.random.split(jax.random.key(1), 5)
  x = jax.random.normal(keys[0], (shape.batch, shape.seq, hidden), dtype)
  weights = [jax.random.normal(k_, (hidden, hidden), dtype) / math.sqrt(hidden)
             for k_ in keys[1:4]]
  cotangent = jax.random.normal(keys[4], (shape.batch, shape.seq, shape.heads, shape.head_dim),
                                dtype)
  split = lambda t: t.reshape(shape.batch, shape.seq, shape.heads, shape.head_dim)

  def layer(x, wq, wk, wv):
    return ops.longformer_attention(split(x @ wq), split(x @ wk), split(x @ wv),
                                    window=shape.window, causal=shape.causal, impl="chunked")

  fwdbwd = jax.jit(lambda *a: jax.vjp(layer, *a)[1](cotangent))
  args = (x, *weights)
  jax.block_until_ready(fwdbwd(*args))
  return [("layer chunked (q/k/v projections + op)", "fwdbwd", _jax_runner(fwdbwd, args))]


def torch_op_rows(shape: Shape, dtype_name: str):
  """Compiled flex_attention forward with a sliding-window block mask; HF's layer fwd+bwd."""
  import torch
  torch.manual_seed(0)
  tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
  b, n, h, d, w = shape.batch, shape.seq, shape.heads, shape.head_dim, shape.window
  rows = []
  try:
    mask, flex = harness.flex_sliding_window(torch, n, w, causal=shape.causal, device="cpu",
                                             compile_attention=True)
    q, k, v = (torch.randn(b, h, n, d, dtype=tdtype) for _ in range(3))

    def run_flex():
      with torch.no_grad():
        flex(q, k, v, block_mask=mask)
    run_flex()
    rows.append(("torch flex_attention (compiled, sliding-window block mask)", "fwd", run_flex))
  except Exception as e:  # Report, don't hide: the row says why it is missing.
    print(f"  torch flex_attention failed: {type(e).__name__}: {str(e)[:300]}")
  if not shape.causal:
    try:
      from transformers import LongformerConfig
      from transformers.models.longformer.modeling_longformer import LongformerSelfAttention
      cfg = LongformerConfig(hidden_size=h * d, num_attention_heads=h,
                             attention_window=[2 * w], num_hidden_layers=1)
      layer = LongformerSelfAttention(cfg, layer_id=0).to(dtype=tdtype)
      mask_hf = torch.zeros(b, n)
      x = torch.randn(b, n, h * d, dtype=tdtype, requires_grad=True)
      ct = torch.randn(b, n, h * d, dtype=tdtype)

      def run_hf():
        out = layer(x, attention_mask=mask_hf, is_index_masked=mask_hf < 0,
                    is_index_global_attn=mask_hf > 0, is_global_attn=False)[0]
        out.backward(ct)
      run_hf()
      rows.append(("layer HF LongformerSelfAttention (its q/k/v projections + op)", "fwdbwd",
                   run_hf))
    except Exception as e:
      print(f"  HF LongformerSelfAttention failed: {type(e).__name__}: {str(e)[:300]}")
  return rows


def interleaved_rounds(rows, rounds: int, calls: int):
  """Runs every row `calls` times per round, rows in an order rotated each round. Returns
  (times[row index] = list of per-round lists of seconds, loads = [(before, after)] per round)."""
  times = [[] for _ in rows]
  loads = []
  for r in range(rounds):
    before = os.getloadavg()[0]
    order = list(range(len(rows)))
    order = order[r % len(order):] + order[:r % len(order)]
    for i in order:
      samples = []
      for _ in range(calls):
        start = time.perf_counter()
        rows[i][2]()
        samples.append(time.perf_counter() - start)
      times[i].append(samples)
    loads.append((round(before, 2), round(os.getloadavg()[0], 2)))
    print(f"  round {r + 1}/{rounds} done, load {loads[-1][0]} -> {loads[-1][1]}", flush=True)
  return times, loads


def op_table(args):
  # torch's OpenMP threads would otherwise spin after each torch row, taking the cores from the
  # JAX row that follows it in the round: both sides yield their cores when idle.
  os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
  harness.compilation_cache()
  backend = jax.default_backend()
  dtype_name = args.dtype or ("float32" if backend == "cpu" else "bfloat16")
  dtype = jnp.dtype(dtype_name)
  budget = (args.dense_budget_gb * 2**30 if args.dense_budget_gb is not None
            else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 3)
  stamp = harness.stamp() | {"cpu_count": os.cpu_count(), "dtype": dtype_name,
                             "rounds": args.rounds, "calls": args.calls}
  try:
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    stamp["torch"] = torch.__version__
  except ImportError:
    args.no_torch = True
  print(stamp, flush=True)
  x = jnp.ones((2048, 2048), jnp.float32)
  matmul = jax.jit(jnp.dot)
  jax.block_until_ready(matmul(x, x))
  results = []
  for seq in args.seqs:
    for mode in args.modes:
      shape = Shape(seq=seq, causal=mode == "causal")
      print(f"{mode} seq={seq}: compiling", flush=True)
      rows = [("matmul 2048^2 f32 (jnp.dot)", "matmul", _jax_runner(matmul, (x, x)))]
      if backend == "cpu" and (matmul_off := compile_with(jnp.dot, (x, x), YNNPACK_OFF)):
        rows.append(("matmul 2048^2 f32 (jnp.dot)" + YNNPACK_OFF_SUFFIX, "matmul",
                     _jax_runner(matmul_off, (x, x))))
      op_rows, temporaries = jax_op_rows(shape, dtype, budget)
      rows += op_rows
      if dtype == jnp.float32:
        rows += dots_only_rows(shape)
      rows += jax_layer_row(shape, dtype)
      if not args.no_torch:
        rows += torch_op_rows(shape, dtype_name)
      times, loads = interleaved_rounds(rows, args.rounds, args.calls)
      results.append(summarize(shape, rows, times, loads, temporaries))
      print(op_markdown(results[-1]), flush=True)
  out = pathlib.Path(args.out)
  slug = (f"attention_optable_cpu{os.cpu_count()}_{stamp['date']}_{stamp['commit']}_"
          f"{'-'.join(map(str, args.seqs))}")
  path = harness.write_json(out / f"{slug}.json", dict(stamp=stamp, tables=results))
  md = "\n\n".join(op_markdown(r) for r in results)
  header = (f"Op table, {stamp['device']} ({os.cpu_count()} cores), {dtype_name}, jax "
            f"{stamp['jax']}, torch {stamp.get('torch')}, {stamp['date']}, commit "
            f"{stamp['commit']}; {args.rounds} interleaved rounds x {args.calls} calls per row "
            f"(`python benchmarks/attention.py --op-table --seqs {' '.join(map(str, args.seqs))} "
            f"--modes {' '.join(args.modes)} --rounds {args.rounds} --calls {args.calls}`).")
  harness.write_text(path.with_suffix(".md"), header + "\n\n" + md)
  pngs = [plot_op_table(out / f"{slug}_{t['mode']}_{t['seq']}.png", t) for t in results]
  harness.print_written(path, path.with_suffix(".md"), *pngs)


def plot_op_table(path, table) -> pathlib.Path:
  """Each row's time over the chunked path's, per round (its fastest call in that round), with
  the load average before each round beside them."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 4.5))
  for r in table["rows"]:
    ratios = r.get("vs_chunked_per_round")
    if ratios:
      rounds = range(1, len(ratios) + 1)
      ax.plot(rounds, ratios, "o-", label=f"{r['impl'][:48]} ({r['kind']})")
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xticks(range(1, len(table["load_before_after_per_round"]) + 1))
  ax.set_yscale("log")
  ax.set(xlabel="round", ylabel="its time / the chunked path's (log)",
         title=f"{table['mode']} n={table['seq']}: each row against the chunked path, per round")
  load = ax.twinx()
  before = [a for a, _ in table["load_before_after_per_round"]]
  load.plot(range(1, len(before) + 1), before, "s--", color="gray", alpha=0.5,
            label="load average before the round")
  load.set_ylabel("1-minute load average")
  fig.legend(loc="lower center", fontsize=7, ncol=2)
  fig.tight_layout(rect=(0, 0.2, 1, 1))
  return harness.write_png(path, fig)


def summarize(shape: Shape, rows, times, loads, temporaries=None):
  matmul_best = [min(r) for r in times[0]]
  matmul_rate = 2 * 2048**3 / min(matmul_best)
  best_of = {(name, kind): [min(r) for r in t] for (name, kind, _), t in zip(rows, times)}
  out_rows = []
  for (name, kind, _), t in zip(rows, times):
    flat = [x for r in t for x in r]
    best_rounds = [min(r) for r in t]
    row = dict(impl=name, kind=kind, fastest_ms=round(min(flat) * 1e3, 2),
               median_ms=round(statistics.median(flat) * 1e3, 2))
    if kind == "matmul":
      row["gflops_fastest"] = round(2 * 2048**3 / min(flat) / 1e9, 1)
    if kind in ("fwd", "fwdbwd"):
      flops = useful_flops_fwd(shape) * (2.5 if kind == "fwdbwd" else 1.0)
      row["gflops_fastest"] = round(flops / min(flat) / 1e9, 1)
      row["pct_of_matmul"] = round(100 * flops / min(flat) / matmul_rate, 1)
      if kind == "fwdbwd" and (temporaries or {}).get(name) is not None:
        row["temp_kb_per_token"] = temporaries[name]
      ours_key = ("chunked", kind)
      if (name != "chunked" and not name.startswith(("layer", "chunked's dots"))
          and ours_key in best_of):
        ratios = [o / c for o, c in zip(best_rounds, best_of[ours_key])]
        row["vs_chunked_per_round"] = [round(x, 3) for x in ratios]
        row["vs_chunked_median"] = round(statistics.median(ratios), 3)
      if name.startswith("layer HF") and ("layer chunked (q/k/v projections + op)",
                                          "fwdbwd") in best_of:
        ratios = [o / c for o, c in zip(
            best_rounds, best_of[("layer chunked (q/k/v projections + op)", "fwdbwd")])]
        row["vs_layer_chunked_per_round"] = [round(x, 3) for x in ratios]
    out_rows.append(row)
  return dict(mode=shape.mode, seq=shape.seq, batch=shape.batch, heads=shape.heads,
              head_dim=shape.head_dim, window=shape.window,
              matmul_gflops_fastest=round(matmul_rate / 1e9, 1),
              load_before_after_per_round=loads, rows=out_rows)


def op_markdown(table) -> str:
  lines = [f"**{table['mode']} n={table['seq']}**, batch {table['batch']}, {table['heads']} "
           f"heads x {table['head_dim']}, window {table['window']}; matmul "
           f"{table['matmul_gflops_fastest']} GFLOP/s; load average (1 min) per round: "
           + ", ".join(f"{a}->{b}" for a, b in table["load_before_after_per_round"]),
           "",
           "| row | pass | fastest ms | median ms | useful GFLOP/s (fastest) | % of matmul | "
           "time / chunked's, per round: median [range] | compiled temporaries KB/token |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in table["rows"]:
    ratios = r.get("vs_chunked_per_round") or r.get("vs_layer_chunked_per_round")
    ratio = (f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
             if ratios else "")
    if r.get("vs_layer_chunked_per_round"):
      ratio += " (vs our layer row)"
    lines.append(f"| {r['impl']} | {r['kind']} | {r['fastest_ms']:.1f} | {r['median_ms']:.1f} | "
                 f"{r.get('gflops_fastest', '')} | {r.get('pct_of_matmul', '')} | {ratio} | "
                 f"{r.get('temp_kb_per_token', '')} |")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
