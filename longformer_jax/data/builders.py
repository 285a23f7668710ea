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
    "check_metadata",
    "prepare",
    "read_split",
]

CHUNK_BYTES = 1 << 20  # one record per MiB: 90 records for enwik8's train split

# The length of each sample's stream (an official corpus's is its `Source.length`): a prepared
# split must hold exactly its share of it.
SAMPLE_BYTES = {"enwik8_sample": 6_089_746, "text8_sample": 3_085_829}
# SHA-256 of the samples' splits, from the package's data (tests/test_data_load.py checks them).
SPLIT_SHA256 = {
    "enwik8_sample": {
        "train": "1cf35daa55b95f1e956fdfdae4070f8828927b3f15f0ddcf79daf17046953727",
        "validation": "7a56b5176df7338194fddbd5903545b649bc4c3469b12ae0f2d438fcf85f084f",
        "test": "445068879abb9d354ba8e86ba820af9c6b91ba40c135be2771ef260a54bff1bf",
    },
    "text8_sample": {
        "train": "b1634e67e28709feca9853afcff45713be44d934a2d36c64fb3743b11f00e665",
        "validation": "a4b210b39a8601f7f342a8bf3d6e4a03cf3a98c62296baec060335b4ce01e641",
        "test": "8f2e2399d15dd6487998858794eed4010b35920441e17b283a13f1c1700be46c",
    },
}
# Written beside a corpus's files when this module prepares it: each split's length and SHA-256
# (the full corpora's digests are known only once their zips are read).
SPLITS_FILE = "longformer_splits.json"
# The modules a prepared dataset's metadata may name feature classes of: TFDS's own.
_FEATURE_MODULES = ("tensorflow_datasets.",)

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
  check_metadata(Path(data_dir or tfds.core.constants.DATA_DIR) / name_or_class.name)
  builder = _open(name_or_class, data_dir)
  prepared_before = builder.is_prepared()
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
  if not prepared_before and builder.name not in SPLIT_SHA256:
    _record_splits(builder)
  return builder


def _open(cls: type[_ByteStream], data_dir) -> tfds.core.DatasetBuilder:
  """`cls(data_dir=...)`: TFDS reads a prepared dataset's dataset_info.json here, and an edited
  one ends in its own parse or assertion errors: a ValueError naming the directory instead."""
  try:
    return cls(data_dir=data_dir)
  except OSError:
    raise
  except Exception as e:  # TFDS raises protobuf, assertion, key errors
    where = Path(data_dir or tfds.core.constants.DATA_DIR) / cls.name
    raise ValueError(f"the prepared dataset {where} cannot be read ({type(e).__name__}: "
                     f"{str(e).splitlines()[0][:200] if str(e) else 'no message'}); delete "
                     f"it to rebuild") from None


def check_metadata(root: os.PathLike | str) -> None:
  """Reads every dataset_info.json and features.json under a prepared dataset's directory
  `root` as data, before TFDS does: each must be a JSON object, and every feature class it
  names ("pythonClassName") one of TFDS's own. TFDS imports the module of a feature class it
  does not know, so a features.json could otherwise make it import any module. Raises
  ValueError naming the file and the value. A missing directory passes (nothing prepared)."""
  import json

  root = Path(root)
  if not root.is_dir():
    return
  for path in sorted(root.glob("**/*.json")):
    if path.name not in ("dataset_info.json", "features.json") or len(
        path.relative_to(root).parts) > 4:
      continue
    try:
      if not path.is_file():
        raise ValueError("not a regular file")
      value = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
      raise ValueError(f"{path}: nests JSON too deeply to be TFDS metadata") from None
    except (ValueError, UnicodeDecodeError) as e:
      raise ValueError(f"{path} is not JSON TFDS can read ({e}); delete the prepared "
                       f"dataset to rebuild it") from None
    if not isinstance(value, dict):
      raise ValueError(f"{path} holds a JSON {type(value).__name__}, not TFDS metadata (an "
                       f"object); delete the prepared dataset to rebuild it")
    for name in _class_names(value):
      if not isinstance(name, str) or not name.startswith(_FEATURE_MODULES):
        raise ValueError(f"{path} names the feature class {str(name)[:120]!r}, not one of "
                         f"TFDS's own: a prepared dataset is read as data, and TFDS would "
                         f"import the module that names")


def _class_names(value) -> list:
  """Every "pythonClassName" value in a JSON tree (iteratively: no recursion limit)."""
  names, stack = [], [value]
  while stack:
    node = stack.pop()
    if isinstance(node, dict):
      if "pythonClassName" in node:
        names.append(node["pythonClassName"])
      stack.extend(node.values())
    elif isinstance(node, list):
      stack.extend(node)
  return names


def _split_digest(data: np.ndarray) -> str:
  import hashlib
  return hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()


def _record_splits(builder: tfds.core.DatasetBuilder) -> None:
  """Writes `SPLITS_FILE` beside a corpus this module has just prepared."""
  import json

  from longformer_jax.io import atomic_write
  record = {}
  for split in corpora.split_bounds(1):
    data = _read(builder, split)
    record[split] = {"bytes": int(data.size), "sha256": _split_digest(data)}
  try:
    atomic_write(Path(builder.data_dir) / SPLITS_FILE, json.dumps(record, indent=2) + "\n")
  except OSError:
    pass  # a read-only data_dir (another process prepared it): the lengths are still checked


def _recorded(builder: tfds.core.DatasetBuilder, split: str) -> str | None:
  """The SHA-256 a split must have: the package's (samples), else the one recorded when the
  corpus was prepared (`SPLITS_FILE`), else None."""
  import json
  if builder.name in SPLIT_SHA256:
    return SPLIT_SHA256[builder.name][split]
  path = Path(builder.data_dir) / SPLITS_FILE
  if not path.is_file():
    return None
  try:
    digest = json.loads(path.read_text())[split]["sha256"]
  except (ValueError, KeyError, TypeError, RecursionError):
    raise ValueError(f"{path} is not the record of {builder.name}'s splits; delete "
                     f"{builder.data_dir} to rebuild") from None
  return digest if isinstance(digest, str) else None


def read_split(builder: tfds.core.DatasetBuilder, split: str) -> np.ndarray:
  """A prepared split as one new uint8 array, its chunks checked to be contiguous, and the
  split checked to be its own before anything is scored: its length is its share of the
  corpus (`Source.length`, `SAMPLE_BYTES`), and its SHA-256 the package's (samples) or the
  one recorded when it was prepared (`SPLITS_FILE`). A split's files swapped for another
  split's are a ValueError naming the directory, not another split scored without a word."""
  data = _read(builder, split)
  where = f"{builder.name}/{split} under {builder.data_dir}"
  source = getattr(builder, "SOURCE", None)
  total = source.length if source is not None else SAMPLE_BYTES.get(builder.name)
  if total is not None:
    start, stop = corpora.split_bounds(total)[split]
    if data.size != stop - start:
      raise ValueError(f"{where} holds {data.size:,} bytes; that split has {stop - start:,}: "
                       f"its files are not its own (another split's?); delete "
                       f"{builder.data_dir} to rebuild")
  recorded = _recorded(builder, split)
  if recorded is not None and _split_digest(data) != recorded:
    raise ValueError(f"{where} has sha256 {_split_digest(data)[:16]}..., that split "
                     f"{recorded[:16]}...: its files are not its own (another split's?); "
                     f"delete {builder.data_dir} to rebuild")
  return data


def _read(builder: tfds.core.DatasetBuilder, split: str) -> np.ndarray:
  """A prepared split as one new uint8 array, its chunks checked to be contiguous."""
  try:
    source = builder.as_data_source(split=split)
  except OSError:
    raise
  except Exception as e:  # an edited dataset_info.json: TFDS's own errors
    raise ValueError(f"{builder.name}/{split} under {builder.data_dir} cannot be read "
                     f"({type(e).__name__}: {str(e)[:200]}); delete it to rebuild") from None
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
