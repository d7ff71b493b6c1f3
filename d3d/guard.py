"""The ASGI layer in front of the server's routes: API key, request-body size limit, request counting.

Plain ASGI rather than a Starlette `BaseHTTPMiddleware`, which would buffer streamed responses and
hide client disconnects from them. Refusals are OpenAI-shaped JSON errors: 401 for a missing or
wrong `Authorization: Bearer KEY` (compared in constant time), 413 for a body over the limit
(declared by Content-Length, or counted as it arrives: the body is read here, then
handed on). Every answered request is counted in
`ServerMetrics.requests` by endpoint (a route's path; "other" for paths no route serves, so that
scanners cannot grow the label set) and status.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from d3d.metrics import ServerMetrics

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def reply(send: Send, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], metrics: ServerMetrics,
                 endpoints: Collection[str], api_key: str | None = None, open_paths: Collection[str] = ("/health",),
                 max_body_bytes: int = 1 << 20) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = set(endpoints)  # the paths counted under their own name
        self.api_key = api_key.encode() if api_key else None  # None: no key needed
        self.open_paths = set(open_paths)  # served without the key
        self.max_body_bytes = max_body_bytes

    def authorized(self, scope: Scope) -> bool:
        if self.api_key is None or scope["path"] in self.open_paths:
            return True
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        # compare_digest takes as long whatever prefix matches: the key cannot be guessed byte by byte.
        return hmac.compare_digest(token.strip(), self.api_key) and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # if the app fails before answering

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if not self.authorized(scope):
                await reply(sending, 401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                            "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                return
            declared = dict(scope["headers"]).get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                await reply(sending, 413, self.too_large, "request_too_large")
                return
            body = await self.read_body(receive)
            if body is None:
                await reply(sending, 413, self.too_large, "request_too_large")
                return
            await self.app(scope, replay(body, receive), sending)
        finally:
            endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
            self.metrics.requests.inc(endpoint=endpoint, status=status)

    @property
    def too_large(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_body_bytes} bytes"

    async def read_body(self, receive: Receive) -> bytes | None:
        """The whole body (None past the limit; what came before a disconnect if the client left)."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(parts)
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return b"".join(parts)


def replay(body: bytes, receive: Receive) -> Receive:
    """`receive` that gives the body already read in one message, then what the client sends next
    (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
