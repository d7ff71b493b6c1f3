"""Context lookup drafting: propose the tokens that followed the latest earlier occurrence of the
current suffix (n-gram "prompt lookup", Saxena 2023).

It costs no model call, and small targets repeat themselves under greedy decoding, so it is both a
baseline and the first source of the hybrid drafter: where the context holds a long enough match
the lookup drafts the block, elsewhere the diffusion drafter does. Tokens only; no models here.
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
