"""Print the look-ahead decisions a RoundPipe trace recorded ([Note: shared frozen weights]): for each, the task,
whether it was taken, and the device's allocated, newly needed and idle bytes against the plan's limit (GiB).

    python3 scripts/device/look_ahead_report.py TRACE.json[.gz] [--limit 12]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--limit", type=int, default=12, help="decisions printed (the counts cover all)")
    args = parser.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    tracks = {(e.get("pid"), e.get("tid")): e["args"].get("name") for e in events if e.get("ph") == "M"}
    decisions = [e for e in events if e.get("ph") == "X" and "look-ahead" in (tracks.get((e["pid"], e["tid"])) or "")]
    counts = collections.Counter(e["name"].rsplit(": ", 1)[-1] for e in decisions)
    print(f"{args.trace}: {len(decisions)} look-ahead decisions, {dict(counts)}")
    for e in decisions[:args.limit]:
        gib = {k: round(float(v) / 2**30, 2) for k, v in e.get("args", {}).items()}  # the trace keeps them as text
        print(f"  {e['name']}  {gib}")


if __name__ == "__main__":
    main()
