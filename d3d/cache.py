"""Preallocated KV cache with append and rewind.

One tensor pair per model, filled from slot 0 up to `length`: keys shaped (layers, batch, kv_heads,
capacity, head_dim); values the same, or with `split=True` (layers, batch, kv_heads, head_dim /
V_PART, capacity, V_PART) — each V_PART-wide slice of d stored for every slot before the next, the
layout the row-exact kernels' weighted sums stream fastest (d3d/kernels/attention.h). A split cache
may also tile its keys (`tile_keys=True`, where the kernels read them so): (layers, batch, kv_heads,
⌈capacity / KEY_TILE⌉, head_dim / 2, KEY_TILE, 2) — each tile of KEY_TILE slots by pairs of d, the
layout the scores of a one-token step read without transposing (attention.h), its capacity rounded
up to whole tiles (values' too, so that both advance alike from head to head). Values with a
dimension more or less than their keys are split; keys with one more than their values are tiled;
every reader and writer of the cache tells them apart that way. A forward pass writes its new
keys/values at `length ... length+T` and the caller
decides how many of them to keep (`commit`) — speculative decoding keeps the accepted prefix and
drops the rest. Asking for more than the capacity fails loudly instead of reallocating.
This module knows nothing about models or tokens.
"""

from __future__ import annotations

import torch

from d3d.memory import huge_zeros


V_PART = 32  # values of d a split V stores together (attention.h's V_PART)
KEY_TILE = 16  # slots a tiled cache stores together (attention.h's KEY_TILE)


def split_values(values: torch.Tensor) -> torch.Tensor:
    """Values (..., T, D) as a split cache stores them: (..., D / V_PART, T, V_PART)."""
    return values.unflatten(-1, (values.shape[-1] // V_PART, V_PART)).transpose(-3, -2)


def joined_values(values: torch.Tensor) -> torch.Tensor:
    """A split cache's values (..., D / V_PART, T, V_PART) as rows (..., T, D) (a copy)."""
    return values.transpose(-3, -2).flatten(-2)


def is_split(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `values` (beside their `keys`) are stored split: a dimension more or less than the
    keys (one more than plain keys, one less than tiled ones)."""
    return values.dim() != keys.dim()


def is_tiled(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `keys` (beside their split `values`) are stored tiled: one dimension more than the values."""
    return keys.dim() == values.dim() + 1


def tiled_keys(keys: torch.Tensor) -> torch.Tensor:
    """Keys (..., T, D) as a tiled cache stores them: (..., ⌈T / KEY_TILE⌉, D / 2, KEY_TILE, 2), the
    slots past T zero (a contiguous copy)."""
    length, dim = keys.shape[-2:]
    padded = torch.nn.functional.pad(keys, (0, 0, 0, -length % KEY_TILE))
    return padded.unflatten(-2, (-1, KEY_TILE)).unflatten(-1, (dim // 2, 2)).transpose(-3, -2).contiguous()


def key_rows(keys: torch.Tensor) -> torch.Tensor:
    """A tiled cache's keys (..., tiles, D / 2, KEY_TILE, 2) as rows (..., tiles · KEY_TILE, D) (a copy)."""
    return keys.transpose(-3, -2).flatten(-2).flatten(-3, -2)


def covering_tiles(keys: torch.Tensor, end: int) -> torch.Tensor:
    """The tiles of tiled keys that hold slots 0 … end-1 (a view)."""
    return keys[..., :-(-end // KEY_TILE), :, :, :]


def write_key_rows(keys: torch.Tensor, start: int, rows: torch.Tensor) -> None:
    """Store rows (..., T, D) at slots start … start+T-1 of tiled keys (the tiles they touch rewritten)."""
    end = start + rows.shape[-2]
    first, last = start // KEY_TILE, -(-end // KEY_TILE)
    block = key_rows(keys[..., first:last, :, :, :])
    block[..., start - first * KEY_TILE:end - first * KEY_TILE, :] = rows
    keys[..., first:last, :, :, :] = tiled_keys(block)


def slots_of(keys: torch.Tensor, values: torch.Tensor) -> int:
    """The slots a cache's (or one layer's) keys and values hold."""
    return values.shape[-2]


def store(keys: torch.Tensor, values: torch.Tensor, start: int, new_keys: torch.Tensor,
          new_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one layer's new K/V (B, H_kv, T, D) at slots start … start+T-1 of its keys and values
    (plain, split or tiled); return K/V over slots 0 … start+T-1 as rows (a copy where not plain)."""
    end = start + new_keys.shape[2]
    if is_tiled(keys, values):
        write_key_rows(keys, start, new_keys)
        keys_so_far = key_rows(covering_tiles(keys, end))[..., :end, :]
    else:
        keys[:, :, start:end] = new_keys
        keys_so_far = keys[:, :, :end]
    if is_split(keys, values):
        values[..., start:end, :] = split_values(new_values)
        return keys_so_far, joined_values(values[..., :end, :])
    values[:, :, start:end] = new_values
    return keys_so_far, values[:, :, :end]


class CacheFullError(RuntimeError):
    """The sequence would exceed the cache's capacity (the model's context limit)."""


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 batch_size: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", split: bool = False, tile_keys: bool = False,
                 storage: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """`storage`: plain keys and values (num_layers, batch_size, num_kv_heads, ≥ capacity, head_dim) to
        hold instead of fresh zeros — a GPU's pooled caches (d3d.graphs), whose slots past `capacity`
        no forward reads."""
        if split and head_dim % V_PART:
            raise ValueError(f"split values need a head_dim that is a multiple of {V_PART}, not {head_dim}")
        if tile_keys and not split:
            raise ValueError("tiled keys go with split values")
        slots = capacity + -capacity % KEY_TILE if tile_keys else capacity  # whole tiles
        shape = (num_layers, batch_size, num_kv_heads, slots, head_dim)
        key_shape = (*shape[:3], slots // KEY_TILE, head_dim // 2, KEY_TILE, 2) if tile_keys else shape
        value_shape = (*shape[:3], head_dim // V_PART, slots, V_PART) if split else shape
        if storage is not None:
            keys, values = storage
            assert not split and not tile_keys and keys.shape == values.shape and keys.shape[:3] == shape[:3] \
                and keys.shape[3] >= capacity and keys.shape[4] == head_dim, "plain storage of this cache's shape"
            self.keys, self.values = keys, values
        elif torch.device(device).type == "cpu":  # streamed by every step: huge pages (d3d.memory)
            self.keys, self.values = huge_zeros(key_shape, dtype), huge_zeros(value_shape, dtype)
        else:
            self.keys = torch.zeros(key_shape, dtype=dtype, device=device)
            self.values = torch.zeros(value_shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.pooled: object | None = None  # the pooled storage (d3d.graphs) this cache holds, if any
        self.length = 0  # committed slots
        self.pending = 0  # slots written by the last forward but not yet committed

    @property
    def split(self) -> bool:
        """Whether the values are stored split (module docstring)."""
        return is_split(self.keys, self.values)

    @property
    def tiled(self) -> bool:
        """Whether the keys are stored tiled (module docstring)."""
        return is_tiled(self.keys, self.values)

    @property
    def position_bytes(self) -> int:
        """Bytes of keys and values one slot holds."""
        slots = slots_of(self.keys, self.values)
        return sum(t.numel() // slots * t.element_size() for t in (self.keys, self.values))

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    def reserve(self, num_new: int) -> int:
        """Claim `num_new` slots after the committed ones for a forward pass; returns their start."""
        if self.length + num_new > self.capacity:
            raise CacheFullError(
                f"KV cache holds {self.capacity} positions; {self.length} used, {num_new} more asked")
        self.pending = num_new
        return self.length

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new K/V (B, H_kv, T, D) in the reserved slots; return K/V over all slots so far."""
        assert keys.shape[2] == self.pending, "write() must follow reserve() with the same token count"
        return store(self.keys[layer], self.values[layer], self.length, keys, values)

    def commit(self, num_kept: int | None = None) -> None:
        """Keep the first `num_kept` slots of the last forward (all when None); drop the rest."""
        kept = self.pending if num_kept is None else num_kept
        if not 0 <= kept <= self.pending:
            raise ValueError(f"cannot keep {kept} of {self.pending} pending slots")
        self.length += kept
        self.pending = 0

    def rewind(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` committed slots."""
        if not 0 <= num_tokens <= self.length:
            raise ValueError(f"cannot rewind {num_tokens} of {self.length} cached positions")
        self.length -= num_tokens
        self.pending = 0

    def crop(self, length: int) -> None:
        """Keep the first `length` committed slots."""
        self.rewind(self.length - length)

    def snapshot(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values of the first `length` committed slots, for `restore`: keys
        as rows (..., length, head_dim) whether plain or tiled, values as the cache stores them — the
        slot the second-to-last dimension of both."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot copy {length} of {self.length} cached positions")
        if self.tiled:
            keys = key_rows(covering_tiles(self.keys, length))[..., :length, :].clone()
        else:
            keys = self.keys[..., :length, :].clone()
        return keys, self.values[..., :length, :].clone()

    def restore(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Hold exactly the first `length` slots of a `snapshot` of a cache of these shapes and this V
        layout (keys come as rows from plain and tiled caches alike)."""
        if length > self.capacity:
            raise CacheFullError(f"KV cache holds {self.capacity} positions; {length} asked")
        key_shape = (*self.keys.shape[:3], 0, self.keys.shape[-3] * 2) if self.tiled else self.keys.shape
        if any(a.shape[:-2] + a.shape[-1:] != b[:-2] + b[-1:]
               for a, b in ((keys, key_shape), (values, self.values.shape))):
            raise ValueError("the snapshot comes from a cache of another layout")
        if self.tiled:
            write_key_rows(self.keys, 0, keys[..., :length, :])
        else:
            self.keys[..., :length, :] = keys[..., :length, :]
        self.values[..., :length, :] = values[..., :length, :]
        self.length, self.pending = length, 0

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the given batch rows (e.g. drop finished sequences from a batched decode)."""
        self.keys = self.keys[:, rows].contiguous()
        self.values = self.values[:, rows].contiguous()

    def reset(self) -> None:
        self.length = 0
        self.pending = 0
