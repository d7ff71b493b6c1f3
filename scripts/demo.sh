#!/usr/bin/env bash
# Install d3d into .venv and run the main job: a real generation on the embedded default target,
# speculative decoding beside plain AR decoding in the same process, with τ and the speedup.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
d3d generate --compare-ar "${@:-Write a Python function that returns the n-th Fibonacci number, with a docstring.}"
