#!/usr/bin/env bash
# Install d3d with its test dependencies into .venv and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
python -m pytest -q "$@"
