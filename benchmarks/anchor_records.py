"""The anchors' records (`common.record()` of ../shared/anchors: ingpu.py, rp.py, fsdp.py, ds.py) as run entries of
`collect.py`: named by workload and system, with the MFU recounted by our formula.

An anchor record holds `section`, `method`, `model`, `seq`, `global_batch`, `mem_cap_gib`, `tokens_per_s_median`,
`MFU_vs_989` (the anchors' own count: 8 x parameters with recomputation), `max_alloc_gib`, `host_peak_rss_gib`,
`status` and `error`. The anchor scripts are read-only here, so three of their habits are read as they are:
ingpu.py's "every micro-batch ran out of memory" record drops the +liger / no-ckpt flags of `method`, its outer
failure record has no `global_batch`, and rp.py writes an `attempt` before each configuration and dies without a
result when a worker fails (roundpipe 0.1.1 calls os._exit(1)).
"""

from __future__ import annotations

import re
import sys

from benchmarks.flops import mfu, workload_flops_per_token
from benchmarks.workloads import SHAPES

RATIO_BASES = ["reference-0.1.1", "in-gpu-liger"]  # the anchors every result's tokens/s is divided by

# Anchor keys that become result fields; every other key of an anchor record is kept in `settings`.
_MAPPED = ("tokens_per_s_median", "max_alloc_gib", "host_peak_rss_gib", "status", "error")


def _num(value: float) -> str:
    return f"{value:g}"


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


def anchor_training(system: str) -> dict:
    """What the anchor scripts do about the three settings every record states (read from their code): none clips
    or reads the loss on the host; the reference steps its optimizer one step late (its records say so too), the
    others in step."""
    return {"optimizer_step": "async" if system.startswith("reference-") else "sync", "max_grad_norm": 0.0,
            "logging_steps": None}


def anchor_mfu(record: dict, tokens_per_s: float | None) -> float | None:
    """The MFU by our count (`benchmarks.flops`), so that anchors and ours compare; None for unknown models."""
    shape = SHAPES.get(record.get("model"))
    if shape is None or record.get("seq") is None:
        return None
    return mfu(workload_flops_per_token(shape, record["seq"], anchor_is_lora(record)), tokens_per_s)


def _same_invocation(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("section", "model", "mem_cap_gib"))


def _method_of_lossy_ingpu(index: int, records: list[tuple[str, dict]]) -> tuple[str | None, str | None]:
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


def _global_batch_of_failure(index: int, records: list[tuple[str, dict]]) -> int | None:
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
        settings = {k: v for k, v in record.items() if k not in _MAPPED}
        if status == "attempt":
            if any(n == name and _answers(record, r) for n, r in records[index + 1:]):
                continue
            status = "EXITED"
            record = {**record, "error": "the process exited during this configuration without a result (roundpipe "
                                         "0.1.1 calls os._exit(1) on a worker exception, e.g. CUDA out of memory)"}
        method = record["method"]
        if method.startswith("in-GPU") and "micro_batches_tried" in record:
            inherited, where = _method_of_lossy_ingpu(index, records)
            if inherited is not None and inherited != method:
                settings["method_from"] = where
                record = {**record, "method": inherited}
        system = section_system.get(record.get("section")) or anchor_system(record)
        gb = record.get("global_batch")
        if gb is None:
            gb = _global_batch_of_failure(index, records)
            settings["global_batch_inferred"] = gb
        workload = section_workload.get(record.get("section")) or anchor_workload(record, gb)
        if workload is None:
            print(f"[collect] {name}: no global batch for {record}; skipped (use --section-workload)",
                  file=sys.stderr)
            continue
        ok = status == "ok" and record.get("tokens_per_s_median") is not None
        status = "ok" if ok else (status if status != "ok" else "ERROR")
        settings["tokens_per_s_basis"] = "median of the timed steps, each synchronized"
        for key, value in anchor_training(system).items():
            settings.setdefault(key, value)
        tokens_per_s = record.get("tokens_per_s_median") if ok else None
        entries.append({
            "workload": workload, "system": system, "seq": record.get("seq"), "tokens_per_s": tokens_per_s,
            "mfu": anchor_mfu(record, tokens_per_s), "gpu_peak_gib": record.get("max_alloc_gib"),
            "host_peak_gib": record.get("host_peak_rss_gib"), "status": status,
            "error": None if ok else (record.get("error") or status), "settings": settings,
            "source": f"anchor {name}"})
    return entries
