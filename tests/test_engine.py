"""Engines: greedy speculative decoding reproduces plain decoding token for token, sampling keeps the
target's distribution, τ behaves as defined, and bad prompts / configs fail early."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import sampling_pair, make_adversary, make_decoder, make_oracle, perturb_drafter, tiny_config
from d3d.config import ConfigError, GenerationConfig, SamplingConfig
from d3d.drafter import Drafter
from d3d.engine import reference_generate, speculative_generate
from d3d.sampling import probabilities
from d3d.sequence import PromptError


def run(steps) -> tuple[list[int], list, str | None]:
    """Drain an engine: (new tokens, steps, finish reason)."""
    steps = list(steps)
    return [t for s in steps for t in s.tokens], steps, steps[-1].finish_reason


def greedy(max_new_tokens: int, eos: list[int] | None = None) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos or [])


def reference(target, prompt, config):
    return run(reference_generate(target, prompt, config))


def speculative(target, drafter, prompt, config):
    return run(speculative_generate(target, drafter, prompt, config))


# -- greedy: token-for-token identity -----------------------------------------------------------

def test_reference_generate_basics(target, prompt):
    """One step per token, τ = 1, stops at max_new_tokens with 'length'."""
    tokens, steps, reason = reference(target, prompt, greedy(30))
    assert len(tokens) == 30 and len(steps) == 30 and reason == "length"
    assert len(set(tokens)) > 5  # the fixture target does not just repeat one token
    stats = steps[-1].stats
    assert stats.new_tokens == 30 and stats.steps == 29 and stats.tau == 1.0
    assert all(s.num_drafted == 0 for s in steps)


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_untrained_drafter_matches_reference(target, prompt, block_size):
    """A drafter copied from one of the two target layers: same tokens as plain decoding."""
    expected, _, _ = reference(target, prompt, greedy(40))
    drafter = Drafter.from_target(target, [1], block_size=block_size)
    tokens, steps, reason = speculative(target, drafter, prompt, greedy(40))
    assert tokens == expected and reason == "length"
    stats = steps[-1].stats
    assert stats.new_tokens == 40
    assert 1.0 <= stats.tau <= block_size
    assert sum(len(s.tokens) for s in steps[1:]) == 39  # every step commits accepted + 1


@pytest.mark.parametrize("mode", ["bidirectional", "causal"])
def test_other_block_attention_and_denoising_match_reference(target, prompt, mode):
    """Block attention and extra denoising passes change the drafts, never the output."""
    expected, _, _ = reference(target, prompt, greedy(30))
    drafter = Drafter.from_target(target, [0], block_size=4, block_attention=mode)
    drafter.config = dataclasses.replace(drafter.config, denoising_steps=2)
    assert speculative(target, drafter, prompt, greedy(30))[0] == expected


@pytest.mark.parametrize("denoising_steps", [1, 2])
def test_unshifted_drafter_matches_reference(target, prompt, denoising_steps):
    """Unshifted labels: the block's B-1 drafts come from rows 1 … B-1; output is the reference's."""
    expected, _, _ = reference(target, prompt, greedy(30))
    drafter = Drafter.from_target(target, [0], block_size=4, labels="unshifted")
    perturb_drafter(drafter, 0.02, seed=1)
    drafter.config = dataclasses.replace(drafter.config, denoising_steps=denoising_steps)
    assert drafter.draft(drafter.new_cache(64), prompt).shape[0] == 3  # rows predicting p+1 … p+3
    tokens, steps, _ = speculative(target, drafter, prompt, greedy(30))
    assert tokens == expected and max(s.num_drafted for s in steps) == 3


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_oracle_drafter_is_always_fully_accepted(target, prompt, block_size):
    """Drafts equal to the target's greedy continuation: each step commits exactly block_size tokens."""
    new_tokens = 1 + 3 * block_size  # prefill token + three full blocks: no truncation anywhere
    expected, _, _ = reference(target, prompt, greedy(new_tokens))
    tokens, steps, reason = speculative(target, make_oracle(target, block_size), prompt, greedy(new_tokens))
    assert tokens == expected and reason == "length"
    assert len(steps) == 4
    for step in steps[1:]:
        assert step.num_drafted == step.num_accepted == block_size - 1
        assert len(step.tokens) == block_size
    stats = steps[-1].stats
    assert stats.tau == block_size
    assert stats.acceptance_rate == [1.0] * (block_size - 1)


def test_oracle_tau_with_a_truncated_last_step(target, prompt):
    """When the length limit cuts the last block short, every earlier step still has τ = B."""
    expected, _, _ = reference(target, prompt, greedy(11))
    tokens, steps, _ = speculative(target, make_oracle(target, 4), prompt, greedy(11))
    assert tokens == expected
    assert [len(s.tokens) for s in steps] == [1, 4, 4, 2]
    assert steps[-1].num_drafted == 1  # only room for one draft + the bonus token
    assert all(s.num_accepted == 3 for s in steps[1:-1])


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_adversarial_drafter_has_tau_one(target, prompt, block_size):
    """Drafts that are never the target's choice: every step keeps only the bonus token, τ = 1."""
    expected, _, _ = reference(target, prompt, greedy(20))
    tokens, steps, _ = speculative(target, make_adversary(target, block_size), prompt, greedy(20))
    assert tokens == expected
    assert all(s.num_accepted == 0 and len(s.tokens) == 1 for s in steps)
    stats = steps[-1].stats
    assert stats.tau == 1.0 and stats.steps == 19
    assert stats.acceptance_rate[0] == 0.0


@pytest.mark.parametrize("make", [make_oracle, make_adversary, None], ids=["oracle", "adversary", "untrained"])
def test_eos_inside_a_block(target, prompt, make):
    """EOS emitted mid-block: both engines stop right after it, EOS included, finish_reason 'eos'."""
    full, _, _ = reference(target, prompt, greedy(30))
    # A first occurrence that does not end an oracle block (blocks commit tokens 1-4, 5-8, ...).
    position = next(i for i in range(6, 30) if i % 4 and full[i] not in full[:i])
    eos = full[position]
    config = greedy(30, eos=[eos])
    expected, _, reason = reference(target, prompt, config)
    assert expected == full[:position + 1] and reason == "eos"
    drafter = make(target, 4) if make else Drafter.from_target(target, [0], block_size=4)
    tokens, steps, reason = speculative(target, drafter, prompt, config)
    assert tokens == expected and reason == "eos"
    assert steps[-1].stats.new_tokens == position + 1
    if make is make_oracle:  # the last block was cut right after the EOS
        assert len(steps[-1].tokens) == (position - 1) % 4 + 1 < 4
        assert steps[-1].num_accepted == 3


def test_eos_as_the_first_token(target, prompt):
    """An EOS from the prefill ends the generation before any drafting."""
    first = reference(target, prompt, greedy(5))[0][0]
    drafter = make_oracle(target, 4)
    tokens, steps, reason = speculative(target, drafter, prompt, greedy(5, eos=[first]))
    assert tokens == [first] and len(steps) == 1 and reason == "eos"


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("make", [make_oracle, None], ids=["oracle", "untrained"])
def test_generation_runs_into_the_context_limit(block_size, make):
    """Context 40, prompt 30, max_new_tokens 100: both engines stop at 40 tokens with 'length'."""
    target = make_decoder(tiny_config(tie_word_embeddings=False, max_position_embeddings=40), seed=1)
    prompt = [(7 * i + 3) % 64 for i in range(30)]
    expected, _, reason = reference(target, prompt, greedy(100))
    assert len(prompt) + len(expected) == 40 and reason == "length"
    drafter = make(target, block_size) if make else Drafter.from_target(target, [0], block_size=block_size)
    tokens, steps, reason = speculative(target, drafter, prompt, greedy(100))
    assert tokens == expected and reason == "length"
    assert all(s.num_drafted <= 40 - 1 - len(prompt) for s in steps)


def test_max_new_tokens_one(target, prompt, oracle_drafter):
    """A single new token comes from the prefill; no verification step happens."""
    expected, _, _ = reference(target, prompt, greedy(1))
    tokens, steps, reason = speculative(target, oracle_drafter, prompt, greedy(1))
    assert tokens == expected and len(tokens) == 1 and reason == "length"
    assert steps[-1].stats.steps == 0 and steps[-1].stats.tau == 1.0


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_qwen3_target_matches_reference(qwen3_config, prompt, block_size):
    target = make_decoder(qwen3_config, seed=1)
    expected, _, _ = reference(target, prompt, greedy(40))
    drafter = Drafter.from_target(target, [0], block_size=block_size)
    assert speculative(target, drafter, prompt, greedy(40))[0] == expected
    assert speculative(target, make_oracle(target, block_size), prompt, greedy(40))[0] == expected


def test_long_prompt_prefill(target):
    """A prompt longer than the row-by-row limit (64) prefills with one masked call in both engines."""
    prompt = [(5 * i + 1) % 64 for i in range(80)]
    expected, _, _ = reference(target, prompt, greedy(20))
    drafter = Drafter.from_target(target, [0, 1], block_size=8)
    assert speculative(target, drafter, prompt, greedy(20))[0] == expected


def test_drafter_for_another_vocabulary_is_refused(target, prompt):
    other = make_decoder(tiny_config(vocab_size=80, tie_word_embeddings=False), seed=2)
    drafter = Drafter.from_target(other, [0], block_size=4)
    with pytest.raises(ValueError, match="vocabulary"):
        next(speculative_generate(target, drafter, prompt, greedy(5)))


# -- sampling ---------------------------------------------------------------------------------

def sampling(seed: int | None = None) -> SamplingConfig:
    return SamplingConfig(temperature=1.0, top_k=6, top_p=0.9, seed=seed)


@pytest.fixture(scope="module")
def sampling_setup():
    """The vocab-8 sampling setup (conftest.sampling_pair), block 4: 3 drafts."""
    return sampling_pair(4)


@torch.no_grad()
def exact_marginals(target, drafter, prompt):
    """Exact distributions of new tokens 1-3 under the transformed target, by enumeration, and the
    drafter's distribution for token 2 (what an engine that accepted every draft would produce)."""
    s = sampling()

    def p(tokens):
        return probabilities(target(torch.tensor([tokens]))[0, -1], s)

    p1, p2, p3, q2 = p(prompt), torch.zeros(8), torch.zeros(8), torch.zeros(8)
    for a in p1.nonzero().flatten().tolist():
        pa = p(prompt + [a])
        p2 += p1[a] * pa
        q2 += p1[a] * probabilities(drafter.draft(drafter.new_cache(32), prompt + [a])[0], s)
        for b in pa.nonzero().flatten().tolist():
            p3 += p1[a] * pa[b] * p(prompt + [a, b])
    return p1, p2, p3, q2


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def histograms(engine, runs: int, first_seed: int):
    """Empirical distributions of new tokens 2 and 3 over seeded runs, and step outcomes seen."""
    counts = torch.zeros(2, 8)
    outcomes = set()
    for seed in range(first_seed, first_seed + runs):
        tokens, steps, _ = run(engine(GenerationConfig(max_new_tokens=3, sampling=sampling(seed))))
        assert len(tokens) == 3
        counts[0, tokens[1]] += 1
        counts[1, tokens[2]] += 1
        outcomes.update((s.num_drafted, s.num_accepted) for s in steps[1:])
    return counts / runs, outcomes


def test_sampling_preserves_the_target_distribution(sampling_setup):
    """T=1, top_k=6, top_p=0.9, 3000 seeded runs per engine: tokens 2 and 3 (which go through
    verification) follow the exact target distribution, like plain sampling does.

    The drafter's own distribution is > 0.3 away in total variation, so accepting drafts blindly,
    or recovering from the wrong residual, would fail by far more than the 0.05 bound allows.
    """
    target, drafter, prompt = sampling_setup
    _, p2, p3, q2 = exact_marginals(target, drafter, prompt)
    assert tv(p2, q2) > 0.3
    runs = 3000
    ref, _ = histograms(lambda c: reference_generate(target, prompt, c), runs, first_seed=0)
    spec, outcomes = histograms(lambda c: speculative_generate(target, drafter, prompt, c), runs,
                                first_seed=100_000)
    assert (1, 0) in outcomes and (1, 1) in outcomes  # both rejection and acceptance happened
    assert tv(ref[0], p2) < 0.05 and tv(ref[1], p3) < 0.05
    assert tv(spec[0], p2) < 0.05 and tv(spec[1], p3) < 0.05
    assert tv(spec[0], ref[0]) < 0.05 and tv(spec[1], ref[1]) < 0.05


def test_sampling_never_leaves_the_filtered_support(sampling_setup):
    """Every sampled token has non-zero probability after top-k / top-p."""
    target, drafter, prompt = sampling_setup
    p1, _, _, _ = exact_marginals(target, drafter, prompt)
    for seed in range(50):
        tokens, _, _ = run(speculative_generate(target, drafter, prompt,
                                                GenerationConfig(max_new_tokens=1, sampling=sampling(seed))))
        assert p1[tokens[0]] > 0


def test_seeded_sampling_is_reproducible(target, prompt):
    """The same seed gives the same tokens; the first token equals the reference's (same prefill draw)."""
    drafter = Drafter.from_target(target, [0], block_size=4)
    config = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=1.0, seed=11))
    first, _, _ = speculative(target, drafter, prompt, config)
    again, _, _ = speculative(target, drafter, prompt, config)
    assert first == again and len(first) == 20
    assert reference(target, prompt, config)[0][0] == first[0]
    other = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=1.0, seed=12))
    assert speculative(target, drafter, prompt, other)[0] != first


# -- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["reference", "speculative"])
def test_bad_prompts(target, engine):
    """An empty prompt, or one that fills the context, is a PromptError before any work."""
    drafter = Drafter.from_target(target, [0], block_size=4)

    def start(prompt):
        if engine == "reference":
            return next(reference_generate(target, prompt, greedy(5)))
        return next(speculative_generate(target, drafter, prompt, greedy(5)))

    with pytest.raises(PromptError, match="empty"):
        start([])
    with pytest.raises(PromptError, match="context"):
        start([1] * 128)
    with pytest.raises(PromptError):
        start([1] * 200)
    assert len(start([1] * 127).tokens) == 1  # one slot left: exactly one token


@pytest.mark.parametrize("make", [
    lambda: SamplingConfig(temperature=-1),
    lambda: SamplingConfig(temperature=float("nan")),
    lambda: SamplingConfig(top_p=0),
    lambda: SamplingConfig(top_p=1.5),
    lambda: SamplingConfig(top_k=-1),
    lambda: GenerationConfig(max_new_tokens=0),
], ids=["negative-temperature", "nan-temperature", "top_p-0", "top_p-1.5", "negative-top_k",
        "max_new_tokens-0"])
def test_invalid_generation_configs(make):
    with pytest.raises(ConfigError):
        make()


def test_generation_config_json_round_trip():
    config = GenerationConfig(max_new_tokens=7, eos_token_ids=[2, 3],
                              sampling=SamplingConfig(temperature=0.7, top_k=5, top_p=0.8, seed=1))
    assert GenerationConfig.from_json(config.to_json()) == config
