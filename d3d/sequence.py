"""A generation's committed tokens and the limits that end it, and the `Step` each target forward yields.

Both engines (`d3d.engine`, `d3d.async_engine`) and the target's half of a step (`d3d.target_step`)
commit through a `Sequence`: it cuts tokens at EOS and at the length limit, keeps the running
`SpecStats`, and returns what one forward committed. It runs no model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from d3d.config import GenerationConfig
from d3d.stats import SpecStats

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
