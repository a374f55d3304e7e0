"""Continuous batching on a paged `CausalLM`: a queue of requests admitted, prefilled, decoded and retired.

`Server(model)` takes a model built with `num_pages` and `page_size`. Each
`step()` admits what fits, prefills a chunk of the requests still
prefilling, decodes one token for every running one (or verifies their
drafts, speculating), and retires those that finished; `run()` steps until
the queue is empty. With a token budget (`step_tokens`), a step that
decodes carries one small chunk inside its decode call (`CausalLM.mixed`),
which reads the weights once for both. The server composes two halves:

- the `Scheduler` (host only): the queue, which request holds which sequence,
  admission through the `PageManager`, preemption when pages run short,
  prefix caching, the prefill budget;
- the `Runner` (device): the weights, its own copy of the page pools, and
  the compiled programs, with fixed shapes, so requests come and go without
  a recompilation.

Sampling, prompt lookup, verification and the speculation policy are
`kvattn.generation`'s, the same the fixed-batch loops use. With greedy
decoding, outputs equal `kvattn.generation.generate`'s token for token, and
a prefix-cache hit gives bit-identical outputs (a preempted request
recomputes its generated tokens as prompt chunks: the same tokens,
log-probabilities equal to rounding).

A device call that fails (or is interrupted) loses no request: every running
one goes back to the head of the queue with what it had generated, the page
bookkeeping and the prefix cache start afresh, and the error is raised; the
next `step()` recomputes them, and requests that had finished are handed out
by the next `step()` or `run()`. The model itself is never changed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import numpy as np

from kvattn import validation as check
from kvattn.generation.adjust import Adjuster, Grammar
from kvattn.generation.drafters import DraftModel, PromptLookup
from kvattn.generation.sampling import Adjustments, RowSampling, Sampling, SamplingParams
from kvattn.models.decoder import CausalLM
from kvattn.models.tokens import stop_ids, token_ids
from kvattn.paging import OutOfPagesError, PageManager
from kvattn.serving.requests import Completion, Request, Stats, Token
from kvattn.serving.runner import Runner
from kvattn.serving.scheduler import Scheduler

__all__ = ["DEFAULT_CHUNK_PAGES", "Server"]

DEFAULT_CHUNK_PAGES = 8
"""The prefill chunk, in pages, unless one is given: on a CPU a chunk's dots are compute-bound, and at 8 pages of
16 (128 tokens) they run at about `generate`'s whole-batch prefill rate, where 4 pages ran at 0.8x of it."""


class Server:
    """Serves requests on a paged `CausalLM` with continuous batching and prefix caching.

    Args:
      model: a `CausalLM` built with `num_pages` and `page_size`; its
        `batch_size` is the number of sequences decoded together.
      chunk: prefill chunk in tokens, a multiple of the page size (default:
        `DEFAULT_CHUNK_PAGES` pages).
      prefix_caching: share the pages of equal prompt prefixes (off with a
        sliding window, whose early pages are freed).
      rng: a `jax.random.key` that draws the seed of each request that
        brings none (default: fresh entropy).
      prefills_per_step: prefill chunks a step runs at most while any
        request decodes, oldest request first (default: one for every
        request still prefilling). A bound keeps each step, and so every
        running request's time between tokens, short while many requests
        arrive together. A step with nothing decoding prefills every
        admitted request's chunk. The chunks of one-choice requests run
        together, in one call: prompts that arrive together are prefilled
        as a wave, their first tokens at once, and their prefill lies in
        their time to the first token, not in the time between tokens of
        requests that started a step before the others.
      speculative: a `PromptLookup`: a step drafts up to K tokens per
        running request from its own prompt and output, and the model
        verifies them in one call over K + 1 tokens, each request keeping
        what it agrees with (the tokens of plain decoding, or their
        distribution when sampling). A request drafts only while its rounds
        keep enough drafts to pay for the longer call, and tries again
        after a while (its `policy`); a step without drafts is a plain
        decode step. With a sliding window, K + 1 must fit in `chunk`.
      step_tokens: the most tokens a step that decodes runs (vLLM's
        `max_num_batched_tokens`): its decode rows, and beside them in the
        same call one prefill chunk of the rest (at most `chunk`), the only
        chunk of such a step; a running request's time between tokens is
        then one call of `step_tokens` tokens, however long the prompts
        that arrive. More than the batch size; not with `speculative`.
        None (default): chunks run
        in calls of their own before the decode call, `prefills_per_step`
        of them (on a CPU a whole chunk's dot is compute-bound, and decode
        rows inside it cost as much as their own call).
      async_scheduling: run a decode step's device call while the host reads the
        step before (vLLM's async scheduling): when nothing is admitted or
        prefilled and every running request goes on, the next decode call is
        dispatched, fed the new tokens still on the device, before this
        step's tokens are read, so the device does not wait for the host's
        bookkeeping. A request that stops meanwhile wastes its row of the
        call ahead; the tokens are the same. Not with `speculative`,
        `step_tokens`, or requests that adjust their logits (those steps run
        as without it).
      donate_pools: hand the model's page pools to the server instead of
        letting it copy them: no second copy of the pools (a large share of
        a server's memory), but the first step deletes the model's caches,
        so pass it only for a model nothing else will use (`kvattn serve`
        and `kvattn.LLM` build theirs for the server alone).

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

    def __init__(self, model: CausalLM, *, chunk: int | None = None, prefix_caching: bool = True, rng=None,
                 prefills_per_step: int | None = None, speculative: PromptLookup | None = None,
                 step_tokens: int | None = None, async_scheduling: bool = False, donate_pools: bool = False):
        config = model.blocks[0].attention.config
        if not config.cache.paged:
            raise ValueError("Server needs a paged model: build it with num_pages and page_size")
        if speculative is not None and not isinstance(speculative, PromptLookup):
            also = " (a DraftModel drafts in kvattn.generation.generate)" if isinstance(speculative, DraftModel) else ""
            raise TypeError(f"speculative must be a PromptLookup or None, got {type(speculative).__name__}{also}")
        # Pages are released behind a window only when every layer slides over the same one; a model mixing
        # sliding and full layers (Gemma's) keeps every page, and its sliding layers mask what they do not see.
        windows = set(model.windows)
        window = windows.pop() if len(windows) == 1 else None
        chunk = DEFAULT_CHUNK_PAGES * config.cache.page_size if chunk is None else check.positive_int(chunk, "chunk")
        if chunk % config.cache.page_size:
            raise ValueError(f"chunk must be a multiple of page_size={config.cache.page_size}, got {chunk}")
        # A round appends K + 1 tokens at once, which beside a window holds their pages and the window's: admission
        # counts a chunk's worth, so a round must be no wider. (A refused draft gives back only pages past what
        # was kept; the pages behind the window are released from the round's first position, not its last.)
        if speculative is not None and window is not None and speculative.num_tokens + 1 > chunk:
            raise ValueError(f"with a sliding window ({window}), a speculative round of num_tokens + 1 = "
                             f"{speculative.num_tokens + 1} tokens must fit in a chunk of {chunk}: "
                             "draft fewer tokens or pass a larger chunk")
        prefills = (config.cache.batch_size if prefills_per_step is None
                    else check.positive_int(prefills_per_step, "prefills_per_step"))
        if step_tokens is not None and check.positive_int(step_tokens, "step_tokens") <= config.cache.batch_size:
            raise ValueError(f"step_tokens must exceed the batch size {config.cache.batch_size} (a decode row each, "
                             f"and room for a chunk), got {step_tokens}")
        if step_tokens is not None and speculative is not None:
            raise ValueError("step_tokens and speculative are not offered together: a speculative round's K + 1 "
                             "tokens a row are not counted in a budget; pass one of them")
        self.step_tokens = None if step_tokens is None else int(step_tokens)
        self.config = config
        self.speculative = speculative
        self.vocab_size = model.config.vocab_size
        self.scheduler = Scheduler(config, chunk=int(chunk), prefix_caching=prefix_caching and window is None,
                                   prefills_per_step=prefills, window=window)
        """The host half: queue, sequences, pages."""
        self.runner = Runner(model, donate_pools=bool(donate_pools))
        """The device half: weights, pools, programs."""
        seed = None if rng is None else np.asarray(jax.random.key_data(rng)).ravel().tolist()
        self._seeds = np.random.default_rng(seed)  # without rng: fresh entropy
        self._submitted = 0
        self._retired: list[Completion] = []  # finished, not yet handed out by step()
        self._ran: list[Completion] = []  # handed out by step() to a run() that has not returned yet
        self._neutral: dict[tuple, Adjustments] = {}  # on the device, by shape
        self.async_scheduling = bool(async_scheduling) and speculative is None and step_tokens is None
        self._ahead: _Ahead | None = None  # a decode call dispatched, its tokens not read yet

    @property
    def manager(self) -> PageManager:
        """The scheduler's `PageManager`."""
        return self.scheduler.manager

    @property
    def chunk(self) -> int:
        return self.scheduler.chunk

    @property
    def prefills_per_step(self) -> int:
        return self.scheduler.prefills_per_step

    @prefills_per_step.setter
    def prefills_per_step(self, value: int):
        self.scheduler.prefills_per_step = check.positive_int(value, "prefills_per_step")

    # ------------------------------------------------------------------ public

    def submit(self, prompt, params: SamplingParams, *, eos_token_ids=(), salt: bytes = b"",
               on_token: Callable[[int, Token], None] | None = None,
               grammar: Callable[[], Grammar] | None = None) -> int:
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
          grammar: makes a fresh matcher of `params.structured_outputs` for each choice
            (`kvattn.serving.structured.Grammars`, which knows the tokenizer); needed with them.
        """
        prompt, stops = self.check(prompt, params, eos_token_ids=eos_token_ids)
        if (params.structured_outputs is None) != (grammar is None):
            raise ValueError("structured_outputs need a grammar (a matcher factory, as kvattn.serving.structured."
                             "Grammars.compile makes) and a grammar needs them: got "
                             f"structured_outputs={params.structured_outputs!r} and grammar={grammar!r}")
        if not isinstance(salt, bytes):
            raise TypeError(f"salt must be bytes, got {type(salt).__name__}")
        if on_token is not None and not callable(on_token):
            raise TypeError(f"on_token must be callable or None, got {type(on_token).__name__}")
        sampling = params.sampling
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**32))
        requests = [Request(self._submitted + i, prompt, params.max_tokens, stops, salt, sampling, seed, i,
                            params.logprobs or 0, on_token) for i in range(params.n)]
        if params.adjusts:
            for request in requests:
                request.adjuster = Adjuster(params, prompt, stops, self.vocab_size,
                                            None if grammar is None else grammar())
        if self.speculative is not None:
            for request in requests:
                request.expected = float(self.speculative.num_tokens)
                request.patience = self.speculative.policy.probe_every
        leader = requests[0]
        for sibling in requests[1:]:
            sibling.leader = leader
        leader.siblings = requests[1:]
        self.scheduler.add(leader)
        self._submitted += params.n  # only now: a refused request takes no index
        return leader.index

    def check(self, prompt, params: SamplingParams, *, eos_token_ids=()) -> tuple[list[int], frozenset[int]]:
        """`submit`'s checks of a request, without queuing it: its prompt ids and the ids that stop it.

        Raises:
          TypeError, ValueError: what `submit` refuses (ids out of the vocabulary, settings the model cannot
            sample with, a request that could never fit), named with its value.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a kvattn.generation.SamplingParams, got {type(params).__name__}")
        prompt = token_ids(prompt, self.vocab_size, "prompt", (None,)).tolist()
        if not prompt:
            raise ValueError("prompt must hold one or more token ids, got none")
        eos_token_ids = () if params.ignore_eos else stop_ids(eos_token_ids, self.vocab_size)
        stops = frozenset(stop_ids(sorted(params.stop_ids(eos_token_ids)), self.vocab_size))
        params.sampling.check_vocab(self.vocab_size)
        if (refusal := self.scheduler.refusal(len(prompt), params.max_tokens, params.n)) is not None:
            raise ValueError(refusal)
        return prompt, stops

    def abort(self, index: int) -> Completion | None:
        """Ends request `index` now, freeing its sequence and pages; None if it is not queued or running.

        A request whose prompt is not prefilled yet ends with the other choices of its `submit`.
        """
        return self.scheduler.abort(index)

    @property
    def idle(self) -> bool:
        return self.scheduler.idle and self._ahead is None

    @property
    def stats(self) -> Stats:
        return self.scheduler.stats()

    def step(self) -> list[Completion]:
        """One scheduling round: admit, prefill a chunk each, decode a token each, retire. Returns what finished.

        With `step_tokens`, a step that decodes runs one chunk, in the decode call (`CausalLM.mixed`), so
        the weights are read once for both; a step with nothing decoding runs as without it.
        """
        scheduler = self.scheduler
        try:
            if self._ahead is not None:
                chained = self._chained()
                self._retired += scheduler.retire_finished()
                if chained:  # this step's call is the one now ahead
                    finished, self._retired = self._retired, []
                    return finished
            scheduler.admit()
            decoding = scheduler.decoding() if self.step_tokens is not None else []
            if decoding:  # under a budget, a step that decodes is one call: its rows and at most one chunk
                prefills = scheduler.prefills()[:1]
                if prefills:
                    self._mixed(decoding, prefills[0])
                else:
                    self._decode(decoding)
            else:
                self._prefill_chunks(scheduler.prefills())
                self._retired += scheduler.retire_finished()  # a first token may already end a request
                decoding = scheduler.decoding()
                offers = self._offers(decoding) if self.speculative else {}
                if offers:
                    self._verify(decoding, offers)
                elif decoding:
                    self._decode(decoding)
            self._retired += scheduler.retire_finished()
        except BaseException:
            self._ahead = None  # its tokens are recomputed with the rest
            scheduler.recover()
            raise
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

    def warm_up(self, on_program: Callable[[int, int], None] | None = None) -> None:
        """Compiles every program the server may run (each decode bucket, the prefill chunk of one sequence and of
        each bucket of sequences) by calling it idle.

        Args:
          on_program: called as `on_program(done, total)` after each program compiles (a progress display).
        """
        buckets = sorted({self._bucket(n) for n in range(1, self.config.cache.batch_size + 1)})
        empty = self.manager.reserve(np.zeros(self.config.cache.batch_size, np.int32))
        self.runner.warm_up(buckets, self.chunk, empty, self.vocab_size, self.speculative, self.config.cache.max_len,
                            on_program, mixed_chunks=None if self.step_tokens is None else {
                                size: self._mixed_width(size) for size in buckets},
                            prefill_buckets=buckets[1:])

    # ---------------------------------------------------------------- internal

    def _rows(self, requests: list[Request | None], size: int | None = None) -> RowSampling:
        """Sampling rows for `requests` (None: an idle row), padded to `size` (default: the batch size)."""
        rows = [r.settings() if r is not None else (Sampling(), 0, 0, 0, 0) for r in requests]
        return RowSampling.of(rows, size or self.config.cache.batch_size)

    def _adjustments(self, requests: list[Request | None], size: int, width: int | None = None,
                     drafts: dict[int, np.ndarray] | None = None) -> Adjustments:
        """The `Adjustments` of `requests` (None: an idle row) `(size, [width,] V)`; row r's drafts are
        `drafts.get(r, ())`. Neutral arrays already on the device when no request adjusts."""
        shape = (size, self.vocab_size) if width is None else (size, width, self.vocab_size)
        if not any(r is not None and r.adjuster is not None for r in requests):
            if shape not in self._neutral:
                self._neutral[shape] = Adjustments(*(jax.device_put(a) for a in Adjustments.neutral(shape)))
            return self._neutral[shape]
        arrays = Adjustments.neutral(shape)
        for row, request in enumerate(requests):
            if request is not None and request.adjuster is not None:
                views = arrays if width is not None else [a[:, None] for a in arrays]
                request.adjuster.fill(*(a[row] for a in views), drafts=(drafts or {}).get(row, ()))
        return arrays

    def _bucket(self, count: int) -> int:
        """Rows of a decode call for `count` sequences: a power of two, at most the batch size."""
        return min(1 << max(count - 1, 0).bit_length(), self.config.cache.batch_size)

    def _mixed_width(self, bucket: int) -> int:
        """The prefill chunk a decode call of `bucket` rows carries: what `step_tokens` leaves, at most `chunk`."""
        return min(self.chunk, self.step_tokens - bucket)

    def _chunk_tokens(self, seq: int, width: int | None = None) -> tuple[np.ndarray, int, bool]:
        """Sequence `seq`'s next prefill chunk, at most `width` tokens (default `chunk`), before its reservation:
        `(tokens (1, width), length, whether it ends the prompt)`."""
        request, width = self.scheduler.seqs[seq], width or self.chunk
        start, end = self.scheduler.next_chunk(seq)
        end = min(end, start + width)
        tokens = np.zeros((1, width), np.int32)
        tokens[0, : end - start] = request.context[start:end]
        return tokens, end - start, end >= len(request.context)

    def _chunk(self, seq: int, width: int | None = None):
        """Sequence `seq`'s next prefill chunk as a call takes it (`_chunk_tokens`): `(tokens (1, width), length,
        sampling rows, adjustments)`, a row for each choice of its request."""
        tokens, length, last = self._chunk_tokens(seq, width)
        return tokens, length, *self._choices(self.scheduler.seqs[seq], last)

    def _choices(self, request: Request, last: bool) -> tuple[RowSampling, Adjustments]:
        """The sampling rows of `request`'s choices (padded to the batch size), sampling from one sequence's logits,
        and their adjustments if its chunk is the `last` (only the last chunk's tokens are kept: adjust only
        those)."""
        return self._rows(request.group), self._adjustments(request.group if last else [], self.config.cache.batch_size)

    def _prefill_chunks(self, seqs: list[int]):
        """The next chunk of each of `seqs`: those of one-choice requests together in one call
        (`_prefill_together`), the others alone (all of a request's choices sample from its one sequence's
        logits)."""
        scheduler = self.scheduler
        together = [s for s in seqs if len(scheduler.seqs[s].group) == 1]
        for seq in seqs:
            if seq not in together and scheduler.prefilling(seq):  # an earlier chunk may have preempted it
                self._prefill_together([seq])
        together = [s for s in together if scheduler.prefilling(s)]
        if together:
            self._prefill_together(together)

    def _prefill_together(self, seqs: list[int]):
        """The next chunk of each of `seqs` in one call: of one sequence (its request's choices all sample from its
        logits), or of several one-choice requests laid over the smallest bucket of rows that holds them
        (`_laid_out`), so that prompts that arrive together are prefilled together and their first tokens come
        together, as a wave. A sequence preempted to make room for the others is left out."""
        chunks = {s: self._chunk_tokens(s) for s in seqs}  # before the reservation moves the sequences on
        counts = np.zeros(self.config.cache.batch_size, np.int32)
        counts[seqs] = [chunks[s][1] for s in seqs]
        batch, seqs, rows, active, table, sampling, laid = self._laid_out(seqs, counts)
        if len(seqs) == 1:
            tokens, length, last = chunks[seqs[0]]
            outputs = self.runner.prefill(tokens, length, batch, seqs[0], *self._choices(laid[0], last))
            self._chunked(seqs[0], *outputs)
        elif seqs:
            tokens, lengths = np.zeros((len(rows), self.chunk), np.int32), np.zeros(len(rows), np.int32)
            for r, seq in enumerate(seqs):
                tokens[r], lengths[r] = chunks[seq][0][0], chunks[seq][1]
            ending = [request if chunks[seq][2] else None for seq, request in zip(seqs, laid)]  # adjust a last chunk
            outputs = self.runner.prefills(tokens, lengths, table, np.where(active, batch.pos[rows], 0), batch,
                                           sampling, self._adjustments(ending + laid[len(seqs):], len(rows)))
            for r, seq in enumerate(seqs):
                self._chunked(seq, *(output[r : r + 1] for output in outputs))

    def _chunked(self, seq: int, new, logprobs, top_ids, top_logprobs):
        """After a chunk of sequence `seq`: its last registers the prompt and gives each choice its first token."""
        scheduler, request = self.scheduler, self.scheduler.seqs[seq]
        if scheduler.prefilling(seq):
            return
        group = request.group  # each choice samples its first token from these logits; forking empties it
        scheduler.prefilled(seq)
        for row, member in enumerate(group):
            if not member.generated:  # a recomputed request already has its next token
                member.append(int(new[row]), float(logprobs[row]), top_ids[row], top_logprobs[row])
                member.first_token_seconds = time.perf_counter() - member.admitted_at
                scheduler.totals["generated_tokens"] += 1

    def _laid_out(self, seqs: list[int], counts: np.ndarray):
        """Reserves `counts` tokens per sequence, then lays `sequences` over the smallest bucket of rows (padding rows:
        sequence 0, inactive): `(batch, the sequences not preempted meanwhile, rows, active, page table, sampling
        rows, each row's request or None)`."""
        batch = self.scheduler.reserve(counts)
        seqs = [s for s in seqs if counts[s]]  # reserve zeroes a preempted one's count
        rows = np.zeros(self._bucket(len(seqs)), np.int64)
        rows[: len(seqs)] = seqs
        active = np.arange(len(rows)) < len(seqs)
        table = np.where(active[:, None], batch.table[rows], 0)
        laid = [self.scheduler.seqs[s] if a else None for s, a in zip(rows, active)]
        return batch, seqs, rows, active, table, self._rows(laid, len(rows)), laid

    def _pending(self, rows: np.ndarray, active: np.ndarray) -> np.ndarray:
        """Each active row's last token, the one a decode call feeds (0 for an idle row)."""
        requests = self.scheduler.seqs
        return np.array([requests[s].generated[-1] if a else 0 for s, a in zip(rows, active)], np.int32)

    def _decode(self, seqs: list[int]):
        """One token for each of `sequences`, in a call over the smallest bucket of rows that holds them."""
        counts = np.zeros(self.config.cache.batch_size, np.int32)
        counts[seqs] = 1
        self._decode_laid(*self._laid_out(seqs, counts))

    def _decode_laid(self, batch, seqs, rows, active, table, sampling, laid):
        adjustments = self._adjustments(laid, len(rows))
        if self.async_scheduling and not any(r is not None and r.adjuster is not None for r in laid):
            outputs = self.runner.dispatch_decode(self._pending(rows, active), active, table, batch.pos[rows], batch,
                                                  sampling, adjustments)
            self._ahead = _Ahead(seqs, rows, active, [self.scheduler.seqs[s] for s in seqs], outputs)
            return
        outputs = self.runner.decode(self._pending(rows, active), active, table, batch.pos[rows], batch, sampling,
                                     adjustments)
        self._decoded(seqs, *outputs)

    def _chained(self) -> bool:
        """With a decode call ahead: dispatches the next one behind it, fed its new tokens on the device, when the
        same requests go on decoding (nothing to admit or prefill, none at its last token, none adjusting, pages
        for one more token each without preempting); then reads the call ahead. Whether it chained: if not, the
        call ahead is read and the step runs as usual."""
        ahead, self._ahead = self._ahead, None
        scheduler = self.scheduler
        goes_on = (
            ahead.requests == [scheduler.seqs[s] for s in ahead.seqs]
            and all(len(r.generated) + 2 <= r.max_new_tokens and r.adjuster is None for r in ahead.requests)
            and not any(scheduler.prefilling(s) for s in range(len(scheduler.seqs)))
            and not scheduler.admittable()
        )
        batch = None
        if goes_on:
            counts = np.zeros(self.config.cache.batch_size, np.int32)
            counts[ahead.seqs] = 1
            try:
                batch = self.manager.reserve(counts)  # all or nothing: no preemption here
            except OutOfPagesError:
                pass
        if batch is not None:
            rows, active = ahead.rows, ahead.active
            sampling = RowSampling.of([r.settings(ahead=1) for r in ahead.requests], len(rows))
            table = np.where(active[:, None], batch.table[rows], 0)
            outputs = self.runner.dispatch_decode(ahead.outputs[0], active, table, batch.pos[rows], batch, sampling,
                                                  self._adjustments([None] * len(rows), len(rows)))
            self._ahead = _Ahead(ahead.seqs, rows, active, ahead.requests, outputs)
        self._read(ahead)
        return batch is not None

    def _read(self, ahead: _Ahead):
        """The tokens of a decode call ahead, to the requests that still hold their sequences and have not ended."""
        self._decoded(ahead.seqs, *self.runner.read(ahead.outputs), requests=ahead.requests)

    def _decoded(self, seqs: list[int], new, logprobs, top_ids, top_logprobs, requests=None):
        """Row r's token to the request of sequence `seqs[r]`; with `requests` (a call read after others ran),
        only where that request still holds the sequence and has not ended."""
        for row, seq in enumerate(seqs):
            request = self.scheduler.seqs[seq]
            if requests is not None and (request is not requests[row] or request.finished):
                continue
            request.append(int(new[row]), float(logprobs[row]), top_ids[row], top_logprobs[row])
            self.scheduler.totals["generated_tokens"] += 1

    def _mixed(self, seqs: list[int], seq: int):
        """One token for each of `sequences` and sequence `seq`'s next prefill chunk, in one call
        (`Runner.mixed`); alone in their own calls if making room preempted the others."""
        scheduler, request = self.scheduler, self.scheduler.seqs[seq]
        tokens, length, chunk_rows, chunk_adjustments = self._chunk(seq, self._mixed_width(self._bucket(len(seqs))))
        counts = np.zeros(self.config.cache.batch_size, np.int32)
        counts[seqs] = 1
        counts[seq] = length
        laid = self._laid_out(seqs, counts)
        batch, seqs, rows, active, table, sampling, requests = laid
        if scheduler.seqs[seq] is not request:  # preempted to make room
            if seqs:
                self._decode_laid(*laid)
            return
        # Making room may have preempted rows: a smaller bucket, whose program takes a chunk as wide or wider.
        width = self._mixed_width(len(rows)) if seqs else self.chunk
        tokens = np.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))
        if not seqs:
            self._chunked(seq, *self.runner.prefill(tokens, length, batch, seq, chunk_rows, chunk_adjustments))
            return
        outputs = self.runner.mixed(
            self._pending(rows, active), active, tokens, length, np.concatenate([table, batch.table[seq : seq + 1]]),
            np.concatenate([batch.pos[rows], batch.pos[seq : seq + 1]]), batch, sampling,
            self._adjustments(requests, len(rows)), chunk_rows, chunk_adjustments)
        self._decoded(seqs, *outputs[:4])
        self._chunked(seq, *outputs[4:])

    def _offers(self, seqs: list[int]) -> dict[int, np.ndarray]:
        """The drafts of each request of `sequences` that drafts this step (by prompt lookup, within its budget)."""
        policy, requests = self.speculative.policy, self.scheduler.seqs
        trying = []
        for seq in seqs:
            request = requests[seq]
            if request.budget > 0 and policy.wants_round(request.expected, request.waited, request.patience):
                trying.append(seq)
            else:
                request.waited += 1
        if not trying:
            return {}
        history = np.zeros((self._bucket(len(trying)), self.config.cache.max_len + 1), np.int32)
        filled = np.zeros(len(history), np.int32)
        for row, seq in enumerate(trying):
            tokens = requests[seq].prompt + requests[seq].generated
            history[row, : len(tokens)] = tokens
            filled[row] = len(tokens) - 1
        drafts, widths = self.runner.lookup(history, filled, self.speculative.num_tokens, self.speculative.max_ngram)
        offers = {}
        for row, seq in enumerate(trying):
            width = min(int(widths[row]), requests[seq].budget)
            if width and requests[seq].adjuster is not None:  # drafts its grammar forbids are never offered
                width = requests[seq].adjuster.drafts_allowed(drafts[row, :width])
            if width:
                offers[seq] = drafts[row, :width]
            else:
                requests[seq].waited += 1
        return offers

    def _verify(self, seqs: list[int], offers: dict[int, np.ndarray]):
        """A speculative round: each of `sequences` feeds its pending token and its drafts (if any) in one call of
        K + 1 tokens per row, keeps the drafts the model agrees with plus one token of the model's, and gives
        back the pages past them."""
        width, policy, totals = self.speculative.num_tokens + 1, self.speculative.policy, self.scheduler.totals
        counts = np.zeros(self.config.cache.batch_size, np.int32)
        counts[seqs] = 1
        for seq, drafts in offers.items():
            counts[seq] = drafts.size + 1
        batch, seqs, rows, active, table, sampling, laid = self._laid_out(seqs, counts)
        requests = self.scheduler.seqs
        tokens = np.zeros((len(rows), width), np.int32)
        for row, seq in enumerate(seqs):
            tokens[row, 0] = requests[seq].generated[-1]
            tokens[row, 1 : counts[seq]] = offers.get(seq, ())
        drafts = {row: offers[seq] for row, seq in enumerate(seqs) if seq in offers}
        kept, new, logprobs, top_ids, top_logprobs = self.runner.verify(
            tokens, np.where(active, counts[rows], 0).astype(np.int32), table, batch.pos[rows], batch, sampling,
            self._adjustments(laid, len(rows), width, drafts))
        for row, seq in enumerate(seqs):
            request = requests[seq]
            produced = new[row, : kept[row] + 1].tolist()
            stops = [j for j, token in enumerate(produced) if token in request.stop_tokens]
            produced = produced[: stops[0] + 1] if stops else produced
            for j, token in enumerate(produced):
                request.append(token, float(logprobs[row, j]), top_ids[row, j], top_logprobs[row, j])
                if request.halted:  # its grammar refused it: nothing after it counts
                    produced = produced[: j + 1]
                    break
            # The cache keeps the pending token and every new one but the last.
            self.manager.truncate(seq, int(batch.pos[seq]) + len(produced))
            totals["generated_tokens"] += len(produced)
            if seq in offers:
                totals["drafted_tokens"] += int(counts[seq] - 1)
                totals["accepted_tokens"] += int(kept[row])
                request.expected = float(policy.estimate(request.expected, int(kept[row])))
                request.waited = 0
                request.patience = int(policy.patience(request.expected, request.patience))


@dataclasses.dataclass
class _Ahead:
    """A decode call dispatched and not read: its sequences, their rows and requests, and its outputs on the device."""

    seqs: list[int]
    rows: np.ndarray
    active: np.ndarray
    requests: list[Request]
    outputs: list[jax.Array]
