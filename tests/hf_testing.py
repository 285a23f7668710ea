"""Seeded random-weight HF transformers models and inputs, shared by the parity/conversion tests.

No hub access: every HF model is built locally from a small config.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

BATCH, SEQ, VOCAB = 3, 23, 64
SEP = 2
# head_dim 16: the smallest the Pallas kernels take, so every implementation runs on these.
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
             intermediate_size=96, max_position_embeddings=40, type_vocab_size=2,
             layer_norm_eps=1e-5, num_labels=3, attn_implementation="eager")


def randomise_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
  """Perturbs every parameter (seeded) away from HF's init, whose zero biases and unit LayerNorm
  scales would hide a mis-mapped bias or scale. Returns the model in eval mode."""
  torch.manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return model.eval()


def random_longformer(hf_class, seed: int = 0, **config_changes):
  """An HF Longformer* model, three layers with different windows (total 4, 8, 6)."""
  torch.manual_seed(seed)
  config = transformers.LongformerConfig(**{**SMALL, "attention_window": [4, 8, 6],
                                            **config_changes})
  return randomise_(hf_class(config), seed)


def random_roberta(hf_class, seed: int = 0, **config_changes):
  """An HF Roberta* model whose position table holds 16 tokens."""
  torch.manual_seed(seed)
  config = transformers.RobertaConfig(**{**SMALL, "max_position_embeddings": 18,
                                         **config_changes})
  return randomise_(hf_class(config), seed)


def make_inputs(seed: int = 0) -> dict[str, np.ndarray]:
  """[BATCH, SEQ] inputs: rows of length 23, 17 and 9 (padding), <s> q </s></s> c </s> layout
  (so HF's QA/multiple-choice defaults apply), 3, 1 and 0 global tokens (row 1 also marks a
  padding token, which must be ignored), and random token types."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(4, VOCAB, (BATCH, SEQ))
  attention_mask = np.zeros((BATCH, SEQ), np.int64)
  for b, (length, question) in enumerate(zip([SEQ, 17, 9], [3, 5, 2])):
    ids[b, 0] = 0
    ids[b, [question + 1, question + 2, length - 1]] = SEP
    ids[b, length:] = 1  # pad token
    attention_mask[b, :length] = 1
  global_mask = np.zeros((BATCH, SEQ), np.int64)
  global_mask[0, [0, 5, 6]] = 1
  global_mask[1, [0, 20]] = 1
  return dict(input_ids=ids, attention_mask=attention_mask, global_attention_mask=global_mask,
              token_type_ids=rng.integers(0, 2, (BATCH, SEQ)))
