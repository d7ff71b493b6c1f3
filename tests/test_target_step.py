"""The target's half of a step (`d3d.target_step`): scoring a block where the target's rounding
depends on the row count, row by row, leaves the same logits and cache as one forward."""

from __future__ import annotations

import torch

from conftest import make_decoder, tiny_config
from d3d import exactness
from d3d.exactness import InvarianceReport
from d3d.models import Decoder
from d3d.target_step import score_block


def failing_report(decoder: Decoder) -> InvarianceReport:
    return InvarianceReport("test", "float32", list(range(1, 18)), {"16": 3})


@torch.no_grad()
def test_score_block_row_by_row_gives_the_batched_logits_and_cache(monkeypatch):
    """The fallback leaves the cache as one forward would: T pending slots holding the same K/V."""
    decoder = make_decoder(tiny_config())
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    caches = [decoder.new_cache(32), decoder.new_cache(32)]
    for cache in caches:
        decoder(torch.tensor([[1, 2, 3]]), cache=cache)
        cache.commit()
    batched = score_block(decoder, caches[0], ids)
    monkeypatch.setattr(exactness, "cached_check", failing_report)
    exactness._modes.clear()
    row_by_row = score_block(decoder, caches[1], ids)
    assert torch.equal(batched, row_by_row)
    assert caches[1].length == 3 and caches[1].pending == 6
    caches[0].commit(4)
    caches[1].commit(4)
    assert torch.equal(caches[0].keys[:, :, :, :7], caches[1].keys[:, :, :, :7])
