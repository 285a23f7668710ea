"""The entry points (`longformer_jax.commands`, their settings by `longformer_jax.cli.settings`):
every installed command resolves and answers --help
and --print-config without training; config files load, --set overrides reach any field and
reject bad ones, the distributed flags reach `jax.distributed.initialize`."""

import argparse
import importlib
import json
import os
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longformer_jax.training import TrainConfig
from longformer_jax.training.overrides import apply_overrides
from longformer_jax.cli.settings import load_config
from longformer_jax.commands.run import add_distributed_args, initialize_distributed

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parents[1]
CONFIGS = ROOT / "train" / "configs"


def _scripts() -> dict[str, str]:
  with open(ROOT / "pyproject.toml", "rb") as f:
    return tomllib.load(f)["project"]["scripts"]


def _entry_point(target: str):
  module, _, name = target.partition(":")
  return importlib.import_module(module), getattr(importlib.import_module(module), name)


def test_every_script_resolves_to_a_main_and_has_a_python_m_shim():
  scripts = _scripts()
  assert len(scripts) == 8
  for command, target in scripts.items():
    module, main = _entry_point(target)
    assert callable(main), command
    # longformer-train-charlm <-> longformer_jax.commands.train_charlm <-> python -m train.charlm
    kind, name = command.removeprefix("longformer-").split("-", 1)
    assert module.__name__ == f"longformer_jax.commands.{kind}_{name}"
    assert f"from longformer_jax.commands.{kind}_{name} import main" in (
        ROOT / kind / f"{name}.py").read_text()


@pytest.mark.parametrize("command", sorted(_scripts()))
def test_help_lists_the_settings(command, capsys):
  _, main = _entry_point(_scripts()[command])
  with pytest.raises(SystemExit) as exit_info:
    main(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  assert "--print-config" in out
  if command == "longformer-eval-bpc":  # the presets, with their settings
    assert "paper: context=32256, stride=512" in " ".join(out.split())
  if command == "longformer-train-mlm":  # the default: the first try, not the paper's run
    assert "(default: mlm_tiny)" in " ".join(out.split())
  if "-train-" in command:  # the settings, with their types and defaults
    assert "settings (--set PATH=VALUE" in out and "  stages.N.learning_rate: float" in out
    assert "  eval_every: int = 500" in out and "--distributed" in out


def _print_config_argv(command: str, tmp_path: Path) -> list[str]:
  """A command line of `command` that resolves without training (tiny inputs)."""
  records = tmp_path / "records.jsonl"
  records.write_text("".join(json.dumps({"input_ids": [5, 6, 7], "label": i % 2}) + "\n"
                             for i in range(4)))
  workdir = ["--workdir", str(tmp_path / "run")]
  return {
      "longformer-train-charlm": ["--config", str(CONFIGS / "char_tiny.py"),
                                  "--set", "stages.0.steps=700"],
      "longformer-train-mlm": ["--data", "text8_sample"],  # the default preset
      "longformer-train-finetune": ["--task", "classification", "--model", "tiny", "--train",
                                    str(records), "--max-length", "16", "--steps", "7",
                                    "--set", "global_attention=none", "--baseline", "segments",
                                    "--length-buckets", "4", "8"],
      "longformer-train-seq2seq": None,
      "longformer-eval-bpc": [],
      "longformer-eval-mlm": [],
      "longformer-eval-sample": ["--prompt", "The "],
      "longformer-eval-export": ["--out", str(tmp_path / "x.zip"), "--seq-len", "8"],
  }[command] + workdir


@pytest.mark.parametrize("command", sorted(set(_scripts()) - {"longformer-train-seq2seq"}))
def test_print_config_prints_the_settings_and_writes_nothing(command, capsys, tmp_path):
  _, main = _entry_point(_scripts()[command])
  argv = _print_config_argv(command, tmp_path)
  assert main(argv + ["--print-config"]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert not (tmp_path / "run").exists() and not (tmp_path / "x.zip").exists()
  if command == "longformer-train-charlm":
    assert printed["config"]["stages"][0]["steps"] == 700
  elif command == "longformer-train-mlm":  # mlm_tiny's 300 steps, not the paper's 65,000
    assert printed["config"]["dataset"] == "text8_sample"
    assert printed["config"]["stages"][0]["steps"] == 300
    assert printed["workdir"] == str(tmp_path / "run")
  elif command == "longformer-train-finetune":  # the task's options beside the TrainConfig
    assert printed["options"]["global_attention"] == "none"
    assert printed["settings"]["options"]["global_attention"] == "none"
    # Flags of the nested options: --baseline is options.baseline.
    assert printed["options"]["baseline"] == "segments"
    assert printed["options"]["length_buckets"] == [4, 8]
    assert printed["config"]["stages"][0]["seq_len"] == 16
    assert printed["config"]["model"]["num_labels"] == 2
  else:
    assert printed["inputs"]["workdir"] == str(tmp_path / "run")


def _toy_pairs(tmp_path: Path) -> Path:
  """A word-level tokenizer.json of six tokens and one (source, target) pair, in tmp_path."""
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import models
  vocab = {t: i for i, t in enumerate(("<s>", "<pad>", "</s>", "<unk>", "a", "b"))}
  tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(
      str(tmp_path / "tokenizer.json"))
  pairs = tmp_path / "pairs.jsonl"
  pairs.write_text(json.dumps({"source": "a b", "target": "b"}) + "\n")
  return pairs


def test_seq2seq_print_config(capsys, tmp_path):
  pairs = _toy_pairs(tmp_path)
  _, main = _entry_point(_scripts()["longformer-train-seq2seq"])
  assert main(["--model", "tiny", "--tokenizer", str(tmp_path / "tokenizer.json"), "--train",
               str(pairs), "--max-source-length", "16", "--max-target-length", "8",
               "--num-beams", "2", "--workdir", str(tmp_path / "run"), "--print-config"]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert printed["config"]["final_eval"] == {"num_beams": 2, "max_new_tokens": 8}
  assert printed["config"]["model"]["vocab_size"] == 6
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["char_tiny", "char_small", "char_large"])
def test_configs_load_and_document_their_command(name):
  path = CONFIGS / f"{name}.py"
  cfg = load_config(str(path))
  assert isinstance(cfg, TrainConfig)
  assert f"python -m train.charlm --config train/configs/{name}.py" in path.read_text()
  if name != "char_tiny":  # the paper's 5 stages: lengths double (capped at 23,040), lr halves
    assert [s.seq_len for s in cfg.stages] == [2048, 4096, 8192, 16384, 23040]
    assert [s.learning_rate for s in cfg.stages] == [2.5e-4 / 2**i for i in range(5)]
    assert [cfg.stage_windows(i)[0] for i in range(5)] == [32, 64, 128, 256, 512]
    # Paper Appendix B, Table 12: batch sizes, steps per phase, warm-up 10% capped at 10K.
    steps = {"char_small": [430_000, 50_000, 50_000, 35_000, 5_000],
             "char_large": [350_000, 25_000, 10_000, 5_000, 5_000]}[name]
    assert [s.batch_size for s in cfg.stages] == [32, 32, 16, 16, 16]
    assert [s.steps for s in cfg.stages] == steps
    assert [s.warmup_steps for s in cfg.stages] == [min(n // 10, 10_000) for n in steps]
    assert cfg.clip_norm == 0.25 and cfg.weight_decay == 0.01


def test_overrides_walk_dataclasses_tuples_and_dicts():
  cfg = load_config(str(CONFIGS / "char_small.py"))
  # Shortening a stage below its warm-up (10K steps in phase 1) needs the warm-up set too.
  cfg = apply_overrides(cfg, ["stages.0.warmup_steps=300", "stages.0.steps=3000",
                              "stages.-1.batch_size=32", "model.hidden_dropout_prob=0.3",
                              "model.dtype=float32", "dataset=text8",
                              "final_eval.context=4096", "mesh_shape=[2, 4]"])
  assert cfg.stages[0].steps == 3000 and cfg.stages[0].warmup_steps == 300
  assert cfg.stages[4].batch_size == 32
  assert cfg.model.hidden_dropout_prob == 0.3 and cfg.dataset == "text8"
  assert cfg.model.dtype == jnp.float32
  assert cfg.final_eval["context"] == 4096 and cfg.mesh_shape == (2, 4)


@pytest.mark.parametrize("assignment, match", [
    ("model.hiden=3", "unknown field 'hiden'"),
    ("stages.9.steps=1", "index '9' is not in a tuple of length 5"),
    ("model.hidden_dropout_prob", "expects path=value"),
    ("model.num_attention_heads=7", "not a multiple of num_attention_heads=7"),
    ("model.dropout=0.1", "unknown field 'dropout'"),
])
def test_bad_overrides_name_the_problem(assignment, match):
  with pytest.raises(ValueError, match=match):
    apply_overrides(load_config(str(CONFIGS / "char_small.py")), [assignment])


_JAX_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
            "TPU_WORKER_HOSTNAMES", "SLURM_NTASKS")


def _initialize(monkeypatch, argv, **env):
  """(kwargs of jax.distributed.initialize or None, config updates) for the CLI flags `argv`."""
  calls, updates = [], []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
  for name in _JAX_ENV:
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  parser = argparse.ArgumentParser()
  add_distributed_args(parser)
  initialize_distributed(parser.parse_args(argv))
  assert len(calls) <= 1
  return (calls[0] if calls else None), updates


def test_distributed_flags_and_environment_reach_jax(monkeypatch):
  gloo = [("jax_cpu_collectives_implementation", "gloo")]  # the tests run on the CPU
  argv = ["--distributed", "on", "--coordinator-address", "localhost:1234", "--num-processes",
          "2", "--process-id", "1"]
  assert _initialize(monkeypatch, argv) == (
      dict(coordinator_address="localhost:1234", num_processes=2, process_id=1), gloo)
  # jax 0.12 reads only the coordinator address from the environment; the other two are ours.
  env = dict(JAX_COORDINATOR_ADDRESS="host:9", JAX_NUM_PROCESSES="4", JAX_PROCESS_ID="3")
  assert _initialize(monkeypatch, [], **env) == (
      dict(coordinator_address="host:9", num_processes=4, process_id=3), gloo)
  # A TPU slice (or SLURM, Open MPI): JAX finds everything itself.
  assert _initialize(monkeypatch, ["--distributed", "on"]) == ({}, gloo)
  assert _initialize(monkeypatch, []) == (None, [])
  assert _initialize(monkeypatch, ["--distributed", "off"], **env) == (None, [])
  with pytest.raises(ValueError, match="JAX_PROCESS_ID='one' is not an integer"):
    _initialize(monkeypatch, ["--distributed", "on"], JAX_PROCESS_ID="one")


def _printed(command: str, argv: list[str], capsys) -> dict:
  """The JSON `command` prints for `argv --print-config` (status 0)."""
  _, main = _entry_point(_scripts()[command])
  assert main(argv + ["--print-config"]) == 0
  return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", ["char_tiny", "char_small", "char_large"])
def test_char_presets_are_their_config_files(name, capsys, tmp_path):
  workdir = ["--workdir", str(tmp_path / "run")]
  by_preset = _printed("longformer-train-charlm", ["--preset", name] + workdir, capsys)
  by_file = _printed("longformer-train-charlm",
                     ["--config", str(CONFIGS / f"{name}.py")] + workdir, capsys)
  assert by_preset == by_file


@pytest.mark.parametrize("command", ["longformer-train-charlm", "longformer-train-finetune",
                                     "longformer-train-seq2seq", "longformer-train-mlm"])
def test_unknown_preset_is_one_line_and_status_2(command, capsys):
  _, main = _entry_point(_scripts()[command])
  with pytest.raises(SystemExit) as exit_info:
    main(["--preset", "nope", "--print-config"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "unknown preset 'nope'" in err


def test_finetune_settings_resolve_config_then_flags_then_set(capsys, tmp_path):
  records = tmp_path / "records.jsonl"
  records.write_text("".join(json.dumps({"input_ids": [5, 6, 7], "label": i % 3}) + "\n"
                             for i in range(6)))
  config = tmp_path / "qa_config.py"
  config.write_text(
      "from longformer_jax.commands.train_finetune import FinetuneConfig\n"
      "from longformer_jax.tasks.finetune import FinetuneOptions\n"
      "def get_config():\n"
      "  return FinetuneConfig(task='classification', model='tiny', steps=20, max_length=16,\n"
      "                        batch_size=4, train_overrides=('stages.0.warmup_steps=3',),\n"
      "                        options=FinetuneOptions(global_attention='none'))\n")
  base = ["--config", str(config), "--train", str(records), "--workdir", str(tmp_path / "run")]
  printed = _printed("longformer-train-finetune", base, capsys)
  stage = printed["config"]["stages"][0]
  assert (stage["steps"], stage["seq_len"], stage["batch_size"], stage["warmup_steps"]) == (
      20, 16, 4, 3)
  assert printed["options"]["global_attention"] == "none"
  assert printed["config"]["model"]["num_labels"] == 3
  assert printed["settings"]["task"] == "classification" and printed["settings"]["steps"] == 20
  assert printed["inputs"]["train"] == str(records)
  # A flag overrides the config's value; --set comes last, over flags and the config's paths.
  printed = _printed("longformer-train-finetune",
                     base + ["--steps", "7", "--batch-size", "2", "--set", "stages.0.steps=9",
                             "--set", "stages.0.warmup_steps=1"], capsys)
  stage = printed["config"]["stages"][0]
  assert (stage["steps"], stage["batch_size"], stage["warmup_steps"]) == (9, 2, 1)
  assert printed["settings"]["steps"] == 7
  # The preset (train/configs/finetune_tiny.py), --task and the files from the command line.
  printed = _printed("longformer-train-finetune",
                     ["--preset", "finetune_tiny", "--task", "classification", "--train",
                      str(records), "--workdir", str(tmp_path / "run")], capsys)
  stage = printed["config"]["stages"][0]
  assert (stage["steps"], stage["seq_len"], stage["learning_rate"]) == (150, 128, 3e-3)
  assert printed["config"]["model"]["hidden_size"] == 64  # the tiny model
  assert not (tmp_path / "run").exists()
  # Inputs refused in one line, status 2, before anything is written: a validation label the
  # training records never name (the head is sized by them, 3 classes), and a tokenizer without
  # <s> and <pad> (its ids 0 and 1 are ordinary tokens, which the rows would take for them).
  valid = tmp_path / "valid.jsonl"
  valid.write_text(json.dumps({"input_ids": [5], "label": 1}) + "\n"
                   + json.dumps({"input_ids": [6], "label": 7}) + "\n")
  from tokenizers import Tokenizer, models
  Tokenizer(models.WordLevel({"a": 0, "b": 1, "</s>": 2, "<unk>": 3}, unk_token="<unk>")).save(
      str(tmp_path / "tokenizer.json"))
  _, main = _entry_point(_scripts()["longformer-train-finetune"])
  for extra, message in (
      (["--validation", str(valid)], f"{valid}:2: field 'label' is 7, not one of the model's "
                                     f"num_labels=3 classes 0..2"),
      (["--tokenizer", str(tmp_path / "tokenizer.json")],
       "the tokenizer has no <s>, <pad> token(s): the model needs <s>, <pad>, </s>")):
    with pytest.raises(SystemExit) as exit_info:
      main(base + extra + ["--print-config"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err, err
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("setting, message", [
    ("steps=0", "steps must be >= 1, got 0"),
    ("task='poetry'", "task must be one of"),
    ("train_overrides=('stages.0.stepz=3',)", "unknown field 'stepz'"),
    ("stepz=3", "unexpected keyword argument 'stepz'"),
])
def test_a_bad_setting_of_a_config_is_one_line_and_status_2(setting, message, capsys,
                                                            tmp_path):
  config = tmp_path / "bad.py"
  config.write_text("from longformer_jax.commands.train_finetune import FinetuneConfig\n"
                    "def get_config():\n  return FinetuneConfig(**{'task': 'qa', "
                    f"'model': 'tiny', **dict({setting})}})\n")
  _, main = _entry_point(_scripts()["longformer-train-finetune"])
  with pytest.raises(SystemExit) as exit_info:
    main(["--config", str(config), "--train", "x.jsonl", "--print-config", "--workdir",
          str(tmp_path / "run")])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and message in err, err


def test_seq2seq_settings_resolve_preset_then_flags_then_set(capsys, tmp_path):
  pairs = _toy_pairs(tmp_path)
  base = ["--preset", "seq2seq_tiny", "--tokenizer", str(tmp_path / "tokenizer.json"),
          "--train", str(pairs), "--workdir", str(tmp_path / "run")]
  printed = _printed("longformer-train-seq2seq", base, capsys)
  stage = printed["config"]["stages"][0]
  assert (stage["steps"], stage["seq_len"], stage["batch_size"]) == (300, 12, 16)
  assert printed["config"]["final_eval"]["max_new_tokens"] == 10
  printed = _printed("longformer-train-seq2seq",
                     base + ["--steps", "5", "--max-source-length", "16", "--set",
                             "stages.0.steps=6"], capsys)
  stage = printed["config"]["stages"][0]
  assert (stage["steps"], stage["seq_len"]) == (6, 16)
  # A config file that starts from the preset.
  config = tmp_path / "led.py"
  config.write_text("import dataclasses\n"
                    "from longformer_jax.cli.settings import load_config\n"
                    "def get_config():\n"
                    f"  tiny = load_config({str(CONFIGS / 'seq2seq_tiny.py')!r})\n"
                    "  return dataclasses.replace(tiny, num_beams=2,\n"
                    "                             train_overrides=('eval_every=7',))\n")
  printed = _printed("longformer-train-seq2seq",
                     ["--config", str(config)] + base[2:] + ["--num-beams", "3"], capsys)
  assert printed["config"]["final_eval"]["num_beams"] == 3
  assert printed["config"]["eval_every"] == 7
  assert not (tmp_path / "run").exists()


def _eval_settings(command: str, tmp_path: Path) -> tuple[str, list[str], dict]:
  """(a config file of `command`, its inputs then flags then --set over it, the settings they
  resolve to): each step overrides one setting of the step before."""
  run, out = str(tmp_path / "run"), str(tmp_path / "x.zip")
  module, cls, fields, argv, expected = {
      "longformer-eval-bpc": (
          "eval_bpc", "BpcConfig", "context=1024, stride=256, batch_size=2",
          ["--workdir", run, "--stride", "128", "--batch-size", "3", "--set", "batch_size=4"],
          {"context": 1024, "stride": 128, "batch_size": 4}),
      "longformer-eval-mlm": (
          "eval_mlm", "MLMEvalConfig", "split='validation', batch_size=2, max_tokens=100",
          ["--workdir", run, "--batch-size", "3", "--max-tokens", "200", "--set",
           "max_tokens=300"],
          {"split": "validation", "batch_size": 3, "max_tokens": 300}),
      "longformer-eval-sample": (
          "eval_sample", "SampleConfig", "temperature=0.5, top_k=4",
          ["--workdir", run, "--prompt", "a", "--temperature", "0.7", "--top-k", "5", "--set",
           "top_k=6"],
          {"temperature": 0.7, "top_k": 6}),
      "longformer-eval-export": (
          "eval_export", "ExportConfig", "seq_len=(8, 16), batch_size=2, num_beams=2",
          ["--workdir", run, "--out", out, "--batch-size", "3", "--num-beams", "3", "--set",
           "num_beams=4"],
          {"seq_len": [8, 16], "batch_size": 3, "num_beams": 4}),
  }[command]
  path = tmp_path / "eval_config.py"
  path.write_text(f"from longformer_jax.commands.{module} import {cls}\n"
                  f"def get_config():\n  return {cls}({fields})\n")
  return str(path), argv, expected


EVAL_COMMANDS = sorted(c for c in _scripts() if "-eval-" in c)


@pytest.mark.parametrize("command", EVAL_COMMANDS)
def test_eval_settings_resolve_config_then_flags_then_set(command, capsys, tmp_path):
  config, argv, expected = _eval_settings(command, tmp_path)
  printed = _printed(command, ["--config", config] + argv, capsys)
  assert {k: printed["settings"][k] for k in expected} == expected
  assert printed["inputs"]["workdir"] == str(tmp_path / "run")
  assert not {"config", "preset", "set", "print_config"} & set(printed["inputs"])
  assert not (tmp_path / "run").exists() and not (tmp_path / "x.zip").exists()


def _usage_error(command: str, argv: list[str], capsys) -> str:
  """The one line `command` writes for `argv --print-config`, exiting with status 2."""
  _, main = _entry_point(_scripts()[command])
  with pytest.raises(SystemExit) as exit_info:
    main(argv + ["--print-config"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith(f"{command.removeprefix('longformer-')}"
                                                 .replace("-", ".") + ": error: ")
  return err


@pytest.mark.parametrize("command, bad, message", [
    ("longformer-eval-bpc", "context=abc", "--set context='abc': expected int | None"),
    ("longformer-eval-mlm", "split=dev", "split must be one of train, validation, test"),
    ("longformer-eval-sample", "top_k=x", "--set top_k='x': expected int | None"),
    ("longformer-eval-export", "seq_len=8,0", "seq_len: must be >= 1, got 0"),
])
def test_eval_set_of_an_unknown_name_or_a_bad_value_is_one_line_and_status_2(
    command, bad, message, capsys, tmp_path):
  config, argv, _ = _eval_settings(command, tmp_path)
  base = ["--config", config] + argv
  err = _usage_error(command, base + ["--set", "contxt=1"], capsys)
  assert "--set contxt: unknown field 'contxt' in " in err and "; fields: [" in err
  assert message in _usage_error(command, base + ["--set", bad], capsys)


@pytest.mark.parametrize("command", EVAL_COMMANDS)
def test_eval_config_of_another_form_is_one_line_and_status_2(command, capsys, tmp_path):
  _, argv, _ = _eval_settings(command, tmp_path)
  path = tmp_path / "mapping.py"
  path.write_text("def get_config():\n  return {'batch_size': 3}\n")
  assert f"--config {path} gives a dict; " in _usage_error(
      command, ["--config", str(path)] + argv, capsys)


def test_eval_bpc_presets(capsys, tmp_path):
  workdir = ["--workdir", str(tmp_path / "run")]
  defaults = _printed("longformer-eval-bpc", workdir, capsys)["settings"]
  # Without a preset: the run's own context and stride, known once its checkpoint is read.
  assert (defaults["context"], defaults["stride"], defaults["protocol"]) == (None, None,
                                                                             "sliding")
  assert _printed("longformer-eval-bpc", workdir + ["--preset", "paper"], capsys)[
      "settings"] == {**defaults, "context": 32256, "stride": 512}
  quick = _printed("longformer-eval-bpc", workdir + ["--preset", "quick", "--stride", "64"],
                   capsys)["settings"]
  assert quick == {**defaults, "context": 1024, "stride": 64}
  # --file replaces the config's dataset; given both on the command line, they are refused.
  config = tmp_path / "enwik8.py"
  config.write_text("from longformer_jax.commands.eval_bpc import BpcConfig\n"
                    "def get_config():\n  return BpcConfig(dataset='enwik8')\n")
  printed = _printed("longformer-eval-bpc", ["--config", str(config), "--file", "a.txt"]
                     + workdir, capsys)
  assert (printed["settings"]["dataset"], printed["inputs"]["file"]) == (None, "a.txt")
  assert "do not go together" in _usage_error(
      "longformer-eval-bpc", workdir + ["--dataset", "enwik8", "--file", "a.txt"], capsys)
  assert "required: --workdir" in _usage_error("longformer-eval-bpc", ["--preset", "quick"],
                                               capsys)


# ----------------------------------------------------------------------------------------------
# Bad command lines, settings and inputs: one line, refused before any work


def _refused(command: str, argv: list[str], capsys, status: int = 2) -> str:
  """The one stderr line `command` writes for `argv`, ending with `status` (2: a `<prog>:
  error:` line; 1: an `error:` line)."""
  _, main = _entry_point(_scripts()[command])
  capsys.readouterr()
  try:
    code = main(argv)
  except SystemExit as e:
    code = e.code
  assert code == status
  err = capsys.readouterr().err
  prog = command.removeprefix("longformer-").replace("-", ".")
  assert err.count("\n") == 1, err
  assert err.startswith(f"{prog}: error: " if status == 2 else "error: "), err
  return err


def _char_run(tmp_path: Path) -> Path:
  """A workdir holding a char-LM run's record only (what the eval commands read first)."""
  from longformer_jax.tasks import charlm
  from longformer_jax.training import write_run_config
  workdir = tmp_path / "char_run"
  write_run_config(workdir, charlm.char_tiny())
  return workdir


def _charlm_argv(tmp_path: Path, workdir: Path, *extra: str) -> list[str]:
  """A train.charlm command line of `testing.CHARLM_RUN_CONFIG` (seconds of training, should a
  check that ought to refuse it let it through)."""
  import testing
  config, data = tmp_path / "charlm_config.py", tmp_path / "data.bin"
  config.write_text(testing.CHARLM_RUN_CONFIG)
  data.write_bytes(bytes(range(256)) * 80)
  return ["--config", str(config), "--data-file", str(data), "--workdir", str(workdir),
          "--no-progress", *extra]


def test_text_that_is_not_text_names_the_file_and_line(capsys, tmp_path):
  # A JSON escape of half a UTF-16 pair: valid JSON, no text (a whole pair is fine).
  pairs = _toy_pairs(tmp_path)
  pairs.write_text('{"source": "a \\ud83d\\ude00", "target": "b"}\n'
                   '{"source": "a \\ud800 b", "target": "b"}\n')
  argv = ["--model", "tiny", "--tokenizer", str(tmp_path / "tokenizer.json"), "--train",
          str(pairs), "--max-source-length", "16", "--max-target-length", "8", "--workdir",
          str(tmp_path / "run")]
  err = _refused("longformer-train-seq2seq", argv, capsys)
  assert f"{pairs}:2: field 'source' holds a lone surrogate '\\ud800'" in err
  # A corpus byte that is not UTF-8.
  corpus = tmp_path / "corpus.txt"
  corpus.write_bytes(b"good line\nbad \xff line\n")
  err = _refused("longformer-train-mlm", ["--preset", "mlm_tiny", "--data", str(corpus),
                                          "--workdir", str(tmp_path / "run")], capsys)
  assert f"{corpus}:2: is not UTF-8 (byte 5 of the line: b'\\xff')" in err
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("source, message", [
    ("missing.txt", "text source '{path}' is not a dataset name"),
    ("empty.txt", "text source '{path}' holds no text (0 bytes)"),
    ("blank.txt", "text source '{path}' holds no text (3 bytes)"),
    ("empty_dir", "text directory '{path}' holds no *.txt files"),
])
def test_mlm_data_that_is_missing_or_empty_is_refused_before_any_work(source, message, capsys,
                                                                      tmp_path):
  path = tmp_path / source
  if source == "empty.txt":
    path.write_bytes(b"")
  elif source == "blank.txt":
    path.write_bytes(b" \n\n")
  elif source == "empty_dir":
    path.mkdir()
  err = _refused("longformer-train-mlm", ["--preset", "mlm_tiny", "--data", str(path),
                                          "--workdir", str(tmp_path / "run")], capsys)
  assert message.format(path=path) in err
  assert not (tmp_path / "run").exists()  # no tokenizer trained or written, no workdir left


@pytest.mark.parametrize("command, flag", [("longformer-train-mlm", "--init"),
                                           ("longformer-train-finetune", "--model")])
def test_a_truncated_safetensors_file_is_one_line(command, flag, capsys, tmp_path):
  from safetensors.numpy import save_file
  model = tmp_path / "roberta"
  model.mkdir()
  (model / "config.json").write_text(json.dumps(
      {"model_type": "roberta", "vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 1,
       "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 18}))
  save_file({"w": np.zeros((64, 64), np.float32)}, str(model / "model.safetensors"))
  whole = (model / "model.safetensors").read_bytes()
  (model / "model.safetensors").write_bytes(whole[:len(whole) // 2])
  records = tmp_path / "records.jsonl"
  records.write_text(json.dumps({"input_ids": [5, 6], "label": 0}) + "\n")
  argv = {"longformer-train-mlm": ["--preset", "mlm_tiny"],
          "longformer-train-finetune": ["--task", "classification", "--train", str(records)],
          }[command] + [flag, str(model), "--workdir", str(tmp_path / "run")]
  err = _refused(command, argv, capsys)
  assert f"{model / 'model.safetensors'} is not a readable safetensors file" in err


def test_a_workdir_that_is_a_file_or_cannot_be_written_is_refused(capsys, tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  err = _refused("longformer-train-charlm", _charlm_argv(tmp_path, a_file), capsys)
  assert f"--workdir {a_file} is a file, not a directory" in err
  err = _refused("longformer-train-charlm", _charlm_argv(tmp_path, a_file / "run"), capsys)
  assert f"--workdir {a_file / 'run'} cannot be written" in err


def test_a_read_only_workdir_is_refused(capsys, tmp_path):
  read_only = tmp_path / "read_only"
  read_only.mkdir(mode=0o555)
  if os.access(read_only, os.W_OK):
    pytest.skip("this user (root) writes into a read-only directory")
  err = _refused("longformer-train-charlm", _charlm_argv(tmp_path, read_only), capsys)
  assert f"--workdir {read_only} cannot be written: Permission denied" in err


def test_a_full_disk_at_the_workdir_lock_is_one_error_and_leaves_no_workdir(capsys, tmp_path,
                                                                             monkeypatch):
  """The lock's pid, the first byte a run writes, finds no room (ENOSPC, in the helper every
  append goes through): one `error:` line, status 1, and the workdir the command made is gone
  (an empty workdir used to be left behind, after a traceback)."""
  import errno
  from longformer_jax import io as lj_io

  def full(file, text):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(lj_io, "_append", full)
  workdir = tmp_path / "runs" / "new"
  err = _refused("longformer-train-charlm", _charlm_argv(tmp_path, workdir), capsys, status=1)
  assert err == f"error: cannot write {workdir / '.lock'}: No space left on device\n"
  assert not workdir.exists()


def test_a_mesh_that_does_not_fit_the_devices_is_refused_before_any_work(capsys, tmp_path):
  devices = len(jax.devices())
  argv = _charlm_argv(tmp_path, tmp_path / "run", "--set", f"mesh_shape=[{devices + 1}, 1]")
  err = _refused("longformer-train-charlm", argv, capsys)
  assert (f"mesh_shape ({devices + 1}, 1) -> (data={devices + 1}, fsdp=1, seq=1) does not use "
          f"the {devices} devices") in err
  assert not (tmp_path / "run").exists()


def test_a_second_job_on_a_workdir_is_refused_while_the_first_holds_it(capsys, tmp_path):
  import fcntl
  workdir = tmp_path / "run"
  workdir.mkdir()
  # The first job: a lock on the workdir's lock file, as `workdir_lock` takes it.
  with open(workdir / ".lock", "w") as held:
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    held.write("4242\n")
    held.flush()
    err = _refused("longformer-train-charlm", _charlm_argv(tmp_path, workdir), capsys, status=1)
  assert f"--workdir {workdir} is in use by another job (pid 4242)" in err
  assert [p.name for p in workdir.iterdir()] == [".lock"]  # nothing else was written


@pytest.mark.parametrize("command, argv, message", [
    ("longformer-train-seq2seq", ["--set", "final_eval.num_beams=0"],
     "final_eval: num_beams must be an int >= 1, got 0"),
    ("longformer-train-seq2seq", ["--set", "final_eval.beams=2"],
     "final_eval has unknown settings ['beams']"),
    ("longformer-train-charlm", ["--set", "final_eval={'context': 64, 'stride': 128}"],
     "final_eval: stride must be in [1, context=64], got 128"),
    ("longformer-train-mlm", ["--set", "final_eval.max_tokens=-5"],
     "final_eval: max_tokens must be >= 1, got -5"),
    ("longformer-train-mlm", ["--set", "final_eval.split=dev"],
     "final_eval.split must be one of ('train', 'validation', 'test'), got 'dev'"),
])
def test_final_eval_settings_are_checked_before_training(command, argv, message, capsys,
                                                        tmp_path):
  workdir = tmp_path / "run"
  base = {
      "longformer-train-seq2seq": lambda: [
          "--model", "tiny", "--tokenizer", str(tmp_path / "tokenizer.json"), "--train",
          str(_toy_pairs(tmp_path)), "--max-source-length", "16", "--max-target-length", "8",
          "--workdir", str(workdir)],
      "longformer-train-charlm": lambda: _charlm_argv(tmp_path, workdir),
      "longformer-train-mlm": lambda: ["--preset", "mlm_tiny", "--workdir", str(workdir)],
  }[command]()
  assert message in _refused(command, base + argv, capsys)
  assert not workdir.exists()


@pytest.mark.parametrize("argv, message", [
    (["--context", "0"], "context must be >= 1, got 0 (with --context 0)"),
    (["--stride", "0"], "stride must be >= 1, got 0 (with --stride 0)"),
    (["--batch-size", "0"], "batch_size must be >= 1, got 0 (with --batch-size 0)"),
    (["--max-bytes", "-5"], "max_bytes must be >= 1, got -5 (with --max-bytes -5)"),
    (["--context", "64", "--stride", "128"], "stride must be in [1, context=64], got 128"),
    (["--stride", "64", "--score-last", "32"], "score_last=32 differs from stride=64"),
    (["--file", "{tmp}/missing.txt"], "--file {tmp}/missing.txt: no such file"),
    (["--file", "{tmp}/one_byte.txt"], "{tmp}/one_byte.txt holds 1 byte(s) to score"),
    (["--file", "{tmp}/one_byte.txt", "--output", "{tmp}/one_byte.txt/x.json"],
     "cannot write the output {tmp}/one_byte.txt/x.json"),
])
def test_eval_bpc_refuses_bad_settings_and_inputs_before_evaluating(argv, message, capsys,
                                                                   tmp_path):
  (tmp_path / "one_byte.txt").write_bytes(b"a")
  if "--output" in argv:
    (tmp_path / "one_byte.txt").write_bytes(b"abc")
  argv = [a.format(tmp=tmp_path) for a in argv]
  err = _refused("longformer-eval-bpc", ["--workdir", str(_char_run(tmp_path)), *argv], capsys)
  assert message.format(tmp=tmp_path) in err


def test_eval_mlm_refuses_a_negative_max_tokens(capsys, tmp_path):
  err = _refused("longformer-eval-mlm", ["--workdir", str(tmp_path), "--max-tokens", "-5"],
                 capsys)
  assert "max_tokens must be >= 1, got -5 (with --max-tokens -5)" in err


def test_eval_sample_refuses_a_prompt_that_is_not_text(capsys, tmp_path):
  err = _refused("longformer-eval-sample", ["--workdir", str(tmp_path), "--prompt", "a\ud800"],
                 capsys)
  assert "--prompt holds '\\ud800' at character 1, a lone surrogate" in err


_RECORDS = {
    "mlm": {"model_config_class": "LongformerConfig", "data": {"mask_rate": 0.15}},
    "finetune": {"model_config_class": "LongformerConfig", "data": {"task": "qa"}},
    "seq2seq": {"model_config_class": "LEDConfig", "data": {}},
}


@pytest.mark.parametrize("command, argv, kind, message", [
    ("longformer-eval-mlm", [], "finetune",
     "{run} is a fine-tuning run (train.finetune --task qa), not an MLM run; score it with "
     "python -m train.finetune --eval-only --task qa --workdir {run}"),
    ("longformer-eval-bpc", [], "mlm",
     "{run} is an MLM run (train.mlm), not a char-LM run; score it with python -m eval.mlm "
     "--workdir {run}"),
    ("longformer-eval-sample", ["--prompt", "a"], "seq2seq",
     "{run} is a seq2seq run (train.seq2seq), not a char-LM run; score it with python -m "
     "eval.export --workdir {run}"),
    ("longformer-eval-mlm", [], "char",
     "{run} is a char-LM run (train.charlm), not an MLM run; score it with python -m eval.bpc"),
])
def test_an_eval_command_on_another_kind_of_run_says_what_the_run_is(command, argv, kind,
                                                                    message, capsys, tmp_path):
  if kind == "char":
    run = _char_run(tmp_path)
  else:
    run = tmp_path / kind
    run.mkdir()
    (run / "run_config.json").write_text(json.dumps(_RECORDS[kind]))
  err = _refused(command, ["--workdir", str(run), *argv], capsys)
  assert message.format(run=run) in err


def test_train_charlm_refuses_bytes_outside_the_vocabulary(capsys, tmp_path):
  """A model of 128 bytes on a file of every byte trained into NaN and "lower the learning
  rate": refused before training, naming the first byte outside and its position."""
  workdir = tmp_path / "run"
  err = _refused("longformer-train-charlm",
                 _charlm_argv(tmp_path, workdir, "--set", "model.vocab_size=128"), capsys)
  assert (f"{tmp_path / 'data.bin'} (train split) holds byte 128 at position 128 (9,216 bytes "
          f">= 128); the model's vocabulary is bytes 0..127 (vocab_size=128)") in err, err
  assert not (workdir / "checkpoints").exists()
