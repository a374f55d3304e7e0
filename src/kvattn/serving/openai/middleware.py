"""`kvattn serve`'s ASGI middleware: the request log, the API key, the body limit.

Plain ASGI, not Starlette's `BaseHTTPMiddleware`, which would hide a
client's disconnect from the routes (a request whose client left could not
be aborted).
"""

from __future__ import annotations

import hmac
import logging
import time

from starlette.exceptions import HTTPException

from kvattn.serving.openai.protocol import ApiError

__all__ = ["Authorize", "BodyLimit", "RequestLog"]

log = logging.getLogger("kvattn.serve")


class RequestLog:
    """ASGI middleware: one INFO line per HTTP request once its answer is sent (a stream's last event included).

    The line holds the method, path, status and seconds, and the token counts
    where the request generated (`request.state.usage`).
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), None

        async def send_noting_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            usage = scope.get("state", {}).get("usage")
            tokens = (f", {usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens"
                      if usage else "")
            log.info("%s %s %s %.3f s%s", scope["method"], scope["path"], status or "no answer",
                     time.perf_counter() - start, tokens)


class Authorize:
    """ASGI middleware: `/v1/` answers 401 unless the request carries `Authorization: Bearer <api_key>`."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = ApiError(401, "Incorrect API key provided", "authentication_error", code="invalid_api_key")
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets OpenAI's JSON 413, declared (Content-Length) or
    streamed, before it is parsed."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = f"the request body is over {self.max_bytes} bytes"
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await ApiError(413, refusal).response()(scope, receive, send)
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, refusal)  # inside the route, which passes it on to `_http`
            return message

        await self.app(scope, limited, send)
