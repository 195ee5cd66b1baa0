"""`benchmarks/collect.py` and `benchmarks/anchor_records.py`: anchor-record mapping, best of a sweep, max_seq,
failures, and the docs section (`benchmarks/results_page.py`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import collect, results_page  # noqa: E402
from benchmarks.flops import mfu, workload_flops_per_token  # noqa: E402
from benchmarks.workloads import SHAPES  # noqa: E402

VERSIONS = {"torch": "2.11.0+cu130", "transformers": "5.17.0"}


# ---------------------------------------------------------------------------------------------- anchor records
# Shaped as the anchors' `common.record(dict(...))` calls write them (plus the torch/transformers keys record() adds).


def _summary(tokens_per_iter: int, iter_s: float) -> dict:  # common.summarize
    times = [iter_s * 1.1, iter_s, iter_s * 0.99]
    return dict(iter_s=[round(t, 4) for t in times], median_iter_s=round(iter_s, 4),
                tokens_per_s_median=round(tokens_per_iter / iter_s, 1),
                tokens_per_s_mean=round(tokens_per_iter * 3 / sum(times), 1))


def _gpu_mem(alloc: float) -> dict:  # common.gpu_mem
    return dict(max_alloc_gib=alloc, max_reserved_gib=round(alloc * 1.1, 2))


def ingpu_ok(model, seq, gb, mb, iter_s, mode="bf16", liger=True, no_ckpt=False, cap=0.0, section="B1", alloc=16.35):
    method = f"in-GPU {mode}" + (" +liger" if liger else "") + (" no-ckpt" if no_ckpt else "")
    lora_note = "fp32 adapters (peft default)" if mode == "lora" else None
    return dict(section=section, method=method, lora_adapters=lora_note, model=model, seq=seq, global_batch=gb,
                micro_batch=mb, grad_accum=gb // mb, mem_cap_gib=cap, dtype="bf16", params=1720574976,
                trainable=1720574976, grad_ckpt=not no_ckpt, attn="sdpa", flops_per_token=15643648000.0,
                model_TFLOPs=582.4, MFU_vs_989=0.589, **_summary(gb * seq, iter_s), **_gpu_mem(alloc), **VERSIONS)


def ingpu_all_mbs_oom(model, seq, gb, mode="bf16", cap=0.0, section="B1"):
    """run_one after every micro-batch size ran out of memory: `method` has no +liger / no-ckpt."""
    return dict(section=section, method=f"in-GPU {mode}", model=model, seq=seq, global_batch=gb,
                micro_batches_tried=[8, 4, 2, 1], mem_cap_gib=cap, status="OOM",
                error="CUDA out of memory. Tried to allocate 2.00 GiB", **_gpu_mem(23.9), **VERSIONS)


def ingpu_outer_failure(model, seq, mode="bf16", liger=True, cap=0.0, section="B1", status="OOM"):
    """main()'s except branch: no `global_batch`."""
    method = f"in-GPU {mode}" + (" +liger" if liger else "")
    return dict(section=section, method=method, lora_adapters=None, model=model, seq=seq, mem_cap_gib=cap,
                status=status, error="OutOfMemoryError('CUDA out of memory.')", **VERSIONS)


def rp_base(model, seq, gb, nm, cap=0.0, lora=False, section="B2"):
    return dict(section=section, method="roundpipe " + ("LoRA" if lora else "full FT"), roundpipe="0.1.1",
                model=model, seq=seq, global_batch=gb, num_microbatch=nm, accum_steps=1, recompute_grain="stage",
                mem_cap_gib=cap, dtype="bf16 params/compute, fp32 Adam on CPU (roundpipe.optim.Adam)", attn="sdpa",
                optimizer_step="async (roundpipe default, 1-step stale)", compat_shim=True)


def rp_attempt(*args, **kwargs):
    return dict(rp_base(*args, **kwargs), status="attempt", **VERSIONS)


def rp_ok(model, seq, gb, nm, iter_s, **kwargs):
    return dict(rp_base(model, seq, gb, nm, **kwargs), status="ok", params=1720574976, trainable=1720574976,
                warmup_s=6.02, flops_per_token=15643648000.0, model_TFLOPs=321.5, MFU_vs_989=0.325,
                **_summary(gb * seq, iter_s), host_peak_rss_gib=39.4, **_gpu_mem(6.72), **VERSIONS)


def fsdp_ok(model, seq, gb, iter_s, cap=0.0, section="B3"):
    base = dict(section=section, method="FSDP2 CPUOffload", model=model, seq=seq, global_batch=gb, micro_batch=gb,
                grad_accum=1, mem_cap_gib=cap, dtype="fp32 master on CPU (pinned), bf16 compute (MixedPrecisionPolicy)",
                optimizer="torch.optim.AdamW(fused) on CPU", attn="sdpa", grad_ckpt=True)
    return dict(base, status="ok", params=1720574976, flops_per_token=15643648000.0, model_TFLOPs=100.0,
                MFU_vs_989=0.101, fwd_bwd_s=2.0, opt_step_s=1.0, **_summary(gb * seq, iter_s), host_peak_rss_gib=45.0,
                **_gpu_mem(12.0), **VERSIONS)


def ds_record(model, seq, gb, iter_s=None, stage=3, cap=0.0, section="B5"):
    base = dict(section=section, method=f"DeepSpeed ZeRO-{stage} CPU offload", model=model, seq=seq, global_batch=gb,
                micro_batch=gb, grad_accum=1, mem_cap_gib=cap,
                dtype="bf16 compute, fp32 master + DeepSpeedCPUAdam on CPU", attn="sdpa", grad_ckpt=True,
                deepspeed="0.18.0")
    if iter_s is None:
        return dict(base, status="ERROR", error="RuntimeError('ninja build failed')", **_gpu_mem(1.0), **VERSIONS)
    return dict(base, status="ok", params=1720574976, flops_per_token=15643648000.0, model_TFLOPs=90.0,
                MFU_vs_989=0.091, **_summary(gb * seq, iter_s), host_peak_rss_gib=50.0, **_gpu_mem(8.0), **VERSIONS)


def hw_record():
    return dict(section="A", what="host", nproc=16, torch_threads_default=16, lscpu="...", **VERSIONS)


def ours(workload, system, tokens_per_s, seq=4096, nms=4, status="ok", cap_sweep=False, error=None):
    """As `benchmarks/run.py`'s `run_one` writes it."""
    record = {"workload": workload, "system": system, "seq": seq, "global_batch": 1 if cap_sweep else 8,
              "gpu": "NVIDIA H200", "commit": "abc1234", "max_seq": seq if cap_sweep else None,
              "tokens_per_s": tokens_per_s, "mfu": None if tokens_per_s is None else 0.2,
              "gpu_peak_gib": None if tokens_per_s is None else 9.5,
              "host_peak_gib": None if tokens_per_s is None else 40.0, "status": status,
              "settings": {"seq": seq, "num_microbatches": nms, "torch": "2.11.0+cu130", "optimizer_step": "async",
                           "max_grad_norm": 0.0, "logging_steps": 1,
                           "path": {"api": "wrap_model + forward_backward"}}}
    if error:
        record["error"] = error
    return record


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


Q17, Q4, L8, CAP = "qwen3-1.7b-full-s4096-b8", "qwen3-4b-full-s4096-b8-cap24", "llama3.1-8b-lora-s4096-b8", \
    "qwen3-1.7b-cap24-b1"


@pytest.fixture
def run_files(tmp_path):
    anchors = [
        hw_record(),
        # qwen3-1.7b s4096 b8
        ingpu_ok("qwen3-1.7b", 4096, 8, 8, 0.8801, section="C1"),
        ingpu_ok("qwen3-1.7b", 4096, 8, 8, 0.80, no_ckpt=True, section="C1n", alloc=60.0),
        ingpu_ok("qwen3-1.7b", 4096, 8, 4, 1.2, liger=False, section="C1p"),
        rp_attempt("qwen3-1.7b", 4096, 8, 4, section="C2"),
        rp_ok("qwen3-1.7b", 4096, 8, 4, 1.5944, section="C2"),
        rp_attempt("qwen3-1.7b", 4096, 8, 8, section="C2"),
        rp_ok("qwen3-1.7b", 4096, 8, 8, 1.8, section="C2"),
        fsdp_ok("qwen3-1.7b", 4096, 8, 3.0),
        ds_record("qwen3-1.7b", 4096, 8, 3.5),
        # qwen3-4b s4096 b8 cap 24: in-GPU runs out of memory at every micro-batch size (method loses "+liger")
        ingpu_all_mbs_oom("qwen3-4b", 4096, 8, cap=24.0, section="C4-liger"),
        rp_attempt("qwen3-4b", 4096, 8, 4, cap=24.0, section="C4"),
        rp_ok("qwen3-4b", 4096, 8, 4, 4.0, cap=24.0, section="C4"),
        ds_record("qwen3-4b", 4096, 8, None, cap=24.0, section="C4ds"),
        # llama3.1-8b LoRA
        ingpu_ok("llama3.1-8b", 4096, 8, 8, 1.0, mode="lora", section="C5"),
        rp_attempt("llama3.1-8b", 4096, 8, 4, lora=True, section="C5rp"),
        rp_ok("llama3.1-8b", 4096, 8, 4, 2.0, lora=True, section="C5rp"),
        # qwen3-1.7b cap 24 batch 1 sequence sweep
        ingpu_ok("qwen3-1.7b", 4096, 1, 1, 0.2, cap=24.0, section="C6"),
        ingpu_ok("qwen3-1.7b", 8192, 1, 1, 0.45, cap=24.0, section="C6"),
        ingpu_all_mbs_oom("qwen3-1.7b", 16384, 1, cap=24.0, section="C6"),
        rp_attempt("qwen3-1.7b", 4096, 1, 1, cap=24.0, section="C6rp"),
        rp_ok("qwen3-1.7b", 4096, 1, 1, 0.5, cap=24.0, section="C6rp"),
        rp_attempt("qwen3-1.7b", 16384, 1, 1, cap=24.0, section="C6rp"),
        rp_ok("qwen3-1.7b", 16384, 1, 1, 2.0, cap=24.0, section="C6rp"),
        rp_attempt("qwen3-1.7b", 32768, 1, 1, cap=24.0, section="C6rp"),  # os._exit: no result follows
    ]
    our_records = [
        ours(Q17, "roundpipe-engine", 16000.0, nms=4), ours(Q17, "roundpipe-engine", 18000.0, nms=2),
        ours(Q17, "roundpipe-trainer", 15000.0), ours(Q17, "roundpipe-accelerate-loop", 15500.0),
        ours(Q4, "roundpipe-engine", 7000.0),
        ours(L8, "roundpipe-engine", None, status="OOM", error="OutOfMemoryError('CUDA out of memory')"),
        ours(CAP, "roundpipe-engine", 15000.0, seq=4096, nms=1, cap_sweep=True),
        ours(CAP, "roundpipe-engine", 14000.0, seq=16384, nms=1, cap_sweep=True),
        ours(CAP, "roundpipe-engine", 12000.0, seq=32768, nms=1, cap_sweep=True),
        ours(CAP, "roundpipe-engine", None, seq=65536, nms=1, cap_sweep=True, status="OOM", error="OOM"),
    ]
    return [write_jsonl(tmp_path / "ours.jsonl", our_records), write_jsonl(tmp_path / "results.jsonl", anchors)]


def by_key(records):
    return {(r["workload"], r["system"]): r for r in records}


def test_anchor_mapping_and_best_of_sweep(run_files):
    records = collect.collect(run_files, "NVIDIA H200", "2026-12-01", section_system={"C4-liger": "in-gpu-liger"})
    got = by_key(records)
    expected = {
        (Q17, "roundpipe-engine"), (Q17, "roundpipe-trainer"), (Q17, "roundpipe-accelerate-loop"),
        (Q17, "reference-0.1.1"), (Q17, "in-gpu"), (Q17, "in-gpu-liger"), (Q17, "in-gpu-liger-nockpt"),
        (Q17, "fsdp2-offload"), (Q17, "deepspeed-zero3-offload"),
        (Q4, "roundpipe-engine"), (Q4, "in-gpu-liger"), (Q4, "reference-0.1.1"), (Q4, "deepspeed-zero3-offload"),
        (L8, "roundpipe-engine"), (L8, "in-gpu-liger"), (L8, "reference-0.1.1"),
        (CAP, "roundpipe-engine"), (CAP, "in-gpu-liger"), (CAP, "reference-0.1.1")}
    assert set(got) == expected
    for record in records:
        for field in ("workload", "system", "tokens_per_s", "max_seq", "mfu", "gpu_peak_gib", "host_peak_gib", "gpu",
                      "commit", "settings"):
            assert field in record, (field, record)
        assert record["gpu"] == "NVIDIA H200" and record["commit"] == "abc1234"
    # order: workloads as listed, then systems as listed
    assert [r["workload"] for r in records][:9] == [Q17] * 9
    assert [r["system"] for r in records][:4] == ["roundpipe-engine", "roundpipe-trainer",
                                                  "roundpipe-accelerate-loop", "reference-0.1.1"]

    liger = got[(Q17, "in-gpu-liger")]
    # the anchor's own MFU is kept; `mfu` is recounted by our formula, as ours is
    assert liger["tokens_per_s"] == round(8 * 4096 / 0.8801, 1) and liger["settings"]["MFU_vs_989"] == 0.589
    assert liger["mfu"] == mfu(workload_flops_per_token(SHAPES["qwen3-1.7b"], 4096, False), liger["tokens_per_s"])
    assert liger["gpu_peak_gib"] == 16.35 and liger["host_peak_gib"] is None
    assert liger["settings"]["micro_batch"] == 8 and liger["source"].startswith("anchor")
    assert got[(Q17, "in-gpu-liger-nockpt")]["gpu_peak_gib"] == 60.0
    assert got[(Q17, "in-gpu")]["settings"]["micro_batch"] == 4
    # best of the micro-batch sweeps, the others listed
    reference = got[(Q17, "reference-0.1.1")]
    assert reference["tokens_per_s"] == round(8 * 4096 / 1.5944, 1) and reference["settings"]["num_microbatch"] == 4
    assert reference["host_peak_gib"] == 39.4
    assert sorted(run["num_microbatch"] for run in reference["settings"]["runs"]) == [4, 8]
    engine = got[(Q17, "roundpipe-engine")]
    assert engine["tokens_per_s"] == 18000.0 and engine["settings"]["num_microbatches"] == 2
    # ratios against both bases
    assert engine["ratios"] == {"reference-0.1.1": round(18000.0 / reference["tokens_per_s"], 3),
                                "in-gpu-liger": round(18000.0 / liger["tokens_per_s"], 3)}
    assert "reference-0.1.1" not in reference["ratios"] and "in-gpu-liger" in reference["ratios"]
    assert got[(L8, "in-gpu-liger")]["settings"]["lora_adapters"] == "fp32 adapters (peft default)"
    assert got[(L8, "reference-0.1.1")]["tokens_per_s"] == round(8 * 4096 / 2.0, 1)


def test_failures_are_kept(run_files):
    records = collect.collect(run_files, "NVIDIA H200", "2026-12-01", section_system={"C4-liger": "in-gpu-liger"})
    got = by_key(records)
    oom = got[(Q4, "in-gpu-liger")]
    assert oom["tokens_per_s"] is None and oom["status"] == "OOM" and "out of memory" in oom["error"]
    assert oom["mfu"] is None
    ds = got[(Q4, "deepspeed-zero3-offload")]
    assert ds["tokens_per_s"] is None and ds["status"] == "ERROR" and "ninja" in ds["error"]
    ours_oom = got[(L8, "roundpipe-engine")]
    assert ours_oom["tokens_per_s"] is None and ours_oom["status"] == "OOM" and ours_oom["error"]
    for record in records:
        assert ("error" in record) == (record["tokens_per_s"] is None)
    # without the override, the lossy in-GPU OOM record (no preceding record of its section) reads as plain in-gpu
    plain = by_key(collect.collect(run_files, "NVIDIA H200", "2026-12-01"))
    assert (Q4, "in-gpu") in plain and (Q4, "in-gpu-liger") not in plain


def test_cap_sweep_max_seq(run_files):
    got = by_key(collect.collect(run_files, "NVIDIA H200", "2026-12-01"))
    liger = got[(CAP, "in-gpu-liger")]  # the 16384 OOM record inherits "+liger" from its section's earlier records
    assert liger["max_seq"] == 8192 and liger["tokens_per_s"] == round(8192 / 0.45, 1)
    assert liger["settings"]["per_seq_tokens_per_s"] == {"4096": round(4096 / 0.2, 1), "8192": round(8192 / 0.45, 1)}
    assert liger["settings"]["failed_seqs"] == {"16384": "OOM"}
    assert liger["settings"]["first_failure"]["seq"] == 16384
    reference = got[(CAP, "reference-0.1.1")]  # 32768 has an attempt and no result: the process died there
    assert reference["max_seq"] == 16384 and reference["settings"]["failed_seqs"] == {"32768": "EXITED"}
    engine = got[(CAP, "roundpipe-engine")]
    assert engine["max_seq"] == 32768 and engine["tokens_per_s"] == 12000.0
    assert engine["settings"]["per_seq_tokens_per_s"] == {"4096": 15000.0, "16384": 14000.0, "32768": 12000.0}
    assert engine["settings"]["failed_seqs"] == {"65536": "OOM"}
    # sweep ratios compare the longest sequence both ran
    assert engine["ratios"]["reference-0.1.1"] == round(14000.0 / round(16384 / 2.0, 1), 3)
    assert engine["ratios"]["in-gpu-liger"] == round(15000.0 / round(4096 / 0.2, 1), 3)
    for key, record in got.items():
        assert (record["max_seq"] is not None) == (key[0] == CAP)


def test_missing_global_batch_is_inferred(tmp_path):
    records = [ingpu_ok("qwen3-4b", 4096, 8, 8, 2.0, cap=24.0, section="X", liger=True),
               ingpu_outer_failure("qwen3-4b", 8192, cap=24.0, section="X")]
    got = by_key(collect.collect([write_jsonl(tmp_path / "r.jsonl", records)], "NVIDIA H200", "2026-12-01", "c0"))
    failed = got[("qwen3-4b-full-s8192-b8-cap24", "in-gpu-liger")]
    assert failed["tokens_per_s"] is None and failed["settings"]["global_batch_inferred"] == 8
    assert got[(Q4, "in-gpu-liger")]["commit"] == "c0"


DOC = """# Benchmarks

Intro paragraph.

## Engine core

| a | b |
|---|---|
| 1 | 2 |

Trailing text, no newline at the end"""


def test_docs_section_appended_then_replaced(run_files, tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text(DOC)
    out = tmp_path / "results" / "h200-2026-12-01.json"
    collect.main(["--inputs", *run_files, "--gpu", "NVIDIA H200", "--date", "2026-12-01", "--out", str(out),
                  "--docs", str(page), "--section-system", "C4-liger=in-gpu-liger"])
    saved = json.loads(out.read_text())
    assert isinstance(saved, list) and len(saved) == 19
    text = page.read_text()
    assert text.startswith(DOC + "\n")  # everything before is untouched
    head, rest = text.split(results_page.BEGIN)
    assert head.rstrip().endswith(results_page.HEADING)
    section, tail = rest.split(results_page.END)
    assert tail == "\n"
    for workload in (Q17, Q4, L8, CAP):
        assert f"### {workload}" in section
    q17 = section.split(f"### {Q17}")[1].split("###")[0]
    assert "| system | tok/s | vs reference-0.1.1 | vs in-gpu-liger | MFU |" in q17
    assert "| `roundpipe-engine` | 18,000 | 0.88x | 0.48x |" in q17
    assert "2026-12-01" in q17 and "abc1234" in q17 and "NVIDIA H200" in q17
    q4 = section.split(f"### {Q4}")[1].split("###")[0]
    assert "| `in-gpu-liger` | OOM |" in q4 and "| `deepspeed-zero3-offload` | failed |" in q4
    assert "vs in-gpu-liger" not in q4  # no successful base, no column
    cap = section.split(f"### {CAP}")[1]
    assert "| system | max_seq | tok/s |" in cap and "| `roundpipe-engine` | 32768 | 12,000 |" in cap
    assert "OOM at seq 65536" in cap and "EXITED at seq 32768" in cap

    # a second run rewrites only the marked section
    edited = text.replace("Intro paragraph.", "Intro paragraph, edited by hand.") + "\nA later section.\n"
    page.write_text(edited)
    collect.main(["--inputs", run_files[0], "--gpu", "NVIDIA H100", "--date", "2026-12-02", "--out", str(out),
                  "--docs", str(page)])
    again = page.read_text()
    before, after = edited.split(results_page.BEGIN)[0], edited.split(results_page.END)[1]
    assert again.startswith(before + results_page.BEGIN) and again.endswith(results_page.END + after)
    new_section = again.split(results_page.BEGIN)[1].split(results_page.END)[0]
    assert "NVIDIA H100" in new_section and "reference-0.1.1" not in new_section
    assert again.count(results_page.BEGIN) == 1 and again.count(results_page.HEADING) == 1


def test_docs_markers_must_pair(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(f"x\n{results_page.END}\n{results_page.BEGIN}\n")
    with pytest.raises(ValueError):
        results_page.rewrite_docs(str(page), "y")


def test_a_record_is_printed_rounded_and_kept_whole(tmp_path, capsys):
    import json

    from benchmarks.records import emit

    out = tmp_path / "records.jsonl"
    emit({"x": 1.234567, "n": 3}, str(out), label="host roofline", digits=2)
    emit({"x": 2.5}, str(out))
    printed = capsys.readouterr().out.splitlines()
    assert printed == ['RESULT host roofline {"x": 1.23, "n": 3}', 'RESULT {"x": 2.5}']
    assert [json.loads(line) for line in out.read_text().splitlines()] == [{"x": 1.234567, "n": 3}, {"x": 2.5}]
