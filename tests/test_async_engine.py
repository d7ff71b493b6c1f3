"""Async engine: async == sync == reference output under every plan (all hits, all misses, none),
both miss policies, serial and concurrent; sampling keeps the target's distribution; no worker
outlives a generation. (The packed pass and the branch plan: tests/test_packed_drafting.py.)"""

from __future__ import annotations

import dataclasses
import gc
import json
import multiprocessing
import threading

import pytest
import torch

import d3d.async_engine
import d3d.generation
from conftest import (sampling_pair, AdversarialDrafter, OracleDrafter, greedy_continuation, make_decoder, one_hot_logits,
                      perturb_drafter, tiny_config)
from d3d.async_engine import AsyncConfig, async_generate
from d3d.cli import main
from d3d.config import ConfigError, GenerationConfig, SamplingConfig
from d3d.drafter import Drafter
from d3d.engine import reference_generate, speculative_generate
from d3d.sampling import probabilities
from test_generation import tiny_target


def run(steps) -> tuple[list[int], list]:
    steps = list(steps)
    return [t for s in steps for t in s.tokens], steps


def greedy(max_new_tokens: int, eos: list[int] | None = None) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos or [])


def no_workers() -> bool:
    return (not any(t.name.startswith("d3d-drafter") for t in threading.enumerate())
            and not multiprocessing.active_children())


# -- drafters and planners with known behaviour ----------------------------------------------

class HistoryMixin:
    """Tracks the token at every drafter-cache slot, so packed branches know their full context."""

    def draft(self, cache, tokens, num_drafts=None):
        self.history = list(tokens)
        self.sync_drafts = getattr(self, "sync_drafts", 0) + 1
        return super().draft(cache, tokens, num_drafts)

    @torch.no_grad()
    def packed_draft(self, cache, trunk, branches, anchor_slot, with_trunk=False):
        slots = self.history[:cache.length] + trunk
        trunk_logits, logits = super().packed_draft(cache, trunk, branches, anchor_slot, with_trunk)
        self.history = slots  # the cache may keep the trunk
        for j, (k, bonus) in enumerate(branches):
            logits[j] = self.branch_logits(slots[:anchor_slot + k + 1] + [bonus], logits.shape[-1])
        if trunk_logits is not None:  # causal row i predicts the token after slot anchor_slot + i
            for i in range(trunk_logits.shape[0]):
                trunk_logits[i] = self.branch_logits(slots[:anchor_slot + i + 1], trunk_logits.shape[-1])[0]
        return trunk_logits, logits


class AsyncOracle(HistoryMixin, OracleDrafter):
    """Drafts (sync and packed) are the target's greedy continuation: every draft is accepted."""

    def branch_logits(self, tokens, vocab):
        return one_hot_logits(greedy_continuation(self.oracle_target, tokens, self.block_size), self.block_size, vocab)


class AsyncAdversary(HistoryMixin, AdversarialDrafter):
    """Every first draft (sync and packed) is wrong: τ = 1."""

    def branch_logits(self, tokens, vocab):
        wanted = greedy_continuation(self.oracle_target, tokens, 1)  # only the first draft matters
        return one_hot_logits([(t + 1) % vocab for t in wanted], self.block_size, vocab, filler=1)


def truth(target, tokens, draft_tokens) -> tuple[int, int]:
    """The greedy verdict (k, bonus) the target will give."""
    wanted = greedy_continuation(target, tokens, len(draft_tokens) + 1)
    k = next((i for i, (d, w) in enumerate(zip(draft_tokens, wanted)) if d != w), len(draft_tokens))
    return k, wanted[k]


def hit_planner(target, extra: int = 0):
    """Plans the true outcome (after `extra` wrong guesses, so the budget matters): all hits."""
    def plan(tokens, draft_tokens, block_logits, max_k):
        k, bonus = truth(target, tokens, draft_tokens)
        vocab = block_logits.shape[-1]
        wrong = [(j % (max_k + 1), (bonus + 1 + j) % vocab) for j in range(extra)]
        return wrong + ([(k, bonus)] if k <= max_k else [])
    return plan


def miss_planner(target):
    """Every k, but never the true bonus: all misses (and a same-k branch for "reanchor")."""
    def plan(tokens, draft_tokens, block_logits, max_k):
        k, bonus = truth(target, tokens, draft_tokens)
        vocab = block_logits.shape[-1]
        return [(j, (bonus + 1) % vocab if j == k else bonus) for j in range(max_k + 1)]
    return plan


def make_drafter(kind: str, target, block_size: int = 4) -> Drafter:
    if kind == "oracle":
        return AsyncOracle.from_target(target, [0], block_size=block_size)
    if kind == "adversary":
        return AsyncAdversary.from_target(target, [0], block_size=block_size)
    drafter = Drafter.from_target(target, [0], block_size=block_size)
    perturb_drafter(drafter, 0.05, seed=3)  # an imperfect drafter: a mix of hits and misses
    return drafter


# -- greedy: async == sync == reference ------------------------------------------------------------

@pytest.fixture(scope="module")
def setup():
    target = make_decoder(tiny_config("llama", tie_word_embeddings=False), seed=1)
    prompt = [3, 17, 42, 5, 9, 33, 60, 1]
    expected, _ = run(reference_generate(target, prompt, greedy(40)))
    return target, prompt, expected


@pytest.mark.parametrize("concurrent", [False, True], ids=["serial", "concurrent"])
@pytest.mark.parametrize("policy", ["redraft", "reanchor"])
@pytest.mark.parametrize("plan", ["trunk", "block", "hits", "misses", "none"])
@pytest.mark.parametrize("kind", ["oracle", "adversary", "perturbed"])
def test_async_output_equals_reference(setup, kind, plan, policy, concurrent):
    """Token-for-token identity for every drafter, plan, miss policy and execution mode; hit rates
    are exactly 1 / 0 for the forced plans."""
    target, prompt, expected = setup
    drafter = make_drafter(kind, target)
    planner = {"hits": hit_planner(target, extra=1), "misses": miss_planner(target)}.get(plan)
    config = AsyncConfig(max_branches=0 if plan == "none" else 4, miss_policy=policy, concurrent=concurrent,
                         guess_source="block" if plan == "block" else "trunk")
    tokens, steps = run(async_generate(target, drafter, prompt, greedy(40), config, planner))
    assert tokens == expected
    assert steps[-1].finish_reason == "length"
    stats = steps[-1].stats
    assert sum(stats.branch_rounds_at) > 0
    if plan == "hits":
        assert stats.hit_rate == 1.0
    if plan in ("misses", "none"):
        assert stats.hit_rate == 0.0
    if kind == "oracle":
        if not (plan == "misses" and policy == "reanchor"):  # reanchored drafts follow a wrong bonus
            assert all(s.num_accepted == 3 for s in steps[1:-1])  # the last one is cut by the length
        if plan in ("hits", "trunk", "block"):  # the oracle's own guesses are right too
            assert stats.hit_rate == 1.0
            assert drafter.sync_drafts == 1  # only the first block; every later block was a hit
    if kind == "adversary":
        assert stats.tau == 1.0


@pytest.mark.parametrize("source", ["trunk", "block"])
def test_async_steps_equal_sync_steps(setup, source):
    """With redraft on misses, every block is drafted from the same context as the sync engine
    would draft it, so both verify the same drafts: identical steps, τ and acceptance."""
    target, prompt, expected = setup
    drafter = make_drafter("perturbed", target)
    _, sync = run(speculative_generate(target, drafter, prompt, greedy(40)))
    config = AsyncConfig(concurrent=False, guess_source=source)
    tokens, steps = run(async_generate(target, drafter, prompt, greedy(40), config))
    assert tokens == expected
    assert [(s.tokens, s.num_drafted, s.num_accepted) for s in steps] == \
        [(s.tokens, s.num_drafted, s.num_accepted) for s in sync]
    assert 0 < steps[-1].stats.hit_rate < 1  # some blocks came from branches, some were redrafted


@pytest.mark.parametrize("block_size", [2, 3, 8])
@pytest.mark.parametrize("budget", [(1, 1, "joint", "trunk"), (16, 4, "joint", "block"), (6, 3, "per_k", "trunk"),
                                    (4, 2, "per_k", "block")])
def test_block_sizes_and_budgets(setup, block_size, budget):
    target, prompt, expected = setup
    max_branches, guesses, selection, source = budget
    drafter = make_drafter("perturbed", target, block_size)
    config = AsyncConfig(max_branches=max_branches, guesses_per_k=guesses, selection=selection, guess_source=source)
    tokens, steps = run(async_generate(target, drafter, prompt, greedy(40), config))
    assert tokens == expected


@pytest.mark.parametrize("kind", ["oracle", "perturbed"])
@pytest.mark.parametrize("concurrent", [False, True], ids=["serial", "concurrent"])
def test_eos_inside_a_block(setup, kind, concurrent):
    target, prompt, full = setup
    position = next(i for i in range(6, 30) if i % 4 and full[i] not in full[:i])
    config = greedy(40, eos=[full[position]])
    drafter = make_drafter(kind, target)
    planner = hit_planner(target) if kind == "oracle" else None
    tokens, steps = run(async_generate(target, drafter, prompt, config, AsyncConfig(concurrent=concurrent), planner))
    assert tokens == full[:position + 1] and steps[-1].finish_reason == "eos"


def test_context_limit_and_first_token_eos():
    """Context 40, prompt 30: stops at 40 tokens; an EOS from the prefill ends before any drafting."""
    target = make_decoder(tiny_config(tie_word_embeddings=False, max_position_embeddings=40), seed=1)
    prompt = [(7 * i + 3) % 64 for i in range(30)]
    expected, _ = run(reference_generate(target, prompt, greedy(100)))
    drafter = make_drafter("perturbed", target, 4)
    assert run(async_generate(target, drafter, prompt, greedy(100)))[0] == expected
    first = expected[0]
    tokens, steps = run(async_generate(target, drafter, prompt, greedy(100, eos=[first])))
    assert tokens == [first] and len(steps) == 1 and no_workers()


def test_denoising_steps_and_missing_drafter_are_refused(target, prompt):
    drafter = Drafter.from_target(target, [0], block_size=4)
    drafter.config = dataclasses.replace(drafter.config, denoising_steps=2)
    with pytest.raises(ConfigError, match="denoising"):
        next(async_generate(target, drafter, prompt, greedy(5)))
    with pytest.raises(ConfigError, match="drafter"):
        next(async_generate(target, None, prompt, greedy(5)))
    unshifted = Drafter.from_target(target, [0], block_size=4, labels="unshifted")
    with pytest.raises(ConfigError, match="shifted labels"):
        next(async_generate(target, unshifted, prompt, greedy(5)))


# -- sampling ---------------------------------------------------------------------------------------

SAMPLING = dict(temperature=1.0, top_k=6, top_p=0.9)


@pytest.fixture(scope="module")
def sampling_setup():
    """The vocab-8 sampling setup (conftest.sampling_pair), block 3: 2 drafts."""
    return sampling_pair(3)


@torch.no_grad()
def exact_marginals(target, prompt, count: int) -> torch.Tensor:
    """(count, V) exact marginals of new tokens 1 … count under the transformed target, by enumeration."""
    s = SamplingConfig(**SAMPLING)
    prefixes, weights = torch.tensor([prompt]), torch.ones(1)
    marginals = []
    for _ in range(count):
        p = probabilities(target(prefixes)[:, -1], s) * weights[:, None]  # (N, V) joint
        marginals.append(p.sum(0))
        keep = p.flatten().nonzero().flatten()
        vocab = p.shape[1]
        prefixes = torch.cat([prefixes[keep // vocab], (keep % vocab)[:, None]], 1)
        weights = p.flatten()[keep]
    return torch.stack(marginals)


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_sampling_preserves_the_target_distribution(sampling_setup):
    """T=1, top_k=6, top_p=0.9, 2000 seeded runs, 5 tokens: tokens 2-5 (verified, blocks 2+ drafted
    by packed branches on hits or by reanchored branches on misses) follow the exact target
    marginals. The drafter is > 0.3 away in TV, so a wrong q or residual would fail by far more."""
    target, drafter, prompt = sampling_setup
    exact = exact_marginals(target, prompt, 5)
    runs, counts = 2000, torch.zeros(5, 8)  # observed TV ≤ 0.03 per token (expected ≈ 0.02)
    hits = rounds = 0
    config = AsyncConfig(max_branches=3, guesses_per_k=2, miss_policy="reanchor", concurrent=False)
    for seed in range(runs):
        generation = GenerationConfig(max_new_tokens=5, sampling=SamplingConfig(**SAMPLING, seed=seed))
        tokens, steps = run(async_generate(target, drafter, prompt, generation, config))
        counts[torch.arange(5), torch.tensor(tokens)] += 1
        hits += sum(steps[-1].stats.branch_hits_at)
        rounds += sum(steps[-1].stats.branch_rounds_at)
    empirical = counts / runs
    assert 0.1 < hits / rounds < 0.9  # both paths were exercised
    with torch.no_grad():  # the drafter's own marginal of token 2: what blind acceptance would give
        q2 = sum(exact[0, a] * probabilities(drafter.draft(drafter.new_cache(32), prompt + [a])[0],
                                             SamplingConfig(**SAMPLING)) for a in range(8))
    assert tv(q2, exact[1]) > 0.3
    for i in range(1, 5):
        assert tv(empirical[i], exact[i]) < 0.05, (i, empirical[i], exact[i])


@pytest.mark.parametrize("source", ["trunk", "block"])
def test_seeded_sampling_is_the_same_serial_and_concurrent(setup, source):
    """The sampling generator is only used on the main thread, in the same order either way."""
    target, prompt, _ = setup
    drafter = make_drafter("perturbed", target)
    config = GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(temperature=1.0, seed=5))
    serial = run(async_generate(target, drafter, prompt, config, AsyncConfig(concurrent=False, guess_source=source)))[0]
    concurrent = run(async_generate(target, drafter, prompt, config, AsyncConfig(guess_source=source)))[0]
    assert serial == concurrent and len(serial) == 30


# -- metrics ----------------------------------------------------------------------------------------

def test_async_metrics(setup):
    """Serial: all packed time is waited for (overlap 0). Hit rates per k; summary and merge carry them."""
    target, prompt, _ = setup
    drafter = make_drafter("perturbed", target)
    _, steps = run(async_generate(target, drafter, prompt, greedy(40), AsyncConfig(concurrent=False)))
    stats = steps[-1].stats
    assert stats.packed_seconds > 0 and stats.wait_seconds == pytest.approx(stats.packed_seconds)
    assert stats.overlap_fraction == pytest.approx(0.0, abs=1e-9)
    assert stats.draft_seconds >= stats.wait_seconds
    assert 0 < sum(stats.branch_rounds_at) <= stats.steps
    rates = stats.hit_rate_at
    assert all(0 <= r <= 1 for r in rates) and len(rates) == len(stats.branch_rounds_at)
    summary = stats.summary()
    assert summary["hit_rate"] == round(stats.hit_rate, 3) and "overlap_fraction" in summary
    merged = stats.merge(stats)
    assert merged.branch_rounds_at == [2 * r for r in stats.branch_rounds_at]
    assert merged.wait_seconds == pytest.approx(2 * stats.wait_seconds)
    assert "hit_rate" not in run(speculative_generate(target, drafter, prompt, greedy(10)))[1][-1].stats.summary()
    _, steps = run(async_generate(target, drafter, prompt, greedy(40), AsyncConfig(concurrent=True)))
    assert 0.0 <= steps[-1].stats.overlap_fraction <= 1.0


# -- shutdown -------------------------------------------------------------------------------------

def test_no_worker_after_exhaustion_or_close(setup):
    target, prompt, _ = setup
    drafter = make_drafter("perturbed", target)
    run(async_generate(target, drafter, prompt, greedy(20)))
    assert no_workers()
    steps = async_generate(target, drafter, prompt, greedy(40))
    next(steps), next(steps), next(steps)
    assert not no_workers()  # the worker is alive mid-generation
    steps.close()
    assert no_workers()


def test_no_worker_after_an_exception_in_the_consumer(setup):
    """An exception in the caller's loop: the worker ends when the generator is closed or collected."""
    target, prompt, _ = setup
    steps = async_generate(target, make_drafter("perturbed", target), prompt, greedy(40))
    with pytest.raises(RuntimeError):
        for i, _ in enumerate(steps):
            if i == 3:
                raise RuntimeError("consumer failed")
    del steps
    gc.collect()
    assert no_workers()


class FailingDrafter(Drafter):
    """Its second packed pass raises (in the worker thread)."""

    error: type[BaseException] = RuntimeError

    def packed_draft(self, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            raise self.error("drafter failed")
        return super().packed_draft(*args, **kwargs)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["worker", "main"])
def test_no_worker_after_an_exception_inside_the_engine(setup, monkeypatch, error, where):
    """An exception (or Ctrl-C) in the worker or in the main thread while the worker drafts."""
    target, prompt, _ = setup
    drafter = FailingDrafter.from_target(target, [0], block_size=4)
    drafter.error = error if where == "worker" else RuntimeError
    if where == "main":
        drafter.calls = -100  # never fails
        real, calls = d3d.async_engine.verify_block, []

        def verify_block(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise error("interrupted")
            return real(*args, **kwargs)
        monkeypatch.setattr(d3d.async_engine, "verify_block", verify_block)
    plan = lambda tokens, drafts, logits, max_k: [(0, 1)] if max_k >= 0 else []  # noqa: E731
    with pytest.raises(error):
        run(async_generate(target, drafter, prompt, greedy(40), AsyncConfig(concurrent=True), plan))
    assert no_workers()


# -- pipeline and CLI -------------------------------------------------------------------------------

def test_pipeline_method_async(setup):
    target, prompt, expected = setup
    pipeline = d3d.generation.Pipeline(tiny_target(target, eos_token_ids=[]),
                                       make_drafter("perturbed", target))
    assert run(pipeline.steps(prompt, greedy(40), "async"))[0] == expected
    pipeline.async_config = AsyncConfig(miss_policy="reanchor", concurrent=False)
    assert run(pipeline.steps(prompt, greedy(40), "async"))[0] == expected
    with pytest.raises(ConfigError, match="needs a drafter"):
        d3d.generation.Pipeline(tiny_target(target), None).steps(prompt, greedy(5), "async")


def test_cli_generate_async_compare_ar(capsys, monkeypatch):
    monkeypatch.setattr(d3d.generation, "load_target", lambda source=None, dtype=None, weights="stored": tiny_target(eos_token_ids=[]))
    code = main(["generate", "hello", "--method", "async", "--compare-ar", "--json", "--drafter", "untrained",
                 "--drafter-layers", "0", "--dtype", "float32", "--max-new-tokens", "24"])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["method"] == "async" and summary["identical_to_ar"] is True
    assert "hit_rate" in summary and "overlap_fraction" in summary
    assert no_workers()


@pytest.mark.parametrize("concurrent", [False, True])
def test_timeline_records_every_verification_and_drafting_job(concurrent, tmp_path):
    """One verify span per verification step, a packed-draft span per job (on the worker lane when
    concurrent), spans well-ordered; the PNG is drawn."""
    from d3d.timeline import plot_timeline

    target = make_decoder(tiny_config(), seed=1)
    drafter = make_drafter("imperfect", target)
    spans = []
    steps = list(async_generate(target, drafter, [3, 4, 5, 6], GenerationConfig(max_new_tokens=20),
                                AsyncConfig(concurrent=concurrent, max_branches=4), timeline=spans))
    verifications = len(steps) - 1  # the first step is the prefill
    assert sum(s.kind == "verify" for s in spans) == verifications
    assert sum(s.kind == "packed draft" for s in spans) >= 1
    assert all(s.end >= s.start for s in spans)
    assert {s.lane for s in spans if s.kind == "packed draft"} == {"drafter" if concurrent else "target"}
    assert plot_timeline(spans, tmp_path / "t.png") and (tmp_path / "t.png").stat().st_size > 0


@pytest.mark.parametrize("concurrent, during", [(True, 1), (False, 2)])
def test_worker_takes_its_threads_from_the_main_thread_and_gives_them_back(setup, concurrent, during):
    """Concurrent on CPU: the main thread verifies with what the worker does not take (2 − 1) while
    the generation runs, and has its 2 threads again once it ends; serial: nothing changes."""
    target, prompt, expected = setup
    drafter = Drafter.from_target(target, [0], block_size=4)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        counts, tokens = [], []
        for step in async_generate(target, drafter, prompt, greedy(20),
                                   AsyncConfig(concurrent=concurrent, drafter_threads=1)):
            counts.append(torch.get_num_threads())
            tokens += step.tokens
        assert tokens == expected[:20]
        assert set(counts[1:]) == {during} and torch.get_num_threads() == 2  # [0]: the prefill, before the worker
    finally:
        torch.set_num_threads(before)


def test_a_miss_is_the_plans_or_the_bonus_guesss(setup):
    """planned_rate counts steps whose k had a branch: a plan of every k with a wrong bonus guess
    (the target's true bonus + 1) misses every step yet plans each k. The reference covers every
    position the plan looks at: greedy(30) has no EOS, so both runs make all 30 tokens."""
    target, prompt, _ = setup
    drafter = make_drafter("perturbed", target)
    expected, _ = run(reference_generate(target, prompt, greedy(30)))

    def every_k_wrong_bonus(tokens, drafts, logits, max_k):
        full = prompt + expected
        return [(k, (full[len(tokens) + k] + 1) % target.config.vocab_size) for k in range(max_k + 1)]

    config = AsyncConfig(concurrent=False, max_branches=16)
    stats = run(async_generate(target, drafter, prompt, greedy(30), config, every_k_wrong_bonus))[1][-1].stats
    assert stats.hit_rate == 0.0 and stats.planned_rate == 1.0
    assert stats.summary()["planned_rate"] == 1.0 and stats.merge(stats).branch_planned_at == [
        2 * n for n in stats.branch_planned_at]
    default = run(async_generate(target, drafter, prompt, greedy(30), AsyncConfig(concurrent=False)))[1][-1].stats
    assert 0.0 <= default.hit_rate <= default.planned_rate <= 1.0
