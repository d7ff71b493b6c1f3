"""One generation between target forwards: the per-sequence state both the solo engine
(`d3d.engine.generate_from_sources`) and the continuous batch (`d3d.batch`) advance.

A `Run` holds a generation's `Sequence`, KV cache, generator, drafting sources, gate and (for
sources that read them) the target's hidden states. `plan` and `rows` say what the next target
forward scores for it (a D3D drafter's pass in between, which a batch runs for all its runs at
once); `settle` takes that forward's logits and commits. It runs no forward itself, so a
caller may score one run or many in one call — with the same decisions and the same bits.
This module knows no text and runs no loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from d3d.config import GenerationConfig
from d3d.costs import forward_costs
from d3d.exactness import verify_mode
from d3d.gate import Crowd, SpeculationGate
from d3d.lazy_rows import LazyRows
from d3d.models import Decoder, SequenceRows
from d3d.prefix_cache import PrefixCache
from d3d.sampling import make_generator
from d3d.sequence import Sequence, Step
from d3d.sources import (DrafterCall, DrafterSource, DraftSource, Proposal, check_vocabulary, propose_together,
                         verify_reach)
from d3d.target_step import TargetStates, judge, pick, reads_target_states


# Called after each step with the target's logits (n, V) of the step's n committed tokens and those
# tokens: row j is the distribution committed token j was chosen from (what `d3d data
# --distill-top-k` keeps and the server's logprobs report).
OnCommit = Callable[[torch.Tensor, list[int]], None]


class Run:
    """One speculative generation between target forwards: `plan` and `rows` say what it feeds the
    next one — the prompt (or, with `prefill_rows`, its next piece), else the anchor and the drafts
    its sources propose —, and `settle` takes that forward's logits: it picks, or verifies and commits,
    and returns the `Step` (None after a piece of the prompt that is not its last). The target's
    forward itself is the caller's: `generate_from_sources` runs one sequence, `d3d.batch` many in
    one forward. Every choice — the gate's, the random draws — depends on this run's own tokens, so
    a run batched with others commits what it commits alone. With `prefixes`, it starts from the
    longest stored prefix of its prompt, stores its prompt once that is in and its whole cache
    when it ends (`release`)."""

    def __init__(self, target: Decoder, sources: list[DraftSource], prompt_ids: list[int],
                 config: GenerationConfig, adaptive: bool = False, on_commit: OnCommit | None = None,
                 prefixes: PrefixCache | None = None) -> None:
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
        # stored prefixes hold this run's own bits only where a position's keys and values do not
        # depend on the forward that computed them; sources reading hidden states would miss theirs
        self.prefixes = (prefixes if prefixes is not None and self.states is None
                         and verify_mode(target) == "batched" else None)
        # prompt tokens in the cache: a stored prefix, never the last token (its logits start the answer)
        self.prefilled = 0 if self.prefixes is None else self.prefixes.restore(self.cache, prompt_ids,
                                                                               len(prompt_ids) - 1)
        self.sequence.stats.cached_tokens = self.prefilled
        self.on_commit = on_commit
        self.source, self.drafts, self.draft_probs = "none", _no_drafts(target.device), None
        self.call: DrafterCall | None = None  # the drafter pass `plan` left to its caller
        self.chances: list[float] | None = None  # what the drafting source said of its drafts (`d3d.gate`)
        self.piece_end = 0  # where the prompt piece `plan` chose ends

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

    def plan(self, prefill_rows: int | None = None, crowd: Crowd | None = None) -> DrafterCall | None:
        """Decide what the next forward scores for this run: the prompt's next `prefill_rows` tokens
        (all when None), or once it is in, the anchor and this step's drafts (with a `crowd`, as many
        as pay for the batched forward as a whole). Drafts are proposed now, except a D3D drafter's:
        its call comes back for the caller to run with other runs' (`propose_together`) and hand
        to `rows`."""
        tokens = self.sequence.tokens
        self.call = None
        if self.prefilling:
            self.piece_end = self.sequence.prompt_length if prefill_rows is None else min(
                self.sequence.prompt_length, self.prefilled + max(1, prefill_rows))
            return None
        started = time.perf_counter()
        self.source, proposal, self.chances = "none", None, None
        for source in self.sources:
            # Never draft past the length limit: the bonus token always needs one slot.
            wanted = min(source.max_drafts, self.sequence.room - 1)
            chances = None
            if self.gate is not None:
                pending = source.pending(tokens) if hasattr(source, "pending") else 0
                chances = source.chances(tokens, wanted) if hasattr(source, "chances") and wanted > 0 else None
                wanted = self.gate.num_drafts(source.name, wanted, len(tokens), pending, crowd, chances)
            if wanted <= 0:
                continue
            self.chances = chances
            if isinstance(source, DrafterSource):  # it always proposes: the call ends the search
                self.source, self.call = source.name, DrafterCall(source, tokens, wanted, self.config.sampling,
                                                                  self.generator)
                break
            proposal = source.propose(tokens, wanted, self.config.sampling, self.generator)
            if proposal is not None:
                self.source = source.name
                break
        self._take(proposal)
        self.sequence.stats.draft_seconds += time.perf_counter() - started
        return self.call

    def rows(self, proposal: Proposal | None = None, seconds: float = 0.0) -> SequenceRows:
        """What the `plan`ned forward scores for this run: a piece of its prompt, or its anchor and
        drafts — with `proposal` the answer to the plan's drafter call, found in `seconds` (a call
        left unanswered is proposed here, alone)."""
        tokens = self.sequence.tokens
        if self.prefilling:
            ids = torch.tensor(tokens[self.prefilled:self.piece_end], device=self.target.device)
            return SequenceRows(ids, self.cache, last_only=True)  # a piece before the last: its logits go unread
        if self.call is not None:
            if proposal is None:
                started = time.perf_counter()
                proposal, = propose_together([self.call])
                seconds = time.perf_counter() - started
            self._take(proposal)
            self.sequence.stats.draft_seconds += seconds
            self.call = None
        anchor = torch.tensor([tokens[-1]], device=self.target.device)
        # a greedy step or verification whose logits nobody reads wants only argmaxes (`SequenceRows.greedy`)
        greedy = self.config.sampling.greedy and self.on_commit is None
        return SequenceRows(torch.cat([anchor, self.drafts]), self.cache, greedy=greedy)

    def _take(self, proposal: Proposal | None) -> None:
        self.drafts, self.draft_probs = ((_no_drafts(self.target.device), None) if proposal is None
                                         else (proposal.draft_tokens, proposal.draft_probs))

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
            if self.prefixes is not None:  # requests sharing this prompt need not wait for its answer
                # (in memory: a folder gets it as the run ends, not before its first token)
                self.prefixes.keep(sequence.tokens, self.cache, to_disk=False)
            return self._committed(sequence.commit([pick(logits[-1], self.config.sampling, self.generator)], 0, 0),
                                   logits, last=True)
        started = time.perf_counter()
        verdict = judge(logits, self.drafts, self.draft_probs, self.config.sampling, self.generator)
        accepted = verdict.num_accepted
        self.cache.commit(accepted + 1)
        if states is not None:
            states.commit(features[:accepted + 1])
            sequence.stats.draft_seconds += states.take_seconds()  # the readers' work is drafting work
        sequence.stats.verify_seconds += seconds + time.perf_counter() - started
        if self.gate is not None:
            self.gate.record(self.source, len(self.drafts), accepted, len(sequence.tokens), self.chances)
        new_tokens = self.drafts[:accepted].tolist() + [verdict.bonus_token]
        return self._committed(sequence.commit(new_tokens, len(self.drafts), accepted, self.source), logits)

    def release(self) -> None:
        """The generation is over (finished, failed or dropped): leave the positions it committed to
        the prefix cache, once."""
        if self.prefixes is not None:
            prefixes, self.prefixes = self.prefixes, None
            prefixes.keep(self.sequence.tokens, self.cache)

    def _committed(self, step: Step, logits: torch.Tensor | LazyRows, last: bool = False) -> Step:
        """`step`, after `on_commit` got the logits its tokens were chosen from — the first rows, or
        with `last` the last (a prompt's) — read only then (a greedy step's rows may never be computed)."""
        if self.on_commit is not None:
            self.on_commit(logits[-1:] if last else logits[:len(step.tokens)], step.tokens)
        return step


def _no_drafts(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.long, device=device)
