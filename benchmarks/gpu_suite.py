"""Every GPU check and timing in one prepared run: correctness first, then speed.

  python benchmarks/gpu_suite.py --out $OUT --budget-s 420     # a GPU session
  python benchmarks/gpu_suite.py --tiny --out /tmp/suite        # CPU: every section at toy sizes
  python benchmarks/gpu_suite.py --sections a,b --out DIR       # a subset (letters below)

The suite lives in benchmarks/suite/, one module per role (see its __init__); this script is its
command line.

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
  d  cuDNN's sliding window (`jax.nn.dot_product_attention(implementation="cudnn",
     local_window_size=(256, 0))`, which has been seen to differ from ours at 64k). Both call forms
     (with and without is_causal=True) at 64k against an exact blockwise reference; their window
     semantics at small lengths against dense masked references (ours [i-w, i], one key fewer or
     more, left bound only, full causal, bidirectional band); for a form that matches ours when
     short but diverges when long, the smallest diverging length (powers of two, then bisection),
     the first row that goes wrong, and probes with 1 head and with batch 8, so that the verdict
     says whether it is a semantic difference or a cuDNN fault (e.g. an int32 overflow near N*N >=
     2^31). A gradient check at 4096. Standalone repro: benchmarks/cudnn_window_repro.py.
  c  peers, each output checked against ours on the SAME inputs before it is timed (a peer that
     disagrees is a failed row with its max |diff|, never timed): cuDNN causal sliding window (in
     JAX), torch flex_attention with a sliding-window block mask (bidirectional and
     causal) and HF LongformerSelfAttention (bidirectional; its q/k/v projections set to feature
     permutations, so it attends exactly the q, k, v ours gets). Our outputs and the cuDNN rows come
     from a child process that ends before the torch peers start, EVERY torch peer in its own child
     process (JAX's allocator keeps the GPU memory it took). Inputs are generated on the device by
     the same integer hash in JAX and in torch (bit-identical; a digest proves it); outputs are
     compared on the first and last 1024 rows and every 31st row.
  f  block-size sweep of the Pallas kernel (benchmarks/block_sweep.py).
  e  whole model (benchmarks/model.py), last: it takes what the others leave, and all of it
     needs about 300 s (`--sections e --budget-s 300`). HF transformers in its own process
     (started only when its share is >= 120 s), then ours, ours with lm_head=masked and the
     full-attention (cuDNN) model, at 4096 x 8 and 16384 x 2, bf16, tokens/s and MFU; a
     jax.profiler trace of our masked-head step.

Time: `--budget-s` (default 420) is a global deadline; the chosen sections split it in the ratio of
their SHARES, on a cumulative schedule, so time one section leaves unused goes to the next. Inside a
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
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

import harness
from suite.common import DEFAULT_ORDER, SECTION_NAMES, TINY_ORDER
from suite.peers import peers_jax_phase, torch_child
from suite.runner import orchestrate, run_section


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  harness.common_arguments(
      parser, out=harness.default_out(), tiny_help="toy sizes on CPU (see the docstring)",
      budget_s=None, budget_help="global deadline in seconds (default 420; 900 with --tiny); "
                                 "sections and rows that do not fit are skipped and recorded so")
  parser.add_argument("--jobs", type=int, default=None,
                      help="sections run at a time: 1 (default; timings need the device to "
                           "themselves); --tiny may run 2 (default there), on a CPU")
  parser.add_argument("--sections", default=None,
                      help=f"comma-separated letters, in order (default {DEFAULT_ORDER}; "
                           f"{TINY_ORDER} with --tiny): "
                           + ", ".join(f"{k}={v}" for k, v in SECTION_NAMES.items()))
  parser.add_argument("--inject-peer-fault", action="store_true",
                      help="perturb ours before the first flex_attention check (tests)")
  # Internal: a section's or a torch peer's child process.
  parser.add_argument("--run-section", choices=sorted(SECTION_NAMES), help=argparse.SUPPRESS)
  parser.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--torch-child", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--peers-jax", default=None, help=argparse.SUPPRESS)
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
  elif args.peers_jax:
    peers_jax_phase(args.peers_jax)
  elif args.run_section:
    run_section(args)
  else:
    try:
      orchestrate(args)
    except ValueError as e:
      sys.exit(f"error: {e}")


if __name__ == "__main__":
  main()
