"""Section c: peers checked against ours on the same inputs, then timed. Our outputs and the
cuDNN rows come from a child process (`peers_jax_phase`) that ends before the torch peers start,
each in a child process of its own (`torch_child`, no JAX there), so that they get the GPU's
memory.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

from .common import (GPU_SIZES, GRACE_S, SCRIPT, TINY_SIZES, Recorder, Sizes, compare_outputs,
                     compared_rows, compile_aot, digest_jax, digest_torch, hashed_jax,
                     hashed_torch, jax_backend, peer_tolerance, run_child, torch_child_env)


def section_peers(rec: Recorder, sizes: Sizes, args) -> None:
  data_dir = pathlib.Path(tempfile.mkdtemp(prefix="gpu_suite_peers_"))
  try:
    # 1-2. Our outputs and the cuDNN rows in a child process of their own: JAX keeps the GPU
    # memory it took until its process ends. On an 80 GB H100 it held 16.5 GiB while the torch
    # peers ran, and HF's backward at 64k x 8 ran out of memory (12 GiB asked, 8.9 free).
    spec_path = data_dir / "jax_phase.json"
    spec_path.write_text(json.dumps(dict(
        part=str(rec.path), t0=rec.t0, deadline=rec.deadline, tiny=bool(args.tiny),
        inject_peer_fault=bool(args.inject_peer_fault), data_dir=str(data_dir))))
    jax_rc, jax_tail = run_child([sys.executable, str(SCRIPT), "--peers-jax", str(spec_path)],
                                 rec.deadline + GRACE_S / 2, rec.t0, "peers/jax")
    cases_path = data_dir / "cases.json"
    cases = (json.loads(cases_path.read_text()) if cases_path.exists()
             else dict(flex=[], hf=[]))
    # 3. The torch peers, each in its own process, on the cases the JAX phase made.
    heads, head_dim, window = sizes.attn
    gpu = jax_backend() == "gpu"
    common = dict(heads=heads, head_dim=head_dim, window=window, dtype=sizes.dtype,
                  reps=sizes.reps, tolerance=peer_tolerance(sizes.dtype), part=str(rec.path),
                  t0=rec.t0, first_estimate_s=sizes.first_row_estimate_s * (3 if gpu else 1))
    children = (("torch_flex_attention", cases["flex"]),
                ("hf_LongformerSelfAttention", cases["hf"]))
    for index, (peer, peer_cases) in enumerate(children):
      remaining = rec.deadline - time.time()
      # The first child may use at most 60% of what is left, so the second gets a turn.
      deadline = time.time() + (remaining * 0.6 if index == 0 else remaining)
      spec = dict(common, peer=peer, cases=peer_cases, deadline=deadline)
      spec_path = data_dir / f"{peer}.json"
      spec_path.write_text(json.dumps(spec))
      rec.log(f"{peer}: child process, {len(peer_cases)} cases, {deadline - time.time():.0f} s")
      rc, tail = run_child([sys.executable, str(SCRIPT), "--torch-child", str(spec_path)],
                           deadline + GRACE_S / 2, rec.t0, f"peers/{peer}",
                           env=torch_child_env())
      if rc != 0:
        rec.row(kind="peer", peer=peer, status="failed",
                error=f"child process rc={rc}: {tail[-600:]}")
    if jax_rc != 0:
      raise RuntimeError(f"the JAX phase (our outputs, cuDNN) ended with rc={jax_rc}: "
                         f"{jax_tail[-600:]}")
  finally:
    shutil.rmtree(data_dir, ignore_errors=True)


def peers_jax_phase(spec_path: str) -> None:
  """Section c's JAX work, in its own process (`--peers-jax`): our outputs on the peers' inputs
  (pallas), saved on the compared rows for the torch children, and the cuDNN rows. Writes the
  torch children's cases to `cases.json` in the data folder after each one, so a kill keeps the
  cases made."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import harness
  from attention import Shape
  from longformer_jax import ops

  spec = json.loads(pathlib.Path(spec_path).read_text())
  sizes = TINY_SIZES if spec["tiny"] else GPU_SIZES
  rec = Recorder(pathlib.Path(spec["part"]), "c", spec["t0"], spec["deadline"])
  data_dir = pathlib.Path(spec["data_dir"])
  gpu = jax.default_backend() == "gpu"
  heads, head_dim, window = sizes.attn
  dtype = jnp.dtype(sizes.dtype)
  tol = peer_tolerance(sizes.dtype)
  embed = heads * head_dim
  perms = dict(k=(np.arange(embed) * 5 + 3) % embed, v=(np.arange(embed) * 7 + 1) % embed)
  ours = jax.jit(lambda q, k, v, causal: ops.longformer_attention(
      q, k, v, window=window, causal=causal, impl="pallas"), static_argnums=3)
  cases = dict(flex=[], hf=[])
  injected = False
  for seq, batch in sizes.peer_shapes:
    dims = (batch, seq, heads, head_dim)
    rows = compared_rows(seq)
    for mode in ("bidir", "causal"):
      if not rec.fits("expected", sizes.first_row_estimate_s):
        break
      started = time.time()
      q, k, v = (hashed_jax(dims, s, dtype) for s in (1, 2, 3))
      out = ours(q, k, v, mode == "causal")
      expected = np.array(out[:, rows], np.float32)  # a writable copy
      if spec["inject_peer_fault"] and not injected:
        expected[0, 0, 0, 0] += 1.0  # the first flex check must now fail
        injected = True
      path = data_dir / f"flex_{mode}_{seq}x{batch}.npz"
      np.savez(path, rows=rows, expected=expected)
      cases["flex"].append(dict(seq=seq, batch=batch, mode=mode, expected=str(path),
                                digest=digest_jax(q, k, v)))
      # cuDNN (causal only: it has no right window), in this process, on the same inputs.
      what = dict(kind="peer", peer="jax_cudnn_sliding_window", mode=mode, seq=seq,
                  batch=batch, heads=heads, head_dim=head_dim, window=window,
                  dtype=sizes.dtype)
      if not gpu:
        rec.row(status="skipped", reason="skipped: no GPU", **what)
      elif mode == "bidir":
        rec.row(status="skipped", reason="unsupported: cuDNN's sliding window has no right "
                "window (jax raises for right > 0 without is_causal)", **what)
      else:
        cudnn_row(rec, what, q, k, v, out, window, tol, sizes.reps,
                  Shape(seq=seq, batch=batch, heads=heads, head_dim=head_dim, window=window,
                        causal=True))
      if mode == "bidir":  # HF: q, k, v as feature permutations of one hidden state x
        x = q.reshape(batch, seq, embed)
        k_h, v_h = (x[..., perms[n]].reshape(dims) for n in ("k", "v"))
        out_h = ours(q, k_h, v_h, False)
        path = data_dir / f"hf_{seq}x{batch}.npz"
        np.savez(path, rows=rows, expected=np.asarray(out_h[:, rows], np.float32),
                 perm_k=perms["k"], perm_v=perms["v"])
        cases["hf"].append(dict(seq=seq, batch=batch, mode=mode, expected=str(path),
                                digest=digest_jax(q)))
      harness.write_json(data_dir / "cases.json", cases)
      del q, k, v, out
      rec.cost("expected", time.time() - started)


def cudnn_row(rec, what, q, k, v, ours_out, window, tol, reps, shape) -> None:
  import jax
  import jax.numpy as jnp
  from attention import median_ms
  fwd_fn = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, local_window_size=(window, 0), implementation="cudnn")
  grad_fn = jax.grad(lambda q, k, v: jnp.sum(fwd_fn(q, k, v).astype(jnp.float32)),
                     argnums=(0, 1, 2))
  try:
    fwd, _ = compile_aot(fwd_fn, (q, k, v))
    got = fwd(q, k, v).astype(jnp.float32)
    # compare_outputs on the device (the whole output: 64k x 8 would be 3 GB on the host)
    worst = float(jnp.max(jnp.abs(got - ours_out.astype(jnp.float32))))
    limit = tol * max(1.0, float(jnp.max(jnp.abs(ours_out.astype(jnp.float32)))))
    check = dict(max_abs_diff=worst, limit=limit, ok=bool(worst <= limit))
    if not check["ok"]:
      rec.row(status="failed", reason="output differs from ours", **check, **what)
      return
    grad, peak = compile_aot(grad_fn, (q, k, v))
    ms_fwd, ms_fwdbwd = median_ms(fwd, (q, k, v), reps), median_ms(grad, (q, k, v), reps)
    rec.row(status="ok", **check, **what, ms_fwd=ms_fwd, ms_fwdbwd=ms_fwdbwd, peak_bytes=peak,
            tflops_fwdbwd=round(shape.flops_fwdbwd() / (ms_fwdbwd * 1e-3) / 1e12, 3))
    rec.log(f"cuDNN causal {what['seq']} x {what['batch']}: fwd+bwd {ms_fwdbwd:.3f} ms")
  except Exception as e:
    rec.row(status="failed", error=f"{type(e).__name__}: {str(e)[:400]}", **what)


# ---------------------------------------------------------------- the torch child (no JAX here)


def torch_child(spec_path: str) -> None:
  import numpy as np
  import torch
  spec = json.loads(pathlib.Path(spec_path).read_text())
  cuda = torch.cuda.is_available()
  device = "cuda" if cuda else "cpu"
  tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
  rec = Recorder(pathlib.Path(spec["part"]), "c", spec["t0"], spec["deadline"])
  heads, head_dim, window = spec["heads"], spec["head_dim"], spec["window"]

  def sync():
    if cuda:
      torch.cuda.synchronize()

  def median_ms(fn):
    fn()
    sync()
    samples = []
    for _ in range(spec["reps"]):
      start = time.perf_counter()
      fn()
      sync()
      samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)

  for case in spec["cases"]:
    seq, batch, mode = case["seq"], case["batch"], case["mode"]
    what = dict(kind="peer", peer=spec["peer"], mode=mode, seq=seq, batch=batch, heads=heads,
                head_dim=head_dim, window=window, dtype=spec["dtype"], device=device)
    if not rec.fits("case", spec["first_estimate_s"]):
      rec.skipped(**what)
      continue
    started = time.time()
    try:
      data = np.load(case["expected"])
      dims = (batch, seq, heads, head_dim)
      if spec["peer"] == "torch_flex_attention":
        q, k, v = (hashed_torch(dims, s, tdtype, device) for s in (1, 2, 3))
        if digest_torch(q, k, v) != case["digest"]:
          raise AssertionError("torch's inputs are not JAX's (digest mismatch)")
        fwd, train, leaves = flex_peer(torch, q, k, v, window, mode == "causal", device)
      else:
        x = hashed_torch(dims, 1, tdtype, device)
        if digest_torch(x) != case["digest"]:
          raise AssertionError("torch's inputs are not JAX's (digest mismatch)")
        fwd, train, leaves = hf_layer_peer(torch, x.reshape(batch, seq, heads * head_dim), heads,
                                   window, data["perm_k"], data["perm_v"], device, tdtype)
      with torch.no_grad():
        got = fwd().reshape(dims)[:, torch.from_numpy(data["rows"]).to(device)]
      check = compare_outputs(data["expected"], got.float().cpu().numpy(), spec["tolerance"])
      if not check["ok"]:
        rec.row(status="failed", reason="output differs from ours", **check, **what)
        rec.log(f"{spec['peer']} {mode} {seq} x {batch}: FAILED the check, max |diff| "
                f"{check['max_abs_diff']}")
        continue
      row = dict(status="ok", **check, **what)
      with torch.no_grad():
        row["ms_fwd"] = median_ms(fwd)

      def fwd_bwd():
        for leaf in leaves:
          leaf.grad = None
        train().float().sum().backward()
      try:
        row["ms_fwdbwd"] = median_ms(fwd_bwd)
        pairs = (seq * (window + 1) - window * (window + 1) // 2 if mode == "causal"
                 else seq * (2 * window + 1) - window * (window + 1))
        row["tflops_fwdbwd"] = round(14 * pairs * head_dim * heads * batch
                                     / (row["ms_fwdbwd"] * 1e-3) / 1e12, 3)
      except Exception as e:  # e.g. no backward on CPU
        row["fwdbwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"
      if cuda:
        row["peak_bytes"] = int(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
      rec.row(**row)
      rec.log(f"{spec['peer']} {mode} {seq} x {batch}: max |diff| {check['max_abs_diff']:.3g}, "
              f"fwd {row['ms_fwd']:.3f} ms, fwd+bwd {row.get('ms_fwdbwd', 'n/a')} ms")
    except Exception as e:  # e.g. out of memory: recorded
      rec.row(status="failed", error=f"{type(e).__name__}: {str(e)[:400]}", **what)
      rec.log(f"{spec['peer']} {mode} {seq} x {batch} failed: {type(e).__name__}: {str(e)[:200]}")
    finally:
      if cuda:
        torch.cuda.empty_cache()
      rec.cost("case", time.time() - started)


def flex_peer(torch, q, k, v, window, causal, device):
  """flex_attention with a sliding-window block mask on [B, H, N, D] (compiled on CUDA)."""
  import harness
  mask, flex = harness.flex_sliding_window(torch, q.shape[1], window, causal=causal,
                                           device=device, compile_attention=device == "cuda")
  plain = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
  # Inputs that require grad only for the training call: on CPU, flex_attention refuses them
  # (it has no CPU backward) even under no_grad.
  leaves = [x.clone().requires_grad_(True) for x in plain]
  return ((lambda: flex(*plain, block_mask=mask).transpose(1, 2)),
          (lambda: flex(*leaves, block_mask=mask).transpose(1, 2)), leaves)


def hf_layer_peer(torch, x, heads, window, perm_k, perm_v, device, tdtype):
  """HF's LongformerSelfAttention (no dropout) with its query projection the identity and its
  key/value projections feature permutations (exact in any dtype), on hidden states x."""
  import numpy as np
  from transformers import LongformerConfig
  from transformers.models.longformer.modeling_longformer import LongformerSelfAttention
  batch, seq, embed = x.shape
  cfg = LongformerConfig(hidden_size=embed, num_attention_heads=heads,
                         attention_window=[2 * window], num_hidden_layers=1,
                         attention_probs_dropout_prob=0.0)
  layer = LongformerSelfAttention(cfg, layer_id=0).to(device=device, dtype=tdtype)
  with torch.no_grad():
    for linear, perm in ((layer.query, np.arange(embed)), (layer.key, perm_k),
                         (layer.value, perm_v)):
      weight = torch.zeros(embed, embed, device=device, dtype=tdtype)
      weight[torch.arange(embed), torch.as_tensor(perm, device=device)] = 1
      linear.weight.copy_(weight)
      linear.bias.zero_()
  mask = torch.zeros(batch, seq, device=device, dtype=tdtype)  # HF: 0 = local attention
  is_masked, is_global = mask < 0, mask > 0
  leaf = x.detach().clone().requires_grad_(True)
  call = lambda: layer(leaf, attention_mask=mask, is_index_masked=is_masked,
                       is_index_global_attn=is_global, is_global_attn=False)[0]
  return call, call, [leaf]
