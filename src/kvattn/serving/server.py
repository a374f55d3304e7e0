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
  outputs (a preempted request recomputes its generated tokens as prompt
  chunks: the same tokens, log-probabilities equal to rounding).
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

import functools
import time
from collections import deque
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn import validation as check
from kvattn.generation.sampling import RowSampling, Sampling, SamplingParams, sample_rows
from kvattn.generation.speculation import lookup, verify_rows
from kvattn.generation.speculative import DraftModel, PromptLookup
from kvattn.models.decoder import CausalLM
from kvattn.models.tokens import stop_ids, token_ids
from kvattn.paging import OutOfPagesError, PageBatch, PageManager
from kvattn.serving.requests import Completion, Request, Stats, Token

__all__ = ["Server"]


class Server:
    """Serves requests on a paged `CausalLM` with continuous batching and prefix caching.

    Args:
      model: a `CausalLM` built with `num_pages` and `page_size`; its
        `batch_size` is the number of sequences decoded together.
      chunk: prefill chunk in tokens, a multiple of the page size.
      prefix_caching: share the pages of equal prompt prefixes (off with a
        sliding window, whose early pages are freed).
      rng: a `jax.random.key` that draws the seed of each request that
        brings none (default: fresh entropy).
      prefills_per_step: prefill chunks a step runs at most, oldest request
        first (default: one for every request still prefilling). A bound
        keeps each step, and so every running request's time between
        tokens, short while many requests arrive together.
      speculative: a `PromptLookup`: a step drafts up to K tokens per
        running request from its own prompt and output, and the model
        verifies them in one call over K + 1 tokens, each request keeping
        what it agrees with (the tokens of plain decoding, or their
        distribution when sampling). A request drafts only while its rounds
        keep enough drafts to pay for the longer call, and tries again
        after a while (its `policy`); a step without drafts is a plain
        decode step.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from kvattn import RoPE
      >>> from kvattn.generation import SamplingParams
      >>> from kvattn.models import CausalLM, ModelConfig
      >>> from kvattn.serving import Server
      >>> config = ModelConfig("llama", vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
      ...                      head_dim=8, intermediate_size=64, norm_eps=1e-5, tie_embeddings=True,
      ...                      max_position_embeddings=64, rope=RoPE())
      >>> model = CausalLM(config, max_len=64, batch_size=2, num_pages=16, page_size=8, rngs=nnx.Rngs(0))
      >>> server = Server(model, chunk=16)
      >>> [server.submit(list(range(1, n)), SamplingParams(max_tokens=4)) for n in (5, 12, 20)]
      [0, 1, 2]
      >>> [len(c.tokens) for c in server.run()]
      [4, 4, 4]
    """

    def __init__(self, model: CausalLM, *, chunk: int = 64, prefix_caching: bool = True, rng=None,
                 prefills_per_step: int | None = None, speculative: PromptLookup | None = None):
        config = model.blocks[0].attention.config
        if not config.paged:
            raise ValueError("Server needs a paged model: build it with num_pages and page_size")
        if speculative is not None and not isinstance(speculative, PromptLookup):
            also = " (a DraftModel drafts in kvattn.generation.generate)" if isinstance(speculative, DraftModel) else ""
            raise TypeError(f"speculative must be a PromptLookup or None, got {type(speculative).__name__}{also}")
        if speculative is not None and config.window is not None:
            raise ValueError(f"speculative decoding is not offered with a sliding window ({config.window}): "
                             "build the model without one, or serve without speculative")
        self.speculative = speculative
        chunk = check.positive_int(chunk, "chunk")
        self.prefills_per_step = (config.batch_size if prefills_per_step is None
                                  else check.positive_int(prefills_per_step, "prefills_per_step"))
        if chunk % config.page_size:
            raise ValueError(f"chunk must be a multiple of page_size={config.page_size}, got {chunk}")
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
        seed = None if rng is None else np.asarray(jax.random.key_data(rng)).ravel().tolist()
        self._seeds = np.random.default_rng(seed)  # without rng: fresh entropy
        self._queue: deque[Request] = deque()
        self._slots: list[Request | None] = [None] * config.batch_size
        self._prefilled = np.zeros(config.batch_size, np.int64)  # context tokens already in the cache
        self._submitted = 0
        self._retired: list[Completion] = []  # finished, not yet handed out by step()
        self._ran: list[Completion] = []  # handed out by step() to a run() that has not returned yet
        self._totals = dict(prompt_tokens=0, cached_tokens=0, generated_tokens=0, drafted_tokens=0,
                            accepted_tokens=0)

    # ------------------------------------------------------------------ public

    def submit(self, prompt, params: SamplingParams, *, eos_token_ids=(), salt: bytes = b"",
               on_token: Callable[[int, Token], None] | None = None) -> int:
        """Queues a request; returns its index. Raises, taking no index, if it could never fit.

        Args:
          prompt: token ids, one or more.
          params: its `SamplingParams`: `max_tokens`, the sampling, `seed`
            (default: drawn from the server's `rng`; the same seed gives the
            same tokens, whatever else is running), `n` choices under indices
            `index .. index + n - 1` that share the prompt's pages (prefilled
            once, then forked), `stop_token_ids`, `ignore_eos`, `logprobs`
            (alternatives per token passed to `on_token`). Stop strings are
            text: the caller that detokenizes matches them and calls `abort`.
          eos_token_ids: the model's end-of-sequence ids: a request stops
            after producing one, unless `params.ignore_eos`.
          salt: prefix-cache namespace: only requests with the same salt share pages.
          on_token: called as `on_token(index, Token)` by `step()` for every new token.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a kvattn.generation.SamplingParams, got {type(params).__name__}")
        prompt = token_ids(prompt, self.vocab_size, "prompt", (None,)).tolist()
        if not prompt:
            raise ValueError("prompt must hold one or more token ids, got none")
        max_new_tokens = params.max_tokens
        stops = frozenset(stop_ids(sorted(params.stop_ids(stop_ids(eos_token_ids, self.vocab_size))),
                                   self.vocab_size))
        if not isinstance(salt, bytes):
            raise TypeError(f"salt must be bytes, got {type(salt).__name__}")
        n = params.n
        if n > self.config.batch_size:
            raise ValueError(f"n must be at most the batch size {self.config.batch_size}, got {n}")
        sampling = params.sampling.check_vocab(self.vocab_size)
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**32))
        if on_token is not None and not callable(on_token):
            raise TypeError(f"on_token must be callable or None, got {type(on_token).__name__}")
        total = len(prompt) + int(max_new_tokens) - 1  # the last new token is never fed back
        pages = self._pages_needed(total)
        if total > self.config.max_len or pages > self.config.num_pages - 1:
            raise ValueError(
                f"a request of {len(prompt)} prompt + {max_new_tokens} new tokens can never fit: a sequence holds "
                f"at most max_len={self.config.max_len} tokens, in a pool of {self.config.num_pages - 1} pages of "
                f"{self.config.page_size} (it needs {pages})"
            )
        if self._group_pages(len(prompt), n) > self.config.num_pages - 1:
            raise ValueError(f"{n} choices of a {len(prompt)}-token prompt can never start together: they need "
                             f"{self._group_pages(len(prompt), n)} pages, the pool has {self.config.num_pages - 1}")
        requests = [Request(self._submitted + i, prompt, max_new_tokens, stops, salt, sampling, seed, i,
                             params.logprobs or 0, on_token) for i in range(n)]
        for request in requests:
            request.expected = float(self.speculative.num_tokens) if self.speculative else 0.0
            request.patience = self.speculative.policy.probe_every if self.speculative else 0
        leader = requests[0]
        for sibling in requests[1:]:
            sibling.leader = leader
        leader.siblings = requests[1:]
        self._queue.append(leader)
        self._submitted += n  # only now: a refused request takes no index
        return leader.index

    def abort(self, index: int) -> Completion | None:
        """Ends request `index` now, freeing its slot and pages; None if it is not queued or running.

        A request whose prompt is not prefilled yet ends with the other choices of its `submit`.
        """
        for request in list(self._queue):
            if index in (r.index for r in request.group):
                self._queue.remove(request)
                return self._aborted(request.group, index)
        for slot, request in enumerate(self._slots):
            if request is not None and request.index == index:
                group = request.group if request.leader is None else request.leader.group
                for member in group:
                    self._release(self._slots.index(member))
                return self._aborted(group, index)
        return None

    @property
    def idle(self) -> bool:
        return not self._queue and all(s is None for s in self._slots)

    @property
    def stats(self) -> Stats:
        running = sum(r is not None for r in self._slots)
        waiting = sum(len(r.group) for r in self._queue)
        return Stats(waiting, running, self.manager.num_free, self.manager.num_cached, self.manager.num_live,
                     **self._totals)

    def step(self) -> list[Completion]:
        """One scheduling round: admit, prefill a chunk each, decode a token each, retire. Returns what finished."""
        self._admit()
        prefilling = sorted((s for s in range(len(self._slots)) if self._prefilling(s)),
                            key=lambda s: self._slots[s].first_admitted)
        for slot in prefilling[: self.prefills_per_step]:
            if self._prefilling(slot):  # an earlier chunk may have preempted it
                self._prefill_chunk(slot)
        self._retire_finished()  # a first token may already end a request
        decoding = [s for s, r in enumerate(self._slots) if r is not None and self._decoding(s)]
        offers = self._offers(decoding) if self.speculative else {}
        if offers:
            self._verify(decoding, offers)
        elif decoding:
            self._decode(decoding)
        self._retire_finished()
        # Handed out only now: a step that raises keeps what had finished for the next one.
        finished, self._retired = self._retired, []
        return finished

    def run(self) -> list[Completion]:
        """Steps until every submitted request has finished; the completions in `submit` order.

        A run that raises (a failed device call) keeps what had finished: the
        next `run()` returns it with the rest.
        """
        while not self.idle:
            self._ran += self.step()
        done, self._ran = self._ran, []
        return sorted(done, key=lambda c: c.request)

    # ---------------------------------------------------------------- internal

    def _prefilling(self, slot: int) -> bool:
        request = self._slots[slot]
        return request is not None and request.leader is None and self._prefilled[slot] < len(request.context)

    def _decoding(self, slot: int) -> bool:
        request = self._slots[slot]
        return request.leader is None and self._prefilled[slot] >= len(request.context)

    def _pages_needed(self, tokens: int) -> int:
        """Pages a sequence holds at most while it grows to `tokens`, prefilled a chunk at a time."""
        manager, window = self.manager, self.config.window
        whole = -(-tokens // manager.page_size)
        if window is None:
            return whole
        # A chunk is written at once, beside the window before it.
        chunk = -(-(window - 1 + min(self.chunk, tokens)) // manager.page_size) + 1
        return min(whole, max(manager.pages_for(tokens), chunk))

    def _group_pages(self, tokens: int, n: int) -> int:
        """Pages `n` choices of a `tokens`-long context hold after forking: shared pages, a private last page each."""
        return self._pages_needed(tokens) + (n - 1) * bool(tokens % self.manager.page_size)

    def _admit(self):
        while self._queue:
            request = self._queue[0]
            group = request.group
            needed = self._group_pages(len(request.context), len(group))
            if self._slots.count(None) < len(group) or needed > self.manager.num_free + self.manager.num_cached:
                return
            self._queue.popleft()
            now = time.perf_counter()
            for member in group:
                slot = self.manager.add()
                member.admitted_at = now
                if member.first_admitted is None:
                    member.first_admitted = now
                self._slots[slot] = member
                self._prefilled[slot] = 0
            slot = self._slots.index(request)
            request.cached_tokens = (
                self.manager.attach(slot, request.context, request.salt) if self.prefix_caching else 0
            )
            self._prefilled[slot] = request.cached_tokens
            self._totals["prompt_tokens"] += len(request.context)
            self._totals["cached_tokens"] += request.cached_tokens

    def _reserve(self, counts: np.ndarray) -> PageBatch:
        """Reserves pages for `counts`, preempting the most recently admitted requests while pages run short."""
        while True:
            try:
                return self.manager.reserve(counts)
            except OutOfPagesError:
                leaders = {id(r.leader or r): r.leader or r for r in self._slots if r is not None}
                if len(leaders) <= 1:
                    raise
                victim = max(leaders.values(), key=lambda r: r.first_admitted)
                for member in victim.group:
                    counts[self._slots.index(member)] = 0
                self._preempt(victim)

    def _release(self, slot: int):
        """Frees a slot and its pages, registering what it prefilled for the prefix cache."""
        request = self._slots[slot]
        if self.prefix_caching and request.leader is None:
            self.manager.register(slot, request.context[: self._prefilled[slot]], request.salt)
        self.manager.free(slot)
        self._slots[slot] = None

    def _preempt(self, request: Request):
        """Back to the head of the queue, with the choices still waiting for it."""
        for member in request.group:
            self._release(self._slots.index(member))
        request.preemptions += 1
        self._queue.appendleft(request)

    def _rows(self, requests: list[Request | None], size: int | None = None) -> RowSampling:
        """Sampling rows for `requests` (None: an idle row), padded to `size` (default: the batch size)."""
        rows = [r.settings() if r is not None else (Sampling(), 0, 0, 0) for r in requests]
        return RowSampling.of(rows, size or self.config.batch_size)

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
        group = request.group  # each choice samples its first token from these logits
        new, logprobs, top_ids, top_logprobs = self._run(
            _prefill_program, tokens, np.int32([end - start]), batch.table[slot : slot + 1],
            batch.pos[slot : slot + 1], batch.copy_from, batch.copy_to, self._rows(group),
        )
        self._prefilled[slot] = end
        if end < len(context):
            return
        if self.prefix_caching:
            self.manager.register(slot, context, request.salt)
        for row, member in enumerate(group):
            if member is not request:  # a choice: the prompt's pages by reference, a private copy of a partial one
                target = self._slots.index(member)
                self.manager.fork(slot, target)
                self._prefilled[target] = end
                member.leader = None
            if not member.generated:  # a recomputed request already has its next token
                member.append(int(new[row]), float(logprobs[row]), top_ids[row], top_logprobs[row])
                member.first_token_seconds = time.perf_counter() - member.admitted_at
                self._totals["generated_tokens"] += 1
        request.siblings = []

    def _decode(self, slots: list[int]):
        """One token for each of `slots`, in a call over the smallest bucket of rows that holds them."""
        counts = np.zeros(self.config.batch_size, np.int32)
        counts[slots] = 1
        batch, slots, rows, active, table, sampling = self._laid_out(slots, counts)
        tokens = np.array([self._slots[s].generated[-1] if a else 0 for s, a in zip(rows, active)], np.int32)
        new, logprobs, top_ids, top_logprobs = self._run(
            _decode_program, tokens, active, table, batch.pos[rows], batch.copy_from, batch.copy_to, sampling)
        for row, slot in enumerate(slots):
            self._prefilled[slot] += 1
            self._slots[slot].append(int(new[row]), float(logprobs[row]), top_ids[row], top_logprobs[row])
            self._totals["generated_tokens"] += 1

    def _laid_out(self, slots: list[int], counts: np.ndarray):
        """Reserves `counts` tokens per slot, then lays `slots` over the smallest bucket of rows (padding rows:
        slot 0, inactive): `(batch, the slots still decoding, rows, active, page table, sampling rows)`."""
        batch = self._reserve(counts)
        slots = [s for s in slots if counts[s]]  # a preempted one is no longer decoding
        rows = np.zeros(self._bucket(len(slots)), np.int64)
        rows[: len(slots)] = slots
        active = np.arange(len(rows)) < len(slots)
        table = np.where(active[:, None], batch.table[rows], 0)
        sampling = self._rows([self._slots[s] if a else None for s, a in zip(rows, active)], len(rows))
        return batch, slots, rows, active, table, sampling

    def _offers(self, slots: list[int]) -> dict[int, np.ndarray]:
        """The drafts of each request of `slots` that drafts this step (by prompt lookup, within its budget)."""
        policy, offers = self.speculative.policy, {}
        trying = []
        for slot in slots:
            request = self._slots[slot]
            budget = request.max_new_tokens - len(request.generated) - 1
            if budget > 0 and policy.wants_round(request.expected, request.waited, request.patience):
                trying.append(slot)
            else:
                request.waited += 1
        if trying:
            history = np.zeros((self._bucket(len(trying)), self.config.max_len + 1), np.int32)
            filled = np.zeros(len(history), np.int32)
            for row, slot in enumerate(trying):
                tokens = self._slots[slot].prompt + self._slots[slot].generated
                history[row, : len(tokens)] = tokens
                filled[row] = len(tokens) - 1
            drafts, widths = map(np.asarray, _lookup(history, filled, self.speculative.num_tokens,
                                                     self.speculative.max_ngram))
            for row, slot in enumerate(trying):
                request = self._slots[slot]
                width = min(int(widths[row]), request.max_new_tokens - len(request.generated) - 1)
                if width:
                    offers[slot] = drafts[row, :width]
                else:
                    request.waited += 1
        return offers

    def _verify(self, slots: list[int], offers: dict[int, np.ndarray]):
        """A speculative round: each of `slots` feeds its pending token and its drafts (if any) in one call of
        K + 1 tokens per row, keeps the drafts the model agrees with plus one token of the model's, and gives
        back the pages past them."""
        width = self.speculative.num_tokens + 1
        counts = np.zeros(self.config.batch_size, np.int32)
        counts[slots] = 1
        for slot, drafts in offers.items():
            counts[slot] = drafts.size + 1
        batch, slots, rows, active, table, sampling = self._laid_out(slots, counts)
        tokens = np.zeros((len(rows), width), np.int32)
        for row, slot in enumerate(slots):
            tokens[row, 0] = self._slots[slot].generated[-1]
            tokens[row, 1 : counts[slot]] = offers.get(slot, ())
        kept, new, logprobs, top_ids, top_logprobs = self._run(
            _verify_program, tokens, np.where(active, counts[rows], 0).astype(np.int32), table, batch.pos[rows],
            batch.copy_from, batch.copy_to, sampling)
        for row, slot in enumerate(slots):
            request = self._slots[slot]
            produced = new[row, : kept[row] + 1].tolist()
            stops = [j for j, token in enumerate(produced) if token in request.stop_tokens]
            produced = produced[: stops[0] + 1] if stops else produced
            for j, token in enumerate(produced):
                request.append(token, float(logprobs[row, j]), top_ids[row, j], top_logprobs[row, j])
            self._prefilled[slot] += len(produced)  # the pending token and every new one but the last
            self.manager.truncate(slot, int(self._prefilled[slot]))
            self._totals["generated_tokens"] += len(produced)
            if slot in offers:
                self._totals["drafted_tokens"] += int(counts[slot] - 1)
                self._totals["accepted_tokens"] += int(kept[row])
                policy = self.speculative.policy
                request.expected = float(policy.estimate(request.expected, int(kept[row])))
                request.waited = 0
                request.patience = int(policy.patience(request.expected, request.patience))

    def _bucket(self, count: int) -> int:
        """Rows of the decode call for `count` sequences: a power of two, at most the batch size."""
        return min(1 << max(count - 1, 0).bit_length(), self.config.batch_size)

    def warm_up(self) -> None:
        """Compiles every program the server may run (each decode bucket, the prefill chunk) by calling it idle.

        Nothing is written: every row is inactive and maps only the null page.
        """
        buckets = sorted({self._bucket(n) for n in range(1, self.config.batch_size + 1)})
        empty = self.manager.reserve(np.zeros(self.config.batch_size, np.int32))
        for size in buckets:
            self._run(_decode_program, np.zeros(size, np.int32), np.zeros(size, bool),
                      np.zeros((size, empty.table.shape[1]), np.int32), np.zeros(size, np.int32), empty.copy_from,
                      empty.copy_to, RowSampling.of([], size))
        if self.speculative is not None:
            width = self.speculative.num_tokens + 1
            for size in buckets:
                _lookup(np.zeros((size, self.config.max_len + 1), np.int32), np.zeros(size, np.int32),
                        self.speculative.num_tokens, self.speculative.max_ngram)
                self._run(_verify_program, np.zeros((size, width), np.int32), np.zeros(size, np.int32),
                          np.zeros((size, empty.table.shape[1]), np.int32), np.zeros(size, np.int32),
                          empty.copy_from, empty.copy_to, RowSampling.of([], size))
        self._run(_prefill_program, np.zeros((1, self.chunk), np.int32), np.int32([0]),
                  np.zeros((1, empty.table.shape[1]), np.int32), np.zeros(1, np.int32), empty.copy_from,
                  empty.copy_to, self._rows([]))

    def _run(self, program, *args):
        """One device call on the server's pools; on any failure, `_recover` and re-raise."""
        try:
            *outputs, pools = program(self._graphdef, self._params, self._pools, *args)
            outputs = [np.asarray(output) for output in outputs]  # waits for the call to finish
        except BaseException:
            self._recover()
            raise
        self._pools = pools
        return outputs

    def _recover(self):
        """After a failed device call: every running request back to the queue; pages and prefix cache afresh."""
        leaders = {id(r.leader or r): r.leader or r for r in self._slots if r is not None}
        for request in sorted(leaders.values(), key=lambda r: r.first_admitted, reverse=True):
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

    def _retire_finished(self) -> None:
        self._retired += [self._retire(slot) for slot, request in enumerate(self._slots)
                          if request is not None and self._finished(request)]

    @staticmethod
    def _finished(request: Request) -> bool:
        generated = request.generated
        return len(generated) >= request.max_new_tokens or bool(generated and generated[-1] in request.stop_tokens)

    def _retire(self, slot: int) -> Completion:
        request = self._slots[slot]
        self._release(slot)
        stopped = bool(request.generated) and request.generated[-1] in request.stop_tokens
        return self._completion(request, "stop" if stopped else "length")

    def _aborted(self, group: list[Request], index: int) -> Completion:
        return next(self._completion(r, "abort") for r in group if r.index == index)

    @staticmethod
    def _completion(request: Request, reason: str) -> Completion:
        return Completion(
            request.index, request.generated[: request.max_new_tokens], request.logprobs[: request.max_new_tokens],
            request.cached_tokens, request.preemptions, request.first_token_seconds, reason,
        )


_lookup = jax.jit(lookup, static_argnames=("num_tokens", "max_ngram"))


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("pools",))
def _prefill_program(graphdef, params, pools, tokens, length, table, pos, copy_from, copy_to, rows):
    """A chunk of one sequence; every row of `rows` samples from its last logits (the choices of a request)."""
    model = nnx.merge(graphdef, params, pools)
    logits = model.prefill(tokens, length, pages=PageBatch(table, pos, copy_from, copy_to), last_only=True)
    logits = jnp.broadcast_to(logits, (rows.seed.shape[0], logits.shape[-1]))
    return *sample_rows(logits, rows), nnx.state(model, nnx.Cache)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("pools",))
def _decode_program(graphdef, params, pools, tokens, active, table, pos, copy_from, copy_to, rows):
    model = nnx.merge(graphdef, params, pools)
    logits = model.step(tokens, active, pages=PageBatch(table, pos, copy_from, copy_to))
    return *sample_rows(logits, rows), nnx.state(model, nnx.Cache)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("pools",))
def _verify_program(graphdef, params, pools, tokens, lengths, table, pos, copy_from, copy_to, rows):
    """A speculative round: each row's pending token and drafts (`lengths` - 1 of them) scored in one chunk."""
    model = nnx.merge(graphdef, params, pools)
    logits = model.prefill(tokens, lengths, pages=PageBatch(table, pos, copy_from, copy_to))
    return *verify_rows(logits, tokens[:, 1:], jnp.maximum(lengths - 1, 0), rows), nnx.state(model, nnx.Cache)
