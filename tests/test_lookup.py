"""Context lookup: the n-gram matcher on hand-made sequences, its config, and the engine with lookup
drafts — greedy output identical to plain decoding, sources reported consistently, and sampling at
T=1 with deterministic (one-hot q) drafts keeping the target's distribution."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import make_decoder, make_oracle, tiny_config
from d3d.config import ConfigError, GenerationConfig, SamplingConfig
from d3d.drafter import Drafter
from d3d.engine import reference_generate, speculative_generate
from d3d.lookup import (MATCH_REACH, LookupConfig, LookupIndex, Match, continuation_chance, continuation_chances,
                        lookup_drafts)


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


def greedy(max_new_tokens: int, eos: list[int] | None = None) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos or [])


# -- lookup_drafts on hand-made sequences ------------------------------------------------------

def test_longest_ngram_is_tried_first():
    """The 3-gram [1,2,3] (followed by 9) wins over the later 2-gram [2,3] (followed by 8)."""
    tokens = [1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3]
    assert lookup_drafts(tokens, 1, LookupConfig(max_ngram=3, min_ngram=2)) == [9]
    # Capped at 2-grams, the latest [2, 3] is the match instead.
    assert lookup_drafts(tokens, 1, LookupConfig(max_ngram=2, min_ngram=2)) == [8]


def test_latest_match_wins():
    """Of several earlier occurrences of the suffix, the latest one's continuation is drafted."""
    tokens = [1, 2, 7, 1, 2, 8, 1, 2]
    assert lookup_drafts(tokens, 1, LookupConfig(max_ngram=2, min_ngram=2)) == [8]
    # The continuation runs on past the match: 8, 1, 2, then the copy re-reads its own draft.
    assert lookup_drafts(tokens, 4, LookupConfig(max_ngram=2, min_ngram=2)) == [8, 1, 2, 8]


def test_suffix_never_matches_itself():
    """The suffix's own position is not a match: a sequence without repeats drafts nothing."""
    assert lookup_drafts([1, 2, 3, 4, 5], 4, LookupConfig(max_ngram=4, min_ngram=1)) == []
    assert lookup_drafts([7], 4, LookupConfig(min_ngram=1)) == []  # nothing before the suffix


def test_no_match_gives_empty_list():
    """No earlier occurrence of any suffix of length min_ngram..max_ngram → []."""
    assert lookup_drafts([5, 6, 7, 5, 8, 9], 3, LookupConfig(max_ngram=4, min_ngram=2)) == []


def test_min_ngram_is_respected():
    """A 1-gram match only counts when min_ngram is 1."""
    tokens = [1, 2, 3, 4, 5, 3]  # only the single token 3 repeats
    assert lookup_drafts(tokens, 4, LookupConfig(max_ngram=4, min_ngram=2)) == []
    assert lookup_drafts(tokens, 4, LookupConfig(max_ngram=4, min_ngram=1)) == [4, 5, 3, 4]


def test_max_ngram_is_respected():
    """A longer match than max_ngram is not looked for: the latest max_ngram-gram decides."""
    tokens = [1, 2, 3, 9, 0, 2, 3, 7, 1, 2, 3]
    assert lookup_drafts(tokens, 1, LookupConfig(max_ngram=2, min_ngram=1)) == [7]
    assert lookup_drafts(tokens, 1, LookupConfig(max_ngram=3, min_ngram=1)) == [9]


@pytest.mark.parametrize("period", [1, 2, 3, 5])
def test_loop_is_drafted_for_the_whole_requested_length(period):
    """A loop of period p (even p=1) is continued for all max_drafts tokens, like an LZ77 copy."""
    loop = [10 + i for i in range(period)]
    tokens = loop * 3 + loop[:1]  # the loop, three times, and the start of a fourth round
    drafts = lookup_drafts(tokens, 12, LookupConfig(max_ngram=4, min_ngram=1))
    expected = [loop[(1 + j) % period] for j in range(12)]
    assert drafts == expected


def test_tensor_and_list_inputs_agree():
    """A 1-D LongTensor gives the same drafts as the list of its ids."""
    tokens = [4, 5, 6, 4, 5, 6, 4, 5]
    config = LookupConfig()
    assert lookup_drafts(torch.tensor(tokens), 7, config) == lookup_drafts(tokens, 7, config) == [6, 4, 5, 6, 4, 5, 6]


def searched_precedent(tokens: list[int], config: LookupConfig) -> str:
    """`LookupIndex.precedent` by a search: the longest suffix n-gram seen before the last token, and
    the tokens that followed each of its occurrences."""
    for n in range(min(config.max_ngram, len(tokens)), config.min_ngram - 1, -1):
        followers = [tokens[s + n] for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
        if followers:
            return "once" if len(followers) == 1 else "agreed" if len(set(followers)) == 1 else "split"
    return "once"


@pytest.mark.parametrize("ngrams", [(1, 1), (2, 4), (1, 3), (3, 3)])
def test_the_index_drafts_what_the_search_drafts(ngrams):
    """`LookupIndex` on sequences growing by 1–16 tokens a call (a small vocabulary, so matches
    and loops abound), restarting with other sequences: the very drafts `lookup_drafts` finds, and
    the precedent a search finds."""
    config = LookupConfig(min_ngram=ngrams[0], max_ngram=ngrams[1])
    index = LookupIndex(config)
    generator = torch.Generator().manual_seed(sum(ngrams))
    found = 0
    for _ in range(6):  # six generations through one index
        tokens = torch.randint(0, 5, (int(torch.randint(1, 4, (1,), generator=generator)),),
                               generator=generator).tolist()
        while len(tokens) < 120:
            max_drafts = int(torch.randint(1, 16, (1,), generator=generator))
            drafts = index.drafts(tokens, max_drafts)
            assert drafts == lookup_drafts(tokens, max_drafts, config)
            assert index.precedent(tokens) == searched_precedent(tokens, config)
            found += bool(drafts)
            tokens = tokens + torch.randint(0, 5, (int(torch.randint(1, 17, (1,), generator=generator)),),
                                            generator=generator).tolist()
        assert index.drafts(torch.tensor(tokens), 3) == lookup_drafts(tokens, 3, config)  # a tensor, as a list
    assert found > 20


@pytest.mark.parametrize("kwargs", [dict(min_ngram=0), dict(min_ngram=3, max_ngram=2), dict(max_ngram=0),
                                    dict(min_ngram=-1, max_ngram=-1)])
def test_lookup_config_validation(kwargs):
    """min_ngram < 1 or min_ngram > max_ngram is refused with a ConfigError (a ValueError)."""
    with pytest.raises(ConfigError, match="min_ngram"):
        LookupConfig(**kwargs)
    assert issubclass(ConfigError, ValueError)


def test_lookup_config_round_trips_through_json():
    """LookupConfig serialises like the other configs."""
    config = LookupConfig(max_ngram=6, min_ngram=3)
    assert LookupConfig.from_json(config.to_json()) == config


# -- the engine with lookup drafts -------------------------------------------------------------

REPEATING_PROMPT = [3, 17, 42, 5, 9, 3, 17, 42, 5, 9, 3, 17]  # lookup matches from the first step


def check_sources(steps) -> Counter:
    """Every step's source agrees with its drafts and the totals agree with stats.steps_by_source."""
    assert steps[0].source == "none" and steps[0].num_drafted == 0  # the prefill is not a verification
    for step in steps[1:]:
        assert step.source in ("lookup", "drafter", "none")
        assert (step.source == "none") == (step.num_drafted == 0)
        assert 0 <= step.num_accepted <= step.num_drafted
    counts = Counter(step.source for step in steps[1:])
    stats = steps[-1].stats
    assert stats.steps_by_source == dict(counts)
    assert stats.steps == len(steps) - 1 == sum(counts.values())
    return counts


@pytest.mark.parametrize("lookup", [LookupConfig(), LookupConfig(max_ngram=2, min_ngram=1)])
@pytest.mark.parametrize("prompt_ids", [REPEATING_PROMPT, [3, 17, 42, 5, 9, 33, 60, 1]])
def test_lookup_only_matches_reference(target, lookup, prompt_ids):
    """No drafter, lookup drafts only: greedy output is token-for-token the AR reference."""
    expected = tokens_of(reference_generate(target, prompt_ids, greedy(48)))
    steps = list(speculative_generate(target, None, prompt_ids, greedy(48), lookup=lookup))
    assert tokens_of(steps) == expected and steps[-1].finish_reason == "length"
    counts = check_sources(steps)
    assert set(counts) <= {"lookup", "none"}  # no drafter: nothing else can draft
    assert counts["lookup"] > 0
    assert all(s.num_drafted <= 15 for s in steps)  # the default block of 16 without a drafter


def test_lookup_saves_steps_on_a_repeating_target(target):
    """Where the target's greedy output loops, lookup drafts are accepted: fewer steps than tokens."""
    prompt_ids = REPEATING_PROMPT
    steps = list(speculative_generate(target, None, prompt_ids, greedy(64), lookup=LookupConfig()))
    stats = steps[-1].stats
    assert stats.new_tokens == 64
    assert sum(s.num_accepted for s in steps) > 0
    assert stats.steps < 63  # AR would need 63 steps after the prefill
    assert stats.tau > 1.0


def test_lookup_with_drafter_matches_reference(target):
    """Lookup where the context matches, the drafter elsewhere: same greedy tokens as AR, both sources used."""
    prompt_ids = REPEATING_PROMPT
    expected = tokens_of(reference_generate(target, prompt_ids, greedy(48)))
    drafter = Drafter.from_target(target, [0], block_size=4)
    steps = list(speculative_generate(target, drafter, prompt_ids, greedy(48), lookup=LookupConfig()))
    assert tokens_of(steps) == expected
    counts = check_sources(steps)
    assert counts["lookup"] > 0 and counts["drafter"] > 0  # the drafter fills in before the loop starts
    assert "none" not in counts  # with a drafter, only a step with no room for drafts is plain
    assert all(s.num_drafted <= 3 for s in steps if s.source == "drafter")  # the drafter's block of 4
    # lookup keeps its own reach beside a short-block drafter: a loop is drafted past 3 tokens
    assert all(s.num_drafted <= 15 for s in steps) and any(s.num_drafted > 3 for s in steps if s.source == "lookup")
    without_lookup = list(speculative_generate(target, drafter, prompt_ids, greedy(48)))
    assert tokens_of(without_lookup) == expected
    assert set(check_sources(without_lookup)) <= {"drafter", "none"}


def test_lookup_with_oracle_drafter_and_eos(target):
    """EOS ends a lookup/drafter generation at the same token as AR, EOS included, reason 'eos'."""
    prompt_ids = REPEATING_PROMPT
    free = tokens_of(reference_generate(target, prompt_ids, greedy(40)))
    eos = free[10]  # a token the target produces: the generation must stop at its first occurrence
    expected = free[:free.index(eos) + 1]
    steps = list(speculative_generate(target, make_oracle(target, 4), prompt_ids, greedy(40, [eos]),
                                      lookup=LookupConfig(min_ngram=1)))
    assert tokens_of(steps) == expected and steps[-1].finish_reason == "eos"
    check_sources(steps)


def test_length_limited_last_step_reports_none(target):
    """With one slot left no draft fits: the step is a plain one, reported as source 'none'."""
    drafter = Drafter.from_target(target, [0], block_size=4)
    for max_new in range(2, 12):
        steps = list(speculative_generate(target, drafter, REPEATING_PROMPT, greedy(max_new), lookup=LookupConfig()))
        assert sum(len(s.tokens) for s in steps) == max_new
        for index, step in enumerate(steps[1:], 1):
            room_before = max_new - sum(len(s.tokens) for s in steps[:index])
            assert step.num_drafted <= room_before - 1
            if room_before == 1:
                assert step.source == "none" and step.num_drafted == 0
        check_sources(steps)


# -- sampling with one-hot lookup drafts keeps the target's distribution ---------------------

VOCAB = 8
SAMPLING_PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 2, 5]  # holds every token: a 1-gram lookup always matches
SAMPLING_LOOKUP = LookupConfig(max_ngram=2, min_ngram=1)
NUM_SEEDS = 800


@pytest.fixture(scope="module")
def small_vocab_target():
    """A tiny 8-token target with a soft head, so T=1 distributions are spread (not near-greedy)."""
    decoder = make_decoder(tiny_config("llama", tie_word_embeddings=False, vocab_size=VOCAB), seed=3)
    with torch.no_grad():
        decoder.lm_head.weight.mul_(0.3)
    return decoder


@torch.no_grad()
def exact_joint(decoder, prompt_ids: list[int]) -> torch.Tensor:
    """P(x1, x2, x3) (V, V, V) of the first three sampled tokens at T=1, by enumeration."""
    p1 = decoder(torch.tensor([prompt_ids]))[0, -1].softmax(-1)
    ids2 = torch.tensor([prompt_ids + [a] for a in range(VOCAB)])
    p2 = decoder(ids2)[:, -1].softmax(-1)  # (V, V): row a = P(x2 | x1=a)
    ids3 = torch.tensor([prompt_ids + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    p3 = decoder(ids3)[:, -1].softmax(-1).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def empirical_joint(engine, num_seeds: int) -> torch.Tensor:
    """Histogram (V, V, V) of the first three tokens over seeds 0 … num_seeds-1."""
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    for seed in range(num_seeds):
        config = GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(temperature=1.0, seed=seed))
        x1, x2, x3 = tokens_of(engine(config))
        counts[x1, x2, x3] += 1
    return counts / num_seeds


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def tv_bound(p: torch.Tensor, n: int) -> float:
    """E[TV] of an n-sample histogram is at most ½Σ√(p(1-p)/n); McDiarmid adds √(ln 1000 / 2n) (p ≤ 1e-3)."""
    return 0.5 * float((p * (1 - p) / n).sqrt().sum()) + (torch.log(torch.tensor(1000.0)) / (2 * n)).sqrt().item()


def test_sampling_with_lookup_drafts_keeps_target_distribution(small_vocab_target):
    """T=1 with one-hot lookup drafts: the first three tokens follow the target's exact law, like AR.

    Every run's first verification checks a deterministic lookup draft d(x1). Checked for both the
    lookup engine and the AR reference: P(x2 = d(x1)) within 4σ of its exact value (a bound shown
    to reject two plausible bugs: always accepting the draft, and resampling from p instead of
    the residual after a rejection), and the (x1, x2), (x2, x3) pairs and the x3 marginal within
    a TV bound that fails with probability < 1e-3 for a correct sampler.
    """
    decoder = small_vocab_target
    exact = exact_joint(decoder, SAMPLING_PROMPT)
    pair12, pair23, marginal3 = exact.sum(2), exact.sum(0), exact.sum((0, 1))
    p1 = pair12.sum(1)

    draft = torch.tensor([lookup_drafts(SAMPLING_PROMPT + [a], 1, SAMPLING_LOOKUP)[0] for a in range(VOCAB)])
    p_draft = (pair12 / p1[:, None])[torch.arange(VOCAB), draft]  # P(x2 = d(x1) | x1): the acceptance rate
    hit = float((p1 * p_draft).sum())
    sigma = (hit * (1 - hit) / NUM_SEEDS) ** 0.5
    assert 0.1 < hit < 0.9  # drafts are accepted sometimes and rejected sometimes: both paths run
    for buggy_hit in (1.0, float((p1 * (2 * p_draft - p_draft ** 2)).sum())):
        assert abs(buggy_hit - hit) > 8 * sigma

    spec_sources: Counter = Counter()

    def speculative(config):
        steps = list(speculative_generate(decoder, None, SAMPLING_PROMPT, config, lookup=SAMPLING_LOOKUP))
        spec_sources.update(s.source for s in steps[1:])
        return steps

    spec = empirical_joint(speculative, NUM_SEEDS)
    ref = empirical_joint(lambda config: reference_generate(decoder, SAMPLING_PROMPT, config), NUM_SEEDS)
    assert spec_sources["lookup"] == NUM_SEEDS  # every run's first verification used a lookup draft
    for empirical in (ref, spec):
        empirical_hit = float(empirical.sum(2)[torch.arange(VOCAB), draft].sum())
        assert abs(empirical_hit - hit) < 4 * sigma
        assert tv(empirical.sum(2), pair12) < tv_bound(pair12, NUM_SEEDS)
        assert tv(empirical.sum(0), pair23) < tv_bound(pair23, NUM_SEEDS)
        assert tv(empirical.sum((0, 1)), marginal3) < tv_bound(marginal3, NUM_SEEDS)


# -- how far a match goes back, and what that says of its drafts ---------------------------------

def test_a_match_is_measured_back_past_its_ngram():
    """`LookupIndex.match`: the continuation `drafts` copies starts where the match says, and its
    length counts every token before it that agrees with the context's end, not only the n-gram
    that found it — up to MATCH_REACH; no match, None."""
    config = LookupConfig(max_ngram=2, min_ngram=2)
    tokens = [9, 5, 6, 7, 8, 1, 5, 6, 7, 8]  # [5, 6, 7, 8] repeats: found by [7, 8], 4 tokens agree
    match = LookupIndex(config).match(tokens)
    assert match == Match(start=5, length=4)
    assert LookupIndex(config).drafts(tokens, 3) == tokens[match.start:match.start + 3] == [1, 5, 6]
    assert LookupIndex(config).match([1, 2, 3, 4]) is None
    loop = [3, 4] * 100  # agrees back to the start, but is counted to MATCH_REACH only
    assert LookupIndex(config).match(loop) == Match(start=len(loop) - 2, length=MATCH_REACH)
    grown = LookupIndex(config)  # the index follows a growing sequence
    assert grown.match(tokens[:6]) is None and grown.match(tokens) == Match(5, 4)


def test_longer_matches_and_later_drafts_are_likelier():
    """The fitted chances rise with the match's length, and each draft is judged as a match one
    longer than the draft before it: a 2-token match's first draft is a coin toss, a 40-token
    match's fifteenth is right ~97% of the time."""
    two, forty = continuation_chances(2, 15), continuation_chances(40, 15)
    assert len(two) == len(forty) == 15
    assert two == sorted(two) and forty == sorted(forty) and all(a < b for a, b in zip(two, forty))
    assert 0.5 < two[0] < 0.56 and 0.96 < forty[-1] < 0.99
    assert continuation_chances(5, 4)[1:] == continuation_chances(6, 3)  # one accepted draft: one longer


def test_an_ngram_that_always_went_on_alike_is_trusted_and_one_that_split_is_not():
    """The first draft's chance comes from the precedent of the n-gram before it — [1, 2, 3] went on
    with 4 all three times (agreed), [1, 2, 3, 4] with 9, 9 and 7 (split) —, the later drafts' from
    the match's length plus the drafts before them."""
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 3, 4, 7, 1, 2, 3]
    index = LookupIndex(LookupConfig())
    assert index.match(tokens) == Match(start=13, length=3) and index.drafts(tokens, 4) == [4, 7, 1, 2]
    assert index.precedent(tokens) == "agreed" and index.precedent([1, 2, 3, 4]) == "split"
    assert index.chances(tokens, 4) == [continuation_chance(3, "agreed"), continuation_chance(4, "any"),
                                        continuation_chance(5, "any"), continuation_chance(6, "any")]
    assert index.chances(tokens[:-3] + [1, 2, 3, 4], 2)[0] == continuation_chance(4, "split")
    assert index.chances([5, 6, 7], 3) == []  # no match
    two = {precedent: continuation_chance(2, precedent) for precedent in ("agreed", "once", "split")}
    assert 0.8 < two["agreed"] < 0.87 and 0.5 < two["once"] < 0.56 and 0.25 < two["split"] < 0.31
