"""A multi-turn chat about a long document through `d3d serve`, with its prefix cache and without:
time to first token per turn, and whether the answers are the same.

Each conversation starts with a long input of `d3d bench --datasets long` (a FastChat source file or
document, then a request about it); each later turn adds a follow-up question and is sent, as
every chat client sends it, as the whole conversation so far. With the prefix cache (`d3d serve
--prefix-cache`, on by default), a turn finds the previous turn's prompt and answer cached and
computes only the new message; without it (`--prefix-cache 0`), the whole conversation again. The
two servers run one after the other, alternated `--rounds` times; greedy, the server's default method.

    python scripts/chat_turns.py --dataset long4k --turns 3 --max-tokens 128 --report docs/server.md

The last stdout line is one JSON document. With --report, the Markdown between
<!-- chat-turns:start --> and <!-- chat-turns:end --> is replaced (appended when absent).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from d3d.prompts import load_dataset
from server_bench import cpu_name, free_port, start_server, write_report

START, END = "<!-- chat-turns:start -->", "<!-- chat-turns:end -->"
FOLLOW_UPS = ("Which part of it would you test first, and why?",
              "Summarise your previous answers in two sentences.",
              "What would you rename, if anything?")


def turn(client: httpx.Client, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat request: its time to first token, usage and text."""
    body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    started, first, text, usage = time.perf_counter(), None, "", {}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter() - started
                    text += piece
            usage = event.get("usage") or usage
    return {"ttft": first, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "text": text}


def conversations(url: str, prompts: list, turns: int, max_tokens: int) -> list[list[dict]]:
    """Every conversation, turn by turn: a list of `turn` results per conversation."""
    results = []
    with httpx.Client(base_url=url, timeout=None) as client:
        for prompt in prompts:
            messages, done = list(prompt.messages or [{"role": "user", "content": prompt.text}]), []
            for n in range(turns):
                if n:
                    messages += [{"role": "assistant", "content": done[-1]["text"]},
                                 {"role": "user", "content": FOLLOW_UPS[(n - 1) % len(FOLLOW_UPS)]}]
                done.append(turn(client, messages, max_tokens))
            results.append(done)
    return results


def serve_and_talk(args: argparse.Namespace, prefix_cache: int, prompts: list) -> list[list[dict]]:
    port = free_port()
    server = start_server(argparse.Namespace(**{**vars(args), "prefix_cache": prefix_cache}), port)
    try:
        return conversations(f"http://127.0.0.1:{port}", prompts, args.turns, args.max_tokens)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def markdown(result: dict) -> str:
    rows = ["| turn | prompt tokens (mean) | TTFT without the cache (s) | TTFT with it (s) | prompt tokens cached | "
            "same answers |", "|---|---|---|---|---|---|"]
    for row in result["turns"]:
        rows.append(f"| {row['turn']} | {row['prompt_tokens']:.0f} | {row['ttft_without']:.2f} | {row['ttft_with']:.2f} "
                    f"| {row['cached_share']:.1%} | {row['same']} |")
    return "\n".join([START, "", f"Measured {result['date']} on {result['cpu']}: {result['conversations']} "
                      f"conversations of {result['dataset']}, {result['turns_per_conversation']} turns, up to "
                      f"{result['max_tokens']} new tokens a turn, greedy, the server's default method; TTFT "
                      f"medians over the conversations" + (f" and {result['rounds']} alternated rounds." if result["rounds"] > 1
                                                  else " (one round: each server once)."), "",
                      f"`{result['command']}`", "", *rows, END])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="long4k", help="long1k, long2k, long4k or long7k (d3d.prompts)")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="times the two servers are alternated")
    parser.add_argument("--prefix-cache", type=int, default=512, metavar="MB", help="the cached server's --prefix-cache")
    parser.add_argument("--target", default="default")
    parser.add_argument("--drafter", default="default")
    parser.add_argument("--max-batch", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--report", default="", help="Markdown file to write the table into")
    args = parser.parse_args()
    if args.prefix_cache < 1:
        parser.error("--prefix-cache must be at least 1 (MiB): the comparison needs a cache")
    prompts = load_dataset(args.dataset)[:args.conversations]
    runs = {"without": [], "with": []}
    for _ in range(args.rounds):
        runs["without"].append(serve_and_talk(args, 0, prompts))
        runs["with"].append(serve_and_talk(args, args.prefix_cache, prompts))
    turns = []
    for n in range(args.turns):
        picked = {kind: [conversation[n] for run in found for conversation in run] for kind, found in runs.items()}
        same = sum(a["text"] == b["text"] for a, b in zip(picked["without"], picked["with"]))
        turns.append({"turn": n + 1, "prompt_tokens": statistics.mean(t["prompt_tokens"] for t in picked["with"]),
                      "ttft_without": statistics.median(t["ttft"] for t in picked["without"]),
                      "ttft_with": statistics.median(t["ttft"] for t in picked["with"]),
                      "cached_share": sum(t["cached_tokens"] for t in picked["with"])
                      / sum(t["prompt_tokens"] for t in picked["with"]),
                      "same": f"{same}/{len(picked['with'])}"})
        print(f"# {json.dumps(turns[-1])}", file=sys.stderr)
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "dataset": args.dataset,
              "conversations": len(prompts), "turns_per_conversation": args.turns, "max_tokens": args.max_tokens,
              "rounds": args.rounds, "command": "python " + shlex.join(sys.argv), "turns": turns}
    if args.report:
        write_report(Path(args.report), markdown(result), START, END)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
