"""`d3d bench`: every method on the same prompts, in one process, interleaved, checked for identity.

Protocol: load once; warm every method up on a throw-away prompt; then for each prompt run every
method back to back, rotating the order from prompt to prompt so that no method always runs
first (these machines are shared and noisy); compare throughput as ratios to d3d's own AR decoding
from the same run. At T = 0 each d3d method's tokens must equal AR's — d3d's target forward is
row-exact by construction (`d3d.kernels`), so this is enforced in bf16 and fp32 alike — and a
mismatch is reported with the prompt id and position and makes the command exit non-zero.
transformers' and llama.cpp's methods run their own kernels, so their agreement with d3d's AR is
reported (their plain AR vs d3d AR is the control), not enforced. Decode-only speed leaves out each
run's prefill (the time to its first new token), so baselines whose prompt processing differs
compare on decoding too.
MT-Bench's second turn follows the model's own first answer (AR's, identical for all methods at T = 0).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from d3d.bench.methods import OURS, base_method, build_methods, close_methods, describe
from d3d.bench.runs import Method, MethodRun
from d3d.config import GenerationConfig, SamplingConfig
from d3d.exactness import cpu_name
from d3d.generation import Pipeline
from d3d.prompts import Prompt, load_dataset, sample_prompts
from d3d.stats import SpecStats


@dataclass
class BenchConfig:
    datasets: list[str] = field(default_factory=lambda: ["humaneval", "mtbench", "math500"])  # names or JSONL paths
    num_prompts: int | None = 16  # per dataset (seeded sample; None = all)
    max_new_tokens: int = 256
    methods: list[str] = field(default_factory=lambda: ["ar", "hf", "hf_lookup", "lookup", "drafter", "speculative"])
    temperature: float = 0.0
    seed: int = 0


@dataclass
class Record:
    """One method on one prompt (one turn)."""

    dataset: str
    prompt_id: str
    method: str
    new_tokens: int
    seconds: float
    loops: bool  # the AR output of this prompt is caught in a repetition loop
    stats: SpecStats
    first_mismatch: int | None  # position where tokens differ from d3d AR (None = identical)
    prefill_seconds: float | None = None  # up to the first new token; None = the method does not say
    extra: dict[str, float] = field(default_factory=dict)  # figures only this method has
    prompt_tokens: int = 0


def is_looping(tokens: list[int], window: int = 64, max_period: int = 32) -> bool:
    """True when the last `window` tokens repeat with some period ≤ `max_period`.

    Small targets loop under greedy decoding, which inflates every method's τ (lookup's most), so
    results are also reported over loop-free outputs.
    """
    if len(tokens) < window:
        return False
    tail = tokens[-window:]
    return any(all(tail[i] == tail[i - p] for i in range(p, window)) for p in range(1, max_period + 1))


def first_mismatch(tokens: list[int], reference: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def machine() -> dict[str, Any]:
    return {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "cuda": torch.cuda.is_available()}


def prompt_turns(pipeline: Pipeline, prompt: Prompt, config: GenerationConfig) -> list[list[int]]:
    """Prompt ids per measured turn; MT-Bench's later turns follow AR's own earlier answers."""
    if prompt.text is not None:
        return [pipeline.encode(prompt.text, chat=False)]
    messages = list(prompt.messages or [])
    turns = [pipeline.encode(messages)]
    for followup in prompt.followups:
        answer = [t for s in pipeline.steps(turns[-1], config, "ar") for t in s.tokens]
        text = pipeline.target.tokenizer.decode(answer, skip_special_tokens=True)
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": followup}]
        turns.append(pipeline.encode(messages))
    return turns


def run_benchmark(pipeline: Pipeline, config: BenchConfig, progress: bool = True,
                  challengers: dict[str, Pipeline] | None = None) -> dict[str, Any]:
    """Every method on every prompt, interleaved. `challengers` (label → pipeline on the same
    target) add `method@label` runs of each drafting method with that pipeline's drafter."""
    sampling = SamplingConfig(temperature=config.temperature, seed=config.seed)
    generation = GenerationConfig(max_new_tokens=config.max_new_tokens,
                                  eos_token_ids=list(pipeline.target.eos_token_ids), sampling=sampling)
    names = list(dict.fromkeys(["ar", *config.methods]))  # AR is always measured: speedups are over it
    methods = build_methods(pipeline, names, challengers)
    names = list(methods)
    # Methods that load outside this process (the llama.cpp servers) say how long that took.
    load = {n: round(m.load_seconds, 2) for n, m in methods.items() if getattr(m, "load_seconds", None) is not None}
    try:
        records, mismatches = run_interleaved(pipeline, config, methods, generation, progress)
    finally:
        close_methods(methods)
    result = summarise(records, names, config)
    drafters = {label: p.drafter_source for label, p in (challengers or {}).items()}
    result.update(machine=machine(), dtype=str(pipeline.target.decoder.dtype).removeprefix("torch."),
                  target=pipeline.target.name, drafter=pipeline.drafter_source, challengers=drafters,
                  mismatches=mismatches, identical=not mismatches, load_seconds=load,
                  peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                  config=config.__dict__, descriptions={n: describe(n, drafters) for n in names},
                  definitions={"tau": "tokens committed per verification step, bonus token included",
                               "speedup": "method tokens/s ÷ d3d AR tokens/s over the same prompts, same run",
                               "decode": "(new tokens − 1) ÷ (seconds − prefill seconds): speed after the "
                                         "first new token",
                               "ttft": "mean seconds from the prompt to the first new token (the prefill)",
                               "loop": "AR output whose last 64 tokens repeat with a period ≤ 32"})
    result["records"] = [record_dict(r) for r in records]
    return result


def run_interleaved(pipeline: Pipeline, config: BenchConfig, methods: dict[str, Method],
                    generation: GenerationConfig, progress: bool) -> tuple[list[Record], list[str]]:
    """Warm every method up, then every prompt through every method in rotating order."""
    names = list(methods)
    sampling = generation.sampling
    # grouped by the set each prompt says it is from: `long` reports its sizes (long1k … long7k) apart
    prompts = [(p.dataset if name == "long" else name, p) for name in config.datasets
               for p in sample_prompts(load_dataset(name), config.num_prompts, config.seed)]
    warm = pipeline.encode("Say hello.", chat=pipeline.target.tokenizer.chat_template is not None)
    warm_config = GenerationConfig(max_new_tokens=16, eos_token_ids=generation.eos_token_ids, sampling=sampling)
    for method in methods.values():
        method(warm, warm_config)
    records: list[Record] = []
    mismatches: list[str] = []
    bar = tqdm(total=len(prompts) * len(names), desc="bench", unit="run", disable=not progress)
    for index, (dataset, prompt) in enumerate(prompts):
        for turn, prompt_ids in enumerate(prompt_turns(pipeline, prompt, generation)):
            order = names[index % len(names):] + names[:index % len(names)]
            runs: dict[str, MethodRun] = {}
            for name in order:
                if config.temperature > 0:
                    torch.manual_seed(config.seed + index)
                runs[name] = methods[name](prompt_ids, generation)
            reference = runs["ar"].tokens
            loops = is_looping(reference)
            prompt_id = prompt.id + (f"/turn{turn + 1}" if turn else "")
            for name, run in runs.items():
                mismatch = first_mismatch(run.tokens, reference) if config.temperature == 0 else None
                if mismatch is not None and base_method(name) in OURS:
                    mismatches.append(f"{name} differs from AR on {dataset}:{prompt_id} at token {mismatch}")
                records.append(Record(dataset, prompt_id, name, len(run.tokens), run.seconds, loops,
                                      run.stats, mismatch, run.prefill_seconds, dict(run.extra), len(prompt_ids)))
        bar.update(len(names))
    bar.close()
    return records, mismatches


def record_dict(r: Record) -> dict[str, Any]:
    prefill = None if r.prefill_seconds is None else round(r.prefill_seconds, 4)
    return {"dataset": r.dataset, "prompt_id": r.prompt_id, "method": r.method, "new_tokens": r.new_tokens,
            "seconds": round(r.seconds, 4), "prefill_seconds": prefill, "prompt_tokens": r.prompt_tokens, "loops": r.loops,
            "tau": round(r.stats.tau, 3), "first_mismatch": r.first_mismatch, **r.extra}


def draft_acceptance(records: list[Record]) -> float | None:
    drafted = sum(r.extra.get("drafted", 0) for r in records)
    return round(sum(r.extra.get("accepted", 0) for r in records) / drafted, 3) if drafted else None


def decode_rate(records: list[Record]) -> float | None:
    """Tokens/s after each run's first new token; None if a run's prefill was not measured."""
    if not records or any(r.prefill_seconds is None for r in records):
        return None
    tokens = sum(max(r.new_tokens - 1, 0) for r in records)
    seconds = sum(r.seconds - r.prefill_seconds for r in records)  # type: ignore[operator]
    return round(tokens / seconds, 2) if seconds > 0 else None


def time_to_first_token(records: list[Record]) -> float | None:
    """Mean seconds to each run's first new token (its prefill); None if a run's was not measured."""
    if not records or any(r.prefill_seconds is None for r in records):
        return None
    return round(sum(r.prefill_seconds for r in records) / len(records), 3)  # type: ignore[misc]


def aggregate(records: list[Record], ar: list[Record]) -> dict[str, Any]:
    tokens, seconds = sum(r.new_tokens for r in records), sum(r.seconds for r in records)
    ar_rate = sum(r.new_tokens for r in ar) / max(sum(r.seconds for r in ar), 1e-9)
    stats = SpecStats()
    for r in records:
        stats = stats.merge(r.stats)
    rate = tokens / max(seconds, 1e-9)
    return {"prompts": len(records), "tokens": tokens, "tokens_per_second": round(rate, 2),
            "decode_tokens_per_second": decode_rate(records),
            "ttft_seconds": time_to_first_token(records),
            "prompt_tokens": round(sum(r.prompt_tokens for r in records) / len(records)) if records else 0,
            # drafts a baseline without SpecStats reports (llama.cpp lookup): accepted ÷ drafted
            "draft_acceptance": draft_acceptance(records),
            "speedup": round(rate / ar_rate, 3) if ar_rate else None,
            "tau": round(stats.tau, 3) if stats.steps else None,
            "acceptance_rate": [round(x, 3) for x in stats.acceptance_rate],
            "accepted_histogram": stats.accepted_histogram,
            "draft_share": round(stats.draft_seconds / max(seconds, 1e-9), 3),
            "identical": sum(r.first_mismatch is None for r in records),
            "per_step": per_step(stats, seconds),
            "median_speedup": round(statistics.median(
                (a.seconds / max(r.seconds, 1e-9)) * (r.new_tokens / max(a.new_tokens, 1))
                for r, a in zip(records, ar)), 3) if records else None}


def per_step(stats: SpecStats, seconds: float) -> dict[str, float | None] | None:
    """Where a verification step's time goes, in ms: the whole step, the target's verify forward,
    drafting on the critical path and, for async drafting, the packed pass, the wait for it and
    the share of steps whose next block was ready (hit rate). None for methods without step
    stats (the transformers baselines)."""
    if not stats.steps:
        return None
    steps = stats.steps + 1  # + the prefill, which verify_seconds includes
    ms = {"step": seconds / steps, "verify": stats.verify_seconds / steps, "draft": stats.draft_seconds / steps}
    result: dict[str, float | None] = {k: round(1000 * v, 2) for k, v in ms.items()}
    asynchronous = bool(stats.branch_rounds_at)
    result["packed"] = round(1000 * stats.packed_seconds / steps, 2) if asynchronous else None
    result["wait"] = round(1000 * stats.wait_seconds / steps, 2) if asynchronous else None
    result["hit_rate"] = round(stats.hit_rate, 3) if asynchronous else None
    result["planned_rate"] = round(stats.planned_rate, 3) if asynchronous else None  # k drafted, any bonus
    result["overlap"] = round(stats.overlap_fraction, 3) if asynchronous else None
    return result


def summarise(records: list[Record], names: list[str], config: BenchConfig) -> dict[str, Any]:
    table: dict[str, dict[str, Any]] = {}
    groups = list(dict.fromkeys(r.dataset for r in records)) + ["all"]
    for group in groups:
        in_group = [r for r in records if group == "all" or r.dataset == group]
        keys = sorted({(r.dataset, r.prompt_id) for r in in_group if r.method == "ar"})
        looping = {k for k in keys if any(r.loops for r in in_group if (r.dataset, r.prompt_id) == k)}
        table[group] = {"loop_share": round(len(looping) / max(len(keys), 1), 3)}
        for name in names:
            by_key = {(r.dataset, r.prompt_id): r for r in in_group if r.method == name}
            ar_by_key = {(r.dataset, r.prompt_id): r for r in in_group if r.method == "ar"}
            table[group][name] = {
                "all": aggregate([by_key[k] for k in keys], [ar_by_key[k] for k in keys]),
                "loop_free": aggregate([by_key[k] for k in keys if k not in looping],
                                       [ar_by_key[k] for k in keys if k not in looping]),
            }
    return {"table": table}


def save_result(result: dict[str, Any], out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(out_dir, f"bench-{stamp}.json")
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)
    return path
