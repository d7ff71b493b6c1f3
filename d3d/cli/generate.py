"""`d3d generate`, `d3d chat` and `d3d serve`: decoding with a loaded pipeline."""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from d3d.batch import MAX_BATCH
from d3d.cli.common import add_model_arguments, add_sampling_arguments, load_pipeline
from d3d.config import ConfigError
from d3d.generation import METHODS, Chunk, Method, Pipeline
from d3d.prefix_cache import PREFIX_CACHE_MB, PREFIX_DISK_MB


@dataclass
class RunResult:
    text: str
    tokens: list[int]
    chunks: list[Chunk]

    @property
    def stats(self):
        return self.chunks[-1].step.stats


def run(pipeline: Pipeline, prompt: str | list[dict[str, str]], args: argparse.Namespace, method: Method,
        echo: bool) -> RunResult:
    chunks: list[Chunk] = []
    for chunk in pipeline.generate(prompt, chat=args.chat, max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                   seed=args.seed, stop=args.stop, method=method):
        chunks.append(chunk)
        if echo:
            print(chunk.text, end="", flush=True)
    if echo:
        print()
    tokens = [t for c in chunks for t in c.step.tokens]
    return RunResult("".join(c.text for c in chunks), tokens, chunks)


def describe(label: str, result: RunResult) -> str:
    s = result.stats
    line = f"{label}: {s.new_tokens} tokens in {s.wall_seconds:.2f} s = {s.tokens_per_second:.1f} tok/s"
    if s.drafted_at:
        rates = " ".join(f"{r:.2f}" for r in s.acceptance_rate[:8])
        line += (f", τ = {s.tau:.2f} (tokens per verification, bonus included; {s.steps} steps), "
                 f"acceptance by draft position: {rates}{' …' if len(s.acceptance_rate) > 8 else ''}, "
                 f"drafting {100 * s.draft_seconds / max(s.wall_seconds, 1e-9):.0f}% of the time")
    if s.cached_tokens:
        line += f", {s.cached_tokens} prompt tokens from the prefix cache"
    if s.branch_rounds_at:  # method "async"
        line += (f", next block drafted ahead for {100 * s.hit_rate:.0f}% of verdicts (a branch for their k: "
                 f"{100 * s.planned_rate:.0f}%), "
                 f"{100 * s.overlap_fraction:.0f}% of that drafting overlapped with verification")
    return line


def generate(args: argparse.Namespace) -> int:
    """Stream one generation; with --compare-ar also run plain AR decoding and report the speedup
    (exit 1 when at T = 0 the output is not AR's)."""
    args.prompt = read_prompt(args.prompt, args.file)
    check_prefix_folder(args.prefix_cache_dir)
    pipeline = load_pipeline(args)
    if args.prefix_cache_dir:  # a prompt computed by an earlier run starts from its stored keys and values
        pipeline.keep_prefixes(PREFIX_CACHE_MB, args.prefix_cache_dir)
    method: Method = args.method
    if args.compare_ar:
        warm = argparse.Namespace(**{**vars(args), "max_new_tokens": 8})
        for m in ("ar", method):  # warm-up: first calls pay for allocation and kernel selection
            run(pipeline, args.prompt, warm, m, echo=False)
    if args.timeline:
        pipeline.timeline = []
    spec = run(pipeline, args.prompt, args, method, echo=True)
    print(describe(method, spec), file=sys.stderr)
    if args.timeline:
        from d3d.timeline import plot_timeline

        if plot_timeline(pipeline.timeline or [], args.timeline, f"{method}: τ = {spec.stats.tau:.2f}"):
            print(f"timeline: {args.timeline}", file=sys.stderr)
        else:
            print("timeline: nothing recorded (only --method async records spans)", file=sys.stderr)
        pipeline.timeline = None
    summary = {"method": method, **spec.stats.summary()}
    if args.compare_ar and method != "ar":
        ar = run(pipeline, args.prompt, args, "ar", echo=False)
        print(describe("ar", ar), file=sys.stderr)
        speedup = spec.stats.tokens_per_second / max(ar.stats.tokens_per_second, 1e-9)
        same = spec.tokens == ar.tokens
        print(f"speedup over AR: {speedup:.2f}x; output identical to AR: {'yes' if same else 'NO'}"
              + ("" if args.temperature == 0 else " (sampling: outputs differ by design)"), file=sys.stderr)
        summary.update(ar_tokens_per_second=round(ar.stats.tokens_per_second, 2), speedup=round(speedup, 3),
                       identical_to_ar=same)
    if args.json:
        print(json.dumps(summary))
    if summary.get("identical_to_ar") is False and args.temperature == 0:  # lossless decoding broke
        at = next((i for i, (a, b) in enumerate(zip(spec.tokens, ar.tokens)) if a != b),
                  min(len(spec.tokens), len(ar.tokens)))
        print(f"d3d: error: {method} output differs from AR's from token {at} on; at T = 0 it must be identical",
              file=sys.stderr)
        return 1
    return 0


def chat(args: argparse.Namespace) -> int:
    """An interactive chat: each line you type is a user turn; an empty line or Ctrl-D ends it. With
    --file, the files' text opens the first turn."""
    if args.prefix_cache < 0:
        raise ConfigError(f"--prefix-cache must be at least 0 MiB, got {args.prefix_cache}")
    if "-" in args.file:
        raise ConfigError("chat reads your messages from standard input: give --file a path")
    documents = [read_text(name) for name in args.file]
    check_prefix_folder(args.prefix_cache_dir)
    pipeline = load_pipeline(args)
    # each turn's prompt is the conversation so far: only the new message is computed
    pipeline.keep_prefixes(args.prefix_cache, args.prefix_cache_dir)
    args.chat = True
    messages: list[dict[str, str]] = []
    method: Method = "speculative"
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        if not messages and documents:
            line = "\n\n".join([*documents, line])
        messages.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        result = run(pipeline, messages, args, method, echo=True)
        print(describe(method, result), file=sys.stderr)
        messages.append({"role": "assistant", "content": result.text})
    return 0


def serve_command(args: argparse.Namespace) -> int:
    """Serve the OpenAI-compatible HTTP API (d3d.server) until interrupted."""
    try:
        from d3d.server import API_KEY_VARIABLE, Limits, default_model_name, serve
    except ImportError as error:
        raise ConfigError(f"d3d serve needs the serve extra: pip install 'd3d-decoding[serve]' ({error})") from None
    limits = Limits(max_queue=args.max_queue, max_batch=args.max_batch, deadline=args.deadline or None, max_body_bytes=args.max_body_bytes,
                    api_key=args.api_key or os.environ.get(API_KEY_VARIABLE) or None,
                    shutdown_grace=args.shutdown_grace, prefix_cache_mb=args.prefix_cache,
                    prefix_cache_dir=args.prefix_cache_dir)
    check_address(args.host, args.port)
    check_prefix_folder(args.prefix_cache_dir)
    pipeline = load_pipeline(args)
    serve(pipeline, args.host, args.port, args.model_name or default_model_name(args.target), args.method, limits)
    return 0


def read_prompt(prompt: str, files: list[str]) -> str:
    """The prompt as given ("-": standard input), after the text of each --file, a blank line
    apart: `d3d generate --file paper.md "Summarise it."`."""
    if [*files, prompt].count("-") > 1:
        raise ConfigError("standard input ('-') can be read once: as the prompt or as one --file")
    return "\n\n".join([*map(read_text, files), read_text(prompt) if prompt == "-" else prompt])


def read_text(name: str) -> str:
    """A file's text ("-": standard input), or a usage error saying why not."""
    try:
        return sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        where = "standard input" if name == "-" else name
        raise ConfigError(f"cannot read the prompt from {where}: {getattr(error, 'strerror', None) or error}") from None


def check_prefix_folder(folder: str | None) -> None:
    """--prefix-cache-dir names a folder this process can make and write (checked before the load)."""
    if folder is None:
        return
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--prefix-cache-dir {folder}: {error.strerror}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--prefix-cache-dir {folder}: not writable")


def check_address(host: str, port: int) -> None:
    """Fail before the model loads where the server could not listen: a port out of range, a host that
    does not resolve, an address taken or not permitted (uvicorn would say so only after the load)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be 0 … 65535, got {port}")
    try:  # every address the host names, as asyncio's server binds them ('': all interfaces)
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ConfigError(f"cannot listen on {host!r}: {error.strerror}") from None
    for family, kind, proto, _, address in addresses:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:  # a family this machine lacks (IPv6 switched off): the server skips it too
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                probe.bind(address)
            except OSError as error:
                hint = " (is a server already running there? choose another --port)" if error.errno == errno.EADDRINUSE else ""
                raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror}{hint}") from None


def add_commands(commands: argparse._SubParsersAction) -> None:
    """generate, chat, serve"""
    p = commands.add_parser("generate", help="generate from one prompt")
    p.add_argument("prompt", help="the prompt ('-': read it from standard input)")
    add_file_argument(p, "the prompt")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the chat template (default); --no-chat for a raw completion prompt")
    p.add_argument("--compare-ar", action="store_true", help="also run plain AR decoding and print the speedup")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--timeline", default="", help="with --method async: draw verify/draft spans per worker to this PNG")
    p.add_argument("--method", default="speculative", choices=METHODS,
                   help="speculative: context lookup where it matches, the drafter elsewhere (default); "
                        "drafter / lookup: one source alone; async: the drafter, drafting ahead during "
                        "verification; ar: plain decoding; ar_drafter: the AR-drafter baseline (--ar-drafter)")
    add_prefix_cache_argument(p, memory=False)
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(handler=generate)
    p = commands.add_parser("chat", help="interactive multi-turn chat")
    add_file_argument(p, "your first message")
    add_model_arguments(p)
    add_sampling_arguments(p)
    add_prefix_cache_argument(p)
    p.set_defaults(handler=chat, chat=True)
    p = commands.add_parser("serve", help="serve an OpenAI-compatible HTTP API (chat and text completions, streaming)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--method", default="speculative", choices=METHODS,
                   help="decoding method of every request (same choices as `d3d generate --method`)")
    p.add_argument("--model-name", default=None,
                   help="model id in responses and /v1/models (default: the target's name); requests may name any")
    p.add_argument("--max-batch", type=int, default=MAX_BATCH,
                   help="generations decoding at once, together in one continuous batch, each exactly as alone "
                        f"(default {MAX_BATCH}; 1: one at a time; method async is never batched)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait while every batch place generates; more get 429 with Retry-After "
                        "(0: none wait)")
    p.add_argument("--deadline", type=float, default=600.0,
                   help="seconds a request may take from arrival to its last token, queue included (0: no deadline)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and the page at / "
                        "(default: $D3D_API_KEY; none when unset)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="on Ctrl-C or SIGTERM, seconds the running generation may take to finish")
    add_prefix_cache_argument(p)
    add_model_arguments(p)
    p.set_defaults(handler=serve_command)


def add_file_argument(p: argparse.ArgumentParser, before: str) -> None:
    p.add_argument("--file", action="append", default=[], metavar="PATH",
                   help=f"put this file's text ('-': standard input) before {before}, a blank line apart "
                        "(repeatable): --file notes.md \"Summarise it.\"")


def add_prefix_cache_argument(p: argparse.ArgumentParser, memory: bool = True) -> None:
    if memory:
        p.add_argument("--prefix-cache", type=int, default=PREFIX_CACHE_MB, metavar="MB",
                       help="MiB of ended generations' keys and values kept so that a later prompt starting with the "
                            "same tokens (a chat's next turn, a shared system prompt) computes only the rest; "
                            f"exact, the same output (default {PREFIX_CACHE_MB}; 0: off)")
    p.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="also keep those keys and values on disk in DIR (a subfolder per target, machine and "
                        f"kernel build; at most {PREFIX_DISK_MB} MiB, the least recently used leaving first), so that a later "
                        "run asked about the same long document starts from them instead of its prefill; exact")
