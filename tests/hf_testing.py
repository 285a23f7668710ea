"""Seeded random-weight HF transformers models, shared by the parity and conversion tests (the
only test helpers that import torch; the torch-free shapes and inputs live in tests/testing.py).

No hub access: every HF model is built locally from a small config.
"""

from __future__ import annotations

import torch
import transformers

from testing import ENCODER_SHAPE, ENCODER_WINDOWS

SMALL = dict(**ENCODER_SHAPE, num_labels=3, attn_implementation="eager")


def randomise_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
  """Perturbs every parameter (seeded) away from HF's init, whose zero biases and unit LayerNorm
  scales would hide a mis-mapped bias or scale. Returns the model in eval mode."""
  torch.manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return model.eval()


def random_longformer(hf_class, seed: int = 0, **config_changes):
  """An HF Longformer* model, three layers with different windows (HF totals 4, 8, 6)."""
  torch.manual_seed(seed)
  config = transformers.LongformerConfig(
      **{**SMALL, "attention_window": [2 * w for w in ENCODER_WINDOWS], **config_changes})
  return randomise_(hf_class(config), seed)


def random_roberta(hf_class, seed: int = 0, **config_changes):
  """An HF Roberta* model whose position table holds 16 tokens."""
  torch.manual_seed(seed)
  config = transformers.RobertaConfig(**{**SMALL, "max_position_embeddings": 18,
                                         **config_changes})
  return randomise_(hf_class(config), seed)
