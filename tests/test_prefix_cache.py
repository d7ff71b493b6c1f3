"""The prefix cache (`d3d.prefix_cache`): a prompt that starts with tokens an ended generation
computed copies their keys and values instead of computing them — and decodes exactly what it
decodes from scratch: a chat's next turn, the same prompt again, prompts sharing a system prompt,
alone and in a continuous batch, at T = 0 and with a seed at T > 0, with every method that reads no
hidden states. The store's own rules: the longest prefix wins, never the prompt's last token, an
extended entry is replaced, the least recently used leaves first within the byte budget.
"""

from __future__ import annotations

import pytest
import torch

import d3d.run
from conftest import make_decoder, make_oracle, tiny_config
from d3d.batch import Batch
from d3d.cache import KVCache, key_rows
from d3d.config import GenerationConfig, SamplingConfig
from d3d.engine import generate_from_sources, reference_generate
from d3d.lookup import LookupConfig
from d3d.prefix_cache import PrefixCache, common_prefix
from d3d.run import Run
from d3d.sources import DFlashSource, LookupSource, default_sources
from test_dflash import make_dflash

MIB = 1 << 20


def filled_cache(length: int, split: bool, seed: int = 0, capacity: int = 64, tiled: bool = False) -> KVCache:
    """A cache of `length` committed positions of random keys and values."""
    cache = KVCache(2, 2, 32, capacity, split=split, tile_keys=tiled)
    generator = torch.Generator().manual_seed(seed)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator))
    cache.values.copy_(torch.randn(cache.values.shape, generator=generator))
    cache.length = length
    return cache


@pytest.mark.parametrize("split,tiled", [(False, False), (True, False), (True, True)], ids=["plain", "split", "tiled"])
def test_a_restored_prefix_holds_the_stored_positions_bit_for_bit(split, tiled):
    source = filled_cache(20, split, tiled=tiled)
    store = PrefixCache(MIB)
    store.keep(list(range(100, 120)), source)
    target = KVCache(2, 2, 32, 64, split=split, tile_keys=tiled)
    assert store.restore(target, list(range(100, 112)) + [7, 8, 9], limit=14) == 12
    assert target.length == 12 and target.pending == 0
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(target.snapshot(12), source.snapshot(12)))
    assert not (key_rows(target.keys) if tiled else target.keys)[..., 12:, :].any()  # nothing past the prefix came along
    assert (store.stats.lookups, store.stats.hits, store.stats.reused_tokens) == (1, 1, 12)


def test_the_longest_prefix_wins_and_the_limit_holds():
    store = PrefixCache(MIB)
    store.keep([1, 2, 3, 4], filled_cache(4, False, seed=1))
    store.keep([1, 2, 9, 9, 9, 9], filled_cache(6, False, seed=2))
    store.keep([5, 6, 7], filled_cache(3, False, seed=3))
    target = KVCache(2, 2, 32, 64)
    assert store.restore(target, [1, 2, 9, 9, 9, 9, 9], limit=6) == 6
    assert store.restore(target, [1, 2, 9, 9, 9, 9, 9], limit=3) == 3  # e.g. never the prompt's last token
    assert store.restore(target, [1, 2, 3, 4, 5], limit=4) == 4
    assert torch.equal(target.keys[..., :4, :], filled_cache(4, False, seed=1).keys[..., :4, :])
    assert store.restore(target, [8, 1, 2], limit=2) == 0
    assert store.stats.hits == 3 and store.stats.lookups == 4


def test_an_entry_a_new_one_extends_is_replaced_and_a_contained_one_is_not_stored():
    store = PrefixCache(MIB)
    store.keep([1, 2, 3], filled_cache(3, False))
    store.keep([1, 2, 3, 4, 5], filled_cache(5, False))  # a chat's next turn: the longer one stays
    assert [entry.tokens.tolist() for entry in store.entries.values()] == [[1, 2, 3, 4, 5]]
    store.keep([1, 2], filled_cache(2, False))  # already held inside it
    assert len(store) == 1
    store.keep([1, 2, 7], filled_cache(3, False))  # a branch: both kept
    assert len(store) == 2


def test_only_committed_positions_are_kept():
    cache = filled_cache(5, False)
    cache.pending = 3  # a forward's rows not committed
    store = PrefixCache(MIB)
    store.keep(list(range(10)), cache)
    assert [entry.tokens.tolist() for entry in store.entries.values()] == [[0, 1, 2, 3, 4]]
    store.keep([], cache)
    store.keep([3], filled_cache(0, False))
    assert len(store) == 1


def test_the_least_recently_used_entry_leaves_first_within_the_budget():
    size = PrefixCache(MIB)
    size.keep([1] * 10, filled_cache(10, False))
    entry_bytes = size.nbytes
    store = PrefixCache(3 * entry_bytes)
    for first in (1, 2, 3):
        store.keep([first] * 10, filled_cache(10, False))
    store.restore(KVCache(2, 2, 32, 64), [1] * 11, limit=10)  # entry 1 used: entry 2 is now the oldest
    store.keep([4] * 10, filled_cache(10, False))
    assert sorted(entry.tokens[0].item() for entry in store.entries.values()) == [1, 3, 4]
    assert store.nbytes == 3 * entry_bytes
    small = PrefixCache(entry_bytes - 1)  # longer than the whole budget: the prefix that fits
    small.keep(list(range(10)), filled_cache(10, False))
    assert [entry.tokens.tolist() for entry in small.entries.values()] == [list(range(9))]
    assert small.nbytes <= small.max_bytes
    nothing = PrefixCache(0)
    nothing.keep([1] * 10, filled_cache(10, False))
    assert len(nothing) == 0 and nothing.nbytes == 0
    with pytest.raises(ValueError, match="at least 0"):
        PrefixCache(-1)
    assert filled_cache(0, True).position_bytes == filled_cache(0, False).position_bytes == 2 * 2 * 2 * 32 * 4


def test_a_snapshot_of_another_layout_is_refused():
    with pytest.raises(ValueError, match="another layout"):
        KVCache(2, 2, 32, 64).restore(*filled_cache(4, True).snapshot(4), 4)


def test_common_prefix():
    assert common_prefix(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4, 5])) == 2
    assert common_prefix(torch.tensor([1, 2]), torch.tensor([1, 2, 4])) == 2
    assert common_prefix(torch.tensor([], dtype=torch.long), torch.tensor([1])) == 0
    assert common_prefix(torch.tensor([3]), torch.tensor([1])) == 0


# -- exactness: decoding from a restored prefix ----------------------------------------------------

METHODS = ("ar", "lookup", "drafter", "speculative")


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def models(request):
    # head_dim 32: the kernels' split V layout, as the real target's caches
    target = make_decoder(tiny_config("llama", num_layers=3, head_dim=32, max_position_embeddings=256), seed=2,
                          dtype=request.param)
    assert target.splits_values
    return target, make_oracle(target, block_size=4)


def sources(method, drafter):
    return {"ar": ([], False), "lookup": (default_sources(None, LookupConfig()), False),
            "drafter": (default_sources(drafter, None), False),
            "speculative": (default_sources(drafter, LookupConfig()), True)}[method]


def decode(target, drafter, method, prompt, config, prefixes=None) -> tuple[list[int], int, torch.Tensor]:
    """A generation alone: its tokens, the prompt tokens it took from `prefixes`, and the target's
    logits of every committed token — bits, which a wrong key or value changes even where the
    tokens survive it."""
    found, adaptive = sources(method, drafter)
    logits = []
    steps = list(generate_from_sources(target, found, prompt, config, adaptive,
                                       on_commit=lambda rows, tokens: logits.append(rows.clone()), prefixes=prefixes))
    return [t for s in steps for t in s.tokens], steps[-1].stats.cached_tokens, torch.cat(logits)


def same(a, b) -> bool:
    """Two `decode` results: the same tokens and the same logits, bit for bit."""
    return a[0] == b[0] and torch.equal(a[2], b[2])


def conversation(seed: int = 0) -> tuple[list[int], list[int]]:
    generator = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 64, (23,), generator=generator).tolist()
    return system, torch.randint(0, 64, (9,), generator=generator).tolist()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_chats_next_turn_decodes_exactly_as_from_scratch(models, method, temperature):
    """Turn 1, then turn 2 = turn 1's prompt + its answer + a new message: the second turn reuses
    the first's positions (its prompt and answer) and commits what it commits with no cache."""
    target, drafter = models
    system, message = conversation()
    config = GenerationConfig(max_new_tokens=20, eos_token_ids=[],
                              sampling=SamplingConfig(temperature=temperature, seed=11))
    store = PrefixCache(MIB)
    first = decode(target, drafter, method, system, config, store)
    assert first[1] == 0 and same(first, decode(target, drafter, method, system, config))
    second_prompt = system + first[0] + message
    second = decode(target, drafter, method, second_prompt, config, store)
    assert second[1] == len(system) + len(first[0]) - 1  # the answer's last token was never a forward's input
    assert same(second, decode(target, drafter, method, second_prompt, config))
    again = decode(target, drafter, method, second_prompt, config, store)  # the same request again
    assert again[1] == len(second_prompt) - 1 and same(again, second)


def test_reference_decoding_gives_the_same_tokens_as_a_run_from_a_prefix(models):
    """Plain decoding with a prefix cache is a run with no source: equal to `reference_generate`."""
    target, drafter = models
    system, message = conversation(1)
    config = GenerationConfig(max_new_tokens=16, eos_token_ids=[])
    store = PrefixCache(MIB)
    decode(target, drafter, "ar", system + [1, 2, 3], config, store)
    tokens, cached, _ = decode(target, drafter, "ar", system + message, config, store)
    assert cached == len(system)
    assert tokens == [t for s in reference_generate(target, system + message, config) for t in s.tokens]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_batched_runs_sharing_a_system_prompt_decode_as_alone(models, temperature):
    """A continuous batch whose runs start from stored prefixes (and leave theirs when they end,
    for the runs joining later), prompts in 8-row pieces, mixed methods: every run commits its
    solo tokens from scratch."""
    target, drafter = models
    system, _ = conversation(2)
    generator = torch.Generator().manual_seed(5)
    prompts = [system + torch.randint(0, 64, (n,), generator=generator).tolist() for n in (4, 1, 12, 7, 3, 9)]
    prompts.append(prompts[2])  # a repeated request
    store = PrefixCache(MIB)
    remember(target, store, system)
    config = GenerationConfig(max_new_tokens=14, eos_token_ids=[],
                              sampling=SamplingConfig(temperature=temperature, seed=3))
    runs, logits = [], {}
    for i, prompt in enumerate(prompts):
        found, adaptive = sources(METHODS[i % len(METHODS)], drafter)
        keep = (lambda i: lambda rows, _: logits.setdefault(i, []).append(rows.clone()))(i)
        runs.append(Run(target, found, prompt, config, adaptive, keep, prefixes=store))
    batch = Batch(target, prefill_rows=8)
    keys, tokens, joined = {}, {}, 0
    while joined < len(runs) or len(batch):
        if joined < len(runs):  # one joins per step: later runs find earlier runs' entries
            keys[batch.add(runs[joined])] = joined
            joined += 1
        for outcome in batch.step():
            assert outcome.error is None, outcome.error
            if outcome.step is not None:
                tokens.setdefault(keys[outcome.key], []).extend(outcome.step.tokens)
    for i, prompt in enumerate(prompts):
        assert runs[i].sequence.stats.cached_tokens >= len(system)
        assert same((tokens[i], 0, torch.cat(logits[i])), decode(target, drafter, METHODS[i % len(METHODS)], prompt,
                                                                 config)), i
    assert store.stats.hits == len(prompts)


def test_a_prompt_is_stored_once_it_is_in_while_its_answer_is_still_decoding(models):
    """A request arriving while another with the same long prompt decodes finds that prompt (its
    prefill's positions are stored as soon as it is in); the entry grows to prompt + answer at the
    end (the longer replaces it)."""
    target, drafter = models
    system, message = conversation(6)
    prompt = system + message
    config = GenerationConfig(max_new_tokens=24, eos_token_ids=[])
    store = PrefixCache(MIB)

    def run(method, prompt):
        found, adaptive = sources(method, drafter)
        return Run(target, found, prompt, config, adaptive, prefixes=store)

    first = run("speculative", prompt)
    batch = Batch(target, prefill_rows=8)
    batch.add(first)
    while first.prefilling:
        batch.step()
    assert [entry.tokens.tolist() for entry in store.entries.values()] == [prompt] and not first.finished
    second = run("lookup", prompt + [3, 4])
    assert second.sequence.stats.cached_tokens == len(prompt)
    key = batch.add(second)
    steps = batch.run_all()[key]
    assert [t for step in steps for t in step.tokens] == decode(target, drafter, "lookup", prompt + [3, 4], config)[0]
    assert len(store) == 2 and all(len(entry.tokens) > len(prompt) for entry in store.entries.values())


def remember(target, store: PrefixCache, tokens: list[int]) -> None:
    """Store the positions of `tokens` as a generation leaves them (its prompt's forward)."""
    list(generate_from_sources(target, [], tokens, GenerationConfig(max_new_tokens=1, eos_token_ids=[]),
                               prefixes=store))
    assert store.entries and next(reversed(store.entries.values())).tokens.tolist() == tokens


def test_a_target_that_is_not_row_exact_computes_every_prompt(models, monkeypatch):
    """Where a forward's bits depend on its rows (PyTorch's kernels on an unverified device), a
    stored prefix is not this prompt's own: the run neither reads nor writes the cache."""
    target, drafter = models
    system, message = conversation(3)
    store = PrefixCache(MIB)
    remember(target, store, system)
    monkeypatch.setattr(d3d.run, "verify_mode", lambda target: "row-by-row")
    config = GenerationConfig(max_new_tokens=6, eos_token_ids=[])
    _, cached, _ = decode(target, drafter, "lookup", system + message, config, store)
    assert cached == 0 and store.stats.lookups == 1 and len(store) == 1


def test_sources_that_read_hidden_states_compute_every_prompt(models):
    """A DFlash-style drafter reads the target's hidden states of every prompt position, which a
    stored prefix does not hold: such runs neither read nor write the cache."""
    target, _ = models
    system, message = conversation(4)
    store = PrefixCache(MIB)
    remember(target, store, system)
    config = GenerationConfig(max_new_tokens=6, eos_token_ids=[])
    found = [LookupSource(LookupConfig()), DFlashSource(make_dflash(target))]
    steps = list(generate_from_sources(target, found, system + message, config, prefixes=store))
    assert steps[-1].stats.cached_tokens == 0 and store.stats.lookups == 1 and len(store) == 1
