"""Decoding forwards of one fixed shape (d3d.graphs): what a GPU runs, captured as CUDA graphs — here on
the CPU in their eager form (fixed rows asked for on a target without the row-exact kernels), and on a
GPU as graphs when torch sees one (scripts/device_check.sh runs this file there). A k-row forward's rows
are its one-row steps' bits (each row computed alone for one shape), the values are the dynamic path's
(the mask, positions and stored keys right), a prompt in pieces stores its steps' keys and values, and
the head takes the same rows."""

from __future__ import annotations

import pytest
import torch

from conftest import make_decoder, tiny_config
from d3d import graphs
from d3d.exactness import check_row_invariance

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
CPU_ROWS = 16  # the CPU form's rows (a GPU takes graphs.FIXED_ROWS)


def torch_decoder(dtype: torch.dtype, device: str, fixed: bool = True):
    """A tiny random target on PyTorch's ops: on the CPU without the row-exact kernels, in CPU_ROWS fixed
    rows; on a GPU as it comes (fixed rows and graphs by default). `fixed` False: each forward its own shape."""
    decoder = make_decoder(tiny_config(max_position_embeddings=128), seed=3, dtype=dtype).to(device)
    decoder.row_exact = None
    decoder.fixed_rows = (CPU_ROWS if device == "cpu" else None) if fixed else 0
    return decoder


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_fixed_rows_make_every_verification_its_steps_bits(dtype, device):
    """(On an AMD EPYC Zen 4 the same decoder's own shapes are not: in fp32 every row of 2-16-row
    forwards differs from its step, in bf16 3-4 rows of 12-16-row ones — `check_row_invariance` with
    fixed_rows 0.)"""
    decoder = torch_decoder(dtype, device)
    rows = graphs.fixed_rows_of(decoder)
    assert rows == (CPU_ROWS if device == "cpu" else graphs.FIXED_ROWS)
    report = check_row_invariance(decoder, max_rows=min(rows, 17), context=20)
    assert report.invariant, report.mismatched_rows
    assert report.kernels == f"torch, {rows} fixed rows" + " as CUDA graphs" * (device == "cuda")  # what doctor names
    cache = decoder.new_cache(64)
    decoder(torch.arange(5, device=device)[None], cache=cache)  # a prefill of 5 rows: fixed rows too
    cache.commit()
    runner = graphs.runner_for(decoder, cache, rows)  # the one the prefill made
    assert runner.rows == rows and (runner.graph is not None) == (device == "cuda") and runner.ids[0, 4] == 4


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_fixed_rows_compute_what_the_dynamic_path_does(device):
    """fp32, after a 20-token context: every row count's logits and stored keys and values match the
    path that attends to the cache's used slots only (within fp32 rounding) — and with the positions
    one off (the negative control) they do not."""
    generator = torch.Generator().manual_seed(0)
    vocab = tiny_config().vocab_size
    context, block = (torch.randint(0, vocab, (1, n), generator=generator).to(device) for n in (20, CPU_ROWS))
    results = {}
    for run in ("fixed", "dynamic", "shifted"):
        decoder = torch_decoder(torch.float32, device, fixed=run != "dynamic")
        cache = decoder.new_cache(64)
        decoder(context, cache=cache)
        cache.commit()
        if run == "shifted":
            graphs.runner_for(decoder, cache, graphs.fixed_rows_of(decoder)).steps += 1
        logits = []
        for count in (1, 3, CPU_ROWS):
            logits.append(decoder(block[:, :count], cache=cache)[0])
            cache.commit(0)
        results[run] = logits, cache.keys[:, :, :, 20:20 + CPU_ROWS].clone()
    close = dict(rtol=1e-5, atol=1e-5) if device == "cpu" else dict(rtol=1e-4, atol=1e-4)
    for got, want in zip(results["fixed"][0], results["dynamic"][0]):
        torch.testing.assert_close(got, want, **close)
    torch.testing.assert_close(results["fixed"][1], results["dynamic"][1], **close)
    assert not torch.allclose(results["shifted"][0][-1], results["dynamic"][0][-1], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_a_prompt_in_pieces_stores_what_its_steps_would(device):
    """bf16: a 40-token prompt at once (in pieces of the fixed rows), in two parts (17 + 23) and token by
    token stores the same keys and values, bit for bit, and gives its last token the same logits. (The
    decoder's own shapes do not, on an AMD EPYC Zen 4: token by token stores other keys and values.)"""
    decoder = torch_decoder(torch.bfloat16, device)
    prompt = torch.randint(0, tiny_config().vocab_size, (1, 40), generator=torch.Generator().manual_seed(2)).to(device)
    runs = []
    for cuts in ((0, 40), (0, 17, 40), tuple(range(41))):
        cache = decoder.new_cache(64)
        for begin, end in zip(cuts, cuts[1:]):
            last = decoder(prompt[:, begin:end], cache=cache, last_only=True)[0, -1]
            cache.commit()
        runs.append((last, cache.keys[:, :, :, :40].clone(), cache.values[:, :, :, :40].clone()))
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_the_head_takes_a_forwards_rows_as_calls_of_fixed_rows():
    generator = torch.Generator().manual_seed(1)
    x, weight = torch.randn(CPU_ROWS + 5, 24, generator=generator), torch.randn(40, 24, generator=generator)
    whole = graphs.fixed_rows_linear(x, weight, CPU_ROWS)
    torch.testing.assert_close(whole, x @ weight.T)
    for count in (1, 2, 7, CPU_ROWS):
        assert torch.equal(graphs.fixed_rows_linear(x[:count], weight, CPU_ROWS), whole[:count]), count
    assert torch.equal(graphs.fixed_rows_linear(x[CPU_ROWS:], weight, CPU_ROWS), whole[CPU_ROWS:])


@torch.no_grad()
def test_the_residual_stream_for_drafters_that_read_it_comes_from_the_same_rows():
    """A DFlash-style drafter reads the target's residual stream after some layers: the forwards that
    give it take the fixed rows too — k-row forwards' hidden states and features are their steps',
    bit for bit, and reading them changes no bit of the hidden states."""
    decoder = torch_decoder(torch.bfloat16, "cpu")
    generator = torch.Generator().manual_seed(4)
    context, block = (torch.randint(0, tiny_config().vocab_size, (1, n), generator=generator) for n in (20, 9))
    cache = decoder.new_cache(64)
    decoder(context, cache=cache)
    cache.commit()
    together, features = decoder.final_hidden(block, [0, 1], cache=cache)
    cache.commit(0)
    alone, _ = decoder.final_hidden(block, cache=cache)
    cache.commit(0)
    assert torch.equal(together, alone)
    steps = []
    for i in range(9):
        steps.append(decoder.final_hidden(block[:, i:i + 1], [0, 1], cache=cache))
        cache.commit()
    assert torch.equal(together, torch.cat([h for h, _ in steps], 1))
    assert torch.equal(features, torch.cat([f for _, f in steps], 1))


def test_a_dflash_drafters_output_is_the_targets_in_fixed_rows():
    """The engines' identity with a drafter that reads hidden states (the review found it broken when
    those forwards took their own shapes while plain decoding took the fixed rows)."""
    from d3d.config import GenerationConfig
    from d3d.drafter import Drafter
    from d3d.engine import generate_from_sources, reference_generate
    from d3d.sources import drafter_source

    target = make_decoder(tiny_config(tie_word_embeddings=False, max_position_embeddings=256), seed=1,
                          dtype=torch.bfloat16)
    target.row_exact, target.fixed_rows = None, CPU_ROWS
    drafter = Drafter.from_target(target, [0], block_size=8, kind="dflash")
    for seed in range(3):
        prompt = torch.randint(0, target.config.vocab_size, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        config = GenerationConfig(max_new_tokens=48)  # (prompt 1 differed at token 47 before)
        expected = [t for s in reference_generate(target, prompt, config) for t in s.tokens]
        got = [t for s in generate_from_sources(target, [drafter_source(drafter)], prompt, config) for t in s.tokens]
        assert got == expected, seed


@torch.no_grad()
def test_a_pooled_cache_comes_back_with_its_runner():
    """A GPU's caches come from a pool (`pooled_cache`, here called directly on the CPU): an ended
    request's storage and the runner captured over it serve the next request of that slot count, and the
    new request decodes as one on fresh storage does."""
    decoder = torch_decoder(torch.bfloat16, "cpu")
    prompt = torch.randint(0, tiny_config().vocab_size, (1, 30), generator=torch.Generator().manual_seed(5))

    def decode(cache) -> torch.Tensor:
        logits = decoder(prompt, cache=cache, last_only=True)
        cache.commit()
        return logits

    fresh = decode(decoder.new_cache(40))
    first = graphs.pooled_cache(decoder, 40)
    assert first.keys.shape[3] == 64 and first.capacity == 40
    assert torch.equal(decode(first), fresh)
    keys, runner = first.keys, first.pooled.runners[CPU_ROWS, ()]
    del first
    second = graphs.pooled_cache(decoder, 50)  # the same slot count: the same storage (zeroed), the same runner
    assert second.keys is keys and not keys.any() and graphs.runner_for(decoder, second, CPU_ROWS) is runner
    assert torch.equal(decode(second), fresh)
    with torch.no_grad():
        next(decoder.parameters()).data = next(decoder.parameters()).data.clone()  # a weight moved
    del second
    third = graphs.pooled_cache(decoder, 50)
    assert third.keys is keys and graphs.runner_for(decoder, third, CPU_ROWS) is not runner


def test_fixed_rows_stay_off_for_the_cpu_kernels_unless_asked():
    decoder = make_decoder(tiny_config(), seed=0)
    assert graphs.fixed_rows_of(decoder) == 0  # a CPU target: the row-exact kernels' own shapes
    decoder.fixed_rows = 8
    assert graphs.fixed_rows_of(decoder) == 8
    cache = decoder.new_cache(32)  # split values where the row-exact kernels read them: not this path's
    assert (graphs.runner_for(decoder, cache, 8) is None) == cache.split


@torch.no_grad()
def test_a_stored_prefix_serves_only_caches_whose_forwards_read_as_many_slots():
    """On a GPU attention reads every slot of a pooled cache's storage, so a prefix computed over 64
    slots may hold other bits than one computed over 128: the prefix cache restores an entry only into a
    cache of the same slot count (and CPU caches, which read the keys before each row, only their own)."""
    from d3d.prefix_cache import PrefixCache

    decoder = torch_decoder(torch.bfloat16, "cpu")
    prompt = list(range(1, 21))
    store = PrefixCache(1 << 20)
    cache = graphs.pooled_cache(decoder, 40)  # 64 slots
    decoder(torch.tensor([prompt]), cache=cache)
    cache.commit()
    store.keep(prompt, cache)
    assert store.restore(graphs.pooled_cache(decoder, 100), prompt, 20) == 0  # 128 slots
    assert store.restore(decoder.new_cache(40), prompt, 20) == 0  # a CPU cache
    assert store.restore(graphs.pooled_cache(decoder, 50), prompt, 20) == 20


def test_fixed_rows_never_serve_a_forward_that_records_gradients():
    decoder = torch_decoder(torch.float32, "cpu")
    cache = decoder.new_cache(32)
    with torch.enable_grad():
        assert graphs.fixed_rows_hidden(decoder, torch.arange(3), cache) is None
    with torch.no_grad():
        assert graphs.fixed_rows_hidden(decoder, torch.arange(3), cache) is not None
