"""`d3d doctor`: what this machine gives d3d — CPU, kernels, the row-invariance check and its costs,
and the speculation gate's measured costs.

For each dtype it loads the target, runs the self-check of `d3d.exactness` afresh (k-row forwards
against one-row steps, k = 1 … 17, bit for bit) for the kernels decoding uses and for PyTorch's
own ops, and times a one-token step and a 17-token verification on each path, so a user sees
what is guaranteed here, which path runs, and what exactness costs. It only reports.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass

import torch

from d3d.costs import forward_costs
from d3d.exactness import MAX_ROWS, check_row_invariance, cpu_name
from d3d.kernels import KernelBuildError, cpu_flags_line, row_exact_kernels
from d3d.lookup import LookupConfig
from d3d.models import Decoder
from d3d.sources import default_sources, verify_reach
from d3d.sources import drafter_source as source_of  # `doctor` has a parameter named drafter_source


@dataclass
class PathCost:
    """One arithmetic path for the target: its check result and its step costs (medians)."""

    kernels: str  # "row-exact: …" or "torch"
    invariant: bool  # k-row forwards bit-identical to one-row steps for every k checked
    mismatched_rows: dict[str, int]  # k → rows that differed
    step_ms: float  # one-token step
    verify_ms: float  # one 17-token forward
    used: bool  # the path decoding takes on this machine

    @property
    def verify_steps(self) -> float:
        """Cost of a verification in one-token steps: one forward if invariant, else 17 steps."""
        return (self.verify_ms if self.invariant else MAX_ROWS * self.step_ms) / self.step_ms


def cpu_flags() -> list[str]:
    """The vector-extension flags that decide the kernels' path, as this CPU reports them."""
    found = set(cpu_flags_line().partition(":")[2].split())
    return [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in found]


@torch.no_grad()
def time_forward(decoder: Decoder, rows: int, context: int = 256, repeats: int = 9) -> float:
    """Median milliseconds of a `rows`-token cached forward after `context` tokens."""
    context = min(context, decoder.config.max_position_embeddings - rows)
    cache = decoder.new_cache(context + rows)
    decoder(torch.randint(0, decoder.config.vocab_size, (1, context)), cache=cache)
    cache.commit()
    ids = torch.randint(0, decoder.config.vocab_size, (1, rows))
    times = []
    for i in range(repeats + 2):
        started = time.perf_counter()
        decoder(ids, cache=cache)
        cache.commit(0)
        if i >= 2:  # warm-up excluded
            times.append(time.perf_counter() - started)
    return 1000 * sorted(times)[len(times) // 2]


def measure_paths(target: Decoder) -> list[PathCost]:
    """The decoding path and PyTorch's own ops, each checked and timed on this target."""
    torch_target = Decoder(target.config, kernels="torch").to(dtype=target.dtype)
    torch_target.load_state_dict(target.state_dict())
    torch_target.eval().requires_grad_(False)
    candidates = [(target, True)]
    if target.row_exact is not None:  # else the decoding path already is PyTorch's
        candidates.append((torch_target, False))
    paths = []
    for decoder, used in candidates:
        report = check_row_invariance(decoder)
        paths.append(PathCost(report.kernels, report.invariant, report.mismatched_rows,
                              time_forward(decoder, 1), time_forward(decoder, MAX_ROWS), used))
    return paths


def describe_weights(decoder: Decoder) -> str:
    """What a one-token step reads of the linear weights, and in which form."""
    weights = decoder.linear_weights().values()
    if decoder.row_exact is None:
        return f"{decoder.streamed_weights()}, {sum(w.numel() * w.element_size() for w in weights) / 1e6:.1f} MB a step"
    one_row = [decoder.row_exact.one_row_stream(w) for w in weights]
    read = sum(stream.nbytes for stream in one_row)
    copies = sum(w.numel() * w.element_size() for w in weights)
    streamed = decoder.streamed_weights()
    if streamed.startswith(("bfloat16", "float")):
        return f"{streamed}, {read / 1e6:.1f} MB a step"
    tables = sum(stream.format == "t4" for stream in one_row)
    form = f" ({tables} of them as tables of their blocks' 16 values)" if tables else ""
    return (f"GGUF {streamed} blocks, decoded in registers to the bf16 weights{form}: {read / 1e6:.1f} MB a step "
            f"(bf16 copies: {copies / 1e6:.1f} MB; --weights dequantized)")


def describe_greedy_head(decoder: Decoder) -> str:
    """How a greedy row's argmax is taken (d3d.kernels.greedy): certified from a few exact logits, or
    from the full head's logits, and why."""
    kernels = decoder.row_exact
    if kernels is None:
        return "the full head's logits (no row-exact kernels)"
    if not kernels.greedy.on:
        return ("the full head's logits (D3D_GREEDY_HEAD=0)" if os.environ.get("D3D_GREEDY_HEAD") == "0" else
                "the full head's logits (the certified head is on by default but on the AMX tiles; "
                "D3D_GREEDY_HEAD=1 tries it on this build, checked at load)")
    head = kernels.greedy.head(decoder.head_weight)
    if head is None:
        return "the full head's logits (its weights are not a quantized stream, or the check failed)"
    if not head.rows:
        return "the full head's logits (the certified head was not faster here, timed at load)"
    return (f"certified: the exact logits of the few vocabulary rows that can hold the argmax, calls of "
            f"{', '.join(map(str, sorted(head.rows)))} row(s) (checked against the full head and timed at load)")


def describe_machine() -> dict:
    try:
        started = time.perf_counter()
        kernels = row_exact_kernels()  # compiled on the machine's first use, then loaded from the cache
        build = f"{kernels.path_name} ({kernels.path}; ready in {time.perf_counter() - started:.2f} s)"
        if kernels.amx_refused:
            build += f"; AMX tiles not used: {kernels.amx_refused}"
    except KernelBuildError as error:
        build = f"unavailable: {str(error).splitlines()[0]}"
    return {"cpu": cpu_name(), "flags": cpu_flags(), "machine": platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "row_exact_kernels": build}


def format_report(machine: dict, results: dict[str, list[PathCost]]) -> str:
    lines = [f"CPU            {machine['cpu']} ({', '.join(machine['flags']) or 'no AVX flags read'})",
             f"torch          {machine['torch']}, {machine['threads']} threads",
             f"kernels        {machine['row_exact_kernels']}",
             "weight packing " + ", ".join(f"{k.removeprefix('pack_seconds_')} {v:.2f} s"
                                           for k, v in machine.items() if k.startswith("pack_seconds_"))
             + " (once per load)",
             *(f"weights        {k.removeprefix('weights_')}: {v}" for k, v in machine.items() if k.startswith("weights_")),
             *(f"greedy argmax  {k.removeprefix('greedy_head_')}: {v}" for k, v in machine.items()
               if k.startswith("greedy_head_")),
             f"rows checked   1 … {MAX_ROWS}: each k-row forward against k one-token steps, bit for bit", ""]
    header = f"{'dtype':<9} {'path':<58} {'check':<22} {'step ms':>8} {'verify-17 ms':>13} {'verify/step':>12}"
    lines += [header, "-" * len(header)]
    for dtype, paths in results.items():
        for path in paths:
            check = "identical" if path.invariant else "DIFFERS " + ",".join(
                f"{k}:{n}" for k, n in list(path.mismatched_rows.items())[:4])
            name = ("→ " if path.used else "  ") + path.kernels
            lines.append(f"{dtype:<9} {name[:58]:<58} {check:<22} {path.step_ms:>8.1f} {path.verify_ms:>13.1f} "
                         f"{path.verify_steps:>12.2f}")
    lines += ["", "→ marks the path decoding uses. A path that differs would verify row by row (17 steps per "
              "verification); decoding is then still exact, only slower.", ""]
    for key, costs in machine.items():
        if key.startswith("gate_costs_"):
            verify = costs["verify"]
            shown = ", ".join(f"{k}: {verify[k]:.2f}" for k in (1, 2, 4, 8, len(verify) - 1) if k < len(verify))
            drafting = costs["drafter"]
            drafter = (f"; drafting them {', '.join(f'{k}: {drafting[k]:.2f}' for k in (1, 2, 4, 8, len(drafting) - 1) if k < len(drafting))}"
                       if any(drafting) else "")
            lines.append(f"gate costs     {key.removeprefix('gate_costs_')}, in one-token steps of "
                         f"{costs['step_ms']:.1f} ms — verifying k drafts {shown}{drafter} "
                         "(measured once, $D3D_CACHE/costs; --recalibrate to redo)")
    return "\n".join(lines)


def doctor(target_source: str | None, dtypes: list[torch.dtype], drafter_source: str | None = "default",
           recalibrate: bool = False) -> tuple[dict, dict[str, list[PathCost]]]:
    """Check and time each dtype's paths; read (or with `recalibrate`, re-measure) the gate's costs."""
    from d3d.generation import resolve_drafter
    from d3d.loading import load_target

    results, machine = {}, describe_machine()
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        target = load_target(target_source, dtype)
        decoder = target.decoder
        fresh = Decoder(decoder.config).to(dtype=dtype)  # unpacked weights: time the packing once
        fresh.load_state_dict(decoder.state_dict())
        machine[f"pack_seconds_{name}"] = round(fresh.pack_weights(), 3)
        del fresh
        machine[f"weights_{name}"] = describe_weights(decoder)
        machine[f"greedy_head_{name}"] = describe_greedy_head(decoder)
        results[name] = measure_paths(decoder)
        drafter, _ = resolve_drafter(target, drafter_source, target_source, None)
        # Exactly the costs the default method's gate asks for (`engine.generate_from_sources`), so that
        # every later command finds them stored: verifications timed on the target alone up to the
        # longest reach of lookup and the drafter, drafting up to the drafter's own.
        gate = asdict(forward_costs(decoder, None, verify_reach(default_sources(drafter, LookupConfig())),
                                    remeasure=recalibrate))
        if drafter is not None:
            gate["drafter"] = forward_costs(decoder, drafter, source_of(drafter).max_drafts,
                                            remeasure=recalibrate, drafter_only=True).drafter
        machine[f"gate_costs_{name}"] = gate
    return machine, results


def as_json(machine: dict, results: dict[str, list[PathCost]]) -> dict:
    return {"machine": machine,
            "paths": {dtype: [{**asdict(p), "verify_steps": p.verify_steps} for p in paths]
                      for dtype, paths in results.items()}}
