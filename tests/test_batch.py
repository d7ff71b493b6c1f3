"""Packed training examples (`d3d.train.batch`): exact layout, attention, labels and weights of a
hand-made example, the leak-freedom of partially revealed blocks, anchor sampling and padding.

The hand-made example: tokens x_0 … x_7 = 10 … 17, response_start 3, anchors [3, 5], block size 4,
MASK id 99. Rows 0 … 7 are the clean tokens, rows 8 … 11 the block at anchor 3, rows 12 … 15 the
block at anchor 5.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from d3d.masks import draft_mask
from d3d.train.batch import IGNORE, collate, pack_example, sample_anchors

TOKENS = [10, 11, 12, 13, 14, 15, 16, 17]
RESPONSE_START = 3
ANCHORS = [3, 5]
B = 4
MASK = 99
LENGTH = len(TOKENS)
MODES = ["anchor_causal", "bidirectional", "causal"]


def block_rows(j: int) -> range:
    return range(LENGTH + j * B, LENGTH + (j + 1) * B)


def expected_mask(mode: str) -> torch.Tensor:
    """The packed mask written out from the definition, independently of the code under test."""
    total = LENGTH + len(ANCHORS) * B
    mask = torch.zeros(total, total, dtype=torch.bool)
    for i in range(LENGTH):
        for k in range(i + 1):
            mask[i, k] = True
    for j, anchor in enumerate(ANCHORS):
        lo = LENGTH + j * B
        for i in range(B):
            for k in range(anchor):
                mask[lo + i, k] = True
            for k in range(B):
                inside = {"bidirectional": True, "causal": k <= i,
                          "anchor_causal": k == 0 if i == 0 else True}[mode]
                mask[lo + i, lo + k] = inside
    return mask


def example(mode: str = "anchor_causal", gamma: float = 0.0):
    return pack_example(TOKENS, RESPONSE_START, ANCHORS, B, MASK, mode, gamma)


@pytest.mark.parametrize("mode", MODES)
def test_mask_matches_the_definition(mode):
    """The whole packed mask equals the hand-written one: causal clean rows, blocks see only earlier clean tokens."""
    assert torch.equal(example(mode).mask, expected_mask(mode))


@pytest.mark.parametrize("mode", MODES)
def test_blocks_never_see_later_clean_tokens_or_other_blocks(mode):
    """A block row sees clean tokens strictly before its anchor, never the anchor's clean copy, later tokens or other blocks."""
    mask = example(mode).mask
    for j, anchor in enumerate(ANCHORS):
        rows = list(block_rows(j))
        assert mask[rows][:, :anchor].all()
        assert not mask[rows][:, anchor:LENGTH].any()
        other = [r for k in range(len(ANCHORS)) if k != j for r in block_rows(k)]
        assert not mask[rows][:, other].any()
    # Clean rows never look into any block.
    assert not mask[:LENGTH, LENGTH:].any()


def test_anchor_causal_inside_the_block():
    """anchor_causal: the anchor row sees only itself inside its block; each mask row sees the whole block."""
    mask = example("anchor_causal").mask
    for j in range(len(ANCHORS)):
        lo = LENGTH + j * B
        inner = mask[lo:lo + B, lo:lo + B]
        assert inner[0].tolist() == [True, False, False, False]
        assert inner[1:].all()


@pytest.mark.parametrize("mode", MODES)
def test_block_rows_agree_with_the_inference_draft_mask(mode):
    """A packed block's rows (context + block columns) are exactly `draft_mask` for a block drafted after `anchor` cached tokens."""
    mask = example(mode).mask
    for j, anchor in enumerate(ANCHORS):
        lo = LENGTH + j * B
        packed = torch.cat([mask[lo:lo + B, :anchor], mask[lo:lo + B, lo:lo + B]], dim=1)
        assert torch.equal(packed, draft_mask(0, B, anchor, mode))


def test_ids_positions_and_block_flags():
    """Clean rows hold the tokens at 0 … L-1; a block holds [x_a, MASK, MASK, MASK] at positions a … a+B-1."""
    e = example()
    assert e.input_ids.tolist() == TOKENS + [13, MASK, MASK, MASK] + [15, MASK, MASK, MASK]
    assert e.positions.tolist() == list(range(8)) + [3, 4, 5, 6] + [5, 6, 7, 8]
    assert e.is_block.tolist() == [False] * 8 + [True] * 8


def test_labels_are_shifted_and_truncated():
    """Block row i predicts x_{a+i+1} (IGNORE past the end); clean rows predict the next token from response_start-1 on."""
    e = example()
    clean = [IGNORE, IGNORE, 13, 14, 15, 16, 17, IGNORE]  # x_2 (last prompt token) predicts x_3
    assert e.labels.tolist() == clean + [14, 15, 16, 17] + [16, 17, IGNORE, IGNORE]
    assert e.weights.tolist() == [0, 0, 1, 1, 1, 1, 1, 0] + [1, 1, 1, 1] + [1, 1, 0, 0]
    # Wherever a label is IGNORE the row carries no weight, and vice versa.
    assert torch.equal(e.labels == IGNORE, e.weights == 0)


def test_response_start_zero_labels_every_clean_row():
    """With no prompt every clean row but the last predicts its next token."""
    e = pack_example(TOKENS, 0, [0], B, MASK)
    assert e.labels[:LENGTH].tolist() == TOKENS[1:] + [IGNORE]


@pytest.mark.parametrize("gamma", [0.5, 2.0])
def test_gamma_decays_block_weights(gamma):
    """gamma > 0 weights block row i by exp(-i/γ); clean rows keep weight 1."""
    e = example(gamma=gamma)
    decay = [math.exp(-i / gamma) for i in range(B)]
    assert e.weights[8:12].tolist() == pytest.approx(decay)
    assert e.weights[12:16].tolist() == pytest.approx(decay[:2] + [0.0, 0.0])
    assert e.weights[2:7].tolist() == [1.0] * 5


@pytest.mark.parametrize("anchor", [-1, LENGTH - 1, LENGTH])
def test_anchor_must_leave_a_token_to_predict(anchor):
    """An anchor outside 0 … L-2 is refused with ValueError."""
    with pytest.raises(ValueError, match="anchor"):
        pack_example(TOKENS, RESPONSE_START, [anchor], B, MASK)


@pytest.mark.parametrize("mode", MODES)
def test_random_mask_ratio_never_leaks_a_label(mode):
    """mask_ratio="random": every revealed slot holds the true token and the row predicting it carries no loss (500 seeded draws)."""
    rng = random.Random(7)
    tokens = list(range(20, 44))  # distinct tokens, so a visible label can only come from its own slot
    block = 6
    revealed_total, partial_blocks = 0, 0
    for _ in range(500):
        anchors = sample_anchors(len(tokens), 5, 4, rng)
        e = pack_example(tokens, 5, anchors, block, MASK, mode, gamma=1.5, mask_ratio="random", rng=rng)
        for j, anchor in enumerate(anchors):
            lo = len(tokens) + j * block
            ids, labels, weights = e.input_ids[lo:lo + block], e.labels[lo:lo + block], e.weights[lo:lo + block]
            assert ids[0] == tokens[anchor]
            slots = [s for s in range(1, block) if ids[s] != MASK]
            available = min(block - 1, len(tokens) - 1 - anchor)
            assert len(slots) < available  # never every true token of the block
            for s in slots:
                assert ids[s] == tokens[anchor + s]  # the revealed token is the true one
                assert labels[s - 1] == IGNORE and weights[s - 1] == 0
            # Rows whose label the block cannot see keep their label and a positive weight.
            for i in range(block):
                visible = (i + 1) in slots
                in_sequence = anchor + i + 1 < len(tokens)
                assert (labels[i] != IGNORE) == (in_sequence and not visible)
                assert (weights[i] > 0) == (in_sequence and not visible)
            # No unmasked label anywhere in the block equals a row's target (tokens are distinct).
            visible_ids = set(ids[1:].tolist()) - {MASK}
            assert not visible_ids & set(labels[labels != IGNORE].tolist())
            revealed_total += len(slots)
            partial_blocks += bool(slots)
    assert revealed_total > 0 and partial_blocks > 100  # the random mode really revealed tokens


def test_random_mask_ratio_is_seeded():
    """The same seed gives the same partially revealed blocks; other seeds give others."""
    def draw(seed):
        rng = random.Random(seed)
        return [pack_example(TOKENS, 0, [0, 2], B, MASK, mask_ratio="random", rng=rng).input_ids.tolist()
                for _ in range(5)]
    assert draw(3) == draw(3)
    assert len({str(draw(seed)) for seed in range(6)}) > 1


def test_sample_anchors_bounds():
    """Anchors are distinct, sorted, in [response_start-1, L-2], and capped by the number of candidates."""
    rng = random.Random(0)
    for _ in range(200):
        length = rng.randint(2, 40)
        start = rng.randint(0, length - 1)
        count = rng.randint(1, 12)
        anchors = sample_anchors(length, start, count, rng)
        low = max(start - 1, 0)
        assert anchors == sorted(set(anchors))
        assert all(low <= a <= length - 2 for a in anchors)
        assert len(anchors) == min(count, length - 1 - low)
    assert sample_anchors(8, 3, 100, random.Random(0)) == [2, 3, 4, 5, 6]
    assert sample_anchors(5, 5, 3, random.Random(0)) == []  # empty response: nothing to anchor
    assert sample_anchors(1, 0, 3, random.Random(0)) == []


def test_collate_pads_with_self_attending_rows():
    """collate: examples copied unchanged; padding rows attend only to themselves, with IGNORE labels and no weight."""
    a = pack_example(TOKENS, RESPONSE_START, ANCHORS, B, MASK)  # 16 rows
    b = pack_example(TOKENS[:5], 1, [1], B, MASK)  # 9 rows
    batch = collate([a, b])
    assert batch["input_ids"].shape == (2, 16) and batch["mask"].shape == (2, 16, 16)
    for row, e in enumerate([a, b]):
        n = e.input_ids.shape[0]
        assert torch.equal(batch["input_ids"][row, :n], e.input_ids)
        assert torch.equal(batch["positions"][row, :n], e.positions)
        assert torch.equal(batch["mask"][row, :n, :n], e.mask)
        assert torch.equal(batch["labels"][row, :n], e.labels)
        assert torch.equal(batch["weights"][row, :n], e.weights)
        assert torch.equal(batch["is_block"][row, :n], e.is_block)
    n = b.input_ids.shape[0]
    pad = batch["mask"][1, n:]
    assert torch.equal(pad, torch.eye(16, dtype=torch.bool)[n:])  # self only
    assert not batch["mask"][1, :n, n:].any()  # real rows never see padding
    assert (batch["labels"][1, n:] == IGNORE).all()
    assert (batch["weights"][1, n:] == 0).all()
    assert not batch["is_block"][1, n:].any()
    assert batch["mask"].any(-1).all()  # no row has an empty softmax


def test_unshifted_labels_put_each_token_on_its_own_row():
    """labels_shift="unshifted": the anchor's row has no label, row i predicts x_{a+i}; decay
    weights follow the draft index (draft k on row k), and a revealed slot drops its own row."""
    e = pack_example(TOKENS, RESPONSE_START, ANCHORS, B, MASK, gamma=2.0, labels_shift="unshifted")
    for j, anchor in enumerate(ANCHORS):
        rows = list(block_rows(j))
        assert e.labels[rows[0]] == IGNORE and e.weights[rows[0]] == 0
        for i in range(1, B):
            in_sequence = anchor + i < LENGTH
            assert e.labels[rows[i]] == (TOKENS[anchor + i] if in_sequence else IGNORE)
            assert e.weights[rows[i]] == pytest.approx(math.exp(-(i - 1) / 2.0) if in_sequence else 0.0)
    rng = random.Random(3)
    tokens = list(range(20, 44))
    for _ in range(200):
        e = pack_example(tokens, 5, [8], 6, MASK, mask_ratio="random", rng=rng, labels_shift="unshifted")
        ids, labels = e.input_ids[len(tokens):], e.labels[len(tokens):]
        for s in range(1, 6):
            visible = ids[s] != MASK
            assert (labels[s] == IGNORE) == bool(visible)
            if not visible:
                assert labels[s] == tokens[8 + s]
