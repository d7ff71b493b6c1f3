"""Where the gated default's time goes, step by step, against plain decoding.

Runs AR and a d3d method (default: the gated default, "speculative") interleaved on benchmark
prompts, and groups every verification step by (source, drafts verified): how many there were, what
one cost in AR steps (split into drafting and verification), and how many tokens it committed. A
group whose tokens per step fall below its cost in AR steps loses time against plain decoding; the
last column says how many AR steps it lost (negative: saved) over the whole run.

Usage: python scripts/step_split.py [--temperature 1] [--num-prompts 4] [--max-new-tokens 128]
                                    [--datasets mtbench,math500] [--method speculative]
Prints a Markdown table. Take it on an idle machine: the times are ratios to AR steps measured in
the same process, between the method's own steps.
"""

import argparse
import collections
import statistics

import torch

from d3d.exactness import cpu_name
from d3d.generation import Pipeline
from d3d.prompts import load_dataset, sample_prompts


def split(pipeline: Pipeline, ids: list[int], config, method: str, groups: dict) -> None:
    """Add every verification step of one generation to `groups[(method, source, drafted)]`."""
    previous = None
    for step in pipeline.steps(ids, config, method):
        stats = step.stats
        now = (stats.wall_seconds, stats.draft_seconds, stats.verify_seconds)
        if previous is not None:  # the first step is the prefill
            group = groups[(method, step.source, step.num_drafted)]
            group["steps"] += 1
            group["tokens"] += len(step.tokens)
            for key, before, after in zip(("seconds", "draft", "verify"), previous, now):
                group[key] += after - before
        previous = now


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--datasets", default="mtbench,math500")
    parser.add_argument("--method", default="speculative")
    args = parser.parse_args()
    pipeline = Pipeline.load()
    groups: dict = collections.defaultdict(lambda: collections.Counter())
    for dataset in args.datasets.split(","):
        for prompt in sample_prompts(load_dataset(dataset), args.num_prompts):
            ids = pipeline.encode(prompt.messages) if prompt.messages else pipeline.encode(prompt.text, chat=False)
            for method in ("ar", args.method, "ar", args.method):  # interleaved, twice
                config = pipeline.generation_config(args.max_new_tokens, args.temperature, seed=0)
                split(pipeline, ids, config, method, groups)
    ar = groups[("ar", "none", 0)]
    ar_step = ar["seconds"] / ar["steps"]
    total = {key: sum(g[key] for (m, _, _), g in groups.items() if m == args.method) for key in ("seconds", "tokens")}
    print(f"{cpu_name()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; T = {args.temperature}; {args.datasets}, {args.num_prompts} prompts "
          f"each, {args.max_new_tokens} new tokens; AR step {1000 * ar_step:.2f} ms over {ar['steps']} steps")
    print(f"{args.method}: {total['tokens'] / total['seconds'] * ar_step:.3f}× AR "
          f"({total['tokens'] / total['seconds']:.1f} against {1 / ar_step:.1f} tok/s)\n")
    print("| source | drafts | steps | AR steps per step (draft + verify) | tokens per step | AR steps lost |")
    print("|---|---:|---:|---|---:|---:|")
    for (method, source, drafted), group in sorted(groups.items()):
        if method != args.method:
            continue
        n = group["steps"]
        cost = group["seconds"] / n / ar_step
        lost = group["seconds"] / ar_step - group["tokens"]
        print(f"| {source} | {drafted} | {n} | {cost:.2f} ({group['draft'] / n / ar_step:.2f} + "
              f"{group['verify'] / n / ar_step:.2f}) | {group['tokens'] / n:.2f} | {lost:+.1f} |")
    print(f"\nAR steps lost in all: {statistics.fsum(g['seconds'] for (m, _, _), g in groups.items() if m == args.method) / ar_step - total['tokens']:+.1f} "
          f"of {total['tokens']} tokens")


if __name__ == "__main__":
    main()
