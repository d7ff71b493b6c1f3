"""The `d3d` command: subcommands are plain functions over the library, argparse only parses.

    d3d generate "prompt"          stream a generation, print τ and tokens/s (--compare-ar: speedup)
    d3d chat                       an interactive multi-turn chat
    d3d serve                      an OpenAI-compatible HTTP API (d3d.server)
    d3d data / train / curves      the drafter's training data, training run and τ curves (d3d.train)
    d3d scaling                    held-out τ against training tokens over runs: a log-linear fit (d3d.train.scaling)
    d3d prune                      acceptance-driven layer pruning of a drafter (d3d.prune)
    d3d export                     the target as a Hugging Face folder, a drafter for vLLM (d3d.export)
    d3d export-hf                  alias of `d3d export --drafter-only` (the drafter alone)
    d3d bench                      every method on the same prompts, interleaved, identity-checked (d3d.bench)
    d3d doctor                     this machine: kernels, the row-invariance check, what exactness costs

Each module here holds a few subcommands' handlers (plain functions of the parsed arguments) and
their options (`add_commands`); `common` holds what they share.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

from d3d.cli import bench, generate, ship, train
from d3d.config import ConfigError, SamplingConfig
from d3d.loading import LoadError
from d3d.prompts import DatasetError
from d3d.sequence import PromptError
from d3d.train.remote import RemoteError


def version() -> str:
    """"d3d VERSION (where the package lives)": which install a command runs, checkout or site-packages."""
    try:
        number = metadata.version("d3d-decoding")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        number = "unknown (not installed)"
    return f"d3d {number} ({Path(__file__).resolve().parents[1]})"


class PrintVersion(argparse.Action):
    """`--version`, printed as is (argparse's own action wraps a long path across lines)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and where d3d is installed, then exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="d3d", description="Lossless speculative decoding with a D3D drafter.")
    parser.add_argument("--version", action=PrintVersion)
    commands = parser.add_subparsers(dest="command", required=True)
    for module in (generate, train, ship, bench):  # `d3d --help` lists them in this order
        module.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "temperature"):  # check sampling options before loading anything
            SamplingConfig(temperature=args.temperature, top_k=args.top_k if hasattr(args, "top_k") else 0,
                           top_p=args.top_p if hasattr(args, "top_p") else 1.0)
        if getattr(args, "max_new_tokens", 1) < 1:
            raise ConfigError("--max-new-tokens must be at least 1")
        return args.handler(args)
    except (ConfigError, PromptError, LoadError, DatasetError, RemoteError) as error:
        print(f"d3d: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nd3d: interrupted", file=sys.stderr)
        return 130

