"""When and how far to speculate: a per-request gate over drafting sources.

Proposing k drafts from source s costs one verification of k+1 tokens plus the source's own
drafting cost, and commits 1 + Σ_{i≤k} Π_{j≤i} α_j tokens in expectation,
where α_j is the chance that draft j is accepted once drafts 1..j-1 were. A plain step commits 1
token for cost 1. The gate keeps moving averages of α_j per source, measured on this request, and
each step proposes the k that maximises tokens ÷ cost — or nothing, when no k beats plain
decoding. A weak drafter then drafts only its first, likely tokens, and lookup drafts that keep
missing fall back to plain decoding instead of slowing the request. A source that does not pay
is tried again with a couple of drafts after `explore_every` steps, then after twice as many each
time the try fails, so the averages follow the text without a full block's cost (~3 steps) per try.
A source not yet seen on the request proposes what pays under a `prior` α at every position, and
its first verdict replaces the prior. (It used to propose a full block, to see every position at
once: at T = 1, where drafts are rarely accepted, those first blocks cost a request 2–3 steps each,
and lookup's 10–15-draft first tries about as much again — most of the default's loss against
plain decoding on the project's CPU.)

Costs are measured on the running machine (`d3d.costs`): verifying k drafts costs verify[k]
one-token steps, drafting them from the drafter its pass over the rows they need; both stored once per machine, so the
gate's choices — and so the random draws at T > 0 — are a function of the tokens alone: the same
seed gives the same output. Output is lossless either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class SpeculationGate:
    draft_costs: dict[str, Sequence[float]]  # per source ("lookup", "drafter"): [k] = drafting k, in one-token steps
    verify_costs: Sequence[float]  # [k]: verifying k drafts, in one-token steps ([0] = 1: a plain step)
    explore_every: int = 8  # steps before a source that does not pay is tried again …
    max_explore_every: int = 64  # … an interval that doubles after every try that still does not pay
    explore_drafts: int = 2  # drafts a try proposes: enough to see the source recover, for ~1.2 steps
    weight: float = 0.25  # moving-average weight of the newest observation
    prior: float = 0.5  # α at every position of a source not yet seen on this request
    acceptance: dict[str, list[float]] = field(default_factory=dict)  # per source: α_1, α_2, …
    last_used: dict[str, int] = field(default_factory=dict)  # step index each source last drafted
    intervals: dict[str, int] = field(default_factory=dict)  # per source: steps between tries
    step: int = 0

    def expected_tokens(self, source: str, num_drafts: int) -> float:
        """1 + expected accepted drafts; positions never reached borrow the last known α (the prior
        before any)."""
        alphas = self.acceptance.get(source) or [self.prior]
        total, reach = 1.0, 1.0
        for i in range(num_drafts):
            reach *= alphas[min(i, len(alphas) - 1)]
            total += reach
        return total

    def best_drafts(self, source: str, max_drafts: int) -> int:
        """The k ≤ max_drafts that maximises expected tokens ÷ cost; 0 when a plain step pays better."""
        best, best_rate = 0, 1.0  # plain decoding: one token per unit cost
        for k in range(1, max_drafts + 1):
            drafting = self.draft_costs[source]
            cost = self.verify_costs[min(k, len(self.verify_costs) - 1)] + drafting[min(k, len(drafting) - 1)]
            rate = self.expected_tokens(source, k) / cost
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def num_drafts(self, source: str, max_drafts: int) -> int:
        """How many drafts to propose from `source` now (0: a plain step pays better)."""
        best = self.best_drafts(source, max_drafts)
        if best:
            return best
        interval = self.intervals.get(source, self.explore_every)
        due = self.step - self.last_used.get(source, -interval) >= interval
        return min(self.explore_drafts, max_drafts) if due else 0

    def record(self, source: str, num_drafted: int, num_accepted: int) -> None:
        """After a verification: drafts 1..num_accepted were accepted, the next one (if any) rejected."""
        if source in self.draft_costs and num_drafted:
            alphas = self.acceptance.setdefault(source, [])
            for i in range(min(num_drafted, num_accepted + 1)):
                accepted = 1.0 if i < num_accepted else 0.0
                if i < len(alphas):
                    alphas[i] = (1 - self.weight) * alphas[i] + self.weight * accepted
                else:
                    alphas.append(accepted if i == 0 else 0.5 * (alphas[i - 1] + accepted))
            self.last_used[source] = self.step
            # a source that pays is tried again soon once it stops; one that keeps failing, less often
            pays = self.best_drafts(source, len(self.verify_costs) - 1) > 0
            interval = self.intervals.get(source, self.explore_every)
            self.intervals[source] = self.explore_every if pays else min(2 * interval, self.max_explore_every)
        self.step += 1
