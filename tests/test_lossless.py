"""Lossless at T > 0, end to end: each engine's output law over whole continuations is the target's
exact law, and the same check fails for the wiring bugs it exists to catch.

Setup (`pair` below): vocabulary 8, T = 0.7, top-k 3, top-p 0.85 (both bind: 92 five-token
continuations have mass, not 3^5 = 243); a 1-layer target; a block-4 drafter over a reduced draft
vocabulary (6 of the 8 ids) with flattened logits, so top-k / top-p cut much of its mass and its q
is far from p. Prompt [1, 5, 2], 5 new tokens: the first verification judges 3 drafts, so
rejections at draft k = 1 and 2 happen, and so do full accepts and later 1- and 2-draft blocks.
Engines: sync speculative; async (packed branches, reanchored misses); lookup + drafter, gated
(the shipped default).

The law: every continuation's probability is the product of the target's conditionals
(full-context forwards, no cache) under the same transform, enumerated over the tokens with mass.
The check: Pearson's chi-square of RUNS = 800 seeded generations against that law, the rarest
cells pooled until each expects ≥ 5 (43 degrees of freedom); it fails when p < ALPHA = 1e-4, or
when a continuation outside the law's support appears. Seeds are fixed (0 … 799, the same for good
and broken engines), so nothing is flaky; ALPHA is the chance that a correct engine fails for an
arbitrary seed set (simulated from the exact law: 1.3e-4 in 100,000 seed sets). Measured p at the
fixed seeds: 0.51 / 0.57 / 0.88 for the three engines, 0.87 for plain sampling.

Negative controls, monkeypatched around the real functions (no flags in production code):
- "unfiltered_q": drafts drawn from the top-k/top-p-filtered drafter law, verification told the
  unfiltered softmax. Moves the output law by TV 0.23 (sync), 0.22 (async), 0.16 (gated lookup).
- "resample_p": after a rejection the recovered token is drawn from p, not from max(0, p - q)
  normalised. TV 0.25 (sync), 0.24 (async), 0.19 (gated lookup).
Power of the check against them at RUNS = 800: `test_the_check_has_power_against_both_bugs`
enumerates the sync and gated engines' exact laws with each bug: 1.0 in 5,000 simulated seed sets,
0.9999 for unfiltered_q in the gated engine; for async (whose reanchored drafts the enumeration
does not model) 1.0 against its law estimated from 12,000 extra runs. At the fixed seeds the broken
engines score p = 1e-12 … 1e-44. A spy test checks the mechanism directly: the q handed to
verification is the very tensor the drafts were drawn from.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

import d3d.async_engine
import d3d.sources
import d3d.target_step
from conftest import make_decoder, perturb_drafter, tiny_config
from d3d.async_engine import AsyncConfig, async_generate
from d3d.config import GenerationConfig, SamplingConfig
from d3d.costs import forward_costs
from d3d.drafter import Drafter
from d3d.engine import reference_generate, speculative_generate
from d3d.gate import SpeculationGate
from d3d.lookup import LookupConfig, LookupIndex, lookup_drafts
from d3d.sampling import probabilities
from d3d.verify import Verdict

SAMPLING = dict(temperature=0.7, top_k=3, top_p=0.85)
PROMPT = [1, 5, 2]
NEW_TOKENS = 5
DRAFT_VOCAB = [0, 1, 2, 3, 4, 6]  # 5 and 7 are never drafted: their mass comes from residuals alone
RUNS = 800
ALPHA = 1e-4
LOOKUP = LookupConfig(max_ngram=2, min_ngram=1)  # on 8 tokens a match is common, but not certain


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, Drafter]:
    """The vocab-8 target and its flat, reduced-vocabulary drafter (see the module docstring)."""
    config = tiny_config(vocab_size=8, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=8, tie_word_embeddings=False, max_position_embeddings=32)
    target = make_decoder(config, seed=1)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.2)  # several tokens survive top-k / top-p at most positions
    drafter = Drafter.from_target(target, [0], block_size=4, draft_vocab=torch.tensor(DRAFT_VOCAB))
    perturb_drafter(drafter, scale=0.5, seed=7)
    with torch.no_grad():
        drafter.decoder.norm.weight.mul_(0.2)  # flat: filtering removes much of the drafter's mass
    return target, drafter


def sampling(seed: int | None = None) -> SamplingConfig:
    return SamplingConfig(**SAMPLING, seed=seed)


@pytest.fixture(scope="module")
def law(pair) -> dict[tuple[int, ...], float]:
    law = exact_law(pair[0], PROMPT, NEW_TOKENS, sampling())
    assert abs(sum(law.values()) - 1) < 1e-5
    assert 3 ** 3 < len(law) < 3 ** NEW_TOKENS  # rich, and top-p binds somewhere
    return law


@torch.no_grad()
def exact_law(target, prompt: list[int], length: int, sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(continuation) of every `length`-token continuation with mass, as a product of the target's
    full-context conditionals; a token the transform zeroes ends its branch (the rest of V^n has mass 0)."""
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        grown = {}
        for tokens, mass in law.items():
            probs = probabilities(target(torch.tensor([prompt + list(tokens)]))[0, -1], sampling)
            for token in probs.nonzero().flatten().tolist():
                grown[tokens + (token,)] = mass * float(probs[token])
        law = grown
    return law


# -- the check -----------------------------------------------------------------------------------

def pooled_cells(expected: torch.Tensor) -> tuple[list[int], list[int]]:
    """Cell indices pooled into one (the rarest, until the pool and every other cell expect ≥ 5), and the rest."""
    order = expected.argsort().tolist()
    pool, mass = [], 0.0
    while order and (mass < 5 or expected[order[0]] < 5):
        mass += float(expected[order[0]])
        pool.append(order.pop(0))
    return pool, order


def chi_square_p_values(counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """(S, C) cell counts of S samples of equal size against cell probabilities (C,) → (S,) p-values."""
    expected = counts[0].sum() * probs
    pool, rest = pooled_cells(expected)
    observed = torch.cat([counts[:, pool].sum(-1, keepdim=True), counts[:, rest]], -1)
    expected = torch.cat([expected[pool].sum(0, keepdim=True), expected[rest]])
    statistic = ((observed - expected) ** 2 / expected).sum(-1)
    degrees = torch.tensor(len(rest) / 2, dtype=torch.float64)  # half of (len(rest) + 1 cells) - 1
    return torch.special.gammaincc(degrees, statistic / 2)  # the chi-square survival function


def p_value(counts: Counter, law: dict[tuple[int, ...], float]) -> float:
    """The check's p-value for the continuations seen; 0 when one of them has no mass under `law`."""
    if any(tokens not in law for tokens in counts):
        return 0.0
    cells = list(law)
    observed = torch.tensor([[counts[c] for c in cells]], dtype=torch.float64)
    return float(chi_square_p_values(observed, torch.tensor([law[c] for c in cells], dtype=torch.float64))[0])


# -- engines, and the bugs the check must catch --------------------------------------------------

ENGINES = {
    "speculative": lambda target, drafter, config: speculative_generate(target, drafter, PROMPT, config),
    "async": lambda target, drafter, config: async_generate(
        target, drafter, PROMPT, config,
        AsyncConfig(max_branches=3, guesses_per_k=2, miss_policy="reanchor", concurrent=False)),
    # The shipped default: lookup drafts (one-hot q) where the context has a match, the drafter's
    # elsewhere, and a gate choosing how many of them to verify from this request's acceptance so far.
    "lookup": lambda target, drafter, config: speculative_generate(target, drafter, PROMPT, config, lookup=LOOKUP,
                                                                   adaptive=True),
}


def report_unfiltered_q(monkeypatch) -> None:
    """Bug: drafts drawn from the filtered q, verification told the unfiltered softmax."""
    real = d3d.sources.drafts_from_logits

    def drafts_from_logits(block_logits, sampling, generator):
        draft_tokens, _ = real(block_logits, sampling, generator)
        return draft_tokens, (block_logits.float() / sampling.temperature).softmax(-1)
    monkeypatch.setattr(d3d.sources, "drafts_from_logits", drafts_from_logits)
    monkeypatch.setattr(d3d.async_engine, "drafts_from_logits", drafts_from_logits)


def recover_from_p(monkeypatch) -> None:
    """Bug: after a rejection the recovered token is drawn from p, not from max(0, p - q) normalised."""
    real = d3d.target_step.verify_sampling

    def verify_sampling(draft_tokens, draft_probs, target_probs, generator=None):
        verdict = real(draft_tokens, draft_probs, target_probs, generator)
        if verdict.num_accepted == draft_tokens.shape[0]:
            return verdict
        redrawn = torch.multinomial(target_probs[verdict.num_accepted], 1, generator=generator)
        return Verdict(verdict.num_accepted, int(redrawn))
    monkeypatch.setattr(d3d.target_step, "verify_sampling", verify_sampling)


BUGS = {"unfiltered_q": report_unfiltered_q, "resample_p": recover_from_p}


def sample_engine(engine, pair, runs: int = RUNS) -> tuple[Counter, Counter, list[int]]:
    """Seeded generations (seeds 0 … runs-1) → (continuation counts, (source, drafted, accepted) of
    every verification, [async branch hits, async rounds])."""
    target, drafter = pair
    counts, outcomes, branches = Counter(), Counter(), [0, 0]
    for seed in range(runs):
        steps = list(engine(target, drafter, GenerationConfig(max_new_tokens=NEW_TOKENS, sampling=sampling(seed))))
        counts[tuple(t for s in steps for t in s.tokens)] += 1
        outcomes.update((s.source, s.num_drafted, s.num_accepted) for s in steps[1:])
        branches[0] += sum(steps[-1].stats.branch_hits_at)
        branches[1] += sum(steps[-1].stats.branch_rounds_at)
    return counts, outcomes, branches


# -- tests ---------------------------------------------------------------------------------------

def test_plain_sampling_passes_the_check(pair, law):
    """Calibration: the AR reference samples the enumerated law (the law and the check are right)."""
    counts, _, _ = sample_engine(lambda target, _, config: reference_generate(target, PROMPT, config), pair)
    assert p_value(counts, law) >= ALPHA


@pytest.mark.parametrize("name", ENGINES)
def test_engine_output_follows_the_target_law(pair, law, name):
    """Sync speculative, async (packed branches, reanchored misses) and lookup + drafter: the joint
    law of all 5 new tokens is the target's; every verification path was taken."""
    counts, outcomes, (hits, rounds) = sample_engine(ENGINES[name], pair)
    assert sum(counts.values()) == RUNS and all(len(c) == NEW_TOKENS for c in counts)
    outside = [c for c in counts if c not in law]
    assert not outside, f"continuations the target never produces: {outside[:5]}"
    assert p_value(counts, law) >= ALPHA
    judged = {(drafted, accepted) for (source, drafted, accepted) in outcomes if source == "drafter"}
    if name == "lookup":  # gated: how many drafts it verifies follows the machine's measured costs
        assert {"lookup", "drafter"} <= {source for source, _, _ in outcomes}
        assert any(accepted == 0 < drafted for drafted, accepted in judged)
        assert any(0 < accepted < drafted for drafted, accepted in judged)  # rejections at k ≥ 1
        assert any(accepted == drafted > 0 for drafted, accepted in judged)
    else:
        assert {(3, 0), (3, 1), (3, 2), (3, 3)} <= judged  # rejections at k ≥ 1 recover from residuals
    if name == "async":
        assert 0 < hits < rounds  # drafted-ahead blocks and redrafts both verified


@pytest.mark.parametrize("bug", BUGS)
@pytest.mark.parametrize("name", ENGINES)
def test_the_check_catches_wiring_bugs(pair, law, name, bug, monkeypatch):
    """Negative controls: the same check, on the same seeds, rejects each broken engine."""
    BUGS[bug](monkeypatch)
    counts, _, _ = sample_engine(ENGINES[name], pair)
    assert all(c in law for c in counts)  # caught by the statistics, not by an impossible token
    assert p_value(counts, law) < ALPHA, f"{bug} in the {name} engine went unnoticed"


# -- q is what the drafts were drawn from --------------------------------------------------------

class DraftSpy:
    """Wraps the engines' sampler and `verify_sampling`: every q handed to verification must be the
    very distribution its drafts were just drawn from (drafter) or their one-hot (context lookup),
    and a drafter's q must be filtered like the target's (≤ top_k tokens, all in the draft vocabulary)."""

    def __init__(self, monkeypatch) -> None:
        self.drawn: tuple[torch.Tensor, torch.Tensor] | None = None  # (probs, tokens) of the latest block draw
        self.checked: Counter = Counter()
        self.mismatches: list[str] = []
        real_sample, real_verify = d3d.target_step.sample, d3d.target_step.verify_sampling

        def sample(probs, generator=None):
            tokens = real_sample(probs, generator)
            if probs.dim() == 2:  # a block of drafts (the prefill's draw is one row of shape (V,))
                self.drawn = (probs.clone(), tokens.clone())  # copies: a later in-place change shows too
            return tokens

        def verify_sampling(draft_tokens, draft_probs, target_probs, generator=None):
            self.inspect(draft_tokens, draft_probs)
            self.drawn = None
            return real_verify(draft_tokens, draft_probs, target_probs, generator)
        monkeypatch.setattr(d3d.target_step, "sample", sample)
        monkeypatch.setattr(d3d.sources, "sample", sample)  # where the drafting sources draw
        monkeypatch.setattr(d3d.target_step, "verify_sampling", verify_sampling)

    def inspect(self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor) -> None:
        if not draft_tokens.numel():
            return
        if self.drawn is None:  # nothing drawn since the last verification: deterministic lookup drafts
            source = "lookup"
            right = torch.equal(draft_probs, d3d.target_step.one_hot(draft_tokens, draft_probs.shape[-1]))
        else:
            source = "drafter"
            probs, tokens = self.drawn
            outside = torch.ones(draft_probs.shape[-1], dtype=torch.bool)
            outside[DRAFT_VOCAB] = False
            right = (torch.equal(tokens, draft_tokens) and torch.equal(probs, draft_probs)
                     and bool(((draft_probs > 0).sum(-1) <= SAMPLING["top_k"]).all())
                     and not draft_probs[:, outside].any())
        self.checked[source] += 1
        if not right:
            self.mismatches.append(source)


SPY_ENGINES = {**ENGINES, "async": lambda target, drafter, config: async_generate(  # the worker thread too
    target, drafter, PROMPT, config, AsyncConfig(max_branches=3, miss_policy="reanchor"))}


@pytest.mark.parametrize("bug", [None, "unfiltered_q"])
@pytest.mark.parametrize("name", SPY_ENGINES)
def test_verification_gets_the_q_each_draft_was_drawn_from(pair, name, bug, monkeypatch):
    """40 seeded 12-token generations per engine: q at verification is exactly the drafting law
    (the unfiltered-q bug is seen at every drafter verification)."""
    if bug:
        BUGS[bug](monkeypatch)
    spy = DraftSpy(monkeypatch)
    target, drafter = pair
    for seed in range(40):
        list(SPY_ENGINES[name](target, drafter, GenerationConfig(max_new_tokens=12, sampling=sampling(seed))))
    assert spy.checked["drafter"] > 30
    if name == "lookup":
        assert spy.checked["lookup"] > 30
    if bug:
        assert spy.mismatches.count("drafter") == spy.checked["drafter"] and "lookup" not in spy.mismatches
    else:
        assert not spy.mismatches


# -- power ---------------------------------------------------------------------------------------

@torch.no_grad()
def speculative_law(target, drafter: Drafter, bug: str | None, lookup: LookupConfig | None = None,
                    adaptive: bool = False) -> dict[tuple[int, ...], float]:
    """The exact output law of `speculative_generate` (lookup drafts where they match, else the
    drafter's; gated or not), with or without one of BUGS: every draft block, accept/reject
    decision and recovered token enumerated with its probability instead of sampled. Block rows
    are drawn independently, each from its own row of the drafter's block logits."""
    config, law = sampling(), Counter()
    end, vocab_size = len(PROMPT) + NEW_TOKENS, target.config.vocab_size
    cached: dict[tuple[int, ...], torch.Tensor] = {}

    def target_probs(tokens: list[int]) -> torch.Tensor:
        if tuple(tokens) not in cached:
            cached[tuple(tokens)] = probabilities(target(torch.tensor([tokens]))[0, -1], config).double()
        return cached[tuple(tokens)]

    def support(probs: torch.Tensor) -> list[int]:
        return probs.nonzero().flatten().tolist()

    def step(tokens: list[int], mass: float, gate: SpeculationGate | None) -> None:  # one verification
        room = end - len(tokens)
        if room == 0:
            law[tuple(tokens[len(PROMPT):])] += mass
            return
        num_drafts = min(drafter.block_size - 1, room - 1)
        chances = LookupIndex(lookup).chances(tokens, num_drafts) if lookup is not None else []  # as LookupSource's
        wanted = num_drafts if gate is None else gate.num_drafts("lookup", num_drafts, chances=chances)
        found = lookup_drafts(tokens, wanted, lookup) if lookup is not None and wanted > 0 else []
        wanted = num_drafts if gate is None else gate.num_drafts("drafter", num_drafts)
        source = "lookup" if found else "drafter" if wanted > 0 else "none"
        if found:
            drawn = told = d3d.target_step.one_hot(torch.tensor(found), vocab_size).double()
        else:
            logits = drafter.draft(drafter.new_cache(end), tokens, wanted)[:wanted]  # as the engine drafts
            drawn = probabilities(logits, config).double()
            told = (logits.double() / config.temperature).softmax(-1) if bug == "unfiltered_q" else drawn

        def next_step(committed: list[int], mass: float, num_accepted: int) -> None:
            after = copy.deepcopy(gate)
            if after is not None:
                after.record(source, drawn.shape[0], num_accepted, chances=chances if found else None)
            step(committed, mass, after)
        judge(tokens, drawn, told, mass, next_step)

    def judge(tokens: list[int], drawn: torch.Tensor, told: torch.Tensor, mass: float, next_step,
              num_accepted: int = 0) -> None:
        target_row = target_probs(tokens)  # judges the next draft, or gives the bonus after them all
        if num_accepted == drawn.shape[0]:
            for token in support(target_row):
                next_step(tokens + [token], mass * float(target_row[token]), num_accepted)
            return
        rejected = 0.0
        draft_row, told_row = drawn[num_accepted], told[num_accepted]
        for token in support(draft_row):
            accept = min(1.0, float(target_row[token] / told_row[token]))
            judge(tokens + [token], drawn, told, mass * float(draft_row[token]) * accept, next_step, num_accepted + 1)
            rejected += float(draft_row[token]) * (1 - accept)
        residual = (target_row - told_row).clamp_min(0)
        recovery = target_row if bug == "resample_p" or residual.sum() <= 1e-12 else residual / residual.sum()
        for token in support(recovery):
            next_step(tokens + [token], mass * rejected * float(recovery[token]), num_accepted)

    gate = None
    if adaptive:
        costs = forward_costs(target, drafter, drafter.block_size - 1)  # the engine's own gate
        verify = forward_costs(target, None, drafter.block_size - 1).verify  # the target's alone
        gate = SpeculationGate({"lookup": [0.0], "drafter": costs.drafter}, verify)
    first = target_probs(PROMPT)  # the prefill's plain draw
    for token in support(first):
        step(PROMPT + [token], float(first[token]), gate)
    return dict(law)


def detection_rate(truth: dict, law: dict, samples: int, generator: torch.Generator) -> float:
    """Share of `samples` simulated runs of RUNS generations from `truth` that the check rejects."""
    cells = list(law) + [c for c in truth if c not in law]
    probs = torch.tensor([truth.get(c, 0.0) for c in cells], dtype=torch.float64)
    draws = torch.multinomial(probs.float(), samples * RUNS, replacement=True, generator=generator)
    draws = draws.view(samples, RUNS)
    counts = torch.zeros(samples, len(cells), dtype=torch.float64)
    counts.scatter_add_(1, draws, torch.ones_like(draws, dtype=torch.float64))
    outside = counts[:, len(law):].sum(-1) > 0
    law_probs = torch.tensor([law[c] for c in cells[:len(law)]], dtype=torch.float64)
    rejected = (chi_square_p_values(counts[:, :len(law)], law_probs) < ALPHA) | outside
    return float(rejected.double().mean())


def tv(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(c, 0.0) - b.get(c, 0.0)) for c in set(a) | set(b))


@pytest.mark.parametrize("name", ["speculative", "lookup"])
def test_the_check_has_power_against_both_bugs(pair, law, name):
    """The engine's algorithm enumerated exactly: correct, it gives the target's law; with either
    bug its law moves > 0.1 in TV, and the check at RUNS rejects ≥ 99.5% of simulated seed sets
    (power), while it rejects the right law about ALPHA of the time (false alarm)."""
    target, drafter = pair
    options = dict(lookup=LOOKUP, adaptive=True) if name == "lookup" else {}
    assert tv(speculative_law(target, drafter, None, **options), law) < 1e-5
    generator = torch.Generator().manual_seed(0)
    assert detection_rate(law, law, 20_000, generator) < 5 * ALPHA
    for bug in BUGS:
        broken = speculative_law(target, drafter, bug, **options)
        assert tv(broken, law) > 0.1, bug
        assert detection_rate(broken, law, 2_000, generator) > 0.995, bug
