"""Time the target's one-token step and a 17-token verification forward, and check they agree bit for bit.

Usage: python scripts/step_costs.py [--dtype bfloat16|float32] [--weights stored|dequantized|q8_0|…] [--context 256]
       [--repeats 15] [--threads N]
Prints one JSON line: the step's median against the fastest read of its bytes (`step_over_floor`,
the pessimistic form: every slow moment of the host counts against the step), and the two
alternated read for read (`…_interleaved`: medians, and fastest against fastest). Works on any d3d checkout (PYTHONPATH=OTHER_CHECKOUT to time another
version on the same machine), so before/after figures come from the same script.
"""

import argparse
import contextlib
import json
import platform
import time

import torch

from d3d.loading import load_target


def read_buffer(num_bytes: int) -> torch.Tensor:
    """What the floor reads: that many bytes of fp32 ones in huge pages."""
    try:
        from d3d.kernels.packing import HugePageArena
        return HugePageArena().empty((num_bytes // 4,), torch.float32).fill_(1.0)
    except ImportError:  # a checkout from before the arena moved
        return torch.ones(num_bytes // 4)


def floor_ms(num_bytes: int, repeats: int = 15) -> float:
    """The bandwidth floor: the fastest plain read (a sum, both threads) of that many bytes in huge pages."""
    buffer = read_buffer(num_bytes)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return 1000 * best


def interleaved(fn, num_bytes: int, repeats: int) -> dict[str, float]:
    """`fn` and the floor's read of `num_bytes` alternated `repeats` times (after 3 of each): the ratio
    of their medians and of their fastest — the host's memory speed moves within seconds here, and
    the step's median against the floor's fastest (`floor_ms`) counts every slow moment against it."""
    buffer = read_buffer(num_bytes)
    times: dict[str, list[float]] = {"step": [], "floor": []}
    for i in range(repeats + 3):
        for name, run in (("step", fn), ("floor", buffer.sum)):
            started = time.perf_counter()
            run()
            if i >= 3:
                times[name].append(time.perf_counter() - started)
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    return {"median_over_median": round(median["step"] / median["floor"], 2),
            "best_over_best": round(min(times["step"]) / min(times["floor"]), 2)}


def median_ms(fn, repeats: int) -> float:
    times = []
    for i in range(repeats + 3):
        started = time.perf_counter()
        fn()
        if i >= 3:  # warm-up excluded
            times.append(time.perf_counter() - started)
    return 1000 * sorted(times)[len(times) // 2]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch / OpenMP threads (0: torch's default)")
    parser.add_argument("--weights", default="stored", help="how the kernels read the weights (d3d.quantized.WEIGHTS)")
    parser.add_argument("--target", default=None, help="a GGUF file or HF folder (default: the embedded SmolLM2)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        target = load_target(args.target, dtype=getattr(torch, args.dtype), weights=args.weights)
    except TypeError:  # a checkout from before --weights
        target = load_target(dtype=getattr(torch, args.dtype))
    decoder = target.decoder
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, decoder.config.vocab_size, (1, args.context), generator=generator)
    block = torch.randint(0, decoder.config.vocab_size, (1, 17), generator=generator)
    cache = decoder.new_cache(args.context + 18)  # 17 single steps, then a greedy step after them
    decoder(prompt, cache=cache)
    cache.commit()

    def forward(rows: int):
        decoder(block[:, :rows], cache=cache)
        cache.commit(0)

    # timed as a generation runs its forwards: holding the weights (the layer table checked once, not at
    # every forward; checkouts from before the hold check it every time)
    holding = getattr(decoder, "holding_weights", contextlib.nullcontext)()
    holding.__enter__()

    step, verify = median_ms(lambda: forward(1), args.repeats), median_ms(lambda: forward(17), args.repeats)
    together = decoder(block, cache=cache)[0]
    cache.commit(0)
    singles = []
    for i in range(17):
        singles.append(decoder(block[:, i:i + 1], cache=cache)[0, 0])
        cache.commit()
    identical_rows = int((together == torch.stack(singles)).all(-1).sum())
    weights = decoder.linear_weights() if hasattr(decoder, "linear_weights") else {}
    kernels = decoder.row_exact
    one_row = getattr(kernels, "one_row_stream", None) or getattr(kernels, "stream", None)  # (older checkouts)
    read = sum(one_row(w).nbytes for w in weights.values()) if kernels is not None and weights else 0
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    result = {"cpu": cpu, "threads": torch.get_num_threads(), "dtype": args.dtype,
              "weights": getattr(target, "weights", "") or args.dtype, "context": args.context,
              "step_ms": round(step, 2), "verify17_ms": round(verify, 2),
              "verify17_in_steps": round(verify / step, 2), "ar_tokens_per_s": round(1000 / step, 1),
              "rows_identical_to_steps": f"{identical_rows}/17"}
    if read:
        floor = floor_ms(read)
        result.update(weight_mb_read=round(read / 1e6, 1), floor_ms=round(floor, 2), step_over_floor=round(step / floor, 2),
                      step_over_floor_interleaved=interleaved(lambda: forward(1), read, args.repeats))
    # The step greedy decoding takes (T = 0): the last hidden state's argmax through the certified greedy
    # head where the kernels have one (its codes, scales and errors read instead of the head's stream).
    greedy = getattr(kernels, "greedy", None)
    head = greedy.head(decoder.head_weight) if greedy is not None and read else None
    if head is not None and 1 in getattr(head, "rows", range(1, getattr(head, "max_rows", 0) + 1)):  # (older: max_rows)
        def greedy_step():
            hidden, _ = decoder.final_hidden(block[:, :1], cache=cache)
            decoder.greedy_ids(hidden[0])
            cache.commit(0)

        greedy_ms = median_ms(greedy_step, args.repeats)
        greedy_read = read - one_row(decoder.head_weight).nbytes + (
            head.bytes_read() if hasattr(head, "bytes_read")  # (older checkouts: read_of, or all they hold)
            else getattr(type(head), "read_of", type(head).bytes_of)(*decoder.head_weight.shape))
        greedy_floor = floor_ms(greedy_read)
        result.update(greedy_step_ms=round(greedy_ms, 2), greedy_mb_read=round(greedy_read / 1e6, 1),
                      greedy_floor_ms=round(greedy_floor, 2), greedy_step_over_floor=round(greedy_ms / greedy_floor, 2),
                      greedy_step_over_floor_interleaved=interleaved(greedy_step, greedy_read, args.repeats))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
