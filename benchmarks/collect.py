"""Collect one device call's benchmark records into `benchmarks/results/<gpu>-<date>.json` and the docs table.

    python benchmarks/collect.py --inputs ours.jsonl results.jsonl --gpu "NVIDIA H200" --date 2026-12-01 \
        --out benchmarks/results/h200-2026-12-01.json --docs docs/benchmarks.md

Inputs are JSONL files (or JSON lists) holding our records (`benchmarks/run.py`, already in the results format:
`workload`, `system`, `tokens_per_s`, ...) and the anchors' (mapped by `anchor_records.py`).

Per (workload, system) the record with the highest tokens/s is kept (a micro-batch sweep gives several); the others
are listed in its `settings["runs"]`. Sequence-sweep workloads (`workloads.is_sweep`) keep the record at `max_seq`,
the longest sequence that produced a tokens/s, with every sequence's tokens/s in `settings["per_seq_tokens_per_s"]`
and the failures in `settings["failed_seqs"]`. A (workload, system) without any tokens/s is kept with
`tokens_per_s: null`, its `status` ("OOM", "ERROR", "EXITED") and `error`.

The output JSON is a list of records: `workload`, `system`, `tokens_per_s`, `max_seq` (sweep workloads, else null),
`seq`, `mfu`, `gpu_peak_gib`, `host_peak_gib`, `gpu`, `commit`, `date`, `status`, `error` (failures), `ratios`
(tokens/s over each of `anchor_records.RATIO_BASES`, where present; for sweeps at the longest sequence both ran),
`source` and `settings` (with `optimizer_step`, `max_grad_norm` and `logging_steps`).

`--docs` rewrites only the part of the page between `<!-- results:begin -->` and `<!-- results:end -->` (appended
under a "Results (latest run)" heading when the page has no markers).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.anchor_records import RATIO_BASES, anchor_entries  # noqa: E402
from benchmarks.commit import git_commit  # noqa: E402
from benchmarks.results_page import render_section, rewrite_docs  # noqa: E402
from benchmarks.workloads import is_sweep  # noqa: E402

WORKLOAD_ORDER = ["qwen3-1.7b-full-s4096-b8", "qwen3-4b-full-s4096-b8-cap24", "llama3.1-8b-lora-s4096-b8",
                  "llama3.1-8b-lora-s4096-b8-cap24", "qwen3-1.7b-cap24-b1"]
SYSTEM_ORDER = ["roundpipe-engine", "roundpipe-engine-sync-optimizer", "roundpipe-trainer", "roundpipe-trainer-clip1",
                "roundpipe-accelerate-loop", "roundpipe-accelerate-loop-sync-optimizer", "reference-0.1.1", "in-gpu",
                "in-gpu-liger", "in-gpu-liger-nockpt", "fsdp2-offload", "deepspeed-zero3-offload"]

_RUN_FIELDS = ("workload", "system", "seq", "tokens_per_s", "mfu", "gpu_peak_gib", "host_peak_gib", "status",
               "error", "settings", "source", "gpu", "commit")
# Measurements and notes, not configuration: left out of `settings["runs"]`.
_MEASURED = {"iter_s", "median_iter_s", "tokens_per_s_mean", "model_TFLOPs", "MFU_vs_989", "flops_per_token",
             "params", "trainable", "warmup_s", "max_reserved_gib", "fwd_bwd_s", "opt_step_s", "micro_batches_tried",
             "step_s", "losses", "path", "partition", "method_from", "global_batch_inferred", "liger"}


# ---------------------------------------------------------------------------------------------- reading


def load_records(paths: list[str]) -> list[tuple[str, dict]]:
    """(file name, record) for every record of every input, in file order."""
    out = []
    for path in paths:
        text = Path(path).read_text()
        if text.lstrip().startswith("["):
            items = json.loads(text)
        else:
            items = []
            for number, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError:
                    print(f"[collect] {path}:{number}: not JSON, skipped", file=sys.stderr)
        out.extend((os.path.basename(path), item) for item in items if isinstance(item, dict))
    return out


def our_entries(records: list[tuple[str, dict]]) -> list[dict]:
    """Our records (`workload` + `system`) as run entries."""
    entries = []
    for name, record in records:
        if "workload" in record and "system" in record:
            entry = {k: record.get(k) for k in _RUN_FIELDS}
            entry["settings"] = dict(record["settings"])
            entry["source"] = entry["source"] or f"ours {name}"
            entries.append(entry)
    return entries


# ---------------------------------------------------------------------------------------------- aggregating


def _distinguishing(entries: list[dict]) -> list[str]:
    """Scalar settings whose values differ between the entries (what the sweep varied)."""
    keys = set().union(*(e["settings"] for e in entries)) - _MEASURED
    out = []
    for key in sorted(keys):
        values = {json.dumps(e["settings"].get(key), sort_keys=True) for e in entries}
        if len(values) > 1 and all(not isinstance(e["settings"].get(key), (dict, list)) for e in entries):
            out.append(key)
    return out


def _runs(entries: list[dict]) -> list[dict]:
    keys = _distinguishing(entries)
    return [{"seq": e["seq"], "tokens_per_s": e["tokens_per_s"], "status": e["status"],
             **{k: e["settings"].get(k) for k in keys}} for e in entries]


def _as_record(entry: dict, max_seq: int | None) -> dict:
    record = {k: entry.get(k) for k in _RUN_FIELDS}
    record["max_seq"] = max_seq
    record["settings"] = dict(entry["settings"])
    if record["tokens_per_s"] is not None:
        record["status"], record["error"] = "ok", None
    return record


def aggregate(entries: list[dict]) -> list[dict]:
    """One record per (workload, system): the best tokens/s, or for sweep workloads the best at `max_seq`."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for entry in entries:
        groups.setdefault((entry["workload"], entry["system"]), []).append(entry)
    out = []
    for (workload, _), group in groups.items():
        ok = [e for e in group if e["tokens_per_s"] is not None]
        failed = [e for e in group if e["tokens_per_s"] is None]
        if not is_sweep(workload):
            if ok:
                record = _as_record(max(ok, key=lambda e: e["tokens_per_s"]), None)
            else:
                record = _as_record(failed[0], None)
            if len(group) > 1:
                record["settings"]["runs"] = _runs(group)
            out.append(record)
            continue
        best_per_seq: dict[int, dict] = {}
        for e in ok:
            if e["seq"] not in best_per_seq or e["tokens_per_s"] > best_per_seq[e["seq"]]["tokens_per_s"]:
                best_per_seq[e["seq"]] = e
        failed_seqs = {str(e["seq"]): e["status"] for e in failed if e["seq"] not in best_per_seq}
        if best_per_seq:
            max_seq = max(best_per_seq)
            record = _as_record(best_per_seq[max_seq], max_seq)
        else:
            record = _as_record(failed[0], None)
        record["settings"]["per_seq_tokens_per_s"] = {str(s): best_per_seq[s]["tokens_per_s"]
                                                      for s in sorted(best_per_seq)}
        record["settings"]["failed_seqs"] = failed_seqs
        if failed_seqs and record["tokens_per_s"] is not None:
            first = min(failed, key=lambda e: e["seq"] or 0)
            record["settings"]["first_failure"] = {"seq": first["seq"], "status": first["status"],
                                                   "error": (first.get("error") or "")[:300]}
        out.append(record)
    return out


def _ratio_pair(record: dict, base: dict, sweep: bool) -> float | None:
    if record["tokens_per_s"] is None or base["tokens_per_s"] is None:
        return None
    if not sweep:
        return round(record["tokens_per_s"] / base["tokens_per_s"], 3)
    ours = {int(k): v for k, v in record["settings"].get("per_seq_tokens_per_s", {}).items()}
    theirs = {int(k): v for k, v in base["settings"].get("per_seq_tokens_per_s", {}).items()}
    common = set(ours) & set(theirs)
    if not common:
        return None
    seq = max(common)
    return round(ours[seq] / theirs[seq], 3)


def _order(records: list[dict]) -> list[dict]:
    def key(r):
        w, s = r["workload"], r["system"]
        return (WORKLOAD_ORDER.index(w) if w in WORKLOAD_ORDER else len(WORKLOAD_ORDER), w,
                SYSTEM_ORDER.index(s) if s in SYSTEM_ORDER else len(SYSTEM_ORDER), s)

    return sorted(records, key=key)


def finalize(records: list[dict], gpu: str, date: str, commit: str) -> list[dict]:
    """Add gpu, date, commit (ours keep the commit they ran) and the ratios; order by workload, then system."""
    by_key = {(r["workload"], r["system"]): r for r in records}
    out = []
    for record in _order(records):
        sweep = is_sweep(record["workload"])
        ratios = {}
        for base_name in RATIO_BASES:
            base = by_key.get((record["workload"], base_name))
            if base is not None and base is not record:
                value = _ratio_pair(record, base, sweep)
                if value is not None:
                    ratios[base_name] = value
        record = {"workload": record["workload"], "system": record["system"], "tokens_per_s": record["tokens_per_s"],
                  "max_seq": record["max_seq"], "seq": record["seq"], "mfu": record["mfu"],
                  "gpu_peak_gib": record["gpu_peak_gib"], "host_peak_gib": record["host_peak_gib"], "gpu": gpu,
                  "commit": record.get("commit") or commit, "date": date, "status": record["status"],
                  **({"error": record["error"]} if record["tokens_per_s"] is None else {}), "ratios": ratios,
                  "source": record["source"], "settings": record["settings"]}
        out.append(record)
    return out


def collect(paths: list[str], gpu: str, date: str, commit: str | None = None,
            section_system: dict[str, str] | None = None, section_workload: dict[str, str] | None = None) -> list[dict]:
    records = load_records(paths)
    entries = our_entries(records) + anchor_entries(records, section_system, section_workload)
    if commit is None:
        ours = [e["commit"] for e in entries if e.get("commit")]
        commit = Counter(ours).most_common(1)[0][0] if ours else git_commit()
    return finalize(aggregate(entries), gpu, date, commit)


# ---------------------------------------------------------------------------------------------- command line


def _pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for value in values or []:
        if "=" not in value:
            raise SystemExit(f"{what} takes SECTION=NAME, got {value!r}")
        key, name = value.split("=", 1)
        out[key] = name
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", nargs="+", required=True, help="JSONL (or JSON list) files: ours and anchors'")
    parser.add_argument("--gpu", required=True, help='e.g. "NVIDIA H200"')
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--commit", default=None, help="default: the commit of our records, else git HEAD")
    parser.add_argument("--out", required=True, help="benchmarks/results/<gpu>-<date>.json")
    parser.add_argument("--docs", default=None, help="page whose marked results section is rewritten")
    parser.add_argument("--section-system", action="append", default=[], metavar="SECTION=SYSTEM",
                        help="system name for every anchor record of this --section (overrides the mapping)")
    parser.add_argument("--section-workload", action="append", default=[], metavar="SECTION=WORKLOAD",
                        help="workload name for every anchor record of this --section")
    args = parser.parse_args(argv)
    records = collect(args.inputs, args.gpu, args.date, args.commit,
                      _pairs(args.section_system, "--section-system"),
                      _pairs(args.section_workload, "--section-workload"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(records, indent=2) + "\n")
    print(f"[collect] {len(records)} records -> {args.out}")
    if args.docs:
        try:
            shown = os.path.relpath(args.out, Path(args.docs).resolve().parents[1])
        except ValueError:
            shown = args.out
        rewrite_docs(args.docs, render_section(records, shown))
        print(f"[collect] rewrote the results section of {args.docs}")
    return records


if __name__ == "__main__":
    main()
