"""The paper's LED claim (§6) at CPU scale: reading the whole long input beats reading BART's
first 1K tokens when the target draws on the whole input.

The paper makes LED from BART by copying BART's 1K learned encoder positions over 16K (the
positions of `convert.bart_to_led`), so that it reads inputs far past BART's 1,024 positions,
and reports on arXiv summarisation (Table 11) that LED reading 4K or 16K tokens beats reading
1K. Here the same comparison with nothing but the input length changed, scaled down for a CPU:
a small BART with 64 positions (standing for BART's 1,024) is made an LED reading 512 tokens
(8x, as 1K -> 8K), and the SAME LED is fine-tuned and scored two ways:

  led_full      the whole source (up to `long_len` tokens);
  bart_limit    only the source's first `bart_positions` tokens (BART's limit, truncated as HF
                truncates: the text is cut, `</s>` kept).

The task is built from real text, the bundled Wikipedia sample (`corpora.sample_xml`, 100
articles after dropping redirects and pages without prose): the article text is stripped of
markup and cut into paragraphs; a source is a run of consecutive paragraphs of one article,
joined by newlines, filling up to `long_len` tokens (3.5 paragraphs on average at the cpu size);
its target is the OPENING (first `target_words` words) of every paragraph of the source, in
order, joined by newlines. A learnable extractive task (find each newline, copy the words after
it) whose evidence is spread over the whole source. Articles are split between training and
evaluation (every fifth article is held out), so no held-out text was trained on; training runs
start at every paragraph (overlapping), held-out runs follow one another.

Why the design is not rigged: both arms have the same model, the same steps on the same pairs in
the same order, and the same target; only the input is cut. `bart_limit` loses exactly what lies
beyond its limit, which is the paper's claim. How much that is is a property of the data,
computed and stored before anything is trained ("data_properties": the fraction of target words
that lie within the first `bart_positions` tokens, 0.30 at the cpu size), and the truncated arm
may still guess the rest from what it learned of paragraph openings in general (most begin "The"
or "In the"). The floor is stored too: the best of several outputs that ignore the source
(ROUGE-1 0.30 at the cpu size, chosen on the held-out references themselves), so a reader sees
whether the models learned anything; and one held-out example with both arms' outputs.

Both arms start from the same LED per seed: one BART per seed (HF, initialised with `init_std`
about 1/sqrt(d_model): BART's 0.02, set for 768 wide, leaves a 64-wide model on a plateau that
no copying is learned from in 1,000 steps), pretrained briefly as BART is (token masking: 15% of
the tokens masked, the text reconstructed) on chunks of the training articles that fit its 64
positions, then made long by `convert.bart_to_led`. In the pilots, the LED fine-tuned from a
random BART of init_std 0.02 without pretraining generated "There is" for every input (400
steps), and with init_std 0.1 and 600 pretraining steps it copied openings of held-out
paragraphs (ROUGE-1 0.38 after 400 fine-tuning steps). The fine-tuning is
`tasks.seq2seq.Seq2SeqTask` with the library's `Trainer`, the first token global; outputs are
generated greedily and scored with ROUGE-1/2/L (`tasks.seq2seq.rouge`, stemmed F-measures). The
metric of an arm is ROUGE-1; ROUGE-2 and ROUGE-L are stored and compared too. The claims are
checked against the detectable difference of the seeds (experiments/study.py).

Sizes (`--device`): cpu (default): BART 64 positions -> LED 512 tokens, one-sided window 32,
d_model 64, 2 + 2 layers, a 2,048-id BPE, 1,000 pretraining steps of 8 chunks, 1,000
fine-tuning steps of 8 pairs, 48 held-out pairs, 3 seeds: 14.9 minutes measured on 2 cores
shared with other jobs (load average 4.2 at the start, 1.7 at the end; the time and loads of a
run are in the JSON's setup); gpu: BART 512 -> LED 4,096 (window 256),
d_model 256, 3 + 3 layers, 4,000 + 3,000 steps (not run); --tiny: a minute, for the tests.

    python experiments/led_truncation.py                  # cpu size, seeds 0 1 2
    python experiments/led_truncation.py --device gpu --seeds 0 1 2 3 4

Writes experiments/results/led_truncation.json ({"study", "metric", "arms": {name: {"seeds",
"values", "mean", "std", "rouge1", "rouge2", "rougeL", "source_tokens", ...}}, "comparisons",
"rouge_comparisons", "detectable_difference", "data_properties", "example", "setup", "paper",
"verdict"}) and led_truncation.png.
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
    "cpu": dict(vocab=2048, d_model=64, layers=2, heads=2, ffn=256, init_std=0.1,
                bart_positions=64, long_len=512, window=32, target_len=48, target_words=3,
                min_paragraphs=3, pretrain_steps=1000, pretrain_batch=8, pretrain_lr=2e-3,
                pretrain_mask=0.15, steps=1000, batch=8, lr=2e-3, eval_pairs=48, eval_batch=16),
    "gpu": dict(vocab=8192, d_model=256, layers=3, heads=4, ffn=1024, init_std=0.05,
                bart_positions=512, long_len=4096, window=256, target_len=256, target_words=3,
                min_paragraphs=3, pretrain_steps=4000, pretrain_batch=32, pretrain_lr=1e-3,
                pretrain_mask=0.15, steps=3000, batch=16, lr=5e-4, eval_pairs=128,
                eval_batch=32),
    "tiny": dict(vocab=300, d_model=16, layers=1, heads=2, ffn=32, init_std=0.1,
                 bart_positions=16, long_len=64, window=8, target_len=16, target_words=2,
                 min_paragraphs=1, pretrain_steps=2, pretrain_batch=4, pretrain_lr=2e-3,
                 pretrain_mask=0.15, steps=3, batch=4, lr=2e-3, eval_pairs=4, eval_batch=4,
                 max_articles=10),
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


PARAGRAPH_SEP = "\n"  # between the paragraphs of a source and between the openings of a target


def opening(paragraph: str, words: int) -> str:
  """The paragraph's first `words` words."""
  return " ".join(paragraph.split()[:words])


def make_pairs(paragraphs: list[str], tokenizer, p: dict, *, every_start: bool = False
               ) -> list[dict]:
  """{"source", "target"} pairs of one article: runs of consecutive paragraphs (joined by
  PARAGRAPH_SEP) filling at most `long_len - 2` tokens, each with the openings (`target_words`
  words) of all its paragraphs as the target, joined by PARAGRAPH_SEP; runs of fewer than
  `min_paragraphs` paragraphs are dropped (a paragraph longer than the budget stands alone). The
  runs follow one another (each paragraph in one run), or with `every_start` one run starts at
  every paragraph (overlapping runs: more training pairs from the same articles)."""
  budget = p["long_len"] - 2  # <s> and </s>
  lengths = [len(e.ids) + 1 for e in tokenizer.encode_batch(paragraphs, add_special_tokens=False)]
  pairs, start = [], 0
  while start < len(paragraphs):
    end, used = start, 0
    while end < len(paragraphs) and used + lengths[end] <= budget:
      used += lengths[end]
      end += 1
    end = max(end, start + 1)  # a paragraph over the budget stands alone, cut when encoded
    run = paragraphs[start:end]
    if len(run) >= p["min_paragraphs"]:
      pairs.append({"source": PARAGRAPH_SEP.join(run),
                    "target": PARAGRAPH_SEP.join(opening(x, p["target_words"]) for x in run)})
    start = start + 1 if every_start else end
  return pairs


def evidence_within_limit(pair: dict, tokenizer, bart_positions: int) -> float:
  """The fraction of the pair's target words that lie within the source's first
  `bart_positions` tokens (what `bart_limit` reads: `<s>`, `bart_positions - 2` tokens of text,
  `</s>`): the most of the target that reading only BART's limit can copy from the source. A
  property of the data: the rest a truncated reader can only guess."""
  ids = tokenizer.encode(pair["source"], add_special_tokens=False)
  kept = ids.offsets[:bart_positions - 2]
  visible_chars = kept[-1][1] if kept else 0
  seen = total = 0
  start = 0  # each paragraph's first character in the source
  for paragraph, target in zip(pair["source"].split(PARAGRAPH_SEP),
                               pair["target"].split(PARAGRAPH_SEP), strict=True):
    words = target.split()
    # articles() keeps single spaces, so the opening is the paragraph's prefix, word by word.
    ends = [start + len(" ".join(words[:i + 1])) for i in range(len(words))]
    seen += sum(end <= visible_chars for end in ends)
    total += len(words)
    start += len(paragraph) + len(PARAGRAPH_SEP)
  return seen / total


def constant_baselines(train: list[dict], references: list[str]) -> dict:
  """ROUGE-1/2/L of the best output that ignores the source: among the most frequent training
  target, the most frequent openings repeated 1-8 times, and the most frequent target words
  (the top 1-12), the one with the highest held-out ROUGE-1 (chosen on the held-out references
  themselves, so an upper bound for these constants). Returns {"output", "rouge1", "rouge2",
  "rougeL", "candidates"}."""
  from collections import Counter
  from longformer_jax.tasks import seq2seq
  openings = Counter(o for x in train for o in x["target"].split(PARAGRAPH_SEP))
  words = Counter(w for x in train for w in x["target"].split())
  candidates = [Counter(x["target"] for x in train).most_common(1)[0][0]]
  candidates += [PARAGRAPH_SEP.join([o] * n) for o, _ in openings.most_common(3)
                 for n in range(1, 9)]
  candidates += [" ".join(w for w, _ in words.most_common(n)) for n in range(1, 13)]
  scored = [(seq2seq.rouge([c] * len(references), references), c) for c in candidates]
  scores, best = max(scored, key=lambda x: x[0]["rouge1"])
  return {"output": best, **scores, "candidates": len(candidates)}


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
  splits = {"train": [x for d in training for x in make_pairs(d, tokenizer, p, every_start=True)],
            "eval": [x for r in rounds for x in r if x is not None][:p["eval_pairs"]]}
  files = {}
  for name, pairs in splits.items():
    files[name] = workdir / f"{name}.jsonl"
    files[name].write_text("".join(json.dumps(x) + "\n" for x in pairs))
  return {"tokenizer": tokenizer, "files": files, "articles": len(docs),
          "held_out_articles": len(held_out), "pairs": {k: len(v) for k, v in splits.items()},
          "training_texts": [PARAGRAPH_SEP.join(d) for d in training]}


# ----------------------------------------------------------------------------------------------
# The models and the runs


def source_length(p: dict, arm: str) -> int:
  """What the arm reads: the LED's whole input, or BART's positions."""
  return p["long_len"] if arm == "led_full" else p["bart_positions"]


def denoising_chunks(texts: list[str], tokenizer, length: int) -> np.ndarray:
  """int32 [C, length]: every training article's tokens (no special tokens) cut into chunks of
  `length` tokens (an article's last, shorter piece dropped)."""
  chunks = []
  for e in tokenizer.encode_batch(texts, add_special_tokens=False):
    ids = np.asarray(e.ids, np.int32)
    chunks += [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]
  return np.stack(chunks)


def mask_tokens(chunk: np.ndarray, mask_id: int, rate: float, rng: np.random.Generator
                ) -> np.ndarray:
  """BART's token masking: each token replaced by `mask_id` with probability `rate` (the length
  kept, so the output is the input read in place except at the masks)."""
  return np.where(rng.random(len(chunk)) < rate, mask_id, chunk).astype(np.int64)


def initial_bart(p: dict, tokenizer, seed: int):
  """The seed's BART (HF, torch): `bart_positions` encoder and decoder positions, randomly
  initialised (torch seeded)."""
  import torch
  import transformers
  ids = {t: tokenizer.token_to_id(t) for t in ("<s>", "<pad>", "</s>")}
  torch.manual_seed(seed)
  return transformers.BartForConditionalGeneration(transformers.BartConfig(
      vocab_size=tokenizer.get_vocab_size(), d_model=p["d_model"], encoder_layers=p["layers"],
      decoder_layers=p["layers"], encoder_attention_heads=p["heads"],
      decoder_attention_heads=p["heads"], encoder_ffn_dim=p["ffn"], decoder_ffn_dim=p["ffn"],
      max_position_embeddings=p["bart_positions"], dropout=0.0, init_std=p.get("init_std", 0.02),
      attention_dropout=0.0, activation_dropout=0.0, pad_token_id=ids["<pad>"],
      bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], decoder_start_token_id=ids["</s>"],
      forced_eos_token_id=None, scale_embedding=False))


def pretrain_bart(bart, p: dict, data: dict, seed: int, log) -> dict:
  """BART's pretraining, short: `pretrain_steps` steps of token masking (`mask_tokens`, rate
  `pretrain_mask`) on chunks of the training articles that fit BART's positions, batches of
  `pretrain_batch`, AdamW at `pretrain_lr` (linear warmup and decay). Trains `bart` in place;
  returns {"losses", "seconds"}."""
  import torch
  tick = time.perf_counter()
  tokenizer = data["tokenizer"]
  bos, eos, mask = (tokenizer.token_to_id(t) for t in ("<s>", "</s>", "<mask>"))
  chunks = denoising_chunks(data["training_texts"], tokenizer, p["bart_positions"] - 2)
  rng = np.random.default_rng(seed)
  steps = p["pretrain_steps"]
  optimizer = torch.optim.AdamW(bart.parameters(), lr=p["pretrain_lr"], weight_decay=0.01,
                                betas=(0.9, 0.98), eps=1e-6)
  warmup = max(steps // 10, 1)
  schedule = torch.optim.lr_scheduler.LambdaLR(
      optimizer, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(steps - warmup, 1))))
  bart.train()
  losses = []
  for _ in range(steps):
    rows_CxL = chunks[rng.choice(len(chunks), p["pretrain_batch"], replace=False)]
    ends = (np.full((len(rows_CxL), 1), bos), np.full((len(rows_CxL), 1), eos))
    # Token masking keeps the length: every row is <s> chunk </s>, no padding.
    noisy = np.stack([mask_tokens(c, mask, p["pretrain_mask"], rng) for c in rows_CxL])
    input_ids = torch.from_numpy(np.concatenate([ends[0], noisy, ends[1]], axis=1))
    labels = torch.from_numpy(np.concatenate([ends[0], rows_CxL, ends[1]], axis=1)
                              .astype(np.int64))
    loss = bart(input_ids=input_ids, labels=labels).loss
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(bart.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    losses.append(float(loss.detach()))
  seconds = time.perf_counter() - tick
  log(f"BART seed {seed}: {steps} pretraining steps, loss {np.mean(losses[-20:]):.3f} (last 20 "
      f"steps, from {np.mean(losses[:5]):.3f}) ({seconds:.0f} s)")
  return {"losses": [round(x, 4) for x in losses], "seconds": seconds}


def initial_led(p: dict, data: dict, seed: int, log=lambda text: None):
  """The seed's LED and its BART's pretraining record: `initial_bart`, pretrained by
  `pretrain_bart` when `pretrain_steps` > 0, made long by `convert.bart_to_led` (positions
  copied up to `long_len`, global projections copied from the local ones, one-sided window
  `window`)."""
  import torch
  from longformer_jax import convert
  bart = initial_bart(p, data["tokenizer"], seed)
  record = {"losses": [], "seconds": 0.0}
  if p.get("pretrain_steps"):
    # One thread: this small model's steps gain nothing from a second, and torch's threads
    # spin against any other process on 2 cores (measured: 0.2 s a step on one, 3-5 s on two).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
      record = pretrain_bart(bart, p, data, seed, log)
    finally:
      torch.set_num_threads(threads)
  return convert.bart_to_led(bart.eval(), max_positions=p["long_len"], window=p["window"]), record


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
  facts = study.get("data_properties", {})
  context = ""
  if facts:
    context = (f" A constant output scores ROUGE-1 {facts['constant_output']['rouge1']:.4f} at "
               f"best; {facts['evidence_within_limit']['mean']:.3f} of the target words lie "
               f"within BART's limit.")
  study["verdict"] = (
      f"{head}. LED reading {setup['long_len']} tokens vs the same LED reading the first "
      f"{setup['bart_positions']} (BART's positions, standing for 1K): " + "; ".join(parts)
      + f".{context} Scale: a {setup['d_model']}-wide BART pretrained for "
      f"{setup.get('pretrain_steps', 0)} steps on the training articles, fine-tuned "
      f"{setup['steps']} steps, against the paper's BART-large on arXiv, so only the sign "
      f"compares. Rule: {study_lib.RULE}.")
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
  constant = study.get("data_properties", {}).get("constant_output")
  if constant:  # what an output that ignores the source gets: the floor of learning anything
    for i, kind in enumerate(ROUGE):
      left.hlines(constant[kind], i - width, i + width, colors="gray", linestyles="--",
                  label="best constant output" if i == 0 else None)
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


def load_average() -> str | None:
  """/proc/loadavg's 1, 5 and 15-minute load averages (None where there is no such file): the
  run's time is only comparable at the load it ran under."""
  try:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])
  except OSError:
    return None


def run(args, p: dict, log, start: float) -> dict:
  import jax
  load_start = load_average()
  with tempfile.TemporaryDirectory() as tmp:
    data = build_data(p, Path(tmp))
    train, held_out = ([json.loads(line) for line in data["files"][name].read_text().splitlines()]
                       for name in ("train", "eval"))
    references = [x["target"] for x in held_out]
    evidence = [evidence_within_limit(x, data["tokenizer"], p["bart_positions"])
                for x in held_out]
    baseline = constant_baselines(train, references)
    log(f"{data['articles']} articles ({data['held_out_articles']} held out): "
        f"{data['pairs']['train']} training and {data['pairs']['eval']} held-out pairs; "
        f"{np.mean(evidence):.3f} of the held-out target words lie in the first "
        f"{p['bart_positions']} tokens; best constant output ROUGE-1 {baseline['rouge1']:.4f}")
    results = {arm: [] for arm in ARMS}
    pretraining = {}
    for seed in args.seeds:
      led, pretraining[str(seed)] = initial_led(p, data, seed, log)
      for arm in ARMS:
        results[arm].append(train_and_score(p, arm, seed, led, data, log))
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
      "data_properties": {
          "evidence_within_limit": {
              "mean": float(np.mean(evidence)), "per_pair": [round(x, 4) for x in evidence],
              "meaning": f"fraction of a held-out target's words that lie within the source's "
                         f"first {p['bart_positions']} tokens (what bart_limit reads), mean "
                         f"over the held-out pairs: the share bart_limit can copy; the rest "
                         f"it can only guess. Computed from the data, not trained"},
          "constant_output": {
              **baseline, "meaning": "the best of several outputs that ignore the source "
                                     "(chosen on the held-out references: an upper bound for "
                                     "them); a model that learned nothing scores about this"},
          "paragraphs_per_source": {
              name: float(np.mean([x["source"].count(PARAGRAPH_SEP) + 1 for x in pairs]))
              for name, pairs in (("train", train), ("eval", held_out))},
      },
      "example": {"source_head": held_out[0]["source"][:400], "target": references[0],
                  **{arm: results[arm][0]["predictions"][0] for arm in ARMS},
                  "seed": args.seeds[0]},
      "setup": {**p, "size": args.size_name, "device": args.device, "seeds": list(args.seeds),
                "data": "the bundled Wikipedia sample (corpora.sample_xml), markup stripped, "
                        "prose paragraphs; source: consecutive paragraphs of one article, "
                        "joined by newlines, up to long_len tokens; target: the opening "
                        "(first target_words words) of every paragraph, in order, joined by "
                        "newlines; training runs start at every paragraph, held-out runs "
                        "follow one another",
                "articles": data["articles"], "held_out_articles": data["held_out_articles"],
                "pairs": data["pairs"], "example_references": references[:3],
                "scale": f"BART positions {p['bart_positions']} (standing for BART's 1,024) -> "
                         f"LED {p['long_len']} tokens (the paper: 1,024 -> 16,384)",
                "start": "per seed one BART (init_std for its width), pretrained by token "
                         "masking on chunks of the training articles that fit its positions, "
                         "made long by convert.bart_to_led; both arms fine-tune that same LED "
                         "on the same pairs in the same order",
                "pretraining": {s: {"final_loss": float(np.mean(r["losses"][-20:]))
                                    if r["losses"] else None,
                                    "seconds": round(r["seconds"], 1)}
                                for s, r in pretraining.items()},
                "load_average_start": load_start, "load_average_end": load_average(),
                "seconds": seconds, "minutes": round(seconds / 60, 1),
                "devices": str(jax.devices()), **study_lib.harness.stamp()},
      "train_losses": {arm: {str(s): r["losses"] for s, r in zip(args.seeds, rs)}
                       for arm, rs in results.items()},
      "pretrain_losses": {s: r["losses"] for s, r in pretraining.items()},
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
