"""Training curves (loss and teacher-forced τ by step) from a run's log.jsonl, drawn as a PNG."""

from __future__ import annotations

import json
from pathlib import Path


def plot_curves(log_path: str | Path, png_path: str | Path) -> bool:
    """Draw loss and τ; returns False (and draws nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    records = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    losses = [(r["step"], r["loss"], r["diff"], r["ar"]) for r in records if "loss" in r]
    taus = [(r["step"], r["tau"]) for r in records if "tau" in r]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    if losses:
        steps, total, diff, ar = zip(*losses)
        left.plot(steps, total, label="loss = L_diff + λ·L_AR", linewidth=1)
        left.plot(steps, diff, label="L_diff (blocks)", linewidth=1, alpha=0.7)
        left.plot(steps, ar, label="L_AR (clean)", linewidth=1, alpha=0.7)
        left.set_xlabel("step")
        left.set_ylabel("cross-entropy")
        left.legend()
    if taus:
        steps, values = zip(*taus)
        right.plot(steps, values, marker="o", label="greedy")
        sampled = [(r["step"], r["tau_t1"]) for r in records if "tau_t1" in r]
        if sampled:
            right.plot(*zip(*sampled), marker="s", label="T = 1 (lower bound)")
            right.legend()
        right.set_xlabel("step")
        right.set_ylabel("teacher-forced τ (bonus included)")
    figure.suptitle(Path(log_path).parent.name)
    figure.tight_layout()
    figure.savefig(png_path, dpi=110)
    plt.close(figure)
    return True


def compare_runs(run_dirs: list[str | Path], png_path: str | Path) -> list[dict]:
    """Held-out τ by step for several runs on one plot; returns each run's final τ and α's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    rows = []
    for run in run_dirs:
        records = [json.loads(line) for line in (Path(run) / "log.jsonl").read_text().splitlines() if line.strip()]
        taus = [(r["step"], r["tau"]) for r in records if "tau" in r]
        if not taus:
            continue
        axis.plot(*zip(*taus), marker="o", markersize=3, label=Path(run).name)
        last = [r for r in records if "tau" in r][-1]
        rows.append({"run": Path(run).name, "step": last["step"], "tau": last["tau"],
                     "acceptance_rate": last["acceptance_rate"][:3]})
    axis.set_xlabel("step")
    axis.set_ylabel("held-out teacher-forced τ (bonus included)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(png_path, dpi=110)
    plt.close(figure)
    return rows
