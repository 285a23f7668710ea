"""`--set path=value` overrides of a frozen config (the training CLIs share them).

    cfg = apply_overrides(cfg, ["stages.0.steps=5", "stages.0.warmup_steps=0",
                                "model.dtype=float32", "async_checkpoints=false"])

A path walks with dots into dataclass fields, tuple indices (negative ones too) and dict keys.
Each value is parsed to the type its field declares (the dataclass annotations):

  int        a Python int literal: 3, 1_000 (not 1.5, abc or True)
  float      an int or float literal: 1, 3e-4
  bool       true/false, yes/no, 1/0 (any case)
  str        the text itself (quotes, if any, are removed)
  X | None   None, none or null; else an X
  tuple      (1, 2), [1, 2] or 1,2 (one value: a tuple of one, when any length is allowed);
             each element parsed to the element type
  dict       a dict literal
  Any        a Python literal, else the text (e.g. model.dtype=bfloat16)

All overrides are applied to a copy of the config tree first and each changed dataclass is then
constructed once, so their order does not matter and the configs' own checks see only the final
values (only an assignment to the same path, or to one that holds it, replaces an earlier one).
Every error is a ValueError (or the config's TypeError) naming the `--set` path.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import types
import typing
from collections.abc import Sequence
from typing import Any

__all__ = ["apply_overrides", "field_types", "parse_value", "type_name"]

_NONE = ("none", "null")
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def apply_overrides(cfg: Any, assignments: Sequence[str | tuple[str, str]]) -> Any:
  """A copy of the dataclass `cfg` with every `path=value` of `assignments` applied; an item may
  be a (`path=value`, label) pair, whose errors name the label (a flag: `--max-length`) instead
  of `--set path`.

  Raises:
    ValueError: for an assignment without '=', a path that names no field, index or key, or a
      value that does not parse as its field's type; and the config's own ValueError or
      TypeError (the assignments appended) when the new values fail its checks.
  """
  if not assignments:
    return cfg
  root = _Edit(cfg)
  for item in assignments:
    item, label = item if isinstance(item, tuple) else (item, None)
    path, eq, text = item.partition("=")
    if not eq:
      raise ValueError(f"--set expects path=value, got {item!r}")
    _assign(root, path.strip(), text.strip(), label or f"--set {path.strip()}")
  try:
    return _build(root)
  except (ValueError, TypeError) as e:
    if type(e) not in (ValueError, TypeError):  # a subclass may not take one message
      raise
    # A flag as it was typed: its values (joined by commas here) apart.
    given = " ".join(a[1] + " " + a[0].partition("=")[2].rstrip(",").replace(",", " ")
                     if isinstance(a, tuple) else f"--set {a}" for a in assignments)
    raise type(e)(f"{e} (with {given})") from e


def parse_value(text: str, annotation: Any, path: str = "value", label: str | None = None
                ) -> Any:
  """`text` parsed to the type `annotation` (see the module docstring); ValueError naming
  `label` (default `--set path`), the expected type and the text when it does not parse."""
  try:
    return _coerce(_literal(text), annotation, text)
  except _Mismatch as e:
    why = "" if e.value is _TOP else f" ({e.value!r} is not of type {type_name(e.annotation)})"
    raise ValueError(f"{label or f'--set {path}'}={text!r}: expected {type_name(annotation)}, got "
                     f"{text!r}{why}") from None


# ---------------------------------------------------------------------------------------------
# Walking the config: changes are collected in `_Edit` nodes, the configs are built at the end.


@dataclasses.dataclass
class _Edit:
  """A dataclass, tuple or dict being changed: the original and its changed children (field
  names, normalised indices or keys, mapped to new values or to further `_Edit`s)."""
  original: Any
  changes: dict[Any, Any] = dataclasses.field(default_factory=dict)


def _assign(root: _Edit, path: str, text: str, label: str) -> None:
  keys = path.split(".")
  node, annotation = root, Any
  for depth, head in enumerate(keys):
    where = ".".join(keys[:depth + 1])
    key, child_annotation = _child(node, head, annotation, label, where)
    if depth == len(keys) - 1:
      node.changes[key] = parse_value(text, child_annotation, path, label)
      return
    if key in node.changes:
      child = node.changes[key]
    elif isinstance(node.original, dict) and key not in node.original:
      raise ValueError(f"{label}: {where} is not a key of a dict with keys "
                       f"{list(node.original)}")
    else:
      child = _current(node.original, key)
    if not isinstance(child, _Edit):
      if child is None:
        raise ValueError(f"{label}: {where} is None, so it has nothing to set")
      if not (dataclasses.is_dataclass(child) or isinstance(child, (tuple, dict))):
        raise ValueError(f"{label}: {where}={child!r} has no fields, indices or keys")
      child = node.changes[key] = _Edit(child)
    node, annotation = child, child_annotation


def _current(obj: Any, key: Any) -> Any:
  return getattr(obj, key) if dataclasses.is_dataclass(obj) else obj[key]


def _child(node: _Edit, head: str, annotation: Any, label: str, where: str) -> tuple[Any, Any]:
  """(the key of `head` inside `node`, the annotation of that child); ValueError if none."""
  obj = node.original
  if dataclasses.is_dataclass(obj):
    hints = field_types(type(obj))
    if head not in hints:
      raise ValueError(f"{label}: unknown field {head!r} in {type(obj).__name__}; "
                       f"fields: {sorted(hints)}")
    return head, hints[head]
  if isinstance(obj, tuple):
    if not head.lstrip("-").isdigit() or not -len(obj) <= int(head) < len(obj):
      raise ValueError(f"{label}: index {head!r} is not in a tuple of length {len(obj)} "
                       f"({where})")
    index = int(head) % len(obj)
    args = typing.get_args(_arm(annotation, tuple))
    if len(args) == 2 and args[1] is Ellipsis:
      return index, args[0]
    return index, args[index] if len(args) == len(obj) else Any
  key_annotation, value_annotation = typing.get_args(_arm(annotation, dict)) or (Any, Any)
  if key_annotation is not Any:
    return parse_value(head, key_annotation, where), value_annotation
  # An unannotated key as the dict spells it: the text ('context'), else a literal (1) it holds.
  try:
    key = _literal(head)
    return (key if head not in obj and key in obj else head), value_annotation
  except TypeError:  # an unhashable literal: only the text can be a key
    return head, value_annotation


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
  """The resolved annotation of each field `__init__` takes (configs use `from __future__
  import annotations`, so `__annotations__` holds strings)."""
  hints = typing.get_type_hints(cls)
  return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


def _arm(annotation: Any, origin: type) -> Any:
  """The member of a union annotation (or the annotation itself) that is a `origin`; Any if
  none is, e.g. for an unannotated container."""
  for member in _members(annotation):
    if member is origin or typing.get_origin(member) is origin:
      return member
  return Any


def _members(annotation: Any) -> tuple[Any, ...]:
  if typing.get_origin(annotation) in (typing.Union, types.UnionType):
    return typing.get_args(annotation)
  return (annotation,)


def _build(value: Any) -> Any:
  """`value` with every `_Edit` replaced by its new object, innermost first."""
  if not isinstance(value, _Edit):
    return value
  obj, changes = value.original, {k: _build(v) for k, v in value.changes.items()}
  if dataclasses.is_dataclass(obj):
    return dataclasses.replace(obj, **changes)
  if isinstance(obj, tuple):
    return tuple(changes.get(i, item) for i, item in enumerate(obj))
  return {**obj, **changes}


# ---------------------------------------------------------------------------------------------
# Parsing a value to its annotation

_TOP = object()  # `_Mismatch.value` when the whole text failed, not an element of it


class _Mismatch(Exception):
  """`value` is not an `annotation`."""

  def __init__(self, value: Any, annotation: Any):
    super().__init__(value, annotation)
    self.value, self.annotation = value, annotation


def _literal(text: str) -> Any:
  """The Python literal `text` spells, else `text` itself."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError, TypeError, RecursionError):
    return text


def _coerce(value: Any, annotation: Any, text: str | None = None) -> Any:
  """`value` (a literal, or the text when none) as an `annotation`; `text` is the source text of
  a whole `--set` value (None for an element of one). Raises _Mismatch."""
  top = _TOP if text is not None else value
  if annotation is Any or annotation is object:
    return _tuples(value)
  members = _members(annotation)
  if len(members) > 1:  # a union: None first, then the members in their order
    if type(None) in members and (value is None or _is_none_word(value)):
      return None
    for member in members:
      if member is not type(None):
        try:
          return _coerce(value, member, text)
        except _Mismatch:
          pass
    raise _Mismatch(top, annotation)
  if annotation is type(None):
    if value is None or _is_none_word(value):
      return None
    raise _Mismatch(top, annotation)
  if annotation is bool:
    if isinstance(value, bool):
      return value
    word = str(value).lower() if isinstance(value, (str, int)) else None
    if word in _BOOLS:
      return _BOOLS[word]
    raise _Mismatch(top, annotation)
  if annotation is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    raise _Mismatch(top, annotation)
  if annotation is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
    raise _Mismatch(top, annotation)
  if annotation is str:
    if isinstance(value, str):
      return value
    if text is not None:  # e.g. dataset=123: a name, whatever it looks like
      return text
    raise _Mismatch(top, annotation)
  origin = typing.get_origin(annotation) or annotation
  if origin is tuple:
    if isinstance(value, str) and text is not None and "," in value:  # 1,2,3 of names
      value = [_literal(piece.strip()) for piece in value.split(",") if piece.strip()]
    args = typing.get_args(annotation)
    if (text is not None and not isinstance(value, (tuple, list, dict)) and len(args) == 2
        and args[1] is Ellipsis):
      value = [value]  # one value of a tuple of any length: length_buckets=512
    if not isinstance(value, (tuple, list)):
      raise _Mismatch(top, annotation)
    args = typing.get_args(annotation)
    if len(args) == 2 and args[1] is Ellipsis:
      args = (args[0],) * len(value)
    elif not args:
      args = (Any,) * len(value)
    elif len(args) != len(value):
      raise _Mismatch(top, annotation)
    return tuple(_coerce(v, a) for v, a in zip(value, args))
  if origin is dict:
    if not isinstance(value, dict):
      raise _Mismatch(top, annotation)
    key_annotation, value_annotation = typing.get_args(annotation) or (Any, Any)
    return {_coerce(k, key_annotation): _coerce(v, value_annotation) for k, v in value.items()}
  # Any other class (e.g. a Stage): only an instance of it, which text cannot spell.
  if isinstance(origin, type) and isinstance(value, origin):
    return value
  raise _Mismatch(top, annotation)


def _is_none_word(value: Any) -> bool:
  return isinstance(value, str) and value.lower() in _NONE


def _tuples(value: Any) -> Any:
  """Lists (at any depth) as tuples: the frozen configs hold tuples."""
  if isinstance(value, (list, tuple)):
    return tuple(_tuples(v) for v in value)
  if isinstance(value, dict):
    return {k: _tuples(v) for k, v in value.items()}
  return value


def type_name(annotation: Any) -> str:
  """`annotation` as it is written in the config classes: int, float | None, tuple[int, ...]."""
  if annotation is Any:
    return "Any"
  if annotation is type(None):
    return "None"
  members = _members(annotation)
  if len(members) > 1:
    return " | ".join(type_name(m) for m in members)
  args = typing.get_args(annotation)
  origin = typing.get_origin(annotation)
  if origin is not None and args:
    inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
    return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
  return getattr(annotation, "__name__", str(annotation))
