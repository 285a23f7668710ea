"""Export a trained model for serving: `jax.export` programs, weights inside, in one zip file.

    python -m eval.export --workdir runs/char_tiny --out char_tiny.zip --seq-len 1024
    python -m eval.export --workdir runs/qa --out qa.zip --batch-size 4 --seq-len 1024 4096 \\
        --max-global 64 --platform tpu
    python -m eval.export --workdir runs/led --out led.zip --seq-len 4096 --max-length 256

--workdir is a training run's directory (train.charlm, train.mlm, train.finetune,
train.seq2seq: its newest checkpoint that restores and verifies, or --step) or a model
checkpoint directory (`checkpoint.save_model`, model.json; an HF model: `convert.from_hf`, then
`save_model`). The run's model class follows its task (a fine-tuning run's head, an
MLM run's masked LM, a char-LM run's LM with its last stage's windows, a seq2seq run's LED).

The output is one zip archive (stored, not compressed) holding one serialized
`jax.export.Exported` per program and length, `<program>/<seq_len>`: "forward" for the encoder
heads and the char LM, "encode", "init_cache" and "decode_step" for LED
(`longformer_jax.export.export_led`), and manifest.json: the model, the step, every program's
inputs and outputs (name, shape, dtype). Reading it needs JAX alone:

    with zipfile.ZipFile("qa.zip") as z:
      forward = jax.export.deserialize(z.read("forward/1024"))
    out = forward.call(input_ids, attention_mask, global_attention_mask)   # int32 [B, N] each

Exit status: 0 written; 1 nothing to export (no run or checkpoint that restores, one `error:`
line); 2 a bad argument (one `error:` line).
"""

from __future__ import annotations

import dataclasses
import sys

from longformer_jax.cli import settings
from longformer_jax.commands.run import EXIT_OK, fail
from longformer_jax.tasks.trained import load_trained


@dataclasses.dataclass(frozen=True)
class ExportConfig:
  """What eval.export compiles; each field has a flag of its own (`--seq-len 1024 4096`)."""
  seq_len: tuple[int, ...] = ()
  batch_size: int = 1
  max_global: int | None = None
  num_choices: int | None = None
  platform: tuple[str, ...] | None = None
  max_length: int | None = None
  num_beams: int = 1

  def __post_init__(self):
    settings.check_bounds(self, dict(batch_size=1, max_global=0, num_choices=1, max_length=1,
                                     num_beams=1))
    for n in self.seq_len:
      if n < 1:
        raise ValueError(f"seq_len: must be >= 1, got {n}")


FLAGS = {
    "seq_len": "input length(s): one program per length (bucket)",
    "batch_size": "rows per call",
    "max_global": "global tokens per row (default: 1 for classification and LED, else "
                  "longformer_jax.export.DEFAULT_MAX_GLOBAL)",
    "num_choices": "candidates per example (multiple choice)",
    "platform": "cpu, cuda, rocm, tpu (default: this machine's backend)",
    "max_length": "LED: decoder positions of the cache (default: its position table)",
    "num_beams": "LED: decoding rows per example (beam search)",
}


def _inputs(parser):
  parser.add_argument("--workdir", required=True,
                      help="a training run or a model checkpoint directory")
  parser.add_argument("--out", required=True, help="the zip archive to write")
  settings.add_step(parser)


COMMAND = settings.Command("eval.export", __doc__, ExportConfig, FLAGS, default=ExportConfig,
                           inputs=_inputs)


def main(argv: list[str] | None = None) -> int:
  parser, parsed = settings.parse(COMMAND, argv)
  args, c = parsed.args, parsed.config
  if not c.seq_len:
    parser.error("--seq-len needed (the flag, or a setting of --config or --set)")
  if parsed.printed():
    return EXIT_OK

  from longformer_jax import export, led
  from longformer_jax.checkpoint import CheckpointError
  try:
    model, info = load_trained(args.workdir, args.step)
  except (CheckpointError, FileNotFoundError) as e:
    return fail(e)
  except ValueError as e:
    parser.error(str(e))
  name = type(model).__name__
  is_led = isinstance(model, led.LEDForConditionalGeneration)
  if not is_led:
    for flag, value in (("--max-length", c.max_length), ("--num-beams", c.num_beams > 1)):
      if value:
        parser.error(f"{flag} is for LED models; {args.workdir} holds a {name}")
  lengths = sorted(set(c.seq_len))
  platforms = c.platform
  try:
    if is_led:
      max_length = c.max_length or model.config.max_decoder_position_embeddings
      max_global = 1 if c.max_global is None else c.max_global
      exported = export.export_led(model, batch_size=c.batch_size, seq_len=lengths,
                                   max_length=max_length, max_global=max_global,
                                   num_beams=c.num_beams, platforms=platforms)
      programs = {f"{program}/{n}": getattr(exported[n], program)
                  for n in lengths for program in export.LEDPrograms._fields}
      names = {entry: export.PROGRAMS[entry.split("/")[0]] for entry in programs}
      info.update(max_length=max_length, num_beams=c.num_beams, max_global=max_global)
    else:
      exported = export.export_model(
          model, batch_size=c.batch_size, seq_len=lengths, max_global=c.max_global,
          num_choices=c.num_choices, windows=info.get("windows"), platforms=platforms)
      programs = {f"forward/{n}": exported[n] for n in lengths}
      names = dict.fromkeys(programs, export.PROGRAMS[name])
      info.update({k: v for k, v in (("max_global", c.max_global),
                                     ("num_choices", c.num_choices)) if v is not None})
  except (TypeError, ValueError) as e:
    parser.error(str(e))
  info.update(model_class=name, batch_size=c.batch_size, seq_lens=lengths)
  size = export.write_archive(args.out, programs, names, info)
  for entry, program in programs.items():
    shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in program.in_avals[:3])
    print(f"{entry}: ({shapes}{', ...' if len(program.in_avals) > 3 else ''}) for "
          f"{'/'.join(program.platforms)}")
  print(f"wrote {args.out} ({size:,} bytes; {name}, step "
        f"{info.get('step', '-')})")
  return EXIT_OK


if __name__ == "__main__":
  sys.exit(main())
