"""`accelerate-roundpipe simulate`: bubble ratios of RoundPipe and the classic schedules for a model's costs.

    accelerate-roundpipe simulate --model qwen3-1.7b --devices 8 --microbatches 16 [--json]
    accelerate-roundpipe simulate --model llama3.1-8b --devices 8 --microbatches 16 --split-head [--grid]
    accelerate-roundpipe simulate --model qwen3-1.7b --devices 2 --microbatches 2 --actions
    python -m accelerate_roundpipe.plan.simulate_cli --profile costs.json --devices 4 --microbatches 8

costs.json: `python -m accelerate_roundpipe.telemetry.report trace.json --profile-out costs.json` from a run's trace.
A classic schedule that cannot be built for the counts given is a row "n/a: <why>" (null in --json, the reason under
"not_built"); RoundPipe's rows are always there.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence

from .actions import format_actions
from .classic import NotBuilt, compare_bubbles, roundpipe_partition, split_head_plan
from .decoder_shapes import MODEL_SHAPES, decoder_layer_flops
from .lowering import lower_schedule
from .schedule import build_schedule, format_schedule


class ProfileError(ValueError):
    """A `--profile` file that is not a list of per-layer forward costs; the message names the file."""


def _number(minimum: float, kind: type, what: str) -> Callable[[str], float]:
    """An argparse type: a `kind` (int or float), finite and at least `minimum`; argparse names the flag."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}") from None
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value
    return parse


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="accelerate-roundpipe simulate", description=__doc__,
                                               formatter_class=argparse.RawDescriptionHelpFormatter)
    count = _number(1, int, "a whole number, at least 1")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=sorted(MODEL_SHAPES), help="a known architecture (FLOP cost model)")
    source.add_argument("--profile", help="JSON file with per-layer forward costs: a list, or {'forward': [...]} "
                                          "(what `telemetry.report --profile-out` writes)")
    parser.add_argument("--devices", type=count, required=True)
    parser.add_argument("--microbatches", type=count, required=True)
    parser.add_argument("--seq", type=count, default=4096, help="sequence length for the attention cost (--model)")
    parser.add_argument("--head-layers", type=_number(0, float, "a number of decoder layers, at least 0"),
                        default=None,
                        help="LM head cost in decoder layers instead of its FLOPs (1 = the paper's profile)")
    parser.add_argument("--chunks", type=count, default=2, help="virtual stages per device (interleaved, looped)")
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


def load_profile(path: str) -> list[float]:
    """The per-layer forward costs of a `--profile` file. Raises OSError if it cannot be read, ProfileError if it
    is not a non-empty list of finite costs >= 0 (or {"forward": [...]}) in which layer 1, the unit, costs > 0."""
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"--profile {path}: not JSON ({e})") from None
    costs = data.get("forward") if isinstance(data, dict) else data
    if not isinstance(costs, list):
        got = f"an object with keys {sorted(data)}" if isinstance(data, dict) else f"a {type(data).__name__}"
        raise ProfileError(f'--profile {path}: needs a list of per-layer forward costs or {{"forward": [...]}}, got '
                           f"{got}")
    if not costs:
        raise ProfileError(f"--profile {path}: has no layers")
    for i, cost in enumerate(costs):
        if isinstance(cost, bool) or not isinstance(cost, (int, float)):
            raise ProfileError(f"--profile {path}: layer {i}'s cost is {cost!r}, not a number")
        if not math.isfinite(cost) or cost < 0:
            raise ProfileError(f"--profile {path}: layer {i}'s cost is {cost}: costs are times, at least 0")
    if not any(costs):
        raise ProfileError(f"--profile {path}: every layer costs 0: nothing to schedule")
    if len(costs) > 2 and costs[1] == 0:
        raise ProfileError(f"--profile {path}: layer 1 (the first decoder layer, the unit of the costs) costs 0")
    return [float(c) for c in costs]


def relative_forward_costs(args: argparse.Namespace) -> list[float]:
    """Each layer's forward cost in decoder-layer units, from a profile or a known architecture's FLOPs."""
    if args.profile:
        costs = load_profile(args.profile)
    else:
        costs = decoder_layer_flops(MODEL_SHAPES[args.model], args.seq)
    unit = costs[1] if len(costs) > 2 else max(costs)
    costs = [c / unit for c in costs]  # in decoder-layer units, for readable output
    if args.head_layers is not None:
        costs[-1] = args.head_layers
    return costs


def run(args: argparse.Namespace, costs: Sequence[float] | None = None) -> dict[str, float | NotBuilt]:
    costs = relative_forward_costs(args) if costs is None else list(costs)
    result = compare_bubbles(args.devices, args.microbatches, costs, chunks=args.chunks, split_head=args.split_head)
    if args.json:
        printed: dict = {k: None if isinstance(v, NotBuilt) else round(v, 4) for k, v in result.items()}
        not_built = {k: v.reason for k, v in result.items() if isinstance(v, NotBuilt)}
        print(json.dumps(printed | ({"not_built": not_built} if not_built else {})))
    else:
        print(f"bubble ratio, {args.devices} devices, {args.microbatches} micro-batches:")
        for name, value in result.items():
            print(f"  {name:18s} {value}" if isinstance(value, NotBuilt) else f"  {name:18s} {value:6.1%}")
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


def main(argv: Sequence[str] | None = None) -> dict[str, float | NotBuilt]:
    """The command line: bad input is the parser's error (one line naming the flag or file, exit status 2), here
    rather than in the `accelerate-roundpipe` wrapper so `python -m` gets it too. `run`, `relative_forward_costs`
    and `compare_bubbles` keep raising their exceptions for Python callers."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.grid and not args.split_head:
        parser.error("--grid prints the split-head plan's grid: add --split-head")
    if args.actions and args.json:
        parser.error("--actions prints text and --json prints only JSON: pass one of them")
    try:
        costs = relative_forward_costs(args)
    except ProfileError as e:
        parser.error(str(e))
    except OSError as e:
        why = "no such file" if isinstance(e, FileNotFoundError) else f"cannot read it ({e.strerror})"
        parser.error(f"--profile {args.profile}: {why}; `python -m accelerate_roundpipe.telemetry.report trace.json "
                     f"--profile-out FILE` writes one from a run's trace")
    return run(args, costs)


if __name__ == "__main__":
    main()
