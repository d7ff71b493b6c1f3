"""Drafting sources: one interface for lookup and the D3D drafter, asked in order by the sync engine,
weighed by the gate under their names, refused once for another vocabulary."""

from __future__ import annotations

import pytest
import torch

from conftest import make_decoder, tiny_config
from d3d.config import GenerationConfig, SamplingConfig
from d3d.drafter import Drafter
from d3d.engine import generate_from_sources, reference_generate, speculative_generate
from d3d.lookup import LookupConfig
from d3d.sources import (DrafterSource, LookupSource, Proposal, check_vocabulary, default_sources,
                         drafts_from_logits)


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


class FixedSource:
    """A source of the interface written here: always proposes the same token (never a model)."""

    name = "fixed"
    vocab_size = None

    def __init__(self, token: int, max_drafts: int = 3) -> None:
        self.token, self.max_drafts, self.asked = token, max_drafts, 0

    def draft_costs(self, target):
        return [0.0]

    def start(self, max_length, device):
        self.device = device

    def propose(self, tokens, num_drafts, sampling, generator):
        self.asked += 1
        return Proposal(torch.full((num_drafts,), self.token, device=self.device), None)


def test_default_sources_keep_lookup_first_with_its_own_reach(target):
    """Lookup first; the drafter drafts its block, lookup as far as it reaches alone (a short-block
    drafter must not cut a repeated run's drafts)."""
    drafter = Drafter.from_target(target, [0], block_size=4)
    lookup, source = default_sources(drafter, LookupConfig())
    assert (lookup.name, lookup.max_drafts, source.name, source.max_drafts) == ("lookup", 15, "drafter", 3)
    assert [s.name for s in default_sources(None, LookupConfig())] == ["lookup"]
    assert default_sources(None, LookupConfig())[0].max_drafts == 15
    assert default_sources(None, None) == []


def test_sources_in_order_first_proposal_wins(target, prompt):
    """The first source that proposes drafts the step; a later one is asked only when it has none."""
    config = GenerationConfig(max_new_tokens=20)
    expected = tokens_of(reference_generate(target, prompt, config))
    first, second = FixedSource(7), FixedSource(9)
    steps = list(generate_from_sources(target, [first, second], prompt, config))
    assert tokens_of(steps) == expected
    drafted = [s for s in steps[1:] if s.num_drafted]
    assert second.asked == 0 and first.asked == len(drafted) > 10
    assert {s.source for s in drafted} == {"fixed"}
    assert steps[-1].num_drafted == 0  # one slot left: the bonus token's, no room to draft


def test_generate_from_sources_equals_speculative_generate(target, prompt):
    """The public entry point is the default sources run by the loop, step for step."""
    drafter = Drafter.from_target(target, [1], block_size=4)
    config = GenerationConfig(max_new_tokens=30)
    old = [(s.tokens, s.source, s.num_drafted) for s in speculative_generate(target, drafter, prompt, config,
                                                                           lookup=LookupConfig())]
    new = [(s.tokens, s.source, s.num_drafted)
           for s in generate_from_sources(target, default_sources(drafter, LookupConfig()), prompt, config)]
    assert old == new and {"lookup", "drafter"} & {s for _, s, _ in new}


def test_gate_keys_are_the_source_names(target, prompt):
    """Adaptive: the gate weighs each source under its own name, with its own measured costs."""
    source = FixedSource(5)
    steps = list(generate_from_sources(target, [source], prompt, GenerationConfig(max_new_tokens=40), adaptive=True))
    assert tokens_of(steps) == tokens_of(reference_generate(target, prompt, GenerationConfig(max_new_tokens=40)))
    by_source = steps[-1].stats.steps_by_source
    # A token that is almost never right stops paying: the gate falls back to plain steps.
    assert by_source.get("none", 0) > by_source.get("fixed", 0)


def test_one_vocabulary_check_for_every_source(target, prompt):
    other = make_decoder(tiny_config(vocab_size=80), seed=2)
    drafter = Drafter.from_target(other, [0], block_size=4)
    with pytest.raises(ValueError, match="'drafter' was made for another vocabulary \\(80 tokens; the target has 64\\)"):
        check_vocabulary([LookupSource(LookupConfig()), DrafterSource(drafter)], target)
    with pytest.raises(ValueError, match="another vocabulary"):
        list(generate_from_sources(target, [DrafterSource(drafter, name="mine")], prompt, GenerationConfig()))
    check_vocabulary([LookupSource(LookupConfig())], target)  # lookup drafts the context's own ids


def test_lookup_source_proposes_on_the_device_it_was_started_on():
    source = LookupSource(LookupConfig(), max_drafts=4)
    source.start(64, torch.device("cpu"))
    proposal = source.propose([1, 2, 3, 1, 2], 4, SamplingConfig(), torch.Generator())
    assert proposal.draft_tokens.tolist() == [3, 1, 2, 3] and proposal.draft_probs is None
    assert proposal.draft_tokens.device.type == "cpu"
    assert source.propose([1, 2, 3, 4], 4, SamplingConfig(), torch.Generator()) is None


def test_drafts_from_logits_greedy_and_sampled():
    logits = torch.tensor([[0.0, 5.0, 0.0], [3.0, 0.0, 0.0]])
    tokens, probs = drafts_from_logits(logits, SamplingConfig(), torch.Generator())
    assert tokens.tolist() == [1, 0] and probs is None
    generator = torch.Generator().manual_seed(0)
    tokens, probs = drafts_from_logits(logits, SamplingConfig(temperature=1.0), generator)
    assert probs.shape == (2, 3) and torch.allclose(probs.sum(-1), torch.ones(2))
    assert all(probs[i, t] > 0 for i, t in enumerate(tokens.tolist()))
