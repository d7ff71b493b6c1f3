"""When speculation pays: a per-request gate over drafting sources, from measured costs.

Speculating with source s commits (accepted + 1) tokens per (verify + draft) seconds; a plain
step commits 1 token per plain-step seconds. The gate keeps recent averages of both (exponential
moving averages, measured on this request) and drafts from a source only while its expected rate
beats plain decoding — so a weak drafter, or lookup drafts that keep missing, fall back to plain
decoding instead of slowing the request down. An unused option is re-tried every `explore_every`
steps so the estimates follow the text. Output is unaffected: the target verifies every token.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Average:
    value: float | None = None

    def update(self, sample: float, weight: float) -> None:
        self.value = sample if self.value is None else (1 - weight) * self.value + weight * sample


@dataclass
class SpeculationGate:
    explore_every: int = 8  # steps after which an option not chosen is tried once more
    weight: float = 0.25  # EMA weight of the newest sample
    tokens: dict[str, Average] = field(default_factory=dict)  # committed tokens per step, by option
    seconds: dict[str, Average] = field(default_factory=dict)  # step seconds (draft + verify), by option
    last_used: dict[str, int] = field(default_factory=dict)  # step index each option last ran
    step: int = 0

    def rate(self, option: str) -> float | None:
        tokens, seconds = self.tokens.get(option), self.seconds.get(option)
        if tokens is None or seconds is None or tokens.value is None or not seconds.value:
            return None
        return tokens.value / seconds.value

    def allows(self, source: str) -> bool:
        """Whether to draft from `source` ("lookup" or "drafter") at this step."""
        if self.step - self.last_used.get(source, -self.explore_every) >= self.explore_every:
            return True  # explore: its estimate may be stale
        if self.step - self.last_used.get("none", -self.explore_every) >= self.explore_every:
            return False  # refresh the plain-step baseline
        rate, plain = self.rate(source), self.rate("none")
        return rate is None or plain is None or rate >= plain

    def record(self, option: str, committed: int, seconds: float) -> None:
        self.tokens.setdefault(option, Average()).update(committed, self.weight)
        self.seconds.setdefault(option, Average()).update(seconds, self.weight)
        self.last_used[option] = self.step
        self.step += 1
