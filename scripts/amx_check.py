"""AMX tiles against the AVX-512 path on the real target, in one process, alternated: forward cost by
row count, and every k-row forward checked against k one-token steps on each path.

Usage: python scripts/amx_check.py [--weights stored|dequantized] [--rows 1,2,4,8,16,17,32,64]
       [--context 256] [--rounds 5] [--report FILE.md]
Needs a CPU with AMX-BF16 (Intel Xeon from Sapphire Rapids on); elsewhere it says so and exits 2.
Both paths run the same build: `RowExactKernels.set_amx` switches the process between them (each
reading its own grouped copies), so each round times the AVX-512 path and the tiles back to back
(these machines are shared and noisy: read the ratios).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from d3d.doctor import cpu_flags, time_forward
from d3d.exactness import check_row_invariance, cpu_name
from d3d.loading import load_target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="stored", choices=["stored", "dequantized"])
    parser.add_argument("--rows", default="1,2,4,8,16,17,32,64")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--report", type=Path)
    args = parser.parse_args()
    try:
        rows = sorted({int(r) for r in args.rows.split(",")})
    except ValueError:
        parser.error(f"--rows takes row counts separated by commas, not {args.rows!r}")
    if not rows or rows[0] < 1:
        parser.error("--rows: row counts from 1")
    target = load_target(dtype=torch.bfloat16, weights=args.weights)
    decoder = target.decoder
    kernels = decoder.row_exact
    if kernels is None or not kernels.amx:
        why = kernels.amx_refused if kernels is not None and kernels.amx_refused else \
            "this CPU, build or kernel has no AMX tiles (see `d3d doctor`)"
        print(f"amx_check: AMX tiles are not in use: {why}", file=sys.stderr)
        return 2
    times: dict[str, dict[int, list[float]]] = {"avx512": {r: [] for r in rows}, "amx": {r: [] for r in rows}}
    exact: dict[str, dict[int, bool]] = {}
    logits: dict[str, torch.Tensor] = {}
    probe = torch.randint(0, decoder.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    try:
        for path, on in (("avx512", 0), ("amx", 1)):
            kernels.set_amx(on)
            mismatched = check_row_invariance(decoder, max_rows=min(33, rows[-1])).mismatched_rows
            exact[path] = {r: str(r) not in mismatched for r in rows if r <= 33}
            with torch.no_grad():
                logits[path] = decoder(probe)[0]
        for _ in range(args.rounds):
            for path, on in (("avx512", 0), ("amx", 1)):
                kernels.set_amx(on)
                for r in rows:
                    times[path][r].append(time_forward(decoder, r, args.context, repeats=5))
    finally:
        kernels.set_amx(True)
    median = {path: {r: sorted(v)[len(v) // 2] for r, v in by_rows.items()} for path, by_rows in times.items()}
    lines = [f"CPU: {cpu_name()} ({', '.join(cpu_flags())}), {torch.get_num_threads()} threads; "
             f"target {target.weights}, bf16, after {args.context} tokens; medians of {args.rounds} alternated rounds",
             "", "| rows | AVX-512 ms | steps | AMX ms | steps | AVX-512 / AMX | k rows = k steps (AVX-512 / AMX) |",
             "|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        a, t = median["avx512"][r], median["amx"][r]
        agree = " / ".join("yes" if exact[p].get(r, True) else "**NO**" for p in ("avx512", "amx")) if r <= 33 else "-"
        lines.append(f"| {r} | {a:.2f} | {a / median['avx512'][rows[0]]:.2f} | {t:.2f} | {t / median['amx'][rows[0]]:.2f} "
                     f"| {a / t:.2f}x | {agree} |")
    same = torch.equal(logits["avx512"], logits["amx"])
    lines += ["", f"The two paths' logits over a 32-token prompt: {'the same bits' if same else 'other bits'} "
              f"(largest difference {float((logits['avx512'].float() - logits['amx'].float()).abs().max()):.3g}); "
              + ("so a process could mix them by row count." if same else "so a process keeps to one of them.")]
    text = "\n".join(lines)
    print(text)
    if args.report:
        args.report.write_text(text + "\n")
    return 0 if all(all(v.values()) for v in exact.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
