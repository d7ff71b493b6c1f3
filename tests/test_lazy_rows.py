"""Logits computed as verification reads them (`d3d.lazy_rows`): the rows, the head calls they
cost, and the verdicts and outputs — the same as over every row computed at once."""

from __future__ import annotations

import pytest
import torch

from conftest import make_decoder, tiny_config
from d3d.config import GenerationConfig, SamplingConfig
from d3d.engine import generate_from_sources, reference_generate
from d3d.exactness import verify_mode
from d3d.lazy_rows import LazyRows, argmax_rows, each_row
from d3d.models import SequenceRows
from d3d.sampling import greedy_ids, probabilities
from d3d.sources import Proposal
from d3d.target_step import HEAD_ROWS, head_rows
from d3d.verify import verify_greedy, verify_sampling


def counted(table: torch.Tensor, computed: int = 0) -> tuple[LazyRows, list[tuple[int, int]]]:
    """LazyRows over `table`'s rows, the first `computed` given, and the ranges it computes."""
    calls = []

    def compute(begin: int, end: int) -> torch.Tensor:
        calls.append((begin, end))
        return table[begin:end].clone()
    return LazyRows(len(table), compute, table[:computed].clone() if computed else None), calls


def test_rows_are_computed_a_growing_prefix_at_a_time():
    table = torch.arange(40.0).view(10, 4)
    rows, calls = counted(table, computed=2)
    assert len(rows) == 10 and rows.num_computed == 2
    assert torch.equal(rows[1], table[1]) and calls == []
    assert torch.equal(rows[2], table[2]) and calls == [(2, 4)]  # at least doubled
    assert torch.equal(rows[:3], table[:3]) and calls == [(2, 4)]
    assert torch.equal(rows[6], table[6]) and calls == [(2, 4), (4, 8)]
    assert torch.equal(rows[-1], table[9]) and calls == [(2, 4), (4, 8), (8, 10)]
    assert torch.equal(rows[:], table)
    for bad in (10, -11):
        with pytest.raises(IndexError):
            rows[bad]
    with pytest.raises(IndexError):
        rows[::2]


def test_a_mapped_view_reads_its_source_as_computed():
    table = torch.randn(9, 5)
    rows, calls = counted(table, computed=3)
    ids = rows.map(greedy_ids)
    assert int(ids[0]) == int(table[0].argmax()) and calls == []  # the computed prefix, in one call
    assert torch.equal(ids[:], greedy_ids(table)) and calls == [(3, 9)]
    assert torch.equal(each_row(table, greedy_ids), greedy_ids(table))


@pytest.mark.parametrize("computed", [0, 2])
def test_argmaxes_read_the_known_then_one_call_a_range(computed):
    """Rows with an argmax of their own (a certified greedy head's) and the first 4 argmaxes known
    (computed with the forward, every sequence's at once): those are read as given, past them each
    range is one call, at least doubling — and the rows past the computed ones are never computed."""
    table = torch.randn(12, 7)
    rows, calls = counted(table, computed)
    ranges = []

    def argmax(begin: int, end: int) -> torch.Tensor:
        ranges.append((begin, end))
        return greedy_ids(table[begin:end])
    known = greedy_ids(table[:4])
    lazy = LazyRows(len(table), rows._compute, rows._rows, argmax=argmax, argmaxes=known)
    ids = lazy.argmaxes(greedy_ids)
    assert int(ids[0]) == int(known[0]) and int(ids[3]) == int(known[3]) and ranges == []
    assert int(ids[5]) == int(table[5].argmax()) and ranges == [(4, 8)]
    assert torch.equal(ids[:], greedy_ids(table)) and ranges == [(4, 8), (8, 12)]
    assert calls == []  # no row computed
    without = LazyRows(len(table), rows._compute, rows._rows, argmax=argmax).argmaxes(greedy_ids)
    ranges.clear()
    assert torch.equal(without[:], greedy_ids(table)) and ranges[0][0] == computed and calls == []


def test_verdicts_read_no_row_past_the_first_rejection():
    """Greedy and sampled verdicts over LazyRows equal those over the whole tensor (the same draws),
    and the rows computed stop at the chunk holding the first rejection."""
    generator = torch.Generator().manual_seed(0)
    for case in range(60):
        num_drafts = int(torch.randint(1, 12, (), generator=generator))
        logits = torch.randn(num_drafts + 1, 16, generator=generator) * 3
        target_tokens = greedy_ids(logits)
        drafts = target_tokens[:-1].clone()
        reject = int(torch.randint(0, num_drafts + 1, (), generator=generator))
        if reject < num_drafts:
            drafts[reject] = (drafts[reject] + 1) % 16
        rows, calls = counted(logits, computed=min(HEAD_ROWS, num_drafts + 1))
        verdict = verify_greedy(drafts, rows.map(greedy_ids))
        assert verdict == verify_greedy(drafts, target_tokens)
        assert verdict.num_accepted == reject
        assert rows.num_computed <= max(HEAD_ROWS, 2 * (reject + 1)), (case, calls)

        sampling = SamplingConfig(temperature=1.0)
        draft_probs = torch.softmax(torch.randn(num_drafts, 16, generator=generator), -1)
        sampled = torch.multinomial(draft_probs, 1, generator=generator)[:, 0]
        seed = int(torch.randint(0, 2**31, (), generator=generator))
        want = verify_sampling(sampled, draft_probs, probabilities(logits, sampling), torch.Generator().manual_seed(seed))
        rows, _ = counted(logits, computed=min(HEAD_ROWS, num_drafts + 1))
        got = verify_sampling(sampled, draft_probs, rows.map(lambda r: probabilities(r, sampling)),
                              torch.Generator().manual_seed(seed))
        assert got == want
        assert rows.num_computed <= max(HEAD_ROWS, 2 * (got.num_accepted + 1))


def blocks_after_prompts(target, prompts: list[torch.Tensor], blocks: list[torch.Tensor], head_rows: int | None,
                         greedy: bool = False) -> list:
    """`forward_rows` over each block after its prompt's cache (the prompts' last rows first, in one
    forward of their own)."""
    caches = [target.new_cache(64) for _ in prompts]
    with torch.no_grad():
        target.forward_rows([SequenceRows(p, c, last_only=True) for p, c in zip(prompts, caches)])
        for cache in caches:
            cache.commit()
        return target.forward_rows([SequenceRows(b, c, greedy=greedy) for b, c in zip(blocks, caches)],
                                   head_rows=head_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_rows_computes_later_rows_when_read_with_the_same_bits(dtype):
    target = make_decoder(tiny_config(), seed=3, dtype=dtype)
    if target.row_exact is None:
        pytest.skip("the row-exact kernels did not build here")
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (n,), generator=generator) for n in (6, 9, 3)]
    blocks = [torch.randint(0, 64, (n,), generator=generator) for n in (1, 9, 5)]

    def scored(head_rows):
        return blocks_after_prompts(target, prompts, blocks, head_rows)

    whole = scored(None)
    head_calls = []
    real_logits = target.logits
    target.logits = lambda hidden: head_calls.append(hidden.shape[0]) or real_logits(hidden)
    try:
        lazy = scored(2)
        assert head_calls == [3, 1 + 2 + 2]  # the prompts' last rows; every block's first rows in one call
        assert isinstance(lazy[1][0], LazyRows) and isinstance(lazy[0][0], torch.Tensor)
        with torch.no_grad():
            for (want, _), (got, _) in zip(whole, lazy):
                assert all(torch.equal(want[i], got[i]) for i in range(len(want)))  # read in order
        assert head_calls[2:] == [2, 4, 1, 2, 1]  # rows 2-3, 4-7, 8 of the 9; rows 2-3, 4 of the 5
    finally:
        del target.logits


def test_greedy_parts_take_their_first_argmaxes_together():
    """Greedy parts (argmaxes only) of a batched forward: no logits with the forward, every part's
    first `head_rows` argmaxes from one `Decoder.greedy_ids` call (a batch of plain greedy steps
    is one call, not one a sequence), later rows one call a range as read — the full head's ids."""
    target = make_decoder(tiny_config(), seed=3)
    if target.row_exact is None:
        pytest.skip("the row-exact kernels did not build here")
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 64, (n,), generator=generator) for n in (6, 9, 3, 4)]
    blocks = [torch.randint(0, 64, (n,), generator=generator) for n in (1, 9, 1, 3)]

    def scored(greedy):
        return blocks_after_prompts(target, prompts, blocks, 2, greedy)

    want = [greedy_ids(rows[:]) for rows, _ in scored(False)]
    calls, head_calls = [], []
    real_ids, real_logits = target.greedy_ids, target.logits
    target.greedy_ids = lambda hidden: calls.append(hidden.shape[0]) or real_ids(hidden)
    target.logits = lambda hidden: head_calls.append(hidden.shape[0]) or real_logits(hidden)
    try:
        out = scored(True)
        assert calls == [1 + 2 + 1 + 2]
        argmaxes = [argmax_rows(rows, greedy_ids) for rows, _ in out]
        got = [torch.stack([ids[i] for i in range(len(ids))]) for ids in argmaxes]  # read in order
        assert calls == [6, 2, 4, 1, 1]  # rows 2-3, 4-7, 8 of the 9; row 2 of the 3
        # the prompts' last rows, then each argmax call's rows (this model has no certified head)
        assert head_calls == [4] + calls
    finally:
        del target.greedy_ids, target.logits
    assert all(torch.equal(w, g) for w, g in zip(want, got))


class WrongDrafts:
    """A source whose 8 drafts are never the target's: every verification rejects its first draft
    (`output`: the target's greedy output after `prompt`)."""

    name, max_drafts, vocab_size, feature_layers = "wrong", 8, None, ()

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.expected = prompt + output

    def draft_costs(self, target):
        return (0.0,) * 9

    def start(self, max_length, device):
        pass

    def propose(self, tokens, num_drafts, sampling, generator):
        return Proposal(torch.full((min(8, num_drafts),), (self.expected[len(tokens)] + 1) % 64), None)

    def observe(self, features):
        pass


def test_a_rejected_block_pays_the_head_for_its_first_rows_only():
    """Each 9-row verification of wrong drafts runs the head over its first `head_rows` rows, and the
    output is plain decoding's."""
    target = make_decoder(tiny_config(), seed=4)
    if target.row_exact is None:
        pytest.skip("the row-exact kernels did not build here")
    prompt, config = [1, 5, 9, 3], GenerationConfig(max_new_tokens=12)
    want = [t for step in reference_generate(target, prompt, config) for t in step.tokens]
    assert verify_mode(target) == "batched"  # the machine's check (its forwards call the head too) done first
    counted_rows = []
    real_logits = target.logits
    target.logits = lambda hidden: counted_rows.append(hidden.shape[0]) or real_logits(hidden)
    try:
        steps = list(generate_from_sources(target, [WrongDrafts(prompt, want)], prompt, config))
    finally:
        del target.logits
    assert [t for step in steps for t in step.tokens] == want
    drafted = [step.num_drafted for step in steps[1:]]
    assert drafted[0] == 8 and all(step.num_accepted == 0 for step in steps)
    # the prompt's last row, then each verification's first rows
    assert counted_rows == [1] + [min(head_rows(target), k + 1) for k in drafted]
