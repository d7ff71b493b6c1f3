"""OpenAI request bodies and the `Job` each becomes — what `d3d.server` accepts, refuses and why —
and the OpenAI-shaped error responses.

Unknown fields are ignored, as OpenAI's servers do; parameters that would change the sampled
distribution (penalties, logit_bias) or that one-sequence engines cannot give (n > 1) are refused
with an `ApiError` (HTTP 400), never silently ignored. Chat completions give `logprobs` and
`top_logprobs` (`d3d.logprobs`: the target's own), also with vLLM's `return_tokens_as_token_ids`;
both endpoints give vLLM's `return_token_ids` (the prompt's and the completion's token ids), so a
client written for vLLM reads the same fields here. OpenAI's own limits hold too: a
message's role is one OpenAI accepts (`ROLES`; a "developer" message is the system message of
OpenAI's newer models and reaches the chat template as "system"; a "tool" message answers a tool
call, and tool calling is refused), at most `MAX_STOP` stop strings, and text that is valid
Unicode (JSON can carry a lone surrogate, "\ud800", which no tokenizer can encode). The `d3d` field
is this server's opt-in extension: another decoding method for one request, and per-step facts in
the stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from d3d.generation import Method
from d3d.logprobs import MAX_TOP_LOGPROBS

ONE_SEQUENCE = "the engine decodes one sequence at a time"
Role = Literal["system", "user", "assistant", "developer", "tool"]  # the roles OpenAI's chat API accepts
ROLES: tuple[str, ...] = get_args(Role)
MAX_STOP = 4  # OpenAI's limit on stop sequences
CHANGES_DISTRIBUTION = "it changes the distribution that lossless decoding reproduces exactly"

# Parameters refused unless left at their defaults: (field, is it asked for?, why not).
REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("n", lambda v: v not in (None, 1), f"only n = 1 is supported: {ONE_SEQUENCE}"),
    ("best_of", lambda v: v not in (None, 1), f"only best_of = 1 is supported: {ONE_SEQUENCE}"),
    ("presence_penalty", bool, f"penalties are not supported: {CHANGES_DISTRIBUTION}"),
    ("frequency_penalty", bool, f"penalties are not supported: {CHANGES_DISTRIBUTION}"),
    ("logit_bias", bool, f"logit_bias is not supported: {CHANGES_DISTRIBUTION}"),
    ("echo", bool, "echo is not supported"),
    ("suffix", bool, "suffix (insertion) is not supported"),
    ("tools", bool, "tool calling is not supported"),
    ("response_format", lambda v: bool(v) and v.get("type") != "text", "only the text response format is supported"),
)


# -- requests -----------------------------------------------------------------------------------

class Extension(BaseModel):
    """The `d3d` request field: this server's extension, off unless asked for."""

    model_config = ConfigDict(extra="forbid")  # a misspelt option is an error, not silently off

    method: Method | None = None  # this request's decoding method (default: the server's --method)
    steps: bool = False  # streamed chunks carry `d3d_step`: each step's tokens by origin and running τ


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
    d3d: Extension | None = None  # extension (see `Extension`)
    # vLLM's extensions: the prompt's and the completion's token ids ("prompt_token_ids", a choice's
    # "token_ids"); logprobs entries naming their tokens "token_id:N" instead of their text
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # chat: a boolean, and top_logprobs alternatives per token; completions: refused (see `completion_job`)
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    # Refused unless left at their defaults (see REFUSED):
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Role
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

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status
        self.headers = headers or {}


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
    method: Method | None = None  # None: the server's
    steps: bool = False  # per-step facts in streamed chunks
    logprobs: bool = False  # each generated token's log-probability (`d3d.logprobs`)
    top_logprobs: int = 0  # with logprobs: this many most likely alternatives per token
    tokens_as_ids: bool = False  # logprobs entries name their tokens "token_id:N"
    token_ids: bool = False  # the prompt's and the completion's token ids in the response


def make_job(request: SamplingRequest, chat: bool, prompt: str | list[dict[str, str]],
             max_tokens: int | None, logprobs: bool = False, top_logprobs: int = 0) -> Job:
    for name, asked, why in REFUSED:
        if asked(getattr(request, name, None)):
            raise ApiError(f"{name}: {why}", param=name, code="unsupported_parameter")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > MAX_STOP:
        raise ApiError(f"stop: at most {MAX_STOP} stop sequences, got {len(stop)}", param="stop")
    for i, text in enumerate(stop):
        check_text(text, "stop" if isinstance(request.stop, str) else f"stop[{i}]", "stop")
    options, extension = request.stream_options, request.d3d or Extension()
    if extension.steps and not request.stream:
        raise ApiError("d3d.steps: per-step facts come with streamed responses: set stream to true", param="d3d")
    return Job(chat, prompt, max_tokens, 1.0 if request.temperature is None else request.temperature,
               request.top_k or 0, 1.0 if request.top_p is None else request.top_p, request.seed, stop,
               bool(request.stream), bool(options and options.include_usage), extension.method, extension.steps,
               logprobs, top_logprobs, bool(request.return_tokens_as_token_ids), bool(request.return_token_ids))


def logprob_options(request: ChatRequest) -> tuple[bool, int]:
    """A chat request's (logprobs, top_logprobs), checked as OpenAI checks them."""
    logprobs, top = request.logprobs, request.top_logprobs
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ApiError(f"logprobs: a boolean on chat completions, got {logprobs!r} (the number of alternatives "
                       "is top_logprobs)", param="logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param="top_logprobs")
    if top and not logprobs:
        raise ApiError("top_logprobs: set logprobs to true to ask for alternatives", param="top_logprobs")
    return bool(logprobs), top or 0


def check_text(text: str, where: str, param: str) -> None:
    """Refuse text that is not valid Unicode: a lone surrogate (JSON's "\ud800") that no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ApiError(f"{where}: a lone surrogate (U+{ord(text[error.start]):04X} at character {error.start}) is not "
                       "valid Unicode text", param=param) from None


def chat_job(request: ChatRequest) -> Job:
    messages = []
    for i, message in enumerate(request.messages):
        if message.role == "tool":
            raise ApiError(f"messages[{i}].role: tool messages answer tool calls, and tool calling is not supported",
                           param=f"messages.{i}.role", code="unsupported_parameter")
        content = message.content
        if isinstance(content, list):
            others = [part.type for part in content if part.type != "text"]
            if others:
                raise ApiError(f"messages[{i}].content: only text parts are supported, got {others[0]!r}",
                               param=f"messages.{i}.content")
            content = "\n".join(part.text or "" for part in content)
        check_text(content or "", f"messages[{i}].content", f"messages.{i}.content")
        # OpenAI: developer messages are the system instructions of its newer models
        messages.append({"role": "system" if message.role == "developer" else message.role, "content": content or ""})
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    return make_job(request, True, messages, max_tokens, *logprob_options(request))


def completion_job(request: CompletionRequest) -> Job:
    prompt = request.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(f"prompt: send one prompt per request ({ONE_SEQUENCE})", param="prompt")
        prompt = prompt[0]
    check_text(prompt, "prompt", "prompt")
    for name in ("logprobs", "top_logprobs"):  # 0 asks for them too in the legacy API: only None or false is off
        if getattr(request, name) is not None and getattr(request, name) is not False:
            raise ApiError(f"{name}: logprobs are given on /v1/chat/completions only", param=name,
                           code="unsupported_parameter")
    return make_job(request, False, prompt, request.max_tokens)


# -- errors -------------------------------------------------------------------------------------

def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)


async def api_error(request: Request, error: ApiError) -> JSONResponse:
    return error_response(error.status, error.message, error.param, error.code, error.headers)


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
