#!/usr/bin/env bash
# Install, then run the main job: a small training run on RoundPipe (GPU if present, CPU otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh   # the package alone: the test and docs extras are scripts/test.sh's
python3 -m accelerate_roundpipe.tiny.train "$@"
