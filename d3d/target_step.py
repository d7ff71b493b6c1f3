"""The target's half of a speculative step: the prefill, scoring a block and verifying it.

`prefill` runs the prompt through the target into a fresh KV cache and picks the first new token
(`next_token`: greedily from the few vocabulary rows that can hold the argmax, where it can);
`score_block` gives the target's logits for a block after the cache in one forward where the target
is row-count invariant on this machine (always, with the row-exact kernels), else row by row — the
same bits as plain decoding either way; `score_rows` scores several sequences' blocks, each after its
own cache, in one forward (continuous batching, `d3d.batch`), the head running over each block's
first rows only until verification reads more (`d3d.lazy_rows`); `verify_block` scores [anchor,
drafts] and judges the drafts (`judge`, `d3d.verify`), keeping the KV of what it accepts. Sources that
read the target's hidden states (DFlash-style) get each committed token's once, in order, through
`TargetStates`.

Both engines build their steps from these, and `d3d.costs` times `score_rows` itself: the cost
the speculation gate weighs is the cost of this very function. This module runs no loop, drafts
nothing and knows nothing of text.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from d3d.cache import KVCache
from d3d.config import SamplingConfig
from d3d.exactness import verify_mode
from d3d.lazy_rows import LazyRows, argmax_rows, each_row
from d3d.models import Decoder, SequenceRows
from d3d.sampling import greedy_ids, probabilities, sample
from d3d.sequence import Sequence, Step
from d3d.verify import Verdict, verify_greedy, verify_sampling


# Rows of a verification whose logits the head computes with the forward; later rows are computed
# when verification reads them (`d3d.lazy_rows`). On AMD EPYC Zen 3 (AVX2) the head over 1-4 rows
# costs 2.5-3.5 ms and over 5 rows 7.9, 17 rows 15.4 (docs/performance.md, "The head over the rows
# read"); where it runs on AMX tiles, 16 rows cost about what one does.
HEAD_ROWS = 4
AMX_HEAD_ROWS = 16


def head_rows(target: Decoder) -> int:
    """How many rows of a verification the head runs over with the forward on this target's kernels."""
    kernels = target.row_exact
    return AMX_HEAD_ROWS if kernels is not None and kernels.amx else HEAD_ROWS


def pick(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> int:
    """One token from (V,) logits: argmax when greedy, else a sample."""
    if sampling.greedy:
        return int(greedy_ids(logits))
    return int(sample(probabilities(logits, sampling), generator))


def next_token(target: Decoder, hidden: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> int:
    """`pick` over the logits of the last of final hidden states (T, hidden): when greedy, the argmax
    through `Decoder.greedy_ids` (the same token, from the few vocabulary rows that can hold it where
    the kernels can tell them)."""
    if sampling.greedy:
        return int(target.greedy_ids(hidden[-1:])[0])
    return pick(target.logits(hidden[-1:])[0], sampling, generator)


def reads_target_states(source: Any) -> bool:
    """Whether `source` (a `d3d.sources.DraftSource`) reads the target's hidden states. A source written before `feature_layers`
    joined the protocol has no such field and reads none: it keeps working unchanged."""
    return bool(getattr(source, "feature_layers", ()))


class TargetStates:
    """The target's hidden states of committed tokens, handed on to the sources that read them
    (DFlash-style drafters, `DraftSource.feature_layers`): every target forward computes them at the
    union of their layers, and each committed token's reach its readers once, in order."""

    def __init__(self, sources: list[Any], hidden_size: int) -> None:  # d3d.sources.DraftSource
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
    hidden, features = target.final_hidden(ids, states.layers if states else (), cache=cache, last_only=True)
    cache.commit()
    token = next_token(target, hidden[0], sampling, generator)
    sequence.stats.verify_seconds += time.perf_counter() - started
    if states is not None:
        states.commit(features[0])
        sequence.stats.draft_seconds += states.take_seconds()
    return sequence.commit([token], 0, 0), cache


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
    ids = torch.cat([torch.tensor([anchor], device=draft_tokens.device), draft_tokens])
    (target_logits, features), = score_rows(target, [SequenceRows(ids, cache, greedy=sampling.greedy)],
                                            states.layers if states else [])  # (K+1, V): at T = 0 read as argmaxes
    verdict = judge(target_logits, draft_tokens, draft_probs, sampling, generator)
    cache.commit(verdict.num_accepted + 1)
    if states is not None:
        states.commit(features[:verdict.num_accepted + 1])
    return verdict


def judge(target_logits: torch.Tensor | LazyRows, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
          sampling: SamplingConfig, generator: torch.Generator) -> Verdict:
    """The verdict on K drafts from the target's logits (K+1, V) over [anchor, drafts]: greedy
    matching, or rejection sampling with the drafts' q (a point mass for deterministic drafts);
    rows are read in order, none past the first rejection (computed as read where `LazyRows`)."""
    if sampling.greedy:
        return verify_greedy(draft_tokens, argmax_rows(target_logits, greedy_ids))
    if draft_probs is None:  # deterministic drafts (none: a plain sampling step): q is a point mass
        draft_probs = one_hot(draft_tokens, target_logits[0].shape[-1])
    return verify_sampling(draft_tokens, draft_probs, each_row(target_logits, lambda rows: probabilities(rows, sampling)),
                           generator)


def score_rows(target: Decoder, parts: list[SequenceRows], feature_layers: Sequence[int] = (),
               ) -> list[tuple[torch.Tensor | LazyRows, torch.Tensor | None]]:
    """`score_block_features` for several sequences, each after its own cache (`SequenceRows`):
    one forward over all their rows where the target is row-count invariant on this machine
    (`Decoder.forward_rows`), else each block row by row — the same bits as each decoded alone.
    With the row-exact kernels, logits past a block's first `head_rows` are computed as
    `judge` reads them (`LazyRows`)."""
    if verify_mode(target) == "batched" or all(len(part.ids) == 1 for part in parts):
        return target.forward_rows(parts, feature_layers, head_rows=head_rows(target))
    scored = []
    for part in parts:
        if part.last_only:  # a prompt's prefill: the same forward plain decoding starts with
            logits, features = target.logits_and_features(part.ids[None], feature_layers, cache=part.cache,
                                                           last_only=True)
            scored.append((logits[0], None if features is None else features[0]))
        else:
            assert part.mask is None, "row-by-row scoring is causal"
            scored.append(score_block_features(target, part.cache, part.ids[None], list(feature_layers)))
    return scored


def one_hot(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(K,) → (K, V): the draft distribution of deterministic drafts (context lookup, a greedy source)."""
    return torch.nn.functional.one_hot(tokens, vocab_size).float()
