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
from d3d.costs import forward_costs
from d3d.drafter import Drafter
from d3d.gate import SpeculationGate
from d3d.lookup import LookupConfig
from d3d.models import Decoder
from d3d.sampling import make_generator
from d3d.sequence import Sequence, Step
from d3d.sources import DraftSource, check_vocabulary, default_sources, verify_reach
from d3d.target_step import TargetStates, pick, prefill, reads_target_states, verify_block


@torch.no_grad()
def reference_generate(target: Decoder, prompt_ids: list[int], config: GenerationConfig) -> Iterator[Step]:
    """Plain autoregressive decoding: one target forward per token."""
    sequence = Sequence(prompt_ids, target.config.max_position_embeddings, config)
    generator = make_generator(config.sampling, target.device)
    step, cache = prefill(target, sequence, config.sampling, generator)
    yield step
    while sequence.finish_reason is None:
        started = time.perf_counter()
        ids = torch.tensor([[sequence.tokens[-1]]], device=target.device)
        logits = target(ids, cache=cache)[0, -1]
        cache.commit()
        token = pick(logits, config.sampling, generator)
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
                          config: GenerationConfig, adaptive: bool = False) -> Iterator[Step]:
    """`speculative_generate` over any drafting sources, asked in order: the first that proposes
    drafts the step (see `d3d.sources`); a step none drafts is a plain AR step. Sources that read the
    target's hidden states (DFlash-style) get them from every target forward, whoever drafted."""
    check_vocabulary(sources, target)
    gate = None
    if adaptive and sources:
        gate = SpeculationGate({source.name: source.draft_costs(target) for source in sources},
                               forward_costs(target, None, verify_reach(sources)).by_context("verify"),
                               {source.name: source.catch_up_costs(target) for source in sources
                                if hasattr(source, "catch_up_costs")})
    sequence = Sequence(prompt_ids, target.config.max_position_embeddings, config)
    generator = make_generator(config.sampling, target.device)
    for source in sources:
        source.start(sequence.max_length, target.device)
    states = TargetStates(sources, target.config.hidden_size) if any(map(reads_target_states, sources)) else None
    step, target_cache = prefill(target, sequence, config.sampling, generator, states)
    yield step
    no_drafts = torch.empty(0, dtype=torch.long, device=target.device)
    while sequence.finish_reason is None:
        started = time.perf_counter()
        name, proposal = "none", None
        for source in sources:
            # Never draft past the length limit: the bonus token always needs one slot.
            wanted = min(source.max_drafts, sequence.room - 1)
            if gate is not None:
                pending = source.pending(sequence.tokens) if hasattr(source, "pending") else 0
                wanted = gate.num_drafts(source.name, wanted, len(sequence.tokens), pending)
            if wanted > 0:
                proposal = source.propose(sequence.tokens, wanted, config.sampling, generator)
                if proposal is not None:
                    name = source.name
                    break
        draft_tokens, draft_probs = (no_drafts, None) if proposal is None else (proposal.draft_tokens,
                                                                               proposal.draft_probs)
        drafted = time.perf_counter()
        verdict = verify_block(target, target_cache, sequence.tokens[-1], draft_tokens, draft_probs,
                               config.sampling, generator, states)
        finished = time.perf_counter()
        observing = states.take_seconds() if states is not None else 0.0  # inside verify_block, but drafting work
        sequence.stats.draft_seconds += drafted - started + observing
        sequence.stats.verify_seconds += finished - drafted - observing
        if gate is not None:
            gate.record(name, len(draft_tokens), verdict.num_accepted, len(sequence.tokens))
        new_tokens = draft_tokens[:verdict.num_accepted].tolist() + [verdict.bonus_token]
        yield sequence.commit(new_tokens, len(draft_tokens), verdict.num_accepted, name)
