"""OpenAI-compatible HTTP API over a `Pipeline`: chat and text completions, streamed or not.

Each request becomes one `Pipeline` generation — the same chunk generator the CLI and the benchmark
consume — so the text is exactly what `Pipeline.generate` gives for the same parameters, and at
temperature 0 exactly what plain autoregressive decoding gives. Responses and errors follow
OpenAI's shapes; a `d3d` object adds the decoding statistics (τ = tokens per verification step,
bonus token included).

What it is not: a batching server. The engines decode one sequence at a time, so generations run
one after another under a lock and requests wait their turn. Parameters that would change the
sampled distribution (penalties, logit_bias) or that the engines cannot give (n > 1, logprobs)
are refused with a 400, never silently ignored.
"""

from __future__ import annotations

import asyncio
import json
import queue
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio.to_thread
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from d3d.config import ConfigError
from d3d.engine import PromptError
from d3d.generation import METHODS, Chunk, Method, Pipeline
from d3d.stats import SpecStats

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # ours → OpenAI's
SAMPLING_FIELDS = ("temperature", "top_k", "top_p")  # what a ConfigError from sampling names first
ONE_SEQUENCE = "the engine decodes one sequence at a time"
CHANGES_DISTRIBUTION = "it changes the distribution that lossless decoding reproduces exactly"

# Parameters refused unless left at their defaults: (field, is it asked for?, why not).
REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("n", lambda v: v not in (None, 1), f"only n = 1 is supported: {ONE_SEQUENCE}"),
    ("best_of", lambda v: v not in (None, 1), f"only best_of = 1 is supported: {ONE_SEQUENCE}"),
    ("logprobs", bool, "logprobs are not supported by this server"),
    ("top_logprobs", bool, "logprobs are not supported by this server"),
    ("presence_penalty", bool, f"penalties are not supported: {CHANGES_DISTRIBUTION}"),
    ("frequency_penalty", bool, f"penalties are not supported: {CHANGES_DISTRIBUTION}"),
    ("logit_bias", bool, f"logit_bias is not supported: {CHANGES_DISTRIBUTION}"),
    ("echo", bool, "echo is not supported"),
    ("suffix", bool, "suffix (insertion) is not supported"),
    ("tools", bool, "tool calling is not supported"),
    ("response_format", lambda v: bool(v) and v.get("type") != "text", "only the text response format is supported"),
)


# -- requests -----------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    include_usage: bool | None = False  # a last chunk with the usage and no choices


class SamplingRequest(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored; null means the default."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # any name is accepted: the server serves one model
    max_tokens: int | None = None  # None: until EOS, a stop string or the end of the context
    temperature: float | None = None  # None: 1.0, OpenAI's default (0 = greedy)
    top_p: float | None = None  # None: 1.0 (off)
    top_k: int | None = None  # extension; None or 0: off
    seed: int | None = None  # makes sampling at temperature > 0 reproducible
    stop: str | list[str] | None = None  # stop strings, not included in the text
    stream: bool | None = False  # Server-Sent Events in OpenAI's chunk format
    stream_options: StreamOptions | None = None
    # Refused unless left at their defaults (see REFUSED):
    n: int | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins over it
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str]  # a raw prompt (no chat template); a list must hold exactly one
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ApiError(Exception):
    """A request the server cannot serve: an OpenAI-shaped error response."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


@dataclass
class Job:
    """One request in the pipeline's terms."""

    chat: bool  # chat completion (messages through the chat template) or raw text completion
    prompt: str | list[dict[str, str]]
    max_new_tokens: int | None  # None: until the context is full
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool


def make_job(request: SamplingRequest, chat: bool, prompt: str | list[dict[str, str]],
             max_tokens: int | None) -> Job:
    for name, asked, why in REFUSED:
        if asked(getattr(request, name, None)):
            raise ApiError(f"{name}: {why}", param=name, code="unsupported_parameter")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    options = request.stream_options
    return Job(chat, prompt, max_tokens, 1.0 if request.temperature is None else request.temperature,
               request.top_k or 0, 1.0 if request.top_p is None else request.top_p, request.seed, stop,
               bool(request.stream), bool(options and options.include_usage))


def chat_job(request: ChatRequest) -> Job:
    messages = []
    for i, message in enumerate(request.messages):
        content = message.content
        if isinstance(content, list):
            others = [part.type for part in content if part.type != "text"]
            if others:
                raise ApiError(f"messages[{i}].content: only text parts are supported, got {others[0]!r}",
                               param=f"messages.{i}.content")
            content = "\n".join(part.text or "" for part in content)
        messages.append({"role": message.role, "content": content or ""})
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    return make_job(request, True, messages, max_tokens)


def completion_job(request: CompletionRequest) -> Job:
    prompt = request.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(f"prompt: send one prompt per request ({ONE_SEQUENCE})", param="prompt")
        prompt = prompt[0]
    return make_job(request, False, prompt, request.max_tokens)


# -- generation ---------------------------------------------------------------------------------

@dataclass
class Generation:
    """A started generation: it holds the server's lock until `Server.end`."""

    prompt_ids: list[int]
    first: Chunk  # taken before answering, so that bad input is a 400 and not a broken stream
    chunks: Iterator[Chunk]  # the rest
    ended: bool = False


def start_generation(pipeline: Pipeline, job: Job, method: Method) -> Generation:
    """Encode the prompt, start the engine and take its first chunk (blocking: run in a worker thread)."""
    context = pipeline.target.decoder.config.max_position_embeddings
    try:
        config = pipeline.generation_config(job.max_new_tokens or context, job.temperature, job.top_k,
                                            job.top_p, job.seed)
    except ConfigError as error:
        named = next((name for name in SAMPLING_FIELDS if str(error).startswith(name)), None)
        raise ApiError(str(error), param=named) from None
    param = "messages" if job.chat else "prompt"
    try:
        prompt_ids = pipeline.encode(job.prompt, chat=job.chat)
    except Exception as error:  # a chat template or tokenizer refusing this input is the input's fault
        raise ApiError(f"{param} cannot be encoded: {error}", param=param) from None
    chunks = pipeline.stream_text(pipeline.steps(prompt_ids, config, method), job.stop)
    try:
        first = next(chunks)
    except PromptError as error:
        raise ApiError(str(error), param=param) from None
    except ConfigError as error:
        raise ApiError(str(error)) from None
    return Generation(prompt_ids, first, chunks)


def extension(method: Method, stats: SpecStats) -> dict[str, Any]:
    """The `d3d` object: how the text was decoded (τ = tokens per verification step, bonus included)."""
    return {"method": method, "tau": round(stats.tau, 3), "steps": stats.steps,
            "drafted": sum(stats.drafted_at), "accepted": sum(stats.accepted_at),
            "tokens_per_second": round(stats.tokens_per_second, 2), "wall_seconds": round(stats.wall_seconds, 3)}


class WorkerThreads:
    """Blocking engine calls in anyio's worker threads: the default of `create_app`."""

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        # A cancelled request still waits for the worker thread (anyio does not abandon it),
        # so the engine is never left running when the lock is released.
        return await anyio.to_thread.run_sync(fn, *args)

    def close(self, chunks: Iterator[Chunk]) -> None:
        chunks.close()  # type: ignore[attr-defined]


class MainThread:
    """Blocking engine calls on the one thread that runs `work()` — the main thread under `serve`.

    On this CPU torch runs at one thread's speed when called from any other thread (measured: the
    same generation at 14.8 tok/s in a worker thread, 20.5 in the main thread), so `serve` keeps
    the engine on the main thread and runs the HTTP event loop beside it. Calls run one after
    another in submission order, so closing a generation (queued too) never races a step of it.
    """

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not future.done():
                future.set_result(value) if ok else future.set_exception(value)

        def job() -> None:
            try:
                outcome = (True, fn(*args))
            except Exception as error:  # handed to the request, which answers with it
                outcome = (False, error)
            except BaseException as error:  # Ctrl-C during a generation stops the server, not one request
                loop.call_soon_threadsafe(settle, False, error)
                raise
            loop.call_soon_threadsafe(settle, *outcome)

        self.jobs.put(job)
        return await future

    def close(self, chunks: Iterator[Chunk]) -> None:
        self.jobs.put(chunks.close)  # type: ignore[attr-defined]

    def work(self, done: threading.Event) -> None:
        """Run submitted calls until `done` is set."""
        while not done.is_set():
            try:
                job = self.jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            job()


class Server:
    """The pipeline behind a lock: one generation at a time, engine calls through `runner`."""

    def __init__(self, pipeline: Pipeline, model_name: str, method: Method,
                 runner: WorkerThreads | MainThread) -> None:
        self.pipeline = pipeline
        self.runner = runner
        self.model_name = model_name
        self.method = method
        self.lock = asyncio.Lock()  # FIFO: waiting requests are served in arrival order
        self.created = int(time.time())

    async def begin(self, job: Job) -> Generation:
        await self.lock.acquire()
        try:
            return await self.runner.run(start_generation, self.pipeline, job, self.method)
        except BaseException:
            self.lock.release()
            raise

    def end(self, generation: Generation) -> None:
        """Close the engine's generator and release the lock (once; safe to call again)."""
        if not generation.ended:
            generation.ended = True
            self.runner.close(generation.chunks)
            self.lock.release()

    async def respond(self, job: Job) -> dict[str, Any] | StreamingResponse:
        generation = await self.begin(job)
        head = {"id": f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion" if job.chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        if job.stream:
            return EventStream(self.events(job, generation, head), lambda: self.end(generation))
        try:
            chunks = [generation.first] + await self.runner.run(list, generation.chunks)
        finally:
            self.end(generation)
        text = "".join(c.text for c in chunks)
        finish_reason = FINISH_REASONS[chunks[-1].finish_reason or "length"]
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if job.chat
                  else {"index": 0, "text": text})
        return {**head, "choices": [{**choice, "logprobs": None, "finish_reason": finish_reason}],
                "usage": self.usage(job, generation, chunks), "d3d": extension(self.method, chunks[-1].step.stats)}

    async def events(self, job: Job, generation: Generation, head: dict[str, Any]) -> AsyncIterator[str]:
        """Server-Sent Events: text deltas, a chunk with the finish reason and the `d3d` object,
        the usage chunk when asked for, then `[DONE]`."""
        head = {**head, "object": "chat.completion.chunk" if job.chat else "text_completion"}
        if job.include_usage:
            head["usage"] = None  # OpenAI: null on every chunk but the last

        def event(text: str, finish_reason: str | None = None, first: bool = False, **extra: Any) -> str:
            if not job.chat:
                choice = {"index": 0, "text": text}
            else:
                delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta}
            choice.update(logprobs=None, finish_reason=finish_reason)
            return sse({**head, "choices": [choice], **extra})

        chunks = [generation.first]
        if job.chat or generation.first.text:
            yield event(generation.first.text, first=True)
        while chunks[-1].finish_reason is None:
            chunk = await self.runner.run(next, generation.chunks, None)
            if chunk is None:
                break
            chunks.append(chunk)
            if chunk.text:
                yield event(chunk.text)
        finish_reason = FINISH_REASONS[chunks[-1].finish_reason or "length"]
        yield event("", finish_reason, d3d=extension(self.method, chunks[-1].step.stats))
        if job.include_usage:
            yield sse({**head, "choices": [], "usage": self.usage(job, generation, chunks)})
        yield "data: [DONE]\n\n"

    def usage(self, job: Job, generation: Generation, chunks: list[Chunk]) -> dict[str, int]:
        completion = chunks[-1].num_tokens  # as plain decoding counts them, also when a stop string cut a step
        prompt = len(generation.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """A text/event-stream response that ends its generation however the response ends.

    Starlette cancels the stream when the client disconnects; the cancelled body iterator may be
    left suspended rather than closed, so the generation is ended here, not in the iterator.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


# -- the app ------------------------------------------------------------------------------------

def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


async def api_error(request: Request, error: ApiError) -> JSONResponse:
    return error_response(error.status, error.message, error.param, error.code)


async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 becomes OpenAI's 400, naming the first offending field."""
    first = error.errors()[0]
    if first.get("type") == "json_invalid":
        return error_response(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                              code="invalid_json")
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    return error_response(400, f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid')}",
                          param=where[0] if where else None)


async def http_error(request: Request, error: HTTPException) -> JSONResponse:
    return error_response(error.status_code, str(error.detail))


async def server_error(request: Request, error: Exception) -> JSONResponse:
    return error_response(500, f"internal error: {type(error).__name__}")


def create_app(pipeline: Pipeline, model_name: str = "d3d", method: Method = "speculative",
               runner: WorkerThreads | MainThread | None = None) -> FastAPI:
    """The API for one loaded pipeline, serving it as `model_name` with decoding method `method`;
    engine calls go through `runner` (default: worker threads; `serve` uses the main thread)."""
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
    if method in ("drafter", "async") and pipeline.drafter is None:
        raise ConfigError(f"method {method!r} needs a drafter: pass --drafter PATH or --drafter untrained")
    server = Server(pipeline, model_name, method, runner or WorkerThreads())
    app = FastAPI(title="d3d", summary="OpenAI-compatible API with lossless speculative decoding")
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": server.created, "owned_by": "d3d"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest):
        return await server.respond(chat_job(request))

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        return await server.respond(completion_job(request))

    return app


def default_model_name(target_source: str) -> str:
    """The id clients see: the embedded model's name, or the target folder's (or .gguf file's) name."""
    if target_source == "default":
        return "SmolLM2-135M-Instruct"
    path = Path(target_source).expanduser().resolve()
    return path.stem if path.suffix == ".gguf" else path.name


def serve(pipeline: Pipeline, host: str = "127.0.0.1", port: int = 8000, model_name: str = "d3d",
          method: Method = "speculative") -> None:
    """Serve the API until interrupted: uvicorn in a background thread, the engine on this one."""
    runner = MainThread()
    app = create_app(pipeline, model_name, method, runner)
    # One short generation first, so the first request does not pay the kernels' first-call costs.
    for _ in pipeline.generate("Hello.", chat=pipeline.target.tokenizer.chat_template is not None,
                               max_new_tokens=4, temperature=0.0, method=method):
        pass
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port))
    done = threading.Event()

    def listen() -> None:
        try:
            server.run()
        finally:
            done.set()

    print(f"# serving {model_name} ({method}) at http://{host}:{port}/v1 — one generation at a time",
          file=sys.stderr)
    thread = threading.Thread(target=listen, name="d3d-http", daemon=True)
    thread.start()
    interrupted = False
    try:
        runner.work(done)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        server.should_exit = True
        thread.join(10)
    if not server.started and not interrupted:
        raise ConfigError(f"could not serve on {host}:{port} (see the error above)")
