"""The package's layers (docs/design.md §7): ops -> models -> data -> training -> tasks -> cli ->
commands, each importing only the layers before it, and no import cycle among modules (imports
inside functions included); `import longformer_jax` loads the library, not the training engine."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[1] / "longformer_jax"
LAYERS = ("ops", "models", "data", "training", "tasks", "cli", "commands")


def _modules() -> dict[str, pathlib.Path]:
  modules = {}
  for path in ROOT.rglob("*.py"):
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return modules


def _layer(module: str) -> str | None:
  parts = module.split(".")
  if len(parts) == 1:
    return None  # the package itself re-exports from every layer
  return parts[1] if parts[1] in LAYERS else "models"


def _imports(path: pathlib.Path, modules, top_level_only: bool) -> set[str]:
  """The package's modules `path` imports (`from a import b` counts a.b when it is a module)."""
  tree = ast.parse(path.read_text())
  nodes = tree.body if top_level_only else ast.walk(tree)
  found = set()
  for node in nodes:
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    else:
      continue
    found.update(n for n in names if n in modules)
  return found


def test_each_layer_imports_only_the_layers_before_it():
  modules = _modules()
  upward = []
  for module, path in modules.items():
    if _layer(module) is None:
      continue
    for target in _imports(path, modules, top_level_only=False):
      if _layer(target) is not None and (LAYERS.index(_layer(target))
                                         > LAYERS.index(_layer(module))):
        upward.append(f"{module} imports {target}")
  assert not upward, upward


def test_no_import_cycle_among_modules():
  """Imports inside functions count too: an import moved into a function to dodge a cycle is
  still a cycle between the two modules."""
  modules = _modules()
  graph = {m: _imports(p, modules, top_level_only=False) - {m} for m, p in modules.items()}
  # A package's __init__ importing its own submodules is how packages work, not a cycle.
  for m in graph:
    graph[m] = {t for t in graph[m] if not t.startswith(m + ".")}
  done, stack = set(), []

  def visit(m):
    if m in stack:
      pytest.fail("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
    if m in done:
      return
    stack.append(m)
    for t in sorted(graph[m]):
      visit(t)
    stack.pop()
    done.add(m)

  for m in sorted(graph):
    visit(m)


def test_importing_the_package_loads_no_training_code():
  import subprocess
  import sys
  code = ("import longformer_jax, sys; print([m for m in sys.modules if m.startswith("
          "('longformer_jax.training', 'longformer_jax.tasks', 'longformer_jax.cli', "
          "'longformer_jax.commands'))])")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True,
                       text=True, check=True).stdout
  assert out.strip() == "[]", out


def test_the_settings_layer_uses_argparse_through_its_public_api():
  """The settings layer builds its parsers from the config classes and reads only the parsed
  namespace: no argparse private attribute (they change between Python releases)."""
  private = re.compile(r"\._(actions|mutually_exclusive_groups|group_actions|option_string_"
                       r"actions|defaults)\b")
  roots = [ROOT, ROOT.parent / "train", ROOT.parent / "eval"]
  found = [f"{path}:{n}" for root in roots for path in sorted(root.rglob("*.py"))
           for n, line in enumerate(path.read_text().splitlines(), 1) if private.search(line)]
  assert not found, found
