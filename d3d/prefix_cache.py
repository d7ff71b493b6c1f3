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
import zlib
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
            for staging in self.folder.glob("*.tmp*"):  # a write a killed process left half done
                if file_time(staging) < time.time() - 3600:
                    remove_file(staging)
            for path in sorted(self.folder.glob("*.safetensors"), key=file_time):
                entry = self._read(path, tensors=False)
                if entry is not None:
                    self.stored.append(entry)

    def __len__(self) -> int:
        """Prefixes stored: in memory, or in the folder only."""
        with self._lock:
            paths = {e.path for e in self.entries.values()}
            return len(self.entries) + sum(e.path not in paths for e in self.stored)

    def restore(self, cache: KVCache, prompt_ids: list[int], limit: int) -> int:
        """Copy the longest stored prefix of `prompt_ids`, at most `limit` positions, into `cache`
        (which then holds just those); returns its length (0: nothing stored matches)."""
        prompt = torch.tensor(prompt_ids[:max(0, limit)], dtype=torch.long)
        with self._lock:
            self.stats.lookups += 1
            slots = slots_read(cache)
            while True:  # a file that fails its read leaves the list: then the next best
                best, length = None, 0
                for key, entry in [*self.entries.items(), *((None, e) for e in self.stored)]:
                    if entry.slots != slots:  # computed over other slots: on a GPU, maybe other bits
                        continue
                    common = common_prefix(prompt, entry.tokens)
                    if common > length:
                        best, length = (key, entry), common
                if best is None:
                    return 0
                key, entry = best
                if key is not None:
                    self.entries.move_to_end(key)
                    cache.restore(entry.keys, entry.values, length)
                    break
                read = self._read(entry.path, tensors=True)  # in the folder only: read it whole
                try:  # as listed (another process may have replaced it), and of this cache's layout
                    if read is None or read.slots != slots or common_prefix(prompt, read.tokens) < length:
                        raise ValueError("not the file listed")
                    cache.restore(read.keys, read.values, length)
                except ValueError:
                    self._forget(entry.path)
                    continue
                touch(read.path)
                self._list(read)
                self._hold(read)  # memory keeps it too, where it fits
                self.stats.disk_hits += 1
                break
            self.stats.hits += 1
            self.stats.reused_tokens += length
        return length

    def keep(self, tokens: list[int], cache: KVCache, to_disk: bool = True) -> None:
        """Store `cache`'s first len(tokens) committed positions, whose tokens are `tokens` — in memory
        as many of the first as its budget holds, and unless not `to_disk` in the folder as many as
        the folder's budget holds."""
        per_position = cache.position_bytes + 8  # and its token id
        length = min(len(tokens), cache.length)
        in_memory = min(length, self.max_bytes // per_position)
        on_disk = min(length, self.disk_bytes // per_position) if to_disk and self.folder is not None else 0
        with self._lock:
            held = self._keep_in_memory(tokens[:in_memory], cache) if in_memory else None
            if on_disk == 0:
                return
            if held is None or len(held.tokens) < on_disk:
                held = Entry(torch.tensor(tokens[:on_disk], dtype=torch.long), *cache.snapshot(on_disk), slots_read(cache))
            if held.path is None or not held.path.exists():  # not in the folder yet, or no longer
                self._write(held)

    def _keep_in_memory(self, tokens: list[int], cache: KVCache) -> Entry:
        """The memory entry holding `tokens`' positions: one already there that holds them, or a new
        one, replacing those it extends."""
        count = len(tokens)
        stored = torch.tensor(tokens, dtype=torch.long)
        for key, entry in list(self.entries.items()):
            common = common_prefix(stored, entry.tokens)
            if common == count:  # already held, within a longer entry
                self.entries.move_to_end(key)
                return entry
            if common == len(entry.tokens):  # the new entry extends this one
                self._drop(key)
        entry = Entry(stored, *cache.snapshot(count), slots_read(cache))
        self._hold(entry)
        return entry

    def _hold(self, entry: Entry) -> None:
        """Keep `entry` in memory, the least recently used leaving while over the budget."""
        self.entries[self._next_key] = entry
        self._next_key += 1
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _write(self, entry: Entry) -> None:
        """`entry` into the folder: a file per entry, replacing the ones it extends, with a checksum of
        its bytes that a read checks (a file cut short or zeroed by a crash is never restored from)."""
        count = len(entry.tokens)
        for stored in list(self.stored):
            if not stored.path.exists():  # removed by another process
                self._forget(stored.path)
                continue
            common = common_prefix(entry.tokens, stored.tokens)
            if common == count:  # a longer file holds it
                touch(stored.path)
                return
            if common == len(stored.tokens):
                self._forget(stored.path)
        size = entry.nbytes + 4096
        if size > self.disk_bytes:
            return
        while self.stored and sum(file_size(e.path) for e in self.stored) + size > self.disk_bytes:
            self._forget(self.stored[0].path)
        digest = hashlib.sha256(entry.tokens.numpy().tobytes()).hexdigest()[:24]
        path = self.folder / f"{digest}.safetensors"
        staging = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tensors = {"tokens": entry.tokens, "keys": entry.keys.contiguous(), "values": entry.values.contiguous()}
        try:
            save_tensors(tensors, staging, metadata={"slots": str(entry.slots), "crc32": str(checksum(tensors))})
            os.replace(staging, path)
        except Exception:  # noqa: BLE001 - a full, removed or read-only folder (safetensors' own error types too): memory keeps it
            remove_file(staging)
            return
        entry.path = path
        self._list(entry)

    def _read(self, path: Path, tensors: bool) -> Entry | None:
        """The entry in `path` (its tokens only unless `tensors`, then checked against its checksum);
        None, and the file removed, where it cannot be read or does not check."""
        try:
            with safe_open(str(path), framework="pt") as file:
                metadata = file.metadata() or {}
                names = ("tokens", "keys", "values") if tensors else ("tokens",)
                read = {name: file.get_tensor(name) for name in names}
            slots = metadata.get("slots", "None")
            entry = Entry(read["tokens"], read.get("keys"), read.get("values"), None if slots == "None" else int(slots), path)
            if entry.tokens.dtype != torch.long or entry.tokens.dim() != 1:
                raise ValueError("not a prefix's tokens")
            if tensors and (str(checksum(read)) != metadata.get("crc32")
                            or not entry.keys.shape[-2] == entry.values.shape[-2] == len(entry.tokens)):
                raise ValueError("its bytes are not the ones written")
            return entry
        except Exception:  # noqa: BLE001 - a damaged or foreign file: never restore from it
            self._forget(path)
            return None

    def _list(self, entry: Entry) -> None:
        """`entry`'s file listed as the folder's most recently used (its tokens only)."""
        self.stored = [e for e in self.stored if e.path != entry.path]
        self.stored.append(Entry(entry.tokens, None, None, entry.slots, entry.path))

    def _forget(self, path: Path) -> None:
        """A folder's file, listed or not, gone."""
        self.stored = [e for e in self.stored if e.path != path]
        remove_file(path)

    def clear(self) -> None:
        """Forget every stored prefix: memory's, and the folder's files."""
        with self._lock:
            self.entries.clear()
            self.nbytes = 0
            for entry in list(self.stored):
                self._forget(entry.path)

    def _drop(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes


def checksum(tensors: dict[str, torch.Tensor]) -> int:
    """CRC-32 of the tensors' bytes, in name order."""
    value = 0
    for name in sorted(tensors):
        value = zlib.crc32(tensors[name].contiguous().view(torch.uint8).numpy(), value)
    return value


def remove_file(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # a folder shared read-only, or another user's file
        pass


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
