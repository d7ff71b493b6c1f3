"""Attention masks, checked against hand-written matrices (True = attend)."""

from __future__ import annotations

import pytest
import torch

from d3d.masks import causal_mask, draft_mask


def m(rows: list[str]) -> torch.Tensor:
    """A boolean matrix from strings of '1' (attend) and '.' (blocked)."""
    return torch.tensor([[c == "1" for c in row] for row in rows])


def test_causal_mask_without_cache():
    assert torch.equal(causal_mask(3, 0), m(["1..",
                                            "11.",
                                            "111"]))


def test_causal_mask_with_cache():
    """New tokens see every cached slot and the new tokens up to themselves."""
    assert torch.equal(causal_mask(2, 3), m(["1111.",
                                            "11111"]))
    assert causal_mask(1, 4).all() and causal_mask(1, 4).shape == (1, 5)


def test_draft_mask_causal():
    """'causal': the block is an ordinary causal continuation of cache + clean tokens."""
    assert torch.equal(draft_mask(1, 4, 1, "causal"), m(["11....",   # clean token (1 cached slot)
                                                         "111...",   # anchor
                                                         "1111..",   # mask 1
                                                         "11111.",   # mask 2
                                                         "111111"]))  # mask 3
    assert torch.equal(draft_mask(2, 4, 3, "causal"), causal_mask(6, 3))


def test_draft_mask_anchor_causal():
    """'anchor_causal': the anchor sees only context + itself; the masks see the whole block."""
    assert torch.equal(draft_mask(2, 3, 1, "anchor_causal"), m(["11....",   # clean 1
                                                                "111...",   # clean 2
                                                                "1111..",   # anchor
                                                                "111111",   # mask 1
                                                                "111111"]))  # mask 2


def test_draft_mask_bidirectional():
    """'bidirectional': every block position sees the whole block; clean tokens stay causal."""
    assert torch.equal(draft_mask(2, 3, 1, "bidirectional"), m(["11....",
                                                                "111...",
                                                                "111111",
                                                                "111111",
                                                                "111111"]))


@pytest.mark.parametrize("mode", ["causal", "anchor_causal", "bidirectional"])
def test_draft_mask_no_clean_tokens(mode):
    """With no clean tokens the block follows the cache directly; the cache is always visible."""
    mask = draft_mask(0, 3, 2, mode)
    assert mask.shape == (3, 5)
    assert mask[:, :2].all()
    expected = {"causal": m(["111..", "1111.", "11111"]),
                "anchor_causal": m(["111..", "11111", "11111"]),
                "bidirectional": m(["11111", "11111", "11111"])}[mode]
    assert torch.equal(mask, expected)
