"""Exported programs for serving (`longformer_jax.export`, `python -m eval.export`).

Every encoder head, the char LM, LED's encoder, cache and decoding step, and char-LM generation
over a traced prompt are exported, written into one archive and called in ONE fresh process
that imports JAX alone (never longformer_jax or flax); what it returns equals the models run
here (1e-5, float32). Also: buckets and exact padding into them, the NaN of a row with more
global tokens than `max_global`, TPU exports from this CPU keeping the Mosaic kernel, GPU
exports refusing the Triton kernel, and the CLI on a char-LM training workdir, an LED and a
model checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh

from longformer_jax import export, led, modeling
from longformer_jax.causal_lm import LongformerForCausalLM
from longformer_jax.config import CharLMConfig, LEDConfig
from longformer_jax.ops import attention as ops
from longformer_jax.ops.band_pallas import band_attention_pallas
from testing import (BATCH, SEQ, assert_close, make_model_inputs, seed_of,
                     tiny_encoder_config)

# slow: in-process, but most of the cost is training runs, command lines and subprocesses.
pytestmark = [pytest.mark.unit, pytest.mark.slow]

# The char-LM run the export command reads: one layer and the dense reference band op (its
# compile time dominates); the stage's windows differ from the model config's, so the export
# must take the stage's.
RUN_MODEL = CharLMConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                         intermediate_size=64, attention_window=8,
                         attention_dilation=((1, 2),), attention_impl="reference")
RUN_WINDOWS = (5,)

TOL = 1e-5

# 2 layers, hidden 32, 4 heads (head_dim 8), windows 2 and 4, on testing.py's [3, 23] inputs.
# Most models run the dense reference band op, whose programs compile several times faster on
# a CPU (the implementations agree: tests/test_attention.py); the classifier runs the default,
# `impl="auto"` (the chunked path on a CPU), so that the default's programs are exported too.
ENCODER = tiny_encoder_config(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                              attention_window=(2, 4), attention_impl="reference")
DEFAULT_IMPL_HEADS = ("LongformerForSequenceClassification",)
CHAR_LM = CharLMConfig(vocab_size=64, num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                       intermediate_size=64, attention_window=(2, 4),
                       attention_dilation=((1, 1, 1, 1), (1, 2, 1, 2)), initializer_range=0.5,
                       attention_impl="reference")
LED = LEDConfig.tiny(d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
                     attention_impl="reference")
BUCKETS = (SEQ, 32)
LED_STEPS = 3  # decoding steps checked, on a cache of LED_LENGTH positions
LED_LENGTH = 4
MOST_GLOBALS = 3  # in any row of make_model_inputs: the bound the jitted references take
GENERATE = dict(max_new_tokens=6, temperature=1.0, top_k=5, seed=3)

# The fresh process: JAX, numpy and the standard library only. It runs `calls` in order; an
# argument "=name" or "=name.key" is an earlier call's result (or one of its entries), any
# other a key of inputs.npz; it saves every leaf of every result as "<call><path>".
_SERVE = textwrap.dedent("""
    import json, sys, zipfile
    import numpy as np
    import jax

    folder = sys.argv[1]
    inputs = np.load(f"{folder}/inputs.npz")
    with open(f"{folder}/calls.json") as f:
      calls = json.load(f)
    with zipfile.ZipFile(f"{folder}/programs.zip") as z:
      manifest = json.loads(z.read("manifest.json"))
      programs = {entry: jax.export.deserialize(z.read(entry)) for entry in manifest["programs"]}
    results, saved = {}, {}

    def value(arg):
      if not arg.startswith("="):
        return inputs[arg]
      name, _, key = arg[1:].partition(".")
      return results[name][key] if key else results[name]

    for call in calls:
      out = programs[call["entry"]].call(*[value(arg) for arg in call["args"]])
      results[call["name"]] = out
      for path, leaf in jax.tree_util.tree_leaves_with_path(out):
        saved[call["name"] + jax.tree_util.keystr(path)] = np.asarray(leaf)
    np.savez(f"{folder}/outputs.npz", **saved)
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("longformer_jax", "flax"))
    assert not leaked, leaked
    print("served", len(calls))
""")


def _encoder_inputs():
  inputs = make_model_inputs()
  return {k: inputs[k].astype(np.int32) for k in ("input_ids", "attention_mask",
                                                   "global_attention_mask")}


def _ids(model_inputs, global_mask):
  return (model_inputs["input_ids"], model_inputs["attention_mask"], global_mask)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """Exports every program, serves them all in one fresh JAX-only process while computing what
  the models give here, and returns (those references, the inputs, the process's outputs, the
  folder of the archive)."""
  folder = tmp_path_factory.mktemp("served")
  inputs = _encoder_inputs()
  arrays = dict(inputs)
  # Sequence classification puts global attention on <s> (max_global 1).
  arrays["cls_global_mask"] = np.asarray(
      modeling.sequence_classification_global_mask(inputs["input_ids"]), np.int32)
  # [3, 23] -> [1, 3, 23], as int64 (a tokenizer's NumPy dtype: the programs take it as int32).
  for name in ("input_ids", "attention_mask", "global_attention_mask"):
    arrays[f"choice_{name}"] = inputs[name][None].astype(np.int64)
  # The same rows right-padded to the second bucket (pad token, attention_mask 0).
  pad = BUCKETS[1] - SEQ
  arrays["padded_input_ids"] = np.pad(inputs["input_ids"], ((0, 0), (0, pad)),
                                      constant_values=ENCODER.pad_token_id)
  for name in ("attention_mask", "global_attention_mask"):
    arrays[f"padded_{name}"] = np.pad(inputs[name], ((0, 0), (0, pad)))
  rng = np.random.default_rng(seed_of("export inputs"))
  arrays["lm_ids"] = rng.integers(0, CHAR_LM.vocab_size, (2, 19)).astype(np.int32)
  arrays["prompt"] = rng.integers(0, CHAR_LM.vocab_size, (2, 5)).astype(np.int32)
  led_ids = rng.integers(3, LED.vocab_size, (2, 20)).astype(np.int32)
  led_mask = np.ones((2, 20), np.int32)
  led_mask[1, 14:] = 0
  led_global = np.zeros((2, 20), np.int32)
  led_global[:, 0] = 1
  arrays.update(led_ids=led_ids, led_mask=led_mask, led_global=led_global)
  arrays["led_tokens"] = rng.integers(3, LED.vocab_size, (LED_STEPS, 2, 1)).astype(np.int32)
  for step in range(LED_STEPS):
    arrays[f"led_token_{step}"] = arrays["led_tokens"][step]

  models = {name: cls(ENCODER.replace(attention_impl="auto") if name in DEFAULT_IMPL_HEADS
                      else ENCODER, rngs=nnx.Rngs(seed_of(name)))
            for name, cls in modeling.MODEL_CLASSES.items()}
  models["LongformerForCausalLM"] = LongformerForCausalLM(CHAR_LM, rngs=nnx.Rngs(1))
  models["LED"] = led.LEDForConditionalGeneration(LED, rngs=nnx.Rngs(2))
  programs, calls = {}, []

  def add(entry, exported, args, name=None):
    programs.setdefault(entry, exported)
    calls.append({"entry": entry, "name": name or entry, "args": args})

  standard = ["input_ids", "attention_mask", "global_attention_mask"]
  for name in modeling.MODEL_CLASSES:
    if name == "LongformerForMultipleChoice":
      add(name, export.export_model(models[name], batch_size=1, seq_len=SEQ, num_choices=BATCH),
          [f"choice_{k}" for k in standard])
    elif name == "LongformerForSequenceClassification":
      exported = export.export_model(models[name], batch_size=BATCH, seq_len=SEQ)
      add(name, exported, ["input_ids", "attention_mask", "cls_global_mask"])
      # Row 0 has 3 global tokens, more than the program's 1 slot.
      add(name, exported, standard, name="cls_too_many_globals")
    elif name == "LongformerForTokenClassification":
      buckets = export.export_model(models[name], batch_size=BATCH, seq_len=list(BUCKETS))
      add(f"{name}/{BUCKETS[0]}", buckets[BUCKETS[0]], standard)
      add(f"{name}/{BUCKETS[1]}", buckets[BUCKETS[1]], [f"padded_{k}" for k in standard])
    else:
      add(name, export.export_model(models[name], batch_size=BATCH, seq_len=SEQ), standard)
  add("LongformerForCausalLM", export.export_model(models["LongformerForCausalLM"],
                                                   batch_size=2, seq_len=19), ["lm_ids"])
  lm = models["LongformerForCausalLM"]
  add("generate", jax.export.export(jax.jit(lambda p: lm.generate(p, **GENERATE)))(
      jax.ShapeDtypeStruct((2, 5), jnp.int32)), ["prompt"])
  led_programs = export.export_led(models["LED"], batch_size=2, seq_len=20,
                                   max_length=LED_LENGTH)
  add("encode", led_programs.encode, ["led_ids", "led_mask", "led_global"])
  add("init_cache", led_programs.init_cache, ["=encode.last_hidden_state", "led_mask"])
  cache = "=init_cache"
  for step in range(LED_STEPS):
    add("decode_step", led_programs.decode_step, [f"led_token_{step}", cache],
        name=f"step{step}")
    cache = f"=step{step}.cache"

  names = {entry: (["prompt"] if entry == "generate" else
                   export.PROGRAMS[entry.split("/")[0]]) for entry in programs}
  export.write_archive(folder / "programs.zip", programs, names, {"test": True})
  np.savez(folder / "inputs.npz", **arrays)
  (folder / "calls.json").write_text(json.dumps(calls))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH="")
  proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(folder)], env=env, cwd=folder,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    refs = _references(models, arrays)  # meanwhile, here
    refs["models"] = models
    stdout, stderr = proc.communicate(timeout=600)
  finally:
    proc.kill()
  assert proc.returncode == 0 and stdout.strip() == f"served {len(calls)}", stderr[-3000:]
  with np.load(folder / "outputs.npz") as outputs:
    return refs, arrays, dict(outputs), folder


def _jit(model, method="__call__", **kwargs):
  """`model.<method>(*args, **kwargs)` in eval mode under `nnx.jit`: the reference (an eager
  first call compiles each of its many small ops, 2-5x longer here)."""
  model.eval()
  run = nnx.jit(lambda model, *args: getattr(model, method)(*args, **kwargs))
  return lambda *args: run(model, *args)


def _references(models, x) -> dict:
  """What the models compute on the served inputs (host arrays, by call name)."""
  refs = {}
  standard = _ids(x, x["global_attention_mask"])
  for name in modeling.MODEL_CLASSES:
    if name == "LongformerForMultipleChoice":
      refs[name] = _jit(models[name], max_global=MOST_GLOBALS)(
          x["choice_input_ids"], x["choice_attention_mask"], x["choice_global_attention_mask"])
    elif name == "LongformerForSequenceClassification":
      classify = _jit(models[name], max_global=1)
      refs[name] = classify(*_ids(x, x["cls_global_mask"]))  # the head's own default: <s>
      refs["cls_too_many_globals"] = classify(*standard)
    else:
      refs[name] = _jit(models[name], max_global=MOST_GLOBALS)(*standard)
  refs["LongformerForCausalLM"] = _jit(models["LongformerForCausalLM"])(x["lm_ids"])
  lm = models["LongformerForCausalLM"]
  refs["generate"] = lm.generate(x["prompt"], **GENERATE)
  # A one-dimensional prompt traces too (abstractly: nothing more to compile).
  refs["generate_1d"] = jax.eval_shape(lambda p: lm.generate(p, **GENERATE),
                                       jax.ShapeDtypeStruct((5,), jnp.int32))
  model = models["LED"]
  encoded = _jit(model, "encode", max_global=1)(x["led_ids"], x["led_mask"],
                                                x["led_global"]).last_hidden_state
  refs["encode"] = encoded
  cache = _jit(model, "init_cache", max_length=LED_LENGTH)(encoded, x["led_mask"])
  refs["init_cache"] = export.cache_to_tree(cache)
  decode_step = _jit(model, "decode_step")
  for step in range(LED_STEPS):
    logits, cache = decode_step(x["led_tokens"][step], cache)
    refs[f"step{step}"] = {"logits": logits, "cache": export.cache_to_tree(cache)}
  return jax.tree.map(lambda a: a if isinstance(a, jax.ShapeDtypeStruct) else np.asarray(a),
                      refs)


@pytest.mark.parametrize("name", sorted(modeling.MODEL_CLASSES))
def test_encoder_heads_equal_the_model(served, name):
  refs, _, out, _ = served
  entry = f"{name}/{SEQ}" if name == "LongformerForTokenClassification" else name
  fields = {"LongformerModel": ("last_hidden_state", "pooler_output"),
            "LongformerForQuestionAnswering": ("start_logits", "end_logits")}.get(name,
                                                                                  ("logits",))
  assert {k for k in out if k.startswith(f"{entry}[")} == {f"{entry}['{f}']" for f in fields}
  for field in fields:
    assert_close(out[f"{entry}['{field}']"], getattr(refs[name], field), TOL, f"{name} {field}")


def test_a_row_with_more_global_tokens_than_max_global_is_nan(served):
  """The classifier's program has max_global=1 slot; row 0 marks 3 tokens (rows 1 and 2: 1 and
  0 real ones): row 0 is NaN, the others equal the model with the same mask."""
  refs, _, out, _ = served
  logits = out["cls_too_many_globals['logits']"]
  assert np.isnan(logits[0]).all()
  assert_close(logits[1:], refs["cls_too_many_globals"].logits[1:], TOL, "rows within bound")


def test_buckets_one_program_per_length_and_padding_is_exact(served):
  """seq_len=[23, 32] gives a program per length; the 23-token rows padded to 32 (pad token,
  attention_mask 0) give the 23-token logits at their real positions."""
  refs, x, out, folder = served
  with zipfile.ZipFile(folder / "programs.zip") as z:
    manifest = json.loads(z.read("manifest.json"))
  name = "LongformerForTokenClassification"
  for n in BUCKETS:
    described = manifest["programs"][f"{name}/{n}"]
    assert [(i["name"], i["shape"], i["dtype"]) for i in described["inputs"]] == [
        (k, [BATCH, n], "int32") for k in ("input_ids", "attention_mask",
                                           "global_attention_mask")]
    assert described["outputs"] == [{"name": "['logits']", "shape": [BATCH, n, 2],
                                     "dtype": "float32"}]
  real = x["attention_mask"][..., None].astype(bool)
  padded = out[f"{name}/{BUCKETS[1]}['logits']"]
  assert_close(np.where(real, padded[:, :SEQ], 0), np.where(real, refs[name].logits, 0), TOL,
               "padded bucket")


def test_char_lm_equals_the_model(served):
  refs, _, out, _ = served
  assert_close(out["LongformerForCausalLM['logits']"], refs["LongformerForCausalLM"], TOL,
               "char LM logits")


def test_generate_over_a_traced_prompt(served):
  """`generate` traced over its prompt, exported and served in the fresh process, draws the
  tokens the eager call draws; a one-dimensional prompt traces too."""
  refs, _, out, _ = served
  np.testing.assert_array_equal(out["generate"], refs["generate"])
  one_row = refs["generate_1d"]
  assert (one_row.shape, one_row.dtype) == ((GENERATE["max_new_tokens"],), jnp.int32)


def test_led_encoder_and_decode_steps_equal_the_model(served):
  """encode -> init_cache -> 3 decoding steps, the cache flowing from one exported step into
  the next in the fresh process, equal the model's own calls: states, logits, every cache."""
  refs, _, out, _ = served
  assert_close(out["encode['last_hidden_state']"], refs["encode"], TOL, "encoder states")
  for call in ["init_cache"] + [f"step{step}" for step in range(LED_STEPS)]:
    for path, leaf in jax.tree_util.tree_leaves_with_path(refs[call]):
      key = call + jax.tree_util.keystr(path)
      assert_close(out[key], leaf, TOL, key)
  assert int(out[f"step{LED_STEPS - 1}['cache']['index']"]) == LED_STEPS


def _stable_custom_calls() -> frozenset[str]:
  """The custom-call targets jax.export serializes: those with a compatibility guarantee."""
  from jax._src.export import _export
  return frozenset(_export._CUSTOM_CALL_TARGETS_GUARANTEED_STABLE)


def test_tpu_export_keeps_the_mosaic_kernel():
  """Exported for ("tpu",) from this CPU, a model with attention_impl="pallas" contains the
  Mosaic kernel, which serializes: its custom call is on jax.export's stable list. ("auto"
  chooses the kernel for the export platform too: the next test.)"""
  assert "tpu_custom_call" in _stable_custom_calls()
  model = modeling.LongformerForMaskedLM(ENCODER.replace(attention_impl="pallas"),
                                         rngs=nnx.Rngs(0))
  exported = export.export_model(model, batch_size=1, seq_len=16, platforms=("tpu",))
  assert exported.platforms == ("tpu",)
  assert "tpu_custom_call" in exported.mlir_module()
  assert b"tpu_custom_call" in bytes(exported.serialize())


def test_target_platform_chooses_the_kernel_inside_the_block_only():
  """`export` traces inside `target_platform(<the export platform>)`: there "auto" takes the
  TPU's Pallas kernel; outside, this CPU's chunked path."""
  q = jnp.ones((1, 256, 2, 64), jnp.bfloat16)
  assert ops.platform_of(None) == "cpu" and ops.resolve_impl("auto", q, 16) == "chunked"
  with ops.target_platform("tpu"):
    assert ops.platform_of(None) == "tpu" and ops.resolve_impl("auto", q, 16) == "pallas"
    with ops.target_platform("cpu"):
      assert ops.resolve_impl("auto", q, 16) == "chunked"
    assert ops.platform_of(None) == "tpu"
  assert ops.platform_of(None) == "cpu"
  with pytest.raises(TypeError, match="platform=None: expected a platform name"):
    with ops.target_platform(None):
      pass


def test_gpu_export_refuses_the_triton_kernel():
  """jax.export refuses the Triton GPU kernel's custom call (no compatibility guarantee), so
  export_model raises a ValueError for attention_impl="pallas" on "cuda" or for several
  platforms, and "auto" exports the chunked path there."""
  stable = _stable_custom_calls()
  assert not any("triton" in target for target in stable)
  # What jax.export does with the kernel itself, lowered for an H200 from this CPU.
  qkv = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  mask = jax.ShapeDtypeStruct((1, 256), jnp.bool_)
  band = lambda q, k, v, m: band_attention_pallas(q, k, v, m, window=16, causal=False,
                                                  interpret=False, backend="triton")
  h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
  with jax.sharding.use_abstract_mesh(h200), warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # jax 0.12: Triton is deprecated
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
      jax.export.export(jax.jit(band), platforms=("cuda",))(qkv, qkv, qkv, mask)

  pallas = modeling.LongformerForSequenceClassification(ENCODER.replace(attention_impl="pallas"),
                                                        rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="Triton custom call.*attention_impl='chunked'"):
    export.export_model(pallas, batch_size=1, seq_len=16, platforms=("cuda",))
  with pytest.raises(ValueError, match="several platforms"):
    export.export_model(pallas, batch_size=1, seq_len=16, platforms=("cpu", "tpu"))
  with pytest.raises(ValueError, match="cannot be exported for 'rocm'"):
    export.export_model(pallas, batch_size=1, seq_len=16, platforms=("rocm",))
  auto = modeling.LongformerForSequenceClassification(ENCODER.replace(attention_impl="auto"),
                                                      rngs=nnx.Rngs(0))
  for platforms in (("cuda",), ("rocm",), ("cpu", "cuda", "tpu")):
    exported = export.export_model(auto, batch_size=1, seq_len=16, platforms=platforms)
    assert exported.platforms == platforms
    assert "custom_call" not in exported.mlir_module()
    exported.serialize()
  # The model itself is unchanged: its config, and training mode.
  assert auto.config.attention_impl == "auto" and not auto.classifier.dropout.deterministic
  # Masks are int32: booleans are refused before anything runs.
  ids = np.zeros((1, 16), np.int32)
  with pytest.raises(ValueError, match="expected int32 and called with bool"):
    exported.call(ids, ids.astype(bool), ids)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A char-LM training workdir as `training.train` lays it out (run_config.json, and
  checkpoints 1 and 2 with the meta `train` saves, by the same writers), holding two different
  parameter sets. Not trained: a training step compiles its program, its health check and its
  checksums (16 s of CPU here), and nothing the CLI reads depends on how the parameters were
  reached (it reads no optimizer state: the parameters stand in for it)."""
  from longformer_jax import checkpoint
  from longformer_jax.tasks import CharLMTask
  from longformer_jax.training import Stage, TrainConfig, config_record, write_run_config
  workdir = tmp_path_factory.mktemp("export_cli") / "run"
  cfg = TrainConfig(model=RUN_MODEL, stages=(Stage(seq_len=16, batch_size=4, steps=2,
                                                   learning_rate=3e-3, windows=RUN_WINDOWS),),
                    eval_every=10_000, checkpoint_every=1, async_checkpoints=False)
  task = CharLMTask(np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 100,
                                  np.uint8))
  record = {**config_record(cfg), "data": task.data_identity(cfg)}
  write_run_config(workdir, record)
  params = nnx.state(LongformerForCausalLM(RUN_MODEL, rngs=nnx.Rngs(cfg.seed)), nnx.Param)
  sampler = task.batches(cfg, 0, process_index=0, process_count=1).state()
  writer = checkpoint.TrainCheckpoints(workdir / checkpoint.CHECKPOINTS, keep=2,
                                       async_save=False)
  for step in (1, 2):
    writer.save(step, params, params,
                {"step": step, "stage": 0, "sampler": sampler, "run": record})
    params = jax.tree.map(lambda p: p + 0.01, params)
  writer.close()
  return workdir


def test_cli_exports_a_trained_run(run_dir, tmp_path, capsys):
  """`python -m eval.export` on a char-LM training run (checkpoint 1 of 2, restored for a
  mesh): an archive with a program per length whose manifest says what they are; one of them
  (the other is the same export at another length) equals the checkpoint's model with the run's
  last-stage windows."""
  from longformer_jax.commands import eval_export as cli
  from longformer_jax import checkpoint
  out = tmp_path / "char.zip"
  assert cli.main(["--workdir", str(run_dir), "--out", str(out), "--seq-len", "12", "8",
                   "--batch-size", "2", "--step", "1"]) == 0
  assert f"wrote {out}" in capsys.readouterr().out
  programs, manifest = export.read_archive(out)
  assert sorted(programs) == ["forward/12", "forward/8"]
  assert manifest["step"] == 1 and manifest["windows"] == list(RUN_WINDOWS)
  assert manifest["model_class"] == "LongformerForCausalLM" and manifest["seq_lens"] == [8, 12]
  for n in (8, 12):
    assert manifest["programs"][f"forward/{n}"] == {
        "inputs": [{"name": "input_ids", "shape": [2, n], "dtype": "int32"}],
        "outputs": [{"name": "['logits']", "shape": [2, n, 256], "dtype": "float32"}],
        "platforms": ["cpu"]}
  model = checkpoint.restore_model(lambda: LongformerForCausalLM(RUN_MODEL, rngs=nnx.Rngs(0)),
                                   run_dir, step=1)
  # The weights are inside: each program holds all of them.
  weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert out.stat().st_size > 2 * weights
  ids = np.random.default_rng(seed_of("cli ids")).integers(0, 256, (2, 8)).astype(np.int32)
  assert_close(programs["forward/8"].call(ids)["logits"],
               _jit(model, windows=RUN_WINDOWS)(ids), TOL, "forward/8")


def test_cli_knows_each_runs_class_and_reads_model_checkpoints(tmp_path, capsys):
  """A training workdir's model class follows its run record; a model checkpoint directory
  (`save_model`) is exported as it is."""
  from longformer_jax.commands import eval_export as cli
  from longformer_jax import checkpoint
  from longformer_jax.tasks import trained
  for task, cls in (("qa", "LongformerForQuestionAnswering"),
                    ("multiple_choice", "LongformerForMultipleChoice"),
                    (None, "LongformerForMaskedLM")):  # an MLM run records no task
    assert trained.run_model_class({"data": {"task": task}}, ENCODER).__name__ == cls
  assert trained.run_model_class({}, LED) is led.LEDForConditionalGeneration
  with pytest.raises(ValueError, match="a run of a CharLMConfig model cannot be exported"):
    trained.run_model_class({}, CHAR_LM)
  checkpoint.save_model(tmp_path / "lm", LongformerForCausalLM(RUN_MODEL, rngs=nnx.Rngs(0)))
  assert cli.main(["--workdir", str(tmp_path / "lm"), "--out", str(tmp_path / "lm.zip"),
                   "--seq-len", "8"]) == 0
  assert "wrote" in capsys.readouterr().out
  programs, manifest = export.read_archive(tmp_path / "lm.zip")
  assert list(programs) == ["forward/8"] and manifest["kind"] == "checkpoint"
  assert "windows" not in manifest and "step" not in manifest  # the config's windows


def test_cli_exports_led_as_three_programs_per_length(served, tmp_path, capsys, monkeypatch):
  """An LED model is exported as encode, init_cache and decode_step per length, decoding
  num_beams rows per example over a cache of max_length positions."""
  from longformer_jax.commands import eval_export as cli
  model = served[0]["models"]["LED"]
  monkeypatch.setattr(cli, "load_trained", lambda path, step: (model, {"source": path,
                                                                     "kind": "checkpoint"}))
  assert cli.main(["--workdir", "an LED", "--out", str(tmp_path / "led.zip"), "--seq-len", "20",
                   "--batch-size", "3", "--num-beams", "2", "--max-length", "5"]) == 0
  assert "decode_step/20" in capsys.readouterr().out
  _, manifest = export.read_archive(tmp_path / "led.zip")
  assert sorted(manifest["programs"]) == ["decode_step/20", "encode/20", "init_cache/20"]
  assert (manifest["num_beams"], manifest["max_length"], manifest["max_global"]) == (2, 5, 1)
  inputs = {i["name"]: i["shape"] for i in manifest["programs"]["decode_step/20"]["inputs"]}
  assert inputs["decoder_input_ids"] == [6, 1]
  assert inputs["cache['layers'][0]['self_key']"] == [6, 4, 5, 8]       # [B * K, H, S, D]
  assert inputs["cache['layers'][0]['cross_key']"] == [3, 4, 20, 8]     # [B, H, N, D]
  assert manifest["programs"]["encode/20"]["inputs"][0] == {
      "name": "input_ids", "shape": [3, 20], "dtype": "int32"}


@pytest.mark.parametrize("args, message", [
    (["--max-global", "2"], "max_global=2: the causal LM has no global tokens"),
    (["--num-beams", "2"], "--num-beams is for LED models"),
    (["--platform", "gpu"], "platforms=('gpu',)"),
    (["--seq-len", "0"], "seq_len: must be >= 1, got 0 (with --seq-len 0)"),
])
def test_cli_bad_arguments_exit_2_in_one_line(run_dir, tmp_path, capsys, args, message):
  from longformer_jax.commands import eval_export as cli
  base = {"--workdir": str(run_dir), "--out": str(tmp_path / "x.zip"), "--seq-len": "8"}
  for flag, value in zip(args[::2], args[1::2]):
    base[flag] = value
  with pytest.raises(SystemExit) as exit_info:
    cli.main([x for item in base.items() for x in item])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("eval.export: error: ") and message in err
  assert not (tmp_path / "x.zip").exists()


def test_cli_nothing_to_export_exits_1(tmp_path, capsys):
  from longformer_jax.commands import eval_export as cli
  assert cli.main(["--workdir", str(tmp_path / "none"), "--out", str(tmp_path / "x.zip"),
                   "--seq-len", "8"]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: ") and "none" in err


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(batch_size=0), ValueError, "batch_size must be an int >= 1, got 0"),
    (dict(seq_len=[]), ValueError, "seq_len must be an int or a non-empty list"),
    (dict(seq_len=[16, 16]), ValueError, "seq_len lists a length twice"),
    (dict(max_global=-1), ValueError, "max_global must be an int >= 0, got -1"),
    (dict(num_choices=2), ValueError, "num_choices=2 is for LongformerForMultipleChoice"),
    (dict(windows=(2, 2)), ValueError, "windows=.* is for LongformerForCausalLM"),
    (dict(platforms=("gpu",)), ValueError, "'cuda', not 'gpu'"),
    (dict(seq_len=64), ValueError, "input_ids has 64 tokens; the position table holds at most"),
])
def test_bad_arguments_name_the_values(kwargs, error, match):
  model = modeling.LongformerForTokenClassification(ENCODER, rngs=nnx.Rngs(0))
  with pytest.raises(error, match=match):
    export.export_model(model, **{"batch_size": 1, "seq_len": 16, **kwargs})


def test_bad_models_name_the_right_function():
  with pytest.raises(TypeError, match="export LED models with export_led"):
    export.export_model(led.LEDModel(LED, rngs=nnx.Rngs(0)), batch_size=1, seq_len=8)
  with pytest.raises(TypeError, match="export_led exports LEDForConditionalGeneration"):
    export.export_led(led.LEDModel(LED, rngs=nnx.Rngs(0)), batch_size=1, seq_len=8,
                      max_length=4)
  with pytest.raises(ValueError, match="give num_choices"):
    export.export_model(modeling.LongformerForMultipleChoice(ENCODER, rngs=nnx.Rngs(0)),
                        batch_size=1, seq_len=8)
  with pytest.raises(TypeError, match="cannot export a Linear"):
    export.export_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), batch_size=1, seq_len=8)
