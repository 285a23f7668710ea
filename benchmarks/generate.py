"""LED generation speed: our `LEDForConditionalGeneration.generate` (JAX) against HF
transformers' PyTorch `generate` on the same machine, greedy and beam search, on a long input.

  python benchmarks/generate.py                            # led-base shapes, 16,384 input tokens
  python benchmarks/generate.py --small                    # a CPU-sized model, 16,384 tokens
  python benchmarks/generate.py --small --input-len 4096 --new-tokens 32 --reps 2

What runs:
- the model: random weights with led-base's shapes (`LEDConfig.base()`: 6 + 6 layers, d_model
  768, window 512 per side, vocabulary 50,265) or, with --small, a CPU-sized one (2 + 2 layers,
  d_model 256, 4 heads, ffn 1024, window 256 per side, the same vocabulary); encoder positions
  stretched to --input-len when it is longer than the table. EOS gets a logit bias of -1e4, so
  that every run generates exactly --new-tokens tokens (both peers do the same work whatever the
  random weights say). One checkpoint (HF's save_pretrained) is written to a temporary directory
  and both peers load it.
- the input: --batch rows of --input-len random tokens (<s> first, </s> last), no padding,
  global attention on <s> (HF: passed explicitly; ours: the default).
- the peers, each in its own process, one after the other (neither sees the other's threads,
  allocator or compilation cache):
  * `hf_transformers`: `transformers.LEDForConditionalGeneration.generate` in float32 under
    `torch.no_grad()` (CUDA when torch has it), do_sample=False;
  * `longformer_jax`: `generate` in float32 (attention_impl auto: our band kernels for the
    encoder), the whole loop one jitted `lax.while_loop`;
  * `longformer_jax_bf16` (--bf16): the same with bf16 compute (float32 parameters).
  For num_beams in --beams (default 1 and 4), length_penalty 1.0, early_stopping False.
- times: median of --reps calls after --warmup untimed ones (our first call compiles: its time is
  reported as `first_call_s`); `encoder_ms`: the encoder pass alone, timed the same way.
  tokens/s = batch * new tokens / generate time (the returned sequences' tokens, not every
  beam's); decode tokens/s = the same over (generate - encoder) time.
- agreement, before anything is reported: the float32 peers' outputs (their first call) must be
  equal token for token for every num_beams; a mismatch is printed (first row and position) and
  the run exits 1 after writing the results with `agree: false`. The bf16 row reports the
  fraction of tokens equal to HF's (bf16 rounding changes choices on random weights).

Writes `<out>/generate_<device>_<model>_<input-len>_<date>.json` (a list of rows) and the markdown
table beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import harness  # benchmarks/harness.py

EOS_BIAS = -1.0e4
PEERS = ("hf_transformers", "longformer_jax", "longformer_jax_bf16")
# Internal roles of the subprocesses: the checkpoint writer (JAX on the CPU: the parent and the
# writer must hold no accelerator memory while a peer runs) and the peers.
ROLES = ("checkpoint",) + PEERS


def make_config(args):
  from longformer_jax import LEDConfig
  positions = max(16384, args.input_len)
  if args.small:
    return LEDConfig(d_model=256, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024,
                     attention_window=256, max_encoder_position_embeddings=positions)
  return LEDConfig.base(max_encoder_position_embeddings=positions)


def make_inputs(args, vocab_size: int):
  import numpy as np
  rng = np.random.default_rng(args.seed)
  ids = rng.integers(4, vocab_size, (args.batch, args.input_len))
  ids[:, 0], ids[:, -1] = 0, 2  # <s> ... </s>
  global_mask = np.zeros_like(ids)
  global_mask[:, 0] = 1
  return ids, np.ones_like(ids), global_mask


def write_checkpoint(args, directory: str) -> None:
  """Random weights (ours, seeded), EOS pushed down, saved as an HF checkpoint."""
  import jax.numpy as jnp
  from flax import nnx

  from longformer_jax import convert, led
  config = make_config(args)
  model = led.LEDForConditionalGeneration(config, rngs=nnx.Rngs(args.seed))
  bias = model.final_logits_bias
  bias[...] = jnp.zeros_like(bias[...]).at[config.eos_token_id].set(EOS_BIAS)
  convert.to_hf(model).save_pretrained(directory)


def report(peer: str, what: str, first_s: float, ms: float) -> None:
  print(f"    {peer}: {what}: {ms:,.1f} ms (first call {first_s:.1f} s)", flush=True)


def timed(fn, reps: int, warmup: int) -> tuple[float, float, object]:
  """(first call s, median of `reps` calls after `warmup` untimed ones in ms, first output)."""
  start = time.perf_counter()
  first = fn()
  first_s = time.perf_counter() - start
  for _ in range(max(warmup - 1, 0)):
    fn()
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return first_s, 1e3 * statistics.median(times), first


# ------------------------------------------------------------------------------------------------
# Peers (each run in a fresh process by `main`).


def run_hf(args, directory: str) -> dict:
  import torch
  import transformers
  device = "cuda" if torch.cuda.is_available() else "cpu"
  model = transformers.LEDForConditionalGeneration.from_pretrained(directory).to(device).eval()
  ids, mask, global_mask = (torch.tensor(x, device=device)
                            for x in make_inputs(args, model.config.vocab_size))
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

  def encode():
    with torch.no_grad():
      out = model.get_encoder()(input_ids=ids, attention_mask=mask,
                                global_attention_mask=global_mask).last_hidden_state
    sync()
    return out

  results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
             "impl": f"hf_transformers_pytorch({device}, float32)", "rows": []}
  first_s, encoder_ms, _ = timed(encode, args.reps, args.warmup)
  report(args.peer, "encoder", first_s, encoder_ms)
  for beams in args.beams:
    def generate(beams=beams):
      with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, global_attention_mask=global_mask,
                             max_new_tokens=args.new_tokens, num_beams=beams, do_sample=False,
                             length_penalty=1.0, early_stopping=False)
      sync()
      return out.cpu().numpy()

    first_s, ms, out = timed(generate, args.reps, args.warmup)
    report(args.peer, f"generate, num_beams={beams}", first_s, ms)
    results["rows"].append(dict(num_beams=beams, first_call_s=first_s, generate_ms=ms,
                                encoder_ms=encoder_ms, sequences=out.tolist()))
  return results


def run_jax(args, directory: str, bf16: bool) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from longformer_jax import convert, led
  model = convert.from_hf(directory)
  if bf16:  # the same float32 parameters, bf16 compute
    float32 = model
    model = led.LEDForConditionalGeneration(model.config.replace(dtype=jnp.bfloat16),
                                            rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(float32))
  model.eval()
  ids, mask, global_mask = (jnp.asarray(x) for x in make_inputs(args, model.config.vocab_size))
  encode = nnx.jit(lambda m, ids, mask, g: m.encode(ids, mask, g, max_global=1)
                   .last_hidden_state)
  dtype = "bfloat16" if bf16 else "float32"
  results = {"device": jax.devices()[0].device_kind,
             "impl": f"longformer_jax({jax.default_backend()}, {dtype}, "
                     f"attention_impl={model.config.attention_impl})", "rows": []}
  first_s, encoder_ms, _ = timed(
      lambda: encode(model, ids, mask, global_mask).block_until_ready(), args.reps, args.warmup)
  report(args.peer, "encoder", first_s, encoder_ms)
  for beams in args.beams:
    # Global attention on <s>: generate's default (the first real token of each row).
    run = lambda beams=beams: np.asarray(model.generate(
        ids, mask, max_new_tokens=args.new_tokens, num_beams=beams, length_penalty=1.0,
        early_stopping=False))
    first_s, ms, out = timed(run, args.reps, args.warmup)
    report(args.peer, f"generate, num_beams={beams}", first_s, ms)
    results["rows"].append(dict(num_beams=beams, first_call_s=first_s, generate_ms=ms,
                                encoder_ms=encoder_ms, sequences=out.tolist()))
  return results


# ------------------------------------------------------------------------------------------------
# The driver.


def agreement(ours: list, theirs: list) -> tuple[bool, float, str]:
  """(equal, fraction of equal tokens, where the first difference is)."""
  import numpy as np
  a, b = np.asarray(ours), np.asarray(theirs)
  if a.shape != b.shape:
    width = min(a.shape[1], b.shape[1])
    return False, float(np.mean(a[:, :width] == b[:, :width])), (
        f"shapes {a.shape} (ours) vs {b.shape} (HF)")
  diff = np.argwhere(a != b)
  if not len(diff):
    return True, 1.0, ""
  row, pos = diff[0]
  return False, float(np.mean(a == b)), (f"row {row}, position {pos}: ours {a[row, pos]}, "
                                         f"HF {b[row, pos]}")


def records_from(peer: str, result: dict, args, hf: dict | None) -> list[dict]:
  today = harness.today()
  records = []
  for row in result["rows"]:
    new_tokens = len(row["sequences"][0]) - 1
    generated = args.batch * new_tokens
    decode_ms = row["generate_ms"] - row["encoder_ms"]
    rec = dict(
        device=result["device"], date=today, peer=peer, impl=result["impl"],
        model="small" if args.small else "led-base", input_len=args.input_len,
        batch=args.batch, new_tokens=new_tokens, num_beams=row["num_beams"],
        encoder_ms=round(row["encoder_ms"], 2), generate_ms=round(row["generate_ms"], 2),
        tokens_per_s=round(generated / (row["generate_ms"] * 1e-3), 2),
        decode_tokens_per_s=(round(generated / (decode_ms * 1e-3), 2) if decode_ms > 0
                             else None),
        first_call_s=round(row["first_call_s"], 2), reps=args.reps)
    if hf is not None and peer != "hf_transformers":
      theirs = next(r for r in hf["rows"] if r["num_beams"] == row["num_beams"])
      equal, fraction, where = agreement(row["sequences"], theirs["sequences"])
      rec.update(agree_with_hf=equal, tokens_equal_to_hf=round(fraction, 4))
      if where:
        rec["first_difference"] = where
      rec["speedup_vs_hf"] = round(theirs["generate_ms"] / row["generate_ms"], 3)
    records.append(rec)
  return records


def markdown_table(records: list[dict]) -> str:
  lines = ["| peer | beams | input x batch | new tokens | encoder ms | generate ms | tokens/s | "
           "decode tokens/s | first call s | vs HF | agrees with HF |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in records:
    speedup = f"{r['speedup_vs_hf']:.2f}x" if "speedup_vs_hf" in r else ""
    agree = ("" if "agree_with_hf" not in r else
             "yes" if r["agree_with_hf"] else f"no ({100 * r['tokens_equal_to_hf']:.1f}% equal)")
    decode = "" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:,.1f}"
    lines.append(f"| {r['impl']} | {r['num_beams']} | {r['input_len']} x {r['batch']} | "
                 f"{r['new_tokens']} | {r['encoder_ms']:,.1f} | {r['generate_ms']:,.1f} | "
                 f"{r['tokens_per_s']:,.1f} | {decode} | {r['first_call_s']:.1f} | {speedup} | "
                 f"{agree} |")
  return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--small", action="store_true",
                      help="CPU-sized model (2 + 2 layers, d_model 256) instead of led-base's")
  parser.add_argument("--input-len", type=int, default=16384, help="encoder tokens per row")
  parser.add_argument("--new-tokens", type=int, default=64, help="max_new_tokens")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--beams", type=int, nargs="+", default=[1, 4], help="num_beams values")
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=1, help="untimed calls (the first compiles)")
  parser.add_argument("--bf16", action="store_true", help="add our bf16-compute row")
  parser.add_argument("--no-hf", action="store_true", help="leave out HF (no agreement check)")
  parser.add_argument("--seed", type=int, default=0)
  harness.common_arguments(parser, out=harness.default_out())
  parser.add_argument("--peer", choices=ROLES, help=argparse.SUPPRESS)  # internal: one role
  parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
  parser.add_argument("--result", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  for name in ("input_len", "new_tokens", "batch", "reps", "warmup"):
    if getattr(args, name) < (name != "warmup"):
      parser.error(f"--{name.replace('_', '-')} must be >= {int(name != 'warmup')}")
  if min(args.beams) < 1:
    parser.error("--beams must be >= 1")
  return args


def run_peer(args) -> None:
  if args.peer == "checkpoint":
    write_checkpoint(args, args.checkpoint)
    return
  if args.peer == "hf_transformers":
    result = run_hf(args, args.checkpoint)
  else:
    result = run_jax(args, args.checkpoint, bf16=args.peer == "longformer_jax_bf16")
  harness.write_json(args.result, result, indent=None)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.peer:
    run_peer(args)
    return 0
  peers = ([] if args.no_hf else ["hf_transformers"]) + ["longformer_jax"] + (
      ["longformer_jax_bf16"] if args.bf16 else [])
  config = make_config(args)
  print(f"model={'small' if args.small else 'led-base'} layers={config.encoder_layers}+"
        f"{config.decoder_layers} d_model={config.d_model} window={config.attention_window}/side "
        f"vocab={config.vocab_size} input={args.input_len} x {args.batch} "
        f"new_tokens={args.new_tokens} beams={args.beams} reps={args.reps}", flush=True)
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    command = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
               "--checkpoint", tmp]
    subprocess.run(command + ["--peer", "checkpoint"], check=True,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    for peer in peers:
      result_path = os.path.join(tmp, f"{peer}.json")
      start = time.perf_counter()
      subprocess.run(command + ["--peer", peer, "--result", result_path], check=True)
      results[peer] = json.loads(pathlib.Path(result_path).read_text())
      print(f"  {peer}: done in {time.perf_counter() - start:.0f} s", flush=True)

  hf = results.get("hf_transformers")
  records = [rec for peer in peers for rec in records_from(peer, results[peer], args, hf)]
  ok = True
  for rec in records:
    if rec["peer"] == "longformer_jax" and rec.get("agree_with_hf") is False:
      ok = False
      print(f"MISMATCH (float32, num_beams={rec['num_beams']}): {rec['first_difference']}")
  table = markdown_table(records)
  print(table)
  device = records[-1]["device"].replace(" ", "_").replace("/", "_")
  model = "small" if args.small else "led-base"
  path = harness.write_json(pathlib.Path(args.out) / (
      f"generate_{device}_{model}_{args.input_len}_{harness.today()}.json"), records)
  harness.write_text(path.with_suffix(".md"), table)
  print(f"wrote {path} and {path.with_suffix('.md')}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
