"""KVCache: reserve / write / commit / rewind / crop bookkeeping and its loud failures."""

from __future__ import annotations

import pytest
import torch

from d3d.cache import CacheFullError, KVCache, joined_values, key_rows


def make_cache(capacity: int = 8) -> KVCache:
    return KVCache(num_layers=2, num_kv_heads=1, head_dim=2, capacity=capacity)


def kv(values: list[float]) -> torch.Tensor:
    """(1, 1, T, 2) keys whose slot t holds values[t] in both channels."""
    return torch.tensor(values).repeat_interleave(2).view(1, 1, len(values), 2)


def test_new_cache_is_empty_and_shaped():
    """A fresh cache has nothing committed or pending and the documented tensor layout."""
    cache = KVCache(num_layers=3, num_kv_heads=2, head_dim=4, capacity=10, batch_size=2)
    assert cache.length == 0 and cache.pending == 0
    assert cache.keys.shape == cache.values.shape == (3, 2, 2, 10, 4)
    assert cache.batch_size == 2 and cache.capacity == 10


def test_reserve_write_commit_appends():
    """write() stores the reserved slots and returns K/V over every slot so far; commit keeps them."""
    cache = make_cache()
    assert cache.reserve(3) == 0
    keys, values = cache.write(0, kv([1, 2, 3]), kv([10, 20, 30]))
    assert keys.shape == (1, 1, 3, 2) and torch.equal(keys, kv([1, 2, 3]))
    assert torch.equal(values, kv([10, 20, 30]))
    cache.commit()
    assert cache.length == 3 and cache.pending == 0

    assert cache.reserve(2) == 3
    keys, values = cache.write(0, kv([4, 5]), kv([40, 50]))
    assert torch.equal(keys, kv([1, 2, 3, 4, 5]))
    assert torch.equal(values, kv([10, 20, 30, 40, 50]))
    cache.commit()
    assert cache.length == 5


def test_partial_commit_drops_the_rest():
    """commit(k) keeps only the first k pending slots; the next forward overwrites the dropped ones."""
    cache = make_cache()
    cache.reserve(4)
    cache.write(1, kv([1, 2, 3, 4]), kv([1, 2, 3, 4]))
    cache.commit(2)
    assert cache.length == 2 and cache.pending == 0
    assert cache.reserve(1) == 2
    keys, _ = cache.write(1, kv([9]), kv([9]))
    assert torch.equal(keys, kv([1, 2, 9]))


def test_commit_zero_and_invalid_counts():
    """commit(0) keeps nothing; keeping more than pending or a negative count is refused."""
    cache = make_cache()
    cache.reserve(2)
    cache.commit(0)
    assert cache.length == 0
    cache.reserve(2)
    with pytest.raises(ValueError):
        cache.commit(3)
    with pytest.raises(ValueError):
        cache.commit(-1)


def test_write_must_match_reservation():
    """Writing a different number of tokens than reserved is a programming error."""
    cache = make_cache()
    cache.reserve(2)
    with pytest.raises(AssertionError):
        cache.write(0, kv([1, 2, 3]), kv([1, 2, 3]))


def test_layers_are_independent():
    """Each layer has its own slots."""
    cache = make_cache()
    cache.reserve(1)
    cache.write(0, kv([1]), kv([1]))
    keys1, _ = cache.write(1, kv([7]), kv([7]))
    cache.commit()
    assert torch.equal(cache.keys[0, :, :, :1], kv([1]))
    assert torch.equal(keys1, kv([7]))


def test_reserve_over_capacity_raises():
    """Filling exactly to capacity works; one more slot raises CacheFullError and changes nothing."""
    cache = make_cache(capacity=4)
    cache.reserve(4)
    cache.commit()
    assert cache.length == 4
    with pytest.raises(CacheFullError, match="4"):
        cache.reserve(1)
    assert cache.length == 4
    fresh = make_cache(capacity=4)
    with pytest.raises(CacheFullError):
        fresh.reserve(5)


def test_rewind_and_crop():
    """rewind(n) forgets the last n committed slots; crop(L) keeps the first L; both clear pending."""
    cache = make_cache()
    cache.reserve(6)
    cache.commit()
    cache.rewind(2)
    assert cache.length == 4
    cache.reserve(1)
    cache.crop(1)
    assert cache.length == 1 and cache.pending == 0
    cache.rewind(0)
    assert cache.length == 1
    cache.crop(1)
    assert cache.length == 1
    cache.reset()
    assert cache.length == 0 and cache.pending == 0


def test_rewind_beyond_length_raises():
    """Rewinding more than is cached (or a negative amount) raises and leaves the cache alone."""
    cache = make_cache()
    cache.reserve(3)
    cache.commit()
    with pytest.raises(ValueError):
        cache.rewind(4)
    with pytest.raises(ValueError):
        cache.rewind(-1)
    with pytest.raises(ValueError):
        cache.crop(5)  # growing is not cropping
    assert cache.length == 3


def test_select_rows_keeps_the_chosen_batch_rows():
    """select_rows drops batch rows (finished sequences) and keeps the others' slots and length."""
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, capacity=4, batch_size=3)
    cache.reserve(2)
    keys = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 2, 2)
    cache.write(0, keys, keys + 10)
    cache.commit()
    cache.select_rows(torch.tensor([0, 2]))
    assert cache.batch_size == 2 and cache.length == 2
    assert torch.equal(cache.keys[0, :, 0, :2, 0], torch.tensor([[0.0, 0.0], [2.0, 2.0]]))
    assert torch.equal(cache.values[0, :, 0, :2, 0], torch.tensor([[10.0, 10.0], [12.0, 12.0]]))


def test_split_values_hold_the_same_values():
    """A split cache (V by 32-wide slices of d) stores and returns exactly what a plain one does."""
    plain, split = (KVCache(num_layers=2, num_kv_heads=2, head_dim=64, capacity=8, split=s) for s in (False, True))
    assert split.split and not plain.split and split.values.shape == (2, 1, 2, 2, 8, 32)
    new = torch.randn(2, 1, 2, 5, 64, generator=torch.Generator().manual_seed(0))
    for cache in (plain, split):
        cache.reserve(5)
        keys, values = cache.write(1, new[0], new[1])
        assert torch.equal(keys, new[0]) and torch.equal(values, new[1])
    assert torch.equal(joined_values(split.values), plain.values)


def test_tiled_keys_hold_the_same_values():
    """A cache that also tiles its keys (16 slots by pairs of d, capacity rounded up to whole tiles)
    stores, returns, snapshots and restores exactly what a split one does, across tile boundaries."""
    split, tiled = (KVCache(num_layers=2, num_kv_heads=2, head_dim=64, capacity=37, split=True, tile_keys=t)
                    for t in (False, True))
    assert tiled.tiled and tiled.split and not split.tiled
    assert tiled.keys.shape == (2, 1, 2, 3, 32, 16, 2) and tiled.values.shape == (2, 1, 2, 2, 48, 32)
    assert tiled.position_bytes == split.position_bytes and tiled.capacity == 37
    new = torch.randn(2, 2, 1, 2, 30, 64, generator=torch.Generator().manual_seed(0))
    for cache in (split, tiled):
        for layer in range(2):
            cache.reserve(13)
            keys, values = cache.write(layer, new[0, layer][:, :, :13], new[1, layer][:, :, :13])
            assert torch.equal(keys, new[0, layer][:, :, :13]) and torch.equal(values, new[1, layer][:, :, :13])
        cache.commit()
        for layer in range(2):
            cache.reserve(17)  # slots 13 … 29: the rest of the first tile, a whole one, a part of the third
            keys, values = cache.write(layer, new[0, layer][:, :, 13:], new[1, layer][:, :, 13:])
            assert torch.equal(keys, new[0, layer]) and torch.equal(values, new[1, layer])
        cache.commit()
    (split_keys, split_values), (tiled_keys, tiled_values) = split.snapshot(30), tiled.snapshot(30)
    assert torch.equal(split_keys, tiled_keys) and torch.equal(split_values, tiled_values)
    assert torch.equal(key_rows(tiled.keys)[..., :30, :], split.keys[..., :30, :])
    restored = KVCache(num_layers=2, num_kv_heads=2, head_dim=64, capacity=37, split=True, tile_keys=True)
    restored.restore(split_keys, split_values, 21)  # a split cache's snapshot, into a tiled cache
    assert torch.equal(restored.snapshot(21)[0], split_keys[..., :21, :])
    with pytest.raises(ValueError, match="another layout"):
        restored.restore(*make_cache().snapshot(0), 0)


def test_tiled_keys_go_with_split_values():
    with pytest.raises(ValueError, match="split values"):
        KVCache(num_layers=1, num_kv_heads=1, head_dim=64, capacity=8, tile_keys=True)


def thp_eligible(address: int) -> bool | None:
    """Whether Linux may back the mapping holding `address` with transparent huge pages (its smaps
    `THPeligible`), or None where this kernel does not say."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    return None


def test_a_cpu_cache_is_zeros_in_memory_advised_for_huge_pages():
    """A CPU cache is zeros, writable, in its own mapping advised for huge pages (every step streams it,
    as it streams the weights); where huge pages come only on request (THP `madvise`), a tensor from
    torch's allocator of the same size is not eligible (the negative control)."""
    cache = KVCache(2, 3, 64, 4096, dtype=torch.bfloat16, split=True, tile_keys=True)
    for t in (cache.keys, cache.values):
        assert t.is_contiguous() and not t.any()
    cache.keys[1, 0, 2, -1] = 1.5
    assert cache.keys.sum().item() == 1.5 * cache.keys[1, 0, 2, -1].numel()
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages here")
    if "[never]" in mode or thp_eligible(cache.keys.data_ptr()) is None:
        pytest.skip(f"huge pages off or unreported ({mode.strip()})")
    assert thp_eligible(cache.keys.data_ptr()) and thp_eligible(cache.values.data_ptr())
    if "[madvise]" in mode:
        plain = torch.zeros_like(cache.keys)
        assert not thp_eligible(plain.data_ptr())
