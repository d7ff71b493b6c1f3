"""The OpenAI-compatible server, end to end: a real uvicorn server on a free localhost port, over the
tiny random target with the byte tokenizer, spoken to by the official `openai` client (and by
httpx where the wire format itself is under test: raw SSE lines, malformed JSON).

What matters most: the served text is exactly `Pipeline.generate`'s (and plain AR's at T = 0),
streamed or not; bad input is an OpenAI-shaped 400, never a 500; a client that hangs up mid-stream
stops its generation and frees the server for the next request.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from test_generation import tiny_pipeline

# The server and its client are extras (`pip install -e ".[dev]"`); without them this module is skipped.
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
d3d_server = pytest.importorskip("d3d.server")  # needs fastapi
create_app = d3d_server.create_app

MODEL = "tiny-d3d"
PROMPT = "hello world"
MESSAGES = [{"role": "user", "content": PROMPT}]


@contextmanager
def running(app) -> Iterator[str]:
    """Serve `app` with uvicorn in a background thread on a free port; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def pipeline():
    return tiny_pipeline(eos_token_ids=[])  # no EOS: generations end at max_tokens or a stop string


@pytest.fixture(scope="module")
def base_url(pipeline) -> Iterator[str]:
    with running(create_app(pipeline, MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def http(base_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=30) as http:
        yield http


def expected(pipeline, prompt, chat: bool = True, **kwargs) -> tuple[str, str, int]:
    """What `Pipeline.generate` gives: text, finish reason and committed tokens."""
    chunks = list(pipeline.generate(prompt, chat=chat, **kwargs))
    return "".join(c.text for c in chunks), chunks[-1].finish_reason, sum(len(c.step.tokens) for c in chunks)


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an event stream, in order."""
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


# -- routes -------------------------------------------------------------------------------------

def test_models_and_health(client, http):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert http.get("/health").json() == {"status": "ok"}


def test_unknown_route_is_an_openai_error(http):
    response = http.get("/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"


# -- lossless text --------------------------------------------------------------------------------

def test_chat_is_the_pipeline_text_and_plain_ar_text(client, pipeline):
    """Non-streamed chat at T = 0: the served text is Pipeline.generate's, which is plain AR's."""
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40)
    text, _, _ = expected(pipeline, MESSAGES, max_new_tokens=40)
    assert text and response.choices[0].message.content == text
    assert expected(pipeline, MESSAGES, max_new_tokens=40, method="ar")[0] == text
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].finish_reason == "length"
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.model == MODEL
    prompt_tokens = len(pipeline.encode(MESSAGES))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, 40)
    assert response.usage.total_tokens == prompt_tokens + 40
    stats = response.model_extra["d3d"]
    assert stats["method"] == "speculative"
    assert stats["tau"] >= 1.0 and 0 <= stats["accepted"] <= stats["drafted"]
    assert stats["tokens_per_second"] > 0


def test_completion_is_the_raw_prompt_pipeline_text(client, pipeline):
    """/v1/completions applies no chat template: the text of the raw prompt, equal to plain AR's."""
    response = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=30)
    text, _, _ = expected(pipeline, PROMPT, chat=False, max_new_tokens=30)
    assert response.choices[0].text == text
    assert expected(pipeline, PROMPT, chat=False, max_new_tokens=30, method="ar")[0] == text
    assert text != expected(pipeline, PROMPT, max_new_tokens=30)[0]  # the template does change it
    assert response.object == "text_completion" and response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(pipeline.encode(PROMPT, chat=False))
    assert response.usage.completion_tokens == 30


def test_streamed_chat_concatenates_to_the_same_text(client, pipeline):
    """Deltas join to the non-streamed text; the finish reason and d3d object come last, then usage."""
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text, _, _ = expected(pipeline, MESSAGES, max_new_tokens=40)
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == text
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in with_choices] == [None] * (len(with_choices) - 1) + ["length"]
    assert with_choices[-1].model_extra["d3d"]["method"] == "speculative"
    assert len(with_choices) > 3  # streamed in pieces, not in one
    assert all(c.usage is None for c in with_choices)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 40
    assert usage.usage.prompt_tokens == len(pipeline.encode(MESSAGES))


def test_streamed_completion_wire_format(http, pipeline):
    """Raw SSE: every event is `data: {json}`, the last one `data: [DONE]`; no usage unless asked."""
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 25, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert all(p["object"] == "text_completion" and "usage" not in p for p in payloads)
    text = "".join(p["choices"][0]["text"] for p in payloads)
    assert text == expected(pipeline, PROMPT, chat=False, max_new_tokens=25)[0]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length" and "d3d" in payloads[-1]
    assert len({p["id"] for p in payloads}) == 1


def test_a_prompt_starting_with_computed_tokens_reuses_their_positions(pipeline):
    """With a prefix cache (`d3d serve --prefix-cache`), a prompt that begins with tokens an ended
    generation computed — a longer prompt, the same request again — computes only the rest: usage
    reports the cached prompt tokens as OpenAI does (`prompt_tokens_details.cached_tokens`), /metrics
    counts them, and every answer is exactly that of a server without the cache, batched or not."""
    longer = PROMPT + " and more"
    for max_batch in (1, 4):
        served = tiny_pipeline(eos_token_ids=[])
        app = create_app(served, MODEL, limits=d3d_server.Limits(prefix_cache_mb=8, max_batch=max_batch))
        with running(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
            first = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=20)
            assert first.choices[0].text == expected(pipeline, PROMPT, chat=False, max_new_tokens=20)[0]
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            second = client.completions.create(model=MODEL, prompt=longer, temperature=0, max_tokens=20)
            assert second.choices[0].text == expected(pipeline, longer, chat=False, max_new_tokens=20)[0]
            assert second.usage.prompt_tokens_details.cached_tokens == len(pipeline.encode(PROMPT, chat=False))
            chats = []
            for _ in range(2):  # the same streamed chat twice: the second reuses all but the last prompt token
                stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20,
                                                        stream=True, stream_options={"include_usage": True})
                events = list(stream)
                chats.append(("".join(e.choices[0].delta.content or "" for e in events if e.choices),
                              events[-1].usage))
            assert chats[0][0] == chats[1][0] == expected(pipeline, MESSAGES, max_new_tokens=20)[0]
            assert chats[1][1].prompt_tokens_details.cached_tokens == chats[1][1].prompt_tokens - 1
            cached = sum(usage.prompt_tokens_details.cached_tokens for usage in (first.usage, second.usage,
                                                                                 chats[0][1], chats[1][1]))
            prompt = sum(usage.prompt_tokens for usage in (first.usage, second.usage, chats[0][1], chats[1][1]))
            metrics = httpx.get(f"{url}/metrics").text
            assert f"d3d_prompt_tokens_cached_total {cached}" in metrics and f"d3d_prompt_tokens_total {prompt}" in metrics
            assert httpx.post(f"{url}/reset_prefix_cache").json()["cleared"] >= 2  # then the same chat computes all
            events = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20,
                                                         stream=True, stream_options={"include_usage": True}))
            assert events[-1].usage.prompt_tokens_details.cached_tokens == 0


# -- stopping -----------------------------------------------------------------------------------

def test_stop_string_ends_the_text(client, pipeline):
    """A stop string cuts the text before it, finish_reason "stop", streamed or not; usage counts the
    tokens plain AR decoding needed to reach it, though a speculative step committed more."""
    full, _, _ = expected(pipeline, MESSAGES, max_new_tokens=40)
    for start in range(len(full) - 2):  # a stop string inside a multi-token step
        stop = full[start:start + 2]
        text, reason, committed = expected(pipeline, MESSAGES, max_new_tokens=40, stop=[stop])
        ar_text, _, ar_tokens = expected(pipeline, MESSAGES, max_new_tokens=40, stop=[stop], method="ar")
        if "\ufffd" not in stop and committed > ar_tokens:
            break
    assert committed > ar_tokens, "no stop string ends inside a speculative step"
    assert reason == "stop" and text == ar_text == full[:full.find(stop)]
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40,
                                              stop=stop)
    assert response.choices[0].message.content == text
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == ar_tokens
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40,
                                            stop=["zzzz", stop], stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_eos_is_finish_reason_stop(client, pipeline, monkeypatch):
    """The target's EOS ends the generation with OpenAI's "stop"."""
    tokens = [t for c in pipeline.generate(MESSAGES, max_new_tokens=20) for t in c.step.tokens]
    monkeypatch.setattr(pipeline.target, "eos_token_ids", [tokens[6]])
    text, reason, count = expected(pipeline, MESSAGES, max_new_tokens=20)
    assert reason == "eos" and count <= 7
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20)
    assert response.choices[0].message.content == text
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == count


def test_max_completion_tokens_wins_over_max_tokens(client):
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=10,
                                              max_completion_tokens=3)
    assert response.usage.completion_tokens == 3
    assert response.choices[0].finish_reason == "length"


# -- sampling -----------------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible(client, pipeline):
    """At T = 1 a seed fixes the output: the same text twice, equal to Pipeline.generate's; an omitted
    temperature is OpenAI's default 1.0; top_k (an extension) is honoured."""
    def sample(**kwargs) -> str:
        response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, **kwargs)
        return response.choices[0].text

    first = sample(temperature=1.0, seed=7)
    assert first == sample(temperature=1.0, seed=7) == sample(seed=7)
    assert first == expected(pipeline, PROMPT, chat=False, max_new_tokens=30, temperature=1.0, seed=7)[0]
    assert first != sample(temperature=1.0, seed=8)
    top_k = sample(temperature=1.0, seed=7, extra_body={"top_k": 3})
    assert top_k == expected(pipeline, PROMPT, chat=False, max_new_tokens=30, temperature=1.0, top_k=3, seed=7)[0]


# -- bad input ------------------------------------------------------------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.mark.parametrize("path, body, param, fragment", [
    (CHAT, '{"messages": [', None, "not valid JSON"),
    (CHAT, "[1, 2]", None, "object"),
    (CHAT, {"model": MODEL}, "messages", "messages"),
    (CHAT, {"messages": []}, "messages", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content", "text"),
    (COMPLETIONS, {"prompt": ""}, "prompt", "empty"),
    (COMPLETIONS, {"prompt": "a" * 200}, "prompt", "context"),
    (COMPLETIONS, {"prompt": ["one", "two"]}, "prompt", "one prompt"),
    (CHAT, {"messages": MESSAGES, "n": 2}, "n", "n = 1"),
    (COMPLETIONS, {"prompt": PROMPT, "best_of": 3}, "best_of", "best_of"),
    (COMPLETIONS, {"prompt": PROMPT, "logprobs": 2}, "logprobs", "on /v1/chat/completions only"),
    (COMPLETIONS, {"prompt": PROMPT, "logprobs": 0}, "logprobs", "on /v1/chat/completions only"),
    (CHAT, {"messages": MESSAGES, "logprobs": 2}, "logprobs", "a boolean on chat completions"),
    (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "set logprobs to true"),
    (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 65}, "top_logprobs", "must be in [0, 64], got 65"),
    (CHAT, {"messages": MESSAGES, "logprobs": True, "d3d": {"method": "async"}}, "logprobs", "method 'async'"),
    (CHAT, {"messages": MESSAGES, "presence_penalty": 0.5}, "presence_penalty", "distribution"),
    (CHAT, {"messages": MESSAGES, "frequency_penalty": -1}, "frequency_penalty", "distribution"),
    (CHAT, {"messages": MESSAGES, "logit_bias": {"5": 3}}, "logit_bias", "distribution"),
    (CHAT, {"messages": MESSAGES, "temperature": -1}, "temperature", "temperature"),
    (CHAT, {"messages": MESSAGES, "temperature": "hot"}, "temperature", "temperature"),
    (COMPLETIONS, {"prompt": PROMPT, "top_p": 2}, "top_p", "top_p"),
    (COMPLETIONS, {"prompt": PROMPT, "top_k": -1}, "top_k", "top_k"),
    (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 0}, "max_tokens", "max_tokens"),
    (COMPLETIONS, {"prompt": PROMPT, "stream": True, "temperature": -1}, "temperature", "temperature"),
    (COMPLETIONS, '{"prompt": "hello", "temperature": 1e999}', "temperature", "temperature must be a finite number"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature", "finite"),
    (COMPLETIONS, '{"prompt": "hello", "stream": true, "temperature": Infinity}', "temperature", "finite"),
    (COMPLETIONS, '{"prompt": "hello", "top_p": NaN}', "top_p", "top_p"),
    (CHAT, {"messages": [{"role": "user", "content": "a" * 200}]}, "messages", "context"),
    # OpenAI's limits: its roles, at most 4 stop strings; text that is valid Unicode
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages",
     "messages.0.role: Input should be 'system', 'user', 'assistant', 'developer' or 'tool'"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]}, "messages.1.role",
     "tool calling is not supported"),
    (COMPLETIONS, {"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 stop sequences, got 5"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}', "messages.0.content",
     "messages[0].content: a lone surrogate (U+D800 at character 3) is not valid Unicode text"),
    (COMPLETIONS, '{"prompt": "a\\udc00b"}', "prompt", "prompt: a lone surrogate (U+DC00 at character 1)"),
    (COMPLETIONS, '{"prompt": "hello", "stop": ["x", "\\ud800"]}', "stop", "stop[1]: a lone surrogate"),
])
def test_bad_input_is_an_openai_400(http, path, body, param, fragment):
    """Malformed, missing, out-of-range or unsupported input: 400 in OpenAI's error shape, never a
    422/500 or a traceback, and nothing streamed."""
    if isinstance(body, str):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert fragment in error["message"], error["message"]
    assert "Traceback" not in response.text


def test_a_developer_message_is_the_system_message_and_four_stops_are_fine(http, pipeline):
    """OpenAI's "developer" role (its newer models' system message) reaches the chat template as
    "system"; four stop strings are within OpenAI's limit."""
    from d3d.openai_schema import ChatRequest, chat_job

    developer = [{"role": "developer", "content": "be brief"}, *MESSAGES]
    system = [{"role": "system", "content": "be brief"}, *MESSAGES]
    assert chat_job(ChatRequest(messages=developer)).prompt == system
    answer = http.post(CHAT, json={"messages": developer, "temperature": 0, "max_tokens": 8}).json()
    assert answer["choices"][0]["message"]["content"] == expected(pipeline, system, max_new_tokens=8)[0]
    four = http.post(COMPLETIONS, json={"prompt": PROMPT, "temperature": 0, "max_tokens": 8,
                                        "stop": ["\u0000", "\u0001", "\u0002", "\u0003"]})
    assert four.status_code == 200


def test_the_server_keeps_serving_after_bad_input(http, pipeline):
    """Each refused request leaves the server (and its one-generation lock) ready for the next one."""
    reference = expected(pipeline, PROMPT, chat=False, max_new_tokens=6)[0]
    for bad in ('{"prompt": "hello", "temperature": 1e999}', '{"prompt": ""}', '{"prompt": "%s"}' % ("a" * 200)):
        response = http.post(COMPLETIONS, content=bad, headers={"content-type": "application/json"})
        assert response.status_code == 400
        good = http.post(COMPLETIONS, json={"prompt": PROMPT, "temperature": 0, "max_tokens": 6})
        assert good.status_code == 200 and good.json()["choices"][0]["text"] == reference


def test_openai_client_sees_bad_request(client):
    """The official client raises BadRequestError carrying our message and param."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2)
    assert raised.value.status_code == 400
    assert raised.value.param == "n" and raised.value.code == "unsupported_parameter"


def test_unknown_fields_are_ignored_and_any_model_name_is_served(http, pipeline):
    body = {"model": "gpt-4o", "messages": MESSAGES, "temperature": 0, "max_tokens": 8, "user": "x",
            "something_new": {"a": 1}, "n": 1, "presence_penalty": 0, "logprobs": False}
    response = http.post(CHAT, json=body)
    assert response.status_code == 200
    assert response.json()["model"] == MODEL
    assert response.json()["choices"][0]["message"]["content"] == expected(pipeline, MESSAGES, max_new_tokens=8)[0]


# -- the d3d extension and the page -----------------------------------------------------------------

def step_events(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(e) for e in sse_events(response) if e != "[DONE]"]


@pytest.mark.parametrize("method", ["lookup", "drafter", "ar"])
def test_step_facts_colour_every_token_by_its_origin(http, pipeline, method):
    """With {"d3d": {"steps": true}} every engine step is an event whose pieces join to the streamed
    text; a piece's origin is the step's draft source for accepted drafts, else "target"; the text
    is the method's own (and so plain AR's). The chosen method overrides the server's."""
    body = {"prompt": "hello hello hello hello", "temperature": 0, "max_tokens": 40, "stream": True,
            "d3d": {"method": method, "steps": True}}
    events = step_events(http, COMPLETIONS, body)
    steps = [e["d3d_step"] for e in events if "d3d_step" in e]
    chunks = list(pipeline.generate("hello hello hello hello", chat=False, max_new_tokens=40, method=method))
    assert len(steps) == len(chunks)  # one event per engine step, also when its text is held back
    text = "".join(e["choices"][0]["text"] for e in events)
    assert text == "".join(c.text for c in chunks) == expected(pipeline, "hello hello hello hello", chat=False,
                                                               max_new_tokens=40, method="ar")[0]
    assert "".join(piece for step in steps for piece, _ in step["pieces"]) == text
    origins = {origin for step in steps for _, origin in step["pieces"]}
    for step, chunk in zip(steps, chunks):
        assert (step["source"], step["accepted"], step["drafted"]) == (
            chunk.step.source, chunk.step.num_accepted, chunk.step.num_drafted)
    if method == "lookup":
        assert origins == {"lookup", "target"}  # the repetitive prompt makes lookup drafts land
    if method == "ar":
        assert origins == {"target"} and steps[-1]["tau"] == 1.0
    assert events[-1]["d3d"]["method"] == method
    assert steps[-1]["tokens"] == 40 and steps[-1]["tau"] == events[-1]["d3d"]["tau"]
    assert len(steps[-1]["acceptance_rate"]) == (0 if method == "ar" else max(s["drafted"] for s in steps))


def test_chat_step_facts_and_the_plain_stream_is_unchanged(http, pipeline):
    """Chat with steps: the first event carries the role, later ones may have an empty delta; without
    the extension no event carries d3d_step (the OpenAI wire format is unchanged)."""
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 12, "stream": True}
    with_steps = step_events(http, CHAT, {**body, "d3d": {"steps": True}})
    plain = step_events(http, CHAT, body)
    assert with_steps[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("d3d_step" in e for e in with_steps[:-1]) and not any("d3d_step" in e for e in plain)
    join = lambda events: "".join(e["choices"][0]["delta"].get("content") or "" for e in events)  # noqa: E731
    assert join(with_steps) == join(plain) == expected(pipeline, MESSAGES, max_new_tokens=12)[0]


@pytest.mark.parametrize("body, param, fragment", [
    ({"prompt": PROMPT, "d3d": {"method": "fastest"}}, "d3d", "speculative"),
    ({"prompt": PROMPT, "d3d": {"stepz": True}}, "d3d", "stepz"),
    ({"prompt": PROMPT, "d3d": {"steps": True}}, "d3d", "stream"),
    ({"prompt": PROMPT, "d3d": "ar"}, "d3d", "d3d"),
])
def test_bad_extension_is_a_400(http, body, param, fragment):
    response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and fragment in response.json()["error"]["message"]


def test_a_method_needing_a_missing_drafter_is_a_400():
    with running(create_app(tiny_pipeline(drafter=False), MODEL, "lookup")) as url:
        response = httpx.post(f"{url}{COMPLETIONS}", json={"prompt": PROMPT, "d3d": {"method": "drafter"}})
    assert response.status_code == 400 and "needs a drafter" in response.json()["error"]["message"]


def test_the_view_is_one_offline_page(http):
    """/ serves the live view: an HTML page with its script and style inline, loading nothing else."""
    response = http.get("/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    page = response.text
    assert 'id="prompt"' in page and 'id="tau"' in page and "steps" in page
    assert "<script>" in page and "<style>" in page
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:)?//""", page)  # no CDN, no remote font
    assert not re.search(r"""fetch\(\s*["']https?:""", page)


# -- one generation at a time ---------------------------------------------------------------------

@pytest.fixture
def slow_steps(pipeline, monkeypatch):
    """Make every engine step take 20 ms and record steps, closures and how many ran at once."""
    real_steps = pipeline.steps
    record = {"taken": [], "closed": threading.Event(), "active": 0, "most_active": 0}
    guard = threading.Lock()

    def steps(*args, **kwargs):
        with guard:
            record["active"] += 1
            record["most_active"] = max(record["most_active"], record["active"])
        try:
            for step in real_steps(*args, **kwargs):
                record["taken"].append(step)
                time.sleep(0.02)
                yield step
        finally:
            with guard:
                record["active"] -= 1
            record["closed"].set()

    monkeypatch.setattr(pipeline, "steps", steps)
    return record


def test_disconnect_mid_stream_stops_the_generation(base_url, client, pipeline, slow_steps):
    """A client hanging up after the first event closes the engine's generator early and releases
    the lock: the next request is served at once."""
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 100, "stream": True}
    with httpx.Client(base_url=base_url, timeout=30) as hanging_up:
        with hanging_up.stream("POST", COMPLETIONS, json=body) as response:
            assert response.status_code == 200
            next(response.iter_lines())
    assert slow_steps["closed"].wait(10), "the generation was never closed"
    assert slow_steps["taken"][-1].finish_reason is None  # stopped before its 100 tokens
    started = time.monotonic()
    response = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=5, timeout=10)
    assert response.choices[0].text == expected(pipeline, PROMPT, chat=False, max_new_tokens=5)[0]
    assert time.monotonic() - started < 5


def test_concurrent_requests_are_served_one_at_a_time(client, pipeline, slow_steps):
    """Requests arriving together queue on the lock: never two generations at once, each text right."""
    prompts = ["hello", "the world", "hello world"]
    results: dict[str, str] = {}

    def ask(prompt: str) -> None:
        response = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6)
        results[prompt] = response.choices[0].text

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert slow_steps["most_active"] == 1
    for prompt in prompts:
        assert results[prompt] == expected(pipeline, prompt, chat=False, max_new_tokens=6)[0]
