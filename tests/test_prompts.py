"""Benchmark prompt sets from the installed packages, user JSONL prompt files, seeded sampling and
the fingerprints that keep benchmark prompts out of training data."""

from __future__ import annotations

import json
import random
import re

import pytest

from d3d.prompts import (DATASETS, LONG_REQUESTS, LONG_SIZES, DatasetError, Prompt, benchmark_fingerprints,
                         load_dataset, load_prompt_file, sample_prompts, text_fingerprint)


def write_jsonl(path, rows) -> str:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows),
                    encoding="utf-8")
    return str(path)


# -- shipped benchmark sets ---------------------------------------------------------------------

@pytest.mark.parametrize("name, count", [("humaneval", 164), ("mtbench", 80), ("math500", 311),
                                         ("aime24", 30), ("aime25", 15)])
def test_benchmark_sizes_and_unique_ids(name, count):
    """Each named set has its documented size, unique ids, its own dataset name and non-empty text."""
    prompts = load_dataset(name)
    assert len(prompts) == count
    assert len({p.id for p in prompts}) == count
    assert all(p.dataset == name for p in prompts)
    assert all(t.strip() for p in prompts for t in p.all_texts())
    assert set(DATASETS) == {"humaneval", "mtbench", "math500", "aime24", "aime25", "long"}


def test_long_inputs_are_package_files_cut_to_their_size_then_a_request():
    """`long`: 4 prompts at each of ~1K, 2K, 4K and 7K tokens, each a FastChat file (from the MT-Bench
    package) cut at a line end within its size's character budget and followed by a request; the
    sizes load alone too, and training data is screened against them."""
    prompts = load_dataset("long")
    assert [p.dataset for p in prompts] == [size for size in LONG_SIZES for _ in range(4)]
    assert len({p.id for p in prompts}) == 16
    for prompt in prompts:
        content = prompt.messages[0]["content"]
        budget = LONG_SIZES[prompt.dataset]
        assert 0.6 * budget < len(content) < budget + 200  # the file cut near its budget, plus the request
        assert content.rstrip().endswith(tuple(LONG_REQUESTS.values()))
        assert "```" in content and prompt.messages[0]["role"] == "user"
    assert [p.id for p in load_dataset("long4k")] == [p.id for p in prompts if p.dataset == "long4k"]
    assert prompts[-1].fingerprint in benchmark_fingerprints()


def test_humaneval_prompts_are_raw_completions():
    """HumanEval items are raw code prompts (no chat messages), ids HumanEval/0 …"""
    prompts = load_dataset("humaneval")
    assert all(p.text is not None and p.messages is None and p.followups == [] for p in prompts)
    assert prompts[0].id == "HumanEval/0" and "def " in prompts[0].text


def test_mtbench_has_two_turns_first_in_messages_second_in_followups():
    """Every MT-Bench item: turn 1 is the single user message, turn 2 the single follow-up."""
    prompts = load_dataset("mtbench")
    for prompt in prompts:
        assert prompt.text is None
        assert len(prompt.messages) == 1 and prompt.messages[0]["role"] == "user"
        assert len(prompt.followups) == 1
        assert prompt.all_texts() == [prompt.messages[0]["content"], prompt.followups[0]]
        assert prompt.id.startswith("mtbench/")


@pytest.mark.parametrize("name", ["math500", "aime24", "aime25"])
def test_math_sets_are_single_user_messages(name):
    """MATH-500 / AIME items are one user message each, ids prefixed with the set name."""
    for prompt in load_dataset(name):
        assert prompt.text is None and len(prompt.messages) == 1 and prompt.messages[0]["role"] == "user"
        assert prompt.id.startswith(f"{name}/")


def test_unknown_dataset_name():
    """A name that is neither a set nor a file: DatasetError listing the known sets."""
    with pytest.raises(DatasetError, match="humaneval"):
        load_dataset("no-such-set")


@pytest.mark.parametrize("name", ["missing.jsonl", "prompts/missing"])
def test_a_missing_prompt_file_is_named_by_its_path(tmp_path, monkeypatch, name):
    """A name that is meant as a file (a .jsonl suffix, a folder in it) but is not there: the
    error gives the path it looked at, not "unknown dataset"."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetError, match=re.escape(f"no prompt file at {tmp_path / name}")):
        load_dataset(name)
    with pytest.raises(DatasetError, match=re.escape(f"no prompt file at {tmp_path / name}")):
        load_prompt_file(name)


# -- user JSONL files --------------------------------------------------------------------------

def test_prompt_file_with_both_shapes(tmp_path):
    """{"prompt"} rows become raw prompts, {"messages"} rows chats; ids default to <file>/<line>."""
    path = write_jsonl(tmp_path / "mine.jsonl", [
        {"id": "a", "prompt": "Complete: def f("},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]},
        "",  # blank lines are skipped
        {"id": 7, "prompt": "x"},
    ])
    prompts = load_prompt_file(path)
    assert [p.id for p in prompts] == ["a", "mine/2", "7"]
    assert all(p.dataset == "mine" for p in prompts)
    assert prompts[0].text == "Complete: def f(" and prompts[0].messages is None
    assert prompts[1].text is None and prompts[1].messages[1] == {"role": "user", "content": "Hi?"}
    assert prompts[1].all_texts() == ["Hi?"]  # user turns only
    # load_dataset takes a path too.
    assert [p.id for p in load_dataset(path)] == ["a", "mine/2", "7"]


def test_malformed_json_line_names_file_and_line(tmp_path):
    """Broken JSON on line 3: DatasetError with '<path>:3'."""
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"prompt": "b"}, '{"prompt": "c"'])
    with pytest.raises(DatasetError, match=re.escape(f"{path}:3: not valid JSON")):
        load_prompt_file(path)


def test_non_object_line_names_file_and_line(tmp_path):
    """A JSON line that is not an object (a list): DatasetError with '<path>:2'."""
    path = write_jsonl(tmp_path / "list.jsonl", [{"prompt": "a"}, ["not", "an", "object"]])
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: expected a JSON object")):
        load_prompt_file(path)


@pytest.mark.parametrize("row", [{"id": "x"}, {"prompt": "   "}, {"prompt": 3}, {"messages": []},
                                 {"messages": "hi"}])
def test_missing_prompt_and_messages_names_the_line(tmp_path, row):
    """A row without a usable prompt or messages: DatasetError naming '<path>:2'."""
    path = write_jsonl(tmp_path / "missing.jsonl", [{"prompt": "ok"}, row])
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: needs a non-empty")):
        load_prompt_file(path)


@pytest.mark.parametrize("message", [{"role": "robot", "content": "x"}, {"role": "user"},
                                     {"role": "user", "content": 5}, "hello"])
def test_bad_message_names_the_line(tmp_path, message):
    """A message with an unknown role or non-string content: DatasetError naming '<path>:1'."""
    path = write_jsonl(tmp_path / "msg.jsonl", [{"messages": [message]}])
    with pytest.raises(DatasetError, match=re.escape(f"{path}:1: each message needs a role")):
        load_prompt_file(path)


def test_duplicate_ids_are_refused(tmp_path):
    """Two rows with the same id: DatasetError naming the second line and the id."""
    path = write_jsonl(tmp_path / "dup.jsonl", [{"id": "q1", "prompt": "a"}, {"id": "q2", "prompt": "b"},
                                                {"id": "q1", "prompt": "c"}])
    with pytest.raises(DatasetError, match=re.escape(f"{path}:3: duplicate id 'q1'")):
        load_prompt_file(path)


def test_line_numbers_count_blank_lines(tmp_path):
    """Blank lines still count: the error names the line as an editor shows it."""
    path = write_jsonl(tmp_path / "gaps.jsonl", [{"prompt": "a"}, "", "", {"id": "z"}])
    with pytest.raises(DatasetError, match=re.escape(f"{path}:4:")):
        load_prompt_file(path)


def test_empty_file_is_refused(tmp_path):
    """A file with no prompts at all: DatasetError naming the file."""
    path = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DatasetError, match="no prompts"):
        load_prompt_file(path)


# -- sampling and fingerprints -----------------------------------------------------------------

def test_sample_prompts_is_seeded_and_stable():
    """The same seed gives the same sample (and order); another seed another; all when count is None or large."""
    prompts = load_dataset("humaneval")
    first = [p.id for p in sample_prompts(prompts, 10, seed=0)]
    assert first == [p.id for p in sample_prompts(prompts, 10, seed=0)]
    assert len(set(first)) == 10 and set(first) <= {p.id for p in prompts}
    assert first != [p.id for p in sample_prompts(prompts, 10, seed=1)]
    assert [p.id for p in sample_prompts(prompts, None)] == [p.id for p in prompts]
    assert [p.id for p in sample_prompts(prompts, 1000, seed=3)] == [p.id for p in prompts]
    assert sample_prompts(prompts, 0) == []
    # Pinned to random.Random(seed).sample: changing the sampler would silently change every benchmark.
    ten = [Prompt(str(i), "t", text="x") for i in range(10)]
    assert [p.id for p in sample_prompts(ten, 3, seed=5)] == [str(i) for i in random.Random(5).sample(range(10), 3)]


def test_text_fingerprint_normalises_whitespace_and_case():
    """Fingerprints ignore whitespace layout and letter case, nothing else."""
    assert text_fingerprint("Def  f(x):\n\treturn x") == text_fingerprint("def f(x): return x ")
    assert text_fingerprint("def f(x): return x") != text_fingerprint("def f(y): return y")
    assert len(text_fingerprint("a")) == 20


def test_benchmark_fingerprints_cover_every_benchmark_text():
    """The exclusion set holds HumanEval prompts, both MT-Bench turns and the math questions."""
    fingerprints = benchmark_fingerprints()
    humaneval = load_dataset("humaneval")[0]
    mtbench = load_dataset("mtbench")[0]
    assert humaneval.fingerprint in fingerprints
    assert text_fingerprint(humaneval.text.strip()) in fingerprints  # whitespace changes do not matter
    assert text_fingerprint(mtbench.messages[0]["content"]) in fingerprints
    assert text_fingerprint(mtbench.followups[0]) in fingerprints
    assert load_dataset("aime25")[0].fingerprint in fingerprints
    assert text_fingerprint("Write a haiku about compilers.") not in fingerprints
    assert len(fingerprints) >= 164 + 80 + 311 + 30 + 15 + 16  # MT-Bench adds its second turns on top
