"""`kvattn serve`: the OpenAI HTTP API (FastAPI + uvicorn) on the paged engine.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with
`stream`), `GET /v1/models`, `GET /health` (liveness: answers at once while
the engine thread runs; `?deep=true` also checks the page bookkeeping and
generates two tokens, queued behind real work), `POST /tokenize` and
`POST /detokenize` (vLLM's shapes) and `GET /metrics` (Prometheus). Each
request is rendered and tokenized on a worker thread (never on the event
loop, so a long prompt stalls no other stream), submitted to the `Engine`
thread, and answered from the tokens it sends back: text is
detokenized incrementally (never half a UTF-8 character) and matched
against the request's stop strings across token boundaries (a stop string
is never sent; the request is aborted at once, its pages back in the
pool). A client that goes away mid-request, streamed or not, has it
aborted the same way within half a second.

Every refusal is an OpenAI-shaped JSON error: 400 for a bad body, 401 for a
wrong key, 404 for an unknown model or path, 413 for a body over 4 MiB, 429
with `Retry-After` when the waiting queue is full, 503 while shutting down.
Extensions over OpenAI's fields, as vLLM names them: `top_k`,
`stop_token_ids`, `ignore_eos`, and `return_token_ids` (each choice also
carries its token ids).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from kvattn.errors import header_value
from kvattn.generation.sampling import SamplingParams
from kvattn.serving.engine import Engine, Full, ShuttingDown
from kvattn.serving.openai import protocol, responses
from kvattn.serving.openai import tokenize as tokens
from kvattn.serving.openai.metrics import Metrics
from kvattn.serving.openai.middleware import Authorize, BodyLimit, RequestLog
from kvattn.serving.openai.protocol import ApiError, ChatRequest, CompletionRequest, Job
from kvattn.serving.openai.responses import ClientGone
from kvattn.serving.openai.tokenize import DetokenizeRequest, TokenizeRequest
from kvattn.serving.requests import Token
from kvattn.serving.structured import Grammars
from kvattn.serving.text import TextStream
from kvattn.serving.tokenizer import Tokenizer

__all__ = ["create_app"]

log = logging.getLogger("kvattn.serve")
MAX_BODY_BYTES = 4 * 2**20
TEXT_WORKERS = 4
"""Threads that render chat templates and tokenize prompts, off the event loop."""
DISCONNECT_CHECK_SECONDS = 0.5


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
    logprob: float = 0.0
    """Its tokens' log-probability (`best_of` ranks choices by their sum)."""


class _App:
    """The routes' shared state: engine, tokenizer, metrics, settings."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, metrics: Metrics, *, model_name: str, max_len: int):
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.model_name, self.max_len = model_name, max_len
        self.created = int(time.time())
        self.text_workers = concurrent.futures.ThreadPoolExecutor(TEXT_WORKERS, thread_name_prefix="kvattn-text")
        self.grammars = Grammars(tokenizer)

    async def off_loop(self, function, *args, **kwargs):
        """`function(*args, **kwargs)` on a text worker (templates, tokenizer): the event loop stays free."""
        return await asyncio.get_running_loop().run_in_executor(self.text_workers, lambda: function(*args, **kwargs))

    # ----------------------------------------------------------- generation

    async def generate(self, request: Request, job: Job, arrived: float) -> AsyncIterator[_Delta | dict]:
        """Submits `job`, each prompt in turn; yields each choice's deltas (choices numbered prompt after prompt),
        then a dict of usage. Aborts whatever is left on exit."""
        events: asyncio.Queue = asyncio.Queue()
        indices: list[int] = []
        submitted = False
        try:
            for prompt in job.prompts:
                handle = await self.engine.submit(prompt, job.params, eos_token_ids=self.tokenizer.eos_token_ids,
                                                  grammar=job.grammar, events=events)
                indices += handle.indices
            submitted = True
        except Full as error:
            self.metrics.rejected.labels("429").inc()
            raise ApiError(429, str(error), "rate_limit_error", headers={"Retry-After": "1"}) from None
        except ShuttingDown as error:
            self.metrics.rejected.labels("503").inc()
            raise ApiError(503, str(error), "service_unavailable") from None
        except (ValueError, TypeError) as error:
            self.metrics.rejected.labels("400").inc()
            raise ApiError(400, str(error)) from None
        finally:
            if not submitted:  # the prompts submitted before the one refused
                self.engine.abort(indices)
        rows = {index: row for row, index in enumerate(indices)}
        choices = [_Choice(TextStream(self.tokenizer, prompt=job.prompts[row // job.params.n], stop=job.stops,
                                      stop_token_ids=job.stop_ids, skip_special_tokens=job.params.skip_special_tokens,
                                      include_stop=job.params.include_stop_str_in_output,
                                      min_tokens=job.params.min_tokens))
                   for row in range(job.rows)]
        open_ = set(indices)
        cached = 0
        watch = _Disconnects(request)
        try:
            while open_:
                event = await watch.next_event(events)
                kind, index = event[0], event[1]
                choice = choices[rows[index]]
                if choice.finish_reason is not None:
                    continue
                if kind == "error":
                    raise ApiError(503, event[2], "service_unavailable")
                if kind == "token":
                    delta = self._token(rows[index], choice, event[2], job, arrived)
                else:  # done
                    completion = event[2]
                    cached = max(cached, completion.cached_tokens)
                    tail, stopped = choice.stream.finish()
                    reason = "stop" if stopped or completion.finish_reason == "stop" else "length"
                    delta = _Delta(rows[index], tail, finish_reason=reason)
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
        prompt_tokens = sum(len(prompt) for prompt in job.prompts)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        request.state.usage = usage  # for the request's log line (RequestLog)
        yield usage

    def _token(self, row: int, choice: _Choice, token: Token, job: Job, arrived: float) -> _Delta:
        now = time.perf_counter()
        if choice.last_token_at is None:
            self.metrics.ttft.observe(now - arrived)
        else:
            self.metrics.itl.observe(now - choice.last_token_at)
        choice.last_token_at = now
        choice.token_ids.append(token.id)
        piece, stopped = choice.stream.push(token.id)
        strings = [(token, job.token_name(self.tokenizer, token.id))] if job.top_logprobs \
            is not None else []
        choice.logprobs += strings
        return _Delta(row, piece, [token.id], strings, "stop" if stopped else None, token.logprob)

class _Disconnects:
    """Engine events for one request, checking every `DISCONNECT_CHECK_SECONDS` whether its client has gone.

    The check runs whether or not events keep coming, so a request whose
    client left is aborted even while it is producing tokens.
    """

    def __init__(self, request: Request):
        self.request = request
        self.checked = time.monotonic()

    async def next_event(self, events: asyncio.Queue):
        """The next engine event; raises `ClientGone` if the client has gone meanwhile."""
        while True:
            if time.monotonic() - self.checked >= DISCONNECT_CHECK_SECONDS:
                self.checked = time.monotonic()
                if await self.request.is_disconnected():
                    raise ClientGone
            try:
                return await asyncio.wait_for(events.get(), timeout=DISCONNECT_CHECK_SECONDS)
            except TimeoutError:
                continue


def create_app(engine: Engine, tokenizer: Tokenizer, metrics: Metrics, *, model_name: str, max_len: int,
               api_key: str | None = None, warm_up: bool = True) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine (and, with `warm_up`, compiles by generating) and stops it.

    Raises:
      ValueError: an `api_key` that no HTTP header can carry (not printable ASCII).
    """
    if api_key is not None:
        header_value("api_key", api_key)
    state = _App(engine, tokenizer, metrics, model_name=model_name, max_len=max_len)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.start()
        if warm_up:  # a first generation before the port opens: the device works
            await _health_generation(engine)
        yield
        engine.stop()
        state.text_workers.shutdown(wait=False, cancel_futures=True)
        tokenizer.close()

    # The body limit is `BodyLimit`'s: Starlette's answers a declared Content-Length over it in plain text.
    app = FastAPI(title="kvattn", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # Plain ASGI middleware (Starlette's `BaseHTTPMiddleware` would hide a client's disconnect from the routes).
    # Innermost: the route reads the body through `BodyLimit` itself, so its 413 reaches the handlers unwrapped.
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    if api_key is not None:
        app.add_middleware(Authorize, api_key=api_key)  # before the body is read or checked

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
    async def health(deep: bool = False):
        if not engine.alive:
            raise ApiError(503, "unhealthy: the engine is stopped or shutting down", "service_unavailable")
        if not deep:  # liveness: never queued behind work, so a busy server is not mistaken for a dead one
            return {"status": "ok"}
        try:  # the bookkeeping is consistent and the device produces tokens
            await engine.check()
            await asyncio.wait_for(_health_generation(engine), timeout=60)
        except (Full, ShuttingDown, TimeoutError, RuntimeError) as error:
            raise ApiError(503, f"unhealthy: {type(error).__name__}: {error}", "service_unavailable") from None
        return {"status": "ok"}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        answer = await state.off_loop(tokens.tokenized, body, tokenizer, model_name=model_name, max_len=max_len)
        return Response(answer, media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await state.off_loop(tokens.detokenized, body, tokenizer, model_name=model_name)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _respond(state, request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await _respond(state, request, body, chat=True)

    app.add_middleware(RequestLog)  # added last, so outermost: its time includes the other middleware's
    return app


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
    with state.engine.arriving():  # an idle engine taking a burst's first request waits for this one too
        job = await state.off_loop(protocol.job, body, state.tokenizer, model_name=state.model_name,
                                   max_len=state.max_len, grammars=state.grammars)
    created, ident = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": state.model_name}
    events = state.generate(request, job, arrived)
    first = await anext(events)  # errors before the first token (refusals) become plain JSON errors
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return EventSourceResponse(responses.sse(state.tokenizer, events, first, head, job, chat, usage))
    try:
        return await responses.whole(state.tokenizer, events, first, head, job, chat)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the request was aborted
    finally:
        await events.aclose()


def _describe(error: dict) -> str:
    where = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
    return f"{where or 'body'}: {error.get('msg', 'invalid')}"


