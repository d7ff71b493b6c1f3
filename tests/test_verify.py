"""Greedy and rejection-sampling verification on hand-made tensors, and losslessness."""

from __future__ import annotations

import pytest
import torch

from d3d.verify import Verdict, verify_greedy, verify_sampling


def t(values) -> torch.Tensor:
    return torch.tensor(values)


def one_hot(ids: list[int], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


# -- greedy ------------------------------------------------------------------------------------

def test_greedy_all_accepted_bonus_is_last_target_token():
    assert verify_greedy(t([5, 6, 7]), t([5, 6, 7, 8])) == Verdict(3, 8)


def test_greedy_first_rejected():
    assert verify_greedy(t([5, 6, 7]), t([4, 6, 7, 8])) == Verdict(0, 4)


def test_greedy_middle_rejected():
    """Acceptance stops at the first mismatch even if later drafts match again."""
    assert verify_greedy(t([5, 6, 7]), t([5, 9, 7, 8])) == Verdict(1, 9)
    assert verify_greedy(t([5, 6, 7]), t([5, 6, 1, 8])) == Verdict(2, 1)


def test_greedy_zero_drafts():
    assert verify_greedy(torch.empty(0, dtype=torch.long), t([3])) == Verdict(0, 3)


def test_greedy_shape_mismatch_is_refused():
    with pytest.raises(AssertionError):
        verify_greedy(t([5, 6]), t([5, 6]))


# -- sampling ----------------------------------------------------------------------------------

def test_sampling_identical_one_hot_always_accepts():
    """p == q, both one-hot on the drafts: every draft is kept and the bonus comes from p's last row."""
    drafts = [1, 2]
    q = one_hot(drafts, 4)
    p = one_hot(drafts + [3], 4)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        assert verify_sampling(t(drafts), q, p, generator) == Verdict(2, 3)


def test_sampling_zero_drafts_draws_from_p():
    """With no drafts the verdict is a plain sample of p's only row."""
    p = t([[0.0, 0.0, 1.0, 0.0]])
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert verify_sampling(torch.empty(0, dtype=torch.long), torch.zeros(0, 4), p, generator) == Verdict(0, 2)


def test_sampling_draft_with_zero_target_probability_is_always_rejected():
    """A draft the target gives p=0 is rejected; the replacement follows normalised max(0, p - q)."""
    q = t([[0.2, 0.6, 0.2, 0.0]])
    p = t([[0.5, 0.0, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]])
    generator = torch.Generator().manual_seed(1)
    counts = torch.zeros(4)
    for _ in range(4000):
        verdict = verify_sampling(t([1]), q, p, generator)
        assert verdict.num_accepted == 0
        counts[verdict.bonus_token] += 1
    # residual = [0.3, 0, 0, 0.3] → {0: 0.5, 3: 0.5}; token 2 has p == q so is never recovered.
    assert counts[1] == 0 and counts[2] == 0
    assert abs(counts[0] / 4000 - 0.5) < 0.03


def test_sampling_acceptance_probability_is_p_over_q():
    """A draft with q(x)=0.8, p(x)=0.4 is accepted half the time; with p(x) >= q(x) always."""
    q = t([[0.8, 0.2, 0.0]])
    p_low = t([[0.4, 0.6, 0.0], [1.0, 0.0, 0.0]])
    p_high = t([[0.9, 0.1, 0.0], [1.0, 0.0, 0.0]])
    generator = torch.Generator().manual_seed(2)
    accepted = sum(verify_sampling(t([0]), q, p_low, generator).num_accepted for _ in range(4000))
    assert abs(accepted / 4000 - 0.5) < 0.03
    assert all(verify_sampling(t([0]), q, p_high, generator) == Verdict(1, 0) for _ in range(200))


def test_sampling_is_seed_reproducible():
    q = t([[0.5, 0.5, 0.0], [0.3, 0.3, 0.4]])
    p = t([[0.2, 0.3, 0.5], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]])

    def run(seed):
        generator = torch.Generator().manual_seed(seed)
        return [verify_sampling(t([1, 2]), q, p, generator) for _ in range(50)]

    assert run(3) == run(3)


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_sampling_is_lossless():
    """Drafts drawn from q, then verified: committed tokens follow p exactly (20000 seeded trials).

    The first committed token must follow p[0]; given that the first draft was kept, the second
    committed token must follow p[1]. q is far from p, so a wrong rule (e.g. always accepting)
    would fail by a wide margin.
    """
    vocab, num_drafts, trials = 5, 3, 20000
    setup = torch.Generator().manual_seed(1234)
    p = (1.5 * torch.randn(num_drafts + 1, vocab, generator=setup)).softmax(-1)
    q = (1.5 * torch.randn(num_drafts, vocab, generator=setup)).softmax(-1)
    assert tv(p[0], q[0]) > 0.15 and tv(p[1], q[1]) > 0.15  # the test can tell p from q

    generator = torch.Generator().manual_seed(99)
    drafts = torch.multinomial(q, trials, replacement=True, generator=generator).T  # (trials, K)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for row in drafts:
        verdict = verify_sampling(row, q, p, generator)
        committed = row[:verdict.num_accepted].tolist() + [verdict.bonus_token]
        first[committed[0]] += 1
        if verdict.num_accepted >= 1:
            second[committed[1]] += 1
    assert tv(first / first.sum(), p[0]) < 0.02
    assert second.sum() > 5000
    assert tv(second / second.sum(), p[1]) < 0.03
