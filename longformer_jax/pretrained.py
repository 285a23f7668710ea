"""`save_pretrained` / `from_pretrained` for the model classes HF transformers has (the Longformer
heads and LED): HF's checkpoint directory, `config.json` and `model.safetensors`, written and read
without torch. The weight names, shapes and config fields are `longformer_jax.convert`'s.
"""

from __future__ import annotations

import json
import os


class HFCheckpointMixin:
  """HF's `save_pretrained` / `from_pretrained` on one of our models of an HF class."""

  def save_pretrained(self, directory: str | os.PathLike) -> None:
    """Writes `directory/config.json` and `directory/model.safetensors` as HF's
    `save_pretrained` writes them for the HF class of the same name (float32 weights, tied
    copies left out), so that transformers' `from_pretrained(directory)` loads this model and
    `from_pretrained` here loads it back bit for bit.

    The directory is created if missing; each file is replaced atomically, and other files (a
    tokenizer, say) are left alone. Raises ValueError, before writing anything, for what HF
    cannot express (dilation, causal=True).
    """
    # Imported here: convert imports the model modules, which import this one.
    from safetensors.numpy import save
    from longformer_jax import convert
    from longformer_jax.io import atomic_write
    config = convert.config_to_hf_dict(self.config, type(self).__name__)  # raises first
    weights = convert.hf_state_dict(self)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    # transformers refuses safetensors files without format "pt". The config goes last: a new
    # directory is not a checkpoint (no config.json) until both files are complete.
    atomic_write(os.path.join(directory, "model.safetensors"),
                 save(weights, metadata={"format": "pt"}))
    atomic_write(os.path.join(directory, "config.json"),
                 json.dumps(config, indent=2, sort_keys=True) + "\n")

  @classmethod
  def from_pretrained(cls, source, *, revision: str | None = None,
                      cache_dir: str | os.PathLike | None = None, rngs=None, **config_changes):
    """This class with the weights and config of an HF checkpoint: a local directory (as
    `save_pretrained` or transformers write it) or an HF Hub id, as `convert.from_hf(source,
    model_class=cls, ...)` takes them. A checkpoint of another task of the family loads its
    backbone, with the new head initialised from `rngs` (a warning names the parts).

    **config_changes: config fields to set, e.g. `attention_impl`, `dtype`, `num_labels`.
    """
    from longformer_jax import convert
    return convert.from_hf(source, model_class=cls, revision=revision, cache_dir=cache_dir,
                           rngs=rngs, **config_changes)
