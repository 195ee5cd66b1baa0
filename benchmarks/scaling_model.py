"""A scaling model of data-parallel RoundPipe over N nodes (one process per node), from measured one-node costs.

    python -m benchmarks.scaling_model            # print the markdown tables
    python -m benchmarks.scaling_model --write    # and put them into docs/multi-node.md (between its markers)

Per step, each node trains its own batch of 8 x 4096 tokens (the global batch grows with N), reduce-scatters the
float32 gradients of the trainable weights and all-gathers the stepped float32 optimizer copies (what the engine
gathers: [Note: data parallel]). Ring algorithms send, and receive, (N-1)/N of the buffer per node each:
4 + 4 = 8 bytes per trainable parameter, times (N-1)/N, each way.

The one-node times come from docs/benchmarks.md (one H200, 16 host cores, sequence 4096, batch 8; see `MEASURED`):
- `gpu_s`, the GPU's time per step: the lagged-step run's iteration (its host step overlaps the next iteration).
- `host_s`, the host's time per step: the exact step's iteration (on one H200 the host is its slower side).
Where a model was not measured, `gpu_s` scales with model FLOPs per token (same MFU) and `host_s` with the trainable
parameters (the host's work is per parameter: gradient commit, AdamW, write-back), both from Qwen3-1.7B.

Two variants (docs/multi-node.md states them too), differing in how the collectives meet the GPU's work:
- "as built": the optimizer thread runs, per bucket and in a fixed order, reduce-scatter -> step -> all-gather, one
  after the other. Only the reduce-scatters that end while the backward still runs hide; the two-rank smoke run
  measured that share: `AS_BUILT_HIDDEN` (0.30 of 2.51 s a step). Each collective moves at most what gloo moved
  between two processes of the H200 host (`GLOO_ALGBW_GB_S`) over as many streams as the engine cuts a decoder
  layer's bucket into at that N (`collective_streams`; the largest measured count not above it), and at most the
  link's `LINK_EFFICIENCY` of its line rate. A real network under gloo may do better or worse than the one host's
  loopback did, and more ranks than the measured two may change gloo's rate per process.
- "pipelined", the target: the reduce-scatter of a bucket runs while the backward computes the buckets below it,
  hidden up to the backward's share of the GPU step (2/3); the all-gather runs while the next forward reaches the
  layer, hidden up to the forward's share (1/3); what is longer is exposed. The transport reaches `LINK_EFFICIENCY`
  of the line rate (no gloo cap). The last bucket's reduce, step and gather are not counted.
In both, the host's step time per node drops by N (each node steps 1/N of the optimizer state) and the GPU time
does not. With T_N = max(gpu, host / N) + exposed communication, the efficiency is T_1 / T_N: the tokens/s per node
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
# Bytes per trainable parameter that each collective's buffer holds: float32 gradients; float32 optimizer copies.
REDUCE_BYTES, GATHER_BYTES = 4, 4
# Host bytes (runtime/state/host_budget.py, bf16 compute and float32 optimizer dtype, AdamW): every parameter's compute
# copy; per trainable parameter on every node the optimizer copy (full: the all-gather fills it) and the gradient
# (every bucket's at once with a clip or accumulation; no spare: [Note: no spare gradient buffer]); split over the
# nodes AdamW's two moments and, with N > 1, the node's range of the reduced gradient (`BucketShard.grad`).
COMPUTE_BYTES = 2
FULL_TRAINABLE_BYTES = 4 + 4
ADAM_STATE_BYTES = 8
REDUCED_GRAD_BYTES = 4

# gloo between two processes of the H200 host, 192 MiB float32, cut into chunks issued at once over as many groups:
# algorithm bandwidth, buffer bytes / seconds, per stream count (benchmarks/results/gloo_h200_2026-12-01.jsonl,
# `torchrun --nproc-per-node 2 benchmarks/gloo_bandwidth.py --streams 1,2,4,8,16`, OMP_NUM_THREADS=8). The engine
# cuts a bucket's collective into up to COLLECTIVE_STREAMS (8) chunks of at least MIN_STREAM_ELEMENTS per rank
# (`chunk_bounds` in runtime/distribution/gloo_exchange.py): small buckets (LoRA adapters) go as one collective.
GLOO_WORLD = 2
GLOO_ALGBW_GB_S = {  # streams: (reduce-scatter, all-gather)
    1: (1.463, 0.832),
    2: (2.298, 1.542),
    4: (3.101, 2.437),
    8: (3.785, 5.582),
}
# The two-rank smoke run with 8 streams (benchmarks/results/dp_h200_2026-12-01_63cacc9.jsonl, rank 0): seconds per
# step in collectives, and the part of them that overlapped GPU compute.
SMOKE_COLLECTIVE_S, SMOKE_HIDDEN_S = 2.5058, 0.2985
AS_BUILT_HIDDEN = SMOKE_HIDDEN_S / SMOKE_COLLECTIVE_S
COLLECTIVE_STREAMS = 8  # the engine's (runtime/distribution/gloo_exchange.py; tests/test_scaling_model.py
# checks they agree)

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


@dataclass(frozen=True)
class Variant:
    """How a step's collectives meet the GPU's work, and what moves them (see the module docstring)."""

    name: str
    pipelined: bool  # reduce-scatter under the backward, all-gather under the next forward; else serial, as built
    gloo_capped: bool  # each collective at most gloo's rate measured on one host


AS_BUILT = Variant("as built", pipelined=False, gloo_capped=True)
PIPELINED = Variant("pipelined", pipelined=True, gloo_capped=False)
VARIANTS = (AS_BUILT, PIPELINED)


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
    return ring_bytes(REDUCE_BYTES * trainable, nodes), ring_bytes(GATHER_BYTES * trainable, nodes)


def layer_bucket_params(workload: Workload) -> int:
    """Trainable parameters of one decoder layer's bucket: its linears and norms, or its LoRA adapters."""
    shape = SHAPES[workload.arch]
    if workload.lora:
        return lora_params(shape) // shape.num_hidden_layers
    qk_norms = 2 * shape.head_dim if workload.arch.startswith("qwen3") else 0
    linears = (matmul_params(shape) - shape.vocab_size * shape.hidden_size) // shape.num_hidden_layers
    return linears + 2 * shape.hidden_size + qk_norms


def collective_streams(bucket_params: int, nodes: int) -> int:
    """How many chunks (gloo streams) the engine cuts one collective of a bucket into on `nodes` ranks."""
    from accelerate_roundpipe.runtime.distribution.gloo_exchange import chunk_bounds

    return len(chunk_bounds(bucket_params // nodes))


def gloo_send_rates(streams: int) -> tuple[float, float]:
    """(reduce-scatter, all-gather) bytes per second each process SENT in the gloo measurement with the largest
    measured stream count up to `streams`: the algorithm bandwidth (buffer bytes / s) times the (world - 1) / world
    of the buffer a ring moves per process, on the measurement's two processes."""
    measured = max(count for count in GLOO_ALGBW_GB_S if count <= streams)
    return tuple(gb_s * 1e9 * ring_bytes(1.0, GLOO_WORLD) for gb_s in GLOO_ALGBW_GB_S[measured])


def transport_rates(link_gbit: float, variant: Variant, streams: int = COLLECTIVE_STREAMS,
                    link_efficiency: float = LINK_EFFICIENCY) -> tuple[float, float]:
    """(reduce-scatter, all-gather) bytes per second one node sends: the link at `link_efficiency` of its line rate,
    and as built at most what gloo sent on one host with the collective cut over `streams` groups."""
    link = link_gbit * 1e9 / 8 * link_efficiency
    if not variant.gloo_capped:
        return link, link
    reduce_cap, gather_cap = gloo_send_rates(streams)
    return min(link, reduce_cap), min(link, gather_cap)


def collective_seconds(trainable: int, nodes: int, link_gbit: float, variant: Variant,
                       streams: int = COLLECTIVE_STREAMS,
                       link_efficiency: float = LINK_EFFICIENCY) -> tuple[float, float]:
    """(reduce-scatter, all-gather) seconds per step on one node."""
    reduce_bytes, gather_bytes = step_bytes(trainable, nodes)
    reduce_rate, gather_rate = transport_rates(link_gbit, variant, streams, link_efficiency)
    return reduce_bytes / reduce_rate, gather_bytes / gather_rate


def exposed_seconds(reduce_s: float, gather_s: float, gpu_s: float, variant: Variant) -> float:
    """The communication the GPU step does not hide: as built all but `AS_BUILT_HIDDEN` of it; pipelined what
    outlasts the backward (reduce-scatter) and the next forward (all-gather)."""
    if not variant.pipelined:
        return (1 - AS_BUILT_HIDDEN) * (reduce_s + gather_s)
    return max(0.0, reduce_s - BACKWARD_SHARE * gpu_s) + max(0.0, gather_s - (1 - BACKWARD_SHARE) * gpu_s)


def step_time(gpu_s: float, host_s: float, trainable: int, nodes: int, link_gbit: float, variant: Variant,
              streams: int = COLLECTIVE_STREAMS, link_efficiency: float = LINK_EFFICIENCY) -> float:
    """T_N: the slower of GPU and host (host / N), plus the communication the GPU step does not hide."""
    reduce_s, gather_s = collective_seconds(trainable, nodes, link_gbit, variant, streams, link_efficiency)
    return max(gpu_s, host_s / nodes) + exposed_seconds(reduce_s, gather_s, gpu_s, variant)


def efficiency(gpu_s: float, host_s: float, trainable: int, nodes: int, link_gbit: float, variant: Variant,
               streams: int = COLLECTIVE_STREAMS, link_efficiency: float = LINK_EFFICIENCY) -> float:
    return max(gpu_s, host_s) / step_time(gpu_s, host_s, trainable, nodes, link_gbit, variant, streams,
                                          link_efficiency)


def host_bytes_per_node(total: int, trainable: int, nodes: int) -> float:
    """Host store bytes on one node (activations and pinned staging not counted): see `COMPUTE_BYTES` and below."""
    sharded = ADAM_STATE_BYTES + (REDUCED_GRAD_BYTES if nodes > 1 else 0)
    return COMPUTE_BYTES * total + FULL_TRAINABLE_BYTES * trainable + sharded * trainable / nodes


def host_gib_per_node(workload: Workload, nodes: int) -> float:
    return host_bytes_per_node(total_params(workload.arch), trainable_params(workload), nodes) / 2**30


def tables() -> str:
    lines = ["| workload | parameters (trainable) | one-node step: GPU / host | source | host GiB per node, N = 1 / "
             + " / ".join(str(n) for n in NODES) + " |", "|---|---|---|---|---|"]
    for w in WORKLOADS:
        gpu_s, host_s, source = one_node_times(w)
        memory = " / ".join(f"{host_gib_per_node(w, n):.0f}" for n in (1, *NODES))
        lines.append(f"| {w.name} | {total_params(w.arch) / 1e9:.2f}B ({trainable_params(w) / 1e9:.3f}B) | "
                     f"{gpu_s:.2f} s / {host_s:.2f} s | {source} | {memory} |")
    names = " / ".join(v.name for v in VARIANTS)
    lines += ["", "| workload | N | GB sent per node per step (reduce-scatter + all-gather) | gloo streams (as built) "
              "| " + " | ".join(f"efficiency at {g} Gb/s: {names}" for g in LINKS_GBIT) + " |",
              "|---|---|---|---|" + "---|" * len(LINKS_GBIT)]
    for w in WORKLOADS:
        gpu_s, host_s, _ = one_node_times(w)
        trainable = trainable_params(w)
        for n in NODES:
            reduce_bytes, gather_bytes = step_bytes(trainable, n)
            streams = collective_streams(layer_bucket_params(w), n)
            cells = " | ".join(" / ".join(f"{efficiency(gpu_s, host_s, trainable, n, g, v, streams):.0%}"
                                          for v in VARIANTS) for g in LINKS_GBIT)
            lines.append(f"| {w.name} | {n} | {reduce_bytes / 1e9:.2f} + {gather_bytes / 1e9:.2f} | {streams} | "
                         f"{cells} |")
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
