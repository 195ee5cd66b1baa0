"""How every benchmark script reports a record: one `RESULT` line on stdout (what `bench.sh` greps for) and, with
an output file, the record appended to it as a JSON line (what `collect.py` and benchmarks/results keep)."""

from __future__ import annotations

import json


def emit(record: dict, out: str | None, label: str = "", digits: int | None = None) -> None:
    """Print `record` as `RESULT [label] {...}` (floats rounded to `digits` on screen only) and append it whole
    to `out`, if given."""
    shown = record if digits is None else {k: round(v, digits) if isinstance(v, float) else v
                                           for k, v in record.items()}
    print(" ".join(["RESULT", *([label] if label else []), json.dumps(shown)]), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
