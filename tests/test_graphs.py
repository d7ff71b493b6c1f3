"""Decoding forwards of one fixed shape (d3d.graphs): what a GPU runs, as CUDA graphs — here in their
CPU form, eager, on PyTorch's ops. A k-row forward's rows are its one-row steps' bits (each row computed
alone for one shape), the values are the dynamic path's (the mask, positions and stored keys right), and
the head takes the same rows."""

from __future__ import annotations

import pytest
import torch

from conftest import make_decoder, tiny_config
from d3d import graphs
from d3d.exactness import check_row_invariance

ROWS = 16


def torch_decoder(dtype: torch.dtype, fixed_rows: int | None) -> object:
    """A tiny random target on PyTorch's ops (no row-exact kernels), its decoding forwards in `fixed_rows` rows."""
    decoder = make_decoder(tiny_config(max_position_embeddings=128), seed=3, dtype=dtype)
    decoder.row_exact, decoder.fixed_rows = None, fixed_rows
    return decoder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_fixed_rows_make_every_verification_its_steps_bits(dtype):
    """(On an AMD EPYC Zen 4 the same decoder's own shapes are not: in fp32 every row of 2-16-row
    forwards differs from its step, in bf16 3-4 rows of 12-16-row ones — `check_row_invariance` with
    fixed_rows 0.)"""
    decoder = torch_decoder(dtype, ROWS)
    report = check_row_invariance(decoder, max_rows=ROWS, context=20)
    assert report.invariant, report.mismatched_rows
    cache = decoder.new_cache(64)
    decoder(torch.arange(5)[None], cache=cache)  # a prefill of 5 rows: fixed rows too
    cache.commit()
    assert graphs._runners.get(cache) is not None and graphs._runners[cache].rows == ROWS


@torch.no_grad()
def test_fixed_rows_compute_what_the_dynamic_path_does():
    """fp32, after a 20-token context: every row count's logits and stored keys and values match the
    path that attends to the cache's used slots only (within fp32 rounding) — and with the positions
    one off (the negative control) they do not."""
    generator = torch.Generator().manual_seed(0)
    vocab = tiny_config().vocab_size
    context, block = (torch.randint(0, vocab, (1, n), generator=generator) for n in (20, ROWS))
    results = {}
    for rows in (ROWS, 0, "shifted"):
        decoder = torch_decoder(torch.float32, ROWS if rows == "shifted" else rows)
        cache = decoder.new_cache(64)
        decoder(context, cache=cache)
        cache.commit()
        if rows == "shifted":
            graphs.runner_for(decoder, cache, ROWS).steps += 1
        logits = []
        for count in (1, 3, ROWS):
            logits.append(decoder(block[:, :count], cache=cache)[0])
            cache.commit(0)
        keys = cache.keys[:, :, :, 20:20 + ROWS].clone()
        results[rows] = logits, keys
    for got, want in zip(results[ROWS][0], results[0][0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[ROWS][1], results[0][1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(results["shifted"][0][-1], results[0][0][-1], rtol=1e-3, atol=1e-3)


def test_the_head_takes_a_forwards_rows_as_one_call_of_fixed_rows():
    generator = torch.Generator().manual_seed(1)
    x, weight = torch.randn(ROWS, 24, generator=generator), torch.randn(40, 24, generator=generator)
    whole = graphs.fixed_rows_linear(x, weight, ROWS)
    torch.testing.assert_close(whole, x @ weight.T)
    for count in (1, 2, 7, ROWS):
        assert torch.equal(graphs.fixed_rows_linear(x[:count], weight, ROWS), whole[:count]), count
    with pytest.raises(AssertionError):
        graphs.fixed_rows_linear(torch.randn(ROWS + 1, 24), weight, ROWS)


def test_fixed_rows_stay_off_for_the_cpu_kernels_unless_asked(monkeypatch):
    decoder = make_decoder(tiny_config(), seed=0)
    assert graphs.fixed_rows_of(decoder) == 0  # a CPU target: the row-exact kernels' own shapes
    decoder.fixed_rows = 8
    assert graphs.fixed_rows_of(decoder) == 8
    split = make_decoder(tiny_config(), seed=0).new_cache(32)
    assert split.split == decoder.splits_values and (graphs.runner_for(decoder, split, 8) is None) == split.split


@torch.no_grad()
def test_a_prompt_in_pieces_stores_what_its_steps_would():
    """bf16: a 40-token prompt at once (pieces of 16), in two parts (17 + 23) and token by token store
    the same keys and values, bit for bit, and give its last token the same logits. (The decoder's own
    shapes do not, on an AMD EPYC Zen 4: token by token stores other keys and values than at once.)"""
    decoder = torch_decoder(torch.bfloat16, ROWS)
    prompt = torch.randint(0, tiny_config().vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    runs = []
    for cuts in ((0, 40), (0, 17, 40), tuple(range(41))):
        cache = decoder.new_cache(64)
        for begin, end in zip(cuts, cuts[1:]):
            last = decoder(prompt[:, begin:end], cache=cache, last_only=True)[0, -1]
            cache.commit()
        runs.append((last, cache.keys[:, :, :, :40].clone(), cache.values[:, :, :, :40].clone()))
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
