"""Shared test set-up: deterministic, CPU-only JAX (set JAX_PLATFORMS=cuda or tpu to run the
compiled-kernel test classes on an accelerator), the `GRID` parametrization hook, and the check
that every test names its tier.

Tiers (markers registered in pyproject.toml): each test module sets a module-level `pytestmark`
with one of `unit`, `kernels`, `integration`, `tpu`, `gpu`, plus `slow` where it is too costly
for the edit loop; a class or test may add marks of its own. The fast tier is
`-m "not integration and not slow"` (`./run.sh fast`); the full suite is everything.

Optimisation level: every program the tests compile, here and in the command lines they start,
is compiled at XLA's cheaper level (`JAX_DISABLE_MOST_OPTIMIZATIONS=1`): the models are tiny, so
compiling dominates, and the cheaper level compiles in about a third of the time. The parity,
resume and sharding tests compare two computations under the same level. What pins the numbers
users get runs at XLA's default level: tests marked `golden` (values recorded at that level) and
the `tpu` tier (memory per chip of TPU programs)."""

import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache for the whole run, set in the environment so that the
# command lines the tests start (training, evaluation, export in subprocesses) read and write it
# too: the CLI tests run the same tiny programs many times, and a warm cache halves each run.
# Every program is cached (no minimum compile time or size). Keyed by jax version, flags and
# program, so a cache left by an earlier run on the same machine is safe to reuse.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(__file__).resolve().parents[1] / ".cache" / "jax-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# XLA's cheaper optimisation level (module docstring), inherited by the tests' subprocesses.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax
import pytest

import testing


TIERS = ("unit", "kernels", "integration", "tpu", "gpu")


def pytest_collection_modifyitems(config, items):
  """Refuses a run in which a test names no tier: a module without its `pytestmark` would
  otherwise fall silently into (or out of) the fast tier."""
  untiered = sorted({item.nodeid.split("::")[0] for item in items
                     if not any(item.get_closest_marker(tier) for tier in TIERS)})
  if untiered:
    raise pytest.UsageError(f"test modules without a tier mark (one of {', '.join(TIERS)}; "
                            f"tests/conftest.py): {', '.join(untiered)}")
  # The costly tiers first (a stable sort keeps each module's and class's tests together):
  # with --no-loadscope-reorder (run.sh) xdist hands out modules in this order, so the long
  # ones start early instead of keeping one worker busy after the other has finished.
  items.sort(key=lambda item: 0 if item.get_closest_marker("integration") else
             1 if item.get_closest_marker("slow") else 2)


@pytest.fixture(scope="session")
def charlm_run(tmp_path_factory) -> testing.CharLMRun:
  """The tiny char-LM run the session shares (`testing.CharLMRun`; read only: copy to change)."""
  directory = testing.shared_run(tmp_path_factory, "charlm_run", testing.make_charlm_run)
  run = testing.charlm_run_files(directory)
  from longformer_jax import checkpoint
  assert tuple(checkpoint.checkpoint_steps(run.workdir)) == run.checkpoints
  return run


def pytest_generate_tests(metafunc):
  """A test class's `GRID` attribute parametrizes its `grid_case` argument (testing.py)."""
  testing.parametrize_grid(metafunc)


@pytest.fixture(autouse=True)
def _optimisation_level(request):
  """XLA's default optimisation level for `golden` tests and the `tpu` tier (module
  docstring); every other test keeps the run's setting."""
  if not (request.node.get_closest_marker("golden") or request.node.get_closest_marker("tpu")):
    yield
    return
  # The flag is not part of JAX's in-memory cache keys: programs (eager ones too) compiled by
  # earlier tests at the other level would be reused, so the caches are cleared at each switch.
  # (The persistent cache keys hold the level: recompiling reads the right programs back.)
  old = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  jax.clear_caches()
  yield
  jax.config.update("jax_disable_most_optimizations", old)
  jax.clear_caches()
