"""`kvattn serve`: the OpenAI HTTP API (FastAPI + uvicorn) on the paged engine.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with
`stream`), `GET /v1/models`, `GET /health` (a real two-token generation)
and `GET /metrics` (Prometheus). Each request is tokenized, submitted to
the `Engine` thread, and answered from the tokens it sends back: text is
detokenized incrementally (never half a UTF-8 character) and matched
against the request's stop strings across token boundaries (a stop string
is never sent; the request is aborted at once, its pages back in the
pool). A client that goes away mid-request has it aborted the same way.

Every refusal is an OpenAI-shaped JSON error: 400 for a bad body, 401 for a
wrong key, 404 for an unknown model or path, 413 for a body over 4 MiB, 429
with `Retry-After` when the waiting queue is full, 503 while shutting down.
Extensions over OpenAI's fields, as vLLM names them: `top_k`,
`stop_token_ids`, `ignore_eos`, and `return_token_ids` (each choice also
carries its token ids).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.exceptions import HTTPException

from kvattn.generation.sampling import SamplingParams
from kvattn.serving.api import ChatRequest, CompletionRequest
from kvattn.serving.engine import Engine, Full, ShuttingDown
from kvattn.serving.metrics import Metrics
from kvattn.serving.requests import Token
from kvattn.serving.text import TextStream, Tokenizer

__all__ = ["ApiError", "create_app", "run"]

log = logging.getLogger("kvattn.serve")
MAX_BODY_BYTES = 4 * 2**20


class ApiError(Exception):
    """A refusal with its HTTP status, shaped as OpenAI's errors."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", *, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.headers = status, kind, param, code, headers

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


@dataclasses.dataclass
class _Job:
    """One HTTP request's generation, after every check."""

    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset
    """The ids that end a choice: the request's, and the tokenizer's end-of-sequence ids unless `ignore_eos`."""
    token_ids: bool

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def stops(self) -> list[str]:
        return list(self.params.stop)

    @property
    def top_logprobs(self) -> int | None:  # None: no logprobs
        return self.params.logprobs


@dataclasses.dataclass
class _Choice:
    """One choice as it is produced: its text stream, ids and logprobs."""

    stream: TextStream
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[tuple[Token, str]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    last_token_at: float | None = None


@dataclasses.dataclass
class _Delta:
    """What one event adds to a choice: text, tokens (with their strings), maybe its end."""

    index: int
    text: str = ""
    ids: list[int] = dataclasses.field(default_factory=list)
    tokens: list[tuple[Token, str]] = dataclasses.field(default_factory=list)  # with logprobs only
    finish_reason: str | None = None


class _App:
    """The routes' shared state: engine, tokenizer, metrics, settings."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, metrics: Metrics, *, model_name: str, max_len: int,
                 api_key: str | None):
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.model_name, self.max_len, self.api_key = model_name, max_len, api_key
        self.created = int(time.time())

    # ------------------------------------------------------------- checking

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "Incorrect API key provided", "authentication_error", code="invalid_api_key")

    def job(self, body: CompletionRequest | ChatRequest) -> _Job:
        if body.model != self.model_name:
            raise ApiError(404, f"The model `{body.model}` does not exist; this server serves `{self.model_name}`",
                           "not_found_error", param="model", code="model_not_found")
        try:
            if isinstance(body, ChatRequest):
                text = self.tokenizer.render_chat([{"role": m.role, "content": m.text} for m in body.messages])
                prompt = self.tokenizer.encode(text, add_special_tokens=False)
                max_tokens = body.max_completion_tokens or body.max_tokens
                top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
            else:
                prompt = (list(body.prompt) if isinstance(body.prompt, list)
                          else self.tokenizer.encode(body.prompt, add_special_tokens=True))
                max_tokens = body.max_tokens or 16
                top_logprobs = body.logprobs
        except (ValueError, TypeError) as error:
            raise ApiError(400, str(error)) from None
        if not prompt:
            raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
        if len(prompt) >= self.max_len:
            raise ApiError(400, f"the prompt holds {len(prompt)} tokens; this server's context is {self.max_len}",
                           param="prompt", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = self.max_len - len(prompt)
        if len(prompt) + max_tokens > self.max_len:
            raise ApiError(400, f"{len(prompt)} prompt tokens + max_tokens {max_tokens} exceed this server's context "
                                f"of {self.max_len} tokens", param="max_tokens", code="context_length_exceeded")
        try:  # the request body becomes the engine's SamplingParams here, and only here
            params = SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                top_k=None if body.top_k in (None, 0, -1) else body.top_k,
                top_p=None if body.top_p in (None, 1) else body.top_p, seed=body.seed, n=body.n,
                stop=tuple(body.stops), stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                logprobs=top_logprobs)
            params.sampling.check_vocab(self.tokenizer.vocab_size)
        except (ValueError, TypeError) as error:
            raise ApiError(400, str(error)) from None
        return _Job(prompt, params, params.stop_ids(self.tokenizer.eos_token_ids), body.return_token_ids)

    # ----------------------------------------------------------- generation

    async def generate(self, request: Request, job: _Job, arrived: float) -> AsyncIterator[_Delta | dict]:
        """Submits `job`; yields each choice's deltas, then a dict of usage. Aborts whatever is left on exit."""
        try:
            handle = await self.engine.submit(job.prompt, job.params, eos_token_ids=self.tokenizer.eos_token_ids)
        except Full as error:
            self.metrics.rejected.labels("429").inc()
            raise ApiError(429, str(error), "rate_limit_error", headers={"Retry-After": "1"}) from None
        except ShuttingDown as error:
            self.metrics.rejected.labels("503").inc()
            raise ApiError(503, str(error), "service_unavailable") from None
        except (ValueError, TypeError) as error:
            self.metrics.rejected.labels("400").inc()
            raise ApiError(400, str(error)) from None
        first = handle.indices[0]
        choices = [_Choice(TextStream(self.tokenizer, prompt=job.prompt, stop=job.stops, stop_token_ids=job.stop_ids))
                   for _ in handle.indices]
        open_ = set(handle.indices)
        cached = 0
        try:
            while open_:
                event = await _next_event(handle.events, request)
                kind, index = event[0], event[1]
                choice = choices[index - first]
                if choice.finish_reason is not None:
                    continue
                if kind == "error":
                    raise ApiError(503, event[2], "service_unavailable")
                if kind == "token":
                    delta = self._token(index - first, choice, event[2], job, arrived)
                else:  # done
                    completion = event[2]
                    cached = max(cached, completion.cached_tokens)
                    tail, stopped = choice.stream.finish()
                    reason = "stop" if stopped or completion.finish_reason == "stop" else "length"
                    delta = _Delta(index - first, tail, finish_reason=reason)
                if delta.finish_reason is not None:
                    choice.finish_reason = delta.finish_reason
                    open_.discard(index)
                    self.metrics.requests.labels(delta.finish_reason).inc()
                    self.metrics.e2e.observe(time.perf_counter() - arrived)
                    if kind == "token":  # a stop string: the engine may still be producing
                        self.engine.abort([index])
                yield delta
        finally:
            if open_:
                self.engine.abort(sorted(open_))
        completion_tokens = sum(len(c.token_ids) for c in choices)
        usage = {"prompt_tokens": len(job.prompt), "completion_tokens": completion_tokens,
                 "total_tokens": len(job.prompt) + completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        request.state.usage = usage  # for the request's log line (_RequestLog)
        yield usage

    def _token(self, row: int, choice: _Choice, token: Token, job: _Job, arrived: float) -> _Delta:
        now = time.perf_counter()
        if choice.last_token_at is None:
            self.metrics.ttft.observe(now - arrived)
        else:
            self.metrics.itl.observe(now - choice.last_token_at)
        choice.last_token_at = now
        choice.token_ids.append(token.id)
        piece, stopped = choice.stream.push(token.id)
        strings = [(token, self.tokenizer.decode([token.id], skip_special_tokens=False))] if job.top_logprobs \
            is not None else []
        choice.logprobs += strings
        return _Delta(row, piece, [token.id], strings, "stop" if stopped else None)

    def token_logprobs(self, tokens: list[tuple[Token, str]], chat: bool, offset: int = 0) -> dict:
        """OpenAI's logprobs object: `{"content": [...]}` for chat, the legacy four lists for completions."""
        decode = self.tokenizer.decode
        if chat:
            return {"content": [
                {"token": text, "logprob": token.logprob, "bytes": list(text.encode()),
                 "top_logprobs": [{"token": (alt := decode([i], skip_special_tokens=False)), "logprob": lp,
                                   "bytes": list(alt.encode())} for i, lp in token.top]}
                for token, text in tokens]}
        offsets, position = [], offset
        for _, text in tokens:
            offsets.append(position)
            position += len(text)
        return {"tokens": [text for _, text in tokens], "token_logprobs": [token.logprob for token, _ in tokens],
                "top_logprobs": [{decode([i], skip_special_tokens=False): lp for i, lp in token.top}
                                 for token, _ in tokens],
                "text_offset": offsets}


class ClientGone(Exception):
    """The client closed its connection before its answer was complete."""


async def _next_event(events: asyncio.Queue, request: Request):
    """The next engine event; raises `ClientGone` if the client has gone meanwhile."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), timeout=0.5)
        except TimeoutError:
            if await request.is_disconnected():
                raise ClientGone from None


def create_app(engine: Engine, tokenizer: Tokenizer, metrics: Metrics, *, model_name: str, max_len: int,
               api_key: str | None = None, warm_up: bool = True) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine (and, with `warm_up`, compiles by generating) and stops it."""
    state = _App(engine, tokenizer, metrics, model_name=model_name, max_len=max_len, api_key=api_key)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.start()
        if warm_up:  # a first generation before the port opens: the device works
            await _health_generation(engine)
        yield
        engine.stop()

    app = FastAPI(title="kvattn", lifespan=lifespan, max_body_size=MAX_BODY_BYTES, docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.middleware("http")
    async def _authorize(request: Request, call_next):  # before the body is read or checked
        if request.url.path.startswith("/v1/"):
            try:
                state.authorize(request)
            except ApiError as error:
                return error.response()
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def _api_error(_request, error: ApiError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, error: RequestValidationError):
        problems = "; ".join(_describe(e) for e in error.errors()[:8])
        metrics.rejected.labels("400").inc()
        return ApiError(400, f"invalid request: {problems}").response()

    @app.exception_handler(HTTPException)
    async def _http(_request, error: HTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}
        return ApiError(error.status_code, str(error.detail), kind.get(error.status_code, "invalid_request_error"),
                        headers=getattr(error, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request, error: Exception):  # a bug: say so, and keep serving
        log.exception("unexpected error")
        return ApiError(500, f"internal error: {type(error).__name__}", "server_error").response()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": state.created, "owned_by": "kvattn",
             "max_model_len": max_len}]}

    @app.get("/health")
    async def health():
        try:  # the bookkeeping is consistent and the device produces tokens
            await engine.check()
            await asyncio.wait_for(_health_generation(engine), timeout=60)
        except (Full, ShuttingDown, TimeoutError, RuntimeError) as error:
            raise ApiError(503, f"unhealthy: {type(error).__name__}: {error}", "service_unavailable") from None
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _respond(state, request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await _respond(state, request, body, chat=True)

    app.add_middleware(_RequestLog)  # added last, so outermost: its time includes the other middleware's
    return app


class _RequestLog:
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


async def _health_generation(engine: Engine) -> None:
    """Generates two tokens (a prefill and a decode step) through the engine."""
    handle = await engine.submit([0], SamplingParams(max_tokens=2))
    while True:
        event = await handle.events.get()
        if event[0] == "error":
            raise RuntimeError(event[2])
        if event[0] == "done":
            return


async def _respond(state: _App, request: Request, body, chat: bool):
    arrived = time.perf_counter()
    job = state.job(body)
    created, ident = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": state.model_name}
    events = state.generate(request, job, arrived)
    first = await anext(events)  # errors before the first token (refusals) become plain JSON errors
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return EventSourceResponse(_sse(state, events, first, head, job, chat, usage))
    try:
        return await _whole(state, events, first, head, job, chat)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the request was aborted
    finally:
        await events.aclose()


async def _whole(state: _App, events, first, head: dict, job: _Job, chat: bool) -> dict:
    choices = [{"text": [], "ids": [], "tokens": [], "finish_reason": None} for _ in range(job.n)]
    item = first
    while not isinstance(item, dict):
        choice = choices[item.index]
        choice["text"].append(item.text)
        choice["ids"] += item.ids
        choice["tokens"] += item.tokens
        choice["finish_reason"] = item.finish_reason or choice["finish_reason"]
        item = await anext(events)
    out = []
    for index, choice in enumerate(choices):
        text = "".join(choice["text"])
        entry = {"index": index, "finish_reason": choice["finish_reason"],
                 "logprobs": state.token_logprobs(choice["tokens"], chat) if job.top_logprobs is not None else None}
        entry |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        if job.token_ids:
            entry["token_ids"] = choice["ids"]
        out.append(entry)
    return {**head, "choices": out, "usage": item}


async def _sse(state: _App, events, first, head: dict, job: _Job, chat: bool, usage: bool):
    chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    offsets = [0] * job.n
    if chat:
        for index in range(job.n):
            yield _event({**chunk_head, "choices": [
                {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]})
    item = first
    try:
        while not isinstance(item, dict):
            if item.text or item.ids or item.finish_reason:
                logprobs = (state.token_logprobs(item.tokens, chat, offsets[item.index])
                            if job.top_logprobs is not None and item.tokens else None)
                offsets[item.index] += len(item.text)
                entry = {"index": item.index, "logprobs": logprobs, "finish_reason": item.finish_reason}
                entry |= {"delta": {"content": item.text} if item.text else {}} if chat else {"text": item.text}
                if job.token_ids:
                    entry["token_ids"] = item.ids
                yield _event({**chunk_head, "choices": [entry]})
            item = await anext(events)
    except ApiError as error:
        yield _event(error.body())
        yield format_sse_event(data_str="[DONE]")
        return
    except ClientGone:
        return
    finally:
        await events.aclose()  # aborts what is left, whether the stream ended or was cancelled
    if usage:
        yield _event({**chunk_head, "choices": [], "usage": item})
    yield format_sse_event(data_str="[DONE]")


def _event(data: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(data, separators=(",", ":")))


def _describe(error: dict) -> str:
    where = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
    return f"{where or 'body'}: {error.get('msg', 'invalid')}"


class _Uvicorn(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT also starting the engine's deadline; a graceful stop exits 0."""

    def __init__(self, config: uvicorn.Config, engine: Engine, deadline: float):
        super().__init__(config)
        self.engine, self.deadline = engine, deadline

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and sockets:  # after the lifespan's first generation: requests are answered from now on
            host, port = sockets[0].getsockname()[:2]
            log.info("ready on http://%s:%d", f"[{host}]" if ":" in host else host, port)

    def handle_exit(self, sig, frame):
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
            return
        self.should_exit = True  # uvicorn's own handler would re-raise the signal after the stop: exit status 0
        self.engine.shutdown(self.deadline)


def run(app: FastAPI, engine: Engine, *, sock: socket.socket, shutdown_seconds: float) -> None:
    """Serves `app` on `sock` until SIGTERM/SIGINT; running requests get `shutdown_seconds` to finish.

    Args:
      sock: a bound, listening TCP socket; the caller takes the port before
        loading anything, so a port in use is reported at once, not after
        the model loads. uvicorn closes it when it stops.
    """
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=shutdown_seconds + 5,
                            timeout_keep_alive=5)
    _Uvicorn(config, engine, shutdown_seconds).run(sockets=[sock])
