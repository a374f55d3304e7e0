"""Continuous batching on a paged `CausalLM`: a queue of requests admitted, prefilled, decoded and retired.

`Server(model)` takes a model built with `num_pages` and `page_size`. Each
`step()` admits what fits, prefills one chunk of each newly admitted
request, decodes one token for every running one, and retires those that
finished; `run()` steps until the queue is empty. The host `PageManager`
decides which page holds what; the device runs two compiled programs, a
prefill chunk `(1, chunk)` and a decode step over every sequence slot, with
fixed shapes, so requests come and go without a recompilation.

- Admission asks the manager `now / later / never`: a request that can
  never fit (prompt plus new tokens past `max_len`, or past the whole pool)
  is refused at `submit`; one that cannot fit now waits.
- Prefix caching: after its prompt is prefilled, a request's full pages are
  registered under a chained hash of their tokens (and the request's
  `salt`), and a later request with the same leading tokens maps them and
  prefills only the rest. Prefill chunks start at multiples of `chunk` (a
  multiple of the page size) in absolute positions, so a hit runs the very
  programs a cold run would, and, with greedy decoding, gives bit-identical
  outputs.
- Running out of pages preempts the request admitted last (a recomputed
  request keeps its first admission's place, so it is not the first victim
  again): its pages are freed (its full pages stay in the prefix cache) and
  it goes back to the head of the queue with what it has generated so far,
  to be recomputed.
- A device call that fails (or is interrupted) loses no request: every
  running one goes back to the head of the queue with what it had generated,
  the page bookkeeping and the prefix cache start afresh, and the error is
  raised; the next `step()` recomputes them.

The server works on its own copy of the model's page pools (donated from
step to step); the model itself is never changed.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn import validation as check
from kvattn.models.decoder import CausalLM
from kvattn.models.sampling import Sampling, sample_with_logprob
from kvattn.models.tokens import stop_ids, token_ids
from kvattn.paging import OutOfPagesError, PageBatch, PageManager

__all__ = ["Completion", "Server"]


@dataclasses.dataclass
class Completion:
    """A finished request."""

    request: int
    """Its index, in the order of `submit`."""
    tokens: list[int]
    """The new tokens, the stop token included."""
    logprobs: list[float]
    """Log-probability of each new token under the model (after temperature)."""
    cached_tokens: int
    """Prompt tokens its last admission found in the prefix cache."""
    preemptions: int
    """Times it was preempted and recomputed."""
    first_token_seconds: float
    """Wall time from its (last) admission to its first new token."""


@dataclasses.dataclass
class _Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    stop_tokens: frozenset
    salt: bytes
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    preemptions: int = 0
    cached_tokens: int = 0
    admitted_at: float = 0.0
    first_admitted: float | None = None  # its place in line: a recomputed request keeps it
    first_token_seconds: float = 0.0

    @property
    def context(self) -> list[int]:
        """Tokens whose keys and values the sequence needs: the prompt, then all but the last new token."""
        return self.prompt + self.generated[:-1] if self.generated else self.prompt


class Server:
    """Serves requests on a paged `CausalLM` with continuous batching and prefix caching.

    Args:
      model: a `CausalLM` built with `num_pages` and `page_size`; its
        `batch_size` is the number of sequences decoded together.
      chunk: prefill chunk in tokens, a multiple of the page size.
      prefix_caching: share the pages of equal prompt prefixes (off with a
        sliding window, whose early pages are freed).
      temperature, top_k, top_p: sampling, as in `kvattn.models.generate`
        (greedy by default).
      rng: a `jax.random.key`, needed when `temperature > 0`.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from kvattn import RoPE
      >>> from kvattn.models import CausalLM, ModelConfig
      >>> from kvattn.serving import Server
      >>> config = ModelConfig("llama", vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
      ...                      head_dim=8, intermediate_size=64, norm_eps=1e-5, tie_embeddings=True,
      ...                      max_position_embeddings=64, rope=RoPE())
      >>> model = CausalLM(config, max_len=64, batch_size=2, num_pages=16, page_size=8, rngs=nnx.Rngs(0))
      >>> server = Server(model, chunk=16)
      >>> [server.submit(list(range(1, n)), 4) for n in (5, 12, 20)]
      [0, 1, 2]
      >>> [len(c.tokens) for c in server.run()]
      [4, 4, 4]
    """

    def __init__(self, model: CausalLM, *, chunk: int = 64, prefix_caching: bool = True, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, rng=None):
        config = model.blocks[0].attention.config
        if not config.paged:
            raise ValueError("Server needs a paged model: build it with num_pages and page_size")
        chunk = check.positive_int(chunk, "chunk")
        if chunk % config.page_size:
            raise ValueError(f"chunk must be a multiple of page_size={config.page_size}, got {chunk}")
        sampling = Sampling(temperature, top_k, top_p).check_vocab(model.config.vocab_size)
        sampling.check_rng(rng)
        self.config = config
        self.chunk = int(chunk)
        self.prefix_caching = prefix_caching and config.window is None
        self.vocab_size = model.config.vocab_size
        self.manager = PageManager(
            config.num_pages, config.page_size, config.batch_size, config.pages_per_sequence, window=config.window
        )
        self._graphdef, self._params, pools = nnx.split(model, nnx.Param, nnx.Cache)
        self._pools = jax.tree.map(jnp.copy, pools)  # ours alone, so each step may donate it
        self._template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), pools)
        self._sampling = sampling
        self._key = jax.random.key(0) if rng is None else rng
        self._queue: deque[_Request] = deque()
        self._slots: list[_Request | None] = [None] * config.batch_size
        self._prefilled = np.zeros(config.batch_size, np.int64)  # context tokens already in the cache
        self._submitted = 0
        self._done: dict[int, Completion] = {}

    # ------------------------------------------------------------------ public

    def submit(self, prompt, max_new_tokens: int, *, stop_tokens=(), salt: bytes = b"") -> int:
        """Queues a request; returns its index. Raises if it could never fit."""
        prompt = token_ids(prompt, self.vocab_size, "prompt", (None,)).tolist()
        if not prompt:
            raise ValueError("prompt must hold one or more token ids, got none")
        max_new_tokens = check.positive_int(max_new_tokens, "max_new_tokens")
        stops = frozenset(stop_ids(stop_tokens, self.vocab_size))
        if not isinstance(salt, bytes):
            raise TypeError(f"salt must be bytes, got {type(salt).__name__}")
        total = len(prompt) + int(max_new_tokens) - 1  # the last new token is never fed back
        if total > self.config.max_len or self._pages_needed(total) > self.config.num_pages - 1:
            raise ValueError(
                f"a request of {len(prompt)} prompt + {max_new_tokens} new tokens can never fit: a sequence holds "
                f"at most max_len={self.config.max_len} tokens, in a pool of {self.config.num_pages - 1} pages of "
                f"{self.config.page_size} (it needs {self._pages_needed(total)})"
            )
        request = _Request(self._submitted, prompt, int(max_new_tokens), stops, salt)
        self._queue.append(request)
        self._submitted += 1  # only now: a refused request takes no index
        return request.index

    @property
    def idle(self) -> bool:
        return not self._queue and all(s is None for s in self._slots)

    def step(self) -> list[Completion]:
        """One scheduling round: admit, prefill a chunk each, decode a token each, retire. Returns what finished."""
        self._admit()
        for slot, request in enumerate(self._slots):
            if request is not None and self._prefilled[slot] < len(request.context):
                self._prefill_chunk(slot)
        finished = self._retire_finished()  # a first token may already end a request
        decoding = [s for s, r in enumerate(self._slots) if r is not None and self._prefilled[s] >= len(r.context)]
        if decoding:
            self._decode(decoding)
        return finished + self._retire_finished()

    def run(self) -> list[Completion]:
        """Steps until every submitted request has finished; their completions in `submit` order."""
        while not self.idle:
            self.step()
        done, self._done = self._done, {}
        return [done[i] for i in sorted(done)]

    # ---------------------------------------------------------------- internal

    def _pages_needed(self, tokens: int) -> int:
        """Pages a sequence holds at most while it grows to `tokens`, prefilled a chunk at a time."""
        manager, window = self.manager, self.config.window
        whole = -(-tokens // manager.page_size)
        if window is None:
            return whole
        # A chunk is written at once, beside the window before it.
        chunk = -(-(window - 1 + min(self.chunk, tokens)) // manager.page_size) + 1
        return min(whole, max(manager.pages_for(tokens), chunk))

    def _admit(self):
        while self._queue and None in self._slots:
            request = self._queue[0]
            needed = self._pages_needed(len(request.context))
            if needed > self.manager.num_free + self.manager.num_cached:
                return
            self._queue.popleft()
            slot = self.manager.add()
            request.cached_tokens = (
                self.manager.attach(slot, request.context, request.salt) if self.prefix_caching else 0
            )
            self._prefilled[slot] = request.cached_tokens
            request.admitted_at = time.perf_counter()
            if request.first_admitted is None:
                request.first_admitted = request.admitted_at
            self._slots[slot] = request

    def _reserve(self, counts: np.ndarray) -> PageBatch:
        """Reserves pages for `counts`, preempting the most recently admitted requests while pages run short."""
        while True:
            try:
                return self.manager.reserve(counts)
            except OutOfPagesError:
                running = [s for s, r in enumerate(self._slots) if r is not None]
                if len(running) <= 1:
                    raise
                victim = max(running, key=lambda s: self._slots[s].first_admitted)
                counts[victim] = 0
                self._preempt(victim)

    def _preempt(self, slot: int):
        request = self._slots[slot]
        if self.prefix_caching:
            self.manager.register(slot, request.context[: self._prefilled[slot]], request.salt)
        self.manager.free(slot)
        self._slots[slot] = None
        request.preemptions += 1
        self._queue.appendleft(request)

    def _prefill_chunk(self, slot: int):
        request = self._slots[slot]
        context, start = request.context, int(self._prefilled[slot])
        end = min(len(context), (start // self.chunk + 1) * self.chunk)
        counts = np.zeros(self.config.batch_size, np.int32)
        counts[slot] = end - start
        batch = self._reserve(counts)
        if self._slots[slot] is not request:  # it was the youngest, preempted to make room for the others
            return
        tokens = np.zeros((1, self.chunk), np.int32)
        tokens[0, : end - start] = context[start:end]
        self._key, key = jax.random.split(self._key)
        token, logprob = self._run(
            _prefill_program, tokens, np.int32([end - start]), batch.table[slot : slot + 1], batch.pos[slot : slot + 1],
            batch.copy_from, batch.copy_to, key,
        )
        self._prefilled[slot] = end
        if end == len(context):
            if self.prefix_caching:
                self.manager.register(slot, context, request.salt)
            if not request.generated:  # a recomputed request already has its next token
                request.generated.append(int(token))
                request.logprobs.append(float(logprob))
                request.first_token_seconds = time.perf_counter() - request.admitted_at

    def _decode(self, slots: list[int]):
        counts = np.zeros(self.config.batch_size, np.int32)
        counts[slots] = 1
        batch = self._reserve(counts)
        active = counts > 0
        tokens = np.zeros(self.config.batch_size, np.int32)
        for slot in np.flatnonzero(active):
            tokens[slot] = self._slots[slot].generated[-1]
        self._key, key = jax.random.split(self._key)
        new, logprobs = self._run(
            _decode_program, tokens, active, batch.table, batch.pos, batch.copy_from, batch.copy_to, key
        )
        for slot in np.flatnonzero(active):
            request = self._slots[slot]
            self._prefilled[slot] += 1
            request.generated.append(int(new[slot]))
            request.logprobs.append(float(logprobs[slot]))

    def _run(self, program, *args):
        """One device call on the server's pools; on any failure, `_recover` and re-raise."""
        try:
            *outputs, pools = program(self._graphdef, self._params, self._pools, *args, sampling=self._sampling)
            outputs = [np.asarray(output) for output in outputs]  # waits for the call to finish
        except BaseException:
            self._recover()
            raise
        self._pools = pools
        return outputs

    def _recover(self):
        """After a failed device call: every running request back to the queue; pages and prefix cache afresh."""
        running = sorted((r for r in self._slots if r is not None), key=lambda r: r.first_admitted, reverse=True)
        for request in running:
            request.preemptions += 1
            self._queue.appendleft(request)
        self._slots = [None] * self.config.batch_size
        self._prefilled[:] = 0
        config = self.config
        self.manager = PageManager(
            config.num_pages, config.page_size, config.batch_size, config.pages_per_sequence, window=config.window
        )
        if any(array.is_deleted() for array in jax.tree.leaves(self._pools)):  # donated to the failed call
            self._pools = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), self._template)

    def _retire_finished(self) -> list[Completion]:
        return [self._retire(slot) for slot, request in enumerate(self._slots)
                if request is not None and self._finished(request)]

    @staticmethod
    def _finished(request: _Request) -> bool:
        generated = request.generated
        return len(generated) >= request.max_new_tokens or bool(generated and generated[-1] in request.stop_tokens)

    def _retire(self, slot: int) -> Completion:
        request = self._slots[slot]
        if self.prefix_caching:
            self.manager.register(slot, request.context[: self._prefilled[slot]], request.salt)
        self.manager.free(slot)
        self._slots[slot] = None
        completion = Completion(
            request.index, request.generated[: request.max_new_tokens], request.logprobs[: request.max_new_tokens],
            request.cached_tokens, request.preemptions, request.first_token_seconds,
        )
        self._done[request.index] = completion
        return completion


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"), donate_argnames=("pools",))
def _prefill_program(graphdef, params, pools, tokens, length, table, pos, copy_from, copy_to, key, sampling):
    model = nnx.merge(graphdef, params, pools)
    pages = PageBatch(table, pos, copy_from, copy_to)
    logits = model.prefill(tokens, length, pages=pages, last_only=True)
    token, logprob = sample_with_logprob(logits, key, sampling)
    return token[0], logprob[0], nnx.state(model, nnx.Cache)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"), donate_argnames=("pools",))
def _decode_program(graphdef, params, pools, tokens, active, table, pos, copy_from, copy_to, key, sampling):
    model = nnx.merge(graphdef, params, pools)
    logits = model.step(tokens, active, pages=PageBatch(table, pos, copy_from, copy_to))
    token, logprob = sample_with_logprob(logits, key, sampling)
    return token, logprob, nnx.state(model, nnx.Cache)

