"""`d3d data`, `d3d train`, `d3d curves` and `d3d scaling`: making a drafter (d3d.train)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from d3d.cli.common import DTYPES
from d3d.config import ConfigError
from d3d.drafter import LAYERS_HELP, layer_selection


def data(args: argparse.Namespace) -> int:
    """Generate the target's own responses to training prompts (resumable): greedy, and with
    --samples also sampled ones; with the target loaded here, or fetched from an OpenAI-compatible
    server serving it (--server, greedy only)."""
    import os
    from pathlib import Path

    from d3d.loading import load_target, load_target_tokenizer
    from d3d.train.data import DataConfig, check_same_identity, check_sources, generate_data
    from d3d.train.remote import ServerConfig

    config = DataConfig(sources=args.sources.split(","), max_prompts=args.max_prompts,
                        skip_prompts=args.skip_prompts,
                        max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                        shard_size=args.shard_size, batch_size=args.batch_size, seed=args.seed,
                        samples=args.samples, temperature=args.temperature)
    if args.distill_top_k < 0:
        raise ConfigError("--distill-top-k must be >= 0")
    server = None
    if args.server:
        server = ServerConfig(url=args.server, served_model=args.served_model or "",
                              concurrency=ServerConfig.concurrency if args.concurrency is None else args.concurrency,
                              retries=ServerConfig.retries if args.retries is None else args.retries,
                              api_key=args.api_key or os.environ.get("OPENAI_API_KEY", ""))
    else:
        for option, value in (("--served-model", args.served_model), ("--concurrency", args.concurrency),
                              ("--retries", args.retries), ("--api-key", args.api_key)):
            if value is not None:
                raise ConfigError(f"{option} is an option of --server URL")
    # What can be refused without the model is refused before it loads (a resumed folder reads its
    # own prompts.jsonl, not the sources).
    out = Path(args.out)
    if (out / "manifest.json").is_file():  # the served model is not known yet: local or server is checked
        check_same_identity(out, {"config": config.to_dict(),
                                  "server": {"url": server.base_url, "model": None} if server else None})
    if not (out / "prompts.jsonl").is_file():
        check_sources(config)
    torch.set_num_threads(args.threads) if args.threads else None
    # with a server, only the tokenizer is needed here: to write the prompts and check the server's answers
    target = load_target_tokenizer(args.target) if server else load_target(args.target, DTYPES[args.dtype])
    manifest = generate_data(target, args.out, config, distill_top_k=args.distill_top_k, server=server)
    keys = ("num_prompts", "shards_done", "num_shards", "response_tokens", "left_out_count")
    print(json.dumps({k: manifest[k] for k in keys if k in manifest}))
    return 0


def train(args: argparse.Namespace) -> int:
    """Train a drafter on `d3d data` output; re-running the same command resumes."""
    from d3d.devices import resolve_device
    from d3d.loading import load_target
    from d3d.train.distributed import World
    from d3d.train.trainer import TrainConfig, Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    def config_for(depth: int | None) -> TrainConfig:
        """The run's options; layers named as "all" / "every:K" need the target's `depth` (None: [])."""
        layers = layer_selection(args.layers, depth, "--layers") if args.layers else []
        features = layer_selection(args.feature_layers, depth, "--feature-layers") if args.feature_layers else []
        if not layers and args.layers and depth is None:
            layers = [0]  # stands for "all" / "every:K" while only the options are checked
        return TrainConfig(layers=layers, drafter_kind=args.drafter_kind,
                           init_from=args.init_from, block_size=args.block_size, feature_layers=features,
                           block_attention=args.block_attention, labels=args.labels, steps=args.steps,
                           batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr, warmup=args.warmup,
                           lambda_ar=args.lambda_ar, gamma=args.gamma, distill=args.distill,
                           ce_weight=args.ce_weight, mask_ratio=args.mask_ratio, anchors=args.anchors,
                           max_length=args.max_length, eval_every=args.eval_every, save_every=args.save_every,
                           draft_vocab_size=args.draft_vocab_size, max_sequences=args.max_sequences, seed=args.seed,
                           compile=args.compile, length_groups=args.length_groups)

    config_for(None)  # bad options are refused before anything loads
    device = resolve_device(args.device)
    # under torchrun: one process per rank (gloo on the CPU, nccl on CUDA: each rank its own GPU)
    world = World.from_environment(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", world.local_rank)
    def run() -> dict:  # the trainer lives in this call only: gone before the world closes
        target = load_target(args.target, torch.float32)  # fp32 master weights; compute autocasts to bf16
        target.decoder.to(device)
        config = config_for(target.decoder.config.num_layers)
        trainer = Trainer(target, args.data, args.out, config, world, fsdp=args.fsdp, release_target=True)
        if trainer.extended_from is not None and world.is_main:
            change = "extending" if config.steps > trainer.extended_from else "shortening"
            print(f"{change} {args.out} from {trainer.extended_from} to {config.steps} steps at step "
                  f"{trainer.step}: the learning rate's decay now spans {config.steps}", file=sys.stderr)
        return trainer.run(progress=world.is_main)

    try:
        result = run()
    finally:
        world.close()
    if world.is_main:
        print(json.dumps(result))
    return 0


def curves(args: argparse.Namespace) -> int:
    """Compare the held-out τ curves of training runs in one PNG; print each run's final τ."""
    from d3d.train.curves import compare_runs

    for row in compare_runs(args.runs, args.out):
        print(json.dumps(row))
    return 0


def scaling(args: argparse.Namespace) -> int:
    """Fit held-out τ against training tokens over runs; print the fit and the tokens it predicts."""
    import math

    from d3d.train.scaling import fit, plot, read_points

    points = read_points(args.runs, args.all_points)
    result = fit(points)
    targets = [float(t) for t in args.targets.split(",")]
    if args.png:
        plot(points, result, args.png, targets)
    for point in points:
        print(json.dumps({"run": point.run, "tokens": point.tokens, "tau": point.tau}))
    predictions = {f"{t:g}": (round(result.tokens_for(t)) if math.isfinite(result.tokens_for(t)) else None)
                   for t in targets}
    print(json.dumps({"fit": f"tau = {result.intercept:.4f} + {result.slope:.4f} * ln(tokens)", "r2": round(result.r2, 4),
                      "points": result.points, "tokens_for_tau": predictions}))
    return 0


def add_commands(commands: argparse._SubParsersAction) -> None:
    """data, train, curves, scaling"""
    p = commands.add_parser("data", help="generate training data: the target's own responses (resumable)")
    p.add_argument("--out", required=True, help="output folder (re-run the same command to resume)")
    p.add_argument("--target", default="default")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--sources", default="sharegpt,stdlib",
                   help="comma-separated: sharegpt, sharegpt-turn2 (second turns), stdlib, math (templated word "
                        "problems), JSONL paths")
    p.add_argument("--max-prompts", type=int, default=0, help="0 = all")
    p.add_argument("--skip-prompts", type=int, default=0,
                   help="leave out the first N prompts of the ordered list: those a folder made with the same "
                        "--sources and --seed holds (its --max-prompts), so a second folder grows the data")
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--shard-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--samples", type=int, default=0,
                   help="also this many sampled responses per prompt beside the greedy one (seeded per prompt "
                        "and sample: the same on every rerun), so a drafter also learns where sampling goes; "
                        "local target only")
    p.add_argument("--temperature", type=float, default=1.0, help="the sampled responses' temperature (default 1)")
    p.add_argument("--distill-top-k", type=int, default=0,
                   help="also record the target's top-K next-token distributions for `d3d train --distill` "
                        "(shards made without them get them by one teacher-forced pass); 0 = off")
    p.add_argument("--server", default="", metavar="URL",
                   help="fetch the responses from this OpenAI-compatible server serving the target (vLLM, SGLang, "
                        "llama.cpp's server, `d3d serve`), e.g. http://127.0.0.1:8000/v1; --target then names the "
                        "local tokenizer it is checked against (no weights are loaded)")
    p.add_argument("--served-model", default=None, help="with --server: the model id to ask for (default: its only one)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="with --server: requests in flight at once (default 8)")
    p.add_argument("--retries", type=int, default=None,
                   help="with --server: further tries of a failed request, with exponential backoff (default 4)")
    p.add_argument("--api-key", default=None, help="with --server: its API key (default: $OPENAI_API_KEY)")
    p.set_defaults(handler=data)
    p = commands.add_parser("train", help="train a D3D (or AR baseline) drafter on the target's responses "
                                          "(resumable; data-parallel under torchrun: `torchrun --nproc-per-node N "
                                          "-m d3d.cli train …`, --batch-size is then the global micro-batch)")
    p.add_argument("--data", required=True,
                   help="a `d3d data` output folder, or several joined by commas: one data set, read in that order "
                        "(made by the same target)")
    p.add_argument("--out", required=True, help="run folder: checkpoint/, drafter/, log.jsonl, curves.png")
    p.add_argument("--target", default="default")
    p.add_argument("--layers", default="0,1,2,3", help=f"the target layers to start from: {LAYERS_HELP}")
    p.add_argument("--init-from", default="", help="start from this drafter checkpoint instead")
    p.add_argument("--drafter-kind", default="d3d", choices=["d3d", "ar", "dflash"],
                   help="d3d: the block-diffusion drafter; ar: the AR-drafter baseline (next-token loss only, "
                        "KL too with --distill; --block-size then bounds its drafts per verification); dflash: "
                        "the DFlash-style baseline, D3D's blocks over the target's hidden states (d3d.dflash)")
    p.add_argument("--feature-layers", default="",
                   help=f"with --drafter-kind dflash: the target layers it reads, {LAYERS_HELP} (default: as many as "
                        "--layers, spread from the second to the fourth-last)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--block-attention", default="anchor_causal", choices=["anchor_causal", "bidirectional", "causal"])
    p.add_argument("--labels", default="shifted", choices=["shifted", "unshifted"],
                   help="block row i predicts x_{a+i+1} (shifted) or its own token x_{a+i} (unshifted)")
    p.add_argument("--steps", type=int, default=2000,
                   help="resuming with more steps than the run began with extends it")
    p.add_argument("--batch-size", type=int, default=8,
                   help="sequences per micro-batch, all processes together (each of N takes 1/N of them)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--lambda-ar", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=0.0, help="L_diff decay exp(-(k-1)/γ) by draft position; 0 = off")
    p.add_argument("--distill", type=float, default=0.0,
                   help="weight of KL to the target's distributions (needs `d3d data --distill-top-k`); 0 = off")
    p.add_argument("--ce-weight", type=float, default=1.0,
                   help="weight of cross-entropy to the target's tokens (e.g. 0.1 beside --distill 1)")
    p.add_argument("--mask-ratio", default="random", choices=["all", "random"])
    p.add_argument("--anchors", type=int, default=8, help="noisy blocks per sequence")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--max-sequences", type=int, default=0,
                   help="train on the data's first N sequences (0 = all); keeps a run resumable while `d3d data` adds shards")
    p.add_argument("--draft-vocab-size", type=int, default=0,
                   help="draft only among this many most frequent response tokens (0 = whole vocabulary)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--compile", action="store_true",
                   help="run the drafter's layers through torch.compile (needs a C++ compiler on the CPU): faster "
                        "steps (~1.8x for a 30-layer drafter on 2 CPU cores, docs/training.md), rounded differently, so a run keeps "
                        "the setting it started with")
    p.add_argument("--length-groups", type=int, default=64, metavar="N",
                   help="micro-batches of sequences of similar length, sorted within windows of N micro-batches "
                        "of the shuffled data (0 = plain shuffle): less padding, faster steps (docs/training.md); "
                        "runs begun before this option resume with --length-groups 0")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard the drafter's weights, gradients and Adam moments over the processes "
                        "(FSDP2) instead of a whole replica each (DDP); for drafters too large to replicate")
    p.add_argument("--device", default="cpu",
                   help="cpu (default), cuda or cuda:N; under torchrun, cuda is each rank's own GPU (LOCAL_RANK)")
    p.set_defaults(handler=train)
    p = commands.add_parser("curves", help="compare training runs' held-out τ curves in one PNG")
    p.add_argument("runs", nargs="+", help="run folders (each with log.jsonl)")
    p.add_argument("--out", required=True, help="PNG path")
    p.set_defaults(handler=curves)
    p = commands.add_parser("scaling", help="fit held-out τ against training tokens over runs (log-linear)")
    p.add_argument("runs", nargs="+", help="`d3d train` run folders, e.g. the same recipe at several --steps")
    p.add_argument("--all-points", action="store_true",
                   help="fit every evaluation of every run, not only each run's final one")
    p.add_argument("--targets", default="2,3,5", help="τ values to predict the training tokens for")
    p.add_argument("--png", default="", help="draw the points and the fit here")
    p.set_defaults(handler=scaling)
