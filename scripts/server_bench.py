"""`d3d serve` under load: requests/s and p50 / p95 time to first token and end-to-end latency at
several concurrency levels, speculative decoding against plain AR decoding, on one server.

The server decodes up to --max-batch generations together (its continuous batch, `d3d.batch`);
every request's text is compared with the same request's at concurrency 1: batching must change
no output (the "same as c=1" column).

Starts `d3d serve` (the embedded default model unless --target/--drafter say otherwise) on a free
loopback port, then for each concurrency level sends the same prompts (HumanEval completions and
MT-Bench first turns, seeded sample) as streamed requests, once with `d3d.method` = speculative and
once = ar, the order alternating between levels; one warm-up request per method is not counted.
Time to first token = until the first event carrying text; end to end = until `[DONE]`; both
measured by the client. Greedy (T = 0) outputs of the two methods are compared prompt by prompt.
Afterwards it loads the live view in headless Chromium, runs one prompt and saves a screenshot.

    python scripts/server_bench.py --requests 16 --max-tokens 128 --concurrency 1,4,16 \
        --report docs/server.md --screenshot docs/server-view.png

The last stdout line is one JSON document. With --report, the Markdown between the markers
<!-- server-bench:start --> and <!-- server-bench:end --> is replaced (the whole file is written
when it has none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from d3d.batch import MAX_BATCH
from d3d.devtools import Chromium, find_chromium
from d3d.prompts import Prompt, load_dataset, sample_prompts

START, END = "<!-- server-bench:start -->", "<!-- server-bench:end -->"
METHODS = ("speculative", "ar")


@dataclass
class Outcome:
    prompt: str  # the prompt's id
    method: str
    first_token: float  # seconds until the first text arrived
    latency: float  # seconds until the stream ended
    tokens: int
    tau: float
    text: str


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentile(values: list[float], share: float) -> float:
    """Nearest-rank percentile (the smallest value with at least `share` of the values at or below it)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def request_body(prompt: Prompt, method: str, max_tokens: int) -> tuple[str, dict]:
    body = {"stream": True, "temperature": 0, "max_tokens": max_tokens,
            "stream_options": {"include_usage": True}, "d3d": {"method": method}}
    if prompt.text is not None:
        return "/v1/completions", {**body, "prompt": prompt.text}
    return "/v1/chat/completions", {**body, "messages": prompt.messages}


async def one_request(client: httpx.AsyncClient, prompt: Prompt, method: str, max_tokens: int) -> Outcome:
    path, body = request_body(prompt, method, max_tokens)
    started = time.perf_counter()
    first, text, tokens, tau = None, "", 0, 1.0
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{path} answered {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter() - started
                    text += piece
            if event.get("d3d"):
                tau = event["d3d"]["tau"]
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return Outcome(prompt.id, method, first if first is not None else math.nan, time.perf_counter() - started,
                   tokens, tau, text)


async def level(url: str, prompts: list[Prompt], method: str, concurrency: int,
                max_tokens: int) -> tuple[list[Outcome], float]:
    """Every prompt once, at most `concurrency` in flight; (outcomes, wall seconds)."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        async def limited(prompt: Prompt) -> Outcome:
            async with gate:
                return await one_request(client, prompt, method, max_tokens)

        started = time.perf_counter()
        outcomes = await asyncio.gather(*(limited(p) for p in prompts))
        return list(outcomes), time.perf_counter() - started


def summary(outcomes: list[Outcome], wall: float, concurrency: int, method: str) -> dict:
    first = [o.first_token for o in outcomes]
    latency = [o.latency for o in outcomes]
    return {"concurrency": concurrency, "method": method, "requests": len(outcomes),
            "requests_per_second": round(len(outcomes) / wall, 3),
            "tokens_per_second": round(sum(o.tokens for o in outcomes) / wall, 1),
            "ttft_p50": round(percentile(first, 0.5), 3), "ttft_p95": round(percentile(first, 0.95), 3),
            "latency_p50": round(percentile(latency, 0.5), 3), "latency_p95": round(percentile(latency, 0.95), 3),
            "mean_tau": round(sum(o.tau for o in outcomes) / len(outcomes), 2),
            "wall_seconds": round(wall, 2)}


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "d3d.cli", "serve", "--port", str(port), "--max-queue", "256",
               "--target", args.target, "--drafter", args.drafter]
    if args.max_batch:
        command += ["--max-batch", str(args.max_batch)]
    command += ["--prefix-cache", str(args.prefix_cache)]
    server = subprocess.Popen(command, stderr=sys.stderr)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        deadline = time.monotonic() + args.startup_timeout
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"d3d serve exited with {server.returncode}")
            try:
                if client.get("/health").status_code == 200:
                    return server
            except httpx.TransportError:
                pass
            time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"d3d serve did not answer within {args.startup_timeout} s")


def screenshot(url: str, path: Path, prompt: str, max_tokens: int) -> str:
    """The live view after one generation and its plain-decoding comparison; returns the page's
    comparison line ("plain decoding: … tokens/s; speculative was …× as fast …").

    The page runs the prompt and its comparison once before the one in the picture: Chromium starts
    on the same cores as the server, and while it is still starting and laying out its first page it
    slows whichever generation runs then (the first picture taken this way showed speculative
    decoding at 0.48x plain decoding, where curl measured it faster)."""
    executable = find_chromium()
    if executable is None:
        print("# no Chromium: no screenshot", file=sys.stderr)
        return ""
    with Chromium(executable, width=1280, height=860) as browser:
        browser.open(f"{url}/")
        for name, value in (("prompt", prompt), ("mode", "chat"), ("method", "speculative"),
                            ("temperature", "0"), ("max_tokens", str(max_tokens))):
            browser.evaluate(f"document.getElementById({json.dumps(name)}).value = {json.dumps(value)}")
        for _ in range(2):  # the first round settles the browser; the second is the picture
            browser.evaluate("document.getElementById('run').click()")
            browser.wait_for("document.getElementById('status').textContent.startsWith('done')", 300)
            browser.evaluate("document.getElementById('compare').click()")
            status = browser.wait_for("document.getElementById('status').textContent.startsWith('plain decoding:') "
                                      "&& document.getElementById('status').textContent", 300)
        browser.screenshot(path)
        return str(status)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return "unknown CPU"


def markdown(result: dict, screenshot_path: str | None, report: Path) -> str:
    rows = ["| concurrency | method | requests | requests/s | tokens/s | TTFT p50 (s) | TTFT p95 (s) "
            "| latency p50 (s) | latency p95 (s) | mean τ | same as c=1 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["levels"]:
        rows.append(f"| {r['concurrency']} | {r['method']} | {r['requests']} | {r['requests_per_second']} "
                    f"| {r['tokens_per_second']} | {r['ttft_p50']} | {r['ttft_p95']} | {r['latency_p50']} "
                    f"| {r['latency_p95']} | {r['mean_tau']} | {r.get('same_as_solo', '')} |")
    same = result["identical"]
    lines = [START, "", f"Measured {result['date']} on {result['cpu']} ({result['cores']} cores), "
             f"target {result['target']}, drafter {result['drafter']}, greedy, up to {result['max_tokens']} "
             f"new tokens, {result['prompts']} prompts (HumanEval and MT-Bench, seed {result['seed']}) per "
             f"method and level; the server's continuous batch holds up to {result['max_batch']} generations; "
             + (f"prefix cache {result['prefix_cache_mb']} MiB, every prompt sent once before the levels. "
                if result.get("prefix_cache_mb") else "no prefix cache: every prompt computed every time. ")
             + f"{result['note']}".rstrip(), "", f"`{result['command']}`", "", *rows, "",
             f"All methods' outputs identical for {same[0]} of {same[1]} requests (greedy: lossless); "
             "\"same as c=1\": the requests whose text equals the same request's at concurrency 1.", ""]
    if screenshot_path:
        relative = os.path.relpath(screenshot_path, report.parent)
        lines += [f"The live view, on the README's prime-number prompt (the second run in the page; the first "
                  f"settles the browser): \"{result.get('view', '')}\"", "",
                  f"![the live view after a speculative generation and its plain-decoding comparison]({relative})", ""]
    return "\n".join(lines + [END])


def write_report(report: Path, section: str, start: str = START, end: str = END) -> None:
    """Replace what lies between the markers `start` and `end` of `report` with `section` (which
    holds them); a report without them gets the section at its end."""
    text = report.read_text() if report.is_file() else "# d3d serve under load\n"
    if start in text and end in text:
        text = text[:text.index(start)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    report.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8, help="prompts per concurrency level and method")
    parser.add_argument("--concurrency", default="1,4,16", help="levels; the first is the reference for 'same as c=1'")
    parser.add_argument("--methods", default=",".join(METHODS), help="d3d.method of the requests, compared")
    parser.add_argument("--max-batch", type=int, default=0, help="the server's --max-batch (0: its default)")
    parser.add_argument("--prefix-cache", type=int, default=0, metavar="MB",
                        help="the server's --prefix-cache (default 0: every prompt computed at every level, the "
                             "engine's whole work); above 0 every prompt is sent once first, so every level and "
                             "method reuses all of it but its last token")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", default="default")
    parser.add_argument("--drafter", default="default")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--report", default="", help="Markdown file to write the results into")
    parser.add_argument("--screenshot", default="", help="PNG path for a screenshot of the live view")
    parser.add_argument("--note", default="", help="a sentence for the report (e.g. what else ran on the machine)")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    methods = args.methods.split(",")
    half = (args.requests + 1) // 2
    prompts = (sample_prompts(load_dataset("humaneval"), half, args.seed)
               + sample_prompts(load_dataset("mtbench"), args.requests - half, args.seed))
    prompts = [Prompt(p.id, p.dataset, p.text, p.messages) for p in prompts]  # first turns only
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(args, port)
    try:
        for method in methods:  # warm-up, not counted
            asyncio.run(level(url, prompts[:1], method, 1, 8))
        if args.prefix_cache:  # every prompt cached before any level: each level and method finds the same
            asyncio.run(level(url, prompts, methods[0], 4, 1))
        rows, texts, solo = [], {}, {}
        for i, concurrency in enumerate(levels):
            for method in methods if i % 2 == 0 else methods[::-1]:
                outcomes, wall = asyncio.run(level(url, prompts, method, concurrency, args.max_tokens))
                rows.append(summary(outcomes, wall, concurrency, method))
                for o in outcomes:
                    texts.setdefault((concurrency, o.prompt), {})[method] = o.text
                    solo.setdefault((method, o.prompt), o.text)  # the first level's
                rows[-1]["same_as_solo"] = f"{sum(solo[method, o.prompt] == o.text for o in outcomes)}/{len(outcomes)}"
                print(f"# {json.dumps(rows[-1])}", file=sys.stderr)
        identical = sum(len(set(pair.values())) == 1 for pair in texts.values())
        view = ""
        if args.screenshot:
            view = screenshot(url, Path(args.screenshot),
                              "Write a Python function that checks whether a number is prime.", args.max_tokens)
            print(f"# live view: {view}", file=sys.stderr)
    finally:
        server.send_signal(signal.SIGINT)  # graceful shutdown
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cores": os.cpu_count(),
              "target": args.target, "drafter": args.drafter, "max_tokens": args.max_tokens,
              "max_batch": args.max_batch or MAX_BATCH, "prefix_cache_mb": args.prefix_cache,
              "prompts": len(prompts), "seed": args.seed, "note": args.note,
              "command": "python " + shlex.join(sys.argv),
              "identical": [identical, len(texts)], "levels": rows, "view": view}
    if args.report:
        write_report(Path(args.report), markdown(result, args.screenshot or None, Path(args.report)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
