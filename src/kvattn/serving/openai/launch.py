"""`kvattn serve` once its port is held: load, compile, serve with uvicorn, stop gracefully on SIGTERM/SIGINT.

`serve` assembles the engine (`Server` on the checkpoint's paged model, its
`Engine` thread), the tokenizer, the metrics and the app, logging each phase
on stderr; `run` serves an app on a socket the caller took before loading.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import sys
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from kvattn import models
from kvattn.caches.base import blocks_spanned
from kvattn.extra import loading_progress
from kvattn.generation.drafters import PromptLookup
from kvattn.serving.engine import Engine
from kvattn.serving.openai.app import TEXT_WORKERS, create_app
from kvattn.serving.openai.metrics import Metrics
from kvattn.serving.server import Server
from kvattn.serving.tokenizer import Tokenizer

__all__ = ["run", "serve"]

log = logging.getLogger("kvattn.serve")


FORCED_EXIT_STATUS = 130
"""`kvattn serve`'s exit status after a second Ctrl-C (128 + SIGINT, as a shell reports an interrupted program)."""
FORCED_GRACE_SECONDS = 0.5
"""After a second Ctrl-C, how long the requests' errors have to reach their clients before the connections close."""


class _Uvicorn(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT also starting the engine's deadline; a graceful stop exits 0.

    A second Ctrl-C (SIGINT after the stop began) ends every request now: the
    engine ends each with an error (a 503, or an error event in a stream),
    the connections close `FORCED_GRACE_SECONDS` later, and `forced` makes
    the exit status `FORCED_EXIT_STATUS`.
    """

    def __init__(self, config: uvicorn.Config, engine: Engine, deadline: float):
        super().__init__(config)
        self.engine, self.deadline = engine, deadline
        self.forced = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and sockets:  # after the lifespan's first generation: requests are answered from now on
            host, port = sockets[0].getsockname()[:2]
            log.info("ready on http://%s:%d", f"[{host}]" if ":" in host else host, port)

    def handle_exit(self, sig, frame):
        if self.should_exit and sig == signal.SIGINT:
            if not self.forced:
                self.forced = True
                self.engine.shutdown(0.0)  # every request ends with an error at the engine's next turn
                log.warning("second interrupt: ending every request now")
                if self._loop is None:
                    self.force_exit = True
                else:
                    self._loop.call_soon_threadsafe(self._loop.call_later, FORCED_GRACE_SECONDS, self._force)
            return
        self.should_exit = True  # uvicorn's own handler would re-raise the signal after the stop: exit status 0
        self.engine.shutdown(self.deadline)

    def _force(self) -> None:
        self.force_exit = True


def run(app: FastAPI, engine: Engine, *, sock: socket.socket, shutdown_seconds: float) -> int:
    """Serves `app` on `sock` until SIGTERM/SIGINT; running requests get `shutdown_seconds` to finish. Returns
    the exit status: 0, or `FORCED_EXIT_STATUS` after a second Ctrl-C.

    Args:
      sock: a bound, listening TCP socket; the caller takes the port before
        loading anything, so a port in use is reported at once, not after
        the model loads. uvicorn closes it when it stops.
    """
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=shutdown_seconds + 5,
                            timeout_keep_alive=5)
    server = _Uvicorn(config, engine, shutdown_seconds)
    server.run(sockets=[sock])
    return FORCED_EXIT_STATUS if server.forced else 0


# A chat template renders request data: bounded per request (`kvattn.templates.TemplateProcesses`).
TEMPLATE_SECONDS = 5.0
TEMPLATE_MAX_CHARS = 32 << 20
TEMPLATE_MEMORY_BYTES = 1 << 30
PROBE_CONVERSATION = [{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "Hello!"}]


def _bound_templates(tokenizer: Tokenizer) -> None:
    """Renders the chat template bounded from now on, and refuses to start if it fails on a plain conversation."""
    if not tokenizer.has_chat_template:
        return
    tokenizer.bound_rendering(seconds=TEMPLATE_SECONDS, max_chars=TEMPLATE_MAX_CHARS,
                              memory_bytes=TEMPLATE_MEMORY_BYTES, processes=TEXT_WORKERS)
    try:
        tokenizer.render_chat(PROBE_CONVERSATION)
    except ValueError as error:
        tokenizer.close()
        raise ValueError(f"the chat template fails on a plain system + user conversation ({error}); fix it or "
                         "pass another with --chat-template") from None


def serve(checkpoint: Path, *, sock: socket.socket, max_len: int, max_batch: int, page_size: int,
          num_pages: int | None, chunk: int, prefills_per_step: int, prefix_caching: bool,
          step_tokens: int | None, async_scheduling: bool, burst_gap_s: float,
          speculative: PromptLookup | None, dtype: str, weights: str | None, chat_template: str | None, model_name: str | None,
          api_key: str | None, max_waiting: int, shutdown_seconds: float) -> int:
    """Loads `checkpoint` as a paged model, compiles every program, and serves it on `sock` until SIGTERM;
    returns the exit status (`run`'s).

    Each phase is logged on stderr with the seconds it took: loading, each
    program compiled, ready; then one line per request. The arguments are
    `kvattn serve`'s options (`kvattn serve --help`).
    """
    def say(message: str) -> None:
        print(f"kvattn serve: {message}", file=sys.stderr, flush=True)

    tokenizer = Tokenizer.from_directory(checkpoint, chat_template=chat_template)
    _bound_templates(tokenizer)
    try:  # the template's child processes end with the server, or with a failed start
        num_pages = num_pages or max_batch * blocks_spanned(max_len, page_size) + 1
        say(f"loading {checkpoint} (max_len {max_len}, batch {max_batch}, {num_pages} pages of {page_size})")
        start = time.perf_counter()
        model = models.from_pretrained(checkpoint, max_len=max_len, batch_size=max_batch, dtype=dtype,
                                       weights=weights, num_pages=num_pages, page_size=page_size,
                                       on_tensor=loading_progress())
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's vocabulary of "
                             f"{model.config.vocab_size}")
        server = Server(model, chunk=chunk, prefix_caching=prefix_caching, prefills_per_step=prefills_per_step,
                        speculative=speculative, step_tokens=step_tokens, async_scheduling=async_scheduling,
                        donate_pools=True)  # the model is the server's alone
        say(f"loaded in {time.perf_counter() - start:.1f} s; compiling the engine's programs")
        start = time.perf_counter()
        server.warm_up(on_program=lambda done, total: say(
            f"compiled {done}/{total} programs ({time.perf_counter() - start:.1f} s)"))
        # What lives now lives as long as the server (the model, its programs, the libraries): frozen, the
        # collector's full passes no longer walk it, and a pass stops both threads for milliseconds, not ~90.
        gc.collect()
        gc.freeze()
        metrics = Metrics()
        engine = Engine(server, max_waiting=max_waiting, burst_gap_s=burst_gap_s, on_step=metrics.on_step,
                        on_error=lambda _: metrics.engine_errors.inc())
        app = create_app(engine, tokenizer, metrics, model_name=model_name or checkpoint.resolve().name,
                         max_len=max_len, api_key=api_key)
        if not log.handlers:  # the ready line, one line per request, the engine's errors
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("kvattn serve: %(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
            log.propagate = False
        return run(app, engine, sock=sock, shutdown_seconds=shutdown_seconds)
    finally:
        tokenizer.close()
