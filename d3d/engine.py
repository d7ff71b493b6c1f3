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
from d3d.gate import Crowd, SpeculationGate
from d3d.lookup import LookupConfig
from d3d.models import Decoder, SequenceRows
from d3d.sampling import make_generator
from d3d.sequence import Sequence, Step
from d3d.sources import DraftSource, check_vocabulary, default_sources, verify_reach
from d3d.target_step import TargetStates, judge, pick, prefill, reads_target_states, score_rows


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
    run = Run(target, sources, prompt_ids, config, adaptive)
    while not run.finished:
        part = run.rows()
        started = time.perf_counter()
        (logits, features), = score_rows(target, [part], run.feature_layers)
        step = run.settle(logits, features, time.perf_counter() - started)
        if step is not None:
            yield step


class Run:
    """One speculative generation between target forwards: `rows` says what it feeds the next one
    — the prompt (or, with `prefill_rows`, its next piece), else the anchor and the drafts its
    sources propose —, and `settle` takes that forward's logits: it picks, or verifies and commits,
    and returns the `Step` (None after a piece of the prompt that is not its last). The target's
    forward itself is the caller's: `generate_from_sources` runs one sequence, `d3d.batch` many in
    one forward. Every choice — the gate's, the random draws — depends on this run's own tokens, so
    a run batched with others commits what it commits alone."""

    def __init__(self, target: Decoder, sources: list[DraftSource], prompt_ids: list[int],
                 config: GenerationConfig, adaptive: bool = False) -> None:
        check_vocabulary(sources, target)
        self.target, self.sources, self.config = target, sources, config
        self.gate = None
        if adaptive and sources:
            self.gate = SpeculationGate({source.name: source.draft_costs(target) for source in sources},
                                        forward_costs(target, None, verify_reach(sources)).by_context("verify"),
                                        {source.name: source.catch_up_costs(target) for source in sources
                                         if hasattr(source, "catch_up_costs")})
        self.sequence = Sequence(prompt_ids, target.config.max_position_embeddings, config)
        self.generator = make_generator(config.sampling, target.device)
        for source in sources:
            source.start(self.sequence.max_length, target.device)
        self.states = TargetStates(sources, target.config.hidden_size) if any(map(reads_target_states, sources)) else None
        self.cache = target.new_cache(self.sequence.max_length)
        self.prefilled = 0  # prompt tokens in the cache
        self.source, self.drafts, self.draft_probs = "none", _no_drafts(target.device), None

    @property
    def finished(self) -> bool:
        return self.sequence.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.sequence.prompt_length

    @property
    def feature_layers(self) -> list[int]:
        """The target layers whose hidden states its sources read."""
        return self.states.layers if self.states is not None else []

    def rows(self, prefill_rows: int | None = None, crowd: Crowd | None = None) -> SequenceRows:
        """What the next forward scores for this run: the prompt's next `prefill_rows` tokens (all
        when None), or once it is in, the anchor and this step's drafts (proposed now; with a
        `crowd`, as many as pay for the batched forward as a whole)."""
        tokens = self.sequence.tokens
        if self.prefilling:
            end = self.sequence.prompt_length if prefill_rows is None else min(
                self.sequence.prompt_length, self.prefilled + max(1, prefill_rows))
            ids = torch.tensor(tokens[self.prefilled:end], device=self.target.device)
            return SequenceRows(ids, self.cache, last_only=True)  # a piece before the last: its logits go unread
        started = time.perf_counter()
        self.source, proposal = "none", None
        for source in self.sources:
            # Never draft past the length limit: the bonus token always needs one slot.
            wanted = min(source.max_drafts, self.sequence.room - 1)
            if self.gate is not None:
                pending = source.pending(tokens) if hasattr(source, "pending") else 0
                wanted = self.gate.num_drafts(source.name, wanted, len(tokens), pending, crowd)
            if wanted > 0:
                proposal = source.propose(tokens, wanted, self.config.sampling, self.generator)
                if proposal is not None:
                    self.source = source.name
                    break
        self.drafts, self.draft_probs = ((_no_drafts(self.target.device), None) if proposal is None
                                         else (proposal.draft_tokens, proposal.draft_probs))
        self.sequence.stats.draft_seconds += time.perf_counter() - started
        anchor = torch.tensor([tokens[-1]], device=self.target.device)
        return SequenceRows(torch.cat([anchor, self.drafts]), self.cache)

    def settle(self, logits: torch.Tensor, features: torch.Tensor | None, seconds: float) -> Step | None:
        """Take the forward of `rows`' part — logits (T, V), or (1, V) of a prompt's last piece; the
        hidden states its sources read — that took `seconds`."""
        sequence, states = self.sequence, self.states
        if self.prefilling:
            self.prefilled += self.cache.pending
            self.cache.commit()
            sequence.stats.verify_seconds += seconds
            if states is not None:
                states.commit(features)
                sequence.stats.draft_seconds += states.take_seconds()
            if self.prefilling:
                return None
            return sequence.commit([pick(logits[-1], self.config.sampling, self.generator)], 0, 0)
        started = time.perf_counter()
        verdict = judge(logits, self.drafts, self.draft_probs, self.config.sampling, self.generator)
        accepted = verdict.num_accepted
        self.cache.commit(accepted + 1)
        if states is not None:
            states.commit(features[:accepted + 1])
            sequence.stats.draft_seconds += states.take_seconds()  # the readers' work is drafting work
        sequence.stats.verify_seconds += seconds + time.perf_counter() - started
        if self.gate is not None:
            self.gate.record(self.source, len(self.drafts), accepted, len(sequence.tokens))
        new_tokens = self.drafts[:accepted].tolist() + [verdict.bonus_token]
        return sequence.commit(new_tokens, len(self.drafts), accepted, self.source)


def _no_drafts(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.long, device=device)
