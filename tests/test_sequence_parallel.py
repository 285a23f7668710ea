"""Sequence-parallel attention (docs/design.md §2.6) on 8 simulated CPU devices: the op with the
sequence split over a mesh axis equals the unsplit op, moves only halos and global tokens, and
keeps the exact receptive field.

The tests need 8 devices, which the test process (one CPU device) does not have: when it has
fewer, `test_on_eight_devices` reruns this file in a subprocess with
`--xla_force_host_platform_device_count=8`, and the cases run there.
"""

from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from longformer_jax import ops
from testing import AttentionCase as Case
from testing import make_attention_inputs as make_inputs
from testing import expected_keys, rerun_on_devices, seed_of

# A subprocess on 8 simulated devices. Compile time dominates (conftest.py); the 8-device rerun
# of this module uses it too.
pytestmark = pytest.mark.integration

DEVICES = 8

if jax.device_count() < DEVICES:

  def test_on_eight_devices():
    rerun_on_devices(__file__, DEVICES, timeout=1500)

else:

  def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)

  # (case, mesh shape over (data, seq)). Shards of 3-10 tokens, so windows reach 1 to 4 shards
  # away; lengths that do not divide the shards; globals in every shard; padding; causal.
  CASES = [
      (Case(batch=2, seq=40, heads=2, window=3, padding=True, max_globals=3), (2, 4)),
      (Case(batch=2, seq=37, heads=2, window=12, padding=True, max_globals=3), (2, 4)),
      (Case(batch=1, seq=29, heads=3, window=4, dilation=(1, 2, 3), padding=True,
            max_globals=4), (1, 8)),
      (Case(batch=2, seq=43, heads=2, window=9, causal=True, padding=True), (2, 4)),
      (Case(batch=1, seq=24, heads=2, window=2, dilation=(1, 4), causal=True), (1, 8)),
      (Case(batch=4, seq=26, heads=2, window=30, padding=True, max_globals=2), (2, 4)),
  ]

  # Every case with the chunked band; the Pallas kernel (interpret mode, slower) on the (2, 4)
  # ones.
  PARAMS = [(c, m, "chunked") for c, m in CASES] + [(c, m, "pallas") for c, m in CASES
                                                     if m == (2, 4)]

  @pytest.mark.parametrize("case,mesh_shape,impl", PARAMS,
                           ids=[f"{i}-{c}-{m[0]}x{m[1]}" for c, m, i in PARAMS])
  def test_equals_unsplit_op_forward_and_gradients(case, mesh_shape, impl):
    mesh = _mesh(mesh_shape, ("data", "seq"))
    (q, k, v), kwargs = make_inputs(case, seed=seed_of(case))
    global_qkv = kwargs.pop("global_qkv", None)
    cotangent = jax.random.normal(jax.random.key(1), q.shape)

    def loss(q, k, v, global_qkv, **sharding):
      out = ops.longformer_attention(q, k, v, global_qkv=global_qkv, impl=impl,
                                     max_global=case.max_globals, **kwargs, **sharding)
      return jnp.sum(out * cotangent), out

    grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True),
                      static_argnames=("mesh", "seq_axis"))
    grads_ref, out_ref = grad_fn(q, k, v, global_qkv)
    grads, out = grad_fn(q, k, v, global_qkv, mesh=mesh, seq_axis="seq")
    np.testing.assert_allclose(out, out_ref, atol=1e-5, rtol=1e-5)
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
      np.testing.assert_allclose(g, g_ref, atol=1e-5, rtol=1e-5)

  def test_inputs_already_sharded_along_the_sequence():
    """Arrays laid out on the mesh as a model's activations are (batch over data, length over
    seq) give the same result, and the result keeps that layout."""
    case = Case(batch=2, seq=32, heads=2, window=5, padding=True, max_globals=2)
    mesh = _mesh((2, 4), ("data", "seq"))
    (q, k, v), kwargs = make_inputs(case, seed=3)
    spec = NamedSharding(mesh, P("data", "seq"))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", "seq", None, None)))
    kwargs["attention_mask"] = jax.device_put(kwargs["attention_mask"], spec)
    kwargs["global_mask"] = jax.device_put(kwargs["global_mask"], spec)
    kwargs["global_qkv"] = tuple(map(put, kwargs["global_qkv"]))
    ref = ops.longformer_attention(q, k, v, impl="chunked", **kwargs)
    out = jax.jit(lambda q, k, v: ops.longformer_attention(
        q, k, v, impl="chunked", max_global=2, mesh=mesh, seq_axis="seq", **kwargs))(
            put(q), put(k), put(v))
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert out.sharding.spec[:2] == ("data", "seq"), out.sharding

  @pytest.mark.parametrize("case", [
      Case(batch=1, seq=24, heads=2, window=4, dilation=(1, 3), padding=True, max_globals=2),
      Case(batch=1, seq=21, heads=2, window=5, dilation=(2, 1), causal=True),
  ], ids=str)
  def test_exact_receptive_field_under_sharding(case):
    """A sliding window must stay a sliding window when split: d out_i / d k_j, v_j is non-zero
    exactly on docs/design.md §1's key set (8 shards of 3 tokens: windows span 2-5 shards)."""
    mesh = _mesh((1, 8), ("data", "seq"))
    (q, k, v), kwargs = make_inputs(case, seed=5)
    global_qkv = kwargs.pop("global_qkv", None)
    am = np.asarray(kwargs["attention_mask"])
    gm = None if global_qkv is None else np.asarray(kwargs["global_mask"])
    probe = jax.random.normal(jax.random.key(3), (case.head_dim,))

    @jax.jit
    def jacobian(k, v, global_qkv):
      def out_probed(k, v, global_qkv):  # [batch, seq, heads]
        return ops.longformer_attention(q, k, v, global_qkv=global_qkv, impl="chunked",
                                        max_global=case.seq, mesh=mesh, seq_axis="seq",
                                        **kwargs) @ probe
      return jax.jacrev(out_probed, argnums=(0, 1, 2))(k, v, global_qkv)

    dk, dv, dglobal = jacobian(k, v, global_qkv)
    dk, dv = np.asarray(dk), np.asarray(dv)
    dglobal = None if dglobal is None else [np.asarray(g) for g in dglobal]
    for b, i, head in itertools.product(range(case.batch), range(case.seq), range(case.heads)):
      local, with_global_proj = expected_keys(case, am, gm, b, i, head)
      touched = lambda g: {j for j in range(case.seq) if np.any(g[b, i, head, b, j, head])}
      assert touched(dv) == local, (b, i, head)
      assert touched(dk) <= local and (len(local) < 2 or touched(dk) == local), (b, i, head)
      if dglobal is not None:
        assert touched(dglobal[2]) == with_global_proj, (b, i, head)
      # Nothing crosses heads.
      other = dv[b, i, head].copy()
      other[:, :, head] = 0
      assert not np.any(other), (b, i, head)

  def _collectives(hlo: str) -> dict[str, list[tuple[int, ...]]]:
    """Result shapes of each collective in compiled HLO text."""
    found = {}
    for match in re.finditer(r"= \(?([a-z0-9]+)\[([\d,]*)\][^=]*? (all-gather|collective-permute|"
                             r"all-reduce|reduce-scatter|all-to-all)(?:-start)?\(", hlo):
      dims = tuple(int(d) for d in match.group(2).split(",") if d)
      found.setdefault(match.group(3), []).append(dims)
    return found

  def _compiled_collectives(mesh_kwargs, seq, in_sharding, impl="chunked"):
    case = Case(batch=2, seq=seq, heads=2, window=16, padding=True, max_globals=2)
    (q, k, v), kwargs = make_inputs(case, seed=2)
    del kwargs["global_qkv"]  # arguments of the compiled function instead

    def fwd_bwd(q, k, v, q_g, k_g, v_g):
      def loss(q, k, v, q_g, k_g, v_g):
        out = ops.longformer_attention(q, k, v, global_qkv=(q_g, k_g, v_g), impl=impl,
                                       max_global=2, **kwargs, **mesh_kwargs)
        return jnp.sum(out ** 2)
      return jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))(q, k, v, q_g, k_g, v_g)

    args = [jax.ShapeDtypeStruct(q.shape, q.dtype, sharding=in_sharding)] * 6
    return _collectives(jax.jit(fwd_bwd).lower(*args).compile().as_text())

  def test_moves_halos_and_global_tokens_never_whole_keys():
    """Reads the compiled fwd+bwd program: collective-permutes of halo size, all-gathers of
    global slots only. The dense reference left to XLA's partitioner (no seq_axis) gathers
    whole-length arrays: the check can fail. (The chunked path's tiles, each a slice of keys
    shifted by a block, are left to XLA's partitioner small enough not to be a control.)"""
    seq, shards, window = 1024, 4, 16
    mesh = _mesh((2, shards), ("data", "seq"))
    sharded = NamedSharding(mesh, P("data", "seq", None, None))
    ours = _compiled_collectives(dict(mesh=mesh, seq_axis="seq"), seq, sharded)
    assert ours.get("collective-permute"), ours
    for kind, shapes in ours.items():
      for shape in shapes:
        # Nothing sequence-long (or a shard's whole length, seq / shards = 256) moves: halos
        # are `window` rows, gathers are shards x global slots.
        assert max(shape, default=0) < seq // shards, (kind, shape)
    assert max(max(s) for s in ours["collective-permute"]) == window, ours
    xla = _compiled_collectives({}, seq, sharded, impl="reference")
    assert any(max(s, default=0) >= seq for s in xla.get("all-gather", [])), xla

  def test_bad_mesh_arguments_are_named():
    mesh = _mesh((2, 4), ("data", "seq"))
    (q, k, v), kwargs = make_inputs(Case(batch=2, seq=16, heads=2, window=2), seed=0)
    with pytest.raises(ValueError, match=r"seq_axis='length' is not an axis of the mesh"):
      ops.longformer_attention(q, k, v, **kwargs, mesh=mesh, seq_axis="length")
    with pytest.raises(ValueError, match=r"sequence length 3 is shorter than the 4 shards"):
      ops.longformer_attention(q[:, :3], k[:, :3], v[:, :3], window=2,
                               mesh=mesh, seq_axis="seq")
    with pytest.raises(ValueError, match=r"batch 2 does not divide over the mesh's batch axes"):
      ops.longformer_attention(q, k, v, **kwargs, mesh=_mesh((4, 2), ("data", "seq")),
                               seq_axis="seq")
    with pytest.raises(ValueError, match=r"seq_axis='seq'.*but mesh=None"):
      ops.longformer_attention(q, k, v, **kwargs, seq_axis="seq")
    with pytest.raises(ValueError, match=r"platform 'metal' has no Pallas band kernel"):
      ops.resolve_impl("pallas", q, 2, platform="metal")

  def test_mesh_without_seq_axis_runs_kernels_per_batch_shard():
    """mesh given, seq_axis None: the kernel runs per batch (and head) shard under shard_map,
    equal to no mesh."""
    case = Case(batch=4, seq=33, heads=4, window=4, dilation=(1, 2, 1, 2), padding=True,
                max_globals=2)
    (q, k, v), kwargs = make_inputs(case, seed=9)
    mesh = _mesh((4, 2), ("data", "fsdp"))
    ref = ops.longformer_attention(q, k, v, impl="pallas", **kwargs)
    out = jax.jit(lambda q, k, v: ops.longformer_attention(
        q, k, v, impl="pallas", max_global=2, mesh=mesh, batch_axes="data", head_axis="fsdp",
        **kwargs))(q, k, v)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"differs between the 2 shards of head_axis='fsdp'"):
      ops.longformer_attention(q, k, v, **dict(kwargs, dilation=(1, 1, 2, 2)), mesh=mesh,
                               batch_axes="data", head_axis="fsdp")

  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
  def test_tpu_kernels_on_a_split_sequence_with_globals_and_dilation(dtype):
    """The sequence-split path as a TPU runs it (the Mosaic kernels, in interpret mode): the
    all-gathered global keys as the band kernel's global tile and step 4 as
    `band_mosaic.global_rows_lse` partial softmaxes merged across shards, against the dense
    reference, forward and the gradients of q, k, v and the global projections. 2 shards of 128
    (whole key blocks of the rows kernel), global tokens in both shards and none in one row,
    padding, dilation 2 on half the heads (reach 2 * 40 into the neighbour)."""
    from longformer_jax.ops import band_mosaic, sequence_parallel, sharded
    from longformer_jax.ops.band_pallas import band_attention_pallas
    from testing import assert_close, tolerance
    batch, seq, heads, head_dim, window, dilations = 2, 256, 4, 64, 40, (1, 1, 2, 2)
    mesh = _mesh((2, 2), ("data", "seq"))
    rng = np.random.default_rng(11)
    q, k, v, q_g, k_g, v_g = (jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)),
                                          dtype) for _ in range(6))
    attention_mask = jnp.asarray(np.arange(seq)[None, :] < np.array([[seq], [200]]))
    global_mask = np.zeros((batch, seq), bool)
    global_mask[0, [3, 127, 128, 250]] = True  # both shards, and a shard's edges
    global_mask[1, [130, 199]] = True  # shard 1 only; 199 the last real token
    global_mask = jnp.asarray(global_mask)
    num_global = 4
    kernel = functools.partial(band_attention_pallas, interpret=True, backend="tpu")
    compose = functools.partial(
        sequence_parallel.compose_sequence_shard, kernel, window=window, dilations=dilations,
        causal=False, num_global=num_global, axis_name="seq", num_shards=2, fused=True,
        rows_kernel=functools.partial(band_mosaic.global_rows_lse, interpret=True))
    cotangent = jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), jnp.float32)

    def split(q, k, v, q_g, k_g, v_g):
      return sharded.on_mesh(compose, mesh, ("data", "seq"), ("data",), "seq", (), q, k, v,
                             attention_mask, global_mask, (q_g, k_g, v_g), check_vma=False)

    def reference(q, k, v, q_g, k_g, v_g):  # float32 from the same (rounded) inputs
      f32 = lambda x: x.astype(jnp.float32)
      return ops.longformer_attention(
          f32(q), f32(k), f32(v), window=window, dilation=dilations,
          attention_mask=attention_mask, global_mask=global_mask,
          global_qkv=(f32(q_g), f32(k_g), f32(v_g)), impl="reference")

    def loss_and_out(attend):
      def loss(*args):
        out = attend(*args)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out
      return jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))

    args = (q, k, v, q_g, k_g, v_g)
    grads, out = loss_and_out(split)(*args)
    grads_ref, out_ref = loss_and_out(reference)(*args)
    assert out.dtype == dtype
    tol = tolerance(dtype)
    assert_close(out, out_ref, tol, "out")
    for name, g, g_ref in zip(("dq", "dk", "dv", "dq_g", "dk_g", "dv_g"), grads, grads_ref):
      assert g.dtype == dtype
      assert_close(g, g_ref, tol, name)
