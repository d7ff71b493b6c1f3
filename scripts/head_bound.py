"""How many vocabulary rows a certified greedy head would have to compute exactly.

Greedy decoding needs only the argmax of each row's logits. A cheap approximate head — the head's
weights as 8-bit codes per block of 32 (`d = max|w| / 127`, `q = round(w / d)`), the hidden state as
16-bit codes per block, exact integer block sums scaled in fp32 — gives every logit within a bound
that follows from the codes' errors (`max|w - d q|` per block, stored; half a step of the hidden
state's codes) and fp32's rounding. A vocabulary row whose approximate logit plus its bound falls
below the best row's approximate logit minus its bound, minus two bf16 steps, cannot be the argmax of
the exact bf16 logits; the rest (the candidates) would be computed exactly, with the kernels' own
chains, so the argmax — ties included — is the exact head's by construction.

This measures the candidates per row on the target's real final hidden states (greedy answers to a
few prompts of each dataset), checks that the exact argmax is always among them and that every
exact logit lies within its bound, and prints the bytes the approximate head reads against the
exact one. No kernel here: the arithmetic is PyTorch's, in fp64 where the bound needs it.

Usage: python scripts/head_bound.py [--datasets mtbench,humaneval,long4k] [--num-prompts 2]
                                   [--max-new-tokens 64]
(prints one JSON line)
"""

import argparse
import json

import torch

from d3d.generation import Pipeline
from d3d.prompts import load_dataset, sample_prompts

BLOCK = 32
UNIT = 2.0 ** -24  # fp32's unit roundoff


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default="mtbench,humaneval,long4k")
    parser.add_argument("--num-prompts", type=int, default=2, help="per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    pipeline = Pipeline.load()
    decoder = pipeline.target.decoder
    weight = decoder.head_weight.double()  # (V, K): the exact weights (bf16 values)
    vocab, width = weight.shape
    assert width % BLOCK == 0, f"hidden size {width} is not a multiple of {BLOCK}"
    hidden_rows = []
    head = decoder.logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        hidden_rows.append(hidden.detach().reshape(-1, width).clone())
        return head(hidden)

    decoder.logits = capture
    for dataset in args.datasets.split(","):
        for prompt in sample_prompts(load_dataset(dataset), args.num_prompts):
            ids = pipeline.encode(prompt.messages) if prompt.messages else pipeline.encode(prompt.text, chat=False)
            list(pipeline.steps(ids, pipeline.generation_config(args.max_new_tokens, 0.0, seed=0), "ar"))
    decoder.logits = head
    x = torch.cat(hidden_rows)  # (N, K), bf16
    exact = (x.float() @ decoder.head_weight.float().T).to(x.dtype).double()  # bf16 logits, as the head gives
    blocks = width // BLOCK
    # the weights' 8-bit codes and their errors, per block (what would be stored once at load)
    w = weight.view(vocab, blocks, BLOCK)
    scale = (w.abs().amax(-1) / 127).float().double()  # stored as fp32
    codes = torch.round(w / scale.clamp_min(1e-300)[..., None]).clamp(-127, 127)
    w_error = (w - codes * scale[..., None]).abs().amax(-1)  # (V, blocks)
    # the hidden state's 16-bit codes, per block (computed each step)
    xb = x.double().view(-1, blocks, BLOCK)
    x_scale = (xb.abs().amax(-1) / 32767).float().double()
    x_codes = torch.round(xb / x_scale.clamp_min(1e-300)[..., None])
    sums = torch.einsum("vbi,nbi->nvb", codes, x_codes)  # exact integer block sums
    approx = (sums * (scale[None] * x_scale[:, None, :])).sum(-1)  # (N, V)
    x_abs = xb.abs().sum(-1)  # (N, blocks)
    bound = x_abs @ w_error.T + (x_scale / 2) @ (scale * codes.abs().sum(-1)).T  # the codes' errors
    magnitude = x_abs @ (scale * 127 + w_error).T  # >= sum |w| |x| per row and logit
    bound = bound + (width + 64) * UNIT * magnitude  # fp32 rounding of the exact chain and of the approximation
    floor = (approx - bound).amax(-1, keepdim=True)
    margin = floor.abs() * 2.0 ** -7  # two bf16 steps at the best logit: ties after rounding stay candidates
    candidates = approx + bound >= floor - margin
    counts = candidates.sum(-1).double()
    argmax = exact.max(-1).indices
    exact_bytes = vocab * width * 2
    print(json.dumps({
        "rows": x.shape[0], "vocab": vocab, "hidden": width,
        "candidates_median": counts.median().item(), "candidates_mean": round(counts.mean().item(), 2),
        "candidates_p90": counts.quantile(0.9).item(), "candidates_max": counts.max().item(),
        "argmax_always_candidate": bool(candidates[torch.arange(x.shape[0]), argmax].all()),
        "within_bound": bool(((exact - approx).abs() <= bound + exact.abs() * 2.0 ** -8).all()),
        "bound_median": round(bound.median().item(), 4),
        "approximate_head_mb": round((vocab * width + 2 * vocab * blocks * 4) / 1e6, 1),
        "bf16_head_mb": round(exact_bytes / 1e6, 1),
    }))


if __name__ == "__main__":
    main()
