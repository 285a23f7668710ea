"""The fine-tuning records' reader (`data.finetune_data`) and the labels a run is sized by
(`tasks.finetune.read_splits` / `fit_head`), on tiny files: what it refuses, naming the file,
the line and the value, and what it keeps."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from longformer_jax.config import LongformerConfig
from longformer_jax.data import finetune_data as fd
from longformer_jax.data.tokenizer import SpecialIds
from longformer_jax.tasks import finetune as ft

pytestmark = pytest.mark.unit

CONFIG = LongformerConfig.tiny(num_hidden_layers=1)
SPECIALS = SpecialIds.of_config(CONFIG)  # <s> 0, <pad> 1, </s> 2 (also the separator)


def _write(tmp_path, name, records):
  path = tmp_path / name
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def _read(path, task="classification", tokenizer=None, **kwargs):
  return fd.read_split(path, ft.KINDS[task], tokenizer, max_length=16, specials=SPECIALS,
                       vocab_size=CONFIG.vocab_size, **kwargs)


def _refused(path, problem, field, line=1, **kwargs):
  with pytest.raises(ValueError) as info:
    _read(path, **kwargs)
  message = str(info.value)
  assert message.startswith(f"{path}:{line}: field {field!r}") and problem in message, message


# ----------------------------------------------------------------------------------------------
# Special ids and masks in the records


@pytest.mark.parametrize("record, field, problem", [
    ({"input_ids": [0, 4, 5, 2], "label": 0}, "input_ids",
     "element 0 is 0, the model's <s> (bos_token_id): records hold the ids of their text only"),
    ({"input_ids": [4, 5, 1], "label": 0}, "input_ids", "element 2 is 1, the model's <pad>"),
    ({"input_ids": [4, 2, 5], "label": 0}, "input_ids", "element 1 is 2, the model's </s>"),
    ({"input_ids": [4, 512], "label": 0}, "input_ids", "element 1 must be a token id in [0, 512)"),
    ({"input_ids": [4, 5], "attention_mask": [1, 0.5], "label": 0}, "attention_mask",
     "element 1 is 0.5: expected 1 or true"),
    ({"input_ids": [4, 5], "attention_mask": [2, 1], "label": 0}, "attention_mask",
     "element 0 is 2: expected 1 or true"),
    ({"input_ids": [4, 5], "attention_mask": [1, 0], "label": 0}, "attention_mask",
     "element 1 is 0: padding in a record"),
    ({"input_ids": [4, 5], "attention_mask": [1], "label": 0}, "attention_mask",
     "has 1 values for 2 input_ids"),
])
def test_id_records_with_special_ids_or_bad_masks_are_refused(tmp_path, record, field, problem):
  # The record on line 2, after a good one.
  path = _write(tmp_path, "r.jsonl", [{"input_ids": [4], "label": 1}, record])
  _refused(path, problem, field, line=2)


def test_questions_and_candidates_are_checked_as_the_document_is(tmp_path):
  base = {"question": [5], "candidates": [[40], [41]], "input_ids": [7], "label": 0}
  _refused(_write(tmp_path, "q.jsonl", [{**base, "question": [5, 1]}]),
           "question: element 1 is 1, the model's <pad>", "question", task="multiple_choice")
  _refused(_write(tmp_path, "c.jsonl", [{**base, "candidates": [[40], [2]]}]),
           "element 1: element 0 is 2, the model's </s>", "candidates", task="multiple_choice")


def test_text_that_spells_a_special_token_is_refused(tmp_path):
  vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", "w1", "w2"])}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer.add_special_tokens(["<s>", "<pad>", "</s>"])
  path = _write(tmp_path, "t.jsonl", [{"text": "w1 </s> w2", "label": 0}])
  _refused(path, "token 1 is '</s>', the model's </s> (eos_token_id): the text spells a "
           "special token", "text", tokenizer=tokenizer)
  # A text mask has no place: the reader makes the mask of a text record from its tokens.
  path = _write(tmp_path, "m.jsonl", [{"text": "w1 w2", "attention_mask": [1, 1], "label": 0}])
  _refused(path, 'goes with "input_ids"', "attention_mask", tokenizer=tokenizer)
  # <unk> is an ordinary id of a record (a word the tokenizer does not know).
  split = _read(_write(tmp_path, "u.jsonl", [{"text": "w1 zz", "label": 0}]),
                tokenizer=tokenizer)
  assert split.examples[0].input_ids.tolist() == [0, 4, 3, 2]


def test_a_mask_of_ones_is_accepted_and_rows_are_built_as_without_it(tmp_path):
  plain = _read(_write(tmp_path, "a.jsonl", [{"input_ids": [4, 5], "label": 0}]))
  masked = _read(_write(tmp_path, "b.jsonl", [
      {"input_ids": [4, 5], "attention_mask": [1, True], "label": 0}]))
  assert masked.examples[0].input_ids.tolist() == plain.examples[0].input_ids.tolist() == [
      0, 4, 5, 2]


# ----------------------------------------------------------------------------------------------
# Labels: the training file's


def _splits(task, files, options=ft.FinetuneOptions(), source=True):
  cfg = ft.new_run_config(ft.ModelSource(CONFIG, None, None, {}), steps=1, batch_size=1,
                          learning_rate=1e-3, max_length=16, seed=0)
  splits = ft.read_splits(task, files, None, cfg, options, new_run=True)
  return splits, ft.fit_head(task, cfg, splits,
                             ft.ModelSource(CONFIG, None, None, {}) if source else None)


def test_a_class_training_never_saw_is_refused_not_a_wider_head(tmp_path):
  train = _write(tmp_path, "train.jsonl", [{"input_ids": [4], "label": 0},
                                           {"input_ids": [5], "label": 2},
                                           {"input_ids": [6], "label": 1}])
  valid = _write(tmp_path, "valid.jsonl", [{"input_ids": [4], "label": 1},
                                           {"input_ids": [5], "label": 3}])
  with pytest.raises(ValueError) as info:
    _splits("classification", {"train": train, "validation": valid})
  assert str(info.value) == (
      f"{valid}:2: field 'label' is 3, not one of the model's num_labels=3 classes 0..2 (a new "
      f"run's are its training labels; --set model.num_labels=N for more)")
  # Inside the training range: kept (the head has the class). Without a training file (scoring
  # a model) the given files size a new head, as before.
  splits, cfg = _splits("classification", {"train": train, "validation": train})
  assert cfg.model.num_labels == 3
  _, cfg = _splits("classification", {"validation": valid, "test": train})
  assert cfg.model.num_labels == 4


@pytest.mark.parametrize("label, problem", [
    (10**9, "is 1000000000: a class id must be below 65,536 (labels are the classes 0..K-1, "
            "K <= 65,536)"),
    (10**30, "is 100000000000... (31 digits): a class id must be below 65,536"),
])
def test_a_huge_label_is_refused_when_read_before_a_head_is_sized(tmp_path, label, problem):
  """A label of 10**9 sized a head of 10**9 classes (a 256 GB allocation); 10**30 ended in a
  TypeError. Both are refused when the file is read, naming the file, line and field."""
  train = _write(tmp_path, "train.jsonl", [{"input_ids": [4], "label": 0},
                                           {"input_ids": [5], "label": label}])
  _refused(train, problem, "label", line=2)
  tags = _write(tmp_path, "tags.jsonl", [{"input_ids": [4, 5], "labels": [0, label]}])
  with pytest.raises(ValueError) as info:
    _splits("token", {"train": tags})
  assert str(info.value).startswith(f"{tags}:1: field 'labels' {problem}"), str(info.value)


def test_labels_must_be_the_dense_range_their_head_is_sized_by(tmp_path):
  """Labels 0 and 5 would size a head of 6 classes, 4 of them never named: refused at the
  largest label, naming the classes no record has. A source classifier declaring the classes
  (its num_labels covers the labels) keeps its head."""
  train = _write(tmp_path, "train.jsonl", [{"input_ids": [4], "label": 0},
                                           {"input_ids": [5], "label": 5},
                                           {"input_ids": [6], "label": 1}])
  with pytest.raises(ValueError) as info:
    _splits("classification", {"train": train})
  assert str(info.value).startswith(
      f"{train}:2: field 'label' is 5, but no record has the class(es) 2, 3, 4: labels must be "
      f"the dense range 0..K-1"), str(info.value)
  classifier = ft.ModelSource(CONFIG.replace(num_labels=8), None,
                              "LongformerForSequenceClassification", {})
  cfg = ft.new_run_config(classifier, steps=1, batch_size=1, learning_rate=1e-3, max_length=16,
                          seed=0)
  splits = ft.read_splits("classification", {"train": train}, None, cfg, ft.FinetuneOptions(),
                          new_run=True)
  assert ft.fit_head("classification", cfg, splits, classifier).model.num_labels == 8
  tags = _write(tmp_path, "tags.jsonl", [{"input_ids": [4, 5], "labels": [0, 1]},
                                         {"input_ids": [4, 5], "labels": [3, 0]}])
  with pytest.raises(ValueError, match=r"tags.jsonl:2: field 'labels' is 3, but no record has "
                                       r"the class\(es\) 2"):
    _splits("token", {"train": tags})


def test_jsonl_nested_too_deeply_is_one_error_naming_the_line(tmp_path):
  """100,000 nested brackets made json's decoder raise RecursionError."""
  path = tmp_path / "deep.jsonl"
  path.write_text('{"input_ids": [4], "label": 0}\n{"input_ids": ' + "[" * 100_000
                  + "]" * 100_000 + ', "label": 0}\n')
  with pytest.raises(ValueError) as info:
    _read(str(path))
  assert str(info.value).startswith(f"{path}:2: nests JSON arrays or objects too deeply"), \
      str(info.value)


def test_a_tokenizer_whose_regex_backtracks_is_one_error_naming_its_file(tmp_path):
  """A pattern that backtracks catastrophically makes `tokenizers` panic (PanicException, a
  BaseException that went through every `except Exception`): a ValueError naming the
  tokenizer's file and the record."""
  from tokenizers import Regex

  from longformer_jax.data.tokenizer import load_tokenizer
  vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", "a"])}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("(a+)+b"), "isolated")
  file = tmp_path / "tokenizer.json"
  tokenizer.save(str(file))
  path = _write(tmp_path, "t.jsonl", [{"text": "a" * 40, "label": 0}])
  with pytest.raises(ValueError) as info:
    _read(path, tokenizer=load_tokenizer(tmp_path))
  assert str(info.value).startswith(
      f"the tokenizer {file} failed while encoding {path}:1 field 'text': Onig: Regex search "
      f"error"), str(info.value)


def test_a_tag_training_never_saw_is_refused_and_the_tags_are_the_training_files(tmp_path):
  train = _write(tmp_path, "train.jsonl", [{"input_ids": [4, 5], "labels": ["O", "B-PER"]}])
  valid = _write(tmp_path, "valid.jsonl", [{"input_ids": [4, 5], "labels": ["O", "B-PER"]},
                                           {"input_ids": [4, 5], "labels": ["B-LOC", "O"]}])
  with pytest.raises(ValueError) as info:
    _splits("token", {"train": train, "validation": valid})
  assert str(info.value) == (
      f"{valid}:2: field 'labels' element 0 is 'B-LOC', not one of the 2 labels ['O', "
      f"'B-PER'] (a new run's are the tags of its training file; --set label_names=... names "
      f"them all)")
  # Named by label_names (the tags of a run's record, or given), a validation tag is read.
  options = ft.FinetuneOptions(label_names=("O", "B-PER", "B-LOC"))
  splits, cfg = _splits("token", {"train": train, "validation": valid}, options)
  assert cfg.model.num_labels == 3 and splits["validation"].label_names == options.label_names
  assert np.asarray(splits["validation"].examples[1].token_labels).tolist()[1:3] == [2, 0]
