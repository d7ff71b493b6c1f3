"""The target's next-token distributions over its own responses: what `d3d train --distill` matches.

For every response token the target generated, the distribution it came from, at temperature 1,
kept as its top-k tokens and their log-probabilities; the rest of the mass is 1 − Σ exp(logprobs).
At T > 0 a draft is accepted with probability 1 − TV(p, q), so a drafter that matches the target's
distribution — not only its argmax — is what sampling rewards (PARD-2 trains on KL to it).

Stored beside the shards, one file per shard, in record order:

    distill/shard-NNNNN.safetensors   ids (R, k) int32, logprobs (R, k) float32, offsets (N+1,) int64

R is the shard's response tokens, rows offsets[i]:offsets[i+1] are record i's (row j: the
distribution that predicted response token j). `d3d data --distill-top-k K` records them while it
generates (from the logits it decodes with) and fills in shards generated without them by one
teacher-forced pass of the target. Files are written atomically; a rerun skips finished ones.

This module stores and computes distributions; the loss that uses them is in `d3d.train.trainer`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tqdm import tqdm

from d3d.config import ConfigError
from d3d.files import save_tensors
from d3d.models import Decoder
from d3d.train.shards import DataFolders, jsonl_lines, shard_paths


@dataclass
class TopK:
    """One record's distributions: row j predicted response token j."""

    ids: torch.Tensor  # (n, k) int32 token ids, most likely first
    logprobs: torch.Tensor  # (n, k) float32 log-probabilities at temperature 1

    def __post_init__(self) -> None:
        assert self.ids.shape == self.logprobs.shape and self.ids.dim() == 2, (self.ids.shape, self.logprobs.shape)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, rows: slice) -> "TopK":
        return TopK(self.ids[rows], self.logprobs[rows])


@dataclass
class Generated:
    """One greedy response, and with `top_k` the distributions that chose its tokens: what `d3d data`
    gets for a prompt, from the local target (`d3d.train.data`) or a server (`d3d.train.remote`)."""

    response_ids: list[int]
    distributions: TopK | None = None  # row j: the target's top-k when it chose response token j


def keep_top(logits: torch.Tensor, k: int) -> TopK:
    """(n, V) logits → their top-k tokens and log-probabilities (softmax in fp32)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    return TopK(ids.to(torch.int32), values)


def path_for(shard: Path) -> Path:
    """distill/shard-NNNNN.safetensors for shards/shard-NNNNN.jsonl."""
    return shard.parent.parent / "distill" / shard.with_suffix(".safetensors").name


def write(path: Path, records: list[TopK]) -> None:
    """One shard's distributions, record by record (none for a shard whose every record a server's
    answers left out, `d3d.train.remote`)."""
    lengths = torch.tensor([0] + [len(r) for r in records], dtype=torch.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp")
    records = records or [TopK(torch.zeros((0, 0), dtype=torch.int32), torch.zeros((0, 0)))]  # no rows, no record
    save_tensors({"ids": torch.cat([r.ids for r in records]).contiguous(),
                  "logprobs": torch.cat([r.logprobs for r in records]).float().contiguous(),
                  "offsets": lengths.cumsum(0)}, staging)
    os.replace(staging, path)  # a file exists completely or not at all


def read(path: Path) -> list[TopK]:
    try:
        tensors = load_file(str(path))
        ids, logprobs, offsets = tensors["ids"], tensors["logprobs"], tensors["offsets"].tolist()
    except (OSError, SafetensorError, KeyError) as error:
        raise ConfigError(f"{path} is not a readable distribution file ({error}); delete it and rerun "
                          "`d3d data --distill-top-k K` to recompute it") from None
    return [TopK(ids[a:b], logprobs[a:b]) for a, b in zip(offsets, offsets[1:])]


@torch.no_grad()
def teacher_forced(target: Decoder, prompt_ids: list[int], response_ids: list[int], k: int) -> TopK:
    """The target's distributions over a given response: one forward over prompt + response."""
    ids = torch.tensor([prompt_ids + response_ids], device=target.device)
    logits = target(ids, cache=target.new_cache(ids.shape[1]))[0]  # (P + n, V)
    start = len(prompt_ids) - 1  # the last prompt token predicts the first response token
    return keep_top(logits[start:start + len(response_ids)], k)


def add_missing(target: Decoder, data_dir: str | Path, k: int, progress: bool = True) -> int:
    """Write the distribution file of every finished shard that lacks one; returns how many."""
    shards = sorted((Path(data_dir) / "shards").glob("shard-*.jsonl"))
    missing = [s for s in shards if not path_for(s).is_file()]
    for shard in tqdm(missing, desc="target distributions (teacher-forced)", unit="shard", disable=not progress):
        records = [json.loads(line) for line in jsonl_lines(shard)]
        write(path_for(shard), [teacher_forced(target, r["prompt_ids"], r["response_ids"], k) for r in records])
    return len(missing)


def check_top_k(data_dir: str | Path, k: int) -> None:
    """Refuse to mix files of another k into one folder."""
    for path in sorted((Path(data_dir) / "distill").glob("shard-*.safetensors"))[:1]:
        found = read(path)
        width = next((r.ids.shape[1] for r in found if len(r)), k)
        if width != k:
            raise ConfigError(f"{path.parent} holds top-{width} distributions; rerun with --distill-top-k {width}")


def available(data_dir: DataFolders) -> bool:
    """Whether every finished shard of the data folder(s) has its distributions."""
    shards = shard_paths(data_dir)
    return bool(shards) and all(path_for(shard).is_file() for shard in shards)


def read_all(data_dir: DataFolders) -> Iterator[TopK]:
    """Every finished shard's distributions, record by record, in the order of `read_shards`."""
    for shard in shard_paths(data_dir):
        path = path_for(shard)
        if not path.is_file():
            raise ConfigError(f"{shard.name} has no distributions: run `d3d data --out {shard.parent.parent} "
                              "--distill-top-k 32` (it adds them to the finished shards), then train again")
        yield from read(path)
