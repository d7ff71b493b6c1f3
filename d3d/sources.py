"""Drafting sources: where a speculative step's drafts come from, behind one small interface.

A source proposes up to k drafts after the committed tokens: draft_tokens (K,) on the target's
device and draft_probs (K, V), the distribution each draft was drawn from — or None when the drafts
are a deterministic function of the tokens (context lookup; any source under greedy decoding),
whose q is a point mass that verification builds itself (`target_step.verify_block`). A source also
names itself (the gate's key and `Step.source`), says what drafting k costs in one-token target
steps measured on this machine (`d3d.costs`), and which vocabulary it drafts from, checked once
against the target's (`check_vocabulary`).

Sources today: context lookup, the D3D drafter, the AR drafter (classic speculative decoding's
baseline: k drafts are k one-token passes), the DFlash-style drafter (`d3d.dflash`: it reads the
target's hidden states, which the engine hands it after every target forward through `observe`)
and the acceptance-controlled simulation (`d3d.simulate`: a D3D drafter whose drafts are replaced,
proposed through `DrafterSource`). The sync engine asks its sources in order and the first that
proposes drafts the step; the async engine drafts with one D3D drafter. A source holds
per-generation state (the drafter's KV cache), reset by `start`: one set of sources serves one
generation at a time.

This module proposes drafts; it verifies nothing and runs no loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from d3d.cache import KVCache
from d3d.config import SamplingConfig
from d3d.costs import forward_costs
from d3d.drafter import Drafter
from d3d.gate import Costs
from d3d.lookup import LookupConfig, LookupIndex
from d3d.models import Decoder
from d3d.sampling import greedy_ids, probabilities, sample

LOOKUP_MAX_DRAFTS = 15  # a free source's reach: a run of repeated text is drafted 15 tokens at a time


@dataclass(frozen=True)
class Proposal:
    draft_tokens: torch.Tensor  # (K,) on the target's device
    draft_probs: torch.Tensor | None  # (K, V) the drafts were drawn from; None: deterministic drafts


class DraftSource(Protocol):
    name: str  # the gate's key and Step.source
    max_drafts: int  # the most drafts one proposal holds
    vocab_size: int | None  # the token ids it drafts (None: the context's own tokens, any vocabulary)
    feature_layers: tuple[int, ...]  # target layers whose hidden states it reads (`observe`); () for most

    def draft_costs(self, target: Decoder) -> Costs:
        """[k]: drafting k drafts, in one-token steps of `target`, measured on this machine (a
        `d3d.gate.ByContext` where they follow the context length)."""
        ...

    def start(self, max_length: int, device: torch.device) -> None:
        """Get ready for a generation of at most `max_length` tokens on `device` (the target's)."""
        ...

    def propose(self, tokens: list[int], num_drafts: int, sampling: SamplingConfig,
                generator: torch.Generator) -> Proposal | None:
        """Up to `num_drafts` drafts after the committed `tokens`; None when it has none to offer."""
        ...

    def observe(self, features: torch.Tensor) -> None:
        """The target's hidden states (T, len(feature_layers) · hidden) of the next T committed tokens;
        called only on sources with feature layers, after each target forward."""
        ...

    # Optional, for sources that read the context themselves before drafting (a drafter's first
    # pass over the prompt): `pending(tokens) -> int`, the tokens its next proposal would read
    # first, and `catch_up_costs(target) -> Costs`, [0] = one such token's cost in one-token steps.
    # The gate weighs them (`SpeculationGate.catch_up`).
    # Optional, for sources that can tell how good their next drafts are before drafting them:
    # `chances(tokens, num_drafts) -> list[float]`, [j] the chance that draft j + 1 is accepted once
    # drafts 1 … j are, under greedy decoding ([] when it has nothing to propose). The gate weighs
    # them, scaled by how they fared on this request (`SpeculationGate.num_drafts`).


def drafts_from_logits(block_logits: torch.Tensor, sampling: SamplingConfig,
                       generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drafts from (K, V) drafter logits → draft_tokens (K,) and, when sampling, draft_probs (K, V)."""
    if sampling.greedy:
        return greedy_ids(block_logits), None
    draft_probs = probabilities(block_logits, sampling)
    return sample(draft_probs, generator), draft_probs


class LookupSource:
    """Context lookup (`d3d.lookup`): free, deterministic drafts where the context holds a match."""

    name = "lookup"
    vocab_size = None
    feature_layers = ()

    def __init__(self, config: LookupConfig, max_drafts: int = LOOKUP_MAX_DRAFTS) -> None:
        self.config = config
        self.max_drafts = max_drafts
        self.device = torch.device("cpu")
        self.index = LookupIndex(config)  # the generation's n-grams, extended as it grows

    def draft_costs(self, target: Decoder) -> Costs:
        # A search over token ids, no model call: microseconds beside a step of milliseconds.
        return [0.0]

    def start(self, max_length: int, device: torch.device) -> None:
        self.device = device
        self.index.reset()

    def chances(self, tokens: list[int], num_drafts: int) -> list[float]:
        """How likely each of the next drafts is to be right, from the match they would be copied
        from (`d3d.lookup.LookupIndex.chances`); [] without a match."""
        return self.index.chances(tokens, num_drafts)

    def propose(self, tokens: list[int], num_drafts: int, sampling: SamplingConfig,
                generator: torch.Generator) -> Proposal | None:
        found = self.index.drafts(tokens, num_drafts)
        return Proposal(torch.tensor(found, device=self.device), None) if found else None


class DrafterSource:
    """A D3D drafter: one block pass over the rows the wanted drafts need, argmax or sampled.

    `costs_of`: the drafter whose measured costs the gate weighs, when they are not this one's own
    (the simulation runs a real drafter's forward and is charged that drafter's cost).
    """

    feature_layers = ()

    def __init__(self, drafter: Drafter, name: str = "drafter", costs_of: Drafter | None = None) -> None:
        if drafter.config.kind != "d3d":
            raise ValueError(f"DrafterSource drafts with a D3D drafter; this one is of kind {drafter.config.kind!r} "
                             "(use drafter_source)")
        self.drafter = drafter
        self.name = name
        self.costs_of = costs_of or drafter
        self.max_drafts = drafter.block_size - 1
        self.vocab_size = drafter.config.target_vocab_size
        self.cache: KVCache | None = None

    def draft_costs(self, target: Decoder) -> Costs:
        return forward_costs(target, self.costs_of, self.max_drafts, drafter_only=True).by_context("drafter")

    def catch_up_costs(self, target: Decoder) -> Costs:
        """[0]: what reading one token of context it lacks costs, in one-token steps."""
        return forward_costs(target, self.costs_of, self.max_drafts, drafter_only=True).by_context("catch_up")

    def pending(self, tokens: list[int]) -> int:
        """Committed tokens its cache lacks beyond what a round commits (a block at most; its
        measured drafting cost feeds those): a prompt its next draft must read first."""
        lacking = len(tokens) - 1 - (self.cache.length if self.cache is not None else 0)
        return max(0, lacking - self.drafter.block_size)

    def start(self, max_length: int, device: torch.device) -> None:
        self.cache = self.drafter.new_cache(max_length)

    def block_logits(self, tokens: list[int], num_drafts: int | None = None) -> torch.Tensor:
        """The drafter's block logits after `tokens` (`Drafter.draft`): (B, V), or the rows
        `num_drafts` drafts need; the async engine plans its branches from them."""
        assert self.cache is not None, "start() the source before drafting"
        return self.drafter.draft(self.cache, tokens, num_drafts)

    def propose(self, tokens: list[int], num_drafts: int, sampling: SamplingConfig,
                generator: torch.Generator) -> Proposal | None:
        return propose_together([DrafterCall(self, tokens, num_drafts, sampling, generator)])[0]


@dataclass(frozen=True)
class DrafterCall:
    """A `DrafterSource.propose` not run yet: a continuous batch runs the calls of all its sequences
    that draft with one drafter in one pass (`propose_together`)."""

    source: DrafterSource
    tokens: list[int]
    num_drafts: int
    sampling: SamplingConfig
    generator: torch.Generator


def propose_together(calls: Sequence[DrafterCall]) -> list[Proposal]:
    """Each call's proposal, the calls on one drafter in one pass (`Drafter.draft_together`): the
    same drafts, and at T > 0 the same draws from each call's own generator, as proposed alone."""
    out: list[Proposal | None] = [None] * len(calls)
    groups: dict[int, list[int]] = {}
    for i, call in enumerate(calls):
        assert call.source.cache is not None, "start() the source before drafting"
        groups.setdefault(id(call.source.drafter), []).append(i)
    for members in groups.values():
        drafter = calls[members[0]].source.drafter
        blocks = drafter.draft_together([(calls[i].source.cache, calls[i].tokens, calls[i].num_drafts)
                                         for i in members])
        for i, block_logits in zip(members, blocks):
            call = calls[i]
            out[i] = Proposal(*drafts_from_logits(block_logits[:call.num_drafts], call.sampling, call.generator))
    return out


class ARDrafterSource:
    """An AR drafter (`Drafter` of kind "ar"): drafts one by one, each a causal pass over its own cache.

    Draft i is the argmax of q_i (greedy) or a sample from it; at T > 0 the proposal carries every
    q_i, so verification's rejection sampling keeps the target's law. The cache holds committed
    tokens and the last proposal's drafts; each proposal first crops it to the longest prefix it
    shares with the committed tokens (rejected drafts go, accepted ones stay). Its drafting cost
    grows with k: k drafts are k sequential passes.
    """

    feature_layers = ()

    def __init__(self, drafter: Drafter, name: str = "ar_drafter") -> None:
        if drafter.config.kind != "ar":
            raise ValueError(f"ARDrafterSource drafts with an AR drafter; this one is of kind {drafter.config.kind!r}")
        self.drafter = drafter
        self.name = name
        self.max_drafts = drafter.block_size - 1
        self.vocab_size = drafter.config.target_vocab_size
        self.cache: KVCache | None = None
        self.cached: list[int] = []  # the tokens whose KV the cache holds, in order

    def draft_costs(self, target: Decoder) -> Costs:
        return forward_costs(target, self.drafter, self.max_drafts, drafter_only=True).by_context("drafter")

    def catch_up_costs(self, target: Decoder) -> Costs:
        """[0]: what reading one token of context it lacks costs, in one-token steps."""
        return forward_costs(target, self.drafter, self.max_drafts, drafter_only=True).by_context("catch_up")

    def pending(self, tokens: list[int]) -> int:
        """Committed tokens its cache lacks beyond what a round commits (a block at most; its
        measured drafting cost feeds those): a prompt its next proposal must read first."""
        return max(0, len(tokens) - 1 - common_prefix(self.cached, tokens[:-1]) - self.drafter.block_size)

    def start(self, max_length: int, device: torch.device) -> None:
        self.cache = self.drafter.new_cache(max_length)
        self.cached = []

    def propose(self, tokens: list[int], num_drafts: int, sampling: SamplingConfig,
                generator: torch.Generator) -> Proposal | None:
        assert self.cache is not None, "start() the source before drafting"
        if num_drafts < 1:
            raise ValueError(f"propose at least one draft, not {num_drafts}")
        kept = common_prefix(self.cached, tokens[:-1])  # the last committed token is always fed: its row drafts
        self.cache.crop(kept)
        del self.cached[kept:]
        new, draft_tokens, draft_probs = tokens[kept:], [], []
        for i in range(num_drafts):
            logits = self.drafter.next_logits(self.cache, new)  # (V,)
            self.cached += new
            token, probs = drafts_from_logits(logits[None], sampling, generator)  # (1,), (1, V) | None
            draft_tokens.append(token)
            draft_probs.append(probs)
            new = [int(token)]  # the last draft is not fed: nothing reads its row
        return Proposal(torch.cat(draft_tokens), None if sampling.greedy else torch.cat(draft_probs))


class DFlashSource:
    """A DFlash-style drafter (`d3d.dflash`): D3D's block pass, its context the target's hidden states.

    The engine hands it every committed token's hidden states (`observe`, in order, the anchor's
    arriving with the verification after it was committed), and it drafts only once it holds all of
    them but the anchor's: it waits for each verification, as DFlash does, and refuses to draft
    without them (`Drafter.draft`).
    """

    def __init__(self, drafter: Drafter, name: str = "dflash") -> None:
        if drafter.config.kind != "dflash":
            raise ValueError(f"DFlashSource drafts with a DFlash-style drafter; this one is of kind {drafter.config.kind!r}")
        self.drafter = drafter
        self.name = name
        self.max_drafts = drafter.block_size - 1
        self.vocab_size = drafter.config.target_vocab_size
        self.feature_layers = tuple(drafter.config.feature_layers)
        self.cache: KVCache | None = None

    def draft_costs(self, target: Decoder) -> Costs:
        return forward_costs(target, self.drafter, self.max_drafts, drafter_only=True).by_context("drafter")

    def start(self, max_length: int, device: torch.device) -> None:
        self.cache = self.drafter.new_cache(max_length)

    def observe(self, features: torch.Tensor) -> None:
        assert self.cache is not None, "start() the source before handing it hidden states"
        self.drafter.read_features(self.cache, features)

    def propose(self, tokens: list[int], num_drafts: int, sampling: SamplingConfig,
                generator: torch.Generator) -> Proposal | None:
        assert self.cache is not None, "start() the source before drafting"
        block_logits = self.drafter.draft(self.cache, tokens, num_drafts)[:num_drafts]  # (K, V)
        return Proposal(*drafts_from_logits(block_logits, sampling, generator))


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def check_vocabulary(sources: Sequence[DraftSource], target: Decoder) -> None:
    """Refuse a source whose drafts are ids of another vocabulary than the target's."""
    for source in sources:
        if source.vocab_size is not None and source.vocab_size != target.config.vocab_size:
            raise ValueError(f"drafting source {source.name!r} was made for another vocabulary "
                             f"({source.vocab_size} tokens; the target has {target.config.vocab_size})")


def drafter_source(drafter: Drafter) -> DraftSource:
    """The source that drafts with `drafter`, by its kind: a D3D block pass, AR passes one by one, or a
    DFlash-style block pass over the target's hidden states."""
    sources = {"ar": ARDrafterSource, "dflash": DFlashSource, "d3d": DrafterSource}
    return sources[drafter.config.kind](drafter)


def verify_reach(sources: Sequence[DraftSource]) -> int:
    """The most drafts any of `sources` proposes: the gate's verification costs are measured and
    stored up to it (one table per reach), so whoever asks for the same sources finds the same table."""
    return max(source.max_drafts for source in sources)


def default_sources(drafter: Drafter | None, lookup: LookupConfig | None) -> list[DraftSource]:
    """Lookup where the context matches (when `lookup` is set), else the drafter (when there is one).

    Lookup's reach does not depend on the drafter's block: a drafter with blocks of 8 must not cut
    a repeated run's drafts to 7 (the gate weighs every source's k against verification costs
    measured up to the longest reach)."""
    sources: list[DraftSource] = []
    if lookup is not None:
        sources.append(LookupSource(lookup))
    if drafter is not None:
        sources.append(drafter_source(drafter))
    return sources
