"""seq2seq_tiny: the `tiny` LED (fresh weights) on short pairs, CPU-sized: the toy recipe
docs/seq2seq.md measures (sources of 12 tokens, targets of 10, 300 steps of 16 pairs at learning
rate 3e-3: ROUGE near 1.0 on a copy task of a few words). --tokenizer and the files come from the
command line:

    python -m train.seq2seq --preset seq2seq_tiny --tokenizer tok.json --train train.jsonl
"""

from longformer_jax.commands.train_seq2seq import Seq2SeqConfig


def get_config() -> Seq2SeqConfig:
  return Seq2SeqConfig(model="tiny", max_source_length=12, max_target_length=10, steps=300,
                       batch_size=16, learning_rate=3e-3)
