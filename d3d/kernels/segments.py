"""What a fused forward is handed besides the weights: the decoder's sizes (`DecoderShape`) and each
sequence's new rows over its own KV cache (`Segment`), with how the C code addresses a cache's slots
(`value_strides`, `contiguous_from`). Read by `RowExactKernels.forward_segments` (binding)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d3d.cache import V_PART, is_split


def value_strides(keys: torch.Tensor, values: torch.Tensor) -> tuple[int, int]:
    """(v_row, v_part) of attention.h for values beside their keys: elements between two slots' values
    and between two V_PART-wide slices of d — rows of D (…, S, D), or a split cache's slices
    (…, D / V_PART, S, V_PART: d3d.cache), told apart by the extra dimension."""
    if is_split(keys, values):
        return values.stride(-2), values.stride(-3)
    return values.stride(-2), V_PART * values.stride(-1)


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a fused forward (`RowExactKernels.forward_segments`): `rows` new tokens
    stored at slots start … start+rows-1 of its own KV cache (keys: (L, H_kv, capacity, D) or tiled:
    (L, H_kv, ⌈capacity / KEY_TILE⌉, D / 2, KEY_TILE, 2); values the same or split: (L, H_kv, D / V_PART,
    capacity, V_PART) — views, e.g. one batch row of a `KVCache`),
    attending over its cache only, causally or by `mask` (rows, start+rows)."""

    rows: int
    keys: torch.Tensor
    values: torch.Tensor
    start: int
    mask: torch.Tensor | None = None


def contiguous_from(tensor: torch.Tensor, dim: int) -> bool:
    """Whether tensor[i, j, …] (the dims from `dim` on) is contiguous, from its strides alone."""
    expected = 1
    for size, stride in zip(reversed(tensor.shape[dim:]), reversed(tensor.stride()[dim:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@dataclass(frozen=True)
class DecoderShape:
    """The sizes `RowExactKernels.forward` needs besides the weights."""

    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float

    def work_elements(self, rows: int, hidden: int) -> int:
        """Elements of a fused forward's work buffer over `rows` rows (rowexact.c's `work`)."""
        width = (self.heads + 2 * self.kv_heads) * self.head_dim
        return rows * (hidden + width + 2 * self.heads * self.head_dim + 3 * self.intermediate)

    def linear_width(self, hidden: int) -> int:
        """The widest input of a layer's linears: what a fused forward's linear scratch is sized by."""
        return max(hidden, self.heads * self.head_dim, self.intermediate)
