"""The benchmark (`d3d.bench`): loop detection, mismatch positions, an end-to-end run on the tiny
target with a user prompt file (raw and chat prompts), its Markdown and PNG report, the identity
check catching a method that changes the output, and the `d3d bench` command's exit codes.

The transformers baselines ("hf", "hf_lookup") need a Hugging Face folder for the target; one
test builds a tiny one (config.json only: the weights come from the d3d target) to run them.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from d3d.bench.harness import BenchConfig, first_mismatch, is_looping, run_benchmark
import d3d.bench.harness as harness
import d3d.bench.methods
from d3d.bench.methods import build_methods
from d3d.bench.report import markdown, plots
from d3d.bench.runs import MethodRun
import d3d.generation
import d3d.loading
from conftest import make_decoder, tiny_config
from d3d.cli import main
from d3d.cli.bench import challenger_specs
from d3d.config import ConfigError
from d3d.drafter import Drafter
from d3d.generation import Pipeline
from d3d.loading import Target
from d3d.stats import SpecStats
from test_generation import ByteTokenizer, tiny_pipeline, tiny_target

PROMPTS = [
    {"id": "raw1", "prompt": "hello world"},
    {"id": "chat1", "messages": [{"role": "user", "content": "the sky is blue."}]},
    {"id": "raw2", "prompt": "1, 2, 3, 4, 5, 6, 7"},
]
METHODS = ["ar", "lookup", "drafter", "speculative"]
NEW_TOKENS = 12


def write_prompts(folder) -> str:
    path = folder / "mine.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return str(path)


def bench_config(path: str, methods=METHODS) -> BenchConfig:
    return BenchConfig(datasets=[path], num_prompts=16, max_new_tokens=NEW_TOKENS, methods=list(methods))


def break_method(monkeypatch, name: str = "lookup") -> None:
    """Make the benchmark's method `name` change the last token it returns."""
    real = harness.build_methods

    def build(pipeline, names, challengers=None):
        methods = real(pipeline, names, challengers)
        honest = methods[name]

        def broken(prompt_ids, config):
            run = honest(prompt_ids, config)
            return MethodRun(run.tokens[:-1] + [(run.tokens[-1] + 1) % 64], run.seconds, run.stats)
        methods[name] = broken
        return methods

    monkeypatch.setattr(harness, "build_methods", build)


# -- helpers ------------------------------------------------------------------------------------

def test_is_looping():
    """A tail repeating with a period ≤ 32 is a loop; short, aperiodic or long-period tails are not."""
    assert is_looping([1, 2, 3] * 30)
    assert is_looping(list(range(100)) + [7] * 64)
    assert is_looping(list(range(40)) + list(range(32)) * 2)  # period exactly 32
    assert not is_looping(list(range(33)) * 3)  # period 33
    assert not is_looping([5] * 63)  # shorter than the window
    assert not is_looping(list(range(200)))
    assert not is_looping([1, 2] * 40 + [3])  # the last token breaks the pattern
    assert is_looping([1, 2] * 10, window=8, max_period=2)


def test_first_mismatch():
    """The first differing position; a length difference counts at the shorter length; None when equal."""
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([], []) is None
    assert first_mismatch([1, 9, 3], [1, 2, 3]) == 1
    assert first_mismatch([0, 2, 3], [1, 2, 3]) == 0
    assert first_mismatch([1, 2], [1, 2, 3]) == 2
    assert first_mismatch([1, 2, 3, 4], [1, 2, 3]) == 3
    assert first_mismatch([1, 5], [1, 2, 3]) == 1


# -- end to end on the tiny target ---------------------------------------------------------------

@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One benchmark of ar, lookup, drafter and speculative over 3 user prompts (raw and chat), 12 tokens, T = 0."""
    path = write_prompts(tmp_path_factory.mktemp("prompts"))
    return path, run_benchmark(tiny_pipeline(eos_token_ids=[]), bench_config(path), progress=False)


def test_benchmark_outputs_are_identical_to_ar(bench_run):
    """At T = 0 every d3d method gives AR's tokens: identical, no mismatches, every record full length."""
    _, result = bench_run
    assert result["identical"] is True and result["mismatches"] == []
    records = result["records"]
    assert len(records) == len(PROMPTS) * len(METHODS)
    assert {(r["prompt_id"], r["method"]) for r in records} == {(p["id"], m) for p in PROMPTS for m in METHODS}
    assert all(r["first_mismatch"] is None and r["new_tokens"] == NEW_TOKENS for r in records)


def test_benchmark_table(bench_run):
    """The table has the dataset row and "all"; AR's speedup is 1; τ ≥ 1 for the speculative methods."""
    path, result = bench_run
    table = result["table"]
    assert list(table) == [path, "all"]
    for group in table:
        assert set(table[group]) == {"loop_share", *METHODS}
        ar = table[group]["ar"]["all"]
        assert ar["speedup"] == 1.0 and ar["prompts"] == len(PROMPTS) and ar["tokens"] == len(PROMPTS) * NEW_TOKENS
        for name in ("lookup", "drafter", "speculative"):
            row = table[group][name]["all"]
            assert row["tau"] is not None and row["tau"] >= 1.0, (group, name)
            assert row["speedup"] > 0 and row["identical"] == len(PROMPTS)
            assert all(0.0 <= r <= 1.0 for r in row["acceptance_rate"])
    for name in ("drafter", "speculative"):  # the drafter drafts on every step, so histograms are non-empty
        assert sum(table["all"][name]["all"]["accepted_histogram"]) > 0
    assert result["target"] == "tiny-random" and result["dtype"] == "float32"
    assert set(result["descriptions"]) == set(METHODS)
    json.dumps(result)  # the result is what `save_result` writes: it must be JSON


def test_markdown_report_lists_every_method(bench_run):
    """markdown(): the command, the identity verdict and one table line per method and group."""
    path, result = bench_run
    text = markdown(result, "d3d bench --test")
    assert "`d3d bench --test`" in text
    assert "every d3d method's output is token-identical to AR" in text
    for name in METHODS:
        assert re.search(rf"\| all \| \d+ \| 0% \| {name} \|", text), name
        assert re.search(rf"\| {re.escape(path)} \| \d+ \| 0% \| {name} \|", text), name
        assert f"- `{name}`:" in text
    assert re.search(r"\| all \| \d+ \| 0% \| ar \| ", text) and "| 1.00× |" in text
    assert "Time per verification step" in text
    for name in METHODS:
        assert any(line.startswith(f"| {name} | ") and line.endswith(" |") for line in text.splitlines()), name


def test_per_step_splits_the_time_of_a_step():
    """per_step(): ms per step over steps + the prefill; async fields only for async stats."""
    stats = SpecStats(steps=3, verify_seconds=0.2, draft_seconds=0.08)
    t = harness.per_step(stats, seconds=0.4)
    assert t["step"] == 100.0 and t["verify"] == 50.0 and t["draft"] == 20.0
    assert t["packed"] is None and t["wait"] is None and t["hit_rate"] is None
    stats.packed_seconds, stats.wait_seconds = 0.12, 0.04
    stats.record_branch(2, hit=True)
    stats.record_branch(0, hit=False)
    t = harness.per_step(stats, seconds=0.4)
    assert t["packed"] == 30.0 and t["wait"] == 10.0 and t["hit_rate"] == 0.5
    assert t["overlap"] == round(1 - 0.04 / 0.12, 3)
    assert harness.per_step(SpecStats(), seconds=1.0) is None  # no engine stats: no split


def test_plots_write_pngs(bench_run, tmp_path):
    """plots(): a speedup bar chart and acceptance histograms, as PNG files."""
    _, result = bench_run
    files = plots(result, tmp_path, "run")
    assert [f.rsplit("/", 1)[-1] for f in files] == ["run-speedup.png", "run-acceptance.png"]
    for f in files:
        assert open(f, "rb").read(4) == b"\x89PNG"


def test_a_method_that_changes_the_output_is_caught(monkeypatch, tmp_path):
    """A "lookup" that alters its last token makes identical False, naming each prompt and the position."""
    break_method(monkeypatch)
    path = write_prompts(tmp_path)
    result = run_benchmark(tiny_pipeline(eos_token_ids=[]), bench_config(path, ["ar", "lookup"]), progress=False)
    assert result["identical"] is False
    assert result["mismatches"] == [f"lookup differs from AR on {path}:{p['id']} at token {NEW_TOKENS - 1}"
                                    for p in PROMPTS]
    lookup = [r for r in result["records"] if r["method"] == "lookup"]
    assert [r["first_mismatch"] for r in lookup] == [NEW_TOKENS - 1] * len(PROMPTS)
    assert result["table"]["all"]["lookup"]["all"]["identical"] == 0
    assert "**MISMATCHES**: lookup differs from AR" in markdown(result, "d3d bench")


def test_transformers_disagreement_is_reported_not_enforced(monkeypatch, tmp_path):
    """A transformers baseline ("hf") differing from AR is recorded per prompt but does not fail the identity check."""
    real = harness.build_methods

    def build(pipeline, names, challengers=None):
        methods = real(pipeline, [n for n in names if n != "hf"])
        methods["hf"] = lambda ids, config: MethodRun([1] * config.max_new_tokens, 0.01)
        return methods

    monkeypatch.setattr(harness, "build_methods", build)
    path = write_prompts(tmp_path)
    result = run_benchmark(tiny_pipeline(eos_token_ids=[]), bench_config(path, ["ar", "hf"]), progress=False)
    assert result["identical"] is True and result["mismatches"] == []
    hf = [r for r in result["records"] if r["method"] == "hf"]
    assert len(hf) == len(PROMPTS) and all(r["first_mismatch"] is not None for r in hf)
    assert result["table"]["all"]["hf"]["all"]["identical"] < len(PROMPTS)


# -- the command ----------------------------------------------------------------------------------

@pytest.fixture
def tiny_default(monkeypatch):
    """'default' target → the tiny random target (no EOS), as test_cli patches it."""
    def load(source=None, dtype=torch.bfloat16, weights="stored"):
        assert source is None or str(source) == "default"
        return tiny_target(eos_token_ids=[])

    monkeypatch.setattr(d3d.generation, "load_target", load)
    monkeypatch.setattr(d3d.loading, "load_target", load)


def bench_argv(tmp_path) -> list[str]:
    return ["bench", "--prompts", write_prompts(tmp_path), "--datasets", "", "--methods", "ar,lookup",
            "--max-new-tokens", "8", "--drafter", "none", "--dtype", "float32",
            "--out", str(tmp_path / "results"), "--report", str(tmp_path / "report" / "bench.md")]


def test_cli_bench_exit_0_with_json_summary(capsys, tiny_default, tmp_path):
    """`d3d bench` on a prompt file: exit 0, a JSON summary as the last stdout line, result file and report written."""
    assert main(bench_argv(tmp_path)) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["identical"] is True
    assert set(summary["speedup"]) == {"ar", "lookup"} and summary["speedup"]["ar"] == 1.0
    saved = json.loads(open(summary["result"]).read())
    assert saved["identical"] is True and saved["config"]["max_new_tokens"] == 8
    assert len(saved["records"]) == 2 * len(PROMPTS)
    report = (tmp_path / "report" / "bench.md").read_text()
    assert report.startswith("# d3d bench: T = 0.0, float32, ") and "bench-speedup.png" in report
    assert (tmp_path / "report" / "bench-speedup.png").is_file()
    assert "token-identical to AR" in err


def test_cli_bench_exit_1_on_mismatch(capsys, tiny_default, monkeypatch, tmp_path):
    """`d3d bench` with a method that changes the output: exit 1, identical false in the JSON, the mismatch on stderr."""
    break_method(monkeypatch)
    assert main(bench_argv(tmp_path)) == 1
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["identical"] is False
    assert "d3d: error: lookup differs from AR on" in err and "raw1 at token 7" in err


def test_cli_bench_unknown_dataset_is_a_usage_error(capsys, tiny_default, tmp_path):
    """An unknown dataset name: exit 2 with a one-line error, no traceback."""
    code = main(["bench", "--datasets", "nope", "--methods", "ar", "--drafter", "none", "--max-new-tokens", "4",
                 "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "unknown dataset 'nope'" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--prompts", "--datasets"])
def test_cli_bench_a_missing_prompt_file_is_named_before_the_model_loads(capsys, monkeypatch, tmp_path, flag):
    """`--prompts missing.jsonl` (or a path in --datasets): exit 2 naming the file's path, not "unknown
    dataset", and no model is loaded first."""
    monkeypatch.setattr("d3d.cli.bench.load_pipeline", lambda args: pytest.fail("loaded a model before checking"))
    missing = tmp_path / "missing.jsonl"
    code = main(["bench", flag, str(missing), "--methods", "ar", "--drafter", "none", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and f"no prompt file at {missing}" in err and "unknown dataset" not in err
    assert "Traceback" not in err


def test_cli_bench_a_bad_prompt_line_is_named_before_the_model_loads(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("d3d.cli.bench.load_pipeline", lambda args: pytest.fail("loaded a model before checking"))
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n{oops\n")
    code = main(["bench", "--prompts", str(path), "--methods", "ar", "--drafter", "none", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and f"{path}:2: not valid JSON" in err


def test_a_challenger_drafter_runs_as_method_at_label(tmp_path):
    """`challengers`: each drafting method also runs with the other drafter as METHOD@LABEL, in the
    same interleaved loop, identity-checked, described with that drafter's source; AR and lookup
    (which draft with no drafter) are not repeated."""
    pipeline = tiny_pipeline(eos_token_ids=[])
    other = Pipeline(pipeline.target, Drafter.from_target(pipeline.target.decoder, [1], block_size=4), "layer-1 copy")
    result = run_benchmark(pipeline, bench_config(write_prompts(tmp_path)), progress=False,
                           challengers={"b": other})
    names = METHODS + ["drafter@b", "speculative@b"]
    assert list(result["descriptions"]) == names
    assert result["descriptions"]["speculative@b"].endswith("; drafter layer-1 copy")
    assert result["challengers"] == {"b": "layer-1 copy"}
    assert {(r["prompt_id"], r["method"]) for r in result["records"]} == {(p["id"], m) for p in PROMPTS for m in names}
    assert result["identical"] is True
    assert result["table"]["all"]["drafter@b"]["all"]["tau"] is not None
    assert "| drafter@b |" in markdown(result, "d3d bench ...")


def test_a_challenger_that_changes_the_output_is_caught(monkeypatch, tmp_path):
    """The identity check covers METHOD@LABEL runs like the methods they repeat."""
    break_method(monkeypatch, "speculative@b")
    pipeline = tiny_pipeline(eos_token_ids=[])
    result = run_benchmark(pipeline, bench_config(write_prompts(tmp_path), ["ar", "speculative"]), progress=False,
                           challengers={"b": tiny_pipeline(eos_token_ids=[])})
    assert result["identical"] is False
    assert all(m.startswith("speculative@b differs from AR") for m in result["mismatches"])


def test_a_challenger_needs_a_drafter_and_a_drafting_method():
    pipeline = tiny_pipeline(eos_token_ids=[])
    with pytest.raises(ConfigError, match="has no drafter"):
        build_methods(pipeline, ["ar", "drafter"], {"b": tiny_pipeline(drafter=False)})
    with pytest.raises(ConfigError, match="needs a method that drafts"):
        build_methods(pipeline, ["ar", "lookup"], {"b": tiny_pipeline()})


def test_cli_bench_compare_drafter(capsys, tiny_default, tmp_path):
    """`d3d bench --compare-drafter b=PATH`: the saved drafter runs as speculative@b; a malformed spec
    is a usage error."""
    target = tiny_target(eos_token_ids=[])
    Drafter.from_target(target.decoder, [0], block_size=4, tokenizer_fingerprint=target.fingerprint
                        ).save_pretrained(tmp_path / "other")
    argv = bench_argv(tmp_path)
    argv[argv.index("ar,lookup")] = "ar,speculative"
    argv[argv.index("none")] = "untrained"
    assert main(argv + ["--compare-drafter", f"b={tmp_path / 'other'}"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["speedup"]) == {"ar", "speculative", "speculative@b"} and summary["identical"] is True
    assert main(argv + ["--compare-drafter", "no-label-here"]) == 2
    assert "LABEL=PATH" in capsys.readouterr().err
    # several in one value, joined by commas: the same as the flag repeated; a label twice is refused
    assert challenger_specs([f"b={tmp_path}/x@q8_0,c={tmp_path}/y"], "stored") == \
        challenger_specs([f"b={tmp_path}/x@q8_0", f"c={tmp_path}/y"], "stored") == \
        {"b": (f"{tmp_path}/x", "q8_0"), "c": (f"{tmp_path}/y", "stored")}
    assert main(argv + ["--compare-drafter", f"b={tmp_path / 'other'},b={tmp_path / 'other'}"]) == 2
    assert "got 'b=" in capsys.readouterr().err
    # @WEIGHTS quantizes one challenger at load: on this fp32 tiny target there is nothing to stream, said so
    assert main(argv + ["--compare-drafter", f"b={tmp_path / 'other'}@q8_0"]) == 2
    assert "bf16 drafter" in capsys.readouterr().err


# -- the transformers baselines --------------------------------------------------------------------

class PaddedByteTokenizer(ByteTokenizer):
    pad_token_id = 0


def test_transformers_baselines_on_a_tiny_hf_folder(tmp_path):
    """hf and hf_lookup run on a transformers Llama holding the tiny target's weights and agree with d3d AR (fp32)."""
    transformers = pytest.importorskip("transformers")
    c = tiny_config("llama", tie_word_embeddings=False)
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    hf_config.save_pretrained(tmp_path)  # config.json only: the weights come from the d3d target
    target = Target(make_decoder(c, seed=1), PaddedByteTokenizer(), "tiny-hf", [], folder=str(tmp_path))
    pipeline = Pipeline(target, None)
    path = write_prompts(tmp_path)
    result = run_benchmark(pipeline, bench_config(path, ["ar", "hf", "hf_lookup"]), progress=False)
    assert result["identical"] is True
    hf = [r for r in result["records"] if r["method"] in ("hf", "hf_lookup")]
    assert len(hf) == 2 * len(PROMPTS)
    assert all(r["new_tokens"] == NEW_TOKENS and r["first_mismatch"] is None for r in hf)
    sampled = run_benchmark(pipeline, BenchConfig(datasets=[path], num_prompts=16, max_new_tokens=NEW_TOKENS,
                                                  methods=["ar", "hf", "hf_lookup", "lookup"], temperature=1.0),
                            progress=False)  # T = 1: every method samples; nothing is compared
    assert all(r["new_tokens"] == NEW_TOKENS for r in sampled["records"])
    assert sampled["table"]["all"]["hf_lookup"]["all"]["tokens_per_second"] > 0


class PadlessByteTokenizer(ByteTokenizer):
    pad_token_id = None


def test_transformers_baselines_without_pad_or_eos(monkeypatch):
    """A target with neither a pad token nor EOS ids still gets its transformers baselines (no IndexError)."""
    monkeypatch.setattr(d3d.bench.methods, "transformers_model", lambda pipeline: object())  # no model needed
    target = Target(make_decoder(tiny_config("llama", tie_word_embeddings=False), seed=1), PadlessByteTokenizer(),
                    "tiny", [])
    methods = d3d.bench.methods.build_methods(Pipeline(target, None), ["ar", "hf", "hf_lookup"])
    assert set(methods) == {"ar", "hf", "hf_lookup"}


class TemplatelessByteTokenizer(ByteTokenizer):
    chat_template = None  # a base model: raw completion prompts only


def test_benchmark_of_raw_prompts_needs_no_chat_template(tmp_path):
    """A target without a chat template can be benchmarked on raw prompts (the warm-up must not need the template)."""
    target = tiny_target(eos_token_ids=[])
    target.tokenizer = TemplatelessByteTokenizer()
    path = tmp_path / "raw.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS if "prompt" in p))
    result = run_benchmark(Pipeline(target, None), bench_config(str(path), ["ar", "lookup"]), progress=False)
    assert result["identical"] is True and len(result["records"]) == 4


def test_cli_bench_quick_keeps_user_prompt_files(tiny_default, monkeypatch, tmp_path):
    """`d3d bench --quick --prompts FILE` still benchmarks FILE (quick shrinks the run, it does not drop user prompts)."""
    seen = []

    def fake_run_benchmark(pipeline, config, progress=True, challengers=None):
        seen.append(config)
        raise KeyboardInterrupt  # stop here: only the configuration is under test

    monkeypatch.setattr(harness, "run_benchmark", fake_run_benchmark)
    path = write_prompts(tmp_path)
    assert main(["bench", "--quick", "--prompts", path, "--methods", "ar", "--drafter", "none"]) == 130
    (config,) = seen
    assert config.num_prompts == 2 and config.max_new_tokens == 48
    assert path in config.datasets


def bench_config_of(monkeypatch, *argv: str) -> BenchConfig:
    """The BenchConfig `d3d bench ARGV` would run (nothing is benchmarked)."""
    seen = []

    def fake_run_benchmark(pipeline, config, progress=True, challengers=None):
        seen.append(config)
        raise KeyboardInterrupt

    monkeypatch.setattr(harness, "run_benchmark", fake_run_benchmark)
    assert main(["bench", *argv, "--methods", "ar", "--drafter", "none"]) == 130
    return seen[0]


@pytest.mark.parametrize("argv, datasets, num_prompts", [
    (["--prompts", "FILE"], ["FILE"], None),  # the file alone, all of it
    (["--prompts", "FILE", "--num-prompts", "2"], ["FILE"], 2),
    (["--prompts", "FILE", "--datasets", "humaneval"], ["humaneval", "FILE"], 16),
    (["--prompts", "FILE", "--quick"], ["FILE"], 2),
    ([], ["humaneval", "mtbench", "math500"], 16),
    (["--quick"], ["humaneval", "mtbench"], 2),
])
def test_cli_bench_prompt_files_replace_the_default_datasets(tiny_default, monkeypatch, tmp_path, argv, datasets,
                                                            num_prompts):
    """`--prompts FILE` without `--datasets` benchmarks only the file, every prompt of it unless
    `--num-prompts` is given; the default datasets are a sample of 16 each."""
    path = write_prompts(tmp_path)
    config = bench_config_of(monkeypatch, *[path if a == "FILE" else a for a in argv])
    assert config.datasets == [path if d == "FILE" else d for d in datasets]
    assert config.num_prompts == num_prompts


def test_cli_bench_runs_every_prompt_of_a_file(capsys, tiny_default, tmp_path):
    """A prompt file longer than the default sample of 16 is benchmarked in full."""
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"hello {i}"}) + "\n" for i in range(18)))
    assert main(["bench", "--prompts", str(path), "--methods", "ar", "--max-new-tokens", "2", "--drafter", "none",
                 "--dtype", "float32", "--out", str(tmp_path / "results")]) == 0
    out, err = capsys.readouterr()
    saved = json.loads(open(json.loads(out.strip().splitlines()[-1])["result"]).read())
    assert sorted(r["prompt_id"] for r in saved["records"]) == sorted(f"p{i}" for i in range(18))
    assert "all prompts per dataset" in err


@pytest.mark.parametrize("argv, fragment", [(["--num-prompts", "0"], "--num-prompts must be at least 1"),
                                            (["--datasets", ""], "nothing to benchmark")])
def test_cli_bench_nothing_to_run_is_a_usage_error(capsys, tiny_default, tmp_path, argv, fragment):
    code = main(["bench", *argv, "--methods", "ar", "--drafter", "none", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and f"d3d: error: {fragment}" in err and "Traceback" not in err


def test_async_methods_both_miss_policies(tmp_path):
    """async (redraft on a miss) and async_reanchor: identical to AR, with hit rate and wait in the per-step figures."""
    path = write_prompts(tmp_path)
    result = run_benchmark(tiny_pipeline(eos_token_ids=[]), bench_config(path, ["ar", "async", "async_reanchor"]),
                           progress=False)
    assert result["identical"] is True
    for name in ("async", "async_reanchor"):
        t = result["table"]["all"][name]["all"]["per_step"]
        assert 0.0 <= t["hit_rate"] <= 1.0 and t["wait"] >= 0 and t["packed"] > 0
    assert "async_reanchor" in markdown(result, "d3d bench")


def test_the_long_set_is_reported_by_size_with_ttft(monkeypatch):
    """`--datasets long` groups its prompts by size (long1k … long7k), and every row reports the
    mean prompt tokens and the time to the first token."""
    from d3d.prompts import Prompt

    prompts = [Prompt("long1k/a", "long1k", text="one two three " * 3), Prompt("long4k/b", "long4k", text="four " * 9)]
    monkeypatch.setattr(harness, "load_dataset", lambda name: prompts if name == "long" else pytest.fail(name))
    result = run_benchmark(tiny_pipeline(eos_token_ids=[]), BenchConfig(datasets=["long"], num_prompts=None,
                           max_new_tokens=4, methods=["ar", "lookup"]), progress=False)
    assert list(result["table"]) == ["long1k", "long4k", "all"]
    for group in ("long1k", "long4k"):
        row = result["table"][group]["ar"]["all"]
        prefill = [r["prefill_seconds"] for r in result["records"] if r["dataset"] == group and r["method"] == "ar"]
        assert row["prompt_tokens"] > 0 and row["ttft_seconds"] == pytest.approx(sum(prefill) / len(prefill), abs=1e-3)
    assert {r["prompt_tokens"] for r in result["records"]} == {
        len(tiny_pipeline(eos_token_ids=[]).encode(p.text, chat=False)) for p in prompts}
