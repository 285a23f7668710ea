"""Checkpoints, HF directories and run records made by someone else are data: opening one runs no
code, reads nothing outside its directory, never blocks on a FIFO, and refuses (one ValueError
naming the file, the field and the value) what does not fit, before anything is allocated.

Each test crafts its own file and shows the refusal (what loaded, hung or crashed before); the
gadget test names every module-level function and class of the package in a model.json, with a
recomputed seal, and only the allow-listed model and config classes load.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import pkgutil
import shutil
import struct
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import longformer_jax
from longformer_jax import checkpoint, convert, modeling
from longformer_jax.config import CharLMConfig, LEDConfig, LongformerConfig
from longformer_jax.coref import CorefConfig
from longformer_jax.io import open_regular, read_json
from longformer_jax.training.config import config_from_record, config_record
from testing import ROOT, subprocess_env

pytestmark = pytest.mark.unit

TINY = LongformerConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=20, type_vocab_size=1,
                        attention_window=2, attention_impl="reference")
TINY_CONFIGS = {
    "longformer_jax.config:LongformerConfig": TINY,
    "longformer_jax.config:CharLMConfig": CharLMConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=24,
        attention_window=2),
    "longformer_jax.config:LEDConfig": LEDConfig.tiny(d_model=16, vocab_size=32,
                                                      encoder_ffn_dim=24, decoder_ffn_dim=24),
    "longformer_jax.coref:CorefConfig": CorefConfig.tiny(encoder=TINY),
}


# ----------------------------------------------------------------------------------------------
# Project model checkpoints (model.json).


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
  """A real model checkpoint of a tiny LongformerModel."""
  path = tmp_path_factory.mktemp("ckpt") / "model"
  checkpoint.save_model(path, modeling.LongformerModel(TINY, rngs=nnx.Rngs(0)))
  return path


def _craft(saved, tmp_path, **changes):
  """A copy of the checkpoint whose model.json has `changes` (None: field removed) and a seal
  recomputed for them, as anyone can."""
  path = tmp_path / "crafted"
  if not path.exists():
    shutil.copytree(saved, path)
  meta = json.loads((saved / checkpoint.MODEL_JSON).read_text())
  meta.pop("sha256")
  for key, value in changes.items():
    if value is None:
      meta.pop(key, None)
    else:
      meta[key] = value
  (path / checkpoint.MODEL_JSON).write_text(json.dumps(checkpoint._seal(meta)))
  return path


def _public_callables():
  """(path, object) of every module-level function and class defined in the package."""
  found = []
  for info in pkgutil.walk_packages(longformer_jax.__path__, "longformer_jax."):
    module = importlib.import_module(info.name)
    for obj in vars(module).values():
      if ((inspect.isfunction(obj) or inspect.isclass(obj))
          and getattr(obj, "__module__", None) == info.name):
        found.append((f"{info.name}:{obj.__qualname__}", obj))
  return found


def test_gadget_only_the_allow_list_loads(saved_model, tmp_path):
  """Before: model.json could name any class or function of the package (and call it with its
  JSON: `cli.settings:load_config` ran a Python file shipped in the directory). After: every one
  of them is refused as model_class and as config_class, with the seal recomputed; only the
  allow-list's entries resolve."""
  callables = _public_callables()
  assert len(callables) > 300  # the walk found the package
  good_model = "longformer_jax.modeling:LongformerModel"
  good_config = "longformer_jax.config:LongformerConfig"
  loaded = []
  for path, _ in callables:
    for field, other, good in (("model_class", "config_class", good_config),
                               ("config_class", "model_class", good_model)):
      crafted = _craft(saved_model, tmp_path, init_kwargs={}, **{field: path, other: good})
      try:
        checkpoint._model_classes(checkpoint._model_meta(checkpoint._orbax_path(crafted)),
                                  "model.json")
      except ValueError as e:
        # A model class of the allow-list is refused for the config it is given.
        assert "model.json: " in str(e) and ("model_class=" in str(e)
                                            or "config_class=" in str(e)), str(e)
      else:
        loaded.append((field, path))
  # Only the allow-list loads: the Longformer model classes (with a LongformerConfig), and as
  # the config of a LongformerModel only its LongformerConfig.
  expected = [("model_class", m) for m, (c, _) in checkpoint.MODEL_CLASSES.items()
              if c == good_config] + [("config_class", good_config)]
  assert sorted(loaded) == sorted(expected) and len(expected) == 9
  # Every allow-listed entry resolves to its class and builds (abstractly) from its config.
  for model_path, (config_path, _) in checkpoint.MODEL_CLASSES.items():
    config = TINY_CONFIGS[config_path]
    meta = {"format_version": 2, "model_class": model_path, "config_class": config_path,
            "config": config.to_dict(), "init_kwargs": {}, "checksums": {"params": {}}}
    model_class, built = checkpoint._model_classes(
        checkpoint._check_model_meta(meta, "model.json"), "model.json")
    assert checkpoint._class_path(model_class) == model_path and built == config
    nnx.eval_shape(lambda: model_class(built, rngs=nnx.Rngs(0)))
  assert sum(1 for p, _ in callables if p in checkpoint.MODEL_CLASSES) == len(
      checkpoint.MODEL_CLASSES)  # every entry is a class of the package


def test_the_load_config_gadget_runs_nothing(saved_model, tmp_path):
  """Before: `load_model` imported `longformer_jax.cli.settings:load_config` and ran evil.py, and
  the error blamed a `--config` nobody gave. After: refused, nothing ran, the error names the
  file and the field."""
  crafted = _craft(saved_model, tmp_path)
  marker = tmp_path / "ran"
  (crafted / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\n"
                                   "def get_config():\n  return None\n")
  crafted = _craft(saved_model, tmp_path, model_class="longformer_jax.cli.settings:load_config",
                   config_class="longformer_jax.cli.settings:load_config",
                   config={"path": str(crafted / "evil.py")})
  with pytest.raises(ValueError) as e:
    checkpoint.load_model(crafted)
  assert not marker.exists()
  assert "--config" not in str(e.value)
  assert str(e.value).startswith(f"{crafted}/model.json: model_class=")
  # The same through the atomic_write gadget: no file is written.
  target = tmp_path / "written"
  crafted = _craft(saved_model, tmp_path, model_class="longformer_jax.io:atomic_write",
                   config={"path": str(target), "data": "x"})
  with pytest.raises(ValueError, match="model_class='longformer_jax.io:atomic_write' is not"):
    checkpoint.load_model(crafted)
  assert not target.exists()


@pytest.mark.parametrize("changes, message", [
    (dict(init_kwargs={"rngs": 1}), r"init_kwargs\.rngs: a .*LongformerModel takes "
                                     r"\['add_pooling_layer'\]"),
    (dict(init_kwargs={"add_pooling_layer": "yes"}),
     r"init_kwargs\.add_pooling_layer='yes' must be a bool"),
    (dict(init_kwargs=[1]), "init_kwargs must be a JSON object, got list"),
    (dict(config_class="longformer_jax.config:LEDConfig"),
     "config_class='longformer_jax.config:LEDConfig'; a longformer_jax.modeling:LongformerModel "
     "takes 'longformer_jax.config:LongformerConfig'"),
    (dict(config=[1, 2]), "config must be a JSON object"),
    (dict(config={**TINY.to_dict(), "num_hidden_layers": 10**9}),
     "config: num_hidden_layers=1000000000 is over this library's bound of 1024"),
    (dict(config={**TINY.to_dict(), "layer_norm_eps": -1}),
     r"config: layer_norm_eps must be a finite number > 0, got -1"),
    (dict(config={**TINY.to_dict(), "hidden_size": "16"}),
     "config: hidden_size='16' must be an int"),
    (dict(config={**TINY.to_dict(), "dtype": {"names": ["a"]}}), "config: dtype=.* is not a dtype"),
    (dict(config={**TINY.to_dict(), "evil": 1}), r"config: unknown LongformerConfig fields"),
    (dict(extra=1), r"unknown fields \['extra'\]"),
    (dict(checksums={"params": {"a": "../x"}}), "checksums must be"),
    (dict(model_class=["longformer_jax.modeling:LongformerModel"]), "model_class=.* is not one"),
])
def test_crafted_model_json_fields_are_refused(saved_model, tmp_path, changes, message):
  """Before: init_kwargs went to the constructor as given, num_hidden_layers=10**9 built a list
  of 10**9 entries, eps=-1 made every output NaN. After: each field is checked before anything
  is built; the error names the file and the field (the seal is recomputed: it is no
  signature)."""
  crafted = _craft(saved_model, tmp_path, **changes)
  with pytest.raises(ValueError, match=message) as e:
    checkpoint.load_model(crafted)
  assert str(e.value).startswith(f"{crafted}/model.json: ")
  assert len(str(e.value).splitlines()) == 1


def test_model_json_that_is_no_regular_file_or_no_object(saved_model, tmp_path):
  """A FIFO model.json would block `load_model` forever; a list or deep nesting crashed."""
  crafted = _craft(saved_model, tmp_path)
  meta = crafted / checkpoint.MODEL_JSON
  meta.unlink()
  os.mkfifo(meta)
  with pytest.raises(ValueError, match="model.json is a FIFO, not a regular file"):
    checkpoint.load_model(crafted)
  meta.unlink()
  meta.write_text("[" * 100_000 + "]" * 100_000)
  with pytest.raises(ValueError, match="nested too deep"):
    checkpoint.load_model(crafted)
  meta.write_text("[1]")
  with pytest.raises(ValueError, match="holds list; expected a JSON object"):
    checkpoint.load_model(crafted)
  # And save_model writes nothing load_model would refuse.
  with pytest.raises(TypeError, match="Stray with a LongformerConfig is not a model class"):
    checkpoint.save_model(tmp_path / "other", Stray())
  assert not (tmp_path / "other").exists()


class Stray(nnx.Module):
  """A model class outside the allow-list."""

  def __init__(self):
    self.config = TINY
    self.w = nnx.Param(np.zeros(2, np.float32))


# ----------------------------------------------------------------------------------------------
# Run records.


def _record():
  from longformer_jax.training.config import Stage, TrainConfig
  return config_record(TrainConfig(model=TINY, stages=(Stage(16, 2, 3, 1e-3),)))


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(model_config_class="growing_windows"),
     r"model_config_class='growing_windows' is not one of"),
    (lambda r: r.update(model_config_class="TransformerConfig"), "is not one of"),
    (lambda r: r.update(model_config_class=["LongformerConfig"]), "is not one of"),
    (lambda r: r["model"].update(num_hidden_layers=10**9),
     "model: num_hidden_layers=1000000000 is over"),
    (lambda r: r["model"].update(layer_norm_eps=-1.0), "model: layer_norm_eps must be"),
    (lambda r: r["stages"][0].update(evil=1), r"unknown Stage fields \['evil'\]"),
    (lambda r: r.update(stages={"a": 1}), "stages must be a list"),
    (lambda r: r.update(evil=1), r"unknown fields \['evil'\]"),
    (lambda r: r.update(final_eval=[1]), "final_eval must be"),
    (lambda r: r.pop("model"), "not a run record"),
])
def test_crafted_run_records_are_refused(edit, message):
  """Before: KeyError / TypeError tracebacks, or a config class looked up by any name of the
  config module. After: a ValueError naming the record and the field."""
  record = json.loads(json.dumps(_record()))
  assert config_from_record(record, "w/run_config.json").model == TINY  # the control
  edit(record)
  with pytest.raises(ValueError, match=message) as e:
    config_from_record(record, "w/run_config.json")
  assert str(e.value).startswith("w/run_config.json: ")
  with pytest.raises(ValueError, match="must be a JSON object, got list"):
    config_from_record([record], "w/run_config.json")


# ----------------------------------------------------------------------------------------------
# HF directories.

HF_TINY = TINY.replace(num_hidden_layers=2, attention_window=(2, 4), type_vocab_size=2)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """An HF directory (config.json + model.safetensors) of a tiny LongformerModel."""
  path = tmp_path_factory.mktemp("hf") / "model"
  modeling.LongformerModel(HF_TINY, rngs=nnx.Rngs(1)).save_pretrained(path)
  return path


def _params(model):
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(
      nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]}


def _load(path):
  return convert.from_hf(str(path), attention_impl="reference")


def _write_safetensors(path, tensors):
  """A safetensors file written by hand (numpy's writer has no bfloat16): {name: array}."""
  codes = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
           np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.int64): "I64"}
  header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
  for name, array in tensors.items():
    data = np.ascontiguousarray(array).tobytes()
    header[name] = {"dtype": codes[array.dtype], "shape": list(array.shape),
                    "data_offsets": [offset, offset + len(data)]}
    blobs.append(data)
    offset += len(data)
  text = json.dumps(header).encode()
  text += b" " * (-len(text) % 8)
  path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _copy_hf(hf_dir, tmp_path, name="copy"):
  path = tmp_path / name
  shutil.copytree(hf_dir, path)
  return path


def _weights(hf_dir):
  from safetensors.numpy import load_file
  return load_file(hf_dir / "model.safetensors")


def _shard(hf_dir, tmp_path, weight_map):
  """The checkpoint as one shard named by an index whose weight_map is `weight_map`."""
  path = _copy_hf(hf_dir, tmp_path, "sharded")
  (path / "model.safetensors").rename(path / "shard-1.safetensors")
  (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return path


def test_index_paths_stay_inside_the_directory(hf_dir, tmp_path):
  """Before: weight_map values were joined unchecked: an absolute path, `../` or a symlink out
  loaded another directory's weights silently, a FIFO blocked forever, an index without
  weight_map or that is a list gave tracebacks. After: one ValueError naming the index."""
  names = list(_weights(hf_dir))
  good = _shard(hf_dir, tmp_path, dict.fromkeys(names, "shard-1.safetensors"))
  reference = _params(_load(good))  # the control: a well-formed index loads
  other = _copy_hf(hf_dir, tmp_path, "elsewhere")
  outside = str(other / "model.safetensors")
  for target, message in ((outside, "is not a relative path inside the directory"),
                          ("../elsewhere/model.safetensors", "is not a relative path inside"),
                          (7, "is not a relative path")):
    path = _shard(hf_dir, tmp_path / f"case{len(str(target))}",
                  {names[0]: target, **dict.fromkeys(names[1:], "shard-1.safetensors")})
    with pytest.raises(ValueError, match=message) as e:
      _load(path)
    assert "model.safetensors.index.json: weight_map[" in str(e.value)
  path = _shard(hf_dir, tmp_path / "link", dict.fromkeys(names, "link.safetensors"))
  os.symlink(outside, path / "link.safetensors")
  with pytest.raises(ValueError, match="leads outside"):
    _load(path)
  os.unlink(path / "link.safetensors")
  os.symlink("shard-1.safetensors", path / "link.safetensors")  # a link inside is fine
  assert all(np.array_equal(v, reference[k]) for k, v in _params(_load(path)).items())
  os.unlink(path / "link.safetensors")
  os.mkfifo(path / "link.safetensors")
  with pytest.raises(ValueError, match="link.safetensors is a FIFO, not a regular file"):
    _load(path)
  for index, message in (({"metadata": {}}, "weight_map must be a JSON object"),
                         ([1, 2], "holds list; expected a JSON object")):
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=message):
      _load(path)


def test_config_json_must_be_a_sane_object(hf_dir, tmp_path):
  """Before: num_hidden_layers=10**9 -> MemoryError, a list or null config -> AttributeError,
  100,000 brackets -> RecursionError, layer_norm_eps=-1 accepted (every output NaN), a FIFO
  config.json -> a hang. After: one ValueError naming config.json, the field and the value."""
  path = _copy_hf(hf_dir, tmp_path)
  config_file = path / "config.json"
  config = json.loads(config_file.read_text())
  cases = [
      ({**config, "num_hidden_layers": 10**9},
       "config.json: num_hidden_layers=1000000000 must be an int in"),
      ({**config, "hidden_size": 2**40}, "config.json: hidden_size=1099511627776 is over"),
      ({**config, "vocab_size": -3}, "config.json: vocab_size must be a positive int, got -3"),
      ({**config, "layer_norm_eps": -1}, "config.json: layer_norm_eps must be a finite number > 0"),
      ({**config, "attention_window": "big"}, "config.json: attention_window='big' must be"),
      ({**config, "id2label": 5}, "config.json: id2label=5 must be"),
      ({**config, "model_type": ["longformer"]}, "config.json: model_type=.* must be a string"),
      ({**config, "architectures": "LongformerModel"}, "config.json: architectures="),
      (None, "config.json holds null; expected a JSON object"),
      ([config], "config.json holds list; expected a JSON object"),
  ]
  for value, message in cases:
    config_file.write_text(json.dumps(value))
    with pytest.raises(ValueError, match=message) as e:
      _load(path)
    assert len(str(e.value).splitlines()) == 1
  config_file.write_text("[" * 100_000 + "]" * 100_000)
  with pytest.raises(ValueError, match="config.json is not valid JSON .nested too deep"):
    _load(path)
  config_file.unlink()
  os.mkfifo(config_file)
  with pytest.raises(ValueError, match="config.json is a FIFO"):
    _load(path)
  config_file.unlink()
  os.symlink(hf_dir / "config.json", config_file)  # a symlink out of the directory
  with pytest.raises(ValueError, match="leads outside"):
    _load(path)
  # A change the caller asks for is named as theirs, not blamed on the file.
  with pytest.raises(ValueError, match=r"^config changes \['layer_norm_eps'\]: layer_norm_eps"):
    convert.from_hf(str(hf_dir), layer_norm_eps=float("nan"))


def test_weights_are_checked_by_exact_shape_and_dtype(hf_dir, tmp_path):
  """Before: only the element count was checked: a transposed or flattened matrix loaded and gave
  wrong logits. After: refused with the file, the tensor and both shapes."""
  weights = _weights(hf_dir)
  name = "encoder.layer.0.intermediate.dense.weight"  # [24, 16] in HF's layout
  for bad in (weights[name].T.copy(), weights[name].reshape(-1)):
    path = _copy_hf(hf_dir, tmp_path, f"bad{bad.ndim}")
    _write_safetensors(path / "model.safetensors", {**weights, name: bad})
    with pytest.raises(ValueError) as e:
      _load(path)
    assert str(e.value) == (f"{path}/model.safetensors: tensor {name} has shape {bad.shape}; "
                            f"LongformerModel expects {weights[name].shape}")
  path = _copy_hf(hf_dir, tmp_path, "ints")
  _write_safetensors(path / "model.safetensors",
                     {**weights, name: weights[name].astype(np.int64)})
  with pytest.raises(ValueError, match=f"tensor {name} has dtype int64; a weight must be floating"):
    _load(path)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_half_precision_checkpoints_load_as_hf_loads_them(hf_dir, tmp_path, dtype):
  """Before: bfloat16 tensors were dropped as "not floating" (the error listed every weight as
  missing). After: bfloat16 and float16 load, converted to the model's dtype as HF does."""
  weights = _weights(hf_dir)
  half = {k: v.astype(dtype) for k, v in weights.items()}
  path = _copy_hf(hf_dir, tmp_path, "half")
  _write_safetensors(path / "model.safetensors", half)
  loaded = _params(_load(path))
  assert all(v.dtype == np.float32 for v in loaded.values())
  reference = _params(_load(hf_dir))
  assert any(not np.array_equal(v, loaded[k]) for k, v in reference.items())  # rounded
  for key, value in reference.items():
    np.testing.assert_array_equal(loaded[key], value.astype(dtype).astype(np.float32))
  model = convert.from_hf(str(path), attention_impl="reference", dtype="bfloat16",
                          param_dtype="bfloat16")
  assert all(v.dtype == ml_dtypes.bfloat16 for v in _params(model).values())


def _roberta_dir(tmp_path, drop=()):
  """A RoBERTa masked LM's HF directory, made by renaming a Longformer's (no global
  projections); `drop`: tensors left out."""
  model = modeling.LongformerForMaskedLM(HF_TINY, rngs=nnx.Rngs(2))
  weights = {k.replace("longformer.", "roberta."): v
             for k, v in convert.hf_state_dict(model).items() if "_global" not in k}
  weights = {k: v for k, v in weights.items() if not k.endswith(drop)}
  path = tmp_path / f"roberta{len(list(tmp_path.iterdir()))}"
  path.mkdir()
  config = convert.config_to_hf_dict(HF_TINY, "RobertaForMaskedLM")
  config.update(model_type="roberta")
  config.pop("attention_window")
  (path / "config.json").write_text(json.dumps(config))
  _write_safetensors(path / "model.safetensors", weights)
  return path


def test_roberta_directories_missing_parts(tmp_path):
  """Before: no position table -> StopIteration, no bias -> KeyError. After: ValueError naming
  the directory and the tensor."""
  control = convert.roberta_to_longformer(str(_roberta_dir(tmp_path)), max_positions=32,
                                          window=4, attention_impl="reference")
  assert control.config.max_position_embeddings == 32 + 2
  path = _roberta_dir(tmp_path, drop=("embeddings.position_embeddings.weight",))
  with pytest.raises(ValueError, match=f"^{path}: no position table"):
    convert.roberta_to_longformer(str(path), max_positions=32, window=4)
  path = _roberta_dir(tmp_path, drop=("layer.1.attention.self.key.bias",))
  with pytest.raises(ValueError, match=r"no tensor roberta.encoder.layer.1.attention.self.key"
                                       r".bias|no tensor longformer.encoder.layer.1"):
    convert.roberta_to_longformer(str(path), max_positions=32, window=4)
  with pytest.raises(ValueError, match=r"max_positions=1099511627776 must be an int in"):
    convert.roberta_to_longformer(str(path), max_positions=2**40, window=4)


def test_open_regular_refuses_without_blocking(tmp_path):
  """The one helper every loader opens its files with: a FIFO (no writer: a plain open would
  block forever), a device and a directory are refused at once; a regular file opens."""
  fifo = tmp_path / "fifo"
  os.mkfifo(fifo)
  for path, what in ((fifo, "a FIFO"), ("/dev/null", "a device"), (tmp_path, "a directory")):
    with pytest.raises(ValueError, match=what):
      open_regular(path)
  (tmp_path / "ok.json").write_text('{"a": 1}')
  assert read_json(tmp_path / "ok.json", tmp_path) == {"a": 1}
  with pytest.raises(ValueError, match="leads outside"):
    read_json(tmp_path / "ok.json", tmp_path / "sub")


def test_config_bounds_are_checked_before_allocation():
  """Sizes are bounded before anything is allocated from them (in the config classes, so every
  path that builds a config gets it), and eps must be finite and > 0."""
  for bad, message in ((dict(num_hidden_layers=10**9), "num_hidden_layers=1000000000 is over"),
                       (dict(attention_window=10**9), "attention_window of layer 0"),
                       (dict(layer_norm_eps=-1.0), "layer_norm_eps must be a finite number > 0"),
                       (dict(layer_norm_eps=0.0), "layer_norm_eps must be a finite number > 0"),
                       (dict(layer_norm_eps=math.inf), "layer_norm_eps=inf must be a finite"),
                       (dict(hidden_dropout_prob="0.1"), "hidden_dropout_prob='0.1' must be"),
                       (dict(num_labels=2**20), "num_labels=1048576 is over")):
    with pytest.raises(ValueError, match=message):
      TINY.replace(**bad)
  with pytest.raises(ValueError, match="decoder_layers=1000000000 is over"):
    LEDConfig.tiny(decoder_layers=10**9)
  with pytest.raises(ValueError, match="rope_base must be > 1"):
    CharLMConfig(rope_base=-1.0)


def test_export_workdir_with_a_gadget_model_json(saved_model, tmp_path):
  """`eval.export --workdir` goes through the checked loader: one `error:` line, exit 2, no
  traceback, and the shipped file never runs."""
  crafted = _craft(saved_model, tmp_path)
  marker = tmp_path / "ran"
  (crafted / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
  crafted = _craft(saved_model, tmp_path, model_class="longformer_jax.cli.settings:load_config",
                   config_class="longformer_jax.cli.settings:load_config",
                   config={"path": str(crafted / "evil.py")})
  proc = subprocess.run([sys.executable, "-m", "eval.export", "--workdir", str(crafted), "--out",
                         str(tmp_path / "a.zip"), "--seq-len", "8"], cwd=ROOT,
                        env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert lines[-1].startswith("error: ") or "error:" in lines[-1], proc.stderr
  assert "model_class=" in proc.stderr and "Traceback" not in proc.stderr
  assert "--config" not in proc.stderr
  assert not marker.exists() and not (tmp_path / "a.zip").exists()


def test_an_hf_cache_snapshot_may_link_into_its_own_repo_only(hf_dir, tmp_path):
  """A snapshot of the HF cache (`snapshot_download`'s directory) links its files into the repo's
  blobs/: those load, given by path; a link out of the repo's folder is refused."""
  repo = tmp_path / "hub" / "models--org--tiny"
  snapshot = repo / "snapshots" / "abc"
  (repo / "blobs").mkdir(parents=True)
  snapshot.mkdir(parents=True)
  for name in ("config.json", "model.safetensors"):
    shutil.copy(hf_dir / name, repo / "blobs" / name)
    os.symlink(f"../../blobs/{name}", snapshot / name)
  reference = _params(_load(hf_dir))
  assert all(np.array_equal(v, reference[k]) for k, v in _params(_load(snapshot)).items())
  os.unlink(snapshot / "model.safetensors")
  os.symlink(hf_dir / "model.safetensors", snapshot / "model.safetensors")
  with pytest.raises(ValueError, match="leads outside"):
    _load(snapshot)
