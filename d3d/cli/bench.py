"""`d3d bench` (and its `--simulate-tau` sweep) and `d3d doctor`: measuring methods and the machine."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

from d3d.cli.common import DTYPES, add_model_arguments, argv_is_cli, load_pipeline
from d3d.config import ConfigError
from d3d.generation import Pipeline, resolve_drafter
from d3d.prompts import load_dataset, load_prompt_file, sample_prompts
from d3d.quantized import DRAFTER_WEIGHTS

DEFAULT_BENCH_DATASETS = "humaneval,mtbench,math500"
DEFAULT_BENCH_PROMPTS = 16  # per named dataset


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
    # Every prompt set is read before the model loads: an unknown name, a missing package or prompt
    # file, or a bad line is said at once (seconds), not after the load (tens of seconds).
    for name in named:
        load_dataset(name)
    for path in args.prompts:
        load_prompt_file(path)
    if args.simulate_tau:
        return simulate_tau(args, config)
    check_methods(config.methods)  # unknown names, llama.cpp not built: say so before loading anything
    specs = challenger_specs(args.compare_drafter, args.drafter_weights)
    pipeline = load_pipeline(args)
    challengers = {label: Pipeline(pipeline.target, *resolve_drafter(pipeline.target, folder, args.target, None, weights),
                                   async_config=pipeline.async_config)
                   for label, (folder, weights) in specs.items()}
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


def doctor_command(args: argparse.Namespace) -> int:
    from d3d.doctor import as_json, doctor, format_report

    dtypes = [DTYPES[name] for name in args.dtypes.split(",")] if args.dtypes else [torch.bfloat16, torch.float32]
    machine, results = doctor(args.target, dtypes, None if args.drafter == "none" else args.drafter, args.recalibrate)
    print(json.dumps(as_json(machine, results)) if args.json else format_report(machine, results))
    return 0 if all(p.invariant for paths in results.values() for p in paths if p.used) else 1


def challenger_specs(values: list[str], default_weights: str) -> dict[str, tuple[str, str]]:
    """label → (drafter folder, weights) from --compare-drafter values: LABEL=PATH[@WEIGHTS], the flag
    repeated or several joined by commas; a malformed or repeated label is a usage error."""
    specs: dict[str, tuple[str, str]] = {}
    for spec in (part for value in values for part in re.split(r",(?=\w+=)", value)):
        label, _, folder = spec.partition("=")
        path, at, weights = folder.rpartition("@")
        folder, weights = (path, weights) if at and weights in DRAFTER_WEIGHTS else (folder, default_weights)
        if not label or not folder or not label.isidentifier() or label in specs:
            raise ConfigError(f"--compare-drafter takes a unique LABEL=PATH[@WEIGHTS] (LABEL a plain word), got {spec!r}")
        specs[label] = (folder, weights)
    return specs


def add_commands(commands: argparse._SubParsersAction) -> None:
    """bench, doctor"""
    p = commands.add_parser("bench", help="benchmark methods on the same prompts, interleaved, identity-checked")
    p.add_argument("--datasets", default=None,
                   help=f"comma-separated: humaneval, mtbench, math500, aime24, aime25, long (16 inputs of "
                        f"~1-7K tokens, reported by size; or one size: long1k, long2k, long4k, long7k) "
                        f"(default: {DEFAULT_BENCH_DATASETS}; none when --prompts is given)")
    p.add_argument("--prompts", action="append", default=[], help="a user JSONL prompt file (repeatable)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"per dataset (default: {DEFAULT_BENCH_PROMPTS}; all when only --prompts files are given)")
    p.add_argument("--methods", default="ar,hf,hf_lookup,lookup,drafter,speculative",
                   help="comma-separated; also async, async_reanchor, and llama.cpp's llamacpp, llamacpp_lookup "
                        "(on the embedded target in BF16) and llamacpp_gguf (on the GGUF file d3d loads the target "
                        "from) (opt-in: build them with scripts/llamacpp.sh)")
    p.add_argument("--quick", action="store_true", help="2 prompts per dataset (of HumanEval and MT-Bench by default), 48 tokens")
    p.add_argument("--out", default="runs/bench", help="folder for the JSON result")
    p.add_argument("--report", default="", help="write a Markdown report (+ PNG plots beside it) here")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-drafter", action="append", default=[], metavar="LABEL=PATH[@WEIGHTS]",
                   help="also run each drafting method with this drafter, as METHOD@LABEL, interleaved (repeatable, "
                        "or several joined by commas); "
                        "@WEIGHTS: how its weights are read, a --drafter-weights choice (default: --drafter-weights)")
    p.add_argument("--simulate-tau", default="", metavar="TAUS",
                   help="instead of --methods: sync and async speedup at these τ values (e.g. 1.5,2,3,4,6,8) with "
                        "the simulated drafter (d3d.simulate), charged the drafter's own cost; greedy only")
    add_model_arguments(p)
    p.set_defaults(handler=bench)
    p = commands.add_parser("doctor", help="this machine: kernels, the row-invariance self-check, what exactness costs")
    p.add_argument("--target", default="default", help="as in `d3d generate`")
    p.add_argument("--dtypes", default=None, help="comma-separated, e.g. bfloat16 (default: bfloat16,float32)")
    p.add_argument("--drafter", default="default", help="the drafter whose costs the gate weighs, as in `d3d generate`")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure the gate's verification and drafting costs again (e.g. after a busy moment)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.set_defaults(handler=doctor_command)
