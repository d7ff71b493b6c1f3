"""Speedup against τ: the acceptance-controlled drafter (`d3d.simulate`) swept over set τ values,
sync and async, beside the speedup the measured step costs predict.

Protocol, per prompt, in one process: plain AR (`reference_generate`) gives the reference
continuation and AR's time; then for every τ, a simulated drafter at the matching corruption rate
drafts full blocks (no gate) for the sync engine and for the async engine, back to back; AR runs
again after the τ runs, and AR's time is the mean of its two runs. Every output must equal AR's,
token for token. Speedups are total AR time ÷ total method time over the same prompts (the tokens
are the same), after a warm-up that is not counted; the device is synchronised before each clock
reading.

Predicted, in one-token steps measured on this machine (`d3d.costs`, K drafts per block):
  sync  ≈ τ / (verify[K] + draft[K])
  async ≈ τ / (verify[K] + (1 − hit) · draft[K]),  hit = the measured share of rounds whose next
          block was drafted during verification — the ideal in which a packed pass costs nothing
          on the critical path (on a CPU whose cores the worker shares, it does).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from d3d.async_engine import AsyncConfig, async_generate
from d3d.config import ConfigError, GenerationConfig
from d3d.costs import forward_costs
from d3d.devices import synchronize
from d3d.drafter import Drafter
from d3d.engine import generate_from_sources, reference_generate
from d3d.models import Decoder
from d3d.sequence import Step
from d3d.simulate import SimulatedDrafter, corruption_rate_for
from d3d.sources import DrafterSource

DEFAULT_TAUS = (1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
METHODS = ("sync", "async")


@dataclass
class Totals:
    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0  # verification steps
    committed: int = 0  # tokens those steps committed (Σ accepted + 1)
    rounds: int = 0  # async: rounds after which a next block was needed …
    hits: int = 0  # … and was drafted already

    def add(self, seconds: float, steps: list[Step]) -> None:
        stats = steps[-1].stats
        self.seconds += seconds
        self.tokens += stats.new_tokens
        self.steps += stats.steps
        self.committed += sum((k + 1) * n for k, n in enumerate(stats.accepted_histogram))
        self.rounds += sum(stats.branch_rounds_at)
        self.hits += sum(stats.branch_hits_at)


@dataclass
class SweepResult:
    taus: list[float]
    rates: list[float]
    ar: Totals = field(default_factory=Totals)
    runs: dict[tuple[str, float], Totals] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)


def timed(device: torch.device, steps: Callable[[], Iterator[Step]]) -> tuple[float, list[Step]]:
    synchronize(device)
    started = time.perf_counter()
    done = list(steps())
    synchronize(device)
    return time.perf_counter() - started, done


def tokens_of(steps: list[Step]) -> list[int]:
    return [t for s in steps for t in s.tokens]


def run_sweep(target: Decoder, drafter: Drafter, prompts: list[list[int]], taus: list[float] | tuple[float, ...],
              max_new_tokens: int = 128, async_config: AsyncConfig | None = None, eos_token_ids: list[int] | None = None,
              seed: int = 0, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The sweep over `prompts` (token ids): greedy, full blocks of the drafter's size; see the module."""
    if not prompts:
        raise ConfigError("the τ sweep needs at least one prompt")
    num_drafts = drafter.block_size - 1
    rates = [corruption_rate_for(tau, num_drafts) for tau in taus]  # refuses a τ out of reach first
    async_config = async_config or AsyncConfig()
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=list(eos_token_ids or []))
    device = target.device
    result = SweepResult(list(taus), rates)

    def engines(prompt_ids: list[int], reference: list[int], rate: float, index: int) -> dict[str, Callable[[], Iterator[Step]]]:
        simulated = SimulatedDrafter(drafter, reference, rate, seed=seed + index)  # the same corruption for both
        source = DrafterSource(simulated, name="simulated", costs_of=drafter)
        return {"sync": lambda: generate_from_sources(target, [source], prompt_ids, config),
                "async": lambda: async_generate(target, simulated, prompt_ids, config, async_config)}

    # Warm-up, not counted: first calls pay for allocation and kernel selection.
    prompt_ids = prompts[0]
    warm = GenerationConfig(max_new_tokens=min(16, max_new_tokens), eos_token_ids=config.eos_token_ids)
    warm_reference = prompt_ids + tokens_of(list(reference_generate(target, prompt_ids, warm)))
    simulated = SimulatedDrafter(drafter, warm_reference, rates[0])
    list(generate_from_sources(target, [DrafterSource(simulated)], prompt_ids, warm))
    list(async_generate(target, simulated, prompt_ids, warm, async_config))

    for index, prompt_ids in enumerate(prompts):
        first, ar_steps = timed(device, lambda: reference_generate(target, prompt_ids, config))
        expected = tokens_of(ar_steps)
        for tau, rate in zip(taus, rates):
            for name, run in engines(prompt_ids, prompt_ids + expected, rate, index).items():
                seconds, steps = timed(device, run)
                if tokens_of(steps) != expected:
                    at = next((i for i, (a, b) in enumerate(zip(tokens_of(steps), expected)) if a != b),
                              min(len(steps), len(expected)))
                    result.mismatches.append(f"{name} at τ {tau} differs from AR on prompt {index} at token {at}")
                result.runs.setdefault((name, tau), Totals()).add(seconds, steps)
        second, ar_steps = timed(device, lambda: reference_generate(target, prompt_ids, config))
        result.ar.add((first + second) / 2, ar_steps)
        if progress is not None:
            progress(f"prompt {index + 1}/{len(prompts)}: {len(expected)} tokens")
    costs = forward_costs(target, drafter, num_drafts)
    return summarise(result, costs.verify[num_drafts], costs.drafter[num_drafts], costs.step_ms, num_drafts,
                     len(prompts), max_new_tokens, async_config)


def summarise(result: SweepResult, verify: float, draft: float, step_ms: float, num_drafts: int,
              num_prompts: int, max_new_tokens: int, async_config: AsyncConfig) -> dict[str, Any]:
    rows = []
    for tau, rate in zip(result.taus, result.rates):
        row: dict[str, Any] = {"tau_set": tau, "corruption_rate": round(rate, 4)}
        for name in METHODS:
            totals = result.runs[(name, tau)]
            measured_tau = totals.committed / max(totals.steps, 1)
            hit = totals.hits / totals.rounds if totals.rounds else 0.0
            on_path = draft if name == "sync" else (1 - hit) * draft
            row[name] = {"tau": round(measured_tau, 3),
                         "speedup": round(result.ar.seconds / totals.seconds, 3),
                         "predicted": round(measured_tau / (verify + on_path), 3),
                         "tokens_per_second": round(totals.tokens / totals.seconds, 2)}
            if name == "async":
                row[name]["hit_rate"] = round(hit, 3)
        rows.append(row)
    return {"rows": rows, "identical": not result.mismatches, "mismatches": result.mismatches,
            "ar_tokens_per_second": round(result.ar.tokens / result.ar.seconds, 2),
            "costs": {"verify": verify, "draft": draft, "step_ms": step_ms, "num_drafts": num_drafts},
            "prompts": num_prompts, "max_new_tokens": max_new_tokens,
            "async_config": async_config.to_dict(), "threads": torch.get_num_threads(),
            "definitions": {"tau": "tokens committed per verification step, bonus token included",
                            "speedup": "AR seconds ÷ method seconds over the same prompts and tokens, same run",
                            "predicted": "τ ÷ (verify[K] + draft[K]) for sync, τ ÷ (verify[K] + (1 − hit)·draft[K]) "
                                         "for async, in measured one-token steps"}}


def markdown(result: dict[str, Any]) -> str:
    costs = result["costs"]
    lines = [f"AR {result['ar_tokens_per_second']} tok/s; one-token step {costs['step_ms']} ms; "
             f"verify[{costs['num_drafts']}] = {costs['verify']} steps, draft[{costs['num_drafts']}] = "
             f"{costs['draft']} steps; {result['prompts']} prompts × {result['max_new_tokens']} tokens; "
             f"identical to AR: {'yes' if result['identical'] else 'NO'}",
             "",
             "| τ set | ε | sync τ | sync speedup | sync predicted | async τ | async speedup | async predicted | async hit rate |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        s, a = row["sync"], row["async"]
        lines.append(f"| {row['tau_set']:g} | {row['corruption_rate']:.3f} | {s['tau']:.2f} | {s['speedup']:.2f}x | "
                     f"{s['predicted']:.2f}x | {a['tau']:.2f} | {a['speedup']:.2f}x | {a['predicted']:.2f}x | "
                     f"{a['hit_rate']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str | Path, title: str = "") -> str:
    """Measured speedup against measured τ, sync and async, with the predicted curves; → the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for name, color in (("sync", "tab:blue"), ("async", "tab:orange")):
        taus = [row[name]["tau"] for row in result["rows"]]
        axes.plot(taus, [row[name]["speedup"] for row in result["rows"]], "o-", color=color, label=f"{name}, measured")
        axes.plot(taus, [row[name]["predicted"] for row in result["rows"]], "--", color=color,
                  label=f"{name}, predicted from step costs")
    axes.axhline(1.0, color="gray", linewidth=0.8)
    axes.set_xlabel("τ (tokens per verification, bonus included)")
    axes.set_ylabel("speedup over AR (same run)")
    axes.set_title(title or "simulated drafter: speedup against τ", fontsize=10)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return str(path)
