"""`d3d prune`, `d3d compress` and `d3d export`: a trained drafter made smaller (d3d.prune: fewer layers;
d3d.delta: fewer bytes) or handed to vLLM (d3d.export)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from d3d.cli.common import DTYPES
from d3d.config import ConfigError


def prune_command(args: argparse.Namespace) -> int:
    """Progressively remove the drafter layers whose removal costs least τ; write the chosen depth."""
    from d3d.drafter import Drafter
    from d3d.loading import load_target
    from d3d.prune import PruneConfig, best_round, prune, save_report, time_rounds
    from d3d.train.trainer import load_sequences

    config = PruneConfig(min_layers=args.min_layers, min_retention=args.min_retention,
                         anchors=args.anchors, seed=args.seed, heal_steps=args.heal_steps, heal_lr=args.heal_lr,
                         heal_distill=args.heal_distill, heal_ce_weight=args.heal_ce_weight)
    target = load_target(args.target, DTYPES[args.dtype])
    drafter = Drafter.from_pretrained(args.drafter, target.decoder, target.fingerprint)
    if args.speed_async and drafter.config.kind != "d3d":
        raise ConfigError(f"--speed-async times asynchronous drafting, which only a D3D drafter does "
                          f"(this one is of kind {drafter.config.kind!r})")
    every = load_sequences(args.data, 512)
    sequences = every[-args.calibration:]
    config.heal_sequences = len(every) - len(sequences)  # healing never sees the calibration sequences
    if args.heal_steps and config.heal_sequences < 1:
        raise ConfigError(f"healing needs data beyond the {len(sequences)} calibration sequences")
    rounds, drafters = prune(drafter, target, sequences, config, args.data if args.heal_steps else None)
    # Decode the calibration prompts themselves, so decoded τ checks the teacher-forced estimate.
    speed_prompts = [tokens[:start] for tokens, start in sequences[:args.speed_prompts]]
    ar = (time_rounds(target.decoder, rounds, drafters, speed_prompts, args.max_new_tokens, args.speed_async)
          if speed_prompts else None)
    chosen = best_round(rounds)
    drafters[chosen].save_pretrained(args.out, dtype=torch.bfloat16)
    if args.keep_all:  # every depth, to benchmark or ship another one (`d3d bench --compare-drafter`)
        for r, kept in zip(rounds, drafters):
            kept.save_pretrained(Path(args.out) / f"layers-{len(r.layers)}", dtype=torch.bfloat16)
    files = save_report(rounds, args.out, ar)
    if ar:
        print(f"AR {ar:.1f} tok/s on the speed prompts", file=sys.stderr)
    for r in rounds:
        speed = "" if r.tokens_per_second is None else f", {r.tokens_per_second:.1f} tok/s (decoded τ {r.decoded_tau:.3f})"
        if r.async_tokens_per_second is not None:
            speed += f", async {r.async_tokens_per_second:.1f} tok/s"
        print(f"{len(r.layers):3d} layers  τ {r.tau:.3f}  ({100 * r.retention:.1f}%){speed}"
              + ("" if r.removed is None else f"  removed the layer at position {r.removed}"), file=sys.stderr)
    print(json.dumps({"chosen_layers": rounds[chosen].layers, "tau": round(rounds[chosen].tau, 4),
                      "retention": round(rounds[chosen].retention, 4), "out": args.out, "files": files}))
    return 0


def compress_command(args: argparse.Namespace) -> int:
    """Write a drafter whose layers were copied from the target as its differences from them in 4-bit
    blocks (d3d.delta); print the sizes and how far the weights moved."""
    from d3d.drafter import Drafter
    from d3d.loading import load_target

    target = load_target(args.target, torch.bfloat16)
    drafter = Drafter.from_pretrained(args.drafter, target.decoder, target.fingerprint)
    if not drafter.config.target_layers:
        raise ConfigError(f"{args.drafter} names no target layers it was copied from: nothing to store as differences")
    out = Path(args.out)
    if out.resolve() == Path(args.drafter).resolve():
        raise ConfigError("--out must be another folder than --drafter (the drafter is never modified)")
    drafter.save_pretrained(out, dtype=torch.bfloat16, delta_from=target.decoder)
    rebuilt = Drafter.from_pretrained(out, target.decoder, target.fingerprint)
    before, after = drafter.own_state(), rebuilt.own_state()
    moved = max(float((after[k].float() - v.float()).abs().max()) for k, v in before.items() if v.is_floating_point())
    sizes = {name: sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file())
             for name, folder in (("bytes_before", args.drafter), ("bytes_after", out))}
    print(json.dumps({"out": str(out), **sizes, "max_weight_change": moved}))
    return 0


def export_command(args: argparse.Namespace) -> int:
    """Write the target as a Hugging Face folder and the drafter as a vLLM draft model (d3d.export), then
    check that transformers computes d3d's logits from both; print the vLLM speculative config."""
    from d3d.drafter import Drafter
    from d3d.export import check_logits, export_drafter, export_target
    from d3d.loading import load_target

    if args.drafter_only and not args.drafter:
        raise ConfigError("--drafter-only needs --drafter")
    target = load_target(args.target, DTYPES[args.dtype])
    out = Path(args.out)
    summary: dict = {"dtype": args.dtype}
    context = torch.randint(0, target.decoder.config.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    if args.drafter:  # first: a refused drafter leaves nothing written
        drafter = Drafter.from_pretrained(args.drafter, target.decoder, target.fingerprint)
        exported = export_drafter(drafter, target, out if args.drafter_only else out / "drafter",
                                  mask_token_id=args.mask_token_id, widen_draft_vocab=args.widen_draft_vocab)
        for change in exported.changes:
            print(f"d3d: note: the exported drafter {change}", file=sys.stderr)
        summary.update(drafter=str(exported.folder), method=exported.method, mask_token_id=exported.mask_token_id,
                       exact=exported.exact, changes=exported.changes,
                       speculative_config=exported.speculative_config())
        if args.check:
            ids = [t for t in context.tolist() if t != exported.mask_token_id]
            masks = exported.num_speculative_tokens - 1 if exported.method == "parallel_draft" else 0
            summary["drafter_max_logit_difference"] = check_logits(exported.folder, drafter, ids, masks,
                                                                   exported.mask_token_id)
    if not args.drafter_only:
        folder = export_target(target, out / "target", source=args.target)
        summary["target"] = str(folder)
        if args.check:
            summary["target_max_logit_difference"] = check_logits(folder, target.decoder, context.tolist())
        if args.drafter:
            summary["vllm"] = (f"vllm serve {folder} --speculative-config "
                               f"'{json.dumps(summary['speculative_config'])}'")
    print(json.dumps(summary))
    return 0


def add_commands(commands: argparse._SubParsersAction) -> None:
    """prune, compress, export, export-hf"""
    p = commands.add_parser("prune", help="acceptance-driven progressive layer pruning of a drafter")
    p.add_argument("--drafter", required=True, help="the drafter checkpoint to prune (never modified)")
    p.add_argument("--data", required=True,
                   help="a `d3d data` folder, or several joined by commas: calibration sequences (and healing data)")
    p.add_argument("--out", required=True, help="folder for the chosen drafter, prune.json and prune.png")
    p.add_argument("--target", default="default")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--min-layers", type=int, default=1)
    p.add_argument("--min-retention", type=float, default=0.0, help="stop below this share of τ (e.g. 0.99)")
    p.add_argument("--calibration", type=int, default=64, help="calibration sequences (the data's last ones)")
    p.add_argument("--anchors", type=int, default=8)
    p.add_argument("--heal-steps", type=int, default=0, help="fine-tune steps after each removal")
    p.add_argument("--heal-lr", type=float, default=None, help="healing's peak learning rate (default: d3d train's)")
    p.add_argument("--heal-distill", type=float, default=None,
                   help="healing's KL weight to the target's distributions (data made with --distill-top-k; "
                        "default: d3d train's)")
    p.add_argument("--heal-ce-weight", type=float, default=None,
                   help="healing's cross-entropy weight (0.1 beside --heal-distill 1: the recipe of `d3d train`'s KD; "
                        "default: d3d train's)")
    p.add_argument("--speed-prompts", type=int, default=0,
                   help="decode this many calibration prompts with AR and every depth, interleaved prompt by "
                        "prompt: tokens/s and decoded τ")
    p.add_argument("--keep-all", action="store_true", help="also write every depth's drafter to OUT/layers-N")
    p.add_argument("--speed-async", action="store_true", help="with --speed-prompts, time async decoding too")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=prune_command)
    p = commands.add_parser("compress", help="store a drafter's layers as 4-bit differences from the target's "
                                             "(~1/4 of the bytes, nearly the same drafts)")
    p.add_argument("--drafter", required=True, help="a drafter copied from the target's layers (never modified)")
    p.add_argument("--out", required=True, help="folder for the compressed drafter (loaded like any other)")
    p.add_argument("--target", default="default", help="the target it was trained for: loading it needs the same one")
    p.set_defaults(handler=compress_command)
    for name, help_text in (("export", "write the target as a Hugging Face folder and a drafter for vLLM"),
                            ("export-hf", "alias of `d3d export --drafter-only`: the drafter alone")):
        p = commands.add_parser(name, help=help_text)
        p.add_argument("--out", required=True,
                       help="folder to write: OUT/target (config, tokenizer, safetensors) and, with --drafter, "
                            "OUT/drafter; with --drafter-only the drafter goes into OUT itself")
        p.add_argument("--target", default="default", help="'default', a Hugging Face folder or a .gguf file")
        p.add_argument("--drafter", default="" if name == "export" else None, required=name == "export-hf",
                       help="a drafter checkpoint: an AR drafter (vLLM draft_model) or a D3D drafter with causal "
                            "blocks (vLLM parallel drafting)")
        p.add_argument("--drafter-only", action="store_true", default=name == "export-hf",
                       help="write only the drafter, into OUT itself")
        p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                       help="the dtype d3d runs the target in, and the exported weights' dtype")
        p.add_argument("--mask-token-id", type=int, default=None,
                       help="vocabulary id vLLM feeds for MASK (default: one the target never uses; refused if it can "
                            "emit it)")
        p.add_argument("--widen-draft-vocab", action="store_true",
                       help="export a drafter with a reduced draft vocabulary drafting among all tokens (not exact)")
        p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                       help="load the exported folders in transformers and compare logits with d3d's (default)")
        p.set_defaults(handler=export_command)
