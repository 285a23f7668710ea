"""cuDNN's causal sliding window against an exact blockwise reference (jax only).

  python benchmarks/cudnn_window_repro.py --seq 65536              # max |diff|, first bad row
  python benchmarks/cudnn_window_repro.py --seq 65536 --no-is-causal

Query i attends keys i-w..i. The cuDNN call is `jax.nn.dot_product_attention(q, k, v,
is_causal=True, local_window_size=(w, 0), implementation="cudnn")` (--no-is-causal: without
is_causal, the other call form). bf16 inputs; the
reference works in float32 on the same bf16 values, one query block against its key slab at a time.
"""
import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # benchmarks/harness.py


def blockwise_reference(q, k, v, left, right=0, block=512):
  """Exact band attention, float32: query i attends keys i-left..i+right (inside [0, n))."""
  b, n, h, d = q.shape
  pad = -n % block
  q = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
  k, v = (jnp.pad(x.astype(jnp.float32), ((0, 0), (left, pad + right), (0, 0), (0, 0)))
          for x in (k, v))
  slab = block + left + right  # keys of a query block: [start - left, start + block + right)
  offset = jnp.arange(slab)[None, :] - jnp.arange(block)[:, None] - left  # key - query

  def one_block(start):
    qs = jax.lax.dynamic_slice_in_dim(q, start, block, axis=1)
    ks, vs = (jax.lax.dynamic_slice_in_dim(x, start, slab, axis=1) for x in (k, v))
    key = start - left + jnp.arange(slab)
    keep = (offset >= -left) & (offset <= right) & (key >= 0)[None, :] & (key < n)[None, :]
    s = jnp.einsum("bqhd,bkhd->bhqk", qs, ks, precision="highest") / d**0.5
    # A finite fill: padded query rows see no key, and -inf would make their gradients NaN.
    p = jax.nn.softmax(jnp.where(keep, s, -1e30), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vs, precision="highest")

  out = jax.lax.map(one_block, jnp.arange(0, n + pad, block))  # [blocks, b, block, h, d]
  return jnp.moveaxis(out, 0, 1).reshape(b, n + pad, h, d)[:, :n]


def cudnn_sliding(q, k, v, window, is_causal=True, implementation="cudnn"):
  return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal,
                                      local_window_size=(window, 0), implementation=implementation)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seq", type=int, default=65536)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--window", type=int, default=256)
  parser.add_argument("--no-is-causal", dest="is_causal", action="store_false")
  parser.add_argument("--implementation", default="cudnn", choices=["cudnn", "xla"])
  harness.common_arguments(parser, out=None,
                           out_help="also write cudnn_window_repro.json (stamped) to this folder")
  args = parser.parse_args()
  q, k, v = (jax.random.normal(jax.random.key(i), (args.batch, args.seq, args.heads, 64),
                               jnp.bfloat16) for i in range(3))
  got = jax.jit(cudnn_sliding, static_argnums=(3, 4, 5))(q, k, v, args.window, args.is_causal,
                                                         args.implementation)
  want = jax.jit(blockwise_reference, static_argnums=(3,))(q, k, v, args.window)
  row_err = jnp.max(jnp.abs(got.astype(jnp.float32) - want), axis=(0, 2, 3))  # per query row
  bad = jnp.nonzero(row_err > 5e-2, size=1, fill_value=-1)[0][0]  # bf16 rounding: ~1e-2
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind} seq={args.seq} "
        f"window={args.window} is_causal={args.is_causal}: "
        f"max |{args.implementation} - reference| = "
        f"{float(row_err.max()):.4g}; first row off by > 5e-2: {int(bad)} (-1: none)")
  if args.out:
    path = harness.write_json(pathlib.Path(args.out) / "cudnn_window_repro.json", dict(
        harness.stamp(), seq=args.seq, batch=args.batch, heads=args.heads, window=args.window,
        is_causal=args.is_causal, implementation=args.implementation,
        max_abs_diff=float(row_err.max()), first_bad_row=int(bad)))
    harness.print_written(path)


if __name__ == "__main__":
  main()
