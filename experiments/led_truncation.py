"""The paper's LED claim (§6) at CPU scale: reading the whole long input beats reading BART's
first 1K tokens when the target draws on the whole input.

The paper makes LED from BART by copying BART's 1K learned encoder positions over 16K (the
positions of `convert.bart_to_led`), so that it reads inputs far past BART's 1,024 positions,
and reports on arXiv summarisation (Table 11) that LED reading 4K or 16K tokens beats reading
1K, while the other models read 1K. Here the same comparison with nothing but the input length
changed, scaled down for a CPU: a small BART with 128 encoder positions (standing for BART's
1,024) is made an LED reading 1,024 tokens (8x, as 1K -> 8K), and the SAME LED is fine-tuned two
ways:

  led_full      the whole source (up to `long_len` tokens);
  bart_limit    only the source's first `bart_positions` tokens (BART's limit, truncated as HF
                truncates: the text is cut, `</s>` kept).

The task is built from real text, the bundled Wikipedia sample (`corpora.sample_xml`, 106
articles after dropping redirects): the article text is stripped of markup and cut into
paragraphs; a source is a run of consecutive paragraphs filling up to `long_len` tokens, and its
target is the first sentence (at most `target_words` words) of EVERY paragraph of the source, in
order. So the target draws evenly on the whole source, and a model that reads only its first
128 tokens sees the first one or two paragraphs of about eight. Articles are split between
training and evaluation (every fifth article is held out), so no held-out text was trained on.

Both arms start from the same LED (`bart_to_led` of one randomly initialised BART per seed: a
BART pretrained on a corpus would not fit this CPU), train for the same steps on the same pairs in
the same order (`tasks.seq2seq.Seq2SeqTask`, the library's `Trainer`), with the same global token
(the first), and are scored on the same held-out pairs with greedy decoding and ROUGE-1/2/L
(`tasks.seq2seq.rouge`, stemmed F-measures). The metric of an arm is ROUGE-1; ROUGE-2 and
ROUGE-L are stored and compared too. The claims are checked against the detectable difference of
the seeds (experiments/study.py).

Sizes (`--device`): cpu (default): BART 128 positions -> LED 1,024 tokens, one-sided window 64,
d_model 64, 2 + 2 layers, a 2,048-id BPE, 500 steps of 8 pairs, 3 seeds (38 min measured on 2
cores shared at a load of about 10); gpu: BART 512 -> LED 4,096 (window 256), d_model 256,
3 + 3 layers, 3,000 steps of 16; --tiny: seconds, for the tests.

    python experiments/led_truncation.py                  # cpu size, seeds 0 1 2
    python experiments/led_truncation.py --device gpu --seeds 0 1 2 3 4

Writes experiments/results/led_truncation.json ({"study", "metric", "arms": {name: {"seeds",
"values", "mean", "std", "rouge1", "rouge2", "rougeL", "source_tokens", ...}}, "comparisons",
"rouge_comparisons", "detectable_difference", "setup", "paper", "verdict"}) and
led_truncation.png.
"""

from __future__ import annotations

import html
import itertools
import json
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import study as study_lib  # experiments/study.py

STUDY = "led_truncation"
ARMS = ("led_full", "bart_limit")
CLAIMS = (("led_full", "bart_limit"),)
ROUGE = ("rouge1", "rouge2", "rougeL")
PAPER_SOURCE = ("Beltagy, Peters, Cohan 2020 (arXiv 2004.05150v2) §6, Table 11: arXiv "
                "summarisation test ROUGE-1/2/L of LED-large reading 4K and 16K "
                "tokens; its Figure 3 shows ROUGE rising with the input length (1K, 4K, 16K)")
PAPER = {"led_large_4k": {"rouge1": 44.40, "rouge2": 17.94, "rougeL": 39.76},
         "led_large_16k": {"rouge1": 46.63, "rouge2": 19.62, "rougeL": 41.83},
         "unit": "ROUGE F-measure (%), arXiv test set", "source": PAPER_SOURCE}

PRESETS = {
    "cpu": dict(vocab=2048, d_model=64, layers=2, heads=4, ffn=256, bart_positions=128,
                long_len=1024, window=64, target_len=128, target_words=10, min_paragraphs=3,
                steps=500, batch=8, lr=2e-3, eval_pairs=48, eval_batch=16),
    "gpu": dict(vocab=8192, d_model=256, layers=3, heads=4, ffn=1024, bart_positions=512,
                long_len=4096, window=256, target_len=512, target_words=16, min_paragraphs=3,
                steps=3000, batch=16, lr=5e-4, eval_pairs=128, eval_batch=32),
    "tiny": dict(vocab=300, d_model=16, layers=1, heads=2, ffn=32, bart_positions=16,
                 long_len=64, window=8, target_len=16, target_words=4, min_paragraphs=1,
                 steps=3, batch=4, lr=2e-3, eval_pairs=4, eval_batch=4, max_articles=10),
}


# ----------------------------------------------------------------------------------------------
# The data: paragraphs of the bundled Wikipedia sample


def _strip_markup(text: str) -> str:
  """MediaWiki text with references, comments, templates, tables, files and categories removed
  and links reduced to their shown text (enough for prose paragraphs; not a full parser)."""
  text = html.unescape(text)
  text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
  text = re.sub(r"<ref[^>]*/>", " ", text)
  text = re.sub(r"<ref[^>]*>.*?</ref>", " ", text, flags=re.S)
  previous = None
  while previous != text:  # innermost first: templates and links nest
    previous = text
    text = re.sub(r"\{\{[^{}]*\}\}", " ", text)
    text = re.sub(r"\{\|[^{}]*?\|\}", " ", text, flags=re.S)
    text = re.sub(r"\[\[(?:File|Image|Category):[^\[\]]*\]\]", " ", text)
    text = re.sub(r"\[\[[^\[\]|]*\|([^\[\]]*)\]\]", r"\1", text)
    text = re.sub(r"\[\[([^\[\]]*)\]\]", r"\1", text)
  text = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", text)
  text = re.sub(r"<[^>]+>", " ", text)
  return text.replace("'''", "").replace("''", "")


def articles(xml: bytes) -> list[list[str]]:
  """The prose paragraphs (lines of at least 20 words that are not headings, lists or tables) of
  every article of a MediaWiki export that is not a redirect, in order."""
  out = []
  for page in re.findall(r"<page>(.*?)</page>", xml.decode("utf-8", "replace"), re.S):
    body = re.search(r"<text[^>]*>(.*?)</text>", page, re.S)
    if not body or body.group(1).lstrip().upper().startswith("#REDIRECT"):
      continue
    lines = (" ".join(line.split()) for line in _strip_markup(body.group(1)).split("\n"))
    paragraphs = [p for p in lines if len(p.split()) >= 20 and p[0] not in "=*#:;|!{}["]
    if paragraphs:
      out.append(paragraphs)
  return out


def first_sentence(paragraph: str, max_words: int) -> str:
  """The paragraph up to its first full stop followed by a space, at most `max_words` words."""
  end = paragraph.find(". ")
  sentence = paragraph if end < 0 else paragraph[:end + 1]
  return " ".join(sentence.split()[:max_words])


def make_pairs(paragraphs: list[str], tokenizer, p: dict) -> list[dict]:
  """{"source", "target"} pairs of one article: runs of consecutive paragraphs filling at most
  `long_len - 2` tokens (a paragraph longer than that stands alone, cut when encoded), each with
  the first sentences of all its paragraphs as the target; runs of fewer than `min_paragraphs`
  paragraphs are dropped."""
  budget = p["long_len"] - 2  # <s> and </s>
  lengths = [len(e.ids) + 1 for e in tokenizer.encode_batch(paragraphs, add_special_tokens=False)]
  pairs, run, used = [], [], 0
  for paragraph, n in zip(paragraphs + [None], lengths + [budget + 1]):
    if run and used + n > budget:
      if len(run) >= p["min_paragraphs"]:
        pairs.append({"source": " ".join(run),
                      "target": " ".join(first_sentence(x, p["target_words"]) for x in run)})
      run, used = [], 0
    if paragraph is not None:
      run.append(paragraph)
      used += n
  return pairs


def build_data(p: dict, workdir: Path) -> dict:
  """The tokenizer (a byte-level BPE of `vocab` ids trained on the training articles, with
  BART's `<s> ... </s>` around every text) and the JSONL files of the pairs: train.jsonl and
  eval.jsonl (every fifth article, at most `eval_pairs` pairs, the articles' first pairs first).
  `max_articles` (the tiny size's): only the first articles."""
  from tokenizers import processors
  from longformer_jax.data import corpora, tokenized
  docs = articles(corpora.sample_xml())[:p.get("max_articles")]
  held_out = [d for i, d in enumerate(docs) if i % 5 == 4]
  training = [d for i, d in enumerate(docs) if i % 5 != 4]
  tokenizer = tokenized.train_bpe((x for d in training for x in d), p["vocab"])
  tokenizer.post_processor = processors.TemplateProcessing(
      single="<s> $A </s>", special_tokens=[("<s>", tokenizer.token_to_id("<s>")),
                                            ("</s>", tokenizer.token_to_id("</s>"))])
  # Held-out pairs taken from the held-out articles in turn (round robin), so that one long
  # article does not fill the evaluation.
  per_article = [make_pairs(d, tokenizer, p) for d in held_out]
  rounds = itertools.zip_longest(*per_article)
  splits = {"train": [x for d in training for x in make_pairs(d, tokenizer, p)],
            "eval": [x for r in rounds for x in r if x is not None][:p["eval_pairs"]]}
  files = {}
  for name, pairs in splits.items():
    files[name] = workdir / f"{name}.jsonl"
    files[name].write_text("".join(json.dumps(x) + "\n" for x in pairs))
  return {"tokenizer": tokenizer, "files": files, "articles": len(docs),
          "held_out_articles": len(held_out), "pairs": {k: len(v) for k, v in splits.items()}}


# ----------------------------------------------------------------------------------------------
# The models and the runs


def source_length(p: dict, arm: str) -> int:
  """What the arm reads: the LED's whole input, or BART's positions."""
  return p["long_len"] if arm == "led_full" else p["bart_positions"]


def initial_led(p: dict, tokenizer, seed: int):
  """The seed's LED: a BART of `bart_positions` encoder positions, randomly initialised (torch
  seeded), made long by `convert.bart_to_led` (positions copied up to `long_len`, global
  projections copied from the local ones, one-sided window `window`)."""
  import torch
  import transformers
  from longformer_jax import convert
  ids = {t: tokenizer.token_to_id(t) for t in ("<s>", "<pad>", "</s>")}
  torch.manual_seed(seed)
  bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
      vocab_size=tokenizer.get_vocab_size(), d_model=p["d_model"], encoder_layers=p["layers"],
      decoder_layers=p["layers"], encoder_attention_heads=p["heads"],
      decoder_attention_heads=p["heads"], encoder_ffn_dim=p["ffn"], decoder_ffn_dim=p["ffn"],
      max_position_embeddings=p["bart_positions"], dropout=0.0,
      attention_dropout=0.0, activation_dropout=0.0, pad_token_id=ids["<pad>"],
      bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], decoder_start_token_id=ids["</s>"],
      forced_eos_token_id=None, scale_embedding=False))
  return convert.bart_to_led(bart.eval(), max_positions=p["long_len"], window=p["window"])


def train_and_score(p: dict, arm: str, seed: int, led, data: dict, log) -> dict:
  """Fine-tunes `led` (its parameters) on the arm's inputs for `steps` steps, then generates the
  held-out targets greedily and scores them. Returns {"rouge1", "rouge2", "rougeL",
  "losses", "predictions", "seconds"}."""
  from flax import nnx
  from longformer_jax.tasks import seq2seq
  from longformer_jax.training import Stage, TrainConfig, Trainer
  n = source_length(p, arm)
  eos = data["tokenizer"].token_to_id("</s>")
  splits = {name: seq2seq.read_pairs(path, data["tokenizer"], max_source_length=n,
                                     max_target_length=p["target_len"], eos_token_id=eos)
            for name, path in data["files"].items()}
  task = seq2seq.Seq2SeqTask(splits["train"], tokenizer=data["tokenizer"])
  cfg = TrainConfig(
      model=led.config, dataset="enwiki_sample", seed=seed,
      stages=(Stage(seq_len=n, batch_size=p["batch"], steps=p["steps"], learning_rate=p["lr"],
                    warmup_steps=max(p["steps"] // 10, 1), end_learning_rate=0.0,
                    decay_power=1.0),),
      weight_decay=0.01, adam_b2=0.98, adam_eps=1e-6)
  tick = time.perf_counter()
  trainer = Trainer(cfg, task=task)
  state, losses = trainer.fit(trainer.init_state(nnx.state(led, nnx.Param)))
  model = trainer.model(state.params)
  predictions = seq2seq.generate_split(
      model, splits["eval"], data["tokenizer"], global_attention=task.global_attention,
      batch_size=p["eval_batch"], max_new_tokens=p["target_len"] - 1)
  scores = seq2seq.rouge(predictions, splits["eval"].references)
  seconds = time.perf_counter() - tick
  log(f"{arm} seed {seed}: loss {np.mean(losses[-20:]):.3f} (last 20 steps), " + ", ".join(
      f"{k} {v:.4f}" for k, v in scores.items()) + f" ({seconds:.0f} s)")
  return {**scores, "losses": [round(float(x), 4) for x in losses],
          "predictions": predictions[:3], "seconds": seconds,
          "source_tokens": float(np.mean([len(s) for s in splits["eval"].sources]))}


# ----------------------------------------------------------------------------------------------
# Summaries, verdict, plot


def summarize_study(study: dict) -> dict:
  """The comparisons on ROUGE-1 (the metric) and on each ROUGE type, the detectable
  differences and the verdict, from the per-seed values."""
  study_lib.summarize_claims(study, CLAIMS, higher_is_better=True)
  study["rouge_comparisons"] = {
      kind: study_lib.compare({name: study_lib.summarize(arm["seeds"], arm[kind])
                               for name, arm in study["arms"].items()}, CLAIMS,
                              higher_is_better=True)[0]
      for kind in ROUGE}
  full, short = (study["arms"][a] for a in ARMS)
  setup = study["setup"]
  parts = [f"{kind}: {np.mean(full[kind]):.4f} vs {np.mean(short[kind]):.4f}, "
           f"{c['difference']:+.4f} (detectable {c['detectable_difference']:.4f}): "
           f"{c['outcome']}" for kind, c in study["rouge_comparisons"].items()]
  head = {"agree": "Reading the whole input beats reading BART's limit, as the paper says",
          "disagree": "Reading only BART's limit beats reading the whole input: the opposite of "
                      "the paper"}.get(study["comparisons"][0]["outcome"],
                                       "Whether reading the whole input helps is not resolved at "
                                       "this scale")
  study["verdict"] = (
      f"{head}. LED reading {setup['long_len']} tokens vs the same LED reading the first "
      f"{setup['bart_positions']} (BART's positions, standing for 1K): " + "; ".join(parts)
      + f". Scale: a {setup['d_model']}-wide model from a random BART, {setup['steps']} steps, "
      f"against the paper's pretrained BART-base on arXiv, so only the sign compares. "
      f"Rule: {study_lib.RULE}.")
  return study


def plot(study: dict, path: Path) -> None:
  """ROUGE-1/2/L per arm: bars (mean ± sd over seeds) and every seed as a dot; and the training
  loss of each arm (mean over seeds)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  arms, setup = study["arms"], study["setup"]
  colors = {"led_full": "tab:blue", "bart_limit": "tab:red"}
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
  width = 0.38
  for j, (name, arm) in enumerate(arms.items()):
    for i, kind in enumerate(ROUGE):
      x = i + (j - 0.5) * width
      left.bar(x, np.mean(arm[kind]), width, yerr=np.std(arm[kind], ddof=1),
               color=colors[name], alpha=0.5, capsize=4, label=name if i == 0 else None)
      left.scatter(x + np.linspace(-0.08, 0.08, len(arm[kind])), arm[kind], color=colors[name],
                   edgecolor="black", s=18, zorder=3)
  left.set_xticks(range(len(ROUGE)), [k.upper().replace("ROUGE", "ROUGE-") for k in ROUGE])
  left.set_ylabel("held-out ROUGE F-measure")
  left.set_title(f"LED reading {setup['long_len']} vs {setup['bart_positions']} tokens "
                 f"({len(setup['seeds'])} seeds)", fontsize=10)
  left.legend(fontsize=8)
  left.grid(axis="y", alpha=0.3)
  for name, losses in study["train_losses"].items():
    curve = np.mean([np.asarray(v) for v in losses.values()], axis=0)
    right.plot(np.arange(1, len(curve) + 1), curve, color=colors[name], label=name)
  right.set_xlabel("step")
  right.set_ylabel("training cross-entropy (nats per target token)")
  right.set_title("training (mean over seeds)", fontsize=10)
  right.legend(fontsize=8)
  right.grid(alpha=0.3)
  fig.tight_layout()
  study_lib.harness.write_png(path, fig, dpi=110)


# ----------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None):
  """The arguments and the size preset (a dict). Raises study.ArgumentError on anything bad."""
  args, p = study_lib.parse_preset(__doc__, STUDY, argv, PRESETS)
  # The decoder keeps BART's positions: the targets must fit in them.
  assert p["target_len"] <= p["bart_positions"] < p["long_len"], p
  return args, p


def run(args, p: dict, log, start: float) -> dict:
  import jax
  with tempfile.TemporaryDirectory() as tmp:
    data = build_data(p, Path(tmp))
    log(f"{data['articles']} articles ({data['held_out_articles']} held out): "
        f"{data['pairs']['train']} training and {data['pairs']['eval']} held-out pairs")
    results = {arm: [] for arm in ARMS}
    for seed in args.seeds:
      led = initial_led(p, data["tokenizer"], seed)
      for arm in ARMS:
        results[arm].append(train_and_score(p, arm, seed, led, data, log))
    references = [json.loads(line)["target"]
                  for line in data["files"]["eval"].read_text().splitlines()[:3]]
  arms = {arm: {**study_lib.summarize(args.seeds, [r["rouge1"] for r in rs]),
                **{kind: [r[kind] for r in rs] for kind in ROUGE},
                "source_tokens": rs[0]["source_tokens"],
                "seconds": [round(r["seconds"], 1) for r in rs],
                "example_predictions": rs[0]["predictions"]}
          for arm, rs in results.items()}
  seconds = round(time.perf_counter() - start, 1)
  return {
      "study": STUDY,
      "metric": (f"ROUGE-1 F-measure (tasks.seq2seq.rouge, stemmed) of greedy outputs on "
                 f"{data['pairs']['eval']} held-out pairs (articles never trained on); ROUGE-2 "
                 f"and ROUGE-L per seed beside it"),
      "arms": arms,
      "paper": PAPER,
      "setup": {**p, "size": args.size_name, "device": args.device, "seeds": list(args.seeds),
                "data": "the bundled Wikipedia sample (corpora.sample_xml), markup stripped, "
                        "prose paragraphs; source: consecutive paragraphs up to long_len "
                        "tokens; target: the first sentence (<= target_words words) of each",
                "articles": data["articles"], "held_out_articles": data["held_out_articles"],
                "pairs": data["pairs"], "example_references": references,
                "scale": f"BART positions {p['bart_positions']} (standing for BART's 1,024) -> "
                         f"LED {p['long_len']} tokens (the paper: 1,024 -> 16,384)",
                "start": "one random BART per seed made long by convert.bart_to_led; both arms "
                         "fine-tune that same LED on the same pairs in the same order",
                "seconds": seconds, "minutes": round(seconds / 60, 1),
                "devices": str(jax.devices()), **study_lib.harness.stamp()},
      "train_losses": {arm: {str(s): r["losses"] for s, r in zip(args.seeds, rs)}
                       for arm, rs in results.items()},
      "seconds": seconds,
  }


def main(argv: Sequence[str] | None = None) -> int:
  args, p = parse_args(argv)
  study = study_lib.run_or_replot(args, STUDY, lambda log, start: run(args, p, log, start),
                                  summarize_study, plot)
  print(study["verdict"])
  return 0


if __name__ == "__main__":
  sys.exit(study_lib.cli(main))
