"""Sampling from the char LM (`longformer_jax.generation`, `LongformerForCausalLM.generate`) and
`python -m eval.sample`.

The reference for every decoded token is the full model run again on the whole prefix: greedy
tokens equal its argmax and the cache's logits equal its last-position logits at every step, on
a model whose layers have different windows and dilated heads, with prompts longer and shorter
than the caches and enough new tokens to wrap every ring buffer several times.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longformer_jax import checkpoint, generation
from longformer_jax.causal_lm import LongformerForCausalLM
from longformer_jax.config import CharLMConfig
from longformer_jax.generation import SamplingConfig
from longformer_jax.training import read_run_config
from testing import assert_close, seed_of, tolerance

# slow: in-process, but most of the cost is training runs, command lines and subprocesses.
pytestmark = [pytest.mark.unit, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]

# Windows 2, 3, 5 and dilations up to 4: ring buffers of K = 3, 10 and 21 slots. A large
# initializer_range spreads the logits, so that greedy choices are not near-ties. The dense
# reference implementation of the band op compiles 4x faster than the chunked one on CPU (the
# band ops agree, tests/test_attention.py); `test_greedy_equals_full_recomputation` also runs
# the default implementation.
CONFIG = CharLMConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=4,
                      intermediate_size=64, attention_window=(2, 3, 5),
                      attention_dilation=((1, 1, 1, 1), (1, 2, 1, 3), (2, 2, 1, 4)),
                      initializer_range=0.5, attention_impl="reference")
CACHE_LENS = (3, 10, 21)
# Every recomputation runs on [ROWS, LENGTH] (one compile per model): N prefixes of B rows.
ROWS, LENGTH = 128, 96


@functools.cache
def _model(cfg=CONFIG):
  return LongformerForCausalLM(cfg, rngs=nnx.Rngs(0))


def _prompt(batch, length, name="prompt"):
  return np.random.default_rng(seed_of(name, batch, length)).integers(0, 256, (batch, length))


@functools.cache
def _forward(cfg, windows):
  graphdef, state = nnx.split(_model(cfg))
  return functools.partial(jax.jit(lambda state, x: nnx.merge(graphdef, state)(
      x, windows=windows)), state)


def _recomputed_logits(cfg, prompt_BxP, tokens_BxN, windows=None):
  """Logits [B, N, V] of the full model run on each prefix prompt + tokens[:n] (n = 0..N-1),
  at the prefix's last position: every prefix is one row of one batch, right-padded (a causal
  model's earlier positions never see the padding)."""
  batch, prompt_len = prompt_BxP.shape
  num_new = tokens_BxN.shape[1]
  text_BxT = np.concatenate([prompt_BxP, tokens_BxN], axis=1)
  prefixes = np.zeros((ROWS, LENGTH), np.int32)
  last = []
  for n in range(num_new):
    for b in range(batch):
      prefixes[len(last), :prompt_len + n] = text_BxT[b, :prompt_len + n]
      last.append(prompt_len + n - 1)
  logits = np.asarray(_forward(cfg, windows)(prefixes))[np.arange(len(last)), last]
  return logits.reshape(num_new, batch, -1).transpose(1, 0, 2)


@pytest.mark.parametrize("prompt_len, impl", [(30, "reference"), (4, "reference"),
                                             (1, "reference"), (30, "auto")])
def test_greedy_equals_full_recomputation(prompt_len, impl):
  """Prompt 30 (longer than every cache), 4 and 1 (shorter); 64 new tokens wrap the caches
  21, 6 and 3 times."""
  cfg = CONFIG.replace(attention_impl=impl)
  model = _model(cfg)
  assert [b.cache_len for b in model.decode_bands(max_len=0)] == list(CACHE_LENS)
  prompt = _prompt(2, prompt_len)
  tokens, logits = model.generate(prompt, 64, temperature=0.0, return_logits=True)
  assert tokens.shape == (2, 64) and tokens.dtype == jnp.int32 and logits.shape == (2, 64, 256)
  expected = _recomputed_logits(cfg, prompt, np.asarray(tokens))
  for n in range(64):  # absolute: the logits reach 13 here; the largest difference is 4.8e-6
    np.testing.assert_allclose(logits[:, n], expected[:, n], rtol=0, atol=1e-5,
                               err_msg=f"logits of new token {n}")
  np.testing.assert_array_equal(tokens, np.argmax(expected, axis=-1))


@pytest.mark.parametrize("changes, windows", [
    ({}, (4, 1, 2)),                                # call-time windows (a trained run's last stage)
    ({"attention": "full"}, None),                  # dense baseline: its cache is the whole text
    ({"tie_word_embeddings": False}, None),
    ({"dtype": "bfloat16"}, None),                  # bf16 compute, float32 cache softmax
])
def test_variants_equal_full_recomputation(changes, windows):
  cfg = CONFIG.replace(**changes)
  model = _model(cfg)
  prompt = _prompt(2, 12)
  tokens, logits = model.generate(prompt, 16, temperature=0.0, windows=windows,
                                  return_logits=True)
  expected = _recomputed_logits(cfg, prompt, np.asarray(tokens), windows)
  assert_close(logits, expected, tolerance(model.config.dtype), f"logits {changes} {windows}")
  np.testing.assert_array_equal(tokens, np.argmax(expected, axis=-1))


def test_one_dimensional_prompt_and_no_new_tokens():
  model = _model()
  prompt = _prompt(1, 9)
  tokens = model.generate(prompt[0], 5, temperature=0.0)
  assert tokens.shape == (5,)
  np.testing.assert_array_equal(tokens, model.generate(prompt, 5, temperature=0.0)[0])
  assert model.generate(prompt, 0).shape == (1, 0)


def test_sampling_is_reproducible_and_a_prefix_of_longer_runs():
  model = _model()
  prompt = _prompt(2, 7)
  first = np.asarray(model.generate(prompt, 24, seed=3))
  np.testing.assert_array_equal(first, model.generate(prompt, 24, seed=3))
  np.testing.assert_array_equal(first[:, :10], model.generate(prompt, 10, seed=3))
  assert not np.array_equal(first, model.generate(prompt, 24, seed=4))
  greedy = model.generate(prompt, 24, temperature=0.0)
  assert not np.array_equal(first, greedy)  # temperature 1 is not greedy here


@pytest.mark.parametrize("sampling", [dict(top_k=1), dict(top_k=1, temperature=7.0),
                                      dict(top_p=1e-6, temperature=3.0)])
def test_top_k_1_and_a_tiny_nucleus_are_greedy(sampling):
  model = _model()
  prompt = _prompt(2, 7)
  np.testing.assert_array_equal(model.generate(prompt, 24, seed=5, **sampling),
                                model.generate(prompt, 24, temperature=0.0))


def _expected_distribution(logits, temperature, top_k, top_p):
  """The distribution sampling must follow, computed separately in float64 numpy."""
  z = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-z, kind="stable")[:top_k or len(z)]
  p = np.exp(z[order] - z[order].max())
  p /= p.sum()
  if top_p is not None:
    keep = (np.cumsum(p) - p) < top_p
    p = np.where(keep, p, 0.0)
    p /= p.sum()
  out = np.zeros(len(z))
  out[order] = p
  return out


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, None, None), (0.5, None, None), (2.0, 3, None), (1.0, None, 0.6), (1.5, 4, 0.7)])
def test_sample_logits_follows_the_distribution(temperature, top_k, top_p):
  logits = jnp.array([[2.0, -1.0, 0.5, 1.5, 0.0, 1.0]])
  draws = 40_000
  sampling = SamplingConfig(temperature, top_k, top_p)
  keys = jax.random.split(jax.random.key(seed_of(temperature, top_k, top_p)), draws)
  tokens = jax.jit(jax.vmap(lambda k: generation.sample_logits(logits, k, sampling)[0]))(keys)
  freq = np.bincount(np.asarray(tokens), minlength=6) / draws
  expected = _expected_distribution(logits[0], temperature, top_k, top_p)
  np.testing.assert_array_equal(freq[expected == 0], 0.0)  # filtered tokens never come out
  np.testing.assert_allclose(freq, expected, atol=0.012)   # ~5 standard deviations


def _scan_inputs(jaxpr) -> list[list[tuple]]:
  """For every `scan` in a jaxpr (nested ones included), the shapes of its body's inputs: the
  loop-invariant operands, the carry and the per-step slices."""
  found = []
  for eqn in jaxpr.eqns:
    subs = [p for v in eqn.params.values() for p in (v if isinstance(v, (list, tuple)) else (v,))]
    subs = [getattr(p, "jaxpr", p) for p in subs]
    subs = [p for p in subs if hasattr(p, "eqns")]
    if eqn.primitive.name == "scan":
      found.append([v.aval.shape for v in subs[0].invars])
    for sub in subs:
      found += _scan_inputs(sub)
  return found


def test_cache_memory_does_not_grow_with_the_length():
  """What the decoding loop is given (parameters, the last token, every layer's key and value
  ring buffer [B, K, H, D] with K = window * max dilation + 1) has the same shapes for 8 and
  4,000 new tokens after a 50- or a 3-byte prompt."""
  graphdef, state = nnx.split(_model())
  generate_fn = generation._generate_fn
  inputs = []
  for max_new, prompt_len in [(8, 50), (4000, 3)]:
    run = generate_fn(graphdef, None, max_new, SamplingConfig(), False)
    jaxpr = jax.make_jaxpr(run)(state, jnp.zeros((2, prompt_len), jnp.int32),
                                jax.random.key(0))
    (shapes,) = _scan_inputs(jaxpr.jaxpr)
    inputs.append(shapes)
  assert inputs[0] == inputs[1]
  for k in CACHE_LENS:
    assert inputs[0].count((2, k, 4, 8)) == 2, (k, inputs[0])


@pytest.mark.parametrize("call, match", [
    (lambda m: m.generate(np.zeros((2, 0), int), 3), "at least one token"),
    (lambda m: m.generate([[1, 256]], 3),
     r"prompt holds 256 at position \(0, 1\); expected ids in \[0, 256\)"),
    (lambda m: m.generate([[1.5]], 3), "prompt must be ints"),
    (lambda m: m.generate([1], -1), "max_new_tokens must be an int >= 0"),
    (lambda m: m.generate([1], 3, top_k=257), "exceeds the vocabulary"),
    (lambda m: m.generate([1], 3, top_k=0), "top_k must be an int >= 1"),
    (lambda m: m.generate([1], 3, top_p=0.0), r"top_p must be in \(0, 1\]"),
    (lambda m: m.generate([1], 3, temperature=-0.5), "temperature must be a finite number"),
    (lambda m: m.generate([1], 3, windows=(1, 2)), "one entry per layer"),
])
def test_bad_arguments_are_named(call, match):
  with pytest.raises(ValueError, match=match):
    call(_model())


# ----------------------------------------------------------------------------------------------
# python -m eval.sample on a run trained here.

@pytest.fixture(scope="module")
def run_dir(charlm_run):
  """The session's tiny char-LM run (tests/conftest.py): checkpoints 2 to 8, its stage's
  windows differ from the model config's (the CLI must use the stage's)."""
  return charlm_run.workdir


def _expected_text(workdir, step, prompt: bytes, max_new, **sampling) -> str:
  cfg = read_run_config(workdir)
  model = checkpoint.restore_model(lambda: LongformerForCausalLM(cfg.model, rngs=nnx.Rngs(0)),
                                   workdir, step=step)
  tokens = model.generate(np.frombuffer(prompt, np.uint8), max_new,
                          windows=cfg.stages[-1].windows, **sampling)
  return (prompt + bytes(np.asarray(tokens, np.uint8))).decode("utf-8", errors="replace")


def test_cli_samples_a_trained_run(run_dir):
  """End to end in a subprocess: the newest checkpoint, greedy, a non-ASCII prompt."""
  prompt = "the lazy ü"
  proc = subprocess.run(
      [sys.executable, "-m", "eval.sample", "--workdir", str(run_dir), "--prompt", prompt,
       "--max-new-tokens", "40", "--temperature", "0"],
      cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
      timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout == _expected_text(run_dir, 8, prompt.encode(), 40, temperature=0.0) + "\n"
  assert "step 8: 40 bytes in" in proc.stderr and "bytes/s" in proc.stderr


def test_cli_step_seed_and_filters(run_dir, capsys):
  from eval import sample
  args = ["--workdir", str(run_dir), "--prompt", "the", "--max-new-tokens", "30", "--step", "6",
          "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "7"]
  assert sample.main(args) == 0
  out = capsys.readouterr()
  assert out.out == _expected_text(run_dir, 6, b"the", 30, temperature=0.8, top_k=20,
                                   top_p=0.9, seed=7) + "\n"
  assert out.err.startswith("step 6: 30 bytes in")


@pytest.mark.parametrize("args, message", [
    (["--top-k", "0"], "top_k must be an int >= 1"),
    (["--top-k", "257"], "top_k=257 exceeds the vocabulary"),
    (["--top-k", "two"], "--top-k='two': expected int | None, got 'two'"),
    (["--top-p", "1.5"], r"top_p must be in (0, 1]"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature='nan': expected float, got 'nan'"),
    (["--max-new-tokens", "-3"], "max_new_tokens must be >= 0, got -3 (with --max-new-tokens -3)"),
    (["--prompt", ""], "the prompt must hold at least one token"),
])
def test_cli_bad_arguments_exit_2_in_one_line(run_dir, capsys, args, message):
  from eval import sample
  base = {"--workdir": str(run_dir), "--prompt": "abc"}
  for flag, value in zip(args[::2], args[1::2]):
    base[flag] = value
  with pytest.raises(SystemExit) as exit_info:
    sample.main([x for item in base.items() for x in item])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("eval.sample: error: ") and message in err


@pytest.mark.parametrize("where, message", [
    ("step", "no checkpoint of step 3"), ("workdir", "run_config.json")])
def test_cli_missing_run_or_step_exits_1_in_one_line(run_dir, tmp_path, capsys, where, message):
  from eval import sample
  args = ["--workdir", str(run_dir if where == "step" else tmp_path / "nothing"),
          "--prompt", "abc", "--step", "3"]
  assert sample.main(args) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: ") and message in err
