"""kvattn.serving.openai.launch: the stop on signals (test_http.py's last test stops a real server with SIGTERM)."""

from __future__ import annotations

import asyncio
import signal

import uvicorn

from kvattn.serving.openai import launch


class _Engine:
    def __init__(self):
        self.deadlines = []

    def shutdown(self, deadline_seconds: float) -> None:
        self.deadlines.append(deadline_seconds)


def test_a_second_interrupt_ends_every_request_with_an_error_then_exits_130():
    engine = _Engine()
    server = launch._Uvicorn(uvicorn.Config(lambda *_: None), engine, 7.0)

    async def signals():
        server._loop = asyncio.get_running_loop()
        server.handle_exit(signal.SIGINT, None)  # the first Ctrl-C: a graceful stop with the deadline
        assert server.should_exit and not server.force_exit and engine.deadlines == [7.0]
        server.handle_exit(signal.SIGINT, None)  # the second: every request ends now, with an error
        server.handle_exit(signal.SIGINT, None)  # a third changes nothing more
        assert server.forced and engine.deadlines == [7.0, 0.0]
        assert not server.force_exit, "the connections stay open while the errors reach the clients"
        await asyncio.sleep(launch.FORCED_GRACE_SECONDS + 0.2)
        assert server.force_exit

    asyncio.run(signals())


def test_sigterm_after_sigterm_is_still_a_graceful_stop():
    engine = _Engine()
    server = launch._Uvicorn(uvicorn.Config(lambda *_: None), engine, 3.0)
    server.handle_exit(signal.SIGTERM, None)
    server.handle_exit(signal.SIGTERM, None)
    assert not server.forced and not server.force_exit and engine.deadlines == [3.0, 3.0]
