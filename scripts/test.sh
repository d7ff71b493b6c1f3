#!/usr/bin/env bash
# Install d3d with its test dependencies into .venv and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
# Headless Chromium for the live view's browser test (tests/test_server_view.py skips, saying why,
# where it cannot be installed).
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null \
            || echo "# chromium could not be installed: the view's browser test will be skipped" >&2
    else
        echo "# chromium is missing (apt-get install chromium as root): the view's browser test will be skipped" >&2
    fi
fi
python -m pytest -q "$@"
