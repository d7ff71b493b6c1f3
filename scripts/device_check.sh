#!/usr/bin/env bash
# One-call device check (issue 17): CUDA tests, AR tokens/s against transformers `generate`, the
# cost of a 16-row verification in one-token steps, and sync/async speedup against a set τ with the
# simulated drafter — on random SmolLM2-135M-shaped weights, so it needs no network and no model
# files. Writes at most 4 files (device_check.json, device_check.md, tests.txt, sweep.png) to $OUT
# or --out DIR (default runs/device_check). Meant to finish in under 8 minutes on one GPU.
#
#   scripts/device_check.sh                       # cuda when torch sees a GPU, else cpu
#   scripts/device_check.sh --device cpu --size tiny --out /tmp/check   # the test suite's reduced form
set -euo pipefail
cd "$(dirname "$0")/.."
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python
exec "$python" -m d3d.bench.device_check "$@"
