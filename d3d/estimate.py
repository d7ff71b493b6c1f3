"""Teacher-forced acceptance length: τ estimated without a decoding loop.

Over the target's own greedy responses, the drafter drafts a block at each sampled anchor in one
packed pass (clean context + all-mask blocks, the layout of `d3d.train.batch`). Under greedy
verification the target would accept the drafts while they equal its own next tokens — which,
for target-generated text, are the labels. So per block the accepted prefix is the number of
leading rows whose argmax equals the label, and τ = 1 + that (bonus token included), averaged over
blocks. Used for training curves and to rank layers when pruning.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from d3d.drafter import Drafter
from d3d.train.batch import IGNORE, collate, pack_example, sample_anchors


@dataclass
class TauEstimate:
    tau: float  # mean 1 + accepted drafts per block (bonus token included)
    acceptance_rate: list[float]  # [i]: P(draft i+1 accepted | drafts 1..i accepted)
    num_blocks: int


def accepted_prefix(predictions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(N, K) predicted and label ids → (N,) length of the leading run of matches (IGNORE stops it)."""
    match = (predictions == labels) & (labels != IGNORE)
    return match.int().cumprod(dim=-1).sum(-1)


@torch.no_grad()
def teacher_forced_tau(drafter: Drafter, sequences: list[tuple[list[int], int]], anchors_per_sequence: int = 8,
                       seed: int = 0, batch_size: int = 4) -> TauEstimate:
    """τ of `drafter` on (tokens, response_start) sequences at seeded anchors."""
    rng = random.Random(seed)
    size, mask_id = drafter.block_size, drafter.config.mask_token_id
    accepted_all: list[torch.Tensor] = []
    for start in range(0, len(sequences), batch_size):
        examples, block_counts = [], []
        for tokens, response_start in sequences[start:start + batch_size]:
            anchors = sample_anchors(len(tokens), response_start, anchors_per_sequence, rng)
            if not anchors:
                continue
            examples.append(pack_example(tokens, response_start, anchors, size, mask_id,
                                         drafter.config.block_attention, labels_shift=drafter.config.labels))
            block_counts.append(len(anchors))
        if not examples:
            continue
        device = drafter.decoder.device
        batch = {k: v.to(device) for k, v in collate(examples).items()}
        embeds = drafter.embed(batch["input_ids"])
        hidden = drafter.decoder.hidden_states(embeds, batch["positions"], None, batch["mask"])
        for row, (example, count) in enumerate(zip(examples, block_counts)):
            block_rows = example.is_block.nonzero()[:, 0].to(device)
            logits = drafter.logits(hidden[row, block_rows])  # (count·B, V)
            predictions = logits.argmax(-1).view(count, size)[:, drafter.draft_rows]  # rows verified as drafts
            labels = example.labels.to(device)[block_rows].view(count, size)[:, drafter.draft_rows]
            accepted_all.append(accepted_prefix(predictions, labels))
    if not accepted_all:
        return TauEstimate(1.0, [], 0)
    accepted = torch.cat(accepted_all)
    rates = []
    for i in range(size - 1):
        reached = (accepted >= i).sum().item()
        rates.append((accepted >= i + 1).sum().item() / reached if reached else 0.0)
    return TauEstimate(1.0 + accepted.float().mean().item(), rates, accepted.numel())
