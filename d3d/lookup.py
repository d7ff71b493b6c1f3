"""Context lookup drafting: propose the tokens that followed the latest earlier occurrence of the
current suffix (n-gram "prompt lookup", Saxena 2023).

It costs no model call, and small targets repeat themselves under greedy decoding, so it is both a
baseline and the first source of the hybrid drafter: where the context holds a long enough match
the lookup drafts the block, elsewhere the diffusion drafter does. Tokens only; no models here.

`lookup_drafts` is the definition: a search over the whole sequence, O(length) per call.
`LookupIndex` gives the same drafts for a sequence that grows between calls, as a generation's
does, from dictionaries of every n-gram's latest position updated with the new tokens only — a few
microseconds per step at any length, where the search took 0.12 ms at 500 tokens and 0.4 ms at
2,000 (1–4% of a SmolLM2-135M step on the project's CPU, paid on every plain step).

How far to trust a match: the longer the context's suffix agrees with the text before the match
(`Match.length`, counted back past the n-gram that found it), the likelier the copy goes on — and,
for its first token, the likelier where the n-gram's earlier occurrences were all followed by the
same token: its `precedent` is "once" (one earlier occurrence, the one copied), "agreed" (several,
all continued alike) or "split" (continued differently). `continuation_chance` is that, measured:
under greedy decoding a match of L tokens goes on for one more with probability 1 − scale / (L +
offset) (`MISS_FIT`): by precedent, a 2-token match whose n-gram always went on alike 0.83, once
0.53, split 0.29; a 10-token one 0.97, 0.86, 0.63; by length alone ("any") 0.53 and 0.87 — maximum-
likelihood fits over 4,425 lookups in SmolLM2-135M-Instruct's own answers to 34 prompts of the
training sources, never a benchmark prompt. After k accepted drafts the match is k tokens longer,
so draft k + 1 is judged at L + k, by length alone: within a copy the n-gram before each draft is
the copied text's own, and judging those by their precedent too drafted less where copies went on
(`scripts/lookup_policy.py`: 1–4% fewer tokens per step of cost on long prompts than the first
draft's precedent alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d3d.config import ConfigError, _JsonMixin


@dataclass
class LookupConfig(_JsonMixin):
    """When and how far context lookup drafts."""

    max_ngram: int = 4  # longest suffix matched (tried first)
    min_ngram: int = 2  # shortest suffix that counts as a match

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError("lookup needs 1 <= min_ngram <= max_ngram")


# The fit above: P(a match of `length` tokens breaks at the next token) = scale / (length + offset),
# (scale, offset) by the precedent of the n-gram before that token, or over all of them ("any").
MISS_FIT = {"any": (1.45, 1.1), "once": (1.6, 1.4), "agreed": (0.35, 0.0), "split": (6.3, 6.9)}
MATCH_REACH = 64  # a match is measured back this far at most: beyond, it changes the chances by < 2%


@dataclass(frozen=True)
class Match:
    """Where the context's continuation is copied from: `start`, the position after the earlier
    occurrence of the suffix, and `length`, how many tokens before `start` agree with the suffix
    (at least the n-gram that found it, at most `MATCH_REACH`)."""

    start: int
    length: int


def continuation_chance(length: int, precedent: str) -> float:
    """The chance that the token after a match of `length` tokens is copied right, where the n-gram
    before it continued earlier as `precedent` says (the module's fit, under greedy decoding)."""
    scale, offset = MISS_FIT[precedent]
    return max(0.0, 1.0 - scale / (length + offset)) if length + offset > 0 else 0.0


def continuation_chances(length: int, num_drafts: int, precedent: str = "any") -> list[float]:
    """[j]: the chance that draft j + 1 copied from a match of `length` tokens is right, drafts 1 … j
    having been: the first by the `precedent` of the n-gram before it, the later ones by length."""
    return [continuation_chance(length + j, precedent if j == 0 else "any") for j in range(num_drafts)]


def lookup_drafts(tokens: list[int] | torch.Tensor, max_drafts: int, config: LookupConfig) -> list[int]:
    """`max_drafts` tokens continuing the latest earlier match of the longest suffix; [] if none."""
    sequence = torch.as_tensor(tokens)
    length = sequence.shape[0]
    for n in range(min(config.max_ngram, length - 1), config.min_ngram - 1, -1):
        suffix = sequence[-n:]
        windows = sequence[:-1].unfold(0, n, 1)  # (length - n, n): every earlier n-gram
        hits = (windows == suffix).all(-1).nonzero()
        if hits.numel():
            start = int(hits[-1, 0]) + n  # continuation of the latest match
            # Copy like LZ77: a continuation that runs past the end re-reads its own drafts, so
            # a loop of any period is drafted for the whole block.
            extended = sequence.tolist()
            for j in range(max_drafts):
                extended.append(extended[start + j])
            return extended[length:]
    return []


class LookupIndex:
    """`lookup_drafts` for one growing sequence, in time independent of its length.

    For every n in [min_ngram, max_ngram] it maps each n-gram of the sequence but its last token to
    where the latest occurrence starts — the windows `lookup_drafts` searches — and extends the maps
    by the tokens appended since the last call. A sequence that is not an extension of the one
    indexed (another generation) is indexed afresh.
    """

    def __init__(self, config: LookupConfig) -> None:
        self.config = config
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []  # the sequence indexed so far
        self.latest: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(self.config.min_ngram, self.config.max_ngram + 1)}
        # how each n-gram's occurrences so far went on: "once", "agreed" or "split" (`precedent`)
        self.precedents: dict[int, dict[tuple[int, ...], str]] = {n: {} for n in self.latest}

    def drafts(self, tokens: list[int] | torch.Tensor, max_drafts: int) -> list[int]:
        """`lookup_drafts(tokens, max_drafts, config)`."""
        tokens = self._indexed(tokens)
        match = self._match(tokens)
        if match is None:
            return []
        length = len(tokens)
        drafts: list[int] = []  # the match's continuation, copied like LZ77 (see lookup_drafts)
        for j in range(match.start, match.start + max_drafts):
            drafts.append(tokens[j] if j < length else drafts[j - length])
        return drafts

    def match(self, tokens: list[int] | torch.Tensor) -> Match | None:
        """The match `drafts` copies from (the latest occurrence of the longest suffix n-gram), with
        its length counted back; None where `drafts` finds none."""
        tokens = self._indexed(tokens)
        match = self._match(tokens)
        if match is None:
            return None
        length, end = len(tokens), match.start
        agree = match.length
        while agree < min(end, MATCH_REACH) and tokens[end - 1 - agree] == tokens[length - 1 - agree]:
            agree += 1
        return Match(end, agree)

    def chances(self, tokens: list[int] | torch.Tensor, num_drafts: int) -> list[float]:
        """`continuation_chances` of the next `num_drafts` drafts, from the match they would be
        copied from and its n-gram's precedent; [] without a match."""
        match = self.match(tokens)
        return [] if match is None else continuation_chances(match.length, num_drafts, self.precedent(self.tokens))

    def precedent(self, tokens: list[int]) -> str:
        """How the sequence's longest indexed suffix n-gram continued where it occurred before:
        "once", "agreed" or "split" ("once" where none is indexed). Read from what the last call
        indexed (the n-grams of its tokens but the last)."""
        for n in range(min(self.config.max_ngram, len(tokens)), self.config.min_ngram - 1, -1):
            found = self.precedents[n].get(tuple(tokens[-n:]))
            if found is not None:
                return found
        return "once"

    def _indexed(self, tokens: list[int] | torch.Tensor) -> list[int]:
        tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        if tokens[:len(self.tokens)] != self.tokens:
            self.reset()
        self._extend(tokens)
        return tokens

    def _match(self, tokens: list[int]) -> Match | None:
        """The latest occurrence of the longest suffix n-gram; `length` is the n-gram's."""
        for n in range(min(self.config.max_ngram, len(tokens) - 1), self.config.min_ngram - 1, -1):
            found = self.latest[n].get(tuple(tokens[-n:]))
            if found is not None:
                return Match(found + n, n)
        return None

    def _extend(self, tokens: list[int]) -> None:
        """Index the n-grams of tokens[:-1] that the last call's tokens[:-1] did not hold."""
        searched = max(len(tokens) - 1, 0)  # n-grams must end before the last token
        known = max(len(self.tokens) - 1, 0)
        for n, latest in self.latest.items():
            precedents = self.precedents[n]
            for start in range(max(known - n + 1, 0), searched - n + 1):
                gram = tuple(tokens[start:start + n])
                before = latest.get(gram)  # the previous occurrence, its follower at before + n
                precedents[gram] = ("once" if before is None else "split" if precedents[gram] == "split"
                                    or tokens[before + n] != tokens[start + n] else "agreed")
                latest[gram] = start
        self.tokens = tokens
