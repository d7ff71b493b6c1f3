"""The `d3d` command: bad input ends with exit code 2 and a one-line `d3d: error: …` on stderr (never a
traceback), and good input runs end to end. Fast tests swap the embedded target for the tiny random
one (`d3d.generation.load_target` / `d3d.loading.load_target` patched); the slow ones load SmolLM2."""

from __future__ import annotations

import io
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import d3d.cli
import d3d.cli.generate
import d3d.generation
import d3d.loading
from d3d.cli import main
from d3d.drafter import Drafter
from test_generation import tiny_target

REAL_LOAD_TARGET = d3d.loading.load_target
_real_targets: dict = {}  # the real target, loaded once for all slow tests of this module


@pytest.fixture
def tiny_default(monkeypatch):
    """'default' (or no) target → the tiny random target with the byte tokenizer; other paths load for real."""
    loads = []

    def load(source=None, dtype=torch.bfloat16, weights="stored"):
        loads.append(source)
        if source is None or str(source) == "default":
            return tiny_target(eos_token_ids=[])
        return REAL_LOAD_TARGET(source, dtype)

    monkeypatch.setattr(d3d.generation, "load_target", load)
    monkeypatch.setattr(d3d.loading, "load_target", load)
    return loads


@pytest.fixture
def real_default(monkeypatch):
    """The real embedded target, loaded once per module (the CLI's own loading path, memoised)."""
    def load(source=None, dtype=torch.bfloat16, weights="stored"):
        key = (str(source), dtype)
        if key not in _real_targets:
            _real_targets[key] = REAL_LOAD_TARGET(source, dtype)
        return _real_targets[key]

    monkeypatch.setattr(d3d.generation, "load_target", load)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_usage_error(code: int, err: str, *fragments: str) -> None:
    """Exit code 2, a `d3d: error:` line naming the problem, and no traceback."""
    assert code == 2
    assert "d3d: error:" in err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"


# -- generate: invalid input ------------------------------------------------------------------

def test_empty_raw_prompt(capsys, tiny_default):
    """`generate "" --no-chat` has no tokens to start from: exit 2, 'empty' on stderr."""
    code, _, err = run_cli(capsys, "generate", "", "--no-chat", "--drafter", "none")
    assert_usage_error(code, err, "empty")


@pytest.mark.parametrize("flag, value, fragment", [("--temperature", "-1", "temperature"),
                                                   ("--temperature", "inf", "temperature must be a finite number"),
                                                   ("--temperature", "1e999", "temperature must be a finite number"),
                                                   ("--temperature", "nan", "temperature must be a finite number"),
                                                   ("--top-p", "0", "top_p"),
                                                   ("--top-p", "1.5", "top_p"),
                                                   ("--top-p", "nan", "top_p"),
                                                   ("--top-k", "-3", "top_k")])
def test_invalid_sampling_arguments(capsys, tiny_default, flag, value, fragment):
    """Out-of-range or non-finite sampling parameters: exit 2 with a message naming the parameter,
    before anything is loaded."""
    code, out, err = run_cli(capsys, "generate", "hello", flag, value, "--drafter", "untrained", "--max-new-tokens", "8")
    assert_usage_error(code, err, fragment)
    assert out == ""  # nothing was generated
    assert tiny_default == []  # no target was loaded


@pytest.mark.parametrize("value", ["0", "-5"])
def test_max_new_tokens_must_be_positive(capsys, tiny_default, value):
    """--max-new-tokens below 1 is refused before anything is loaded."""
    code, _, err = run_cli(capsys, "generate", "hello", "--max-new-tokens", value)
    assert_usage_error(code, err, "--max-new-tokens")
    assert tiny_default == []  # no target was loaded


def test_over_long_prompt(capsys, tiny_default):
    """A prompt that fills the (tiny, 128-token) context: exit 2 saying there is no room to generate."""
    code, out, err = run_cli(capsys, "generate", "a" * 200, "--no-chat", "--drafter", "none", "--max-new-tokens", "8")
    assert_usage_error(code, err, "200 tokens", "context")
    assert out == ""


def test_nonexistent_drafter(capsys, tiny_default):
    """--drafter /nonexistent: exit 2 naming the path and what a drafter folder needs."""
    code, _, err = run_cli(capsys, "generate", "hello", "--drafter", "/nonexistent")
    assert_usage_error(code, err, "/nonexistent", "not a d3d drafter")


def test_nonexistent_target(capsys):
    """--target /nonexistent: exit 2 naming the path (no download is attempted)."""
    code, _, err = run_cli(capsys, "generate", "hello", "--target", "/nonexistent")
    assert_usage_error(code, err, "/nonexistent", "neither a .gguf file nor a Hugging Face folder")


def test_target_folder_without_config(capsys, tmp_path):
    """An existing folder that is not a model: exit 2 saying config.json is missing."""
    code, _, err = run_cli(capsys, "generate", "hello", "--target", str(tmp_path))
    assert_usage_error(code, err, "config.json")


@pytest.mark.parametrize("text, fragments", [
    ("{not json", ["config.json is not readable JSON", "line 1 column 2"]),
    ("{}", ["config.json is not a model config transformers can read", "model_type"]),
    ('{"model_type": "llama", "hidden_size": "x"}', ["config.json is not a model config", "hidden_size"]),
])
def test_target_folder_with_a_broken_config(capsys, tmp_path, text, fragments):
    """A config.json that is not JSON, or not a config transformers reads: exit 2 naming the file,
    not transformers' 50-line traceback."""
    (tmp_path / "config.json").write_text(text)
    code, _, err = run_cli(capsys, "generate", "hello", "--target", str(tmp_path))
    assert_usage_error(code, err, str(tmp_path / "config.json"), *fragments)


def test_target_folder_with_a_broken_generation_config(capsys, tmp_path, tiny_default):
    """A valid model folder whose generation_config.json is not JSON: exit 2 naming that file."""
    from d3d.export import export_target

    folder = export_target(tiny_target(eos_token_ids=[]), tmp_path / "target")
    (folder / "generation_config.json").write_text("{")
    code, _, err = run_cli(capsys, "generate", "hello", "--target", str(folder), "--drafter", "none")
    assert_usage_error(code, err, str(folder / "generation_config.json"), "not readable JSON")


@pytest.fixture
def drafter_folder(tmp_path):
    """A saved drafter for the tiny target, with a reduced draft vocabulary, to damage in tests."""
    folder = tmp_path / "drafter"
    target = tiny_target(eos_token_ids=[])
    Drafter.from_target(target.decoder, [0], block_size=4, tokenizer_fingerprint=target.fingerprint,
                        draft_vocab=torch.arange(10, 30)).save_pretrained(folder)
    return folder


def edit_drafter(folder, config=None, weights=None) -> None:
    if config:
        document = json.loads((folder / "config.json").read_text())
        config(document)
        (folder / "config.json").write_text(json.dumps(document))
    if weights:
        state = load_file(str(folder / "model.safetensors"))
        weights(state)
        save_file(state, str(folder / "model.safetensors"))


def test_saved_drafter_generates(capsys, tiny_default, drafter_folder):
    """The undamaged folder loads and generates (so the failures below are the damage's)."""
    code, out, _ = run_cli(capsys, "generate", "hello", "--drafter", str(drafter_folder), "--max-new-tokens", "8")
    assert code == 0 and out.strip()


def test_drafter_weights_quantized_at_load(capsys, monkeypatch, tmp_path):
    """--drafter-weights q8_0 on a bf16 target: the load line says so and the output is AR's; on an
    fp32 one (no quantized streams there) it is a usage error."""
    from conftest import make_decoder, tiny_config

    def load(source=None, dtype=torch.bfloat16, weights="stored"):
        return tiny_target(make_decoder(tiny_config("llama", tie_word_embeddings=False), seed=1, dtype=dtype),
                           eos_token_ids=[])

    monkeypatch.setattr(d3d.generation, "load_target", load)
    folder = tmp_path / "drafter"
    target = load()
    Drafter.from_target(target.decoder, [0], block_size=4, tokenizer_fingerprint=target.fingerprint,
                        draft_vocab=torch.arange(10, 42)).save_pretrained(folder)
    argv = ["generate", "hello", "--drafter", str(folder), "--drafter-weights", "q8_0", "--max-new-tokens", "12",
            "--compare-ar", "--json"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0 and "Q8_0 weights quantized at load" in err
    assert json.loads(out.strip().splitlines()[-1])["identical_to_ar"] is True
    code, _, err = run_cli(capsys, *argv, "--dtype", "float32")
    assert_usage_error(code, err, "bf16 drafter")


@pytest.mark.parametrize("damage, fragments", [
    (dict(config=lambda d: d.pop("model")), ["config.json", "missing fields ['model']"]),
    (dict(config=lambda d: d["model"].update(hiden_size=32)), ["config.json", "unknown fields ['hiden_size']"]),
    (dict(config=lambda d: d.update(block_size="4")), ["config.json", "block_size: expected int"]),
    (dict(config=lambda d: d["model"].update(rope_scaling={"rope_type": "llama3"})), ["config.json", "rope_scaling"]),
    (dict(weights=lambda s: s.pop("mask_embedding")), ["model.safetensors", "missing ['mask_embedding']"]),
    (dict(weights=lambda s: s.update({"decoder.norm.weight": torch.ones(8)})), ["model.safetensors", "shape (8,)"]),
    (dict(weights=lambda s: s.update(draft_vocab=torch.arange(50, 70))), ["model.safetensors", "draft vocabulary"]),
    (dict(weights=lambda s: s["mask_embedding"].__setitem__(0, float("nan"))), ["mask_embedding", "NaN"]),
])
@pytest.mark.parametrize("temperature", ["0", "0.7"])
def test_damaged_drafter_is_a_usage_error(capsys, tiny_default, drafter_folder, damage, fragments, temperature):
    """A drafter folder with a broken config or broken weights, at T = 0 and T > 0: exit 2 with one
    line naming the file and the problem; nothing generated, no traceback."""
    edit_drafter(drafter_folder, **damage)
    code, out, err = run_cli(capsys, "generate", "hello", "--drafter", str(drafter_folder), "--max-new-tokens", "8",
                             "--temperature", temperature, "--seed", "0")
    assert_usage_error(code, err, *fragments)
    assert out == ""


def test_drafter_folder_with_a_non_safetensors_file(capsys, tiny_default, drafter_folder):
    (drafter_folder / "model.safetensors").write_text("<html>404</html>")
    code, _, err = run_cli(capsys, "generate", "hello", "--drafter", str(drafter_folder), "--max-new-tokens", "8")
    assert_usage_error(code, err, "not a readable safetensors file")


def test_drafter_layers_out_of_range(capsys, tiny_default):
    """--drafter-layers naming a layer the target does not have: exit 2."""
    code, _, err = run_cli(capsys, "generate", "hello", "--drafter", "untrained", "--drafter-layers", "0,7")
    assert_usage_error(code, err, "layers")


def test_malformed_drafter_layers(capsys, tiny_default):
    """--drafter-layers that are not integers: exit 2 naming the option (from d3d or argparse), no traceback."""
    try:
        code = main(["generate", "hello", "--drafter", "untrained", "--drafter-layers", "0,x"])
    except SystemExit as exit_info:  # an argparse `type=` check would exit here instead
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2 and "error:" in err and "--drafter-layers" in err and "Traceback" not in err


@pytest.mark.parametrize("spec", ["all", "every:2", "0-1"])
def test_drafter_layers_by_name(capsys, tiny_default, spec):
    """--drafter-layers all / every:K / a range: the untrained drafter copies those layers of the target."""
    depth = tiny_target().decoder.config.num_layers
    expected = {"all": depth, "every:2": (depth + 1) // 2, "0-1": 2}[spec]
    code, _, err = run_cli(capsys, "generate", "hello", "--drafter", "untrained", "--drafter-layers", spec,
                           "--max-new-tokens", "4")
    assert code == 0 and f"drafter: {expected}-layer drafter" in err


def test_drafter_method_without_drafter(capsys, tiny_default):
    """--method drafter --drafter none: exit 2 with a message, not a ValueError traceback."""
    code, _, err = run_cli(capsys, "generate", "hello", "--method", "drafter", "--drafter", "none")
    assert_usage_error(code, err, "drafter")


def test_unknown_choices_are_argparse_errors(capsys):
    """An unknown --method / --dtype is rejected by argparse itself (SystemExit 2)."""
    for argv in (["generate", "hi", "--method", "beam"], ["generate", "hi", "--dtype", "int8"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert "invalid choice" in capsys.readouterr().err


def test_serve_refuses_an_address_it_cannot_listen_on_before_loading(capsys, tiny_default):
    """A port out of range or taken by another server: exit 2 at once, before the model loads."""
    import socket
    code, _, err = run_cli(capsys, "serve", "--port", "70000")
    assert_usage_error(code, err, "--port must be 0 … 65535")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        code, _, err = run_cli(capsys, "serve", "--port", port)
    assert_usage_error(code, err, f"cannot listen on 127.0.0.1:{port}", "already running there")
    assert tiny_default == []  # nothing was loaded


# -- generate / chat / data: valid input on the tiny target -----------------------------------

def test_generate_compare_ar_json_on_tiny_target(capsys, tiny_default):
    """generate --compare-ar --json: exit 0, the text on stdout, a JSON summary last, identical to AR."""
    code, out, err = run_cli(capsys, "generate", "hello", "--max-new-tokens", "12", "--compare-ar", "--json",
                             "--dtype", "float32", "--drafter", "untrained", "--drafter-layers", "0")
    assert code == 0
    lines = out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["method"] == "speculative" and summary["new_tokens"] == 12
    assert summary["identical_to_ar"] is True
    assert summary["speedup"] > 0 and summary["ar_tokens_per_second"] > 0
    assert "speedup over AR" in err and "output identical to AR: yes" in err
    assert "tiny-random" in err  # the load line names the target


@pytest.fixture
def broken_speculation(monkeypatch):
    """Make every non-AR run of `d3d generate` change its fifth token (a lossless-decoding bug)."""
    real_run = d3d.cli.generate.run

    def run(pipeline, prompt, args, method, echo):
        result = real_run(pipeline, prompt, args, method, echo)
        if method != "ar":
            result.tokens[4] = (result.tokens[4] + 1) % 64
        return result

    monkeypatch.setattr(d3d.cli.generate, "run", run)


def test_generate_compare_ar_mismatch_at_greedy_exits_1(capsys, tiny_default, broken_speculation):
    """At T = 0 an output that is not AR's is an error: exit 1, "NO" and a `d3d: error:` line naming
    where they part; the JSON summary still says so."""
    code, out, err = run_cli(capsys, "generate", "hello", "--max-new-tokens", "8", "--compare-ar", "--json",
                             "--dtype", "float32", "--drafter", "untrained", "--drafter-layers", "0")
    assert code == 1
    assert json.loads(out.strip().splitlines()[-1])["identical_to_ar"] is False
    assert "output identical to AR: NO" in err
    assert "d3d: error: speculative output differs from AR's from token 4 on; at T = 0 it must be identical" in err
    assert "Traceback" not in err


def test_generate_compare_ar_mismatch_when_sampling_exits_0(capsys, tiny_default, broken_speculation):
    """At T > 0 outputs differ by design: "NO" is reported as such and the command succeeds."""
    code, _, err = run_cli(capsys, "generate", "hello", "--max-new-tokens", "8", "--compare-ar", "--temperature", "0.7",
                           "--seed", "0", "--dtype", "float32", "--drafter", "untrained", "--drafter-layers", "0")
    assert code == 0
    assert "output identical to AR: NO (sampling: outputs differ by design)" in err
    assert "d3d: error" not in err


def test_generate_stop_string(capsys, tiny_default):
    """--stop ends the printed text before the stop string."""
    code, full, _ = run_cli(capsys, "generate", "hello", "--max-new-tokens", "12", "--drafter", "none")
    assert code == 0
    text = full.rstrip("\n")
    stop = text[2:5]
    code, out, _ = run_cli(capsys, "generate", "hello", "--max-new-tokens", "12", "--drafter", "none", "--stop", stop)
    assert code == 0 and out.rstrip("\n") == text[:text.index(stop)]


def test_chat_reads_turns_until_empty_line(capsys, tiny_default, monkeypatch):
    """chat: each input line is answered; an empty line ends the session with exit 0."""
    lines = iter(["hello", "the world", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    code, out, err = run_cli(capsys, "chat", "--drafter", "none", "--max-new-tokens", "4")
    assert code == 0
    assert out.count("assistant> ") == 2
    assert err.count("speculative: 4 tokens") == 2
    # the second turn's prompt starts with the first turn's: its positions come from the prefix cache
    assert "prompt tokens from the prefix cache" in err.split("speculative: 4 tokens")[2]
    lines = iter(["hello", "the world", ""])
    code, _, err = run_cli(capsys, "chat", "--drafter", "none", "--max-new-tokens", "4", "--prefix-cache", "0")
    assert code == 0 and "prefix cache" not in err
    code, _, err = run_cli(capsys, "chat", "--drafter", "none", "--prefix-cache", "-1")
    assert_usage_error(code, err, "--prefix-cache")


def test_chat_opens_with_the_files_text(capsys, tiny_default, tmp_path, monkeypatch):
    """chat --file: the file's text, then the first line typed, is the first turn (later turns as typed)."""
    seen = []
    monkeypatch.setattr(d3d.cli.generate, "run", lambda pipeline, messages, args, method, echo:
                        seen.append([m["content"] for m in messages if m["role"] == "user"])
                        or d3d.cli.generate.RunResult("ok", [], []))
    monkeypatch.setattr(d3d.cli.generate, "describe", lambda label, result: "")
    (tmp_path / "notes.md").write_text("the notes")
    lines = iter(["What do they say?", "And then?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    code, _, _ = run_cli(capsys, "chat", "--drafter", "none", "--file", str(tmp_path / "notes.md"))
    assert code == 0 and seen == [["the notes\n\nWhat do they say?"], ["the notes\n\nWhat do they say?", "And then?"]]
    code, _, err = run_cli(capsys, "chat", "--drafter", "none", "--file", str(tmp_path / "missing.md"))
    assert_usage_error(code, err, "missing.md")
    code, _, err = run_cli(capsys, "chat", "--drafter", "none", "--file", "-")
    assert_usage_error(code, err, "give --file a path")


def test_data_on_tiny_target(capsys, tiny_default, tmp_path):
    """data: a user JSONL source answered by the (tiny) target; prints the manifest summary."""
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "hello " * (i + 1)}) + "\n" for i in range(5)))
    out_dir = tmp_path / "out"
    argv = ["data", "--out", str(out_dir), "--sources", str(source), "--max-new-tokens", "3", "--shard-size", "2",
            "--batch-size", "2"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    assert json.loads(out.strip().splitlines()[-1]) == {"num_prompts": 5, "shards_done": 3, "num_shards": 3,
                                                         "response_tokens": 15}
    # A different config in the same folder is a usage error naming the option, before any model loads.
    loaded = len(tiny_default)
    code, _, err = run_cli(capsys, *argv[:-1], "3")
    assert_usage_error(code, err, "another config", "--batch-size 2 there, 3 now")
    assert len(tiny_default) == loaded


@pytest.mark.parametrize("argv, fragments", [(["--sources", "nope"], ["unknown prompt source", "no file"]),
                                             (["--sources", "MISSING"], ["unknown prompt source", "missing.jsonl"]),
                                             (["--shard-size", "0"], ["shard_size"])])
def test_data_bad_arguments(capsys, tiny_default, tmp_path, argv, fragments):
    """data with an unknown source, a missing prompt file or a zero shard size: exit 2 with the reason
    (the missing file's path), before any model is loaded."""
    argv = [str(tmp_path / "missing.jsonl") if a == "MISSING" else a for a in argv]
    code, _, err = run_cli(capsys, "data", "--out", str(tmp_path / "out"), *argv)
    assert_usage_error(code, err, *fragments)
    assert tiny_default == []


# -- the real embedded target -------------------------------------------------------------------

@pytest.mark.slow
def test_empty_raw_prompt_on_real_target(capsys, real_default):
    """SmolLM2, `generate "" --no-chat`: the empty prompt is refused with exit 2, not a traceback."""
    code, _, err = run_cli(capsys, "generate", "", "--no-chat", "--dtype", "float32", "--drafter", "none")
    assert_usage_error(code, err, "empty")


@pytest.mark.slow
def test_generate_end_to_end_on_real_target(capsys, real_default):
    """SmolLM2 with an untrained 2-layer drafter: exit 0, JSON summary last, output identical to AR."""
    code, out, err = run_cli(capsys, "generate", "Say hi", "--max-new-tokens", "8", "--compare-ar", "--json",
                             "--dtype", "float32", "--drafter", "untrained", "--drafter-layers", "0,1")
    assert code == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["identical_to_ar"] is True
    assert summary["new_tokens"] == 8 and summary["method"] == "speculative"
    assert "UNTRAINED" in err and "SmolLM2" in err


def test_the_prompt_from_files_and_standard_input(capsys, tiny_default, tmp_path, monkeypatch):
    """--file puts a file's text before the prompt, '-' reads the prompt from standard input: the same
    output as the same text given inline; a file that cannot be read is a usage error."""
    document = tmp_path / "notes.md"
    document.write_text("some notes\nover two lines")
    base = ["--max-new-tokens", "8", "--drafter", "none", "--no-chat"]
    code, inline, _ = run_cli(capsys, "generate", "some notes\nover two lines\n\nSummarise.", *base)
    assert code == 0
    code, from_file, _ = run_cli(capsys, "generate", "--file", str(document), "Summarise.", *base)
    assert code == 0 and from_file == inline
    monkeypatch.setattr("sys.stdin", io.StringIO("Summarise."))
    code, from_stdin, _ = run_cli(capsys, "generate", "--file", str(document), "-", *base)
    assert code == 0 and from_stdin == inline
    code, _, err = run_cli(capsys, "generate", "--file", str(tmp_path / "missing.md"), "hi", *base)
    assert_usage_error(code, err, "cannot read the prompt from", "missing.md")
    code, _, err = run_cli(capsys, "generate", "--file", "-", "-", *base)
    assert_usage_error(code, err, "standard input ('-') can be read once")
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00")
    code, _, err = run_cli(capsys, "generate", "--file", str(tmp_path / "binary"), "hi", *base)
    assert_usage_error(code, err, "cannot read the prompt from")
