"""The library inside someone else's program: `nnx.tabulate` and treescope work on every model
class, and importing or using the library (checkpoints included, failed reads and background
saves too) leaves the process's hooks, loggers and warning filters as it found them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import treescope
from flax import nnx

import longformer_jax as lj

pytestmark = pytest.mark.unit

ENCODER = lj.LongformerConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=64,
                              max_position_embeddings=40, attention_window=(2, 3))
LED = lj.LEDConfig.tiny()


def _ids(batch: int, seq: int) -> jnp.ndarray:
  """<s> question </s></s> context </s> rows (QA and multiple choice read the </s> positions)."""
  c = ENCODER
  ids = np.full((batch, seq), 7, np.int32)
  ids[:, 0] = c.bos_token_id
  ids[:, 4:6] = c.eos_token_id
  ids[:, -1] = c.eos_token_id
  return jnp.asarray(ids)


# (class, config, call arguments, call keywords). A head that computes its own global mask from
# the ids needs `max_global` when traced, and tabulate traces every module call.
CASES = [
    (lj.LongformerModel, ENCODER, (_ids(2, 16),), {}),
    (lj.LongformerForMaskedLM, ENCODER, (_ids(2, 16),), {}),
    (lj.LongformerForSequenceClassification, ENCODER, (_ids(2, 16),), {}),
    (lj.LongformerForQuestionAnswering, ENCODER, (_ids(2, 16),), dict(max_global=4)),
    (lj.LongformerForTokenClassification, ENCODER, (_ids(2, 16),), {}),
    (lj.LongformerForMultipleChoice, ENCODER, (_ids(2, 16)[:, None],), dict(max_global=12)),
    (lj.LongformerForCausalLM, lj.CharLMConfig.tiny(), (jnp.ones((1, 32), jnp.int32),), {}),
    (lj.LEDModel, LED, (_ids(2, 16), None, _ids(2, 6)), {}),
    (lj.LEDForConditionalGeneration, LED, (_ids(2, 16), None, _ids(2, 6)), {}),
    (lj.LEDForQuestionAnswering, LED, (_ids(2, 16),), {}),
]


@pytest.mark.parametrize("model_class, config, args, kwargs", CASES,
                         ids=[c[0].__name__ for c in CASES])
def test_tabulate_and_treescope(model_class, config, args, kwargs):
  model = model_class(config, rngs=nnx.Rngs(0))
  model.eval()
  table = nnx.tabulate(model, *args, **kwargs, depth=2, console_kwargs={"width": 200})
  assert model_class.__name__ in table and "Total Parameters" in table
  # Every parameter is counted: the summary's total equals the model's own count.
  count = sum(np.size(p) for p in nnx.to_flat_state(nnx.state(model, nnx.Param)).leaves)
  assert f"{count:,}" in table.replace("\n", " ")
  text = treescope.render_to_text(model)
  assert model_class.__name__ in text


_STATE_PROBE = textwrap.dedent("""
  import asyncio, logging, signal, sys, threading, warnings
  for name in ("absl", "asyncio", "orbax"):  # the loggers a checkpoint read touches
    logging.getLogger(name)

  def snapshot():
    loggers = {"": logging.getLogger()}
    loggers.update((n, l) for n, l in logging.root.manager.loggerDict.items()
                   if isinstance(l, logging.Logger))
    return {
        "sys.unraisablehook": sys.unraisablehook, "sys.excepthook": sys.excepthook,
        "threading.excepthook": threading.excepthook, "warnings": list(warnings.filters),
        "SIGTERM": signal.getsignal(signal.SIGTERM), "SIGINT": signal.getsignal(signal.SIGINT),
        "loggers": {n: (l.level, list(l.filters), list(l.handlers), l.propagate, l.disabled)
                    for n, l in loggers.items()},
    }

  def same(before, after, when):
    for key, value in before.items():
      if key == "loggers":
        for name, state in value.items():
          assert after["loggers"][name] == state, (when, name, state, after["loggers"][name])
      else:
        assert after[key] == value, (when, key, value, after[key])

  import jax
  import numpy as np
  before = snapshot()
  import longformer_jax as lj
  from longformer_jax import checkpoint, data, tasks, training
  same(before, snapshot(), "import")

  from flax import nnx
  cfg = lj.LongformerConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=32,
                            max_position_embeddings=40, attention_window=2)
  model = lj.LongformerModel(cfg, rngs=nnx.Rngs(0))
  model(jax.numpy.ones((1, 8), jax.numpy.int32))
  root = sys.argv[1]
  checkpoint.save_model(f"{root}/ckpt", model)
  checkpoint.load_model(f"{root}/ckpt")
  # A damaged checkpoint: every array file truncated, so Orbax's read fails inside TensorStore.
  import pathlib
  for f in pathlib.Path(f"{root}/ckpt/params").rglob("*"):
    if f.is_file() and f.stat().st_size > 1000:
      f.write_bytes(f.read_bytes()[:100])
  try:
    checkpoint.load_model(f"{root}/ckpt")
    raise AssertionError("a truncated checkpoint loaded")
  except checkpoint.DamagedCheckpointError as e:
    print("refused:", str(e).splitlines()[0][:60])
  params = nnx.state(model, nnx.Param)
  writer = checkpoint.TrainCheckpoints(f"{root}/run", keep=1)
  assert logging.getLogger("absl").filters  # Orbax's error records: for the writer's life only
  writer.save(1, params, params, {"stage": 0})
  writer.close()
  same(before, snapshot(), "use")
  print("unchanged")
""")


def test_import_and_use_change_no_process_wide_state(tmp_path):
  """In a fresh process: the hooks, loggers (levels, filters, handlers), warning filters and
  signal handlers are the same after importing the library, saving and loading checkpoints,
  failing to read a damaged one and running a train-state writer. The failed read still prints
  nothing but its one-line error (the quieting of Orbax's leftovers is scoped, not removed)."""
  root = Path(__file__).parents[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(root))
  proc = subprocess.run([sys.executable, "-c", _STATE_PROBE, str(tmp_path)], env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  assert proc.stdout.strip().endswith("unchanged"), proc.stdout
  assert "refused:" in proc.stdout
  for noise in ("Event loop is closed", "Traceback", "was never retrieved"):
    assert noise not in proc.stderr, proc.stderr[-4000:]
