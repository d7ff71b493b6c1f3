"""Temperature / top-k / top-p transforms on hand-made logits, and seeded sampling."""

from __future__ import annotations

import math

import pytest
import torch

from d3d.config import SamplingConfig
from d3d.sampling import make_generator, probabilities, sample

P = [0.5, 0.25, 0.15, 0.1]
PERMUTATION = [2, 0, 3, 1]  # the same distribution stored in scrambled order


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def cfg(**kwargs) -> SamplingConfig:
    return SamplingConfig(**{"temperature": 1.0, **kwargs})


def close(actual: torch.Tensor, expected: list[float]) -> None:
    assert torch.allclose(actual, torch.tensor(expected, dtype=torch.float32), atol=1e-6), actual
    assert math.isclose(float(actual.sum()), 1.0, abs_tol=1e-6)


def test_temperature_one_is_softmax():
    close(probabilities(logits_of(P), cfg()), P)


def test_temperature_scales_logits():
    """T=2 flattens (p^(1/2)), T=0.5 sharpens (p^2), both renormalised."""
    flat = [p ** 0.5 for p in P]
    sharp = [p ** 2 for p in P]
    close(probabilities(logits_of(P), cfg(temperature=2.0)), [x / sum(flat) for x in flat])
    close(probabilities(logits_of(P), cfg(temperature=0.5)), [x / sum(sharp) for x in sharp])


def test_output_is_fp32_and_keeps_shape():
    probs = probabilities(logits_of(P).to(torch.bfloat16).expand(3, -1), cfg())
    assert probs.dtype == torch.float32 and probs.shape == (3, 4)


def test_top_k_support():
    """top_k keeps exactly the k largest and renormalises; k >= V (or 0) keeps everything."""
    close(probabilities(logits_of(P), cfg(top_k=2)), [2 / 3, 1 / 3, 0, 0])
    close(probabilities(logits_of(P), cfg(top_k=1)), [1, 0, 0, 0])
    close(probabilities(logits_of(P), cfg(top_k=4)), P)
    close(probabilities(logits_of(P), cfg(top_k=10)), P)
    close(probabilities(logits_of(P), cfg(top_k=0)), P)


def test_top_p_support():
    """top_p keeps the smallest prefix (by probability) whose mass reaches top_p."""
    close(probabilities(logits_of(P), cfg(top_p=0.7)), [2 / 3, 1 / 3, 0, 0])  # 0.5+0.25 >= 0.7
    close(probabilities(logits_of(P), cfg(top_p=0.8)), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])
    close(probabilities(logits_of(P), cfg(top_p=0.3)), [1, 0, 0, 0])  # the top token always stays
    close(probabilities(logits_of(P), cfg(top_p=1.0)), P)


def test_top_k_then_top_p():
    """top-k applies first, then top-p on the renormalised survivors (the transformers order)."""
    # After top_k=2: [2/3, 1/3]; 2/3 >= 0.6 already, so top_p leaves only the top token.
    close(probabilities(logits_of(P), cfg(top_k=2, top_p=0.6)), [1, 0, 0, 0])
    close(probabilities(logits_of(P), cfg(top_k=3, top_p=0.99)), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])


def test_unsorted_logits_and_rows_are_handled_independently():
    """Filtering follows the tokens, not their storage order, and each row gets its own support."""
    scrambled = [P[i] for i in PERMUTATION]
    rows = torch.stack([logits_of(scrambled), logits_of(P)])
    probs = probabilities(rows, cfg(top_p=0.7))
    expected_sorted = [2 / 3, 1 / 3, 0, 0]
    close(probs[0], [expected_sorted[i] for i in PERMUTATION])
    close(probs[1], expected_sorted)
    probs = probabilities(rows, cfg(top_k=3, temperature=0.5))
    sharp = [p ** 2 for p in P[:3]] + [0]
    expected_sorted = [x / sum(sharp) for x in sharp]
    close(probs[0], [expected_sorted[i] for i in PERMUTATION])
    close(probs[1], expected_sorted)


def test_top_k_keeps_ties_at_the_threshold():
    """Tokens tied with the k-th score are kept (as in transformers' TopKLogitsWarper)."""
    close(probabilities(torch.tensor([1.0, 1.0, 1.0, 0.0]), cfg(top_k=2)), [1 / 3, 1 / 3, 1 / 3, 0])


def test_greedy_has_no_probabilities():
    with pytest.raises(ValueError, match="greedy"):
        probabilities(logits_of(P), SamplingConfig(temperature=0.0))


def test_sample_shape_and_support():
    """sample() draws one id per row, never a zero-probability token."""
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    generator = make_generator(cfg(seed=0))
    draws = torch.stack([sample(probs, generator) for _ in range(200)])
    assert draws.shape == (200, 2)
    assert (draws[:, 0] == 1).all()
    assert set(draws[:, 1].tolist()) == {0, 2}
    assert sample(probs[None].expand(4, -1, -1), generator).shape == (4, 2)


def test_seeded_generator_is_reproducible():
    """Two generators from the same seed give the same draws; another seed gives other draws."""
    probs = probabilities(torch.zeros(2, 50), cfg())

    def draws(seed):
        generator = make_generator(cfg(seed=seed))
        return [sample(probs, generator).tolist() for _ in range(20)]

    assert draws(123) == draws(123)
    assert draws(123) != draws(124)


def test_sample_frequencies_follow_probabilities():
    """Empirical frequencies of 20000 seeded draws match the probabilities (TV < 0.02)."""
    probs = probabilities(logits_of(P), cfg())
    generator = make_generator(cfg(seed=7))
    draws = sample(probs.expand(20000, -1), generator)
    freq = torch.bincount(draws, minlength=4).float() / 20000
    assert 0.5 * (freq - probs).abs().sum() < 0.02


def test_greedy_ids_are_argmax_first_of_equal_maxima():
    """`greedy_ids` (torch's max, faster on CPU) picks argmax's index — the first of equal maxima —
    on logits full of ties, in bf16 and fp32, with NaN and all -inf rows, at the vocabulary sizes used."""
    from d3d.sampling import greedy_ids

    generator = torch.Generator().manual_seed(0)
    for trial in range(60):
        rows, vocab = 1 + trial % 9, (49152, 8192, 33, 1)[trial % 4]
        logits = torch.randint(0, 3, (rows, vocab), generator=generator).float()
        if trial % 2:
            logits = logits.to(torch.bfloat16)
        if trial % 5 == 0:
            logits[0, vocab // 2] = float("nan")
        if trial % 7 == 0:
            logits[-1] = float("-inf")
        expected = logits.float().argmax(-1)
        assert torch.equal(greedy_ids(logits), expected)
        assert int(greedy_ids(logits[0])) == int(expected[0])
    ties = torch.zeros(2, 49152)
    ties[:, [5, 9, 40000]] = 1.0
    assert greedy_ids(ties).tolist() == [5, 5]  # the first maximum, not any of them
