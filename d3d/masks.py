"""Boolean attention masks (True = attend) for the layouts d3d runs: causal, draft block, packed.

Every mask is (T, S): T new tokens over S = cached + T key slots, where the new tokens occupy the
last T slots in order. Masks say who may see whom; they know nothing about models or tokens —
and so where a long forward may be cut into chunks (`chunk_bounds`).
"""

from __future__ import annotations

import torch

from d3d.config import BlockAttention


def causal_mask(length: int, cached: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(T, cached + T): new token i attends to every cached slot and to new tokens ≤ i."""
    rows = torch.arange(length, device=device)[:, None] + cached
    cols = torch.arange(cached + length, device=device)[None]
    return cols <= rows


def draft_mask(num_clean: int, block_size: int, cached: int, block_attention: BlockAttention,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """(C + B, cached + C + B) for `num_clean` clean tokens followed by one draft block.

    Clean tokens are causal. The block [anchor, MASK × (B-1)] sees every cached and clean token;
    inside the block, `block_attention` decides: "causal" (like an AR model), "bidirectional"
    (every block position sees the whole block), or "anchor_causal" (the anchor sees only itself
    and the context, so its output stays the ordinary next-token prediction; the masks see the
    whole block).
    """
    length = num_clean + block_size
    mask = causal_mask(length, cached, device)
    start = cached + num_clean  # key slot of the anchor
    if block_attention == "bidirectional":
        mask[num_clean:, start:] = True
    elif block_attention == "anchor_causal":
        mask[num_clean + 1:, start:] = True
    return mask


def packed_mask(trunk_length: int, branch_visible: list[int], block_size: int, cached: int,
                block_attention: BlockAttention, device: torch.device | str = "cpu") -> torch.Tensor:
    """(N, cached + N), N = trunk_length + len(branch_visible) · B: a trunk and draft-block branches.

    The trunk (clean tokens after the cache, e.g. [anchor, drafts under verification]) is causal.
    Branch j is one draft block that sees the first `branch_visible[j]` of the cached + trunk slots
    and itself, inside the block as `draft_mask` lays it out; never other branches or later slots.
    """
    length = trunk_length + len(branch_visible) * block_size
    mask = torch.zeros(length, cached + length, dtype=torch.bool, device=device)
    mask[:trunk_length, :cached + trunk_length] = causal_mask(trunk_length, cached, device)
    inside = draft_mask(0, block_size, 0, block_attention, device)  # (B, B): the block over itself
    for j, visible in enumerate(branch_visible):
        if not 0 <= visible <= cached + trunk_length:
            raise ValueError(f"branch {j} sees {visible} slots; cache and trunk hold {cached + trunk_length}")
        row = trunk_length + j * block_size
        rows = slice(row, row + block_size)
        mask[rows, :visible] = True
        mask[rows, cached + row:cached + row + block_size] = inside
    return mask


def chunk_bounds(length: int, cached: int, mask: torch.Tensor | None, chunk: int) -> list[int]:
    """Row boundaries 0 < r1 < … < length for splitting a forward of `length` new rows after
    `cached` slots: chunks of at most `chunk` rows, cut only where no row before the cut sees a key
    after it (always, causally; a mask (B, T, cached + T) may forbid a cut, e.g. inside a
    bidirectional block, and the chunk then grows to the next allowed cut)."""
    if length <= chunk:
        return [length]
    if mask is None:
        return [*range(chunk, length, chunk), length]
    keys = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(mask, keys, -1).amax(-1).amax(0)  # (T,) the last key any batch row's row t sees
    reach = torch.cummax(last, 0).values.tolist()  # the last key rows 0 … t see
    cuttable = [r == length or reach[r - 1] < cached + r for r in range(length + 1)]
    bounds, begin = [], 0
    while begin < length:
        end = min(begin + chunk, length)
        while not cuttable[end] and end > begin + 1:  # the last cut within the chunk …
            end -= 1
        if not cuttable[end]:  # … or, with none, the first after it
            end = next(r for r in range(begin + chunk + 1, length + 1) if cuttable[r])
        bounds.append(end)
        begin = end
    return bounds
