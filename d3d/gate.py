"""When speculation pays: a per-request gate over drafting sources.

Speculating with source s commits (accepted + 1) tokens for the cost of a verification (plus the
drafter's pass for the diffusion drafter); a plain step commits 1 token for the cost of one
decoding step. The gate keeps a moving average of what each source committed on this request
and drafts from it only while tokens ÷ cost beats plain decoding — so a weak drafter, or lookup
drafts that keep missing, fall back to plain decoding instead of slowing the request down. An
option not chosen is re-tried every `explore_every` steps so the averages follow the text.

Costs are a fixed model, not clock readings: at batch 1 on CPU a forward is bound by the bytes of
weights it reads, and a 16-token verification measured 1.42× a one-token step here (bf16,
SmolLM2-135M). Fixed costs keep the gate's choices — and so the random draws at T > 0 — a function
of the tokens alone: the same seed gives the same output. Output is lossless either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

VERIFY_COST_PER_DRAFT = 0.028  # extra cost of each verified draft, in one-token steps (1.42 at 15 drafts)


def weight_bytes(modules: list[nn.Module]) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def drafter_cost(target, drafter) -> float:
    """The drafter's block pass in one-token target steps, by weight bytes read (both read their head)."""
    target_bytes = weight_bytes([target.layers, target.norm]) + target.embed_tokens.weight.nbytes
    head = drafter.draft_head.nbytes if drafter.config.draft_vocab_size else target.embed_tokens.weight.nbytes
    return (weight_bytes([drafter.decoder.layers, drafter.decoder.norm]) + head) / target_bytes


@dataclass
class SpeculationGate:
    costs: dict[str, float]  # step cost of each option ("none", "lookup", "drafter") in one-token steps
    explore_every: int = 8  # steps after which an option not chosen is tried once more
    weight: float = 0.25  # moving-average weight of the newest step
    tokens: dict[str, float] = field(default_factory=dict)  # average tokens committed per step, by option
    last_used: dict[str, int] = field(default_factory=dict)  # step index each option last ran
    step: int = 0

    def rate(self, option: str) -> float | None:
        return None if option not in self.tokens else self.tokens[option] / self.costs[option]

    def allows(self, source: str) -> bool:
        """Whether to draft from `source` ("lookup" or "drafter") at this step."""
        if self.step - self.last_used.get(source, -self.explore_every) >= self.explore_every:
            return True  # explore: its average may be stale
        rate = self.rate(source)
        return rate is None or rate >= 1.0 / self.costs["none"]

    def record(self, option: str, committed: int) -> None:
        previous = self.tokens.get(option)
        self.tokens[option] = committed if previous is None else (1 - self.weight) * previous + self.weight * committed
        self.last_used[option] = self.step
        self.step += 1
