"""TPU programs compiled ahead of time on this CPU machine (tests/tpu_testing.py): the Mosaic
band kernel and `ops.longformer_attention` compile for real TPU slices, and the kernel's memory
per token stays flat with length.

Every test compiles with XLA's TPU compiler and Mosaic through libtpu's compile-only client
(nothing runs), and checks that the compiled program holds the Mosaic kernels
(`tpu_custom_call`), not the interpret path. The tests skip only when libtpu is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import typing

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import pytest

from longformer_jax import ops
from longformer_jax.ops.band_pallas import band_attention_pallas
import tpu_testing

pytestmark = [pytest.mark.tpu, pytest.mark.slow]

# The base model's attention shape (docs/design.md §6).
HEADS, HEAD_DIM, WINDOW = 12, 64, 256


@pytest.fixture(scope="module")
def one_chip():
  """One v5e chip: the kernel's memory is per chip, so one is enough to measure it."""
  return tpu_testing.tpu_mesh("v5e:1x1", (1,), ("data",))


def _band_loss(row_major: bool):
  """Loss of the band kernel alone (its out and lse), on q, k, v given as [B, N, H, D] or, as
  they come out of a projection, row-major [B, N, H*D]."""
  def loss(q, k, v, key_mask):
    if row_major:
      q, k, v = (x.reshape(*x.shape[:2], HEADS, HEAD_DIM) for x in (q, k, v))
    out, lse = band_attention_pallas(q, k, v, key_mask, window=WINDOW, causal=False,
                                     interpret=False, backend="tpu")
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)
  return loss


def _compile_band_grad(mesh, seq: int, row_major: bool):
  shape = (1, seq, HEADS * HEAD_DIM) if row_major else (1, seq, HEADS, HEAD_DIM)
  qkv = tpu_testing.sds(shape, jnp.bfloat16, mesh)
  key_mask = tpu_testing.sds((1, seq), jnp.bool_, mesh)
  grad = jax.jit(jax.value_and_grad(_band_loss(row_major), argnums=(0, 1, 2)))
  return grad.lower(qkv, qkv, qkv, key_mask).compile()


@pytest.mark.parametrize("row_major", [False, True], ids=["BxNxHxD", "BxNxHD"])
def test_band_kernel_temporaries_per_token_are_flat(one_chip, row_major):
  """XLA's temporaries (HBM, one v5e chip) of the kernel's forward + backward per token: equal
  within 5% at 128k and 256k tokens, and at most the arrays the program cannot avoid.

  One [B, N, H, D] bf16 array is 1.5 KB per token. The kernel needs out and dout (2 arrays);
  with [B, N, H, D] inputs in XLA's default TPU layout (sequence minor) also q, k, v copied to
  row-major and dq, dk, dv before their copy to the output layout (6 in all, some shared). The
  previous [B, H, N, D] kernel layout padded head_dim 64 to 128 lanes and needed 18 KB per
  token (12 arrays' worth); a float32 copy of out for delta took 3 more. Below ~100k tokens XLA
  keeps whole temporaries in VMEM (128 MiB on v5e), so the HBM figure is smaller there: the
  lengths are chosen past that.
  """
  array_per_token = HEADS * HEAD_DIM * 2
  per_token = {}
  for seq in (131072, 262144):
    compiled = _compile_band_grad(one_chip, seq, row_major)
    assert tpu_testing.mosaic_calls(compiled) == 3  # fwd, dq (with delta), dk/dv
    text = compiled.as_text()
    for name in ("band_attention_fwd_tpu", "band_attention_bwd_dq_tpu",
                 "band_attention_bwd_dkv_tpu"):
      assert name in text, name
    per_token[seq] = tpu_testing.memory(compiled)["temp"] / seq
  small, large = per_token.values()
  assert abs(large - small) <= 0.05 * large, per_token
  arrays = 2 if row_major else 6
  assert large <= 1.05 * arrays * array_per_token, (per_token, arrays * array_per_token)


@pytest.mark.parametrize("dtype, causal, heads, head_dim", [
    (jnp.float32, True, 3, 64),   # odd heads: padded to a pair
    (jnp.bfloat16, False, 2, 128),
    (jnp.float32, False, 1, 256),
    (jnp.bfloat16, True, 5, 40),  # head_dim 40: zero-padded to 64
], ids=["f32-causal-h3-d64", "bf16-bidir-h2-d128", "f32-bidir-h1-d256", "bf16-causal-h5-d40"])
def test_band_kernel_compiles(one_chip, dtype, causal, heads, head_dim):
  """Forward + backward of the kernel alone for the head dims and dtypes it takes."""
  qkv = tpu_testing.sds((2, 3000, heads, head_dim), dtype, one_chip)
  key_mask = tpu_testing.sds((2, 3000), jnp.bool_, one_chip)

  def loss(q, k, v, key_mask):
    out, lse = band_attention_pallas(q, k, v, key_mask, window=WINDOW, causal=causal,
                                     interpret=False, backend="tpu")
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  assert tpu_testing.mosaic_calls(grad.lower(qkv, qkv, qkv, key_mask).compile()) == 3


# ---------------------------------------------------------------------------------------------
# The op on a TPU slice: 4 v5e chips as (data 2, seq 2), or all 4 on the batch.

@pytest.fixture(scope="module")
def slice_2x2():
  return tpu_testing.tpu_mesh("v5e:2x2", (2, 2), ("data", "seq"))


class OpCase(typing.NamedTuple):
  dtype: typing.Any
  causal: bool
  seq: int
  dilation: typing.Any
  globals: bool
  seq_axis: str | None
  spec: P  # how the inputs arrive: odd lengths cannot be laid out split over "seq"

  def __str__(self):
    return (f"{jnp.dtype(self.dtype).name}-{'causal' if self.causal else 'bidir'}-n{self.seq}-"
            f"d{self.dilation}-{'glob' if self.globals else 'noglob'}-seq{self.seq_axis}")


OP_CASES = [
    OpCase(jnp.bfloat16, False, 2048, 1, False, None, P(("data", "seq"))),  # batch over all 4
    OpCase(jnp.float32, True, 999, 1, False, "seq", P("data")),
    OpCase(jnp.bfloat16, False, 1001, (1, 1, 2, 2), True, "seq", P("data")),
    OpCase(jnp.float32, False, 1024, (1, 2, 1, 2), True, "seq", P("data", "seq")),
    OpCase(jnp.bfloat16, False, 1024, (1, 1, 2, 2), True, None, P(("data", "seq"))),
]


def _op_program(mesh, case: OpCase, grad: bool):
  batch, heads, head_dim = 4, 4, 64
  qkv = tpu_testing.sds((batch, case.seq, heads, head_dim), case.dtype, mesh, case.spec)
  mask = tpu_testing.sds((batch, case.seq), jnp.bool_, mesh, case.spec)

  def attend(q, k, v, attention_mask, global_mask):
    extra = {}
    if case.globals:
      extra = dict(global_mask=global_mask, global_qkv=(q, k, v), max_global=4)
    return ops.longformer_attention(q, k, v, window=64, dilation=case.dilation,
                                    causal=case.causal, attention_mask=attention_mask,
                                    impl="pallas", mesh=mesh, seq_axis=case.seq_axis, **extra)

  fn = attend
  if grad:
    fn = jax.value_and_grad(lambda *a: jnp.sum(attend(*a).astype(jnp.float32)),
                            argnums=(0, 1, 2))
  return jax.jit(fn).lower(qkv, qkv, qkv, mask, mask).compile()


@pytest.mark.parametrize("case", OP_CASES, ids=str)
def test_op_gradients_compile_with_the_mosaic_kernel(slice_2x2, case):
  """value_and_grad of the op: 3 Mosaic calls (forward, dQ, dK/dV), whatever the dilations (one
  launch of each kernel takes every head), and with global tokens 2 more (the global rows'
  forward and backward, `band_mosaic.global_rows_lse`) where the rows on a device are a
  multiple of 128: whole sequences, or shards of 512 when the sequence is split over 2 (a
  split sequence merges their partial softmaxes across shards); 1001 split in 2 takes XLA's
  pass. The interpret path would have none."""
  compiled = _op_program(slice_2x2, case, grad=True)
  local_seq = case.seq if case.seq_axis is None else -(-case.seq // 2)
  rows_kernel = case.globals and local_seq % 128 == 0
  assert rows_kernel == (case.globals and case.seq != 1001)
  assert tpu_testing.mosaic_calls(compiled) == 3 + 2 * rows_kernel


def test_op_forward_compiles_with_the_mosaic_kernel(slice_2x2):
  compiled = _op_program(slice_2x2, OP_CASES[2], grad=False)
  assert tpu_testing.mosaic_calls(compiled) == 1  # one band kernel for every dilation


def test_benchmark_quick(tmp_path):
  """benchmarks/tpu_aot.py --quick: its kernel and op rows compile, with the Mosaic kernel, and
  it writes its JSON and markdown."""
  tpu_testing.require_libtpu()
  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "tpu_aot.py"
  spec = importlib.util.spec_from_file_location("tpu_aot_benchmark", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  rows = module.main(["--quick", "--out", str(tmp_path)])
  assert [r["row"] for r in rows] == ["band", "op_1m"]
  for r in rows:
    assert "error" not in r and r["mosaic_calls"] == 3 and 0 < r["total_bytes"] < r["hbm_bytes"]
  (json_path,) = tmp_path.glob("tpu_aot_*_quick.json")
  assert json.loads(json_path.read_text())["rows"] == rows
  assert json_path.with_suffix(".md").exists()


@pytest.mark.parametrize("mesh_shape", [(2, 2, 4), (1, 2, 8)])
def test_char_lm_train_step_compiles_on_a_multi_host_slice(mesh_shape):
  """The whole char-LM train step (forward, backward, AdamW; sequence-parallel attention) for a
  4-host v5e:4x4 slice with a (data, fsdp, seq) mesh, the seq axis inside a host (2, 2, 4) or
  across two hosts (1, 2, 8): every layer's band runs the Mosaic kernel (3 calls: forward, dQ,
  dK/dV) inside shard_map, and the halos move by collective-permute."""
  from longformer_jax.config import CharLMConfig
  from longformer_jax.tasks import CharLMTask
  from longformer_jax.training import Stage, TrainConfig, Trainer, make_mesh
  tpu_testing.require_libtpu()
  devices = tpu_testing.topology("v5e:4x4").devices
  assert len({d.process_index for d in devices}) == 4  # a multi-host slice
  layers, seq, batch = 2, 4096, 4
  cfg = TrainConfig(
      model=CharLMConfig(num_hidden_layers=layers, hidden_size=128, num_attention_heads=2,
                         intermediate_size=256, attention_window=(64, 128)),
      stages=(Stage(seq_len=seq, batch_size=batch, steps=1, learning_rate=1e-3),),
      mesh_shape=mesh_shape)
  trainer = Trainer(cfg, make_mesh(cfg.mesh_shape, devices), task=CharLMTask())
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  compiled = trainer.lower_train_step(0, {"inputs": tokens, "targets": tokens}).compile()
  assert tpu_testing.mosaic_calls(compiled) == 3 * layers
  assert "collective-permute" in compiled.as_text()
  assert 0 < tpu_testing.memory(compiled)["total"] < 16 * 2**30


def test_row_groups_on_a_multi_host_slice():
  """Which rows each of the 4 hosts of a v5e:4x4 slice feeds: its own when the seq axis stays
  inside a host, the same as the hosts that share its sequences when it does not."""
  from longformer_jax.training.sharding import LOGICAL_RULES, batch_sharding, make_mesh, row_group
  tpu_testing.require_libtpu()
  devices = tpu_testing.topology("v5e:4x4").devices
  shape = (8, 4096)
  expected = {(4, 1, 4): [(0, 4), (1, 4), (2, 4), (3, 4)],
              (2, 2, 4): [(0, 4), (1, 4), (2, 4), (3, 4)],
              (1, 2, 8): [(0, 2), (0, 2), (1, 2), (1, 2)],
              (1, 1, 16): [(0, 1)] * 4}
  for mesh_shape, groups in expected.items():
    sharding = batch_sharding(make_mesh(mesh_shape, devices), LOGICAL_RULES, shape)
    assert [row_group(sharding, shape, process_index=p) for p in range(4)] == groups, mesh_shape


@pytest.mark.parametrize("slice_name", ["v5e:1x1", "v6e:1x1", "v5p:1x1x1"])
def test_band_kernel_with_dilation_and_global_keys_compiles(slice_name):
  """Forward + backward of the kernel with two runs of heads (dilation 1 and 2, addressed in
  place by one launch of each kernel: strided rows of a block) and a global key tile, on one chip
  of each generation."""
  mesh = tpu_testing.tpu_mesh(slice_name, (1,), ("data",))
  batch, seq, heads = 1, 4096, 4
  qkv = tpu_testing.sds((batch, seq, heads, HEAD_DIM), jnp.bfloat16, mesh)
  glob = tpu_testing.sds((batch, 2, heads, HEAD_DIM), jnp.bfloat16, mesh)
  masks = tpu_testing.sds((batch, seq), jnp.bool_, mesh), tpu_testing.sds((batch, 2), jnp.bool_,
                                                                          mesh)

  def loss(q, k, v, kg, vg, key_mask, keep):
    out, lse = band_attention_pallas(q, k, v, key_mask, window=WINDOW, causal=False,
                                     dilation=(1, 1, 2, 2), global_kv=(kg, vg, keep),
                                     interpret=False, backend="tpu")
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
  compiled = grad.lower(qkv, qkv, qkv, glob, glob, *masks).compile()
  assert tpu_testing.mosaic_calls(compiled) == 3  # fwd, dq, dk/dv, each for both dilations
