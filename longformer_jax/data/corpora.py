"""Where the corpora's bytes come from, and the checks they pass. No TFDS needed here.

- `enwik8`, `text8`: official zips (`Source`), from a manual directory or downloaded, verified
  by archive size and sha256, then by the extracted file's length, digest and alphabet.
- `enwik8_sample`, `text8_sample`: the Wikipedia XML bundled in `enwiki_sample/` (checked against
  its README's sha256), as is or through `wikifil` (checked against `perl wikifil.pl`'s output).
- `split_bounds`: the 90% / 5% / rest byte split shared by all four.
"""

from __future__ import annotations

import bz2
import dataclasses
import functools
import hashlib
import importlib.resources
import os
import urllib.request
import zipfile
from pathlib import Path

import numpy as np

from longformer_jax.data.wikifil import wikifil

__all__ = [
    "DOWNLOAD_TIMEOUT_S",
    "ENWIK8_SOURCE",
    "SAMPLES",
    "TEXT8_ALPHABET",
    "TEXT8_SOURCE",
    "Source",
    "fetch",
    "read_archive",
    "sample_stream",
    "sample_xml",
    "split_bounds",
    "verify_archive",
]

TEXT8_ALPHABET = b" abcdefghijklmnopqrstuvwxyz"

# Seconds any one socket operation of a download (connecting, each read) may wait: a server that
# stops answering then fails the download instead of hanging the run (and every host with it).
DOWNLOAD_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Source:
  """An official archive and what must hold for it before it is used.

  Attributes:
    url: where it is downloaded from.
    filename: its name in the manual and download directories.
    size: archive bytes.
    sha256: archive digest; None trusts `size`, the zip's own CRC-32 and the content checks
      below (no published digest of text8.zip was at hand to pin).
    member: the file inside the zip.
    length: bytes of `member`.
    md5: published digest of `member`, if any.
    alphabet: the only bytes `member` may contain, if restricted.
  """

  url: str
  filename: str
  size: int
  sha256: str | None
  member: str
  length: int
  md5: str | None = None
  alphabet: bytes | None = None


ENWIK8_SOURCE = Source(
    url="http://mattmahoney.net/dc/enwik8.zip",
    filename="enwik8.zip",
    size=36_445_475,
    sha256="547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc",
    member="enwik8",
    length=100_000_000,
    md5="a1fa5ffddb56f4953e226637dabbb36a",
)
TEXT8_SOURCE = Source(
    url="http://mattmahoney.net/dc/text8.zip",
    filename="text8.zip",
    size=31_344_016,
    sha256=None,
    member="text8",
    length=100_000_000,
    alphabet=TEXT8_ALPHABET,
)

# The bundled sample and its digests (enwiki_sample/README.md; the filtered one from
# `perl wikifil.pl`, 3,085,829 bytes).
_SAMPLE_RESOURCE = ("enwiki_sample", "enwiki-sample.xml.bz2")
SAMPLE_BZ2_SHA256 = "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"
SAMPLE_XML_SHA256 = "34c1c63050c87cc8477b9ae36b1cb0edf372612c92938b742e579a7109c20fa4"
SAMPLE_TEXT8_SHA256 = "0cf035b28f92b01ff2dd0880909f6087bfb48bc8b8c726b793bccdad5c56a13c"
SAMPLES = ("enwik8_sample", "text8_sample")


def split_bounds(n: int) -> dict[str, tuple[int, int]]:
  """`[start, stop)` of each split of an `n`-byte stream: first 90%, next 5%, the rest.

  10^8 bytes give the standard 90M/5M/5M; the 6,089,746-byte sample gives
  5,480,771 / 304,487 / 304,488.
  """
  n_train, n_valid = n * 9 // 10, n // 20
  return {
      "train": (0, n_train),
      "validation": (n_train, n_train + n_valid),
      "test": (n_train + n_valid, n),
  }


def _file_sha256(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      h.update(block)
  return h.hexdigest()


def verify_archive(path: os.PathLike | str, source: Source) -> None:
  """Raises ValueError unless `path` has `source`'s size and (when pinned) sha256."""
  path = Path(path)
  size = path.stat().st_size
  if size != source.size:
    raise ValueError(
        f"{path} is {size:,} bytes but {source.filename} from {source.url} is "
        f"{source.size:,} bytes; replace it with the official file"
    )
  if source.sha256 is not None and (digest := _file_sha256(path)) != source.sha256:
    raise ValueError(
        f"{path} has sha256 {digest}, expected {source.sha256} for {source.url}; "
        "replace it with the official file"
    )


def _download(url: str, dest: Path, timeout: float = DOWNLOAD_TIMEOUT_S) -> None:
  """Streams `url` to `dest` through a temporary file, so `dest` is whole or absent.

  Raises OSError (TimeoutError or urllib's URLError included) when the server cannot be
  reached or a socket operation waits more than `timeout` seconds.
  """
  import tqdm  # only needed for downloads

  dest.parent.mkdir(parents=True, exist_ok=True)
  # A name of its own, so processes downloading at once never write into the same file.
  tmp = dest.with_name(f"{dest.name}.incomplete.{os.getpid()}")
  try:
    with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as f:
      total = int(response.headers.get("Content-Length") or 0) or None
      with tqdm.tqdm(total=total, unit="B", unit_scale=True, desc=dest.name) as bar:
        for block in iter(lambda: response.read(1 << 20), b""):
          f.write(block)
          bar.update(len(block))
    os.replace(tmp, dest)
  finally:
    tmp.unlink(missing_ok=True)


def fetch(
    source: Source,
    *,
    manual_dir: os.PathLike | str | None,
    download_dir: os.PathLike | str,
    timeout: float = DOWNLOAD_TIMEOUT_S,
) -> Path:
  """The verified archive: `manual_dir/<filename>` if it exists, else a (cached) download.

  Args:
    source: the archive.
    manual_dir: where a copy put there by hand is looked for first; None: TFDS's default for
      this download directory, `<download_dir>/manual`.
    download_dir: where the download is cached.
    timeout: seconds each socket operation of the download may wait.

  Raises ValueError for a wrong file and OSError (naming the file, its size and the path to
  put it at instead) when the download fails.
  """
  manual_dir = Path(download_dir) / "manual" if manual_dir is None else Path(manual_dir)
  if (manual := manual_dir / source.filename).exists():
    verify_archive(manual, source)
    return manual
  path = Path(download_dir) / source.filename
  if not path.exists():
    try:
      _download(source.url, path, timeout=timeout)
    except OSError as e:  # urllib's URLError and timeouts included
      raise OSError(
          f"could not download {source.url} ({type(e).__name__}: {e}); without network "
          f"access put the official {source.filename} ({source.size:,} bytes) in the "
          f"manual directory {manual_dir}, as {manual}"
      ) from e
  verify_archive(path, source)
  return path


def read_archive(archive: os.PathLike | str, source: Source) -> bytes:
  """`source.member` out of `archive`, checked (zipfile itself checks the CRC-32)."""
  with zipfile.ZipFile(archive) as z:
    if source.member not in z.namelist():
      raise ValueError(f"{archive} has no member {source.member!r}: it holds {z.namelist()}")
    data = z.read(source.member)
  what = f"{archive}:{source.member}"
  if len(data) != source.length:
    raise ValueError(f"{what} is {len(data):,} bytes, expected {source.length:,}")
  if source.md5 is not None and (digest := hashlib.md5(data).hexdigest()) != source.md5:
    raise ValueError(f"{what} has MD5 {digest}, expected {source.md5}")
  if source.alphabet is not None:
    allowed = np.zeros(256, dtype=bool)
    allowed[np.frombuffer(source.alphabet, dtype=np.uint8)] = True
    bad = np.flatnonzero(~allowed[np.frombuffer(data, dtype=np.uint8)])
    if bad.size:
      raise ValueError(
          f"{what} may only hold bytes of {source.alphabet!r}; it has byte {data[bad[0]]} "
          f"at offset {bad[0]:,} ({bad.size:,} such bytes)"
      )
  return data


def _checked(data: bytes, sha256: str, what: str) -> bytes:
  if (digest := hashlib.sha256(data).hexdigest()) != sha256:
    raise ValueError(f"{what} has sha256 {digest}, expected {sha256}")
  return data


@functools.cache  # bytes are immutable; 9 MB held saves a decompress + filter per call
def sample_xml() -> bytes:
  """The bundled Wikipedia XML, 6,089,746 bytes, checked against its README's sha256."""
  resource = importlib.resources.files("longformer_jax.data").joinpath(*_SAMPLE_RESOURCE)
  packed = _checked(resource.read_bytes(), SAMPLE_BZ2_SHA256, str(resource))
  return _checked(bz2.decompress(packed), SAMPLE_XML_SHA256, f"decompressed {resource}")


@functools.cache
def sample_stream(name: str) -> bytes:
  """All bytes of `enwik8_sample` (the XML) or `text8_sample` (its `wikifil` output)."""
  if name == "enwik8_sample":
    return sample_xml()
  if name == "text8_sample":
    return _checked(wikifil(sample_xml()), SAMPLE_TEXT8_SHA256, "wikifil(sample XML)")
  raise ValueError(f"unknown sample name={name!r}; expected one of {SAMPLES}")
