"""Teacher-forced τ (`d3d.estimate`): the accepted-prefix count, and the packed estimator checked
against a brute-force one that drafts every anchor separately through `Drafter.draft`.

The sequences are the tiny target's own greedy continuations (as `d3d data` makes them), so a
draft is accepted exactly when it equals the next token of the sequence.
"""

from __future__ import annotations

import random

import pytest
import torch

from d3d.config import GenerationConfig
from d3d.drafter import Drafter
from d3d.engine import reference_generate
from d3d.estimate import accepted_prefix, teacher_forced_tau
from d3d.train.batch import IGNORE, sample_anchors


def test_accepted_prefix_counts_leading_matches():
    """Only the leading run of matches counts; a later match after a miss does not."""
    predictions = torch.tensor([[1, 2, 3], [1, 0, 3], [0, 2, 3], [1, 2, 0], [5, 5, 5]])
    labels = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3], [5, 6, 5]])
    assert accepted_prefix(predictions, labels).tolist() == [3, 1, 0, 2, 1]


def test_accepted_prefix_stops_at_ignore():
    """An IGNORE label (past the end of the sequence) ends the run, even if the prediction were IGNORE too."""
    predictions = torch.tensor([[1, 2, 3], [1, IGNORE, 3], [IGNORE, 2, 3]])
    labels = torch.tensor([[1, IGNORE, IGNORE], [1, IGNORE, 3], [IGNORE, 2, 3]])
    assert accepted_prefix(predictions, labels).tolist() == [1, 1, 0]


def greedy_sequences(target, count: int = 3, new_tokens: int = 14, seed: int = 5) -> list[tuple[list[int], int]]:
    """(prompt + the target's greedy response, response_start) for prompts of different lengths."""
    rng = random.Random(seed)
    config = GenerationConfig(max_new_tokens=new_tokens, eos_token_ids=[])
    sequences = []
    for i in range(count):
        prompt = [rng.randrange(4, 64) for _ in range(4 + 3 * i)]
        response = [t for step in reference_generate(target, prompt, config) for t in step.tokens]
        assert len(response) == new_tokens
        sequences.append((prompt + response, len(prompt)))
    return sequences


def brute_force_accepted(drafter: Drafter, sequences, anchors_per_sequence: int, seed: int) -> list[int]:
    """Accepted drafts per block, one `Drafter.draft` call per anchor on a fresh cache."""
    rng = random.Random(seed)  # the estimator's anchor stream, consumed in the same order
    size = drafter.block_size
    accepted = []
    for tokens, response_start in sequences:
        for anchor in sample_anchors(len(tokens), response_start, anchors_per_sequence, rng):
            prefix = tokens[:anchor + 1]
            logits = drafter.draft(drafter.new_cache(len(prefix)), prefix)
            drafts = logits.argmax(-1).tolist()[:size - 1]
            truth = tokens[anchor + 1:anchor + size]
            count = 0
            while count < len(truth) and drafts[count] == truth[count]:
                count += 1
            accepted.append(count)
    return accepted


def drafter_made_sequences(drafter: Drafter, count: int = 3, seed: int = 9) -> list[tuple[list[int], int]]:
    """Sequences that follow the drafter's own drafts for 0 … B-1 tokens at a time, then a random token.

    Anchors then accept anywhere from 0 to B-1 drafts (also right at the end of a sequence, where
    the labels run out), so every branch of the count is exercised.
    """
    rng = random.Random(seed)
    size = drafter.block_size
    sequences = []
    for i in range(count):
        tokens = [rng.randrange(4, 64) for _ in range(3 + 2 * i)]
        start = len(tokens)
        while len(tokens) < start + 20:
            drafts = drafter.draft(drafter.new_cache(len(tokens)), tokens).argmax(-1).tolist()[:size - 1]
            tokens += drafts[:rng.randint(0, size - 1)] + [rng.randrange(4, 64)]
        drafts = drafter.draft(drafter.new_cache(len(tokens)), tokens).argmax(-1).tolist()
        sequences.append((tokens + drafts[:2], start))  # ends inside a run of drafts
    return sequences


@pytest.mark.parametrize("mode,labels", [("anchor_causal", "shifted"), ("causal", "shifted"),
                                         ("bidirectional", "shifted"), ("anchor_causal", "unshifted")])
def test_teacher_forced_tau_equals_brute_force(target, mode, labels):
    """The packed, batched estimator gives exactly the τ and acceptance rates of drafting each anchor on its own."""
    drafter = Drafter.from_target(target, [0], block_size=4, block_attention=mode, labels=labels).eval()
    sequences = drafter_made_sequences(drafter)
    estimate = teacher_forced_tau(drafter, sequences, anchors_per_sequence=12, seed=11, batch_size=2)
    accepted = brute_force_accepted(drafter, sequences, 12, seed=11)
    assert estimate.num_blocks == len(accepted) == 36
    assert set(accepted) == {0, 1, 2, 3}  # the comparison covers every outcome of a block of 4
    assert estimate.tau == pytest.approx(1 + sum(accepted) / len(accepted), abs=1e-6)
    size = drafter.block_size
    expected_rates = []
    for i in range(size - 1):
        reached = sum(a >= i for a in accepted)
        expected_rates.append(sum(a >= i + 1 for a in accepted) / reached if reached else 0.0)
    assert estimate.acceptance_rate == pytest.approx(expected_rates)
    assert 1.0 <= estimate.tau <= size
    assert len(estimate.acceptance_rate) == size - 1
    assert all(0.0 <= r <= 1.0 for r in estimate.acceptance_rate)


def test_labels_running_out_cap_the_accepted_prefix(target):
    """At an anchor two tokens before the end, drafts that would all be accepted count only 2 (the labels run out)."""
    drafter = Drafter.from_target(target, [0], block_size=4).eval()
    context = [7, 30, 12, 45, 9, 22]
    drafts = drafter.draft(drafter.new_cache(len(context)), context).argmax(-1).tolist()[:3]
    anchor = len(context) - 1
    for kept in (1, 2, 3):
        tokens = context + drafts[:kept]
        # response_start = anchor + 1 makes the anchor the first candidate; take just that one.
        estimate = teacher_forced_tau(drafter, [(tokens, anchor + 1)], anchors_per_sequence=len(tokens))
        accepted = brute_force_accepted(drafter, [(tokens, anchor + 1)], len(tokens), seed=0)
        assert accepted[0] == kept
        assert estimate.tau == pytest.approx(1 + sum(accepted) / len(accepted))
        assert estimate.num_blocks == kept


@pytest.mark.parametrize("mode", ["anchor_causal", "causal"])
def test_full_copy_drafter_always_gets_its_first_draft_accepted(target, mode):
    """A drafter copying every target layer, whose anchor row sees no mask, predicts the target's next token: rate[0] = 1, τ ≥ 2."""
    sequences = greedy_sequences(target)
    drafter = Drafter.from_target(target, [0, 1], block_size=4, block_attention=mode).eval()
    estimate = teacher_forced_tau(drafter, sequences, anchors_per_sequence=6, seed=3)
    assert estimate.acceptance_rate[0] == 1.0
    assert estimate.tau >= 2.0


def test_batch_size_does_not_change_the_estimate(target):
    """Padding in the packed batch is invisible: batch sizes 1 and 3 give the same estimate."""
    sequences = greedy_sequences(target)
    drafter = Drafter.from_target(target, [1], block_size=4).eval()
    one = teacher_forced_tau(drafter, sequences, anchors_per_sequence=5, seed=2, batch_size=1)
    three = teacher_forced_tau(drafter, sequences, anchors_per_sequence=5, seed=2, batch_size=3)
    assert one.num_blocks == three.num_blocks == 15
    assert one.tau == pytest.approx(three.tau)
    assert one.acceptance_rate == pytest.approx(three.acceptance_rate)


def test_no_anchor_gives_the_neutral_estimate(target):
    """Sequences without a response token to anchor on give τ = 1 over zero blocks."""
    drafter = Drafter.from_target(target, [0], block_size=4).eval()
    estimate = teacher_forced_tau(drafter, [([5, 6, 7], 3), ([8], 0)])
    assert (estimate.tau, estimate.acceptance_rate, estimate.num_blocks) == (1.0, [], 0)
