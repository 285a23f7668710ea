"""What a training run is, and its model whatever its task (what `eval.export` serves).

    model, info = runs.load_model("runs/qa")          # a training workdir, or
    model, info = runs.load_model("exported_model/")  # a model checkpoint (`save_model`)
    _, cfg = runs.read_run("runs/char_tiny", "charlm")  # ValueError: a run of another kind
"""

from __future__ import annotations

import os

__all__ = ["KINDS", "load_model", "read_run", "run_kind", "run_model_class"]

# The kinds of training run: what it is, the command that trained it and the one that scores it
# ({task} and {workdir}: the run's).
KINDS = {
    "charlm": ("a char-LM run", "train.charlm",
               "python -m eval.bpc (or eval.sample) --workdir {workdir}"),
    "mlm": ("an MLM run", "train.mlm", "python -m eval.mlm --workdir {workdir}"),
    "finetune": ("a fine-tuning run", "train.finetune --task {task}",
                 "python -m train.finetune --eval-only --task {task} --workdir {workdir} "
                 "--validation FILE (or --test FILE)"),
    "seq2seq": ("a seq2seq run", "train.seq2seq", "python -m eval.export --workdir {workdir}"),
}


def run_kind(record: dict) -> str:
  """The kind of training run (a key of `KINDS`) of a run record (run_config.json): the char
  LM's and LED's model configs name theirs; of the Longformer runs, a fine-tuning one names its
  task."""
  name = record.get("model_config_class")
  if name == "CharLMConfig":
    return "charlm"
  if name == "LEDConfig":
    return "seq2seq"
  return "finetune" if _task(record) is not None else "mlm"


def _task(record: dict) -> str | None:
  """The fine-tuning task a run record names (None: none, or not a name)."""
  data = record.get("data")
  task = data.get("task") if isinstance(data, dict) else None
  return task if isinstance(task, str) else None


def read_run(workdir, kind: str):
  """(run record, `TrainConfig`) of the training run in `workdir`, a run of `kind` (a key of
  `KINDS`).
  Raises FileNotFoundError when `workdir` holds no run, and ValueError saying what the run is
  and which command scores it when it is a run of another kind."""
  from longformer_jax.training.config import RUN_CONFIG, config_from_record, read_run_record
  record = read_run_record(workdir)
  found = run_kind(record)
  if found != kind:
    names = {"task": _task(record), "workdir": os.fspath(workdir)}
    what, origin, command = (text.format(**names) for text in KINDS[found])
    raise ValueError(f"{os.fspath(workdir)} is {what} ({origin}), not {KINDS[kind][0]}; score "
                     f"it with {command}")
  return record, config_from_record(record, f"{os.fspath(workdir)}/{RUN_CONFIG}")


def run_model_class(record: dict, model_config):
  """The class a training run of `model_config` trained, by its run record: a fine-tuning run's
  task head, an MLM run's masked LM, a seq2seq run's LED (the char LM is restored apart, with
  its windows)."""
  from longformer_jax import led, modeling
  from longformer_jax.config import LEDConfig, LongformerConfig
  from longformer_jax.tasks.finetune import MODEL_CLASSES as TASK_CLASSES
  if isinstance(model_config, LEDConfig):
    return led.LEDForConditionalGeneration
  if isinstance(model_config, LongformerConfig):
    # A fine-tuning run names its task; an MLM run's model is a masked LM.
    return TASK_CLASSES.get(_task(record), modeling.LongformerForMaskedLM)
  raise ValueError(f"a run of a {type(model_config).__name__} model cannot be exported")


def load_model(path: str, step: int | None = None):
  """(model, info) of a training workdir or a model checkpoint directory; info: JSON facts for
  the manifest ("source", "kind", "step", and the char LM's "windows")."""
  import jax
  from flax import nnx
  from longformer_jax import checkpoint
  from longformer_jax.config import CharLMConfig
  from longformer_jax.training import config_from_record, make_mesh
  from longformer_jax.training.config import RUN_CONFIG, read_run_record
  info = {"source": os.fspath(path)}
  if os.path.lexists(os.path.join(path, RUN_CONFIG)):  # a FIFO is refused, not skipped
    record = read_run_record(path)
    cfg = config_from_record(record, f"{path}/{RUN_CONFIG}")
    if isinstance(cfg.model, CharLMConfig):
      from longformer_jax.tasks.charlm import restore_run
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
