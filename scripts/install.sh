#!/usr/bin/env bash
# Installs the package, with the extras named in $1 (e.g. `test,docs`; none by default: the main job needs none).
# A machine without torch gets the CPU build that lies on the CI disk (pip's plain `torch` would fetch a multi-GB CUDA
# build); a machine with torch keeps its own.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".${extras:+[$extras]}"
