"""The commit a benchmark ran at."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit() -> str:
    """$BENCH_COMMIT (device calls copy a working tree without .git), else git's short HEAD."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1])
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"
