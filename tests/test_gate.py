"""The speculation gate: a source that commits too little for its cost is skipped, re-tried every
`explore_every` steps, and the decision depends on tokens only (no clocks)."""

from __future__ import annotations

import torch

from conftest import make_decoder, tiny_config
from d3d.drafter import Drafter
from d3d.gate import SpeculationGate, drafter_cost


def test_a_source_below_plain_rate_is_skipped_then_explored():
    """Drafts that commit 1.2 tokens at cost 1.4 lose to plain steps (1 token at cost 1)."""
    gate = SpeculationGate({"none": 1.0, "lookup": 1.4}, explore_every=4)
    assert gate.allows("lookup")  # never tried: explore
    gate.record("lookup", 1)
    decisions = []
    for _ in range(8):
        use = gate.allows("lookup")
        decisions.append(use)
        gate.record("lookup" if use else "none", 1)
    assert decisions == [False, False, False, True, False, False, False, True]


def test_a_source_above_plain_rate_is_kept():
    """3 tokens per step at cost 1.4 beat plain decoding every step."""
    gate = SpeculationGate({"none": 1.0, "drafter": 1.4})
    for _ in range(20):
        assert gate.allows("drafter")
        gate.record("drafter", 3)


def test_moving_average_follows_recent_steps():
    """After a run of misses the average falls below the threshold, after hits it recovers."""
    gate = SpeculationGate({"none": 1.0, "lookup": 1.5}, explore_every=100, weight=0.5)
    for _ in range(6):
        gate.record("lookup", 1)
    assert not gate.allows("lookup")
    for _ in range(3):
        gate.record("lookup", 8)
    assert gate.allows("lookup")


def test_drafter_cost_counts_layers_and_head():
    """A drafter copying all layers costs about a target step; fewer layers and a smaller head cost less."""
    target = make_decoder(tiny_config(), seed=0)
    full = Drafter.from_target(target, list(range(target.config.num_layers)))
    small = Drafter.from_target(target, [0], draft_vocab=torch.arange(8))
    assert abs(drafter_cost(target, full) - 1.0) < 0.05
    assert drafter_cost(target, small) < drafter_cost(target, full) / 1.5
