"""Whole target forwards of k rows under two or more builds of the row-exact kernels, interleaved in one
process, in one-token steps of the first build — and whether every build gives the same logits.

A build is a compiled kernel library: this checkout's (`this`), or another checkout's, e.g.
    git worktree add /tmp/before HEAD~1
    PYTHONPATH=/tmp/before python -P -c "from d3d.kernels import build; print(build())"
(-P: without it, `python -c` run in this checkout imports this checkout's d3d before PYTHONPATH's, and
builds this checkout's sources.)
Every build reads the same weight streams (packed once by this checkout), so only the kernels differ
(a build that lays out a copy otherwise — e.g. before a change to the quads' code order — reads other
values: its times hold, its logits are not comparable) — except `LABEL=plain`: this build reading
bf16 values as stored (PLAIN) where it would lane-pack them, and `LABEL=grouped`: this build with the
4-bit quads off (G4 blocks and bf16 copies; AVX-512 BF16 with VBMI).

Usage: python scripts/rows_ab.py --builds before=/path/to/rowexact-….so,this [--rows 1,2,3,4,5,8,9,17]
       [--context 256] [--rounds 7] [--weights stored|dequantized|…] [--last-only] [--raw]
(a 4K prompt's prefill: --rows 1,4096 --context 0 --last-only)
Prints one JSON line: per row count, each build's median cost in one-token steps of the first build.
"""

import argparse
import ctypes
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

from d3d.loading import load_target
from d3d.models import SequenceRows


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--builds", required=True, help="LABEL=PATH or 'this', comma-separated; the first is the unit")
    parser.add_argument("--rows", default="1,2,3,4,5,8,9,17")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--weights", default="stored", help="how the target's weights are read (d3d.quantized.WEIGHTS)")
    parser.add_argument("--last-only", action="store_true",
                        help="the rows are a prompt's prefill: only the last row's logits (as generation asks)")
    parser.add_argument("--raw", action="store_true",
                        help="also each round's ms per forward (this host's memory has two speeds: compare round by round)")
    args = parser.parse_args()
    target = load_target(weights=args.weights).decoder
    target.pack_weights()
    this = target.row_exact
    builds = {}
    for spec in args.builds.split(","):
        label, _, path = spec.partition("=")
        if path == "plain":
            builds[label] = this.same_streams(this.library, this.path, lane_packs=False)
        elif path == "grouped":  # this build with the 4-bit quads off: its own library copy, G4 and dense copies
            copy = Path(tempfile.mkdtemp()) / this.path.name
            shutil.copy(this.path, copy)
            other = builds[label] = this.same_streams(ctypes.CDLL(str(copy)), copy)
            other._dense, other._grouped = {}, {}
            other.set_quads(False)
        else:
            builds[label] = this if label == "this" and not path else this.same_streams(ctypes.CDLL(path), Path(path))
    generator = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    sizes = [int(n) for n in args.rows.split(",")]
    cache = target.new_cache(args.context + max(sizes))
    if args.context:
        target(torch.randint(0, vocab, (1, args.context), generator=generator), cache=cache)
        cache.commit()
    ids = {n: torch.randint(0, vocab, (n,), generator=generator) for n in sizes}
    times, logits = {}, {}
    for round_ in range(args.rounds):
        order = list(builds.items()) if round_ % 2 == 0 else list(builds.items())[::-1]
        for n in sizes:
            for label, kernels in order:
                target.row_exact, target._layer_table = kernels, None  # the table of this build's streams

                def forward():
                    (rows, _), = target.forward_rows([SequenceRows(ids[n], cache, last_only=args.last_only)])
                    cache.commit(0)
                    return rows
                logits.setdefault(n, {})[label] = forward()
                started = time.perf_counter()
                for _ in range(3):
                    forward()
                times.setdefault((n, label), []).append((time.perf_counter() - started) / 3 * 1000)
    target.row_exact = this
    if args.raw:
        print(json.dumps({f"{n} rows, {label}": [round(t, 1) for t in times[(n, label)]] for n in sizes for label in builds}))
    unit = median(times[(1, next(iter(builds)))])
    same = all(torch.equal(got, next(iter(by.values()))) for by in logits.values() for got in by.values())
    print(json.dumps({"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                      "context": args.context, "step_ms": round(unit, 2), "identical": same,
                      "steps": {n: {label: round(median(times[(n, label)]) / unit, 2) for label in builds} for n in sizes}}))


if __name__ == "__main__":
    main()
