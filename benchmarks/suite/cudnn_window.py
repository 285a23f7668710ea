"""Section d: cuDNN's sliding window against exact references: call forms, window semantics, the
smallest diverging length, gradients, and a verdict.
"""

from __future__ import annotations

import itertools
import time

from .common import CUDNN_BAD, Recorder, Sizes, errors_of, hashed_jax


def window_candidates(window: int) -> dict:
  """Window semantics a sliding-window kernel might implement: (lo, hi) bounds on key - query
  (None: unbounded)."""
  return {"ours: causal band [i-w, i]": (-window, 0),
          "one key fewer: [i-w+1, i]": (-window + 1, 0),
          "one key more: [i-w-1, i]": (-window - 1, 0),
          "left bound only: [i-w, n)": (-window, None),
          "full causal: [0, i]": (None, 0),
          "bidirectional band: [i-w, i+w]": (-window, window)}


def dense_reference(q, k, v, lo, hi):
  """float32 attention of q, k, v with key - query in [lo, hi] (None: unbounded), dense."""
  import jax
  import jax.numpy as jnp
  n = q.shape[1]
  offset = jnp.arange(n)[None, :] - jnp.arange(n)[:, None]
  keep = jnp.ones((n, n), bool)
  if lo is not None:
    keep &= offset >= lo
  if hi is not None:
    keep &= offset <= hi
  with jax.default_matmul_precision("float32"):
    return jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                        mask=keep[None, None], implementation="xla")


def bisect_divergence(probe, good: int, bad: int, granularity: int):
  """Smallest multiple of `granularity` in (good, bad] at which probe(n) is False (diverges),
  given probe(good) True and probe(bad) False; `probe` is called O(log) times. Returns
  (n, [(n, ok), ...] probed)."""
  if not good < bad:
    raise ValueError(f"need good < bad, got good={good}, bad={bad}")
  if granularity < 1:
    raise ValueError(f"granularity={granularity} must be >= 1")
  probed = []
  lo, hi = good // granularity, -(-bad // granularity)  # in units of granularity
  while hi - lo > 1:
    mid = (lo + hi) // 2
    ok = probe(mid * granularity)
    probed.append((mid * granularity, ok))
    lo, hi = (mid, hi) if ok else (lo, mid)
  return min(hi * granularity, bad), probed


def cudnn_verdict(reproduce: dict, semantics: dict, divergence: dict, window: int) -> str:
  """One paragraph from the rows of section d (pure: unit-tested)."""
  lines = []
  for form, rep in reproduce.items():
    if rep.get("error"):
      lines.append(f"{form}: could not run ({rep['error'][:120]}).")
      continue
    match = semantics.get(form) or []
    ours = "ours: causal band [i-w, i]"
    head = f"{form}: max |diff| {rep['max_abs_diff']:.3g} at n={rep['seq']}"
    if match and ours not in match:
      lines.append(f"{head}. SEMANTIC difference: at short lengths it matches {match} (w={window}),"
                   " not our causal band, at every length.")
    elif not match:
      lines.append(f"{head}. At short lengths it matches none of the candidate windows.")
    elif rep["agrees"]:
      lines.append(f"{head}: agrees with our causal band at short and long lengths.")
    else:
      div = divergence.get(form) or {}
      n = div.get("first_bad_seq")
      if n is None:
        lines.append(f"{head}: matches our band when short, diverges when long (smallest "
                     "diverging length not found within the budget).")
        continue
      row = div.get("first_bad_row")
      facts = [f"n*n = {n * n:,} ({n * n / 2**31:.3f} x 2^31)"]
      if row is not None and row >= 0:
        facts.append(f"first wrong row {row} (row x n = {row * n / 2**31:.3f} x 2^31)")
      overflow = (n * n >= 2**31 > (n - div.get("granularity", 1)) ** 2
                  or (row is not None and row > 0 and row * n >= 2**31 > (row - 1) * n))
      lines.append(f"{head}: matches our causal band when short, first diverges at n = {n} "
                   f"({'; '.join(facts)}). A cuDNN FAULT, not a window semantic"
                   + (", consistent with int32 overflow of an n*n or row*n index." if overflow
                      else "."))
  return " ".join(lines)


def section_cudnn(rec: Recorder, sizes: Sizes, args) -> None:
  import jax
  import jax.numpy as jnp
  from cudnn_window_repro import blockwise_reference, cudnn_sliding

  gpu = jax.default_backend() == "gpu"
  implementation = "cudnn" if gpu else "xla"
  if not gpu:
    rec.note(skip_reason="skipped: no GPU (cuDNN). XLA stands in so that the code runs; its "
                         "numbers say nothing about cuDNN", stand_in="xla")
  heads, head_dim, window = sizes.attn
  forms = {"is_causal=True, local_window_size=(w, 0)": True,
           "local_window_size=(w, 0) without is_causal (as attention.py called it)": False}
  dtype = jnp.bfloat16 if gpu else jnp.float32

  def inputs(seq, batch=1, nheads=heads):
    return [hashed_jax((batch, seq, nheads, head_dim), s, dtype) for s in (11, 12, 13)]

  run_cudnn = jax.jit(cudnn_sliding, static_argnums=(3, 4, 5))
  run_ref = jax.jit(blockwise_reference, static_argnums=(3, 4))

  def probe(seq, is_causal, batch=1, nheads=heads, lo=-window, hi=0):
    """Row errors of the cuDNN call against the exact band [lo, hi] on the same inputs."""
    q, k, v = inputs(seq, batch, nheads)
    got = run_cudnn(q, k, v, window, is_causal, implementation).astype(jnp.float32)
    want = run_ref(q, k, v, -lo, hi)
    row_err = jnp.max(jnp.abs(got - want), axis=(0, 2, 3))
    bad = jnp.nonzero(row_err > CUDNN_BAD, size=1, fill_value=-1)[0][0]
    return dict(seq=seq, batch=batch, heads=nheads, max_abs_diff=float(row_err.max()),
                first_bad_row=int(bad), bad_rows=int(jnp.sum(row_err > CUDNN_BAD)),
                agrees=bool(row_err.max() <= CUDNN_BAD), implementation=implementation)

  def guarded(kind, fn, **what):
    if not rec.fits(kind, sizes.first_row_estimate_s):
      rec.skipped(kind=kind, **what)
      return None
    started = time.time()
    try:
      result = fn()
      rec.row(kind=kind, status="ok", **what, **result)
      return result
    except Exception as e:
      rec.row(kind=kind, status="failed", error=f"{type(e).__name__}: {str(e)[:400]}", **what)
      return dict(error=f"{type(e).__name__}: {str(e)[:400]}")
    finally:
      rec.cost(kind, time.time() - started)

  # 1. The reported observation, both call forms, at the long length.
  reproduce = {}
  for form, is_causal in forms.items():
    result = guarded("reproduce", lambda: probe(sizes.cudnn_long, is_causal), form=form)
    if result is not None:
      reproduce[form] = result
      if "error" not in result:
        rec.log(f"{form} at {sizes.cudnn_long}: max |diff| {result['max_abs_diff']:.4g}, "
                f"first bad row {result['first_bad_row']}")
  # 2. Window semantics at short lengths: which dense masked reference does each form match?
  semantics = {}
  # A small window too: there one key more or fewer moves the output far past bf16 rounding.
  for seq, w in itertools.product(sizes.cudnn_short, (window // 16, window)):
    q, k, v = inputs(seq)
    refs = {name: dense_reference(q, k, v, lo, hi)
            for name, (lo, hi) in window_candidates(w).items()}
    for form, is_causal in forms.items():
      def run(is_causal=is_causal):
        got = run_cudnn(q, k, v, w, is_causal, implementation).astype(jnp.float32)
        diffs = {name: float(jnp.max(jnp.abs(got - ref))) for name, ref in refs.items()}
        return dict(seq=seq, window=w, diffs=diffs,
                    matches=[name for name, d in diffs.items() if d <= CUDNN_BAD])
      result = guarded("semantics", run, form=form)
      if result and "matches" in result:
        previous = semantics.get(form)
        semantics[form] = (result["matches"] if previous is None
                           else [m for m in previous if m in result["matches"]])
        rec.log(f"semantics n={seq} w={w} {form}: matches {result['matches']}")
  # 3. Smallest diverging length of a form that is right when short and wrong when long.
  divergence = {}
  for form, is_causal in forms.items():
    rep = reproduce.get(form) or {}
    if rep.get("agrees", True) or "ours: causal band [i-w, i]" not in semantics.get(form, []):
      continue
    good, bad, first_row = max(sizes.cudnn_short), None, None
    for seq in sizes.cudnn_pow2:
      result = guarded("bisect", lambda: probe(seq, is_causal), form=form, stage="power of two")
      if result is None or "error" in result:
        break
      if result["agrees"]:
        good = seq
      else:
        bad, first_row = seq, result["first_bad_row"]
        break
    div = dict(granularity=sizes.cudnn_granularity, last_good_seq=good, first_bad_seq=bad,
               first_bad_row=first_row)
    if bad is not None and bad - good > sizes.cudnn_granularity:
      def check(seq):
        result = guarded("bisect", lambda: probe(seq, is_causal), form=form, stage="bisection")
        if result is None or "error" in result:
          raise TimeoutError("bisection cut by the budget")
        if not result["agrees"]:
          div["first_bad_row"] = result["first_bad_row"]
        return result["agrees"]
      try:
        # first_bad_row stays that of the last failing probe: the returned length itself.
        div["first_bad_seq"], _ = bisect_divergence(check, good, bad, sizes.cudnn_granularity)
      except TimeoutError:
        div["first_bad_seq"] = None
    divergence[form] = div
    rec.note(divergence={form: div})
    if div["first_bad_seq"]:
      n = div["first_bad_seq"]
      guarded("probe", lambda: probe(n, is_causal, 1, 1), form=form,
              question="1 head, batch 1 at the smallest diverging n: does it depend on heads?")
      guarded("probe", lambda: probe(div["last_good_seq"], is_causal, 8), form=form,
              question="batch 8 at the last good n: does it depend on the batch?")
  # 4. Gradients of the form that should be right, at a length where it agrees.
  def grads():
    q, k, v = inputs(sizes.cudnn_grad_seq)
    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)))
    got = jax.grad(loss(lambda q, k, v: cudnn_sliding(q, k, v, window, True, implementation)),
                   argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: blockwise_reference(q, k, v, window)),
                    argnums=(0, 1, 2))(q, k, v)
    errors = errors_of(dict(zip(("dq", "dk", "dv"), got)), dict(zip(("dq", "dk", "dv"), want)))
    return dict(seq=sizes.cudnn_grad_seq, errors=errors,
                agrees=all(e <= 5e-2 for e in errors.values()))
  guarded("grad_check", grads, form="is_causal=True, local_window_size=(w, 0)")
  verdict = cudnn_verdict(reproduce, semantics, divergence, window)
  rec.note(verdict=("[stand-in: XLA, no GPU] " if not gpu else "") + verdict,
           semantics=semantics)
  rec.log(f"verdict: {verdict}")
