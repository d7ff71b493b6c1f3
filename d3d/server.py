"""OpenAI-compatible HTTP API over a `Pipeline`: chat and text completions, streamed or not, with a
live acceptance view at `/` and Prometheus metrics at `/metrics`.

Each request becomes one `Pipeline` generation — the same chunk generator the CLI and the benchmark
consume — so the text is exactly what `Pipeline.generate` gives for the same parameters, and at
temperature 0 exactly what plain autoregressive decoding gives. Responses and errors follow
OpenAI's shapes; a `d3d` object adds the decoding statistics (τ = tokens per verification step,
bonus token included), and a request's opt-in `d3d` field (`d3d.openai_schema.Extension`) picks
another method or streams per-step facts: which tokens were accepted drafts, from which source.
Chat completions give `logprobs` / `top_logprobs`, the target's own (`d3d.logprobs`), and both
endpoints vLLM's `return_token_ids`, so a client of vLLM (`d3d data --server`) reads the same fields.

Limits (`Limits`): `max_batch` generations at a time — decoding together in one continuous batch
(`d3d.batch`), each exactly as alone — with a bounded queue (full → 429, `d3d.scheduler`), a
deadline per request, a body size limit and an optional API key (`d3d.guard`); a client that hangs
up cancels its queued or running generation (a batched one leaves the batch at its next step);
shutdown lets the running generations finish within a grace period and sends the queued ones away.
Method "async" is never batched: its generations take their slots and decode one at a time
between the batch's steps.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from d3d.batch import Batch, SharedBatch
from d3d.config import ConfigError
from d3d.generation import METHODS, Chunk, Method, Pipeline
from d3d.guard import Guard
from d3d.logprobs import TokenLogprobs, content
from d3d.metrics import CONTENT_TYPE, ServerMetrics
from d3d.openai_schema import (ApiError, ChatRequest, CompletionRequest, Job, api_error, chat_job, completion_job,
                               http_error, invalid_request, server_error)
from d3d.scheduler import DeadlineExceeded, MainThread, QueueFull, Scheduler, Unavailable, WorkerThreads
from d3d.sequence import PromptError
from d3d.stats import SpecStats

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # ours → OpenAI's
SAMPLING_FIELDS = ("temperature", "top_k", "top_p")  # what a ConfigError from sampling names first
VIEW = Path(__file__).parent / "view.html"
API_KEY_VARIABLE = "D3D_API_KEY"
CLIENT_GONE = 499  # nginx's "client closed request": the status counted for a request whose client left


@dataclass
class Limits:
    """What one server accepts, and for how long."""

    max_queue: int = 64  # requests that may wait while every slot generates; one more gets a 429
    deadline: float | None = 600.0  # seconds from arrival to the last token, queue included; None: none
    max_body_bytes: int = 1 << 20  # a larger request body gets a 413
    api_key: str | None = None  # when set, every route but /health and the page at / needs it as a Bearer token
    shutdown_grace: float = 30.0  # on shutdown, seconds the running generations may take to finish
    max_batch: int = 1  # generations decoding at once, in one continuous batch when above 1
    prefix_cache_mb: int = 0  # MiB of ended generations' keys and values kept for later prompts (0: none)
    prefix_cache_dir: str | None = None  # where they are also kept on disk, for later processes

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be at least 0, got {self.max_queue}")
        if self.max_batch < 1:
            raise ConfigError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.prefix_cache_mb < 0:
            raise ConfigError(f"prefix_cache_mb must be at least 0, got {self.prefix_cache_mb}")
        if self.deadline is not None and not self.deadline > 0:
            raise ConfigError(f"the deadline must be positive seconds (or none), got {self.deadline}")
        if self.max_body_bytes < 1:
            raise ConfigError(f"max_body_bytes must be at least 1, got {self.max_body_bytes}")
        if self.shutdown_grace < 0:
            raise ConfigError(f"shutdown_grace must be at least 0, got {self.shutdown_grace}")


# -- generation ---------------------------------------------------------------------------------

@dataclass
class Generation:
    """A started generation: it holds the scheduler's slot until `Server.end`."""

    prompt_ids: list[int]
    first: Chunk  # taken before answering, so that bad input is a 400 and not a broken stream
    chunks: Iterator[Chunk]  # the rest
    method: Method
    deadline: float = float("inf")  # time.monotonic() after which it stops
    origins: list[str] = field(default_factory=list)  # [i]: "lookup" / "drafter" (an accepted draft) or "target"
    token_ids: list[int] = field(default_factory=list)  # the committed tokens so far
    logprobs: TokenLogprobs | None = None  # with logprobs asked for: each committed token's
    reported: int = 0  # generated tokens whose ids / logprobs a streamed event carried
    last: Chunk | None = None  # the latest chunk served
    stopped: str | None = None  # why it ended early: "deadline", "shutdown", "error"
    ended: bool = False

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason is not None


class Stopped(Exception):
    """A generation ended by its deadline or by the server's shutdown (`code`: the error's code)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def start_generation(pipeline: Pipeline, job: Job, method: Method, batch: SharedBatch | None = None) -> Generation:
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
    logprobs = TokenLogprobs(job.top_logprobs) if job.logprobs else None
    if logprobs is not None and method == "async":
        raise ApiError("logprobs: method 'async' verifies beside its drafting thread and does not report the "
                       "target's logits; use another method (d3d.method)", param="logprobs")
    try:
        chunks = pipeline.stream_text(pipeline.steps(prompt_ids, config, method, batch, on_commit=logprobs), job.stop)
        first = next(chunks)
    except PromptError as error:
        raise ApiError(str(error), param=param) from None
    except ConfigError as error:
        raise ApiError(str(error), param="d3d" if job.method else None) from None
    return Generation(prompt_ids, first, chunks, method, logprobs=logprobs)


def extension(method: Method, stats: SpecStats) -> dict[str, Any]:
    """The `d3d` object: how the text was decoded (τ = tokens per verification step, bonus included)."""
    return {"method": method, "tau": round(stats.tau, 3), "steps": stats.steps,
            "drafted": sum(stats.drafted_at), "accepted": sum(stats.accepted_at),
            "tokens_per_second": round(stats.tokens_per_second, 2), "wall_seconds": round(stats.wall_seconds, 3)}


def token_report(job: Job, generation: Generation, tokenizer: Any, upto: int) -> dict[str, Any]:
    """A choice's `logprobs` and (vLLM's `return_token_ids`) `token_ids` for the generated tokens
    not yet reported, up to `upto` (a chunk's `num_tokens`: with a stop string, up to the token
    that completed it), as far as the request asked for them."""
    start, generation.reported = generation.reported, max(generation.reported, upto)
    report: dict[str, Any] = {}
    if generation.logprobs is not None:
        report["logprobs"] = {"content": content(generation.logprobs.entries[start:upto], tokenizer, job.tokens_as_ids)}
    if job.token_ids:
        report["token_ids"] = generation.token_ids[start:upto]
    return report


def step_facts(generation: Generation, chunk: Chunk) -> dict[str, Any]:
    """The `d3d_step` object: the chunk's text split by token origin, and the running statistics."""
    step, stats = chunk.step, chunk.step.stats
    return {"pieces": [[text, generation.origins[index]] for index, text in chunk.pieces],
            "source": step.source, "drafted": step.num_drafted, "accepted": step.num_accepted,
            "tokens": stats.new_tokens, "steps": stats.steps, "tau": round(stats.tau, 3),
            "tokens_per_second": round(stats.tokens_per_second, 2),
            "acceptance_rate": [round(rate, 3) for rate in stats.acceptance_rate]}


class Server:
    """The pipeline behind the scheduler: `limits.max_batch` generations at a time, engine calls through `runner`."""

    def __init__(self, pipeline: Pipeline, model_name: str, method: Method, runner: WorkerThreads | MainThread,
                 limits: Limits, metrics: ServerMetrics) -> None:
        self.pipeline = pipeline
        self.runner = runner
        self.model_name = model_name
        self.method = method
        self.limits = limits
        self.metrics = metrics
        self.scheduler = Scheduler(limits.max_queue, limits.max_batch)
        # every generation starts from the longest stored prefix of its prompt and leaves its own
        pipeline.keep_prefixes(limits.prefix_cache_mb, limits.prefix_cache_dir)
        # the continuous batch the admitted generations decode in (none: one at a time); its gates
        # see the queue (with nobody waiting, only the runs the batch waits on draft)
        self.batch = (SharedBatch(Batch(pipeline.target.decoder, backlog=self.scheduler.waiting_count))
                      if limits.max_batch > 1 else None)
        self.cutoff = float("inf")  # time.monotonic() at which a shutdown stops the running generation
        self.created = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving event loop, once started

    async def begin(self, job: Job, arrived: float) -> Generation:
        """Wait for the slot, then start the generation (its first chunk taken)."""
        deadline = arrived + self.limits.deadline if self.limits.deadline else float("inf")
        try:
            waited = await self.scheduler.acquire(None if deadline == float("inf") else deadline - time.monotonic())
        except QueueFull as error:
            raise ApiError(str(error), code="queue_full", status=429,
                           headers={"Retry-After": str(error.retry_after)}) from None
        except DeadlineExceeded as error:
            raise ApiError(str(error), code="deadline_exceeded", status=503) from None
        except Unavailable as error:
            raise ApiError(str(error), code="shutting_down", status=503) from None
        self.metrics.queue_seconds.observe(waited)
        start = asyncio.ensure_future(self.runner.run(start_generation, self.pipeline, job, job.method or self.method,
                                                      self.batch))
        try:
            generation = await asyncio.shield(start)
        except asyncio.CancelledError:  # the client left while the engine started: clean up once it has
            start.add_done_callback(self.abandon)
            raise
        except BaseException:
            self.scheduler.release()
            raise
        generation.deadline = deadline
        self.metrics.first_token.observe(time.monotonic() - arrived)
        self.metrics.record_prompt(len(generation.prompt_ids), generation.first.step.stats.cached_tokens)
        self.observe(generation, generation.first)
        return generation

    def abandon(self, start: asyncio.Future[Generation]) -> None:
        if start.cancelled() or start.exception() is not None:
            self.scheduler.release()
        else:
            self.end(start.result())

    def observe(self, generation: Generation, chunk: Chunk) -> None:
        """Note a chunk's step: its tokens' origins and, past the prefill, the step's metrics."""
        step = chunk.step
        drafts = min(step.num_accepted, len(step.tokens))
        generation.origins += [step.source] * drafts + ["target"] * (len(step.tokens) - drafts)
        generation.token_ids += step.tokens
        if generation.last is not None:  # the first chunk is the prefill's token: nothing was verified
            self.metrics.record_step(generation.method, step)
        generation.last = chunk

    async def next_chunk(self, generation: Generation) -> Chunk | None:
        """The next chunk (None once the engine ended); `Stopped` past the deadline or the shutdown."""
        now = time.monotonic()
        for reason, limit, code, message in (
                ("deadline", generation.deadline, "deadline_exceeded", "the request's deadline passed"),
                ("shutdown", self.cutoff, "shutting_down", "the server is shutting down")):
            if now > limit:
                generation.stopped = reason
                raise Stopped(code, f"{message} during its generation")
        chunk = await self.runner.run(next, generation.chunks, None)
        if chunk is not None:
            self.observe(generation, chunk)
        return chunk

    def end(self, generation: Generation) -> None:
        """Close the engine's generator, free the slot and record the generation (once)."""
        if generation.ended:
            return
        generation.ended = True
        self.runner.close(generation.chunks)
        self.scheduler.release()
        if generation.last is not None:
            self.metrics.record_generation(generation.method, generation.last.step.stats)
        if not generation.finished:
            self.metrics.cancelled.inc(reason=generation.stopped or "disconnected")

    async def respond(self, job: Job, arrived: float) -> dict[str, Any] | StreamingResponse:
        generation = await self.begin(job, arrived)
        head = {"id": f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion" if job.chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        if job.stream:
            return EventStream(self.events(job, generation, head), lambda: self.end(generation))
        chunks = [generation.first]
        try:
            while chunks[-1].finish_reason is None and (chunk := await self.next_chunk(generation)) is not None:
                chunks.append(chunk)
        except Stopped as stopped:
            raise ApiError(str(stopped), code=stopped.code, status=503) from None
        except Exception:
            generation.stopped = "error"
            raise
        finally:
            self.end(generation)
        text = "".join(c.text for c in chunks)
        finish_reason = FINISH_REASONS[chunks[-1].finish_reason or "length"]
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if job.chat
                  else {"index": 0, "text": text})
        choice.update(logprobs=None, finish_reason=finish_reason)
        choice.update(token_report(job, generation, self.pipeline.target.tokenizer, chunks[-1].num_tokens))
        if job.token_ids:
            head["prompt_token_ids"] = generation.prompt_ids
        return {**head, "choices": [choice], "usage": self.usage(generation, chunks),
                "d3d": extension(generation.method, chunks[-1].step.stats)}

    async def events(self, job: Job, generation: Generation, head: dict[str, Any]) -> AsyncIterator[str]:
        """Server-Sent Events: text deltas, a chunk with the finish reason and the `d3d` object,
        the usage chunk when asked for, then `[DONE]`. With `d3d.steps`, one event per engine step,
        each with its `d3d_step`. A deadline or shutdown mid-stream ends it with an error event."""
        head = {**head, "object": "chat.completion.chunk" if job.chat else "text_completion"}
        if job.include_usage:
            head["usage"] = None  # OpenAI: null on every chunk but the last
        tokenizer = self.pipeline.target.tokenizer
        prompt_sent = not job.token_ids  # vLLM: prompt_token_ids come with the first event only

        def event(chunk: Chunk | None, finish_reason: str | None = None, first: bool = False, **extra: Any) -> str:
            nonlocal prompt_sent
            text = chunk.text if chunk is not None else ""
            if not job.chat:
                choice = {"index": 0, "text": text}
            else:
                delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta}
            choice.update(logprobs=None, finish_reason=finish_reason)
            # the tokens this event's text stands for (at the end: all the text stands for)
            choice.update(token_report(job, generation, tokenizer, (chunk or chunks[-1]).num_tokens))
            if job.steps and chunk is not None:
                extra["d3d_step"] = step_facts(generation, chunk)
            if not prompt_sent:
                extra["prompt_token_ids"], prompt_sent = generation.prompt_ids, True
            return sse({**head, "choices": [choice], **extra})

        chunks = [generation.first]
        if job.chat or job.steps or generation.first.text:
            yield event(generation.first, first=True)
        try:
            while chunks[-1].finish_reason is None and (chunk := await self.next_chunk(generation)) is not None:
                chunks.append(chunk)
                if chunk.text or job.steps:
                    yield event(chunk)
        except Stopped as stopped:
            yield sse({"error": {"message": str(stopped), "type": "server_error", "param": None, "code": stopped.code}})
            yield "data: [DONE]\n\n"
            return
        except Exception:
            generation.stopped = "error"
            raise
        finish_reason = FINISH_REASONS[chunks[-1].finish_reason or "length"]
        yield event(None, finish_reason, d3d=extension(generation.method, chunks[-1].step.stats))
        if job.include_usage:
            yield sse({**head, "choices": [], "usage": self.usage(generation, chunks)})
        yield "data: [DONE]\n\n"

    def usage(self, generation: Generation, chunks: list[Chunk]) -> dict[str, int]:
        completion = chunks[-1].num_tokens  # as plain decoding counts them, also when a stop string cut a step
        prompt = len(generation.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": chunks[-1].step.stats.cached_tokens}}

    async def drain(self) -> None:
        """Shutdown: refuse new requests, send the queued away, give the running one the grace period."""
        self.scheduler.close()
        self.cutoff = time.monotonic() + self.limits.shutdown_grace
        await self.scheduler.idle.wait()


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


async def until_disconnected(request: Request) -> None:
    """Return when the client hangs up (the body has been read, so only a disconnect comes next)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def answer(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it if the client hangs up first.

    An anyio cancel scope rather than `Task.cancel`: worker-thread calls shield themselves until
    their thread returns, and only a scope's cancellation is delivered again after that.
    """
    outcome: dict[str, Any] = {}
    async with anyio.create_task_group() as group:
        async def run() -> None:
            try:
                outcome["value"] = await work
            except Exception as error:  # answered by the app's error handlers, outside the group
                outcome["error"] = error
            group.cancel_scope.cancel()

        async def watch() -> None:
            await until_disconnected(request)
            group.cancel_scope.cancel()

        group.start_soon(run)
        group.start_soon(watch)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"] if "value" in outcome else Response(status_code=CLIENT_GONE)


# -- the app ------------------------------------------------------------------------------------

def create_app(pipeline: Pipeline, model_name: str = "d3d", method: Method = "speculative",
               runner: WorkerThreads | MainThread | None = None, limits: Limits | None = None) -> FastAPI:
    """The API for one loaded pipeline, serving it as `model_name` with decoding method `method`;
    engine calls go through `runner` (default: worker threads; `serve` uses the main thread).
    The returned app's `state.server` is the `Server` (its `drain()` starts a graceful shutdown)."""
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
    if method in ("drafter", "async") and pipeline.drafter is None:
        raise ConfigError(f"method {method!r} needs a drafter: pass --drafter PATH or --drafter untrained")
    limits = limits or Limits()
    metrics = ServerMetrics(pipeline.drafter.block_size if pipeline.drafter is not None else 16)
    server = Server(pipeline, model_name, method, runner or WorkerThreads(), limits, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop = asyncio.get_running_loop()  # where other threads start `drain()`
        yield

    app = FastAPI(title="d3d", summary="OpenAI-compatible API with lossless speculative decoding", lifespan=lifespan)
    app.state.server = server
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)

    @app.get("/", response_class=HTMLResponse)
    async def view() -> HTMLResponse:
        return HTMLResponse(VIEW.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text() -> PlainTextResponse:
        batch = server.batch.batch.stats if server.batch is not None else None
        text = metrics.render(server.scheduler.queue_depth, server.scheduler.held, batch)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, int]:
        """Empty the prefix cache (vLLM's route of that name): measure cold prompts without a restart."""
        prefixes = pipeline.prefixes
        cleared = len(prefixes) if prefixes is not None else 0
        if prefixes is not None:
            prefixes.clear()
        return {"cleared": cleared}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": server.created, "owned_by": "d3d"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await answer(request, server.respond(chat_job(body), time.monotonic()))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await answer(request, server.respond(completion_job(body), time.monotonic()))

    endpoints = [route.path for route in app.routes]
    # Open without the key: /health for probes, and the page at /, which holds no data and asks
    # the person for the key (a browser cannot send a Bearer header when it loads a page).
    app.add_middleware(Guard, metrics=metrics, endpoints=endpoints, api_key=limits.api_key,
                       open_paths=("/health", "/"), max_body_bytes=limits.max_body_bytes)
    return app


WARM_UP_PROMPT = "count from 1 to 10, then from 1 to 10 again."  # repeats: lookup drafts too


def warm_up(pipeline: Pipeline, method: Method, max_new_tokens: int = 16) -> float:
    """Pay every one-time cost before the first request, so that its timing is what a user gets;
    returns the seconds it took. A short greedy generation with the server's method finds (or, on a
    machine seen for the first time, measures) the gate's costs and checks the target's row
    invariance; one with the drafter alone runs it on every step, packing its weights for the
    row-exact kernels (the target's are packed at load); one of plain decoding warms the path the
    live view's comparison takes. `serve` calls it before it listens."""
    started = time.perf_counter()
    chat = pipeline.target.tokenizer.chat_template is not None
    methods = [method] + ["drafter"] * (pipeline.drafter is not None) + ["ar"]
    for name in dict.fromkeys(methods):
        for _ in pipeline.generate(WARM_UP_PROMPT, chat=chat, max_new_tokens=max_new_tokens, temperature=0.0,
                                   method=name):
            pass
    return time.perf_counter() - started


def default_model_name(target_source: str) -> str:
    """The id clients see: the embedded model's name, or the target folder's (or .gguf file's) name."""
    if target_source == "default":
        return "SmolLM2-135M-Instruct"
    path = Path(target_source).expanduser().resolve()
    return path.stem if path.suffix == ".gguf" else path.name


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def serve(pipeline: Pipeline, host: str = "127.0.0.1", port: int = 8000, model_name: str = "d3d",
          method: Method = "speculative", limits: Limits | None = None) -> None:
    """Serve until interrupted: uvicorn in a background thread, the engine on this one.

    The first Ctrl-C (or SIGTERM) shuts down gracefully: no new requests, the queued ones get a
    503, the running generation gets `limits.shutdown_grace` seconds. A second Ctrl-C stops at once.
    """
    limits = limits or Limits()
    runner = MainThread()
    app = create_app(pipeline, model_name, method, runner, limits)
    print(f"# warmed up in {warm_up(pipeline, method):.1f} s: the first request is timed as every later one",
          file=sys.stderr)
    # After the drain, uvicorn waits for open connections to send their last events, no longer than this.
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=limits.shutdown_grace))
    done, stopping = threading.Event(), threading.Event()

    def listen() -> None:
        try:
            server.run()
        finally:
            done.set()

    def shut_down(signum: int, frame: Any) -> None:
        loop = app.state.server.loop
        if stopping.is_set() or loop is None:
            raise KeyboardInterrupt  # a second signal, or one before the server listens: stop now
        stopping.set()
        print("# shutting down: finishing the running generation (Ctrl-C again to stop at once)", file=sys.stderr)
        draining = asyncio.run_coroutine_threadsafe(app.state.server.drain(), loop)
        draining.add_done_callback(lambda _: setattr(server, "should_exit", True))

    if not is_loopback(host) and not limits.api_key:
        print(f"# WARNING: listening on {host} without an API key: anyone who can reach this port can use it "
              f"(set --api-key or {API_KEY_VARIABLE})", file=sys.stderr)
    at_once = (f"up to {limits.max_batch} generations decoding together" if limits.max_batch > 1
               else "one generation at a time")
    print(f"# serving {model_name} ({method}) at http://{host}:{port}/v1 — {at_once}, "
          f"up to {limits.max_queue} waiting; live view at http://{host}:{port}/, metrics at /metrics",
          file=sys.stderr)
    thread = threading.Thread(target=listen, name="d3d-http", daemon=True)
    previous = {signum: signal.signal(signum, shut_down) for signum in (signal.SIGINT, signal.SIGTERM)}
    thread.start()
    interrupted = False
    try:
        runner.work(done)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        server.should_exit = True
        thread.join(10)
    if not server.started and not interrupted:
        raise ConfigError(f"could not serve on {host}:{port} (see the error above)")
