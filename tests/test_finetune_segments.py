"""The segment baseline of fine-tuning (`FinetuneOptions(baseline="segments")`,
`tasks.finetune_segments`) for every kind, on a tiny model: a document that fits one segment
gives the Longformer's outputs; longer ones are each segment's row read alone (QA's logits
stitched, multiple choice's scores summed); editing segment 2 leaves segment 1's states
bit-identical where the Longformer's change; the options are checked. The command line's
save / reload / --eval-only of a segments run is in tests/test_finetune.py."""

import json

import numpy as np
import pytest
from flax import nnx

from longformer_jax import segments
from longformer_jax.config import LongformerConfig
from longformer_jax.data import finetune_data as fd
from longformer_jax.data.tokenizer import SpecialIds
from longformer_jax.tasks import finetune as ft

pytestmark = pytest.mark.unit

_CONFIG = LongformerConfig.tiny(num_hidden_layers=1, attention_impl="reference")
_SPECIALS = SpecialIds.of_config(_CONFIG)


def _doc(rng, n):
  return [int(x) for x in rng.integers(10, 60, n)]


def _records(task, lengths, seed=0):
  rng = np.random.default_rng(seed)
  if task == "classification":
    return [{"input_ids": _doc(rng, n), "label": i % 2} for i, n in enumerate(lengths)]
  if task == "qa":
    return [{"question": [5, 6], "input_ids": _doc(rng, n), "answers": [{"start": 1, "end": 2}]}
            for n in lengths]
  if task == "token":
    return [{"input_ids": _doc(rng, n), "labels": (["O", "B"] * n)[:n]} for n in lengths]
  return [{"question": [5], "candidates": [[40], [41, 42], [43]][:2 + i % 2],
           "input_ids": _doc(rng, n), "label": 1} for i, n in enumerate(lengths)]


def _split(tmp_path, task, records, max_length):
  path = tmp_path / f"{task}.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  kind = ft.KINDS[task]
  return fd.read_split(path, kind, None, max_length=max_length, specials=_SPECIALS,
                       vocab_size=512, label_names=kind.label_names([path], None))


def _model(kind, split):
  size = kind.num_labels([split], ft.ModelSource(_CONFIG, None, None, {}))
  model = kind.model_class(_CONFIG.replace(num_labels=size), rngs=nnx.Rngs(0))
  model.eval()
  return model


def _segmented(kind, model, split, segment_length, *, loss=True):
  """The segments' (logits, outputs, loss or None, batch), each a jitted program: eager, every
  primitive of the model compiles anew for each batch shape, several times the time."""
  mode = kind.resolve_global("default")
  reading = ft.FinetuneOptions(baseline="segments", segment_length=segment_length).reading(
      kind, mode)
  reading.check(split)
  seg_batch = reading.batch(split, list(range(len(split))), global_attention=mode,
                            specials=_SPECIALS)
  seg_logits = nnx.jit(reading.logits)(model, seg_batch)
  seg_loss = nnx.jit(reading.loss)(model, seg_batch) if loss else None
  return seg_logits, reading.outputs(seg_logits, 30), seg_loss, seg_batch


def _both(kind, model, split, segment_length):
  """(the Longformer's logits, outputs, loss; the segments' logits, outputs, loss, batch)."""
  mode = kind.resolve_global("default")
  batch = kind.batch(split, list(range(len(split))), global_attention=mode, specials=_SPECIALS)
  max_global = split.max_global(mode)
  logits = nnx.jit(lambda m, b: kind.logits(m, b, max_global))(model, batch)
  plain = (logits, kind.outputs(logits, 30),
           nnx.jit(lambda m, b: kind.loss(m, b, max_global))(model, batch))
  return plain, _segmented(kind, model, split, segment_length)


@pytest.mark.parametrize("task", ["classification", "qa", "token", "multiple_choice"])
def test_a_document_in_one_segment_gives_the_longformer_outputs(tmp_path, task):
  split = _split(tmp_path, task, _records(task, (5, 9, 14)), max_length=24)
  kind = ft.KINDS[task]
  model = _model(kind, split)
  # Rows of the split's length, and the shortest that still hold every example whole.
  longest = max(len(row) for e in split.examples
                for row in (e.input_ids if isinstance(e.input_ids, tuple) else (e.input_ids,)))
  assert longest < 24
  for segment_length in (24, longest):
    (logits, outputs, loss), (seg_logits, seg_outputs, seg_loss, seg_batch) = _both(
        kind, model, split, segment_length)
    assert seg_batch["document_ids"].shape[1] == 24 - (4 if kind.has_question else 2)
    np.testing.assert_allclose(seg_loss, loss, rtol=1e-6, atol=1e-6)
    if task == "qa":  # the logits of every context position, the best span and its score
      for e, row, name in [(e, i, n) for i, e in enumerate(split.examples)
                           for n in ("start_logits", "end_logits")]:
        a, b = e.context
        np.testing.assert_allclose(seg_logits[name][row, :b - a], logits[name][row, a:b],
                                   rtol=1e-6, atol=1e-6)
      for name in ("start", "end"):
        np.testing.assert_array_equal(seg_outputs[name], outputs[name])
      np.testing.assert_allclose(seg_outputs["score"], outputs["score"], rtol=1e-6, atol=1e-6)
    elif task == "token":  # every document position's logits, the tags of every word
      for i, e in enumerate(split.examples):
        n = len(e.input_ids) - 2
        np.testing.assert_allclose(seg_logits["logits"][i, :n], logits["logits"][i, 1:n + 1],
                                   rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(seg_outputs["tags"])[i, e.words],
                                      np.asarray(outputs["tags"])[i, e.words])
    else:
      np.testing.assert_allclose(seg_logits["logits"], logits["logits"], rtol=1e-6, atol=1e-6)
      assert set(seg_outputs) == set(outputs)


def test_segments_are_rows_read_alone_stitched_and_summed(tmp_path):
  """QA: each document position's logits are those of its segment's row read alone by the plain
  model (`<s> question </s></s> segment </s>`); multiple choice: a candidate's score is the sum
  of its segment rows' scores."""
  qa = _split(tmp_path, "qa", _records("qa", (30, 12), seed=1), max_length=48)
  kind = ft.KINDS["qa"]
  model = _model(kind, qa)
  # The plain model's call, jitted once (one program per row length: eager, each new length
  # compiles every primitive again); max_global: the row's exact number of global tokens.
  read_alone = nnx.jit(lambda m, ids, mask, global_mask, max_global: m(
      ids, mask, global_mask, max_global=max_global), static_argnames="max_global")
  seg_logits, seg_outputs, _, _ = _segmented(kind, model, qa, 16, loss=False)
  room = 16 - 5 - 1  # <s> q q </s></s> ... </s>
  for i, e in enumerate(qa.examples):
    document = e.input_ids[e.context[0]:e.context[1]]
    for s in range(-(-len(document) // room)):
      piece = document[s * room:(s + 1) * room]
      row = np.concatenate([e.input_ids[:5], piece, [_SPECIALS.eos]])[None]
      alone = read_alone(model, row, np.ones_like(row),
                         (np.arange(row.shape[1]) < 3)[None].astype(int), max_global=3)
      np.testing.assert_allclose(seg_logits["start_logits"][i, s * room:s * room + len(piece)],
                                 alone.start_logits[0, 5:5 + len(piece)], rtol=1e-5, atol=1e-6)
    assert (seg_logits["start_logits"][i, len(document):] == -1e9).all()  # nothing read there
    assert e.context[0] <= seg_outputs["start"][i] <= seg_outputs["end"][i] < e.context[1]

  mc = _split(tmp_path, "multiple_choice", _records("multiple_choice", (11, 6), seed=2),
              max_length=40)
  kind = ft.KINDS["multiple_choice"]
  model = _model(kind, mc)
  seg_logits, _, _, _ = _segmented(kind, model, mc, 14, loss=False)
  for i, e in enumerate(mc.examples):
    for c, (row, end) in enumerate(zip(e.input_ids, e.candidate_ends)):
      document, head = row[end + 2:-1], row[:end + 2]
      room = 14 - len(head) - 1
      total = 0.0
      for s in range(-(-len(document) // room)):
        seg = np.concatenate([head, document[s * room:(s + 1) * room], [_SPECIALS.eos]])
        ids = seg[None, None]
        total += float(read_alone(model, ids, np.ones_like(ids),
                                  (np.arange(len(seg)) < end)[None, None].astype(int),
                                  max_global=end).logits[0, 0])
      assert seg_logits["logits"][i, c] == pytest.approx(total, rel=1e-5, abs=1e-6)
    assert (seg_logits["logits"][i, len(e.input_ids):] == -1e9).all()


def test_classification_pools_the_first_or_every_segments_start(tmp_path):
  split = _split(tmp_path, "classification", _records("classification", (25,), seed=4),
                 max_length=32)
  kind = ft.KINDS["classification"]
  model = _model(kind, split)
  document = split.examples[0].input_ids[1:-1]
  room = 10 - 2
  starts = []
  # Jitted (eager, each row length compiles every primitive anew); <s> is the one global token.
  encode = nnx.jit(lambda m, ids, mask, global_mask: m.longformer(
      ids, mask, global_mask, max_global=1).last_hidden_state)
  for s in range(-(-len(document) // room)):  # each segment's <s> state, its row read alone
    row = np.concatenate([[_SPECIALS.bos], document[s * room:(s + 1) * room],
                          [_SPECIALS.eos]])[None]
    starts.append(np.asarray(encode(model, row, np.ones_like(row),
                                    np.eye(1, row.shape[1], dtype=int))[:, :1]))
  assert len(starts) == 4
  expected = {"first": model.classifier(starts[0]),
              "mean": model.classifier(np.mean(starts, axis=0))}
  for pool, want in expected.items():
    reading = ft.FinetuneOptions(baseline="segments", segment_length=10,
                                 segment_pool=pool).reading(kind, "first")
    batch = reading.batch(split, [0], global_attention="first", specials=_SPECIALS)
    np.testing.assert_allclose(nnx.jit(reading.logits)(model, batch)["logits"], want,
                               rtol=1e-5, atol=1e-6)
  # The two pools differ by more than the tolerance above (an untrained head: by little).
  assert np.abs(np.asarray(expected["first"]) - np.asarray(expected["mean"])).max() > 2e-5


def test_editing_segment_two_leaves_segment_one_alone(tmp_path):
  records = _records("qa", (40,), seed=3)
  split = _split(tmp_path, "qa", records, max_length=48)
  edited = json.loads(json.dumps(records))
  room = 16 - 5 - 1
  edited[0]["input_ids"][room + 3] = 59 if records[0]["input_ids"][room + 3] != 59 else 58
  (tmp_path / "edited").mkdir()
  split2 = _split(tmp_path / "edited", "qa", edited, max_length=48)
  kind = ft.KINDS["qa"]
  model = _model(kind, split)
  reading = ft.FinetuneOptions(baseline="segments", segment_length=16).reading(kind, "question")
  states = []
  # Jitted, each program once for both splits (eager, every primitive compiles anew).
  row_states = nnx.jit(lambda m, b: reading.encode(m, b).row_states)
  for s in (split, split2):
    batch = reading.batch(s, [0], global_attention="question", specials=_SPECIALS)
    states.append(np.asarray(row_states(model, batch)))
  first, second = states
  np.testing.assert_array_equal(first[0, 0], second[0, 0])  # segment 1: bit-identical
  assert not np.array_equal(first[0, 1], second[0, 1])  # segment 2 itself changed
  # The Longformer reads the whole row: the edit reaches the first segment's positions.
  plain = []
  encode = nnx.jit(lambda m, b, max_global: m.longformer(
      b["input_ids"], b["attention_mask"], b["global_attention_mask"],
      max_global=max_global).last_hidden_state, static_argnames="max_global")
  for s in (split, split2):
    batch = kind.batch(s, [0], global_attention="question", specials=_SPECIALS)
    # The row's exact number of global tokens (the question's).
    max_global = int(np.asarray(batch["global_attention_mask"]).sum(-1).max())
    plain.append(np.asarray(encode(model, batch, max_global=max_global)))
  assert np.abs(plain[0][0, 5:5 + room] - plain[1][0, 5:5 + room]).max() > 1e-4


def test_the_report_counts_as_kept_what_the_segments_read(tmp_path):
  """Under the segment baseline the truncation report's kept tokens are those the segments
  read: what the row of max_length keeps (multiple choice: its candidate rows' fewest)."""
  for task in ("classification", "qa", "token", "multiple_choice"):
    (tmp_path / task).mkdir()
    split = _split(tmp_path / task, task, _records(task, (5, 40, 60)), max_length=32)
    kind = ft.KINDS[task]
    reading = ft.FinetuneOptions(baseline="segments", segment_length=12).reading(kind, "none")
    batch = reading.batch(split, [0, 1, 2], global_attention="none", specials=_SPECIALS)
    layout = segments.segment_layout(
        batch["document_ids"], batch["document_mask"], prefix_ids=batch.get("prefix_ids"),
        prefix_mask=batch.get("prefix_mask"), specials=_SPECIALS, segment_length=12)
    read = np.asarray(layout.kept_tokens).reshape(3, -1)
    facts = [e.truncation for e in split.examples]
    assert [f.truncated for f in facts] == [False, True, True], task
    for e, f, row in zip(split.examples, facts, read):
      rows = len(e.input_ids) if isinstance(e.input_ids, tuple) else 1
      assert int(row[:rows].min()) == f.kept_tokens, task
      assert int(np.asarray(layout.segments_needed).max()) > 1


def test_segments_need_positions_for_a_segment_not_for_max_length(tmp_path):
  split = _split(tmp_path, "qa", _records("qa", (30,)), max_length=48)
  short = _CONFIG.replace(max_position_embeddings=34)  # 32 positions after pad_token_id + 1
  cfg = ft.new_run_config(ft.ModelSource(short, None, None, {}), steps=1, batch_size=1,
                          learning_rate=1e-3, max_length=48, seed=0)
  segments16 = ft.FinetuneOptions(baseline="segments", segment_length=16)
  ft.FinetuneTask("qa", split, global_attention="default", options=segments16).check(cfg)
  with pytest.raises(ValueError, match="max_length=48 exceeds the model's 32 positions"):
    ft.FinetuneTask("qa", split, global_attention="default").check(cfg)
  segments40 = ft.FinetuneOptions(baseline="segments", segment_length=40)
  with pytest.raises(ValueError, match="segment_length=40 exceeds the model's 32 positions"):
    ft.FinetuneTask("qa", split, global_attention="default", options=segments40).check(cfg)


def test_evidence_beyond_the_first_segment_never_reaches_the_classifier(tmp_path):
  """Exact, untrained: with the label's evidence only past the first segment, the segment
  baseline's classification logits (segment_pool "first") are bit-identical whatever that
  evidence is, so no training can do better than chance; the Longformer's, with `<s>` global,
  change."""
  rng = np.random.default_rng(5)
  ids = rng.integers(10, 60, size=100).tolist()
  records = [{"input_ids": ids, "label": 0}, {"input_ids": ids[:80] + [61] + ids[81:],
                                              "label": 1}]
  split = _split(tmp_path, "classification", records, max_length=128)
  kind = ft.KINDS["classification"]
  model = _model(kind, split)
  (logits, _, _), (seg_logits, _, _, _) = _both(kind, model, split, 64)
  seg = np.asarray(seg_logits["logits"])
  np.testing.assert_array_equal(seg[0], seg[1])
  assert not np.array_equal(np.asarray(logits["logits"])[0], np.asarray(logits["logits"])[1])


@pytest.mark.parametrize("changes, message", [
    ({"baseline": "roberta"}, "baseline must be one of ('longformer', 'segments')"),
    ({"segment_pool": "max"}, "segment_pool must be one of ('first', 'mean')"),
    ({"segment_length": 2}, "segment_length must be an int >= 4, got 2"),
    ({"segment_overlap": -1}, "segment_overlap must be an int >= 0"),
    ({"segment_length": 64, "segment_overlap": 64}, "segment_overlap=64 must be below"),
])
def test_bad_segment_options_are_refused(changes, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    ft.FinetuneOptions(**changes)


def test_segments_too_short_for_the_question_are_refused(tmp_path):
  split = _split(tmp_path, "qa", _records("qa", (9,)), max_length=24)
  reading = ft.FinetuneOptions(baseline="segments", segment_length=8,
                               segment_overlap=2).reading(ft.KINDS["qa"], "question")
  with pytest.raises(ValueError, match=r"qa.jsonl: segment_length=8 leaves 2 document tokens "
                     r"per segment after <s>, a prefix of 2 tokens, </s></s> and </s>; it must "
                     r"leave more than segment_overlap=2"):
    reading.check(split)
