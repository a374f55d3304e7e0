"""The paged cache's device half against the contiguous one: the online softmax, the step, and a state machine.

The host half (`kvattn.paging` pool and manager) has its own tests beside
this file; here the device follows its tables. The oracle is the contiguous
layer (itself checked against the float64 reference elsewhere) and, for the
pure step, the float64 reference directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvattn
from kvattn.kernels import native
from kvattn.math import ops
from kvattn.layer.forward import extend
from kvattn.paging import OutOfPagesError
from tests.helpers import BATCH, CHUNK, MAX_LEN, manager_for, poison_free_pages
from tests.helpers import paged_layers as layers
from tests.helpers import random_tokens as tokens
from tests.reference import ReferenceCache, assert_close, weights_of
from tests.reference import attention as reference_attention


# ------------------------------------------------- the chunked (online) softmax


@functools.cache
def chunked_attention(chunk: int, window: int | None, softcap: float | None):
    """`ops.chunked_cached_attention` reading slots `chunk` at a time, compiled once per setting."""

    @jax.jit
    def attend(q, k, v, new_len, cache_len):
        batch, num_slots = k.shape[:2]
        filled = cache_len + new_len

        def read_chunk(index):
            slots = index * chunk + jnp.arange(chunk)
            inside = slots < num_slots
            slots = jnp.minimum(slots, num_slots - 1)
            held = inside[None, :] & (slots[None, :] < filled[:, None])
            clean = jnp.where(held[:, :, None, None], v[:, slots], 0.0)  # a masked slot must hold no NaN
            positions = jnp.broadcast_to(jnp.where(inside, slots, num_slots), (batch, chunk))
            return k[:, slots], clean, None, None, positions

        return ops.chunked_cached_attention(
            q, new_len, read_chunk, (jnp.max(filled) + chunk - 1) // chunk, cache_len, window=window,
            logit_softcap=softcap,
        )

    return attend


@pytest.mark.parametrize(("chunk", "window", "softcap"), [(1, None, None), (2, 4, 2.0), (5, None, 2.0)])
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_chunked_attention_equals_the_reference(chunk, window, softcap, data):
    """Slots read a few at a time (fully masked chunks included) equal one softmax over all of them."""
    batch, num_new, num_heads, num_kv_heads, head_dim, num_slots = 3, 3, 4, 2, 4, 10
    cache_len = np.array(data.draw(st.lists(st.integers(0, num_slots - num_new), min_size=batch, max_size=batch)))
    new_len = np.array(data.draw(st.lists(st.integers(0, num_new), min_size=batch, max_size=batch)))
    keys = jax.random.split(jax.random.key(data.draw(st.integers(0, 99))), 3)
    q = jax.random.normal(keys[0], (batch, num_new, num_heads, head_dim))
    k = jax.random.normal(keys[1], (batch, num_slots, num_kv_heads, head_dim))
    v = jax.random.normal(keys[2], (batch, num_slots, num_kv_heads, head_dim))
    out = chunked_attention(chunk, window, softcap)(q, k, v, jnp.asarray(new_len), jnp.asarray(cache_len))
    for b in range(batch):
        real, held = new_len[b], slice(0, cache_len[b] + new_len[b])
        if real:
            query_pos = cache_len[b] + np.arange(real)
            expected = reference_attention(q[b, :real], k[b, held], v[b, held], query_pos, window, softcap)
            np.testing.assert_allclose(out[b, :real], expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out[b, real:], 0.0)


# ------------------------------------------------- the step against the contiguous step


@pytest.mark.parametrize(
    ("page_size", "cache_dtype"),
    [(1, "float32"), (8, "float32"), (16, "float32"), (8, "bfloat16"), (8, "int8")],
)
def test_paged_equals_contiguous(page_size, cache_dtype):
    """A ragged prefill, then steps: the paged layer equals the contiguous cache written first (same stored values)."""
    paged_layer, contiguous = layers(page_size, cache_dtype, num_pages=16)
    manager = manager_for(paged_layer)
    for _ in range(BATCH):
        manager.add()
    rng = np.random.default_rng(page_size)
    cache = jax.tree.map(jnp.zeros_like, contiguous.cache)
    model = ReferenceCache(weights_of(contiguous), BATCH)
    lengths = np.array([3, 1, 2], np.int32)
    for count in [lengths, np.ones(BATCH, np.int32), np.ones(BATCH, np.int32), np.array([1, 0, 1], np.int32)]:
        xs = tokens(rng, BATCH, CHUNK if count is lengths else 1)
        poison_free_pages(paged_layer, manager)
        batch = manager.reserve(count)
        if xs.shape[1] == 1:
            got = paged_layer.step(xs[:, 0], jnp.asarray(count > 0), pages=batch)[:, None]
        else:
            got = paged_layer.prefill(xs, jnp.asarray(count), pages=batch)
        want, cache = extend(contiguous.weights, cache, xs, jnp.asarray(count), config=contiguous.config,
                             write_first=True)
        for b in range(BATCH):
            np.testing.assert_allclose(got[b, : count[b]], want[b, : count[b]], rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(got[b, count[b] :], 0)
            if cache_dtype == "float32":
                for t in range(count[b]):
                    assert_close(got[b, t], model.append(b, xs[b, t]))


@pytest.mark.skipif(not native.available(native.PAGED_DECODE_ATTENTION),
                    reason="kvattn's native paged kernel is not built or cannot run here")
def test_native_paged_chunks_and_steps_equal_the_reference_and_xla():
    """Head dims of 16 in a heads-major pool: the CPU's chunks and steps read the pages natively (not XLA's
    views) where their kernels run (AVX2 and FMA), and equal float64 and the same layer forced onto
    XLA, with NaN in every free page."""

    def build(kernel):
        return kvattn.MultiHeadAttention(4, 64, num_kv_heads=2, batch_size=BATCH, max_len=MAX_LEN, num_pages=16,
                                         page_size=4, cache_layout="heads_major", decode_kernel=kernel,
                                         rngs=nnx.Rngs(0))

    native_layer, xla_layer = build("auto"), build("xla")
    for width, kernel in ((1, native.PAGED_DECODE_ATTENTION), (CHUNK, native.PAGED_PREFILL_ATTENTION)):
        assert (kernel in str(jax.make_jaxpr(
            functools.partial(extend.__wrapped__, config=native_layer.config, write_first=True))(
                native_layer.weights, native_layer.paged_cache(jnp.ones((BATCH, 4), jnp.int32),
                                                               jnp.zeros(BATCH, jnp.int32)),
                jnp.zeros((BATCH, width, 64)), jnp.ones(BATCH, jnp.int32)))) == native.available(kernel)
    manager = manager_for(native_layer)
    for _ in range(BATCH):
        manager.add()
    model = ReferenceCache(weights_of(native_layer), BATCH)
    rng = np.random.default_rng(6)
    xs = jnp.asarray(rng.standard_normal((BATCH, CHUNK, 64)).astype(np.float32))
    lengths = np.array([3, 1, 0], np.int32)
    for _ in range(2):  # a chunk over nothing, then over the first
        poison_free_pages(native_layer, manager)
        poison_free_pages(xla_layer, manager)
        batch = manager.reserve(lengths)
        got, on_xla = (layer.prefill(xs, jnp.asarray(lengths), pages=batch) for layer in (native_layer, xla_layer))
        np.testing.assert_allclose(got, on_xla, rtol=1e-5, atol=1e-5)
        for b in range(BATCH):
            for t in range(lengths[b]):
                assert_close(got[b, t], model.append(b, xs[b, t]))
            np.testing.assert_array_equal(got[b, lengths[b]:], 0)
        xs = xs[:, ::-1]
    for _ in range(6):
        x = jnp.asarray(rng.standard_normal((BATCH, 64)).astype(np.float32))
        poison_free_pages(native_layer, manager)
        poison_free_pages(xla_layer, manager)
        batch = manager.reserve(np.ones(BATCH, np.int32))
        got, on_xla = (layer.step(x, pages=batch) for layer in (native_layer, xla_layer))
        np.testing.assert_allclose(got, on_xla, rtol=1e-5, atol=1e-5)
        for b in range(BATCH):
            assert_close(got[b], model.append(b, x[b]))


@pytest.mark.parametrize("groups", [((2, 1), (1, CHUNK)), ((1, CHUNK), (1, 1), (1, CHUNK)), ((3, 1),)])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_ragged_calls_equal_the_reference(groups, data):
    """Decode rows and prefill chunks in one call (`MultiHeadAttention.ragged`), rows in any order over the
    sequences, two calls in a row: every real token's output equals float64, padding gives zeros, free pages
    hold NaN."""
    paged_layer, _ = layers(4, num_pages=16)
    manager = manager_for(paged_layer)
    for _ in range(BATCH):
        manager.add()
    model = ReferenceCache(weights_of(paged_layer), BATCH)
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    widths = np.repeat([w for _, w in groups], [r for r, _ in groups])
    for _ in range(2):
        order = np.asarray(data.draw(st.permutations(range(BATCH))))  # row r of the call is sequence order[r]
        lengths = np.array([data.draw(st.integers(0, w)) for w in widths], np.int32)
        counts = np.zeros(BATCH, np.int32)
        counts[order] = lengths
        poison_free_pages(paged_layer, manager)
        batch = manager.reserve(counts)
        xs = tokens(rng, int(widths.sum()))
        got = paged_layer.ragged(xs, lengths, groups, pages=batch._replace(table=batch.table[order],
                                                                            pos=batch.pos[order]))
        first = 0
        for row, width in enumerate(widths):
            for t in range(width):
                if t < lengths[row]:
                    assert_close(got[first + t], model.append(int(order[row]), xs[first + t]))
                else:
                    np.testing.assert_array_equal(got[first + t], 0)
            first += width
    manager.check()


def test_ragged_calls_refuse_bad_groups_and_lengths_before_any_change():
    paged_layer, contiguous = layers(4, num_pages=16)
    manager = manager_for(paged_layer)
    manager.add()
    manager.add()
    batch = manager.reserve(np.array([1, 0, 0], np.int32))
    pages = batch._replace(table=batch.table[:2], pos=batch.pos[:2])
    before = jax.tree.map(np.asarray, nnx.state(paged_layer, nnx.Cache))
    xs = tokens(np.random.default_rng(0), 1 + CHUNK)
    with pytest.raises(ValueError, match="groups must be"):
        paged_layer.ragged(xs, np.array([1, 0]), [(1, 1), (1, 0)], pages=pages)
    with pytest.raises(ValueError, match=r"xs must hold the 4 tokens"):
        paged_layer.ragged(xs[:2], np.array([1, 0]), ((1, 1), (1, CHUNK)), pages=pages)
    with pytest.raises(ValueError, match=r"at most each row's group width \[1, 3\]"):
        paged_layer.ragged(xs, np.array([2, 2]), ((1, 1), (1, CHUNK)), pages=pages)
    with pytest.raises(ValueError, match="sequence 1 writes positions 0..2"):
        paged_layer.ragged(xs, np.array([1, 3]), ((1, 1), (1, CHUNK)), pages=pages)
    with pytest.raises(ValueError, match="a paged layer's"):
        contiguous.ragged(xs, np.array([1, 0]), ((1, 1), (1, CHUNK)), pages=pages)
    after = jax.tree.map(np.asarray, nnx.state(paged_layer, nnx.Cache))
    jax.tree.map(np.testing.assert_array_equal, after, before)


def test_windowed_paged_layer_equals_the_ring_and_frees_pages():
    window, page_size = 5, 2
    paged_layer, ring = layers(page_size, window=window, num_pages=12)
    ring.reset()
    manager = manager_for(paged_layer)
    for _ in range(BATCH):
        manager.add()
    rng = np.random.default_rng(3)
    for t in range(14):
        x = tokens(rng, BATCH)
        poison_free_pages(paged_layer, manager)
        got = paged_layer.step(x, pages=manager.reserve(np.ones(BATCH, np.int32)))
        np.testing.assert_allclose(got, ring.step(x), rtol=1e-5, atol=1e-5)
        # The window's blocks plus the one being filled; the rest went back to the pool.
        assert np.count_nonzero(manager.tables[0]) <= -(-window // page_size) + 1
    manager.check()


def test_permuting_physical_pages_gives_bit_identical_outputs():
    paged_layer, _ = layers(8, num_pages=16)
    manager = manager_for(paged_layer)
    for _ in range(BATCH):
        manager.add()
    rng = np.random.default_rng(4)
    paged_layer.prefill(tokens(rng, BATCH, CHUNK), pages=manager.reserve(np.full(BATCH, CHUNK, np.int32)))
    x = tokens(rng, BATCH)
    batch = manager.reserve(np.ones(BATCH, np.int32))
    pool = {name: getattr(paged_layer, name)[...] for name in ("k_pages", "v_pages")}
    want = paged_layer.step(x, pages=batch)
    permutation = np.concatenate([[0], 1 + rng.permutation(15)]).astype(np.int32)  # the null page stays
    inverse = np.argsort(permutation)
    for name, array in pool.items():
        getattr(paged_layer, name)[...] = array[inverse]
    moved = batch._replace(table=permutation[batch.table])
    got = paged_layer.step(x, pages=moved)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_call_without_reserved_pages_raises_and_changes_nothing():
    paged_layer, _ = layers(8, num_pages=16)
    manager = manager_for(paged_layer)
    manager.add()
    batch = manager.reserve(np.array([8, 0, 0], np.int32))
    before = jax.tree.map(np.asarray, nnx.state(paged_layer, nnx.Cache))
    with pytest.raises(ValueError, match=r"sequence 1 writes positions 0\.\.0, but blocks \[0\]"):
        paged_layer.step(tokens(np.random.default_rng(0), BATCH), pages=batch)
    with pytest.raises(kvattn.CacheOverflowError):
        paged_layer.step(tokens(np.random.default_rng(0), BATCH),
                         pages=batch._replace(pos=np.full(BATCH, MAX_LEN, np.int32)))
    with pytest.raises(ValueError, match="needs pages="):
        paged_layer.step(tokens(np.random.default_rng(0), BATCH))
    with pytest.raises(ValueError, match="PageManager owns"):
        paged_layer.fork(0, [1])
    after = jax.tree.map(np.asarray, nnx.state(paged_layer, nnx.Cache))
    jax.tree.map(np.testing.assert_array_equal, after, before)


# ------------------------------------------------------------------ the machine


class PagedMachine(RuleBasedStateMachine):
    """A paged layer and its page manager, with the contiguous layer as the model.

    Free pages hold NaN before every call; after every rule the manager's
    accounting holds, and every output equals the contiguous layer's.
    """

    def __init__(self):
        super().__init__()
        self.paged = None

    @initialize(page_size=st.sampled_from([1, 4]))
    def build(self, page_size):
        # A pool too small for every slot to fill: reservations do fail.
        self.paged, self.contiguous = layers(page_size, num_pages=1 + 2 * MAX_LEN // page_size)
        self.contiguous.reset()
        self.manager = manager_for(self.paged)
        self.rng = np.random.default_rng(page_size)

    def live(self) -> list[int]:
        return np.flatnonzero(self.manager.live).tolist()

    def room(self, b: int) -> int:
        return MAX_LEN - int(self.manager.pos[b])

    @precondition(lambda self: not self.manager.live.all())
    @rule()
    def add(self):
        slot = self.manager.add()
        self.contiguous.reset([slot])

    @precondition(lambda self: self.manager.live.any())
    @rule(wanted=st.lists(st.integers(0, CHUNK), min_size=BATCH, max_size=BATCH), one=st.booleans())
    def extend(self, wanted, one):
        counts = np.array(
            [min(w, 1 if one else CHUNK, self.room(b)) if self.manager.live[b] else 0 for b, w in enumerate(wanted)],
            np.int32,
        )
        state = (self.manager.refcount.copy(), self.manager.tables.copy(), self.manager.pos.copy())
        try:
            batch = self.manager.reserve(counts)
        except OutOfPagesError:
            for got, want in zip((self.manager.refcount, self.manager.tables, self.manager.pos), state):
                np.testing.assert_array_equal(got, want)
            return
        written = [batch.table[b, p // self.paged.config.page_size]
                   for b in range(BATCH) for p in range(batch.pos[b], batch.pos[b] + counts[b])]
        assert all(self.manager.refcount[page] == 1 for page in written), "a write into a shared page"
        poison_free_pages(self.paged, self.manager)
        if one:
            x = tokens(self.rng, BATCH)
            got = self.paged.step(x, jnp.asarray(counts > 0), pages=batch)
            want = self.contiguous.step(x, jnp.asarray(counts > 0))
        else:
            xs = tokens(self.rng, BATCH, CHUNK)
            got = self.paged.prefill(xs, jnp.asarray(counts), pages=batch)
            want = self.contiguous.prefill(xs, jnp.asarray(counts))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    @precondition(lambda self: self.manager.live.any())
    @rule(data=st.data())
    def fork(self, data):
        source = data.draw(st.sampled_from(self.live()))
        target = data.draw(st.sampled_from([b for b in range(BATCH) if b != source]))
        self.manager.fork(source, target)
        self.contiguous.fork(source, [target])

    @precondition(lambda self: self.manager.live.any())
    @rule(data=st.data())
    def free(self, data):
        slot = data.draw(st.sampled_from(self.live()))
        self.manager.free(slot)
        self.contiguous.reset([slot])

    @precondition(lambda self: self.manager.live.any())
    @rule(data=st.data())
    def truncate(self, data):
        slot = data.draw(st.sampled_from(self.live()))
        keep = data.draw(st.integers(0, int(self.manager.pos[slot])))
        self.manager.truncate(slot, keep)
        keeps = self.manager.pos.copy()
        self.contiguous.truncate(jnp.asarray(keeps))

    @precondition(lambda self: self.manager.live.any())
    @rule(data=st.data())
    def reorder(self, data):
        live = self.live()
        order = [data.draw(st.sampled_from(live)) if self.manager.live[b] else b for b in range(BATCH)]
        self.manager.reorder(order)
        self.contiguous.reorder(jnp.asarray(order, jnp.int32))

    @invariant()
    def accounting(self):
        if self.paged is not None:
            self.manager.check()
            np.testing.assert_array_equal(np.asarray(self.contiguous.pos[...])[self.manager.live],
                                          self.manager.pos[self.manager.live])


PagedMachine.TestCase.settings = settings(
    max_examples=12, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck)
)
test_paged_machine = PagedMachine.TestCase
