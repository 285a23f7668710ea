"""Sample text from a trained char-LM run.

    python -m eval.sample --workdir runs/char_tiny --prompt "<page><title>"
    python -m eval.sample --workdir runs/char_tiny --prompt "The " --max-new-tokens 500 \\
        --temperature 0.8 --top-k 40 --top-p 0.95 --seed 3
    python -m eval.sample --workdir runs/char_tiny --prompt "The " --temperature 0   # greedy

The model comes from <workdir>/run_config.json (written by train.charlm) and samples with the
final stage's attention windows of the settings saved with the checkpoint, as eval.bpc
scores; only the checkpoint's parameters are read, checked against their checksums (without
--step the newest checkpoint that verifies; a damaged one is skipped with a one-line warning).
The prompt's UTF-8 bytes are the token ids (the char LM's vocabulary is the 256 byte values; bytes
of the command line that are not UTF-8 are taken as they are); the output is the prompt followed by
the sampled bytes, decoded as UTF-8 (a byte sequence that is not valid UTF-8 prints as U+FFFD), on
stdout, and a line of timing (new bytes per second, compilation excluded) on stderr. Exit status: 0
done; 1 no checkpoint that restores and verifies, or no run in --workdir (one `error:` line); 2 a
bad argument, or a run of another kind in --workdir (one `error:` line), checked before sampling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time

from longformer_jax.cli import settings
from longformer_jax.commands.run import EXIT_OK, fail


@dataclasses.dataclass(frozen=True)
class SampleConfig:
  """How eval.sample samples; each field has a flag of its own (`--top-k`). The sampling
  settings are checked by `generation.SamplingConfig`."""
  max_new_tokens: int = 200
  temperature: float = 1.0
  top_k: int | None = None
  top_p: float | None = None
  seed: int = 0

  def __post_init__(self):
    if self.max_new_tokens < 0:
      raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")


FLAGS = {"max_new_tokens": "bytes to sample", "temperature": "0: greedy",
         "top_k": "sample among the k likeliest", "top_p": "nucleus sampling, in (0, 1]",
         "seed": "the sampling's seed"}


def _inputs(parser):
  parser.add_argument("--workdir", required=True, help="the training run's directory")
  parser.add_argument("--prompt", required=True, help="text to continue (at least one byte)")
  settings.add_step(parser)


COMMAND = settings.Command("eval.sample", __doc__, SampleConfig, FLAGS, default=SampleConfig,
                           inputs=_inputs)


def main(argv: list[str] | None = None) -> int:
  parser, parsed = settings.parse(COMMAND, argv)
  args, c = parsed.args, parsed.config
  if parsed.printed():
    return EXIT_OK

  import jax
  import numpy as np
  from longformer_jax.checkpoint import CheckpointError
  from longformer_jax.generation import SamplingConfig
  from longformer_jax.tasks.charlm import restore_run
  from longformer_jax.training import make_mesh
  try:
    # Checked before the checkpoint is read. A command line's bytes that are not UTF-8 come
    # back as they were given (Python holds them as escapes): the model reads bytes.
    prompt = args.prompt.encode("utf-8", "surrogateescape")
    SamplingConfig(c.temperature, c.top_k, c.top_p)
  except UnicodeEncodeError as e:
    parser.error(f"--prompt holds {args.prompt[e.start]!a} at character {e.start}, a lone "
                 f"surrogate: not text, and no byte")
  except ValueError as e:
    parser.error(str(e))
  try:
    # One device: sampling one sequence has nothing to split.
    model, step, windows = restore_run(args.workdir, step=args.step,
                                       mesh=make_mesh((1, 1), jax.devices()[:1]))
  except (CheckpointError, FileNotFoundError) as e:
    return fail(e)
  except ValueError as e:  # a run of another kind
    parser.error(str(e))
  start = time.perf_counter()
  with _compile_seconds() as compiling:
    try:
      tokens = model.generate(np.frombuffer(prompt, np.uint8), c.max_new_tokens,
                              temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
                              seed=c.seed, windows=windows)
    except ValueError as e:
      # Raised by the checks of the prompt and the sampling settings, before any compute.
      parser.error(str(e))
    tokens = jax.block_until_ready(tokens)
  total = time.perf_counter() - start
  sampled = bytes(np.asarray(tokens, np.uint8))
  print((prompt + sampled).decode("utf-8", errors="replace"))
  running = max(total - compiling[0], 1e-9)
  print(f"step {step}: {len(sampled)} bytes in {running:.2f} s, {len(sampled) / running:,.0f} "
        f"bytes/s (prompt {len(prompt)} bytes; compiling took {compiling[0]:.1f} s more)",
        file=sys.stderr)
  return 0


@contextlib.contextmanager
def _compile_seconds():
  """A one-item list that holds, on exit, the seconds JAX spent tracing, lowering and compiling
  inside the block (its monitoring events), so that the speed reported is the sampling's."""
  events = ("/jax/core/compile/jaxpr_trace_duration",
            "/jax/core/compile/jaxpr_to_mlir_module_duration",
            "/jax/core/compile/backend_compile_duration")
  seconds = [0.0]

  def listen(event: str, duration: float, **_):
    if event in events:
      seconds[0] += duration

  import jax
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield seconds
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


if __name__ == "__main__":
  sys.exit(main())
