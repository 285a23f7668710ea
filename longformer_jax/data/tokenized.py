"""Subword token ids for masked-LM pretraining: tokenizers, documents, packing and an id cache.

    >>> from longformer_jax.data import tokenized, tokenizer
    >>> tok = tokenizer.load_tokenizer("./roberta-base")            # tokenizer.json, or
    ...                                                             # vocab.json + merges.txt
    >>> ids = tokenized.token_ids("enwik8_sample", "validation", tok)  # cached .npy stream
    >>> rows = tokenized.pack(ids, 4096, tokenizer.special_ids(tok))   # [R, 4096] int32

Tokenizers are the HF `tokenizers` library's, read from local files only (no hub access,
`data.tokenizer.load_tokenizer`): a `tokenizer.json`, or RoBERTa's `vocab.json` + `merges.txt`.
`train_bpe` makes a small byte-level BPE with RoBERTa's special tokens in seconds (the offline
tokenizer of the CPU presets and the position-copy demo).

Documents and packing follow allenai/longformer's `scripts/pretrain.py` (RoBERTa's FULL-SENTENCES
input format, RoBERTa paper Table 2): every non-empty line of the text, stripped, is a document;
each document's tokens are followed by `</s>`, and the documents are concatenated into one
stream. A sequence of length N is `<s>` + N - 2 consecutive tokens of the stream + `</s>`, so
sequences run across document boundaries, which the `</s>` inside them mark. `pack` cuts a whole
stream into such rows (the last one padded with `<pad>`); training draws its rows from the same
stream at per-epoch offsets (`tasks.mlm`).

Text sources (`text_of`): "enwik8", "text8" and their bundled samples (`load_split`'s bytes, read
as UTF-8); "tfds:NAME" or "tfds:NAME:FIELD" (a prepared TFDS dataset's `text` feature, or FIELD,
each record's lines being documents; needs tensorflow-datasets); or a local text file or a
directory of `*.txt` files. Local text is split like the corpora: the first 90% of its bytes
train, the next 5% validation, the rest test. It must be UTF-8 (a byte that is not is an error
naming the file and line), and every split must hold some text.

The stream of a (source, split, tokenizer) is cached as a `.npy` file (uint16 when the vocabulary
fits, else int32), written atomically and named by the SHA-256 of the tokenizer and of the
source's identity, so a changed file or tokenizer is never served stale ids. The SHA-256 of the
file's bytes is written beside it (`.sha256`) and checked whenever it is read: a damaged or edited
cache is rebuilt from its source (one warning line), never read.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from longformer_jax.data.tokenizer import (ROBERTA_SPECIAL_TOKENS, SpecialIds, encoding_errors,
                                           special_ids, tokenizer_sha256)
from longformer_jax.io import atomic_write

__all__ = [
    "cache_dir", "documents", "encode_documents", "is_byte_level", "pack", "text_of",
    "token_bytes", "token_ids", "train_bpe", "with_specials",
]

_CACHE_VERSION = "mlm-stream-v1"  # bump when `documents` / `encode_documents` change


def train_bpe(texts: Iterable[str], vocab_size: int):
  """A byte-level BPE tokenizer (RoBERTa's kind) trained on `texts`, with RoBERTa's special
  tokens as ids 0-4. About 3 s for the 5.5 MB training split of enwik8_sample on 2 cores."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  if not isinstance(vocab_size, int) or vocab_size < len(alphabet) + len(ROBERTA_SPECIAL_TOKENS):
    raise ValueError(f"vocab_size must be an int >= {len(alphabet) + len(ROBERTA_SPECIAL_TOKENS)}"
                     f" (the 256 bytes and 5 special tokens), got {vocab_size!r}")
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(ROBERTA_SPECIAL_TOKENS),
                                initial_alphabet=alphabet, show_progress=False)
  tokenizer.train_from_iterator(texts, trainer)
  return tokenizer


def is_byte_level(tokenizer) -> bool:
  """Whether the tokenizer is a byte-level BPE (decodes with `decoders.ByteLevel`)."""
  from tokenizers import decoders
  return isinstance(tokenizer.decoder, decoders.ByteLevel)


def token_bytes(tokenizer) -> np.ndarray:
  """[V] int: the number of UTF-8 bytes each token id stands for (0 for special tokens), the
  characters of bits per character.

  Exact for byte-level BPE (RoBERTa's, GPT-2's, `train_bpe`'s): each character of a byte-level
  token string is one byte. Other tokenizers raise ValueError: their tokens do not decode to
  bytes one at a time.
  """
  if not is_byte_level(tokenizer):
    raise ValueError(f"bits per character counts the bytes of each token, which needs a "
                     f"byte-level BPE tokenizer (decoder ByteLevel); this one decodes with "
                     f"{tokenizer.decoder!r}")
  special = set(special_ids(tokenizer).special)
  size = tokenizer.get_vocab_size(with_added_tokens=True)
  out = np.zeros(size, np.int64)
  for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
    if i not in special:
      out[i] = len(token)
  return out


def documents(text: str) -> list[str]:
  """Every non-empty line of `text`, stripped: one document each (allenai's pretrain.py)."""
  return [line for line in (raw.strip() for raw in text.splitlines()) if line]


def encode_documents(tokenizer, docs: Sequence[str], eos: int,
                     what: str = "documents") -> np.ndarray:
  """The token stream of `docs`: each document's ids (no special tokens added) then `eos`. A
  tokenizer that fails on them is a ValueError naming its file and `what`
  (`tokenizer.encoding_errors`)."""
  with encoding_errors(tokenizer, what):
    encoded = tokenizer.encode_batch(list(docs), add_special_tokens=False)
  pieces = []
  for e in encoded:
    pieces.append(np.asarray(e.ids, np.int64))
    pieces.append(np.asarray([eos], np.int64))
  stream = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
  return stream.astype(_stream_dtype(tokenizer.get_vocab_size(with_added_tokens=True)))


def with_specials(chunks_RxN: np.ndarray, ids: SpecialIds) -> np.ndarray:
  """`<s>` + each row + `</s>`: [R, N] -> [R, N + 2] int32 sequences."""
  chunks_RxN = np.asarray(chunks_RxN)
  rows = chunks_RxN.shape[0]
  return np.concatenate([np.full((rows, 1), ids.bos, np.int32), chunks_RxN.astype(np.int32),
                         np.full((rows, 1), ids.eos, np.int32)], axis=1)


def pack(stream: np.ndarray, seq_len: int, ids: SpecialIds) -> np.ndarray:
  """The whole `stream` as [R, seq_len] int32 sequences, in order: row r is `<s>`, tokens
  [r * (seq_len - 2), (r + 1) * (seq_len - 2)) of the stream, `</s>`. The last row holds what is
  left, then `</s>`, then `<pad>`s. Every token of the stream is in exactly one row."""
  if not isinstance(seq_len, int) or seq_len < 3:
    raise ValueError(f"seq_len must be an int >= 3 (<s>, a token, </s>), got {seq_len!r}")
  stream = np.asarray(stream)
  if stream.ndim != 1 or stream.size == 0:
    raise ValueError(f"stream must be a non-empty 1-D array of token ids, got shape "
                     f"{stream.shape}")
  body = seq_len - 2
  full, rest = divmod(stream.size, body)
  rows = with_specials(stream[:full * body].reshape(full, body), ids)
  if rest:
    last = np.full((1, seq_len), ids.pad, np.int32)
    last[0, :rest + 2] = with_specials(stream[None, full * body:], ids)[0]
    rows = np.concatenate([rows, last])
  return rows


# ----------------------------------------------------------------------------------------------
# Text sources and the id cache.

_LOCAL_SPLITS = ("train", "validation", "test")


def text_of(source: str, split: str, data_dir: str | os.PathLike | None = None) -> list[str]:
  """The documents of `split` ("train", "validation", "test") of a text source (module doc).
  Raises FileNotFoundError / ValueError naming the source when it does not exist, when a local
  file is not UTF-8 (its line named) or when the split holds no text."""
  if split not in _LOCAL_SPLITS:
    raise ValueError(f"split must be one of {_LOCAL_SPLITS}, got {split!r}")
  from longformer_jax.data import DATASETS, load_split
  where = ""
  if source in DATASETS:
    docs = documents(load_split(source, split, data_dir).tobytes().decode("utf-8", "replace"))
  elif source.startswith("tfds:"):
    docs = _tfds_documents(source.removeprefix("tfds:"), split, data_dir)
  else:
    from longformer_jax.data.corpora import split_bounds
    data = _local_bytes(source)
    if not data.strip():
      raise ValueError(f"text source {source!r} holds no text ({len(data):,} bytes)")
    start, stop = split_bounds(len(data))[split]
    where = f" (bytes {start:,} to {stop:,} of its {len(data):,})"
    # The split's edges fall between bytes, not characters (the file itself is checked to be
    # UTF-8): a character cut in two there reads as U+FFFD.
    docs = documents(data[start:stop].decode("utf-8", "replace"))
  if not docs:
    raise ValueError(f"the {split} split of text source {source!r}{where} holds no text")
  return docs


def _local_files(source: str) -> list[Path]:
  path = Path(source)
  if path.is_file():
    return [path]
  if path.is_dir():
    files = sorted(p for p in path.rglob("*.txt") if p.is_file())
    if files:
      return files
    raise FileNotFoundError(f"text directory {source!r} holds no *.txt files")
  raise FileNotFoundError(f"text source {source!r} is not a dataset name (enwik8, text8, "
                          f"enwik8_sample, text8_sample), a tfds:NAME, a file or a directory")


def _local_bytes(source: str) -> bytes:
  """The bytes of a local source's files, joined by newlines; ValueError naming the file and
  line of the first byte that is not UTF-8."""
  pieces = []
  for path in _local_files(source):
    data = path.read_bytes()
    try:
      data.decode("utf-8")
    except UnicodeDecodeError as e:
      line, line_start = data.count(b"\n", 0, e.start) + 1, data.rfind(b"\n", 0, e.start) + 1
      raise ValueError(f"{path}:{line}: is not UTF-8 (byte {e.start - line_start + 1} of the "
                       f"line: {data[e.start:e.start + 1]!r})") from None
    pieces.append(data)
  return b"\n".join(pieces)


def _tfds_documents(spec: str, split: str, data_dir) -> list[str]:
  """The documents of every record of a prepared TFDS dataset's split, read without TensorFlow
  (`builder.as_data_source`). spec: "NAME" or "NAME:FIELD", the feature holding the text
  (default "text"; strings, bytes or uint8 arrays). A dataset without the split (Wikipedia has
  only "train") gives its train split's 90% / 5% / 5% by record."""
  try:
    import tensorflow_datasets as tfds
    # The project's own builders (enwik8_sample, ...) become TFDS names.
    builders = importlib.import_module("longformer_jax.data.builders")
  except ImportError as e:
    raise ImportError(f"text source tfds:{spec} needs tensorflow-datasets and array_record "
                      f"(pip install tensorflow-datasets array_record)") from e
  name, _, field = spec.partition(":")
  field = field or "text"
  if name in builders.BUILDERS:  # the project's own: prepared from local files when missing
    builder = builders.prepare(name, data_dir=data_dir)
  else:
    # Its metadata read as data first: TFDS would import a module its features.json names.
    builders.check_metadata(Path(data_dir or tfds.core.constants.DATA_DIR) / name)
    builder = tfds.builder(name, data_dir=data_dir)
    if not builder.is_prepared():
      raise FileNotFoundError(f"tfds:{name} is not prepared in {builder.data_dir}: prepare it "
                              f"first (tfds build {name}, or tfds.builder({name!r})"
                              ".download_and_prepare()), or pass its data_dir")
  available = set(builder.info.splits)
  if split in available:
    chosen = split
  elif "train" in available:
    chosen = {"train": "train[:90%]", "validation": "train[90%:95%]", "test": "train[95%:]"}[split]
  else:
    raise ValueError(f"tfds:{name} has splits {sorted(available)}: neither {split!r} nor train")
  if field not in builder.info.features:
    raise ValueError(f"tfds:{name} has no feature {field!r}; its features: "
                     f"{sorted(builder.info.features)} (name one as tfds:{name}:FIELD)")
  source = builder.as_data_source(split=chosen)
  docs = []
  for i in range(len(source)):
    text = source[i][field]
    if isinstance(text, np.ndarray):
      text = text.tobytes()
    docs += documents(text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text))
  return docs


def _source_identity(source: str, split: str) -> str:
  """What the ids of (source, split) depend on, besides the tokenizer: the bytes of local files
  (hashed), else the name (the corpora are fixed and checked when read)."""
  from longformer_jax.data import DATASETS
  if source in DATASETS or source.startswith("tfds:"):
    return f"{source}/{split}"
  digest = hashlib.sha256()
  for path in _local_files(source):
    with open(path, "rb") as f:
      for block in iter(lambda: f.read(1 << 22), b""):
        digest.update(block)
    digest.update(b"\0")
  return f"file:{digest.hexdigest()}/{split}"


def cache_dir(data_dir: str | os.PathLike | None = None) -> Path:
  """Where token streams are cached: `<data_dir>/mlm_tokens`, or (no data_dir)
  `$LONGFORMER_JAX_CACHE` or `~/.cache/longformer_jax`, then `/mlm_tokens`."""
  if data_dir is not None:
    return Path(data_dir) / "mlm_tokens"
  root = os.environ.get("LONGFORMER_JAX_CACHE") or Path.home() / ".cache" / "longformer_jax"
  return Path(root) / "mlm_tokens"


def token_ids(source: str, split: str, tokenizer, *, data_dir: str | os.PathLike | None = None,
              cache: str | os.PathLike | None = None) -> np.ndarray:
  """The token stream of a split (documents, each followed by `</s>`), from the cache when it
  holds it, else tokenized and written to it atomically. cache: the directory (default
  `cache_dir(data_dir)`). A cached stream is read only when its bytes match the SHA-256 written
  beside it (`<name>.sha256`); one that does not (damaged or edited, or without the checksum) is
  rebuilt from the source, with a one-line warning on stderr."""
  key = hashlib.sha256("\n".join(
      [_CACHE_VERSION, tokenizer_sha256(tokenizer), _source_identity(source, split)]).encode())
  name = "".join(c if c.isalnum() or c in "-_" else "_" for c in Path(source).name)[:40]
  path = Path(cache or cache_dir(data_dir)) / f"{name}-{split}-{key.hexdigest()[:20]}.npy"
  checksum = path.with_suffix(".sha256")
  if path.exists():
    data = path.read_bytes()
    found = hashlib.sha256(data).hexdigest()
    recorded = checksum.read_text().strip() if checksum.exists() else None
    if found == recorded:
      return np.load(io.BytesIO(data))
    # A cache is rebuilt from its source, as a user expects of one (the run's record holds the
    # training stream's SHA-256 too: a resume never trains on other ids).
    why = ("has no checksum beside it" if recorded is None else
           f"has sha256 {found[:16]}..., its checksum file says {recorded[:16]}...")
    print(f"warning: the token cache {path} {why}: rebuilt from {source} ({split})",
          file=sys.stderr, flush=True)
  ids = encode_documents(tokenizer, text_of(source, split, data_dir),
                         special_ids(tokenizer).eos, what=f"{source} ({split})")
  path.parent.mkdir(parents=True, exist_ok=True)
  buffer = io.BytesIO()
  np.save(buffer, ids)
  # The ids, then their SHA-256 (a cache cut off between the two has no checksum: rebuilt).
  atomic_write(path, buffer.getvalue())
  atomic_write(checksum, hashlib.sha256(buffer.getvalue()).hexdigest() + "\n")
  return ids


def _stream_dtype(vocab_size: int):
  return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
