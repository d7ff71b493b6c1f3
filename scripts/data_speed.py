"""`d3d data`'s generation speed: the continuous batch it decodes in — one over all shards
(`shards_in_order`, "across-W"), or one per shard ("continuous-W", as until 2026-12-03) — against
the static batches it used before (`generate_batch`: left padding, finished rows dropped), on the same
prompts in shards of --shard-size (each sorted by length, as `d3d data` orders a shard), interleaved
in one process, with the share of responses that are identical.

    python scripts/data_speed.py --data data/smollm2 --prompts 192 --max-new-tokens 128 --widths 32,64

--data is a `d3d data` folder (its prompts.jsonl is read, nothing is written). Prints one JSON line
per method, then one JSON document with all of them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from d3d.loading import load_target
from d3d.train.data import DataConfig, generate_batch, generate_continuous, shards_in_order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a `d3d data` folder (its prompts.jsonl)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--shard-size", type=int, default=64, help="prompts per shard (`d3d data --shard-size`)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--static-batch", type=int, default=32, help="rows of each static batch")
    parser.add_argument("--widths", default="32", help="continuous batch widths, comma-separated")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (the best of each is kept)")
    args = parser.parse_args()
    target = load_target(dtype=torch.bfloat16)
    lines = (Path(args.data) / "prompts.jsonl").read_text().splitlines()[:args.prompts]
    records = [json.loads(line) for line in lines]
    shards = {i: sorted(records[at:at + args.shard_size], key=lambda p: len(p["prompt_ids"]))  # as a shard orders them
              for i, at in enumerate(range(0, len(records), args.shard_size))}
    prompts = [p["prompt_ids"] for shard in shards.values() for p in shard]
    by_shard = [[p["prompt_ids"] for p in shard] for shard in shards.values()]
    eos, size = target.eos_token_ids, args.static_batch

    def static():
        return [g for shard in by_shard for i in range(0, len(shard), size)
                for g in generate_batch(target.decoder, shard[i:i + size], args.max_new_tokens, eos)]

    def across(width: int):
        config = DataConfig(max_new_tokens=args.max_new_tokens, batch_size=width, shard_size=args.shard_size)
        return [g for _, shard in shards_in_order(target.decoder, shards, config, eos) for g in shard]

    methods = {f"static-{size}": static}
    for width in map(int, args.widths.split(",")):
        methods[f"continuous-{width}"] = (lambda w: lambda: [g for shard in by_shard for g in generate_continuous(
            target.decoder, shard, args.max_new_tokens, eos, 0, w)])(width)
        methods[f"across-{width}"] = (lambda w: lambda: across(w))(width)
    generate_continuous(target.decoder, prompts[:4], 8, eos, 0, 4)  # warm-up: weights packed, kernels built
    generate_batch(target.decoder, prompts[:4], 8, eos)
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    responses: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, generate in methods.items():
            started = time.perf_counter()
            responses[name] = [g.response_ids for g in generate()]
            seconds[name].append(time.perf_counter() - started)
    reference = responses[f"static-{size}"]
    rows = []
    for name in methods:
        tokens = sum(map(len, responses[name]))
        rows.append({"method": name, "prompts": len(prompts), "tokens": tokens, "seconds": round(min(seconds[name]), 2),
                     "tokens_per_second": round(tokens / min(seconds[name]), 1),
                     "identical_to_static": f"{sum(a == b for a, b in zip(responses[name], reference))}/{len(prompts)}"})
        print(json.dumps(rows[-1]))
    print(json.dumps({"cpu_threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens, "methods": rows}))


if __name__ == "__main__":
    main()
