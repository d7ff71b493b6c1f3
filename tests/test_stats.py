"""SpecStats: τ, per-position acceptance and merging, on hand-made record() sequences."""

from __future__ import annotations

import pytest

from d3d.stats import SpecStats

# (num_drafted, num_accepted) of four verification steps.
STEPS = [(3, 0), (3, 3), (3, 1), (2, 2)]


def recorded(steps=STEPS) -> SpecStats:
    stats = SpecStats()
    for drafted, accepted in steps:
        stats.record(drafted, accepted)
    return stats


def test_empty_stats():
    stats = SpecStats()
    assert stats.steps == 0 and stats.tau == 1.0
    assert stats.acceptance_rate == [] and stats.tokens_per_second == 0.0


def test_record_counts():
    """Histogram of accepted drafts, and per-position drafted / accepted counts."""
    stats = recorded()
    assert stats.steps == 4
    assert stats.accepted_histogram == [1, 1, 1, 1]
    assert stats.drafted_at == [4, 4, 3]
    assert stats.accepted_at == [3, 2, 1]


def test_tau_counts_the_bonus_token():
    """τ = mean(num_accepted + 1): (1 + 4 + 2 + 3) / 4."""
    assert recorded().tau == pytest.approx(2.5)


def test_tau_of_plain_autoregressive_steps_is_one():
    stats = recorded([(0, 0)] * 5)
    assert stats.tau == 1.0 and stats.acceptance_rate == [] and stats.accepted_histogram == [5]


def test_tau_of_full_acceptance_is_block_size():
    assert recorded([(15, 15)] * 3).tau == 16.0


def test_acceptance_rate_is_conditional_on_reaching_the_position():
    """acceptance_rate[i] = P(draft i+1 accepted | drafted and drafts 1..i accepted), as documented.

    Draft 1: drafted in 4 steps, accepted in 3 → 3/4.
    Draft 2: reached (drafted, draft 1 accepted) in steps 2, 3, 4; accepted in 2 and 4 → 2/3.
    Draft 3: reached only in step 2 (step 4 drafted 2), accepted there → 1.
    """
    assert recorded().acceptance_rate == pytest.approx([3 / 4, 2 / 3, 1.0])


def test_acceptance_rate_when_every_step_reaches_every_draft():
    """Without early rejections the conditional and per-position rates agree."""
    assert recorded([(2, 2), (2, 2), (2, 1)]).acceptance_rate == pytest.approx([1.0, 2 / 3])


def test_tokens_per_second():
    stats = SpecStats(new_tokens=50, wall_seconds=2.0)
    assert stats.tokens_per_second == 25.0


def test_merge_sums_everything_and_pads_lists():
    """merge() adds counters and times, padding the shorter lists with zeros, without mutating inputs."""
    a = recorded([(3, 1)])
    a.new_tokens, a.wall_seconds, a.draft_seconds, a.verify_seconds = 3, 1.0, 0.25, 0.5
    b = recorded([(1, 1), (0, 0)])
    b.new_tokens, b.wall_seconds, b.draft_seconds, b.verify_seconds = 4, 2.0, 0.5, 1.0
    merged = a.merge(b)
    assert merged.steps == 3 and merged.new_tokens == 7
    assert merged.wall_seconds == 3.0 and merged.draft_seconds == 0.75 and merged.verify_seconds == 1.5
    assert merged.accepted_histogram == [1, 2]
    assert merged.drafted_at == [2, 1, 1]
    assert merged.accepted_at == [2, 0, 0]
    assert merged.tau == pytest.approx((2 + 2 + 1) / 3)
    assert a.steps == 1 and b.steps == 2 and a.drafted_at == [1, 1, 1]


def test_merge_equals_recording_everything_in_one():
    """Merging two runs gives the same τ and counts as one run over all their steps."""
    merged = recorded(STEPS[:2]).merge(recorded(STEPS[2:]))
    whole = recorded()
    assert merged.tau == whole.tau
    assert merged.accepted_histogram == whole.accepted_histogram
    assert merged.acceptance_rate == pytest.approx(whole.acceptance_rate)


def test_summary_reports_rounded_values():
    stats = recorded()
    stats.new_tokens, stats.wall_seconds = 10, 4.0
    summary = stats.summary()
    assert summary["tau"] == 2.5 and summary["steps"] == 4 and summary["new_tokens"] == 10
    assert summary["tokens_per_second"] == 2.5
    assert len(summary["acceptance_rate"]) == 3
