"""Whole-model training step: our LongformerForMaskedLM against HF transformers' PyTorch one.

  python benchmarks/model.py                              # base, seq 4096, batch 8 (the GPU target)
  python benchmarks/model.py --seq 16384 --batch 2        # the other docs/design.md §6 anchor
  python benchmarks/model.py --impl pallas --reps 20 --out benchmarks/results
  PYTHONPATH=. python benchmarks/model.py --small --out /tmp/modelbench   # tiny, CPU, < 1 min

One process, one device, side by side: (a) `longformer_jax.LongformerForMaskedLM`, float32
parameters with bf16 compute (`dtype=jnp.bfloat16` in the config), optax AdamW, the step under
`nnx.jit`; (b) `transformers.LongformerForMaskedLM` with the same config (HF's total window is
twice our one-sided one; `convert.config_to_hf` / `convert.to_hf` do that), float32 parameters,
`torch.autocast` bf16 on CUDA (plain float32 on CPU), `torch.optim.AdamW`. Both: random weights,
dropout on (train mode), 1 global token (<s>) per row, MLM cross-entropy on 15% of positions.
HF computes the full [batch, seq, vocab] logits; ours is timed both ways: the same (row
`longformer_jax(...)`) and with the LM head at the masked positions only (row
`longformer_jax(..., lm_head=masked)`, `prediction_positions` / `masked_positions`). Before timing, the two models are
checked to agree: our float32 model's weights copied to HF with `convert.to_hf` give MLM logits
within 1e-3 on a small input (eval mode); the max difference is printed.

Times are medians of `--reps` steps after warm-up (compile); only ratios between rows of the SAME
run are meaningful. Peak memory: `device.memory_stats()["peak_bytes_in_use"]` for JAX (none on
CPU), `torch.cuda.max_memory_allocated()` for torch on CUDA. HF is run before ours and its memory
released, because each framework's allocator keeps what it has taken.

Writes `<out>/model_<device>_<date>.json` (a list of rows with keys device, date, impl, seq,
batch, dtype, ms_step, tokens_per_s, peak_bytes) and the printed markdown table beside it.
torch/transformers are optional: without them only our row is measured (a note says so).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import statistics
import sys
import time
import traceback

# Torch shares the GPU with JAX in this process; JAX's default grab of 75% of device memory up
# front would leave HF too little (it peaks near 48 GB at base size, seq 4096, batch 8).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from longformer_jax import LongformerConfig, LongformerForMaskedLM, convert  # noqa: E402
from longformer_jax.modeling import masked_positions  # noqa: E402

MASK_FRACTION = 0.15
LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.01
CHECK_TOLERANCE = 1e-3


def make_config(args) -> LongformerConfig:
  """Our config (one-sided window); the position table is grown when seq needs it."""
  if args.small:
    config = LongformerConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=256, attention_window=16)
  else:
    config = LongformerConfig.base()
  # RoBERTa positions start at pad_token_id + 1.
  positions = max(config.max_position_embeddings, args.seq + config.pad_token_id + 1)
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
# Ours.


def mlm_loss(logits_BxNxV, labels_BxN):
  # float32 softmax: bf16 logits lose too much over a 50K vocabulary (HF's cross-entropy upcasts
  # under autocast too).
  weights = (labels_BxN >= 0).astype(jnp.float32)
  per_token = optax.softmax_cross_entropy_with_integer_labels(
      logits_BxNxV.astype(jnp.float32), jnp.maximum(labels_BxN, 0))
  return jnp.sum(per_token * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def bench_ours(config: LongformerConfig, args, masked_head: bool = False):
  """masked_head: the LM head runs at the masked positions only (`prediction_positions`), as
  many per row as the batch's most-masked row has; else at every position, as HF's does."""
  model = LongformerForMaskedLM(config.replace(dtype=jnp.bfloat16) if args.bf16 else config,
                                rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY),
                            wrt=nnx.Param)
  model.train()  # dropout on, as in HF's train mode

  @nnx.jit
  def train_step(model, optimizer, ids, global_mask, labels):
    def loss_fn(model):
      # max_global: the traced mask cannot be counted under jit; one <s> per row.
      if not masked_head:
        logits = model(ids, global_attention_mask=global_mask, max_global=1).logits
        return mlm_loss(logits, labels)
      positions, targets, _ = masked_positions(labels, max_predictions)
      logits = model(ids, global_attention_mask=global_mask, max_global=1,
                     prediction_positions=positions).logits
      return mlm_loss(logits, targets)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  batch = make_batch(config, args.seq, args.batch)
  max_predictions = int((batch[2] >= 0).sum(axis=1).max())  # no target is ever dropped
  ids, global_mask, labels = (jnp.asarray(x) for x in batch)
  ms = timed(lambda: train_step(model, optimizer, ids, global_mask, labels),
             jax.block_until_ready, args.reps, args.warmup)
  loss = float(train_step(model, optimizer, ids, global_mask, labels))
  if not np.isfinite(loss):
    raise FloatingPointError(f"our training step gave loss {loss}")
  stats = jax.devices()[0].memory_stats() or {}
  return ms, stats.get("peak_bytes_in_use")


# ------------------------------------------------------------------------------------------------
# HF transformers (PyTorch).


def import_torch():
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    print(f"note: torch/transformers not importable ({e}); only our model is measured")
    return None, None
  return torch, transformers


def check_agreement(config: LongformerConfig, torch, device: str) -> float:
  """Max |our logits - HF logits|, float32, same weights (ours copied over), eval mode."""
  seq = min(512, 4 * max(config.layer_windows))  # several windows wide, still small
  ours = LongformerForMaskedLM(config.replace(dtype=jnp.float32), rngs=nnx.Rngs(1))
  ours.eval()
  hf = convert.to_hf(ours).to(device)  # eval mode, float32
  ids, global_mask, _ = make_batch(config, seq, 2, seed=1)
  # "highest": JAX would otherwise use TF32 matmuls on GPU; torch's default is full float32.
  with jax.default_matmul_precision("highest"):
    ours_logits = np.asarray(ours(jnp.asarray(ids), global_attention_mask=jnp.asarray(global_mask))
                             .logits, np.float32)
  with torch.no_grad():
    hf_logits = hf(input_ids=torch.from_numpy(ids).long().to(device),
                   global_attention_mask=torch.from_numpy(global_mask).long().to(device)
                   ).logits.float().cpu().numpy()
  del hf
  return float(np.max(np.abs(ours_logits - hf_logits)))


def bench_hf(config: LongformerConfig, args, torch, device: str):
  # Same config, random weights (no copy needed for timing); HF takes the total window.
  hf = convert.config_to_hf(config, "LongformerForMaskedLM")
  import transformers  # pylint: disable=import-outside-toplevel
  model = transformers.LongformerForMaskedLM(hf).to(device)
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

  if device == "cuda":
    torch.cuda.reset_peak_memory_stats()
  ms = timed(step, sync, args.reps, args.warmup)
  loss = float(step().detach())
  if not np.isfinite(loss):
    raise FloatingPointError(f"HF training step gave loss {loss}")
  peak = int(torch.cuda.max_memory_allocated()) if device == "cuda" else None
  # Hand the memory back before our run: torch's caching allocator keeps it otherwise.
  del model, optimizer, ids, global_mask, labels
  gc.collect()
  if device == "cuda":
    torch.cuda.empty_cache()
  return ms, peak, "bfloat16" if use_bf16 else "float32"


# ------------------------------------------------------------------------------------------------


def markdown_table(records) -> str:
  lines = ["| impl | seq x batch | dtype | ms/step | tokens/s | peak GB | vs HF tokens/s |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  hf = {(r["seq"], r["batch"]): r["tokens_per_s"] for r in records if r["impl"].startswith("hf")}
  for r in records:
    base = hf.get((r["seq"], r["batch"]))
    ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
    peak = "" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 1e9:.1f}"
    lines.append(f"| {r['impl']} | {r['seq']} x {r['batch']} | {r['dtype']} | "
                 f"{r['ms_step']:.1f} | {r['tokens_per_s']:,.0f} | {peak} | {ratio} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="base", choices=["base"],
                      help="model size (allenai/longformer-base-4096 shape)")
  parser.add_argument("--small", action="store_true",
                      help="tiny config (2 layers, hidden 64, 4 heads, window 16), seq 256, "
                           "batch 2, 2 reps: a CPU smoke run")
  parser.add_argument("--seq", type=int, default=None, help="default 4096 (256 with --small)")
  parser.add_argument("--batch", type=int, default=None, help="default 8 (2 with --small)")
  parser.add_argument("--reps", type=int, default=None, help="default 10 (2 with --small)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps (the first compiles)")
  parser.add_argument("--impl", default="auto", help="our attention_impl (auto, chunked, ...)")
  parser.add_argument("--float32", dest="bf16", action="store_false",
                      help="float32 compute for both (default: bf16 compute on accelerators)")
  parser.add_argument("--no-hf", action="store_true", help="measure only ours")
  parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
  args = parser.parse_args(argv)
  args.seq = args.seq or (256 if args.small else 4096)
  args.batch = args.batch or (2 if args.small else 8)
  args.reps = args.reps or (2 if args.small else 10)
  backend = jax.default_backend()
  # bf16 on CPU is emulated and slow in both frameworks: float32 there (docs/design.md §6).
  args.bf16 = args.bf16 and backend != "cpu"
  dtype_name = "bfloat16" if args.bf16 else "float32"

  config = make_config(args)
  device = jax.devices()[0].device_kind
  today = datetime.date.today().isoformat()
  print(f"device={device} backend={backend} jax={jax.__version__} dtype={dtype_name} "
        f"seq={args.seq} batch={args.batch} layers={config.num_hidden_layers} "
        f"hidden={config.hidden_size} window={config.attention_window}/side "
        f"impl={args.impl} date={today}", flush=True)

  torch = None if args.no_hf else import_torch()[0]
  torch_device = None
  if torch is not None:
    torch_device = "cuda" if torch.cuda.is_available() else "cpu"
    if (backend == "gpu") != (torch_device == "cuda"):
      print(f"note: jax runs on {backend} but torch on {torch_device}; the ratio compares "
            f"different devices")
    diff = check_agreement(config, torch, torch_device)
    print(f"agreement (float32, same weights): max |ours - HF| MLM logit = {diff:.2e}", flush=True)
    if not diff <= CHECK_TOLERANCE:
      raise AssertionError(f"our MLM logits differ from HF's by {diff} > {CHECK_TOLERANCE}")

  records = []

  def record(impl, ms, peak, dtype):
    records.append(dict(device=device, date=today, impl=impl, seq=args.seq, batch=args.batch,
                        dtype=dtype, ms_step=round(ms, 3),
                        tokens_per_s=round(args.seq * args.batch / (ms * 1e-3), 1),
                        peak_bytes=None if peak is None else int(peak)))
    print(f"  {impl:40s} {ms:10.1f} ms/step  {records[-1]['tokens_per_s']:12,.0f} tokens/s",
          flush=True)

  if torch is not None:
    try:
      ms, peak, hf_dtype = bench_hf(config, args, torch, torch_device)
      record("hf_transformers_pytorch", ms, peak, hf_dtype)
    except Exception as e:  # An HF failure (e.g. out of memory) must not lose our row.
      print(f"  HF training step failed: {type(e).__name__}: {str(e)[:300]}")
  ours_failed = False
  for masked_head in (False, True):
    impl = f"longformer_jax(attention_impl={args.impl}" + (
        ", lm_head=masked)" if masked_head else ")")
    try:
      ms, peak = bench_ours(config, args, masked_head)
      record(impl, ms, peak, dtype_name)
    except Exception:  # Keep the other rows: write what was measured, then report the failure.
      traceback.print_exc()
      print(f"  our training step failed ({impl}; traceback above)")
      ours_failed = True
    gc.collect()

  hf_rows = [r for r in records if r["impl"].startswith("hf")]
  for r in records:
    if hf_rows and not r["impl"].startswith("hf"):
      ratio = r["tokens_per_s"] / hf_rows[0]["tokens_per_s"]
      print(f"{r['impl']}/HF tokens/s: {ratio:.2f}x (target on GPU, base 4096 x 8 bf16: >= 5x)")

  table = markdown_table(records)
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  slug = device.replace(" ", "_").replace("/", "_")
  path = out_dir / f"model_{slug}_{today}.json"
  for target, text in ((path, json.dumps(records, indent=1)), (path.with_suffix(".md"), table)):
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, target)  # atomic: never a half-written result file
  print(f"\nwrote {path} and {path.with_suffix('.md')}\n")
  print(table)
  if ours_failed:
    sys.exit(1)


if __name__ == "__main__":
  main()
