"""The parent's report: the section part files merged into gpu_suite.json, gpu_suite.md and
gpu_suite.png, with a summary against the GPU targets.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import sys
import time

import harness

from .common import SECTION_NAMES


def read_part(path: pathlib.Path) -> dict:
  section = dict(rows=[], notes={}, meta=None, done=None)
  if not path.exists():
    return section
  for line in path.read_text(encoding="utf-8").splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue  # a line cut by a kill
    kind = record.pop("type", None)
    if kind == "row":
      section["rows"].append(record)
    elif kind == "note":
      for key, value in record.items():
        if isinstance(value, dict) and isinstance(section["notes"].get(key), dict):
          section["notes"][key].update(value)
        else:
          section["notes"][key] = value
    elif kind in ("meta", "done"):
      section[kind] = record
  return section


class Report:
  def __init__(self, args, order):
    self.out = pathlib.Path(args.out)
    self.parts = self.out / "gpu_suite_parts"
    self.order = order
    self.t0 = args.t0
    self.meta = dict(started=datetime.datetime.now().isoformat(timespec="seconds"),
                     argv=sys.argv[1:], budget_s=args.budget_s, tiny=args.tiny,
                     sections=[f"{k}: {SECTION_NAMES[k]}" for k in order],
                     python=sys.version.split()[0])
    self.state = {k: dict(name=SECTION_NAMES[k], status="pending") for k in order}

  def set(self, key, **fields):
    self.state[key].update(fields)

  def build(self) -> dict:
    sections = {}
    for key in self.order:
      part = read_part(self.parts / f"{key}.jsonl")
      entry = dict(self.state[key])
      entry.update(rows=part["rows"], notes=part["notes"])
      if part["meta"]:
        self.meta.setdefault("device", part["meta"]["device"])
        self.meta.setdefault("jax", part["meta"]["jax"])
      if entry["status"] in ("done", "running") and part["done"]:
        entry["status"] = part["done"]["status"]
      if entry["status"] == "done" and any(r.get("status") == "skipped" for r in entry["rows"]):
        entry["status"] = "partial"
      if part["notes"].get("skip_reason") and not entry.get("skip_reason"):
        entry["skip_reason"] = part["notes"]["skip_reason"]
      sections[SECTION_NAMES[key]] = entry
    summary = summarize(sections)
    return dict(meta=dict(self.meta, elapsed_s=round(time.time() - self.t0, 1)),
                summary=summary, sections=sections)

  def write(self, png: bool = False) -> dict:
    report = self.build()
    harness.write_json(self.out / "gpu_suite.json", report, indent=1)
    harness.write_text(self.out / "gpu_suite.md", markdown(report))
    if png:
      try:
        harness.write_png(self.out / "gpu_suite.png", plot_figure(report), dpi=100)
      except Exception as e:  # the numbers matter more
        print(f"PNG not written: {type(e).__name__}: {e}", flush=True)
    return report


def summarize(sections: dict) -> dict:
  """Ratios against the GPU targets (docs/pallas.md), from whatever rows exist."""
  summary = {}
  attn = [r for r in sections.get("attention", {}).get("rows", []) if r.get("status") == "ok"]
  by = {(r["impl"], r["variant"], r["seq"], r["batch"]): r for r in attn}
  ratios = []
  for (impl, variant, seq, batch), r in sorted(by.items()):
    plain = by.get((impl, "bidir", seq, batch))
    if variant.startswith("bidir dil") and plain:
      ratio = r["ms_fwdbwd"] / plain["ms_fwdbwd"]
      ratios.append(dict(impl=impl, seq=seq, batch=batch, ratio=round(ratio, 3),
                         target_met=ratio <= 1.25))
  summary["dilation_global_vs_plain_band_fwdbwd"] = ratios
  speedups = []
  for (impl, variant, seq, batch), r in sorted(by.items()):
    fast = by.get(("pallas", variant, seq, batch))
    if impl == "chunked" and fast:
      speedups.append(dict(variant=variant, seq=seq, batch=batch,
                           pallas_speedup=round(r["ms_fwdbwd"] / fast["ms_fwdbwd"], 3)))
  summary["pallas_vs_chunked_fwdbwd"] = speedups
  model = [r for r in sections.get("model", {}).get("rows", []) if r.get("status") == "ok"]
  ratios = []
  for r in model:
    for base_row in ("hf_transformers", "full_attention"):
      base = next((b for b in model if b.get("row") == base_row and b["seq"] == r["seq"]
                   and b["batch"] == r["batch"]), None)
      if base and r.get("row", "").startswith("longformer_jax"):
        ratios.append(dict(row=r["row"], vs=base_row, seq=r["seq"], batch=r["batch"],
                           tokens_per_s_ratio=round(r["tokens_per_s"] / base["tokens_per_s"], 3)))
  summary["model_tokens_per_s_ratios"] = ratios
  checks = [r for s in ("correctness",) for r in sections.get(s, {}).get("rows", [])]
  summary["correctness_ok"] = (all(r.get("status") == "ok" for r in checks) if checks
                               else None)
  peers = sections.get("peers", {}).get("rows", [])
  summary["peer_checks_failed"] = [
      dict(peer=r.get("peer"), mode=r.get("mode"), seq=r.get("seq"), batch=r.get("batch"),
           max_abs_diff=r.get("max_abs_diff"), error=r.get("error"))
      for r in peers if r.get("status") == "failed"]
  cudnn = sections.get("cudnn_window", {}).get("notes", {})
  if cudnn.get("verdict"):
    summary["cudnn_verdict"] = cudnn["verdict"]
  return summary


def _fmt(x, spec=".3f"):
  if x is None or x == "":
    return ""
  return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def markdown(report: dict) -> str:
  meta, sections, summary = report["meta"], report["sections"], report["summary"]
  out = [f"# GPU suite: {meta.get('device', '?')}, jax {meta.get('jax', '?')}, "
         f"{meta['started']}" + (" (--tiny: toy sizes, numbers mean nothing)" if meta["tiny"]
                                  else ""),
         "", f"Budget {meta['budget_s']} s, elapsed {meta['elapsed_s']} s. Only ratios between "
         "rows of this run mean anything.", "", "| section | status | seconds | rows | note |",
         "| --- | --- | --- | --- | --- |"]
  for name, s in sections.items():
    note = s.get("skip_reason") or s.get("error") or s.get("notes", {}).get("error") or ""
    out.append(f"| {name} | {s['status']} | {_fmt(s.get('seconds'), '.0f')} | "
               f"{len(s.get('rows', []))} | {str(note)[:160]} |")
  out += ["", "## Summary", "", "```", json.dumps(summary, indent=1), "```"]
  columns = {
      "correctness": ("kind", "impl", "dtype", "causal", "seq", "dilation", "globals", "status",
                      "errors", "error"),
      "attention": ("impl", "variant", "seq", "batch", "status", "ms_fwd", "ms_fwdbwd",
                    "tflops_fwdbwd", "peak_bytes", "max_abs_diff_vs_pallas", "error", "reason"),
      "model": ("impl", "seq", "batch", "status", "ms_step", "tokens_per_s",
                "model_tflops_per_s", "mfu", "peak_bytes", "error", "reason"),
      "cudnn_window": ("kind", "form", "stage", "seq", "window", "batch", "heads", "status",
                       "agrees", "max_abs_diff", "first_bad_row", "bad_rows", "matches", "errors",
                       "error", "question", "reason"),
      "peers": ("peer", "mode", "seq", "batch", "status", "max_abs_diff", "limit", "ms_fwd",
                "ms_fwdbwd", "tflops_fwdbwd", "fwdbwd_error", "error", "reason"),
      "block_sweep": ("stage", "block_sizes", "status", "ms_fwdbwd", "max_error", "error"),
  }
  for name, s in sections.items():
    out += ["", f"## {name}", ""]
    if s.get("skip_reason"):
      out += [f"Skip reason: {s['skip_reason']}", ""]
    cols = columns[name]
    rows = s.get("rows", [])
    if rows:
      out += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
      for r in rows:
        cells = []
        for c in cols:
          value = r.get(c)
          if c == "block_sizes" and isinstance(value, dict):
            value = "/".join(str(v) for v in value.values())
          if isinstance(value, dict):
            value = ", ".join(f"{k}: {_fmt(v, '.3g')}" for k, v in value.items())
          cells.append(_fmt(value, ".4g").replace("|", "/").replace("\n", " ")[:200])
        out.append("| " + " | ".join(cells) + " |")
    notes = {k: v for k, v in s.get("notes", {}).items() if k not in ("skip_reason",)}
    if name == "model":
      for r in rows:
        if r.get("trace"):
          import model as model_bench
          out += ["", "```", model_bench.format_top_ops(r["trace"]), "```"]
    if notes:
      out += ["", "```", json.dumps(notes, indent=1, default=harness.json_default)[:6000], "```"]
  return "\n".join(out) + "\n"


def _seq(row) -> str:
  return f"{row['seq'] // 1024}k" if row["seq"] >= 1024 else str(row["seq"])


def plot_figure(report: dict):
  """Four panels: attention fwd+bwd ms, model tokens/s (MFU), peers vs ours, sweep."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  sections = report["sections"]
  fig, axes = plt.subplots(2, 2, figsize=(14, 9))
  ok = lambda name: [r for r in sections.get(name, {}).get("rows", []) if r.get("status") == "ok"]

  def bars(ax, labels, values, title, ylabel, notes=None):
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=6)
    ax.set(title=title, ylabel=ylabel)
    for i, note in enumerate(notes or []):
      ax.annotate(note, (i, values[i]), ha="center", va="bottom", fontsize=6)
    if not values:
      ax.text(0.5, 0.5, "no rows", ha="center", transform=ax.transAxes)

  attn = ok("attention")
  bars(axes[0, 0], [f"{r['impl']} {r['variant']} {_seq(r)} x{r['batch']}" for r in attn],
       [r["ms_fwdbwd"] for r in attn], "attention fwd+bwd (ours)", "ms")
  axes[0, 0].set_yscale("log")
  model = ok("model")
  bars(axes[0, 1], [f"{r.get('row', r['impl'])} {r['seq']}x{r['batch']}" for r in model],
       [r["tokens_per_s"] for r in model], "whole model, training step", "tokens/s",
       ["" if r.get("mfu") is None else f"{100 * r['mfu']:.0f}%" for r in model])
  peers = ok("peers")
  ours = {(r["mode"], r["seq"], r["batch"]): r["ms_fwdbwd"] for r in attn
          if r["impl"] == "pallas" and r["variant"] in ("bidir", "causal")}
  labels, values = [], []
  for r in peers:
    if r.get("ms_fwdbwd") and (r["mode"], r["seq"], r["batch"]) in ours:
      labels.append(f"{r['peer']} {r['mode']} {_seq(r)} x{r['batch']}")
      values.append(r["ms_fwdbwd"] / ours[(r["mode"], r["seq"], r["batch"])])
  bars(axes[1, 0], labels, values, "peers: fwd+bwd time / ours (pallas); > 1: ours faster",
       "ratio")
  sweep = ok("block_sweep")
  bars(axes[1, 1], ["/".join(str(v) for v in r["block_sizes"].values()) for r in sweep],
       [r["ms_fwdbwd"] for r in sweep], "Pallas block sweep (q/k, dkv q/k, dq q/k, warps/stages)",
       "fwd+bwd ms")
  meta = report["meta"]
  fig.suptitle(f"{meta.get('device', '?')} jax {meta.get('jax', '?')} {meta['started']}"
               + (" (--tiny: numbers mean nothing)" if meta["tiny"] else ""))
  fig.tight_layout()
  return fig
