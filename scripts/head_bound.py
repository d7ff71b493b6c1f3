"""How many vocabulary rows the certified greedy head computes exactly, on the target's real rows.

Greedy decoding needs only the argmax of each row's logits. The certified greedy head
(`d3d/kernels/greedy.h`, `d3d.kernels.greedy`) bounds every logit from an approximate head and
computes exactly only the vocabulary rows whose bound reaches the best row's (the candidates). This
runs the kernels' own candidate pass over the target's real final hidden states (greedy answers to a
few prompts of each dataset) and reports how many candidates a row has, whether the exact argmax —
the full head's — was always among them, and what the certified argmax gave against it.

Usage: python scripts/head_bound.py [--datasets mtbench,humaneval,long4k] [--num-prompts 2]
                                   [--max-new-tokens 64]
(prints one JSON line)
"""

import argparse
import json

import torch

from d3d.generation import Pipeline
from d3d.prompts import load_dataset, sample_prompts


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default="mtbench,humaneval,long4k")
    parser.add_argument("--num-prompts", type=int, default=2, help="per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    pipeline = Pipeline.load()
    decoder = pipeline.target.decoder
    kernels, weight = decoder.row_exact, decoder.head_weight
    head = kernels.greedy.head(weight) if kernels is not None else None
    if head is None:
        raise SystemExit("this target's head has no certified greedy head here (see `d3d doctor`)")
    hidden_rows = []
    full_head = decoder.logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        hidden_rows.append(hidden.detach().reshape(-1, hidden.shape[-1]).clone())
        return full_head(hidden)

    decoder.logits = capture
    kernels.greedy.on = False  # every row through the full head, captured
    try:
        for dataset in args.datasets.split(","):
            for prompt in sample_prompts(load_dataset(dataset), args.num_prompts):
                ids = pipeline.encode(prompt.messages) if prompt.messages else pipeline.encode(prompt.text, chat=False)
                list(pipeline.steps(ids, pipeline.generation_config(args.max_new_tokens, 0.0, seed=0), "ar"))
    finally:
        decoder.logits = full_head
        kernels.greedy.on = True
    x = torch.cat(hidden_rows)
    exact = torch.cat([full_head(x[i:i + 64]).float().max(-1).indices for i in range(0, len(x), 64)])
    found, counts = [], []
    for i in range(0, len(x), 4):
        f, c = head.candidates(kernels.library, x[i:i + 4].float().contiguous())
        found.append(f), counts.append(c)
    found, counts = torch.cat(found), torch.cat(counts)
    among = [counts[m] < 0 or int(exact[m]) in found[m, :counts[m]].tolist() for m in range(len(x))]
    certified = torch.cat([kernels.greedy.certified_ids(head, x[i:i + 1], weight) for i in range(len(x))])
    sized = counts[counts >= 0].double()
    print(json.dumps({
        "rows": len(x), "datasets": args.datasets,
        "candidates_median": sized.median().item(), "candidates_mean": round(sized.mean().item(), 2),
        "candidates_p90": sized.quantile(0.9).item(), "candidates_max": sized.max().item(),
        "rows_with_too_many": int((counts < 0).sum()),
        "exact_argmax_always_a_candidate": all(among),
        "certified_equals_full": bool(torch.equal(certified, exact)),
        "approximate_head_mb_read": round(head.bytes_read() / 1e6, 1),
    }))


if __name__ == "__main__":
    main()
