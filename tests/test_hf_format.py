"""`save_pretrained` / `from_pretrained` in HF's checkpoint format, for every Longformer head and
LED class.

A subprocess with torch blocked from import saves every class (random weights), loads it back
bit for bit (parameters and outputs), loads checkpoints by Hub id from a fake HF cache with
`HF_HUB_OFFLINE=1`, and checks the errors for what is not there. This process (torch available)
then loads each saved directory with transformers' `AutoModel*.from_pretrained`: no missing or
unexpected weights, the key set HF's own `save_pretrained` writes, and our outputs to 1e-5 in
float32 (inputs with padding and global tokens).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from testing import make_model_inputs
from longformer_jax import LEDConfig, LongformerConfig, convert, led, modeling

# slow: in-process, but most of the cost is training runs, command lines and subprocesses.
pytestmark = [pytest.mark.unit, pytest.mark.slow]

ATOL = 1e-5
# The dense reference attention has the fewest ops to compile when run eagerly; it is not saved
# (HF has no such field), so loading passes it again. tests/test_models_parity.py holds every
# implementation to HF.
IMPL = dict(attention_impl="reference")
LONGFORMER = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=48, max_position_embeddings=70, type_vocab_size=2,
                  attention_window=(2, 4), num_labels=3, **IMPL)
LED = dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
           decoder_ffn_dim=40, max_encoder_position_embeddings=64,
           max_decoder_position_embeddings=32, attention_window=(2, 4), **IMPL)
CLASSES = {**modeling.MODEL_CLASSES, **led.MODEL_CLASSES}
# The outputs compared, by class; LED's encoder output at real tokens only.
OUTPUTS = {"LongformerModel": ("last_hidden_state", "pooler_output"),
           "LongformerForQuestionAnswering": ("start_logits", "end_logits"),
           "LEDModel": ("last_hidden_state", "encoder_last_hidden_state"),
           "LEDForConditionalGeneration": ("logits", "encoder_last_hidden_state"),
           "LEDForQuestionAnswering": ("start_logits", "end_logits",
                                       "encoder_last_hidden_state")}
# transformers' Auto class that loads each of ours.
AUTO = {"LongformerModel": "AutoModel", "LongformerForMaskedLM": "AutoModelForMaskedLM",
        "LongformerForSequenceClassification": "AutoModelForSequenceClassification",
        "LongformerForQuestionAnswering": "AutoModelForQuestionAnswering",
        "LongformerForTokenClassification": "AutoModelForTokenClassification",
        "LongformerForMultipleChoice": "AutoModelForMultipleChoice", "LEDModel": "AutoModel",
        "LEDForConditionalGeneration": "AutoModelForSeq2SeqLM",
        "LEDForQuestionAnswering": "AutoModelForQuestionAnswering"}
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # a Hub commit hash: 40 hex digits


def build(name: str, seed: int):
  """Our model of class `name` (the base model without its pooler for "NoPooler") with seeded
  random parameters, none at HF's init (whose zero biases and unit scales would hide a mis-mapped
  bias or scale), in eval mode. Made abstractly and filled from numpy: no init ops to compile."""
  cls = CLASSES[name.removesuffix("NoPooler")]
  if cls.__module__.endswith("led"):
    make = lambda: cls(LEDConfig(**LED), rngs=nnx.Rngs(0))
  else:
    kwargs = {"add_pooling_layer": False} if name.endswith("NoPooler") else {}
    num_labels = 2 if name == "LongformerForQuestionAnswering" else 3
    config = LongformerConfig(**{**LONGFORMER, "num_labels": num_labels})
    make = lambda: cls(config, rngs=nnx.Rngs(0), **kwargs)
  model = nnx.eval_shape(make)
  state = nnx.state(model, nnx.Param)
  rng = np.random.default_rng(seed)

  def draw(path, x):
    noise = rng.standard_normal(x.shape).astype(np.float32)
    return jax.numpy.asarray(1 + 0.1 * noise if path[-1].key == "scale" else 0.2 * noise)

  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(draw,
                                                                   nnx.to_pure_dict(state)))
  nnx.update(model, state)
  model.eval()
  return model


def inputs_for(name: str) -> dict[str, np.ndarray]:
  """`testing.make_model_inputs`: rows of 23, 17 and 9 tokens with 3, 1 and 0 global tokens
  (multiple choice: the three rows as the choices of one example). LED's encoder takes the same
  rows (so both families run the same attention shapes), its decoder full rows of 7 tokens."""
  inputs = make_model_inputs(0)
  if name == "LongformerForMultipleChoice":
    return {k: v[None] for k, v in inputs.items()}
  if name.startswith("LED"):
    decoder_ids = np.random.default_rng(1).integers(4, 64, (3, 7))
    decoder_ids[:, 0] = 2
    return dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                global_attention_mask=inputs["global_attention_mask"] * inputs["attention_mask"],
                decoder_input_ids=decoder_ids, decoder_attention_mask=np.ones((3, 7), np.int64))
  return inputs


def outputs_of(model, name: str) -> dict[str, np.ndarray]:
  inputs = inputs_for(name)
  out = model(**{k: jax.numpy.asarray(v) for k, v in inputs.items()})
  fields = OUTPUTS.get(name.removesuffix("NoPooler"), ("logits",))
  if name.endswith("NoPooler"):
    fields = ("last_hidden_state",)
  return {f: np.asarray(getattr(out, f)) for f in fields}


def params_of(model) -> list:
  return jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]


def assert_same_params(a, b):
  for (path, x), (path_b, y) in zip(params_of(a), params_of(b), strict=True):
    assert path == path_b
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


def cache_repo(cache: Path, repo_id: str, files: dict[str, Path], commit: str = COMMIT,
               ref: str = "main") -> None:
  """`files` (name -> source) as the HF cache holds a download of `repo_id`: contents in
  blobs/, the snapshot of `commit` linking to them, refs/<ref> naming the commit."""
  repo = cache / f"models--{repo_id.replace('/', '--')}"
  snapshot = repo / "snapshots" / commit
  for d in (repo / "blobs", repo / "refs", snapshot):
    d.mkdir(parents=True, exist_ok=True)
  for name, source in files.items():
    blob = repo / "blobs" / f"{name}-{commit}"  # the Hub names blobs by hash; any name works
    shutil.copyfile(source, blob)
    (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
  (repo / "refs" / ref).write_text(commit)


# ----------------------------------------------------------------------------------------------
# Without torch (in a subprocess that blocks it).

NAMES = list(CLASSES) + ["LongformerModelNoPooler"]


def run_torch_free(out: Path) -> None:
  """Every class saved, loaded back bit for bit and its outputs written to out/outputs/; saving
  over a directory; Hub ids from a fake cache (HF_HUB_CACHE, HF_HUB_OFFLINE=1 are set by the
  caller); the errors for what is not there."""
  (out / "outputs").mkdir(parents=True)
  models = {}
  for seed, name in enumerate(NAMES):
    model = models[name] = build(name, seed)
    model.save_pretrained(out / name)
    assert sorted(os.listdir(out / name)) == ["config.json", "model.safetensors"], name
    loaded = CLASSES[name.removesuffix("NoPooler")].from_pretrained(out / name, **IMPL)
    assert type(loaded) is type(model) and loaded.config == model.config, name
    assert_same_params(model, loaded)
    loaded.eval()  # models start in training mode
    ours = outputs_of(model, name)
    for field, value in outputs_of(loaded, name).items():
      np.testing.assert_array_equal(value, ours[field], err_msg=f"{name}.{field}")
    np.savez(out / "outputs" / f"{name}.npz", **ours)

  # Saving into an existing directory replaces the two files and leaves the others alone.
  directory, other = out / "LongformerForTokenClassification", build(
      "LongformerForTokenClassification", seed=len(NAMES))
  (directory / "tokenizer.json").write_text("{}")
  other.save_pretrained(str(directory))
  assert sorted(os.listdir(directory)) == ["config.json", "model.safetensors", "tokenizer.json"]
  assert_same_params(other, modeling.LongformerForTokenClassification.from_pretrained(directory))
  models["LongformerForTokenClassification"].save_pretrained(directory)

  # Hub ids: one in HF_HUB_CACHE by its main branch; one in another cache by commit hash.
  mlm, gen = out / "LongformerForMaskedLM", out / "LEDForConditionalGeneration"
  checkpoint = {"config.json": mlm / "config.json",
                "model.safetensors": mlm / "model.safetensors"}
  cache_repo(Path(os.environ["HF_HUB_CACHE"]), "test-org/tiny-mlm", checkpoint)
  loaded = modeling.LongformerForMaskedLM.from_pretrained("test-org/tiny-mlm")
  assert_same_params(models["LongformerForMaskedLM"], loaded)
  other_cache = out / "other_cache"
  cache_repo(other_cache, "test-org/tiny-led", {"config.json": gen / "config.json",
                                                "model.safetensors": gen / "model.safetensors"},
             commit=COMMIT[::-1], ref="v1")
  for revision in ("v1", COMMIT[::-1]):
    loaded = convert.from_hf("test-org/tiny-led", revision=revision, cache_dir=other_cache)
    assert isinstance(loaded, led.LEDForConditionalGeneration)
    assert_same_params(models["LEDForConditionalGeneration"], loaded)
  # A task model from the masked LM's checkpoint: backbone loaded, new head, a warning.
  with pytest.warns(UserWarning, match=r"newly initialised \['classifier"):
    clf = modeling.LongformerForTokenClassification.from_pretrained("test-org/tiny-mlm",
                                                                    num_labels=5)
  assert clf.config.num_labels == 5
  assert_same_params(models["LongformerForMaskedLM"].longformer, clf.longformer)

  # What is not there: an id not in the (offline) cache, a revision not in it, a repo whose
  # weights are only a pytorch_model.bin (torch needed to read it).
  with pytest.raises(FileNotFoundError, match=r"'test-org/absent' is not a local directory, "
                                              r"and the HF Hub model 'test-org/absent' could "
                                              r"not be fetched: \w+Error"):
    modeling.LongformerModel.from_pretrained("test-org/absent")
  with pytest.raises(FileNotFoundError, match=r"'test-org/tiny-mlm' at revision 'v2' could not"):
    convert.from_hf("test-org/tiny-mlm", revision="v2")
  (out / "pytorch_model.bin").write_bytes(b"not read")
  cache_repo(Path(os.environ["HF_HUB_CACHE"]), "test-org/bin-only",
             {"config.json": mlm / "config.json", "pytorch_model.bin": out / "pytorch_model.bin"})
  with pytest.raises(FileNotFoundError, match=r"'test-org/bin-only' has no safetensors weights, "
                                              r"and reading a pytorch_model.bin needs torch"):
    convert.from_hf("test-org/bin-only")
  assert "torch" not in sys.modules


_TORCH_FREE = """
import importlib.abc, sys
from pathlib import Path

class BlockTorch(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name == "torch" or name.startswith("torch."):
      raise ImportError(f"{name} is blocked: this run checks that torch is not needed")

sys.meta_path.insert(0, BlockTorch())
import test_hf_format
test_hf_format.run_torch_free(Path(sys.argv[1]))
print("ok")
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
  """The directory `run_torch_free` filled, after checking that it passed."""
  out = tmp_path_factory.mktemp("hf_format")
  root = Path(__file__).parents[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{root}:{root / 'tests'}",
             HF_HOME=str(out / "hf_home"), HF_HUB_CACHE=str(out / "hub"), HF_HUB_OFFLINE="1",
             HF_HUB_DISABLE_TELEMETRY="1")
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, "-c", _TORCH_FREE, str(out / "run")], env=env,
                        capture_output=True, text=True, timeout=600)
  print(f"torch-free run: {time.perf_counter() - start:.1f} s")
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
      proc.stdout[-3000:] + proc.stderr[-6000:])
  return out / "run"


def test_round_trip_and_hub_ids_without_torch(saved):
  """Every class (and the base model without pooler) back bit for bit, saving over a directory,
  Hub ids from a fake cache, the errors for what is missing: all in `run_torch_free`, which never
  imported torch."""
  for name in NAMES:
    assert (saved / "outputs" / f"{name}.npz").is_file(), name


def test_unexpressible_models_raise_before_writing(tmp_path):
  # Abstract models (nothing to compile): the check reads the config only.
  dilated = nnx.eval_shape(lambda: modeling.LongformerModel(
      LongformerConfig(**LONGFORMER, attention_dilation=(1, (1, 2, 1, 1))), rngs=nnx.Rngs(0)))
  causal = nnx.eval_shape(lambda: modeling.LongformerForMaskedLM(
      LongformerConfig(**LONGFORMER, causal=True), rngs=nnx.Rngs(0)))
  for model, message in ((dilated, "no dilation"), (causal, "no causal mode")):
    with pytest.raises(ValueError, match=message):
      model.save_pretrained(tmp_path / "new")
    assert not (tmp_path / "new").exists()


# ----------------------------------------------------------------------------------------------
# transformers reads what we write (torch needed).

_NEEDS = "loading into transformers needs torch: pip install -e '.[torch]'"


@pytest.mark.parametrize("name", list(CLASSES))
def test_transformers_loads_saved_directory(saved, name):
  torch = pytest.importorskip("torch", reason=_NEEDS)
  transformers = pytest.importorskip("transformers", reason=_NEEDS)
  from safetensors import safe_open

  directory = saved / name
  hf_model, info = getattr(transformers, AUTO[name]).from_pretrained(
      directory, output_loading_info=True)
  assert type(hf_model).__name__ == name
  assert not any(info.values()), info  # missing, unexpected, mismatched keys, errors
  # The weights and metadata HF's own save_pretrained writes for this model.
  hf_model.save_pretrained(saved / "hf" / name)
  with safe_open(directory / "model.safetensors", "np") as ours, safe_open(
      saved / "hf" / name / "model.safetensors", "np") as theirs:
    assert sorted(ours.keys()) == sorted(theirs.keys())
    assert ours.metadata() == theirs.metadata() == {"format": "pt"}
  theirs_config = json.loads((saved / "hf" / name / "config.json").read_text())
  assert theirs_config["architectures"] == [name]
  assert theirs_config["attention_window"] == [4, 8]  # one-sided 2 and 4

  inputs = inputs_for(name)
  with torch.no_grad():
    out = hf_model.eval()(**{k: torch.tensor(v) for k, v in inputs.items()})
  ours = np.load(saved / "outputs" / f"{name}.npz")
  for field in ours.files:
    theirs, expected = getattr(out, field).numpy(), ours[field]
    if field == "encoder_last_hidden_state":  # padding positions are not compared
      real = inputs["attention_mask"].astype(bool)
      theirs, expected = theirs[real], expected[real]
    np.testing.assert_allclose(expected, theirs, atol=ATOL, rtol=0, err_msg=f"{name}.{field}")


def test_hub_repo_with_only_pytorch_model_bin(saved, tmp_path, monkeypatch):
  """Without safetensors weights on the Hub, the pytorch_model.bin is read (torch installed)."""
  torch = pytest.importorskip("torch", reason=_NEEDS)
  huggingface_hub = pytest.importorskip("huggingface_hub", reason=_NEEDS)
  from safetensors.numpy import load_file
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
  source = saved / "LongformerForQuestionAnswering"
  state = {k: torch.from_numpy(v) for k, v in load_file(source / "model.safetensors").items()}
  torch.save(state, tmp_path / "pytorch_model.bin")
  cache_repo(tmp_path / "cache", "test-org/bin-only",
             {"config.json": source / "config.json",
              "pytorch_model.bin": tmp_path / "pytorch_model.bin"})
  from_bin = modeling.LongformerForQuestionAnswering.from_pretrained(
      "test-org/bin-only", cache_dir=tmp_path / "cache")
  assert_same_params(from_bin, modeling.LongformerForQuestionAnswering.from_pretrained(source))
