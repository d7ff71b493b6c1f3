"""Time the target against the context length: a prompt's prefill (the time to the first token) and,
after that prompt, a one-token step and a verification of 8 drafts.

Usage: python scripts/context_costs.py [--contexts 256,1024,2048,4096,7168] [--dtype bfloat16]
       [--weights stored|dequantized|…] [--repeats 7] [--plot docs/context-costs.png] [--interleaved 60]
Prints one JSON line per context. Works on any d3d checkout (PYTHONPATH=OTHER_CHECKOUT times
another version on the same machine), so before/after figures come from the same script. The
prompt is random token ids: a forward's cost does not depend on which tokens it reads. With
`--interleaved N`, N more rounds of one one-token step after each context in turn end it: each
context's median step and its decoding speed against the first context's (on a shared, noisy machine
the per-context lines above are minutes apart; these are not).
"""

import argparse
import json
import platform
import time

import torch

from d3d.loading import load_target


def median_ms(fn, repeats: int, warm_up: int = 2) -> float:
    times = []
    for i in range(repeats + warm_up):
        started = time.perf_counter()
        fn()
        if i >= warm_up:
            times.append(time.perf_counter() - started)
    return 1000 * sorted(times)[len(times) // 2]


def cpu_name() -> str:
    return next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                platform.processor())


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [row["context"] for row in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(contexts, [row["prefill_tokens_per_s"] for row in rows], "o-")
    left.set(xlabel="prompt tokens", ylabel="prefill tokens/s", title="prefill", ylim=(0, None))
    right.plot(contexts, [row["step_ms"] for row in rows], "o-", label="one-token step")
    right.plot(contexts, [row["verify8_ms"] for row in rows], "s-", label="verify 8 drafts (9 rows)")
    right.set(xlabel="context tokens", ylabel="ms", title="decoding", ylim=(0, None))
    right.legend()
    first = rows[0]
    figure.suptitle(f"{first['cpu']}, {first['threads']} threads, {first['dtype']}, weights {first['weights']}"
                    " (scripts/context_costs.py)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="256,1024,2048,4096,7168")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--weights", default="stored")
    parser.add_argument("--repeats", type=int, default=7, help="repeats of each decoding forward")
    parser.add_argument("--prefill-repeats", type=int, default=1)
    parser.add_argument("--plot", default="", help="write a PNG of the curves here")
    parser.add_argument("--interleaved", type=int, default=0,
                        help="then this many rounds of a one-token step after each context in turn")
    args = parser.parse_args()
    try:
        target = load_target(dtype=getattr(torch, args.dtype), weights=args.weights)
    except TypeError:  # a checkout from before --weights
        target = load_target(dtype=getattr(torch, args.dtype))
    decoder = target.decoder
    generator = torch.Generator().manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    prompt = torch.randint(0, decoder.config.vocab_size, (1, max(contexts)), generator=generator)
    block = torch.randint(0, decoder.config.vocab_size, (1, 9), generator=generator)
    decoder(prompt[:, :64], cache=decoder.new_cache(80), last_only=True)  # warm-up: kernels, streams, pages
    rows, caches = [], []
    for context in contexts:
        cache = decoder.new_cache(context + 9)

        def prefill():
            cache.rewind(cache.length)
            decoder(prompt[:, :context], cache=cache, last_only=True)
            cache.commit()

        prefill_ms = median_ms(prefill, args.prefill_repeats, warm_up=0)

        def forward(rows: int):
            decoder(block[:, :rows], cache=cache)
            cache.commit(0)

        step, verify = median_ms(lambda: forward(1), args.repeats), median_ms(lambda: forward(9), args.repeats)
        row = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "dtype": args.dtype,
               "weights": getattr(target, "weights", "") or args.dtype, "context": context,
               "prefill_s": round(prefill_ms / 1000, 2), "prefill_tokens_per_s": round(context / prefill_ms * 1000, 1),
               "step_ms": round(step, 2), "decode_tokens_per_s": round(1000 / step, 1),
               "verify8_ms": round(verify, 2), "verify8_in_steps": round(verify / step, 2)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.interleaved:
            caches.append(cache)
    if args.interleaved:
        times: list[list[float]] = [[] for _ in contexts]
        for _ in range(args.interleaved):
            for cache, kept in zip(caches, times):
                started = time.perf_counter()
                decoder(block[:, :1], cache=cache)
                cache.commit(0)
                kept.append(1000 * (time.perf_counter() - started))
        steps = [sorted(kept)[len(kept) // 2] for kept in times]
        print(json.dumps({"interleaved_rounds": args.interleaved,
                          "step_ms": {c: round(ms, 2) for c, ms in zip(contexts, steps)},
                          "speed_vs_first": {c: round(steps[0] / ms, 3) for c, ms in zip(contexts, steps)}}))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
