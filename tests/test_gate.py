"""The speculation gate: how many drafts each source proposes, from its measured acceptance and
the machine's measured costs — none when plain decoding pays better, re-tried every
`explore_every` steps; and the cost measurement itself (`d3d.costs`)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_decoder, tiny_config
from d3d.drafter import Drafter
from d3d.costs import fill_in, forward_costs
from d3d.gate import ByContext, Crowd, SpeculationGate
from d3d.lookup import continuation_chances


def linear(per_draft: float, drafts: int = 15) -> list[float]:
    """A cost model where each verified draft adds `per_draft` one-token steps."""
    return [1 + per_draft * k for k in range(drafts + 1)]


def tries(gate: SpeculationGate, source: str, steps: int = 200) -> list[int]:
    """The steps at which `source`, judged useless (15 drafts, none accepted), is tried again: every
    try fails, and each step commits one token the source has to catch up on until it drafts."""
    gate.record(source, 15, 0)
    tried, pending = [], 0
    for step in range(1, steps):
        pending += 1
        k = gate.num_drafts(source, 15, pending=pending)
        if k:
            tried.append(step)
            pending = 0
        gate.record(source if k else "none", k, 0)
    return tried


def test_an_unknown_source_drafts_what_pays_under_the_prior():
    """Before any observation a source is judged with α = prior at every position; its first verdict
    replaces the prior."""
    costs = linear(0.1)
    gate = SpeculationGate({"lookup": [0.0]}, costs, prior=0.5)
    def rate(k):
        return sum(0.5 ** i for i in range(k + 1)) / costs[k]

    assert gate.num_drafts("lookup", 15) == max(range(1, 16), key=rate) == 2  # 1.75 tokens for 1.2 steps
    assert SpeculationGate({"lookup": [0.0]}, costs, prior=0.9).num_drafts("lookup", 15) == 10
    gate.record("lookup", 3, 3)
    assert gate.acceptance["lookup"] == [1.0, 1.0, 1.0] and gate.num_drafts("lookup", 15) == 15


def test_expected_tokens_from_acceptance():
    """1 + α1 + α1·α2 + …; unreached positions borrow the last α."""
    gate = SpeculationGate({"drafter": [0.1]}, linear(0.1), acceptance={"drafter": [0.5, 0.5]})
    assert gate.expected_tokens("drafter", 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_a_weak_drafter_proposes_only_its_likely_drafts():
    """α = (0.6, 0.1, …), drafting cost 0.1, 0.028 steps per verified draft: two drafts pay best,
    all fifteen pay less."""
    gate = SpeculationGate({"drafter": [0.1]}, linear(0.028), explore_every=100,
                           acceptance={"drafter": [0.6, 0.1]}, last_used={"drafter": 0})
    def rate(k):
        return gate.expected_tokens("drafter", k) / (1 + 0.028 * k + 0.1)

    k = gate.num_drafts("drafter", 15)
    assert k == max(range(1, 16), key=rate) == 2  # 1.66 tokens for cost 1.156
    assert rate(k) > rate(15) and rate(k) > 1.0


def test_a_useless_source_falls_back_to_plain_steps_and_is_explored():
    """Drafts that are never accepted: zero drafts, except a two-draft try after 4 steps, then after
    8, 16, … as tries keep failing."""
    gate = SpeculationGate({"lookup": [0.0]}, linear(0.1), explore_every=4, max_explore_every=16)
    gate.record("lookup", 15, 0)
    tries = []
    for step in range(1, 60):
        k = gate.num_drafts("lookup", 15)
        if k:
            tries.append((step, k))
        gate.record("lookup" if k else "none", k, 0)
    assert tries == [(8, 2), (24, 2), (40, 2), (56, 2)]  # intervals 8, 16, then capped at 16


def test_a_cheap_source_is_tried_again_sooner_than_a_dear_one():
    """Tries back off only as far as their cost allows: a lookup try costing 0.1 step above a plain
    one comes every 10 steps however often it fails (1% of a step per step), a drafter try costing
    0.6 after 16, 32, then every 60 steps."""
    def tries_of(source: str, drafting: float) -> list[int]:
        return tries(SpeculationGate({source: [0.0, drafting, drafting]}, linear(0.05), explore_every=8,
                                     max_explore_every=64), source)

    assert tries_of("lookup", 0.0) == list(range(10, 200, 10))
    dear = tries_of("drafter", 0.5)
    assert [b - a for a, b in zip([0] + dear, dear)] == [16, 32, 60, 60]


def test_a_useless_source_is_not_explored_in_a_batch():
    """In a batched forward a try's rows cost every sequence: the gate that would try a useless source
    alone proposes nothing in a crowd, until the source pays again."""
    gate = SpeculationGate({"lookup": [0.0]}, linear(0.1), explore_every=4, max_explore_every=16)
    gate.record("lookup", 15, 0)
    crowd = Crowd(16, 15.0, tuple([0.0, 1.0] + [1.0 + 0.3 * (n - 1) for n in range(2, 65)]))
    for _ in range(1, 30):
        assert gate.num_drafts("lookup", 15, crowd=crowd) == 0
        gate.record("none", 0, 0)
    assert gate.num_drafts("lookup", 15) == 2  # alone, the try is due


def test_acceptance_averages_follow_recent_steps():
    """After misses α1 falls and drafting stops; after accepted tries it resumes, and a source in
    use keeps the short try interval."""
    gate = SpeculationGate({"lookup": [0.0]}, linear(0.1), explore_every=100, weight=0.5)
    for _ in range(6):
        gate.record("lookup", 15, 0)
    assert gate.num_drafts("lookup", 15) == 0
    for _ in range(3):
        gate.record("lookup", 2, 2)
    assert gate.num_drafts("lookup", 15) > 2
    assert gate.intervals["lookup"] == 100


def test_cheap_short_drafts_make_a_weak_drafter_pay():
    """α = (0.4, 0.2): with a full-block pass per proposal (0.45 steps) no k beats plain steps; with a
    pass over the rows k drafts need (0.1 + 0.02·(k-1)), two drafts do (1.48 tokens for 1.16 steps)."""
    acceptance = {"drafter": [0.4, 0.2]}
    full = SpeculationGate({"drafter": [0.0] + [0.45] * 15}, linear(0.02), explore_every=100,
                           acceptance=dict(acceptance), last_used={"drafter": 0})
    rows = SpeculationGate({"drafter": [0.0] + [0.1 + 0.02 * k for k in range(15)]}, linear(0.02), explore_every=100,
                           acceptance=dict(acceptance), last_used={"drafter": 0})
    assert full.num_drafts("drafter", 15) == 0 and rows.num_drafts("drafter", 15) == 2


def test_the_gate_reads_measured_costs_where_they_bend():
    """Costs that jump past 8 drafts (a second tile of rows): the gate stops where the jump starts."""
    costs = [1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35, 1.4] + [2.2] * 7
    gate = SpeculationGate({"lookup": [0.0]}, costs, explore_every=100,
                           acceptance={"lookup": [0.9] * 15}, last_used={"lookup": 0})
    assert gate.num_drafts("lookup", 15) == 8


def new_process() -> None:
    """Forget what this process measured and probed, as a new process would."""
    import d3d.costs

    d3d.costs._measured.clear()
    d3d.costs._probed.clear()


@torch.no_grad()
def test_forward_costs_are_measured_once_and_stored(tmp_path, monkeypatch):
    """Costs come from timed forwards of these models: a plain step is 1, a verification never costs
    less than a smaller one, a drafter pass costs something; stored on disk, then read back as is."""
    monkeypatch.setenv("D3D_CACHE", str(tmp_path))
    target = make_decoder(tiny_config(), seed=0)
    drafter = Drafter.from_target(target, [0], draft_vocab=torch.arange(8))
    costs = forward_costs(target, drafter, max_drafts=15)
    assert len(costs.verify) == len(costs.drafter) == 16 and costs.verify[0] == 1.0 and costs.drafter[0] == 0.0
    for table in (costs.verify, costs.drafter):
        assert all(a <= b for a, b in zip(table, table[1:]))
    assert costs.drafter[1] > 0 and costs.step_ms > 0
    assert all(round(c, 2) == c for c in costs.verify)
    stored = list((tmp_path / "costs").glob("*.json"))
    assert len(stored) == 1
    import d3d.costs

    new_process()  # read from disk, not measured again
    monkeypatch.setattr(d3d.costs, "measure", lambda *args, **kwargs: pytest.fail("measured twice"))
    monkeypatch.setattr(d3d.costs, "probe_step_ms", lambda target: costs.step_ms)  # as fast as when measured
    assert forward_costs(target, drafter, max_drafts=15) == costs
    other = Drafter.from_target(target, [0, 1], draft_vocab=torch.arange(8))
    monkeypatch.undo()
    monkeypatch.setenv("D3D_CACHE", str(tmp_path))
    forward_costs(target, other, max_drafts=15)  # another drafter shape: measured on its own
    assert len(list((tmp_path / "costs").glob("*.json"))) == 2


@torch.no_grad()
def test_a_measurement_with_progress_shows_a_bar_over_its_rounds(capsys):
    """A real model's first measurement takes ~20 s: `progress` draws a bar over every context's
    rounds on stderr, and measures what the silent measurement measures."""
    import d3d.costs

    target = make_decoder(tiny_config(), seed=0)
    costs = d3d.costs.measure(target, None, 3, progress=True)
    bar = capsys.readouterr().err
    rounds = d3d.costs.ROUNDS + d3d.costs.LONG_ROUNDS * (len(costs.contexts) - 1)
    assert f"gate costs:   0%|          | 0/{rounds} " in bar  # then cleared (tqdm draws at most every 0.1 s)
    assert len(costs.verify) == 4 and costs.contexts == d3d.costs.measure(target, None, 3).contexts
    assert "gate costs" not in capsys.readouterr().err


@torch.no_grad()
@pytest.mark.parametrize("head_dim", [8, 32], ids=["values-as-rows", "split-values"])
def test_a_long_measured_context_repeats_the_prefilled_positions(monkeypatch, head_dim):
    """A cost measurement's long context runs `PREFILLED` tokens through the target and repeats their
    keys and values to its length (what a forward after it costs follows the length): every slot
    past the prefilled ones holds the copy of a prefilled slot, the cache's length is the context,
    and a verification after it runs — values stored as rows, or split where the kernels read them so."""
    import d3d.costs

    monkeypatch.setattr(d3d.costs, "PREFILLED", 24)
    target = make_decoder(tiny_config(head_dim=head_dim), seed=0)
    tokens, cache = d3d.costs._after_context(target, 60, 4, seed=0)
    assert cache.length == 60 and len(tokens) == 64 and cache.split == target.splits_values
    for stored in (cache.keys, cache.values):
        first = stored[..., :24, :]
        assert first.abs().sum() > 0
        for start in (24, 48):
            width = min(24, 60 - start)
            assert torch.equal(stored[..., start:start + width, :], first[..., :width, :])
    d3d.costs._verification(target, cache, tokens[None, 60:63])()
    assert cache.length == 60  # the timed forward keeps nothing


@torch.no_grad()
def test_costs_measured_on_a_busy_machine_are_measured_again(tmp_path, monkeypatch, capsys):
    """Stored costs whose one-token step was over `BUSY` times slower than a probe now were taken while
    other work held the cores: measured again (with a word), stored, and the new ones used. Stored
    costs slower by less, or faster (the machine is busy now, not then), are kept."""
    import d3d.costs

    monkeypatch.setenv("D3D_CACHE", str(tmp_path))
    target = make_decoder(tiny_config(), seed=0)
    first = forward_costs(target, None, max_drafts=3)
    assert 0 < d3d.costs.probe_step_ms(target)
    fresh = d3d.costs.ForwardCosts((1.0, 1.1, 1.2, 1.3), (0.0,) * 4, step_ms=first.step_ms)
    monkeypatch.setattr(d3d.costs, "measure", lambda *args, **kwargs: fresh)
    for probe, expected in ((first.step_ms / 1.4, first), (first.step_ms * 3, first), (first.step_ms / 2, fresh)):
        new_process()
        monkeypatch.setattr(d3d.costs, "probe_step_ms", lambda target: probe)
        assert forward_costs(target, None, max_drafts=3) == expected
    assert "measured while the machine was busy" in capsys.readouterr().err
    new_process()
    monkeypatch.setattr(d3d.costs, "probe_step_ms", lambda target: fresh.step_ms)
    assert forward_costs(target, None, max_drafts=3) == fresh  # stored in place of the busy ones


def test_costs_by_context_interpolate_between_the_measured_contexts():
    costs = ByContext((256, 1024, 4096), ((1.0, 1.2), (1.0, 1.6), (1.0, 2.2)))
    assert costs.at(0) == costs.at(256) == (1.0, 1.2)
    assert costs.at(640) == (1.0, 1.4)
    assert costs.at(2560) == (1.0, 1.9)
    assert costs.at(9000) == (1.0, 2.2)


def test_at_a_long_context_verification_costs_more_and_the_gate_drafts_less():
    """The same acceptance: after 256 tokens 8 drafts pay; after 4K, where each verified draft costs
    four times as much, fewer do."""
    verify = ByContext((256, 4096), (tuple(linear(0.05)), tuple(linear(0.2))))
    gate = SpeculationGate({"drafter": [0.0] * 16}, verify, explore_every=100,
                           acceptance={"drafter": [0.8] * 15}, last_used={"drafter": 0})
    short, long = gate.num_drafts("drafter", 15, context=256), gate.num_drafts("drafter", 15, context=4096)
    assert 0 < long < short
    assert gate.num_drafts("drafter", 15, context=4096) == gate.best_drafts("drafter", 15, 4096)


def test_catching_up_on_a_long_prompt_is_charged_and_not_explored():
    """A drafter that has yet to read 4,000 prompt tokens at 0.01 steps each (40 steps) is neither
    chosen nor tried for exploration; with the prompt read it drafts again."""
    gate = SpeculationGate({"drafter": [0.0] * 16}, linear(0.05), catch_up={"drafter": [0.01]}, explore_every=1,
                           acceptance={"drafter": [0.9] * 15}, last_used={"drafter": 0}, step=5)
    assert gate.num_drafts("drafter", 15, context=4000, pending=4000) == 0
    assert gate.num_drafts("drafter", 15, context=4000, pending=0) > 2
    gate.acceptance["drafter"] = [0.05] * 15  # does not pay: only exploration would try it
    assert gate.num_drafts("drafter", 15, context=4000, pending=4000) == 0


def test_a_try_waits_until_the_exploration_budget_covers_its_catching_up():
    """A try's catching up is part of its cost: with 1% of a step per step to explore, a drafter whose
    catching up costs 0.001 steps a token is tried every 10 steps (a try costs 0.1 step more than a
    plain one), its 10 tokens to read included; one at 0.04 steps a token (AMD EPYC Zen 3's 4-layer
    drafter) never is, however long it waits, as the tokens to read grow with the wait; lookup, which
    reads nothing, keeps its tries."""
    def tries_of(source: str, per_token: float) -> list[int]:
        return tries(SpeculationGate({source: [0.0, 0.0, 0.0]}, linear(0.05), catch_up={source: [per_token]},
                                     explore_every=8, max_explore_every=64), source)

    assert tries_of("drafter", 0.001)[:2] == [10, 20]
    assert tries_of("drafter", 0.04) == []
    assert tries_of("lookup", 0.0)[:2] == [10, 20]


def test_a_source_not_yet_judged_may_catch_up_on_the_prompt_for_its_first_try():
    """Before its first verdict a source's try may read up to `max_catch_up` steps of context (its
    verdict decides whether it drafts at all): 300 tokens at 0.01 steps each are read, 500 are not."""
    def first_try(pending: int) -> int:
        gate = SpeculationGate({"drafter": [0.0, 2.0, 2.0]}, linear(0.05), catch_up={"drafter": [0.01]},
                               explore_every=8, step=8)
        assert gate.best_drafts("drafter", 15, context=pending, pending=pending) == 0  # the prior does not pay
        return gate.num_drafts("drafter", 15, context=pending, pending=pending)

    assert first_try(300) == 2
    assert first_try(500) == 0


def test_fill_in_interpolates_the_draft_counts_not_timed():
    assert fill_in((1.0, 1.1, 1.5), [0, 1, 5], 5) == (1.0, 1.1, 1.2, 1.3, 1.4, 1.5)


@torch.no_grad()
def test_costs_are_measured_after_each_context_and_read_by_it(tmp_path, monkeypatch):
    """After each of `CONTEXTS` tokens: verification and drafter rows for every k (the longer contexts
    timing a subset), the first context's rows as `verify` and `drafter`, and the drafter's cost of
    catching up per token; the gate's tables read them back."""
    import d3d.costs

    monkeypatch.setenv("D3D_CACHE", str(tmp_path))
    monkeypatch.setattr(d3d.costs, "CONTEXTS", (16, 64))
    target = make_decoder(tiny_config(), seed=0)
    drafter = Drafter.from_target(target, [0], draft_vocab=torch.arange(8))
    costs = forward_costs(target, drafter, max_drafts=15)
    assert costs.contexts == (16, 64)
    assert [len(row) for row in costs.verify_by_context + costs.drafter_by_context] == [16] * 4
    assert costs.verify_by_context[0] == costs.verify and costs.drafter_by_context[0] == costs.drafter
    assert all(per_token > 0 for per_token in costs.catch_up)
    assert costs.by_context("verify").at(64) == costs.verify_by_context[1]
    assert costs.by_context("catch_up").at(16) == (costs.catch_up[0],)
    new_process()
    # as fast as when measured: a tiny model's step timed on a shared machine can look BUSY times slower
    monkeypatch.setattr(d3d.costs, "probe_step_ms", lambda target: costs.step_ms)
    assert forward_costs(target, drafter, max_drafts=15) == costs  # stored with its contexts


@torch.no_grad()
def test_a_drafting_sources_costs_time_no_verification_but_the_step(tmp_path, monkeypatch):
    """What drafting sources read (`drafter_only`): the drafter's passes and catching up, each in the
    one-token step of its round, stored apart from the full measurement — and of the verifications
    only those one-token steps are timed (the gate's verify tables are the target's alone)."""
    import d3d.costs

    monkeypatch.setenv("D3D_CACHE", str(tmp_path))
    monkeypatch.setattr(d3d.costs, "CONTEXTS", (16, 64))
    target = make_decoder(tiny_config(), seed=0)
    drafter = Drafter.from_target(target, [0], draft_vocab=torch.arange(8))
    verified, verification = [], d3d.costs._verification
    monkeypatch.setattr(d3d.costs, "_verification", lambda t, cache, block: verified.append(block.shape[1])
                        or verification(t, cache, block))
    costs = forward_costs(target, drafter, max_drafts=7, drafter_only=True)
    assert set(verified) == {1} and len(verified) == d3d.costs.ROUNDS + d3d.costs.LONG_ROUNDS
    assert costs.verify == () and costs.verify_by_context == ((), ())
    assert len(costs.drafter) == 8 and costs.drafter[0] == 0.0 and costs.drafter[1] > 0 and costs.step_ms > 0
    assert len(costs.catch_up) == 2 and costs.by_context("drafter").at(16) == costs.drafter
    verified.clear()
    full = forward_costs(target, drafter, max_drafts=7)  # the full measurement: its own file, every row count
    assert sorted(set(verified)) == list(range(1, 9)) and len(full.verify) == 8
    assert len(list((tmp_path / "costs").glob("*.json"))) == 2


# -- in a batched forward --------------------------------------------------------------------------

def crowd_gate() -> SpeculationGate:
    gate = SpeculationGate({"drafter": [0.0] * 8}, [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7])
    gate.acceptance["drafter"] = [0.8, 0.7, 0.6, 0.5]
    return gate


def test_a_crowd_of_one_decides_as_alone():
    """A forward holding only this run, priced by a table equal to the solo verification costs,
    gives the solo decision; so does no crowd at all."""
    gate = crowd_gate()
    alone = gate.best_drafts("drafter", 7)
    assert alone > 0
    assert gate.best_drafts("drafter", 7, crowd=Crowd(1, 0.0, (0.0, *gate.verify_costs))) == alone


def test_a_compute_bound_batch_stops_drafting_and_a_memory_bound_one_does_not():
    gate = crowd_gate()
    linear = tuple(float(n) for n in range(65))  # every row costs a step: 16 sequences are compute-bound
    assert gate.best_drafts("drafter", 7, crowd=Crowd(16, 15.0, linear)) == 0
    flat = (0.0,) + (1.0,) * 64  # rows are free: draft as far as pays alone, and further
    assert gate.best_drafts("drafter", 7, crowd=Crowd(16, 15.0, flat)) >= gate.best_drafts("drafter", 7)
    # measured-like: 16 sequences 5.5 steps, each more row ~0.3 steps
    measured = Crowd(16, 15.0, tuple([0.0, 1.0] + [1.0 + 0.3 * (n - 1) for n in range(2, 65)]))
    assert gate.best_drafts("drafter", 7, crowd=measured) < gate.best_drafts("drafter", 7)
    assert Crowd(40, 0.0, (0.0, 1.0, 1.5, 2.0)).cost(40) == pytest.approx(1.0 + 39 * 0.5)
    flat_ahead = Crowd(16, 15.0, flat, waited_on=False)  # a run the batch does not wait on: never drafts
    assert gate.best_drafts("drafter", 7, crowd=flat_ahead) == gate.num_drafts("drafter", 7, crowd=flat_ahead) == 0


# -- a source that tells its chances (context lookup, by its match's length) ---------------------

def test_a_long_match_drafts_far_at_once_and_a_short_one_cautiously():
    """With the chances a source gives, the gate weighs them, not the source's running averages:
    after a verdict of 15 drafts all missed, each match drafts the k whose expected tokens per cost
    are best under its chances — at 0.2 steps a draft, a 40-token match 14, a 2-token match 2, or 3
    where its n-gram always went on alike before and 1 where it went on differently; a source with
    nothing to propose ([]) is not even tried."""
    costs = ByContext((256,), (tuple(linear(0.2)),))
    gate = SpeculationGate({"lookup": [0.0]}, costs)
    gate.record("lookup", 15, 0)  # the averages alone: lookup does not pay now
    assert gate.num_drafts("lookup", 15, 256) == 0

    def best(length: int, precedent: str) -> int:
        def rate(k: int) -> float:
            reach, tokens = 1.0, 1.0
            for alpha in continuation_chances(length, 15, precedent)[:k]:
                reach *= alpha
                tokens += reach
            return tokens / linear(0.2)[k]
        return max(range(1, 16), key=rate)

    for length, precedent, drafts in ((40, "any", 14), (2, "any", 2), (2, "agreed", 3), (2, "split", 1)):
        chances = continuation_chances(length, 15, precedent)
        assert gate.num_drafts("lookup", 15, 256, chances=chances) == best(length, precedent) == drafts
    for step in range(100):  # however long since it last drafted: [] is no try
        assert gate.num_drafts("lookup", 15, 256, chances=[]) == 0
        gate.record("none", 0, 0)


def test_chances_that_keep_missing_are_scaled_down():
    """Drafts judged likely that miss (sampled text, say) raise the source's miss scale, and it
    drafts less for the same match; drafts that hit bring it back."""
    costs = linear(0.12)
    gate = SpeculationGate({"lookup": [0.0]}, costs)
    chances = continuation_chances(12, 15)
    assert gate.miss_scale("lookup") == 1.0
    far = gate.num_drafts("lookup", 15, chances=chances)
    for _ in range(6):
        gate.record("lookup", 4, 0, chances=chances)
    assert gate.miss_scale("lookup") > 3 and gate.num_drafts("lookup", 15, chances=chances) < far
    for _ in range(30):
        gate.record("lookup", 4, 4, chances=chances)
    assert gate.miss_scale("lookup") < 1 and gate.num_drafts("lookup", 15, chances=chances) >= far
