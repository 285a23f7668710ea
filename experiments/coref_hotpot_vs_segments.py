"""The paper's fine-tuning claim (§6, Table 7) on its two structured tasks at CPU scale:
Longformer against the segment baseline made from the same short model, on coreference and
HotpotQA, where antecedents and evidence cross segments.

The paper's Table 7 (base models; the baseline RoBERTa reading 512-token segments ->
Longformer reading 4,096): HotpotQA 63.5 -> 64.4 joint F1, OntoNotes coreference 78.4 -> 78.6
average F1, the smallest gains of the table. Here both arms run `train.finetune` in-process
(`segments_vs_longformer.finetune`, one workdir per run) on generated data, gold by
construction, whose links or evidence lie inside one segment in some documents and across
segments in the others, and the results are split so.

The model, the pairing and the statistics are `segments_vs_longformer.py`'s: per seed and task
ONE tiny random-weight masked LM (2 layers, hidden 64, one-sided window 32) whose first `segment`
learned positions are copied over its long table and whose global projections start as copies of
the local ones, saved once; both arms fine-tune that checkpoint with the same steps, batch size,
learning rate and batches (the same --seed), compared paired by seed
(`study.compare(design="paired")`) with the detectable difference of the per-seed differences.
Not pretrained: only the direction and where a gain lives compare with the paper, not the size.

Arms (`arm_arguments`, the one place that spells them on the command line):

  longformer  the whole row, the task's default global attention (coreference: none; HotpotQA:
              `<s>`, the question and every marker), the tiny window;
  segments    the encoder reads the row in independent segments of `segment` tokens with a
              window covering each segment and no global attention (RoBERTa's full attention
              inside a segment, `--set global_attention=none`, `model.attention_window`); the
              head reads the stitched states.

Tasks:

  coref     `data.coref_generate` documents (filler words, `entities` people of 2 to
            `mentions` mentions each at least `min_gap` words apart), one row `<s> words </s>`
            of `max_length` tokens (a word-level tokenizer: one token per word, so every
            document is kept whole). Metric: the CoNLL F1 (the mean of MUC, B-cubed and CEAFe
            F1, the paper's "average F1"), over the held-out documents. Groups: documents whose
            gold links (each mention to its cluster's previous one) all lie within one segment
            of the row, and those with a link across segments.
  hotpotqa  `data.hotpotqa_generate` records (`paragraphs` paragraphs of 2-3 sentences, a third
            each bridge, comparison and yes/no questions), stage-1 rows of `max_length` tokens,
            stage-2 rows of `stage2_length`. Metric: joint F1 (HotpotQA's official metric, the
            paper's). Groups: records whose supporting sentences all lie in one segment of the
            stage-1 row, and those whose evidence spans several.

    python experiments/coref_hotpot_vs_segments.py                 # cpu size, seeds 0 1 2
    python experiments/coref_hotpot_vs_segments.py --tasks coref   # one task
    python experiments/coref_hotpot_vs_segments.py --tiny --out /tmp/c.json   # a test's size

The cpu size: 7.6 minutes on 2 shared cores (12 runs; coreference 250 steps, HotpotQA 150).

Writes experiments/results/coref_hotpot_vs_segments.json ({"study", "metric", "tasks": {task:
{"metric", "arms": {arm: {"seeds", "values", "mean", "std", "by_evidence", "also", "seconds"}},
"comparisons", "by_evidence_comparisons", "detectable_difference", "data"}}, "arms",
"comparisons" and "detectable_difference" (the first task's, the study's headline), "paper",
"setup", "verdict"}) and its PNG.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import segments_vs_longformer as svl  # experiments/segments_vs_longformer.py
import study as study_lib  # experiments/study.py

STUDY = "coref_hotpot_vs_segments"
ARMS, CLAIMS = svl.ARMS, svl.CLAIMS
TASKS = ("coref", "hotpotqa")
METRICS = {"coref": "conll_f1", "hotpotqa": "joint_f1"}
# Other metrics of results.json kept per run (the README's tables).
ALSO = {"coref": ("muc_f1", "b3_f1", "ceafe_f1"),
        "hotpotqa": ("em", "f1", "sp_f1", "joint_em", "paragraph_recall")}
GROUPS = ("one_segment", "across_segments")
PAPER = {"table": "Table 7, base models: RoBERTa (segments of 512) -> Longformer (4,096)",
         "tasks": {"HotpotQA joint F1": [63.5, 64.4], "OntoNotes coreference average F1":
                   [78.4, 78.6]},
         "source": "the paper's Table 7 as quoted in the project's design notes"}
TOKENS = ("<s>", "<pad>", "</s>", "<unk>")  # the tiny model's special ids 0..3, in its order

# The coreference head of docs/finetune.md's CPU run; singletons removed when scoring (Joshi et
# al.'s metrics' convention, the reference scorer's on OntoNotes, whose gold has none, as the
# generated gold has none; the trivial predictor, every gold mention its own cluster, then
# scores 0). vocab_size: the start model's, above the tokenizer's words (1,309 cpu, 2,965 gpu).
_COREF = dict(coref_ffnn_size=64, coref_max_span_width=5, coref_feature_size=8,
              coref_max_antecedents=10, coref_dropout=0, coref_mention_weight=1.0,
              coref_singletons=False)
# Every segment row carries the question ([q] question [/q], at most max_question_length
# tokens; the generated questions are shorter).
_HOTPOT = dict(hotpot_stage2_length=128, max_question_length=16)
_SIZES = {
    "coref": dict(segment=64, max_length=128, vocab_size=2048, words=80, entities=2,
                  mentions=2, min_gap=6, settings=_COREF),
    "hotpotqa": dict(segment=96, max_length=192, paragraphs=4, settings=_HOTPOT),
}
PRESETS = {
    "cpu": {"coref": dict(_SIZES["coref"], train=256, eval=160, steps=250, batch=8, lr=5e-3),
            "hotpotqa": dict(_SIZES["hotpotqa"], train=512, eval=96, steps=150, batch=8,
                             lr=3e-3)},
    "gpu": {"coref": dict(_SIZES["coref"], vocab_size=4096, train=1024, eval=256, steps=600,
                          batch=16, lr=2e-3),
            "hotpotqa": dict(_SIZES["hotpotqa"], train=2048, eval=256, steps=600, batch=16,
                             lr=2e-3)},
    # One layer (HotpotQA: shorter rows): the pipeline in seconds, not learning; both groups
    # occur in the 16 held-out examples of either task.
    "tiny": {"coref": dict(_SIZES["coref"], train=8, eval=16, steps=2, batch=4, lr=3e-3,
                           num_hidden_layers=1),
             "hotpotqa": dict(_SIZES["hotpotqa"], segment=64, max_length=160, paragraphs=3,
                              train=8, eval=16, steps=2, batch=4, lr=3e-3, num_hidden_layers=1)},
}


# ----------------------------------------------------------------------------------------------
# The arms on the command line (the one place that spells the segment baseline)


def arm_arguments(task: str, arm: str, p: dict) -> list[str]:
  """`train.finetune` arguments that make `arm` of `task` beyond what both arms share: none for
  Longformer; the segment baseline's reading with a window covering each segment and no global
  attention for the segments arm."""
  del task  # both tasks spell the baseline alike
  if arm == "longformer":
    return []
  return ["--baseline", "segments", "--segment-length", str(p["segment"]),
          "--set", "global_attention=none", "--set", f"model.attention_window={p['segment']}"]


def segment_of(task: str, p: dict, positions: np.ndarray, prefix: int = 0) -> np.ndarray:
  """The segment of each row position under the segments arm's reading (`longformer_jax.
  segments`, no overlap): coreference cuts the row `<s> tokens </s>` into rows of `segment`
  tokens (position // segment); HotpotQA puts the row's `<s> [q] question [/q]` (its first
  `prefix` positions, up to the first `[p]`) at the head of every segment row `<s> [q] question
  [/q] part </s>` and cuts the rest of the row into parts of segment - prefix - 1 tokens."""
  positions = np.asarray(positions)
  if task == "coref":
    return positions // p["segment"]
  return (positions - prefix) // (p["segment"] - prefix - 1)


# ----------------------------------------------------------------------------------------------
# Data


def word_tokenizer(words, path: Path, pre, markers: Sequence[str] = ()) -> Path:
  """A word-level tokenizer of `words` (the special tokens first, then `markers`) saved at
  `path`: every word of the generated data one token."""
  from tokenizers import Tokenizer, models
  vocab = {t: i for i, t in enumerate([*TOKENS, *markers, *sorted(set(words) - set(markers))])}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre
  from longformer_jax.io import atomic_write
  atomic_write(path, tokenizer.to_str())
  return path


def link_segments(clusters, p: dict) -> bool:
  """Whether every gold link of a document (each mention to its cluster's previous one, word
  spans) lies within one segment of its row (word w at row position w + 1, after `<s>`)."""
  for cluster in clusters:
    for (s0, e0), (s1, e1) in zip(cluster, cluster[1:]):
      if len(set(segment_of("coref", p, np.asarray([s0, e0, s1, e1]) + 1).tolist())) > 1:
        return False
  return True


def coref_data(p: dict, root: Path, seed: int) -> dict:
  """The coreference train and held-out files (CoNLL), their tokenizer, and each held-out
  document's facts {"one_segment", "words"}."""
  from tokenizers import pre_tokenizers
  from longformer_jax.data import coref_generate
  docs = {split: coref_generate.generate_documents(
      n, seed=seed + k, num_words=p["words"], num_entities=p["entities"],
      max_mentions=p["mentions"], min_gap=p["min_gap"], source="filler", key_prefix=split)
      for k, (split, n) in enumerate((("train", p["train"]), ("eval", p["eval"])))}
  files = {}
  for split, ds in docs.items():
    files[split] = root / f"coref_{split}.v4_gold_conll"
    coref_generate.write_conll(files[split], ds)
    longest = max(len(d.tokens) for d in ds)
    if longest > p["max_length"] - 2:
      raise ValueError(f"coref: a {split} document of {longest} words does not fit rows of "
                       f"max_length={p['max_length']} (raise max_length or lower words)")
  words = {w for ds in docs.values() for d in ds for w in d.tokens}
  if len(words) + len(TOKENS) > p["vocab_size"]:
    raise ValueError(f"coref: {len(words)} words and {len(TOKENS)} special tokens do not fit "
                     f"the model's vocab_size={p['vocab_size']} (raise it in the preset)")
  files["tokenizer"] = word_tokenizer(words, root / "coref_tokenizer.json",
                                      pre_tokenizers.WhitespaceSplit())
  facts = {d.doc_key: {"one_segment": link_segments(d.clusters, p), "words": len(d.tokens)}
           for d in docs["eval"]}
  return {**files, "facts": facts}


def hotpot_data(p: dict, root: Path, seed: int) -> dict:
  """The HotpotQA train and held-out files, their tokenizer, and each held-out record's facts
  {"one_segment", "record"} from its stage-1 row."""
  from tokenizers import Tokenizer, pre_tokenizers
  from longformer_jax.data import hotpotqa as hq
  from longformer_jax.data import hotpotqa_generate as gen
  from longformer_jax.data.tokenizer import SpecialIds
  records = {split: gen.generate_records(n, seed=seed + k, num_paragraphs=p["paragraphs"],
                                         sentences=(2, 3))
             for k, (split, n) in enumerate((("train", p["train"]), ("eval", p["eval"])))}
  files = {}
  for split, rs in records.items():
    files[split] = root / f"hotpot_{split}.json"
    gen.write_hotpotqa(files[split], rs)
  pre = pre_tokenizers.Whitespace()
  texts = [t for rs in records.values() for r in rs
           for t in [r["question"], *(x for title, s in r["context"] for x in (title, *s))]]
  files["tokenizer"] = word_tokenizer({w for t in texts for w, _ in pre.pre_tokenize_str(t)},
                                      root / "hotpot_tokenizer.json", pre, hq.MARKER_TOKENS)
  tokenizer = Tokenizer.from_file(str(files["tokenizer"]))
  encode = hq.tokenizer_encoder(tokenizer)
  specials = SpecialIds(bos=0, pad=1, eos=2, sep=2)
  markers = hq.MarkerIds.of_tokenizer(tokenizer)
  facts = {}
  for record in hq.read_hotpotqa(files["eval"]):
    row = hq.build_layout(record, encode, specials, markers, max_length=p["max_length"])
    if not row.truncation.evidence_within_limit:
      raise ValueError(f"hotpotqa: record {record.id}'s evidence does not fit stage-1 rows of "
                       f"max_length={p['max_length']}")
    supporting = np.flatnonzero(row.sentence_mask * row.sentence_labels)
    where = np.flatnonzero(np.isin(row.token_sentence, supporting))
    prefix = int(row.paragraph_positions[0])  # <s> [q] question [/q]
    facts[record.id] = {"one_segment": len(set(segment_of("hotpotqa", p, where, prefix)
                                               .tolist())) == 1,
                        "record": record.as_json()}
  return {**files, "facts": facts}


def build_data(presets: dict, root: Path, seed: int = 1234) -> dict:
  """Each task's (the keys of `presets`) files, the same for every seed and arm, its held-out
  facts, the share of the held-out examples in one segment, and its trivial predictor's
  score."""
  from longformer_jax.tasks import coref_kind, hotpotqa_kind
  data = {}
  if "coref" in presets:
    p = presets["coref"]
    data["coref"] = coref_data(p, root, seed)
    data["coref"]["trivial"] = coref_kind.trivial_scores(
        data["coref"]["eval"], singletons=p["settings"]["coref_singletons"])["conll_f1"]
  if "hotpotqa" in presets:
    data["hotpotqa"] = hotpot_data(presets["hotpotqa"], root, seed)
    data["hotpotqa"]["trivial"] = hotpotqa_kind.trivial_scores(
        data["hotpotqa"]["train"], data["hotpotqa"]["eval"])["joint_f1"]
  for entry in data.values():
    entry["one_segment_share"] = float(np.mean([f["one_segment"]
                                                for f in entry["facts"].values()]))
  return data


# ----------------------------------------------------------------------------------------------
# The runs


def _settings(p: dict) -> list[str]:
  return [x for k, v in p["settings"].items() for x in ("--set", f"{k}={v}")]


def group_scores(task: str, p: dict, workdir: Path, facts: dict) -> dict[str, dict]:
  """The task's metric over all held-out examples and over each group, recomputed from the
  run's predictions with the command's own scorer: {"all" | group: {"value", "examples"}}."""
  from longformer_jax.tasks.coref_metrics import coref_scores
  from longformer_jax.tasks.qa_metrics import hotpot_scores
  if task == "coref":
    records = {r["id"]: r for r in map(json.loads, (workdir / "predictions_validation.jsonl")
                                        .read_text().splitlines())}
    singletons = p["settings"]["coref_singletons"]
    score = lambda ids: coref_scores(golds=[records[i]["gold"] for i in ids],
                                     predictions=[records[i]["clusters"] for i in ids],
                                     singletons=singletons)["conll_f1"]
  else:
    official = json.loads((workdir / "predictions_validation.json").read_text())
    score = lambda ids: hotpot_scores(predictions=official,
                                      golds=[facts[i]["record"] for i in ids])["joint_f1"]
  ids = {"all": list(facts)}
  for g in GROUPS:
    ids[g] = [i for i in facts if facts[i]["one_segment"] == (g == "one_segment")]
  return {g: {"value": float(score(v)) if v else None, "examples": len(v)}
          for g, v in ids.items()}


def run_arm(task: str, arm: str, seed: int, p: dict, start: Path, data: dict, workdir: Path,
            log) -> dict:
  """One `train.finetune` run in-process; its metric, overall and by group."""
  files = data[task]
  argv = ["--task", task, "--model", str(start), "--tokenizer", str(files["tokenizer"]),
          "--train", str(files["train"]), "--validation", str(files["eval"]),
          "--max-length", str(p["max_length"]), "--steps", str(p["steps"]),
          "--batch-size", str(p["batch"]), "--learning-rate", str(p["lr"]), "--seed", str(seed),
          "--workdir", str(workdir), "--no-progress",
          "--set", "model.attention_impl=reference", *_settings(p),
          *arm_arguments(task, arm, p)]
  tick = time.perf_counter()
  results = svl.finetune(argv, workdir)
  scores = group_scores(task, p, workdir, files["facts"])
  metric = METRICS[task]
  value = float(results[metric])
  # The per-group scoring must be the command's: over every example it gives the metric back.
  assert abs(scores["all"]["value"] - value) < 1e-9, (task, arm, seed, scores["all"], value)
  seconds = time.perf_counter() - tick
  groups = ", ".join(f"{g.replace('_', ' ')} {scores[g]['value']:.3f}" for g in GROUPS
                     if scores[g]["examples"])
  log(f"{task} {arm} seed {seed}: {metric} {value:.4f} ({groups}) ({seconds:.0f} s)")
  return {"value": value, "by_evidence": {g: scores[g] for g in GROUPS},
          "also": {k: float(results[k]) for k in ALSO[task]}, "seconds": seconds}


# ----------------------------------------------------------------------------------------------
# Summaries, verdict


def _group(c: dict | None) -> str:
  return svl._group(c) if c else "no example"


def summarize_study(study: dict) -> dict:
  for entry in study["tasks"].values():
    svl.summarize_task(entry)
  # The headline "arms", "comparisons" and "detectable_difference" every study JSON carries: the
  # first task's (coreference, when run).
  headline = next(iter(study["tasks"].values()))
  for key in ("arms", "comparisons", "detectable_difference"):
    study[key] = headline[key]
  parts, scales = [], []
  setup = study["setup"]
  for task, entry in study["tasks"].items():
    c, ev, arms = entry["comparisons"][0], entry["by_evidence_comparisons"], entry["arms"]
    parts.append(
        f"{task} ({entry['metric']}; trivial predictor {entry['data']['trivial']:.3f}): "
        f"longformer {arms['longformer']['mean']:.3f} ± {arms['longformer']['std']:.3f} vs "
        f"segments {arms['segments']['mean']:.3f} ± {arms['segments']['std']:.3f}, "
        f"{c['difference']:+.3f} (detectable {c['detectable_difference']:.3f}): {c['outcome']}; "
        f"links or evidence in one segment {_group(ev['one_segment'])}, across segments "
        f"{_group(ev['across_segments'])}")
    scales.append(f"{task}: segments of {setup[task]['segment']} in rows of "
                  f"{setup[task]['max_length']}, {setup[task]['steps']} steps")
  study["verdict"] = (
      "; ".join(parts) + f". Scale: {len(setup['seeds'])} seeds per arm, paired by seed, a tiny "
      f"random-weight model ({'; '.join(scales)}; the paper: 512 and 4,096); only the direction "
      f"and where a gain lives compare with the paper's Table 7 (base: HotpotQA 63.5 -> 64.4 "
      f"joint F1, OntoNotes 78.4 -> 78.6 average F1). Rule: {study_lib.RULE}.")
  return study


# ----------------------------------------------------------------------------------------------


def run(args, presets: dict, log, start: float) -> dict:
  import jax
  from tqdm import tqdm
  seeds = list(args.seeds)
  tasks = list(presets)
  runs = {task: {arm: [] for arm in ARMS} for task in tasks}
  with tempfile.TemporaryDirectory() as tmp:
    root = Path(tmp)
    data = build_data(presets, root)
    for task in tasks:
      log(f"{task}: {presets[task]['train']} training and {presets[task]['eval']} held-out "
          f"examples, {data[task]['one_segment_share']:.3f} of the held out with their links or "
          f"evidence in one segment; the trivial predictor's {METRICS[task]} "
          f"{data[task]['trivial']:.3f}")
    total = len(seeds) * len(ARMS) * sum(presets[t]["steps"] for t in tasks)
    with tqdm(total=total, unit="step", desc=STUDY, file=sys.stderr, dynamic_ncols=True) as bar:
      for seed in seeds:
        for task in tasks:
          p = presets[task]
          model = svl.short_model_made_long(p, seed, root / f"start_{task}_{seed}")
          for arm in ARMS:
            bar.set_postfix_str(f"{task} {arm} seed {seed}")
            runs[task][arm].append(run_arm(task, arm, seed, p, model, data,
                                           root / f"{task}_{arm}_{seed}", log))
            bar.update(p["steps"])
  entries = {}
  for task in tasks:
    arms = {}
    for arm, rs in runs[task].items():
      arms[arm] = svl.arm_entry(seeds, rs)
      arms[arm]["also"] = {k: study_lib.stats([r["also"][k] for r in rs]) for k in ALSO[task]}
    p = presets[task]
    entries[task] = {"metric": METRICS[task], "arms": arms,
                   "data": {"one_segment_share": data[task]["one_segment_share"],
                            "trivial": data[task]["trivial"], "segment": p["segment"],
                            "max_length": p["max_length"]}}
  seconds = round(time.perf_counter() - start, 1)
  return {
      "study": STUDY,
      "metric": "held-out CoNLL F1 (coreference) and joint F1 (HotpotQA) of train.finetune's "
                "results.json, per seed; by group (links or evidence within one segment, or "
                "across segments) from the run's predictions with the same scorer",
      "tasks": entries,
      "paper": PAPER,
      "setup": {**presets, "size": args.size_name, "device": args.device, "seeds": seeds,
                "data": "coreference: data.coref_generate documents (filler words); HotpotQA: "
                        "data.hotpotqa_generate records (filler sentences); word-level "
                        "tokenizers of their words",
                "start": "per seed and task one tiny masked LM, its first segment+2 position "
                         "rows copied over the long table, global projections copied from the "
                         "local ones, saved once; both arms fine-tune it",
                "arms": {task: {arm: arm_arguments(task, arm, presets[task]) for arm in ARMS}
                         for task in tasks},
                "seconds": seconds, "minutes": round(seconds / 60, 1),
                "devices": str(jax.devices()), **study_lib.harness.stamp()},
      "seconds": seconds,
  }


def _arguments(parser) -> None:
  parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS),
                      help="the tasks to run (default: both)")


def main(argv: Sequence[str] | None = None) -> int:
  args, p = study_lib.parse_preset(__doc__, STUDY, argv, PRESETS, _arguments)
  tasks = [t for t in TASKS if t in args.tasks]
  presets = copy.deepcopy({task: p[task] for task in tasks})
  if args.steps is not None:  # --steps sets every task's budget
    for task in tasks:
      presets[task]["steps"] = args.steps
  study = study_lib.run_or_replot(args, STUDY, lambda log, start: run(args, presets, log, start),
                                  summarize_study, svl.plot)
  print(study["verdict"])
  return 0


if __name__ == "__main__":
  sys.exit(study_lib.cli(main))
