"""The certified greedy head (d3d.kernels.greedy, greedy.h): each row's argmax of the vocabulary
head's logits from the exact logits of only the vocabulary rows that can hold it — the full head's
argmax on every row, ties included, and a model decoding through it decodes the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import kernels_built_for, make_decoder, tiny_config
from d3d.config import GenerationConfig
from d3d.engine import generate_from_sources, reference_generate
from d3d.kernels import greedy, row_exact_kernels
from d3d.lookup import LookupConfig
from d3d.quantized import quantize_weights
from d3d.sampling import greedy_ids
from d3d.sources import LookupSource
from test_quantized import loader_values, random_blocks, stream_of


@pytest.fixture(scope="module")
def kernels():
    kernels = row_exact_kernels()
    if not kernels.greedy.on:
        pytest.skip(f"the certified greedy head is on where the linears take the fp32 lanes; this build: {kernels.path_name}")
    return kernels


def q8_head(kernels, rows: int, width: int, seed: int, copies: dict[int, int] | None = None) -> torch.Tensor:
    """A bf16 head of random Q8_0 blocks streamed as stored; `copies` {row: source row}: rows made
    equal to others (their logits then tie exactly)."""
    raw = random_blocks("Q8_0", rows, width, seed=seed)
    for row, source in (copies or {}).items():
        raw[row] = raw[source]
    weight = loader_values("Q8_0", raw)
    kernels.use_stream(weight, stream_of(kernels, "Q8_0", raw))
    return weight


def full_ids(kernels, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return kernels.linear(x, weight, None).float().max(-1).indices


def test_the_certified_argmax_is_the_full_heads(kernels, threads):
    """Rows at scales from 0.01 to 100, a row of zeros (every logit 0: too many candidates, the full
    head's first index) and rows aimed at two equal vocabulary rows (exact ties: the lower index)."""
    width = 128
    weight = q8_head(kernels, 1024, width, seed=3, copies={700: 37, 901: 37})
    head = kernels.greedy.head(weight)
    assert head is not None, "a Q8_0 head of one stream part has a greedy head"
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randn(width, generator=generator) * scale for scale in (0.01, 0.1, 1.0, 3.0, 10.0, 100.0)
            for _ in range(8)]
    rows += [torch.zeros(width), weight[37].float(), -weight[700].float() * 0.5, weight[901].float() * 3]
    x = torch.stack(rows).to(torch.bfloat16)
    found, counts = head.candidates(kernels.library, x.float().contiguous())
    assert counts[-4] == -1 and (counts[:-4] > 0).all()  # zeros: every row a candidate; else a few
    assert 37 in found[-3, :counts[-3]].tolist() and 700 in found[-3, :counts[-3]].tolist()
    got = kernels.greedy.certified_ids(head, x, weight)
    assert torch.equal(got, full_ids(kernels, x, weight))
    assert got[-3] == 37 and got[-1] == 37  # the first of the tied rows


def test_a_vocabulary_off_the_lanes_never_takes_a_padding_row(kernels, threads):
    """A vocabulary of 1,000 rows (not a multiple of the 16 a pass may take in a vector's lanes): the
    rows padding its last group read as logits of 0, which must never be a candidate nor raise the
    bounds — rows whose every logit is negative (each vocabulary row's first weight positive, x
    along minus it) and rows aimed at the last vocabulary row give the full head's argmax."""
    width, vocab = 96, 1000
    raw = random_blocks("Q8_0", vocab, width, seed=11, scales=[1e-3, 2e-3])
    raw[:, 2] = 20 + np.arange(vocab) % 100  # each row's first code: its first weight 0.02 to 0.24
    weight = loader_values("Q8_0", raw)
    kernels.use_stream(weight, stream_of(kernels, "Q8_0", raw))
    head = kernels.greedy.head(weight)
    assert head is not None
    generator = torch.Generator().manual_seed(4)
    negative = [torch.randn(width, generator=generator) * 0.01 - 100.0 * torch.nn.functional.one_hot(torch.tensor(0), width)
                for _ in range(6)]
    last = [weight[vocab - 1].float() * scale for scale in (1.0, 3.0)]
    x = torch.stack(negative + last).to(torch.bfloat16)
    assert bool((full_logits := kernels.linear(x, weight, None).float())[:6].max() < 0)
    found, counts = head.candidates(kernels.library, x.float().contiguous())
    assert (counts > 0).all() and (found[counts.unsqueeze(1) > torch.arange(found.shape[1])] < vocab).all()
    got = kernels.greedy.certified_ids(head, x, weight)
    assert torch.equal(got, full_logits.max(-1).indices) and (got[6:] == vocab - 1).all()


def test_the_loose_pass_leaves_the_candidates_the_bound_alone_gives(kernels):
    """The pass over every vocabulary row bounds each logit loosely (its row's largest block error and
    scale) and computes the block-by-block bound for the rows that leaves only: the candidates are
    those of the block-by-block bound over all rows — what limits too large to drop any row give.
    Negative control: limits of zero drop rows the bound keeps."""
    width = 128
    weight = q8_head(kernels, 1024, width, seed=8)
    head = kernels.greedy.head(weight)
    generator = torch.Generator().manual_seed(2)
    x = torch.stack([torch.randn(width, generator=generator) * scale for scale in (0.03, 0.3, 1.0, 3.0, 30.0)
                     for _ in range(10)]).to(torch.bfloat16).float()

    def candidates(limits: torch.Tensor) -> list[list[int]]:
        probe = greedy.GreedyHead(head.codes, head.scale, head.error, limits, head.lane_scale, head.part)
        found, counts = probe.candidates(kernels.library, x)
        return [found[m, :counts[m]].tolist() if counts[m] >= 0 else None for m in range(len(x))]

    loose = candidates(head.limits)
    assert all(row is not None for row in loose) and max(map(len, loose)) > 1
    assert loose == candidates(torch.full_like(head.limits, 1e20))
    assert loose != candidates(torch.zeros_like(head.limits))


def test_a_head_of_other_codes_fails_the_check(kernels):
    """Negative control: a head prepared from another weight's codes gives other argmaxes, and the
    check a head passes before use says so."""
    width = 64
    weight = q8_head(kernels, 256, width, seed=4)
    other = q8_head(kernels, 256, width, seed=5)
    wrong = greedy.GreedyHead.of(other, kernels.stream(weight).parts[0], kernels.library)
    assert not greedy.check(lambda x: kernels.greedy.certified_ids(wrong, x, weight), lambda x: full_ids(kernels, x, weight),
                            width)
    right = greedy.GreedyHead.of(weight, kernels.stream(weight).parts[0], kernels.library)
    assert greedy.check(lambda x: kernels.greedy.certified_ids(right, x, weight), lambda x: full_ids(kernels, x, weight),
                        width)


def reference_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """greedy.h's codes, scales and errors as PyTorch computes them (how they were first made)."""
    blocks = weight.shape[1] // greedy.BLOCK
    w = weight.float().view(-1, blocks, greedy.BLOCK)
    s = w.abs().amax(-1) / 127
    q = torch.round(w / torch.where(s > 0, s, torch.ones_like(s))[..., None]).clamp(-127, 127)
    exact = (w.double() - q.double() * s.double()[..., None]).abs().amax(-1)
    e = exact.float()
    e = torch.where(e.double() < exact, torch.nextafter(e, torch.full_like(e, float("inf"))), e)
    return q.to(torch.int8).view(weight.shape), s, e


def row_layout(head: greedy.GreedyHead, vocab: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A head's codes (vocab, K) and, on builds whose pass takes 16 vocabulary rows in a vector's lanes,
    its lane scales (vocab, K / 32), put back in row order: the lanes layout is (groups, blocks, 8
    steps of 4 k, 16 rows, 4 k) of code + 128, the lane scales (groups, blocks, 16 rows)."""
    padded, width = head.codes.shape
    if not head.lane_scale.numel():
        return head.codes[:vocab], None
    blocks = width // greedy.BLOCK
    codes = head.codes.view(torch.uint8).view(padded // 16, blocks, 8, 16, 4).permute(0, 3, 1, 2, 4)
    scale = head.lane_scale.view(padded // 16, blocks, 16).permute(0, 2, 1)
    return ((codes.reshape(padded, width).to(torch.int16) - 128).to(torch.int8)[:vocab],
            scale.reshape(padded, blocks)[:vocab])


def test_the_heads_codes_and_bounds_are_made_as_defined(kernels):
    """d3d_greedy_weights gives PyTorch's codes, scales and errors bit for bit — on blocks of zeros,
    of one value, of bf16's smallest and largest normal values, and random ones at many scales —
    and every error bounds its block's |w - scale·code|, exactly. A vocabulary not a multiple of the
    pass's lanes is padded with rows of zeros (limits 0)."""
    generator = torch.Generator().manual_seed(7)
    rows = [torch.randn(96, generator=generator) * 10.0 ** p for p in range(-30, 31, 3)]
    rows += [torch.zeros(96), torch.full((96,), -0.37), torch.full((96,), 1.2e-38), torch.full((96,), 3.0e38),
             torch.tensor([5.0, -5.0] * 48)]
    weight = torch.stack(rows).to(torch.bfloat16)
    made = greedy.GreedyHead.of(weight, None, kernels.library)
    codes, scale, error = reference_codes(weight)
    made_codes, lane_scale = row_layout(made, len(rows))
    assert torch.equal(made_codes, codes) and torch.equal(made.scale, scale) and torch.equal(made.error, error)
    assert lane_scale is None or torch.equal(lane_scale, scale)
    padded = greedy.padded_rows(len(rows), kernels.greedy.lanes)
    assert len(made.limits) == padded and not made.limits[len(rows):].any()
    assert torch.equal(made.limits[:len(rows)], torch.stack([error.amax(-1), scale.amax(-1)], -1))
    off = (weight.double().view(len(rows), -1, 32) - codes.double().view(len(rows), -1, 32) * scale.double()[..., None])
    assert bool((off.abs().amax(-1) <= error.double()).all())
    held = sum(t.numel() * t.element_size() for t in (made.codes, made.scale, made.error, made.limits, made.lane_scale))
    assert greedy.GreedyHead.bytes_of(*weight.shape, kernels.greedy.lanes) == held  # what a load reserves for it


def test_heads_without_runs_of_rows_have_none(kernels):
    """A bf16 head read as its own values (no quantized stream) takes the full head: `GreedyHeads.ids`
    declines and `Decoder.greedy_ids` takes the logits' argmax."""
    weight = torch.randn(64, 32).to(torch.bfloat16)
    assert kernels.greedy.head(weight) is None
    assert kernels.greedy.ids(torch.randn(2, 32).to(torch.bfloat16), weight) is None


def test_decoding_through_the_greedy_head_gives_the_same_tokens(kernels):
    """A tiny bf16 model whose weights are Q8_0 blocks: plain decoding and lookup-drafted decoding with
    the greedy head forced on (every argmax of 1-4 rows through it: a plain step's row, a
    verification's first rows at once) give the tokens of plain decoding with it off."""
    target = make_decoder(tiny_config(tie_word_embeddings=False), seed=6, dtype=torch.bfloat16)
    if target.row_exact is None:
        pytest.skip("the row-exact kernels did not build here")
    quantize_weights(target.row_exact, target.linear_weights(), "Q8_0")
    target.pack_weights()
    prompt, config = [3, 9, 27, 17, 51, 25, 3, 9, 27], GenerationConfig(max_new_tokens=40)
    exact = target.row_exact
    exact.greedy.on = False
    want = [t for step in reference_generate(target, prompt, config) for t in step.tokens]
    exact.greedy.on = True
    head = exact.greedy.head(target.head_weight)
    assert head is not None
    head.rows = frozenset(range(1, greedy.ROWS + 1))  # whatever this machine's timing said
    calls = []
    real = exact.greedy.ids
    exact.greedy.ids = lambda x, weight: calls.append(x.shape[0]) or real(x, weight)
    try:
        plain = [t for step in reference_generate(target, prompt, config) for t in step.tokens]
        plain_calls, calls[:] = calls[:], []
        sources = [LookupSource(LookupConfig())]
        drafted = [t for step in generate_from_sources(target, sources, prompt, config) for t in step.tokens]
    finally:
        del exact.greedy.ids
    assert plain == want and drafted == want
    assert plain_calls and set(plain_calls) == {1}  # the prefill's last row, each plain step's
    assert max(calls) > 1  # verifications' rows together


@pytest.mark.parametrize("build", ["native", "x86-64-v2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernels_argmax_is_greedy_ids(dtype, build):
    """`RowExactKernels.argmax` (greedy.h's d3d_argmax) gives `greedy_ids`' index on every row: ties to
    the lowest index, -0 equal to +0, rows of -inf, rows holding a NaN (torch's answer there), widths
    off the vector length, 1 to 3 dimensions — this machine's build and the portable C's."""
    kernels = row_exact_kernels() if build == "native" else kernels_built_for(build, why="the portable build is x86-64's")
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        rows, width = int(torch.randint(1, 6, (1,), generator=generator)), int(torch.randint(1, 70, (1,), generator=generator))
        x = (torch.randint(-3, 4, (rows, width), generator=generator).float() * 0.5).to(dtype)  # many ties
        if trial % 3 == 0:
            x[x == 0] = -0.0
        if trial % 7 == 0:
            x[0, width // 2] = float("nan")
        if trial % 11 == 0:
            x[-1] = float("-inf")
        for shaped in (x, x[0], x[None]):
            assert torch.equal(kernels.argmax(shaped), greedy_ids(shaped)), (trial, shaped)
    wide = torch.randn(3, 49_152, generator=generator).to(dtype)
    assert torch.equal(kernels.argmax(wide), greedy_ids(wide))
