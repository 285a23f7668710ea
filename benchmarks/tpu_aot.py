"""Memory per chip of TPU programs, compiled ahead of time on a machine without a TPU.

  python benchmarks/tpu_aot.py --quick --out /tmp/tpu_aot           # kernel + op rows, ~1 min
  python benchmarks/tpu_aot.py --rows band,op_1m,mlm --out benchmarks/results
  python benchmarks/tpu_aot.py --slices v5e:4x4 --rows char_small --out benchmarks/results

Needs libtpu (`pip install -e '.[tpu]'`): `jax.experimental.topologies` describes a named TPU
slice, its devices form a mesh, and `jax.jit(f).lower(<abstract sharded arguments>).compile()`
runs XLA's TPU compiler and Mosaic for real in this one process (nothing runs; there is no
TPU). `compiled.memory_analysis()` gives the bytes one chip needs: arguments, outputs,
temporaries, minus what donated arguments give back to outputs (alias). total = argument +
output + temp - alias, compared with the chip's HBM (nominal: v5e 16 GiB, v6e 32 GiB, v5p 95
GiB, v4 32 GiB per chip = 16 GiB per core). Below what XLA keeps in VMEM (whole temporaries of
up to ~100 MiB on v5e), `temp` undercounts a program's working set; it is HBM only.

Rows (`--rows`, comma-separated):
  band        the Mosaic band kernel alone, fwd+bwd, base attention shape (12 heads, head_dim 64,
              window 256), bf16, batch 1, on one chip: 16k and 128k tokens (KB per token).
  op_1m       `ops.longformer_attention(impl="pallas", mesh=..., seq_axis="seq")` fwd+bwd on
              1,048,576 tokens (batch 1) split over every chip of the slice: the char LM's
              attention shape (8 heads, head_dim 64), window 512, bf16.
  op_mix      `ops.longformer_attention(impl="pallas", mesh=...)` fwd+bwd (gradients of q, k, v and
              the global projections), base attention shape (12 heads, head_dim 64, window 256),
              bf16, at 131,072 and 262,144 tokens per slice, two layouts: 4 sequences over the
              batch axis, and 1 sequence over the seq axis; each plain (dilation 1, no global
              token) and mixed (dilation 2 on heads 10-11, 2 global tokens per sequence, global
              projections of their own). The mixed/plain ratios of temporaries and of XLA's
              `cost_analysis()` bytes accessed show what dilation and globals cost beyond the
              band.
  mlm         a LongformerForMaskedLM base (LongformerConfig.base(), bf16 compute) AdamW train
              step through `training.Trainer`, 4,096 tokens x 8 rows and 16,384 x 2 per chip
              (docs/design.md §6's anchors), one global token per row, data-parallel.
  char_small, char_large
              the train step of each of the paper's 5 stages (train/configs/char_*.py: up to
              23,040 tokens x 16 rows, per-layer windows up to 8,192), the configs' mesh
              (char_large: fsdp 4), on the slice.
  charlm_1m   the char_small train step on one 1,048,576-token sequence split over every chip
              (mesh (1, 1, chips)), stage-5 windows.
Whole-model rows compile for minutes each on 2 CPU cores (the time is printed and recorded).

`--quick`: the band and op_1m rows at small lengths on v5e:2x2 only (tests/test_tpu_aot.py runs
it). Writes `<out>/tpu_aot_<date>[_<rows>].json` (rows: slice, device kind, chips, row, what, seq,
batch per chip, bytes, fraction of HBM, compile seconds, Mosaic kernel calls) and the printed
markdown table beside it (`.md`), with jax/libtpu versions and the command.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import pathlib
import sys
import time
import traceback

# Compile-only: the TPU is described by libtpu's topology, the CPU stays jax's backend (and
# jax does not try to start a TPU client on a machine without one).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A compile-only client owns no chips: let other processes (tests, another run) load libtpu too.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # benchmarks/harness.py

GIB = 1 << 30
# Nominal HBM per device of the compile-only topology (v4's devices are its cores).
HBM_BYTES = {"v5e": 16 * GIB, "v6e": 32 * GIB, "v5p": 95 * GIB, "v4": 16 * GIB}
DEFAULT_SLICES = ("v5e:2x2", "v6e:2x2", "v5p:2x2x1", "v4:2x2x1")
ALL_ROWS = ("band", "op_1m", "op_mix", "mlm", "char_small", "char_large", "charlm_1m")
DEFAULT_ROWS = ("band", "op_1m", "mlm")
MOSAIC_TARGET = 'custom_call_target="tpu_custom_call"'


# ---------------------------------------------------------------------------------------------
# Slices and meshes.

def topology(name: str):
  from jax.experimental import topologies
  return topologies.get_topology_desc(topology_name=name, platform="tpu")


def slice_devices(name: str) -> list:
  """The devices of a named slice. v4's compile-only topology lists one device per core (not
  megacore), which `topologies.make_mesh` refuses; its devices are used as they are."""
  return list(topology(name).devices)


def mesh_of(devices, shape, axes) -> Mesh:
  return Mesh(np.array(devices).reshape(shape), axes)


def generation(name: str) -> str:
  return name.split(":")[0]


def sds(shape, dtype, mesh, spec=P()):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


# ---------------------------------------------------------------------------------------------
# Programs: each builder returns (description, seq, batch per device, lowered program).

def band_programs(devices, quick: bool):
  from longformer_jax.ops import band_pallas
  mesh = mesh_of(devices[:1], (1,), ("data",))
  heads, head_dim, window = 12, 64, 256

  def loss(q, k, v, key_mask):
    q, k, v = (x.reshape(*x.shape[:2], heads, head_dim) for x in (q, k, v))
    out, lse = band_pallas.band_attention_pallas(q, k, v, key_mask, window=window,
                                                 causal=False, interpret=False, backend="tpu")
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

  for seq in ((4096,) if quick else (16384, 131072)):
    qkv = sds((1, seq, heads * head_dim), jnp.bfloat16, mesh)
    mask = sds((1, seq), jnp.bool_, mesh)
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    yield ("band kernel fwd+bwd, 12x64, w256, bf16, q/k/v [B,N,H*D], 1 chip", seq, 1,
           lambda fn=fn, qkv=qkv, mask=mask: fn.lower(qkv, qkv, qkv, mask))


def op_programs(devices, quick: bool):
  from longformer_jax import ops
  mesh = mesh_of(devices, (1, len(devices)), ("data", "seq"))
  heads, head_dim, window = 8, 64, 512
  seq = 65536 if quick else 1 << 20
  spec = P(None, "seq")
  qkv = sds((1, seq, heads, head_dim), jnp.bfloat16, mesh, spec)
  mask = sds((1, seq), jnp.bool_, mesh, spec)

  def loss(q, k, v, attention_mask):
    out = ops.longformer_attention(q, k, v, window=window, causal=True,
                                   attention_mask=attention_mask, impl="pallas", mesh=mesh,
                                   seq_axis="seq")
    return jnp.sum(out.astype(jnp.float32))

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  yield (f"op fwd+bwd, causal 8x64, w{window}, bf16, seq split over {len(devices)}", seq,
         1 / len(devices), lambda: fn.lower(qkv, qkv, qkv, mask))


def op_mix_programs(devices, quick: bool):
  from longformer_jax import ops
  chips = len(devices)
  heads, head_dim, window = 12, 64, 256
  layouts = {"batch": (mesh_of(devices, (chips, 1), ("data", "seq")), P("data"), None),
             "seq": (mesh_of(devices, (1, chips), ("data", "seq")), P(None, "seq"), "seq")}
  for total in ((16384,) if quick else (131072, 262144)):
    for layout, (mesh, spec, seq_axis) in layouts.items():
      batch = chips if layout == "batch" else 1
      shape = (batch, total // batch, heads, head_dim)
      qkv = sds(shape, jnp.bfloat16, mesh, spec)
      mask = sds(shape[:2], jnp.bool_, mesh, spec)
      for mixed in (False, True):
        def loss(q, k, v, q_g, k_g, v_g, attention_mask, global_mask, mixed=mixed,
                 mesh=mesh, seq_axis=seq_axis):
          extra = {}
          if mixed:
            extra = dict(dilation=(1,) * (heads - 2) + (2, 2), global_mask=global_mask,
                         global_qkv=(q_g, k_g, v_g), max_global=2)
          out = ops.longformer_attention(q, k, v, window=window, attention_mask=attention_mask,
                                         impl="pallas", mesh=mesh, seq_axis=seq_axis, **extra)
          return jnp.sum(out.astype(jnp.float32))

        fn = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6 if mixed else 3))))
        what = (f"op fwd+bwd, 12x64, w{window}, bf16, {shape[0]} x {shape[1]:,} over {layout}, "
                + ("dilation 2 on 2 heads + 2 globals" if mixed else "plain"))
        yield (what, shape[1], batch / chips,
               lambda fn=fn, qkv=qkv, mask=mask: fn.lower(*(qkv,) * 6, mask, mask))


def _trainer_program(cfg, devices, stage_index: int, task=None, batch_arrays=("inputs",
                                                                               "targets")):
  """Lowers `Trainer.train_step(stage)` on abstract, sharded state and batch."""
  from longformer_jax.tasks import CharLMTask
  from longformer_jax.training.loop import Trainer
  from longformer_jax.training.sharding import make_mesh
  trainer = Trainer(cfg, mesh=make_mesh(cfg.mesh_shape, devices),
                    task=CharLMTask() if task is None else task)
  stage = cfg.stages[stage_index]
  shape = (stage.batch_size, stage.seq_len)
  batch = {name: jax.ShapeDtypeStruct(shape, jnp.float32 if name == "weights" else jnp.int32)
           for name in batch_arrays}
  return lambda: trainer.lower_train_step(stage_index, batch)


def char_programs(which: str, devices, quick: bool, stages=None):
  del quick
  from train.configs import char_large, char_small
  cfg = (char_small if which == "char_small" else char_large).get_config()
  for i, stage in enumerate(cfg.stages):
    if stages and i + 1 not in stages:
      continue
    chips = len(devices)
    yield (f"{which} stage {i + 1} train step, windows <= {max(stage.windows)}, "
           f"mesh {cfg.mesh_shape}", stage.seq_len, stage.batch_size / chips,
           _trainer_program(cfg, devices, i))


def charlm_1m_programs(devices, quick: bool):
  import dataclasses
  from longformer_jax.training import Stage
  from train.configs import char_small
  cfg = char_small.get_config()
  last = cfg.stages[-1]
  seq = 65536 if quick else 1 << 20
  # remat: at a million tokens the activations kept for the backward pass dominate (without
  # it, 32.8 GB of temporaries per v5e chip at 262k tokens per chip).
  cfg = dataclasses.replace(
      cfg, model=cfg.model.replace(remat=True), mesh_shape=(1, 1, len(devices)),
      microbatch_size=None,
      stages=(Stage(seq_len=seq, batch_size=1, steps=1, learning_rate=last.learning_rate,
                    windows=last.windows),))
  yield (f"char_small train step (remat), 1 sequence split over {len(devices)}, stage-5 windows",
         seq, 1 / len(devices), _trainer_program(cfg, devices, 0))


class _MaskedLMTask:
  """Masked-token cross-entropy of `LongformerForMaskedLM`, <s> global (max_global=1)."""

  def __new__(cls):
    import optax
    from flax import nnx
    from longformer_jax import LongformerForMaskedLM
    from longformer_jax.training.task import Task

    class MaskedLMTask(Task):

      def build_model(self, config, rngs, mesh=None, seq_axis=None):
        return LongformerForMaskedLM(config, rngs=rngs, mesh=mesh, seq_axis=seq_axis)

      def loss(self, model, batch, stage, dropout_key):
        nnx.reseed(model, dropout=dropout_key)
        ids = batch["input_ids"]
        global_mask = jnp.zeros(ids.shape, bool).at[:, 0].set(True)
        logits = model(ids, global_attention_mask=global_mask, max_global=1).logits
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        return jnp.sum(nll * batch["weights"]) / jnp.maximum(jnp.sum(batch["weights"]), 1.0)

      def batches(self, cfg, stage_index, *, process_index, process_count):
        raise RuntimeError("this task only compiles the step (benchmarks/tpu_aot.py): no data")

    return MaskedLMTask()


def mlm_programs(devices, quick: bool):
  from longformer_jax import LongformerConfig
  from longformer_jax.training import Stage, TrainConfig
  chips = len(devices)
  for seq, per_chip in (((1024, 2),) if quick else ((4096, 8), (16384, 2))):
    model = LongformerConfig.base(max_position_embeddings=seq + 2, dtype="bfloat16")
    cfg = TrainConfig(model=model, dataset="none", mesh_shape=(-1, 1),
                      stages=(Stage(seq_len=seq, batch_size=per_chip * chips, steps=1,
                                    learning_rate=1e-4),))
    yield ("MLM base train step (AdamW), <s> global", seq, per_chip,
           _trainer_program(cfg, devices, 0, task=_MaskedLMTask(),
                            batch_arrays=("input_ids", "labels", "weights")))


STAGES: tuple[int, ...] = ()  # --stages: which of the 5 char stages (1-based); () = all

BUILDERS = {
    "band": band_programs,
    "op_1m": op_programs,
    "op_mix": op_mix_programs,
    "mlm": mlm_programs,
    "char_small": lambda devices, quick: char_programs("char_small", devices, quick, STAGES),
    "char_large": lambda devices, quick: char_programs("char_large", devices, quick, STAGES),
    "charlm_1m": charlm_1m_programs,
}


# ---------------------------------------------------------------------------------------------

def measure(slice_name: str, row: str, quick: bool):
  devices = slice_devices(slice_name)
  kind = devices[0].device_kind
  hbm = HBM_BYTES[generation(slice_name)]
  try:
    programs = list(BUILDERS[row](devices, quick))
  except Exception as e:
    # E.g. a mesh the training code refuses; the other rows and slices still run.
    traceback.print_exc()
    record = dict(slice=slice_name, device_kind=kind, devices=len(devices), row=row, what=row,
                  seq=0, batch_per_device=0, hbm_bytes=hbm, compile_s=0.0,
                  error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    print(_row_line(record), flush=True)
    yield record
    return
  for what, seq, batch, lower in programs:
    record = dict(slice=slice_name, device_kind=kind, devices=len(devices), row=row, what=what,
                  seq=seq, batch_per_device=batch, hbm_bytes=hbm)
    start = time.time()
    try:
      lowered = lower()
      compiled = lowered.compile()
      stats = compiled.memory_analysis()
      record.update(
          argument_bytes=stats.argument_size_in_bytes, output_bytes=stats.output_size_in_bytes,
          temp_bytes=stats.temp_size_in_bytes, alias_bytes=stats.alias_size_in_bytes,
          mosaic_calls=compiled.as_text().count(MOSAIC_TARGET),
          bytes_accessed=_bytes_accessed(compiled))
      record["total_bytes"] = (record["argument_bytes"] + record["output_bytes"]
                               + record["temp_bytes"] - record["alias_bytes"])
      record["hbm_fraction"] = record["total_bytes"] / hbm
    except Exception as e:
      record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
      traceback.print_exc()
    record["compile_s"] = round(time.time() - start, 1)
    print(_row_line(record), flush=True)
    yield record


def _bytes_accessed(compiled) -> float:
  """XLA's estimate of the bytes the program reads and writes (`cost_analysis()`; 0 if none)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float((cost or {}).get("bytes accessed", 0.0))


def _gib(x):
  return f"{x / GIB:.2f}"


HEADER = ("| slice | row | what | seq | batch/device | argument GiB | output GiB | temp GiB | "
          "total GiB | of HBM | temp KB/token | accessed KB/token | Mosaic calls | compile s |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def _row_line(r) -> str:
  if "error" in r:
    return (f"| {r['slice']} | {r['row']} | {r['what']} | {r['seq']:,} | {r['batch_per_device']:g} "
            f"| failed: {r['error']} | | | | | | | | {r['compile_s']} |")
  tokens = r["seq"] * r["batch_per_device"]
  return (f"| {r['slice']} | {r['row']} | {r['what']} | {r['seq']:,} | "
          f"{r['batch_per_device']:g} | {_gib(r['argument_bytes'])} | {_gib(r['output_bytes'])} | "
          f"{_gib(r['temp_bytes'])} | {_gib(r['total_bytes'])} | {r['hbm_fraction']:.0%} | "
          f"{r['temp_bytes'] / tokens / 1024:.2f} | {r['bytes_accessed'] / tokens / 1024:.1f} | "
          f"{r['mosaic_calls']} | {r['compile_s']} |")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--slices", default=None,
                      help=f"comma-separated topology names (default {','.join(DEFAULT_SLICES)})")
  parser.add_argument("--rows", default=None,
                      help=f"comma-separated of {','.join(ALL_ROWS)} (default "
                           f"{','.join(DEFAULT_ROWS)})")
  parser.add_argument("--quick", action="store_true",
                      help="band and op_1m rows, small lengths, v5e:2x2 (a test runs it)")
  parser.add_argument("--stages", default="",
                      help="char_small/char_large stages to compile, 1-based, e.g. 1,5 "
                           "(default all 5; each takes minutes)")
  harness.common_arguments(parser, out=None, out_help="directory for the JSON and markdown")
  args = parser.parse_args(argv)
  global STAGES
  STAGES = tuple(int(x) for x in args.stages.split(",") if x)
  try:
    libtpu = importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    parser.exit(2, "benchmarks/tpu_aot.py needs libtpu: pip install -e '.[tpu]'\n")
  slices = (args.slices.split(",") if args.slices
            else ["v5e:2x2"] if args.quick else list(DEFAULT_SLICES))
  rows = (args.rows.split(",") if args.rows
          else ["band", "op_1m"] if args.quick else list(DEFAULT_ROWS))
  for row in rows:
    if row not in BUILDERS:
      parser.error(f"unknown row {row!r}; rows: {', '.join(ALL_ROWS)}")
  date = harness.today()
  command = " ".join(sys.argv[1:] if argv is None else argv)
  title = (f"# TPU memory per device, compiled ahead of time ({date})\n\n"
           f"Command: `python benchmarks/tpu_aot.py {command}`"
           f" (jax {jax.__version__}, libtpu {libtpu}; compiled on a CPU host, "
           f"{os.cpu_count()} cores). total = argument + output + temp - alias; HBM nominal.\n")
  print(title)
  print(HEADER, flush=True)
  records = []
  for slice_name in slices:
    for row in rows:
      records.extend(measure(slice_name, row, args.quick))
  if args.out:
    out = pathlib.Path(args.out)
    meta = dict(date=date, jax=jax.__version__, jaxlib=importlib.metadata.version("jaxlib"),
                libtpu=libtpu, command=f"python benchmarks/tpu_aot.py {command}")
    # One file per date and set of rows, so runs of different rows do not overwrite each other.
    suffix = "_quick" if args.quick else "" if args.rows is None else "_" + "-".join(rows)
    stem = out / f"tpu_aot_{date}{suffix}"
    harness.write_json(stem.with_suffix(".json"), dict(**meta, rows=records))
    harness.write_text(stem.with_suffix(".md"),
                       title + "\n" + HEADER + "\n" + "\n".join(_row_line(r) for r in records))
    print(f"\nwrote {stem}.json and .md")
  return records


if __name__ == "__main__":
  main()
