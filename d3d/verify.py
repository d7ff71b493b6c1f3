"""Verification of a drafted block against the target: pure tensor functions.

Glossary (one name per role, everywhere in d3d):
- draft_tokens (K,): the drafter's proposals for the K positions after the anchor.
- draft_probs (K, V): the distributions the drafts were drawn from (q in the literature).
- target_probs (K+1, V): the target's distributions at the anchor and at each draft (p); row i
  judges draft i, row K follows the last draft.
- num_accepted: how many leading drafts the target keeps (0 … K).
- bonus_token: the one token the target adds every step — at the first rejection it is
  *recovered* from the residual max(0, p - q); after a full accept it is drawn from p's last row.
So each verification commits num_accepted + 1 tokens, and τ counts that bonus token.

Greedy: accept while the draft equals the target's argmax. Sampling: accept draft x with
probability min(1, p(x)/q(x)) (Leviathan et al. 2023; Chen et al. 2023), which reproduces p exactly
because every draft was drawn from a q fixed before verification. No model, cache or tokenizer here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d3d.sampling import sample


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # leading drafts kept
    bonus_token: int  # the target's own token after them (recovered or bonus)


def verify_greedy(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> Verdict:
    """draft_tokens (K,), target_tokens (K+1,) = target argmax at the anchor and each draft."""
    assert target_tokens.shape == (draft_tokens.shape[0] + 1,), \
        f"target_tokens {tuple(target_tokens.shape)} must be one longer than draft_tokens {tuple(draft_tokens.shape)}"
    mismatch = (draft_tokens != target_tokens[:-1]).nonzero()
    num_accepted = int(mismatch[0, 0]) if mismatch.numel() else draft_tokens.shape[0]
    return Verdict(num_accepted, int(target_tokens[num_accepted]))


def verify_sampling(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                    generator: torch.Generator | None = None) -> Verdict:
    """Speculative rejection sampling; draft_probs (K, V), target_probs (K+1, V), draft_tokens (K,)."""
    num_drafts = draft_tokens.shape[0]
    assert draft_probs.shape[0] == num_drafts and target_probs.shape[0] == num_drafts + 1, \
        f"shapes: draft_tokens {tuple(draft_tokens.shape)}, draft_probs {tuple(draft_probs.shape)}, " \
        f"target_probs {tuple(target_probs.shape)}"
    if num_drafts == 0:  # a plain step: the target's own draw, exactly as plain decoding draws it
        return Verdict(0, int(sample(target_probs[0], generator)))
    rows = torch.arange(num_drafts, device=draft_tokens.device)
    p_draft = target_probs[rows, draft_tokens]
    q_draft = draft_probs[rows, draft_tokens]
    uniform = torch.rand(num_drafts, generator=generator, device=draft_probs.device)  # on the generator's device
    # Accept when u < p/q, written as u*q < p so that q = 0 never divides (such a draft is never drawn).
    rejected = (uniform * q_draft >= p_draft).nonzero()
    if not rejected.numel():
        bonus = sample(target_probs[num_drafts], generator)
        return Verdict(num_drafts, int(bonus))
    k = int(rejected[0, 0])
    residual = (target_probs[k] - draft_probs[k]).clamp_min(0)
    total = residual.sum()
    # p == q up to rounding leaves no residual mass; p itself is then the exact recovery distribution.
    residual = residual / total if total > 1e-12 else target_probs[k]
    recovered = sample(residual, generator)
    return Verdict(k, int(recovered))
