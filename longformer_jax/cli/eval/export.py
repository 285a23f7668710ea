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

import sys

from longformer_jax.cli.driver import (
    EXIT_OK, Parser, fail, nonnegative_int, positive_int, parse_settings, printed_config)
from longformer_jax.tasks.trained import load_trained


def main(argv: list[str] | None = None) -> int:
  parser = Parser("eval.export", __doc__)
  parser.add_argument("--workdir", required=True,
                      help="a training run or a model checkpoint directory")
  parser.add_argument("--out", required=True, help="the zip archive to write")
  parser.add_argument("--seq-len", type=positive_int, nargs="+", required=True,
                      help="input length(s): one program per length (bucket)")
  parser.add_argument("--batch-size", type=positive_int, default=1)
  parser.add_argument("--max-global", type=nonnegative_int, default=None,
                      help="global tokens per row (default: 1 for classification and LED, "
                           "else longformer_jax.export.DEFAULT_MAX_GLOBAL)")
  parser.add_argument("--num-choices", type=positive_int, default=None,
                      help="candidates per example (multiple choice)")
  parser.add_argument("--platform", nargs="+", default=None,
                      help="cpu, cuda, rocm, tpu (default: this machine's backend)")
  parser.add_argument("--step", type=nonnegative_int, default=None,
                      help="checkpoint step (default: latest)")
  parser.add_argument("--max-length", type=positive_int, default=None,
                      help="LED: decoder positions of the cache (default: its position table)")
  parser.add_argument("--num-beams", type=positive_int, default=1,
                      help="LED: decoding rows per example (beam search)")
  args = parse_settings(parser, argv)
  if printed_config(args):
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
    for flag, value in (("--max-length", args.max_length), ("--num-beams", args.num_beams > 1)):
      if value:
        parser.error(f"{flag} is for LED models; {args.workdir} holds a {name}")
  lengths = sorted(set(args.seq_len))
  try:
    if is_led:
      max_length = args.max_length or model.config.max_decoder_position_embeddings
      max_global = 1 if args.max_global is None else args.max_global
      exported = export.export_led(model, batch_size=args.batch_size, seq_len=lengths,
                                   max_length=max_length, max_global=max_global,
                                   num_beams=args.num_beams, platforms=args.platform)
      programs = {f"{program}/{n}": getattr(exported[n], program)
                  for n in lengths for program in export.LEDPrograms._fields}
      names = {entry: export.PROGRAMS[entry.split("/")[0]] for entry in programs}
      info.update(max_length=max_length, num_beams=args.num_beams, max_global=max_global)
    else:
      exported = export.export_model(
          model, batch_size=args.batch_size, seq_len=lengths, max_global=args.max_global,
          num_choices=args.num_choices, windows=info.get("windows"), platforms=args.platform)
      programs = {f"forward/{n}": exported[n] for n in lengths}
      names = dict.fromkeys(programs, export.PROGRAMS[name])
      info.update({k: v for k, v in (("max_global", args.max_global),
                                     ("num_choices", args.num_choices)) if v is not None})
  except (TypeError, ValueError) as e:
    parser.error(str(e))
  info.update(model_class=name, batch_size=args.batch_size, seq_lens=lengths)
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
