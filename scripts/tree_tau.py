"""Would token trees pay? Teacher-forced τ of a D3D drafter's block verified as a chain or as a tree.

A block drafter scores every draft position in one pass, each without knowing the drafts before it
(like Medusa's heads), so its later drafts are rarely right as a chain. A token tree verifies
several candidates per position at once (SpecInfer, Medusa): the target keeps the longest
root-to-node path it agrees with. This script measures, on target-generated sequences, the rank of
each true token in the drafter's row for its position, builds the best tree of N nodes from the
rank paths of one half of the blocks (the most frequent rank prefixes: a prefix is never rarer
than its extension, so the top N form a tree) and reports τ (bonus included) on the other half,
beside the chain of the same number of drafts. Nothing here decodes; pair τ with the verification
costs `d3d doctor` prints to see whether a tree pays on this machine.

    python scripts/tree_tau.py --drafter d3d/drafters/smollm2-135m-instruct --data data/smollm2-wide \
        --first 5000 --sequences 200
"""

from __future__ import annotations

import argparse
import collections
import random

import torch

from d3d.drafter import Drafter
from d3d.loading import load_target
from d3d.train.batch import IGNORE, collate, pack_example, sample_anchors
from d3d.train.trainer import load_sequences

TOP = 10  # ranks beyond this count as a miss


def label_ranks(drafter: Drafter, sequences: list[tuple[list[int], int]], anchors: int, seed: int) -> torch.Tensor:
    """(blocks, B-1) rank of each draft position's true token in the drafter's row; -1 beyond TOP or past the end."""
    rng, size = random.Random(seed), drafter.block_size
    ranks = []
    for start in range(0, len(sequences), 4):
        examples, counts = [], []
        for tokens, response_start in sequences[start:start + 4]:
            chosen = sample_anchors(len(tokens), response_start, anchors, rng)
            if chosen:
                examples.append(pack_example(tokens, response_start, chosen, size, drafter.config.mask_token_id,
                                             drafter.config.block_attention))
                counts.append(len(chosen))
        hidden = drafter.packed_hidden(collate(examples))
        for row, (example, count) in enumerate(zip(examples, counts)):
            block_rows = example.is_block.nonzero()[:, 0]
            logits = drafter.logits(hidden[row, block_rows]).view(count, size, -1)[:, drafter.draft_rows]
            labels = example.labels[block_rows].view(count, size)[:, drafter.draft_rows]
            match = logits.float().topk(TOP, -1).indices == labels[..., None]  # (count, B-1, TOP)
            rank = torch.where(match.any(-1), match.int().argmax(-1), -1)
            ranks.append(rank.masked_fill(labels == IGNORE, -1))
    return torch.cat(ranks)


def rank_prefixes(ranks: list[int]) -> list[tuple[int, ...]]:
    """The tree nodes a block's true path passes through, root first, until its first miss."""
    path = []
    for depth, rank in enumerate(ranks):
        if rank < 0:
            break
        path.append(tuple(ranks[:depth + 1]))
    return path


def accepted(path: list[tuple[int, ...]], tree: set[tuple[int, ...]]) -> int:
    depth = 0
    for node in path:
        if node not in tree:
            break
        depth = len(node)
    return depth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--data", required=True, help="a `d3d data` folder")
    parser.add_argument("--first", type=int, default=0, help="skip the data's first N sequences (the training set)")
    parser.add_argument("--sequences", type=int, default=200)
    parser.add_argument("--anchors", type=int, default=8, help="blocks per sequence")
    parser.add_argument("--sizes", default="1,2,3,4,6,8,12,16")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    target = load_target("default", torch.bfloat16)
    drafter = Drafter.from_pretrained(args.drafter, target.decoder, target.fingerprint)
    sequences = load_sequences(args.data, 512)[args.first:args.first + args.sequences]
    ranks = label_ranks(drafter, sequences, args.anchors, seed=0)
    paths = [rank_prefixes(r) for r in ranks.tolist()]
    build, test = paths[:len(paths) // 2], paths[len(paths) // 2:]
    print(f"{ranks.shape[0]} blocks; true token within the drafter's top 1 / 2 / 4 / 8, by draft position:")
    for position in range(min(4, ranks.shape[1])):
        r = ranks[:, position]
        shares = " / ".join(f"{((r >= 0) & (r < k)).float().mean().item():.3f}" for k in (1, 2, 4, 8))
        print(f"  draft {position + 1}: {shares}")
    counts = collections.Counter(node for path in build for node in path)
    order = sorted(counts, key=lambda node: (-counts[node], len(node), node))
    print("nodes  tau (tree)  tau (chain of as many drafts)")
    for size in (int(x) for x in args.sizes.split(",")):
        tree, chain = set(order[:size]), {(0,) * d for d in range(1, size + 1)}
        tau_tree = 1 + sum(accepted(p, tree) for p in test) / len(test)
        tau_chain = 1 + sum(accepted(p, chain) for p in test) / len(test)
        print(f"{size:5d}  {tau_tree:10.3f}  {tau_chain:10.3f}")


if __name__ == "__main__":
    main()
