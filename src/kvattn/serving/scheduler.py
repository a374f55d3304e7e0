"""The host half of the engine: which request holds which sequence, and what the next step runs.

Policy only, in NumPy, testable without a device: requests wait in a queue,
are admitted when the `PageManager` says they fit now, get their prompts
prefilled a chunk at a time (oldest first, at most `prefills_per_step`
chunks a step), and are preempted, youngest first, when pages run short.
How many tokens a sequence holds is the manager's count alone (`held`): the
scheduler reserves before each device call and rolls back after a
speculative round, and never keeps a second count.

- A recomputed (preempted) request keeps its first admission's place, so it
  is not the first victim again; it goes back to the head of the queue with
  what it has generated, and recomputes it as prompt chunks.
- Prefix caching: after its prompt is prefilled, a request's full pages are
  registered under a chained hash of their tokens and its `salt`, and a
  later request with the same leading tokens maps them and prefills only the
  rest. Chunks start at multiples of `chunk` in absolute positions, so a hit
  runs the very programs a cold run would.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from kvattn.config import AttentionConfig
from kvattn.paging import OutOfPagesError, PageBatch, PageManager
from kvattn.serving.requests import Completion, Request, Stats

__all__ = ["Scheduler"]


class Scheduler:
    """Requests, sequences and pages for a paged model of `config`.

    Args:
      config: the model's attention config (batch size, pages).
      chunk: prefill chunk in tokens, a multiple of the page size.
      prefix_caching: share the pages of equal prompt prefixes.
      prefills_per_step: prefill chunks a step runs at most.
      window: the sliding window behind which a sequence's pages are released (every layer's), or None.
    """

    def __init__(self, config: AttentionConfig, *, chunk: int, prefix_caching: bool, prefills_per_step: int,
                 window: int | None = None):
        self.config = config
        self.window = window
        self.chunk = chunk
        self.prefix_caching = prefix_caching
        self.prefills_per_step = prefills_per_step
        self.manager = self._new_manager()
        self.queue: deque[Request] = deque()
        self.seqs: list[Request | None] = [None] * config.cache.batch_size
        self.totals = dict(prompt_tokens=0, cached_tokens=0, generated_tokens=0, drafted_tokens=0, accepted_tokens=0)

    def _new_manager(self) -> PageManager:
        spec = self.config.cache
        return PageManager(spec.num_pages, spec.page_size, spec.batch_size, spec.pages_per_sequence,
                           window=self.window)

    # -------------------------------------------------------------- requests

    def refusal(self, prompt_tokens: int, max_new_tokens: int, n: int) -> str | None:
        """Why a request could never run (None if it can), from the manager's `admission` in an empty pool."""
        total = prompt_tokens + max_new_tokens - 1  # the last new token is never fed back
        spec = self.config.cache
        if total > spec.max_len or self.manager.admission(total, chunk=self.chunk) == "never":
            return (f"a request of {prompt_tokens} prompt + {max_new_tokens} new tokens can never fit: a sequence "
                    f"holds at most max_len={spec.max_len} tokens, in a pool of {spec.num_pages - 1} "
                    f"pages of {spec.page_size} (it needs {self.manager.pages_for(total, chunk=self.chunk)})")
        if n > spec.batch_size:
            return f"n must be at most the batch size {spec.batch_size}, got {n}"
        if self.manager.admission(prompt_tokens, chunk=self.chunk, sequences=n) == "never":
            return (f"{n} choices of a {prompt_tokens}-token prompt can never start together: the pool has "
                    f"{self.config.cache.num_pages - 1} pages")
        return None

    def add(self, leader: Request) -> None:
        self.queue.append(leader)

    def abort(self, index: int) -> Completion | None:
        """Ends request `index` now, freeing its sequence and pages; None if it is not queued or running."""
        for request in list(self.queue):
            if index in (r.index for r in request.group):
                self.queue.remove(request)
                return next(r.completion("abort") for r in request.group if r.index == index)
        for request in self.seqs:
            if request is not None and request.index == index:
                group = request.group if request.leader is None else request.leader.group
                for member in group:
                    self.release(self.seqs.index(member))
                return request.completion("abort")
        return None

    @property
    def idle(self) -> bool:
        return not self.queue and all(s is None for s in self.seqs)

    def stats(self) -> Stats:
        running = sum(r is not None for r in self.seqs)
        waiting = sum(len(r.group) for r in self.queue)
        manager = self.manager
        return Stats(waiting, running, manager.num_free, manager.num_cached, manager.num_live, **self.totals)

    # ----------------------------------------------------------------- sequences

    def held(self, seq: int) -> int:
        """Tokens whose keys and values sequence `seq` holds."""
        return int(self.manager.pos[seq])

    def prefilling(self, seq: int) -> bool:
        request = self.seqs[seq]
        return request is not None and request.leader is None and self.held(seq) < len(request.context)

    def decoding(self) -> list[int]:
        """The sequences whose requests have their prompts in the cache and a pending token."""
        return [s for s, r in enumerate(self.seqs)
                if r is not None and r.leader is None and self.held(s) >= len(r.context)]

    def admittable(self) -> bool:
        """Whether the oldest queued request fits now (what `admit` would take first)."""
        if not self.queue:
            return False
        request = self.queue[0]
        return self.manager.admission(len(request.context), chunk=self.chunk, sequences=len(request.group)) == "now"

    def admit(self) -> None:
        """Admits queued requests, oldest first, while the manager says they fit now."""
        while self.admittable():
            request = self.queue.popleft()
            group = request.group
            now = time.perf_counter()
            for member in group:
                member.admitted_at = now
                if member.first_admitted is None:
                    member.first_admitted = now
                self.seqs[self.manager.add()] = member
            seq = self.seqs.index(request)
            request.cached_tokens = (
                self.manager.attach(seq, request.context, request.salt) if self.prefix_caching else 0
            )
            self.totals["prompt_tokens"] += len(request.context)
            self.totals["cached_tokens"] += request.cached_tokens

    def prefills(self) -> list[int]:
        """The sequences to prefill a chunk of this step, the oldest admitted first: within `prefills_per_step`
        while any request decodes (the bound keeps its time between tokens short), every one when none does (no
        one waits on them, and they start together)."""
        waiting = sorted((s for s in range(len(self.seqs)) if self.prefilling(s)),
                         key=lambda s: self.seqs[s].first_admitted)
        return waiting[: self.prefills_per_step] if self.decoding() else waiting

    def next_chunk(self, seq: int) -> tuple[int, int]:
        """The context positions `(start, end)` of sequence `seq`'s next prefill chunk (chunk-aligned)."""
        start, context = self.held(seq), self.seqs[seq].context
        return start, min(len(context), (start // self.chunk + 1) * self.chunk)

    def reserve(self, counts: np.ndarray) -> PageBatch:
        """Reserves pages for `counts`, preempting the most recently admitted requests while pages run short.

        A preempted request's count is zeroed in `counts`, which the caller reads back.
        """
        while True:
            try:
                return self.manager.reserve(counts)
            except OutOfPagesError:
                leaders = {id(r.leader or r): r.leader or r for r in self.seqs if r is not None}
                if len(leaders) <= 1:
                    raise
                victim = max(leaders.values(), key=lambda r: r.first_admitted)
                for member in victim.group:
                    counts[self.seqs.index(member)] = 0
                self.preempt(victim)

    def prefilled(self, seq: int) -> None:
        """After sequence `seq`'s last prefill chunk: registers its prompt and forks its choices."""
        request = self.seqs[seq]
        if self.prefix_caching:
            self.manager.register(seq, request.context, request.salt)
        for member in request.siblings:  # the prompt's pages by reference, a private copy of a partial one
            self.manager.fork(seq, self.seqs.index(member))
            member.leader = None
        request.siblings = []

    def release(self, seq: int) -> None:
        """Frees a sequence and its pages, registering what it prefilled for the prefix cache."""
        request = self.seqs[seq]
        if self.prefix_caching and request.leader is None:
            self.manager.register(seq, request.context[: self.held(seq)], request.salt)
        self.manager.free(seq)
        self.seqs[seq] = None

    def preempt(self, request: Request) -> None:
        """Back to the head of the queue, with the choices still waiting for it."""
        for member in request.group:
            self.release(self.seqs.index(member))
        request.preemptions += 1
        self.queue.appendleft(request)

    def retire_finished(self) -> list[Completion]:
        """Frees the sequences of the requests that finished; their completions."""
        done = []
        for seq, request in enumerate(self.seqs):
            if request is not None and request.finished:
                self.release(seq)
                done.append(request.completion("stop" if request.stopped else "length"))
        return done

    def recover(self) -> None:
        """After a failed device call: every running request back to the queue; pages and prefix cache afresh."""
        leaders = {id(r.leader or r): r.leader or r for r in self.seqs if r is not None}
        for request in sorted(leaders.values(), key=lambda r: r.first_admitted, reverse=True):
            request.preemptions += 1
            self.queue.appendleft(request)
        self.seqs = [None] * self.config.cache.batch_size
        self.manager = self._new_manager()
