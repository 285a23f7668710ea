"""Models on meshes with Explicit axes (`jax.make_mesh`'s default) and with Auto axes, on 4
simulated CPU devices: forward and every parameter gradient equal the unsharded model's (1e-5 /
1e-4, float32), with tensor-parallel rules (heads, mlp and vocab over 'model', batch over 'data'),
FSDP rules (`embed` over 'data') and data-parallel ones (every parameter replicated, the batch over
4 devices): every encoder head, the char LM and LED (conditional generation and question
answering). The docs' sharding example is part of the script, verbatim. Compiling is most of the
time: the models checked on one mesh run side by side in one program, and one unsharded program
runs them all for reference.

The process has one CPU device, so `test_on_four_devices` reruns the script below in a
subprocess with `--xla_force_host_platform_device_count=4`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

_SCRIPT = r'''
import dataclasses
from typing import Callable, NamedTuple
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P
from longformer_jax import (
    CharLMConfig, LEDConfig, LEDForConditionalGeneration, LEDForQuestionAnswering,
    LongformerConfig, LongformerForCausalLM, LongformerForMaskedLM, LongformerForMultipleChoice,
    LongformerForQuestionAnswering, LongformerForSequenceClassification,
    LongformerForTokenClassification, LongformerModel)
from testing import assert_close


config = LongformerConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=40, attention_window=(2, 3),
                          attention_dilation=(1, (1, 2, 1, 2)), hidden_dropout_prob=0.0)
rng = np.random.default_rng(0)
input_ids = rng.integers(3, 64, (4, 24)).astype(np.int32)
input_ids[1, 18:] = config.pad_token_id
global_mask = np.zeros((4, 24), bool)
global_mask[:, 0] = True

# --- docs/models.md, "Sharding" (verbatim) ---
mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
rules = (("vocab", "model"), ("heads", "model"), ("mlp", "model"), ("embed", None), ("kv", None),
         ("norm", None))
with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
  model = LongformerForMaskedLM(config, rngs=nnx.Rngs(0))
  ids = jax.device_put(input_ids, P("data"))           # the batch split over 'data'
  logits = nnx.jit(lambda m, ids: m(ids).logits)(model, ids)
print(jax.typeof(logits).sharding.spec)                # PartitionSpec('data', None, 'model')
# --- end of the example ---
assert tuple(jax.typeof(logits).sharding.spec) == ("data", None, "model"), jax.typeof(logits)


def copy_weights(model, reference):
  """The reference's weights, laid out as the model's."""
  state = nnx.state(model)
  values = jax.tree.map(lambda s, r: jax.device_put(r, s.sharding), nnx.to_pure_dict(state),
                        nnx.to_pure_dict(nnx.state(reference)))
  nnx.replace_by_pure_dict(state, values)
  nnx.update(model, state)


def outputs(out):
  """The output array(s) of any head, as one array (`Heads`: a dict of them)."""
  if hasattr(out, "start_logits"):
    return jnp.stack([out.start_logits, out.end_logits], -1)
  if hasattr(out, "last_hidden_state"):
    return out.last_hidden_state
  return out.logits if hasattr(out, "logits") else out


class Together(nnx.Module):
  """Models side by side, each as built alone, run in one program: compiling dominates this
  test, and one program for several models compiles in about two thirds of the time of one
  program each."""

  def __init__(self, names):
    for name in names:
      setattr(self, name, MODELS[name].build())


def loss_and_grads(model, args):
  """{model name: its outputs} and {parameter path: gradient} of `model` (a `Together`) on
  `args` ({model name: its array arguments}; its other arguments are MODELS[name].kwargs)."""
  @nnx.jit
  def run(model, args):
    def loss(model):
      logits = {name: outputs(getattr(model, name)(*a, **MODELS[name].kwargs))
                for name, a in args.items()}
      # The same cotangent for each output array, whichever models run beside it.
      return sum(jnp.sum(x * jax.random.normal(jax.random.key(1), x.shape))
                 for x in jax.tree.leaves(logits)), logits
    return nnx.grad(loss, has_aux=True)(model)
  grads, logits = run(model, args)
  return logits, dict(nnx.to_flat_state(grads))


def check(name, mesh, rules, names):
  """The models `names` sharded on `mesh` by `rules`: outputs and every parameter gradient
  equal the unsharded run's."""
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    model = Together(names)
    for n in names:
      copy_weights(getattr(model, n), getattr(reference, n))
    placed = {n: tuple(jax.device_put(a, s) for a, s in zip(MODELS[n].args, MODELS[n].specs))
              for n in names}
    logits, grads = loss_and_grads(model, placed)
  for n in names:
    # Each output array against its own scale (`Heads`: one per head).
    named = lambda x: x if isinstance(x, dict) else {"": x}
    assert named(logits[n]).keys() == named(want_logits[n]).keys()
    for head, want in named(want_logits[n]).items():
      what = f"{name}: {' '.join(filter(None, (n, head)))} logits"
      assert_close(named(logits[n])[head], want, 1e-5, what)
      error = np.max(np.abs(np.asarray(named(logits[n])[head]) - np.asarray(want)))
      print(f"{what} {error:.2g}")
    paths = {path for path in want_grads if path[0] == n}
    assert {path for path in grads if path[0] == n} == paths and len(paths) > 10, n
  assert len(grads) == sum(1 for path in want_grads if path[0] in names)
  worst = 0.0
  for path, g in grads.items():
    w = want_grads[path]
    assert_close(g[...], w[...], 1e-4, f"{name} grad {path}")
    worst = max(worst, float(np.max(np.abs(np.asarray(g[...]) - np.asarray(w[...])))))
  print(f"{name}: {', '.join(names)}: grads {worst:.2g}")


class Model(NamedTuple):
  build: Callable
  args: tuple      # the array arguments (numpy), unsharded
  specs: tuple     # their shardings on the meshes
  kwargs: dict     # the other arguments, constants of the program


tp_rules = rules
fsdp_rules = (("vocab", None), ("heads", None), ("mlp", None), ("embed", "data"), ("kv", None),
              ("norm", None))
dp_rules = tuple((name, None) for name, _ in tp_rules)  # every parameter replicated
auto_mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
dp_mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))
mask = np.ones((4, 24), np.int32)
mask[1, 18:] = 0
encoder_args, encoder_specs = (input_ids, mask, global_mask), (P("data"),) * 3

# The other heads on one (dilated) layer: the encoder's sharding is checked with the masked LM,
# what is new is each head's parameters and outputs.
head_config = dataclasses.replace(config, num_hidden_layers=1, attention_window=3,
                                  attention_dilation=((1, 2, 1, 2),))


class Heads(nnx.Module):
  """Every other encoder head, each as built alone."""

  def __init__(self):
    for head in (LongformerModel, LongformerForSequenceClassification,
                 LongformerForQuestionAnswering, LongformerForTokenClassification,
                 LongformerForMultipleChoice):
      setattr(self, head.__name__, head(head_config, rngs=nnx.Rngs(0)))

  def __call__(self, ids, mask, global_mask, choice_ids, choice_mask, choice_global, **kwargs):
    out = {name: outputs(getattr(self, name)(ids, mask, global_mask, **kwargs))
           for name in ("LongformerModel", "LongformerForSequenceClassification",
                        "LongformerForQuestionAnswering", "LongformerForTokenClassification")}
    out["LongformerForMultipleChoice"] = outputs(self.LongformerForMultipleChoice(
        choice_ids, choice_mask, choice_global, **kwargs))
    return out


choices = lambda x: x.reshape(2, 2, 24)  # [batch 2, choices 2, seq]

# The char LM and LED on one layer (each stack): a second layer adds parameters of the same
# kinds under the same rules, and as much compile time again.
char_config = CharLMConfig.tiny(vocab_size=64, hidden_dropout_prob=0.0, num_hidden_layers=1,
                                 hidden_size=32, intermediate_size=64, attention_window=4)
led_config = LEDConfig.tiny(dropout=0.0, encoder_layers=1, decoder_layers=1, attention_window=4)
decoder_ids = rng.integers(3, 64, (4, 10)).astype(np.int32)
decoder_mask = np.ones((4, 10), np.int32)
decoder_mask[2, 7:] = 0
led_args = (input_ids, mask, decoder_ids, decoder_mask)
led_kwargs = dict(global_attention_mask=global_mask, max_global=1)

MODELS = {
    "masked_lm": Model(lambda: LongformerForMaskedLM(config, rngs=nnx.Rngs(0)), encoder_args,
                       encoder_specs, dict(max_global=1)),
    "heads": Model(Heads, encoder_args + tuple(map(choices, encoder_args)), (P("data"),) * 6,
                   dict(max_global=1)),
    "char_lm": Model(lambda: LongformerForCausalLM(char_config, rngs=nnx.Rngs(0)), (input_ids,),
                     (P("data"),), {}),
    "led": Model(lambda: LEDForConditionalGeneration(led_config, rngs=nnx.Rngs(0)), led_args,
                 (P("data"),) * 4, led_kwargs),
    "led_qa": Model(lambda: LEDForQuestionAnswering(led_config, rngs=nnx.Rngs(0)), led_args,
                    (P("data"),) * 4, led_kwargs),
}
# One unsharded run of every model, which each mesh's run is checked against.
reference = Together(MODELS)
want_logits, want_grads = loss_and_grads(reference, {n: m.args for n, m in MODELS.items()})

check("Explicit, tensor parallel", mesh, tp_rules, ("masked_lm", "heads", "led"))
check("Auto, tensor parallel", auto_mesh, tp_rules, ("masked_lm", "char_lm"))
check("Explicit, FSDP", mesh, fsdp_rules, ("masked_lm", "char_lm"))
check("Auto, FSDP", auto_mesh, fsdp_rules, ("led",))
check("Explicit, data parallel (4)", dp_mesh, dp_rules, ("led_qa",))
print("ok")
'''


def test_on_four_devices():
  root = Path(__file__).parents[1]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu", PYTHONPATH=f"{root}:{root / 'tests'}")
  proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                        text=True, timeout=900)
  print(proc.stdout)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
      proc.stdout[-3000:] + proc.stderr[-5000:])
