"""When and how far to speculate: a per-request gate over drafting sources.

Proposing k drafts from source s costs one verification of k+1 tokens (1 + c·k one-token steps)
plus the source's own drafting cost, and commits 1 + Σ_{i≤k} Π_{j≤i} α_j tokens in expectation,
where α_j is the chance that draft j is accepted once drafts 1..j-1 were. A plain step commits 1
token for cost 1. The gate keeps moving averages of α_j per source, measured on this request, and
each step proposes the k that maximises tokens ÷ cost — or nothing, when no k beats plain
decoding. A weak drafter then drafts only its first, likely tokens, and lookup drafts that keep
missing fall back to plain decoding instead of slowing the request. Every `explore_every` steps a
source drafts in full again so the averages follow the text.

Costs are a fixed model, not clock readings: at batch 1 on CPU a one-token forward is bound by
the bytes of weights it reads and each extra row adds arithmetic; with the row-exact kernels a
verification of k drafts measured about 1 + 0.075·k one-token steps (bf16, SmolLM2-135M, AMD
EPYC Zen 4, 2 threads: 1 row 14.2 ms, 4 rows 16.8, 8 rows 21.9, 17 rows 31.6; see
docs/performance.md). Fixed costs keep the gate's choices — and so the random draws at T > 0 —
a function of the tokens alone: the same seed gives the same output. Output is lossless either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

VERIFY_COST_PER_DRAFT = 0.075  # extra cost of each verified draft, in one-token steps


def weight_bytes(modules: list[nn.Module]) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def drafter_cost(target, drafter) -> float:
    """The drafter's block pass in one-token target steps: its share of the weight bytes (both read
    their head), times what a B-token forward costs over a one-token one."""
    target_bytes = weight_bytes([target.layers, target.norm]) + target.embed_tokens.weight.nbytes
    head = drafter.draft_head.nbytes if drafter.config.draft_vocab_size else target.embed_tokens.weight.nbytes
    share = (weight_bytes([drafter.decoder.layers, drafter.decoder.norm]) + head) / target_bytes
    return share * (1.0 + VERIFY_COST_PER_DRAFT * (drafter.block_size - 1))


@dataclass
class SpeculationGate:
    draft_costs: dict[str, float]  # drafting cost of each source ("lookup", "drafter") in one-token steps
    verify_cost_per_draft: float = VERIFY_COST_PER_DRAFT
    explore_every: int = 8  # steps after which a source drafts in full once more
    weight: float = 0.25  # moving-average weight of the newest observation
    acceptance: dict[str, list[float]] = field(default_factory=dict)  # per source: α_1, α_2, …
    last_used: dict[str, int] = field(default_factory=dict)  # step index each source last drafted
    step: int = 0

    def expected_tokens(self, source: str, num_drafts: int) -> float:
        """1 + expected accepted drafts; positions never reached borrow the last known α."""
        alphas = self.acceptance[source]
        total, reach = 1.0, 1.0
        for i in range(num_drafts):
            reach *= alphas[min(i, len(alphas) - 1)]
            total += reach
        return total

    def num_drafts(self, source: str, max_drafts: int) -> int:
        """How many drafts to propose from `source` now (0: a plain step pays better)."""
        due = self.step - self.last_used.get(source, -self.explore_every) >= self.explore_every
        if due or not self.acceptance.get(source):
            return max_drafts
        best, best_rate = 0, 1.0  # plain decoding: one token per unit cost
        for k in range(1, max_drafts + 1):
            cost = 1.0 + self.verify_cost_per_draft * k + self.draft_costs[source]
            rate = self.expected_tokens(source, k) / cost
            if rate > best_rate:
                best, best_rate = k, rate
        return best

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
        self.step += 1
