"""Train the character-level Longformer LM, then score the test split.

    python -m train.charlm --preset char_tiny
    python -m train.charlm --config train/configs/char_small.py --workdir gs://... \\
        --set dataset=text8 --set stages.0.batch_size=64

Settings: a preset (`--preset char_tiny|char_small|char_large`, train/configs/char_*.py) or a config
file (`--config`, whose `get_config()` returns a TrainConfig), then `--set path=value` overrides
(dots walk into dataclasses, tuples and dicts; each value is parsed to its field's type, see
`longformer_jax.training.overrides`); `--print-config` shows the result. Rerunning the same command
resumes from the newest checkpoint in the workdir that verifies (damaged ones are skipped with a
warning), and refuses to if the model, the data or the stages already trained differ from the run's
(`longformer_jax.training.identity`; `--allow-change FIELD` for an optimiser or schedule setting).
Exit status (`longformer_jax.commands.run`): 0 done; 75 stopped by SIGTERM after saving its step; 1
the run failed, or another job holds the workdir (one `error:` line); 2 a bad command line, `--set`,
`--data-file`, mesh or workdir (one line, before training). Writes <workdir>/metrics.jsonl,
tensorboard/, curves.png, checkpoints/ and results.json (the final test BPC,
`CharLMTask.final_evaluation`).

Several processes (e.g. on one machine, or hosts that JAX cannot discover by itself) run the same
command with `--distributed on --coordinator-address HOST:PORT --num-processes P --process-id I`
(I = 0..P-1; process 0 listens on PORT), or with the environment variables JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID. `--data-file` trains on any file's bytes (no dataset).
"""

from __future__ import annotations

import sys
from pathlib import Path

from longformer_jax.cli.settings import Command
from longformer_jax.commands.run import Plan, TrainCommand


def _inputs(parser):
  parser.add_argument("--data-file", default=None,
                      help="train, validate and test on this file's bytes (split 90/5/5) "
                           "instead of the config's dataset")


class CharLM(TrainCommand):

  def command(self):
    from longformer_jax.training import TrainConfig
    return Command("train.charlm", __doc__, TrainConfig, presets="train/configs/char_*",
                   inputs=_inputs)

  def default_workdir(self, parsed):
    args = parsed.args
    return Path("runs") / (Path(args.config).stem if args.config else args.preset or "charlm")

  def train_config(self, parsed, workdir):
    from longformer_jax.tasks import charlm
    charlm.check_final_eval(parsed.config)
    return parsed.config

  def plan(self, parsed, cfg, workdir):
    from longformer_jax.tasks import CharLMTask
    args = parsed.args
    if args.data_file is not None and not Path(args.data_file).is_file():
      raise FileNotFoundError(f"--data-file {args.data_file}: no such file")
    task = CharLMTask() if args.data_file is None else CharLMTask.of_file(args.data_file)
    return Plan(task, {"config": args.config, "preset": args.preset, "overrides": args.set,
                       "data_file": args.data_file})


def main(argv: list[str] | None = None) -> int:
  return CharLM().main(argv)


if __name__ == "__main__":
  sys.exit(main())
