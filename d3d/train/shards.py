"""A `d3d data` folder's records on disk: shards of JSON lines, read in order, written atomically.

Data generation (`d3d.train.data`) writes the shards, the target's distributions beside them
(`d3d.train.distill`) follow their record order, and the trainer reads them back; all three meet
here, below each other. This module reads and writes files; it generates nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def jsonl_lines(path: Path) -> list[str]:
    """Non-empty lines split on "\n" only: str.splitlines() would also split on U+2028 and
    friends, which JSON strings may hold raw."""
    return [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def write_atomic(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)


def read_shards(data_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Every finished (prompt_ids, response_ids) record, in shard order."""
    for path in sorted((Path(data_dir) / "shards").glob("shard-*.jsonl")):
        for line in jsonl_lines(path):
            yield json.loads(line)
