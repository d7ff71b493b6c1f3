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
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from d3d.cache import KVCache, slots_of

# `d3d serve`'s and `d3d chat`'s default budget: ~23K positions of SmolLM2-135M in bf16 (22.5 KiB each),
# ~3.5K of an 8B model with 8 KV heads of 128 (144 KiB each).
PREFIX_CACHE_MB = 512


@dataclass
class Entry:
    tokens: torch.Tensor  # (L,) the token at each stored position
    keys: torch.Tensor  # `KVCache.snapshot`'s copies of the L positions
    values: torch.Tensor
    slots: int | None = None  # a GPU's pooled cache's slot count (d3d.graphs: attention reads them all)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tokens, self.keys, self.values))


@dataclass
class PrefixStats:
    """What the cache saved: `/metrics` reports these."""

    lookups: int = 0  # prompts that asked
    hits: int = 0  # of those, prompts that reused a stored prefix
    reused_tokens: int = 0  # positions copied in instead of computed


class PrefixCache:
    """Stored KV prefixes of one target's caches, at most `max_bytes` of them."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be at least 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.stats = PrefixStats()
        self._next_key = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    def restore(self, cache: KVCache, prompt_ids: list[int], limit: int) -> int:
        """Copy the longest stored prefix of `prompt_ids`, at most `limit` positions, into `cache`
        (which then holds just those); returns its length (0: nothing stored matches)."""
        prompt = torch.tensor(prompt_ids[:max(0, limit)], dtype=torch.long)
        with self._lock:
            self.stats.lookups += 1
            best, length = None, 0
            slots = slots_read(cache)
            for key, entry in self.entries.items():
                if entry.slots != slots:  # computed over other slots: on a GPU, maybe other bits
                    continue
                common = common_prefix(prompt, entry.tokens)
                if common > length:
                    best, length = key, common
            if best is None:
                return 0
            self.entries.move_to_end(best)
            entry = self.entries[best]
            cache.restore(entry.keys, entry.values, length)
            self.stats.hits += 1
            self.stats.reused_tokens += length
        return length

    def keep(self, tokens: list[int], cache: KVCache) -> None:
        """Store `cache`'s first len(tokens) committed positions, whose tokens are `tokens` — as many
        of the first as the whole budget holds, when not all."""
        per_position = cache.position_bytes + 8  # and its token id
        count = min(len(tokens), cache.length, self.max_bytes // per_position)
        if count == 0:
            return
        stored = torch.tensor(tokens[:count], dtype=torch.long)
        with self._lock:
            for key, entry in list(self.entries.items()):
                common = common_prefix(stored, entry.tokens)
                if common == count:  # already held, within a longer entry
                    self.entries.move_to_end(key)
                    return
                if common == len(entry.tokens):  # the new entry extends this one
                    self._drop(key)
            keys, values = cache.snapshot(count)
            entry = Entry(stored, keys, values, slots_read(cache))
            self.entries[self._next_key] = entry
            self._next_key += 1
            self.nbytes += entry.nbytes
            while self.nbytes > self.max_bytes:
                self._drop(next(iter(self.entries)))

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self.nbytes = 0

    def _drop(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes


def slots_read(cache: KVCache) -> int | None:
    """The slots every forward over `cache` reads where that is all of them (a GPU's pooled caches,
    d3d.graphs), else None (the CPU kernels read the keys before each row, whatever the storage)."""
    return slots_of(cache.keys, cache.values) if cache.pooled is not None else None


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens two 1-D id tensors share."""
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n
