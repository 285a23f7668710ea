"""The attention op inside users' sharded programs (docs/design.md §2.6), on 4 simulated CPU
devices: under an Explicit mesh (`jax.make_mesh`'s default, `jax.set_mesh`) and an Auto one, for
every implementation, and inside a user's `jax.shard_map` (check_vma=True), also with the
sequence split over the user's axis. Forward and gradients equal the unsharded op's.

The cases need 4 devices, which the test process (one CPU device) does not have: when it has
fewer, `test_on_four_devices` reruns this file in a subprocess with
`--xla_force_host_platform_device_count=4`, and the cases run there.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from longformer_jax import ops
from testing import AttentionCase as Case
from testing import make_attention_inputs as make_inputs
from testing import rerun_on_devices, seed_of

# A subprocess on 4 simulated devices.
pytestmark = pytest.mark.integration

DEVICES = 4

if jax.device_count() < DEVICES:

  def test_on_four_devices():
    rerun_on_devices(__file__, DEVICES, timeout=900)

else:

  pytestmark = pytest.mark.integration

  # Batch over 'data', heads over 'model'; rows after the first are padded. CAUSAL has one
  # dilation per head (each head shard holds (2, 1)); the Pallas cases keep one dilation for
  # all heads, so that each kernel is one launch (interpret mode compiles slowly).
  GLOBALS = Case(batch=2, seq=32, heads=2, window=3, dilation=2, padding=True, max_globals=3)
  CAUSAL = Case(batch=2, seq=32, heads=4, window=5, dilation=(2, 1, 2, 1), causal=True,
                padding=True)
  PALLAS_CAUSAL = Case(batch=2, seq=32, heads=2, window=5, dilation=2, causal=True,
                       padding=True)
  FWD_TOL = GRAD_TOL = 1e-5  # measured: at most 4.8e-7 forward, 9.6e-7 gradients
  _REFERENCES = {}

  def _inputs(case):
    (q, k, v), kwargs = make_inputs(case, seed=seed_of(case))
    global_qkv = kwargs.pop("global_qkv", None)
    cotangent = jax.random.normal(jax.random.key(seed_of(case, "cotangent")), q.shape)
    return (q, k, v, global_qkv), kwargs, cotangent

  def _value_and_grads(attend, args, cotangent):
    """out and d(sum(out * cotangent)) / d(q, k, v, global_qkv), jitted."""
    def loss(q, k, v, global_qkv):
      out = attend(q, k, v, global_qkv)
      return jnp.sum(out * cotangent), out
    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*args)
    return out, grads

  def _reference(case):
    """The unsharded dense reference: out and gradients (computed once per case)."""
    if case not in _REFERENCES:
      args, kwargs, cotangent = _inputs(case)
      _REFERENCES[case] = _value_and_grads(
          lambda q, k, v, g: ops.longformer_attention(q, k, v, global_qkv=g, impl="reference",
                                                      **kwargs), args, cotangent)
    return _REFERENCES[case]

  def _assert_equal_to_reference(case, out, grads):
    out_ref, grads_ref = _reference(case)
    np.testing.assert_allclose(out, out_ref, atol=FWD_TOL, rtol=FWD_TOL)
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
      np.testing.assert_allclose(g, g_ref, atol=GRAD_TOL, rtol=GRAD_TOL)

  def _put(x, mesh, spec):
    return None if x is None else jax.device_put(x, NamedSharding(mesh, spec))

  def _laid_out(args, kwargs, mesh, spec_BxNxHxD, spec_BxN):
    q, k, v, global_qkv = args
    qkv = tuple(_put(x, mesh, spec_BxNxHxD) for x in (q, k, v))
    global_qkv = None if global_qkv is None else tuple(_put(x, mesh, spec_BxNxHxD)
                                                       for x in global_qkv)
    kwargs = dict(kwargs, attention_mask=_put(kwargs["attention_mask"], mesh, spec_BxN))
    if "global_mask" in kwargs:
      kwargs["global_mask"] = _put(kwargs["global_mask"], mesh, spec_BxN)
    return (*qkv, global_qkv), kwargs

  MESH_CASES = [(c, i, "explicit") for i in ("reference", "chunked") for c in (GLOBALS, CAUSAL)]
  MESH_CASES += [(GLOBALS, "pallas", "explicit"), (PALLAS_CAUSAL, "pallas", "explicit")]
  MESH_CASES += [(GLOBALS, "reference", "auto"), (GLOBALS, "chunked", "auto"),
                 (PALLAS_CAUSAL, "pallas", "auto")]

  @pytest.mark.parametrize("case,impl,axis_type", MESH_CASES,
                           ids=[f"{a}-{i}-{c}" for c, i, a in MESH_CASES])
  def test_under_a_mesh_batch_and_heads_sharded(case, impl, axis_type):
    """`jax.set_mesh` with batch over 'data' and heads over 'model': no `mesh=`, the op reads
    the layout from its inputs' types (Explicit) or leaves it to XLA (Auto)."""
    kind = AxisType.Explicit if axis_type == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(kind, kind))
    args, kwargs, cotangent = _inputs(case)
    with jax.set_mesh(mesh):
      spec = P("data", None, "model", None)
      args, kwargs = _laid_out(args, kwargs, mesh, spec, P("data", None))
      out, grads = _value_and_grads(
          lambda q, k, v, g: ops.longformer_attention(q, k, v, global_qkv=g, impl=impl,
                                                      max_global=case.max_globals, **kwargs),
          args, _put(cotangent, mesh, spec))
      if kind == AxisType.Explicit:  # the output is laid out as the input
        assert jax.typeof(out).sharding.spec == spec, jax.typeof(out)
    _assert_equal_to_reference(case, out, grads)

  # (case, impl, how dilation is given: for all heads, or per local head).
  # The Pallas kernels run in the TPU interpreter here (band_pallas.band_attention_pallas), the
  # slowest to compile: one case, with the global key tile.
  USER_CASES = [(GLOBALS, "chunked", "all"), (CAUSAL, "chunked", "all"),
                (CAUSAL, "chunked", "local"), (GLOBALS, "pallas", "all")]

  @pytest.mark.parametrize("case,impl,heads", USER_CASES,
                           ids=[f"{i}-{h}-{c}" for c, i, h in USER_CASES])
  def test_inside_a_user_shard_map_with_check_vma(case, impl, heads):
    """A user's `jax.shard_map` (check_vma=True, the default) over batch and heads: the op runs
    on the shards it is given; dilation is given for all heads or per local head."""
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    spec, spec_BxN = P("data", None, "model", None), P("data", None)
    args, kwargs, cotangent = _inputs(case)
    args, kwargs = _laid_out(args, kwargs, mesh, spec, spec_BxN)
    masks = {name: kwargs.pop(name) for name in ("attention_mask", "global_mask")
             if name in kwargs}
    dilation = kwargs.pop("dilation")
    if heads == "local":  # this shard's 2 of the 4 heads
      dilation = dilation[:2]

    def per_shard(q, k, v, global_qkv, masks):
      return ops.longformer_attention(q, k, v, global_qkv=global_qkv, impl=impl,
                                      max_global=case.max_globals, dilation=dilation,
                                      head_axis="model", batch_axes="data", **masks, **kwargs)

    in_specs = (spec, spec, spec, None if args[3] is None else (spec,) * 3,
                {name: spec_BxN for name in masks})
    attend = lambda q, k, v, g: jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs,
                                              out_specs=spec)(q, k, v, g, masks)
    out, grads = _value_and_grads(attend, args, _put(cotangent, mesh, spec))
    _assert_equal_to_reference(case, out, grads)

  # The same cases with the sequence split in 2 shards of 16 tokens (the reference impl gathers
  # the sequence over the caller's axis). The Pallas kernels run the same collectives with
  # `mesh=` in tests/test_sequence_parallel.py.
  SEQ_CASES = [(GLOBALS, "chunked"), (CAUSAL, "chunked"), (CAUSAL, "reference")]

  @pytest.mark.parametrize("case,impl", SEQ_CASES, ids=[f"{i}-{c}" for c, i in SEQ_CASES])
  def test_seq_axis_of_a_user_shard_map(case, impl):
    """The sequence split over the user's 'seq' axis: `seq_axis="seq"` without `mesh=`
    exchanges halos over the caller's axis and equals the unsplit op."""
    mesh = jax.make_mesh((2, 2), ("data", "seq"))
    spec, spec_BxN = P("data", "seq", None, None), P("data", "seq")
    args, kwargs, cotangent = _inputs(case)
    args, kwargs = _laid_out(args, kwargs, mesh, spec, spec_BxN)
    masks = {name: kwargs.pop(name) for name in ("attention_mask", "global_mask")
             if name in kwargs}

    def per_shard(q, k, v, global_qkv, masks):
      return ops.longformer_attention(q, k, v, global_qkv=global_qkv, impl=impl,
                                      max_global=case.max_globals, seq_axis="seq", **masks,
                                      **kwargs)

    in_specs = (spec, spec, spec, None if args[3] is None else (spec,) * 3,
                {name: spec_BxN for name in masks})
    attend = lambda q, k, v, g: jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs,
                                              out_specs=spec)(q, k, v, g, masks)
    out, grads = _value_and_grads(attend, args, cotangent)
    _assert_equal_to_reference(case, out, grads)

  def test_explicit_sequence_sharding_is_sequence_parallel():
    """Under an Explicit mesh, a sequence split over 'seq' in the inputs' types makes the op
    exchange halos over it (ppermute, not an all-gather of the sequence), laid out as its
    input."""
    case = CAUSAL
    mesh = jax.make_mesh((2, 2), ("data", "seq"))
    spec = P("data", "seq", None, None)
    args, kwargs, cotangent = _inputs(case)
    with jax.set_mesh(mesh):
      args, kwargs = _laid_out(args, kwargs, mesh, spec, P("data", "seq"))
      attend = lambda q, k, v, g: ops.longformer_attention(
          q, k, v, global_qkv=g, impl="chunked", max_global=case.max_globals, **kwargs)
      out, grads = _value_and_grads(attend, args, _put(cotangent, mesh, spec))
      assert jax.typeof(out).sharding.spec == spec, jax.typeof(out)
      jaxpr = str(jax.make_jaxpr(attend)(*args))
      assert "ppermute" in jaxpr and "all_gather" not in jaxpr, jaxpr
    _assert_equal_to_reference(case, out, grads)

  def test_mesh_argument_with_an_explicit_mesh():
    """`mesh=` from `jax.make_mesh` (Explicit axes) with plain inputs, the sequence over 3
    shards (32 tokens: padded to 33 and cut back): as with an Auto mesh."""
    case = CAUSAL
    mesh = jax.make_mesh((3,), ("seq",), devices=jax.devices()[:3])
    args, kwargs, cotangent = _inputs(case)
    out, grads = _value_and_grads(
        lambda q, k, v, g: ops.longformer_attention(q, k, v, global_qkv=g, impl="chunked",
                                                    max_global=case.max_globals, mesh=mesh,
                                                    seq_axis="seq", **kwargs), args, cotangent)
    _assert_equal_to_reference(case, out, grads)

  def test_axes_that_name_no_usable_mesh_axis_are_refused():
    (q, k, v), kwargs = make_inputs(Case(batch=2, seq=16, heads=2, window=2), seed=0)
    with pytest.raises(ValueError, match=r"seq_axis='seq' names a mesh axis, but mesh=None and "
                                         r"no mesh is set"):
      ops.longformer_attention(q, k, v, **kwargs, seq_axis="seq")
    auto = jax.make_mesh((2, 2), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(auto), pytest.raises(
        ValueError, match=r"seq_axis='seq' names a mesh axis.*'seq' is not an Explicit or Manual"):
      ops.longformer_attention(q, k, v, **kwargs, seq_axis="seq")
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    spec = P("data", None, "model", None)

    def per_shard(q, k, v):
      return ops.longformer_attention(q, k, v, window=2, dilation=(1, 2, 2, 1),
                                      head_axis="model")
    q4 = _put(jnp.zeros((2, 8, 4, 8)), mesh, spec)
    with pytest.raises(ValueError, match=r"dilation=\(1, 2, 2, 1\) differs between the 2 shards "
                                         r"of head_axis='model'"):
      jax.shard_map(per_shard, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q4, q4, q4)
    with pytest.raises(ValueError, match=r"inside a shard_map over its axes"):
      jax.shard_map(lambda q: ops.longformer_attention(q, q, q, window=2, mesh=mesh), mesh=mesh,
                    in_specs=spec, out_specs=spec)(q4)

  # platform: (device kind, custom call of the kernels), as in tests/test_band_pallas.py.
  KERNELS = {"tpu": ("TPU v5 lite", "tpu_custom_call"), "cuda": ("NVIDIA H200", "xla.gpu.triton")}

  @pytest.mark.parametrize("where", ["user_shard_map", "explicit"])
  @pytest.mark.parametrize("platform", sorted(KERNELS))
  def test_lowers_the_kernels_for_a_gpu_or_tpu(platform, where):
    """Lowered for a TPU or GPU from this CPU (docs/design.md §5.1), fwd + bwd with the sequence
    split over 'seq': the kernels' custom calls, with the platform from the caller's abstract
    mesh, inside a user's shard_map (check_vma=True) or the op's own over Explicit axes."""
    kind, target = KERNELS[platform]
    device = AbstractDevice(device_kind=kind, num_cores=1 if platform == "tpu" else None,
                            platform=platform)
    mesh = AbstractMesh((2, 2), ("data", "seq"), axis_types=(AxisType.Explicit,) * 2,
                        abstract_device=device)
    spec, spec_BxN = P("data", "seq", None, None), P("data", "seq")
    attend = lambda q, k, v, mask: ops.longformer_attention(
        q, k, v, window=128, attention_mask=mask, impl="pallas", seq_axis="seq")
    if where == "user_shard_map":
      attend = jax.shard_map(attend, in_specs=(spec,) * 3 + (spec_BxN,), out_specs=spec)
    loss = lambda q, k, v, mask: jnp.sum(attend(q, k, v, mask).astype(jnp.float32) ** 2)
    qkv = jax.ShapeDtypeStruct((2, 1024, 2, 64), jnp.bfloat16,
                               sharding=NamedSharding(mesh, spec))
    mask = jax.ShapeDtypeStruct((2, 1024), jnp.bool_, sharding=NamedSharding(mesh, spec_BxN))
    with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)  # jax 0.12: Triton is deprecated
      hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(qkv, qkv, qkv, mask).lower(
          lowering_platforms=(platform,)).as_text()
    assert target in hlo and "collective_permute" in hlo

  # docs/models.md, "Using the op inside your own shard_map", verbatim.
  DOCS_SNIPPET = """import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from longformer_jax import ops

mesh = jax.make_mesh((2, 2), ("data", "seq"))  # 4 devices
spec, spec_BxN = P("data", "seq", None, None), P("data", "seq")


def attend(q, k, v, attention_mask, global_mask, q_g, k_g, v_g):
  # One shard: [batch / 2, seq / 2, heads, head_dim]. The op fetches from the neighbouring
  # shards along "seq" the keys its queries see, and the global tokens of every shard.
  return ops.longformer_attention(
      q, k, v, window=8, attention_mask=attention_mask, global_mask=global_mask,
      global_qkv=(q_g, k_g, v_g), max_global=2, seq_axis="seq", impl="chunked")


attend_sharded = jax.jit(jax.shard_map(
    attend, mesh=mesh, in_specs=(spec,) * 3 + (spec_BxN,) * 2 + (spec,) * 3, out_specs=spec))

put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
q, k, v, q_g, k_g, v_g = (put(jax.random.normal(key, (2, 64, 2, 16)), spec)
                          for key in jax.random.split(jax.random.key(0), 6))
attention_mask = put(jnp.arange(64) < jnp.array([[64], [50]]), spec_BxN)  # row 1: 14 pads
global_mask = put(jnp.zeros((2, 64), bool).at[:, [0, 40]].set(True), spec_BxN)
out = attend_sharded(q, k, v, attention_mask, global_mask, q_g, k_g, v_g)  # [2, 64, 2, 16]
"""

  def test_docs_snippet():
    docs = (Path(__file__).parent.parent / "docs" / "models.md").read_text()
    assert DOCS_SNIPPET in docs, "the snippet of docs/models.md changed: update DOCS_SNIPPET"
    scope = {}
    exec(compile(DOCS_SNIPPET, "docs/models.md", "exec"), scope)
    q, k, v, q_g, k_g, v_g, attention_mask, global_mask = (
        np.asarray(jax.device_get(scope[n]))
        for n in ("q", "k", "v", "q_g", "k_g", "v_g", "attention_mask", "global_mask"))
    ref = jax.jit(lambda q, k, v, q_g, k_g, v_g: ops.longformer_attention(
        q, k, v, window=8, impl="reference", attention_mask=attention_mask,
        global_mask=global_mask, global_qkv=(q_g, k_g, v_g)))(q, k, v, q_g, k_g, v_g)
    np.testing.assert_allclose(scope["out"], ref, atol=FWD_TOL, rtol=FWD_TOL)
    assert jax.typeof(scope["out"]).sharding.spec == scope["spec"]
