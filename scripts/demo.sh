#!/usr/bin/env bash
# Install d3d into .venv and run the main job: a real generation on the embedded default target,
# speculative decoding beside plain AR decoding in the same process, with τ and the speedup.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
# The default prompt is a HumanEval-style task (written here, not taken from the benchmark): the
# kind of prompt whose benchmark average is in the README. Pass your own prompt as the argument.
PROMPT='Complete this Python function and explain how it works.

def running_max(numbers: list[int]) -> list[int]:
    """Return a list where element i is the largest of numbers[0..i].
    >>> running_max([1, 3, 2, 5, 4])
    [1, 3, 3, 5, 5]
    """'
d3d generate --compare-ar "${@:-$PROMPT}"
