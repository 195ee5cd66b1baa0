"""One line per record of a device call, for the screen at its end (`scripts/device/bench.sh` prints it): our
`benchmarks/run.py` records, the anchors' and `benchmarks/convergence.py`'s, each with its speed, memory, how it
stepped and its loss, and its tokens/s over the baseline of its comparison measured in the same files (HF + Liger in
GPU memory for a workload, the plain Trainer for the convergence preset).

    python benchmarks/call_summary.py $OUT/ours.jsonl $OUT/results.jsonl $OUT/convergence_*.jsonl

The records themselves are what count (collect.py reads them); this only reads them back.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.anchor_records import anchor_entries  # noqa: E402
from benchmarks.collect import load_records  # noqa: E402

BASELINE = "in-gpu-liger"  # a workload's tokens/s is divided by this anchor's (same workload, same files)
PLAIN = "hf"  # convergence.py's plain Trainer


def _num(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(value, base) -> str:
    return "-" if value is None or not base else f"{value / base:.3f}x"


def _losses(losses: list | None) -> str:
    if not losses:
        return "-"
    values = [v[1] if isinstance(v, (list, tuple)) else v for v in losses]
    return f"{values[0]:.4f}" if len(values) == 1 else f"{values[0]:.4f}..{values[-1]:.4f}"


def _placement(settings: dict) -> str:
    """The setting, and what the engine placed: 'auto (28/29 buckets, 25.4 GiB on device)', and with a disk tier
    'auto+disk (4/38 buckets, 11.0 GiB on device; 34 on disk, 38.4 GiB)'."""
    placed = (settings.get("path") or {}).get("optimizer_placement")
    text = settings.get("optimizer_placement", "-")
    if placed:
        # The record counts the disk's buckets apart from the host's (`host_buckets` holds those whose state stays
        # in host memory), so the total names all three tiers.
        disk = placed.get("disk") or {}
        total = placed["device_buckets"] + placed["host_buckets"] + disk.get("buckets", 0)
        text += f" ({placed['device_buckets']}/{total} buckets, {placed['device_gib']:.1f} GiB on device"
        if disk.get("buckets"):
            text += f"; {disk['buckets']} on disk, {disk['gib']:.1f} GiB"
        text += ")"
    return text


def run_lines(ours: list[dict], anchors: list[dict]) -> list[str]:
    """Our records and the anchors', grouped by workload, each against the workload's baseline anchor."""
    base = {a["workload"]: a["tokens_per_s"] for a in anchors if a["system"] == BASELINE and a["tokens_per_s"]}
    anchors = [dict(a, tokens_per_s_median_step=a["tokens_per_s"]) for a in anchors]  # theirs is the median step
    lines = []
    for r in sorted(ours + anchors, key=lambda r: r["workload"]):
        s = r.get("settings", {})
        status = "" if r.get("status") == "ok" else f"  {r.get('status')}: {str(r.get('error'))[:160]}"
        lines.append(
            f"{r['workload']:34s} {r['system']:58s} {_num(r['tokens_per_s']):>8s} tok/s "
            f"(median step {_num(r.get('tokens_per_s_median_step')):>8s}, "
            f"{_ratio(r['tokens_per_s'], base.get(r['workload']))} {BASELINE})  "
            f"gpu {_num(r.get('gpu_peak_gib'), 1)} GiB, host {_num(r.get('host_peak_gib'), 1)} GiB  "
            f"placement {_placement(s)}, step {s.get('optimizer_step', '-')}, "
            f"clip {s.get('max_grad_norm', '-')}, logging {s.get('logging_steps', '-')}  "
            f"loss {_losses(r.get('losses'))}{status}")
    return lines


def convergence_lines(records: list[dict]) -> list[str]:
    """convergence.py's records, each against the plain Trainer of its regime (the last one in the files: a warm-up
    run of it comes first)."""
    base = {r["regime"]: r["tokens_per_s"] for r in records if r["system"] == PLAIN}
    med = {r["regime"]: r.get("tokens_per_s_median_step") for r in records if r["system"] == PLAIN}
    lines = []
    for r in records:
        s = r.get("settings", {})
        placement = "-" if s.get("roundpipe") is None else s["roundpipe"].get("optimizer_placement", "default")
        lines.append(
            f"{r['regime']:8s} {r['system']:10s} {_num(r['tokens_per_s']):>9s} tok/s "
            f"({_ratio(r['tokens_per_s'], base.get(r['regime']))} {PLAIN}; median step "
            f"{_num(r.get('tokens_per_s_median_step'))} tok/s, "
            f"{_ratio(r.get('tokens_per_s_median_step'), med.get(r['regime']))})"
            f"  held-out {r['final_eval_loss']:.4f}  "
            f"train loss {_losses(r.get('losses'))}  {s.get('optimizer_mode')}, placement {placement}, "
            f"clip {s.get('max_grad_norm')}, logging {s.get('logging_steps')}, {r.get('train_s')} s, "
            f"first step {r.get('first_step_s', '-')} s (prepare {r.get('prepare_s', '-')} s); whole train() "
            f"{r.get('train_runtime_s', '-')} s, evaluations {r.get('eval_runtime_s', '-')} s, final evaluate "
            f"{r.get('final_eval_runtime_s', '-')} s = {r.get('final_eval_samples_per_s', '-')} samples/s")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="JSONL files (missing ones are skipped)")
    args = parser.parse_args(argv)
    records = load_records([f for f in args.files if Path(f).is_file()])
    ours = [dict(r, settings=r.get("settings", {})) for _, r in records if "workload" in r and "system" in r]
    convergence = [r for _, r in records if "regime" in r and "final_eval_loss" in r]
    lines = run_lines(ours, anchor_entries(records)) + convergence_lines(convergence)
    for line in lines:
        print("SUMMARY " + line, flush=True)
    return lines


if __name__ == "__main__":
    main()
