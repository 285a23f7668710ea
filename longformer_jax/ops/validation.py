"""Argument checks for the attention op: every error names the offending value and what was
expected."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _normalise_dilation(dilation, heads: int) -> tuple[int, ...]:
  if _is_int(dilation):
    if dilation < 1:
      raise ValueError(f"dilation={dilation}: every dilation must be >= 1")
    return (int(dilation),) * heads
  if isinstance(dilation, (tuple, list)):
    if len(dilation) != heads:
      raise ValueError(f"dilation={tuple(dilation)} has {len(dilation)} entries; expected one "
                       f"per head ({heads})")
    if not all(_is_int(d) for d in dilation):
      raise TypeError(f"dilation={tuple(dilation)}: expected ints")
    dilation = tuple(int(d) for d in dilation)
  else:
    raise TypeError(f"dilation={dilation!r}: expected an int or a tuple of {heads} ints")
  if any(d < 1 for d in dilation):
    raise ValueError(f"dilation={dilation}: every dilation must be >= 1")
  return dilation


def check_arrays(**named) -> None:
  """TypeError naming the argument and its type when one is not an array (a Python list, a
  scalar): without it the error came from deep inside jax and printed the whole value."""
  for name, x in named.items():
    if not all(hasattr(x, a) for a in ("shape", "dtype", "ndim")):
      raise TypeError(f"{name} is a {type(x).__name__}; expected an "
                      "array [batch, seq, heads, head_dim] (a jax.Array or a numpy.ndarray)")


def _check_dtypes(named_arrays) -> None:
  """One rule for every implementation: q, k, v and the global projections share one floating
  dtype (no implicit promotion: the kernels take one dtype, and a silent cast would change the
  precision and memory of the caller's choice)."""
  (first, x0), *rest = named_arrays
  for name, x in named_arrays:
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} has dtype {x.dtype}; expected a floating dtype")
  for name, x in rest:
    if x.dtype != x0.dtype:
      raise TypeError(f"{name} has dtype {x.dtype} and {first} {x0.dtype}: q, k, v and the "
                      "global projections must share one floating dtype; cast them to one")


def _check_mask(name: str, mask, batch: int, seq: int):
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  if mask.shape != (batch, seq):
    raise ValueError(f"{name} has shape {mask.shape}; expected (batch, seq) = {(batch, seq)}")
  check_mask_values(name, mask)
  return mask != 0


def check_mask_values(name: str, mask) -> None:
  """ValueError naming the first value of a concrete mask that is neither 0 nor 1 (a bool mask
  always passes), with its position: 0.5, 2, -1 or NaN would count as 1, and HF's internal
  attention mask, where 2 marks a global token, would silently make that token local.

  The masks are read as `mask != 0` everywhere (the models and every implementation of the op).
  A traced mask (under jit, or a jnp value staged by an outer trace) is not checked: its values
  are unknown while tracing, and a check would need the device's answer; there a nonzero value
  counts as 1. A NumPy mask is checked on the host; a concrete jax.Array is reduced on its
  device to one bool (it may be a global array sharded over processes).
  """
  if mask is None or is_traced(mask):
    return
  if not isinstance(mask, jax.Array):
    mask = np.asarray(mask)
  if mask.dtype == bool:
    return
  found = _first_true(mask, (mask != 0) & (mask != 1))
  if found is not None:
    position, value = found
    raise ValueError(f"{name} holds {value!r} at {position}; expected 0 or 1 (or bool)")


def _first_true(values, bad):
  """(position, value) of the first element of `values` where `bad` holds, or None. A
  concrete jax.Array is reduced on its device to one bool first (it may be a global array
  sharded over processes); a NumPy array is checked on the host."""
  if isinstance(bad, jax.Array):
    if is_traced(bad) or not bool(jnp.any(bad)):
      return None
    flat = int(jnp.argmax(bad.reshape(-1)))
  else:
    if not bad.any():
      return None
    flat = int(np.argmax(bad.reshape(-1)))
  position = tuple(int(i) for i in np.unravel_index(flat, values.shape))
  return position, np.asarray(values.reshape(-1)[flat]).item()


def check_index_values(name: str, ids, size: int, table: str) -> None:
  """ValueError naming the first id of a concrete integer array outside [0, size), with its
  position and the valid range: an embedding lookup would otherwise wrap a negative id around
  to a row counted from the end (-1: the last row) and give NaN for an id >= size.

  `table` says which table the ids index ("vocab_size=50265"). As in `check_mask_values`, a
  traced array (under jit) is not checked: its values are unknown while tracing. There every
  model looks ids up with `layers.Embed`, which gives NaN embeddings for an out-of-range id,
  negative or too large (never another row), so the outputs of that row turn NaN. A NumPy array
  is checked on the host; a concrete jax.Array is reduced on its device to one bool (it may be a
  global array sharded over processes).
  """
  if ids is None or is_traced(ids):
    return
  if not isinstance(ids, jax.Array):
    ids = np.asarray(ids)
  found = _first_true(ids, (ids < 0) | (ids >= size))
  if found is not None:
    position, value = found
    raise ValueError(f"{name} holds {value!r} at position {position}; expected ids in "
                     f"[0, {size}) ({table})")


def is_traced(x) -> bool:
  """Whether `x` is a tracer (under jit / grad): its values cannot be checked in Python."""
  return isinstance(x, jax.core.Tracer)


def validate_attention_args(q, k, v, *, window, dilation, causal, attention_mask, global_mask,
                            global_qkv, max_global):
  """Checks and normalises the op's arguments.

  Returns (dilations: one int per head, attention_mask: bool [batch, seq], global_mask: bool
  [batch, seq] and-ed with attention_mask, or None when no token is global, global_qkv or None,
  num_global: static number of global slots per row). A traced global_mask with max_global=0
  comes back with num_global 0 and no global_qkv: no global attention runs, and the mask only
  says which rows exceed the bound (the op outputs NaN there).
  """
  check_arrays(q=q, k=k, v=v)
  if q.ndim != 4:
    raise ValueError(f"q has shape {q.shape}; expected [batch, seq, heads, head_dim]")
  for name, x in (("k", k), ("v", v)):
    if x.shape != q.shape:
      raise ValueError(f"{name} has shape {x.shape}; expected the shape of q, {q.shape}")
  _check_dtypes((("q", q), ("k", k), ("v", v)))
  if not _is_int(window):
    raise TypeError(f"window={window!r}: expected an int (one-sided window)")
  if window < 1:
    raise ValueError(f"window={window}: expected >= 1 (one-sided)")
  if not isinstance(causal, (bool, np.bool_)):
    raise TypeError(f"causal={causal!r}: expected a bool")
  batch, seq, heads, _ = q.shape
  dilation = _normalise_dilation(dilation, heads)
  concrete = not any(is_traced(m) for m in (attention_mask, global_mask))
  raw_masks = (attention_mask, global_mask)
  attention_mask = _check_mask("attention_mask", attention_mask, batch, seq)
  if attention_mask is None:
    attention_mask = jnp.ones((batch, seq), bool)
  global_mask = _check_mask("global_mask", global_mask, batch, seq)
  if max_global is not None and (not _is_int(max_global) or max_global < 0):
    raise ValueError(f"max_global={max_global!r}: expected an int >= 0")

  num_global = 0  # static number of global slots per row
  if global_mask is not None:
    global_mask = global_mask & attention_mask  # a padding token is never global
    if concrete:
      # Count on the host: under an outer trace even jnp ops on constants are staged.
      am, gm = (np.ones((batch, seq), bool) if m is None else np.asarray(m).astype(bool)
                for m in raw_masks)
      num_global = int((am & gm).sum(axis=1).max()) if batch else 0
      if max_global is not None and num_global > max_global:
        raise ValueError(f"global_mask has {num_global} global tokens in a row; "
                         f"max_global={max_global}")
    elif max_global is None:
      raise ValueError(
          "global_mask is traced (inside jit/vmap), so the number of global tokens is unknown "
          "when tracing; pass max_global=<static upper bound on global tokens per row>")
    else:
      num_global = max_global
    if num_global == 0 and concrete:
      global_mask = None
  if num_global:
    if causal:
      raise ValueError("causal=True with global tokens: a global token would see the future; "
                       "pass no global_mask (or an all-zero one) in causal mode")
    if global_qkv is None:
      raise ValueError("global_mask marks global tokens but global_qkv=None; pass "
                       "global_qkv=(q_g, k_g, v_g) from the global projections")
    if not isinstance(global_qkv, (tuple, list)) or len(global_qkv) != 3:
      raise ValueError(f"global_qkv must be a tuple (q_g, k_g, v_g); got {type(global_qkv)}")
    for name, x in zip(("q_g", "k_g", "v_g"), global_qkv):
      check_arrays(**{f"global_qkv {name}": x})
      if x.shape != q.shape:
        raise ValueError(f"global_qkv {name} has shape {x.shape}; expected {q.shape}")
    _check_dtypes((("q", q),) + tuple(zip(("global_qkv q_g", "global_qkv k_g", "global_qkv v_g"),
                                          global_qkv)))
  else:
    global_qkv = None
  return dilation, attention_mask, global_mask, tuple(global_qkv or ()) or None, num_global


def zero_padding(attention_mask_BxN, tree):
  """Every [batch, seq, ...] array in `tree` (None entries stay None) with its padding positions
  (attention_mask False) set to zero.

  Masking a key by its probability is not enough: a padded key gets probability exactly 0, but
  0 * NaN (or inf) is NaN in p @ V and in the scores' max and lse, and a huge finite key outweighs
  the additive mask. A select, not a multiplication, removes any value, and its gradient with
  respect to the padded positions is exactly zero.
  """
  def zero(x):
    keep = attention_mask_BxN.reshape(attention_mask_BxN.shape + (1,) * (x.ndim - 2))
    return jnp.where(keep, x, jnp.zeros((), x.dtype))
  return jax.tree.map(zero, tree)
