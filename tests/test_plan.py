"""A decoding step's fused forward through its `ForwardPlan` (d3d.kernels.plan): the bits of the
forward that builds its arguments at every call, whatever the cache layout, row count, context, cache
or thread — and a plan that follows what it was built over."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from conftest import make_decoder, tiny_config
from d3d.cache import KVCache
from d3d.config import GenerationConfig
from d3d.engine import generate_from_sources, reference_generate
from d3d.kernels.plan import MAX_ROWS
from d3d.models import SequenceRows
from d3d.sampling import greedy_ids


def ids_of(length: int, seed: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def unplanned(decoder, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The final hidden states of `ids` (1, T) after `cache` by the forward that builds its arguments each call."""
    positions = torch.arange(cache.length, cache.length + ids.shape[1])[None]
    return decoder.hidden_and_features(decoder.embed(ids), positions, cache)[0]


def plan_of(decoder):
    return decoder._plans.__dict__.get("plan")


@pytest.mark.parametrize("layout", ["plain", "split", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_a_planned_step_has_the_bits_of_the_forward_it_plans(dtype, layout):
    """Steps of 1-32 rows after a prompt, in every cache layout, through the plan: the hidden states,
    keys and values of the forward that builds its arguments at every call; 33 rows take that forward."""
    config = tiny_config("qwen3", head_dim=64, num_heads=2, num_kv_heads=1, max_position_embeddings=256)
    decoder = make_decoder(config, dtype=dtype)
    if layout == "tiled" and not decoder.row_exact.tiles_keys(dtype, 64):
        pytest.skip("this build reads no tiled keys in this dtype")
    c = decoder.config
    caches = [KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 200, 1, dtype, split=layout != "plain",
                      tile_keys=layout == "tiled") for _ in range(2)]
    for cache in reversed(caches):  # a prompt of 9 rows, planned too: last in the cache the steps go to
        decoder(ids_of(9, seed=1), cache=cache)
        cache.commit()
    for seed, (rows, kept) in enumerate([(1, 1), (5, 2), (17, 0), (MAX_ROWS, 3), (1, 1), (MAX_ROWS + 1, 0)]):
        ids = ids_of(rows, seed=10 + seed)
        before = plan_of(decoder)
        planned = decoder.final_hidden(ids, cache=caches[0])[0]
        assert (plan_of(decoder).args.rows == rows) == (rows <= MAX_ROWS)  # the plan ran it, or not
        assert torch.equal(planned, unplanned(decoder, ids, caches[1])), rows
        assert plan_of(decoder) is before  # one plan for the cache and all its steps
        for cache in caches:
            cache.commit(kept)
        assert torch.equal(caches[0].keys, caches[1].keys) and torch.equal(caches[0].values, caches[1].values)


@torch.no_grad()
def test_a_plan_follows_its_cache_its_weights_and_the_context():
    """Two caches in turn each get their own bits (the plan rebuilt for each); a weight changed in place
    is read at the next step; steps far into a long cache (the scores' scratch grown) keep the bits; and
    a plan holds its cache weakly."""
    decoder = make_decoder(tiny_config(max_position_embeddings=1024), dtype=torch.bfloat16)
    first, second, reference = (decoder.new_cache(1000) for _ in range(3))
    for cache, seed in ((first, 1), (second, 2)):
        decoder(ids_of(6, seed), cache=cache)
        cache.commit()
    step = ids_of(3, seed=3)
    one, two = decoder.final_hidden(step, cache=first)[0], decoder.final_hidden(step, cache=second)[0]
    assert not torch.equal(one, two)
    decoder(ids_of(6, seed=1), cache=reference)
    reference.commit()
    assert torch.equal(one, unplanned(decoder, step, reference))
    for cache in (first, reference):
        cache.commit(0)
    decoder.layers[0].mlp.down_proj.weight.mul_(2.0)  # in place, as an optimizer step
    changed = decoder.final_hidden(step, cache=first)[0]
    assert not torch.equal(changed, one) and torch.equal(changed, unplanned(decoder, step, reference))
    for cache in (first, reference):  # 900 tokens on: the scores' scratch must grow
        cache.commit(0)
        cache.reserve(900)
        cache.commit()
    far = ids_of(4, seed=4)
    assert torch.equal(decoder.final_hidden(far, cache=first)[0], unplanned(decoder, far, reference))
    held = weakref.ref(first.keys)
    del first
    gc.collect()
    assert held() is None and plan_of(decoder) is not None  # the plan did not keep the cache


@torch.no_grad()
def test_threads_decode_through_plans_of_their_own():
    """Two threads decoding with one decoder, each its own cache, both through plans at once: each
    thread's rows are those it gets alone (a plan is per thread: its structs are written every step)."""
    decoder = make_decoder(tiny_config(), dtype=torch.bfloat16)

    @torch.no_grad()  # (grad mode is per thread)
    def decode(seed: int, out: list) -> None:
        cache = decoder.new_cache(64)
        decoder(ids_of(4, seed), cache=cache)
        cache.commit()
        for i in range(30):
            rows = decoder.forward_rows([SequenceRows(ids_of(1 + i % 3, seed + i)[0], cache)])[0][0]
            cache.commit(1)
            out.append(rows)

    alone = {seed: [] for seed in (1, 2)}
    for seed, out in alone.items():
        decode(seed, out)
    together = {seed: [] for seed in (1, 2)}
    threads = [threading.Thread(target=decode, args=(seed, out)) for seed, out in together.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for seed in (1, 2):
        assert len(together[seed]) == 30 and all(torch.equal(a, b) for a, b in zip(alone[seed], together[seed]))


@torch.no_grad()
def test_a_hold_reads_the_weights_as_they_were_when_it_began():
    """Within `holding_weights` the layer table is checked once: a weight changed in place inside the
    hold is read from the next hold on (and by forwards outside any hold at once); a generation holds
    them, so one changed between generations is read by the next."""
    decoder = make_decoder(tiny_config(), dtype=torch.bfloat16)
    step = ids_of(3, seed=3)

    def hidden() -> torch.Tensor:
        cache = decoder.new_cache(16)
        decoder(ids_of(6, seed=1), cache=cache)
        cache.commit()
        return decoder.final_hidden(step, cache=cache)[0]

    before = hidden()
    weight = decoder.layers[0].mlp.down_proj.weight
    with decoder.holding_weights():
        assert torch.equal(hidden(), before)
        weight.mul_(2.0)
        assert torch.equal(hidden(), before)  # held: the table as checked when the hold began
        with decoder.holding_weights():  # a new hold checks once more
            after = hidden()
        assert not torch.equal(after, before)
    assert torch.equal(hidden(), after)
    weight.mul_(0.5)
    assert torch.equal(hidden(), before)  # outside any hold, every forward checks
    config = GenerationConfig(max_new_tokens=6)

    def generation_logits() -> torch.Tensor:
        seen: list[torch.Tensor] = []
        for _ in generate_from_sources(decoder, [], [1, 2, 3], config, on_commit=lambda logits, _: seen.append(logits)):
            pass
        return torch.cat(seen)

    first, original = generation_logits(), weight.clone()
    weight.mul_(-3.0)
    second = generation_logits()
    weight.copy_(original)
    assert torch.equal(generation_logits(), first) and not torch.equal(second, first)
    assert [t for s in reference_generate(decoder, [1, 2, 3], config) for t in s.tokens] == \
        [int(i) for i in greedy_ids(first)]
    assert decoder._holds == 0


def tiled_decoder(heads: int, capacity: int):
    """A bf16 decoder with head_dim 64 and one KV head for `heads` query heads, two caches of `capacity`
    slots whose keys are tiled, and one whose keys are rows (their tiles transposed into pairs as read,
    one at a time: the reference) — skipped where this build reads no tiled keys."""
    config = tiny_config("qwen3", head_dim=64, num_heads=heads, num_kv_heads=1, max_position_embeddings=256)
    decoder = make_decoder(config, dtype=torch.bfloat16)
    if not decoder.row_exact.tiles_keys(torch.bfloat16, 64):
        pytest.skip("this build reads no tiled keys")
    c = decoder.config
    return decoder, *(KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, 1, torch.bfloat16, split=True,
                              tile_keys=tiled) for tiled in (True, True, False))


@pytest.mark.parametrize("heads", [1, 3, 4])
@torch.no_grad()
def test_a_steps_whole_key_tiles_two_at_a_time_keep_the_bits(threads, heads):
    """A one-token step over a tiled cache scores two whole key tiles at a time (attention.h's
    fused_tiles2_bf16) and a tile left over alone: after every context from 1 to 80 keys — odd and even
    tile counts, each thread's span of tiles cut anywhere — its hidden state is the bits of the same
    step over keys stored as rows, and of the same row in a 2-row forward."""
    decoder, step, pairs, rows = tiled_decoder(heads, 100)
    ids = ids_of(82, seed=5)
    for cache in (step, rows):
        decoder(ids[:, :1], cache=cache)
        cache.commit()
    for length in range(1, 81):  # `step` and `rows` hold `length` tokens, `pairs` one fewer
        alone = decoder.final_hidden(ids[:, length:length + 1], cache=step)[0][0]
        reference = decoder.final_hidden(ids[:, length:length + 1], cache=rows)[0][0]
        together = decoder.final_hidden(ids[:, length - 1:length + 1], cache=pairs)[0][0]
        step.commit(), rows.commit(), pairs.commit(1)
        assert torch.equal(alone[-1], reference[-1]) and torch.equal(alone[-1], together[-1]), length


@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("rows", [2, 3, 9, 17])
@torch.no_grad()
def test_a_few_rows_whole_key_tiles_two_at_a_time_keep_the_bits(threads, heads, rows):
    """A call of a few rows (a verification) over a tiled cache scores the tiles that all its rows see
    whole two at a time (attention.h's ATTENTION_PAIR_RUN) and the rest tile by tile: block after block
    of `rows` tokens up to 120 keys, its hidden states are the bits of the same blocks over keys stored
    as rows, and of the same rows in one forward over all 120 tokens (a prefill's blocks of 32)."""
    decoder, whole, blocks, reference = tiled_decoder(heads, 128)
    ids = ids_of(120, seed=7)
    prefill = decoder.final_hidden(ids, cache=whole)[0][0]
    for start in range(0, 120 - rows + 1, rows):
        block = decoder.final_hidden(ids[:, start:start + rows], cache=blocks)[0][0]
        want = decoder.final_hidden(ids[:, start:start + rows], cache=reference)[0][0]
        blocks.commit(), reference.commit()
        assert torch.equal(block, want) and torch.equal(block, prefill[start:start + rows]), start
