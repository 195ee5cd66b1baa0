"""A scaling model of data-parallel RoundPipe over N nodes (one process per node), from measured one-node costs.

    python -m benchmarks.scaling_model            # print the markdown tables
    python -m benchmarks.scaling_model --write    # and put them into docs/multi-node.md (between its markers)

Per step, each node trains its own batch of 8 x 4096 tokens (the global batch grows with N), reduce-scatters its
float32 gradients of the trainable weights and all-gathers the updated bfloat16 weights. Ring algorithms send, and
receive, (N-1)/N of the buffer per node each: 4 + 2 = 6 bytes per trainable parameter, times (N-1)/N, each way.

The one-node times come from docs/benchmarks.md (one H200, 16 host cores, sequence 4096, batch 8; see `MEASURED`):
- `gpu_s`, the GPU's time per step: the lagged-step run's iteration (its host step overlaps the next iteration).
- `host_s`, the host's time per step: the exact step's iteration (on one H200 the host is its slower side).
Where a model was not measured, `gpu_s` scales with model FLOPs per token (same MFU) and `host_s` with the trainable
parameters (the host's work is per parameter: gradient commit, AdamW, write-back), both from Qwen3-1.7B.

Assumptions of the model (docs/multi-node.md states them too):
- the reduce-scatter of a bucket runs while the backward computes the buckets below it: hidden up to the backward's
  share of the GPU step (2/3); the all-gather runs while the next forward reaches the layer: hidden up to the
  forward's share (1/3); what is longer is exposed. The last bucket's reduce, step and gather are not counted;
- the host's step time per node drops by N (each node steps 1/N of the optimizer state); the GPU time does not;
- links reach `LINK_EFFICIENCY` of their line rate, and a node's traffic goes over one such link.
Then, with T_N = max(gpu, host / N) + exposed communication, the efficiency is T_1 / T_N: the tokens/s per node
against one node alone (above 100% where sharding the optimizer relieves a host-bound step).
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

from accelerate_roundpipe.plan.decoder_shapes import DecoderShape
from benchmarks.flops import lora_params, matmul_params, workload_flops_per_token

TOKENS_PER_STEP = 8 * 4096  # per node
LINKS_GBIT = (25, 100, 400)
NODES = (2, 4, 8, 16)
LINK_EFFICIENCY = 0.8
BACKWARD_SHARE = 2 / 3
GRAD_BYTES, WEIGHT_BYTES, OPTIMIZER_BYTES = 4, 2, 12  # fp32 gradient; bf16 weight; fp32 master + Adam m, v

# The models' config.json numbers (hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tied).
SHAPES = {
    "qwen3-1.7b": DecoderShape(2048, 6144, 28, 16, 8, 128, 151936, True),
    "llama3.1-8b": DecoderShape(4096, 14336, 32, 32, 8, 128, 128256, False),
    "qwen3-32b": DecoderShape(5120, 25600, 64, 64, 8, 128, 151936, False),
}

# Measured on one H200 (docs/benchmarks.md, tok/s of 8 x 4096-token steps).
MEASURED = {
    # 2026-12-01, 768fe63: roundpipe-engine (lagged step) 40,572 tok/s; roundpipe-engine-sync-optimizer 33,957.
    "qwen3-1.7b": {"gpu_tok_s": 40_572, "host_tok_s": 33_957},
    # 2026-11-29: Llama-3.1-8B LoRA r16, 13,690 tok/s (lagged step); its host step (adapters only) is not measured.
    "llama3.1-8b": {"gpu_tok_s": 13_690},
}


@dataclass(frozen=True)
class Workload:
    name: str
    arch: str
    lora: bool


WORKLOADS = (Workload("Qwen3-1.7B full fine-tune", "qwen3-1.7b", False),
             Workload("Llama-3.1-8B LoRA r16", "llama3.1-8b", True),
             Workload("Qwen3-32B full fine-tune", "qwen3-32b", False))


def total_params(arch: str) -> int:
    """Every parameter: the matrices, the input embedding when untied, and the norms (Qwen3's q/k norms too)."""
    shape = SHAPES[arch]
    embedding = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
    qk_norms = 2 * shape.head_dim if arch.startswith("qwen3") else 0
    norms = shape.num_hidden_layers * (2 * shape.hidden_size + qk_norms) + shape.hidden_size
    return matmul_params(shape) + embedding + norms


def trainable_params(workload: Workload) -> int:
    shape = SHAPES[workload.arch]
    return lora_params(shape) if workload.lora else total_params(workload.arch)


def one_node_times(workload: Workload) -> tuple[float, float, str]:
    """(gpu_s, host_s, where they come from) of one step on one node."""
    reference = WORKLOADS[0]
    ref = MEASURED[reference.arch]
    ref_host = TOKENS_PER_STEP / ref["host_tok_s"]
    measured = MEASURED.get(workload.arch, {})
    host_s = ref_host * trainable_params(workload) / trainable_params(reference)
    if "gpu_tok_s" in measured:
        gpu_s, source = TOKENS_PER_STEP / measured["gpu_tok_s"], "measured"
    else:
        flops = workload_flops_per_token(SHAPES[workload.arch], 4096, workload.lora)
        ref_flops = workload_flops_per_token(SHAPES[reference.arch], 4096, reference.lora)
        gpu_s, source = TOKENS_PER_STEP / ref["gpu_tok_s"] * flops / ref_flops, "scaled by FLOPs"
    if "host_tok_s" in measured:
        host_s = TOKENS_PER_STEP / measured["host_tok_s"]
    else:
        source += ", host scaled by parameters"
    return gpu_s, host_s, source


def ring_bytes(buffer_bytes: float, nodes: int) -> float:
    """What one node sends (and receives) in a ring reduce-scatter or all-gather of `buffer_bytes`."""
    return buffer_bytes * (nodes - 1) / nodes


def step_bytes(trainable: int, nodes: int) -> tuple[float, float]:
    """(reduce-scatter, all-gather) bytes one node sends per step."""
    return ring_bytes(GRAD_BYTES * trainable, nodes), ring_bytes(WEIGHT_BYTES * trainable, nodes)


def step_time(gpu_s: float, host_s: float, trainable: int, nodes: int, link_gbit: float,
              link_efficiency: float = LINK_EFFICIENCY) -> float:
    """T_N: the slower of GPU and host (host / N), plus the communication the GPU step does not hide."""
    bandwidth = link_gbit * 1e9 / 8 * link_efficiency
    reduce_bytes, gather_bytes = step_bytes(trainable, nodes)
    exposed = max(0.0, reduce_bytes / bandwidth - BACKWARD_SHARE * gpu_s) \
        + max(0.0, gather_bytes / bandwidth - (1 - BACKWARD_SHARE) * gpu_s)
    return max(gpu_s, host_s / nodes) + exposed


def efficiency(gpu_s: float, host_s: float, trainable: int, nodes: int, link_gbit: float,
               link_efficiency: float = LINK_EFFICIENCY) -> float:
    return max(gpu_s, host_s) / step_time(gpu_s, host_s, trainable, nodes, link_gbit, link_efficiency)


def host_gib_per_node(workload: Workload, nodes: int) -> float:
    """bf16 weights (all) and fp32 gradients (trainable) on every node; optimizer state split over the nodes."""
    total, trainable = total_params(workload.arch), trainable_params(workload)
    return (WEIGHT_BYTES * total + GRAD_BYTES * trainable + OPTIMIZER_BYTES * trainable / nodes) / 2**30


def tables() -> str:
    lines = ["| workload | parameters (trainable) | one-node step: GPU / host | source | host GiB per node, N = 1 / "
             + " / ".join(str(n) for n in NODES) + " |", "|---|---|---|---|---|"]
    for w in WORKLOADS:
        gpu_s, host_s, source = one_node_times(w)
        memory = " / ".join(f"{host_gib_per_node(w, n):.0f}" for n in (1, *NODES))
        lines.append(f"| {w.name} | {total_params(w.arch) / 1e9:.2f}B ({trainable_params(w) / 1e9:.3f}B) | "
                     f"{gpu_s:.2f} s / {host_s:.2f} s | {source} | {memory} |")
    lines += ["", "| workload | N | GB sent per node per step (reduce-scatter + all-gather) | "
              + " | ".join(f"efficiency at {g} Gb/s" for g in LINKS_GBIT) + " |", "|---|---|---|" + "---|" * 3]
    for w in WORKLOADS:
        gpu_s, host_s, _ = one_node_times(w)
        trainable = trainable_params(w)
        for n in NODES:
            reduce_bytes, gather_bytes = step_bytes(trainable, n)
            cells = " | ".join(f"{efficiency(gpu_s, host_s, trainable, n, g):.0%}" for g in LINKS_GBIT)
            lines.append(f"| {w.name} | {n} | {reduce_bytes / 1e9:.2f} + {gather_bytes / 1e9:.2f} | {cells} |")
    return "\n".join(lines)


DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "multi-node.md")
START, END = "<!-- scaling-model:start -->", "<!-- scaling-model:end -->"


def doc_block(text: str) -> str | None:
    """The tables between the markers of a doc (None without markers)."""
    found = re.search(re.escape(START) + r"\n(.*?)" + re.escape(END), text, re.S)
    return found.group(1).rstrip("\n") if found else None


def write_doc(path: str = DOC) -> None:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if doc_block(text) is None:
        raise SystemExit(f"{path} has no {START} ... {END} block to write the tables into.")
    text = re.sub(re.escape(START) + r"\n.*?" + re.escape(END), lambda _: f"{START}\n{tables()}\n{END}", text,
                  flags=re.S)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"also write the tables into {DOC}")
    args = parser.parse_args(argv)
    print(tables())
    if args.write:
        write_doc()


if __name__ == "__main__":
    main()
