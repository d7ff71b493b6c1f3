"""Continuous batching (`d3d.batch`): every generation in a batch commits exactly what it commits alone.

Solo runs are the engines' own (`reference_generate`, `generate_from_sources`); batched runs join a
`Batch` at staggered steps, with mixed prompt lengths, max_new_tokens and methods (plain, lookup,
drafter, the gated default, DFlash-style), prompts entering in pieces of a few rows. At T = 0 the
tokens must equal, at T > 0 with each request's own seed too; the batched sampler's output law is
checked exactly (with the negative controls of tests/test_lossless.py). Failures and cancellations
stay with their run.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import make_decoder, make_oracle, perturb_drafter, tiny_config
from d3d.batch import Batch, SharedBatch, generate_batched
from d3d.config import GenerationConfig, SamplingConfig
from d3d.drafter import Drafter
from d3d.engine import generate_from_sources, reference_generate
from d3d.gate import SpeculationGate
from d3d.run import Run
from d3d.lookup import LookupConfig
from d3d.models import SequenceRows
from d3d.sources import DFlashSource, LookupSource, default_sources
from test_dflash import make_dflash
from test_lossless import (ALPHA, BUGS, LOOKUP, NEW_TOKENS, PROMPT, RUNS, law, p_value, pair,  # noqa: F401
                           sampling)

METHODS = ("ar", "lookup", "drafter", "speculative", "dflash")


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


def sources_for(method: str, target, drafter, dflash) -> tuple[list, bool]:
    """(sources, adaptive) of a method, fresh for one generation."""
    return {"ar": ([], False),
            "lookup": (default_sources(None, LookupConfig()), False),
            "drafter": (default_sources(drafter, None), False),
            "speculative": (default_sources(drafter, LookupConfig()), True),
            "dflash": ([LookupSource(LookupConfig()), DFlashSource(dflash)], False)}[method]


def solo(method, target, drafter, dflash, prompt, config) -> list[int]:
    if method == "ar":
        return tokens_of(reference_generate(target, prompt, config))
    sources, adaptive = sources_for(method, target, drafter, dflash)
    return tokens_of(generate_from_sources(target, sources, prompt, config, adaptive))


def make_run(method, target, drafter, dflash, prompt, config) -> Run:
    sources, adaptive = sources_for(method, target, drafter, dflash)
    return Run(target, sources, prompt, config, adaptive)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def models(request):
    target = make_decoder(tiny_config("llama", num_layers=3, max_position_embeddings=256), seed=2, dtype=request.param)
    drafter = make_oracle(target, block_size=4)  # accepted drafts, so blocks of several rows are verified
    return target, drafter, make_dflash(target)


def requests(count: int, seed: int = 0):
    """(method, prompt, config) of `count` requests: mixed methods, prompt lengths and max_new_tokens;
    some repeat a phrase so that lookup finds matches."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        length = [3, 40, 9, 70, 1, 17][i % 6]
        prompt = torch.randint(0, 64, (length,), generator=generator).tolist()
        if i % 2:
            prompt = (prompt + prompt)[:max(length, 2)]
        config = GenerationConfig(max_new_tokens=[12, 30, 5, 21][i % 4], eos_token_ids=[7] if i % 5 == 0 else [])
        out.append((METHODS[i % len(METHODS)], prompt, config))
    return out


def run_staggered(target, runs, joins, prefill_rows):
    """Runs joining a batch at the given steps; their tokens, by index."""
    batch = Batch(target, prefill_rows)
    keys, tokens, step = {}, {}, 0
    while len(keys) < len(runs) or len(batch):
        for i, run in enumerate(runs):
            if joins[i] == step:
                keys[batch.add(run)] = i
        for outcome in batch.step():
            assert outcome.error is None, outcome.error
            if outcome.step is not None:
                tokens.setdefault(keys[outcome.key], []).extend(outcome.step.tokens)
        step += 1
    return [tokens[i] for i in range(len(runs))]


@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_greedy_batched_equals_solo(models, concurrency):
    """T = 0: staggered arrivals, mixed methods and lengths, prompts in 8-row pieces."""
    target, drafter, dflash = models
    reqs = requests(concurrency)
    runs = [make_run(m, target, drafter, dflash, p, c) for m, p, c in reqs]
    joins = [0 if concurrency == 1 else (i * 3) % 7 for i in range(concurrency)]
    batched = run_staggered(target, runs, joins, prefill_rows=8)
    for (method, prompt, config), got in zip(reqs, batched):
        assert got == solo(method, target, drafter, dflash, prompt, config), method


def test_a_batch_verifies_several_drafted_blocks_in_one_forward(models):
    """The mechanism, not only the result: forwards held several sequences' multi-row blocks."""
    target, drafter, dflash = models
    reqs = [("drafter", [5, 6, 7, 8], GenerationConfig(max_new_tokens=20, eos_token_ids=[]))] * 4
    batch = Batch(target)
    for m, p, c in reqs:
        batch.add(make_run(m, target, drafter, dflash, p, c))
    passes = []  # the drafter forwards: how many sequences each held
    hidden_rows = drafter.decoder.hidden_rows
    drafter.decoder.hidden_rows = lambda embeds, parts, *rest: passes.append(len(parts)) or hidden_rows(embeds, parts,
                                                                                                           *rest)
    try:
        batch.run_all()
    finally:
        del drafter.decoder.hidden_rows
    assert batch.stats.mean_sequences > 3 and batch.stats.mean_rows > 8
    assert passes and passes.count(4) >= len(passes) - 1  # every run's drafts from one drafter forward
    assert len(passes) < batch.stats.forwards


@pytest.mark.parametrize("waiting", [0, 2])
def test_with_nothing_waiting_only_the_runs_the_batch_waits_on_draft(models, monkeypatch, waiting):
    """Gated runs of 30 and 10 new tokens decoding together: with nothing waiting to join, the batch
    lasts as long as the run with the most tokens left, so only that run is offered drafts
    (`Crowd.waited_on`) — the 10-token run at first not, the 30-token run until its accepted drafts
    take it below the other; with requests waiting, a finished run's place is taken at once and
    every run may draft. Either way each run's tokens are its solo tokens."""
    target, drafter, dflash = models
    configs = [GenerationConfig(max_new_tokens=n, eos_token_ids=[]) for n in (30, 10)]
    runs = [make_run("speculative", target, drafter, dflash, [5, 6, 7, 8], c) for c in configs]
    offers = []  # (run index, waited on, its tokens left, the other's)
    num_drafts = SpeculationGate.num_drafts

    def spy(gate, source, max_drafts, context=0, pending=0, crowd=None, chances=None):
        if crowd is not None:
            i = next(j for j, run in enumerate(runs) if run.gate is gate)  # dataclasses: == compares fields
            offers.append((i, crowd.waited_on, runs[i].sequence.room, runs[1 - i].sequence.room))
        return num_drafts(gate, source, max_drafts, context, pending, crowd, chances)

    monkeypatch.setattr(SpeculationGate, "num_drafts", spy)
    batch = Batch(target, backlog=lambda: waiting)
    keys = [batch.add(run) for run in runs]
    steps = batch.run_all()
    assert offers and (0, True) in {offer[:2] for offer in offers}
    for i, waited_on, left, other_left in offers:
        assert waited_on == (bool(waiting) or left >= other_left)
    assert (1, False) in {offer[:2] for offer in offers} or waiting
    for key, config in zip(keys, configs):
        assert tokens_of(steps[key]) == solo("speculative", target, drafter, dflash, [5, 6, 7, 8], config)


def test_seeded_sampling_with_a_drafter_batched_equals_solo():
    """T > 0 with a real (perturbed, so imperfect) D3D drafter: the batch runs every sequence's
    drafter pass in one forward, and each request still draws its solo drafts and tokens."""
    target = make_decoder(tiny_config("llama", num_layers=3, max_position_embeddings=256), seed=2,
                          dtype=torch.bfloat16)
    drafter = Drafter.from_target(target, [0, 2], block_size=4)
    perturb_drafter(drafter, 0.05, seed=3)
    reqs = [(torch.randint(0, 64, (5 + 7 * i,), generator=torch.Generator().manual_seed(i)).tolist(),
             GenerationConfig(max_new_tokens=24, eos_token_ids=[],
                              sampling=SamplingConfig(temperature=0.9, top_k=(0, 8)[i % 2], seed=50 + i)))
            for i in range(6)]
    runs = [Run(target, default_sources(drafter, None), p, c) for p, c in reqs]
    batched = run_staggered(target, runs, [i % 2 for i in range(len(runs))], prefill_rows=16)
    for (prompt, config), got in zip(reqs, batched):
        assert got == tokens_of(generate_from_sources(target, default_sources(drafter, None), prompt, config))
    assert sum(sum(run.sequence.stats.accepted_at) for run in runs)  # some drafts were kept, some not
    assert sum(run.sequence.stats.accepted_histogram[0] for run in runs)


def test_seeded_sampling_batched_equals_solo(models):
    """T > 0: each request's own seed gives its solo output, whatever shares the batch."""
    target, drafter, dflash = models
    reqs = []
    for i, (method, prompt, config) in enumerate(requests(8, seed=1)):
        config = GenerationConfig(max_new_tokens=config.max_new_tokens, eos_token_ids=[],
                                  sampling=SamplingConfig(temperature=0.8 + 0.1 * (i % 3), top_k=(0, 5)[i % 2],
                                                          top_p=(1.0, 0.9)[i % 2], seed=100 + i))
        reqs.append((method, prompt, config))
    runs = [make_run(m, target, drafter, dflash, p, c) for m, p, c in reqs]
    batched = run_staggered(target, runs, [i % 3 for i in range(len(runs))], prefill_rows=16)
    for (method, prompt, config), got in zip(reqs, batched):
        assert got == solo(method, target, drafter, dflash, prompt, config), method


def test_forward_rows_is_each_sequence_alone(models):
    """The batched forward itself: ragged parts after caches of different lengths, a masked part
    among causal ones — each part's logits and KV are those of its forward alone."""
    target, _, _ = models
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 64, (n,), generator=generator) for n in (5, 33, 1, 12)]
    blocks = [torch.randint(0, 64, (n,), generator=generator) for n in (1, 4, 7, 2)]
    with torch.no_grad():
        alone, caches = [], []
        for prompt, block in zip(prompts, blocks):
            cache = target.new_cache(128)
            target(prompt[None], cache=cache)
            cache.commit()
            mask = torch.ones(len(block), cache.length + len(block), dtype=torch.bool)  # bidirectional block
            alone.append(target(block[None], cache=cache, mask=mask[None] if len(block) == 7 else None)[0])
            caches.append(cache)
        batched_caches = [target.new_cache(128) for _ in prompts]
        target.forward_rows([SequenceRows(p, c) for p, c in zip(prompts, batched_caches)])
        for cache in batched_caches:
            cache.commit()
        parts = [SequenceRows(b, c, mask=torch.ones(len(b), c.length + len(b), dtype=torch.bool) if len(b) == 7 else None)
                 for b, c in zip(blocks, batched_caches)]
        got = target.forward_rows(parts)
    for want, (logits, _), cache, mine in zip(alone, got, caches, batched_caches):
        assert torch.equal(want, logits)
        end = cache.length + cache.pending
        assert torch.equal(cache.keys[:, :, :, :end], mine.keys[:, :, :, :end])


def test_a_failing_run_leaves_the_others_alone(models):
    target, drafter, dflash = models

    class Broken(LookupSource):
        def propose(self, tokens, num_drafts, sampling, generator):
            if len(tokens) > 12:
                raise RuntimeError("this source broke")
            return super().propose(tokens, num_drafts, sampling, generator)

    config = GenerationConfig(max_new_tokens=20, eos_token_ids=[])
    healthy = [make_run("speculative", target, drafter, dflash, [1, 2, 3, 1, 2], config) for _ in range(2)]
    broken = Run(target, [Broken(LookupConfig())], [4, 5, 6], config)
    batch = Batch(target)
    keys = [batch.add(run) for run in (healthy[0], broken, healthy[1])]
    errors, tokens = {}, {key: [] for key in keys}
    while len(batch):
        for outcome in batch.step():
            if outcome.error is not None:
                errors[outcome.key] = outcome.error
            elif outcome.step is not None:
                tokens[outcome.key] += outcome.step.tokens
    assert list(errors) == [keys[1]] and "broke" in str(errors[keys[1]])
    want = solo("speculative", target, drafter, dflash, [1, 2, 3, 1, 2], config)
    assert tokens[keys[0]] == tokens[keys[2]] == want


def test_cancelled_runs_leave_between_steps(models):
    target, drafter, dflash = models
    config = GenerationConfig(max_new_tokens=25, eos_token_ids=[])
    shared = SharedBatch(Batch(target))
    streams = [shared.submit(make_run("drafter", target, drafter, dflash, [9, i, 4], config)) for i in range(3)]
    got = [[], [], []]
    for _ in range(3):
        for i, stream in enumerate(streams):
            got[i] += next(stream).tokens
    streams[1].close()
    assert len(shared.batch) == 2 and next(streams[1], None) is None
    for i in (0, 2):
        got[i] += tokens_of(streams[i])
    for i in (0, 2):
        assert got[i] == solo("drafter", target, drafter, dflash, [9, i, 4], config)
    assert len(shared.batch) == 0 and not shared.feeds


def test_batched_streams_drive_one_batch_from_several_threads(models):
    """The server's use: each request pulls its own stream, from its own thread."""
    import threading
    target, drafter, dflash = models
    reqs = requests(6, seed=3)
    shared = SharedBatch(Batch(target, prefill_rows=16))
    streams = [shared.submit(make_run(m, target, drafter, dflash, p, c)) for m, p, c in reqs]
    got: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, tokens_of(streams[i]))) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, (method, prompt, config) in enumerate(reqs):
        assert got[i] == solo(method, target, drafter, dflash, prompt, config)
    assert shared.batch.stats.mean_sequences > 1


# -- the output law of batched sampling -------------------------------------------------------------

def sample_batched(pair, runs: int = RUNS, width: int = 16) -> Counter:
    """Seeded generations (seeds 0 … runs-1) of the gated default (lookup + drafter), `width` at a time in one batch."""
    target, drafter = pair
    counts = Counter()
    for first in range(0, runs, width):
        batch = [Run(target, default_sources(drafter, LOOKUP), PROMPT,
                     GenerationConfig(max_new_tokens=NEW_TOKENS, sampling=sampling(seed)), adaptive=True)
                 for seed in range(first, min(runs, first + width))]
        for steps in generate_batched(target, batch, prefill_rows=2):
            counts[tuple(tokens_of(steps))] += 1
    return counts


def test_batched_sampling_follows_the_target_law(pair, law):  # noqa: F811
    counts = sample_batched(pair)
    assert sum(counts.values()) == RUNS and all(len(c) == NEW_TOKENS for c in counts)
    assert p_value(counts, law) >= ALPHA


@pytest.mark.parametrize("bug", BUGS)
def test_the_law_check_catches_batched_wiring_bugs(pair, law, bug, monkeypatch):  # noqa: F811
    BUGS[bug](monkeypatch)
    assert p_value(sample_batched(pair), law) < ALPHA, f"{bug} in the batched engine went unnoticed"


def test_a_batch_takes_only_its_own_targets_runs(models):
    target, drafter, dflash = models
    other = make_decoder(tiny_config("llama"), seed=9)
    with pytest.raises(ValueError, match="own target"):
        Batch(target).add(Run(other, [], [1, 2], GenerationConfig(max_new_tokens=2)))
    with pytest.raises(ValueError, match="prefill_rows"):
        Batch(target, prefill_rows=0)


def test_a_stream_closed_while_the_batch_steps_leaves_cleanly(models):
    """A stream closed from inside the batch's step, on the stepping thread (as a finaliser may:
    the lock is re-entrant): its run leaves, the others decode as alone."""
    target, drafter, dflash = models
    config = GenerationConfig(max_new_tokens=10, eos_token_ids=[])
    shared = SharedBatch(Batch(target))
    streams = [shared.submit(make_run("ar", target, drafter, dflash, [3, i, 5], config)) for i in range(3)]
    real_step = shared.batch.step

    def step():
        streams[1].close()  # as a finaliser would, from inside the step
        return real_step()
    shared.batch.step = step
    got = tokens_of(streams[0])
    assert got == solo("ar", target, drafter, dflash, [3, 0, 5], config)
    assert tokens_of(streams[2]) == solo("ar", target, drafter, dflash, [3, 2, 5], config)
