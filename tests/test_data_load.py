"""`load_split` on the bundled samples, and the enwik8/text8 builders on tiny local zips.

No network: official-corpus builders are exercised with fake archives (their `Source` swapped
for one describing the fake) from a manual directory and through a `file://` download.
"""

import hashlib
import os
import socket
import subprocess
import sys
import textwrap
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from longformer_jax.data import DATASETS, corpora, load_split

pytestmark = pytest.mark.unit

builders = pytest.importorskip("longformer_jax.data.builders")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("tfds")


# --- the samples through load_split ---------------------------------------------------------


@pytest.mark.parametrize(
    "name,sizes,sha256",
    [
        ("enwik8_sample", (5_480_771, 304_487, 304_488), corpora.SAMPLE_XML_SHA256),
        ("text8_sample", (2_777_246, 154_291, 154_292), corpora.SAMPLE_TEXT8_SHA256),
    ],
)
def test_sample_splits_are_contiguous_90_5_5(data_dir, name, sizes, sha256):
  parts = [load_split(name, split, data_dir) for split in ("train", "validation", "test")]
  assert tuple(len(p) for p in parts) == sizes
  assert all(p.dtype == np.uint8 and p.ndim == 1 for p in parts)
  # In order, nothing lost or repeated: the splits concatenate to the whole stream.
  assert hashlib.sha256(np.concatenate(parts).tobytes()).hexdigest() == sha256
  np.testing.assert_array_equal(load_split(name, "valid", data_dir), parts[1])


def test_sample_byte_handling(data_dir):
  enwik8 = load_split("enwik8_sample", "train", data_dir)
  assert enwik8[:5].tobytes() == b"<medi"
  assert (enwik8 == ord("\n")).sum() > 10_000  # newlines are kept
  assert enwik8.max() > 127  # so are UTF-8 bytes
  text8 = load_split("text8_sample", "test", data_dir)
  assert set(np.unique(text8).tobytes()) <= set(corpora.TEXT8_ALPHABET)


def test_returned_arrays_are_fresh(data_dir):
  a = load_split("text8_sample", "validation", data_dir)
  a[:] = 0
  assert load_split("text8_sample", "validation", data_dir).any()


@pytest.mark.parametrize(
    "name,split,match", [("enwik9", "train", "enwik9"), ("text8", "dev", "dev")]
)
def test_unknown_name_or_split(name, split, match):
  with pytest.raises(ValueError, match=match):
    load_split(name, split)


def test_samples_without_tensorflow_datasets():
  """A fresh interpreter without TFDS (like the GPU image) imports the package and still
  serves the samples: the same bytes the builders store."""
  script = textwrap.dedent(
      """
        import hashlib, sys
        import numpy as np
        sys.modules["tensorflow_datasets"] = None  # any import of it now fails
        import longformer_jax.data as data
        for name in ("enwik8_sample", "text8_sample"):
            parts = [data.load_split(name, s) for s in ("train", "validation", "test")]
            print(name, [len(p) for p in parts], hashlib.sha256(np.concatenate(parts)).hexdigest())
        try:
            data.load_split("enwik8", "train")
        except ImportError as e:
            print("ImportError", "tensorflow-datasets" in str(e))
        """
  )
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  out = subprocess.run(
      [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
  ).stdout.split("\n")
  assert out[0] == f"enwik8_sample [5480771, 304487, 304488] {corpora.SAMPLE_XML_SHA256}"
  assert out[1] == f"text8_sample [2777246, 154291, 154292] {corpora.SAMPLE_TEXT8_SHA256}"
  assert out[2] == "ImportError True"


def test_processes_preparing_at_once_all_succeed(tmp_path):
  """Each host process calls load_split at start-up; all must get the data, whichever
  finishes preparing first."""
  script = (
      "import hashlib, sys\n"
      "from longformer_jax.data import load_split\n"
      "x = load_split('text8_sample', 'validation', sys.argv[1])\n"
      "print(hashlib.sha256(x).hexdigest())\n"
  )
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  procs = [
      subprocess.Popen(
          [sys.executable, "-c", script, str(tmp_path)],
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
          env=env,
      )
      for _ in range(2)
  ]
  results = [p.communicate() for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
  start, stop = corpora.split_bounds(3_085_829)["validation"]
  expected = hashlib.sha256(corpora.sample_stream("text8_sample")[start:stop]).hexdigest()
  assert [out.split()[-1] for out, _ in results] == [expected, expected]


# --- the enwik8 / text8 builders on fake archives -------------------------------------------


def _fake_archive(path: Path, member: str, content: bytes) -> corpora.Source:
  path.parent.mkdir(parents=True, exist_ok=True)
  with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
    z.writestr(member, content)
  raw = path.read_bytes()
  return corpora.Source(
      url=path.as_uri(),
      filename=path.name,
      size=len(raw),
      sha256=hashlib.sha256(raw).hexdigest(),
      member=member,
      length=len(content),
      md5=hashlib.md5(content).hexdigest(),
  )


def _with_source(base, source):
  class Fake(base, skip_registration=True):
    SOURCE = source

  return Fake


@pytest.fixture
def small_chunks(monkeypatch):
  # Several records per split, so reading proves their order.
  monkeypatch.setattr(builders, "CHUNK_BYTES", 64)


def test_registered_with_tfds():
  import tensorflow_datasets as tfds

  registered = tfds.list_builders(with_community_datasets=False)
  assert set(DATASETS) <= set(registered)


def test_enwik8_from_manual_dir(tmp_path, small_chunks):
  content = bytes(range(256)) * 8 + b"\n\r\n<page>"  # every byte value, newlines included
  source = _fake_archive(tmp_path / "manual" / "enwik8.zip", "enwik8", content)
  builder = builders.prepare(
      _with_source(builders.Enwik8, source),
      data_dir=tmp_path / "data",
      manual_dir=tmp_path / "manual",
  )
  parts = {s: builders.read_split(builder, s) for s in ("train", "validation", "test")}
  n = len(content)
  assert [len(p) for p in parts.values()] == [n * 9 // 10, n // 20, n - n * 9 // 10 - n // 20]
  assert np.concatenate(list(parts.values())).tobytes() == content
  assert len(builder.as_data_source(split="train")) > 1
  assert not (tmp_path / "data" / "downloads" / "enwik8.zip").exists()  # nothing downloaded


def test_text8_downloaded_verified_and_cached(tmp_path, small_chunks):
  content = b" anarchism originated as a term of abuse" * 20
  source = _fake_archive(tmp_path / "server" / "text8.zip", "text8", content)
  source = replace(source, md5=None, alphabet=corpora.TEXT8_ALPHABET)
  builder = builders.prepare(_with_source(builders.Text8, source), data_dir=tmp_path / "data")
  assert (tmp_path / "data" / "downloads" / "text8.zip").read_bytes() == (
      tmp_path / "server" / "text8.zip"
  ).read_bytes()
  splits = ("train", "validation", "test")
  whole = b"".join(builders.read_split(builder, s).tobytes() for s in splits)
  assert whole == content


def test_text8_rejects_bytes_outside_alphabet(tmp_path):
  source = _fake_archive(tmp_path / "manual" / "text8.zip", "text8", b" fine text Not fine")
  source = replace(source, alphabet=corpora.TEXT8_ALPHABET)
  cls = _with_source(builders.Text8, source)
  with pytest.raises(ValueError, match=r"byte 78 at offset 11"):
    builders.prepare(cls, data_dir=tmp_path / "data", manual_dir=tmp_path / "manual")


def test_official_enwik8_rejects_a_wrong_manual_file(tmp_path):
  _fake_archive(tmp_path / "manual" / "enwik8.zip", "enwik8", b"not the real thing")
  with pytest.raises(ValueError, match=r"enwik8\.zip is \d+ bytes but .* is 36,445,475 bytes"):
    builders.prepare("enwik8", data_dir=tmp_path / "data", manual_dir=tmp_path / "manual")
  assert not (tmp_path / "data" / "enwik8" / "1.0.0").exists()


def test_real_sources_pin_the_published_figures():
  assert corpora.ENWIK8_SOURCE.size == 36_445_475
  assert corpora.ENWIK8_SOURCE.md5 == "a1fa5ffddb56f4953e226637dabbb36a"
  assert corpora.TEXT8_SOURCE.size == 31_344_016
  assert corpora.ENWIK8_SOURCE.length == corpora.TEXT8_SOURCE.length == 10**8
  assert corpora.split_bounds(10**8) == {
      "train": (0, 90_000_000),
      "validation": (90_000_000, 95_000_000),
      "test": (95_000_000, 100_000_000),
  }


def test_verify_archive_checks_size_then_sha256(tmp_path):
  source = _fake_archive(tmp_path / "enwik8.zip", "enwik8", b"abc")
  corpora.verify_archive(tmp_path / "enwik8.zip", source)
  with pytest.raises(ValueError, match=f"is {source.size:,} bytes but .* is {source.size + 1:,}"):
    corpora.verify_archive(tmp_path / "enwik8.zip", replace(source, size=source.size + 1))
  with pytest.raises(ValueError, match="sha256 .* expected 0000"):
    corpora.verify_archive(tmp_path / "enwik8.zip", replace(source, sha256="0" * 64))


def test_read_archive_checks_member_length_and_md5(tmp_path):
  source = _fake_archive(tmp_path / "enwik8.zip", "enwik8", b"abc")
  assert corpora.read_archive(tmp_path / "enwik8.zip", source) == b"abc"
  for change, match in [
      ({"member": "enwik9"}, "no member 'enwik9'"),
      ({"length": 4}, "is 3 bytes, expected 4"),
      ({"md5": "f" * 32}, "MD5 .* expected ffff"),
      ({"alphabet": b"ab"}, "byte 99 at offset 2"),
  ]:
    with pytest.raises(ValueError, match=match):
      corpora.read_archive(tmp_path / "enwik8.zip", replace(source, **change))


def test_failed_download_names_the_manual_dir(tmp_path):
  source = replace(corpora.TEXT8_SOURCE, url=(tmp_path / "missing.zip").as_uri())
  with pytest.raises(OSError, match="put the official text8.zip .* in the manual directory"):
    corpora.fetch(source, manual_dir=tmp_path / "manual", download_dir=tmp_path / "downloads")
  assert not list((tmp_path / "downloads").glob("*"))  # no partial file left behind


def test_failed_download_names_the_default_manual_dir(tmp_path):
  """Without a manual directory the error names TFDS's default one, `<download_dir>/manual`,
  where a file put by hand is then found."""
  source = replace(corpora.TEXT8_SOURCE, url=(tmp_path / "missing.zip").as_uri())
  downloads = tmp_path / "downloads"
  with pytest.raises(OSError) as e:
    corpora.fetch(source, manual_dir=None, download_dir=downloads)
  assert "None" not in str(e.value)
  assert (
      f"put the official text8.zip (31,344,016 bytes) in the manual directory "
      f"{downloads / 'manual'}, as {downloads / 'manual' / 'text8.zip'}"
  ) in str(e.value)
  fake = _fake_archive(downloads / "manual" / "text8.zip", "text8", b"abc")
  fake = replace(fake, url=source.url)
  assert corpora.fetch(fake, manual_dir=None, download_dir=downloads) == (
      downloads / "manual" / "text8.zip"
  )


@pytest.mark.parametrize("given", [False, True])
def test_builder_download_error_names_the_manual_dir(tmp_path, given):
  """Through TFDS: the manual directory given (empty here), else the default
  `<data_dir>/downloads/manual`, never None."""
  source = replace(corpora.TEXT8_SOURCE, url=(tmp_path / "missing.zip").as_uri())
  manual = tmp_path / "my_manual" if given else tmp_path / "data" / "downloads" / "manual"
  with pytest.raises(OSError, match="could not download") as e:
    builders.prepare(
        _with_source(builders.Text8, source),
        data_dir=tmp_path / "data",
        manual_dir=manual if given else None,
    )
  assert f"in the manual directory {manual}, as {manual / 'text8.zip'}" in str(e.value)
  assert "31,344,016 bytes" in str(e.value)


def test_builder_finds_a_zip_in_the_default_manual_dir(tmp_path, small_chunks):
  content = b" what the default manual directory holds" * 4
  manual = tmp_path / "data" / "downloads" / "manual"
  source = _fake_archive(manual / "text8.zip", "text8", content)
  source = replace(source, url=(tmp_path / "missing.zip").as_uri())  # no download possible
  builder = builders.prepare(_with_source(builders.Text8, source), data_dir=tmp_path / "data")
  splits = ("train", "validation", "test")
  assert b"".join(builders.read_split(builder, s).tobytes() for s in splits) == content


@pytest.fixture
def silent_server():
  """A local URL whose server accepts connections (the kernel's backlog) and never answers."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    yield f"http://127.0.0.1:{server.getsockname()[1]}/text8.zip"


def test_download_times_out(tmp_path, silent_server):
  source = replace(corpora.TEXT8_SOURCE, url=silent_server)
  start = time.monotonic()
  with pytest.raises(OSError, match=r"could not download .*timed out.* manual directory") as e:
    corpora.fetch(
        source, manual_dir=None, download_dir=tmp_path / "downloads", timeout=0.2
    )
  assert time.monotonic() - start < 10
  assert str(tmp_path / "downloads" / "manual" / "text8.zip") in str(e.value)
  assert not list((tmp_path / "downloads").glob("*"))  # no partial file left behind
  assert corpora.DOWNLOAD_TIMEOUT_S == 60  # the default: per socket operation, not in total


# --- a prepared directory is data, and a split is its own ------------------------------------


def _split_file(builder_dir: Path, split: str) -> Path:
  (path,) = builder_dir.glob(f"*-{split}.array_record-*")
  return path


def test_a_swapped_split_file_is_refused_not_scored(data_dir, tmp_path, small_chunks):
  """A prepared split's files swapped for another split's were read without a word: the length
  (the samples: and the SHA-256 the package knows) or the SHA-256 recorded when this module
  prepared the corpus (equal lengths: the official corpora's validation and test) refuse it."""
  import shutil
  load_split("enwik8_sample", "test", data_dir)  # prepared in the session's directory
  shutil.copytree(data_dir / "enwik8_sample", tmp_path / "copy" / "enwik8_sample")
  version = tmp_path / "copy" / "enwik8_sample" / "1.0.0"
  test, validation = _split_file(version, "test"), _split_file(version, "validation")
  test.write_bytes(validation.read_bytes())
  with pytest.raises(ValueError, match=r"enwik8_sample/test under .* holds 304,487 bytes; that "
                                       r"split has 304,488: its files are not its own"):
    load_split("enwik8_sample", "test", tmp_path / "copy")

  content = (bytes(range(256)) * 8)[:2000]  # validation and test: 100 bytes each
  source = _fake_archive(tmp_path / "manual" / "enwik8.zip", "enwik8", content)
  cls = _with_source(builders.Enwik8, source)
  builder = builders.prepare(cls, data_dir=tmp_path / "data", manual_dir=tmp_path / "manual")
  assert (Path(builder.data_dir) / builders.SPLITS_FILE).is_file()
  test, validation = (_split_file(Path(builder.data_dir), s) for s in ("test", "validation"))
  swapped = validation.read_bytes()
  validation.write_bytes(test.read_bytes())
  test.write_bytes(swapped)
  with pytest.raises(ValueError, match=r"/test under .* has sha256 .*, that split .*: its files "
                                       r"are not its own"):
    builders.read_split(builder, "test")


@pytest.mark.parametrize("edit, message", [
    (lambda text: text[:100], "dataset_info.json is not JSON TFDS can read"),
    (lambda text: "[]", "dataset_info.json holds a JSON list, not TFDS metadata"),
    (lambda text: text.replace('"version": "1.0.0"', '"version": "9.9.9"'),
     "cannot be read"),
])
def test_an_edited_dataset_info_is_one_error_naming_it(data_dir, tmp_path, edit, message):
  """An edited dataset_info.json crashed in TFDS (a protobuf ParseError, an AssertionError)."""
  import shutil
  load_split("enwik8_sample", "test", data_dir)
  shutil.copytree(data_dir / "enwik8_sample", tmp_path / "enwik8_sample")
  info = tmp_path / "enwik8_sample" / "1.0.0" / "dataset_info.json"
  info.write_text(edit(info.read_text()))
  with pytest.raises(ValueError, match=message):
    load_split("enwik8_sample", "test", tmp_path)


def test_a_features_json_cannot_make_tfds_import_a_module(tmp_path, monkeypatch):
  """TFDS imports the module of a feature class a features.json names: a prepared directory
  (tfds:NAME) naming one outside TFDS is refused before TFDS reads it, and nothing is imported."""
  from longformer_jax.data import tokenized
  marker = tmp_path / "imported"
  (tmp_path / "planted_module.py").write_text(
      f"open({str(marker)!r}, 'w').write('ran')\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  version = tmp_path / "data" / "planted" / "1.0.0"
  version.mkdir(parents=True)
  (version / "dataset_info.json").write_text('{"name": "planted", "version": "1.0.0"}')
  (version / "features.json").write_text(
      '{"pythonClassName": "planted_module.Feature", "featuresDict": {}}')
  with pytest.raises(ValueError, match=r"features.json names the feature class "
                                       r"'planted_module.Feature', not one of TFDS's own"):
    tokenized.text_of("tfds:planted", "test", data_dir=tmp_path / "data")
  assert not marker.exists()
