"""The suite's shared pieces: the section letters and the sizes of a GPU run and of --tiny, the
inputs JAX and torch generate bit-identically, the output check of a peer, the per-section
`Recorder`, the ahead-of-time compile, and the child process with a deadline."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
import threading
import time
import zlib

import harness


BENCH = pathlib.Path(__file__).resolve().parents[1]
REPO = BENCH.parent
SCRIPT = BENCH / "gpu_suite.py"  # the command line every child process runs
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

SECTION_NAMES = {"a": "correctness", "b": "attention", "e": "model", "d": "cudnn_window",
                 "c": "peers", "f": "block_sweep"}
# The whole model (e) last: it needs about 300 s (HF's child, the full-attention swap check, then
# 30-50 s per row of ours), more than a 420-s run can give it after the others, so it takes what
# they leave; `--sections e --budget-s 300` runs all of it.
DEFAULT_ORDER = "a,b,d,c,f,e"
TINY_ORDER = "e,a,b,c,d,f"  # two at a time on a CPU: the longest first
# Relative shares of --budget-s, normalised over the sections chosen, on a cumulative schedule;
# as seconds of the default 420 for all six. Correctness gets the most: on an H100 (jax 0.11.2,
# 2026-12-05) its four band-kernel checks took 89 s (compiling most of it) and its four op checks
# 45 s, so the 45 s it once had ran three checks and none of the op checks.
SHARES = {"a": 150, "b": 70, "d": 60, "c": 70, "f": 20, "e": 50}
GRACE_S = 20  # a section is killed this long after its deadline
MERGE_EVERY_S = 5.0
PEER_ROWS_EDGE = 1024  # compared rows: the first and last 1024 and every 31st
PEER_ROWS_STRIDE = 31
CUDNN_BAD = 5e-2  # |diff| of a row that is wrong (bf16 rounding is ~1e-2)


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
  hf_child_min_s: float                     # e: below this, the HF child is not started
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
    # The HF child on an H100 (2026-12-05): its imports and the logits agreement check (our
    # base model and HF's, float32) took more than 60 s before its first step.
    model_first_estimate_s=60.0, hf_child_min_s=120.0, cudnn_long=65536, cudnn_short=(1024, 2048),
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
    model_first_estimate_s=20.0, hf_child_min_s=0.0, cudnn_long=512, cudnn_short=(128,),
    cudnn_pow2=(256, 512), cudnn_granularity=32, cudnn_grad_seq=128, peer_shapes=((256, 1),),
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
      f.write(json.dumps(record, default=harness.json_default) + "\n")
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


def errors_of(got, want) -> dict:
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
