"""Fine-tuning LED on JSONL pairs (`python -m train.seq2seq`, `tasks.seq2seq`,
`data.text`): a tiny random LED learns a copy task over an 8-word alphabet (the loss falls,
results.json and the predictions files are written with ROUGE in [0, 1]), a rerun resumes, a bad
JSONL line is a one-line error naming file, line and field (exit status 2), and the first loss of
a run started from an LED directory saved by transformers, or from a BART made long, equals HF's
`labels=` loss of that model.

The two CLI runs (the `tiny` preset cut to one layer each side) build the same programs, so the
second one takes the first one's compilations from a persistent compilation cache kept for this
module (XLA takes tens of seconds on a CPU for the train step and for the health check of the
saves).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longformer_jax import checkpoint, led
from longformer_jax.config import LEDConfig
from longformer_jax.data import text
from longformer_jax.data.tokenizer import load_tokenizer
from longformer_jax.tasks import seq2seq
from testing import seed_of
from longformer_jax.commands import train_seq2seq as cli

tokenizers = pytest.importorskip("tokenizers", reason="pip install -e '.[torch]'")
pytest.importorskip("rouge_score", reason="pip install -e '.[torch]'")
# slow: in-process, but most of the cost is training runs, command lines and subprocesses.
pytestmark = [pytest.mark.unit, pytest.mark.slow]

WORDS = "abcdefgh"
SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0, 1, 2, 3: BART's order
# An HF LED whose converted config is `LEDConfig.tiny()` with this tokenizer's 12 tokens.
HF_LED = dict(vocab_size=12, d_model=64, encoder_layers=2, decoder_layers=2,
              encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=96,
              decoder_ffn_dim=80, max_encoder_position_embeddings=64,
              max_decoder_position_embeddings=32, attention_window=[4, 8], pad_token_id=1,
              bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
SOURCE_LEN, TARGET_LEN = 12, 10
# The preset trimmed to one encoder and one decoder layer: the CLI runs compile less.
ONE_LAYER = ("--set", "model.encoder_layers=1", "--set", "model.decoder_layers=1", "--set",
             "model.attention_window=4")


# ----------------------------------------------------------------------------------------------
# Fixtures


def _copy_pairs(path: Path, count: int, seed: int) -> None:
  """`count` copy-task pairs: the target repeats the source, 3 to 6 words of WORDS."""
  rng = random.Random(seed)
  with open(path, "w") as f:
    for i in range(count):
      words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6)))
      f.write(json.dumps({"id": f"pair-{i}", "source": words, "target": words}) + "\n")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
  """tokenizer.json (WordLevel over WORDS, BART's special tokens and `<s> $A </s>` template),
  train (64 pairs), validation and test (8 each) JSONL files."""
  base = tmp_path_factory.mktemp("seq2seq")
  from tokenizers import models, pre_tokenizers, processors
  vocab = {token: i for i, token in enumerate(SPECIALS + tuple(WORDS))}
  tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer.post_processor = processors.TemplateProcessing(
      single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
  tokenizer.add_special_tokens(list(SPECIALS))
  tokenizer.save(str(base / "tokenizer.json"))
  for name, count in (("train", 64), ("validation", 8), ("test", 8)):
    _copy_pairs(base / f"{name}.jsonl", count, seed_of("seq2seq", name))
  return base


def _argv(files: Path, workdir: Path, *extra: str, model: str = "tiny") -> list[str]:
  return ["--model", model, "--tokenizer", str(files / "tokenizer.json"),
          "--train", str(files / "train.jsonl"), "--max-source-length", str(SOURCE_LEN),
          "--max-target-length", str(TARGET_LEN), "--batch-size", "8",
          "--learning-rate", "3e-3", "--workdir", str(workdir), "--no-progress", *extra]


def _losses(workdir: Path) -> dict[int, float]:
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  losses = {r["step"]: r["train_loss"] for r in records if "train_loss" in r}
  assert len(losses) == sum("train_loss" in r for r in records), "a step was logged twice"
  return losses


# ----------------------------------------------------------------------------------------------
# End to end


def test_fine_tune_resume_and_rouge(files, tmp_path, capsys):
  workdir = tmp_path / "run"
  assert cli.main(_argv(files, workdir, "--steps", "20", *ONE_LAYER)) == 0
  assert json.loads((workdir / "results.json").read_text())["steps"] == 20

  # The same command with more steps continues the run from its last checkpoint (evaluation
  # files are not part of a run's identity: they may come and go).
  capsys.readouterr()
  assert cli.main(_argv(files, workdir, "--steps", "40", "--validation",
                        str(files / "validation.jsonl"), "--test", str(files / "test.jsonl"),
                        "--set", "eval_every=20", *ONE_LAYER)) == 0
  assert "resumed from step 20" in capsys.readouterr().out
  losses = _losses(workdir)
  assert sorted(losses) == list(range(1, 41))
  start, end = np.mean([losses[s] for s in (1, 2, 3)]), np.mean([losses[s] for s in (38, 39, 40)])
  assert end < 0.7 * start, f"the copy task's loss went from {start:.3f} to {end:.3f}"

  results = json.loads((workdir / "results.json").read_text())
  assert results["steps"] == results["checkpoint_step"] == 40
  assert results["generation"] == {"num_beams": 1, "max_new_tokens": TARGET_LEN}
  assert results["valid_loss"] < losses[1]
  # final_logits_bias (HF: a buffer) is never trained: the preset's zeros stay zeros.
  config = LEDConfig.tiny(vocab_size=12, encoder_layers=1, decoder_layers=1, attention_window=4)
  params = checkpoint.load_params(workdir, nnx.state(nnx.eval_shape(
      lambda: led.LEDForConditionalGeneration(config, rngs=nnx.Rngs(0))), nnx.Param))
  assert not np.any(np.asarray(params["final_logits_bias"][...]))
  # The run's workdir is itself a model to fine-tune further, and so is a model checkpoint.
  source = seq2seq.load_source(str(workdir))
  assert source.identity["kind"] == "workdir" and source.config == config
  np.testing.assert_array_equal(source.params["led"]["shared"]["embedding"],
                                params["led"]["shared"]["embedding"][...])
  checkpoint.save_model(tmp_path / "model", checkpoint.restore_model(
      lambda: led.LEDForConditionalGeneration(config, rngs=nnx.Rngs(0)), workdir))
  saved = seq2seq.load_source(str(tmp_path / "model"))
  assert saved.identity == {**source.identity, "kind": "checkpoint"}
  for split in ("validation", "test"):
    scores = results[split]
    assert scores["pairs"] == 8
    assert all(0.0 <= scores[k] <= 1.0 for k in seq2seq.ROUGE_TYPES), scores
    lines = (workdir / f"predictions_{split}.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    pairs = [json.loads(line) for line in (files / f"{split}.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == [p["id"] for p in pairs]
    assert [r["reference"] for r in records] == [p["target"] for p in pairs]
    # The scores are those of the written predictions.
    assert seq2seq.rouge([r["prediction"] for r in records],
                         [r["reference"] for r in records]) == pytest.approx(
                             {k: scores[k] for k in seq2seq.ROUGE_TYPES})
  assert not list(workdir.glob(".*.tmp*")), "a temporary file was left behind"


def test_bad_jsonl_line_is_a_one_line_error(files, tmp_path, capsys):
  bad = tmp_path / "bad.jsonl"
  good = (files / "train.jsonl").read_text().splitlines()
  bad.write_text("\n".join(good[:2] + ['{"source": "a b", "target": 3}'] + good[2:]) + "\n")
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_status:  # what `python -m train.seq2seq` exits with
    cli.main(_argv(files, tmp_path / "run", "--steps", "1", "--test", str(bad)))
  assert exit_status.value.code == 2
  lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
  assert len(lines) == 1 and f"error: {bad}:3: field 'target' must be a string, got 3" in lines[0]
  assert not (tmp_path / "run").exists()  # nothing was written


@pytest.mark.parametrize("content, line, field, problem", [
    ('{"source": "a", "target": "b"}\n{"source": "a"', 2, None, "is not JSON"),
    ('["a", "b"]', 1, None, "must be a JSON object, got list"),
    ('{"source": "a"}', 1, "target", "is missing"),
    ('{"source": "a", "target": "  "}', 1, "target", "is empty"),
    ('{"source": "a \\ud83d\\ude00", "target": "b \\udc00"}', 1, "target",
     r"holds a lone surrogate '\\udc00' \(half of a UTF-16 pair, not text\)"),
    ('{"source": "a", "target": "b", "id": true}', 1, "id", "must be a string or an integer"),
    ('{"source": "a", "target": "b", "id": 7}\n\n{"source": "c", "target": "d", "id": 7}', 3,
     "id", "repeats 7 of line 1"),
    ("\n\n", None, None, "holds no records"),
])
def test_jsonl_rules(tmp_path, content, line, field, problem):
  path = tmp_path / "pairs.jsonl"
  path.write_text(content)
  with pytest.raises(text.JsonlError, match=problem) as error:
    text.read_jsonl(path, {"source": str, "target": str}, optional={"id": (str, int)},
                    unique=("id",))
  assert (error.value.line, error.value.field) == (line, field)
  assert str(error.value).startswith(f"{path}:{line}:" if line else f"{path}:")
  path.write_bytes(b'{"source": "\xff", "target": "b"}\n')
  with pytest.raises(text.JsonlError, match=r":1: is not UTF-8"):
    text.read_jsonl(path, {"source": str, "target": str})


# ----------------------------------------------------------------------------------------------
# Pieces


def test_pairs_labels_and_global_tokens(files):
  tokenizer = load_tokenizer(files)  # the directory holding tokenizer.json
  split = seq2seq.read_pairs(files / "train.jsonl", tokenizer, max_source_length=6,
                             max_target_length=4, eos_token_id=2)
  first = json.loads((files / "train.jsonl").read_text().splitlines()[0])
  ids = [tokenizer.token_to_id(w) for w in first["source"].split()]
  # HF's truncation: the text is cut, <s> and </s> kept; every target ends with EOS.
  np.testing.assert_array_equal(split.sources[0], [0] + ids[:4] + [2])
  np.testing.assert_array_equal(split.targets[0], [0] + ids[:2] + [2])
  assert split.ids[0] == "pair-0" and split.references[0] == first["target"]

  batch = seq2seq.training_batch(split, [0, 1], pad_token_id=1,
                                 global_attention=seq2seq.GlobalAttention())
  assert batch["labels"].shape == (2, 4) and batch["input_ids"].shape == (2, 6)
  np.testing.assert_array_equal(batch["global_attention_mask"][:, 0], [1, 1])
  assert batch["global_attention_mask"][:, 1:].sum() == 0
  separator = seq2seq.GlobalAttention.parse("token:</s>", tokenizer)
  mask = separator.mask(batch["input_ids"], batch["attention_mask"])
  np.testing.assert_array_equal(mask, (batch["input_ids"] == 2) & (batch["attention_mask"] == 1))
  assert not seq2seq.GlobalAttention.parse("none").mask(batch["input_ids"],
                                                       batch["attention_mask"]).any()
  with pytest.raises(ValueError, match="has no token '<sep>'"):
    seq2seq.GlobalAttention.parse("token:<sep>", tokenizer)

  # Decoder inputs: the labels shifted right behind the decoder start token, padding -> pad.
  labels = np.array([[5, 6, 2, seq2seq.IGNORE_INDEX]])
  np.testing.assert_array_equal(led.shift_tokens_right(labels, 1, 2), [[2, 5, 6, 2]])


def test_example_sampler_resumes_and_splits_between_processes():
  full = text.ExampleSampler(10, global_batch_size=4, seed=3)
  batches = [next(full) for _ in range(6)]  # 24 rows: every example in each 10-row epoch
  flat = np.concatenate(batches)
  assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
  resumed = text.ExampleSampler(10, global_batch_size=4, seed=3)
  resumed.load_state(json.loads(json.dumps(full.state())))
  np.testing.assert_array_equal(next(resumed), full.global_indices(6))
  halves = [text.ExampleSampler(10, global_batch_size=4, seed=3, process_index=p,
                                process_count=2) for p in (0, 1)]
  np.testing.assert_array_equal(np.concatenate([next(h) for h in halves]), batches[0])
  with pytest.raises(ValueError, match="num_examples=11"):
    resumed.load_state({**full.state(), "num_examples": 11})


# ----------------------------------------------------------------------------------------------
# Starting from HF directories


def _hf_loss(hf_model, batch) -> float:
  import torch
  kwargs = {k: torch.from_numpy(v).long() for k, v in batch.items()}
  if "global_attention_mask" in kwargs and "bart" in type(hf_model).__name__.lower():
    del kwargs["global_attention_mask"]
  with torch.no_grad():
    return float(hf_model(**kwargs).loss)


def _task_loss(cfg, task, source, batch) -> float:
  """The run's first loss as `train` computes it, dropout off (HF's model is in eval mode)."""
  from longformer_jax.training import Trainer
  trainer = Trainer(dataclasses.replace(cfg, model=cfg.model.replace(dropout=0.0)), task=task)
  model = trainer.model(trainer.init_state(source.params).params)
  # Jitted: run op by op, the model would compile hundreds of small programs.
  loss = nnx.jit(lambda model, batch: task.loss(model, batch, cfg.stages[0], jax.random.key(0)))
  return float(loss(model, {k: jnp.asarray(v) for k, v in batch.items()}))


def test_hf_led_directory(files, tmp_path):
  transformers = pytest.importorskip("transformers")
  import torch
  torch.manual_seed(seed_of("seq2seq hf led"))
  hf = transformers.LEDForConditionalGeneration(transformers.LEDConfig(**HF_LED))
  with torch.no_grad():
    hf.final_logits_bias.normal_()  # a buffer, which random init leaves at zero
  hf.eval().save_pretrained(tmp_path / "hf_led")

  command = cli.Seq2Seq()
  _, cfg, plan = command.resolve(_argv(files, tmp_path / "run", "--steps", "2",
                                          model=str(tmp_path / "hf_led")))
  task, source, splits = plan.task, command.source, {"train": plan.task.train}
  assert source.identity["kind"] == "hf_led"
  assert cfg.model == LEDConfig.tiny(vocab_size=12)
  batch = seq2seq.training_batch(splits["train"], range(8), pad_token_id=1,
                                 global_attention=task.global_attention)
  assert _task_loss(cfg, task, source, batch) == pytest.approx(_hf_loss(hf, batch), abs=1e-5)
  from longformer_jax.training import Trainer
  partial = {k: v for k, v in source.params.items() if k != "final_logits_bias"}
  with pytest.raises(ValueError, match=r"missing \['final_logits_bias'\]"):
    Trainer(cfg, task=task).init_state(partial)


def test_bart_directory_made_long(files, tmp_path):
  transformers = pytest.importorskip("transformers")
  import torch
  torch.manual_seed(seed_of("seq2seq bart"))
  fields = {k: v for k, v in HF_LED.items() if not k.startswith(("max_", "attention_"))}
  bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
      **fields, max_position_embeddings=16))
  bart.eval().save_pretrained(tmp_path / "bart")

  command = cli.Seq2Seq()
  _, cfg, plan = command.resolve(_argv(files, tmp_path / "run", "--steps", "2",
                                          "--bart-positions", "64", "--bart-window", "16",
                                          model=str(tmp_path / "bart")))
  task, source, splits = plan.task, command.source, {"train": plan.task.train}
  assert source.identity["kind"] == "hf_bart"
  assert (cfg.model.max_encoder_position_embeddings, cfg.model.layer_windows) == (64, (16, 16))
  batch = seq2seq.training_batch(splits["train"], range(8), pad_token_id=1,
                                 global_attention=task.global_attention)
  # Sources within BART's 14 positions and the window: the LED computes the BART's loss.
  assert _task_loss(cfg, task, source, batch) == pytest.approx(_hf_loss(bart, batch), abs=1e-5)
