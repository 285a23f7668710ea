"""Our NNX models against HF transformers' PyTorch Longformer, float32, atol 1e-5.

Random-weight HF models (tests/hf_testing.py): three layers with different windows, inputs whose
length is not a multiple of any window, padding, and a different number of global tokens per
row. Each test runs with every attention implementation the op offers (`ops.IMPLS`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

_NEEDS = "the HF parity tests compare with PyTorch: pip install -e '.[torch]'"
torch = pytest.importorskip("torch", reason=_NEEDS)
transformers = pytest.importorskip("transformers", reason=_NEEDS)

from hf_testing import random_longformer
from testing import BATCH, make_model_inputs as make_inputs
from longformer_jax import LongformerConfig, LongformerForMaskedLM, convert, ops

pytestmark = pytest.mark.unit

ATOL = 1e-5


@pytest.fixture(params=ops.IMPLS)
def impl(request) -> str:
  return request.param


def run_both(hf_model, impl: str, inputs: dict, **call_kwargs):
  """(HF output, our output) for the same inputs; ours converted from the HF model."""
  with torch.no_grad():
    theirs = hf_model(**{k: torch.tensor(v) for k, v in inputs.items()}, **call_kwargs)
  model = convert.from_hf(hf_model, attention_impl=impl)
  model.eval()
  ours = model(**{k: jnp.asarray(v) for k, v in inputs.items()}, **call_kwargs)
  return theirs, ours


def assert_close(ours, theirs):
  np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=ATOL, rtol=0)


def test_model_matches_hf(impl):
  hf_model = random_longformer(transformers.LongformerModel)
  theirs, ours = run_both(hf_model, impl, make_inputs(), output_hidden_states=True)
  assert_close(ours.last_hidden_state, theirs.last_hidden_state)
  assert_close(ours.pooler_output, theirs.pooler_output)
  assert len(ours.hidden_states) == len(theirs.hidden_states) == 4
  for a, b in zip(ours.hidden_states, theirs.hidden_states):
    assert_close(a, b)


def test_masked_lm_matches_hf(impl):
  hf_model = random_longformer(transformers.LongformerForMaskedLM, seed=1)
  theirs, ours = run_both(hf_model, impl, make_inputs(1))
  assert_close(ours.logits, theirs.logits)


def test_sequence_classification_matches_hf(impl):
  """Without a global mask both put global attention on <s>."""
  hf_model = random_longformer(transformers.LongformerForSequenceClassification, seed=2)
  inputs = make_inputs(2)
  del inputs["global_attention_mask"]
  theirs, ours = run_both(hf_model, impl, inputs)
  assert_close(ours.logits, theirs.logits)


def test_question_answering_matches_hf(impl):
  """Without a global mask both put global attention on the question (before the first </s>)."""
  hf_model = random_longformer(transformers.LongformerForQuestionAnswering, seed=3, num_labels=2)
  inputs = make_inputs(3)
  del inputs["global_attention_mask"]
  theirs, ours = run_both(hf_model, impl, inputs)
  assert_close(ours.start_logits, theirs.start_logits)
  assert_close(ours.end_logits, theirs.end_logits)


def test_token_classification_matches_hf():
  hf_model = random_longformer(transformers.LongformerForTokenClassification, seed=4)
  theirs, ours = run_both(hf_model, "chunked", make_inputs(4))
  assert_close(ours.logits, theirs.logits)


def test_multiple_choice_matches_hf():
  """[batch, choices, seq] inputs; default global attention after the first </s></s>."""
  hf_model = random_longformer(transformers.LongformerForMultipleChoice, seed=5)
  inputs = make_inputs(5)
  del inputs["global_attention_mask"]
  inputs = {k: v[None] for k, v in inputs.items()}  # one example with BATCH choices
  theirs, ours = run_both(hf_model, "chunked", inputs)
  assert ours.logits.shape == (1, BATCH)
  assert_close(ours.logits, theirs.logits)


def test_presets_match_hf_parameter_counts():
  """base and large have allenai/longformer-{base,large}-4096's shapes: same parameter count as
  the HF masked LM built from their config (on torch's meta device: no memory)."""
  for preset, hf_window in ((LongformerConfig.base(), 512), (LongformerConfig.large(), 512)):
    assert preset.layer_windows == (256,) * preset.num_hidden_layers
    assert preset.max_sequence_length == 4096
    ours = nnx.eval_shape(lambda p=preset: LongformerForMaskedLM(p, rngs=nnx.Rngs(0)))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(ours, nnx.Param)))
    hf_config = transformers.LongformerConfig(
        **{k: getattr(preset, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                            "num_attention_heads", "intermediate_size",
                                            "max_position_embeddings", "type_vocab_size")},
        attention_window=hf_window)
    with torch.device("meta"):
      hf_model = transformers.LongformerForMaskedLM(hf_config)
    assert count == sum(p.numel() for p in hf_model.parameters())
  assert LongformerConfig.large().hidden_size == 1024
