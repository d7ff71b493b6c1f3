"""Where a forward of the target spends its time: each row-exact kernel's share, the rest (Python,
PyTorch glue) by difference. One-token step and 17-token verification, after a 256-token context.

Usage: python scripts/profile_step.py [--dtype bfloat16] [--repeats 20]   (prints one JSON line)
"""

import argparse
import collections
import json
import time

import torch

from d3d.loading import load_target

KERNELS = ("linear", "attention", "rms_norm", "silu_mul", "rope_store")


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    decoder = load_target(dtype=getattr(torch, args.dtype)).decoder
    kernels = decoder.row_exact
    spent: collections.Counter[str] = collections.Counter()
    for name in KERNELS:  # wrap each kernel of this process's instance with a timer
        function = getattr(kernels, name)

        def timed(*call_args, function=function, name=name):
            started = time.perf_counter()
            result = function(*call_args)
            spent[name] += time.perf_counter() - started
            return result

        setattr(kernels, name, timed)
    generator = torch.Generator().manual_seed(0)
    cache = decoder.new_cache(256 + 17)
    decoder(torch.randint(0, decoder.config.vocab_size, (1, 256), generator=generator), cache=cache)
    cache.commit()
    result = {"dtype": args.dtype, "threads": torch.get_num_threads()}
    for rows in (1, 17):
        ids = torch.randint(0, decoder.config.vocab_size, (1, rows), generator=generator)
        for _ in range(3):
            decoder(ids, cache=cache)
            cache.commit(0)
        spent.clear()
        started = time.perf_counter()
        for _ in range(args.repeats):
            decoder(ids, cache=cache)
            cache.commit(0)
        total = (time.perf_counter() - started) / args.repeats * 1000
        shares = {name: round(spent[name] / args.repeats * 1000, 2) for name in KERNELS}
        shares["other"] = round(total - sum(shares.values()), 2)
        result[f"rows_{rows}"] = {"total_ms": round(total, 2), **shares}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
