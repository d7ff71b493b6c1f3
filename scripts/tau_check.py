"""Does decoding get the τ that training measures? Teacher-forced against decoded τ on the same text.

For benchmark prompts, the target's greedy continuation is generated; then the drafter's τ is
measured two ways on that very text: teacher-forced at seeded anchors, as `d3d train` evaluates its
held-out set (`d3d.estimate.teacher_forced_tau`), and decoded, by the drafter-alone method (every
output checked against AR). Equal figures mean the inference path drafts as training scored it, so
a gap between held-out and decoded τ is the text's, not the code's.

Usage: python scripts/tau_check.py [--drafter PATH] [--datasets humaneval,mtbench,math500]
                                   [--num-prompts 6] [--max-new-tokens 128]
"""

import argparse

import torch

from d3d.estimate import teacher_forced_tau
from d3d.generation import Pipeline
from d3d.prompts import load_dataset, sample_prompts


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="default")
    parser.add_argument("--datasets", default="humaneval,mtbench,math500")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    pipeline = Pipeline.load(drafter=args.drafter)
    config = pipeline.generation_config(args.max_new_tokens)
    sequences, tokens, steps = [], 0, 0
    for dataset in args.datasets.split(","):
        for prompt in sample_prompts(load_dataset(dataset), args.num_prompts):
            ids = pipeline.encode(prompt.messages) if prompt.messages else pipeline.encode(prompt.text, chat=False)
            reference = [t for step in pipeline.steps(ids, config, "ar") for t in step.tokens]
            sequences.append((ids + reference, len(ids)))
            decoded = list(pipeline.steps(ids, config, "drafter"))
            if [t for step in decoded for t in step.tokens] != reference:
                raise SystemExit(f"{prompt.id}: the drafter-alone output differs from AR")
            tokens += sum(len(step.tokens) for step in decoded[1:])  # the prefill's token is no verification
            steps += len(decoded) - 1
    estimate = teacher_forced_tau(pipeline.drafter, sequences, anchors_per_sequence=32, seed=0)
    print(f"{len(sequences)} prompts from {args.datasets}, {args.max_new_tokens} greedy tokens each")
    print(f"teacher-forced τ on that text: {estimate.tau:.3f} over {estimate.num_blocks} blocks; "
          f"α by position {' '.join(f'{a:.2f}' for a in estimate.acceptance_rate)}")
    print(f"decoded τ, drafter alone:      {tokens / steps:.3f} over {steps} verifications (bonus token included)")


if __name__ == "__main__":
    main()
