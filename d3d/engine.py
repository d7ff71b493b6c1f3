"""Token engines: the AR reference and synchronous speculative decoding, as generators of steps.

`reference_generate` is plain autoregressive decoding over the native decoder and cache — the
definition every fast path is checked against, token for token. `speculative_generate` drafts a
block — from context lookup or the D3D drafter, or from any drafting sources (`d3d.sources`) with
`generate_from_sources` — verifies it with one target forward, and commits the accepted drafts
plus the target's bonus token. Both yield one `Step` per target forward and keep a running
`SpecStats`. The engines know nothing about text: ids in, ids out (see `d3d.generation`).

Cache invariant in both: the target cache holds every committed token but the last (the anchor),
which is fed with the next forward; the drafter cache holds a prefix of the committed tokens. A
source that reads the target's hidden states (DFlash-style) gets each committed token's once, in
order, from the forward that verified it (`TargetStates`): all of them but the anchor's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch

from d3d.cache import KVCache
from d3d.config import GenerationConfig, SamplingConfig
from d3d.costs import forward_costs
from d3d.drafter import Drafter
from d3d.exactness import verify_mode
from d3d.gate import SpeculationGate
from d3d.lookup import LookupConfig
from d3d.models import Decoder
from d3d.sampling import make_generator, probabilities, sample
from d3d.sources import DraftSource, check_vocabulary, default_sources, verify_reach
from d3d.stats import SpecStats
from d3d.verify import Verdict, verify_greedy, verify_sampling

FinishReason = Literal["eos", "length"]


class PromptError(ValueError):
    """A prompt that cannot be generated from (empty, or no room left in the context)."""


@dataclass
class Step:
    """What one target forward committed."""

    tokens: list[int]  # tokens committed by this step (truncated at EOS / length)
    num_drafted: int  # drafts the target verified (0 for AR steps and the prefill)
    num_accepted: int  # drafts it accepted
    source: str  # the drafting source's name (d3d.sources): "lookup", "drafter", …; "none" for plain steps
    finish_reason: FinishReason | None  # set on the last step
    stats: SpecStats = field(repr=False)  # running totals of the whole generation


class Sequence:
    """Committed tokens and the limits that end a generation."""

    def __init__(self, prompt_ids: list[int], context: int, config: GenerationConfig) -> None:
        if not prompt_ids:
            raise PromptError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= context:
            raise PromptError(f"the prompt has {len(prompt_ids)} tokens; the model's context holds "
                              f"{context}, leaving no room to generate")
        self.tokens = list(prompt_ids)
        self.prompt_length = len(prompt_ids)
        self.max_length = min(context, len(prompt_ids) + config.max_new_tokens)
        self.eos = set(config.eos_token_ids)
        self.finish_reason: FinishReason | None = None
        self.stats = SpecStats()
        self.started = time.perf_counter()

    @property
    def room(self) -> int:
        """Tokens that may still be committed."""
        return self.max_length - len(self.tokens)

    def commit(self, tokens: list[int], num_drafted: int, num_accepted: int,
               source: str = "none") -> Step:
        kept = tokens[:self.room]
        for i, token in enumerate(kept):
            if token in self.eos:
                kept = kept[:i + 1]
                self.finish_reason = "eos"
                break
        self.tokens.extend(kept)
        if self.finish_reason is None and self.room == 0:
            self.finish_reason = "length"
        if self.stats.new_tokens:  # the prefill's token is not a verification step
            self.stats.record(num_drafted, num_accepted, source)
        self.stats.new_tokens += len(kept)
        self.stats.wall_seconds = time.perf_counter() - self.started
        return Step(kept, num_drafted, num_accepted, source, self.finish_reason, self.stats)


def pick(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> int:
    """One token from (V,) logits: argmax when greedy, else a sample."""
    if sampling.greedy:
        return int(logits.argmax())
    return int(sample(probabilities(logits, sampling), generator))


def reads_target_states(source: DraftSource) -> bool:
    """Whether `source` reads the target's hidden states. A source written before `feature_layers`
    joined the protocol has no such field and reads none: it keeps working unchanged."""
    return bool(getattr(source, "feature_layers", ()))


class TargetStates:
    """The target's hidden states of committed tokens, handed on to the sources that read them
    (DFlash-style drafters, `DraftSource.feature_layers`): every target forward computes them at the
    union of their layers, and each committed token's reach its readers once, in order."""

    def __init__(self, sources: list[DraftSource], hidden_size: int) -> None:
        self.readers = [source for source in sources if reads_target_states(source)]
        self.layers = sorted({layer for source in self.readers for layer in source.feature_layers})
        self.hidden_size = hidden_size
        self.seconds = 0.0  # spent in the readers' `observe`: their drafting work, not verification
        # each reader's layers, as positions among `layers`
        self.columns = [[self.layers.index(layer) for layer in source.feature_layers] for source in self.readers]

    def commit(self, features: torch.Tensor) -> None:
        """`features` (T, len(layers) · hidden) of the next T committed tokens."""
        started = time.perf_counter()
        per_layer = features.view(features.shape[0], len(self.layers), self.hidden_size)
        for source, columns in zip(self.readers, self.columns):
            source.observe(per_layer[:, columns].flatten(1))
        self.seconds += time.perf_counter() - started

    def take_seconds(self) -> float:
        """The readers' time since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def prefill(target: Decoder, sequence: Sequence, sampling: SamplingConfig, generator: torch.Generator,
            states: TargetStates | None = None) -> tuple[Step, KVCache]:
    cache = target.new_cache(sequence.max_length)
    started = time.perf_counter()
    ids = torch.tensor([sequence.tokens], device=target.device)
    logits, features = target.logits_and_features(ids, states.layers if states else (), cache=cache,
                                                   last_only=True)
    cache.commit()
    token = pick(logits[0, -1], sampling, generator)
    sequence.stats.verify_seconds += time.perf_counter() - started
    if states is not None:
        states.commit(features[0])
        sequence.stats.draft_seconds += states.take_seconds()
    return sequence.commit([token], 0, 0), cache


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


def score_block(target: Decoder, cache: KVCache, ids: torch.Tensor) -> torch.Tensor:
    """Target logits (T, V) for ids (1, T) after the cache, the T new slots left pending.

    One forward where the target is row-count invariant on this machine (always, with the
    row-exact kernels), else T one-row forwards — the same bits as plain decoding either way.
    """
    return score_block_features(target, cache, ids, ())[0]


def score_block_features(target: Decoder, cache: KVCache, ids: torch.Tensor,
                         feature_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`score_block`, and the hidden states at `feature_layers` of its rows (T, F · hidden) when any."""
    if ids.shape[1] == 1 or verify_mode(target) == "batched":
        logits, features = target.logits_and_features(ids, feature_layers, cache=cache)
        return logits[0], None if features is None else features[0]
    rows, feature_rows = [], []
    for i in range(ids.shape[1]):
        logits, features = target.logits_and_features(ids[:, i:i + 1], feature_layers, cache=cache)
        rows.append(logits[0, 0])
        feature_rows.append(features)
        cache.commit()
    cache.rewind(ids.shape[1])
    cache.reserve(ids.shape[1])  # the slots keep their K/V and are pending again, as after one forward
    return torch.stack(rows), None if not feature_layers else torch.cat(feature_rows, 1)[0]


def verify_block(target: Decoder, cache: KVCache, anchor: int, draft_tokens: torch.Tensor,
                 draft_probs: torch.Tensor | None, sampling: SamplingConfig,
                 generator: torch.Generator, states: TargetStates | None = None) -> Verdict:
    """One target forward over [anchor, drafts]; keeps the KV of the anchor and accepted drafts (and
    hands their hidden states to `states`)."""
    ids = torch.cat([torch.tensor([anchor], device=draft_tokens.device), draft_tokens])[None]
    target_logits, features = score_block_features(target, cache, ids, states.layers if states else [])  # (K+1, V)
    if sampling.greedy:
        verdict = verify_greedy(draft_tokens, target_logits.argmax(-1))
    else:
        if draft_probs is None:  # deterministic drafts (none: a plain sampling step): q is a point mass
            draft_probs = one_hot(draft_tokens, target_logits.shape[-1])
        verdict = verify_sampling(draft_tokens, draft_probs, probabilities(target_logits, sampling), generator)
    cache.commit(verdict.num_accepted + 1)
    if states is not None:
        states.commit(features[:verdict.num_accepted + 1])
    return verdict


def one_hot(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(K,) → (K, V): the draft distribution of deterministic drafts (context lookup, a greedy source)."""
    return torch.nn.functional.one_hot(tokens, vocab_size).float()


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
                               forward_costs(target, None, verify_reach(sources)).verify)
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
                wanted = gate.num_drafts(source.name, wanted)
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
            gate.record(name, len(draft_tokens), verdict.num_accepted)
        new_tokens = draft_tokens[:verdict.num_accepted].tolist() + [verdict.bonus_token]
        yield sequence.commit(new_tokens, len(draft_tokens), verdict.num_accepted, name)
