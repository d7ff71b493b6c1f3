"""τ against training tokens: a log-linear fit over training runs, and what it predicts.

Scylla (arXiv 2505.07858) finds a drafter's acceptance length log-linear in its training tokens.
Each run contributes its final held-out teacher-forced τ (bonus included) at the response tokens
it trained on (`tokens_seen` in its log.jsonl) — one point per run, each with its own full
learning-rate schedule, which is the comparison the law is about; `all_points` adds every
evaluation of every run (within one schedule, τ also moves with the decaying learning rate, so
those points only illustrate). The fit τ = a + b·ln N by least squares; `tokens_for(τ)` inverts it.

This module fits and draws; it trains nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from d3d.config import ConfigError


@dataclass(frozen=True)
class Point:
    run: str
    tokens: int  # response tokens trained on
    tau: float  # held-out teacher-forced τ, bonus included


@dataclass(frozen=True)
class LogLinearFit:
    """τ = intercept + slope · ln(tokens)."""

    intercept: float
    slope: float
    r2: float  # coefficient of determination over the fitted points
    points: int

    def tau(self, tokens: float) -> float:
        return self.intercept + self.slope * math.log(tokens)

    def tokens_for(self, tau: float) -> float:
        """Training tokens the fit predicts for `tau` (inf when τ does not grow with tokens)."""
        if self.slope <= 0:
            return math.inf
        return math.exp((tau - self.intercept) / self.slope)


def read_points(run_dirs: list[str | Path], all_points: bool = False) -> list[Point]:
    """(tokens, τ) of each run's final evaluation, or of all its evaluations past step 0."""
    points = []
    for run in run_dirs:
        log = Path(run) / "log.jsonl"
        if not log.is_file():
            raise ConfigError(f"{run} has no log.jsonl: give `d3d train --out` folders")
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        evaluated = [r for r in records if "tau" in r and r.get("tokens_seen")]
        if not evaluated:
            raise ConfigError(f"{log} has no evaluation with tokens_seen (runs from before it was logged)")
        for record in evaluated if all_points else evaluated[-1:]:
            points.append(Point(Path(run).name, int(record["tokens_seen"]), float(record["tau"])))
    return points


def fit(points: list[Point]) -> LogLinearFit:
    """Least-squares τ = a + b·ln N over at least two distinct token counts."""
    xs = [math.log(p.tokens) for p in points]
    ys = [p.tau for p in points]
    if len(set(xs)) < 2:
        raise ConfigError("a fit needs evaluations at two or more different token counts")
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    intercept = mean_y - slope * mean_x
    total = sum((y - mean_y) ** 2 for y in ys)
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    return LogLinearFit(intercept, slope, 1 - residual / total if total > 0 else 1.0, len(points))


def plot(points: list[Point], result: LogLinearFit, png_path: str | Path, targets: list[float]) -> bool:
    """Points, the fitted line extended to the largest target τ; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axis = plt.subplots(figsize=(7, 4))
    for run in dict.fromkeys(p.run for p in points):
        mine = [p for p in points if p.run == run]
        axis.scatter([p.tokens for p in mine], [p.tau for p in mine], s=18, label=run)
    low = min(p.tokens for p in points)
    high = max([max(p.tokens for p in points)] + [t for t in map(result.tokens_for, targets) if math.isfinite(t)])
    grid = [low * (high / low) ** (i / 60) for i in range(61)]
    axis.plot(grid, [result.tau(n) for n in grid], color="black", linewidth=1,
              label=f"τ = {result.intercept:.2f} + {result.slope:.3f}·ln N (R² {result.r2:.2f})")
    axis.set_xscale("log")
    axis.set_xlabel("training tokens N (target-generated responses)")
    axis.set_ylabel("held-out teacher-forced τ (bonus included)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(png_path, dpi=110)
    plt.close(figure)
    return True
