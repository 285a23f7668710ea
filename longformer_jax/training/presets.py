"""Named presets, per task: what an entry point's `--preset NAME` starts from.

    presets.register("mlm", "mlm_tiny", mlm_tiny)
    cfg = presets.get("mlm", "mlm_tiny")

A preset has the form of the command's settings (`longformer_jax.cli.driver`): a `TrainConfig`
(char LM, MLM), or a mapping of settings by flag name or `--set` path (fine-tuning, seq2seq,
whose TrainConfig is built from the model and the data), or by flag name alone (an eval command,
under its own name: "eval.bpc"). A task module registers its presets when it is imported
(`longformer_jax.tasks.<task>`), an eval command's in its own module; a preset is a function
that returns a fresh value, so that a registry entry is never shared state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from longformer_jax.training.config import TrainConfig

__all__ = ["get", "names", "register"]

Preset = TrainConfig | Mapping[str, Any]
_PRESETS: dict[str, dict[str, Callable[[], Preset]]] = {}


def register(task: str, name: str, make: Callable[[], Preset]) -> None:
  """Names `make()` preset `name` of `task`; a name is registered once."""
  known = _PRESETS.setdefault(task, {})
  if name in known and known[name] is not make:
    raise ValueError(f"preset {name!r} of task {task!r} is already registered")
  known[name] = make


def names(task: str) -> tuple[str, ...]:
  """The presets of `task`, sorted (none: an empty tuple)."""
  return tuple(sorted(_PRESETS.get(task, {})))


def get(task: str, name: str) -> Preset:
  """A fresh value of preset `name` of `task`; ValueError naming the known ones."""
  if name not in _PRESETS.get(task, {}):
    raise ValueError(f"unknown preset {name!r}; presets: {list(names(task))}")
  return _PRESETS[task][name]()
