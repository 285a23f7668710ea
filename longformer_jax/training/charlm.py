"""The character-level LM task: `LongformerForCausalLM` on a byte stream, next-byte NLL,
`BatchSampler` batches, and validation bits per character with each stage's windows."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from longformer_jax.causal_lm import LongformerForCausalLM, next_byte_nll
from longformer_jax.config import CharLMConfig
from longformer_jax.training.config import Stage, TrainConfig
from longformer_jax.training.task import Batches, Task, dict_batches


class CharLMTask(Task):
  """train_data / valid_data: byte arrays (default: `cfg.dataset`'s train and validation splits,
  loaded when first needed). Batches are {"inputs", "targets"}, int32 [rows, seq_len]."""

  plot_keys = ("train_bpc", "valid_bpc")
  plot_ylabel = "bits per character"

  def __init__(self, train_data: np.ndarray | None = None,
               valid_data: np.ndarray | None = None):
    self._train_data = None if train_data is None else np.asarray(train_data)
    self._valid_data = None if valid_data is None else np.asarray(valid_data)

  def check(self, cfg: TrainConfig) -> None:
    if not isinstance(cfg.model, CharLMConfig):
      raise ValueError(f"the char-LM task trains a CharLMConfig model, got "
                       f"{type(cfg.model).__name__}")
    for i, stage in enumerate(cfg.stages):
      if stage.windows is not None and len(stage.windows) != cfg.model.num_hidden_layers:
        raise ValueError(f"stages[{i}].windows has {len(stage.windows)} entries for a "
                         f"{cfg.model.num_hidden_layers}-layer model: {stage.windows}")

  def data_identity(self, cfg: TrainConfig) -> dict[str, Any]:
    """The training bytes' length and SHA-256 (a 90 MB split hashes in well under a second)."""
    if self._train_data is None:
      self._train_data = _load(cfg, "train")
    data = np.ascontiguousarray(self._train_data)
    return {"train_bytes": int(data.size),
            "train_sha256": hashlib.sha256(data.tobytes()).hexdigest()}

  def build_model(self, config: CharLMConfig, rngs: nnx.Rngs, mesh: Mesh | None = None,
                  seq_axis: str | None = None) -> LongformerForCausalLM:
    return LongformerForCausalLM(config, rngs=rngs, mesh=mesh, seq_axis=seq_axis)

  def loss(self, model, batch, stage: Stage, dropout_key: jax.Array) -> jax.Array:
    # stage.windows None: the model config's windows.
    logits_BxNxV = model(batch["inputs"], windows=stage.windows, dropout_key=dropout_key)
    return jnp.mean(next_byte_nll(logits_BxNxV, batch["targets"]))

  def batches(self, cfg: TrainConfig, stage_index: int, *, process_index: int,
              process_count: int) -> Batches:
    from longformer_jax.data import BatchSampler  # pylint: disable=g-import-not-at-top
    if self._train_data is None:
      self._train_data = _load(cfg, "train")
    stage = cfg.stages[stage_index]
    sampler = BatchSampler(
        self._train_data, seq_len=stage.seq_len, global_batch_size=stage.batch_size,
        seed=cfg.seed + stage_index, process_index=process_index, process_count=process_count)
    return dict_batches(sampler, ("inputs", "targets"))

  def evaluate(self, model, cfg: TrainConfig, stage_index: int, mesh: Mesh) -> dict[str, float]:
    """BPC on the first `cfg.eval_tokens` bytes of the validation data, in non-overlapping
    windows of the stage's sequence length, with the stage's windows."""
    from longformer_jax.evaluation import evaluate_bpc  # pylint: disable=g-import-not-at-top
    if self._valid_data is None:
      self._valid_data = _load(cfg, "validation")
    data = self._valid_data
    if cfg.eval_tokens is not None:
      data = data[:cfg.eval_tokens + 1]
    stage = cfg.stages[stage_index]
    bpc = evaluate_bpc(model, data, context=stage.seq_len, stride=stage.seq_len,
                       batch_size=cfg.eval_batch_size, protocol="chunks",
                       windows=cfg.stage_windows(stage_index), mesh=mesh)
    return {"valid_bpc": bpc}

  def train_metrics(self, loss: float) -> dict[str, float]:
    return {"train_bpc": loss / math.log(2)}


def _load(cfg: TrainConfig, split: str) -> np.ndarray:
  from longformer_jax.data import load_split  # pylint: disable=g-import-not-at-top
  return load_split(cfg.dataset, split, cfg.data_dir)
