"""`d3d serve`, the command: its options reach `d3d.server.serve`, it loads and warms up before it
listens, the engine runs on the thread that called it until Ctrl-C, and bad options or a damaged
drafter are refused with exit 2 before anything listens. The server's HTTP behaviour itself is
tests/test_server.py's.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import d3d.generation
from d3d.batch import MAX_BATCH
from d3d.prefix_cache import PREFIX_CACHE_MB
from d3d.cli import main
from d3d.drafter import Drafter
from test_generation import tiny_pipeline, tiny_target
from test_server import COMPLETIONS, PROMPT, d3d_server, expected, httpx


@pytest.fixture
def tiny_loading(monkeypatch):
    """The CLI's model loading gives the tiny target (no real model is loaded)."""
    monkeypatch.setattr(d3d.generation, "load_target",
                        lambda source=None, dtype=torch.bfloat16, weights="stored": tiny_target())


def test_serve_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for option in ("--host", "--port", "--method", "--model-name", "--target", "--drafter", "--dtype",
                   "--max-queue", "--deadline", "--max-body-bytes", "--api-key", "--shutdown-grace"):
        assert option in out


def test_serve_wires_its_arguments(monkeypatch, tiny_loading):
    """The handler loads the pipeline and hands host, port, model name, method and limits to
    d3d.server.serve; the API key comes from --api-key, else from $D3D_API_KEY."""
    calls = []
    monkeypatch.setattr(d3d_server, "serve", lambda *args: calls.append(args))
    monkeypatch.setenv("D3D_API_KEY", "from-env")
    assert main(["serve", "--host", "0.0.0.0", "--port", "9001", "--method", "lookup", "--drafter", "none",
                 "--model-name", "mine", "--max-queue", "3", "--deadline", "0", "--max-body-bytes", "99",
                 "--api-key", "k", "--shutdown-grace", "2", "--max-batch", "4", "--prefix-cache", "0"]) == 0
    assert main(["serve", "--drafter", "none"]) == 0
    (pipeline, *rest), (_, *defaults) = calls
    assert pipeline.target.name == "tiny-random" and pipeline.drafter is None
    assert rest == ["0.0.0.0", 9001, "mine", "lookup", d3d_server.Limits(3, None, 99, "k", 2.0, max_batch=4)]
    assert defaults == ["127.0.0.1", 8000, "SmolLM2-135M-Instruct", "speculative",
                        d3d_server.Limits(api_key="from-env", max_batch=MAX_BATCH, prefix_cache_mb=PREFIX_CACHE_MB)]
    assert main(["serve", "--drafter", "none", "--max-queue", "-1"]) == 2
    assert main(["serve", "--drafter", "none", "--max-batch", "0"]) == 2
    assert main(["serve", "--drafter", "none", "--prefix-cache", "-1"]) == 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_runs_the_engine_on_its_own_thread_until_interrupted(monkeypatch, tiny_loading, capsys):
    """`d3d serve`: uvicorn listens in a background thread while every engine call runs on the thread
    that called serve (torch is slower from other threads); a request is answered right, Ctrl-C
    (KeyboardInterrupt on that thread) stops it cleanly with exit 0."""
    import _thread

    port = free_port()
    engine_threads, answers = set(), []
    real_steps = d3d.generation.Pipeline.steps

    def steps(self, *args, **kwargs):
        for step in real_steps(self, *args, **kwargs):
            engine_threads.add(threading.get_ident())
            yield step

    monkeypatch.setattr(d3d.generation.Pipeline, "steps", steps)

    def ask() -> None:
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                for _ in range(1200):  # up to a minute for start-up on a loaded machine
                    try:
                        http.get("/health")
                        break
                    except httpx.ConnectError:
                        time.sleep(0.05)
                body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 6}
                answers.append(http.post(COMPLETIONS, json=body).json())
                answers.append(http.post(COMPLETIONS, json={**body, "stream": True}).text)
        finally:
            _thread.interrupt_main()

    asker = threading.Thread(target=ask)
    asker.start()
    assert main(["serve", "--port", str(port), "--drafter", "none", "--model-name", "mine"]) == 0
    asker.join(10)
    assert engine_threads == {threading.get_ident()}
    answer, stream = answers
    reference = expected(tiny_pipeline(drafter=False), PROMPT, chat=False, max_new_tokens=6)[0]
    assert answer["model"] == "mine" and answer["choices"][0]["text"] == reference
    events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == reference
    assert stream.rstrip().endswith("data: [DONE]")


def test_warm_up_pays_the_one_time_costs_before_the_first_request(monkeypatch, tmp_path):
    """warm_up runs the server's method, the drafter alone and plain decoding once; afterwards a
    request's generation neither measures nor probes the gate's costs."""
    import d3d.costs

    monkeypatch.setenv("D3D_CACHE", str(tmp_path))
    d3d.costs._measured.clear()
    d3d.costs._probed.clear()
    pipeline, methods = tiny_pipeline(eos_token_ids=[]), []
    real_steps = d3d.generation.Pipeline.steps

    def steps(self, prompt_ids, config, method="speculative"):
        methods.append(method)
        return real_steps(self, prompt_ids, config, method)

    monkeypatch.setattr(d3d.generation.Pipeline, "steps", steps)
    assert d3d_server.warm_up(pipeline, "speculative") > 0
    assert methods == ["speculative", "drafter", "ar"]
    monkeypatch.setattr(d3d.costs, "measure", lambda *args, **kwargs: pytest.fail("measured inside a request"))
    monkeypatch.setattr(d3d.costs, "probe_step_ms", lambda *args: pytest.fail("probed inside a request"))
    assert expected(pipeline, PROMPT, chat=False, max_new_tokens=8)[2] == 8


def test_serve_warms_up_before_it_listens(monkeypatch, tiny_loading, capsys):
    order = []
    monkeypatch.setattr(d3d_server, "warm_up", lambda pipeline, method: order.append(("warm", method)) or 0.5)

    class Listener:
        started = True
        should_exit = False

        def __init__(self, config) -> None:
            pass

        def run(self) -> None:
            order.append("listen")

    monkeypatch.setattr(d3d_server.uvicorn, "Server", Listener)
    assert main(["serve", "--drafter", "none", "--method", "lookup", "--port", str(free_port())]) == 0
    assert order == [("warm", "lookup"), "listen"]
    assert "# warmed up in 0.5 s" in capsys.readouterr().err


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                             ("0.0.0.0", False), ("192.168.1.5", False), ("example.org", False)])
def test_binding_beyond_loopback_without_a_key_warns(monkeypatch, capsys, host, loopback):
    """serve() warns before listening on a non-loopback address without an API key, not with one."""
    class NotListening:  # uvicorn.Server stand-in: returns at once, never started
        def __init__(self, config):
            self.started, self.should_exit = False, False

        def run(self):
            pass

    monkeypatch.setattr(d3d_server.uvicorn, "Server", NotListening)
    pipeline = tiny_pipeline(drafter=False)
    for key in (None, "k"):
        with pytest.raises(d3d_server.ConfigError, match="could not serve"):
            d3d_server.serve(pipeline, host, 1, "tiny", "lookup", d3d_server.Limits(api_key=key))
        warned = "WARNING" in capsys.readouterr().err
        assert warned == (key is None and not loopback)


def test_serve_refuses_a_method_without_its_drafter(tiny_loading, capsys):
    assert main(["serve", "--method", "drafter", "--drafter", "none"]) == 2
    assert "needs a drafter" in capsys.readouterr().err


def test_serve_refuses_a_damaged_drafter(tiny_loading, capsys, tmp_path):
    """`d3d serve --drafter FOLDER` with NaN weights: exit 2 naming the tensor, before listening."""
    target = tiny_target()
    Drafter.from_target(target.decoder, [0], block_size=4).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["decoder.norm.weight"][0] = float("nan")
    save_file(state, str(tmp_path / "model.safetensors"))
    assert main(["serve", "--drafter", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "d3d: error:" in err and "decoder.norm.weight holds NaN" in err and "serving" not in err


def test_main_thread_runner_keeps_order_and_hands_back_errors():
    """MainThread: calls run on the working thread in submission order, a close queued after a call
    runs after it, and an exception in a call reaches the awaiting request."""
    runner, done, order, results = d3d_server.MainThread(), threading.Event(), [], []

    def boom():
        raise ValueError("bad")

    async def requests():
        results.append(await runner.run(threading.get_ident))

        class Closing:
            def close(self):
                order.append("close")
        runner.close(Closing())
        results.append(await runner.run(lambda: order.append("after") or 7))
        try:
            await runner.run(boom)
        except ValueError as error:
            results.append(str(error))
        done.set()

    loop_thread = threading.Thread(target=lambda: __import__("asyncio").run(requests()))
    loop_thread.start()
    runner.work(done)
    loop_thread.join(10)
    assert results == [threading.get_ident(), 7, "bad"]
    assert order == ["close", "after"]
