"""jax's Pallas decode kernels (`kvattn.kernels.pallas`), in interpret mode, against XLA and float64.

Interpret mode compiles slowly, so every test keeps one tiny shape and draws
only data (lengths, page tables, pool contents): one compile per test. The
contiguous step's glue (the new token joined, normalised) runs on the
native decode kernel too (`kvattn.kernels.cpu`), where it is built; the
kernel itself is held to float64 in `test_native.py`. Nothing here lowers a
kernel for a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import kvattn
from kvattn.caches import storage
from kvattn.caches import contiguous as cache_ops
from kvattn.caches import paged as paged_ops
from kvattn.caches import views
from kvattn.caches.base import NULL_PAGE
from kvattn.kernels import cpu, native, pallas
from kvattn.math import ops
from kvattn.paging import PageManager
from tests.reference import ReferenceCache, assert_close, weights_of
from tests.reference import attention as reference_attention

SLOTS_MAJOR, HEADS_MAJOR = ops.SLOTS_MAJOR, ops.HEADS_MAJOR
HEAD_DIM = 16  # the smallest the kernels take (Triton's tiles)


# ------------------------------------------------------------------ paged pools

PAGE, BLOCKS, BATCH = 4, 4, 4  # four sequences of up to 16 tokens, in 4-slot pages
NUM_PAGES = 1 + BATCH * BLOCKS + 3  # the null page, every block, and three free pages


@functools.cache
def paged_pair(layout: str, softcap: float | None):
    """The kernel (interpreted) and the XLA path's reading (views, one softmax) of the same pool, compiled once."""

    @jax.jit
    def both(q, k, v, k_scale, v_scale, table, filled):
        ones = jnp.ones_like(filled)
        kernel = pallas.paged_step(q, ones, k, v, table, filled, layout, k_scale=k_scale, v_scale=v_scale,
                                    logit_softcap=softcap, interpret=True)
        cache = paged_ops.PagedKVCache(storage.Stored(k, k_scale), storage.Stored(v, v_scale), table, filled,
                                       layout=layout)
        (k_view, k_s), (v_view, v_s), positions = views.view(cache, BLOCKS, jnp.zeros_like(filled), filled)
        xla = ops.cached_attention(q, ones, k_view, v_view, filled - 1, layout, k_scale=k_s, v_scale=v_s,
                                   logit_softcap=softcap, slot_positions=positions)
        return kernel, xla

    return both


@pytest.mark.parametrize(
    ("heads", "layout", "dtype", "softcap"),
    [((2, 2), SLOTS_MAJOR, "float32", None), ((4, 1), HEADS_MAJOR, "int8", 2.0)],
    ids=["mha-slots-major-float32", "gqa4-heads-major-int8-softcap"],
)
@settings(max_examples=3)
@given(data=st.data())
def test_paged_kernel_equals_xla_and_reference(heads, layout, dtype, softcap, data):
    """Ragged lengths (1 and full among them), shuffled pages, NaN in every page no table holds (the null page too)."""
    num_heads, num_kv_heads = heads
    full = PAGE * BLOCKS
    filled = np.array([1, full, *data.draw(st.lists(st.integers(1, full), min_size=2, max_size=2))], np.int32)
    pages = 1 + np.array(data.draw(st.permutations(range(NUM_PAGES - 1))), np.int32)
    table = pages[: BATCH * BLOCKS].reshape(BATCH, BLOCKS)
    table[np.arange(BLOCKS)[None, :] >= -(-filled[:, None] // PAGE)] = NULL_PAGE  # blocks not reserved
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    tokens = rng.standard_normal((2, NUM_PAGES, PAGE, num_kv_heads, HEAD_DIM)).astype(np.float32)
    held = np.zeros((NUM_PAGES, PAGE), bool)  # the slots that hold a token
    for b in range(BATCH):
        for position in range(filled[b]):
            held[table[b, position // PAGE], position % PAGE] = True
    in_tables = np.isin(np.arange(NUM_PAGES), table[table != NULL_PAGE])
    # Past a sequence's end its last page may hold anything finite; pages no table holds may hold NaN.
    tokens[:, ~in_tables] = np.nan
    q = jnp.asarray(rng.standard_normal((BATCH, 1, num_heads, HEAD_DIM)).astype(np.float32))

    stored = [storage.encode(jnp.asarray(x), jnp.dtype(dtype)) for x in tokens]  # int8: NaN scales
    dequantized = [np.asarray(storage.decode_values(s)) for s in stored]
    if layout == HEADS_MAJOR:
        stored = [jax.tree.map(lambda a: jnp.swapaxes(a, 1, 2), s) for s in stored]
    (k, k_scale), (v, v_scale) = stored
    kernel, xla = paged_pair(layout, softcap)(q, k, v, k_scale, v_scale, jnp.asarray(table), jnp.asarray(filled))

    np.testing.assert_allclose(kernel, xla, rtol=1e-5, atol=1e-5)
    for b in range(BATCH):
        positions = np.arange(filled[b])
        keys, values = (x[table[b, positions // PAGE], positions % PAGE] for x in dequantized)
        expected = reference_attention(q[b], keys, values, positions[-1:], softcap=softcap)
        assert_close(kernel[b], expected)


# ------------------------------------------------------------ contiguous caches

SLOTS = 32


needs_native = pytest.mark.skipif(not native.available(native.DECODE_ATTENTION),
                                  reason="kvattn's native decode kernel is not built or cannot run")
KERNELS = ["interpret", pytest.param("native", marks=needs_native)]


@functools.cache
def contiguous_programs(kernel: str):
    """Read first (old cache and the new token) and written first, kernel and XLA, compiled once."""
    if kernel == "native":
        def step(q, new_len, k_cache, v_cache, visible, layout, **new):
            return cpu.contiguous_step(q, new_len, k_cache, v_cache, visible, **new)
    else:
        step = functools.partial(pallas.contiguous_step, interpret=True)

    @jax.jit
    def run(q, k_new, v_new, new_len, k_cache, v_cache, old_pos):
        cache = cache_ops.KVCache(storage.Stored(k_cache), storage.Stored(v_cache), old_pos, HEADS_MAJOR)
        written = cache_ops.append(cache, k_new, v_new, new_len)
        k_all, v_all = written.k.values, written.v.values
        return {
            "read_first": step(q, new_len, k_cache, v_cache, old_pos, HEADS_MAJOR, new=(k_new, v_new)),
            "read_first_xla": ops.attention(q, k_new, v_new, new_len, k_cache, v_cache, old_pos, HEADS_MAJOR),
            "written_first": step(q, new_len, k_all, v_all, written.pos, HEADS_MAJOR),
            "written_first_xla": ops.cached_attention(q, new_len, k_all, v_all, old_pos, HEADS_MAJOR),
        }

    return run


@pytest.mark.parametrize("kernel", KERNELS)
@settings(max_examples=3)
@given(data=st.data())
def test_contiguous_kernel_equals_xla_and_reference(kernel, data):
    """GQA 2, heads-major: an empty cache, a full one and ragged lengths, read first and written first; padding rows."""
    num_heads, num_kv_heads = 4, 2
    old_pos = np.array([0, SLOTS - 1, *data.draw(st.lists(st.integers(0, SLOTS - 1), min_size=2, max_size=2))],
                       np.int32)
    new_len = np.array([1, 1, 1, data.draw(st.integers(0, 1))], np.int32)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    keys, values = rng.standard_normal((2, BATCH, num_kv_heads, SLOTS, HEAD_DIM)).astype(np.float32)
    unfilled = np.broadcast_to(np.arange(SLOTS)[None, None, :] >= old_pos[:, None, None], keys.shape[:-1])
    keys[unfilled], values[unfilled] = 0.0, 0.0  # the contiguous cache keeps unfilled slots at zero
    q, k_new, v_new = (jnp.asarray(rng.standard_normal((BATCH, 1, n, HEAD_DIM)).astype(np.float32))
                       for n in (num_heads, num_kv_heads, num_kv_heads))
    out = contiguous_programs(kernel)(q, k_new, v_new, jnp.asarray(new_len), jnp.asarray(keys), jnp.asarray(values),
                                jnp.asarray(old_pos))

    for order in ("read_first", "written_first"):
        np.testing.assert_allclose(out[order], out[f"{order}_xla"], rtol=1e-5, atol=1e-5, err_msg=order)
        for b in range(BATCH):
            if not new_len[b]:
                np.testing.assert_array_equal(out[order][b], 0.0)
                continue
            k_seq = np.concatenate([keys[b, :, : old_pos[b]].transpose(1, 0, 2), k_new[b]])
            v_seq = np.concatenate([values[b, :, : old_pos[b]].transpose(1, 0, 2), v_new[b]])
            assert_close(out[order][b], reference_attention(q[b], k_seq, v_seq, old_pos[b : b + 1]))


# --------------------------------------------------------- through the layer

IN_FEATURES, NUM_HEADS, NUM_KV_HEADS, MAX_LEN = 64, 4, 2, 16  # head_dim 16


def layer(**options):
    return kvattn.MultiHeadAttention(NUM_HEADS, IN_FEATURES, num_kv_heads=NUM_KV_HEADS, batch_size=3,
                                     rngs=nnx.Rngs(0), **options)


def tokens(rng, *shape):
    return jnp.asarray(rng.standard_normal((*shape, IN_FEATURES)).astype(np.float32))


def test_paged_layer_on_the_kernel_equals_the_reference():
    """Decode steps on the interpreted kernel after a ragged prefill: free pages hold NaN before every call.

    The pages reserved for a step held NaN until then, past the token it
    writes too: the step zeroes them (`zero_page_tails`) before the kernel
    reads the page whole.
    """
    paged = layer(max_len=MAX_LEN, num_pages=12, page_size=4, decode_kernel="interpret")
    manager = PageManager(12, 4, 3, MAX_LEN // 4)
    for _ in range(3):
        manager.add()
    model = ReferenceCache(weights_of(paged), 3)
    rng = np.random.default_rng(0)

    def poison_free_pages():
        free = jnp.asarray(np.flatnonzero(manager.refcount == 0))
        for name in ("k_pages", "v_pages"):
            getattr(paged, name)[...] = getattr(paged, name)[...].at[free].set(jnp.nan)

    prompt = np.array([4, 1, 3], np.int32)
    xs = tokens(rng, 3, 4)
    poison_free_pages()
    paged.prefill(xs, jnp.asarray(prompt), pages=manager.reserve(prompt))
    for b in range(3):
        for t in range(prompt[b]):
            model.append(b, xs[b, t])
    for active in ([1, 1, 1], [1, 0, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]):
        active = np.array(active, np.int32)
        x = tokens(rng, 3)
        poison_free_pages()
        got = paged.step(x, jnp.asarray(active > 0), pages=manager.reserve(active))
        for b in range(3):
            if active[b]:
                assert_close(got[b], model.append(b, x[b]))
            else:
                np.testing.assert_array_equal(got[b], 0.0)


def test_contiguous_layer_and_ring_decoder_on_the_kernel_equal_the_reference():
    """The layer's step reads first (the new token joins the kernel's sums); a ring `Decoder` writes first."""
    rng = np.random.default_rng(1)
    for options, driver, steps in (({"max_len": MAX_LEN}, False, 9), ({"window": 16}, True, 19)):
        stepped = layer(cache_layout="heads_major", decode_kernel="interpret", **options)
        model = ReferenceCache(weights_of(stepped), 3, window=options.get("window"))
        step = kvattn.Decoder(stepped).step if driver else stepped.step
        for _ in range(steps):  # the ring wraps
            x = tokens(rng, 3)
            got = step(x)
            for b in range(3):
                assert_close(got[b], model.append(b, x[b]))
