"""`save_pretrained` / `from_pretrained` for the model classes HF transformers has (the Longformer
heads and LED): HF's checkpoint directory, `config.json` and `model.safetensors`, written and read
without torch. The weight names, shapes and config fields are `longformer_jax.convert`'s.

The methods hand their work to `convert.save_pretrained` and `convert.from_hf`, which `convert`
registers here when it is imported (`register_hf_io`). The model modules inherit the methods
without importing `convert`, which imports them: no import circle. `import longformer_jax` (which
any import of a model module runs first) imports `convert`, so the functions are always there.
"""

from __future__ import annotations

import os
from collections.abc import Callable

_HF_IO: dict[str, Callable] = {}


def register_hf_io(*, save: Callable, load: Callable) -> None:
  """Sets the functions behind the methods: `save(model, directory)` and `load(source, *,
  model_class, revision, cache_dir, rngs, **config_changes)`."""
  _HF_IO.update(save=save, load=load)


def _hf_io(name: str) -> Callable:
  if name not in _HF_IO:  # only when `longformer_jax.convert` failed to import
    raise RuntimeError("longformer_jax.convert is not imported: import longformer_jax first")
  return _HF_IO[name]


class HFCheckpointMixin:
  """HF's `save_pretrained` / `from_pretrained` on one of our models of an HF class."""

  def save_pretrained(self, directory: str | os.PathLike) -> None:
    """Writes `directory/config.json` and `directory/model.safetensors` as HF's
    `save_pretrained` writes them for the HF class of the same name (`convert.save_pretrained`).
    """
    _hf_io("save")(self, directory)

  @classmethod
  def from_pretrained(cls, source, *, revision: str | None = None,
                      cache_dir: str | os.PathLike | None = None, rngs=None, **config_changes):
    """This class with the weights and config of an HF checkpoint: a local directory (as
    `save_pretrained` or transformers write it) or an HF Hub id, as `convert.from_hf(source,
    model_class=cls, ...)` takes them. A checkpoint of another task of the family loads its
    backbone, with the new head initialised from `rngs` (a warning names the parts).

    **config_changes: config fields to set, e.g. `attention_impl`, `dtype`, `num_labels`.
    """
    return _hf_io("load")(source, model_class=cls, revision=revision, cache_dir=cache_dir,
                          rngs=rngs, **config_changes)
