"""Data for every task: the byte corpora (enwik8, text8 and their bundled samples) and the
tokenized and JSONL data of the other tasks.

  builders       TFDS builders of the byte corpora, read without TensorFlow
  corpora        where the corpora's bytes come from and their checks; the split boundaries
  wikifil        Mahoney's wikifil (enwik8 XML -> text8 characters)
  sampler        BatchSampler: resumable (inputs, targets) batches of a token stream
  text           JSONL records, encoding with a tokenizer, padded id batches, a resumable order
  tokenizer      loading and checking HF tokenizers; the special tokens and their ids
  tokenized      token caches and packed rows of tokenized documents (masked LM)
  finetune_data  what the fine-tuning kinds' records share (the kinds: tasks.finetune_kinds)

The byte corpora, as arrays and batches:

    >>> from longformer_jax.data import load_split, BatchSampler
    >>> train = load_split("enwik8_sample", "train")      # uint8, 5,480,771 bytes, offline
    >>> sampler = BatchSampler(train, seq_len=512, global_batch_size=8, seed=0)
    >>> inputs, targets = next(sampler)                     # int32 [8, 512] each

Datasets are TFDS builders (`longformer_jax.data.builders`) stored as array_record and read
without TensorFlow. tensorflow-datasets is imported only when data is loaded, so this package
imports on machines that lack it; there `load_split` still serves the two samples, computed
straight from the package data. Byte handling and directories: docs/data.md.
"""

from __future__ import annotations

import os

import numpy as np

from longformer_jax.data import corpora
from longformer_jax.data.sampler import BatchSampler
from longformer_jax.data.wikifil import wikifil

__all__ = ["DATASETS", "SPLITS", "BatchSampler", "load_split", "wikifil"]

DATASETS = ("enwik8", "text8", "enwik8_sample", "text8_sample")
SPLITS = ("train", "validation", "test")
_SPLIT_ALIASES = {"valid": "validation"}


def load_split(
    name: str,
    split: str,
    data_dir: os.PathLike | str | None = None,
    *,
    manual_dir: os.PathLike | str | None = None,
) -> np.ndarray:
  """One split of a corpus as a uint8 array of its bytes, in order.

  The first call prepares the dataset under `data_dir` (TFDS's default: `$TFDS_DATA_DIR` or
  `~/tensorflow_datasets`); later calls read the prepared array_record files. The samples need
  no network: they are built from data inside the package. enwik8 and text8 use
  `manual_dir/enwik8.zip` (`text8.zip`) when present (default manual_dir:
  `<data_dir>/downloads/manual`), else download and verify the official zip.

  Args:
    name: "enwik8", "text8", "enwik8_sample" or "text8_sample".
    split: "train", "validation" (or "valid") or "test": the first 90% of the bytes, the next
      5%, the rest (90M/5M/5M for enwik8 and text8).
    data_dir: where prepared datasets live.
    manual_dir: where to look for the official zips before downloading.

  Returns:
    A fresh, writable uint8 array. enwik8 data holds every byte of the XML (newlines
    included); text8 data holds only b" abcdefghijklmnopqrstuvwxyz".
  """
  if name not in DATASETS:
    raise ValueError(f"unknown dataset name={name!r}; expected one of {DATASETS}")
  canonical = _SPLIT_ALIASES.get(split, split)
  if canonical not in SPLITS:
    raise ValueError(f"unknown split={split!r}; expected one of {SPLITS} (or 'valid')")
  try:
    from longformer_jax.data import builders  # tensorflow-datasets only from here on
  except ImportError as e:
    if name not in corpora.SAMPLES:
      raise ImportError(
          f"load_split({name!r}) needs tensorflow-datasets and array_record "
          "(pip install tensorflow-datasets array_record)"
      ) from e
    # Machines without TFDS (the GPU image) still get the samples: the same bytes the
    # builders store, computed from the package data (tests check both paths agree).
    stream = corpora.sample_stream(name)
    start, stop = corpora.split_bounds(len(stream))[canonical]
    return np.frombuffer(stream[start:stop], dtype=np.uint8).copy()
  builder = builders.prepare(name, data_dir=data_dir, manual_dir=manual_dir)
  return builders.read_split(builder, canonical)
