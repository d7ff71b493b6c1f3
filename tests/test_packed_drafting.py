"""Packed drafting, the async engine's drafter side: the packed attention mask, a packed pass
(trunk + branches) equal to drafting each branch on its own, and the branch plan that picks the
outcomes worth drafting ahead from the drafter's own probabilities."""

from __future__ import annotations

import pytest
import torch

from conftest import make_decoder, perturb_drafter, tiny_config
from d3d.async_engine import AsyncConfig, plan_branches
from d3d.config import ConfigError, SamplingConfig
from d3d.drafter import Drafter
from d3d.masks import draft_mask, packed_mask

GREEDY = SamplingConfig()


def m(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in row] for row in rows])


# -- packed mask ------------------------------------------------------------------------------

def test_packed_mask_by_hand():
    """Trunk of 3 after 1 cached slot; branch 0 sees 2 slots (cache + trunk 0), branch 1 all 4."""
    expected = m(["11......",   # trunk 0 (the anchor)
                  "111.....",   # trunk 1
                  "1111....",   # trunk 2
                  "11..1...",   # branch 0 anchor: cache, trunk 0, itself (anchor_causal)
                  "11..11..",   # branch 0 mask: + the whole block
                  "1111..1.",   # branch 1 anchor
                  "1111..11",   # branch 1 mask
                  ])
    mask = packed_mask(3, [2, 4], 2, 1, "anchor_causal")
    assert mask.shape == (7, 8)
    assert torch.equal(mask, expected[:, :8])


@pytest.mark.parametrize("mode", ["causal", "anchor_causal", "bidirectional"])
def test_packed_mask_branch_matches_draft_mask(mode):
    """Each branch's rows over (visible slots, own block) are exactly a draft_mask layout."""
    trunk, visible_slots, size, cached = 5, [3, 5, 8, 1], 4, 3
    mask = packed_mask(trunk, visible_slots, size, cached, mode)
    for j, visible in enumerate(visible_slots):
        rows = mask[trunk + j * size:trunk + (j + 1) * size]
        own = cached + trunk + j * size
        seen = torch.cat([rows[:, :visible], rows[:, own:own + size]], 1)
        assert torch.equal(seen, draft_mask(0, size, visible, mode))
        assert rows.sum() == seen.sum()  # nothing else: no other branch, no later slot
    with pytest.raises(ValueError):
        packed_mask(2, [3], 2, 0, mode)


# -- packed pass == unpacked drafts -------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("mode", ["causal", "anchor_causal", "bidirectional"])
@pytest.mark.parametrize("cached_all", [True, False], ids=["cache-holds-context", "cache-behind"])
@pytest.mark.parametrize("two_pass", [False, True], ids=["one-forward", "trunk-first"])
def test_packed_branches_equal_unpacked_drafts(family, mode, cached_all, two_pass):
    """Branch (k, b) == `draft` on a fresh cache over committed + a, d_1..d_k + b, whether the trunk
    shares the forward or ran first; the trunk's outputs are the drafter's causal predictions."""
    target = make_decoder(tiny_config(family, tie_word_embeddings=False), seed=1)
    drafter = Drafter.from_target(target, [0, 1], block_size=5, block_attention=mode)
    perturb_drafter(drafter, 0.1, seed=2)
    tokens = [3, 17, 42, 5, 9, 33, 60, 1, 7]
    draft_tokens = [11, 12, 13, 14]
    branches = [(0, 20), (2, 21), (4, 22), (1, 23), (2, 24)]
    cache = drafter.new_cache(64 + 5 * 5)
    known = len(tokens) - 1 if cached_all else 3
    if known:
        drafter.block_pass(cache, tokens[:known], [])  # committed context in the cache
    trunk, anchor_slot = tokens[known:] + draft_tokens, len(tokens) - 1
    if two_pass:
        trunk_logits, _ = drafter.packed_draft(cache, trunk, [], anchor_slot, with_trunk=True)
        cache.commit(len(trunk))
        _, packed = drafter.packed_draft(cache, [], branches, anchor_slot)
        causal = drafter.logits(drafter.decoder.hidden_states(
            drafter.embed(torch.tensor([tokens + draft_tokens])), torch.arange(13)[None]))[0, anchor_slot:]
        torch.testing.assert_close(trunk_logits, causal, atol=1e-4, rtol=0)
    else:
        _, packed = drafter.packed_draft(cache, trunk, branches, anchor_slot)
        cache.commit(len(trunk))
    assert packed.shape == (5, 5, 64)
    for (k, bonus), logits in zip(branches, packed):
        expected = drafter.draft(drafter.new_cache(64), tokens + draft_tokens[:k] + [bonus])
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    # The verdict "2 accepted": the trunk KV of a, d_1, d_2 stays and is valid KV.
    cache.crop(len(tokens) + 2)
    after = tokens + draft_tokens[:2] + [30]
    torch.testing.assert_close(drafter.draft(cache, after), drafter.draft(drafter.new_cache(64), after),
                               atol=1e-4, rtol=0)


def test_packed_draft_rejects_bad_input(target):
    drafter = Drafter.from_target(target, [0], block_size=4)
    cache = drafter.new_cache(32)
    with pytest.raises(ValueError, match="slot"):
        drafter.packed_draft(cache, [], [(0, 3)], 0)  # no anchor anywhere
    with pytest.raises(ValueError, match="slot"):
        drafter.packed_draft(cache, [5, 1, 2], [(3, 3)], 0)  # k = 3 needs slot 3
    assert drafter.packed_draft(cache, [5, 6, 1, 2], [], 1)[1].shape == (0, 4, 64)


# -- branch plan --------------------------------------------------------------------------------

def plan_logits(rows: list[dict[int, float]], vocab: int = 10) -> torch.Tensor:
    """Logits whose softmax puts the given probabilities on tokens (the rest spread evenly)."""
    probs = torch.zeros(len(rows), vocab)
    for i, row in enumerate(rows):
        rest = (1 - sum(row.values())) / (vocab - len(row))
        probs[i] = rest
        for token, p in row.items():
            probs[i, token] = p
    return probs.log()


def test_plan_follows_the_drafters_probabilities():
    """P(k, b) ≈ c_0⋯c_{k-1} · q_k(b), b ≠ d_{k+1}; row K (the extra row) guesses after a full accept."""
    logits = plan_logits([{1: 0.9, 5: 0.05}, {2: 0.5, 6: 0.4}, {7: 0.8}])
    plan = plan_branches(logits, [1, 2], 2, AsyncConfig(max_branches=3, guesses_per_k=2), GREEDY)
    # k=1, b=6: 0.9·0.4 = .36; k=2, b=7: 0.9·0.5·0.8 = .36; k=0, b=5: .05 — never b = d_{k+1}.
    assert set(plan[:2]) == {(1, 6), (2, 7)} and plan[2] == (0, 5)
    assert all(b != d for (k, b), d in [(p, [1, 2, None][p[0]]) for p in plan])
    assert plan_branches(logits, [1, 2], 2, AsyncConfig(max_branches=1, guesses_per_k=1), GREEDY) in ([(1, 6)], [(2, 7)])
    assert plan_branches(logits, [1, 2], 2, AsyncConfig(max_branches=0), GREEDY) == []
    # max_k = 0: only the outcome "first draft rejected" is useful.
    assert {k for k, _ in plan_branches(logits, [1, 2], 0, AsyncConfig(max_branches=8), GREEDY)} == {0}


def test_plan_per_k_spends_the_budget_on_likely_k():
    """per_k: the most probable k values (exactly k accepted), each with guesses_per_k guesses."""
    logits = plan_logits([{1: 0.2}, {2: 0.9}, {3: 0.9}])  # k=0 most likely (0.8)
    plan = plan_branches(logits, [1, 2], 2, AsyncConfig(max_branches=4, guesses_per_k=4, selection="per_k"), GREEDY)
    assert len(plan) == 4 and all(k == 0 for k, _ in plan) and 1 not in [b for _, b in plan]


def test_plan_at_temperature_uses_the_transformed_probabilities():
    """With top_k = 1 only the top token survives the transform: row k has no guess once d_{k+1} is excluded."""
    logits = plan_logits([{1: 0.6, 4: 0.3}, {2: 0.6}, {7: 0.6}])
    sampling = SamplingConfig(temperature=1.0, top_k=1)
    plan = plan_branches(logits, [1, 2], 2, AsyncConfig(max_branches=8, guesses_per_k=3), sampling)
    assert plan == [(2, 7)]


def test_async_config_validation_and_json():
    for bad in (dict(max_branches=-1), dict(guesses_per_k=0), dict(miss_policy="wait"), dict(selection="x"),
                dict(drafter_threads=-1), dict(guess_source="mask")):
        with pytest.raises(ConfigError):
            AsyncConfig(**bad)
    config = AsyncConfig(max_branches=7, miss_policy="reanchor", concurrent=False)
    assert AsyncConfig.from_json(config.to_json()) == config
