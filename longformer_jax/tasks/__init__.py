"""What is trained: one module per task, each with its data layout, model, loss, metrics and
final evaluation, on the engine of `longformer_jax.training` (the `Task` contract).

  charlm     CharLMTask: the character-level LM (paper §4), its bits-per-character evaluation
             and its configs (char_tiny, char_small, char_large)
  mlm        MLMTask: continued masked-LM pretraining (paper §5), its evaluation and configs
  finetune   FinetuneTask: classification, QA, tagging, multiple choice, WikiHop (paper §6), the
             run a command builds; finetune_kinds: the kinds of task and their metrics;
             finetune_segments: the segment baseline; truncation: what a length limit cut
  seq2seq    Seq2SeqTask: LED on (source, target) pairs, ROUGE of generated outputs (paper §6)
  runs       what kind of run a workdir holds; trained: a trained run's model (eval.export)
"""

from longformer_jax.tasks.charlm import CharLMTask
from longformer_jax.tasks.coref_metrics import coref_scores
from longformer_jax.tasks.qa_metrics import hotpot_scores

__all__ = ["CharLMTask", "coref_scores", "hotpot_scores"]
