"""Whole-model training step: our LongformerForMaskedLM against HF transformers' PyTorch one and
against the same model with full attention.

  python benchmarks/model.py                              # base, seq 4096, batch 8 (the GPU target)
  python benchmarks/model.py --shapes 4096x8 16384x2      # both docs/design.md §6 anchors
  python benchmarks/model.py --rows longformer_jax_masked full_attention --trace /tmp/trace
  python benchmarks/model.py --impl pallas --reps 20 --out benchmarks/results
  PYTHONPATH=. python benchmarks/model.py --small --out /tmp/modelbench   # tiny, CPU, < 1 min
  python benchmarks/model.py --vs-hf-rounds 5             # ours vs HF side by side, 6x512, 4096x1
  python benchmarks/model.py --vs-hf-rounds 2 --small --seq 128 --batch 1   # its smoke run

Rows (`--rows`, default all; the JSON's `row` key, and its `impl` string in parentheses):
- `hf_transformers` (`hf_transformers_pytorch`): `transformers.LongformerForMaskedLM` with the same
  config (HF's total window is twice our one-sided one; `convert.config_to_hf` / `convert.to_hf`
  do that), float32 parameters, `torch.autocast` bf16 on CUDA (plain float32 on CPU),
  `torch.optim.AdamW` (fused on CUDA). Logits at every position.
- `longformer_jax` (`longformer_jax(attention_impl=auto)`): `longformer_jax.LongformerForMaskedLM`,
  float32 parameters with bf16 compute (`dtype=jnp.bfloat16` in the config), optax AdamW, the step
  under `nnx.jit`. Logits at every position, as HF's.
- `longformer_jax_masked` (`longformer_jax(attention_impl=auto, lm_head=masked)`): the same with
  the LM head at the masked positions only (`prediction_positions` / `masked_positions`, as many
  per row as the batch's most-masked row has).
- `full_attention` (`full_attention(jax.nn.dot_product_attention, implementation=cudnn)`): the
  SAME model (embeddings, layers, LM head, parameter dtype, bf16 compute, dropout, AdamW, logits
  at every position), each layer's band attention swapped for FULL attention through
  `jax.nn.dot_product_attention`: `implementation="cudnn"` (flash attention) on GPU, "xla"
  elsewhere, so that the path runs on CPU too. What a user would pick instead of Longformer at
  4k. No global tokens (so no global projections: 3 x 768^2 fewer weights per layer) and no
  padding (the batch has none; this attention ignores the attention mask).
All rows: random weights, dropout on (train mode), MLM cross-entropy on 15% of positions; the
band rows have 1 global token (<s>) per row. Before timing, HF is checked against ours (our
float32 model's weights copied to HF with `convert.to_hf` give MLM logits within 1e-3, eval mode)
and the full-attention swap is checked against the band model (window >= seq, no globals: the same
function; float32, XLA; on a GPU also cuDNN against XLA at one bf16 attention call). Max
differences are printed.

Times are medians of `--reps` steps after warm-up (compile); only ratios between rows of the SAME
run are meaningful. Peak memory: `device.memory_stats()["peak_bytes_in_use"]` for JAX (none on
CPU), which is the PROCESS's peak so far (jax cannot reset it: a later JAX row shows at least the
peaks of the rows before it); `torch.cuda.max_memory_allocated()` for torch on CUDA. HF runs first
(every shape) and its memory is released, because each framework's allocator keeps what it took.

Model FLOPs and MFU (every row; `mfu` is null where no peak is known: CPU, float32, other GPUs):
- dense part: 6 x (weights) x (positions they apply to): the encoder layers' parameters (global
  projections included: the band rows compute k_g, v_g (and q_g) at every position) x B x N, the
  LM head (dense, LayerNorm, bias and the tied E x V decoder) x B x (positions it runs at: N, or
  the masked ones). Embedding lookups count nothing.
- attention, per layer: 4 x B x H x D x pairs forward, x3 for forward+backward (no
  recomputation counted), with pairs the attended (query, key) pairs per head and row: the band's
  P of docs/design.md §2.5 (`N(2w+1)` less the edges) plus 2 N G for G global tokens; N^2 for
  full attention.
- MFU = model FLOPs / step time / peak; peak = `PEAK_BF16_FLOPS[device_kind]` (dense bf16).

`--trace DIR` wraps `TRACE_STEPS` steps of the first of our rows measured (after its timing) in
`jax.profiler.trace(DIR)` and prints the top ops by time, read back from the written
`.xplane.pb` with `jax.profiler.ProfileData` (no tensorboard needed); the JSON row gets them too.
On a GPU that is device time; on a CPU it is CPU time summed over every host thread that ran an
op, the intra-op pool's included (`top_ops`), so it can exceed the step's wall time.

`--vs-hf-rounds R`: ours and HF side by side in ONE shape (--seq, default 4096; --batch,
default 1; --preset, default 6x512: 6 layers x hidden 512, 8 heads, FFN 2,048, vocabulary
50,265, window 256 per side; --small: the tiny config), float32 on CPU. First the logits check
(`check_agreement`, recorded in the JSON with its max difference; a failure writes the JSON and
times nothing). Then HF gets OUR model's weights (`convert.to_hf`), so both train the same
weights on the same batch (logits at every position on both sides unless `--vs-hf-row
longformer_jax_masked`), and R interleaved rounds (benchmarks/attention.py's
`interleaved_rounds`: each round runs both steps `--calls` times, the order rotated, the 1-minute
load average before and after) are summarised by `harness.side_by_side`: each row's fastest and
median step and tokens/s, and per round HF's fastest step over ours (= our tokens/s over HF's)
with its median and range. Writes `<out>/model_vs_hf_<preset>_cpu<n>_<date>_<commit>_<seq>x
<batch>.json`, `.md` and `.png` (the per-round ratios beside the load).

Writes `<out>/model_<device>_<date>.json`, a list of rows with the keys of earlier versions
(device, date, impl, seq, batch, dtype, ms_step, tokens_per_s, peak_bytes; `impl` strings
unchanged) and new ones (row, attention, attention_share, lm_head_positions, params,
model_flops_per_step, model_tflops_per_s, mfu, peak_tflops; `trace` on the traced row), and the
markdown table beside it, both rewritten after every row.
torch/transformers are optional: without them the HF row is left out (a note says so).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import statistics
import sys
import time
import traceback
import warnings

# Torch shares the GPU with JAX in this process; JAX's default grab of 75% of device memory up
# front would leave HF too little (it peaks near 48 GB at base size, seq 4096, batch 8).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # benchmarks/harness.py
from attention import Shape, interleaved_rounds
from longformer_jax import LongformerConfig, LongformerForMaskedLM, convert
from longformer_jax.modeling import masked_positions

MASK_FRACTION = 0.15
LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.01
CHECK_TOLERANCE = 1e-3
BF16_ATTENTION_TOLERANCE = 2e-2  # one bf16 attention call, cuDNN vs XLA (outputs are O(1))
TRACE_STEPS = 3
ROWS = ("hf_transformers", "longformer_jax", "longformer_jax_masked", "full_attention")
JAX_ROWS = ROWS[1:]
# Dense (no sparsity) bf16 tensor-core peak FLOP/s by `jax.Device.device_kind`, for MFU. Source:
# NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): "BF16 Tensor Core 1,979 TFLOPS" is quoted with
# sparsity; dense is half of it, 989 TFLOPS. The H100 SXM has the same figure in its datasheet;
# "NVIDIA H100 80GB HBM3" is the device kind jax reported on one (2026-12-05).
PEAK_BF16_FLOPS = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12}
# `--preset`: changes to `LongformerConfig.base()` (vocabulary 50,265, window 256 per side).
# "6x512": the CPU figure's model, 6 layers x hidden 512, 8 heads of 64, FFN 2,048.
PRESETS = {"base": {},
           "6x512": dict(num_hidden_layers=6, hidden_size=512, num_attention_heads=8,
                         intermediate_size=2048)}
AGREEMENT_ROWS = 2  # rows of the logits check's batch


def peak_flops(device_kind: str, dtype_name: str) -> float | None:
  """The dense peak for MFU, or None (CPU, float32 compute, a device kind not in the table)."""
  return PEAK_BF16_FLOPS.get(device_kind) if dtype_name == "bfloat16" else None


def full_attention_implementation() -> str:
  """cuDNN flash attention on a GPU; XLA elsewhere (so that the row's code runs on CPU too)."""
  return "cudnn" if jax.default_backend() == "gpu" else "xla"


def impl_name(row: str, attention_impl: str) -> str:
  """The `impl` string of a row (kept as before for the rows that existed)."""
  if row not in ROWS:
    raise ValueError(f"row={row!r} is not one of {ROWS}")
  return {"hf_transformers": "hf_transformers_pytorch",
          "longformer_jax": f"longformer_jax(attention_impl={attention_impl})",
          "longformer_jax_masked": f"longformer_jax(attention_impl={attention_impl}, "
                                   "lm_head=masked)",
          "full_attention": "full_attention(jax.nn.dot_product_attention, "
                            f"implementation={full_attention_implementation()})"}[row]


def make_config(args, seq: int | None = None) -> LongformerConfig:
  """Our config (one-sided window); the position table is grown when seq needs it."""
  seq = args.seq if seq is None else seq
  if args.small:
    config = LongformerConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=256, attention_window=16)
  else:
    config = LongformerConfig.base(**PRESETS[args.preset])
  # RoBERTa positions start at pad_token_id + 1.
  positions = max(config.max_position_embeddings, seq + config.pad_token_id + 1)
  return config.replace(max_position_embeddings=positions, attention_impl=args.impl)


def make_batch(config: LongformerConfig, seq: int, batch: int, seed: int = 0):
  """numpy int32 ids (<s> first, never <pad>), global mask on <s>, labels (-100 = unmasked)."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(config.pad_token_id + 1, config.vocab_size, (batch, seq), dtype=np.int32)
  ids[:, 0] = config.bos_token_id
  global_mask = np.zeros((batch, seq), np.int32)
  global_mask[:, 0] = 1
  labels = rng.integers(config.pad_token_id + 1, config.vocab_size, (batch, seq), dtype=np.int32)
  labels[rng.random((batch, seq)) >= MASK_FRACTION] = -100
  return ids, global_mask, labels


def timed(step, sync, reps: int, warmup: int) -> float:
  """Median milliseconds of `step` (after `warmup` untimed calls), `sync` waiting for it."""
  for _ in range(warmup):
    sync(step())
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    sync(step())
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


# ------------------------------------------------------------------------------------------------
# The full-attention peer: our model with each layer's attention core swapped.


class FullSelfAttention(nnx.Module):
  """Drop-in for a layer's `LongformerSelfAttention`: the same query/key/value/output
  projections (the modules themselves, not copies), full attention in between through
  `jax.nn.dot_product_attention(implementation=...)`. No global tokens, no padding mask."""

  def __init__(self, band_attention, implementation: str):
    if implementation not in ("cudnn", "xla"):
      raise ValueError(f"implementation={implementation!r}: expected 'cudnn' or 'xla'")
    self.query, self.key = band_attention.query, band_attention.key
    self.value = band_attention.value
    self.output = band_attention.output
    self.implementation = implementation

  def __call__(self, hidden_BxNxE, attention_mask_BxN=None, global_mask_BxN=None, *,
               window=None, max_global=None, output_attentions=False):
    del attention_mask_BxN, window, max_global  # no padding in the benchmark's batches
    if global_mask_BxN is not None or output_attentions:
      raise ValueError("full attention takes no global_mask and no output_attentions")
    out_BxNxHxD = jax.nn.dot_product_attention(
        self.query(hidden_BxNxE), self.key(hidden_BxNxE), self.value(hidden_BxNxE),
        implementation=self.implementation)
    return self.output(out_BxNxHxD), None


def with_full_attention(model: LongformerForMaskedLM, implementation: str):
  """Swaps every layer's attention for `FullSelfAttention` in place; returns the model."""
  for layer in model.longformer.layers:
    layer.attention = FullSelfAttention(layer.attention, implementation)
  return model


def build_model(config: LongformerConfig, row: str, seed: int = 0) -> LongformerForMaskedLM:
  model = LongformerForMaskedLM(config, rngs=nnx.Rngs(seed))
  if row == "full_attention":
    with_full_attention(model, full_attention_implementation())
  return model


def check_full_attention(config: LongformerConfig) -> dict:
  """Max |band model - full-attention model| MLM logits with window >= seq and no globals (the
  same function), float32, XLA; on a GPU also max |cuDNN - XLA| of one bf16 attention call."""
  seq = 128
  cfg = config.replace(attention_window=seq, dtype=jnp.float32)
  model = LongformerForMaskedLM(cfg, rngs=nnx.Rngs(2))
  model.eval()
  ids = jnp.asarray(make_batch(cfg, seq, 2, seed=2)[0])
  forward = lambda: nnx.jit(lambda model, ids: model(ids).logits)(model, ids)
  with jax.default_matmul_precision("highest"):
    band = forward()
    with_full_attention(model, "xla")
    full = forward()
  result = dict(band_vs_full_xla=float(jnp.max(jnp.abs(band - full))))
  if full_attention_implementation() == "cudnn":
    heads = config.num_attention_heads
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 512, heads, config.hidden_size // heads),
                                 jnp.bfloat16) for i in range(3))
    outs = [jax.nn.dot_product_attention(q, k, v, implementation=i).astype(jnp.float32)
            for i in ("cudnn", "xla")]
    result["cudnn_vs_xla_bf16"] = float(jnp.max(jnp.abs(outs[0] - outs[1])))
  return result


def full_attention_check_ok(check: dict) -> bool:
  """Whether `check_full_attention` says the full-attention row is the model it claims."""
  return (check["band_vs_full_xla"] <= CHECK_TOLERANCE
          and check.get("cudnn_vs_xla_bf16", 0.0) <= BF16_ATTENTION_TOLERANCE)


# ------------------------------------------------------------------------------------------------
# Model FLOPs (see the module docstring).


def count_params(module) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def model_flops(config: LongformerConfig, row: str, seq: int, batch: int,
                head_positions: int, num_global: int = 1) -> dict:
  """Model FLOPs of one training step (forward + backward) of `row` at seq x batch."""
  abstract = nnx.eval_shape(lambda: build_model(config, row))
  layer_params = count_params(abstract.longformer.layers)
  head_params = (count_params(abstract.lm_head)
                 + count_params(abstract.longformer.embeddings.word_embeddings))  # tied decoder
  dense = 6 * (batch * seq * layer_params + batch * head_positions * head_params)
  heads = config.num_attention_heads
  head_dim = config.hidden_size // heads
  pairs = 0
  for window in config.layer_windows:
    if row == "full_attention":
      pairs += seq * (seq + 1) // 2 if config.causal else seq * seq
    else:
      pairs += (Shape(seq=seq, window=window, causal=config.causal).attended_pairs()
                + (0 if config.causal else 2 * seq * num_global))
  attention = 12 * batch * heads * head_dim * pairs
  return dict(params=count_params(abstract), dense_flops=dense, attention_flops=attention,
              total_flops=dense + attention)


# ------------------------------------------------------------------------------------------------
# Ours.


def mlm_loss(logits_BxNxV, labels_BxN):
  # float32 softmax: bf16 logits lose too much over a 50K vocabulary (HF's cross-entropy upcasts
  # under autocast too).
  weights = (labels_BxN >= 0).astype(jnp.float32)
  per_token = optax.softmax_cross_entropy_with_integer_labels(
      logits_BxNxV.astype(jnp.float32), jnp.maximum(labels_BxN, 0))
  return jnp.sum(per_token * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def our_step(config: LongformerConfig, args, row: str = "longformer_jax",
             model: LongformerForMaskedLM | None = None):
  """One of our rows' (JAX_ROWS) training step on `make_batch(config, args.seq, args.batch)`:
  (step, head_positions), `step()` running one AdamW step and returning its loss (a jax scalar,
  not waited for). `model`: train this model (e.g. one whose weights HF got too) instead of a
  new one (`build_model`).

  longformer_jax_masked: the LM head runs at the masked positions only (`prediction_positions`),
  as many per row as the batch's most-masked row has; the other rows: at every position, as HF's.
  """
  if row not in JAX_ROWS:
    raise ValueError(f"row={row!r} is not one of our rows {JAX_ROWS}")
  masked_head = row == "longformer_jax_masked"
  full = row == "full_attention"
  if model is None:
    model = build_model(config.replace(dtype=jnp.bfloat16) if args.bf16 else config, row)
  optimizer = nnx.Optimizer(model, optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY),
                            wrt=nnx.Param)
  model.train()  # dropout on, as in HF's train mode

  @nnx.jit
  def train_step(model, optimizer, ids, global_mask, labels):
    def loss_fn(model):
      # max_global: the traced mask cannot be counted under jit; one <s> per row.
      kwargs = {} if full else dict(global_attention_mask=global_mask, max_global=1)
      if not masked_head:
        return mlm_loss(model(ids, **kwargs).logits, labels)
      positions, targets, _ = masked_positions(labels, max_predictions)
      logits = model(ids, prediction_positions=positions, **kwargs).logits
      return mlm_loss(logits, targets)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  batch = make_batch(config, args.seq, args.batch)
  max_predictions = int((batch[2] >= 0).sum(axis=1).max())  # no target is ever dropped
  ids, global_mask, labels = (jnp.asarray(x) for x in batch)
  step = lambda: train_step(model, optimizer, ids, global_mask, labels)
  return step, max_predictions if masked_head else args.seq


def bench_ours(config: LongformerConfig, args, row: str = "longformer_jax",
               trace_dir: str | None = None) -> dict:
  """Times one of our rows (JAX_ROWS, `our_step`). Returns dict(ms, peak, head_positions,
  trace). trace_dir: also run TRACE_STEPS steps under `jax.profiler.trace(trace_dir)` after the
  timing and read back their top ops (`top_ops`).
  """
  step, head_positions = our_step(config, args, row)
  ms = timed(step, jax.block_until_ready, args.reps, args.warmup)
  loss = float(step())
  if not np.isfinite(loss):
    raise FloatingPointError(f"our training step ({row}) gave loss {loss}")
  stats = jax.devices()[0].memory_stats() or {}
  trace = None
  if trace_dir:
    started = time.time()
    with jax.profiler.trace(trace_dir):
      for _ in range(TRACE_STEPS):
        jax.block_until_ready(step())
    trace = top_ops(trace_dir, since=started, steps=TRACE_STEPS)
  return dict(ms=ms, peak=stats.get("peak_bytes_in_use"), head_positions=head_positions,
              trace=trace)


# ------------------------------------------------------------------------------------------------
# Reading a jax.profiler trace back.


def _event_key(event) -> str:
  try:
    stats = dict(event.stats)
  except Exception:
    stats = {}
  return str(stats.get("hlo_op") or event.name)


def top_ops(trace_dir: str, count: int = 15, since: float = 0.0, steps: int = 1) -> dict:
  """Time per op of the newest `.xplane.pb` under `trace_dir` (written after `since`).

  Read with `jax.profiler.ProfileData` (jax 0.11 and 0.12; no tensorboard plugin). Device planes
  ('/device:GPU:0', ...): their 'XLA Ops' line if present, else their 'Stream' lines (kernels,
  keyed by the `hlo_op` stat where there is one), else all their lines but module/step ones.

  A CPU-only trace has no device plane: XLA's CPU runtime runs the thunks of a step on its
  executing thread ('tf_XLAExecute/...') AND on the intra-op pool's threads ('tf_XLAEigen/...'),
  where the dots and most large fusions run, a parallel fusion split into pieces over several of
  them. Then every line of every '/host:' plane is read (`host_op_times`): its op events are the
  ones carrying an `hlo_op` stat (python frames, the thread pool's bookkeeping
  'ThreadpoolListener::*', 'ThunkExecutor::Execute*', 'SlinkyThreadPool::Await' and the 'end: X'
  markers carry none), each piece counted once on its own thread with its EXCLUSIVE time (a
  'while' thunk less the body ops that ran nested inside it on the same thread), so the total is
  CPU time summed over threads: above the step's wall time when threads run in parallel.
  `source` names the threads summed, `threads` gives each one's op time.

  Returns dict(path, source, total_ms, ms_per_step, ops=[dict(name, ms, count, share)],
  planes={plane: its first line names}, threads={line: op ms} on a CPU trace; count: events,
  i.e. thread pieces on a CPU trace) or dict(path, error) when the trace cannot be read (it is
  still on disk for TensorBoard/Perfetto).
  """
  files = [p for p in pathlib.Path(trace_dir).rglob("*.xplane.pb")
           if p.stat().st_mtime >= since - 1]
  if not files:
    return dict(path=str(trace_dir), error="no .xplane.pb written under it")
  path = max(files, key=lambda p: p.stat().st_mtime)
  with warnings.catch_warnings():
    # jax's event_stats type warns (DeprecationWarning: no __module__) when it is first built.
    warnings.simplefilter("ignore", DeprecationWarning)
    return _read_trace(path, count, steps)


def _read_trace(path: pathlib.Path, count: int, steps: int) -> dict:
  threads = None
  try:
    from jax.profiler import ProfileData
    data = ProfileData.from_file(str(path))
    totals, source, layout = {}, None, {}
    for plane in data.planes:
      lines = list(plane.lines)
      layout[plane.name] = [l.name for l in lines][:12]  # for reading a trace that surprises
      if not plane.name.startswith("/device:") or "CUSTOM" in plane.name:
        continue
      chosen = ([l for l in lines if l.name == "XLA Ops"]
                or [l for l in lines if l.name.startswith("Stream")]
                or [l for l in lines if not any(w in l.name for w in ("Module", "Step"))])
      for line in chosen:
        source = source or f"{plane.name}: {line.name}"
        for event in line.events:
          entry = totals.setdefault(_event_key(event), [0, 0.0])
          entry[0] += 1
          entry[1] += event.duration_ns
    if not totals:
      totals, threads = host_op_times(data)
      if threads:
        kinds = {}
        for name in threads:  # 'plane: line', the line 'tf_XLAEigen/<id>'
          kind = name.split(": ", 1)[-1].split("/")[0]
          kinds[kind] = kinds.get(kind, 0) + 1
        source = ("host threads " + ", ".join(f"{k} x{n}" for k, n in kinds.items())
                  + ": CPU time summed over threads (exclusive time of each op piece)")
  except Exception as e:
    return dict(path=str(path), error=f"{type(e).__name__}: {str(e)[:200]}")
  if not totals:
    return dict(path=str(path), error="no op events found", planes=layout)
  total_ns = sum(ns for _, ns in totals.values())
  ops = [dict(name=name[:120], ms=round(ns / 1e6, 3), count=n, share=round(ns / total_ns, 4))
         for name, (n, ns) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:count]]
  result = dict(path=str(path), source=source, total_ms=round(total_ns / 1e6, 3),
                ms_per_step=round(total_ns / 1e6 / steps, 3), ops=ops, planes=layout)
  if threads is not None:
    result["threads"] = {name: round(ns / 1e6, 3) for name, ns in threads.items()}
  return result


def host_op_times(data) -> tuple[dict, dict]:
  """({op: [pieces, exclusive ns]}, {'plane: line': op ns}) over every line of every '/host:'
  plane of a `ProfileData`: op events are those with an `hlo_op` stat; an event's exclusive time
  is its duration less that of the op events nested directly inside it on the same line."""
  totals, threads = {}, {}
  for plane in data.planes:
    if not plane.name.startswith("/host:"):
      continue
    for line in plane.lines:
      if line.name == "python":
        continue  # Python frames carry no hlo_op stat: skipped unread (100k+ events a step)
      events = []
      for event in line.events:
        stats = dict(event.stats)
        if "hlo_op" in stats:
          events.append((event.start_ns, event.duration_ns, str(stats["hlo_op"])))
      if not events:
        continue
      events.sort(key=lambda e: (e[0], -e[1]))  # a parent before the events nested in it
      exclusive = [duration for _, duration, _ in events]
      stack = []  # indices of the open events, innermost last
      for i, (start, duration, _) in enumerate(events):
        while stack and events[stack[-1]][0] + events[stack[-1]][1] <= start:
          stack.pop()
        if stack:
          exclusive[stack[-1]] -= duration
        stack.append(i)
      line_ns = 0.0
      for (_, _, name), ns in zip(events, exclusive):
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += ns
        line_ns += ns
      threads[f"{plane.name}: {line.name}"] = line_ns
  return totals, threads


def format_top_ops(trace: dict) -> str:
  if trace.get("error"):
    return f"trace written under {trace['path']}; not read back: {trace['error']}"
  lines = [f"trace {trace['path']}", f"top ops by time ({trace['source']}; "
           f"{trace['ms_per_step']:.1f} ms of op time per step):"]
  for op in trace["ops"]:
    lines.append(f"  {op['ms']:10.2f} ms {100 * op['share']:5.1f}%  x{op['count']:<5d} "
                 f"{op['name']}")
  return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# HF transformers (PyTorch).


def import_torch():
  try:
    import torch
    import transformers
  except ImportError as e:
    print(f"note: torch/transformers not importable ({e}); only our model is measured")
    return None, None
  return torch, transformers


def agreement_seq(config: LongformerConfig) -> int:
  """The length `check_agreement` compares at: several windows wide, still small."""
  return min(512, 4 * max(config.layer_windows))


def check_agreement(config: LongformerConfig, torch, device: str) -> float:
  """Max |our logits - HF logits|, float32, same weights (ours copied over), eval mode."""
  seq = agreement_seq(config)
  ours = LongformerForMaskedLM(config.replace(dtype=jnp.float32), rngs=nnx.Rngs(1))
  ours.eval()
  hf = convert.to_hf(ours).to(device)  # eval mode, float32
  ids, global_mask, _ = make_batch(config, seq, AGREEMENT_ROWS, seed=1)
  # "highest": JAX would otherwise use TF32 matmuls on GPU; torch's default is full float32.
  # Under jit (one compile, not one per op); one global token per row.
  forward = nnx.jit(lambda model, ids, gm: model(ids, global_attention_mask=gm,
                                                 max_global=1).logits)
  with jax.default_matmul_precision("highest"):
    ours_logits = np.asarray(forward(ours, jnp.asarray(ids), jnp.asarray(global_mask)),
                             np.float32)
  with torch.no_grad():
    hf_logits = hf(input_ids=torch.from_numpy(ids).long().to(device),
                   global_attention_mask=torch.from_numpy(global_mask).long().to(device)
                   ).logits.float().cpu().numpy()
  del hf
  return float(np.max(np.abs(ours_logits - hf_logits)))


def hf_step(config: LongformerConfig, args, torch, device: str, model=None):
  """HF's training step on `make_batch(config, args.seq, args.batch)`: (step, sync, dtype name),
  `step()` running one AdamW step and returning its loss, `sync(loss)` waiting for it. `model`:
  train this `transformers.LongformerForMaskedLM` (e.g. `convert.to_hf` of ours: the same
  weights) instead of a new one with random weights."""
  if model is None:
    # Same config, random weights (no copy needed for timing); HF takes the total window.
    hf = convert.config_to_hf(config, "LongformerForMaskedLM")
    import transformers
    model = transformers.LongformerForMaskedLM(hf)
  model = model.to(device)
  model.train()
  # fused AdamW on CUDA: HF's best single-GPU optimizer step, so the baseline is not handicapped.
  optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY,
                                fused=device == "cuda")
  ids, global_mask, labels = (torch.from_numpy(x).long().to(device)
                              for x in make_batch(config, args.seq, args.batch))
  use_bf16 = args.bf16 and device == "cuda"

  def step():
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=use_bf16):
      loss = model(input_ids=ids, global_attention_mask=global_mask, labels=labels).loss
    loss.backward()
    optimizer.step()
    return loss

  def sync(loss):
    if device == "cuda":
      torch.cuda.synchronize()
    return loss

  return step, sync, "bfloat16" if use_bf16 else "float32"


def bench_hf(config: LongformerConfig, args, torch, device: str):
  step, sync, dtype_name = hf_step(config, args, torch, device)
  if device == "cuda":
    torch.cuda.reset_peak_memory_stats()
  ms = timed(step, sync, args.reps, args.warmup)
  loss = float(step().detach())
  if not np.isfinite(loss):
    raise FloatingPointError(f"HF training step gave loss {loss}")
  peak = int(torch.cuda.max_memory_allocated()) if device == "cuda" else None
  # Hand the memory back before our run: torch's caching allocator keeps it otherwise (the
  # closure `step` holds the model, optimizer and batch).
  step = sync = None
  gc.collect()
  if device == "cuda":
    torch.cuda.empty_cache()
  return ms, peak, dtype_name


# ------------------------------------------------------------------------------------------------


def make_record(row: str, args, seq: int, batch: int, ms: float, peak, dtype_name: str,
                head_positions: int) -> dict:
  """One JSON row, with model FLOPs and MFU (see the module docstring)."""
  config = make_config(args, seq)
  device = jax.devices()[0].device_kind
  flops = model_flops(config, row, seq, batch, head_positions)
  peak_flops_s = peak_flops(device, dtype_name)
  flops_per_s = flops["total_flops"] / (ms * 1e-3)
  full = row == "full_attention"
  return dict(
      device=device, date=harness.today(), impl=impl_name(row, args.impl),
      row=row, seq=seq, batch=batch, dtype=dtype_name, ms_step=round(ms, 3),
      tokens_per_s=round(seq * batch / (ms * 1e-3), 1),
      peak_bytes=None if peak is None else int(peak),
      attention=("full, no global tokens" if full else
                 f"band {max(config.layer_windows)}/side, 1 global token per row"),
      lm_head_positions=head_positions, params=flops["params"],
      model_flops_per_step=int(flops["total_flops"]),
      attention_share=round(flops["attention_flops"] / flops["total_flops"], 4),
      model_tflops_per_s=round(flops_per_s / 1e12, 3),
      mfu=None if peak_flops_s is None else round(flops_per_s / peak_flops_s, 4),
      peak_tflops=None if peak_flops_s is None else peak_flops_s / 1e12)


def measure_row(row: str, args, seq: int, batch: int, trace_dir: str | None = None) -> dict:
  """Measures one of our rows at seq x batch and returns its record (+ `trace` when traced)."""
  run_args = argparse.Namespace(**{**vars(args), "seq": seq, "batch": batch})
  result = bench_ours(make_config(run_args), run_args, row, trace_dir)
  record = make_record(row, run_args, seq, batch, result["ms"], result["peak"],
                       "bfloat16" if args.bf16 else "float32", result["head_positions"])
  if result["trace"] is not None:
    record["trace"] = result["trace"]
  return record


def markdown_table(records) -> str:
  lines = ["| impl | seq x batch | dtype | ms/step | tokens/s | peak GB | model TFLOP/s | MFU | "
           "vs HF tokens/s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  hf = {(r["seq"], r["batch"]): r["tokens_per_s"] for r in records if r["impl"].startswith("hf")}
  for r in records:
    base = hf.get((r["seq"], r["batch"]))
    ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
    peak = "" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 1e9:.1f}"
    mfu = "" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
    lines.append(f"| {r['impl']} | {r['seq']} x {r['batch']} | {r['dtype']} | "
                 f"{r['ms_step']:.1f} | {r['tokens_per_s']:,.0f} | {peak} | "
                 f"{r.get('model_tflops_per_s', '')} | {mfu} | {ratio} |")
  return "\n".join(lines)


def parse_shape(text: str) -> tuple[int, int]:
  """'4096x8' -> (4096, 8)."""
  try:
    seq, batch = (int(x) for x in text.lower().split("x"))
  except ValueError:
    raise ValueError(f"shape {text!r}: expected SEQxBATCH, e.g. 4096x8") from None
  if seq < 1 or batch < 1:
    raise ValueError(f"shape {text!r}: seq and batch must be >= 1")
  return seq, batch


def parse_args(argv=None) -> argparse.Namespace:
  """The command line, with the defaults that depend on --small filled in (and `shapes`)."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default=None, choices=list(PRESETS),
                      help="model size: base (allenai/longformer-base-4096's shape; the default) "
                           "or 6x512 (6 layers x hidden 512, 8 heads; the default of "
                           "--vs-hf-rounds)")
  parser.add_argument("--small", action="store_true",
                      help="tiny config (2 layers, hidden 64, 4 heads, window 16), seq 256, "
                           "batch 2, 2 reps: a CPU smoke run")
  parser.add_argument("--seq", type=int, default=None, help="default 4096 (256 with --small)")
  parser.add_argument("--batch", type=int, default=None,
                      help="default 8 (1 with --vs-hf-rounds, 2 with --small)")
  parser.add_argument("--shapes", nargs="+", default=None, metavar="SEQxBATCH",
                      help="several shapes in one run, e.g. 4096x8 16384x2 (overrides "
                           "--seq/--batch)")
  parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS,
                      help="rows to measure (default: all)")
  parser.add_argument("--reps", type=int, default=None, help="default 10 (2 with --small)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps (the first compiles)")
  parser.add_argument("--impl", default="auto", help="our attention_impl (auto, chunked, ...)")
  parser.add_argument("--float32", dest="bf16", action="store_false",
                      help="float32 compute for both (default: bf16 compute on accelerators)")
  parser.add_argument("--no-hf", action="store_true", help="leave out the HF row")
  parser.add_argument("--trace", default=None, metavar="DIR",
                      help="profile a few steps of the first of our rows into DIR and print "
                           "its top ops")
  parser.add_argument("--vs-hf-rounds", type=int, default=None, metavar="R",
                      help="ours against HF side by side in R interleaved rounds (see the "
                           "module docstring): one shape, the logits check first")
  parser.add_argument("--calls", type=int, default=1,
                      help="--vs-hf-rounds: steps per row per round")
  parser.add_argument("--vs-hf-row", default="longformer_jax", choices=JAX_ROWS[:2],
                      help="--vs-hf-rounds: our row (default longformer_jax: logits at every "
                           "position, as HF's)")
  harness.common_arguments(parser, out=harness.default_out())
  args = parser.parse_args(argv)
  vs_hf = args.vs_hf_rounds is not None
  if vs_hf and args.vs_hf_rounds < 1:
    parser.error(f"--vs-hf-rounds must be >= 1, got {args.vs_hf_rounds}")
  if args.calls < 1:
    parser.error(f"--calls must be >= 1, got {args.calls}")
  if vs_hf and (args.shapes or args.no_hf or args.trace):
    parser.error("--vs-hf-rounds times one shape (--seq, --batch) against HF: it takes no "
                 "--shapes, --no-hf or --trace")
  args.preset = args.preset or ("6x512" if vs_hf else "base")
  args.seq = args.seq or (256 if args.small else 4096)
  args.batch = args.batch or (2 if args.small else 1 if vs_hf else 8)
  if args.seq < 1 or args.batch < 1:
    parser.error(f"--seq and --batch must be >= 1, got {args.seq} and {args.batch}")
  args.reps = args.reps or (2 if args.small else 10)
  try:
    args.shapes = ([parse_shape(s) for s in args.shapes] if args.shapes
                   else [(args.seq, args.batch)])
  except ValueError as e:
    parser.error(str(e))
  if args.no_hf and "hf_transformers" in args.rows:
    args.rows = [r for r in args.rows if r != "hf_transformers"]
  # bf16 on CPU is emulated and slow in both frameworks: float32 there (docs/design.md §6).
  args.bf16 = args.bf16 and jax.default_backend() != "cpu"
  return args


def vs_hf(args) -> dict:
  """`--vs-hf-rounds`: our training step and HF's side by side (see the module docstring).
  Returns the result written as JSON (its `path` added)."""
  # torch's OpenMP threads would otherwise spin after each HF step, taking the cores from our
  # step that follows it in the round: both sides yield their cores when idle. Before torch.
  os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
  torch, transformers = import_torch()
  if torch is None:
    print("error: --vs-hf-rounds needs torch and transformers", file=sys.stderr)
    sys.exit(1)
  torch.set_num_threads(os.cpu_count() or 1)
  device = "cuda" if torch.cuda.is_available() and jax.default_backend() == "gpu" else "cpu"
  seq, batch = args.seq, args.batch
  config = make_config(args)
  dtype_name = "bfloat16" if args.bf16 else "float32"
  stamp = harness.stamp() | {"cpu_count": os.cpu_count(), "torch": torch.__version__,
                             "transformers": transformers.__version__, "torch_device": device,
                             "dtype": dtype_name, "rounds": args.vs_hf_rounds,
                             "calls": args.calls, "warmup": args.warmup}
  ours_name = impl_name(args.vs_hf_row, args.impl)
  hf_name = impl_name("hf_transformers", args.impl)
  result = dict(
      stamp=stamp, preset="small" if args.small else args.preset, seq=seq, batch=batch,
      model=dict(layers=config.num_hidden_layers, hidden=config.hidden_size,
                 heads=config.num_attention_heads, intermediate=config.intermediate_size,
                 vocab=config.vocab_size, window_per_side=max(config.layer_windows),
                 global_tokens_per_row=1, optimizer=f"AdamW lr {LEARNING_RATE} weight decay "
                 f"{WEIGHT_DECAY}", train_mode="dropout on", our_row=args.vs_hf_row))
  print(stamp, flush=True)
  print(f"model: {json.dumps(result['model'])}, {seq} x {batch}", flush=True)

  out = pathlib.Path(args.out)
  slug = (f"model_vs_hf_{'small' if args.small else args.preset}_cpu{os.cpu_count()}_"
          f"{stamp['date']}_{stamp['commit']}_{seq}x{batch}")
  path = out / f"{slug}.json"
  diff = check_agreement(config, torch, device)
  result["agreement"] = dict(
      max_abs_diff=diff, tolerance=CHECK_TOLERANCE, seq=agreement_seq(config),
      batch=AGREEMENT_ROWS, passed=bool(diff <= CHECK_TOLERANCE),
      what="MLM logits, float32, eval mode, our weights copied to HF (convert.to_hf)")
  print(f"agreement (float32, same weights): max |ours - HF| MLM logit = {diff:.2e}", flush=True)
  if not result["agreement"]["passed"]:
    result["status"] = "failed: our logits disagree with HF's; nothing timed"
    harness.write_json(path, result)
    print(f"error: our MLM logits differ from HF's by {diff} > {CHECK_TOLERANCE}; wrote {path}",
          file=sys.stderr)
    sys.exit(1)

  # The same weights on both sides: HF's model is ours copied over before either trains.
  ours = build_model(config.replace(dtype=jnp.bfloat16) if args.bf16 else config,
                     args.vs_hf_row)
  hf_model = convert.to_hf(ours)
  result["params"] = dict(ours=count_params(ours),
                          hf=int(sum(p.numel() for p in hf_model.parameters())))
  our_fn, _ = our_step(config, args, args.vs_hf_row, model=ours)
  hf_fn, hf_sync, _ = hf_step(config, args, torch, device, model=hf_model)
  rows = [(ours_name, "step", lambda: jax.block_until_ready(our_fn())),
          (hf_name, "step", lambda: hf_sync(hf_fn()))]
  result["first_step_loss"] = harness.warm_up(rows, args.warmup)
  times, loads = interleaved_rounds(rows, args.vs_hf_rounds, args.calls)
  result["summary"] = harness.side_by_side([ours_name, hf_name], times, loads,
                                           tokens_per_step=seq * batch)
  result["status"] = "ok"
  harness.write_side_by_side(path, result, vs_hf_markdown(result, args),
                             f"MLM step, {seq} x {batch}: ours vs HF, per round")
  return result | {"path": str(path)}


def vs_hf_markdown(result: dict, args) -> str:
  m, st, a = result["model"], result["stamp"], result["agreement"]
  command = (f"python benchmarks/model.py --vs-hf-rounds {st['rounds']} --calls {st['calls']} "
             + ("--small " if args.small else f"--preset {args.preset} ")
             + f"--seq {result['seq']} --batch {result['batch']}")
  header = (f"MLM training step, ours vs HF transformers side by side, {st['device']} "
            f"({st['cpu_count']} cores), {st['dtype']}, jax {st['jax']}, torch {st['torch']}, "
            f"transformers {st['transformers']}, {st['date']}, commit {st['commit']}. "
            f"{m['layers']} layers x hidden {m['hidden']}, {m['heads']} heads, FFN "
            f"{m['intermediate']}, vocabulary {m['vocab']:,}, window {m['window_per_side']} per "
            f"side, 1 global token per row, {result['seq']:,} x {result['batch']} tokens, "
            f"{m['optimizer']}, {m['train_mode']}; the same weights on both sides; parameters: "
            f"ours {result['params']['ours']:,}, HF {result['params']['hf']:,}. Logits check "
            f"before timing: max |ours - HF| = {a['max_abs_diff']:.2e} (tolerance "
            f"{a['tolerance']}, {a['seq']} x {a['batch']}). {st['rounds']} interleaved rounds x "
            f"{st['calls']} steps per row (`{command}`).")
  return header + "\n\n" + harness.side_by_side_markdown(result["summary"])


def main(argv=None):
  args = parse_args(argv)
  if args.vs_hf_rounds is not None:
    return vs_hf(args)
  backend = jax.default_backend()
  dtype_name = "bfloat16" if args.bf16 else "float32"
  config = make_config(args, max(seq for seq, _ in args.shapes))
  device = jax.devices()[0].device_kind
  today = harness.today()
  print(f"device={device} backend={backend} jax={jax.__version__} dtype={dtype_name} "
        f"shapes={' '.join(f'{s}x{b}' for s, b in args.shapes)} "
        f"layers={config.num_hidden_layers} hidden={config.hidden_size} "
        f"window={config.attention_window}/side impl={args.impl} rows={' '.join(args.rows)} "
        f"date={today}", flush=True)

  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  slug = device.replace(" ", "_").replace("/", "_")
  path = out_dir / f"model_{slug}_{today}.json"
  records = []

  def record(rec):
    records.append(rec)
    mfu = "" if rec["mfu"] is None else f"  MFU {100 * rec['mfu']:5.1f}%"
    print(f"  {rec['impl']:40s} {rec['seq']:6d} x {rec['batch']:<3d} {rec['ms_step']:10.1f} "
          f"ms/step  {rec['tokens_per_s']:12,.0f} tokens/s  {rec['model_tflops_per_s']:8.2f} "
          f"model TFLOP/s{mfu}", flush=True)
    # Rewritten after every row: a crash later leaves what was measured.
    harness.write_json(path, records)
    harness.write_text(path.with_suffix(".md"), markdown_table(records))

  failed = False
  torch = import_torch()[0] if "hf_transformers" in args.rows else None
  if torch is not None:
    torch_device = "cuda" if torch.cuda.is_available() else "cpu"
    if (backend == "gpu") != (torch_device == "cuda"):
      print(f"note: jax runs on {backend} but torch on {torch_device}; the ratio compares "
            f"different devices")
    diff = check_agreement(config, torch, torch_device)
    print(f"agreement (float32, same weights): max |ours - HF| MLM logit = {diff:.2e}", flush=True)
    if not diff <= CHECK_TOLERANCE:
      raise AssertionError(f"our MLM logits differ from HF's by {diff} > {CHECK_TOLERANCE}")
    for seq, batch in args.shapes:  # HF first, every shape (see the module docstring)
      try:
        run_args = argparse.Namespace(**{**vars(args), "seq": seq, "batch": batch})
        ms, peak, hf_dtype = bench_hf(make_config(run_args), run_args, torch, torch_device)
        record(make_record("hf_transformers", run_args, seq, batch, ms, peak, hf_dtype, seq))
      except Exception as e:  # An HF failure (e.g. out of memory) must not lose our rows.
        print(f"  HF training step failed at {seq} x {batch}: {type(e).__name__}: "
              f"{str(e)[:300]}")
  if "full_attention" in args.rows:
    check = check_full_attention(config)
    print(f"full-attention swap check: {json.dumps(check)}", flush=True)
    if not full_attention_check_ok(check):
      raise AssertionError(f"the full-attention row is not the model it claims: {check}")

  trace_dir = args.trace
  for seq, batch in args.shapes:
    for row in (r for r in args.rows if r in JAX_ROWS):
      try:
        rec = measure_row(row, args, seq, batch, trace_dir)
      except Exception:  # Keep the other rows: write what was measured, report the failure.
        traceback.print_exc()
        print(f"  our training step failed ({row} at {seq} x {batch}; traceback above)")
        failed = True
        continue
      finally:
        gc.collect()
      if trace_dir:
        print(format_top_ops(rec["trace"]), flush=True)
        trace_dir = None  # one trace: the first of our rows measured
      record(rec)

  hf_rows = {(r["seq"], r["batch"]): r for r in records if r["row"] == "hf_transformers"}
  for r in records:
    base = hf_rows.get((r["seq"], r["batch"]))
    if base and r is not base:
      print(f"{r['impl']} at {r['seq']} x {r['batch']} / HF tokens/s: "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x "
            f"(target on GPU, base 4096 x 8 bf16: >= 5x)")
  print(f"\nwrote {path} and {path.with_suffix('.md')}\n")
  print(markdown_table(records))
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  main()
