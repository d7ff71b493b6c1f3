"""How well the speculation gate spends context lookup, simulated over the target's own greedy answers.

Under greedy decoding the target's output is fixed, so what lookup drafts at any point and how many
of its drafts verification would accept follow from the tokens alone. This decodes each prompt once
with plain decoding, then replays the answer under three policies for lookup's number of drafts,
each step charged the verification costs measured on this machine (`d3d.costs`, at the step's
context length; lookup itself is free):

- `averages`: the gate weighing lookup by its running acceptance averages (before lookup told its
  chances);
- `chances`: the gate weighing the chances lookup gives from its match's length and its n-gram's
  precedent (`d3d.lookup`), as the engine now does;
- `perfect`: each step the k with the most accepted tokens per cost, known in advance (a bound).

It prints tokens committed per one-token step of cost for each (plain decoding: 1.0), and with
`--fit` the maximum-likelihood fits of P(a match of L tokens breaks at the next token) = c / (L + d)
over every lookup along the answers, by the precedent of the match's n-gram and over all (the
module's constants were fitted on `--prompts training`); `--plot` draws the first drafts' hit rates
by match length and precedent beside the module's curves.
Lookup alone, no drafter. The answers are kept in `--answers` (a JSON file, reused when present;
by default under runs/lookup-policy/, named by the prompts asked for).

Usage: python scripts/lookup_policy.py [--prompts bench|training] [--datasets humaneval,mtbench,math500]
                                       [--num-prompts 16] [--max-new-tokens 256] [--answers FILE] [--fit]
                                       [--plot PNG]
(the docs' figures: the defaults; --datasets long4k --num-prompts 4; --prompts training --num-prompts 34 --fit
--plot docs/lookup-chances.png)
"""

import argparse
import itertools
import json
import math
from pathlib import Path

import numpy as np
import torch

from d3d.costs import forward_costs
from d3d.gate import ByContext, SpeculationGate
from d3d.generation import Pipeline
from d3d.lookup import MATCH_REACH, MISS_FIT, LookupConfig, LookupIndex, continuation_chance
from d3d.prompts import load_dataset, sample_prompts
from d3d.sources import LOOKUP_MAX_DRAFTS, LookupSource, common_prefix, default_sources, verify_reach


def training_prompts(count: int):
    """Prompts of `d3d data`'s sources (never a benchmark prompt), past the first 200 of each, in
    shares 12 : 6 : 8 : 8 (34 prompts: the set the chances were fitted on)."""
    from d3d.train.data import math_prompts, sharegpt_prompts, sharegpt_second_turns, stdlib_prompts
    shares = (("sharegpt", sharegpt_prompts(), 12), ("sharegpt-turn2", sharegpt_second_turns(), 6),
              ("stdlib", stdlib_prompts(), 8), ("math", math_prompts(), 8))
    total = sum(share for _, _, share in shares)
    for name, prompts, share in shares:
        for _, messages in itertools.islice(prompts, 200, 200 + max(1, count * share // total)):
            yield name, messages


@torch.no_grad()
def answers(args: argparse.Namespace) -> dict:
    """The prompts' greedy answers and this machine's verification costs (from `--answers` if kept)."""
    path = Path(args.answers)
    if path.exists():
        return json.loads(path.read_text())
    pipeline = Pipeline.load()
    if args.prompts == "training":
        prompts = [(name, pipeline.encode(messages)) for name, messages in training_prompts(args.num_prompts)]
        prompts = [(name, ids) for name, ids in prompts if len(ids) <= 1500]  # long ones are long4k's matter
    else:
        prompts = [(dataset, pipeline.encode(p.messages) if p.messages else pipeline.encode(p.text, chat=False))
                   for dataset in args.datasets.split(",")
                   for p in sample_prompts(load_dataset(dataset), args.num_prompts)]
    runs = []
    for name, ids in prompts:
        config = pipeline.generation_config(args.max_new_tokens, 0.0, seed=0)
        output = [token for step in pipeline.steps(ids, config, "ar") for token in step.tokens]
        runs.append({"dataset": name, "prompt": ids, "output": output})
        print(f"{name}: {len(ids)} prompt tokens, {len(output)} answered", flush=True)
    costs = forward_costs(pipeline.target.decoder, None,
                          verify_reach(default_sources(pipeline.drafter, pipeline.lookup))).by_context("verify")
    kept = {"runs": runs, "verify": {"contexts": list(costs.contexts), "rows": [list(row) for row in costs.rows]}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(kept))
    return kept


def replay(run: dict, verify: ByContext, policy: str) -> tuple[int, float]:
    """(tokens after the first, their cost in one-token steps) of one answer under `policy`."""
    prompt, output = run["prompt"], run["output"]
    gate, source = SpeculationGate({"lookup": [0.0]}, verify), LookupSource(LookupConfig())
    position, cost = 1, 0.0  # the first token is the prefill's
    while position < len(output):
        tokens, future = prompt + output[:position], output[position:]
        wanted = min(LOOKUP_MAX_DRAFTS, len(future) - 1)
        costs = verify.at(len(tokens))
        if wanted <= 0:
            k, chances = 0, None
        elif policy == "perfect":
            chances = None
            drafts = source.index.drafts(tokens, wanted)
            def rate(k: int) -> float:
                return (common_prefix(drafts[:k], future) + 1) / costs[k]
            k = max(range(wanted + 1), key=rate) if drafts else 0
        else:
            chances = source.chances(tokens, wanted) if policy == "chances" else None
            k = gate.num_drafts("lookup", wanted, len(tokens), 0, None, chances)
        drafts = source.index.drafts(tokens, k) if k else []
        accepted = common_prefix(drafts, future)
        cost += costs[len(drafts)] if drafts else 1.0
        gate.record("lookup" if drafts else "none", len(drafts), accepted, len(tokens), chances if drafts else None)
        position += accepted + 1
    return len(output) - 1, cost


def lookups(runs: list[dict]) -> dict[str, list[tuple[int, bool]]]:
    """Every lookup along the answers, (match length, first draft right), by the precedent of the
    match's n-gram, and all of them under "any"."""
    points: dict[str, list[tuple[int, bool]]] = {precedent: [] for precedent in MISS_FIT}
    for run in runs:
        prompt, output = run["prompt"], run["output"]
        index = LookupIndex(LookupConfig())
        for position in range(1, len(output)):
            tokens = prompt + output[:position]
            match = index.match(tokens)
            if match is not None:
                point = (match.length, tokens[match.start] == output[position])
                points["any"].append(point)
                points[index.precedent(tokens)].append(point)
    return points


def fit(runs: list[dict]) -> dict[str, tuple[int, float, float]]:
    """By precedent (and over all lookups, "any"): (lookups, c, d), P(a match of L tokens breaks at
    the next token) = c / (L + d), by maximum likelihood."""
    points = lookups(runs)
    scales = np.arange(1, 301) / 20  # c in steps of 0.05 to 15, d in steps of 0.1 to 15: the whole grid
    fits = {}
    for precedent, some in points.items():
        lengths = np.array([length for length, _ in some], dtype=float)
        right = np.array([r for _, r in some])
        best, best_likelihood = (0.0, 0.0), -math.inf
        for d in np.arange(0, 151) / 10:
            miss = np.clip(scales[:, None] / (lengths[None, :] + d), 0.001, 0.999)
            likelihood = np.where(right[None, :], np.log1p(-miss), np.log(miss)).sum(axis=1)
            if likelihood.max() > best_likelihood:
                best_likelihood, best = likelihood.max(), (float(scales[likelihood.argmax()]), float(d))
        fits[precedent] = (len(some), *best)
    return fits


def plot(runs: list[dict], path: str, title: str) -> None:
    """The first drafts' hit rates by match length (bins) and precedent, and the module's curves."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    bins = [(2, 2), (3, 3), (4, 4), (5, 8), (9, 16), (17, 32), (33, MATCH_REACH)]
    figure, axes = plt.subplots(figsize=(7, 4.2))
    for (precedent, points), color in zip(lookups(runs).items(), ("black", "tab:blue", "tab:green", "tab:red")):
        xs, ys, ns = [], [], []
        for low, high in bins:
            hits = [right for length, right in points if low <= length <= high]
            if hits:
                xs.append((low + high) / 2), ys.append(sum(hits) / len(hits)), ns.append(len(hits))
        axes.scatter(xs, ys, s=[8 + n / 4 for n in ns], color=color, alpha=0.6)
        lengths = range(2, MATCH_REACH + 1)
        axes.plot(lengths, [continuation_chance(length, precedent) for length in lengths], color=color,
                  label=f"{precedent} ({len(points)} lookups)")
    axes.set(xscale="log", xlabel="match length L (tokens agreeing, to 64)", ylabel="first draft right",
             ylim=(0, 1.02), title=title)
    ticks = [2, 3, 4, 8, 16, 32, 64]
    axes.set_xticks(ticks, [str(tick) for tick in ticks])
    axes.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    axes.legend(title="n-gram's precedent: fit (line), data (dots)", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="bench", choices=["bench", "training"])
    parser.add_argument("--datasets", default="humaneval,mtbench,math500", help="with --prompts bench")
    parser.add_argument("--num-prompts", type=int, default=16, help="per dataset (bench), in all (training: 34)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--answers", default="",
                        help="where the answers are kept (default: runs/lookup-policy/, named by the options)")
    parser.add_argument("--fit", action="store_true", help=f"also fit the chances (matches counted to {MATCH_REACH})")
    parser.add_argument("--plot", default="", help="write a PNG of the first drafts' hit rates and the fits here")
    args = parser.parse_args()
    if not args.answers:
        which = "training" if args.prompts == "training" else args.datasets.replace(",", "-")
        args.answers = f"runs/lookup-policy/{which}-{args.num_prompts}-{args.max_new_tokens}.json"
    kept = answers(args)
    verify = ByContext(tuple(kept["verify"]["contexts"]), tuple(tuple(row) for row in kept["verify"]["rows"]))
    for policy in ("averages", "chances", "perfect"):
        tokens, cost = map(sum, zip(*(replay(run, verify, policy) for run in kept["runs"])))
        print(f"{policy:9s} {tokens / cost:.4f} tokens per one-token step of cost ({tokens} tokens)")
    if args.plot:
        plot(kept["runs"], args.plot, f"lookups along SmolLM2-135M-Instruct's greedy answers ({Path(args.answers).stem})")
    if args.fit:
        for precedent, (count, c, d) in fit(kept["runs"]).items():
            print(f"fit, precedent {precedent!r}, {count} lookups: P(miss) = {c} / (L + {d})")


if __name__ == "__main__":
    main()
