#!/usr/bin/env bash
# Install, then run the whole test suite (GPU tests are skipped without a GPU) and the lint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,docs   # pytest, ruff, TRL, mkdocs: what the suite and the docs build need
python3 -m ruff check accelerate_roundpipe tests integration_tests examples benchmarks
NO_MKDOCS_2_WARNING=1 python3 -m mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
python3 -m pytest -q -ra "$@"
