"""Token engines: the AR reference and synchronous speculative decoding, as generators of steps.

`reference_generate` is plain autoregressive decoding over the native decoder and cache — the
definition every fast path is checked against, token for token. `speculative_generate` drafts a
block — from context lookup or the D3D drafter, or from any drafting sources (`d3d.sources`) with
`generate_from_sources` — verifies it with one target forward, and commits the accepted drafts
plus the target's bonus token. Both yield one `Step` per target forward and keep a running
`SpecStats`. The engines know nothing about text: ids in, ids out (see `d3d.generation`). The
target's half of each step — prefill, scoring and verifying a block — is `d3d.target_step`'s.

Cache invariant in both: the target cache holds every committed token but the last (the anchor),
which is fed with the next forward; the drafter cache holds a prefix of the committed tokens. A
source that reads the target's hidden states (DFlash-style) gets each committed token's once, in
order, from the forward that verified it (`TargetStates`): all of them but the anchor's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from d3d.config import GenerationConfig
from d3d.drafter import Drafter
from d3d.lookup import LookupConfig
from d3d.models import Decoder
from d3d.prefix_cache import PrefixCache
from d3d.sampling import make_generator
from d3d.sequence import Sequence, Step
from d3d.run import OnCommit, Run
from d3d.sources import DraftSource, default_sources
from d3d.target_step import next_token, prefill, score_rows


@torch.no_grad()
def reference_generate(target: Decoder, prompt_ids: list[int], config: GenerationConfig) -> Iterator[Step]:
    """Plain autoregressive decoding: one target forward per token."""
    sequence = Sequence(prompt_ids, target.config.max_position_embeddings, config)
    generator = make_generator(config.sampling, target.device)
    with target.holding_weights():
        step, cache = prefill(target, sequence, config.sampling, generator)
        yield step
        while sequence.finish_reason is None:
            started = time.perf_counter()
            ids = torch.tensor([[sequence.tokens[-1]]], device=target.device)
            hidden, _ = target.final_hidden(ids, cache=cache)
            cache.commit()
            token = next_token(target, hidden[0], config.sampling, generator)
            sequence.stats.verify_seconds += time.perf_counter() - started
            yield sequence.commit([token], 0, 0)


@torch.no_grad()
def speculative_generate(target: Decoder, drafter: Drafter | None, prompt_ids: list[int],
                         config: GenerationConfig, lookup: LookupConfig | None = None,
                         adaptive: bool = False) -> Iterator[Step]:
    """Synchronous speculative decoding: draft a block, verify it, commit, repeat.

    Drafts come from context lookup when `lookup` is set and the context holds a match, else from
    the diffusion drafter (when there is one); with neither, the step is a plain AR step. With
    `adaptive`, a `SpeculationGate` picks how many drafts each source proposes (none when
    plain decoding is expected to pay better).
    """
    yield from generate_from_sources(target, default_sources(drafter, lookup), prompt_ids, config, adaptive)


@torch.no_grad()
def generate_from_sources(target: Decoder, sources: list[DraftSource], prompt_ids: list[int],
                          config: GenerationConfig, adaptive: bool = False,
                          on_commit: OnCommit | None = None, prefixes: PrefixCache | None = None) -> Iterator[Step]:
    """`speculative_generate` over any drafting sources, asked in order: the first that proposes
    drafts the step (see `d3d.sources`); a step none drafts is a plain AR step. Sources that read the
    target's hidden states (DFlash-style) get them from every target forward, whoever drafted.
    The generation is one `d3d.run.Run`, scored alone; `on_commit` gets each step's logits (`d3d.run.OnCommit`);
    `prefixes`: the prefix cache it starts from and leaves its cache to."""
    run = Run(target, sources, prompt_ids, config, adaptive, on_commit, prefixes)
    try:
        with target.holding_weights():
            while not run.finished:
                run.plan()
                part = run.rows()
                started = time.perf_counter()
                (logits, features), = score_rows(target, [part], run.feature_layers)
                step = run.settle(logits, features, time.perf_counter() - started)
                if step is not None:
                    yield step
    finally:
        run.release()
