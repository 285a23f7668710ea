"""Models on meshes with Explicit axes (`jax.make_mesh`'s default) and with Auto axes, on 4
simulated CPU devices: forward and every parameter gradient equal the unsharded model's (1e-5 /
1e-4, float32), with tensor-parallel rules (heads, mlp and vocab over 'model', batch over 'data'),
FSDP rules (`embed` over 'data') and data-parallel ones (every parameter replicated, the batch over
4 devices): every encoder head, the char LM and LED (conditional generation and question
answering). The docs' sharding example is part of the script, verbatim.

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
  """The output array(s) of any head, as one array."""
  if hasattr(out, "start_logits"):
    return jnp.stack([out.start_logits, out.end_logits], -1)
  if hasattr(out, "last_hidden_state"):
    return out.last_hidden_state
  return out.logits if hasattr(out, "logits") else out


def loss_and_grads(model, *args, **kwargs):
  @nnx.jit
  def run(model, *args):
    def loss(model):
      logits = outputs(model(*args, **kwargs))
      # The same cotangent for each output array (`Heads` gives one per head).
      return sum(jnp.sum(x * jax.random.normal(jax.random.key(1), x.shape))
                 for x in jax.tree.leaves(logits)), logits
    return nnx.grad(loss, has_aux=True)(model)
  grads, logits = run(model, *args)
  return logits, nnx.to_flat_state(grads)


_references = {}  # one unsharded run per model and inputs, however many meshes check it


def check(name, build, args, mesh, rules, arg_specs, **kwargs):
  key = (build, tuple(map(id, args)), tuple((k, id(v)) for k, v in sorted(kwargs.items())))
  if key not in _references:
    reference = build()
    _references[key] = (reference, *loss_and_grads(reference, *args, **kwargs))
  reference, want_logits, want_grads = _references[key]
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    model = build()
    copy_weights(model, reference)
    placed = [jax.device_put(a, s) for a, s in zip(args, arg_specs)]
    logits, grads = loss_and_grads(model, *placed, **kwargs)
  # Each output array against its own scale (`Heads`: a dict of them, one per head).
  named = lambda x: x if isinstance(x, dict) else {"": x}
  assert named(logits).keys() == named(want_logits).keys()
  for head, want in named(want_logits).items():
    assert_close(named(logits)[head], want, 1e-5, f"{name} {head} logits")
  assert len(grads) == len(want_grads) > 10
  worst = 0.0
  for (path, g), (want_path, w) in zip(grads, want_grads):
    assert path == want_path
    assert_close(g[...], w[...], 1e-4, f"{name} grad {path}")
    worst = max(worst, float(np.max(np.abs(np.asarray(g[...]) - np.asarray(w[...])))))
  logits_error = max(float(np.max(np.abs(np.asarray(named(logits)[head]) - np.asarray(want))))
                     for head, want in named(want_logits).items())
  print(f"{name}: logits {logits_error:.2g}, grads {worst:.2g}")


tp_rules = rules
fsdp_rules = (("vocab", None), ("heads", None), ("mlp", None), ("embed", "data"), ("kv", None),
              ("norm", None))
dp_rules = tuple((name, None) for name, _ in tp_rules)  # every parameter replicated
auto_mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
dp_mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))
mask = np.ones((4, 24), np.int32)
mask[1, 18:] = 0
encoder_args, encoder_specs = (input_ids, mask, global_mask), (P("data"),) * 3

masked_lm = lambda: LongformerForMaskedLM(config, rngs=nnx.Rngs(0))
check("masked LM, Explicit, tensor parallel", masked_lm, encoder_args, mesh, tp_rules,
      encoder_specs, max_global=1)
check("masked LM, Auto, tensor parallel", masked_lm, encoder_args, auto_mesh, tp_rules,
      encoder_specs, max_global=1)
check("masked LM, Explicit, FSDP", masked_lm, encoder_args, mesh, fsdp_rules, encoder_specs,
      max_global=1)
# The other heads on one (dilated) layer: the encoder's sharding is checked above, what is new
# is each head's parameters and outputs.
head_config = dataclasses.replace(config, num_hidden_layers=1, attention_window=3,
                                  attention_dilation=((1, 2, 1, 2),))


class Heads(nnx.Module):
  """Every other head, each as built alone, run side by side: one program for the five instead
  of one each (a program's compile time, not its size, is the cost here)."""

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
check("heads, Explicit, tensor parallel", Heads, encoder_args + tuple(map(choices, encoder_args)),
      mesh, tp_rules, (P("data"),) * 6, max_global=1)

# The char LM and LED on one layer (each stack): a second layer adds parameters of the same
# kinds under the same rules, and as much compile time again.
char_config = CharLMConfig.tiny(vocab_size=64, hidden_dropout_prob=0.0, num_hidden_layers=1,
                                 hidden_size=32, intermediate_size=64, attention_window=4)
char_lm = lambda: LongformerForCausalLM(char_config, rngs=nnx.Rngs(0))
check("char LM, Explicit, FSDP", char_lm, (input_ids,), mesh, fsdp_rules, (P("data"),))
check("char LM, Auto, tensor parallel", char_lm, (input_ids,), auto_mesh, tp_rules, (P("data"),))

led_config = LEDConfig.tiny(dropout=0.0, encoder_layers=1, decoder_layers=1, attention_window=4)
decoder_ids = rng.integers(3, 64, (4, 10)).astype(np.int32)
decoder_mask = np.ones((4, 10), np.int32)
decoder_mask[2, 7:] = 0
led_args = (input_ids, mask, decoder_ids, decoder_mask)
led_specs = (P("data"),) * 4
led = lambda: LEDForConditionalGeneration(led_config, rngs=nnx.Rngs(0))
check("LED, Explicit, tensor parallel", led, led_args, mesh, tp_rules, led_specs,
      global_attention_mask=global_mask, max_global=1)
check("LED, Auto, FSDP", led, led_args, auto_mesh, fsdp_rules, led_specs,
      global_attention_mask=global_mask, max_global=1)
check("LED question answering, Explicit, data parallel (4)",
      lambda: LEDForQuestionAnswering(led_config, rngs=nnx.Rngs(0)), led_args, dp_mesh, dp_rules,
      led_specs, global_attention_mask=global_mask, max_global=1)
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
