"""The server under load and at its limits, on loopback only (127.0.0.1), over the tiny random target:
16 concurrent streams each equal to its sequential run; a full queue answers 429 with Retry-After;
a client that hangs up (streaming, waiting in the queue, or waiting for a whole answer) frees its
place within a second; the API key, the body limit, the deadline and the graceful shutdown; and
after each of these the server still answers the next request right.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
d3d_server = pytest.importorskip("d3d.server")

from test_generation import tiny_pipeline  # noqa: E402
from test_metrics import parse, value  # noqa: E402
from test_server import COMPLETIONS, expected, running, sse_events  # noqa: E402

Limits = d3d_server.Limits
PROMPT = "hello world"
AR = {"method": "ar"}  # one token per step: a generation's length in steps is known


@pytest.fixture(scope="module")
def pipeline():
    return tiny_pipeline(eos_token_ids=[])


@contextmanager
def serving(pipeline, **limits) -> Iterator[tuple[str, object]]:
    """A server over `pipeline` with these limits: (base URL, the app's Server)."""
    app = d3d_server.create_app(pipeline, "tiny", "speculative", limits=Limits(**limits))
    with running(app) as url:
        yield url, app.state.server


@contextmanager
def slow_steps(pipeline, seconds: float) -> Iterator[None]:
    """Every engine step takes at least `seconds` (so requests overlap)."""
    real = pipeline.steps

    def steps(*args, **kwargs):
        for step in real(*args, **kwargs):
            time.sleep(seconds)
            yield step

    pipeline.steps = steps
    try:
        yield
    finally:
        del pipeline.steps  # back to the class's method


def gauges(url: str, headers: dict | None = None) -> tuple[float, float]:
    """(queue depth, generations in flight) from /metrics."""
    samples, _ = parse(httpx.get(f"{url}/metrics", headers=headers).text)
    return value(samples, "d3d_queue_depth"), value(samples, "d3d_generations_in_flight")


def wait_for(condition, within: float, what: str) -> float:
    """Poll `condition` until true; the seconds it took (fails after `within`)."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within, f"not within {within} s: {what}"
        time.sleep(0.01)
    return time.monotonic() - started


def streamed_text(url: str, body: dict, headers: dict | None = None) -> tuple[str, list[dict]]:
    with httpx.stream("POST", f"{url}{COMPLETIONS}", json={**body, "stream": True}, headers=headers,
                      timeout=60) as response:
        assert response.status_code == 200, response.read()
        events = [json.loads(e) for e in sse_events(response) if e != "[DONE]"]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices")), events


def still_serving(url: str, pipeline, headers: dict | None = None) -> None:
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 8}
    response = httpx.post(f"{url}{COMPLETIONS}", json=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected(pipeline, PROMPT, chat=False, max_new_tokens=8)[0]


# -- concurrency ----------------------------------------------------------------------------------

def test_sixteen_concurrent_streams_each_equal_their_sequential_run(pipeline):
    """16 clients stream at once (greedy and seeded sampling, different prompts and lengths): each gets
    exactly the text, steps and statistics of the same request sent alone; none is lost or mixed."""
    bodies = [{"prompt": f"{word} {i}", "max_tokens": 24 + i, "temperature": 0 if i % 2 else 1.0, "seed": i,
               "d3d": {"steps": True}} for i, word in enumerate(["hello", "the world", "abc", "he said"] * 4)]
    with serving(pipeline, max_queue=16) as (url, _):
        alone = [streamed_text(url, body) for body in bodies]
        together: list = [None] * len(bodies)

        def client(i: int) -> None:
            together[i] = streamed_text(url, bodies[i])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert gauges(url) == (0, 0)
        still_serving(url, pipeline)
    for (text, events), (text_alone, events_alone), body in zip(together, alone, bodies):
        assert text == text_alone and len(text) > 0
        steps = [e["d3d_step"]["pieces"] for e in events if "d3d_step" in e]
        assert steps == [e["d3d_step"]["pieces"] for e in events_alone if "d3d_step" in e]
        assert events[-1]["d3d"]["steps"] == events_alone[-1]["d3d"]["steps"]
        assert sum(e["d3d_step"]["tokens"] == body["max_tokens"] for e in events if "d3d_step" in e) == 1
    assert len({events[0]["id"] for _, events in together}) == len(bodies)


@pytest.mark.parametrize("max_batch", [4, 16])
def test_batched_streams_each_equal_their_solo_run(pipeline, max_batch):
    """--max-batch: 16 clients at once, decoding together in one continuous batch — mixed methods
    (async among them, which is never batched), greedy and seeded sampling, stop strings: each gets
    exactly the text it gets alone from a one-at-a-time server, and but for the greedy gated ones
    (whose gate weighs the batch) the same steps and statistics; /metrics shows forwards that held
    several generations."""
    methods = ["ar", "lookup", "speculative", "drafter", "async"]
    bodies = [{"prompt": f"{word} {i}", "max_tokens": 20 + 2 * i, "temperature": 0 if i % 3 else 0.9, "seed": i,
               "stop": ["q"] if i % 4 == 1 else None, "d3d": {"steps": True, "method": methods[i % 5]}}
              for i, word in enumerate(["hello", "the world", "abc", "he said"] * 4)]
    with serving(pipeline, max_queue=16) as (url, _):
        alone = [streamed_text(url, body) for body in bodies]
    with serving(pipeline, max_queue=16, max_batch=max_batch) as (url, server):
        together: list = [None] * len(bodies)

        def client(i: int) -> None:
            together[i] = streamed_text(url, bodies[i])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert gauges(url) == (0, 0)
        samples, _ = parse(httpx.get(f"{url}/metrics").text)
        assert value(samples, "d3d_batch_sequences_per_forward") > 1.5
        assert value(samples, "d3d_batch_rows_per_forward") >= value(samples, "d3d_batch_sequences_per_forward")
        assert not server.batch.feeds and not len(server.batch.batch)  # every run left the batch
        still_serving(url, pipeline)
    for (text, events), (text_alone, events_alone), body in zip(together, alone, bodies):
        assert text == text_alone and len(text) > 0
        if body["temperature"] == 0 and body["d3d"]["method"] == "speculative":
            continue  # greedy and gated: the gate weighs drafts against the whole batch (same text, other steps)
        steps = [e["d3d_step"]["pieces"] for e in events if "d3d_step" in e]
        assert steps == [e["d3d_step"]["pieces"] for e in events_alone if "d3d_step" in e]
        assert events[-1]["d3d"]["steps"] == events_alone[-1]["d3d"]["steps"]


def test_a_batched_client_that_leaves_frees_its_rows(pipeline):
    """A batched stream whose client hangs up leaves the batch at its next step; the others finish
    with their solo text."""
    long = {"prompt": PROMPT, "temperature": 0, "max_tokens": 100, "stream": True, "d3d": AR}
    other = {"prompt": "the world", "temperature": 0, "max_tokens": 60, "d3d": AR}
    with slow_steps(pipeline, 0.01), serving(pipeline, max_batch=4) as (url, server):
        results: list = []
        thread = threading.Thread(target=lambda: results.append(streamed_text(url, other)[0]))
        thread.start()
        with httpx.Client(base_url=url, timeout=30) as leaving:
            with leaving.stream("POST", COMPLETIONS, json=long) as response:
                lines = response.iter_lines()
                next(lines)
        wait_for(lambda: gauges(url)[1] <= 1, 2.0, "the dropped stream's slot is free")
        thread.join(60)
        wait_for(lambda: not len(server.batch.batch), 2.0, "the batch is empty")
        still_serving(url, pipeline)
    assert results == [expected(pipeline, "the world", chat=False, max_new_tokens=60)[0]]


def test_a_full_queue_answers_429_with_retry_after(pipeline):
    """One generating, two waiting (max_queue 2): the next request is refused at once with 429 and a
    Retry-After in whole seconds; the waiting ones are then served in full."""
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 40, "d3d": AR}
    with slow_steps(pipeline, 0.02), serving(pipeline, max_queue=2) as (url, _):
        results: list = []
        threads = [threading.Thread(target=lambda: results.append(streamed_text(url, body)[0])) for _ in range(3)]
        for thread in threads:
            thread.start()
        wait_for(lambda: gauges(url) == (2, 1), 10, "one generating and two waiting")
        refused = httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=5)
        for thread in threads:
            thread.join(60)
        assert gauges(url) == (0, 0)
        still_serving(url, pipeline)
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    assert results == [expected(pipeline, PROMPT, chat=False, max_new_tokens=40)[0]] * 3


# -- clients that leave ---------------------------------------------------------------------------

def test_a_client_dropped_mid_stream_frees_its_slot_within_a_second(pipeline):
    """A 100-step stream whose client hangs up after the first event: the engine stops and the slot
    is free (no generation in flight) within a second; the next request is served."""
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 100, "stream": True, "d3d": AR}
    with slow_steps(pipeline, 0.05), serving(pipeline) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as leaving:
            with leaving.stream("POST", COMPLETIONS, json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()  # held: dropping the iterator closes the connection
                next(lines)
                assert gauges(url) == (0, 1)
        freed = wait_for(lambda: gauges(url) == (0, 0), 1.0, "the dropped stream's slot is free")
        still_serving(url, pipeline)
    assert freed < 1.0


def test_a_client_leaving_the_queue_or_a_whole_answer_frees_its_place(pipeline):
    """A non-streamed request whose client gives up, while queued and while generating: its queue
    place and then its slot are free within a second; the generation stops early."""
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 100, "d3d": AR}
    with slow_steps(pipeline, 0.05), serving(pipeline) as (url, server):
        holder = threading.Thread(target=streamed_text, args=(url, {**body, "max_tokens": 30}))
        holder.start()
        wait_for(lambda: gauges(url) == (0, 1), 10, "the first request generates")
        with pytest.raises(httpx.ReadTimeout):  # queued behind the first, then gives up
            httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=0.3)
        wait_for(lambda: gauges(url)[0] == 0, 1.0, "the queue place is free")
        holder.join(30)
        wait_for(lambda: gauges(url) == (0, 0), 5, "the first request ended")
        with pytest.raises(httpx.ReadTimeout):  # generating alone, then gives up
            httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=0.5)
        wait_for(lambda: gauges(url) == (0, 0), 1.0, "the generation's slot is free")
        samples, _ = parse(httpx.get(f"{url}/metrics").text)
        still_serving(url, pipeline)
    assert value(samples, "d3d_generations_cancelled_total", reason="disconnected") == 1
    assert value(samples, "d3d_requests_total", endpoint=COMPLETIONS, status=499) == 2


# -- keys, sizes, deadlines, shutdown ---------------------------------------------------------------

def test_an_api_key_guards_every_route_but_health_and_the_page(pipeline):
    key = "s3cret-key"
    good = {"Authorization": f"Bearer {key}"}
    with serving(pipeline, api_key=key) as (url, _):
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/").status_code == 200  # the page holds no data: it asks for the key
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key},
                        {"Authorization": f"Basic {key}"}, {"Authorization": f"Bearer {key}x"}):
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", COMPLETIONS)):
                response = httpx.request(method, f"{url}{path}", headers=headers, json={"prompt": PROMPT})
                assert response.status_code == 401, (headers, path)
                assert response.json()["error"]["code"] == "invalid_api_key"
                assert response.headers["WWW-Authenticate"] == "Bearer"
        assert httpx.get(f"{url}/v1/models", headers=good).status_code == 200
        assert gauges(url, good) == (0, 0)
        still_serving(url, pipeline, good)


def test_an_oversized_body_is_413(pipeline):
    """Over the limit by Content-Length, or by counting a chunked body: 413 in OpenAI's shape."""
    limit = 1000
    with serving(pipeline, max_body_bytes=limit) as (url, _):
        big = json.dumps({"prompt": "a" * limit}).encode()
        declared = httpx.post(f"{url}{COMPLETIONS}", content=big, headers={"content-type": "application/json"})
        chunked = httpx.post(f"{url}{COMPLETIONS}", content=iter([big[:600], big[600:]]),
                             headers={"content-type": "application/json"})
        assert "content-length" not in chunked.request.headers
        still_serving(url, pipeline)
    for response in (declared, chunked):
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "request_too_large" and str(limit) in response.text


def test_the_deadline_ends_a_long_request(pipeline):
    """A 0.5 s deadline and 1.2 s steps: a long answer is a 503, a long stream ends with an error
    event, a request that waits in the queue past it is a 503; the next request is served."""
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 100, "d3d": AR}
    with serving(pipeline, deadline=0.5) as (url, _):
        with slow_steps(pipeline, 1.2):
            whole = httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=30)
            _, events = streamed_text(url, body)
            holder = threading.Thread(target=streamed_text, args=(url, body))
            holder.start()
            wait_for(lambda: gauges(url) == (0, 1), 10, "a request generates")
            queued = httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=30)
            holder.join(30)
        still_serving(url, pipeline)
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "deadline_exceeded"
    assert events[-1]["error"]["code"] == "deadline_exceeded"
    assert queued.status_code == 503 and "waited" in queued.json()["error"]["message"]


def drain(server) -> None:
    """Start the server's graceful shutdown from this (another) thread."""
    asyncio.run_coroutine_threadsafe(server.drain(), server.loop)


@pytest.mark.parametrize("grace", [10.0, 0.0])
def test_shutdown_finishes_or_ends_the_running_generation_and_sends_the_queue_away(pipeline, grace):
    """Draining: the queued request and any new one get 503 at once; the running stream finishes
    within the grace period (10 s), or ends with an error event when there is none (0 s)."""
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 30, "d3d": AR}
    with slow_steps(pipeline, 0.05), serving(pipeline, shutdown_grace=grace) as (url, server):
        outcome: dict = {}
        running_one = threading.Thread(target=lambda: outcome.update(stream=streamed_text(url, body)))
        queued_one = threading.Thread(target=lambda: outcome.update(
            queued=httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=30)))
        running_one.start()
        wait_for(lambda: gauges(url) == (0, 1), 10, "the first request generates")
        queued_one.start()
        wait_for(lambda: gauges(url) == (1, 1), 10, "the second request waits")
        drain(server)
        queued_one.join(10)
        late = httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=30)
        running_one.join(30)
        assert gauges(url) == (0, 0)
    for refused in (outcome["queued"], late):
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    text, events = outcome["stream"]
    if grace:
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert text == expected(pipeline, PROMPT, chat=False, max_new_tokens=30)[0]
    else:
        assert events[-1]["error"]["code"] == "shutting_down"
