"""Where a forward of the target spends its time: each stage of the fused C forward (summed over
the layers, timed by thread 0 after each stage's barrier), the output projection, and the rest
(Python, embedding, allocation) by difference — and attention's passes within "attention" (scores,
softmax, weighted sums; on AMX tiles, for many query heads, the last two as one: "softmax_and_sums").
One-token step and 17-token verification, after a 256-token context
(--context).

Usage: python scripts/profile_step.py [--dtype bfloat16] [--weights stored|dequantized] [--repeats 20] [--rows 1,17]
       [--context 256]
(prints one JSON line)
"""

import argparse
import ctypes
import json
import time

import torch

from d3d.kernels import build
from d3d.loading import load_target


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rows", default="1,17", help="forward sizes to profile, comma-separated")
    parser.add_argument("--context", type=int, default=256, help="tokens in the cache before the profiled forwards")
    parser.add_argument("--weights", default="stored", help="how the kernels read the weights (d3d.quantized.WEIGHTS)")
    args = parser.parse_args()
    target = load_target(dtype=getattr(torch, args.dtype), weights=args.weights)
    decoder = target.decoder
    path = build(profile=True)  # the same kernels, with stage timers compiled in
    kernels = decoder.row_exact = decoder.row_exact.same_streams(ctypes.CDLL(str(path)), path)
    decoder.pack_weights()
    head_seconds = 0.0
    linear = kernels.linear

    def timed_linear(*call_args):  # after the fused forward, only the output projection calls it
        nonlocal head_seconds
        started = time.perf_counter()
        result = linear(*call_args)
        head_seconds += time.perf_counter() - started
        return result

    kernels.linear = timed_linear
    generator = torch.Generator().manual_seed(0)
    sizes = [int(rows) for rows in args.rows.split(",")]
    cache = decoder.new_cache(args.context + max(sizes))
    decoder(torch.randint(0, decoder.config.vocab_size, (1, args.context), generator=generator), cache=cache)
    cache.commit()
    result = {"context": args.context, "dtype": args.dtype, "weights": target.weights, "threads": torch.get_num_threads()}
    for rows in sizes:
        ids = torch.randint(0, decoder.config.vocab_size, (1, rows), generator=generator)
        for _ in range(3):
            decoder(ids, cache=cache)
            cache.commit(0)
        kernels.stage_seconds(reset=True)
        kernels.attention_pass_seconds(reset=True)
        head_seconds = 0.0
        started = time.perf_counter()
        for _ in range(args.repeats):
            decoder(ids, cache=cache)
            cache.commit(0)
        total = (time.perf_counter() - started) / args.repeats * 1000
        shares = {name: round(seconds / args.repeats * 1000, 2)
                  for name, seconds in kernels.stage_seconds().items()}
        shares["output_projection"] = round(head_seconds / args.repeats * 1000, 2)
        shares["other"] = round(total - sum(shares.values()), 2)
        result[f"rows_{rows}"] = {"total_ms": round(total, 2), **shares}
        passes = {name: round(seconds / args.repeats * 1000, 2) for name, seconds in kernels.attention_pass_seconds().items()}
        if any(passes.values()):  # attention's passes, within "attention"
            result[f"rows_{rows}"]["attention_passes"] = passes
    print(json.dumps(result))


if __name__ == "__main__":
    main()
