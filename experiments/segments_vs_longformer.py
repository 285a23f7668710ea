"""The paper's fine-tuning claim (§6, Table 7) at CPU scale: Longformer against the segment
baseline made from the same short model.

The paper fine-tunes Longformer (RoBERTa's weights, positions copied to 4,096) and a baseline
that reads the document in independent 512-token segments with RoBERTa, and reports Longformer
ahead on every long-document task (base: WikiHop 72.4 -> 75.0 accuracy, TriviaQA 74.3 -> 75.2 F1,
Hyperpartisan 87.4 -> 94.8 F1). The claim implies where the gain should live: on examples whose
evidence the baseline cannot put together, not on those that fit one segment. Here both arms run
`train.finetune` (`longformer_jax.commands.train_finetune.main`, in-process, one workdir per run)
on tasks whose evidence lies inside the first segment in some examples and beyond it in others,
and the results are split by where the evidence was and by length bucket.

Scale (the paper's 512 / 4,096 scaled down): segments of `segment` = 64 tokens (QA:
`qa_segment` = 128, below), documents of
`min_len`..`max_len` (96..320) characters of the bundled Wikipedia sample's text8 form (one id per
character: ' ' and a..z are ids 10..36), rows of `max_length` = 384, the length buckets split at
`bucket` = 128 tokens. The model: per seed ONE short tiny Longformer masked LM (2 layers, hidden
64, one-sided window 32) whose first `segment` learned positions (after RoBERTa's 2-row offset)
are copied over the long table (the paper's recipe, `convert.roberta_to_longformer`'s
`_copied_positions`) and whose global projections
start as copies of the local ones; it is saved once and both arms start from that checkpoint.
Unlike the paper's, it is not pretrained: both arms fine-tune the same random weights, so only the
direction and where the gain lives compare with the paper, not the size.

Arms (the same starting weights, steps, batch size, learning rate and batches: classification
150 steps of 8 at 3e-3, QA 400 steps of 8 at 5e-3, which it needs to learn at all):

  longformer  rows of `max_length`, the task's default global attention (classification: `<s>`;
              QA: `<s>` and the question), the tiny window;
  segments    `--baseline segments --segment-length 64` (QA 128): every segment `<s> [question
              </s></s>] segment </s>` read alone by the same model with the same attention (the
              tiny window, the task's global tokens inside each row): the short model denied any
              reach across segments, the one difference between the arms. Classification reads
              the first segment's `<s>` (`segment_pool=first`, the command's default; the paper
              does not say); QA takes one softmax across every segment of an example. RoBERTa's
              own reading, full attention inside a segment and no global tokens
              (`--set global_attention=none --set model.attention_window=<segment>`), is not
              an arm: from these random weights it did not learn the QA lookup in 400 steps
              (seed 0, exact match 0.004 with segments of 64, 0.020 with 128), while the same
              segments of 128 with the tiny window and the question global reached 0.680.

Tasks (`text8` filler; the evidence placed uniformly over the document, so some examples hold it
inside the first segment and others beyond):

  classification  a binary label spelled by `copies` copies of a marker token (500 + label) in a
                  cluster of `cluster` positions somewhere in the document. Evidence: the
                  cluster. Out of the baseline's reach when the cluster lies past the first
                  segment's document tokens (the first segment's `<s>` never sees it).
  qa              the question is one key token (400..415); the document holds `keys` distinct
                  keys, each followed by a 2-character span; the answer is the span after the
                  asked key. Evidence: the asked key and its span. Every segment has the
                  question, so the baseline can find evidence in any segment that holds it whole.
                  The presets hold one key (no distractor): with 3 keys neither arm of the
                  random-weight tiny model learned the lookup in 150 steps (exact match 0.004
                  and 0.012, seed 0), which would have compared nothing. QA's segments are
                  `qa_segment` = 128 tokens: in rows holding at most 59 document tokens this
                  model does not learn the lookup in 400 steps whichever way it reads them
                  (seed 0, segments of 64: exact match 0.039 with the tiny window and the
                  question global, 0.000 with window 64; the Longformer itself on 30..55-
                  character documents, rows of 64 or 384: 0.055 and 0.004), while with 123 it
                  does (segments of 128: 0.680; one segment of 384: 0.664 against the
                  Longformer's 0.570, their losses equal to 5e-7 for 71 steps).

Metric: held-out accuracy (classification) and exact match (QA), per seed; the paired design
(`study.compare(design="paired")`: same seed, same start and batches) with its detectable
difference, overall, by where the evidence lies (first segment or beyond) and by length bucket.

    python experiments/segments_vs_longformer.py                # cpu size, seeds 0 1 2
    python experiments/segments_vs_longformer.py --tiny --out /tmp/s.json  # seconds

Writes experiments/results/segments_vs_longformer.json ({"study", "metric", "tasks": {task:
{"arms": {arm: {"seeds", "values", "mean", "std", "by_evidence", "by_length", "truncation",
"seconds"}}, "comparisons", "by_evidence_comparisons", "by_length_comparisons",
"detectable_difference", "data"}}, "arms" (the classification task's, the study's headline),
"comparisons", "detectable_difference", "paper", "setup", "verdict"}) and its PNG.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import study as study_lib  # experiments/study.py

STUDY = "segments_vs_longformer"
ARMS = ("longformer", "segments")
CLAIMS = [("longformer", "segments")]
TASKS = ("classification", "qa")
METRICS = {"classification": "accuracy", "qa": "exact_match"}
GROUPS = ("first_segment", "beyond")
# The paper's Table 7 (base models): the baseline (RoBERTa in 512-token segments) -> Longformer.
PAPER = {"table": "Table 7, base models: RoBERTa (segments of 512) -> Longformer (4,096)",
         "values": {"segments": 87.4, "longformer": 94.8},
         "tasks": {"WikiHop accuracy": [72.4, 75.0], "TriviaQA F1": [74.3, 75.2],
                   "Hyperpartisan F1": [87.4, 94.8]}}

# Character ids: ' ' -> 10, a..z -> 11..36 (text8's alphabet); markers and keys above them.
SPACE_ID, LETTER_ID = 10, 11
LABEL_ID, KEY_ID, NUM_KEYS = 500, 400, 16

PRESETS = {
    # Measured: 12 runs (2 tasks x 2 arms x 3 seeds) in 9.3 minutes on 2 shared cores.
    "cpu": dict(segment=64, qa_segment=128, min_len=96, max_len=320, max_length=384, bucket=128,
                train=480, eval=256, steps=150, qa_steps=400, batch=8, lr=3e-3, qa_lr=5e-3,
                copies=12, cluster=24, keys=1),
    "gpu": dict(segment=64, qa_segment=128, min_len=96, max_len=320, max_length=384, bucket=128,
                train=2000, eval=1000, steps=600, qa_steps=1500, batch=16, lr=2e-3, qa_lr=3e-3,
                copies=12, cluster=24, keys=1),
    "tiny": dict(segment=64, qa_segment=64, min_len=96, max_len=160, max_length=192, bucket=128,
                 train=16, eval=16, steps=2, qa_steps=2, batch=4, lr=3e-3, qa_lr=3e-3,
                 copies=12, cluster=24, keys=1),
}


# ----------------------------------------------------------------------------------------------
# Data


def filler_ids() -> np.ndarray:
  """The bundled sample's text8 form as one id per character (' ' 10, a..z 11..36)."""
  from longformer_jax.data import corpora
  text = np.frombuffer(corpora.sample_stream("text8_sample"), np.uint8)
  return np.where(text == ord(" "), SPACE_ID, text.astype(np.int64) - ord("a") + LETTER_ID)


def _filler(rng: np.random.Generator, text: np.ndarray, length: int) -> np.ndarray:
  start = int(rng.integers(0, len(text) - length))
  return text[start:start + length].copy()


def segment_of(p: dict, task: str) -> int:
  """The task's segment length: `qa_segment` for QA, `segment` otherwise (see PRESETS)."""
  return p["qa_segment"] if task == "qa" else p["segment"]


def first_segment_capacity(p: dict, task: str) -> int:
  """Document tokens the first segment row holds: classification `<s> seg </s>`, QA `<s> q
  </s></s> seg </s>` with a one-token question."""
  return segment_of(p, task) - (2 if task == "classification" else 1 + 4)


def classification_records(p: dict, n: int, rng: np.random.Generator, text: np.ndarray,
                           split: str) -> list[dict]:
  """Records {"id", "input_ids", "label"} and each one's facts ("evidence_end", the last marker's
  document position, and "first_segment"). The cluster never straddles the first segment's end:
  an example's evidence is wholly inside it or wholly beyond."""
  capacity = first_segment_capacity(p, "classification")
  out = []
  for i in range(n):
    length = int(rng.integers(p["min_len"], p["max_len"] + 1))
    ids = _filler(rng, text, length)
    label = int(rng.integers(2))
    while True:
      start = int(rng.integers(0, length - p["cluster"] + 1))
      if start + p["cluster"] <= capacity or start >= capacity:
        break
    where = start + rng.choice(p["cluster"], p["copies"], replace=False)
    ids[where] = LABEL_ID + label
    out.append({"id": f"{split}-{i}", "input_ids": ids.tolist(), "label": label,
                "_first_segment": bool(where.max() < capacity), "_length": length})
  return out


def qa_records(p: dict, n: int, rng: np.random.Generator, text: np.ndarray, split: str
               ) -> list[dict]:
  """Records {"id", "question", "input_ids", "answers"}: `keys` distinct keys at spread-out
  positions, each followed by 2 filler characters; the question asks one, its span the answer.
  "first_segment": the asked key and its span lie inside the first segment's document tokens."""
  capacity = first_segment_capacity(p, "qa")
  out = []
  for i in range(n):
    length = int(rng.integers(p["min_len"], p["max_len"] + 1))
    ids = _filler(rng, text, length)
    keys = rng.choice(NUM_KEYS, p["keys"], replace=False) + KEY_ID
    # Positions at least 4 apart so no key falls inside another's span.
    while True:
      where = np.sort(rng.choice(length - 3, p["keys"], replace=False))
      if np.all(np.diff(where) >= 4):
        break
    ids[where] = keys
    asked = int(rng.integers(p["keys"]))
    key_at = int(where[asked])
    out.append({"id": f"{split}-{i}", "question": [int(keys[asked])], "input_ids": ids.tolist(),
                "answers": [{"start": key_at + 1, "end": key_at + 2}],
                "_first_segment": bool(key_at + 2 < capacity), "_length": length})
  return out


def write_records(path: Path, records: Sequence[dict]) -> Path:
  """JSONL without the "_" facts (the command reads only the task's fields)."""
  from longformer_jax.io import atomic_write
  lines = [json.dumps({k: v for k, v in r.items() if not k.startswith("_")}) for r in records]
  atomic_write(path, ("\n".join(lines) + "\n").encode())
  return path


def build_data(p: dict, root: Path, seed: int = 1234) -> dict:
  """Each task's train and eval files (the same for every seed and arm) and the eval facts."""
  rng = np.random.default_rng(seed)
  text = filler_ids()
  makers = {"classification": classification_records, "qa": qa_records}
  data = {}
  for task in TASKS:
    train = makers[task](p, p["train"], rng, text, "train")
    held_out = makers[task](p, p["eval"], rng, text, "eval")
    data[task] = {"train": write_records(root / f"{task}_train.jsonl", train),
                  "eval": write_records(root / f"{task}_eval.jsonl", held_out),
                  "facts": {r["id"]: r for r in held_out},
                  "first_segment_share": {
                      split: float(np.mean([r["_first_segment"] for r in rs]))
                      for split, rs in (("train", train), ("eval", held_out))}}
  return data


# ----------------------------------------------------------------------------------------------
# The model and the runs


def short_model_made_long(p: dict, seed: int, path: Path) -> Path:
  """Saves the seed's starting checkpoint: a tiny masked LM (its vocabulary and layers
  `p["vocab_size"]` and `p["num_hidden_layers"]` when the preset names them) whose `segment`
  learned positions (after RoBERTa's 2-row offset) are copied over a table for `max_length`
  tokens, its global projections copies of the local ones (the paper's recipe). Returns
  `path`."""
  from flax import nnx
  from longformer_jax import checkpoint, convert, modeling
  from longformer_jax.config import LongformerConfig
  offset = 2
  # A word-level task's vocabulary may outgrow the tiny preset's, and a test wants one layer.
  config = LongformerConfig.tiny(max_position_embeddings=p["max_length"] + offset,
                                 **{k: p[k] for k in ("vocab_size", "num_hidden_layers")
                                    if k in p})
  model = modeling.LongformerForMaskedLM(config, rngs=nnx.Rngs(seed))
  table = model.longformer.embeddings.position_embeddings.embedding
  short = np.asarray(table[...])[:offset + p["segment"]]
  table[...] = np.concatenate([short[:offset], convert._copied_positions(
      short, offset, p["max_length"])]).astype(short.dtype)
  for layer in model.longformer.layers:
    attention = layer.attention
    for proj in ("query", "key", "value"):
      for leaf in ("kernel", "bias"):
        getattr(getattr(attention, f"{proj}_global"), leaf)[...] = getattr(
            getattr(attention, proj), leaf)[...]
  checkpoint.save_model(path, model)
  return path


def finetune(argv: Sequence[str], workdir: Path) -> dict:
  """One `train.finetune` run in-process (its printing kept quiet, `--workdir` given in `argv`):
  its results.json's "validation" block. RuntimeError with the run's output when it fails."""
  from longformer_jax.commands import train_finetune
  quiet = io.StringIO()
  with contextlib.redirect_stdout(quiet):
    status = train_finetune.main(list(argv))
  if status != 0:
    raise RuntimeError(f"train.finetune {' '.join(argv)} exited {status}: {quiet.getvalue()}")
  return json.loads((workdir / "results.json").read_text())["validation"]


def arm_arguments(p: dict, arm: str, task: str) -> list[str]:
  if arm == "longformer":
    return []
  return ["--baseline", "segments", "--segment-length", str(segment_of(p, task))]


def run_arm(p: dict, task: str, arm: str, seed: int, start: Path, data: dict, workdir: Path,
            log) -> dict:
  """One `train.finetune` run in-process; its results.json, read back with the per-example
  correctness split by where the evidence lies."""
  files = data[task]
  prefix = "qa_" if task == "qa" else ""  # QA's own budget: both arms learn slower there
  argv = ["--task", task, "--model", str(start), "--train", str(files["train"]),
          "--validation", str(files["eval"]), "--max-length", str(p["max_length"]),
          "--steps", str(p[f"{prefix}steps"]), "--batch-size", str(p["batch"]),
          "--learning-rate", str(p[f"{prefix}lr"]), "--seed", str(seed),
          "--workdir", str(workdir),
          "--length-buckets", str(p["bucket"]), "--no-progress",
          "--set", "model.attention_impl=reference", *arm_arguments(p, arm, task)]
  tick = time.perf_counter()
  results = finetune(argv, workdir)
  predictions = [json.loads(line) for line in
                 (workdir / "predictions_validation.jsonl").read_text().splitlines()]
  correct = {}
  for record in predictions:
    fact = files["facts"][record["id"]]
    if task == "classification":
      correct[record["id"]] = float(record["prediction"] == fact["label"])
    else:
      gold = fact["input_ids"][fact["answers"][0]["start"]:fact["answers"][0]["end"] + 1]
      correct[record["id"]] = float(list(record["prediction"]) == gold)
  metric = METRICS[task]
  value = float(results[metric])
  # The per-example scoring must be the command's: its mean is the metric (exact for these
  # means over examples).
  assert abs(np.mean(list(correct.values())) - value) < 1e-9, (task, arm, value)
  groups = {g: [c for i, c in correct.items() if files["facts"][i]["_first_segment"] ==
                (g == "first_segment")] for g in GROUPS}
  seconds = time.perf_counter() - tick
  log(f"{task} {arm} seed {seed}: {metric} {value:.4f} (first segment "
      f"{np.mean(groups['first_segment']):.3f}, beyond {np.mean(groups['beyond']):.3f}) "
      f"({seconds:.0f} s)")
  return {"value": value,
          "by_evidence": {g: {"value": float(np.mean(v)), "examples": len(v)}
                          for g, v in groups.items()},
          "by_length": {b: ({"value": float(r[metric]), "examples": r["examples"]}
                            if r["examples"] else {"value": None, "examples": 0})
                        for b, r in results["by_length"].items()},
          "truncation": results["truncation"], "seconds": seconds}


# ----------------------------------------------------------------------------------------------
# Summaries, verdict, plot


def _arm_stats(seeds, runs: Sequence[dict], pick) -> dict:
  return study_lib.summarize(seeds, [pick(r) for r in runs])


def arm_entry(seeds: Sequence[int], runs: Sequence[dict]) -> dict:
  """An arm's entry from its runs (one per seed, each {"value", "by_evidence": {group: {"value",
  "examples"}}, "seconds"} and optionally "by_length" and "truncation", as `run_arm` returns
  them): the per-seed values with their mean and sd, overall and per group and bucket."""
  seeds = list(seeds)
  groups = runs[0]["by_evidence"]
  entry = {
      **_arm_stats(seeds, runs, lambda r: r["value"]),
      "by_evidence": {g: {**_arm_stats(seeds, runs, lambda r, g=g: r["by_evidence"][g]["value"]),
                          "examples": runs[0]["by_evidence"][g]["examples"]} for g in groups}}
  if "by_length" in runs[0]:
    entry["by_length"] = {b: {"seeds": seeds, "values": [r["by_length"][b]["value"] for r in runs],
                              "examples": runs[0]["by_length"][b]["examples"]}
                          for b in runs[0]["by_length"]}
    for bucket in entry["by_length"].values():
      if bucket["examples"]:
        bucket.update(study_lib.stats(bucket["values"]))
  if "truncation" in runs[0]:
    entry["truncation"] = runs[0]["truncation"]
  entry["seconds"] = [round(r["seconds"], 1) for r in runs]
  return entry


def summarize_task(entry: dict) -> dict:
  """The task's comparisons (overall, by evidence, by length bucket when the arms have it) from
  the per-seed values."""
  arms = entry["arms"]
  entry["comparisons"] = study_lib.compare(arms, CLAIMS, higher_is_better=True, design="paired")
  entry["detectable_difference"] = study_lib.power_summary(arms, entry["comparisons"], "paired")
  for split in ("by_evidence", "by_length"):
    if split not in arms[ARMS[0]]:
      continue
    groups = arms[ARMS[0]][split]
    entry[f"{split}_comparisons"] = {}
    for g in groups:
      sub = {a: arms[a][split][g] for a in ARMS}
      if any(v is None for a in ARMS for v in sub[a]["values"]):
        entry[f"{split}_comparisons"][g] = None  # an empty bucket
        continue
      entry[f"{split}_comparisons"][g] = study_lib.compare(
          sub, CLAIMS, higher_is_better=True, design="paired")[0]
  return entry


def _group(c: dict) -> str:
  """A group's comparison in words: the difference, the detectable one, and which arm is ahead."""
  where = {"agree": "Longformer ahead", "disagree": "segments ahead"}.get(c["outcome"],
                                                                        "not resolved")
  return f"{c['difference']:+.3f} (detectable {c['detectable_difference']:.3f}, {where})"


def summarize_study(study: dict) -> dict:
  for entry in study["tasks"].values():
    summarize_task(entry)
  headline = study["tasks"]["classification"]
  study["arms"] = headline["arms"]
  study["comparisons"] = headline["comparisons"]
  study["detectable_difference"] = headline["detectable_difference"]
  parts = []
  for task, entry in study["tasks"].items():
    c, ev = entry["comparisons"][0], entry["by_evidence_comparisons"]
    arms = entry["arms"]
    parts.append(
        f"{task} ({entry['metric']}): longformer {arms['longformer']['mean']:.3f} ± "
        f"{arms['longformer']['std']:.3f} vs segments {arms['segments']['mean']:.3f} ± "
        f"{arms['segments']['std']:.3f}, {c['difference']:+.3f} (detectable "
        f"{c['detectable_difference']:.3f}): {c['outcome']}; evidence in the first segment "
        f"{_group(ev['first_segment'])}, beyond it {_group(ev['beyond'])}")
  cls = study["tasks"]["classification"]["by_evidence_comparisons"]
  qa = study["tasks"]["qa"]["by_evidence_comparisons"]
  gain_beyond = cls["beyond"]["outcome"] == "agree"
  gain_first = cls["first_segment"]["outcome"] == "agree"
  if gain_beyond and not gain_first:
    where = ("The classification gain lives where the evidence was out of the baseline's reach "
             "(past its first segment), and not where the first segment held it, as the "
             "paper's claim implies")
  elif gain_beyond:
    where = ("Longformer gains on classification both past the first segment and inside it: "
             "the gain is not confined to evidence out of the baseline's reach")
  else:
    where = ("No resolved classification gain where the evidence was out of the baseline's "
             "reach at this scale")
  qa_note = ("QA, whose question every segment carries, shows " + (
      "no resolved difference" if not any(
          qa[g]["outcome"] in ("agree", "disagree") for g in GROUPS) else
      "a resolved difference (" + ", ".join(f"{g}: {qa[g]['outcome']}" for g in GROUPS) + ")")
      + " by where the evidence lies")
  if qa["first_segment"]["outcome"] == "agree":
    qa_note += (": Longformer is ahead where the first segment holds the evidence too, which "
                "the baseline reads whole, so that gap is not one of reach")
  setup = study["setup"]
  study["verdict"] = (
      f"{where}. {qa_note}. " + "; ".join(parts) + f". Scale: segments of {setup['segment']} "
      f"(QA {setup.get('qa_segment', setup['segment'])}) and rows of {setup['max_length']} "
      f"(the paper: 512 and 4,096), a tiny random-weight "
      f"model fine-tuned {setup['steps']} steps (classification) and {setup['qa_steps']} (QA), "
      f"{len(setup['seeds'])} seeds per arm, paired by seed; only the direction and where the "
      f"gain lives compare with the paper's Table 7 "
      f"(base: WikiHop 72.4 -> 75.0, TriviaQA 74.3 -> 75.2, Hyperpartisan 87.4 -> 94.8 F1). "
      f"Rule: {study_lib.RULE}.")
  return study


def plot(study: dict, path: Path) -> None:
  """Per task: each arm's metric overall, with the evidence inside / beyond the first segment,
  and per length bucket (bars mean ± sd over seeds, dots the seeds)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  colors = {"longformer": "tab:blue", "segments": "tab:red"}
  tasks = study["tasks"]
  fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.2), squeeze=False)
  width = 0.38
  for ax, (task, entry) in zip(axes[0], tasks.items()):
    first = entry["arms"][ARMS[0]]
    columns = [("all", lambda a: a)] + [
        (f"evidence {g.replace('_', ' ')}", lambda a, g=g: a["by_evidence"][g])
        for g in first["by_evidence"]
    ] + [(f"length {b}", lambda a, b=b: a["by_length"][b]) for b in first.get("by_length", ())]
    for j, arm in enumerate(ARMS):
      for i, (_, pick) in enumerate(columns):
        values = [v for v in pick(entry["arms"][arm])["values"] if v is not None]
        if not values:
          continue
        x = i + (j - 0.5) * width
        ax.bar(x, np.mean(values), width, yerr=np.std(values, ddof=1) if len(values) > 1 else 0,
               color=colors[arm], alpha=0.5, capsize=4, label=arm if i == 0 else None)
        ax.scatter(x + np.linspace(-0.08, 0.08, len(values)), values, color=colors[arm],
                   edgecolor="black", s=16, zorder=3)
    if task == "classification":
      ax.axhline(0.5, color="gray", linestyle="--", linewidth=1, label="chance")
    elif "trivial" in entry["data"]:  # a task's trivial predictor
      ax.axhline(entry["data"]["trivial"], color="gray", linestyle="--", linewidth=1,
                 label="trivial predictor")
    ax.set_xticks(range(len(columns)), [c[0] for c in columns], fontsize=8, rotation=15)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel(f"held-out {entry['metric']}")
    # A task's own scale when the study's tasks differ in it, else the study's.
    scale = {k: entry["data"].get(k, study["setup"].get(k)) for k in ("segment", "max_length")}
    ax.set_title(f"{task}: segments of {scale['segment']} vs rows of {scale['max_length']} "
                 f"({len(study['setup']['seeds'])} seeds)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  study_lib.harness.write_png(path, fig, dpi=110)


# ----------------------------------------------------------------------------------------------


def run(args, p: dict, log, start: float) -> dict:
  import jax
  seeds = list(args.seeds)
  with tempfile.TemporaryDirectory() as tmp:
    root = Path(tmp)
    data = build_data(p, root)
    for task in TASKS:
      log(f"{task}: {p['train']} training and {p['eval']} held-out examples; evidence within "
          f"the first segment in {data[task]['first_segment_share']['eval']:.3f} of the held out")
    runs = {task: {arm: [] for arm in ARMS} for task in TASKS}
    for seed in seeds:
      model = short_model_made_long(p, seed, root / f"start_{seed}")
      for task in TASKS:
        for arm in ARMS:
          runs[task][arm].append(run_arm(p, task, arm, seed, model, data,
                                         root / f"{task}_{arm}_{seed}", log))
  tasks = {}
  for task in TASKS:
    arms = {arm: arm_entry(seeds, rs) for arm, rs in runs[task].items()}
    tasks[task] = {"metric": METRICS[task], "arms": arms,
                   "data": {"first_segment_share": data[task]["first_segment_share"],
                            "first_segment_capacity": first_segment_capacity(p, task)}}
  seconds = round(time.perf_counter() - start, 1)
  return {
      "study": STUDY,
      "metric": "held-out accuracy (classification; the headline \"arms\") and exact match (QA) "
                "of train.finetune's results.json, per seed; split by where the evidence lies "
                "(inside the first segment's document tokens or beyond) from the predictions, "
                "and by length bucket from results.json's by_length",
      "tasks": tasks,
      "paper": PAPER,
      "setup": {**p, "size": args.size_name, "device": args.device, "seeds": seeds,
                "data": "text8 form of the bundled Wikipedia sample, one id per character; "
                        "classification: a cluster of marker copies spells the label; QA: the "
                        "span after the asked one of several keys",
                "scale": f"segments of {p['segment']} tokens (QA {p['qa_segment']}), rows of "
                         f"{p['max_length']} (the paper: 512 and 4,096)",
                "start": "per seed one tiny masked LM, its first segment+2 position rows copied "
                         "over the long table, global projections copied from the local ones, "
                         "saved once; both arms fine-tune it",
                "arms": {task: {arm: arm_arguments(p, arm, task) for arm in ARMS}
                         for task in TASKS},
                "seconds": seconds, "minutes": round(seconds / 60, 1),
                "devices": str(jax.devices()), **study_lib.harness.stamp()},
      "seconds": seconds,
  }


def main(argv: Sequence[str] | None = None) -> int:
  args, p = study_lib.parse_preset(__doc__, STUDY, argv, PRESETS)
  if args.steps is not None:  # --steps sets both tasks' budgets
    p["qa_steps"] = args.steps
  study = study_lib.run_or_replot(args, STUDY, lambda log, start: run(args, p, log, start),
                                  summarize_study, plot)
  print(study["verdict"])
  return 0


if __name__ == "__main__":
  sys.exit(study_lib.cli(main))
