"""When and how far to speculate: a per-request gate over drafting sources.

Proposing k drafts from source s costs one verification of k+1 tokens plus the source's own
drafting cost, and commits 1 + Σ_{i≤k} Π_{j≤i} α_j tokens in expectation,
where α_j is the chance that draft j is accepted once drafts 1..j-1 were. A plain step commits 1
token for cost 1. The gate keeps moving averages of α_j per source, measured on this request, and
each step proposes the k that maximises tokens ÷ cost — or nothing, when no k beats plain
decoding. A weak drafter then drafts only its first, likely tokens, and lookup drafts that keep
missing fall back to plain decoding instead of slowing the request. A source that does not pay
is tried again with a couple of drafts after `explore_every` steps, then after twice as many each
time the try fails — up to as many as the try's cost allows (`explore_budget`: a cheap lookup try
keeps coming every ~10 steps, so a repetition that starts is soon copied) — so the averages follow
the text without a full block's cost (~3 steps) per try.
A source not yet seen on the request proposes what pays under a `prior` α at every position, and
its first verdict replaces the prior. (It used to propose a full block, to see every position at
once: at T = 1, where drafts are rarely accepted, those first blocks cost a request 2–3 steps each,
and lookup's 10–15-draft first tries about as much again — most of the default's loss against
plain decoding on the project's CPU.)

Costs are measured on the running machine (`d3d.costs`): verifying k drafts costs verify[k]
one-token steps, drafting them from the drafter its pass over the rows they need; both stored once per machine, so the
gate's choices — and so the random draws at T > 0 — are a function of the tokens alone: the same
seed gives the same output. Output is lossless either way.

Costs can be measured after several context lengths (`ByContext`): at 4K tokens a verification
of 8 drafts costs ~2.1 one-token steps against ~1.3 at 256 (docs/performance.md), so the gate reads
them at the request's current length. A source that must first catch up on the context (the D3D
drafter's first pass over a long prompt) is charged that too (`catch_up`, per pending token), and a
try counts its catching up in its cost: a source not yet judged on the request is not tried when
catching up costs more than `max_catch_up` steps; one that drafted and stopped paying is tried only
when the exploration budget of the steps since covers its catching up (a drafter that reads ~1 new
token per step at more than `explore_budget` steps per token is then not tried again).

A source that can tell how good its next drafts are (`chances`: context lookup, from the length of
its match, `d3d.lookup`) is weighed by that instead of its running averages: a 40-token match is
drafted far at once, a bare 2-gram cautiously, whatever the last verdicts were. Its chances are
calibrated on the request — each chance of a miss scaled by the misses it saw over the misses its
chances predicted (moving averages) —, so where they are too hopeful (sampling at T > 0, text that
rarely repeats) it drafts less. Simulated over the AR outputs of the benchmark's 48 prompts with the
verification costs measured on an AMD EPYC Zen 3, lookup then commits 1.59 tokens per one-token
step of cost against 1.55 (a perfect judge of each step: 1.76); after four ~4.2K-token prompts 1.92
against 1.62 (perfect: 2.30) — the averages had stopped drafting where long copies of the prompt began
(`scripts/lookup_policy.py`).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ByContext:
    """Costs [k] measured after each of `contexts` tokens (ascending), read at any context length:
    linearly interpolated between the measured ones (rounded to 4 decimals), the nearest beyond them."""

    contexts: tuple[int, ...]
    rows: tuple[tuple[float, ...], ...]  # rows[i][k]: the cost of k after contexts[i] tokens

    def at(self, context: int) -> tuple[float, ...]:
        i = bisect_right(self.contexts, context)
        if i == 0:
            return self.rows[0]
        if i == len(self.contexts):
            return self.rows[-1]
        low, high = self.contexts[i - 1], self.contexts[i]
        share = (context - low) / (high - low)
        return tuple(round(a + share * (b - a), 4) for a, b in zip(self.rows[i - 1], self.rows[i]))


Costs = Sequence[float] | ByContext


def costs_at(costs: Costs, context: int) -> Sequence[float]:
    return costs.at(context) if isinstance(costs, ByContext) else costs


@dataclass(frozen=True)
class Crowd:
    """The rest of a batched forward as one run's gate sees it (`d3d.batch`): the forward holds
    `rows` rows without this run's drafts (its anchor included), the other runs are expected to
    commit `tokens`, and `rows_cost[n]` is a forward of n one-row sequences in one-token steps
    (measured, `d3d.costs.batch_costs`; linear past its end). A draft then pays when it raises the
    whole forward's tokens per step, not this run's alone: where the batch is already
    compute-bound, drafting stops."""

    rows: int
    tokens: float
    rows_cost: tuple[float, ...]  # [0] unused
    # Whether this run's accepted drafts can make the batch go faster: True while generations wait
    # to join (a finished run's place is taken at once, so its tokens are the batch's throughput) or
    # when no other run has more tokens left (the batch lasts as long as it does). False for a run
    # ahead of another with nothing waiting: its drafts would only shorten a run the batch does not
    # wait on, so it does not draft (AMD EPYC Zen 4, 16 generations started together: the default
    # 0.93x plain decoding before, drafting rows that saved 3 of 145 forwards; 1.01-1.03x after).
    waited_on: bool = True

    def cost(self, rows: int) -> float:
        table = self.rows_cost
        if rows < len(table):
            return table[rows]
        last = len(table) - 1
        return table[last] + (rows - last) * (table[last] - table[last - 1])


@dataclass
class SpeculationGate:
    draft_costs: dict[str, Costs]  # per source ("lookup", "drafter"): [k] = drafting k, in one-token steps
    verify_costs: Costs  # [k]: verifying k drafts, in one-token steps ([0] = 1: a plain step)
    catch_up: dict[str, Costs] = field(default_factory=dict)  # per source: [0] = steps per token it must catch up on
    max_catch_up: float = 4.0  # steps of catching up beyond which a source not yet judged is not tried
    explore_every: int = 8  # steps before a source that does not pay is tried again …
    max_explore_every: int = 64  # … an interval that doubles after every try that still does not pay,
    # up to this, or sooner where a try is cheap: tries may cost up to `explore_budget` one-token
    # steps per step (a lookup try at 4K tokens costs ~0.1 step: every ~10 steps, so a repetition
    # that starts is copied within a few steps, not after up to 64 plain ones — Intel Xeon, long4k:
    # the default had decoded at 0.91x ungated lookup; a drafter try, ~0.4 steps, still backs off to 40-64)
    explore_budget: float = 0.01
    explore_drafts: int = 2  # drafts a try proposes: enough to see the source recover, for ~1.2 steps
    weight: float = 0.25  # moving-average weight of the newest observation
    prior: float = 0.5  # α at every position of a source not yet seen on this request
    # per source: α at positions it has not reached yet on this request, where higher than its last
    # known α (see expected_tokens); other sources borrow their last known α
    unseen: dict[str, float] = field(default_factory=lambda: {"lookup": 0.9})
    acceptance: dict[str, list[float]] = field(default_factory=dict)  # per source: α_1, α_2, …
    # per source with chances: moving averages of the misses seen and of those its chances predicted
    calibration: dict[str, tuple[float, float]] = field(default_factory=dict)
    last_used: dict[str, int] = field(default_factory=dict)  # step index each source last drafted
    intervals: dict[str, int] = field(default_factory=dict)  # per source: steps between tries
    step: int = 0

    def expected_tokens(self, source: str, num_drafts: int) -> float:
        """1 + expected accepted drafts. Before any verdict every position has the prior; after,
        positions never reached borrow the last known α — or, for context lookup, at least
        `unseen`: a lookup match that holds is copying, so its later drafts are accepted far more
        often than its first (α ≈ 0.4 at the first, ≈ 0.9 at each later one on long prompts), and
        borrowing the first's α kept the gate proposing one or two drafts, never learning better
        (a long prompt decoded at half of ungated lookup's speed)."""
        return self.expected_curve(source, num_drafts)[num_drafts]

    def expected_curve(self, source: str, max_drafts: int, chances: Sequence[float] | None = None) -> list[float]:
        """[k]: `expected_tokens(source, k)` for every k ≤ max_drafts, in one pass (the gate asks
        for all of them every step of every generation); from the source's `chances`, calibrated,
        where it gives them (positions past their end borrow the last)."""
        alphas = self.acceptance.get(source)
        scale = self.miss_scale(source) if chances else 1.0
        curve, reach = [1.0], 1.0
        for i in range(max_drafts):
            if chances:
                alpha = 1.0 - min(1.0, scale * (1.0 - chances[min(i, len(chances) - 1)]))
            elif not alphas:
                alpha = self.prior
            elif i < len(alphas):
                alpha = alphas[i]
            else:
                alpha = max(alphas[-1], self.unseen.get(source, 0.0))
            reach *= alpha
            curve.append(curve[-1] + reach)
        return curve

    def miss_scale(self, source: str) -> float:
        """How many times more often `source`'s drafts missed on this request than its chances said
        (moving averages, both starting at half a miss: 1 until it has drafted)."""
        seen, predicted = self.calibration.get(source, (0.5, 0.5))
        return (seen + 0.1) / (predicted + 0.1)

    def best_drafts(self, source: str, max_drafts: int, context: int = 0, pending: int = 0,
                    crowd: Crowd | None = None, chances: Sequence[float] | None = None) -> int:
        """The k ≤ max_drafts that maximises expected tokens ÷ cost after `context` tokens, the
        source first catching up on `pending` of them; 0 when a plain step pays better. In a
        `crowd`, tokens and cost are the whole batched forward's."""
        if crowd is not None and not crowd.waited_on:
            return 0
        verify, drafting = costs_at(self.verify_costs, context), costs_at(self.draft_costs[source], context)
        catching_up = self.catch_up_steps(source, context, pending)
        others = crowd.tokens if crowd is not None else 0.0
        best, best_rate = 0, (1.0 + others) / (crowd.cost(crowd.rows) if crowd is not None else 1.0)
        expected = self.expected_curve(source, max_drafts, chances)
        for k in range(1, max_drafts + 1):
            forward = crowd.cost(crowd.rows + k) if crowd is not None else verify[min(k, len(verify) - 1)]
            cost = forward + drafting[min(k, len(drafting) - 1)] + catching_up
            rate = (expected[k] + others) / cost
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def catch_up_steps(self, source: str, context: int, pending: int) -> float:
        """What catching up on `pending` tokens of context costs `source`, in one-token steps."""
        if not pending or source not in self.catch_up:
            return 0.0
        return pending * costs_at(self.catch_up[source], context)[0]

    def num_drafts(self, source: str, max_drafts: int, context: int = 0, pending: int = 0,
                   crowd: Crowd | None = None, chances: Sequence[float] | None = None) -> int:
        """How many drafts to propose from `source` now, after `context` tokens of which the source
        has yet to read `pending` (0: a plain step pays better), in a batched forward's `crowd` if any,
        weighing its `chances` where it gives them ([]: it has nothing to propose, 0).
        A source that does not pay is tried now and then alone, never in a crowd (AMD EPYC Zen 4, 16
        generations decoded together: the default's drafter tries took 36 of its 1,276 steps, and
        without them it ran 0.96-0.97x plain decoding instead of 0.92x)."""
        if chances is not None and not chances:
            return 0
        best = self.best_drafts(source, max_drafts, context, pending, crowd, chances)
        if best:
            return best
        if crowd is not None:  # a try's rows would cost the whole batch: explore alone only
            return 0
        interval = self.intervals.get(source, self.explore_every)
        since = self.step - self.last_used.get(source, -interval)
        if since < interval:
            return 0
        # A try's catching up is part of its cost. A source judged on this request that stopped paying
        # is tried once the exploration budget of the steps since it last drafted covers it (AMD EPYC
        # Zen 3, T = 1: the 4-layer drafter's tries after 8-64 plain steps each caught up for ~1.6 steps,
        # 4% of all decoding time; with this rule the default went from 0.92x to 1.10x plain decoding
        # at T = 1 and from 1.15x to 1.18x at T = 0, 18 prompts interleaved); a source not yet judged
        # may read up to `max_catch_up` steps of the context first: its first verdict decides whether
        # it drafts at all.
        limit = self.explore_budget * since if source in self.acceptance else self.max_catch_up
        if self.catch_up_steps(source, context, pending) > limit:
            return 0
        return min(self.explore_drafts, max_drafts)

    def record(self, source: str, num_drafted: int, num_accepted: int, context: int = 0,
               chances: Sequence[float] | None = None) -> None:
        """After a verification after `context` tokens: drafts 1..num_accepted were accepted, the
        next one (if any) rejected; `chances`: what the source said of them, if it did."""
        if source in self.draft_costs and num_drafted:
            judged = min(num_drafted, num_accepted + 1)  # the drafts verification looked at
            if chances:
                seen, predicted = self.calibration.get(source, (0.5, 0.5))
                missed = 1.0 if num_accepted < num_drafted else 0.0
                expected = sum(1.0 - chances[min(i, len(chances) - 1)] for i in range(judged))
                self.calibration[source] = ((1 - self.weight) * seen + self.weight * missed,
                                            (1 - self.weight) * predicted + self.weight * expected)
            alphas = self.acceptance.setdefault(source, [])
            for i in range(judged):
                accepted = 1.0 if i < num_accepted else 0.0
                if i < len(alphas):
                    alphas[i] = (1 - self.weight) * alphas[i] + self.weight * accepted
                else:
                    alphas.append(accepted if i == 0 else 0.5 * (alphas[i - 1] + accepted))
            self.last_used[source] = self.step
            # a source that pays is tried again soon once it stops; one that keeps failing, less often
            pays = self.best_drafts(source, len(costs_at(self.verify_costs, context)) - 1, context, chances=chances) > 0
            interval = self.intervals.get(source, self.explore_every)
            self.intervals[source] = self.explore_every if pays else min(2 * interval, self.longest_interval(source, context))
        self.step += 1

    def longest_interval(self, source: str, context: int = 0) -> int:
        """The most steps between tries of `source`: `max_explore_every`, or fewer where its tries'
        cost over a plain step, spread over the interval, stays within `explore_budget` steps a step."""
        verify, drafting = costs_at(self.verify_costs, context), costs_at(self.draft_costs[source], context)
        k = self.explore_drafts
        extra = verify[min(k, len(verify) - 1)] + drafting[min(k, len(drafting) - 1)] - 1.0
        return max(self.explore_every, min(self.max_explore_every, math.ceil(round(extra / self.explore_budget, 6))))
