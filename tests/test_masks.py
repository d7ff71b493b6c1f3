"""Attention masks, checked against hand-written matrices (True = attend), and a decoder under them."""

from __future__ import annotations

import pytest
import torch

from conftest import make_decoder, tiny_config
from d3d.masks import causal_mask, draft_mask
from d3d.models import Decoder


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


# -- a decoder under explicit masks ----------------------------------------------------------------------------

CLEAN, BLOCK = 5, 4  # rows 0-4 clean, row 5 the anchor, rows 6-8 the block's later positions


@torch.no_grad()
def masked_logits(decoder: Decoder, ids: list[int], mode: str) -> torch.Tensor:
    mask = draft_mask(CLEAN, BLOCK, 0, mode)[None]
    return decoder(torch.tensor([ids]), mask=mask)[0]


def changed(ids: list[int], position: int) -> list[int]:
    out = list(ids)
    out[position] = (out[position] + 1) % 64
    return out


@pytest.fixture
def mask_decoder():
    return make_decoder(tiny_config("qwen3"))


BASE_IDS = [3, 14, 15, 9, 26, 5, 35, 8, 9]
ANCHOR = CLEAN


def test_anchor_causal_mask(mask_decoder):
    """anchor_causal: the anchor ignores the block after it; later block positions see each other."""
    base = masked_logits(mask_decoder, BASE_IDS, "anchor_causal")
    later = masked_logits(mask_decoder, changed(BASE_IDS, ANCHOR + 2), "anchor_causal")
    assert torch.equal(base[:ANCHOR + 1], later[:ANCHOR + 1])  # clean rows and anchor untouched
    assert not torch.allclose(base[ANCHOR + 1], later[ANCHOR + 1])  # position 1 sees position 2
    # The anchor row is the ordinary causal next-token prediction.
    plain = mask_decoder(torch.tensor([BASE_IDS[:ANCHOR + 1]]))[0, -1]
    torch.testing.assert_close(base[ANCHOR], plain, atol=1e-5, rtol=1e-5)
    # Everything in the block sees the clean context.
    earlier = masked_logits(mask_decoder, changed(BASE_IDS, 1), "anchor_causal")
    assert not torch.allclose(base[ANCHOR:], earlier[ANCHOR:])


def test_bidirectional_mask(mask_decoder):
    """bidirectional: an early block position (the anchor too) sees later ones; clean rows do not."""
    base = masked_logits(mask_decoder, BASE_IDS, "bidirectional")
    later = masked_logits(mask_decoder, changed(BASE_IDS, ANCHOR + 3), "bidirectional")
    assert torch.equal(base[:ANCHOR], later[:ANCHOR])
    assert not torch.allclose(base[ANCHOR], later[ANCHOR])
    assert not torch.allclose(base[ANCHOR + 1], later[ANCHOR + 1])


def test_causal_block_mask(mask_decoder):
    """causal: no block position sees a later one, and the result equals an unmasked forward."""
    base = masked_logits(mask_decoder, BASE_IDS, "causal")
    later = masked_logits(mask_decoder, changed(BASE_IDS, ANCHOR + 2), "causal")
    assert torch.equal(base[:ANCHOR + 2], later[:ANCHOR + 2])
    assert not torch.allclose(base[ANCHOR + 2], later[ANCHOR + 2])
    torch.testing.assert_close(base, mask_decoder(torch.tensor([BASE_IDS]))[0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_explicit_mask_over_a_cache(mask_decoder):
    """A draft mask after cached context: the anchor row equals the cached causal prediction."""
    ids = torch.tensor([BASE_IDS])
    cache = mask_decoder.new_cache()
    mask_decoder(ids[:, :3], cache=cache)
    cache.commit()
    mask = draft_mask(2, BLOCK, 3, "anchor_causal")[None]
    out = mask_decoder(ids[:, 3:], cache=cache, mask=mask)[0]
    plain = mask_decoder(ids[:, :ANCHOR + 1])[0, -1]
    torch.testing.assert_close(out[2], plain, atol=1e-5, rtol=1e-5)
