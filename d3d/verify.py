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

from d3d.lazy_rows import LazyRows
from d3d.sampling import sample


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # leading drafts kept
    bonus_token: int  # the target's own token after them (recovered or bonus)


def verify_greedy(draft_tokens: torch.Tensor, target_tokens: torch.Tensor | LazyRows) -> Verdict:
    """draft_tokens (K,), target_tokens (K+1,) = target argmax at the anchor and each draft, read in
    order: row i only once drafts 0 … i-1 are accepted (rows computed as read, `d3d.lazy_rows`)."""
    assert len(target_tokens) == draft_tokens.shape[0] + 1, \
        f"target_tokens ({len(target_tokens)},) must be one longer than draft_tokens {tuple(draft_tokens.shape)}"
    if isinstance(target_tokens, torch.Tensor):
        target_tokens = target_tokens.tolist()
    for i, draft in enumerate(draft_tokens.tolist()):
        target = int(target_tokens[i])
        if target != draft:
            return Verdict(i, target)
    return Verdict(len(draft_tokens), int(target_tokens[len(draft_tokens)]))


def verify_sampling(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor | LazyRows,
                    generator: torch.Generator | None = None) -> Verdict:
    """Speculative rejection sampling; draft_probs (K, V), target_probs (K+1, V), draft_tokens (K,).
    The target's rows are read in order, none after the first rejection (`d3d.lazy_rows`); the K
    uniforms are drawn first, whatever is read."""
    num_drafts = draft_tokens.shape[0]
    assert draft_probs.shape[0] == num_drafts and len(target_probs) == num_drafts + 1, \
        f"shapes: draft_tokens {tuple(draft_tokens.shape)}, draft_probs {tuple(draft_probs.shape)}, " \
        f"target_probs ({len(target_probs)}, V)"
    if num_drafts == 0:  # a plain step: the target's own draw, exactly as plain decoding draws it
        return Verdict(0, int(sample(target_probs[0], generator)))
    rows = torch.arange(num_drafts, device=draft_tokens.device)
    q_draft = draft_probs[rows, draft_tokens]
    uniform = torch.rand(num_drafts, generator=generator, device=draft_probs.device)  # on the generator's device
    # Accept when u < p/q, written as u*q < p so that q = 0 never divides (such a draft is never drawn).
    threshold = uniform * q_draft
    for k in range(num_drafts):
        if threshold[k] >= target_probs[k][draft_tokens[k]]:
            residual = (target_probs[k] - draft_probs[k]).clamp_min(0)
            total = residual.sum()
            # p == q up to rounding leaves no residual mass; p itself is then the exact recovery distribution.
            residual = residual / total if total > 1e-12 else target_probs[k]
            return Verdict(k, int(sample(residual, generator)))
    return Verdict(num_drafts, int(sample(target_probs[num_drafts], generator)))
