"""longformer-jax: Longformer (Beltagy, Peters, Cohan 2020) in JAX / Flax NNX.

  ops           pure functions: `ops.longformer_attention` and the band kernels behind it
  LongformerConfig, CharLMConfig   frozen configs with presets, one shared vocabulary
  LongformerSelfAttention          the one attention module (encoder, char LM, LED's encoder)
  Longformer*   NNX models matching HF's classes (`convert` to/from HF)
  LEDConfig, LED*   the Longformer-Encoder-Decoder (paper §6; `convert` to/from HF, bart_to_led)
  LongformerForCausalLM, evaluate_bpc   the paper's character-level LM
  checkpoint    Orbax save/load of models and train states
  data          enwik8 / text8 (and the bundled samples), wikifil, the batch sampler
  training      mesh-sharded training with Orbax checkpoints (train/charlm.py runs it)

`import longformer_jax` loads the library only (ops, models, conversion, checkpoints): the
training engine and the tasks load when first used (`evaluate_bpc` is `tasks.charlm`'s).
"""

# `ops` first: the model modules import it.
from longformer_jax import ops
from longformer_jax import checkpoint, convert
from longformer_jax.checkpoint import load_model, save_model
from longformer_jax.attention import LongformerSelfAttention
from longformer_jax.causal_lm import LongformerForCausalLM
from longformer_jax.config import CharLMConfig, LEDConfig, LongformerConfig
from longformer_jax.convert import bart_to_led, from_hf, roberta_to_longformer, to_hf
from longformer_jax.encoder import LongformerEmbeddings, LongformerLayer
from longformer_jax.led import (
    LEDForConditionalGeneration, LEDForQuestionAnswering, LEDModel)
from longformer_jax.modeling import (
    LongformerForMaskedLM, LongformerForMultipleChoice, LongformerForQuestionAnswering,
    LongformerForSequenceClassification, LongformerForTokenClassification, LongformerLogitsOutput,
    LongformerModel, LongformerModelOutput, LongformerQuestionAnsweringOutput)

__all__ = [
    "LEDConfig", "LEDForConditionalGeneration", "LEDForQuestionAnswering", "LEDModel",
    "CharLMConfig", "LongformerConfig", "LongformerEmbeddings", "LongformerForCausalLM",
    "LongformerForMaskedLM", "LongformerForMultipleChoice", "LongformerForQuestionAnswering",
    "LongformerForSequenceClassification", "LongformerForTokenClassification",
    "LongformerLayer", "LongformerLogitsOutput", "LongformerModel", "LongformerModelOutput",
    "LongformerQuestionAnsweringOutput", "LongformerSelfAttention", "bart_to_led", "checkpoint",
    "convert", "evaluate_bpc", "from_hf", "load_model", "ops", "roberta_to_longformer",
    "save_model", "to_hf",
]

__version__ = "0.1.0"


def __getattr__(name: str):
  # The char LM's BPC evaluation lives with its task (tasks.charlm, on the training engine):
  # imported on first use so that importing the package loads no training code.
  if name == "evaluate_bpc":
    from longformer_jax.tasks.charlm import evaluate_bpc
    return evaluate_bpc
  raise AttributeError(f"module 'longformer_jax' has no attribute {name!r}")
