"""Training examples for the D3D drafter: one packed forward per sequence.

A sequence x (prompt + the target's response) becomes
    [clean x_0 … x_{L-1} (causal) | block_1 | … | block_A]
where block j = [x_a, MASK × (B-1)] at positions a … a+B-1 for a sampled anchor a. A block sees the
clean tokens strictly before its anchor and (per `block_attention`) itself, never later clean
tokens or other blocks. Labels are shifted by default: block row i predicts x_{a+i+1} (draft
k = i+1); unshifted, row i predicts its own token x_{a+i} (draft k = i; the anchor's row has no
label). Draft k is weighted by exp(-(k-1)/γ). Clean rows predict the next token (the auxiliary AR loss) on the
response only. With `mask_ratio="random"`, a random share of a block's masks is replaced by the
true tokens (denoising from partial blocks); "all" matches one-step drafting. With the target's
distributions (`d3d.train.distill`), every labelled row also points at the distribution its label
was drawn from, for the distillation loss.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

import torch

from d3d.config import BlockAttention, LabelShift
from d3d.train.distill import TopK

IGNORE = -100
MaskRatio = Literal["all", "random"]


@dataclass
class PackedExample:
    input_ids: torch.Tensor  # (T,) clean tokens then blocks; MASK ids inside blocks
    positions: torch.Tensor  # (T,)
    mask: torch.Tensor  # (T, T) bool, True = attend
    labels: torch.Tensor  # (T,) next-token targets, IGNORE where none
    weights: torch.Tensor  # (T,) loss weight per row
    is_block: torch.Tensor  # (T,) bool: row belongs to a noisy block (L_diff) or not (L_AR)
    teacher: TopK | None = None  # the target's distribution per response token (distillation)
    teacher_rows: torch.Tensor | None = None  # (T,) the row of `teacher` for each row's label, -1 where none


def pack_example(tokens: list[int], response_start: int, anchors: list[int], block_size: int, mask_token_id: int,
                 block_attention: BlockAttention = "anchor_causal", gamma: float = 0.0,
                 mask_ratio: MaskRatio = "all", rng: random.Random | None = None,
                 labels_shift: LabelShift = "shifted", teacher: TopK | None = None) -> PackedExample:
    """Pack one sequence with noisy blocks at `anchors` (indices into `tokens`); with `teacher` (one
    row per response token), each labelled row also points at the distribution its label came from."""
    length = len(tokens)
    num_blocks = len(anchors)
    total = length + num_blocks * block_size
    ids = torch.empty(total, dtype=torch.long)
    positions = torch.empty(total, dtype=torch.long)
    labels = torch.full((total,), IGNORE, dtype=torch.long)
    weights = torch.zeros(total)
    is_block = torch.zeros(total, dtype=torch.bool)
    mask = torch.zeros(total, total, dtype=torch.bool)

    sequence = torch.tensor(tokens)
    ids[:length] = sequence
    positions[:length] = torch.arange(length)
    mask[:length, :length] = torch.tril(torch.ones(length, length, dtype=torch.bool))
    start = max(response_start - 1, 0)  # the last prompt token predicts the first response token
    labels[start:length - 1] = sequence[start + 1:]
    weights[start:length - 1] = 1.0

    draft_weights = torch.tensor([math.exp(-i / gamma) if gamma > 0 else 1.0 for i in range(block_size)])
    first_row = 0 if labels_shift == "shifted" else 1  # the row that predicts x_{a+1}
    for j, anchor in enumerate(anchors):
        if not 0 <= anchor < length - 1:
            raise ValueError(f"anchor {anchor} must leave at least one token to predict (length {length})")
        lo = length + j * block_size
        rows = slice(lo, lo + block_size)
        block = torch.full((block_size,), mask_token_id, dtype=torch.long)
        block[0] = tokens[anchor]
        truth = sequence[anchor + 1:anchor + block_size]  # what block slots 1 … B-1 hold
        revealed: list[int] = []
        if mask_ratio == "random" and truth.numel():
            rng = rng or random.Random()
            keep = rng.randint(0, truth.numel() - 1)  # reveal 0 … n-1 true tokens
            revealed = rng.sample(range(truth.numel()), keep)
            for slot in revealed:
                block[1 + slot] = truth[slot]
        ids[rows] = block
        positions[rows] = torch.arange(anchor, anchor + block_size)
        mask[rows, :anchor] = True  # clean context strictly before the anchor
        if block_attention == "bidirectional":
            mask[rows, rows] = True
        elif block_attention == "anchor_causal":
            mask[lo, lo] = True
            mask[lo + 1:lo + block_size, rows] = True
        else:
            mask[rows, rows] = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        targets = sequence[anchor + 1:anchor + 1 + block_size - first_row]  # draft k = x_{a+k}
        first = lo + first_row
        labels[first:first + targets.numel()] = targets
        weights[first:first + targets.numel()] = draft_weights[:targets.numel()]
        for slot in revealed:  # the row predicting block slot slot+1, which the block can see
            weights[first + slot] = 0.0
            labels[first + slot] = IGNORE
        is_block[rows] = True
    teacher_rows = None
    if teacher is not None:
        assert len(teacher) == length - response_start, f"{len(teacher)} teacher rows for {length - response_start} tokens"
        # a label is token x_i; the teacher row that predicted it is i - response_start
        source = torch.full((total,), -1, dtype=torch.long)
        source[start:length - 1] = torch.arange(start + 1, length)
        for j, anchor in enumerate(anchors):
            first = length + j * block_size + first_row
            count = min(block_size - first_row, length - anchor - 1)
            source[first:first + count] = torch.arange(anchor + 1, anchor + 1 + count)
        teacher_rows = torch.where((labels != IGNORE) & (source >= response_start), source - response_start, -1)
    return PackedExample(ids, positions, mask, labels, weights, is_block, teacher, teacher_rows)


def sample_anchors(length: int, response_start: int, count: int, rng: random.Random) -> list[int]:
    """Up to `count` distinct anchors in the response (each leaves at least one token to predict)."""
    low = max(response_start - 1, 0)
    candidates = range(low, length - 1)
    return sorted(rng.sample(candidates, min(count, len(candidates))))


def collate(examples: list[PackedExample]) -> dict[str, torch.Tensor]:
    """Pad examples to one batch; padding rows attend to themselves and carry no loss."""
    longest = max(e.input_ids.shape[0] for e in examples)
    batch = len(examples)
    out = {"input_ids": torch.zeros(batch, longest, dtype=torch.long),
           "positions": torch.zeros(batch, longest, dtype=torch.long),
           "mask": torch.eye(longest, dtype=torch.bool).repeat(batch, 1, 1),
           "labels": torch.full((batch, longest), IGNORE, dtype=torch.long),
           "weights": torch.zeros(batch, longest),
           "is_block": torch.zeros(batch, longest, dtype=torch.bool)}
    for row, e in enumerate(examples):
        n = e.input_ids.shape[0]
        out["input_ids"][row, :n] = e.input_ids
        out["positions"][row, :n] = e.positions
        out["mask"][row, :n, :n] = e.mask
        out["labels"][row, :n] = e.labels
        out["weights"][row, :n] = e.weights
        out["is_block"][row, :n] = e.is_block
    if all(e.teacher is not None for e in examples):  # every example's teacher rows, stacked
        out["teacher_rows"] = torch.full((batch, longest), -1, dtype=torch.long)
        offset = 0
        for row, e in enumerate(examples):
            n = e.input_ids.shape[0]
            out["teacher_rows"][row, :n] = torch.where(e.teacher_rows >= 0, e.teacher_rows + offset, -1)
            offset += len(e.teacher)
        out["teacher_ids"] = torch.cat([e.teacher.ids for e in examples]).long()  # (N, k)
        out["teacher_logprobs"] = torch.cat([e.teacher.logprobs for e in examples]).float()  # (N, k)
    return out
