"""The target's log-probabilities of the tokens a generation commits, in the shape OpenAI's
`logprobs` reports them.

`TokenLogprobs` is a `d3d.run.OnCommit` callback: for every committed token it keeps that token's
log-probability and the `top` most likely tokens with theirs, taken from the very logits that chose
the token. A speculative method therefore reports what plain decoding reports: its verification
forward scores each committed token's position as plain decoding does, bit for bit
(`d3d.target_step`). The distribution is the target's own — log_softmax of its logits in fp32,
before temperature, top-k and top-p (vLLM's default, "raw" logprobs; at T = 0 the sampling
transform is the argmax and changes no probability) — so these are the numbers
`d3d data --distill-top-k` stores (`d3d.train.distill.keep_top` computes them the same way).

`content` turns them into the entries of a chat completion's `logprobs.content`: each token's text
(or "token_id:N" with vLLM's `return_tokens_as_token_ids` extension), the UTF-8 bytes of that text,
the log-probability and the top alternatives. This module runs no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# The most alternatives a request may ask for: OpenAI allows 20; more here so that
# `d3d data --server … --distill-top-k 32` can take the shipped recipe's distributions from `d3d serve`.
MAX_TOP_LOGPROBS = 64


@dataclass
class TokenLogprob:
    """One committed token's log-probability and its most likely alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token, logprob), most likely first


class TokenLogprobs:
    """Collects the log-probabilities of every token a generation commits (an `OnCommit` callback)."""

    def __init__(self, top: int = 0) -> None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        self.top = top
        self.entries: list[TokenLogprob] = []  # [i]: the i-th generated token's

    def __call__(self, logits: torch.Tensor, tokens: list[int]) -> None:
        assert logits.dim() == 2 and logits.shape[0] == len(tokens), (logits.shape, len(tokens))  # (n, V)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs[torch.arange(len(tokens), device=logits.device),
                          torch.tensor(tokens, device=logits.device)].tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in tokens]
        if self.top:
            values, ids = torch.topk(logprobs, min(self.top, logprobs.shape[-1]), dim=-1)
            tops = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
        self.entries += [TokenLogprob(token, logprob, top) for token, logprob, top in zip(tokens, chosen, tops)]


def content(entries: list[TokenLogprob], tokenizer: Any, tokens_as_ids: bool = False) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content` entries for `entries`: token text (special tokens by name) or
    "token_id:N", the text's UTF-8 bytes (a piece of a multi-byte character decodes to U+FFFD: ask
    for ids to be exact), the log-probability and the `top_logprobs` alternatives."""
    texts: dict[int, str] = {}

    def text(token: int) -> str:
        if token not in texts:
            texts[token] = tokenizer.decode([token], skip_special_tokens=False)
        return texts[token]

    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": f"token_id:{token}" if tokens_as_ids else text(token), "logprob": logprob,
                "bytes": list(text(token).encode("utf-8"))}

    return [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]} for e in entries]
