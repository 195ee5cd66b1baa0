"""Collect one device call's benchmark records into `benchmarks/results/<gpu>-<date>.json` and a docs table.

    python benchmarks/collect.py --inputs ours.jsonl results.jsonl --gpu "NVIDIA H200" --date 2026-12-01 \
        --out benchmarks/results/h200-2026-12-01.json --docs docs/benchmarks.md

Inputs are JSONL files (or JSON lists) holding
- our records (`benchmarks/paths.py`), already in the results format: `workload`, `system`, `tokens_per_s`, ...;
- the anchors' records (`common.record()` of ingpu.py, rp.py, fsdp.py, ds.py: `section`, `method`, `model`, `seq`,
  `global_batch`, `mem_cap_gib`, `tokens_per_s_median`, `MFU_vs_989`, `max_alloc_gib`, `host_peak_rss_gib`,
  `status`, `error`), mapped to workload and system names (see `anchor_system` and `anchor_workload`).

Per (workload, system) the record with the highest tokens/s is kept (a micro-batch sweep gives several); the others
are listed in its `settings["runs"]`. Workloads named `<model>-cap<GiB>-b1` are sequence-length sweeps: the record
is the one at `max_seq`, the longest sequence that produced a tokens/s, with every sequence's tokens/s in
`settings["per_seq_tokens_per_s"]` and the failures in `settings["failed_seqs"]`. A (workload, system) without any
tokens/s is kept with `tokens_per_s: null`, its `status` ("OOM", "ERROR", "EXITED") and `error`.

The output JSON is a list of records: `workload`, `system`, `tokens_per_s`, `max_seq` (sweep workloads, else null),
`seq`, `mfu`, `gpu_peak_gib`, `host_peak_gib`, `gpu`, `commit`, `date`, `status`, `error` (failures), `ratios`
(tokens/s over each of reference-0.1.1 and in-gpu-liger, where present; for sweeps at the longest sequence both
ran), `source` and `settings`.

`--docs` rewrites only the part of the page between `<!-- results:begin -->` and `<!-- results:end -->` (appended
under a "Results (latest run)" heading when the page has no markers).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
HEADING = "## Results (latest run)"

WORKLOAD_ORDER = ["qwen3-1.7b-full-s4096-b8", "qwen3-4b-full-s4096-b8-cap24", "llama3.1-8b-lora-s4096-b8",
                  "qwen3-1.7b-cap24-b1"]
SYSTEM_ORDER = ["roundpipe-engine", "roundpipe-trainer", "roundpipe-accelerate-loop", "reference-0.1.1", "in-gpu",
                "in-gpu-liger", "in-gpu-liger-nockpt", "fsdp2-offload", "deepspeed-zero3-offload"]
RATIO_BASES = ["reference-0.1.1", "in-gpu-liger"]
SWEEP = re.compile(r"-cap[0-9.]+-b1$")
OURS_PREFIX = "roundpipe-"

# Anchor keys that become result fields; every other key of an anchor record is kept in `settings`.
_ANCHOR_MAPPED = ("tokens_per_s_median", "MFU_vs_989", "max_alloc_gib", "host_peak_rss_gib", "status", "error")
_RUN_FIELDS = ("workload", "system", "seq", "tokens_per_s", "mfu", "gpu_peak_gib", "host_peak_gib", "status",
               "error", "settings", "source", "gpu", "commit")


def is_sweep(workload: str) -> bool:
    return bool(SWEEP.search(workload))


def _num(value: float) -> str:
    return f"{value:g}"


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


# ---------------------------------------------------------------------------------------------- anchors


def _ingpu_flags(method: str) -> tuple[str, bool, bool]:
    words = method.split()
    mode = words[1] if len(words) > 1 else "bf16"
    return mode, "+liger" in method, "no-ckpt" in method


def anchor_system(record: dict) -> str:
    """ingpu.py: in-gpu[-amp][-liger][-nockpt]; rp.py: reference-<roundpipe version>; fsdp.py: fsdp2-offload (or
    fsdp2 without --offload); ds.py: deepspeed-zero<stage>-offload."""
    method = record.get("method", "")
    if method.startswith("in-GPU"):
        mode, liger, nockpt = _ingpu_flags(method)
        suffixes = ("-amp" if mode == "amp" else "", "-liger" if liger else "", "-nockpt" if nockpt else "")
        return "in-gpu" + "".join(suffixes)
    if method.startswith("roundpipe"):
        return f"reference-{record.get('roundpipe', '0.1.1')}"
    if method.startswith("FSDP2"):
        return "fsdp2-offload" if "CPUOffload" in method else "fsdp2"
    match = re.match(r"DeepSpeed ZeRO-(\d)", method)
    if match:
        return f"deepspeed-zero{match.group(1)}-offload"
    return re.sub(r"[^a-z0-9.]+", "-", method.lower()).strip("-")


def anchor_is_lora(record: dict) -> bool:
    method = record.get("method", "")
    return (method.startswith("in-GPU") and _ingpu_flags(method)[0] == "lora") or method == "roundpipe LoRA"


def anchor_workload(record: dict, global_batch: int | None = None) -> str | None:
    """`<model>-cap<GiB>-b1` for batch-1 runs under a memory cap (the sequence sweep), else
    `<model>-{full|lora}-s<seq>-b<batch>[-cap<GiB>]`. None when the batch is unknown."""
    gb = record.get("global_batch", global_batch)
    if gb is None:
        return None
    model, cap = record.get("model"), float(record.get("mem_cap_gib") or 0.0)
    if gb == 1 and cap:
        return f"{model}-cap{_num(cap)}-b1"
    mode = "lora" if anchor_is_lora(record) else "full"
    return f"{model}-{mode}-s{record.get('seq')}-b{gb}" + (f"-cap{_num(cap)}" if cap else "")


def _same_invocation(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("section", "model", "mem_cap_gib"))


def _resolve_lossy_ingpu(index: int, records: list[tuple[str, dict]]) -> tuple[str | None, str | None]:
    """ingpu.py's "every micro-batch ran out of memory" record says `method="in-GPU <mode>"` without the +liger /
    no-ckpt flags. Take them from the nearest earlier in-GPU record of the same file, section, model, mode and cap
    (the same invocation's sweep); returns (method, where it came from)."""
    name, record = records[index]
    mode = _ingpu_flags(record["method"])[0]
    for j in range(index - 1, -1, -1):
        other_name, other = records[j]
        if other_name != name:
            continue
        method = other.get("method", "")
        if method.startswith("in-GPU") and _ingpu_flags(method)[0] == mode and "micro_batches_tried" not in other \
                and _same_invocation(record, other):
            return method, f"{other_name}: the preceding in-GPU record of section {record.get('section')!r}"
    return None, None


def _infer_global_batch(index: int, records: list[tuple[str, dict]]) -> int | None:
    """ingpu.py's outer failure record has no `global_batch`: take it from a record of the same file, section,
    model and method (the same invocation)."""
    name, record = records[index]
    nearest_first = sorted(range(len(records)), key=lambda j: abs(j - index))
    for other_name, other in (records[j] for j in nearest_first):
        if other_name == name and other.get("global_batch") is not None and other.get("method") == record.get(
                "method") and _same_invocation(record, other):
            return other["global_batch"]
    return None


def _answers(attempt: dict, later: dict) -> bool:
    """`later` is the result of the configuration `attempt` announced (same values for every key of the attempt)."""
    return later.get("status", "ok") != "attempt" and all(
        later.get(k) == v for k, v in attempt.items() if k not in ("status", "torch", "transformers"))


def anchor_entries(records: list[tuple[str, dict]], section_system: dict[str, str] | None = None,
                   section_workload: dict[str, str] | None = None) -> list[dict]:
    """Every anchor record as a run entry (workload, system, seq, tokens_per_s, ...)."""
    section_system, section_workload = section_system or {}, section_workload or {}
    entries = []
    for index, (name, record) in enumerate(records):
        if "method" not in record or "workload" in record:
            continue  # hw.py's records, ours
        status = record.get("status", "ok")
        settings = {k: v for k, v in record.items() if k not in _ANCHOR_MAPPED}
        if status == "attempt":
            # rp.py writes an attempt before each configuration; a worker exception (e.g. CUDA OOM) makes roundpipe
            # call os._exit(1), so an attempt with no later result of the same configuration died.
            if any(n == name and _answers(record, r) for n, r in records[index + 1:]):
                continue
            status = "EXITED"
            record = {**record, "error": "the process exited during this configuration without a result (roundpipe "
                                         "0.1.1 calls os._exit(1) on a worker exception, e.g. CUDA out of memory)"}
        method = record["method"]
        if method.startswith("in-GPU") and "micro_batches_tried" in record:
            inherited, where = _resolve_lossy_ingpu(index, records)
            if inherited is not None and inherited != method:
                settings["method_from"] = where
                record = {**record, "method": inherited}
        system = section_system.get(record.get("section")) or anchor_system(record)
        gb = record.get("global_batch")
        if gb is None:
            gb = _infer_global_batch(index, records)
            settings["global_batch_inferred"] = gb
        workload = section_workload.get(record.get("section")) or anchor_workload(record, gb)
        if workload is None:
            print(f"[collect] {name}: no global batch for {record}; skipped (use --section-workload)",
                  file=sys.stderr)
            continue
        ok = status == "ok" and record.get("tokens_per_s_median") is not None
        status = "ok" if ok else (status if status != "ok" else "ERROR")
        settings["tokens_per_s_basis"] = "median of the timed steps, each synchronized"
        entries.append({
            "workload": workload, "system": system, "seq": record.get("seq"),
            "tokens_per_s": record.get("tokens_per_s_median") if ok else None,
            "mfu": record.get("MFU_vs_989") if ok else None, "gpu_peak_gib": record.get("max_alloc_gib"),
            "host_peak_gib": record.get("host_peak_rss_gib"), "status": status,
            "error": None if ok else (record.get("error") or status), "settings": settings,
            "source": f"anchor {name}"})
    return entries


# ---------------------------------------------------------------------------------------------- ours


def our_entries(records: list[tuple[str, dict]]) -> list[dict]:
    """Our records (`workload` + `system`), and the lines of the first-session script `hf_fullft.py` (system
    "accelerate_roundpipe"; since replaced by `paths.py`), as run entries."""
    entries = []
    for name, record in records:
        if "workload" in record and "system" in record:
            entry = {k: record.get(k) for k in _RUN_FIELDS}
            entry["settings"] = dict(record.get("settings") or {})
            if entry["seq"] is None:
                entry["seq"] = record.get("max_seq") or entry["settings"].get("seq")
            if entry["status"] is None:
                entry["status"] = "ok" if entry["tokens_per_s"] is not None else "ERROR"
            if entry["tokens_per_s"] is None and not entry["error"]:
                entry["error"] = entry["status"]
            entry["source"] = entry["source"] or f"ours {name}"
            entries.append(entry)
        elif record.get("system") == "accelerate_roundpipe" and "model" in record:
            settings = {k: v for k, v in record.items() if k not in ("tokens_per_s", "peak_gpu_gib", "commit")}
            entries.append({
                "workload": f"{record['model']}-full-s{record.get('seq')}-b{record.get('gb')}",
                "system": "roundpipe-engine", "seq": record.get("seq"), "tokens_per_s": record.get("tokens_per_s"),
                "mfu": None, "gpu_peak_gib": record.get("peak_gpu_gib"), "host_peak_gib": None, "status": "ok",
                "error": None, "settings": settings, "source": f"ours {name} (hf_fullft.py)",
                "commit": record.get("commit")})
    return entries


# ---------------------------------------------------------------------------------------------- aggregating


# Measurements and notes, not configuration: left out of `settings["runs"]`.
_MEASURED = {"iter_s", "median_iter_s", "tokens_per_s_mean", "model_TFLOPs", "flops_per_token", "params", "trainable",
             "warmup_s", "max_reserved_gib", "fwd_bwd_s", "opt_step_s", "micro_batches_tried", "step_s", "losses",
             "path", "partition", "method_from", "global_batch_inferred", "liger"}


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


def git_commit() -> str:
    """The commit a benchmark ran at: $BENCH_COMMIT (device calls copy a working tree without .git), else git's."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1])
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


# ---------------------------------------------------------------------------------------------- docs


def describe_workload(workload: str) -> str:
    match = re.match(r"^(?P<model>.+?)-(?P<mode>full|lora)-s(?P<seq>\d+)-b(?P<gb>\d+)(?:-cap(?P<cap>[0-9.]+))?$",
                     workload)
    if match:
        text = (f"{match['model']}, {'full fine-tune' if match['mode'] == 'full' else 'LoRA r=16 on every linear'}, "
                f"sequence {match['seq']}, global batch {match['gb']}")
        return text + (f", GPU memory capped at {match['cap']} GiB" if match["cap"] else "")
    match = re.match(r"^(?P<model>.+)-cap(?P<cap>[0-9.]+)-b1$", workload)
    if match:
        return (f"{match['model']}, full fine-tune, batch 1, GPU memory capped at {match['cap']} GiB, sequence length "
                f"swept upwards: `max_seq` is the longest sequence that trained, tok/s is measured there, ratios "
                f"compare tok/s at the longest sequence both systems ran")
    return workload


def _settings_summary(record: dict) -> str:
    s = record["settings"]
    parts = []
    for key in ("num_microbatches", "num_microbatch", "nms"):  # ours, rp.py, hf_fullft.py
        if s.get(key) is not None:
            parts.append(f"{s[key]} micro-batch" + ("es" if s[key] != 1 else ""))
            break
    if s.get("micro_batch") is not None:
        parts.append(f"micro-batch {s['micro_batch']}")
    if (s.get("grad_accum") or 1) > 1 or (s.get("accum_steps") or 1) > 1:
        parts.append(f"accumulation {s.get('grad_accum') or s.get('accum_steps')}")
    if s.get("recompute_grain"):
        parts.append(f"recompute {s['recompute_grain']}")
    if s.get("lora_adapters"):
        parts.append(s["lora_adapters"])
    path = s.get("path") or {}
    if isinstance(path, dict) and path.get("api"):
        parts.append(path["api"].split("(")[0].split(" + ")[0])
    if s.get("first_failure"):
        parts.append(f"{s['first_failure']['status']} at seq {s['first_failure']['seq']}")
    if record["tokens_per_s"] is None and record.get("error"):
        parts.append(f"error: {str(record['error'])[:80]}")
    return ", ".join(parts).replace("|", "/")


def _cell(value, fmt) -> str:
    return "" if value is None else fmt(value)


def render_section(records: list[dict], json_name: str | None = None) -> str:
    """The Markdown between the markers: one table per workload."""
    if not records:
        return "No results.\n"
    dates = sorted({r["date"] for r in records})
    commits = sorted({r["commit"] for r in records})
    gpus = sorted({r["gpu"] for r in records})
    versions = Counter()
    for r in records:
        for key in ("torch", "transformers"):
            if r["settings"].get(key):
                versions[f"{key} {r['settings'][key]}"] += 1
    lines = [f"<!-- written by benchmarks/collect.py{f' from {json_name}' if json_name else ''}; "
             f"edits between the markers are overwritten -->", "",
             f"Run of {', '.join(dates)}, commit {', '.join(commits)}, {', '.join(gpus)}"
             + (f" ({', '.join(sorted(versions))})" if versions else "") + ". Random-init models, bf16, sdpa; ours "
             "(`roundpipe-*`, `benchmarks/paths.py`): tok/s over the mean of the timed steps, synchronized at both "
             "ends; anchors: tok/s over the median step. MFU against 989 dense bf16 TFLOP/s with the anchors' FLOP "
             "count." + (f" Raw records: `{json_name}`." if json_name else ""), ""]
    workloads = []
    for r in records:
        if r["workload"] not in workloads:
            workloads.append(r["workload"])
    for workload in workloads:
        rows = [r for r in records if r["workload"] == workload]
        sweep = is_sweep(workload)
        bases = [b for b in RATIO_BASES if any(r["system"] == b and r["tokens_per_s"] is not None for r in rows)]
        header = ["system"] + (["max_seq"] if sweep else []) + ["tok/s"] + [f"vs {b}" for b in bases] + [
            "MFU", "GPU peak GiB", "host peak GiB", "settings"]
        when = (f"Measured {', '.join(sorted({r['date'] for r in rows}))}, commit "
                f"{', '.join(sorted({r['commit'] for r in rows}))}, {', '.join(sorted({r['gpu'] for r in rows}))}.")
        lines += [f"### {workload}", "", f"{describe_workload(workload)}. {when}", "",
                  "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for r in rows:
            if r["tokens_per_s"] is None:
                speed = "OOM" if r["status"] == "OOM" else "failed"
            else:
                speed = f"{r['tokens_per_s']:,.0f}"
            cells = [f"`{r['system']}`"] + ([_cell(r["max_seq"], str)] if sweep else []) + [speed]
            cells += [_cell(r["ratios"].get(b), lambda v: f"{v:.2f}x") if r["system"] != b else "1.00x"
                      for b in bases]
            cells += [_cell(r["mfu"], lambda v: f"{100 * v:.1f}%"), _cell(r["gpu_peak_gib"], lambda v: f"{v:.2f}"),
                      _cell(r["host_peak_gib"], lambda v: f"{v:.1f}"), _settings_summary(r)]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def rewrite_docs(path: str, section: str) -> None:
    """Replace the text between the markers (keeping them); append the markers under HEADING when absent."""
    text = Path(path).read_text()
    body = "\n" + section.strip("\n") + "\n\n"
    begin, end = text.find(BEGIN), text.find(END)
    if begin == -1 and end == -1:
        new = text + ("" if text.endswith("\n") or not text else "\n") + f"\n{HEADING}\n\n{BEGIN}{body}{END}\n"
    elif begin == -1 or end == -1 or end < begin or text.count(BEGIN) > 1 or text.count(END) > 1:
        raise ValueError(f"{path}: expected one {BEGIN} followed by one {END}")
    else:
        new = text[:begin + len(BEGIN)] + body + text[end:]
    Path(path).write_text(new)


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
