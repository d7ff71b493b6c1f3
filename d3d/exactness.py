"""Row-count invariance of the target, checked on the running machine, and the verification mode.

Greedy speculative decoding reproduces plain decoding token for token only if a token's logits are
the same bits whether the target computes them in a one-token step or among the k + 1 rows of a
verification. The row-exact kernels (`d3d.kernels`) make that true by construction; this module
checks it anyway on the real target — k-row forwards against one-row steps, bit for bit, for every
row count the engines use — once per machine, kernel build, dtype and model shape (cached under
`$D3D_CACHE/exactness`). Where the check fails (PyTorch's ops on a CPU whose GEMM rounds by row
count, when no C compiler was found), verification falls back to one-row forwards: exact, slower,
and said once on stderr. Never silently inexact.

This module decides how to verify; it runs no generation loop.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from d3d.kernels import cpu_flags_line
from d3d.files import write_text
from d3d.graphs import fixed_rows_of
from d3d.loading import cache_root
from d3d.models import Decoder

VerifyMode = Literal["batched", "row-by-row"]
MAX_ROWS = 17  # a 16-token block plus one: every row count a verification can have


@dataclass
class InvarianceReport:
    """The outcome of one check: which rows of which k-row forwards differed from one-row steps."""

    kernels: str  # the kernels the forwards ran ("row-exact: …" or "torch")
    dtype: str  # the target's dtype
    row_counts: list[int]  # k values checked
    mismatched_rows: dict[str, int] = field(default_factory=dict)  # k → rows not bit-identical
    seconds: float = 0.0  # time the check took when it ran

    @property
    def invariant(self) -> bool:
        return not self.mismatched_rows

    @property
    def mode(self) -> VerifyMode:
        return "batched" if self.invariant else "row-by-row"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernel_name(decoder: Decoder, dtype: torch.dtype) -> str:
    kernels = decoder.kernels_for(torch.empty(0, dtype=dtype, device=decoder.device))
    if kernels.name == "row-exact":
        return f"row-exact: {kernels.path_name}"
    rows = fixed_rows_of(decoder)  # d3d.graphs: a GPU's decoding forwards
    return f"{kernels.name}, {rows} fixed rows{' as CUDA graphs' * (decoder.device.type == 'cuda')}" if rows else kernels.name


@torch.no_grad()
def check_row_invariance(decoder: Decoder, max_rows: int = MAX_ROWS, context: int = 40,
                         seed: int = 0) -> InvarianceReport:
    """Compare every k-row cached forward (k = 1 … max_rows) with k one-row steps, bit for bit.

    Inputs are random token ids after a random context: activations the model really produces,
    many of them, so a kernel whose rounding depends on the row count shows within a few rows.
    """
    started = time.perf_counter()
    limit = decoder.config.max_position_embeddings
    max_rows = min(max_rows, limit - 1)
    context = max(1, min(context, limit - max_rows))
    vocab = decoder.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (1, context), generator=generator).to(decoder.device)
    block = torch.randint(0, vocab, (1, max_rows), generator=generator).to(decoder.device)
    cache = decoder.new_cache(context + max_rows)
    decoder(prefix, cache=cache)
    cache.commit()
    together = {}
    for rows in range(1, max_rows + 1):
        together[rows] = decoder(block[:, :rows], cache=cache)[0]
        cache.commit(0)
    steps = []
    for i in range(max_rows):
        steps.append(decoder(block[:, i:i + 1], cache=cache)[0, 0])
        cache.commit()
    steps_t = torch.stack(steps)
    mismatched = {}
    for rows, logits in together.items():
        differing = int((logits != steps_t[:rows]).any(-1).sum())
        if differing:
            mismatched[str(rows)] = differing
    return InvarianceReport(kernel_name(decoder, decoder.dtype), str(decoder.dtype).removeprefix("torch."),
                            list(range(1, max_rows + 1)), mismatched, time.perf_counter() - started)


def machine_key(decoder: Decoder) -> list:
    """What a measurement on `decoder` depends on: CPU, kernel build, torch, dtype, device, threads, shapes,
    and the weights the kernels stream (a GGUF's blocks cost less to read than bf16 copies)."""
    kernels = decoder.row_exact
    build = (kernels.path.name + " amx" * kernels.amx + " quads" * kernels.quads) if kernels is not None \
        else "torch-" + torch.__version__
    device = str(decoder.device) + (f" {torch.cuda.get_device_name(decoder.device)}" if decoder.device.type == "cuda" else "")
    return [cpu_name(), cpu_flags_line(), build, torch.__version__, str(decoder.dtype), device,
            torch.get_num_threads(), decoder.config.to_dict(), decoder.streamed_weights(), fixed_rows_of(decoder)]


def _cache_file(decoder: Decoder) -> Path:
    key = json.dumps(machine_key(decoder), sort_keys=True)
    root = cache_root() / "exactness"
    return root / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def cached_check(decoder: Decoder) -> InvarianceReport:
    """The check's report for this machine, kernels, dtype and shapes: from disk, or run and stored."""
    path = _cache_file(decoder)
    try:
        data = json.loads(path.read_text())
        return InvarianceReport(**data)
    except (OSError, ValueError, TypeError):
        pass
    report = check_row_invariance(decoder, max(MAX_ROWS, fixed_rows_of(decoder)))  # every row of the fixed rows
    write_text(path, json.dumps(asdict(report), indent=2))
    return report


_modes: weakref.WeakKeyDictionary[Decoder, VerifyMode] = weakref.WeakKeyDictionary()


def verify_mode(target: Decoder) -> VerifyMode:
    """How verification must run for this target on this machine (checked once per decoder)."""
    mode = _modes.get(target)
    if mode is None:
        report = cached_check(target)
        mode = report.mode
        if mode == "row-by-row":
            rows = ", ".join(f"{k} rows: {n} differ" for k, n in report.mismatched_rows.items())
            print(f"d3d: on this machine the target's {report.dtype} forwards with {report.kernels} kernels "
                  f"change with the row count ({rows}); verifying row by row (exact, slower). "
                  "See `d3d doctor`.", file=sys.stderr)
        _modes[target] = mode
    return mode
