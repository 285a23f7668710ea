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
