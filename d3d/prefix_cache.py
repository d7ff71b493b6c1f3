"""Prompts already computed: the keys and values of earlier generations, reused by later prompts
that begin with the same tokens — a chat's next turn (the conversation so far, then one more
message), a shared system prompt, a request sent again.

A generation leaves its cache here once its prompt is in and again when it ends (`keep`: the
positions it committed, as a trimmed copy); a new one copies in the longest stored prefix of its
prompt (`restore`) and computes only the rest. That is exact by construction where the target's
kernels are row-exact (`d3d.exactness`: verify mode "batched"): a position's keys and values are
the same bits whichever forward computed them — the prompt in one piece or in several, a
verification's rows, another request's prompt — so a restored prefix holds what this prompt's own
prefill would have written. `d3d.run.Run` uses it only there.

Bounded in bytes, the least recently used entry leaving first (a sequence longer than the whole
budget leaves the prefix that fits); an entry that a new one extends is replaced by it.
Thread-safe. This module knows caches and token ids, not models or text.

With a `folder`, every kept entry is also written there (a safetensors file of its tokens, keys and
values, renamed into place whole), and a later process with the same folder starts from them: the
same long document asked about again costs a file's read instead of its prefill. The folder must
belong to one target on one machine and kernel build — the caller keys it (`d3d.generation`'s
`Pipeline.keep_prefixes`: by `d3d.exactness.machine_key`) — since only there are a position's bits
the ones this process would compute. Bounded by `disk_bytes`, the least recently used file leaving
first; a file that cannot be read is removed and never restored from.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from d3d.cache import KVCache, slots_of
from d3d.files import save_tensors

# `d3d serve`'s and `d3d chat`'s default budget: ~23K positions of SmolLM2-135M in bf16 (22.5 KiB each),
# ~3.5K of an 8B model with 8 KV heads of 128 (144 KiB each).
PREFIX_CACHE_MB = 512
PREFIX_DISK_MB = 4096  # with a folder: a 4K-token prompt of SmolLM2-135M is ~94 MB on disk


@dataclass
class Entry:
    tokens: torch.Tensor  # (L,) the token at each stored position
    keys: torch.Tensor | None  # `KVCache.snapshot`'s copies of the L positions (None: on disk only, at `path`)
    values: torch.Tensor | None
    slots: int | None = None  # a GPU's pooled cache's slot count (d3d.graphs: attention reads them all)
    path: Path | None = None  # its file in the cache's folder, if any

    @property
    def nbytes(self) -> int:
        """Bytes it holds in memory."""
        return sum(t.numel() * t.element_size() for t in (self.tokens, self.keys, self.values) if t is not None)


@dataclass
class PrefixStats:
    """What the cache saved: `/metrics` reports these."""

    lookups: int = 0  # prompts that asked
    hits: int = 0  # of those, prompts that reused a stored prefix
    reused_tokens: int = 0  # positions copied in instead of computed
    disk_hits: int = 0  # of the hits, prefixes read from the folder


class PrefixCache:
    """Stored KV prefixes of one target's caches, at most `max_bytes` of them."""

    def __init__(self, max_bytes: int, folder: str | Path | None = None, disk_bytes: int = PREFIX_DISK_MB << 20) -> None:
        if max_bytes < 0 or disk_bytes < 0:
            raise ValueError(f"max_bytes and disk_bytes must be at least 0, got {max_bytes}, {disk_bytes}")
        self.max_bytes, self.disk_bytes = max_bytes, disk_bytes
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.stats = PrefixStats()
        self._next_key = 0
        self._lock = threading.Lock()
        self.folder = None if folder is None else Path(folder)
        self.stored: list[Entry] = []  # the folder's entries, tokens only, least recently used first
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            for staging in self.folder.glob("*.tmp"):  # a write a killed process left half done
                if file_time(staging) < time.time() - 3600:
                    staging.unlink(missing_ok=True)
            for path in sorted(self.folder.glob("*.safetensors"), key=file_time):
                entry = self._read(path, tensors=False)
                if entry is not None:
                    self.stored.append(entry)

    def __len__(self) -> int:
        """Prefixes stored: in memory, or in the folder only."""
        paths = {e.path for e in self.entries.values()}
        return len(self.entries) + sum(e.path not in paths for e in self.stored)

    def restore(self, cache: KVCache, prompt_ids: list[int], limit: int) -> int:
        """Copy the longest stored prefix of `prompt_ids`, at most `limit` positions, into `cache`
        (which then holds just those); returns its length (0: nothing stored matches)."""
        prompt = torch.tensor(prompt_ids[:max(0, limit)], dtype=torch.long)
        with self._lock:
            self.stats.lookups += 1
            best, length = None, 0
            slots = slots_read(cache)
            for key, entry in [*self.entries.items(), *((None, e) for e in self.stored)]:
                if entry.slots != slots:  # computed over other slots: on a GPU, maybe other bits
                    continue
                common = common_prefix(prompt, entry.tokens)
                if common > length:
                    best, length = (key, entry), common
            if best is None:
                return 0
            key, entry = best
            if key is None:  # in the folder only: read it (memory keeps it too, where it fits)
                entry = self._read(entry.path, tensors=True)
                if entry is None:
                    return 0
                touch(entry.path)
                self.stored.append(self.stored.pop(next(i for i, e in enumerate(self.stored) if e.path == entry.path)))
                self._hold(entry)
                self.stats.disk_hits += 1
            else:
                self.entries.move_to_end(key)
            cache.restore(entry.keys, entry.values, length)
            self.stats.hits += 1
            self.stats.reused_tokens += length
        return length

    def keep(self, tokens: list[int], cache: KVCache, to_disk: bool = True) -> None:
        """Store `cache`'s first len(tokens) committed positions, whose tokens are `tokens` — as many
        of the first as the whole budget holds, when not all; in the folder too unless not `to_disk`."""
        per_position = cache.position_bytes + 8  # and its token id
        budget = max(self.max_bytes, self.disk_bytes if self.folder is not None else 0)
        count = min(len(tokens), cache.length, budget // per_position)
        if count == 0:
            return
        stored = torch.tensor(tokens[:count], dtype=torch.long)
        with self._lock:
            for key, entry in list(self.entries.items()):
                common = common_prefix(stored, entry.tokens)
                if common == count:  # already held, within a longer entry
                    self.entries.move_to_end(key)
                    if to_disk and entry.path is None:  # held in memory only so far
                        self._write(entry)
                    return
                if common == len(entry.tokens):  # the new entry extends this one
                    self._drop(key)
            keys, values = cache.snapshot(count)
            entry = Entry(stored, keys, values, slots_read(cache))
            if to_disk:
                self._write(entry)
            self._hold(entry)

    def _hold(self, entry: Entry) -> None:
        """Keep `entry` in memory, the least recently used leaving while over the budget."""
        self.entries[self._next_key] = entry
        self._next_key += 1
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _write(self, entry: Entry) -> None:
        """`entry` into the folder too (if any): a file per entry, replacing the ones it extends."""
        if self.folder is None:
            return
        count = len(entry.tokens)
        for stored in list(self.stored):
            common = common_prefix(entry.tokens, stored.tokens)
            if common == count:  # a longer file holds it
                touch(stored.path)
                entry.path = stored.path
                return
            if common == len(stored.tokens):
                self._remove(stored)
        size = entry.nbytes + 4096
        if size > self.disk_bytes:
            return
        while self.stored and sum(file_size(e.path) for e in self.stored) + size > self.disk_bytes:
            self._remove(self.stored[0])
        digest = hashlib.sha256(entry.tokens.numpy().tobytes()).hexdigest()[:24]
        path = self.folder / f"{digest}.safetensors"
        staging = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            save_tensors({"tokens": entry.tokens, "keys": entry.keys.contiguous(), "values": entry.values.contiguous()},
                         staging, metadata={"slots": str(entry.slots)})
            os.replace(staging, path)
        except OSError:  # a full or read-only disk: memory keeps it
            staging.unlink(missing_ok=True)
            return
        entry.path = path
        self.stored.append(Entry(entry.tokens, None, None, entry.slots, path))

    def _read(self, path: Path, tensors: bool) -> Entry | None:
        """The entry in `path` (its tokens only unless `tensors`); None, and the file removed, where it
        cannot be read."""
        try:
            with safe_open(str(path), framework="pt") as file:
                slots = file.metadata().get("slots", "None")
                read = [file.get_tensor(name) for name in (("tokens", "keys", "values") if tensors else ("tokens",))]
            entry = Entry(read[0], *(read[1:] if tensors else (None, None)),
                          None if slots == "None" else int(slots), path)
            if entry.tokens.dtype != torch.long or entry.tokens.dim() != 1:
                raise ValueError("not a prefix's tokens")
            return entry
        except Exception:  # noqa: BLE001 - a damaged or foreign file: never restore from it
            self.stored = [e for e in self.stored if e.path != path]
            path.unlink(missing_ok=True)
            return None

    def _remove(self, entry: Entry) -> None:
        self.stored.remove(entry)
        entry.path.unlink(missing_ok=True)

    def clear(self) -> None:
        """Forget every stored prefix: memory's, and the folder's files."""
        with self._lock:
            self.entries.clear()
            self.nbytes = 0
            for entry in list(self.stored):
                self._remove(entry)

    def _drop(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes


def touch(path: Path) -> None:
    """Mark a file used now (the folder's recency); another process may have removed it."""
    try:
        os.utime(path)
    except OSError:
        pass


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # removed by another process sharing the folder
        return 0


def file_time(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def slots_read(cache: KVCache) -> int | None:
    """The slots every forward over `cache` reads where that is all of them (a GPU's pooled caches,
    d3d.graphs), else None (the CPU kernels read the keys before each row, whatever the storage)."""
    return slots_of(cache.keys, cache.values) if cache.pooled is not None else None


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens two 1-D id tensors share."""
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n
