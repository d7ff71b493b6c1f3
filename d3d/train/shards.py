"""A `d3d data` folder's records on disk: shards of JSON lines, read in order, written atomically.

Data generation (`d3d.train.data`) writes the shards, the target's distributions beside them
(`d3d.train.distill`) follow their record order, and the trainer reads them back; all three meet
here, below each other. This module reads and writes files; it generates nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from d3d.config import ConfigError

DataFolders = str | Path | Sequence[str | Path]  # one `d3d data` folder, or several ("A,B" or a list)


def jsonl_lines(path: Path) -> list[str]:
    """Non-empty lines split on "\n" only: str.splitlines() would also split on U+2028 and
    friends, which JSON strings may hold raw."""
    return [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def write_atomic(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)


def data_folders(data: DataFolders) -> list[Path]:
    """The folders `data` names: one, or several joined by commas (or listed), read in that order as
    one data set. Several must come from the same target (their manifests say which), since one
    drafter trains on them all."""
    items = str(data).split(",") if isinstance(data, (str, Path)) else [str(item) for item in data]
    folders = [Path(item) for item in items if item]
    if not folders:
        raise ConfigError("no data folder given")
    targets = {}
    for folder in folders:
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
        except (OSError, ValueError):
            continue  # a folder made without a manifest (or by hand) is taken as it is
        targets[folder] = (manifest.get("target"), manifest.get("tokenizer_fingerprint"))
    if len(set(targets.values())) > 1:
        made = "; ".join(f"{folder}: {target} (tokenizer {fingerprint})" for folder, (target, fingerprint) in targets.items())
        raise ConfigError(f"these data folders were made by different targets, so one drafter cannot train on them: {made}")
    return folders


def shard_paths(data: DataFolders) -> list[Path]:
    """Every finished shard file of the folders, folder by folder, each in shard order."""
    return [path for folder in data_folders(data) for path in sorted((folder / "shards").glob("shard-*.jsonl"))]


def read_shards(data: DataFolders) -> Iterator[dict[str, Any]]:
    """Every finished (prompt_ids, response_ids) record, in shard order (folder by folder)."""
    for path in shard_paths(data):
        for line in jsonl_lines(path):
            yield json.loads(line)
