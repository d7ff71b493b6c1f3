"""The speculation gate: how many drafts each source proposes, from its measured acceptance and a
fixed cost model — none when plain decoding pays better, re-tried every `explore_every` steps."""

from __future__ import annotations

import pytest
import torch

from conftest import make_decoder, tiny_config
from d3d.drafter import Drafter
from d3d.gate import VERIFY_COST_PER_DRAFT, SpeculationGate, drafter_cost


def test_an_unknown_source_drafts_in_full():
    """Before any observation a source proposes every draft it may."""
    assert SpeculationGate({"lookup": 0.0}).num_drafts("lookup", 15) == 15


def test_expected_tokens_from_acceptance():
    """1 + α1 + α1·α2 + …; unreached positions borrow the last α."""
    gate = SpeculationGate({"drafter": 0.1}, acceptance={"drafter": [0.5, 0.5]})
    assert gate.expected_tokens("drafter", 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_a_weak_drafter_proposes_only_its_likely_drafts():
    """α = (0.6, 0.1, …), drafting cost 0.1, 0.028 steps per verified draft: two drafts pay best,
    all fifteen pay less."""
    gate = SpeculationGate({"drafter": 0.1}, verify_cost_per_draft=0.028, explore_every=100,
                           acceptance={"drafter": [0.6, 0.1]}, last_used={"drafter": 0})
    def rate(k):
        return gate.expected_tokens("drafter", k) / (1 + 0.028 * k + 0.1)

    k = gate.num_drafts("drafter", 15)
    assert k == max(range(1, 16), key=rate) == 2  # 1.66 tokens for cost 1.156
    assert rate(k) > rate(15) and rate(k) > 1.0


def test_a_useless_source_falls_back_to_plain_steps_and_is_explored():
    """Drafts that are never accepted: zero drafts, except a full try every `explore_every` steps."""
    gate = SpeculationGate({"lookup": 0.0}, explore_every=4)
    gate.record("lookup", 15, 0)
    decisions = []
    for _ in range(8):
        k = gate.num_drafts("lookup", 15)
        decisions.append(k)
        gate.record("lookup" if k else "none", k, 0)
    assert decisions == [0, 0, 0, 15, 0, 0, 0, 15]


def test_acceptance_averages_follow_recent_steps():
    """After misses α1 falls and drafting stops; after full accepts it recovers."""
    gate = SpeculationGate({"lookup": 0.0}, explore_every=100, weight=0.5)
    for _ in range(6):
        gate.record("lookup", 15, 0)
    assert gate.num_drafts("lookup", 15) == 0
    for _ in range(3):
        gate.record("lookup", 15, 15)
    assert gate.num_drafts("lookup", 15) == 15


def test_drafter_cost_counts_layers_and_head():
    """A drafter copying all layers costs about a B-token target forward; fewer layers and a smaller
    head cost less."""
    target = make_decoder(tiny_config(), seed=0)
    full = Drafter.from_target(target, list(range(target.config.num_layers)))
    small = Drafter.from_target(target, [0], draft_vocab=torch.arange(8))
    assert abs(drafter_cost(target, full) - (1 + VERIFY_COST_PER_DRAFT * 15)) < 0.05
    assert drafter_cost(target, small) < drafter_cost(target, full) / 1.5
