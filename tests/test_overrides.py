"""`--set path=value` overrides (longformer_jax.training.overrides) and the config checks they
rely on: values parse to their field's type, all overrides are applied before the config is
validated (so order does not matter), and every error names the field, the value and what was
expected. No training: everything here runs in well under a second, the CLI test in a few."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from longformer_jax.config import CharLMConfig
from longformer_jax.training import Stage, TrainConfig, apply_overrides
from longformer_jax.training.overrides import parse_value
from longformer_jax.cli.settings import load_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "train" / "configs"


@pytest.fixture(scope="module")
def small():
  return load_config(str(CONFIGS / "char_small.py"))


@pytest.fixture(scope="module")
def tiny():
  return load_config(str(CONFIGS / "char_tiny.py"))


# --- values parse to the field's type ------------------------------------------------------


@pytest.mark.parametrize("assignment, error, match", [
    # Parsing: the full dotted path, the expected type and the text.
    ("stages.0.steps=abc", ValueError,
     r"--set stages\.0\.steps='abc': expected int, got 'abc'"),
    ("weight_decay=abc", ValueError, r"--set weight_decay='abc': expected float, got 'abc'"),
    ("async_checkpoints=flase", ValueError,
     r"--set async_checkpoints='flase': expected bool, got 'flase'"),
    ("checkpoint_every=1.5", ValueError,
     r"--set checkpoint_every='1\.5': expected int, got '1\.5'"),
    ("stages.-1.batch_size=True", ValueError, r"stages\.-1\.batch_size='True': expected int"),
    ("eval_tokens=many", ValueError, r"eval_tokens='many': expected int \| None"),
    ("mesh_shape=(1, 1.5)", ValueError,
     r"mesh_shape='\(1, 1\.5\)': expected tuple\[int, \.\.\.\], got .* \(1\.5 is not of type "
     r"int\)"),
    ("stages.0=(1, 2)", ValueError, r"--set stages\.0='\(1, 2\)': expected Stage"),
    # Ranges: the config's own checks, with the assignment that led there.
    ("clip_norm=-1", ValueError,
     r"TrainConfig\.clip_norm must be > 0, got -1\.0 \(with --set clip_norm=-1\)"),
    ("checkpoint_every=0", ValueError, r"TrainConfig\.checkpoint_every must be >= 1, got 0"),
    ("adam_b2=1", ValueError, r"TrainConfig\.adam_b2 must be >= 0 and < 1, got 1\.0"),
    ("stages.0.learning_rate=0", ValueError, r"Stage\.learning_rate must be > 0, got 0\.0"),
    # Model fields: the model config's own checks.
    ("model.dtype=int8", ValueError, r"dtype=int8 must be a floating dtype"),
    ("model.param_dtype=abc", TypeError, r"param_dtype='abc' is not a dtype"),
    ("model.remat=maybe", ValueError, r"model\.remat='maybe': expected bool"),
    ("model.attention_window=(8, 8)", ValueError,
     r"attention_window has 2 entries, expected 12: \(8, 8\)"),
])
def test_bad_values_name_the_field(small, assignment, error, match):
  with pytest.raises(error, match=match):
    apply_overrides(small, [assignment])


@pytest.mark.parametrize("assignment, match", [
    ("model.hiden=3",
     r"--set model\.hiden: unknown field 'hiden' in CharLMConfig; fields: \['attention', "),
    ("hiden=3", r"unknown field 'hiden' in TrainConfig; fields: \[.*'adam_b1'"),
    ("stages.5.steps=1", r"index '5' is not in a tuple of length 5 \(stages\.5\)"),
    ("stages.-6.steps=1", r"index '-6' is not in a tuple of length 5"),
    ("stages.first.steps=1", r"index 'first' is not in a tuple of length 5"),
    ("data_dir.x=1", r"--set data_dir\.x: data_dir is None, so it has nothing to set"),
    ("dataset.x=1", r"--set dataset\.x: dataset='enwik8' has no fields, indices or keys"),
    ("final_eval.nokey.x=1",
     r"--set final_eval\.nokey\.x: final_eval\.nokey is not a key of a dict with keys "
     r"\['split', 'protocol', "),
    ("model.hidden_dropout_prob", r"--set expects path=value, got 'model\.hidden_dropout_prob'"),
])
def test_bad_paths_name_the_problem(small, assignment, match):
  with pytest.raises(ValueError, match=match):
    apply_overrides(small, [assignment])


@pytest.mark.parametrize("text, expected", [
    ("true", True), ("True", True), ("TRUE", True), ("yes", True), ("Yes", True), ("1", True),
    ("false", False), ("False", False), ("no", False), ("NO", False), ("0", False),
])
def test_bool_spellings(tiny, text, expected):
  assert apply_overrides(tiny, [f"async_checkpoints={text}"]).async_checkpoints is expected


@pytest.mark.parametrize("text", ["flase", "2", "on", "", "None", "1.0"])
def test_bool_rejects_anything_else(tiny, text):
  with pytest.raises(ValueError, match=r"async_checkpoints=.*expected bool"):
    apply_overrides(tiny, [f"async_checkpoints={text}"])


def test_numbers(tiny):
  cfg = apply_overrides(tiny, ["weight_decay=0", "clip_norm=1", "stages.0.learning_rate=3e-4",
                               "seed=3", "eval_every=1_000"])
  assert cfg.weight_decay == 0.0 and isinstance(cfg.weight_decay, float)
  assert cfg.clip_norm == 1.0 and isinstance(cfg.clip_norm, float)
  assert cfg.stages[0].learning_rate == 3e-4
  assert cfg.seed == 3 and cfg.eval_every == 1000
  for text in ("1.5", "abc", "True", "1e3", "(1,)"):
    with pytest.raises(ValueError, match=rf"--set seed={re.escape(repr(text))}: expected int"):
      apply_overrides(tiny, [f"seed={text}"])
  for text in ("abc", "inf", "True", "(1,)"):
    with pytest.raises(ValueError, match=r"expected float"):
      apply_overrides(tiny, [f"clip_norm={text}"])


@pytest.mark.parametrize("text", ["None", "none", "null"])
def test_none(tiny, text):
  cfg = apply_overrides(tiny, [f"eval_tokens={text}", f"stages.0.end_learning_rate={text}",
                               f"final_eval={text}", f"data_dir={text}"])
  assert cfg.eval_tokens is None and cfg.stages[0].end_learning_rate is None
  assert cfg.final_eval is None and cfg.data_dir is None
  with pytest.raises(ValueError, match=r"--set checkpoint_every=.*: expected int"):
    apply_overrides(tiny, [f"checkpoint_every={text}"])  # not optional


def test_strings_are_taken_as_written(tiny):
  cfg = apply_overrides(tiny, ["dataset=text8", "data_dir=/tmp/my data"])
  assert cfg.dataset == "text8" and cfg.data_dir == "/tmp/my data"
  assert apply_overrides(tiny, ["dataset='text8'"]).dataset == "text8"  # quotes come off
  assert apply_overrides(tiny, ["data_dir=123"]).data_dir == "123"  # a name, not an int


@pytest.mark.parametrize("text", ["(2, 1)", "[2, 1]", "2,1", " 2, 1 ", "(2, 1,)"])
def test_tuple_spellings(tiny, text):
  assert apply_overrides(tiny, [f"mesh_shape={text}"]).mesh_shape == (2, 1)
  windows = text.replace("2", "8, 8, 8")
  assert apply_overrides(tiny, [f"stages.0.windows={windows}"]).stages[0].windows == (8, 8, 8, 1)


def test_one_value_of_a_tuple_of_any_length(tiny):
  from longformer_jax.tasks.finetune import FinetuneOptions
  assert apply_overrides(FinetuneOptions(), ["length_buckets=4096"]).length_buckets == (4096,)
  assert apply_overrides(tiny, ["stages.0.windows=None"]).stages[0].windows is None
  with pytest.raises(ValueError, match=r"mesh_shape='x': expected tuple\[int, \.\.\.\]"):
    apply_overrides(tiny, ["mesh_shape=x"])


def test_tuples_are_checked_and_indexed(small):
  cfg = apply_overrides(small, ["stages.0.windows=None", "mesh_shape.1=4",
                                "stages.-1.windows.-1=4096", "mesh_shape=(-1, 2, 2)"])
  assert cfg.stages[0].windows is None and cfg.stage_windows(0) == small.model.layer_windows
  assert cfg.mesh_shape == (-1, 2, 2)  # the later assignment of the same field wins
  assert cfg.stages[4].windows[-1] == 4096
  assert cfg.stages[4].windows[:-1] == small.stages[4].windows[:-1]
  with pytest.raises(ValueError, match=r"stages\.0\.windows='\(8, x\)': expected "
                     r"tuple\[int, \.\.\.\] \| None"):
    apply_overrides(small, ["stages.0.windows=(8, x)"])


def test_negative_indices(small):
  cfg = apply_overrides(small, ["stages.-1.batch_size=32", "stages.-5.batch_size=64",
                                "stages.-1.steps=7", "stages.-1.warmup_steps=2"])
  assert [s.batch_size for s in cfg.stages] == [64, 32, 16, 16, 32]
  assert (cfg.stages[4].steps, cfg.stages[4].warmup_steps) == (7, 2)
  assert cfg.stages[:4][1:] == small.stages[1:4]


def test_model_fields(small):
  cfg = apply_overrides(small, ["model.dtype=float32", "model.param_dtype=bfloat16",
                                "model.attention_window=64", "model.remat=true",
                                "model.hidden_dropout_prob=0", "model.rope_base=5e5",
                                "model.attention_dilation.0=(1, 1, 1, 1, 1, 1, 2, 2)"])
  model = cfg.model
  assert isinstance(model, CharLMConfig)
  assert model.dtype == jnp.float32 and model.param_dtype == jnp.bfloat16
  assert model.layer_windows == (64,) * 12 and model.remat is True
  assert model.hidden_dropout_prob == 0.0 and model.rope_base == 5e5
  assert model.attention_dilation[0] == (1,) * 6 + (2, 2)
  assert model.attention_dilation[1:] == small.model.attention_dilation[1:]
  windows = tuple(range(8, 20))
  assert apply_overrides(small, [f"model.attention_window={list(windows)}"]
                         ).model.layer_windows == windows
  assert apply_overrides(small, ["model.attention_window.3=5"]).model.attention_window[3] == 5
  assert apply_overrides(small, []) is small


def test_dicts(small):
  cfg = apply_overrides(small, ["final_eval.context=4096", "final_eval.split=validation",
                                "final_eval.new_key=(1, 2)"])
  assert cfg.final_eval == {**small.final_eval, "context": 4096, "split": "validation",
                            "new_key": (1, 2)}
  assert small.final_eval["context"] == 32256  # the original is left alone
  cfg = apply_overrides(small, ["final_eval={'split': 'test', 'context': 512}"])
  assert cfg.final_eval == {"split": "test", "context": 512}
  with pytest.raises(ValueError, match=r"final_eval='\[1\]': expected dict\[str, Any\] \| None"):
    apply_overrides(small, ["final_eval=[1]"])


@pytest.mark.parametrize("order", [1, -1])
def test_order_does_not_matter(small, order):
  # Phase 1 of char_small warms up for 10,000 steps: shortening it needs the warm-up lowered
  # too, and the stage is validated once, with both changes.
  assert small.stages[0].warmup_steps == 10_000
  sets = ["stages.0.steps=5", "stages.0.warmup_steps=0", "microbatch_size=None",
          "stages.0.batch_size=3"][::order]
  cfg = apply_overrides(small, sets)
  assert (cfg.stages[0].steps, cfg.stages[0].warmup_steps, cfg.stages[0].batch_size) == (5, 0, 3)
  assert cfg.microbatch_size is None and cfg.stages[1:] == small.stages[1:]


def test_the_final_config_is_validated(small):
  # Each alone is fine; together the stage is invalid.
  with pytest.raises(ValueError, match=r"Stage\.warmup_steps must be in \[0, steps=5\], got "
                     r"6 \(with --set stages\.0\.steps=5 --set stages\.0\.warmup_steps=6\)"):
    apply_overrides(small, ["stages.0.steps=5", "stages.0.warmup_steps=6"])
  with pytest.raises(ValueError, match=r"stages\[0\]\.batch_size=3 is not a multiple of "
                     r"microbatch_size=16"):
    apply_overrides(small, ["stages.0.batch_size=3"])


def test_parse_value_of_unions():
  window = int | tuple
  assert parse_value("32", window) == 32
  assert parse_value("(1, 2)", window) == (1, 2)
  assert parse_value("[[1, 2], [3, 4]]", window) == ((1, 2), (3, 4))  # nested lists: tuples
  with pytest.raises(ValueError, match=r"--set w='x': expected int \| tuple, got 'x'"):
    parse_value("x", window, "w")
  assert parse_value("3", float | None) == 3.0
  assert parse_value("null", float | None) is None
  assert parse_value("(1, 'a')", tuple[int, str]) == (1, "a")
  with pytest.raises(ValueError, match=r"expected tuple\[int, str\], got '\(1, 2, 3\)'"):
    parse_value("(1, 2, 3)", tuple[int, str])


# --- the config classes check their own fields ----------------------------------------------


def _stage(**kw):
  return Stage(**{**dict(seq_len=16, batch_size=4, steps=3, learning_rate=1e-3), **kw})


def _config(**kw):
  return TrainConfig(**{**dict(model=CharLMConfig.tiny(), stages=(_stage(),)), **kw})


@pytest.mark.parametrize("name", ["seq_len", "batch_size", "steps", "warmup_steps"])
@pytest.mark.parametrize("bad", ["3", 3.0, True, None])
def test_stage_ints_are_ints(name, bad):
  with pytest.raises(TypeError,
                     match=rf"Stage\.{name} must be an int, got {re.escape(repr(bad))}"):
    _stage(**{name: bad})


@pytest.mark.parametrize("name", ["seed", "log_every", "eval_every", "checkpoint_every",
                                  "keep_checkpoints", "eval_batch_size", "microbatch_size",
                                  "eval_tokens"])
@pytest.mark.parametrize("bad", ["2", 2.0, True])
def test_train_config_ints_are_ints(name, bad):
  with pytest.raises(TypeError,
                     match=rf"TrainConfig\.{name} must be an int, got {re.escape(repr(bad))}"):
    _config(**{name: bad})


@pytest.mark.parametrize("name", ["weight_decay", "clip_norm", "adam_b1", "adam_b2", "adam_eps"])
def test_train_config_floats_are_finite_reals(name):
  for bad in ["0.1", True, None]:
    with pytest.raises(TypeError, match=rf"TrainConfig\.{name} must be a real number, got "
                       + re.escape(repr(bad))):
      _config(**{name: bad})
  for bad in [math.nan, math.inf]:
    with pytest.raises(ValueError, match=rf"TrainConfig\.{name} must be finite, got {bad}"):
      _config(**{name: bad})
  assert getattr(_config(**{name: 0.5}), name) == 0.5


@pytest.mark.parametrize("field, bad, match", [
    ("clip_norm", 0.0, r"TrainConfig\.clip_norm must be > 0, got 0\.0"),
    ("clip_norm", -1, r"TrainConfig\.clip_norm must be > 0, got -1"),
    ("weight_decay", -0.1, r"TrainConfig\.weight_decay must be >= 0, got -0\.1"),
    ("adam_b1", 1.0, r"TrainConfig\.adam_b1 must be >= 0 and < 1, got 1\.0"),
    ("adam_b2", -0.5, r"TrainConfig\.adam_b2 must be >= 0 and < 1, got -0\.5"),
    ("adam_eps", 0, r"TrainConfig\.adam_eps must be > 0, got 0"),
    ("eval_tokens", 0, r"TrainConfig\.eval_tokens must be >= 1, got 0"),
    ("eval_batch_size", 0, r"TrainConfig\.eval_batch_size must be >= 1, got 0"),
    ("checkpoint_every", 0, r"TrainConfig\.checkpoint_every must be >= 1, got 0"),
    ("microbatch_size", 0, r"TrainConfig\.microbatch_size must be >= 1, got 0"),
    ("seed", -1, r"TrainConfig\.seed must be >= 0, got -1"),
])
def test_train_config_ranges(field, bad, match):
  with pytest.raises(ValueError, match=match):
    _config(**{field: bad})


def test_train_config_other_types():
  with pytest.raises(TypeError, match=r"TrainConfig\.async_checkpoints must be a bool, got "
                     r"'false'"):
    _config(async_checkpoints="false")
  with pytest.raises(TypeError, match=r"TrainConfig\.dataset must be a str, got 8"):
    _config(dataset=8)
  with pytest.raises(TypeError, match=r"TrainConfig\.stages\[0\] must be a Stage, got \{"):
    _config(stages=({"seq_len": 16},))
  cfg = _config(eval_tokens=None, microbatch_size=None, adam_b1=0, seed=0)
  assert cfg.eval_tokens is None and cfg.adam_b1 == 0


def test_stage_ranges():
  for bad in [0, -1e-3, math.nan, math.inf]:
    with pytest.raises(ValueError, match=r"Stage\.learning_rate must be"):
      _stage(learning_rate=bad)
  with pytest.raises(ValueError, match=r"Stage\.end_learning_rate must be >= 0, got -1"):
    _stage(end_learning_rate=-1)
  with pytest.raises(TypeError, match=r"Stage\.end_learning_rate must be a real number"):
    _stage(end_learning_rate="0")
  assert _stage(end_learning_rate=0).end_learning_rate == 0
  with pytest.raises(ValueError, match=r"Stage\.steps must be >= 1, got 0"):
    _stage(steps=0)


# --- the CLI ----------------------------------------------------------------------------------


def test_cli_bad_override_is_one_line_and_status_2():
  """The override fails before any data is read or model built: exit status 2, one line on
  stderr naming the field, no traceback."""
  env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(
      [sys.executable, "-m", "train.charlm", "--config", "train/configs/char_tiny.py",
       "--set", "checkpoint_every=1.5", "--workdir", os.devnull + "/never"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert lines == ["train.charlm: error: --set checkpoint_every='1.5': expected int, got '1.5'"], (
      proc.stderr[-2000:])
  assert proc.stdout == ""
