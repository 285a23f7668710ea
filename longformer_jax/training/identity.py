"""A run's identity: the settings that determine what it computes, fixed when it starts.

A run is stored as a record: the `TrainConfig` as JSON (`config_record`) plus a fingerprint of
its training data (`Task.data_identity`). The record is written to `<workdir>/run_config.json`
when the run starts (and never rewritten once the run has a checkpoint: a record without any is
a failed start's, which the next start replaces), and with every checkpoint (the settings that
produced it). A resume is compared with the record of the checkpoint it continues from, before
anything is written (`check_resume`); every difference is sorted into one of four kinds:

  * free, never reported: how the run is executed, logged, checkpointed and evaluated
    (`FREE`: the mesh, gradient accumulation, log/eval/checkpoint intervals, final_eval, ...);
  * allowed: the number of steps of the stage being trained and of later stages (extending or
    shortening a run, never below the step reached; the steps taken keep their learning rates
    and the decay goes on from there, `schedule.continued_stages`), stages added or removed
    after it, and anything of a stage that has not started yet;
  * on request only (`allow`, the CLI's `--allow-change FIELD`): the optimiser and schedule
    values of stages already started (`ON_REQUEST`), e.g. a lower learning rate after a
    divergence;
  * refused, always: everything else (the model, the dataset and its fingerprint, the seed, the
    sequence length, batch size and windows of started stages). A run with a different model or
    data is a new run: it belongs in another workdir.

The files around the checkpoints are checked against the record too, before a run resumes or is
evaluated (`RunFileError`, one line naming the file, what the run recorded and what is there):
run_config.json against the record sealed (with its SHA-256) into the newest checkpoint's meta
(`check_record_file`: every field that fixes the run must agree), and the files named by their
SHA-256 in the record, e.g. a tokenizer (`check_checksum`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

# Top-level TrainConfig fields that do not change what a run computes (to float rounding: the
# mesh and accumulation change the order of sums), only how it runs and reports.
FREE = frozenset({
    "log_every", "read_every", "eval_every", "eval_tokens", "eval_batch_size", "checkpoint_every",
    "keep_checkpoints", "async_checkpoints", "final_eval", "mesh_shape", "logical_rules",
    "microbatch_size", "data_dir",
})
# Fields of the data's identity that say where the data was, not what it is (its length and
# SHA-256 do): free as well.
FREE_KEYS = frozenset({"data.data_file"})
# Optimiser settings, and the fields of a started stage, that may change when asked for.
ON_REQUEST = frozenset({"weight_decay", "clip_norm", "adam_b1", "adam_b2", "adam_eps"})
ON_REQUEST_STAGE = frozenset({"learning_rate", "end_learning_rate", "warmup_steps"})
# Stage fields the loop keeps itself (from the run's record), never compared.
KEPT_BY_LOOP = frozenset({"step_changes"})
# Fields added to TrainConfig after runs were recorded without them: a record that lacks one
# ran with this value (the default, which reproduces what those runs computed).
ADDED_LATER = {"trainable": None}


class RunMismatchError(ValueError):
  """A resume whose settings differ from the run's in what determines it. One line listing every
  differing field with its old and new value."""


class RunFileError(ValueError):
  """A file a run's numbers depend on (its run_config.json, its tokenizer) is not the one the run
  recorded: one line naming the file, what was recorded and what is there. An input problem
  (the commands' exit status 2), found before anything is computed or written."""


def _flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in record.items():
    if isinstance(value, Mapping) and value:
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _same(a: Any, b: Any) -> bool:
  # Records come from JSON (lists) or from a live config (tuples).
  normal = lambda x: [normal(v) for v in x] if isinstance(x, (list, tuple)) else x
  return normal(a) == normal(b)


def _on_request(key: str) -> bool:
  return key in ON_REQUEST or (key.startswith("stages.")
                               and key.rsplit(".", 1)[-1] in ON_REQUEST_STAGE)


def _change(key: str, old: Any, new: Any) -> str:
  return f"{key}: {old!r} -> {new!r}"


def check_resume(stored: Mapping[str, Any], new: Mapping[str, Any], *, step: int,
                 allow: Iterable[str] = (), where: str = "") -> list[str]:
  """Checks a resume at `step` with record `new` against the run's `stored` record.

  Returns the accepted changes ("field: old -> new"); raises RunMismatchError naming every
  refused one. allow: dotted field names (as the error prints them) of `ON_REQUEST` fields that
  may change; naming any other field is itself an error.
  """
  allow = set(allow)
  refused, accepted = [], []
  old_stages, new_stages = list(stored["stages"]), list(new["stages"])
  old_flat = _flatten({**ADDED_LATER, **{k: v for k, v in stored.items() if k != "stages"}})
  new_flat = _flatten({**ADDED_LATER, **{k: v for k, v in new.items() if k != "stages"}})
  for key in sorted(set(old_flat) | set(new_flat)):
    old, value = old_flat.get(key, "<missing>"), new_flat.get(key, "<missing>")
    if _same(old, value) or key.split(".")[0] in FREE or key in FREE_KEYS:
      continue
    (accepted if _on_request(key) and key in allow else refused).append(
        _change(key, old, value))

  start = 0
  for i, (old, value) in enumerate(itertools.zip_longest(old_stages, new_stages)):
    started = old is not None and start < step
    old_end = start + (old["steps"] if old is not None else 0)
    if old is None:
      accepted.append(f"stages.{i} added")
    elif value is None:
      (refused if started else accepted).append(f"stages.{i} removed")
    elif not started:
      accepted += [_change(f"stages.{i}.{k}", old[k], value.get(k)) for k in old
                   if k not in KEPT_BY_LOOP and not _same(old[k], value.get(k))]
    else:
      for k in sorted(set(old) | set(value)):
        key, a, b = f"stages.{i}.{k}", old.get(k), value.get(k)
        if k in KEPT_BY_LOOP or _same(a, b):
          continue
        if k == "steps":
          # Stage boundaries already passed stay where they are; the stage reached may end
          # anywhere from the current step on.
          ok = old_end >= step and start + b >= step
          (accepted if ok else refused).append(
              _change(key, a, b) + ("" if ok else f" (step {step} is past that)"))
        else:
          (accepted if _on_request(key) and key in allow else refused).append(
              _change(key, a, b))
    start = old_end if old is not None else start

  unknown = sorted(k for k in allow if not _on_request(k))
  if unknown:
    raise RunMismatchError(
        f"cannot allow changes to {', '.join(unknown)}: only the optimiser and schedule values "
        f"{sorted(ON_REQUEST)} and stages.N.{{{', '.join(sorted(ON_REQUEST_STAGE))}}} may "
        "change within a run; a different model or data is a new run (use another workdir)")
  if refused:
    optional = [c.split(":")[0] for c in refused if _on_request(c.split(":")[0])]
    hint = (f" To change {', '.join(optional)} on purpose, allow it (--allow-change FIELD, or "
            "train(..., allow_changes=[...]))." if optional else "")
    raise RunMismatchError(
        f"cannot resume{where}: these settings differ from the run's at step {step}: "
        f"{'; '.join(refused)}. The model, the data and the stages already trained are fixed "
        f"within a run; start a new run in another workdir.{hint}")
  return accepted


def _fixed(record: Mapping[str, Any]) -> dict[str, Any]:
  """The flattened fields of a run record that no resume may change: all but the `FREE` and
  `ON_REQUEST` ones, and of the stages only the first one's (it has started by the first
  checkpoint), but for its steps and schedule values. A later stage may change until it starts,
  so its values in the record a run started with need not be those of a later checkpoint."""
  flat = _flatten({**ADDED_LATER, **{k: v for k, v in record.items() if k != "stages"}})
  first = (list(record.get("stages") or []) or [{}])[0]
  flat.update({f"stages.0.{k}": v for k, v in first.items()
               if k != "steps" and k not in ON_REQUEST_STAGE and k not in KEPT_BY_LOOP})
  return {k: v for k, v in flat.items()
          if k.split(".")[0] not in FREE and k not in FREE_KEYS and k not in ON_REQUEST}


def check_record_file(found: Mapping[str, Any], sealed: Mapping[str, Any], *, path: str,
                      step: int) -> None:
  """Raises RunFileError when `found` (the record of a run_config.json at `path`) differs from
  `sealed` (the run record of checkpoint `step`'s meta, sealed with its SHA-256) in a field
  that fixes the run (`_fixed`): the file was changed after the run started. The first three
  differing fields are named with both values."""
  mine, theirs = _fixed(found), _fixed(sealed)
  differ = [k for k in sorted(set(mine) | set(theirs))
            if not _same(mine.get(k, "<missing>"), theirs.get(k, "<missing>"))]
  if differ:
    shown = "; ".join(f"{k} is {mine.get(k, '<missing>')!r} there, {theirs.get(k, '<missing>')!r}"
                      f" in the run's record" for k in differ[:3])
    more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
    raise RunFileError(
        f"{path} is not the run's record: {shown}{more} (sealed into checkpoint step {step}). "
        "It was changed after the run started; put the run's values back")


def check_checksum(what: str, recorded: str | None, found: str, remedy: str = "") -> None:
  """Raises RunFileError naming `what` when the SHA-256 `found` of a file is not the one the run
  `recorded` (None: nothing recorded, an older run's record: not checked)."""
  if recorded is not None and found != recorded:
    raise RunFileError(f"{what} has sha256 {found[:16]}..., the run recorded {recorded[:16]}..."
                       + (f": {remedy}" if remedy else ""))
