"""Running the app: uvicorn on a socket the CLI took before loading, with a graceful stop on SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import signal
import socket

import uvicorn
from fastapi import FastAPI

from kvattn.serving.engine import Engine

__all__ = ["run"]

log = logging.getLogger("kvattn.serve")


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
