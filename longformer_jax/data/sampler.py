"""A deterministic, resumable batch sampler over a byte stream, sharded across processes.

The sampler is a pure function of `(seed, step)`: the global batch at a step never depends on
what was drawn before, on how many processes there are, or on the machine. Resuming is therefore
setting the step (`load_state`), and a checkpoint needs only `state()`: a dict of ints.

Epochs. The stream of N tokens is cut into W = (N - seq_len) // seq_len windows of
`seq_len + 1` tokens (inputs and their next-token targets), window i starting at
`shift + i * seq_len`. Every epoch draws its own `shift` in [0, seq_len), so epochs cut the text
at different places, and its own window order. A global batch takes the next `global_batch_size`
windows of the epoch's order; the W % global_batch_size windows left at the end of an epoch are
skipped in that epoch. (Validation scores the split in stream order with
`longformer_jax.tasks.charlm`, not with a sampler.)

Processes. Process p of P receives rows [p * b, (p + 1) * b) of each global batch, b =
global_batch_size / P: a contiguous block, the layout `jax.make_array_from_process_local_data`
expects for a batch axis sharded over processes in order. Concatenating the P local batches
gives exactly the one-process batch, so a run can resume on a different number of hosts.

Randomness comes from NumPy's Philox counter-based generator keyed by (seed, epoch), read as raw
bits (`random_raw`), which NumPy keeps stable across versions; no distribution sampling is
involved, so every host computes the same order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

__all__ = ["BatchSampler"]

_STATE_KEYS = ("step", "seed", "seq_len", "global_batch_size", "num_tokens")


class BatchSampler(Iterator[tuple[np.ndarray, np.ndarray]]):
  """Yields `(inputs, targets)`, each int32 `[global_batch_size // process_count, seq_len]`.

  `targets[r, t]` is the token after `inputs[r, t]`: both are slices of one window of
  `seq_len + 1` consecutive tokens of `data`.

  Example (training loop with checkpoints)::

      sampler = BatchSampler(load_split("enwik8_sample", "train"), seq_len=512,
                             global_batch_size=32, seed=0,
                             process_index=jax.process_index(),
                             process_count=jax.process_count())
      sampler.load_state(restored["sampler"])      # on resume, else skip
      for inputs, targets in sampler:              # endless; epochs roll over
          ...
          save({"sampler": sampler.state(), ...})  # state() = the NEXT batch to draw

  For a staged schedule (sequence length or batch size change per stage), make one sampler
  per stage and give each stage its own seed (e.g. `seed + stage`) so stages draw different
  orders.

  Args:
    data: 1-D array of token ids (e.g. uint8 bytes from `load_split`); not copied.
    seq_len: tokens per input row.
    global_batch_size: rows per step summed over all processes.
    seed: non-negative int < 2**64 choosing shifts and orders.
    process_index: this process (e.g. `jax.process_index()`).
    process_count: number of processes sharing each global batch.
  """

  def __init__(
      self,
      data: np.ndarray,
      *,
      seq_len: int,
      global_batch_size: int,
      seed: int = 0,
      process_index: int = 0,
      process_count: int = 1,
  ):
    data = np.asarray(data)
    if data.ndim != 1:
      raise ValueError(f"data must be 1-D, got shape {data.shape}")
    if seq_len < 1 or global_batch_size < 1:
      raise ValueError(
          f"seq_len={seq_len} and global_batch_size={global_batch_size} must be >= 1"
      )
    if not 0 <= seed < 2**64:
      raise ValueError(f"seed={seed} must be in [0, 2**64)")
    if not 0 <= process_index < process_count:
      raise ValueError(f"process_index={process_index} must be in [0, {process_count})")
    if global_batch_size % process_count:
      raise ValueError(
          f"global_batch_size={global_batch_size} is not divisible by "
          f"process_count={process_count}"
      )
    num_windows = max(len(data) - seq_len, 0) // seq_len
    if num_windows < global_batch_size:
      raise ValueError(
          f"{len(data):,} tokens give {num_windows:,} windows of seq_len={seq_len} (+1), "
          f"fewer than global_batch_size={global_batch_size}"
      )
    self._data = data
    self.seq_len = seq_len
    self.global_batch_size = global_batch_size
    self.seed = seed
    self.process_index = process_index
    self.process_count = process_count
    self.num_windows = num_windows
    self.batches_per_epoch = num_windows // global_batch_size
    self.local_batch_size = global_batch_size // process_count
    self.step = 0
    self._cached_epoch: tuple[int, np.ndarray] | None = None
    self._offsets = np.arange(seq_len + 1)

  def _epoch_starts(self, epoch: int) -> np.ndarray:
    """Start positions of all windows of `epoch`, in the order the epoch serves them."""
    if self._cached_epoch is None or self._cached_epoch[0] != epoch:
      raw = np.random.Philox(key=(self.seed << 64) | epoch).random_raw(self.num_windows + 1)
      shift = int(raw[0] % np.uint64(self.seq_len))
      order = np.argsort(raw[1:], kind="stable")
      self._cached_epoch = (epoch, shift + order * self.seq_len)
    return self._cached_epoch[1]

  def global_window_starts(self, step: int) -> np.ndarray:
    """Where each window of global batch `step` starts in `data`; shape [global_batch_size]."""
    if step < 0:
      raise ValueError(f"step={step} must be >= 0")
    epoch, index = divmod(step, self.batches_per_epoch)
    first = index * self.global_batch_size
    return self._epoch_starts(epoch)[first : first + self.global_batch_size]

  def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    """This process's `(inputs, targets)` of global batch `step`; does not move `self.step`."""
    b = self.local_batch_size
    first = self.process_index * b
    starts = self.global_window_starts(step)[first : first + b]
    windows = self._data[starts[:, None] + self._offsets].astype(np.int32)
    return windows[:, :-1], windows[:, 1:]

  def __next__(self) -> tuple[np.ndarray, np.ndarray]:
    out = self.batch(self.step)
    self.step += 1
    return out

  def __iter__(self) -> BatchSampler:
    return self

  def state(self) -> dict[str, int]:
    """What a checkpoint stores: the next step, plus what fixes the stream (for checking)."""
    return {
        "step": self.step,
        "seed": self.seed,
        "seq_len": self.seq_len,
        "global_batch_size": self.global_batch_size,
        "num_tokens": len(self._data),
    }

  def load_state(self, state: Mapping[str, int | np.integer | np.ndarray]) -> None:
    """Continues from `state()` of a sampler over the same stream and settings.

    Values may come back from a checkpoint as NumPy scalars or 0-d arrays. The process
    layout may differ from the run that saved it. Raises ValueError on any other mismatch.
    """
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing:
      raise ValueError(f"sampler state lacks {missing}: got keys {sorted(state)}")
    saved = {k: int(state[k]) for k in _STATE_KEYS}
    mine = self.state()
    wrong = {k: (saved[k], mine[k]) for k in _STATE_KEYS if k != "step" and saved[k] != mine[k]}
    if wrong:
      raise ValueError(
          "sampler state is for a different stream, (saved, this sampler): "
          + ", ".join(f"{k}={v}" for k, v in wrong.items())
      )
    if saved["step"] < 0:
      raise ValueError(f"sampler state has step={saved['step']} < 0")
    self.step = saved["step"]
