"""The results section of docs/benchmarks.md: one table per workload, written between two markers."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from benchmarks.anchor_records import RATIO_BASES
from benchmarks.workloads import is_sweep

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
HEADING = "## Results (latest run)"


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


def _training_summary(s: dict) -> list[str]:
    """Optimizer mode, clipping and logging, which every record states."""
    parts = []
    if s.get("optimizer_step"):
        parts.append(f"{s['optimizer_step'].split()[0]} optimizer")
    if "max_grad_norm" in s:
        parts.append(f"clip {s['max_grad_norm']:g}" if s["max_grad_norm"] else "no clipping")
    if "logging_steps" in s:
        steps = s["logging_steps"]
        parts.append("loss not read" if steps is None else "loss read every step" if steps == 1
                     else f"logging every {steps} steps")
    return parts


def _settings_summary(record: dict) -> str:
    s = record["settings"]
    parts = []
    for key in ("num_microbatches", "num_microbatch"):  # ours, rp.py
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
    parts += _training_summary(s)
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
             "(`roundpipe-*`, `benchmarks/run.py`): tok/s over the mean of the timed steps, synchronized at both "
             "ends; anchors: tok/s over the median step. MFU: model FLOPs (6 x trainable and 4 x frozen matrix "
             "weights, causal attention, recomputation not counted: `training_flops_per_token` in "
             "`accelerate_roundpipe/telemetry/metrics.py`), the anchors' recounted the same way, over 989 dense bf16 "
             "TFLOP/s." + (f" Raw records: `{json_name}`." if json_name else ""), ""]
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
