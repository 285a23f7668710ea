"""Tokenizers and special tokens, shared by the tasks.

    >>> from longformer_jax.data import tokenizer as tok
    >>> tokenizer = tok.load_tokenizer("./roberta-base")   # tokenizer.json, or vocab + merges
    >>> tok.check_tokenizer(tokenizer, config)             # the model's vocabulary and ids?
    >>> specials = tok.SpecialIds.of_config(config)        # <s>, <pad>, </s> of the model
    >>> specials = tok.special_ids(tokenizer)              # ... and <mask>, every special id

  ROBERTA_SPECIAL_TOKENS   RoBERTa's special token strings, in its id order
  SpecialIds               the special ids rows are built with (one dataclass for every task)
  special_ids              a RoBERTa-style tokenizer's `SpecialIds`, <mask> included (MLM)
  special_token_ids        the ids of the special tokens a model needs, or a ValueError naming
                           every one the tokenizer lacks
  load_tokenizer           a `tokenizers.Tokenizer` from local files (nothing is downloaded)
  tokenizer_file           the tokenizer.json a path names
  token_id                 a token's id, or a ValueError naming the token
  tokenizer_sha256         what a run and a token cache are keyed by
  check_tokenizer          ValueError when a tokenizer cannot be a model's
  encoding_errors          a context: a tokenizer that fails (panics) while encoding is a
                           ValueError naming its file

Tokenizers are the HF `tokenizers` library's (the fast tokenizers of HF transformers use the same
`tokenizer.json` files).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os

from longformer_jax import io

__all__ = [
    "MODEL_SPECIAL_TOKENS", "ROBERTA_SPECIAL_TOKENS", "SpecialIds", "check_tokenizer",
    "copy_tokenizer", "encoding_errors", "load_tokenizer", "special_ids", "special_token_ids",
    "token_id", "tokenizer_file", "tokenizer_sha256",
]

# RoBERTa's special tokens in RoBERTa's id order (<s> 0, <pad> 1, </s> 2, <unk> 3); its <mask> is
# the last id of its vocabulary (that of `data.tokenized.train_bpe` is 4).
ROBERTA_SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
# The special tokens every model of the package builds its rows with (RoBERTa's and BART's):
# `<s>` (bos_token_id), `<pad>` (pad_token_id), `</s>` (eos_token_id, also the separator).
MODEL_SPECIAL_TOKENS = ("<s>", "<pad>", "</s>")


@dataclasses.dataclass(frozen=True)
class SpecialIds:
  """The special token ids rows are built with (RoBERTa's layout: `<s> ... </s>`, segments
  joined by `</s></s>`).

  bos: `<s>`, the first token of every row. pad: `<pad>`. eos: `</s>`, the last token of every
  row (and, in MLM's stream, after every document). sep: the separator between segments (the
  same id as eos in RoBERTa). mask: `<mask>` (MLM; None when not needed). special: every special
  id of the tokenizer (MLM never masks them nor draws them as random replacements; empty when
  made from a config).
  """
  bos: int
  pad: int
  eos: int
  sep: int
  mask: int | None = None
  special: tuple[int, ...] = ()

  @classmethod
  def of_config(cls, config) -> SpecialIds:
    """The ids a model's config names (`LongformerConfig`'s bos/pad/eos/sep_token_id)."""
    return cls(bos=config.bos_token_id, pad=config.pad_token_id, eos=config.eos_token_id,
               sep=config.sep_token_id)


def special_token_ids(tokenizer, tokens=MODEL_SPECIAL_TOKENS, *, needed_by: str = "the model"
                      ) -> dict[str, int]:
  """{token: id} of the special `tokens` in `tokenizer`'s vocabulary; ValueError naming every one
  it lacks. A tokenizer without them cannot be the model's: the rows' special ids would be ids
  of ordinary tokens of this tokenizer."""
  ids = {token: tokenizer.token_to_id(token) for token in tokens}
  missing = [token for token, i in ids.items() if i is None]
  if missing:
    raise ValueError(f"the tokenizer has no {', '.join(missing)} token(s): {needed_by} needs "
                     f"{', '.join(tokens)} (RoBERTa's and BART's special tokens); without them "
                     f"the rows' special ids would be ids of its ordinary tokens")
  return ids


def special_ids(tokenizer) -> SpecialIds:
  """`<s>`, `<pad>`, `</s>` (also the separator), `<mask>` of a RoBERTa-style tokenizer, and all
  its special ids; ValueError naming the tokens it lacks."""
  ids = special_token_ids(tokenizer, MODEL_SPECIAL_TOKENS + ("<mask>",),
                          needed_by="MLM pretraining")
  special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
  special |= set(ids.values())
  unk = tokenizer.token_to_id("<unk>")
  if unk is not None:
    special.add(unk)
  return SpecialIds(bos=ids["<s>"], pad=ids["<pad>"], eos=ids["</s>"], sep=ids["</s>"],
                    mask=ids["<mask>"], special=tuple(sorted(special)))


def load_tokenizer(path: str | os.PathLike):
  """A `tokenizers.Tokenizer` from local files (nothing is downloaded):

    * a `tokenizer.json`, or a directory holding one (an HF model directory saved by a fast
      tokenizer);
    * a directory holding only RoBERTa's `vocab.json` + `merges.txt`: a byte-level BPE, built
      as RoBERTa's tokenizer is (no prefix space, byte-level decoding, its special tokens
      marked special, so that encoding text never splits them);
    * a remote `tokenizer.json` (any etils path, e.g. a run's gs:// workdir).

  Raises FileNotFoundError or ValueError naming the path.
  """
  tokenizer = _load_tokenizer(path)
  # Named in errors while encoding (`encoding_errors`).
  file = tokenizer_file(path)
  tokenizer.source_file = file if os.path.isfile(file) else os.fspath(path)
  return tokenizer


def _load_tokenizer(path):
  import tokenizers

  if "://" in str(path):
    from etils import epath
    return tokenizers.Tokenizer.from_str(epath.Path(path).read_text())
  path = os.fspath(path)
  vocab, merges = os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt")
  if (os.path.isdir(path) and not os.path.exists(os.path.join(path, "tokenizer.json"))
          and os.path.isfile(vocab) and os.path.isfile(merges)):
    from tokenizers import decoders, models, pre_tokenizers
    # Checked as every file of a model directory is (docs/checkpoints.md): regular files inside
    # the directory, a FIFO refused rather than waited on; then read by their real paths.
    vocab, merges = (io.regular_file(f, io.links_root(path)) for f in (vocab, merges))
    tokenizer = tokenizers.Tokenizer(models.BPE.from_file(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([t for t in ROBERTA_SPECIAL_TOKENS
                                  if tokenizer.token_to_id(t) is not None])
    return tokenizer
  file = tokenizer_file(path)
  if not os.path.lexists(file):  # what is there but not a regular file: open_regular says so
    hint = (" (and no vocab.json + merges.txt of a byte-level BPE)"
            if os.path.isdir(path) else "")
    raise FileNotFoundError(f"{file}: no such tokenizer file{hint}")
  directory = io.links_root(path) if os.path.isdir(path) else None
  with io.open_regular(file, directory) as f:
    content = f.read()
  try:
    return tokenizers.Tokenizer.from_str(content.decode("utf-8"))
  except UnicodeDecodeError as e:
    raise ValueError(f"{file} is not a tokenizers tokenizer.json: {e}") from None
  except Exception as e:  # the Rust side raises a bare Exception on a malformed file
    raise ValueError(f"{file} is not a tokenizers tokenizer.json: {e}") from None


@contextlib.contextmanager
def encoding_errors(tokenizer, what: str):
  """Runs its block (encoding with `tokenizer`); a Rust panic inside `tokenizers` becomes a
  ValueError naming the tokenizer's file (`load_tokenizer` records it) and `what` was encoded.

  A tokenizer.json is data, but its regular expressions run on every text: a pattern that
  backtracks catastrophically makes the regex engine give up, which `tokenizers` turns into a
  panic. That surfaces as `pyo3_runtime.PanicException`, a BaseException (not an Exception), so
  it is caught here by name; every other exception passes through unchanged. (The Rust side
  also prints the panic on stderr before it is caught.)
  """
  try:
    yield
  except BaseException as e:
    if type(e).__name__ != "PanicException":
      raise
    source = getattr(tokenizer, "source_file", None)
    name = f"the tokenizer {source}" if source else "the tokenizer"
    reason = (str(e).strip().splitlines() or ["panicked"])[0][:200]
    raise ValueError(f"{name} failed while encoding {what}: {reason} (a pattern of the "
                     f"tokenizer that backtracks catastrophically, or a broken tokenizer.json: "
                     f"use another tokenizer)") from None


def copy_tokenizer(tokenizer):
  """An independent copy of `tokenizer` (its own truncation and padding settings), still named
  by its file in errors."""
  import tokenizers
  copy = tokenizers.Tokenizer.from_str(tokenizer.to_str())
  source = getattr(tokenizer, "source_file", None)
  if source is not None:
    copy.source_file = source
  return copy


def tokenizer_file(path: str | os.PathLike) -> str:
  """The tokenizer.json `path` names: itself, or the one inside it when it is a directory."""
  path = os.fspath(path)
  return os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path


def token_id(tokenizer, token: str) -> int:
  """The id of `token` in `tokenizer`'s vocabulary; ValueError naming it when it has none."""
  index = tokenizer.token_to_id(token)
  if index is None:
    raise ValueError(f"the tokenizer has no token {token!r} "
                     f"(vocabulary of {tokenizer.get_vocab_size():,})")
  return index


def tokenizer_sha256(tokenizer) -> str:
  """SHA-256 of the tokenizer's JSON: what a run and the id cache are keyed by."""
  return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def check_tokenizer(tokenizer, config) -> None:
  """ValueError when `tokenizer` cannot be the model's (`config`: a `LongformerConfig` or an
  `LEDConfig`): no `<s>`, `<pad>` or `</s>` (`special_token_ids`; the rows are built with
  them), more tokens than the embedding table, or `<s>` / `<pad>` / `</s>` at other ids than
  the config's bos, pad and EOS ids."""
  ids = special_token_ids(tokenizer)
  size = tokenizer.get_vocab_size()
  if size > config.vocab_size:
    raise ValueError(f"the tokenizer has {size:,} tokens, the model's vocabulary "
                     f"{config.vocab_size:,}: it is not this model's tokenizer")
  for token, field in (("<s>", "bos_token_id"), ("<pad>", "pad_token_id"),
                       ("</s>", "eos_token_id")):
    if ids[token] != getattr(config, field):
      raise ValueError(f"the tokenizer's {token} is id {ids[token]}, the model's {field} is "
                       f"{getattr(config, field)}: it is not this model's tokenizer")
