"""What a training run is: its kind, and its record read as the kind the caller expects. The
tasks import this module; none of it imports a task (`tasks.trained` restores a run's model,
whatever its task).

    _, cfg = runs.read_run("runs/char_tiny", "charlm")  # ValueError: a run of another kind
"""

from __future__ import annotations

import os

__all__ = ["KINDS", "read_run", "run_kind", "run_task"]

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
  return "finetune" if run_task(record) is not None else "mlm"


def run_task(record: dict) -> str | None:
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
    names = {"task": run_task(record), "workdir": os.fspath(workdir)}
    what, origin, command = (text.format(**names) for text in KINDS[found])
    raise ValueError(f"{os.fspath(workdir)} is {what} ({origin}), not {KINDS[kind][0]}; score "
                     f"it with {command}")
  return record, config_from_record(record, f"{os.fspath(workdir)}/{RUN_CONFIG}")
