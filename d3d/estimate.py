"""Teacher-forced acceptance length: τ estimated without a decoding loop.

Over the target's own greedy responses, the drafter drafts a block at each sampled anchor in one
packed pass (clean context + all-mask blocks, the layout of `d3d.train.batch`). Under greedy
verification the target would accept the drafts while they equal its own next tokens — which,
for target-generated text, are the labels. So per block the accepted prefix is the number of
leading rows whose argmax equals the label, and τ = 1 + that (bonus token included), averaged over
blocks. An AR drafter (kind "ar") reads one causal pass over the clean sequence instead: its row
a+i predicts x_{a+i+1} from the true prefix, which under greedy verification is the prefix it
would have drafted from while its drafts were accepted — so the same count is its τ at k = B-1.
With the target's distributions (`d3d.train.distill`) it also estimates τ at T = 1, where
a draft is accepted with probability 1 − TV(p, q). Used for training curves and to rank layers
when pruning.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from d3d.config import ConfigError
from d3d.dflash import attach_features
from d3d.drafter import Drafter
from d3d.models import Decoder
from d3d.train.batch import IGNORE, collate, pack_example, sample_anchors
from d3d.train.distill import TopK


@dataclass
class TauEstimate:
    tau: float  # mean 1 + accepted drafts per block (bonus token included)
    acceptance_rate: list[float]  # [i]: P(draft i+1 accepted | drafts 1..i accepted)
    num_blocks: int
    tau_t1: float | None = None  # at temperature 1, from the target's distributions (a lower bound)


def accepted_prefix(predictions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(N, K) predicted and label ids → (N,) length of the leading run of matches (IGNORE stops it)."""
    match = (predictions == labels) & (labels != IGNORE)
    return match.int().cumprod(dim=-1).sum(-1)


def sampled_acceptance(logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """(N, V) drafter logits and the target's top-k (N, k) → (N,) Σ_v min(p_v, q_v) over the top-k:
    the chance a draft sampled at T = 1 is accepted (1 − TV(p, q)), less the unknown tail's share."""
    q = torch.softmax(logits.float(), dim=-1).gather(-1, teacher_ids.long())
    return torch.minimum(teacher_logprobs.exp(), q).sum(-1)


@torch.no_grad()
def teacher_forced_tau(drafter: Drafter, sequences: list[tuple[list[int], int]], anchors_per_sequence: int = 8,
                       seed: int = 0, batch_size: int = 4, teachers: list[TopK] | None = None,
                       target: Decoder | None = None) -> TauEstimate:
    """τ of `drafter` on (tokens, response_start) sequences at seeded anchors; with the target's
    distributions over the responses (`teachers`, one per sequence), also τ at T = 1: per block
    1 + Σ_k Π_{i≤k} α_i with α_i = Σ_v min(p_v, q_v) for draft i (a lower bound: p's tail beyond
    its top-k is left out). A DFlash-style drafter also needs the `target` whose hidden states it reads."""
    rng = random.Random(seed)
    size, mask_id = drafter.block_size, drafter.config.mask_token_id
    accepted_all: list[torch.Tensor] = []
    sampled_all: list[torch.Tensor] = []  # expected accepted drafts per block at T = 1
    for start in range(0, len(sequences), batch_size):
        examples, block_counts, anchors_of = [], [], []
        for index, (tokens, response_start) in enumerate(sequences[start:start + batch_size], start):
            anchors = sample_anchors(len(tokens), response_start, anchors_per_sequence, rng)
            if not anchors:
                continue
            teacher = teachers[index] if teachers is not None else None
            anchors_of.append(anchors)
            blocks = [] if drafter.config.kind == "ar" else anchors  # an AR drafter reads the clean rows alone
            examples.append(pack_example(tokens, response_start, blocks, size, mask_id,
                                         drafter.config.block_attention, labels_shift=drafter.config.labels,
                                         teacher=teacher))
            block_counts.append(len(anchors))
        if not examples:
            continue
        device = drafter.decoder.device
        batch = {k: v.to(device) for k, v in collate(examples).items()}
        if drafter.feature_projection is not None:  # DFlash-style: the clean rows are the target's hidden states
            if target is None:
                raise ConfigError("a DFlash-style drafter's τ needs the target, whose hidden states it reads")
            batch = attach_features(batch, [e.input_ids[~e.is_block].tolist() for e in examples], target,
                                    drafter.config.feature_layers)
        hidden = drafter.packed_hidden(batch)
        for row, (example, count) in enumerate(zip(examples, block_counts)):
            if drafter.config.kind == "ar":  # draft i of the block at anchor a: clean row a+i
                length = example.input_ids.shape[0]  # clean rows only
                rows = (torch.tensor(anchors_of[row])[:, None] + torch.arange(size - 1)).clamp_max(length - 1)
                rows = rows.to(device)  # (count, B-1); past the end: the last row, whose label is IGNORE
                logits = drafter.logits(hidden[row, :length])[rows]  # (count, B-1, V)
            else:
                block_rows = example.is_block.nonzero()[:, 0].to(device)
                rows = block_rows.view(count, size)[:, drafter.draft_rows]  # rows verified as drafts
                logits = drafter.logits(hidden[row, block_rows]).view(count, size, -1)[:, drafter.draft_rows]
            predictions = logits.argmax(-1)
            labels = example.labels.to(device)[rows]
            accepted_all.append(accepted_prefix(predictions, labels))
            if example.teacher is not None:
                sources = example.teacher_rows.to(device)[rows]
                known = sources >= 0
                alpha = sampled_acceptance(logits[known],
                                           example.teacher.ids.to(device)[sources[known]],
                                           example.teacher.logprobs.to(device)[sources[known]])
                alphas = torch.zeros(sources.shape, device=device).masked_scatter(known, alpha)
                sampled_all.append(alphas.cumprod(-1).sum(-1))  # a draft past the response: α = 0
    if not accepted_all:
        return TauEstimate(1.0, [], 0)
    accepted = torch.cat(accepted_all)
    rates = []
    for i in range(size - 1):
        reached = (accepted >= i).sum().item()
        rates.append((accepted >= i + 1).sum().item() / reached if reached else 0.0)
    tau_t1 = 1.0 + torch.cat(sampled_all).mean().item() if sampled_all else None
    return TauEstimate(1.0 + accepted.float().mean().item(), rates, accepted.numel(), tau_t1)
