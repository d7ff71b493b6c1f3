"""An acceptance-controlled drafter for simulation: τ is set, not learned.

`SimulatedDrafter` wraps a real D3D drafter. Every drafting call runs that drafter's own forward —
the same rows, the same KV cache, the same cores or device — so drafting costs what the real
drafter costs on this machine, and the async worker competes for compute as the real one does
(charged by spending the time, not by a cost model; choose another cost by wrapping a drafter of
another depth). Then it replaces the logits: the row predicting position j puts its maximum on
stream[j], the target's own greedy continuation of the prompt (a precomputed reference, e.g. the
AR run a benchmark makes anyway) in which each position was replaced independently, with
probability ε = `corruption_rate`, by another token. Under greedy decoding the target accepts a
draft exactly when it is not corrupted, so a round of K drafts commits min(first corrupted
offset, K + 1) tokens and τ = Σ_{i=0..K} (1 − ε)^i (`expected_tau`; `corruption_rate_for` inverts
it). Corruption is a function of the position and the seed alone, so sync and async runs of a
prompt meet the same corrupted positions.

Each row's second choice is where the async branch plan looks for the bonus token: at a corrupted
position it is the target's token, elsewhere another token; the draft's own probability is 1 − ε
(calibrated) for ε ≤ 1/2, 1/2 above. So a packed pass hits exactly when it drafted ahead for the
accepted count k: the simulation measures the plan's choice of k and what overlapping costs, not
bonus guessing.

Lossless like every source: it only proposes, the target verifies. At T > 0 the committed tokens
leave the reference at the first sampled difference, so acceptance is no longer controlled; the
output law is still the target's (the drafts' q is the replaced logits' distribution).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from d3d.cache import KVCache
from d3d.config import ConfigError, DrafterConfig
from d3d.drafter import Drafter, DraftRequest
from d3d.models import Decoder


def expected_tau(corruption_rate: float, num_drafts: int) -> float:
    """τ of rounds of `num_drafts` drafts, each corrupted independently with this rate."""
    kept = 1.0 - corruption_rate
    return sum(kept ** i for i in range(num_drafts + 1))


def corruption_rate_for(tau: float, num_drafts: int) -> float:
    """The corruption rate that makes rounds of `num_drafts` drafts commit `tau` tokens on average."""
    if not 1.0 <= tau <= num_drafts + 1:
        raise ConfigError(f"τ = {tau} is out of reach with {num_drafts} drafts per round: "
                          f"choose 1 ≤ τ ≤ {num_drafts + 1}")
    low, high = 0.0, 1.0  # expected_tau falls as the rate rises
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if expected_tau(middle, num_drafts) > tau else (low, middle)
    return (low + high) / 2


class SimulatedDrafter:
    """A D3D drafter whose drafts are the target's reference continuation, corrupted at a set rate.

    Speaks `Drafter`'s drafting contract (`draft`, `packed_draft`, `new_cache`, `block_size`,
    `config`, `decoder`), so both engines run it unchanged; `drafter` is the real one it runs.
    """

    def __init__(self, drafter: Drafter, reference: list[int], corruption_rate: float, seed: int = 0) -> None:
        if not (isinstance(corruption_rate, (int, float)) and 0.0 <= corruption_rate <= 1.0):
            raise ConfigError(f"corruption_rate must lie in [0, 1], got {corruption_rate!r}")
        if drafter.config.labels != "shifted":
            raise ConfigError("the simulation replaces shifted-label block rows; this drafter has "
                              f"{drafter.config.labels} labels")
        if not reference:
            raise ConfigError("the simulation needs a reference: the prompt and the target's greedy continuation")
        vocab = drafter.config.target_vocab_size
        if vocab < 2:
            raise ConfigError("the simulation needs a vocabulary of at least 2 tokens to corrupt a draft")
        self.drafter = drafter
        self.corruption_rate = float(corruption_rate)
        generator = torch.Generator().manual_seed(seed)
        truth = torch.tensor(reference, dtype=torch.long)
        corrupted = torch.rand(truth.shape[0], generator=generator) < self.corruption_rate
        other = (truth + torch.randint(1, vocab, truth.shape, generator=generator)) % vocab  # never the truth
        device = drafter.decoder.device
        self.stream = torch.where(corrupted, other, truth).to(device)  # (L,) the drafts, by position
        self.second = torch.where(corrupted, truth, other).to(device)  # (L,) each row's second choice
        # The second choice's logit below the draft's 0: log(ε / (1 − ε)), kept under 0 so the draft
        # stays the argmax, and finite (a row with ε = 0 still has a second choice to rank).
        ratio = self.corruption_rate / max(1.0 - self.corruption_rate, 1e-12)
        self.second_logit = min(math.log(max(ratio, 1e-13)), -0.01)

    # -- the Drafter contract ---------------------------------------------------------------------

    @property
    def config(self) -> DrafterConfig:
        return self.drafter.config

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    @property
    def decoder(self) -> Decoder:
        return self.drafter.decoder

    def new_cache(self, capacity: int) -> KVCache:
        return self.drafter.new_cache(capacity)

    @torch.no_grad()
    def draft(self, cache: KVCache, tokens: list[int], num_drafts: int | None = None) -> torch.Tensor:
        """`Drafter.draft`, run for its cost and cache; row i then predicts position len(tokens)+i."""
        return self.draft_together([(cache, tokens, num_drafts)])[0]

    @torch.no_grad()
    def draft_together(self, requests: Sequence[DraftRequest]) -> list[torch.Tensor]:
        """`Drafter.draft_together`, run for its cost and caches; each sequence's rows as `draft`'s."""
        return [self.rows(len(tokens), logits.shape[0], logits)
                for logits, (_, tokens, _) in zip(self.drafter.draft_together(requests), requests)]

    @torch.no_grad()
    def packed_draft(self, cache: KVCache, trunk: list[int], branches: list[tuple[int, int]], anchor_slot: int,
                     with_trunk: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
        """`Drafter.packed_draft`, run for its cost and cache; trunk row i predicts anchor_slot+1+i,
        branch (k, b)'s row i predicts anchor_slot+k+2+i."""
        trunk_logits, logits = self.drafter.packed_draft(cache, trunk, branches, anchor_slot, with_trunk)
        if trunk_logits is not None:
            trunk_logits = self.rows(anchor_slot + 1, trunk_logits.shape[0], trunk_logits)
        blocks = [self.rows(anchor_slot + k + 2, logits.shape[1], logits[i]) for i, (k, _) in enumerate(branches)]
        return trunk_logits, torch.stack(blocks) if blocks else logits

    # -- the simulation ----------------------------------------------------------------------------

    def rows(self, first_position: int, num_rows: int, like: torch.Tensor) -> torch.Tensor:
        """(num_rows, V) logits shaped like `like`, row i predicting position first_position + i:
        0 at the draft, `second_logit` at the second choice, -inf elsewhere. Past the reference's
        end (only drafted ahead for branches that cannot be reached) the last position repeats."""
        positions = torch.arange(first_position, first_position + num_rows, device=like.device)
        positions = positions.clamp_max(self.stream.shape[0] - 1)
        rows = torch.arange(num_rows, device=like.device)
        logits = torch.full((num_rows, like.shape[-1]), float("-inf"), dtype=like.dtype, device=like.device)
        logits[rows, self.second[positions]] = self.second_logit
        logits[rows, self.stream[positions]] = 0.0
        return logits
