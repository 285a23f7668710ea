"""What is trained: one module per task, each with its data layout, model, loss, metrics and
final evaluation, on the engine of `longformer_jax.training` (the `Task` contract).

  charlm     CharLMTask: the character-level LM (paper §4), its bits-per-character evaluation
             and presets
  mlm        MLMTask: continued masked-LM pretraining (paper §5), its evaluation and presets
  finetune   FinetuneTask: classification, QA, tagging, multiple choice (paper §6), the run a
             command builds, presets; finetune_kinds: the kinds of task and their metrics
  seq2seq    Seq2SeqTask: LED on (source, target) pairs, ROUGE of generated outputs (paper §6),
             presets
  runs       a trained run's model, whatever its task (what eval.export serves)
"""

from longformer_jax.tasks.charlm import CharLMTask
from longformer_jax.tasks.coref_metrics import coref_scores
from longformer_jax.tasks.qa_metrics import hotpot_scores

__all__ = ["CharLMTask", "coref_scores", "hotpot_scores"]
