"""A trained run's model, whatever its task: what `eval.export` serves.

    model, info = trained.load_trained("runs/qa")          # a training workdir, or
    model, info = trained.load_trained("exported_model/")  # a model checkpoint (`save_model`)

Apart from `tasks.runs` (what a run is), which the tasks import: this module imports them.
"""

from __future__ import annotations

import os

import jax
from flax import nnx

from longformer_jax import checkpoint, led, modeling
from longformer_jax.config import CharLMConfig, LEDConfig, LongformerConfig
from longformer_jax.tasks.charlm import restore_run
from longformer_jax.tasks.finetune import MODEL_CLASSES as TASK_CLASSES
from longformer_jax.tasks.runs import run_task
from longformer_jax.training import config_from_record, make_mesh
from longformer_jax.training.config import RUN_CONFIG, read_run_record

__all__ = ["load_trained", "run_model_class"]


def run_model_class(record: dict, model_config):
  """The class a training run of `model_config` trained, by its run record: a fine-tuning run's
  task head, an MLM run's masked LM, a seq2seq run's LED (the char LM is restored apart, with
  its windows)."""
  if isinstance(model_config, LEDConfig):
    return led.LEDForConditionalGeneration
  if isinstance(model_config, LongformerConfig):
    # A fine-tuning run names its task; an MLM run's model is a masked LM.
    return TASK_CLASSES.get(run_task(record), modeling.LongformerForMaskedLM)
  raise ValueError(f"a run of a {type(model_config).__name__} model cannot be exported")


def load_trained(path: str, step: int | None = None):
  """(model, info) of a training workdir or a model checkpoint directory; info: JSON facts for
  the manifest ("source", "kind", "step", and the char LM's "windows")."""
  info = {"source": os.fspath(path)}
  if os.path.lexists(os.path.join(path, RUN_CONFIG)):  # a FIFO is refused, not skipped
    record = read_run_record(path)
    cfg = config_from_record(record, f"{path}/{RUN_CONFIG}")
    if isinstance(cfg.model, CharLMConfig):
      model, step, windows = restore_run(path, step=step,
                                         mesh=make_mesh((1, 1), jax.devices()[:1]))
      return model, {**info, "kind": "workdir", "step": step, "windows": list(windows)}
    cls = run_model_class(record, cfg.model)
    model, step, _ = checkpoint.restore_model_and_meta(
        lambda: cls(cfg.model, rngs=nnx.Rngs(0)), path, step=step)
    return model, {**info, "kind": "workdir", "step": step}
  if step is not None:
    raise ValueError(f"--step {step}: {path} is not a training workdir (no {RUN_CONFIG}), so it "
                     f"holds one model, not checkpoints by step")
  if not os.path.lexists(os.path.join(path, checkpoint.MODEL_JSON)):
    raise FileNotFoundError(f"{path} holds no {RUN_CONFIG} (training workdir) or "
                            f"{checkpoint.MODEL_JSON} (model checkpoint)")
  return checkpoint.load_model(path), {**info, "kind": "checkpoint"}
