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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from d3d.bench.datasets import DatasetError
from d3d.async_engine import AsyncConfig
from d3d.config import ConfigError, SamplingConfig
from d3d.devices import resolve_device
from d3d.engine import PromptError
from d3d.generation import METHODS, Chunk, Method, Pipeline, load_ar_drafter, resolve_drafter
from d3d.loading import LoadError

DEFAULT_BENCH_DATASETS = "humaneval,mtbench,math500"
DEFAULT_BENCH_PROMPTS = 16  # per named dataset
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


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
    if s.branch_rounds_at:  # method "async"
        line += (f", next block drafted ahead for {100 * s.hit_rate:.0f}% of verdicts (a branch for their k: "
                 f"{100 * s.planned_rate:.0f}%), "
                 f"{100 * s.overlap_fraction:.0f}% of that drafting overlapped with verification")
    return line


def load_pipeline(args: argparse.Namespace) -> Pipeline:
    started = time.perf_counter()
    try:
        layers = [int(x) for x in args.drafter_layers.split(",")] if args.drafter_layers else None
    except ValueError:
        raise ConfigError(f"--drafter-layers takes comma-separated layer indices, got {args.drafter_layers!r}") from None
    drafter = None if args.drafter == "none" else args.drafter
    device = resolve_device(args.device)
    async_config = AsyncConfig(max_branches=args.branches)
    if device.type == "cpu":
        pipeline = Pipeline.load(args.target, drafter, DTYPES[args.dtype], layers, args.ar_drafter, async_config)
    else:  # weights are read on the CPU; the drafters are built on the target's device
        target = Pipeline.load(args.target, None, DTYPES[args.dtype]).target
        target.decoder.to(device)
        pipeline = Pipeline(target, *resolve_drafter(target, drafter, args.target, layers),
                            ar_drafter=load_ar_drafter(target, args.ar_drafter), async_config=async_config)
    d = pipeline.drafter
    where = pipeline.drafter_source if d is None else (
        f"{d.config.model.num_layers}-layer drafter, block {d.block_size}, {pipeline.drafter_source}")
    print(f"# target: {pipeline.target.name} ({args.dtype}, {device}); drafter: {where}; "
          f"loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return pipeline


def generate(args: argparse.Namespace) -> int:
    """Stream one generation; with --compare-ar also run plain AR decoding and report the speedup
    (exit 1 when at T = 0 the output is not AR's)."""
    pipeline = load_pipeline(args)
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
    """An interactive chat: each line you type is a user turn; an empty line or Ctrl-D ends it."""
    pipeline = load_pipeline(args)
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
        messages.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        result = run(pipeline, messages, args, method, echo=True)
        print(describe(method, result), file=sys.stderr)
        messages.append({"role": "assistant", "content": result.text})
    return 0


def data(args: argparse.Namespace) -> int:
    """Generate the target's own greedy responses to training prompts (resumable)."""
    from d3d.loading import load_target
    from d3d.train.data import DataConfig, generate_data

    config = DataConfig(sources=args.sources.split(","), max_prompts=args.max_prompts,
                        max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                        shard_size=args.shard_size, batch_size=args.batch_size, seed=args.seed)
    torch.set_num_threads(args.threads) if args.threads else None
    target = load_target(args.target, DTYPES[args.dtype])
    if args.distill_top_k < 0:
        raise ConfigError("--distill-top-k must be >= 0")
    manifest = generate_data(target, args.out, config, distill_top_k=args.distill_top_k)
    print(json.dumps({k: manifest[k] for k in ("num_prompts", "shards_done", "num_shards", "response_tokens")}))
    return 0


def train(args: argparse.Namespace) -> int:
    """Train a drafter on `d3d data` output; re-running the same command resumes."""
    from d3d.loading import load_target
    from d3d.train.trainer import TrainConfig, Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    config = TrainConfig(layers=[int(x) for x in args.layers.split(",")] if args.layers else [],
                         drafter_kind=args.drafter_kind, init_from=args.init_from, block_size=args.block_size,
                         feature_layers=[int(x) for x in args.feature_layers.split(",")] if args.feature_layers else [],
                         block_attention=args.block_attention, labels=args.labels, steps=args.steps,
                         batch_size=args.batch_size,
                         grad_accum=args.grad_accum, lr=args.lr, warmup=args.warmup, lambda_ar=args.lambda_ar,
                         gamma=args.gamma, distill=args.distill, ce_weight=args.ce_weight,
                         mask_ratio=args.mask_ratio, anchors=args.anchors,
                         max_length=args.max_length, eval_every=args.eval_every, save_every=args.save_every,
                         draft_vocab_size=args.draft_vocab_size, max_sequences=args.max_sequences, seed=args.seed)
    target = load_target(args.target, torch.float32)  # fp32 master weights; compute autocasts to bf16
    result = Trainer(target, args.data, args.out, config).run()
    print(json.dumps(result))
    return 0


def bench(args: argparse.Namespace) -> int:
    """Every method on the same prompts in one process; exits 1 if a d3d method's output differs from AR."""
    from d3d.bench.harness import BenchConfig, run_benchmark, save_result
    from d3d.bench.methods import check_methods
    from d3d.bench.report import markdown, plots

    if args.datasets is not None:
        named = [name for name in args.datasets.split(",") if name]
    elif args.prompts:  # the user's own prompts alone
        named = []
    else:
        named = ["humaneval", "mtbench"] if args.quick else DEFAULT_BENCH_DATASETS.split(",")
    if not named and not args.prompts:
        raise ConfigError("nothing to benchmark: give --datasets or --prompts")
    num_prompts = args.num_prompts
    if num_prompts is None:  # a sample of each named set; every prompt of the user's own files
        num_prompts = DEFAULT_BENCH_PROMPTS if named else None
    elif num_prompts < 1:
        raise ConfigError(f"--num-prompts must be at least 1, got {num_prompts}")
    config = BenchConfig(datasets=named + args.prompts, num_prompts=num_prompts, max_new_tokens=args.max_new_tokens,
                         methods=args.methods.split(","), temperature=args.temperature, seed=args.seed)
    if args.quick:
        config.num_prompts = 2 if config.num_prompts is None else min(config.num_prompts, 2)
        config.max_new_tokens = min(config.max_new_tokens, 48)
    if args.simulate_tau:
        return simulate_tau(args, config)
    check_methods(config.methods)  # unknown names, llama.cpp not built: say so before loading anything
    pipeline = load_pipeline(args)
    challengers = {}
    for spec in args.compare_drafter:
        label, _, folder = spec.partition("=")
        if not label or not folder or not label.isidentifier() or label in challengers:
            raise ConfigError(f"--compare-drafter takes a unique LABEL=PATH (LABEL a plain word), got {spec!r}")
        challengers[label] = Pipeline(pipeline.target, *resolve_drafter(pipeline.target, folder, args.target, None),
                                      async_config=pipeline.async_config)
    result = run_benchmark(pipeline, config, challengers=challengers)
    path = save_result(result, args.out)
    command = "d3d " + " ".join(sys.argv[1:]) if argv_is_cli() else "d3d bench ..."
    report = markdown(result, command)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        stem = Path(args.report).stem
        images = plots(result, Path(args.report).parent, stem)
        body = report + "".join(f"\n![{Path(i).stem}]({Path(i).name})\n" for i in images)
        datasets = ", ".join(group for group in result["table"] if group != "all")
        title = f"# d3d bench: T = {config.temperature}, {result['dtype']}, {datasets}"
        Path(args.report).write_text(f"{title}\n\n" + body)
    print(report, file=sys.stderr)
    summary = {"result": path, "identical": result["identical"],
               "speedup": {n: result["table"]["all"][n]["all"]["speedup"] for n in result["descriptions"]},
               "tau": {n: result["table"]["all"][n]["all"]["tau"] for n in result["descriptions"]}}
    print(json.dumps(summary))
    if not result["identical"]:
        print("d3d: error: " + "; ".join(result["mismatches"][:5]), file=sys.stderr)
        return 1
    return 0


def simulate_tau(args: argparse.Namespace, config) -> int:
    """`d3d bench --simulate-tau`: speedup against a set τ, sync and async, with the simulated
    drafter (d3d.simulate) charged the loaded drafter's cost; exits 1 if an output differs from AR."""
    from d3d.bench.datasets import load_dataset, sample_prompts
    from d3d.bench.harness import machine, prompt_turns
    from d3d.bench.sweep import markdown, plot, run_sweep

    try:
        taus = [float(x) for x in args.simulate_tau.split(",") if x]
    except ValueError:
        raise ConfigError(f"--simulate-tau takes comma-separated τ values, got {args.simulate_tau!r}") from None
    if args.temperature != 0:
        raise ConfigError("--simulate-tau sets τ under greedy decoding: leave --temperature at 0")
    pipeline = load_pipeline(args)
    if pipeline.drafter is None:
        raise ConfigError("--simulate-tau charges a real drafter's cost: give --drafter default, untrained or PATH")
    generation = pipeline.generation_config(config.max_new_tokens)
    prompts = [prompt_turns(pipeline, prompt, generation)[0] for name in config.datasets
               for prompt in sample_prompts(load_dataset(name), config.num_prompts, config.seed)]
    result = run_sweep(pipeline.target.decoder, pipeline.drafter, prompts, taus, config.max_new_tokens,
                       pipeline.async_config, generation.eos_token_ids, config.seed,
                       progress=lambda line: print(f"# {line}", file=sys.stderr))
    command = "d3d " + " ".join(sys.argv[1:]) if argv_is_cli() else "d3d bench --simulate-tau ..."
    result.update(machine=machine(), target=pipeline.target.name, drafter=pipeline.drafter_source,
                  device=str(pipeline.target.decoder.device), command=command,
                  dtype=str(pipeline.target.decoder.dtype).removeprefix("torch."))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"tau-sweep-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    report = markdown(result)
    if args.report:
        image = plot(result, Path(args.report).with_suffix(".png"),
                     f"simulated drafter, {result['machine']['cpu']}, {result['dtype']}")
        Path(args.report).write_text(f"# d3d bench --simulate-tau\n\n`{command}`\n\n{report}\n"
                                     f"![speedup against τ]({Path(image).name})\n")
    print(report, file=sys.stderr)
    print(json.dumps({"result": str(path), "identical": result["identical"],
                      "speedup": {m: [row[m]["speedup"] for row in result["rows"]] for m in ("sync", "async")},
                      "tau": taus}))
    if not result["identical"]:
        print("d3d: error: " + "; ".join(result["mismatches"][:5]), file=sys.stderr)
        return 1
    return 0


def argv_is_cli() -> bool:
    return Path(sys.argv[0]).name in ("d3d", "cli.py", "__main__.py")


def prune_command(args: argparse.Namespace) -> int:
    """Progressively remove the drafter layers whose removal costs least τ; write the chosen depth."""
    from d3d.drafter import Drafter
    from d3d.loading import load_target
    from d3d.prune import PruneConfig, ar_speed, best_round, prune, save_report, warm_up
    from d3d.train.trainer import load_sequences

    config = PruneConfig(min_layers=args.min_layers, min_retention=args.min_retention,
                         anchors=args.anchors, seed=args.seed, heal_steps=args.heal_steps)
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
    # Decode the calibration prompts themselves, so decoded τ checks the teacher-forced estimate.
    speed_prompts = [tokens[:start] for tokens, start in sequences[:args.speed_prompts]]
    ar = None
    if speed_prompts:
        warm_up(target.decoder, drafter, speed_prompts)
        ar = ar_speed(target.decoder, speed_prompts, args.max_new_tokens)
    rounds, drafters = prune(drafter, target, sequences, config, args.data if args.heal_steps else None,
                             speed_prompts, args.max_new_tokens, with_async=args.speed_async)
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
        folder = export_target(target, out / "target")
        summary["target"] = str(folder)
        if args.check:
            summary["target_max_logit_difference"] = check_logits(folder, target.decoder, context.tolist())
        if args.drafter:
            summary["vllm"] = (f"vllm serve {folder} --speculative-config "
                               f"'{json.dumps(summary['speculative_config'])}'")
    print(json.dumps(summary))
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


def serve_command(args: argparse.Namespace) -> int:
    """Serve the OpenAI-compatible HTTP API (d3d.server) until interrupted."""
    try:
        from d3d.server import API_KEY_VARIABLE, Limits, default_model_name, serve
    except ImportError as error:
        raise ConfigError(f"d3d serve needs the serve extra: pip install 'd3d-decoding[serve]' ({error})") from None
    limits = Limits(max_queue=args.max_queue, deadline=args.deadline or None, max_body_bytes=args.max_body_bytes,
                    api_key=args.api_key or os.environ.get(API_KEY_VARIABLE) or None,
                    shutdown_grace=args.shutdown_grace)
    pipeline = load_pipeline(args)
    serve(pipeline, args.host, args.port, args.model_name or default_model_name(args.target), args.method, limits)
    return 0


def doctor_command(args: argparse.Namespace) -> int:
    from d3d.doctor import as_json, doctor, format_report

    dtypes = [DTYPES[name] for name in args.dtypes.split(",")] if args.dtypes else [torch.bfloat16, torch.float32]
    machine, results = doctor(args.target, dtypes, None if args.drafter == "none" else args.drafter, args.recalibrate)
    print(json.dumps(as_json(machine, results)) if args.json else format_report(machine, results))
    return 0 if all(p.invariant for paths in results.values() for p in paths if p.used) else 1


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="default",
                        help="'default' (embedded SmolLM2-135M-Instruct), a Hugging Face folder or a .gguf file")
    parser.add_argument("--drafter", default="default",
                        help="drafter checkpoint folder, 'default', 'untrained' or 'none' (plain AR)")
    parser.add_argument("--drafter-layers", default=None,
                        help="with an untrained drafter: comma-separated target layers to copy (default: all)")
    parser.add_argument("--ar-drafter", default="",
                        help="an AR drafter checkpoint (`d3d train --drafter-kind ar`) for --method ar_drafter")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--branches", type=int, default=AsyncConfig.max_branches,
                        help="method async: outcomes (accepted count, bonus guess) whose next block is drafted "
                             f"ahead in each packed pass (default {AsyncConfig.max_branches}; 0 = none)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="d3d", description="Lossless speculative decoding with a D3D drafter.")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("generate", help="generate from one prompt")
    p.add_argument("prompt")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the chat template (default); --no-chat for a raw completion prompt")
    p.add_argument("--compare-ar", action="store_true", help="also run plain AR decoding and print the speedup")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--timeline", default="", help="with --method async: draw verify/draft spans per worker to this PNG")
    p.add_argument("--method", default="speculative", choices=METHODS,
                   help="speculative: context lookup where it matches, the drafter elsewhere (default); "
                        "drafter / lookup: one source alone; async: the drafter, drafting ahead during "
                        "verification; ar: plain decoding; ar_drafter: the AR-drafter baseline (--ar-drafter)")
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(handler=generate)

    p = commands.add_parser("data", help="generate training data: the target's own responses (resumable)")
    p.add_argument("--out", required=True, help="output folder (re-run the same command to resume)")
    p.add_argument("--target", default="default")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--sources", default="sharegpt,stdlib",
                   help="comma-separated: sharegpt, sharegpt-turn2 (second turns), stdlib, math (templated word "
                        "problems), JSONL paths")
    p.add_argument("--max-prompts", type=int, default=0, help="0 = all")
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--shard-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--distill-top-k", type=int, default=0,
                   help="also record the target's top-K next-token distributions for `d3d train --distill` "
                        "(shards made without them get them by one teacher-forced pass); 0 = off")
    p.set_defaults(handler=data)

    p = commands.add_parser("train", help="train a D3D (or AR baseline) drafter on the target's responses (resumable)")
    p.add_argument("--data", required=True, help="a `d3d data` output folder")
    p.add_argument("--out", required=True, help="run folder: checkpoint/, drafter/, log.jsonl, curves.png")
    p.add_argument("--target", default="default")
    p.add_argument("--layers", default="0,1,2,3", help="comma-separated target layers to start from")
    p.add_argument("--init-from", default="", help="start from this drafter checkpoint instead")
    p.add_argument("--drafter-kind", default="d3d", choices=["d3d", "ar", "dflash"],
                   help="d3d: the block-diffusion drafter; ar: the AR-drafter baseline (next-token loss only, "
                        "KL too with --distill; --block-size then bounds its drafts per verification); dflash: "
                        "the DFlash-style baseline, D3D's blocks over the target's hidden states (d3d.dflash)")
    p.add_argument("--feature-layers", default="",
                   help="with --drafter-kind dflash: comma-separated target layers it reads (default: as many as "
                        "--layers, spread from the second to the fourth-last)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--block-attention", default="anchor_causal", choices=["anchor_causal", "bidirectional", "causal"])
    p.add_argument("--labels", default="shifted", choices=["shifted", "unshifted"],
                   help="block row i predicts x_{a+i+1} (shifted) or its own token x_{a+i} (unshifted)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=8)
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
    p.set_defaults(handler=train)

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

    p = commands.add_parser("bench", help="benchmark methods on the same prompts, interleaved, identity-checked")
    p.add_argument("--datasets", default=None,
                   help=f"comma-separated: humaneval, mtbench, math500, aime24, aime25 "
                        f"(default: {DEFAULT_BENCH_DATASETS}; none when --prompts is given)")
    p.add_argument("--prompts", action="append", default=[], help="a user JSONL prompt file (repeatable)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"per dataset (default: {DEFAULT_BENCH_PROMPTS}; all when only --prompts files are given)")
    p.add_argument("--methods", default="ar,hf,hf_lookup,lookup,drafter,speculative",
                   help="comma-separated; also async, async_reanchor, and llama.cpp's llamacpp, llamacpp_lookup "
                        "(opt-in: build them with scripts/llamacpp.sh)")
    p.add_argument("--quick", action="store_true", help="2 prompts per dataset (of HumanEval and MT-Bench by default), 48 tokens")
    p.add_argument("--out", default="runs/bench", help="folder for the JSON result")
    p.add_argument("--report", default="", help="write a Markdown report (+ PNG plots beside it) here")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-drafter", action="append", default=[], metavar="LABEL=PATH",
                   help="also run each drafting method with this drafter, as METHOD@LABEL, interleaved (repeatable)")
    p.add_argument("--simulate-tau", default="", metavar="TAUS",
                   help="instead of --methods: sync and async speedup at these τ values (e.g. 1.5,2,3,4,6,8) with "
                        "the simulated drafter (d3d.simulate), charged the drafter's own cost; greedy only")
    add_model_arguments(p)
    p.set_defaults(handler=bench)

    p = commands.add_parser("prune", help="acceptance-driven progressive layer pruning of a drafter")
    p.add_argument("--drafter", required=True, help="the drafter checkpoint to prune (never modified)")
    p.add_argument("--data", required=True, help="a `d3d data` folder: calibration sequences (and healing data)")
    p.add_argument("--out", required=True, help="folder for the chosen drafter, prune.json and prune.png")
    p.add_argument("--target", default="default")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--min-layers", type=int, default=1)
    p.add_argument("--min-retention", type=float, default=0.0, help="stop below this share of τ (e.g. 0.99)")
    p.add_argument("--calibration", type=int, default=64, help="calibration sequences (the data's last ones)")
    p.add_argument("--anchors", type=int, default=8)
    p.add_argument("--heal-steps", type=int, default=0, help="fine-tune steps after each removal")
    p.add_argument("--speed-prompts", type=int, default=0,
                   help="decode this many calibration prompts per depth: tokens/s and decoded τ")
    p.add_argument("--keep-all", action="store_true", help="also write every depth's drafter to OUT/layers-N")
    p.add_argument("--speed-async", action="store_true", help="with --speed-prompts, time async decoding too")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=prune_command)

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

    p = commands.add_parser("chat", help="interactive multi-turn chat")
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(handler=chat, chat=True)

    p = commands.add_parser("serve", help="serve an OpenAI-compatible HTTP API (chat and text completions, streaming)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--method", default="speculative", choices=METHODS,
                   help="decoding method of every request (same choices as `d3d generate --method`)")
    p.add_argument("--model-name", default=None,
                   help="model id in responses and /v1/models (default: the target's name); requests may name any")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait while one generates; more get 429 with Retry-After (0: none wait)")
    p.add_argument("--deadline", type=float, default=600.0,
                   help="seconds a request may take from arrival to its last token, queue included (0: no deadline)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and the page at / "
                        "(default: $D3D_API_KEY; none when unset)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="on Ctrl-C or SIGTERM, seconds the running generation may take to finish")
    add_model_arguments(p)
    p.set_defaults(handler=serve_command)

    p = commands.add_parser("doctor", help="this machine: kernels, the row-invariance self-check, what exactness costs")
    p.add_argument("--target", default="default", help="as in `d3d generate`")
    p.add_argument("--dtypes", default=None, help="comma-separated, e.g. bfloat16 (default: bfloat16,float32)")
    p.add_argument("--drafter", default="default", help="the drafter whose costs the gate weighs, as in `d3d generate`")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure the gate's verification and drafting costs again (e.g. after a busy moment)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.set_defaults(handler=doctor_command)
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
    except (ConfigError, PromptError, LoadError, DatasetError) as error:
        print(f"d3d: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nd3d: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
