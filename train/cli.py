"""What every entry point's command line shares: the exit status of a preempted run, config
files, the flags of a multi-process run and argument types that name a bad value."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

# Exit status after SIGTERM once the step is saved (sysexits' EX_TEMPFAIL: "try again later").
EXIT_PREEMPTED = 75


def load_config(path: str):
  """`get_config()` of a config file, imported by path."""
  spec = importlib.util.spec_from_file_location(f"charlm_config_{Path(path).stem}", path)
  if spec is None or spec.loader is None:
    raise ValueError(f"cannot import a config from {path!r}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
  """--distributed and the three values `training.maybe_initialize_distributed` passes on."""
  parser.add_argument("--distributed", default="auto", choices=("auto", "on", "off"),
                      help="jax.distributed.initialize(): 'on' in every process of a "
                           "multi-process run; 'auto' does it when the arguments or the "
                           "environment name a cluster")
  parser.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                      help="process 0's address (default: $JAX_COORDINATOR_ADDRESS; found "
                           "automatically on TPU slices, SLURM and Open MPI)")
  parser.add_argument("--num-processes", type=int, default=None,
                      help="processes in the run (default: $JAX_NUM_PROCESSES or detected)")
  parser.add_argument("--process-id", type=int, default=None,
                      help="this process, 0..num_processes-1 (default: $JAX_PROCESS_ID or "
                           "detected)")


def initialize_distributed(args: argparse.Namespace) -> None:
  """`training.maybe_initialize_distributed` with the flags of `add_distributed_args`."""
  from longformer_jax import training
  training.maybe_initialize_distributed(
      args.distributed, coordinator_address=args.coordinator_address,
      num_processes=args.num_processes, process_id=args.process_id)


def positive_int(text: str) -> int:
  """An argparse type: an int >= 1."""
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def positive_float(text: str) -> float:
  """An argparse type: a float > 0 (not nan)."""
  value = float(text)
  if not value > 0:
    raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
  return value
