"""The pure functions alone: attention math and cache transitions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvattn.caches import storage

from kvattn.caches import contiguous as cache_ops
from kvattn.caches.base import default_length_buckets
from kvattn.math import ops
from tests.helpers import CACHED, FRESH, POISONS, SLOTS, WIDTH, XLA_LEAKS, poison_chunk
from tests.reference import assert_close
from tests.reference import attention as reference_attention


def to_layout(cache, layout):
    """`(B, S, K, H)` in the given layout."""
    return cache if layout == ops.SLOTS_MAJOR else jnp.swapaxes(cache, 1, 2)


@settings(max_examples=10)
@given(
    shape=st.sampled_from([(1, 1, 1, 2), (2, 4, 2, 3), (3, 2, 1, 4)]),  # B, N, K, H
    num_new=st.sampled_from([1, 4, 11]),
    layout=st.sampled_from([ops.SLOTS_MAJOR, ops.HEADS_MAJOR]),
    data=st.data(),
)
def test_attention_equals_reference_for_every_cache_fill(shape, num_new, layout, data):
    """Cache part and chunk part together equal attention over the concatenated keys.

    `num_new = 11` exceeds the block-diagonal threshold, covering both paths.
    """
    batch, num_heads, num_kv_heads, head_dim = shape
    num_slots = 6
    cache_len = np.array(data.draw(st.lists(st.integers(0, num_slots), min_size=batch, max_size=batch)))
    new_len = np.array(data.draw(st.lists(st.integers(0, num_new), min_size=batch, max_size=batch)))
    keys = jax.random.split(jax.random.key(data.draw(st.integers(0, 999))), 5)
    q = jax.random.normal(keys[0], (batch, num_new, num_heads, head_dim))
    k_new = jax.random.normal(keys[1], (batch, num_new, num_kv_heads, head_dim))
    v_new = jax.random.normal(keys[2], (batch, num_new, num_kv_heads, head_dim))
    k_cache = jax.random.normal(keys[3], (batch, num_slots, num_kv_heads, head_dim))
    v_cache = jax.random.normal(keys[4], (batch, num_slots, num_kv_heads, head_dim))

    out = jax.jit(ops.attention, static_argnames="layout")(
        q, k_new, v_new, jnp.asarray(new_len), to_layout(k_cache, layout), to_layout(v_cache, layout),
        jnp.asarray(cache_len), layout=layout,
    )
    for b in range(batch):
        filled = cache_len[b]
        k_all = np.concatenate([k_cache[b, :filled], k_new[b]])
        v_all = np.concatenate([v_cache[b, :filled], v_new[b]])
        positions = filled + np.arange(num_new)
        expected = reference_attention(q[b], k_all, v_all, positions)
        real = new_len[b]
        np.testing.assert_allclose(out[b, :real], expected[:real], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out[b, real:], 0.0)


def test_attention_without_cache_is_causal():
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 5, 2, 3)) for i in range(3))
    out = ops.attention(q, k, v, jnp.array([5]))
    np.testing.assert_allclose(out[0], reference_attention(q[0], k[0], v[0], np.arange(5)), rtol=1e-5, atol=1e-6)
    # Changing a later token never changes an earlier output.
    k_later = k.at[0, 3:].set(100.0)
    np.testing.assert_array_equal(ops.attention(q, k_later, v, jnp.array([5]))[0, :3], out[0, :3])


def test_unfilled_slots_get_zero_weight_whatever_they_hold():
    """Any finite garbage past `cache_len` is ignored (the layer keeps unfilled slots zero)."""
    q = jnp.ones((1, 1, 1, 1))
    k_new = v_new = jnp.ones((1, 1, 1, 1))
    k_cache = jnp.full((1, 4, 1, 1), 1e30)
    v_cache = jnp.full((1, 4, 1, 1), -1e30)
    for layout in (ops.SLOTS_MAJOR, ops.HEADS_MAJOR):
        k_part, v_part = to_layout(k_cache, layout), to_layout(v_cache, layout)
        out = ops.attention(q, k_new, v_new, jnp.array([1]), k_part, v_part, jnp.array([0]), layout)
        np.testing.assert_array_equal(out, 1.0)


# ---------------------------------------------- NaN and inf: as float64, and only where they are seen

XLA_LEAK = "XLA mixes unseen cached values by a weight of 0, and 0 * NaN is NaN (#33)"


def written(cache, new):
    """A heads-major cache `(B, K, S, H)` with each sequence's real new tokens `(B, T, K, H)` stored after its own."""
    cache = cache.copy()
    for b in range(len(cache)):
        cache[b, :, CACHED[b] : CACHED[b] + FRESH[b]] = new[b, : FRESH[b]].transpose(1, 0, 2)
    return cache


CHUNK_PATHS = {
    "ops.attention heads-major": lambda q, kn, vn, kc, vc, cached, fresh: ops.attention(
        q, kn, vn, fresh, kc, vc, cached, ops.HEADS_MAJOR),
    "ops.attention slots-major": lambda q, kn, vn, kc, vc, cached, fresh: ops.attention(
        q, kn, vn, fresh, jnp.swapaxes(kc, 1, 2), jnp.swapaxes(vc, 1, 2), cached, ops.SLOTS_MAJOR),
    "ops.cached_attention": lambda q, kn, vn, kc, vc, cached, fresh: ops.cached_attention(
        q, fresh, kc, vc, cached, ops.HEADS_MAJOR, v_new=vn),
}


@pytest.mark.parametrize("path", CHUNK_PATHS)
@pytest.mark.parametrize("poison", POISONS)
def test_a_nan_or_inf_spreads_as_in_float64_and_only_to_the_queries_that_see_it(path, poison, request):
    """Each real query against float64 over exactly the keys it sees; padding queries give zeros.

    A masked key or value (later in the chunk, unfilled, padding) adds nothing, not 0 * NaN.
    """
    if poison in XLA_LEAKS.get(path, ()):
        request.applymarker(pytest.mark.xfail(reason=XLA_LEAK, strict=True))
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 6, 2, WIDTH)).astype(np.float32)
    k_new, v_new = rng.standard_normal((2, 2, 6, 1, WIDTH)).astype(np.float32)
    k_cache, v_cache = rng.standard_normal((2, 2, 1, SLOTS, WIDTH)).astype(np.float32)
    poison_chunk(poison, q, k_new, v_new, k_cache, v_cache)
    if path == "ops.cached_attention":
        k_cache, v_cache = written(k_cache, k_new), written(v_cache, v_new)
    call = jax.jit(CHUNK_PATHS[path])
    got = np.asarray(call(*(jnp.asarray(x) for x in (q, k_new, v_new, k_cache, v_cache, CACHED, FRESH))))
    for b in range(2):
        np.testing.assert_array_equal(got[b, FRESH[b] :], 0.0)
        keys = np.concatenate([k_cache[b, :, : CACHED[b]].transpose(1, 0, 2), k_new[b]])
        values = np.concatenate([v_cache[b, :, : CACHED[b]].transpose(1, 0, 2), v_new[b]])
        for t in range(FRESH[b]):
            seen = CACHED[b] + t + 1
            want = reference_attention(q[b, t : t + 1], keys[:seen], values[:seen], [seen - 1])
            assert_close(got[b, t : t + 1], want)  # NaN and inf where float64 has them, and only there


@pytest.mark.parametrize("num_new", [pytest.param(1, marks=pytest.mark.xfail(reason=XLA_LEAK, strict=True)), 11],
                         ids=["block-diagonal", "plain"])
def test_a_nan_key_of_one_kv_head_leaves_the_other_heads_alone(num_new):
    """Slots-major: the block-diagonal reading of short chunks multiplies every head's keys by the others' zeros."""
    rng = np.random.default_rng(8)
    q, k_new, v_new = rng.standard_normal((3, 1, num_new, 2, WIDTH)).astype(np.float32)
    k_cache, v_cache = rng.standard_normal((2, 1, 6, 2, WIDTH)).astype(np.float32)
    k_cache[0, 1, 1, 0] = np.nan  # a visible slot of kv head 1
    got = ops.attention(*(jnp.asarray(x) for x in (q, k_new, v_new)), jnp.array([num_new]), jnp.asarray(k_cache),
                        jnp.asarray(v_cache), jnp.array([3]), ops.SLOTS_MAJOR)
    keys, values = (np.concatenate([cache[0, :3], new[0]]) for cache, new in ((k_cache, k_new), (v_cache, v_new)))
    assert_close(got[0], reference_attention(q[0], keys, values, 3 + np.arange(num_new)))
    assert np.isfinite(np.asarray(got)[0, :, 0]).all() and np.isnan(np.asarray(got)[0, :, 1]).all()


STEP_POISONS = {
    "a NaN key": (3, 0, np.nan), "an inf key": (3, slice(None), np.inf), "a NaN query": None,
    "a NaN in the last visible slot": (9, 0, np.nan), "NaN and inf past the visible slots": (10, slice(None), np.nan),
}


@pytest.mark.parametrize("poison", STEP_POISONS)
def test_a_decode_step_over_a_nan_or_inf_gives_what_float64_gives(poison, request):
    """One query over 10 of 16 slots on XLA against float64 (the native kernels: `tests/kernels/test_native.py`)."""
    if poison == "NaN and inf past the visible slots":
        request.applymarker(pytest.mark.xfail(reason=XLA_LEAK, strict=True))
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 1, 2, WIDTH)).astype(np.float32)
    k_cache, v_cache = rng.standard_normal((2, 1, 1, 16, WIDTH)).astype(np.float32)
    if poison == "a NaN query":
        q[0, 0, 1, 2] = np.nan
    else:
        slot, dims, value = STEP_POISONS[poison]
        k_cache[0, 0, slot:slot + 1, dims] = value
        if slot == 10:
            v_cache[0, 0, slot:] = np.inf
    one, visible = jnp.ones(1, jnp.int32), jnp.full(1, 10, jnp.int32)
    q, k_cache, v_cache = (jnp.asarray(x) for x in (q, k_cache, v_cache))
    got = jax.jit(ops.cached_attention, static_argnames="layout")(q, one, k_cache, v_cache, visible - 1,
                                                                  layout=ops.HEADS_MAJOR)
    keys, values = (np.asarray(x[0]).transpose(1, 0, 2)[:10] for x in (k_cache, v_cache))
    assert_close(got[0], reference_attention(np.asarray(q[0]), keys, values, [9]))


@settings(max_examples=10)
@given(
    shape=st.sampled_from([(1, 1, 1, 2), (2, 4, 2, 3), (3, 2, 1, 4)]),  # B, N, K, H
    num_new=st.sampled_from([1, 3, 11]),
    layout=st.sampled_from([ops.SLOTS_MAJOR, ops.HEADS_MAJOR]),
    data=st.data(),
)
def test_cached_attention_over_written_chunk_equals_reference(shape, num_new, layout, data):
    """Write first, then read: a chunk already in the cache attends exactly as `attention` would."""
    batch, num_heads, num_kv_heads, head_dim = shape
    num_slots = 14
    cache_len = np.array(data.draw(st.lists(st.integers(0, num_slots - num_new), min_size=batch, max_size=batch)))
    new_len = np.array(data.draw(st.lists(st.integers(0, num_new), min_size=batch, max_size=batch)))
    keys = jax.random.split(jax.random.key(data.draw(st.integers(0, 999))), 3)
    q = jax.random.normal(keys[0], (batch, num_new, num_heads, head_dim))
    # Slots past each sequence's written tokens hold garbage that must not matter.
    k_cache = jax.random.normal(keys[1], (batch, num_slots, num_kv_heads, head_dim))
    v_cache = jax.random.normal(keys[2], (batch, num_slots, num_kv_heads, head_dim))

    out = jax.jit(ops.cached_attention, static_argnames="layout")(
        q, jnp.asarray(new_len), to_layout(k_cache, layout), to_layout(v_cache, layout),
        jnp.asarray(cache_len), layout=layout,
    )
    for b in range(batch):
        filled, real = cache_len[b], new_len[b]
        if real:
            positions = filled + np.arange(real)
            expected = reference_attention(q[b, :real], k_cache[b, : filled + real], v_cache[b, : filled + real], positions)
            np.testing.assert_allclose(out[b, :real], expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out[b, real:], 0.0)


@pytest.mark.parametrize("layout", [ops.SLOTS_MAJOR, ops.HEADS_MAJOR])
def test_bucketed_attention_equals_full_at_every_fill_and_boundary(layout):
    """Both attention orders read only a bucket prefix, from nothing filled to the whole buffer."""
    buckets = (2, 4, 8)
    q = jax.random.normal(jax.random.key(0), (2, 1, 2, 3))
    k_new, v_new = (jax.random.normal(jax.random.key(i), (2, 1, 1, 3)) for i in (1, 2))
    k_cache, v_cache = (jax.random.normal(jax.random.key(i), (2, 8, 1, 3)) for i in (3, 4))
    k_cache, v_cache = to_layout(k_cache, layout), to_layout(v_cache, layout)
    one = jnp.ones(2, jnp.int32)

    @jax.jit
    def both(cache_len, needed_before, needed_after):
        def read_first(caches):
            k, v = caches
            return ops.attention(q, k_new, v_new, one, k, v, cache_len, layout)

        def write_first(caches):
            k, v = caches
            return ops.cached_attention(q, one, k, v, cache_len, layout)

        caches = (k_cache, v_cache)
        return (
            ops.bucketed(read_first, caches, needed_before, buckets, layout),
            ops.bucketed(write_first, caches, needed_after, buckets, layout),
        )

    for filled in range(8):  # crosses 2, 4 and 8 from both sides, from nothing filled
        cache_len = jnp.array([filled, max(filled - 3, 0)])
        read_full = ops.attention(q, k_new, v_new, one, k_cache, v_cache, cache_len, layout)
        write_full = ops.cached_attention(q, one, k_cache, v_cache, cache_len, layout)
        read_got, write_got = both(cache_len, jnp.max(cache_len), jnp.max(cache_len) + 1)
        np.testing.assert_allclose(read_got, read_full, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(write_got, write_full, rtol=1e-6, atol=1e-6)


def test_bucketed_reads_nothing_when_nothing_is_filled():
    calls = []

    def attend(caches):
        k, _ = caches
        calls.append(k.shape)
        return jnp.zeros((1,)) + k.shape[1]

    k = v = jnp.ones((1, 8, 1, 1))
    got = [float(ops.bucketed(attend, (k, v), jnp.int32(n), (4, 8), ops.SLOTS_MAJOR)[0]) for n in (0, 3, 5)]
    assert got == [0.0, 4.0, 8.0]


def test_bucket_index_picks_the_smallest_bucket_that_fits():
    buckets = (2, 4, 8)
    picks = [int(ops.bucket_index(buckets, jnp.int32(n))) for n in range(9)]
    assert picks == [0, 0, 0, 1, 1, 2, 2, 2, 2]


def test_length_buckets():
    assert default_length_buckets(2048) == (128, 256, 2048)
    assert default_length_buckets(8192) == (128, 256, 512, 1024, 8192)
    assert default_length_buckets(100) == (100,)
    assert default_length_buckets(32, smallest=2) == (2, 4, 32)
    # Caches past the last-level cache: a prefix copy pays up to a quarter.
    assert default_length_buckets(2048, cache_bytes=64 * 2**20) == (128, 256, 512, 2048)



# ------------------------------------------------------------------- cache.py


def values_of(cache, layout=ops.SLOTS_MAJOR):
    """`(B, S)` view of a cache with K = H = 1."""
    k = cache.k.values if layout == ops.SLOTS_MAJOR else jnp.swapaxes(cache.k.values, 1, 2)
    return np.asarray(k)[..., 0, 0]


def empty_cache(batch, slots, layout=ops.SLOTS_MAJOR, dtype=jnp.float32, window=None):
    k = storage.Stored(to_layout(jnp.zeros((batch, slots, 1, 1), dtype), layout))
    return cache_ops.KVCache(k, k, jnp.zeros(batch, jnp.int32), layout=layout, window=window)


@pytest.mark.parametrize("layout", [ops.SLOTS_MAJOR, ops.HEADS_MAJOR])
def test_append_puts_each_token_at_its_slot_and_drops_the_rest(layout):
    cache = empty_cache(2, 4, layout).replace(pos=jnp.array([1, 2]))
    new = jnp.arange(1.0, 7.0).reshape(2, 3, 1, 1)
    out = cache_ops.append(cache, new, new, jnp.array([2, 3]))
    # Sequence 1 has room for 2 of its 3 tokens: the third is dropped, not wrapped or clamped.
    np.testing.assert_array_equal(values_of(out, layout), [[0, 1, 2, 0], [0, 0, 4, 5]])
    np.testing.assert_array_equal(out.pos, [3, 5])


def test_ring_append_wraps_and_keeps_only_the_last_tokens():
    cache = empty_cache(2, 3, window=3).replace(pos=jnp.array([2, 0]))
    new = jnp.arange(1.0, 11.0).reshape(2, 5, 1, 1)
    out = cache_ops.append(cache, new, new, jnp.array([2, 5]))
    # Sequence 0: positions 2, 3 -> slots 2, 0. Sequence 1: five tokens in
    # three slots, only positions 2, 3, 4 (values 8, 9, 10) survive.
    np.testing.assert_array_equal(values_of(out), [[2, 0, 1], [9, 10, 8]])
    np.testing.assert_array_equal(out.pos, [4, 5])


def test_append_after_a_result_is_exact_even_when_it_is_nan():
    cache = empty_cache(1, 3).replace(pos=jnp.array([1]))
    new = jnp.ones((1, 1, 1, 1))
    out = cache_ops.append(cache, new, new, jnp.array([1]), after=jnp.array([[jnp.nan, -jnp.inf]]))
    np.testing.assert_array_equal(values_of(out), [[0, 1, 0]])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8])
def test_encode_round_trips_within_the_storage_precision(dtype):
    x = jax.random.normal(jax.random.key(0), (2, 3, 4, 16))
    stored = storage.encode(x, dtype)
    assert stored.values.dtype == dtype
    assert (stored.scale is None) == (dtype != jnp.int8)
    back = storage.decode_values(stored)
    bound = 2.0**-8 if dtype == jnp.bfloat16 else 0.5 / 127  # half a step, relative to max|x|
    peak = np.abs(np.asarray(x)).max(axis=-1, keepdims=True)
    assert (np.abs(np.asarray(back - x)) <= bound * peak + 1e-7).all()
    zeros = storage.encode(jnp.zeros((1, 1, 1, 4)), dtype)
    np.testing.assert_array_equal(storage.decode_values(zeros), 0.0)


def test_clear_truncate_fork_reorder():
    k = jnp.arange(1.0, 13.0).reshape(3, 4, 1, 1)
    cache = cache_ops.KVCache(storage.Stored(k), storage.Stored(k), jnp.array([4, 4, 4]))
    cleared = cache_ops.clear(cache, jnp.array([False, True, False]))
    np.testing.assert_array_equal(values_of(cleared), [[1, 2, 3, 4], [0, 0, 0, 0], [9, 10, 11, 12]])
    np.testing.assert_array_equal(cleared.pos, [4, 0, 4])
    kept = cache_ops.truncate(cache, jnp.array([0, 2, 4]))
    np.testing.assert_array_equal(values_of(kept), [[0, 0, 0, 0], [5, 6, 0, 0], [9, 10, 11, 12]])
    np.testing.assert_array_equal(kept.pos, [0, 2, 4])
    heads_major = cache_ops.relayout(cache, ops.HEADS_MAJOR)
    assert heads_major.layout == ops.HEADS_MAJOR and heads_major.k.values.shape == (3, 1, 4, 1)
    kept_hm = cache_ops.truncate(heads_major, jnp.array([0, 2, 4]))
    np.testing.assert_array_equal(values_of(kept_hm, ops.HEADS_MAJOR), values_of(kept))
    forked = cache_ops.fork(cache.replace(pos=jnp.array([1, 2, 3])), jnp.int32(2), jnp.array([True, False, False]))
    np.testing.assert_array_equal(values_of(forked), [[9, 10, 11, 12], [5, 6, 7, 8], [9, 10, 11, 12]])
    np.testing.assert_array_equal(forked.pos, [3, 2, 3])
    reordered = cache_ops.reorder(cache, jnp.array([1, 1, 0]))
    np.testing.assert_array_equal(values_of(reordered), [[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    assert storage.capacity_ok(jnp.array([2, 3]), jnp.array([2, 2]), 4).tolist() == [True, False]
    # A ring's capacity is the int32 limit of pos; the check itself never overflows, and a poisoned pos has no room.
    limit = jnp.iinfo(jnp.int32).max
    assert storage.capacity_ok(jnp.array([2, limit - 1, -1]), jnp.array([2, 2, 0]), limit).tolist() == [True, False, False]


def test_out_of_range_fork_and_reorder_poison_their_targets():
    """Under jit nothing can raise: a bad index empties its targets with pos = -1, never a clamped copy."""
    k = jnp.arange(1.0, 13.0).reshape(3, 4, 1, 1)
    cache = cache_ops.KVCache(storage.Stored(k), storage.Stored(k), jnp.array([4, 3, 2]))
    forked = jax.jit(cache_ops.fork)(cache, jnp.int32(7), jnp.array([False, True, False]))
    np.testing.assert_array_equal(values_of(forked), [[1, 2, 3, 4], [0, 0, 0, 0], [9, 10, 11, 12]])
    np.testing.assert_array_equal(forked.pos, [4, cache_ops.INVALID_POS, 2])
    reordered = jax.jit(cache_ops.reorder)(cache, jnp.array([2, 5, -1]))
    np.testing.assert_array_equal(values_of(reordered), [[9, 10, 11, 12], [0, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(reordered.pos, [2, cache_ops.INVALID_POS, cache_ops.INVALID_POS])
