"""`d3d data`: prompt collection (dedup, benchmark exclusion), batched greedy generation identical to
the AR reference, resumable atomic shards, and the ShareGPT / stdlib prompt sources."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch

import d3d.train.data as data
from conftest import make_decoder, tiny_config
from d3d.config import ConfigError, GenerationConfig, SamplingConfig
from d3d.engine import reference_generate
from d3d.loading import Target
from d3d.prompts import DatasetError, load_dataset, text_fingerprint
from d3d.train.data import (DataConfig, collect_prompts, generate_batch, generate_data, math_prompts,
                            sharegpt_prompts, sharegpt_second_turns, stdlib_prompts)
from d3d.train.shards import read_shards

BOS, EOS, USER = 0, 1, 2


class CharTokenizer:
    """Each character → one of 60 ids (4 + ord % 60); a toy chat template around the user turns."""

    chat_template = "<bos>{% for m in messages %}<user>{{ m.content }}{% endfor %}"
    eos_token_id = EOS

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        # No generation marker at the end: the tiny random target's response depends mostly on the
        # last few ids, and this way they differ between prompts.
        ids = [BOS]
        for message in messages:
            ids += [USER] + [4 + ord(c) % 60 for c in message["content"]]
        return ids

    def get_vocab(self) -> dict[str, int]:
        return {f"<{i}>": i for i in range(64)}


USER_PROMPTS = [f"Question {i}: tell me about topic {'abc'[i % 3]}" + " please" * (i % 4) + " " + "xyzwvu"[i % 6] * (1 + i % 2)
                for i in range(12)]  # 12 distinct texts of different lengths
HUMANEVAL_PROMPT = load_dataset("humaneval")[3].text
MTBENCH_TURN = load_dataset("mtbench")[5].messages[0]["content"]


@pytest.fixture(scope="module")
def decoder():
    return make_decoder(tiny_config("llama", tie_word_embeddings=False), seed=1)


@pytest.fixture(scope="module")
def source_file(tmp_path_factory) -> str:
    """12 user prompts of different lengths, a near-duplicate, and two benchmark prompts to be excluded."""
    path = tmp_path_factory.mktemp("sources") / "user.jsonl"
    rows = [{"id": f"user/{i}", "prompt": text} for i, text in enumerate(USER_PROMPTS)]
    rows.insert(5, {"id": "user/dup", "prompt": "  " + USER_PROMPTS[2].upper() + "\n"})  # same fingerprint
    rows.insert(3, {"id": "user/humaneval", "prompt": HUMANEVAL_PROMPT})
    rows.insert(8, {"id": "user/mtbench", "messages": [{"role": "user", "content": MTBENCH_TURN}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def eos_token(decoder, source_file) -> int:
    """A token that ends some greedy responses early but not all (so batches hold both kinds of row)."""
    config = DataConfig(sources=[source_file], max_new_tokens=6)
    prompts = collect_prompts(config, CharTokenizer())
    responses = [greedy(decoder, p["prompt_ids"], 6, []) for p in prompts]
    counts = {t: sum(t in r[:5] for r in responses) for t in {t for r in responses for t in r[:5]}}
    token = max(counts, key=lambda t: (0 < counts[t] < len(responses), -abs(counts[t] - len(responses) / 2)))
    assert 0 < counts[token] < len(responses)
    return token


@pytest.fixture
def target(decoder, eos_token) -> Target:
    return Target(decoder, CharTokenizer(), "tiny-random", [eos_token])


@pytest.fixture
def config(source_file) -> DataConfig:
    return DataConfig(sources=[source_file], shard_size=4, batch_size=2, max_new_tokens=6)


def greedy(decoder, prompt_ids: list[int], max_new_tokens: int, eos: list[int]) -> list[int]:
    """The AR reference's greedy response (EOS included when it stops there)."""
    steps = reference_generate(decoder, prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos))
    return [t for s in steps for t in s.tokens]


def shard_files(out: Path) -> list[Path]:
    return sorted((out / "shards").glob("shard-*.jsonl"))


# -- configuration and prompt collection -------------------------------------------------------

@pytest.mark.parametrize("kwargs", [dict(sources=[]), dict(shard_size=0), dict(batch_size=0),
                                    dict(max_new_tokens=0), dict(max_prompt_tokens=0), dict(max_prompts=-1),
                                    dict(skip_prompts=-1)])
def test_data_config_validation(kwargs):
    """No sources, or a size below 1: ConfigError."""
    with pytest.raises(ConfigError):
        DataConfig(**kwargs)


def test_collect_prompts_dedups_and_excludes_benchmarks(source_file):
    """User prompts are kept once each; the near-duplicate and both benchmark prompts are dropped."""
    prompts = collect_prompts(DataConfig(sources=[source_file]), CharTokenizer())
    assert sorted(p["id"] for p in prompts) == sorted(f"user/{i}" for i in range(12))
    texts = [p["messages"][0]["content"] for p in prompts]
    assert HUMANEVAL_PROMPT not in texts and MTBENCH_TURN not in texts
    for prompt in prompts:
        assert prompt["messages"] == [{"role": "user", "content": USER_PROMPTS[int(prompt["id"].split("/")[1])]}]
        assert prompt["prompt_ids"] == CharTokenizer().apply_chat_template(prompt["messages"])


def test_collect_prompts_seed_limits_and_lengths(source_file):
    """The seed fixes the order; max_prompts caps the count; skip_prompts leaves out the first ones; prompts
    over max_prompt_tokens are skipped."""
    tokenizer = CharTokenizer()
    base = collect_prompts(DataConfig(sources=[source_file], seed=0), tokenizer)
    assert [p["id"] for p in collect_prompts(DataConfig(sources=[source_file], seed=0), tokenizer)] == \
        [p["id"] for p in base]
    other = collect_prompts(DataConfig(sources=[source_file], seed=1), tokenizer)
    assert [p["id"] for p in other] != [p["id"] for p in base] and {p["id"] for p in other} == {p["id"] for p in base}
    assert [p["id"] for p in collect_prompts(DataConfig(sources=[source_file], max_prompts=5), tokenizer)] == \
        [p["id"] for p in base[:5]]
    # skip_prompts continues the list where a folder with max_prompts left it, the length cap applied first
    rest = collect_prompts(DataConfig(sources=[source_file], skip_prompts=5, max_prompts=4), tokenizer)
    assert [p["id"] for p in rest] == [p["id"] for p in base[5:9]]
    assert collect_prompts(DataConfig(sources=[source_file], skip_prompts=len(base)), tokenizer) == []
    limit = sorted(len(p["prompt_ids"]) for p in base)[6]
    short = collect_prompts(DataConfig(sources=[source_file], max_prompt_tokens=limit), tokenizer)
    tail = collect_prompts(DataConfig(sources=[source_file], max_prompt_tokens=limit, skip_prompts=2), tokenizer)
    assert [p["id"] for p in tail] == [p["id"] for p in short[2:]]
    assert short and all(len(p["prompt_ids"]) <= limit for p in short)
    assert len(short) == sum(len(p["prompt_ids"]) <= limit for p in base)


def test_unknown_source_is_a_dataset_error():
    """A source that is neither sharegpt, stdlib nor a file: DatasetError naming it."""
    with pytest.raises(DatasetError, match="no-such-source"):
        collect_prompts(DataConfig(sources=["no-such-source"]), CharTokenizer())


# -- batched greedy generation -----------------------------------------------------------------

def test_generate_batch_matches_reference_with_left_padding(decoder):
    """Prompts of lengths 2 … 30 in one left-padded batch: each row is the AR reference's greedy output."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 64, (n,), generator=generator).tolist() for n in (7, 2, 30, 13, 5)]
    responses = [g.response_ids for g in generate_batch(decoder, prompts, 10, [])]
    assert responses == [greedy(decoder, p, 10, []) for p in prompts]
    assert all(len(r) == 10 for r in responses)


def test_generate_batch_stops_rows_at_eos(decoder):
    """Rows stop at their first EOS (any of several ids; EOS included) mid-generation while others run on."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 64, (n,), generator=generator).tolist() for n in (3, 9, 4, 15, 6, 11, 8, 2)]
    free = [greedy(decoder, p, 8, []) for p in prompts]
    eos = [free[0][3], free[4][4]]  # two EOS ids, first produced mid-way through rows 0 and 4
    expected = [greedy(decoder, p, 8, eos) for p in prompts]
    assert [g.response_ids for g in generate_batch(decoder, prompts, 8, eos)] == expected
    assert 2 <= len(expected[0]) <= 4 and expected[0][-1] in eos
    assert any(len(r) == 8 and not set(r) & set(eos) for r in expected)  # some rows never stop early


@pytest.mark.parametrize("width", [1, 3, 16])
def test_continuous_generation_equals_the_static_batch_and_the_reference(decoder, width):
    """`d3d data`'s continuous batch (a finished row replaced by the next prompt at once): every
    response and every recorded top-k distribution equal the static batch's and plain decoding's,
    whatever the width."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 64, (n,), generator=generator).tolist() for n in (3, 9, 4, 15, 6, 11, 8, 2)]
    free = [greedy(decoder, p, 8, []) for p in prompts]
    eos = [free[0][3], free[4][4]]
    static = generate_batch(decoder, prompts, 8, eos, top_k=5)
    continuous = data.generate_continuous(decoder, prompts, 8, eos, top_k=5, width=width)
    assert [g.response_ids for g in continuous] == [g.response_ids for g in static] == \
        [greedy(decoder, p, 8, eos) for p in prompts]
    for a, b in zip(continuous, static):
        assert torch.equal(a.distributions.ids, b.distributions.ids)
        assert torch.allclose(a.distributions.logprobs, b.distributions.logprobs, atol=1e-5)
        assert a.distributions.ids.shape[0] == len(a.response_ids)


def test_generate_batch_mixed_eos_and_length_rows(decoder, eos_token, source_file):
    """On the data prompts, one batch holds rows ending at EOS and rows reaching the length cap."""
    prompts = [p["prompt_ids"] for p in collect_prompts(DataConfig(sources=[source_file]), CharTokenizer())]
    responses = [g.response_ids for g in generate_batch(decoder, prompts, 6, [eos_token])]
    assert responses == [greedy(decoder, p, 6, [eos_token]) for p in prompts]
    assert any(r[-1] == eos_token and len(r) < 6 for r in responses)
    assert any(len(r) == 6 for r in responses)
    assert all(eos_token not in r[:-1] for r in responses)  # nothing after the first EOS


def test_generate_batch_single_row_and_no_eos_list(decoder):
    """A batch of one and an empty EOS list (never stops early) also match the reference."""
    assert generate_batch(decoder, [[5, 6, 7]], 5, [])[0].response_ids == greedy(decoder, [5, 6, 7], 5, [])


def test_generate_batch_builds_tensors_on_the_decoder_device(decoder):
    """Every tensor generate_batch builds is on the decoder's device, so it runs on a GPU.

    Checked without a GPU on the 'meta' device: the run may only fail where it copies values back
    to Python (NotImplementedError), never on a tensor left on the CPU (RuntimeError).
    """
    meta_decoder = copy.deepcopy(decoder).to("meta")
    with pytest.raises(NotImplementedError, match="meta"):
        generate_batch(meta_decoder, [[5, 6, 7], [8, 9]], 3, [])


# -- generate_data: shards, manifest, resume ---------------------------------------------------

def test_generate_data_writes_shards_and_manifest(target, config, tmp_path):
    """3 shards of ≤ 4 records, prompts.jsonl and a manifest; every response is the AR reference's."""
    out = tmp_path / "run"
    manifest = generate_data(target, out, config, progress=False)
    assert [p.name for p in shard_files(out)] == ["shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    assert not list(out.rglob(".*.tmp"))  # no staging files left behind
    prompts = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 12
    records = list(read_shards(out))
    assert sorted(r["id"] for r in records) == sorted(p["id"] for p in prompts)
    by_id = {p["id"]: p for p in prompts}
    for record in records:
        assert record["prompt_ids"] == by_id[record["id"]]["prompt_ids"]
        assert record["response_ids"] == greedy(target.decoder, record["prompt_ids"], 6, target.eos_token_ids)
    lengths = [len(r["response_ids"]) for r in records]
    assert min(lengths) < 6 and max(lengths) == 6  # some rows stopped at EOS, some at the length cap
    for index, path in enumerate(shard_files(out)):
        shard = [json.loads(line) for line in path.read_text().splitlines()]
        assert {r["id"] for r in shard} == {p["id"] for p in prompts[4 * index:4 * index + 4]}
        assert [len(r["prompt_ids"]) for r in shard] == sorted(len(r["prompt_ids"]) for r in shard)
    saved = json.loads((out / "manifest.json").read_text())
    assert saved == manifest
    assert manifest["num_prompts"] == 12 and manifest["num_shards"] == 3 and manifest["shards_done"] == 3
    assert manifest["response_tokens"] == sum(len(r["response_ids"]) for r in records)
    assert manifest["config"] == config.to_dict() and manifest["target"] == "tiny-random"
    assert manifest["tokenizer_fingerprint"] == target.fingerprint


def test_benchmark_prompts_never_reach_prompts_jsonl(target, config, tmp_path):
    """The HumanEval prompt and MT-Bench turn put in the user file are absent from prompts.jsonl and shards."""
    out = tmp_path / "run"
    generate_data(target, out, config, progress=False)
    text = (out / "prompts.jsonl").read_text()
    fingerprints = {text_fingerprint(json.loads(line)["messages"][0]["content"]) for line in text.splitlines()}
    assert text_fingerprint(HUMANEVAL_PROMPT) not in fingerprints
    assert text_fingerprint(MTBENCH_TURN) not in fingerprints
    assert "user/humaneval" not in text and "user/mtbench" not in text and "user/dup" not in text
    assert not {"user/humaneval", "user/mtbench"} & {r["id"] for r in read_shards(out)}


def spy_on_streams(monkeypatch) -> list[int]:
    """The prompt count of every continuous batch `d3d data` runs, as it runs them."""
    calls, real = [], data.stream_continuous

    def counted(decoder, prompts, *args, **kwargs):
        prompts = list(prompts)
        calls.append(len(prompts))
        return real(decoder, prompts, *args, **kwargs)

    monkeypatch.setattr(data, "stream_continuous", counted)
    return calls


def test_one_continuous_batch_runs_across_shards(target, config, tmp_path, monkeypatch):
    """Every shard's prompts go through one batch (a finished response's place goes to the next
    prompt, of the next shard too), and the shards hold what each prompt's greedy decoding gives."""
    calls = spy_on_streams(monkeypatch)
    steps = []
    real_step = data.Batch.step
    monkeypatch.setattr(data.Batch, "step", lambda self: steps.append(len(self)) or real_step(self))
    out = tmp_path / "run"
    generate_data(target, out, config, progress=False)
    assert calls == [12]
    assert max(steps) == config.batch_size and steps.count(config.batch_size) >= 12 // config.batch_size
    for record in read_shards(out):
        assert record["response_ids"] == greedy(target.decoder, record["prompt_ids"], 6, target.eos_token_ids)


def test_resume_regenerates_only_the_missing_shard(target, config, tmp_path, monkeypatch):
    """Deleting the last shard (a kill mid-shard) and rerunning rebuilds it identically, touching nothing else."""
    out = tmp_path / "run"
    first = generate_data(target, out, config, progress=False)
    files = shard_files(out)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in files}
    prompts_before = (out / "prompts.jsonl").stat().st_mtime_ns
    files[-1].unlink()
    calls = spy_on_streams(monkeypatch)
    second = generate_data(target, out, config, progress=False)
    assert calls == [4]  # one shard of 4 prompts: only the deleted shard ran
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in shard_files(out)}
    assert after.keys() == before.keys()
    for name in before:
        assert after[name][0] == before[name][0]  # identical contents
    for name in list(before)[:-1]:
        assert after[name][1] == before[name][1]  # untouched
    assert (out / "prompts.jsonl").stat().st_mtime_ns == prompts_before
    assert second == first


def test_interrupted_shard_leaves_no_partial_file(target, config, tmp_path, monkeypatch):
    """A kill during the second shard leaves no file for it; the rerun equals an uninterrupted run."""
    reference_out = tmp_path / "reference"
    generate_data(target, reference_out, config, progress=False)
    out = tmp_path / "run"
    real = data.stream_continuous

    def dies_in_the_second_shard(*args, **kwargs):
        first_shard = set()
        for index, generated in real(*args, **kwargs):
            if len(first_shard) == 4:  # the first shard is written: the kill comes inside the second
                raise KeyboardInterrupt
            if index < 4:
                first_shard.add(index)
            yield index, generated

    monkeypatch.setattr(data, "stream_continuous", dies_in_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        generate_data(target, out, config, progress=False)
    assert [p.name for p in shard_files(out)] == ["shard-00000.jsonl"]
    assert not list(out.rglob(".*.tmp"))
    assert json.loads((out / "manifest.json").read_text())["shards_done"] == 1
    monkeypatch.setattr(data, "stream_continuous", real)
    manifest = generate_data(target, out, config, progress=False)
    assert manifest["shards_done"] == 3
    for mine, theirs in zip(shard_files(out), shard_files(reference_out), strict=True):
        assert mine.read_bytes() == theirs.read_bytes()


def test_other_config_or_target_in_the_same_folder_is_refused(target, config, tmp_path):
    """A finished folder rerun with another config, or another target, raises ConfigError."""
    out = tmp_path / "run"
    generate_data(target, out, config, progress=False)
    other = DataConfig(sources=config.sources, shard_size=4, batch_size=2, max_new_tokens=7)
    with pytest.raises(ConfigError, match="another config.*--max-new-tokens 6 there, 7 now"):
        generate_data(target, out, other, progress=False)
    renamed = Target(target.decoder, target.tokenizer, "another-target", target.eos_token_ids)
    with pytest.raises(ConfigError, match="the target: tiny-random there, another-target now"):
        generate_data(renamed, out, config, progress=False)
    # The same config and target is a no-op resume.
    assert generate_data(target, out, config, progress=False)["shards_done"] == 3


def solo(decoder, prompt_ids: list[int], sampling: SamplingConfig, max_new_tokens: int, eos: list[int]) -> list[int]:
    """The AR reference's response under `sampling` (its own seed), decoded alone."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos, sampling=sampling)
    return [t for s in reference_generate(decoder, prompt_ids, config) for t in s.tokens]


def test_sampled_responses_are_the_targets_own_samples_beside_the_greedy_one(target, source_file, tmp_path):
    """--samples 2: each prompt gets its greedy response (written as always) and two sampled ones,
    each the target's own sampling of the prompt with the seed drawn from (seed, prompt id, sample)
    — the batch replays the solo draws; different samples of a prompt differ from each other and
    from the greedy response somewhere (negative control: a sampler ignoring its seed would repeat)."""
    config = DataConfig(sources=[source_file], shard_size=4, batch_size=3, max_new_tokens=8, samples=2,
                        temperature=1.0)
    out = tmp_path / "run"
    manifest = generate_data(target, out, config, progress=False)
    records = list(read_shards(out))
    prompts = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(records) == 3 * len(prompts) == 36 and manifest["num_prompts"] == 12
    by_prompt: dict[str, list[dict]] = {}
    for record in records:
        by_prompt.setdefault(record["id"], []).append(record)
    eos = target.eos_token_ids
    for prompt_id, mine in by_prompt.items():
        assert [r.get("sample", 0) for r in mine] == [0, 1, 2]  # greedy first, then its samples, together
        assert "temperature" not in mine[0] and {r["temperature"] for r in mine[1:]} == {1.0}
        plans = config.responses(prompt_id)
        assert plans[0].greedy and len({p.seed for p in plans[1:]}) == 2
        for record, plan in zip(mine, plans):
            assert record["response_ids"] == solo(target.decoder, record["prompt_ids"], plan, 8, eos)
    samples = [tuple(r["response_ids"]) for r in records if r.get("sample")]
    greedy_ones = {r["id"]: tuple(r["response_ids"]) for r in records if not r.get("sample")}
    assert len(set(samples)) > len(samples) // 2
    assert any(tuple(r["response_ids"]) != greedy_ones[r["id"]] for r in records if r.get("sample"))
    # the same command resumes to the same bytes; another temperature is another folder's config
    files = {p.name: p.read_bytes() for p in shard_files(out)}
    shard_files(out)[-1].unlink()
    generate_data(target, out, config, progress=False)
    assert {p.name: p.read_bytes() for p in shard_files(out)} == files
    with pytest.raises(ConfigError, match="--temperature 1.0 there, 0.7 now"):
        generate_data(target, out, dataclasses.replace(config, temperature=0.7), progress=False)


def test_a_folder_made_before_samples_existed_resumes(target, config, tmp_path):
    """A manifest without the sampling options (written before they existed) is the greedy config."""
    out = tmp_path / "run"
    generate_data(target, out, config, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    for key in ("samples", "temperature"):
        del manifest["config"][key]
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert generate_data(target, out, config, progress=False)["shards_done"] == 3


@pytest.mark.parametrize("kwargs, why", [(dict(samples=-1), "samples"), (dict(temperature=0.0), "temperature"),
                                         (dict(temperature=float("nan")), "temperature")])
def test_sampling_options_are_checked(kwargs, why):
    with pytest.raises(ConfigError, match=why):
        DataConfig(**kwargs)


def test_config_change_after_a_kill_during_the_first_shard(target, config, tmp_path, monkeypatch):
    """Killed before any shard finished, then rerun with another config: the new config is honoured or refused.

    prompts.jsonl is written before the first manifest, so a rerun must not silently reuse a prompt
    list made under another config while the manifest claims the new one.
    """
    out = tmp_path / "run"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(data, "stream_continuous", killed)
    with pytest.raises(KeyboardInterrupt):
        generate_data(target, out, config, progress=False)
    monkeypatch.undo()
    capped = DataConfig(sources=config.sources, shard_size=4, batch_size=2, max_new_tokens=6, max_prompts=5)
    try:
        manifest = generate_data(target, out, capped, progress=False)
    except ConfigError:
        return
    assert manifest["num_prompts"] == 5
    assert len(list(read_shards(out))) == 5


# -- prompt sources ------------------------------------------------------------------------------

def test_sharegpt_prompts():
    """The truncated ShareGPT file still yields > 10000 first human turns, with unique ids."""
    prompts = list(sharegpt_prompts())
    assert len(prompts) > 10000
    assert len({i for i, _ in prompts}) == len(prompts)
    for prompt_id, messages in prompts[:500]:
        assert prompt_id.startswith("sharegpt/") and len(messages) == 1 and messages[0]["role"] == "user"
        assert messages[0]["content"] and messages[0]["content"] == messages[0]["content"].strip()


def test_sharegpt_second_turns():
    """Second human turns come after the recorded first exchange: user, assistant, user."""
    prompts = list(itertools.islice(sharegpt_second_turns(), 2000))
    assert len(prompts) == 2000
    for prompt_id, messages in prompts[:300]:
        assert prompt_id.startswith("sharegpt-turn2/")
        assert [m["role"] for m in messages] == ["user", "assistant", "user"] and all(m["content"] for m in messages)


def test_math_prompts_are_seeded_word_problems():
    """Templated word problems: the same seed gives the same problems, thousands of distinct ones."""
    first = list(math_prompts(3000))
    assert first == list(math_prompts(3000)) and first != list(math_prompts(3000, seed=1))
    texts = [messages[0]["content"] for _, messages in first]
    assert len(set(texts)) > 2900
    assert all(text.endswith("Explain your reasoning step by step.") and any(c.isdigit() for c in text)
               for text in texts)


def test_stdlib_prompts():
    """The standard library yields > 1000 code requests naming a documented function."""
    prompts = list(itertools.islice(stdlib_prompts(), 1001))
    assert len(prompts) == 1001
    for prompt_id, messages in prompts[:200]:
        assert prompt_id.startswith("stdlib/") and ".py:" in prompt_id
        text = messages[0]["content"]
        assert text.startswith("Write a Python function `") and "that does the following:\n" in text


def test_multi_turn_prompts_keep_their_turns(target, tmp_path):
    """A JSONL prompt given as messages keeps every turn; one sharing a turn with a benchmark is dropped."""
    source = tmp_path / "chats.jsonl"
    rows = [{"id": "chat/0", "messages": [{"role": "user", "content": "hi there, who are you"},
                                          {"role": "assistant", "content": "a helper"},
                                          {"role": "user", "content": "then help me count to ten"}]},
            {"id": "chat/1", "messages": [{"role": "user", "content": MTBENCH_TURN},
                                          {"role": "assistant", "content": "ok"},
                                          {"role": "user", "content": "and now shorter"}]}]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = collect_prompts(DataConfig(sources=[str(source)]), CharTokenizer())
    assert [p["id"] for p in prompts] == ["chat/0"]
    assert prompts[0]["messages"] == rows[0]["messages"]


def test_prompts_with_unicode_line_separators_survive_resume(target, tmp_path):
    """A prompt holding U+2028 / U+0085 (which str.splitlines() splits on) is read back intact on resume."""
    source = tmp_path / "odd.jsonl"
    texts = [f"line one\u2028line two {i}\x85tail" for i in range(3)]
    source.write_text("".join(json.dumps({"id": f"odd/{i}", "prompt": t}, ensure_ascii=False) + "\n"
                              for i, t in enumerate(texts)), encoding="utf-8")
    config = DataConfig(sources=[str(source)], shard_size=2, batch_size=2, max_new_tokens=3)
    out = tmp_path / "out"
    first = generate_data(target, out, config, progress=False)
    (out / "shards" / "shard-00001.jsonl").unlink()
    second = generate_data(target, out, config, progress=False)
    assert second["num_prompts"] == first["num_prompts"] == 3
    stored = [json.loads(line) for line in (out / "prompts.jsonl").read_text(encoding="utf-8").split("\n") if line]
    assert sorted(p["messages"][0]["content"] for p in stored) == sorted(texts)
    assert len(list(read_shards(out))) == 3


def test_sampled_responses_from_a_server_are_refused_before_connecting(target, source_file, tmp_path):
    """--samples with --server: a ConfigError naming the local target, and no folder made."""
    from d3d.train.remote import ServerConfig

    config = DataConfig(sources=[source_file], samples=1)
    with pytest.raises(ConfigError, match="local target"):
        generate_data(target, tmp_path / "run", config, server=ServerConfig(url="http://127.0.0.1:9/v1"))
    assert not (tmp_path / "run").exists()
