"""Masked-LM pretraining (`tasks.mlm`, `data.tokenized`, `python -m train.mlm`, `eval.mlm`):
RoBERTa's masking statistics, packing, the bits-per-character definition on a hand-computed
example, the paper preset's schedule, steps that are functions of the step (exact resume), and
the command line end to end from a tiny RoBERTa (positions copied) with a resume, and bad
arguments."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longformer_jax import LongformerConfig, LongformerForMaskedLM
from longformer_jax.data import tokenized
from longformer_jax.data.tokenizer import load_tokenizer, special_ids
from longformer_jax.training import Stage, TrainConfig, Trainer, learning_rate_schedule
from longformer_jax.tasks import mlm
from longformer_jax.training import sources
from testing import seed_of

# slow: in-process, but most of the cost is training runs, command lines and subprocesses.
pytestmark = [pytest.mark.unit, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("The quick brown fox jumps over the lazy dog near the river bank.\n"
        "Longformer reads long documents with a sliding window of attention.\n\n"
        "   Every line is a document; blank lines are dropped.   \n")


@pytest.fixture(scope="module")
def tokenizer():
  return tokenized.train_bpe(tokenized.documents(TEXT * 20), vocab_size=300)


def _rows(rng, specials, vocab_size, shape):
  """Random non-special ids with <s> first, </s> last and some <pad> at the end of rows."""
  ids = rng.integers(max(specials.special) + 1, vocab_size, shape)
  ids[:, 0], ids[:, -1] = specials.bos, specials.eos
  ids[::3, -20:] = specials.pad
  return ids


def test_masking_statistics_and_determinism(tokenizer):
  specials = special_ids(tokenizer)
  vocab = tokenizer.get_vocab_size()
  ids = _rows(np.random.default_rng(seed_of("mask")), specials, vocab, (64, 512))
  keys = [(7, 0, 0, 3, r) for r in range(len(ids))]
  inputs, labels = mlm.mask_tokens(ids, keys, specials, vocab)
  chosen = labels >= 0
  special = np.isin(ids, specials.special)
  assert not np.any(chosen & special)                    # specials are never targets ...
  np.testing.assert_array_equal(inputs[special], ids[special])  # ... nor changed
  np.testing.assert_array_equal(labels[chosen], ids[chosen])
  # floor(0.15 M + u) per row: 15% of the maskable tokens up to rounding, within P per row.
  per_row = chosen.sum(1)
  np.testing.assert_array_less(np.abs(per_row - 0.15 * (~special).sum(1)), 1.0)
  assert per_row.max() <= mlm.max_predictions(512)
  # 80% <mask> / 10% random / 10% unchanged over ~4,900 targets (4.5 sigma tolerances).
  masked = np.mean(inputs[chosen] == specials.mask)
  kept = np.mean(inputs[chosen] == ids[chosen])
  replaced = inputs[chosen][(inputs[chosen] != specials.mask) & (inputs[chosen] != ids[chosen])]
  assert abs(masked - 0.8) < 0.026 and abs(kept - 0.1) < 0.02
  assert abs(replaced.size / chosen.sum() - 0.1) < 0.02
  assert not np.any(np.isin(replaced, specials.special))
  # A function of the keys only: the same keys give the same masks, another step others.
  again = mlm.mask_tokens(ids, keys, specials, vocab)
  np.testing.assert_array_equal(again[0], inputs)
  np.testing.assert_array_equal(again[1], labels)
  other = mlm.mask_tokens(ids, [(7, 0, 0, 4, r) for r in range(len(ids))], specials, vocab)[1]
  assert np.mean((other >= 0) == chosen) < 0.9
  with pytest.raises(ValueError, match="mask rate must be in"):
    mlm.mask_tokens(ids, keys, specials, vocab, rate=1.5)


def test_batches_do_not_depend_on_the_process_layout_and_resume(tokenizer):
  specials = special_ids(tokenizer)
  stream = tokenized.encode_documents(tokenizer, tokenized.documents(TEXT * 40), specials.eos)
  stage = Stage(seq_len=32, batch_size=4, steps=10, learning_rate=1e-3)
  make = lambda p, n: mlm.MaskedBatches(stream, stage, seed=3, stage_index=0, specials=specials,
                                        vocab_size=tokenizer.get_vocab_size(), rate=0.15,
                                        process_index=p, process_count=n)
  whole, halves = make(0, 1), [make(0, 2), make(1, 2)]
  for _ in range(3):
    batch = next(whole)
    parts = [next(h) for h in halves]
    for name in ("input_ids", "labels"):
      np.testing.assert_array_equal(batch[name], np.concatenate([p[name] for p in parts]))
  assert batch["input_ids"].shape == (4, 32) and np.all(batch["input_ids"][:, 0] == specials.bos)
  resumed = make(0, 1)
  resumed.load_state(whole.state())
  np.testing.assert_array_equal(next(resumed)["labels"], next(whole)["labels"])


def test_documents_and_packing_lose_no_token(tokenizer):
  assert tokenized.documents(TEXT) == [
      "The quick brown fox jumps over the lazy dog near the river bank.",
      "Longformer reads long documents with a sliding window of attention.",
      "Every line is a document; blank lines are dropped."]
  specials = special_ids(tokenizer)
  stream = tokenized.encode_documents(tokenizer, tokenized.documents(TEXT), specials.eos)
  assert np.sum(stream == specials.eos) == 3 and stream[-1] == specials.eos
  assert tokenizer.decode(stream[stream != specials.eos].tolist()).startswith("The quick brown")
  rows = tokenized.pack(stream, 10, specials)
  assert rows.shape == (math.ceil(stream.size / 8), 10) and rows.dtype == np.int32
  assert np.all(rows[:, 0] == specials.bos)
  body = rows[:, 1:-1].reshape(-1)
  tail = stream.size - 8 * (len(rows) - 1)  # tokens in the last row
  np.testing.assert_array_equal(np.concatenate([body[:-8], rows[-1, 1:1 + tail]]), stream)
  assert rows[-1, 1 + tail] == specials.eos and np.all(rows[-1, 2 + tail:] == specials.pad)
  assert np.all(rows[:-1, -1] == specials.eos)
  with pytest.raises(ValueError, match="seq_len must be an int >= 3"):
    tokenized.pack(stream, 2, specials)


def test_a_token_cache_is_read_only_when_its_checksum_matches(tokenizer, tmp_path, capsys,
                                                              monkeypatch):
  # Written with its SHA-256 beside it and read back as it is (nothing tokenized again); one
  # without the checksum (an earlier version's, or cut off between the two writes) is rebuilt
  # with one line. (A damaged one: the command line test below.)
  text, cache = tmp_path / "corpus.txt", tmp_path / "cache"
  text.write_text(TEXT * 20)
  ids = tokenized.token_ids(str(text), "train", tokenizer, cache=cache)
  [stream] = cache.glob("*.npy")
  encode = tokenized.encode_documents
  monkeypatch.setattr(tokenized, "encode_documents", None)  # not called: read from the cache
  np.testing.assert_array_equal(tokenized.token_ids(str(text), "train", tokenizer, cache=cache),
                                ids)
  assert capsys.readouterr().err == ""
  monkeypatch.setattr(tokenized, "encode_documents", encode)
  stream.with_suffix(".sha256").unlink()
  np.testing.assert_array_equal(tokenized.token_ids(str(text), "train", tokenizer, cache=cache),
                                ids)
  assert capsys.readouterr().err == (f"warning: the token cache {stream} has no checksum beside "
                                     f"it: rebuilt from {text} (train)\n")
  assert stream.with_suffix(".sha256").read_text() == (
      hashlib.sha256(stream.read_bytes()).hexdigest() + "\n")


def test_roberta_vocab_and_merges_load_as_the_same_tokenizer(tokenizer, tmp_path):
  """A RoBERTa directory without tokenizer.json: vocab.json + merges.txt, byte-level BPE."""
  model = json.loads(tokenizer.to_str())["model"]
  (tmp_path / "vocab.json").write_text(json.dumps(model["vocab"]))
  (tmp_path / "merges.txt").write_text(
      "#version: 0.2\n" + "".join(f"{' '.join(m) if isinstance(m, list) else m}\n"
                                  for m in model["merges"]))
  loaded = load_tokenizer(tmp_path)
  assert loaded.encode(TEXT).ids == tokenizer.encode(TEXT).ids
  assert loaded.decode(loaded.encode(TEXT).ids) == TEXT
  assert special_ids(loaded) == special_ids(tokenizer)


def test_a_tfds_source_gives_the_same_documents(tmp_path):
  """In a data directory of its own: the project's builder is prepared on first use (whatever
  other tests prepared elsewhere); a TFDS dataset that is not prepared is named as such."""
  pytest.importorskip("tensorflow_datasets")
  assert (tokenized.text_of("tfds:enwik8_sample:bytes", "validation", data_dir=tmp_path)
          == tokenized.text_of("enwik8_sample", "validation", data_dir=tmp_path))
  with pytest.raises(ValueError, match="has no feature 'text'; its features: \\['bytes'"):
    tokenized.text_of("tfds:enwik8_sample", "validation", data_dir=tmp_path)
  with pytest.raises(FileNotFoundError, match="tfds:mnist is not prepared in"):
    tokenized.text_of("tfds:mnist", "validation", data_dir=tmp_path)


def _bias_only_model(vocab_size: int, bias: np.ndarray) -> LongformerForMaskedLM:
  """A masked LM whose logits are `bias` at every position: with zero word embeddings the tied
  decoder adds nothing to the LM head's bias."""
  config = LongformerConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=32,
                            max_position_embeddings=66, attention_window=4)
  model = LongformerForMaskedLM(config, rngs=nnx.Rngs(0))
  table = model.longformer.embeddings.word_embeddings.embedding
  table[...] = jnp.zeros_like(table[...])
  model.lm_head.bias[...] = jnp.asarray(bias, jnp.float32)
  return model


def test_bits_per_character_on_a_hand_computed_example(tokenizer):
  """p("abc") = 1/2 and p("x") = 1/4 wherever they are masked: 1 bit over 3 bytes, 2 bits over
  1 byte."""
  tok = tokenized.train_bpe(["abc abc xabc abcabc"] * 50, vocab_size=270)
  specials, vocab = special_ids(tok), tok.get_vocab_size()
  abc, x = tok.token_to_id("abc"), tok.token_to_id("x")
  bytes_per_token = tokenized.token_bytes(tok)
  assert (bytes_per_token[abc], bytes_per_token[x]) == (3, 1)
  assert bytes_per_token[tok.token_to_id("Ġabc")] == 4 and bytes_per_token[specials.mask] == 0
  probs = np.full(vocab, 0.25 / (vocab - 2))
  probs[abc], probs[x] = 0.5, 0.25
  model = _bias_only_model(vocab, np.log(probs))
  score = lambda stream: mlm.evaluate_mlm(
      model, stream, seq_len=64, specials=specials, bytes_per_token=bytes_per_token,
      vocab_size=vocab, batch_size=3)
  only_abc = score(np.full(700, abc))
  assert only_abc["masked_bytes"] == 3 * only_abc["masked_tokens"]
  np.testing.assert_allclose(
      [only_abc["bpc"], only_abc["bits_per_token"], only_abc["loss"]],
      [1 / 3, 1.0, math.log(2)], rtol=1e-5)
  mixed = score(np.where(np.arange(700) % 3 == 0, x, abc))
  n_abc = (mixed["masked_bytes"] - mixed["masked_tokens"]) // 2  # 3 n_abc + n_x bytes
  n_x = mixed["masked_tokens"] - n_abc
  assert n_abc > 0 and n_x > 0
  np.testing.assert_allclose(mixed["bpc"], (n_abc * 1 + n_x * 2) / (3 * n_abc + n_x), rtol=1e-5)
  np.testing.assert_allclose(mixed["bits_per_token"], (n_abc + 2 * n_x) / (n_abc + n_x),
                             rtol=1e-5)


def test_paper_preset_and_its_power_3_schedule():
  from longformer_jax.cli.settings import load_config
  from longformer_jax.commands.train_mlm import MLM
  cfg = load_config(ROOT / "train" / "configs" / "mlm_paper.py")  # --preset mlm_paper
  stage = cfg.stages[0]
  assert (stage.seq_len, stage.batch_size, stage.steps) == (4096, 64, 65_000)
  assert (stage.learning_rate, stage.warmup_steps, stage.decay_power) == (3e-5, 500, 3.0)
  assert cfg.microbatch_size == 8 and cfg.model.attention_window == 256
  schedule = learning_rate_schedule(cfg)
  for step, expected in [(250, 1.5e-5), (500, 3e-5), (500 + 32_250, 3e-5 / 8), (65_000, 0.0)]:
    np.testing.assert_allclose(float(schedule(step)), expected, rtol=1e-4, atol=1e-12)
  with pytest.raises(ValueError, match="decay_power=3.0 needs end_learning_rate"):
    Stage(seq_len=8, batch_size=1, steps=2, learning_rate=1e-3, decay_power=3.0)
  with pytest.raises(ValueError, match="unknown preset 'nope'"):
    MLM().command().preset_file("nope")


def _tiny_task_config(tokenizer, **changes):
  model = LongformerConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32,
                           num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           max_position_embeddings=34, attention_window=4)
  return TrainConfig(model=model, dataset="unused", stages=(
      Stage(seq_len=32, batch_size=4, steps=4, learning_rate=3e-3),), eval_every=1000,
      checkpoint_every=2, async_checkpoints=False, **changes)


def test_steps_are_functions_of_the_step_so_a_resume_is_exact(tokenizer):
  """Masks (batches) and dropout are keyed by the step: continuing from a batch iterator's saved
  state and the state reached gives bit for bit the uninterrupted losses (the loop's checkpoint
  round trip is tests/test_training.py's)."""
  specials = special_ids(tokenizer)
  stream = tokenized.encode_documents(tokenizer, tokenized.documents(TEXT * 40), specials.eos)
  cfg = _tiny_task_config(tokenizer)
  cfg = dataclasses.replace(cfg, model=cfg.model.replace(hidden_dropout_prob=0.1))
  task = mlm.MLMTask(tokenizer, train_ids=stream, valid_ids=stream)
  trainer = Trainer(cfg, task=task)
  step = trainer.train_step(0)

  def run(state, batches, n):
    losses = []
    for _ in range(n):
      state, metrics = step(state, trainer.global_batch(next(batches), 4))
      losses.append(float(metrics["loss"]))
    return state, losses

  new_batches = lambda: task.batches(cfg, 0, process_index=0, process_count=1)
  _, full = run(trainer.init_state(), new_batches(), 4)
  batches = new_batches()
  state, first = run(trainer.init_state(), batches, 2)
  resumed = new_batches()
  resumed.load_state(batches.state())
  _, rest = run(state, resumed, 2)
  assert first + rest == full and full[3] < full[0]
  # Dropout is on and keyed: the same batch under two step keys gives two losses.
  loss = jax.jit(lambda params, rest, batch, key: task.loss(
      nnx.merge(trainer.graphdef, params, rest), batch, cfg.stages[0], key))
  params, batch = trainer.init_state().params, next(new_batches())
  losses = [float(loss(params, trainer.rest, batch, jax.random.key(k))) for k in (1, 2)]
  assert losses[0] != losses[1]


def _tiny_roberta(directory: Path, tokenizer) -> None:
  """A RobertaForMaskedLM with 32 positions and `tokenizer`, saved like a hub download."""
  import transformers
  config = transformers.RobertaConfig(
      vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=1,
      num_attention_heads=2, intermediate_size=64, max_position_embeddings=34,
      type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2)
  import torch
  torch.manual_seed(0)
  transformers.RobertaForMaskedLM(config).save_pretrained(directory)
  tokenizer.save(str(directory / "tokenizer.json"))


def _run(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", LONGFORMER_JAX_CACHE=os.environ["MLM_TEST_CACHE"])
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)


def test_command_line_continues_a_roberta_lowers_the_loss_and_resumes(tokenizer, tmp_path,
                                                                       monkeypatch, capsys):
  text = tmp_path / "corpus.txt"
  text.write_text(TEXT * 300)
  roberta = tmp_path / "roberta"
  _tiny_roberta(roberta, tokenizer)
  monkeypatch.setenv("MLM_TEST_CACHE", str(tmp_path / "cache"))
  workdir = tmp_path / "run"
  # 64-token sequences from a 32-position RoBERTa: its positions are copied twice.
  command = ["-m", "train.mlm", "--preset", "mlm_tiny", "--init", str(roberta), "--data",
             str(text), "--workdir", str(workdir), "--no-progress",
             "--set", "stages.0.seq_len=64", "--set", "stages.0.batch_size=4",
             "--set", "stages.0.warmup_steps=0", "--set", "stages.0.learning_rate=3e-3",
             "--set", "stages.0.end_learning_rate=None", "--set", "stages.0.decay_power=None",
             "--set", "model.attention_window=8", "--set", "eval_every=6",
             "--set", "checkpoint_every=3", "--set", "eval_tokens=512",
             "--set", "final_eval.max_tokens=512"]
  first = _run(*command, "--set", "stages.0.steps=6", "--skip-final-eval")
  assert first.returncode == 0, first.stderr[-3000:]
  record = json.loads((workdir / "run_config.json").read_text())
  assert record["model"]["max_position_embeddings"] == 66  # 64 tokens + RoBERTa's offset 2
  # The starting weights are part of the run (a resume from others is refused).
  init_model, _ = mlm.load_pretrained(roberta, max_positions=64, window=8)
  assert record["data"]["init"] == {
      "kind": "hf_roberta",
      "params_sha256": sources.params_fingerprint(nnx.state(init_model, nnx.Param))}
  assert (workdir / "tokenizer.json").exists()
  # A damaged training cache is rebuilt from its source (one line), so the resume trains on the
  # run's ids (before: refused as a run on other data; a new run took the wrong ids).
  [train_cache] = (tmp_path / "cache" / "mlm_tokens").glob("corpus_txt-train-*.npy")
  recorded = train_cache.with_suffix(".sha256").read_text().strip()
  assert recorded == hashlib.sha256(train_cache.read_bytes()).hexdigest()
  damaged = bytearray(train_cache.read_bytes())
  damaged[-2:] = (5).to_bytes(2, "little") if damaged[-2:] != b"\x05\x00" else b"\x06\x00"
  train_cache.write_bytes(bytes(damaged))
  second = _run(*command, "--set", "stages.0.steps=10")
  assert second.returncode == 0, second.stderr[-3000:]
  assert "resumed from step 6" in second.stdout
  rebuilt = [line for line in second.stderr.splitlines() if "token cache" in line]
  assert rebuilt == [f"warning: the token cache {train_cache} has sha256 "
                     f"{hashlib.sha256(damaged).hexdigest()[:16]}..., its checksum file says "
                     f"{recorded[:16]}...: rebuilt from {text} (train)"]
  assert hashlib.sha256(train_cache.read_bytes()).hexdigest() == recorded
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  losses = {r["step"]: r["train_loss"] for r in records if "train_loss" in r}
  assert sorted(losses) == list(range(1, 11))
  assert np.mean([losses[s] for s in (8, 9, 10)]) < np.mean([losses[s] for s in (1, 2, 3)])
  results = json.loads((workdir / "results.json").read_text())
  assert results["steps"] == 10 and results["eval"]["split"] == "test"
  assert results["checkpoint_step"] == results["eval"]["step"] == 10
  assert all(math.isfinite(results["eval"][k]) for k in ("loss", "bits_per_token", "bpc"))
  assert results["valid_bpc"] > 0

  from longformer_jax.commands.eval_mlm import main as eval_main
  from longformer_jax.commands.train_mlm import main as train_main
  monkeypatch.setenv("LONGFORMER_JAX_CACHE", str(tmp_path / "cache"))
  # Another tokenizer.json in the workdir, or an edited run_config.json (a window of 2 scores
  # other numbers), is refused in one line, by the evaluation and by a resume, before any work.
  run_files = {name: (workdir / name).read_bytes() for name in ("tokenizer.json",
                                                                "run_config.json")}
  other = tokenized.train_bpe(tokenized.documents("a b c d\n" * 50), vocab_size=270)
  record = json.loads(run_files["run_config.json"])
  edited = json.dumps({**record, "model": {**record["model"], "attention_window": 2}})
  other_tokenizer = f"the tokenizer {workdir / 'tokenizer.json'} has sha256 "
  evaluation = ["--workdir", str(workdir), "--split", "validation"]
  for prog, main, args, name, changed, message in (
      ("eval.mlm", eval_main, evaluation, "tokenizer.json", other.to_str(), other_tokenizer),
      ("eval.mlm", eval_main, evaluation, "run_config.json", edited,
       f"{workdir / 'run_config.json'} is not the run's record: model.attention_window is 2 "
       f"there, 8 in the run's record"),
      ("train.mlm", train_main, command[2:], "tokenizer.json", other.to_str(),
       other_tokenizer)):
    (workdir / name).write_text(changed)
    capsys.readouterr()  # what came before
    with pytest.raises(SystemExit) as exit_info:
      main(args)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.startswith(f"{prog}: error: {message}"), err
    assert len(err.splitlines()) == 1, err
    (workdir / name).write_bytes(run_files[name])
  assert not (workdir / "mlm_validation.json").exists()
  assert eval_main(["--workdir", str(workdir), "--split", "validation", "--max-tokens", "512",
                    "--no-progress"]) == 0
  scored = json.loads((workdir / "mlm_validation.json").read_text())
  np.testing.assert_allclose(scored["bpc"], results["valid_bpc"], rtol=1e-5)  # same targets
  assert scored["step"] == 10 and " targets; step 10)\n" in capsys.readouterr().out



def test_a_failed_starts_tokenizer_is_not_the_next_runs(tmp_path):
  # A start that failed before its first checkpoint left its tokenizer, trained on another
  # corpus: the next start trains its own and keeps that one.
  from longformer_jax.commands.train_mlm import MLM
  workdir = tmp_path / "run"
  workdir.mkdir()
  stale = tokenized.train_bpe(tokenized.documents("a b c d\n" * 50), vocab_size=270)
  stale.save(str(workdir / mlm.TOKENIZER_FILE))
  text = tmp_path / "corpus.txt"
  text.write_text(TEXT * 20)
  *_, plan = MLM().resolve(["--preset", "mlm_tiny", "--data", str(text), "--workdir",
                            str(workdir), "--no-progress"])
  saved = (workdir / mlm.TOKENIZER_FILE).read_text()
  assert saved == plan.task.tokenizer.to_str(pretty=True) != stale.to_str(pretty=True)
  assert "Ġquick" in plan.task.tokenizer.get_vocab()  # learnt from this corpus


@pytest.mark.parametrize("args, message", [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--preset", "mlm_paper"], "preset mlm_paper continues a pretrained model"),
    # The default preset trains from scratch: the schedule of a pretrained model is named.
    (["--init", "/nonexistent/roberta"], "--init continues a pretrained model: name its "
                                         "schedule (--preset mlm_paper"),
    (["--preset", "mlm_tiny", "--init", "/nonexistent/roberta"], "is not a model directory"),
    (["--preset", "mlm_tiny", "--set", "stages.0.sequence=3"], "unknown field 'sequence'"),
])
def test_bad_arguments_exit_2_with_one_line(args, message, capsys, tmp_path):
  from longformer_jax.commands.train_mlm import main
  with pytest.raises(SystemExit) as exit_info:
    main([*args, "--workdir", str(tmp_path / "w"), "--no-progress"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert message in err and len(err.splitlines()) == 1 and "error:" in err
  assert not (tmp_path / "w").exists()


def test_task_checks_name_the_bad_value(tokenizer):
  task = mlm.MLMTask(tokenizer, train_ids=np.zeros(10, np.int32))
  cfg = _tiny_task_config(tokenizer)
  with pytest.raises(ValueError, match=r"stages\[0\]\.seq_len=40 must be in \[3, 32\]"):
    task.check(dataclasses.replace(cfg, stages=(
        Stage(seq_len=40, batch_size=4, steps=4, learning_rate=1e-3),)))
  small = cfg.model.replace(vocab_size=100)
  with pytest.raises(ValueError, match="the tokenizer has 300 ids; the model's vocabulary holds "
                                       "100"):
    task.check(dataclasses.replace(cfg, model=small))
  with pytest.raises(ValueError, match="the tokenizer's <pad> is id 1, the model's pad_token_id "
                                       "is 3: it is not this model's tokenizer"):
    task.check(dataclasses.replace(cfg, model=cfg.model.replace(pad_token_id=3)))
  with pytest.raises(ValueError, match="has shape"):
    params = nnx.state(nnx.eval_shape(lambda: LongformerForMaskedLM(cfg.model, rngs=nnx.Rngs(0))),
                       nnx.Param)
    mlm.check_params_fit(cfg.model.replace(hidden_size=64, intermediate_size=64), params)
  with pytest.raises(FileNotFoundError, match="no such tokenizer file"):
    load_tokenizer(ROOT / "docs")
