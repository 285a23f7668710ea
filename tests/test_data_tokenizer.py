"""Tokenizers a model cannot use (`data.tokenizer`): one without the special tokens the rows are
built with, or with them at other ids than the model's, is refused naming the tokens."""

import pytest
from tokenizers import Tokenizer, models

from longformer_jax.config import LEDConfig, LongformerConfig
from longformer_jax.data import tokenizer as tok
from longformer_jax.tasks import seq2seq

pytestmark = pytest.mark.unit


def _tokenizer(tokens):
  vocab = {t: i for i, t in enumerate(["<unk>", *tokens, *(f"w{i}" for i in range(8))])}
  return Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))


def test_a_tokenizer_without_the_special_tokens_is_refused_naming_them():
  bare = _tokenizer(["</s>"])  # ordinary tokens at ids 0..2: they would be <s>, <pad>, </s>
  for config in (LongformerConfig.tiny(), LEDConfig.tiny()):
    with pytest.raises(ValueError, match="the tokenizer has no <s>, <pad> token\\(s\\): the "
                                         "model needs <s>, <pad>, </s>"):
      tok.check_tokenizer(bare, config)
  with pytest.raises(ValueError, match="has no <s>, <pad>, <mask> token\\(s\\): MLM pretraining "
                                       "needs <s>, <pad>, </s>, <mask>"):
    tok.special_ids(bare)
  # The LED preset takes its ids from the tokenizer: all the missing ones are named at once.
  with pytest.raises(ValueError, match="has no <s>, <pad> token\\(s\\): the LED needs"):
    seq2seq.load_source("tiny", bare)


def test_special_tokens_at_other_ids_than_the_models_are_refused():
  roberta = _tokenizer(["<s>", "<pad>", "</s>"])  # <unk> 0, <s> 1, <pad> 2, </s> 3
  with pytest.raises(ValueError, match="the tokenizer's <s> is id 1, the model's bos_token_id "
                                       "is 0: it is not this model's tokenizer"):
    tok.check_tokenizer(roberta, LongformerConfig.tiny())
  tok.check_tokenizer(roberta, LongformerConfig.tiny(bos_token_id=1, pad_token_id=2,
                                                     eos_token_id=3, sep_token_id=3))


def test_tokenizer_files_are_regular_files_inside_their_directory(tmp_path):
  """A tokenizer is read as every file of a model directory is (docs/checkpoints.md): a FIFO
  named tokenizer.json is refused at once instead of blocking the load, a tokenizer.json that
  links out of its directory is refused, and a real one still loads."""
  import os
  real = tmp_path / "real"
  real.mkdir()
  _tokenizer(["<s>", "<pad>", "</s>"]).save(str(real / "tokenizer.json"))
  assert tok.load_tokenizer(real).token_to_id("</s>") == 3
  assert tok.load_tokenizer(real / "tokenizer.json").token_to_id("</s>") == 3

  fifo = tmp_path / "fifo"
  fifo.mkdir()
  os.mkfifo(fifo / "tokenizer.json")
  with pytest.raises(ValueError, match="tokenizer.json is a FIFO, not a regular file"):
    tok.load_tokenizer(fifo)

  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "tokenizer.json").symlink_to(real / "tokenizer.json")
  with pytest.raises(ValueError, match="outside"):
    tok.load_tokenizer(outside)
  escaping = tmp_path / "escaping"
  escaping.mkdir()
  (escaping / "vocab.json").symlink_to("/etc/hostname")
  (escaping / "merges.txt").write_text("#version: 0.2\n")
  with pytest.raises(ValueError, match="outside"):
    tok.load_tokenizer(escaping)
