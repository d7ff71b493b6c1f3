"""What the `d3d` subcommands share: dtypes by name, the model and sampling options, and loading
the pipeline those options name."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from d3d.async_engine import AsyncConfig
from d3d.config import ConfigError
from d3d.devices import resolve_device
from d3d.exactness import kernel_name
from d3d.drafter import LAYERS_HELP, layer_selection
from d3d.generation import Pipeline, load_ar_drafter, resolve_drafter
from d3d.quantized import DRAFTER_WEIGHTS, WEIGHTS

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def load_pipeline(args: argparse.Namespace) -> Pipeline:
    started = time.perf_counter()
    layers = args.drafter_layers
    if layers:
        layer_selection(layers, option="--drafter-layers")  # refused before anything loads; resolved with the target
    drafter = None if args.drafter == "none" else args.drafter
    device = resolve_device(args.device)
    async_config = AsyncConfig(max_branches=args.branches)
    if device.type == "cpu":
        pipeline = Pipeline.load(args.target, drafter, DTYPES[args.dtype], layers, args.ar_drafter, async_config,
                                 weights=args.weights, drafter_weights=args.drafter_weights)
    else:  # weights are read on the CPU; the drafters are built on the target's device
        target = Pipeline.load(args.target, None, DTYPES[args.dtype], weights="dequantized").target
        target.decoder.to(device)
        pipeline = Pipeline(target, *resolve_drafter(target, drafter, args.target, layers, args.drafter_weights),
                            ar_drafter=load_ar_drafter(target, args.ar_drafter), async_config=async_config)
    d = pipeline.drafter
    where = pipeline.drafter_source if d is None else (
        f"{d.config.model.num_layers}-layer drafter, block {d.block_size}, {pipeline.drafter_source}")
    decoder = pipeline.target.decoder
    weights = f", {pipeline.target.weights} weights" if pipeline.target.weights.startswith("GGUF") else ""
    print(f"# target: {pipeline.target.name} ({args.dtype}{weights}, {device}, {kernel_name(decoder, decoder.dtype)} kernels); "
          f"drafter: {where}; loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return pipeline


def argv_is_cli() -> bool:
    return Path(sys.argv[0]).name in ("d3d", "__main__.py")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="default",
                        help="'default' (embedded SmolLM2-135M-Instruct), a Hugging Face folder or a .gguf file")
    parser.add_argument("--drafter", default="default",
                        help="drafter checkpoint folder, 'default', 'untrained' or 'none' (plain AR)")
    parser.add_argument("--drafter-layers", default=None,
                        help=f"with an untrained drafter: the target layers to copy, {LAYERS_HELP} (default: all)")
    parser.add_argument("--ar-drafter", default="",
                        help="an AR drafter checkpoint (`d3d train --drafter-kind ar`) for --method ar_drafter")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    add_weights_argument(parser)
    parser.add_argument("--drafter-weights", default="stored", choices=DRAFTER_WEIGHTS,
                        help="how the kernels read the drafter's own weights: 'stored' (default) as its file holds "
                             "them; q8_0/q4_1/q4_0: quantized at load — fewer bytes a draft, other drafts, the same "
                             "output (every draft is verified)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--branches", type=int, default=AsyncConfig.max_branches,
                        help="method async: outcomes (accepted count, bonus guess) whose next block is drafted "
                             f"ahead in each packed pass (default {AsyncConfig.max_branches}; 0 = none)")


def add_weights_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weights", default="stored", choices=WEIGHTS,
                        help="how the kernels read the target's weights: 'stored' (default) as the source holds "
                             "them — a GGUF's own quantized blocks, decoded exactly to the dequantized bf16 values; "
                             "'dequantized': bf16 copies (same logits, more bytes a step); q8_0/q4_1/q4_0: quantize "
                             "a bf16 folder at load (a different model)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
