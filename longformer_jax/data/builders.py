"""tensorflow-datasets builders for the character-level LM corpora; no TensorFlow needed.

Importing this module registers four TFDS datasets (then `tfds.builder("enwik8_sample")`,
`tfds.data_source("text8", split="test")` etc. work too):

| name            | bytes                                        | from                           |
| --------------- | -------------------------------------------- | ------------------------------ |
| `enwik8`        | 10^8, every byte kept (XML, UTF-8, newlines) | `enwik8.zip` (Hutter Prize)    |
| `text8`         | 10^8, only `a-z` and space                   | `text8.zip` (Mahoney)          |
| `enwik8_sample` | 6,089,746, every byte kept                   | Wikipedia XML in the package   |
| `text8_sample`  | 3,085,829, only `a-z` and space              | `wikifil` of that XML          |

Each is one byte stream cut into `train` (first 90%), `validation` (next 5%) and `test` (the
rest): 90M/5M/5M for the full corpora. A split is stored as consecutive chunks of `CHUNK_BYTES`,
`{"bytes": uint8[n], "offset": int64}` with the offset counted from the split's start, in
`array_record` files with `disable_shuffling=True`: `builder.as_data_source(split)` serves them
in order without TensorFlow (`tfds.load` and `as_dataset` would need it).

enwik8 and text8 read the official zip from the manual directory (default
`<data_dir>/downloads/manual/`) when it is there, else download it into `<data_dir>/downloads/`;
see `corpora.fetch` for the checks.
"""

from __future__ import annotations

import abc
import os
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds

from longformer_jax.data import corpora

__all__ = [
    "BUILDERS",
    "CHUNK_BYTES",
    "Enwik8",
    "Enwik8Sample",
    "Text8",
    "Text8Sample",
    "prepare",
    "read_split",
]

CHUNK_BYTES = 1 << 20  # one record per MiB: 90 records for enwik8's train split

_WIKIPEDIA_LICENSE = "Wikipedia text: CC BY-SA 3.0 and GFDL, https://en.wikipedia.org"
_SAMPLE_LICENSE = (
    "Text from English Wikipedia, CC BY-SA 3.0, https://en.wikipedia.org (also GFDL); "
    "see longformer_jax/data/enwiki_sample/README.md"
)
_CITATION = """\
@misc{mahoney2011ltcb,
  author = {Matt Mahoney},
  title = {Large Text Compression Benchmark},
  year = {2011},
  howpublished = {\\url{http://mattmahoney.net/dc/text.html}}
}"""


class _ByteStream(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """One byte stream, split 90/5/5 by bytes, stored as ordered chunks in array_record."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First release."}
  _DESCRIPTION = ""
  _HOMEPAGE = "http://mattmahoney.net/dc/textdata.html"
  _LICENSE = _WIKIPEDIA_LICENSE

  def __init__(self, *, file_format: str = "array_record", **kwargs):
    # array_record is the format TFDS reads without TensorFlow (`as_data_source`).
    super().__init__(file_format=file_format, **kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=self._DESCRIPTION,
        features=tfds.features.FeaturesDict(
            {
          # Raw bytes on disk, not one int64 per byte.
                "bytes": tfds.features.Tensor(
                    shape=(None,), dtype=np.uint8, encoding=tfds.features.Encoding.BYTES
                ),
                "offset": tfds.features.Scalar(dtype=np.int64),
            }
        ),
        homepage=self._HOMEPAGE,
        citation=_CITATION,
        license=self._LICENSE,
        disable_shuffling=True,  # records are written in key (= offset) order
    )

  @abc.abstractmethod
  def _stream(self, dl_manager) -> bytes:
    """The whole corpus, in order (each concrete builder says where it comes from)."""

  def _split_generators(self, dl_manager):
    data = np.frombuffer(self._stream(dl_manager), dtype=np.uint8)
    return {
        split: self._generate_examples(data[start:stop])
        for split, (start, stop) in corpora.split_bounds(len(data)).items()
    }

  def _generate_examples(self, data: np.ndarray):
    for offset in range(0, len(data), CHUNK_BYTES):
      yield offset, {"bytes": data[offset : offset + CHUNK_BYTES], "offset": offset}


def _manual_instructions(source: corpora.Source) -> str:
  return (
      f"Optional: put {source.filename} ({source.size:,} bytes, from {source.url}) in the "
      "manual directory to use it instead of downloading it."
  )


class _Official(_ByteStream, skip_registration=True):
  """A corpus from an official zip: the manual directory first, else a download; verified."""

  SOURCE: corpora.Source

  def _stream(self, dl_manager) -> bytes:
    archive = corpora.fetch(
        self.SOURCE,
        manual_dir=_manual_dir(dl_manager),
        download_dir=Path(dl_manager.download_dir),
    )
    return corpora.read_archive(archive, self.SOURCE)


def _manual_dir(dl_manager) -> Path:
  """The manual directory TFDS was given, or its default, whether or not it exists yet."""
  try:
    return Path(dl_manager.manual_dir)
  except AssertionError:
    # TFDS's way of saying the (optional) manual dir is missing or empty; it does not say
    # which directory it looked in, and the error must name it. TFDS's default when
    # `DownloadConfig.manual_dir` is None is `<download_dir>/manual`, i.e.
    # `<data_dir>/downloads/manual`.
    configured = getattr(dl_manager, "_manual_dir", None)
    return Path(configured) if configured else Path(dl_manager.download_dir) / "manual"


class Enwik8(_Official):
  """enwik8: the first 10^8 bytes of the English Wikipedia XML dump of 2006-03-03."""

  SOURCE = corpora.ENWIK8_SOURCE
  MANUAL_DOWNLOAD_INSTRUCTIONS = _manual_instructions(SOURCE)
  _DESCRIPTION = (
      "The first 10^8 bytes of the English Wikipedia XML dump of 2006-03-03 (Hutter Prize), "
      "every byte kept, newlines included. Split by bytes 90M/5M/5M."
  )
  _HOMEPAGE = "http://prize.hutter1.net/"


class Text8(_Official):
  """text8: Mahoney's wikifil filter of Wikipedia, cut to 10^8 characters (a-z and space)."""

  SOURCE = corpora.TEXT8_SOURCE
  MANUAL_DOWNLOAD_INSTRUCTIONS = _manual_instructions(SOURCE)
  _DESCRIPTION = (
      "English Wikipedia through Mahoney's wikifil.pl, first 10^8 characters: 27 symbols "
      "(a-z and space). Split by characters 90M/5M/5M."
  )


class _Sample(_ByteStream, skip_registration=True):
  """A corpus built from the Wikipedia XML inside the package: offline, about a second."""

  _LICENSE = _SAMPLE_LICENSE

  def _stream(self, dl_manager) -> bytes:
    return corpora.sample_stream(self.name)


class Enwik8Sample(_Sample):
  """The bundled 6.09 MB of Wikipedia XML, enwik8-style: every byte kept."""

  _DESCRIPTION = (
      "206 pages of a 2016 English Wikipedia XML dump shipped with longformer-jax, every byte "
      "kept; split 90/5/5 by bytes like enwik8."
  )


class Text8Sample(_Sample):
  """The bundled Wikipedia XML through `wikifil`, text8-style: a-z and space."""

  _DESCRIPTION = (
      "The enwik8_sample XML through Mahoney's wikifil filter (3,085,829 characters, a-z and "
      "space); split 90/5/5 like text8."
  )


BUILDERS: dict[str, type[_ByteStream]] = {
    "enwik8": Enwik8,
    "text8": Text8,
    "enwik8_sample": Enwik8Sample,
    "text8_sample": Text8Sample,
}


def prepare(
    name_or_class: str | type[_ByteStream],
    *,
    data_dir: os.PathLike | str | None = None,
    manual_dir: os.PathLike | str | None = None,
) -> tfds.core.DatasetBuilder:
  """The builder of a dataset, prepared under `data_dir` (TFDS's default when None).

  Preparation runs once (TFDS writes into a temporary directory and renames it when done);
  later calls find the files and return at once. Several processes may call this together.
  """
  if isinstance(name_or_class, str):
    if name_or_class not in BUILDERS:
      raise ValueError(
          f"unknown dataset name={name_or_class!r}; expected one of {tuple(BUILDERS)}"
      )
    name_or_class = BUILDERS[name_or_class]
  builder = name_or_class(data_dir=data_dir)
  try:
    builder.download_and_prepare(
      # No GCS lookup: these datasets are not hosted there, and machines may be offline.
        download_config=tfds.download.DownloadConfig(
            manual_dir=manual_dir, try_download_gcs=False
        )
    )
  except OSError:
    # Processes preparing the same dataset at once (one per host process) each write a
    # private directory; renaming it into place fails for all but the first, which is fine.
    builder = name_or_class(data_dir=data_dir)
    if not builder.is_prepared():
      raise
  return builder


def read_split(builder: tfds.core.DatasetBuilder, split: str) -> np.ndarray:
  """A prepared split as one new uint8 array, its chunks checked to be contiguous."""
  source = builder.as_data_source(split=split)
  records = [source[i] for i in range(len(source))]
  expected = 0
  for record in records:
    if int(record["offset"]) != expected:
      raise ValueError(
          f"{builder.name}/{split} under {builder.data_dir}: a chunk starts at offset "
          f"{int(record['offset']):,}, expected {expected:,}; delete it to rebuild"
      )
    expected += len(record["bytes"])
  return np.concatenate([r["bytes"] for r in records] or [np.zeros(0, np.uint8)])
