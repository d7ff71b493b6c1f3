"""`d3d data --server`: the target's greedy responses fetched from an OpenAI-compatible server —
vLLM, SGLang, llama.cpp's server or `d3d serve` — instead of generated here.

Each prompt of `prompts.jsonl` is sent as a chat completion (its messages; temperature 0, max_tokens
= --max-new-tokens), `concurrency` at a time, and comes back as the same `Generated` the local path
gives (`d3d.train.data.generate_continuous`), so `generate_data` writes both into the same shards.

What a record holds must be the target's own tokens, so:
- before the first shard, one probe request checks that the server serves the local target's
  tokenizer and chat template (`RemoteTarget.check`): the prompt's token ids (or at least their
  count) must be the local chat template's, the response's ids must decode to the server's text;
  a server that fails is refused with `RemoteError` before anything is written. (Two models with
  the same tokenizer and template cannot be told apart this way: the weights are not compared.)
- token ids are the server's where it gives them — vLLM's `return_token_ids` (a choice's
  "token_ids") or, with `logprobs` and `return_tokens_as_token_ids`, entries named "token_id:N";
  `d3d serve` gives both. Where a server gives text only, the text is re-tokenized with the local
  tokenizer and kept only if those ids decode to exactly that text and are as many as the server
  counted (`retokenize`); any record whose ids cannot be trusted is a `LeftOut`, kept out of the
  shard and reported, never silently kept.
- with `--distill-top-k K` the distributions are the server's `top_logprobs` (named by id: vLLM gives
  at most its --max-logprobs, 20 by default); a server that gives fewer than K, or names them by
  text only, is refused.

Requests that fail (no connection, a timeout, HTTP 408/429/5xx) are retried `retries` times with
exponential backoff, then the run stops with a `RemoteError`; the shards written so far are kept,
and the same command resumes. httpx (the `train` extra) is imported only here, when a server is used.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from d3d.config import ConfigError, _JsonMixin
from d3d.loading import TargetTokenizer
from d3d.train.distill import Generated, TopK

RETRIED_STATUS = {408, 429, 500, 502, 503, 504}  # worth another try: overload, restarts, gateways
PROBE_TOKENS = 16  # the probe's response length (at most --max-new-tokens)
TOKEN_ID_PREFIX = "token_id:"  # vLLM's return_tokens_as_token_ids names tokens "token_id:123"


class RemoteError(RuntimeError):
    """A server that cannot be reached, keeps failing, or does not serve the local target."""


class Refused(RemoteError):
    """A request the server answered with an error that another try would not change (a 4xx)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass
class ServerConfig(_JsonMixin):
    """Where `d3d data` fetches the target's responses, and how."""

    url: str  # the server's base URL, with or without its /v1
    served_model: str = ""  # the model id to ask for; "" = the one model the server lists
    concurrency: int = 8  # requests in flight at once
    timeout: float = 600.0  # seconds one request may take
    retries: int = 4  # further tries of a failed request, after backoff · 2^i seconds each
    backoff: float = 1.0
    api_key: str = ""  # sent as a Bearer token when set; never written to the manifest

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"--server takes an http:// or https:// URL, got {self.url!r}")
        if self.concurrency < 1:
            raise ConfigError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.retries < 0 or self.backoff < 0 or not self.timeout > 0:
            raise ConfigError("retries and backoff must be at least 0, the timeout positive")

    @property
    def base_url(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else f"{url}/v1"


@dataclass
class LeftOut:
    """A response kept out of its shard: its token ids cannot be trusted to be the target's."""

    reason: str


def retokenize(text: str, tokenizer: Any) -> list[int] | LeftOut:
    """The local tokenizer's ids for a server's text, if they decode to exactly that text."""
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    except Exception as error:  # a tokenizer refusing the text: the record cannot be made faithfully
        return LeftOut(f"the text cannot be tokenized locally ({error})")
    if tokenizer.decode(ids, skip_special_tokens=True) != text:
        return LeftOut("the re-tokenized text does not decode to the server's text")
    return ids


def server_ids(choice: dict[str, Any]) -> list[int] | None:
    """The response's token ids as the server gives them (None: it gives text only)."""
    if choice.get("token_ids") is not None:
        return [int(token) for token in choice["token_ids"]]
    entries = (choice.get("logprobs") or {}).get("content")
    if entries and all(str(entry.get("token", "")).startswith(TOKEN_ID_PREFIX) for entry in entries):
        return [int(entry["token"][len(TOKEN_ID_PREFIX):]) for entry in entries]
    return None


def top_distributions(entries: list[dict[str, Any]] | None, k: int) -> TopK:
    """The top-k of every token from a choice's `logprobs.content` (alternatives named by id)."""
    ids, logprobs = [], []
    for entry in entries or []:
        top = entry.get("top_logprobs") or []
        if len(top) < k:
            raise RemoteError(f"the server gives {len(top)} top_logprobs per token, --distill-top-k asks for {k}"
                              " (vLLM gives at most its --max-logprobs, 20 by default)")
        if not all(str(t.get("token", "")).startswith(TOKEN_ID_PREFIX) for t in top):
            raise RemoteError("the server names its top_logprobs by text, not by token id: --distill-top-k needs "
                              "ids (vLLM's return_tokens_as_token_ids)")
        ranked = sorted(top, key=lambda t: -t["logprob"])[:k]  # stable: ties keep the server's order
        ids.append([int(t["token"][len(TOKEN_ID_PREFIX):]) for t in ranked])
        logprobs.append([float(t["logprob"]) for t in ranked])
    return TopK(torch.tensor(ids, dtype=torch.int32).reshape(-1, k), torch.tensor(logprobs).reshape(-1, k))


def read_response(body: dict[str, Any], prompt_ids: list[int], tokenizer: Any, eos_token_ids: list[int],
                  top_k: int = 0) -> Generated | LeftOut:
    """One chat completion → the response's token ids (the server's, else the text re-tokenized
    and checked) and with `top_k` their distributions; a `LeftOut` saying why when they cannot be
    trusted to be the target's answer to exactly `prompt_ids`."""
    choice = body["choices"][0]
    usage = body.get("usage") or {}
    served_prompt = body.get("prompt_token_ids")
    if served_prompt is not None and list(served_prompt) != prompt_ids:
        return LeftOut("the server's prompt tokens are not the local chat template's")
    if served_prompt is None and usage.get("prompt_tokens") not in (None, len(prompt_ids)):
        return LeftOut(f"the server counts {usage['prompt_tokens']} prompt tokens, the local chat template "
                       f"{len(prompt_ids)}")
    ids = server_ids(choice)
    from_server = ids is not None
    if ids is None:
        found = retokenize((choice.get("message") or {}).get("content") or "", tokenizer)
        if isinstance(found, LeftOut):
            return found
        ids = found
    finish_reason, appended = choice.get("finish_reason"), 0
    if finish_reason == "stop" and not (ids and ids[-1] in eos_token_ids):
        if from_server:
            return LeftOut(f"the server stopped after token {ids[-1] if ids else None}, not one of the target's "
                           f"end tokens {eos_token_ids}")
        if len(eos_token_ids) != 1:  # text carries no end token: which one ended it is known only if one can
            return LeftOut(f"the server stopped at an end token it does not name, and the target has several "
                           f"({eos_token_ids})")
        ids, appended = ids + eos_token_ids, 1
    elif finish_reason not in ("stop", "length"):
        return LeftOut(f"finish_reason {finish_reason!r}")
    # (a server may or may not count the end token its text does not show)
    if not from_server and usage.get("completion_tokens") not in (None, len(ids), len(ids) - appended):
        return LeftOut(f"the server counts {usage['completion_tokens']} response tokens, the re-tokenized text "
                       f"{len(ids)} (a split the local tokenizer would not make)")
    if not top_k:
        return Generated(ids)
    entries = (choice.get("logprobs") or {}).get("content")
    if entries is None:
        raise RemoteError("the server gives no logprobs: --distill-top-k needs a server that gives top_logprobs")
    if len(entries) != len(ids):
        return LeftOut(f"the server gives distributions for {len(entries)} of {len(ids)} response tokens")
    return Generated(ids, top_distributions(entries, top_k))


class RemoteTarget:
    """The target served by an OpenAI-compatible server, checked against the local target's tokenizer."""

    def __init__(self, config: ServerConfig, target: TargetTokenizer) -> None:
        try:
            import httpx  # noqa: F401  (the train extra; only this path needs it)
        except ImportError:
            raise ConfigError("--server needs httpx: pip install 'd3d-decoding[train]'") from None
        self.config, self.target = config, target
        self.model = config.served_model
        # what each request asks for beyond OpenAI's fields; `check` drops what the server refuses
        self.extensions = {"logprobs": True, "return_tokens_as_token_ids": True, "return_token_ids": True}

    @property
    def identity(self) -> dict[str, str]:
        """What the manifest records: the URL (may change on resume) and the served model (may not)."""
        return {"url": self.config.base_url, "model": self.model}

    def describe(self) -> str:
        return f"{self.config.base_url} (model {self.model!r})"

    def connect(self) -> dict[str, str]:
        """Find the served model id (`served_model`, which the server must list, or its only one)."""
        try:
            listed = [card.get("id") for card in asyncio.run(self._call("GET", "/models")).get("data") or []]
        except Refused as refused:
            raise RemoteError(f"{self.config.base_url}/models: {refused} (is it an OpenAI-compatible server? "
                              "--server takes its base URL, e.g. http://127.0.0.1:8000/v1)") from None
        if self.config.served_model:
            if self.config.served_model not in listed:
                raise RemoteError(f"{self.config.base_url} does not serve {self.config.served_model!r} "
                                  f"(it serves: {', '.join(map(str, listed)) or 'nothing'})")
        elif len(listed) != 1:
            raise RemoteError(f"{self.config.base_url} serves {len(listed)} models ({', '.join(map(str, listed))}): "
                              "pick one with --served-model")
        else:
            self.model = str(listed[0])
        return self.identity

    def check(self, prompt: dict[str, Any], max_new_tokens: int, top_k: int = 0) -> None:
        """One probe request with `prompt`: refuse a server whose tokenizer or chat template is not the
        local target's, and learn which extensions it takes (a server refusing vLLM's fields is asked
        without them; without logprobs too, unless `top_k` needs them)."""
        tokenizer, eos = self.target.tokenizer, self.target.eos_token_ids
        tries = [dict(self.extensions), {"logprobs": True}] + ([] if top_k else [{}])
        for extensions in tries:
            self.extensions = extensions
            try:
                body = asyncio.run(self._call("POST", "/chat/completions",
                                              self.body(prompt["messages"], min(PROBE_TOKENS, max_new_tokens), top_k)))
                break
            except Refused as refused:
                if refused.status != 400 or extensions is tries[-1]:
                    needs = " (--distill-top-k needs top_logprobs)" if top_k else ""
                    raise RemoteError(f"{self.describe()} refused the probe request: {refused}{needs}") from None
        answer = read_response(body, prompt["prompt_ids"], tokenizer, eos, top_k)
        refusal = f"{self.describe()} does not serve the local target {self.target.name} (--target)"
        if isinstance(answer, LeftOut):
            raise RemoteError(f"{refusal}: {answer.reason}")
        ids, text = answer.response_ids, (body["choices"][0].get("message") or {}).get("content") or ""
        vocab_size = max(tokenizer.get_vocab().values()) + 1
        if any(not 0 <= token < vocab_size for token in ids):
            raise RemoteError(f"{refusal}: it returns token ids outside the local vocabulary of {vocab_size}")
        # ends' whitespace aside: detokenizers differ there (vLLM's incremental one gives a word-level
        # vocabulary a leading space that transformers' decode does not)
        if tokenizer.decode(ids, skip_special_tokens=True).strip() != text.strip():
            raise RemoteError(f"{refusal}: the token ids it returns decode to other text with the local tokenizer")

    def body(self, messages: list[dict[str, str]], max_new_tokens: int, top_k: int) -> dict[str, Any]:
        body = {"model": self.model, "messages": messages, "temperature": 0, "max_tokens": max_new_tokens,
                "stream": False, **self.extensions}
        return {**body, "logprobs": True, "top_logprobs": top_k} if top_k else body

    def generate(self, prompts: list[dict[str, Any]], max_new_tokens: int, top_k: int = 0) -> list[Generated | LeftOut]:
        """Each prompt's ({"messages", "prompt_ids"}) response, in order, `concurrency` requests at a time."""
        return asyncio.run(self._generate(prompts, max_new_tokens, top_k))

    async def _generate(self, prompts: list[dict[str, Any]], max_new_tokens: int, top_k: int) -> list[Generated | LeftOut]:
        import httpx

        limit = asyncio.Semaphore(self.config.concurrency)
        async with httpx.AsyncClient(**self._client_options()) as client:
            async def one(prompt: dict[str, Any]) -> Generated | LeftOut:
                async with limit:
                    body = await self._send(client, "POST", "/chat/completions",
                                            self.body(prompt["messages"], max_new_tokens, top_k))
                return read_response(body, prompt["prompt_ids"], self.target.tokenizer, self.target.eos_token_ids,
                                     top_k)

            return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))

    async def _call(self, method: str, path: str, json: dict[str, Any] | None = None) -> dict[str, Any]:
        import httpx

        async with httpx.AsyncClient(**self._client_options()) as client:
            return await self._send(client, method, path, json)

    def _client_options(self) -> dict[str, Any]:
        import httpx

        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        return dict(base_url=self.config.base_url, headers=headers,
                    timeout=httpx.Timeout(self.config.timeout, connect=min(10.0, self.config.timeout)),
                    limits=httpx.Limits(max_connections=self.config.concurrency))

    async def _send(self, client: Any, method: str, path: str, json: dict[str, Any] | None) -> dict[str, Any]:
        """One request's JSON answer, retried with backoff while it fails in a way a retry may mend."""
        import httpx

        attempts = self.config.retries + 1
        for attempt in range(attempts):
            try:
                response = await client.request(method, path, json=json)
            except httpx.TransportError as error:  # no connection, a timeout, a dropped connection
                problem = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            else:
                if response.status_code == 200:
                    try:
                        return response.json()
                    except ValueError:
                        problem = "the answer is not JSON"
                elif response.status_code in RETRIED_STATUS:
                    problem = f"HTTP {response.status_code}: {error_message(response)}"
                else:
                    raise Refused(response.status_code, error_message(response))
            if attempt + 1 < attempts:
                await asyncio.sleep(self.config.backoff * 2 ** attempt)
        raise RemoteError(f"{self.config.base_url}{path}: {problem} ({attempts} attempt{'s' * (attempts > 1)}; "
                          "is the server running? the shards written so far are kept: rerun to resume)")


def error_message(response: Any) -> str:
    """The message of an (OpenAI-shaped, or any) error response, one line."""
    try:
        error = response.json().get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    lines = str(message or response.text or "").strip().splitlines()
    return lines[0][:300] if lines else f"status {response.status_code} {response.reason_phrase}".strip()
