"""Exported programs for serving: the models as `jax.export.Exported`, weights inside.

    exported = export.export_model(model, batch_size=8, seq_len=4096)
    blob = exported.serialize()                       # bytes; needs the `flatbuffers` package
    # Anywhere with JAX alone (no longformer_jax, no flax):
    outputs = jax.export.deserialize(blob).call(input_ids, attention_mask, global_attention_mask)

An exported program is the model's forward for one input shape, in eval mode (dropout off), with
every weight closed over as a constant: calling it needs nothing NNX-specific, only JAX. Inputs
and outputs are plain arrays, tuples and dicts (`PROGRAMS` names them per model class):

  encoder heads   (input_ids, attention_mask, global_attention_mask), int32 [B, N] each
                  ([B, C, N] for multiple choice); every mask is an input (1 = real / global)
  char LM         (input_ids,), int32 [B, N]
  outputs         a dict named like the model's output fields: {"logits": ...}; question
                  answering {"start_logits", "end_logits"}; `LongformerModel`
                  {"last_hidden_state"} (and "pooler_output" when it pools)

Shapes are static: `seq_len` given as a list exports one program per length (a bucket), as a
dict {length: Exported}; pad each request to the smallest bucket that holds it with the pad
token and `attention_mask` 0 (its real positions then give the unpadded outputs). `max_global`
bounds the global tokens per row: a traced mask cannot be counted, so the program has
`max_global` global slots; a row with more global tokens comes back as NaN, never silently
truncated (docs/design.md §1.4). The default is 1 for sequence classification (<s>),
`DEFAULT_MAX_GLOBAL` (at most the length) for the other encoder heads.

LED (`export_led`): three programs per length: `encode`, `init_cache` (the cross-attention keys
and values, once) and `decode_step` (new tokens + cache -> logits + the updated cache), the
cache a dict of arrays (`cache_to_tree`).

Kernels follow the export platform (`platforms`, default the default backend): exported for
("tpu",) from a CPU host, `attention_impl="pallas"` or "auto" keep the Mosaic TPU kernel (a
custom call with JAX's compatibility guarantee). The Triton GPU kernel has none, so jax.export
refuses it: for "cuda"/"rocm" (or several platforms at once) "auto" exports the chunked path and
"pallas" raises ValueError. `write_archive` / `read_archive` keep a set of programs in one file.

An exported program, and so an archive, is code by design: calling it runs its compiled program
on your devices (custom calls such as the Mosaic kernel included). Unlike a checkpoint (data,
docs/checkpoints.md), load archives only from people you trust. `read_archive` checks that the
file is a zip whose manifest.json is JSON naming its programs, reads each from inside the archive
(nothing is extracted) and has `jax.export.deserialize` check the serialization format and
version; it does not check what a program computes.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from longformer_jax import causal_lm, led, modeling
from longformer_jax.io import atomic_write
from longformer_jax.ops.attention import target_platform

__all__ = ["DEFAULT_MAX_GLOBAL", "PLATFORMS", "PROGRAMS", "LEDPrograms", "cache_from_tree",
           "cache_to_tree", "describe", "export_led", "export_model", "read_archive",
           "write_archive"]

# Global slots of the encoder heads that set no single default token (<s>): questions and
# candidate lists of the paper's tasks are shorter. Pass max_global for more.
DEFAULT_MAX_GLOBAL = 64

# jax.export's platform names.
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
_GPU_PLATFORMS = ("cuda", "rocm")

_ENCODER_INPUTS = ("input_ids", "attention_mask", "global_attention_mask")

# The argument names of every exported program, in call order (the archive manifest and
# `describe` use them).
PROGRAMS: dict[str, tuple[str, ...]] = {
    **{name: _ENCODER_INPUTS for name in modeling.MODEL_CLASSES},
    "LongformerForCausalLM": ("input_ids",),
    "encode": _ENCODER_INPUTS,
    "init_cache": ("encoder_hidden_states", "attention_mask"),
    "decode_step": ("decoder_input_ids", "cache"),
}


class LEDPrograms(NamedTuple):
  """The exported programs of one LED input length (`export_led`)."""
  encode: jax.export.Exported       # ids, mask, global mask -> {"last_hidden_state": [B, N, E]}
  init_cache: jax.export.Exported   # encoder states [B, N, E], mask [B, N] -> cache
  decode_step: jax.export.Exported  # ids [R, 1], cache -> {"logits": [R, 1, V], "cache": cache}


# ----------------------------------------------------------------------------------------------
# Argument checks and the model copy that is exported.


def _check_int(name: str, value, minimum: int = 1) -> int:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
  return int(value)


def _lengths(seq_len) -> tuple[list[int], bool]:
  """(the lengths, whether one was given as a plain int)."""
  if isinstance(seq_len, (int, np.integer)) and not isinstance(seq_len, bool):
    return [_check_int("seq_len", seq_len)], True
  if not isinstance(seq_len, Sequence) or isinstance(seq_len, str) or not seq_len:
    raise ValueError(f"seq_len must be an int or a non-empty list of ints, got {seq_len!r}")
  lengths = [_check_int("seq_len", n) for n in seq_len]
  if len(set(lengths)) != len(lengths):
    raise ValueError(f"seq_len lists a length twice: {list(seq_len)}")
  return sorted(lengths), False


def _platforms(platforms) -> tuple[str, ...]:
  if platforms is None:
    return (jax.export.default_export_platform(),)
  if isinstance(platforms, str):
    platforms = (platforms,)
  platforms = tuple(platforms)
  bad = [p for p in platforms if p not in PLATFORMS]
  if not platforms or bad:
    raise ValueError(f"platforms={platforms!r}: expected a non-empty tuple of {PLATFORMS} "
                     f"(jax.export's names; 'cuda', not 'gpu')")
  return platforms


def _attention_impl(config, platforms: tuple[str, ...]) -> str:
  """The attention implementation to trace for `platforms`. A Pallas kernel is specific to one
  platform, and only the TPU's (Mosaic) has jax.export's compatibility guarantee: the Triton GPU
  kernel's custom call is refused by jax.export."""
  impl = config.attention_impl
  if len(platforms) == 1 and platforms[0] not in _GPU_PLATFORMS:
    return impl
  if impl == "pallas":
    if len(platforms) > 1:
      raise ValueError(f"attention_impl='pallas' cannot be exported for several platforms "
                       f"{platforms}: a Pallas kernel is compiled for one; export per platform "
                       f"or use attention_impl='chunked'")
    raise ValueError(
        f"attention_impl='pallas' cannot be exported for {platforms[0]!r}: the GPU kernel is a "
        f"Triton custom call without jax.export's compatibility guarantee, which jax.export "
        f"refuses to serialize; use attention_impl='chunked' (or 'auto', which exports the "
        f"chunked path there)")
  return "chunked" if impl == "auto" else impl


def _inference_copy(model: nnx.Module, platforms: tuple[str, ...]) -> nnx.Module:
  """The model rebuilt for one device (no mesh: a model built for a mesh runs its attention in
  `shard_map` over that mesh's devices), with the attention implementation the platforms take,
  the model's weights (gathered to the host) and dropout off. The model itself is not changed."""
  config = model.config
  impl = _attention_impl(config, platforms)
  if impl != config.attention_impl:
    config = dataclasses.replace(config, attention_impl=impl)
  init_kwargs = getattr(model, "init_kwargs", {})
  abstract = nnx.eval_shape(lambda: type(model)(config, rngs=nnx.Rngs(0), **init_kwargs))
  graphdef, _ = nnx.split(abstract)

  def to_host(x):
    # Key arrays (dropout streams, never read in eval mode) have no numpy form.
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return x
    return np.asarray(x)

  copy = nnx.merge(graphdef, jax.tree.map(to_host, nnx.state(model)))
  copy.eval()
  return copy


def _export(fn, platforms: tuple[str, ...], *args) -> jax.export.Exported:
  """jax.export of a fresh closure `fn` (fresh: jax's trace cache must not hand back a trace
  made for another platform), with the attention kernels chosen for a single platform."""
  export = jax.export.export(jax.jit(fn), platforms=platforms)
  if len(platforms) == 1:
    with target_platform(platforms[0]):
      return export(*args)
  return export(*args)


def _int_spec(*shape: int) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, jnp.int32)


# ----------------------------------------------------------------------------------------------
# Encoder heads and the char LM.


def _outputs(model: nnx.Module, out) -> dict[str, jax.Array]:
  if isinstance(model, modeling.LongformerModel):
    names = ("last_hidden_state",) + (("pooler_output",) if model.pooler is not None else ())
  elif isinstance(model, modeling.LongformerForQuestionAnswering):
    names = ("start_logits", "end_logits")
  else:
    names = ("logits",)
  return {name: getattr(out, name) for name in names}


def export_model(model: nnx.Module, *, batch_size: int, seq_len: int | Sequence[int],
                 max_global: int | None = None, num_choices: int | None = None,
                 windows: Sequence[int] | None = None,
                 platforms: Sequence[str] | None = None):
  """The forward of an encoder head (`modeling.MODEL_CLASSES`) or of the char LM, exported.

  Args:
    model: the model; it is not changed (a copy in eval mode, for one device, is exported).
    batch_size: B; seq_len: N, or a list of lengths (buckets: one program each).
    max_global: encoder heads: the global slots per row (static). Default: 1 for sequence
      classification, `DEFAULT_MAX_GLOBAL` (at most N) for the others. A row whose
      global_attention_mask marks more tokens outputs NaN.
    num_choices: C, multiple choice only (its inputs are [B, C, N]).
    windows: char LM only: per-layer one-sided windows of the call (default: the config's; a
      trained run's last stage has its own).
    platforms: jax.export platforms ("cpu", "cuda", "rocm", "tpu"); default the default
      backend. The attention kernel follows them (module docstring).

  Returns a `jax.export.Exported` (a dict {length: Exported} when seq_len is a list) whose call
  takes the arguments `PROGRAMS[type(model).__name__]` names (int32) and returns a dict of
  arrays (module docstring).
  """
  name = type(model).__name__
  is_lm = isinstance(model, causal_lm.LongformerForCausalLM)
  if type(model) in led.MODEL_CLASSES.values():
    raise TypeError(f"{name}: export LED models with export_led (encoder and decoding step)")
  if not is_lm and modeling.MODEL_CLASSES.get(name) is not type(model):
    raise TypeError(f"cannot export a {name}: expected one of "
                    f"{sorted(modeling.MODEL_CLASSES) + ['LongformerForCausalLM']}")
  batch_size = _check_int("batch_size", batch_size)
  lengths, single = _lengths(seq_len)
  platforms = _platforms(platforms)
  is_choice = isinstance(model, modeling.LongformerForMultipleChoice)
  if is_choice:
    if num_choices is None:
      raise ValueError("LongformerForMultipleChoice takes [batch, choices, seq] inputs: give "
                       "num_choices")
    num_choices = _check_int("num_choices", num_choices)
  elif num_choices is not None:
    raise ValueError(f"num_choices={num_choices!r} is for LongformerForMultipleChoice, not {name}")
  if is_lm:
    if max_global is not None:
      raise ValueError(f"max_global={max_global!r}: the causal LM has no global tokens")
    windows = None if windows is None else tuple(windows)
  elif windows is not None:
    raise ValueError(f"windows={windows!r} is for LongformerForCausalLM, not {name}")
  elif max_global is not None:
    max_global = _check_int("max_global", max_global, 0)
  copy = _inference_copy(model, platforms)

  def one(n: int) -> jax.export.Exported:
    if is_lm:
      return _export(lambda ids: {"logits": copy(ids, windows=windows)}, platforms,
                     _int_spec(batch_size, n))
    slots = max_global
    if slots is None:
      slots = (1 if isinstance(model, modeling.LongformerForSequenceClassification)
               else min(DEFAULT_MAX_GLOBAL, n))
    shape = (batch_size, num_choices, n) if is_choice else (batch_size, n)

    def forward(input_ids, attention_mask, global_attention_mask):
      return _outputs(copy, copy(input_ids, attention_mask, global_attention_mask,
                                 max_global=slots))

    return _export(forward, platforms, *[_int_spec(*shape)] * 3)

  programs = {n: one(n) for n in lengths}
  return programs[lengths[0]] if single else programs


# ----------------------------------------------------------------------------------------------
# LED.


def cache_to_tree(cache: led.LEDDecoderCache) -> dict[str, Any]:
  """An `LEDDecoderCache` as plain containers (what the exported decoding programs take and
  return): {"layers": ({"self_key", "self_value", "cross_key", "cross_value"}, ...),
  "encoder_mask": bool [B, N], "index": int32 []}."""
  layers = tuple({"self_key": l.self_key, "self_value": l.self_value,
                  "cross_key": l.cross_key, "cross_value": l.cross_value} for l in cache.layers)
  return {"layers": layers, "encoder_mask": cache.encoder_mask, "index": cache.index}


def cache_from_tree(tree: Mapping[str, Any]) -> led.LEDDecoderCache:
  """`cache_to_tree`'s inverse."""
  layers = tuple(led.LEDLayerCache(l["self_key"], l["self_value"], l["cross_key"],
                                   l["cross_value"]) for l in tree["layers"])
  return led.LEDDecoderCache(layers=layers, encoder_mask=tree["encoder_mask"],
                             index=tree["index"])


def export_led(model: led.LEDForConditionalGeneration, *, batch_size: int,
               seq_len: int | Sequence[int], max_length: int, max_global: int = 1,
               num_beams: int = 1, platforms: Sequence[str] | None = None):
  """LED's encoder and one decoding step, exported (`LEDPrograms`; a dict {length:
  LEDPrograms} when seq_len is a list).

    encode(input_ids, attention_mask, global_attention_mask)   int32 [B, N] each
        -> {"last_hidden_state": [B, N, E]}
    init_cache(encoder_hidden_states [B, N, E], attention_mask int32 [B, N]) -> cache
    decode_step(decoder_input_ids int32 [R, 1], cache) -> {"logits": [R, 1, V], "cache": cache}

  what `encode`, `init_cache(max_length=, num_beams=)` and `decode_step` of the model compute.
  The cache is `cache_to_tree`'s dict: its self-attention slots hold max_length decoder
  positions for R = batch_size * num_beams rows (beam k of item b is row b * K + k; a beam
  search reorders the rows of every "self_key" / "self_value" itself), its "index" is the
  position of the next token. max_global: the encoder's global slots per row (default 1: the
  first token, as `generate` puts it); a row with more global tokens gives NaN.
  platforms: as in `export_model`.
  """
  if not isinstance(model, led.LEDForConditionalGeneration):
    raise TypeError(f"export_led exports LEDForConditionalGeneration (its decoding step "
                    f"returns logits), got {type(model).__name__}")
  batch_size = _check_int("batch_size", batch_size)
  lengths, single = _lengths(seq_len)
  max_length = _check_int("max_length", max_length)
  max_global = _check_int("max_global", max_global, 0)
  num_beams = _check_int("num_beams", num_beams)
  platforms = _platforms(platforms)
  copy = _inference_copy(model, platforms)

  def encode(input_ids, attention_mask, global_attention_mask):
    out = copy.encode(input_ids, attention_mask, global_attention_mask, max_global=max_global)
    return {"last_hidden_state": out.last_hidden_state}

  def init_cache(encoder_hidden_states, attention_mask):
    return cache_to_tree(copy.init_cache(encoder_hidden_states, attention_mask,
                                         max_length=max_length, num_beams=num_beams))

  def decode_step(decoder_input_ids, cache):
    logits, cache = copy.decode_step(decoder_input_ids, cache_from_tree(cache))
    return {"logits": logits, "cache": cache_to_tree(cache)}

  def one(n: int) -> LEDPrograms:
    ids = _int_spec(batch_size, n)
    encoded = _export(encode, platforms, ids, ids, ids)
    states = encoded.out_avals[0]
    states = jax.ShapeDtypeStruct(states.shape, states.dtype)
    cache_maker = _export(init_cache, platforms, states, ids)
    cache = jax.tree.unflatten(cache_maker.out_tree, [
        jax.ShapeDtypeStruct(a.shape, a.dtype) for a in cache_maker.out_avals])
    step = _export(decode_step, platforms, _int_spec(batch_size * num_beams, 1), cache)
    return LEDPrograms(encoded, cache_maker, step)

  programs = {n: one(n) for n in lengths}
  return programs[lengths[0]] if single else programs


# ----------------------------------------------------------------------------------------------
# Files.


def _aval(aval) -> dict[str, Any]:
  return {"shape": list(aval.shape), "dtype": jnp.dtype(aval.dtype).name}


def describe(exported: jax.export.Exported, names: Sequence[str]) -> dict[str, Any]:
  """JSON of a program's interface: its inputs (named by `names`, in call order) and outputs,
  each leaf with its pytree path, shape and dtype, and its platforms."""
  args = jax.tree.unflatten(exported.in_tree, list(exported.in_avals))[0]
  if len(args) != len(names):
    raise ValueError(f"{len(names)} names {tuple(names)} for a program of {len(args)} arguments")

  def leaves(prefix: str, tree) -> list[dict[str, Any]]:
    return [{"name": prefix + jax.tree_util.keystr(path), **_aval(a)}
            for path, a in jax.tree_util.tree_leaves_with_path(tree)]

  outputs = jax.tree.unflatten(exported.out_tree, list(exported.out_avals))
  return {"inputs": [leaf for name, arg in zip(names, args) for leaf in leaves(name, arg)],
          "outputs": leaves("", outputs), "platforms": list(exported.platforms)}


ARCHIVE_MANIFEST = "manifest.json"


def write_archive(path: str | os.PathLike, programs: Mapping[str, jax.export.Exported],
                  names: Mapping[str, Sequence[str]], info: Mapping[str, Any] | None = None
                  ) -> int:
  """Writes `programs` ({entry name: Exported}) serialized into one zip file at `path`
  (atomically), with a manifest.json: `info` plus, per entry, `describe(exported,
  names[entry])`. Read it with `read_archive`, or with JAX alone:

      with zipfile.ZipFile(path) as z:
        program = jax.export.deserialize(z.read(entry))

  Returns the size of the file in bytes.
  """
  manifest = {"format": 1, "jax_version": jax.__version__, **dict(info or {}), "programs": {}}
  buffer = io.BytesIO()
  # Stored, not compressed: the constants (weights) hardly compress and a reader can map them.
  with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
    for entry, exported in programs.items():
      if entry == ARCHIVE_MANIFEST:
        raise ValueError(f"{entry!r} is the manifest's name; name the program otherwise")
      archive.writestr(entry, bytes(exported.serialize()))
      manifest["programs"][entry] = describe(exported, names[entry])
    archive.writestr(ARCHIVE_MANIFEST, json.dumps(manifest, indent=2) + "\n")
  atomic_write(path, buffer.getvalue())
  return buffer.tell()


def read_archive(path: str | os.PathLike) -> tuple[dict[str, jax.export.Exported], dict]:
  """({entry name: Exported}, manifest) of a `write_archive` file: programs, to be loaded only
  from people you trust (module docstring)."""
  with epath.Path(path).open("rb") as f, zipfile.ZipFile(f) as archive:
    manifest = json.loads(archive.read(ARCHIVE_MANIFEST))
    programs = {entry: jax.export.deserialize(bytearray(archive.read(entry)))
                for entry in manifest["programs"]}
  return programs, manifest
