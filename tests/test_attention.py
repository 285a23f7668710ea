"""The attention op against its dense reference (docs/design.md §1), for every fast implementation.

`TestChunked` holds the whole suite; another implementation reruns all of it by subclassing with
a different `IMPL` (`TestPallas`, at the end), so no test is written twice. The bad-value tests
(padding holding NaN or inf, too few global slots) hold for the dense reference too: their
bodies are functions that the class and module-level reference tests both call.
"""

from __future__ import annotations

import functools
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longformer_jax import ops
from testing import TOLERANCE_VS_FLOAT32, expected_keys, seed_of, shared_arrays, tolerance
from testing import AttentionCase as Case
from testing import make_attention_inputs as make_inputs

# `TestPallas` adds the kernels and slow marks: it interprets the Pallas kernel on a CPU.
pytestmark = pytest.mark.unit


def _grid():
  """A grid of cases, each seeded by `seed_of(case)` (stable across processes): block
  (non-)multiples, windows 1..>seq, dilations, causal, padding, globals."""
  cases = []
  for seq, window, dilation, causal in itertools.product(
      (24, 67), (1, 5, 200), (1, 2, (1, 3, 2)), (False, True)):
    cases.append(Case(batch=2, seq=seq, heads=3, window=window, dilation=dilation, causal=causal,
                      padding=True, max_globals=0 if causal else 3))
  cases += [Case(batch=2, seq=1, heads=3, window=3, dilation=(1, 3, 2), max_globals=1),
            Case(batch=2, seq=1, heads=1, window=1, causal=True)]
  # Longer than one chunk block (128) with several blocks of reach, and a window exactly a block.
  cases += [Case(batch=2, seq=300, heads=2, window=128, padding=True, max_globals=2),
            Case(batch=1, seq=257, heads=2, window=130, causal=True, dilation=(1, 2)),
            Case(batch=3, seq=50, heads=2, window=4, max_globals=7, padding=True)]
  return cases


GRID = _grid()
# Rows with padding, with and without globals: for the bad-value tests.
PADDED_CASES = [
    Case(batch=2, seq=37, heads=2, window=3, dilation=(1, 2), padding=True, max_globals=2),
    Case(batch=2, seq=37, heads=2, window=3, dilation=(2, 1), causal=True, padding=True),
]


class TestChunked:
  IMPL = "chunked"
  GRID = GRID  # the parity grid; tests/conftest.py parametrizes `grid_case` over it

  def attention(self, *args, **kwargs):
    return ops.longformer_attention(*args, impl=self.IMPL, **kwargs)

  # --------------------------------------------------------------------------- parity

  def test_matches_reference_forward_and_gradients(self, grid_case, tmp_path_factory):
    case = grid_case
    (q, k, v), kwargs = make_inputs(case, seed=seed_of(case))
    global_qkv = kwargs.pop("global_qkv", None)
    cotangent = jax.random.normal(jax.random.key(1), q.shape)

    def loss(impl, q, k, v, global_qkv):
      out = ops.longformer_attention(q, k, v, global_qkv=global_qkv, impl=impl, **kwargs)
      return jnp.sum(out * cotangent), out

    # One program per implementation (run eagerly, every primitive compiles on its own: 2-3x
    # the time); the masks are constants of it, as in an eager call.
    grad_fn = jax.jit(jax.grad(loss, argnums=(1, 2, 3, 4), has_aux=True), static_argnums=0)
    # The reference's result is computed once per session for every class that reruns the grid.
    out_ref, *grads_ref = shared_arrays(
        tmp_path_factory, f"attention-reference-{seed_of(case):08x}",
        lambda: grad_fn("reference", q, k, v, global_qkv)[::-1])
    grads, out = grad_fn(self.IMPL, q, k, v, global_qkv)
    grads = jax.tree.leaves(grads)
    assert len(grads) == len(grads_ref)
    np.testing.assert_allclose(out, out_ref, atol=1e-5, rtol=1e-5)
    for g, g_ref in zip(grads, grads_ref):
      np.testing.assert_allclose(g, g_ref, atol=1e-5, rtol=1e-5)
    # The grid must exercise what it claims: padding queries are exactly zero.
    assert not jnp.any(out[~kwargs["attention_mask"]])

  # --------------------------------------------------------------------------- receptive field

  @pytest.mark.parametrize("case", [
      Case(batch=2, seq=23, heads=2, window=2, dilation=(1, 3), padding=True, max_globals=2),
      Case(batch=1, seq=19, heads=2, window=3, dilation=(2, 1), causal=True, padding=True),
  ], ids=str)
  def test_exact_receptive_field(self, case):
    (q, k, v), kwargs = make_inputs(case, seed=7)
    global_qkv = kwargs.pop("global_qkv", None)
    am = np.asarray(kwargs["attention_mask"])
    gm = None if global_qkv is None else np.asarray(kwargs["global_mask"])
    probe = jax.random.normal(jax.random.key(3), (case.head_dim,))

    @jax.jit
    def grads_of_output(i, k, v, global_qkv):
      def out_i(k, v, global_qkv):
        out = ops.longformer_attention(q, k, v, global_qkv=global_qkv, impl=self.IMPL,
                                       max_global=case.seq, **kwargs)
        return out[:, i] @ probe  # [batch, heads]
      return jax.jacrev(out_i, argnums=(0, 1, 2))(k, v, global_qkv)

    for i in range(case.seq):
      (dk, dv, dglobal) = grads_of_output(i, k, v, global_qkv)
      for b, head in itertools.product(range(case.batch), range(case.heads)):
        local, with_global_proj = expected_keys(case, am, gm, b, i, head)
        # d out[b, i, head] / d x[b', j, head'] -> which j are touched, for this (b, head) only.
        touched = lambda g: {j for j in range(case.seq) if np.any(np.asarray(g)[b, head, :, j])}
        # d out / d v_j is p_ij * probe: non-zero exactly on the attended set. d out / d k_j is
        # p_ij (v_j - out_i) . probe q_i: zero up to rounding when i attends one key (out_i = v_j).
        assert touched(dv) == local, (b, i, head)
        assert touched(dk) <= local and (len(local) < 2 or touched(dk) == local), (b, i, head)
        if dglobal is not None:
          _, dk_g, dv_g = dglobal
          assert touched(dv_g) == with_global_proj, (b, i, head)
          assert touched(dk_g) <= with_global_proj
          assert len(with_global_proj) < 2 or touched(dk_g) == with_global_proj
        # Nothing crosses batch rows or heads.
        other = np.asarray(dv)[b, head].copy()
        other[b, :, head] = 0
        assert not np.any(other)

  # --------------------------------------------------------------------------- batch split

  def test_batch_split_invariance(self):
    case = Case(batch=4, seq=41, heads=2, window=3, dilation=(1, 2), padding=True, max_globals=4)
    (q, k, v), kwargs = make_inputs(case, seed=11)
    q_g, k_g, v_g = kwargs.pop("global_qkv")
    am, gm = kwargs.pop("attention_mask"), kwargs.pop("global_mask")
    assert len({int(n) for n in gm.sum(1)}) > 1  # different global counts per row
    whole = self.attention(q, k, v, attention_mask=am, global_mask=gm, global_qkv=(q_g, k_g, v_g),
                           **kwargs)
    for b in range(case.batch):
      row = lambda x: x[b:b + 1]
      alone = self.attention(row(q), row(k), row(v), attention_mask=row(am), global_mask=row(gm),
                             global_qkv=(row(q_g), row(k_g), row(v_g)), **kwargs)
      np.testing.assert_allclose(whole[b:b + 1], alone, atol=1e-6, rtol=1e-6)

  # --------------------------------------------------------------------------- dtypes

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  @pytest.mark.parametrize("causal", [False, True])
  def test_low_precision_close_to_float32_reference(self, dtype, causal):
    case = Case(batch=2, seq=70, heads=2, window=9, dilation=(1, 2), causal=causal,
                padding=True, max_globals=0 if causal else 2, head_dim=16)
    (q, k, v), kwargs = make_inputs(case, seed=5, dtype=dtype)
    f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
    out = self.attention(q, k, v, **kwargs)
    assert out.dtype == dtype
    ref_kwargs = {**kwargs, "global_qkv": f32(kwargs.get("global_qkv"))}
    ref = ops.longformer_attention(*f32((q, k, v)), impl="reference", **ref_kwargs)
    tol = tolerance(dtype, TOLERANCE_VS_FLOAT32)
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=tol, rtol=tol)
    grads = jax.grad(lambda q, k, v: self.attention(q, k, v, **kwargs).astype(jnp.float32).sum(),
                     argnums=(0, 1, 2))(q, k, v)
    assert all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in grads)

  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
  def test_fully_masked_rows_are_zero_with_finite_gradients(self, dtype):
    case = Case(batch=2, seq=20, heads=2, window=3, max_globals=2)
    (q, k, v), kwargs = make_inputs(case, seed=2, dtype=dtype)
    kwargs["attention_mask"] = kwargs["attention_mask"].at[1].set(False)  # a row of padding only
    global_qkv = kwargs.pop("global_qkv")

    def loss(q, k, v, global_qkv):
      out = self.attention(q, k, v, global_qkv=global_qkv, **kwargs)
      return out.astype(jnp.float32).sum(), out

    grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, global_qkv)
    assert not jnp.any(out[1])
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    for g in jax.tree.leaves(grads):
      assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32))))
      assert not jnp.any(g[1])  # padding contributes no gradient

  # --------------------------------------------------------------------------- transformations

  def test_jit_vmap_and_checkpoint(self):
    case = Case(batch=2, seq=33, heads=2, window=4, padding=True, max_globals=2)
    (q, k, v), kwargs = make_inputs(case, seed=3)
    eager = self.attention(q, k, v, **kwargs)
    # Under jit the mask is traced, so the static bound on global tokens is passed.
    kw_traced = {k_: v_ for k_, v_ in kwargs.items() if k_ not in ("window", "dilation", "causal")}
    static = {k_: kwargs[k_] for k_ in ("window", "dilation", "causal")}
    run = jax.jit(lambda q, k, v, kw: self.attention(q, k, v, max_global=2, **static, **kw))
    np.testing.assert_allclose(run(q, k, v, kw_traced), eager, atol=1e-6)
    # vmap over a leading axis: every mapped slice equals its own eager call.
    stacked = jax.tree.map(lambda x: jnp.stack([x, x[::-1]]), (q, k, v, kw_traced))
    mapped = jax.vmap(lambda q, k, v, kw: self.attention(q, k, v, max_global=2, **static, **kw))(
        *stacked)
    np.testing.assert_allclose(mapped[0], eager, atol=1e-6)
    flipped = jax.tree.map(lambda x: x[::-1], kw_traced)
    np.testing.assert_allclose(
        mapped[1], self.attention(q[::-1], k[::-1], v[::-1], **static, **flipped), atol=1e-6)
    # Rematerialised gradients equal plain ones.
    loss = lambda q: self.attention(q, k, v, **kwargs).sum()
    np.testing.assert_allclose(jax.grad(jax.checkpoint(loss))(q), jax.grad(loss)(q), atol=1e-6)

  # --------------------------------------------------------------------------- bad values

  @pytest.mark.parametrize("case", PADDED_CASES, ids=str)
  def test_padded_positions_never_reach_real_rows(self, case):
    check_padded_positions_never_reach_real_rows(self.IMPL, case)

  @pytest.mark.parametrize("max_global", [0, 1])
  def test_too_few_global_slots_under_jit_poisons_the_row(self, max_global):
    check_too_few_global_slots_poison_the_row(self.IMPL, max_global)


# ------------------------------------------------------------------------ bad values, every impl
# The bodies of the class's bad-value tests, also run for the dense reference below.

def check_padded_positions_never_reach_real_rows(impl, case):
  """NaN, inf or a huge value written into the padded positions of q, k, v (and of the global
  projections) change no output and no gradient: the op computes exactly what it computes on
  the clean inputs, padded-query outputs stay zero."""
  (q, k, v), kwargs = make_inputs(case, seed=seed_of(case))
  inputs = (q, k, v, kwargs.pop("global_qkv", None))
  padded_BxN = ~kwargs["attention_mask"]
  assert bool(jnp.any(padded_BxN)) and not bool(jnp.all(padded_BxN))
  cotangent = jax.random.normal(jax.random.key(2), q.shape)

  @jax.jit
  @functools.partial(jax.grad, argnums=(0, 1, 2, 3), has_aux=True)
  def grad_fn(q, k, v, global_qkv):
    out = ops.longformer_attention(q, k, v, global_qkv=global_qkv, impl=impl, **kwargs)
    return jnp.sum(out * cotangent), out

  grads_clean, out_clean = grad_fn(*inputs)
  assert not jnp.any(out_clean[padded_BxN])
  for value in (jnp.nan, jnp.inf, -jnp.inf, 1e30):
    poison = lambda x: jnp.where(padded_BxN[:, :, None, None], value, x)
    grads, out = grad_fn(*jax.tree.map(poison, inputs))
    np.testing.assert_array_equal(out, out_clean, err_msg=f"out, padding = {value}")
    for g, g_clean in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_clean)):
      np.testing.assert_array_equal(g, g_clean, err_msg=f"gradient, padding = {value}")


def check_too_few_global_slots_poison_the_row(impl, max_global):
  """Under jit, a row with more global tokens than `max_global` (0 included) is NaN at its real
  positions (padding queries stay zero); the other rows are the op's result. With a concrete
  mask the same bound is a ValueError naming the counts."""
  case = Case(batch=3, seq=16, heads=2, window=2, dilation=(1, 2))
  (q, k, v), kwargs = make_inputs(case, seed=4)
  am = jnp.arange(case.seq)[None, :] < jnp.array([[16], [16], [11]])
  gm = jnp.zeros((3, case.seq), bool).at[0, jnp.array([1, 9])].set(True).at[2, 5].set(True)
  gqkv = tuple(jax.random.normal(jax.random.key(s), q.shape) for s in range(3))
  kwargs.update(attention_mask=am, global_qkv=gqkv, impl=impl)
  out = jax.jit(lambda gm: ops.longformer_attention(q, k, v, global_mask=gm,
                                                     max_global=max_global, **kwargs))(gm)
  poisoned_B = np.asarray(gm.sum(1)) > max_global
  assert poisoned_B.tolist() == [True, False, max_global == 0]
  real = np.asarray(am)
  for b in range(case.batch):
    if poisoned_B[b]:
      assert bool(jnp.all(jnp.isnan(out[b, real[b]]))), b
      assert not jnp.any(out[b, ~real[b]]), b
    else:
      eager = ops.longformer_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                       **{**kwargs, "attention_mask": am[b:b + 1],
                                          "global_mask": gm[b:b + 1],
                                          "global_qkv": tuple(x[b:b + 1] for x in gqkv)})
      np.testing.assert_allclose(out[b:b + 1], eager, atol=1e-6, rtol=1e-6)
  with pytest.raises(ValueError, match=f"2 global tokens in a row; max_global={max_global}"):
    ops.longformer_attention(q, k, v, global_mask=gm, max_global=max_global, **kwargs)


@pytest.mark.parametrize("case", PADDED_CASES, ids=str)
def test_reference_padded_positions_never_reach_real_rows(case):
  check_padded_positions_never_reach_real_rows("reference", case)


@pytest.mark.parametrize("max_global", [0, 1])
def test_reference_too_few_global_slots_under_jit_poisons_the_row(max_global):
  check_too_few_global_slots_poison_the_row("reference", max_global)


# ------------------------------------------------------------------------ independent of impl


def test_chunked_never_materialises_seq_by_seq():
  """Every intermediate of fwd+bwd at seq 2048 is far smaller than seq^2 elements."""
  seq = 2048
  q = jnp.ones((1, seq, 1, 8))
  gm = jnp.zeros((1, seq), bool).at[0, 0].set(True)

  def loss(q):
    return ops.longformer_attention(q, q, q, window=4, dilation=1, global_mask=gm,
                                    global_qkv=(q, q, q), impl="chunked").sum()

  jaxpr = jax.make_jaxpr(jax.grad(loss))(q)
  sizes = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      sizes.extend(int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape"))
      for param in eqn.params.values():  # pjit / remat / custom_vjp bodies
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            walk(sub)

  walk(jaxpr.jaxpr)
  assert max(sizes) < seq * seq // 16, max(sizes)


def test_grid_seeds_are_stable_across_processes():
  """The parity grid's inputs come from `seed_of(case)`, a crc32 of the case id: the same in
  every process and Python (unlike the salted `hash()`), so a failing case reruns identically."""
  case = GRID[0]
  assert str(case) == ("batch2-seq24-heads3-window1-dilation1-causalFalse-paddingTrue-"
                       "max_globals3-head_dim8")
  assert seed_of(case) == zlib.crc32(str(case).encode()) == 3269934452  # golden
  assert seed_of("a", 1) == zlib.crc32(b"a/1")
  assert len({str(case) for case in GRID}) == len(GRID)  # ids (and seeds) are distinct
  assert len({seed_of(case) for case in GRID}) == len(GRID)


def test_auto_picks_chunked_on_cpu():
  q = jnp.ones((1, 8, 1, 4))
  assert ops.resolve_impl("auto", q, 2) == "chunked"


def _inputs(shape=(2, 10, 3, 4)):
  x = jnp.ones(shape)
  return x, x, x


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(window=0), ValueError, "window=0"),
    (dict(window=2.5), TypeError, "window=2.5"),
    (dict(window=2, dilation=0), ValueError, "dilation"),
    (dict(window=2, dilation=(1, 2)), ValueError, r"dilation=\(1, 2\) has 2 entries.*\(3\)"),
    (dict(window=2, causal="yes"), TypeError, "causal"),
    (dict(window=2, attention_mask=jnp.ones((2, 9))), ValueError, r"attention_mask.*\(2, 9\)"),
    (dict(window=2, global_mask=jnp.ones((10,))), ValueError, "global_mask"),
    (dict(window=2, global_mask=jnp.ones((2, 10))), ValueError, "global_qkv=None"),
    (dict(window=2, causal=True, global_mask=jnp.ones((2, 10)), global_qkv=_inputs()),
     ValueError, "causal=True with global tokens"),
    (dict(window=2, global_mask=jnp.ones((2, 10)), global_qkv=_inputs((2, 10, 3, 5))),
     ValueError, "q_g has shape"),
    (dict(window=2, impl="fast"), ValueError, "impl='fast'"),
])
def test_bad_arguments_are_named(kwargs, error, match):
  with pytest.raises(error, match=match):
    ops.longformer_attention(*_inputs(), **kwargs)


def test_mismatched_shapes_and_dtypes_are_named():
  q = jnp.ones((2, 10, 3, 4))
  with pytest.raises(ValueError, match=r"k has shape \(2, 11, 3, 4\)"):
    ops.longformer_attention(q, jnp.ones((2, 11, 3, 4)), q, window=1)
  with pytest.raises(ValueError, match=r"q has shape \(10, 3, 4\)"):
    ops.longformer_attention(q[0], q[0], q[0], window=1)
  with pytest.raises(TypeError, match="int32"):
    ops.longformer_attention(q.astype(jnp.int32), q, q, window=1)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_masks_hold_0_and_1_and_nonzero_counts_as_1_under_jit(impl):
  """A concrete mask (NumPy or jax.Array, either mask) with another value than 0 and 1 is a
  ValueError naming the value and its position; under jit the values are not known (nor read:
  no host sync), and the op reads any nonzero value as 1, in every implementation."""
  q = jax.random.normal(jax.random.key(0), (2, 8, 2, 4))
  gqkv = (q, q, q)
  ones = np.ones((2, 8), np.float32)
  ones[1, 6:] = 0
  for name, value in (("attention_mask", 0.5), ("attention_mask", 2.0),
                      ("attention_mask", np.nan), ("global_mask", 2.0)):
    mask = ones.copy()
    mask[1, 3] = value
    given = {"attention_mask": ones, "global_mask": np.zeros_like(ones), name: mask}
    for array in (np.asarray, jnp.asarray):
      with pytest.raises(ValueError, match=rf"{name} holds {value!r} at \(1, 3\); expected 0 "
                                           rf"or 1 \(or bool\)"):
        ops.longformer_attention(q, q, q, window=2, impl=impl, global_qkv=gqkv,
                                 **{k: array(m) for k, m in given.items()})
  ops.longformer_attention(q, q, q, window=2, impl=impl, attention_mask=ones.astype(bool))
  run = jax.jit(lambda am, gm: ops.longformer_attention(
      q, q, q, window=2, impl=impl, attention_mask=am, global_mask=gm, global_qkv=gqkv,
      max_global=1))
  odd_am, odd_gm = ones * np.array([1, 2, 0.5, 1, 3, 1, 1, 1], np.float32), np.zeros_like(ones)
  odd_gm[0, 1] = 2.0
  np.testing.assert_array_equal(run(odd_am, odd_gm), run(ones, (odd_gm != 0).astype(np.float32)))


def test_traced_global_mask_needs_max_global():
  q = jnp.ones((1, 6, 1, 4))
  f = jax.jit(lambda gm: ops.longformer_attention(q, q, q, window=1, global_mask=gm,
                                                   global_qkv=(q, q, q)))
  with pytest.raises(ValueError, match="max_global"):
    f(jnp.ones((1, 6), bool))


# ----------------------------------------------------------------------------------------------
# The op at its edges (docs/design.md §1.1-1.2): the same answer from every implementation.

EVERY_IMPL = ["reference", "chunked", pytest.param("pallas", marks=pytest.mark.kernels)]


@pytest.mark.parametrize("impl", EVERY_IMPL)
@pytest.mark.parametrize("shape", [(0, 16, 2, 8), (1, 0, 2, 8), (1, 16, 0, 8), (1, 16, 2, 0)],
                         ids=["batch0", "seq0", "heads0", "head_dim0"])
def test_inputs_with_no_element_give_an_empty_output(impl, shape):
  """An empty batch, sequence, no heads or head_dim 0: an empty output of q's shape and dtype
  (and empty gradients), with masks and global tokens given, in every implementation and the
  reference function; the argument checks still run first."""
  q = jnp.ones(shape, jnp.bfloat16)
  masks = dict(attention_mask=np.ones(shape[:2], bool), global_mask=np.zeros(shape[:2], bool),
               global_qkv=(q, q, q))

  def loss(q, k, v):
    out = ops.longformer_attention(q, k, v, window=2, dilation=2, impl=impl, **masks)
    assert out.shape == shape and out.dtype == jnp.bfloat16
    return jnp.sum(out.astype(jnp.float32))

  grads = jax.grad(loss, argnums=(0, 1, 2))(q, q, q)
  assert [g.shape for g in grads] == [shape] * 3
  out = ops.longformer_attention_reference(q, q, q, window=2, **masks)
  assert out.shape == shape and out.dtype == jnp.bfloat16
  with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 3\)"):
    ops.longformer_attention(q, q, q, window=2, impl=impl, attention_mask=np.ones((3, 3)))


def _compiled_temp_bytes(f, *args) -> int:
  return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("impl", EVERY_IMPL)
@pytest.mark.parametrize("kwargs", [dict(window=2, dilation=(1, 10**6)),
                                    dict(window=3, dilation=(10**6, 2), causal=True),
                                    dict(window=2**31 - 1, dilation=2**31 - 1)], ids=str)
def test_a_dilation_beyond_the_sequence_allocates_by_the_sequence(impl, kwargs):
  """A head whose dilation is the sequence length or more attends the query alone (its output is
  v at the query), and no implementation allocates by the raw value: compiled, the whole op's
  temporaries stay under 16 MiB (before, the Pallas path asked for 86 GB here, and the chunked
  one 137 GB with dilation 2^31 - 1)."""
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 16, 2, 8)), jnp.float32) for _ in range(3))
  mask = np.ones((2, 16), bool)
  mask[1, 12:] = False
  run = lambda q, k, v: ops.longformer_attention(q, k, v, attention_mask=mask, impl=impl,
                                                 **kwargs)
  assert _compiled_temp_bytes(run, q, k, v) < 16 * 2**20
  out = run(q, k, v)
  dilations = kwargs["dilation"] if isinstance(kwargs["dilation"], tuple) else (
      kwargs["dilation"],) * 2
  for h, d in enumerate(dilations):
    if d >= 16:
      expected = jnp.where(mask[:, :, None], v[:, :, h], 0)
      np.testing.assert_allclose(out[:, :, h], expected, rtol=1e-6, atol=1e-6)
  same = dict(kwargs, dilation=tuple(min(d, 16) for d in dilations))
  np.testing.assert_allclose(out, ops.longformer_attention(q, k, v, attention_mask=mask,
                                                           impl="reference", **same),
                             rtol=1e-5, atol=1e-5)


def test_pallas_refuses_dilations_whose_lcm_exceeds_the_sequence_and_auto_falls_back():
  """The Pallas layout pads the sequence to a multiple of lcm(dilations): 7 and 11 at 16 tokens
  would pad it to a multiple of block x 77 rows. impl="pallas" refuses them before any work,
  and "auto" on a kernel platform then takes the chunked path."""
  q = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"dilation=\(7, 11\).*lcm.*77.*impl='chunked'"):
    ops.longformer_attention(q, q, q, window=2, dilation=(7, 11), impl="pallas")
  assert ops.resolve_impl("auto", q, 2, "tpu") == "pallas"
  assert ops.resolve_impl("auto", q, 2, "tpu", dilation=(7, 11)) == "chunked"
  assert ops.resolve_impl("auto", q, 2, "tpu", dilation=(10**6, 16)) == "pallas"  # capped: 16


@pytest.mark.parametrize("impl", EVERY_IMPL + ["auto"])
def test_mixed_input_dtypes_are_one_type_error_in_every_impl(impl):
  """q, k, v and the global projections share one floating dtype, whatever the implementation
  (before, chunked and reference took q float32 with k bfloat16 and Pallas refused it, so
  impl="auto" took it on a CPU and not on a GPU or TPU)."""
  q = jnp.ones((1, 16, 2, 8), jnp.float32)
  half = q.astype(jnp.bfloat16)
  with pytest.raises(TypeError, match="k has dtype bfloat16 and q float32.*one floating dtype"):
    ops.longformer_attention(q, half, q, window=2, impl=impl)
  with pytest.raises(TypeError, match="global_qkv v_g has dtype bfloat16 and q float32"):
    ops.longformer_attention(q, q, q, window=2, impl=impl, global_mask=np.eye(1, 16),
                             global_qkv=(q, q, half))
  with pytest.raises(TypeError, match="k has dtype bfloat16 and q float32"):
    ops.longformer_attention_reference(q, half, q, window=2)


@pytest.mark.parametrize("impl", EVERY_IMPL)
def test_a_python_list_is_a_short_type_error_naming_the_argument(impl):
  """Before, jax's own TypeError printed the whole list."""
  q = jnp.ones((1, 16, 2, 8))
  big = np.ones((1, 16, 2, 8)).tolist()
  for args, name in (((big, q, q), "q"), ((q, q, big), "v")):
    with pytest.raises(TypeError, match=rf"^{name} is a list; expected an array") as error:
      ops.longformer_attention(*args, window=2, impl=impl)
    assert len(str(error.value)) < 120
  with pytest.raises(TypeError, match=r"^global_qkv k_g is a list; expected an array"):
    ops.longformer_attention(q, q, q, window=2, impl=impl, global_mask=np.eye(1, 16),
                             global_qkv=(q, big, q))


@pytest.mark.kernels
@pytest.mark.slow
class TestPallas(TestChunked):
  """The whole suite rerun with the Pallas band kernel.

  `longformer_attention(impl="pallas")` offers no switch between the compiled kernel and Pallas
  interpret mode: it runs the kernel compiled on GPU/TPU and interpreted on CPU, as
  `jax.default_backend()` dictates (longformer_jax/ops/dispatch.py). So, unlike
  tests/test_band_pallas.py, there is one class, which runs wherever the op runs: on CPU the
  Triton-style kernel in interpret mode, forward and gradients, float32 and 16-bit, with the same
  tolerances as the chunked path."""
  IMPL = "pallas"
