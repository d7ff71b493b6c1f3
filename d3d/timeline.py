"""A generation's timeline: what each worker did when, drawn as a PNG.

The async engine records spans — verification and synchronous drafting on the main thread,
packed drafting jobs on the drafter worker, waits for the worker — so one can see how much of
the drafting hides behind verification. Spans only; no engine logic here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

COLOURS = {"verify": "tab:blue", "draft": "tab:orange", "packed draft": "tab:green", "wait": "tab:red"}


@dataclass(frozen=True)
class Span:
    lane: str  # "target" (main thread) or "drafter" (worker)
    kind: str  # "verify", "draft" (synchronous), "packed draft", "wait"
    start: float  # time.perf_counter() seconds
    end: float


def plot_timeline(spans: list[Span], path: str | Path, title: str = "") -> bool:
    """Draw spans as one bar lane per worker; False (nothing drawn) without matplotlib or spans."""
    if not spans:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    origin = min(s.start for s in spans)
    lanes = list(dict.fromkeys(s.lane for s in spans))
    figure, axis = plt.subplots(figsize=(11, 1.2 + 0.7 * len(lanes)))
    for row, lane in enumerate(lanes):
        for kind in COLOURS:
            bars = [((s.start - origin) * 1000, (s.end - s.start) * 1000) for s in spans
                    if s.lane == lane and s.kind == kind]
            if bars:
                axis.broken_barh(bars, (row - 0.35, 0.7), color=COLOURS[kind], label=kind)
    handles, labels = axis.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axis.legend(unique.values(), unique.keys(), loc="upper center", bbox_to_anchor=(0.5, -0.35),
                ncol=len(unique), frameon=False, fontsize=8)
    axis.set_yticks(range(len(lanes)), lanes)
    axis.set_xlabel("milliseconds")
    axis.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
