"""SpecStats: what a generation measured, with fixed definitions.

- τ (acceptance length) = tokens committed per verification step, bonus token included:
  mean(num_accepted + 1), so 1 ≤ τ ≤ block_size. Plain AR decoding has τ = 1.
- acceptance_rate[i] = P(draft i+1 accepted | it was drafted and drafts 1..i were accepted).
- tokens_per_second = new tokens / wall time of the whole generation (prefill included).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    new_tokens: int = 0  # tokens generated (after EOS / length truncation)
    steps: int = 0  # verification steps (AR: one per token after the first)
    accepted_histogram: list[int] = field(default_factory=list)  # [k] = steps that accepted k drafts
    drafted_at: list[int] = field(default_factory=list)  # [i] = steps that proposed a draft at position i+1
    reached_at: list[int] = field(default_factory=list)  # [i] = steps that drafted i+1 and accepted drafts 1..i
    accepted_at: list[int] = field(default_factory=list)  # [i] = steps whose draft i+1 was accepted
    steps_by_source: dict[str, int] = field(default_factory=dict)  # drafts from "lookup", "drafter", "none"
    wall_seconds: float = 0.0  # whole generation
    draft_seconds: float = 0.0  # spent in the drafter on the critical path
    verify_seconds: float = 0.0  # spent in target forwards (prefill included)

    def record(self, num_drafted: int, num_accepted: int, source: str = "none") -> None:
        self.steps_by_source[source] = self.steps_by_source.get(source, 0) + 1
        for values, size in ((self.accepted_histogram, num_accepted + 1), (self.drafted_at, num_drafted),
                             (self.reached_at, num_drafted), (self.accepted_at, num_drafted)):
            values.extend([0] * (size - len(values)))
        self.steps += 1
        self.accepted_histogram[num_accepted] += 1
        for i in range(num_drafted):
            self.drafted_at[i] += 1
        for i in range(min(num_drafted, num_accepted + 1)):
            self.reached_at[i] += 1
        for i in range(num_accepted):
            self.accepted_at[i] += 1

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification step, bonus token included."""
        if not self.steps:
            return 1.0
        return sum((k + 1) * n for k, n in enumerate(self.accepted_histogram)) / self.steps

    @property
    def acceptance_rate(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached_at)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def merge(self, other: "SpecStats") -> "SpecStats":
        """Sum of two stats (for dataset-level totals)."""
        merged = SpecStats()
        for name in ("new_tokens", "steps", "wall_seconds", "draft_seconds", "verify_seconds"):
            setattr(merged, name, getattr(self, name) + getattr(other, name))
        merged.steps_by_source = {k: self.steps_by_source.get(k, 0) + other.steps_by_source.get(k, 0)
                                  for k in {**self.steps_by_source, **other.steps_by_source}}
        for name in ("accepted_histogram", "drafted_at", "reached_at", "accepted_at"):
            a, b = getattr(self, name), getattr(other, name)
            size = max(len(a), len(b))
            setattr(merged, name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0)
                                   for i in range(size)])
        return merged

    def summary(self) -> dict[str, float | int | list[float]]:
        return {"new_tokens": self.new_tokens, "steps": self.steps, "tau": round(self.tau, 3),
                "tokens_per_second": round(self.tokens_per_second, 2),
                "acceptance_rate": [round(r, 3) for r in self.acceptance_rate],
                "steps_by_source": dict(self.steps_by_source),
                "draft_seconds": round(self.draft_seconds, 3), "verify_seconds": round(self.verify_seconds, 3),
                "wall_seconds": round(self.wall_seconds, 3)}
