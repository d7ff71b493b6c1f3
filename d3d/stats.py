"""SpecStats: what a generation measured, with fixed definitions.

- τ (acceptance length) = tokens committed per verification step, bonus token included:
  mean(num_accepted + 1), so 1 ≤ τ ≤ block_size. Plain AR decoding has τ = 1.
- acceptance_rate[i] = P(draft i+1 accepted | it was drafted and drafts 1..i were accepted).
- tokens_per_second = new tokens / wall time of the whole generation (prefill included).
- Asynchronous drafting (`d3d.async_engine`): hit_rate = share of verification steps after which
  the next block was already drafted (a branch matched the verdict (k, bonus)), overall and per k;
  a miss is either the plan's (no branch drafted for that k: 1 − planned_rate) or the bonus
  guess's (a branch had that k, for another bonus: planned_rate − hit_rate);
  wait_seconds = time the loop waited for a packed drafting pass after verifying (all of it when
  serial); overlap_fraction = 1 − wait_seconds / packed_seconds, the packed drafting hidden behind
  verification.
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
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache (d3d.prefix_cache)
    # Asynchronous drafting only (empty / zero for the other engines):
    branch_rounds_at: list[int] = field(default_factory=list)  # [k] = async steps that accepted k drafts
    branch_hits_at: list[int] = field(default_factory=list)  # [k] = of those, steps whose outcome had a branch
    branch_planned_at: list[int] = field(default_factory=list)  # [k] = of those, steps with a branch for k (any bonus)
    packed_seconds: float = 0.0  # drafter time in packed passes (concurrent with verification or not)
    wait_seconds: float = 0.0  # loop time spent waiting for packed passes (included in draft_seconds)

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

    def record_branch(self, num_accepted: int, hit: bool, planned: bool | None = None) -> None:
        """One async step's outcome: did a drafted-ahead branch match it (`hit`), and was one drafted
        for its k at all (`planned`; a hit was)?"""
        for values in (self.branch_rounds_at, self.branch_hits_at, self.branch_planned_at):
            values.extend([0] * (num_accepted + 1 - len(values)))
        self.branch_rounds_at[num_accepted] += 1
        self.branch_hits_at[num_accepted] += int(hit)
        self.branch_planned_at[num_accepted] += int(hit if planned is None else planned or hit)

    @property
    def hit_rate(self) -> float:
        rounds = sum(self.branch_rounds_at)
        return sum(self.branch_hits_at) / rounds if rounds else 0.0

    @property
    def planned_rate(self) -> float:
        """Share of async steps whose accepted count k had a branch drafted (whatever its bonus guess)."""
        rounds = sum(self.branch_rounds_at)
        return sum(self.branch_planned_at) / rounds if rounds else 0.0

    @property
    def hit_rate_at(self) -> list[float]:
        """[k] = P(a branch was ready | k drafts accepted)."""
        return [h / r if r else 0.0 for h, r in zip(self.branch_hits_at, self.branch_rounds_at)]

    @property
    def overlap_fraction(self) -> float:
        if self.packed_seconds <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.wait_seconds / self.packed_seconds))

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
        for name in ("new_tokens", "steps", "wall_seconds", "draft_seconds", "verify_seconds",
                     "packed_seconds", "wait_seconds"):
            setattr(merged, name, getattr(self, name) + getattr(other, name))
        merged.steps_by_source = {k: self.steps_by_source.get(k, 0) + other.steps_by_source.get(k, 0)
                                  for k in {**self.steps_by_source, **other.steps_by_source}}
        for name in ("accepted_histogram", "drafted_at", "reached_at", "accepted_at", "branch_rounds_at",
                     "branch_hits_at", "branch_planned_at"):
            a, b = getattr(self, name), getattr(other, name)
            size = max(len(a), len(b))
            setattr(merged, name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0)
                                   for i in range(size)])
        return merged

    def summary(self) -> dict[str, float | int | list[float]]:
        summary = {"new_tokens": self.new_tokens, "steps": self.steps, "tau": round(self.tau, 3),
                   "tokens_per_second": round(self.tokens_per_second, 2),
                   "acceptance_rate": [round(r, 3) for r in self.acceptance_rate],
                   "steps_by_source": dict(self.steps_by_source),
                   "draft_seconds": round(self.draft_seconds, 3), "verify_seconds": round(self.verify_seconds, 3),
                   "wall_seconds": round(self.wall_seconds, 3)}
        if self.branch_rounds_at:  # async runs only
            summary.update(hit_rate=round(self.hit_rate, 3), hit_rate_at=[round(r, 3) for r in self.hit_rate_at],
                           planned_rate=round(self.planned_rate, 3),
                           packed_seconds=round(self.packed_seconds, 3), wait_seconds=round(self.wait_seconds, 3),
                           overlap_fraction=round(self.overlap_fraction, 3))
        return summary
