"""The device half of the engine: a paged model's weights, its page pools, and the programs a step runs.

Five compiled programs with fixed shapes, so requests come and go without a
recompilation: a prefill chunk `(1, chunk)` whose last logits every choice
of a request samples from (or a chunk of each of a bucket of one-choice
requests, `(C, chunk)`), a decode step over a bucket of rows, the two in
one call (`CausalLM.mixed`: a decode bucket and a chunk, the weights read
once for both), a speculative verify over a bucket of rows of K + 1 tokens,
and prompt lookup over the same buckets. Each samples with `kvattn.generation.sampling` and
verifies with `kvattn.generation.speculation`, as the fixed-batch loops do.

The runner works on its own copy of the model's pools, donated from call to
call; the model itself is never changed, unless the caller hands the pools
over (`donate_pools`): then they are the runner's without a copy, and the
model's caches are deleted by the first call. A call that fails leaves pools
that were donated to it replaced by zeros (the scheduler recomputes what
they held).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn.generation.sampling import Adjustments, RowSampling, sample_rows
from kvattn.generation.speculation import lookup, verify_rows
from kvattn.models.decoder import CausalLM
from kvattn.paging import PageBatch

__all__ = ["Runner"]


class Runner:
    """Runs `model`'s programs on the runner's own pools.

    Args:
      model: a paged `CausalLM`; its weights are shared, its pools copied.
      donate_pools: take the model's pools as they are instead of a copy (half the pools' memory); the model's
        caches are then deleted by the first call, so only a caller that will not use the model again passes it.
    """

    def __init__(self, model: CausalLM, *, donate_pools: bool = False):
        graphdef, params, pools = nnx.split(model, nnx.Param, nnx.Cache)
        # Weights and pools travel as flat lists of arrays, their structure in the static argument: jit flattens
        # a list in C++, where an `nnx.State` is taken apart in Python, node by node, on every call.
        self._params, params_def = jax.tree.flatten(params)
        pools, pools_def = jax.tree.flatten(pools)
        self._graphdef = _Static((graphdef, params_def, pools_def))
        # Ours alone, so each call may donate them.
        self._pools = pools if donate_pools else [jnp.copy(a) for a in pools]
        self._template = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in pools]

    def prefill(self, tokens, length, batch: PageBatch, seq: int, rows: RowSampling, adjustments: Adjustments):
        """Chunk `tokens` `(1, chunk)` of sequence `seq`, `length` of them real; each row of `rows` samples from its
        last logits, after its row of `adjustments`: `(tokens, logprobs, top_ids, top_logprobs)` per row."""
        return self.prefills(tokens, np.int32([length]), batch.table[seq : seq + 1], batch.pos[seq : seq + 1], batch,
                             rows, adjustments)

    def prefills(self, tokens, lengths, table, pos, batch: PageBatch, rows: RowSampling, adjustments: Adjustments):
        """A chunk of each of C sequences in one call: `tokens` `(C, chunk)`, `lengths` real, their rows of the page
        `table` and `pos`; row c of `rows` samples from sequence c's last logits (with C = 1, every row samples from
        its one sequence's: the choices of a request): `(tokens, logprobs, top_ids, top_logprobs)` per row."""
        return self._run(_prefill_program, tokens, lengths, table, pos, batch.copy_from, batch.copy_to, rows,
                         adjustments)

    def decode(self, tokens, active, table, pos, batch: PageBatch, rows: RowSampling, adjustments: Adjustments):
        """One token for each active row: `(tokens, logprobs, top_ids, top_logprobs)`."""
        return self.read(self.dispatch_decode(tokens, active, table, pos, batch, rows, adjustments))

    def dispatch_decode(self, tokens, active, table, pos, batch: PageBatch, rows: RowSampling,
                        adjustments: Adjustments) -> list[jax.Array]:
        """`decode`, without waiting: its outputs on the device, for `read` (`tokens` may be the new tokens of
        the call before, still on the device). The next call runs after this one, on the pools it leaves."""
        return self._dispatch(_decode_program, tokens, active, table, pos, batch.copy_from, batch.copy_to, rows,
                              adjustments)

    def read(self, outputs: list[jax.Array]) -> list[np.ndarray]:
        """A dispatched call's outputs on the host, once it has run; a failed call replaces the pools (`_run`)."""
        try:
            return [np.asarray(output) for output in outputs]
        except BaseException:
            self._replace_deleted_pools()
            raise

    def mixed(self, tokens, active, chunk, length, table, pos, batch: PageBatch, rows: RowSampling,
              adjustments: Adjustments, chunk_rows: RowSampling, chunk_adjustments: Adjustments):
        """`decode`'s rows and `prefill`'s chunk `(1, chunk)` (`length` real tokens) in one call; `table` and `pos`
        hold the decode rows, then the chunk's sequence. The decode rows' `(tokens, logprobs, top_ids,
        top_logprobs)`, then the same for each row of `chunk_rows`, sampling from the chunk's last logits."""
        return self._run(_mixed_program, tokens, active, chunk, np.int32([length]), table, pos, batch.copy_from,
                         batch.copy_to, rows, adjustments, chunk_rows, chunk_adjustments)

    def verify(self, tokens, lengths, table, pos, batch: PageBatch, rows: RowSampling, adjustments: Adjustments):
        """Each row's pending token and drafts (`lengths` - 1 of them) scored in one chunk and verified, each
        position with its row of `adjustments` `(B, K1, V)`: `(kept, tokens, logprobs, top_ids, top_logprobs)`
        (`kvattn.generation.speculation.verify_rows`)."""
        return self._run(_verify_program, tokens, lengths, table, pos, batch.copy_from, batch.copy_to, rows,
                         adjustments)

    @staticmethod
    def lookup(history: np.ndarray, filled: np.ndarray, num_tokens: int, max_ngram: int):
        """Prompt lookup's drafts for each row of `history`: `(drafts, widths)` on the host."""
        return tuple(np.asarray(x) for x in _lookup(history, filled, num_tokens, max_ngram))

    def warm_up(self, buckets: list[int], chunk: int, empty: PageBatch, vocab_size: int, speculative=None,
                max_len: int = 0, on_program: Callable[[int, int], None] | None = None,
                mixed_chunks: dict[int, int] | None = None, prefill_buckets: list[int] = ()) -> None:
        """Compiles every program a step may run, by calling each idle: nothing is written (every row is
        inactive and maps only the null page of `empty`, a reservation of nothing).

        Args:
          buckets: the row counts decode and verify calls take.
          chunk: the prefill chunk.
          empty: a `PageBatch` reserving nothing.
          vocab_size: the width of the model's logits.
          speculative: the server's `PromptLookup`, if any (verify and lookup programs too).
          max_len: the width of lookup's histories, less one.
          on_program: called as `on_program(done, total)` after each program.
          mixed_chunks: the chunk a mixed call of each bucket carries (None: the server makes no mixed calls).
          prefill_buckets: the sequence counts of calls that prefill several sequences' chunks together.
        """
        width = empty.table.shape[1]
        choices = max(buckets)  # a chunk's sampling rows: one per choice of its request
        chunk_rows, chunk_adjustments = RowSampling.of([], choices), Adjustments.neutral((choices, vocab_size))
        calls = []
        for size in buckets:
            idle = (np.zeros(size, np.int32), np.zeros(size, bool))
            calls.append(functools.partial(self.decode, *idle, np.zeros((size, width), np.int32),
                                           np.zeros(size, np.int32), empty, RowSampling.of([], size),
                                           Adjustments.neutral((size, vocab_size))))
            if mixed_chunks is not None:
                calls.append(functools.partial(
                    self.mixed, *idle, np.zeros((1, mixed_chunks[size]), np.int32), 0,
                    np.zeros((size + 1, width), np.int32), np.zeros(size + 1, np.int32), empty,
                    RowSampling.of([], size), Adjustments.neutral((size, vocab_size)), chunk_rows, chunk_adjustments))
        if speculative is not None:
            for size in buckets:
                calls.append(functools.partial(self.lookup, np.zeros((size, max_len + 1), np.int32),
                                               np.zeros(size, np.int32), speculative.num_tokens, speculative.max_ngram))
                calls.append(functools.partial(
                    self.verify, np.zeros((size, speculative.num_tokens + 1), np.int32), np.zeros(size, np.int32),
                    np.zeros((size, width), np.int32), np.zeros(size, np.int32), empty, RowSampling.of([], size),
                    Adjustments.neutral((size, speculative.num_tokens + 1, vocab_size))))
        calls.append(functools.partial(self.prefill, np.zeros((1, chunk), np.int32), 0, empty, 0, chunk_rows,
                                       chunk_adjustments))
        for size in prefill_buckets:
            calls.append(functools.partial(
                self.prefills, np.zeros((size, chunk), np.int32), np.zeros(size, np.int32),
                np.zeros((size, width), np.int32), np.zeros(size, np.int32), empty, RowSampling.of([], size),
                Adjustments.neutral((size, vocab_size))))
        for done, call in enumerate(calls, start=1):
            call()
            if on_program is not None:
                on_program(done, len(calls))

    def _run(self, program, *args):
        """One device call on the pools; on any failure, pools that were donated are replaced before re-raising."""
        return self.read(self._dispatch(program, *args))

    def _dispatch(self, program, *args) -> list[jax.Array]:
        try:
            *outputs, pools = program(self._graphdef, self._params, self._pools, *args)
        except BaseException:
            self._replace_deleted_pools()
            raise
        self._pools = pools
        return outputs

    def _replace_deleted_pools(self):
        """After a failed call: pools donated to it (deleted), or left by it (never computed), become zeros."""
        try:
            jax.block_until_ready(self._pools)
            failed = any(array.is_deleted() for array in jax.tree.leaves(self._pools))
        except Exception:  # the pools of a call that failed on the device
            failed = True
        if failed:
            self._pools = [jnp.zeros(a.shape, a.dtype, device=a.sharding) for a in self._template]


class _Static:
    """A graphdef and the structures of the weights and pools, as a jit static argument hashed once: flax hashes a
    `GraphDef` anew on every call, node by node, which a step would pay each time. Equal graphdefs stay equal, so
    equal models share programs."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef):
        self.graphdef, self._hash = graphdef, hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, _Static) and self._hash == other._hash
                                 and self.graphdef == other.graphdef)


_lookup = jax.jit(lookup, static_argnames=("num_tokens", "max_ngram"))


def _merged(static: _Static, params: list[jax.Array], pools: list[jax.Array]) -> CausalLM:
    """The model of a program's flat weights and pools."""
    graphdef, params_def, pools_def = static.graphdef
    return nnx.merge(graphdef, jax.tree.unflatten(params_def, params), jax.tree.unflatten(pools_def, pools))


def _pools(model: CausalLM) -> list[jax.Array]:
    """The model's pools after a program's call, flat as the runner holds them."""
    return jax.tree.leaves(nnx.state(model, nnx.Cache))


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("pools",))
def _prefill_program(graphdef, params, pools, tokens, lengths, table, pos, copy_from, copy_to, rows, adjustments):
    """A chunk of each of C sequences; row c of `rows` samples from sequence c's last logits, or, with one sequence,
    every row does (the choices of a request)."""
    model = _merged(graphdef, params, pools)
    logits = model.prefill(tokens, lengths, pages=PageBatch(table, pos, copy_from, copy_to), last_only=True)
    logits = jnp.broadcast_to(logits, (rows.seed.shape[0], logits.shape[-1]))
    return *sample_rows(logits, rows, adjustments), _pools(model)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("pools",))
def _decode_program(graphdef, params, pools, tokens, active, table, pos, copy_from, copy_to, rows, adjustments):
    model = _merged(graphdef, params, pools)
    logits = model.step(tokens, active, pages=PageBatch(table, pos, copy_from, copy_to))
    return *sample_rows(logits, rows, adjustments), _pools(model)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("pools",))
def _mixed_program(graphdef, params, pools, tokens, active, chunk, length, table, pos, copy_from, copy_to, rows,
                   adjustments, chunk_rows, chunk_adjustments):
    """A decode step over a bucket of rows and a prefill chunk of one sequence, in one pass over the weights."""
    model = _merged(graphdef, params, pools)
    logits, last = model.mixed(tokens, active, chunk, length, pages=PageBatch(table, pos, copy_from, copy_to))
    last = jnp.broadcast_to(last, (chunk_rows.seed.shape[0], last.shape[-1]))
    return (*sample_rows(logits, rows, adjustments), *sample_rows(last, chunk_rows, chunk_adjustments),
            _pools(model))


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("pools",))
def _verify_program(graphdef, params, pools, tokens, lengths, table, pos, copy_from, copy_to, rows, adjustments):
    """A speculative round: each row's pending token and drafts (`lengths` - 1 of them) scored in one chunk."""
    model = _merged(graphdef, params, pools)
    logits = model.prefill(tokens, lengths, pages=PageBatch(table, pos, copy_from, copy_to))
    kept = verify_rows(logits, tokens[:, 1:], jnp.maximum(lengths - 1, 0), rows, adjustments)
    return *kept, _pools(model)
