"""The acceptance-controlled simulated drafter: τ is what was asked for, output is the target's."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_decoder, tiny_config
from d3d.async_engine import AsyncConfig, async_generate
from d3d.config import ConfigError, GenerationConfig, SamplingConfig
from d3d.drafter import Drafter
from d3d.engine import generate_from_sources, reference_generate
from d3d.simulate import SimulatedDrafter, corruption_rate_for, expected_tau
from d3d.sources import DrafterSource

PROMPT = [3, 17, 42, 5, 9, 33, 60, 1]


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


@pytest.fixture(scope="module")
def setup():
    target = make_decoder(tiny_config(tie_word_embeddings=False, max_position_embeddings=512), seed=1)
    drafter = Drafter.from_target(target, [0], block_size=16)
    return target, drafter


def reference(target, max_new_tokens: int) -> list[int]:
    return tokens_of(reference_generate(target, PROMPT, GenerationConfig(max_new_tokens=max_new_tokens)))


def sync_run(target, simulated, max_new_tokens: int):
    source = DrafterSource(simulated, name="simulated")
    return list(generate_from_sources(target, [source], PROMPT, GenerationConfig(max_new_tokens=max_new_tokens)))


@pytest.mark.parametrize("tau", [1.0, 1.5, 3.0, 8.0, 16.0])
def test_corruption_rate_inverts_expected_tau(tau):
    rate = corruption_rate_for(tau, 15)
    assert 0.0 <= rate <= 1.0 and math.isclose(expected_tau(rate, 15), tau, rel_tol=1e-6)


@pytest.mark.parametrize("tau", [0.5, 17.0])
def test_unreachable_tau_is_refused(tau):
    with pytest.raises(ConfigError, match="out of reach"):
        corruption_rate_for(tau, 15)


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan")])
def test_corruption_rate_outside_unit_interval_is_refused(setup, rate):
    _, drafter = setup
    with pytest.raises(ConfigError, match=r"corruption_rate must lie in \[0, 1\]"):
        SimulatedDrafter(drafter, PROMPT + [1, 2], rate)


def test_rounds_accept_exactly_up_to_the_first_corrupted_draft(setup):
    """Greedy: each round's accepted count is the offset of its first corrupted position (or all)."""
    target, drafter = setup
    expected = reference(target, 120)
    simulated = SimulatedDrafter(drafter, PROMPT + expected, corruption_rate=0.2, seed=4)
    steps = sync_run(target, simulated, 120)
    assert tokens_of(steps) == expected
    truth = torch.tensor(PROMPT + expected)
    corrupted = (simulated.stream.cpu() != truth).tolist()
    position = len(PROMPT) + 1  # the first drafted position follows the prefill's token
    for step in steps[1:]:
        drafted = range(position, position + step.num_drafted)
        first_bad = next((i for i, p in enumerate(drafted) if corrupted[p]), step.num_drafted)
        assert step.num_accepted == first_bad
        position += len(step.tokens)


@pytest.mark.parametrize("tau", [1.5, 3.0, 6.0])
def test_measured_tau_hits_the_set_tau(setup, tau):
    """Over 8 seeds × 240 tokens the measured τ lies within 4 standard errors of the set τ."""
    target, drafter = setup
    expected = reference(target, 240)
    rate = corruption_rate_for(tau, drafter.block_size - 1)
    committed = []  # tokens per full-size round
    for seed in range(8):
        steps = sync_run(target, SimulatedDrafter(drafter, PROMPT + expected, rate, seed=seed), 240)
        assert tokens_of(steps) == expected
        committed += [len(s.tokens) for s in steps[1:] if s.num_drafted == drafter.block_size - 1]
    kept = 1 - rate
    second_moment = sum((i + 1) ** 2 * kept ** i * (rate if i < 15 else 1.0) for i in range(16))
    error = math.sqrt((second_moment - tau ** 2) / len(committed))
    measured = sum(committed) / len(committed)
    assert abs(measured - tau) < 4 * error + 1e-9, (measured, tau, error)


@pytest.mark.parametrize("tau", [2.0, 6.0])
@pytest.mark.parametrize("concurrent", [False, True])
def test_async_with_the_simulation_is_lossless_and_hits_planned_outcomes(setup, tau, concurrent):
    """Async over the simulation: AR's tokens; a packed pass hits exactly when its plan drafted the
    accepted count k (each row's second choice is the target's token). With 4 branches and the
    draft's probability the same at every position, the plan drafts k = 0 … 3."""
    target, drafter = setup
    expected = reference(target, 160)
    simulated = SimulatedDrafter(drafter, PROMPT + expected, corruption_rate_for(tau, 15), seed=1)
    steps = list(async_generate(target, simulated, PROMPT, GenerationConfig(max_new_tokens=160),
                                AsyncConfig(max_branches=4, concurrent=concurrent)))
    assert tokens_of(steps) == expected
    stats = steps[-1].stats
    rounds, hits = stats.branch_rounds_at, stats.branch_hits_at
    assert hits[:4] == rounds[:4] and sum(rounds[:4]) > 0
    assert not any(hits[4:15])


def test_sampling_with_the_simulation_is_seeded_and_runs_to_the_end(setup):
    """T > 0: a valid proposal source (its q is the replaced logits' law); same seed, same tokens."""
    target, drafter = setup
    expected = reference(target, 60)
    config = GenerationConfig(max_new_tokens=60, sampling=SamplingConfig(temperature=1.0, seed=3))

    def run():
        source = DrafterSource(SimulatedDrafter(drafter, PROMPT + expected, 0.3), name="simulated")
        return tokens_of(generate_from_sources(target, [source], PROMPT, config))
    first = run()
    assert len(first) == 60 and first == run()


def test_simulation_needs_shifted_labels_and_a_reference(setup):
    target, _ = setup
    unshifted = Drafter.from_target(target, [0], block_size=4, labels="unshifted")
    with pytest.raises(ConfigError, match="shifted"):
        SimulatedDrafter(unshifted, PROMPT, 0.1)
    with pytest.raises(ConfigError, match="reference"):
        SimulatedDrafter(setup[1], [], 0.1)
