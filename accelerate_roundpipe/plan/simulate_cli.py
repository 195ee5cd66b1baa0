"""`accelerate-roundpipe simulate`: bubble ratios of RoundPipe and the classic schedules for a model's costs.

    accelerate-roundpipe simulate --model qwen3-1.7b --devices 8 --microbatches 16 [--json]
    accelerate-roundpipe simulate --model llama3.1-8b --devices 8 --microbatches 16 --split-head [--grid]
    accelerate-roundpipe simulate --model qwen3-1.7b --devices 2 --microbatches 2 --actions
    python -m accelerate_roundpipe.plan.simulate_cli --profile costs.json --devices 4 --microbatches 8
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from .actions import format_actions
from .classic import compare_bubbles, roundpipe_partition, split_head_plan
from .decoder_shapes import MODEL_SHAPES, decoder_layer_flops
from .lowering import lower_schedule
from .schedule import build_schedule, format_schedule


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="accelerate-roundpipe simulate", description=__doc__,
                                               formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=sorted(MODEL_SHAPES), help="a known architecture (FLOP cost model)")
    source.add_argument("--profile", help="JSON file with per-layer forward costs: a list, or {'forward': [...]}")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--seq", type=int, default=4096, help="sequence length for the attention cost (--model)")
    parser.add_argument("--head-layers", type=float, default=None,
                        help="LM head cost in decoder layers instead of its FLOPs (1 = the paper's profile)")
    parser.add_argument("--chunks", type=int, default=2, help="virtual stages per device (interleaved, looped)")
    parser.add_argument("--split-head", action="store_true",
                        help="cut the LM head into vocabulary shards: RoundPipe's planner picks their number and the "
                             "stage counts; the classic schedules get as many shards (see [Note: split head])")
    parser.add_argument("--grid", action="store_true",
                        help="with --split-head, also print the planned sync iteration's schedule grid")
    parser.add_argument("--actions", action="store_true",
                        help="also print RoundPipe's sync iteration lowered into actions (uploads, computes, sends, "
                             "commits, steps) with the actions each waits for (not with --json)")
    parser.add_argument("--json", action="store_true", help="print only the JSON of bubble ratios")
    return parser


def relative_forward_costs(args: argparse.Namespace) -> list[float]:
    """Each layer's forward cost in decoder-layer units, from a profile or a known architecture's FLOPs."""
    if args.profile:
        with open(args.profile) as f:
            data = json.load(f)
        costs = [float(c) for c in (data["forward"] if isinstance(data, dict) else data)]
    else:
        costs = decoder_layer_flops(MODEL_SHAPES[args.model], args.seq)
    unit = costs[1] if len(costs) > 2 else max(costs)
    costs = [c / unit for c in costs]  # in decoder-layer units, for readable output
    if args.head_layers is not None:
        costs[-1] = args.head_layers
    return costs


def run(args: argparse.Namespace) -> dict[str, float]:
    costs = relative_forward_costs(args)
    result = compare_bubbles(args.devices, args.microbatches, costs, chunks=args.chunks, split_head=args.split_head)
    if args.json:
        print(json.dumps({k: round(v, 4) for k, v in result.items()}))
    else:
        print(f"bubble ratio, {args.devices} devices, {args.microbatches} micro-batches:")
        for name, value in result.items():
            print(f"  {name:18s} {value:6.1%}")
        if args.split_head:
            split, planned = split_head_plan(args.devices, args.microbatches, costs, asynchronous=False)
            print(f"sync plan: head in {split.num_head_shards} vocabulary shards, {planned.partition}")
            if args.grid:
                tasks = build_schedule(planned.partition, args.microbatches, args.microbatches, args.devices)
                print(format_schedule(tasks, args.devices))
        if args.actions:
            partition = (split_head_plan(args.devices, args.microbatches, costs, asynchronous=False)[1].partition
                         if args.split_head else roundpipe_partition(costs))
            tasks = build_schedule(partition, args.microbatches, args.microbatches, args.devices)
            print(f"lowered sync iteration, {len(tasks)} tasks ({partition}):")
            print(format_actions(lower_schedule(tasks)))
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
