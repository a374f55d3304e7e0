"""The `Server` on a thread of its own, and the asyncio side that talks to it.

A `Server` is not thread-safe and its `step()` blocks for a device call, so
one engine thread owns it: it takes commands (submit, abort) from a queue
between steps, steps while anything is queued or running, and hands every
new token and completion to the event loop of the request that asked for
it (`loop.call_soon_threadsafe`). Nothing on the event loop ever waits for
the device.

- A submit is answered before the response starts: the request's indices,
  or the error that refused it (`Full` past `max_waiting` queued requests,
  `ShuttingDown` after `shutdown`, the server's `ValueError` for a request
  that can never fit).
- `abort` is fire-and-forget: the engine frees the request's sequence and pages
  before its next step.
- A step that fails loses no request (the server re-queues them); after
  `max_failures` failures in a row the engine gives up on the requests it
  holds and ends each with an error event, and keeps serving new ones.
- `shutdown(deadline)` stops admission; running and queued requests go on
  until the deadline, and whatever is left then ends with an error event.
- A request that finds the engine idle waits for those behind it while they
  keep arriving, each within `burst_gap_s` of the one before, or while the
  HTTP side still holds some on their way (`arriving`), until they fill
  every sequence: a burst's requests, which reach the thread milliseconds
  apart, then start in one step, are prefilled in one call and decode in
  step from their first token, instead of the first running alone and each
  later one's prefill landing between the earlier ones' tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

from kvattn.generation.adjust import Grammar
from kvattn.generation.sampling import SamplingParams
from kvattn.serving.requests import Stats, Token
from kvattn.serving.server import Server

__all__ = ["Engine", "Full", "Handle", "ShuttingDown"]

BURST_GAPS = 8
"""The longest an idle engine's first request waits for others, in gaps (`burst_gap_s`): a stream of commands that
never fills the batch (refused requests, aborts), or requests slow on their way, hold it no longer."""

_POLL_S = 0.001
"""How often a gathering engine looks again at the requests on their way."""

log = logging.getLogger("kvattn.serve")


class Full(Exception):
    """The waiting queue is full: try again later."""


class ShuttingDown(Exception):
    """The engine admits nothing more."""


@dataclasses.dataclass
class Handle:
    """A submitted request as the event loop sees it: its indices and the events the engine sends it.

    Events are `("token", index, Token)`, `("done", index, Completion)` and
    `("error", index, message)`; each index gets exactly one `done` or `error`.
    """

    indices: list[int]
    events: asyncio.Queue


@dataclasses.dataclass
class _Submit:
    """Queue a request; answer `future` with its indices, or the error that refused it."""

    prompt: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    grammar: Callable[[], Grammar] | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    future: asyncio.Future


@dataclasses.dataclass
class _Abort:
    """End these requests before the next step."""

    indices: list[int]


@dataclasses.dataclass
class _Shutdown:
    """Admit nothing more; end what is left at `deadline` (monotonic seconds)."""

    deadline: float


@dataclasses.dataclass
class _Check:
    """Run the page manager's invariant check; answer `future`."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclasses.dataclass
class _Wake:
    """Nothing: wakes the thread so it sees it was stopped."""


_Command = _Submit | _Abort | _Shutdown | _Check | _Wake
"""What the event loop asks of the engine thread, through one queue."""


class Engine:
    """Runs `server` on a daemon thread.

    Args:
      server: the `Server` it owns from now on; nothing else may call it.
      max_waiting: requests queued, not yet running, before `submit` raises `Full`.
      max_failures: failed steps in a row after which the held requests end with an error.
      burst_gap_s: the longest gap between requests arriving at an idle engine that still starts them in one step
        (0: none, and no wait for requests on their way either).
      on_step: called on the engine thread with the server's `Stats` after each step and each abort (metrics).
      on_error: called on the engine thread with the exception of each failed step.
    """

    def __init__(self, server: Server, *, max_waiting: int = 64, max_failures: int = 3, burst_gap_s: float = 0.0,
                 on_step: Callable[[Stats], None] | None = None, on_error: Callable[[Exception], None] | None = None):
        self.server = server
        self.max_waiting = max_waiting
        self.max_failures = max_failures
        self.burst_gap_s = burst_gap_s
        self._on_step = on_step
        self._on_error = on_error
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._routes: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._deadline: float | None = None
        self._stopped = threading.Event()
        self._arriving = 0  # requests between the HTTP side's receipt and their submit (written on the event loop)
        self._thread = threading.Thread(target=self._loop, name="kvattn-engine", daemon=True)
        self.failures = 0

    # -------------------------------------------------------- event-loop side

    def start(self) -> None:
        self._thread.start()

    async def submit(self, prompt: list[int], params: SamplingParams, *, eos_token_ids=(),
                     grammar: Callable[[], Grammar] | None = None, events: asyncio.Queue | None = None) -> Handle:
        """`Server.submit(prompt, params, eos_token_ids=..., grammar=...)` on the engine thread (`on_token` is the
        engine's); its events go to `events` (default: a queue of its own; several submits may share one)."""
        loop = asyncio.get_running_loop()
        command = _Submit(prompt, params, frozenset(eos_token_ids), grammar, loop,
                          asyncio.Queue() if events is None else events, loop.create_future())
        self._commands.put(command)
        indices = await command.future
        return Handle(indices, command.events)

    @contextlib.contextmanager
    def arriving(self):
        """Marks a request on its way to `submit` (read, its prompt being built): an idle engine that has taken the
        first request of a burst waits for those still on their way, at most `BURST_GAPS` gaps in all."""
        self._arriving += 1
        try:
            yield
        finally:
            self._arriving -= 1

    async def check(self) -> None:
        """Runs the page manager's invariant check on the engine thread; raises what it finds."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(_Check(loop, future))
        await future

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs and admits requests (not stopped, not shutting down)."""
        return self._thread.is_alive() and not self._stopped.is_set() and self._deadline is None

    def abort(self, indices) -> None:
        """Ends these requests before the next step, if they are still queued or running."""
        self._commands.put(_Abort(list(indices)))

    def shutdown(self, deadline_seconds: float) -> None:
        """Admits nothing more; what is left after `deadline_seconds` ends with an error."""
        self._commands.put(_Shutdown(time.monotonic() + deadline_seconds))

    def stop(self, timeout: float = 10.0) -> None:
        """Ends the thread (after `shutdown`'s deadline has done its work)."""
        self._stopped.set()
        self._commands.put(_Wake())
        self._thread.join(timeout)

    # ----------------------------------------------------------- engine thread

    def _loop(self):
        while not self._stopped.is_set():
            idle = self.server.idle
            self._take_commands(block=idle)
            if idle and not self.server.idle:
                self._gather()
            if self._deadline is not None and time.monotonic() >= self._deadline and self._routes:
                self._end_all("the server is shutting down and this request ran past its deadline")
            if self.server.idle:
                continue
            try:
                finished = self.server.step()
            except Exception as error:  # the server re-queued every request: report, and go on
                self.failures += 1
                log.exception("engine step failed (%d in a row)", self.failures)
                if self._on_error is not None:
                    self._on_error(error)
                if self.failures >= self.max_failures:
                    self._end_all(f"the device failed {self.failures} times in a row: {error}")
                continue
            self.failures = 0
            for completion in finished:
                self._send(completion.request, ("done", completion.request, completion))
            if self._on_step is not None:
                self._on_step(self.server.stats)

    def _take_commands(self, block: bool):
        try:
            command = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._do(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _gather(self):
        """Takes commands while they keep coming, each within `burst_gap_s` of the one before, or while requests are
        on their way (`arriving`), at most `BURST_GAPS` gaps in all, until the queued requests fill every
        sequence."""
        start = last = time.monotonic()
        end = start + BURST_GAPS * self.burst_gap_s
        sequences = self.server.config.cache.batch_size
        while self.server.stats.waiting < sequences:
            now = time.monotonic()
            until = min(end, max(last + self.burst_gap_s, now + _POLL_S if self._arriving else now))
            if until <= now:
                return
            try:
                command = self._commands.get(timeout=until - now)
            except queue.Empty:
                continue  # look again: the gap may have passed, or the requests on their way arrived
            self._do(command)
            last = time.monotonic()

    def _do(self, command: _Command):
        match command:
            case _Submit():
                command.loop.call_soon_threadsafe(self._settle, command.future, *self._submit(command))
            case _Abort(indices):
                for index in indices:
                    completion = self.server.abort(index)
                    if completion is not None:
                        self._send(index, ("done", index, completion))
                    else:  # ended with another choice of its submit, or already finished
                        self._routes.pop(index, None)
                if self._on_step is not None:  # the metrics see the freed pages now, not at the next step
                    self._on_step(self.server.stats)
            case _Shutdown(deadline):
                self._deadline = deadline
            case _Check(loop, future):
                try:
                    self.server.manager.check()
                    error = None
                except AssertionError as failed:
                    error = RuntimeError(f"page bookkeeping is inconsistent: {failed}")
                loop.call_soon_threadsafe(self._settle, future, None if error else [], error)

    def _submit(self, command: _Submit):
        if self._deadline is not None:
            return None, ShuttingDown("the server is shutting down")
        if self.server.stats.waiting >= self.max_waiting:
            return None, Full(f"{self.server.stats.waiting} requests are waiting, the most this server queues")
        try:
            first = self.server.submit(command.prompt, command.params, eos_token_ids=command.eos_token_ids,
                                       on_token=self._on_token, grammar=command.grammar)
        except (ValueError, TypeError) as error:
            return None, error
        indices = list(range(first, first + command.params.n))
        for index in indices:
            self._routes[index] = (command.loop, command.events)
        return indices, None

    def _on_token(self, index: int, token: Token):
        route = self._routes.get(index)
        if route is not None:
            route[0].call_soon_threadsafe(route[1].put_nowait, ("token", index, token))

    def _send(self, index: int, event):
        route = self._routes.pop(index, None)
        if route is not None:
            route[0].call_soon_threadsafe(route[1].put_nowait, event)

    def _settle(self, future: asyncio.Future, indices, error):
        """On the event loop: answers a submit; a request whose caller has gone is aborted."""
        if future.cancelled():
            if indices is not None:
                self.abort(indices)
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(indices)

    def _end_all(self, message: str):
        """Aborts every held request; each gets an error event."""
        for index in list(self._routes):
            self.server.abort(index)
            self._send(index, ("error", index, message))
        self.failures = 0
