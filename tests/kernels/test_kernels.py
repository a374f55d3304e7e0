"""The decode kernels (`kvattn.kernels`) against the XLA path and the float64 reference.

The Pallas kernels run in interpret mode, which compiles slowly, so every
Pallas test keeps one tiny shape and draws only data (lengths, page tables,
pool contents): one compile per test. The native CPU kernels
(`kvattn.kernels.native.decode_attention`, `prefill_attention`) run compiled, over
drawn shapes too, where they are built. The dispatch rule is checked by tracing, with the GPU
check replaced; nothing here lowers a kernel for a GPU.
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
from kvattn import UnsupportedConfigError, kernels
from kvattn.kernels import native
from kvattn.math import ops
from kvattn.caches import contiguous as cache_ops
from kvattn.config import NULL_PAGE
from kvattn.layer.forward import extend
from kvattn.paging import PageManager
from kvattn.caches import paged as paged_ops
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
        kernel = kernels.paged_step(q, ones, k, v, table, filled, layout, k_scale=k_scale, v_scale=v_scale,
                                    logit_softcap=softcap, interpret=True)
        cache = paged_ops.PagedKVCache(cache_ops.Stored(k, k_scale), cache_ops.Stored(v, v_scale), table, filled,
                                       layout=layout)
        (k_view, k_s), (v_view, v_s), positions = paged_ops.view(cache, BLOCKS, jnp.zeros_like(filled), filled)
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

    stored = [cache_ops.encode(jnp.asarray(x), jnp.dtype(dtype)) for x in tokens]  # int8: NaN scales
    dequantized = [np.asarray(cache_ops.decode_values(s)) for s in stored]
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


needs_native = pytest.mark.skipif(not native.available(), reason="kvattn's native kernels are not built or cannot run")
KERNELS = ["interpret", pytest.param("native", marks=needs_native)]


@functools.cache
def contiguous_programs(kernel: str):
    """Read first (old cache and the new token) and written first, kernel and XLA, compiled once."""
    how = {"interpret": kernel == "interpret", "native_kernel": kernel == "native"}

    @jax.jit
    def run(q, k_new, v_new, new_len, k_cache, v_cache, old_pos):
        cache = cache_ops.KVCache(cache_ops.Stored(k_cache), cache_ops.Stored(v_cache), old_pos, HEADS_MAJOR)
        written = cache_ops.append(cache, k_new, v_new, new_len)
        k_all, v_all = written.k.values, written.v.values
        return {
            "read_first": kernels.contiguous_step(
                q, new_len, k_cache, v_cache, old_pos, HEADS_MAJOR, new=(k_new, v_new), **how
            ),
            "read_first_xla": ops.attention(q, k_new, v_new, new_len, k_cache, v_cache, old_pos, HEADS_MAJOR),
            "written_first": kernels.contiguous_step(q, new_len, k_all, v_all, written.pos, HEADS_MAJOR, **how),
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


@needs_native
@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 3), group=st.integers(1, 4),
       head_dim=st.sampled_from([16, 32, 64]), slots=st.integers(1, 70), spread=st.sampled_from([0.1, 1.0, 8.0]),
       seed=st.integers(0, 2**16))
def test_the_native_kernel_gives_the_float64_softmax_sums(batch, kv_heads, group, head_dim, slots, spread, seed):
    """Its unnormalised sums, weight totals and top scores, over every visible count from none to all."""
    rng = np.random.default_rng(seed)
    q = (spread * rng.standard_normal((batch, kv_heads, group, head_dim))).astype(np.float32)
    keys, values = rng.standard_normal((2, batch, kv_heads, slots, head_dim)).astype(np.float32)
    visible = rng.integers(0, slots + 1, batch).astype(np.int32)
    visible[0] = slots if seed % 2 else 0
    arrays = (jnp.asarray(x) for x in (q, keys, values, visible))
    o, total, top = (np.asarray(x) for x in native.decode_attention(*arrays))
    for b in range(batch):
        seen = visible[b]
        if not seen:
            assert (o[b] == 0).all() and (total[b] == 0).all() and (top[b] == -np.inf).all()
            continue
        scores = np.einsum("kgh,ksh->kgs", q[b].astype(np.float64), keys[b, :, :seen].astype(np.float64))
        best = scores.max(-1)
        weights = np.exp(scores - best[..., None])
        np.testing.assert_allclose(top[b], best, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(total[b], weights.sum(-1), rtol=1e-5)
        np.testing.assert_allclose(o[b], np.einsum("kgs,ksh->kgh", weights, values[b, :, :seen]), rtol=1e-5, atol=1e-5)


@needs_native
@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 3), group=st.integers(1, 4), new=st.integers(1, 11),
       head_dim=st.sampled_from([16, 32, 64, 80, 128]), slots=st.integers(1, 40),
       spread=st.sampled_from([0.1, 1.0, 8.0]), seed=st.integers(0, 2**16))
def test_the_native_prefill_kernel_equals_the_float64_reference(batch, kv_heads, group, new, head_dim, slots, spread,
                                                                 seed):
    """A chunk over filled cache slots and causally over itself: every fill from none to all, ragged and padding rows.

    Head dims past 64 take two passes over the values; rows come in blocks of
    four (a group of 3 splits a token across blocks); keys in pairs of 16.
    """
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    q = (spread * rng.standard_normal((batch, new, heads, head_dim))).astype(np.float32)
    k_new, v_new = rng.standard_normal((2, batch, new, kv_heads, head_dim)).astype(np.float32)
    keys, values = rng.standard_normal((2, batch, kv_heads, slots, head_dim)).astype(np.float32)
    cache_len = rng.integers(0, slots + 1, batch).astype(np.int32)
    new_len = rng.integers(0, new + 1, batch).astype(np.int32)
    cache_len[0], new_len[0] = (slots, new) if seed % 2 else (0, new)
    got = np.asarray(jax.jit(kernels.contiguous_chunk)(*(jnp.asarray(x) for x in (q, k_new, v_new, new_len, keys,
                                                                                   values, cache_len))))
    for b in range(batch):
        np.testing.assert_array_equal(got[b, new_len[b]:], 0.0)  # padding queries
        if new_len[b]:
            k_seq = np.concatenate([keys[b, :, : cache_len[b]].transpose(1, 0, 2), k_new[b, : new_len[b]]])
            v_seq = np.concatenate([values[b, :, : cache_len[b]].transpose(1, 0, 2), v_new[b, : new_len[b]]])
            want = reference_attention(q[b, : new_len[b]], k_seq, v_seq, cache_len[b] + np.arange(new_len[b]))
            assert_close(got[b, : new_len[b]], want)


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


@needs_native
def test_a_cached_layer_differentiates_on_the_native_kernels_as_on_xla():
    """An FFI call has no derivatives of its own: the native kernels take those of the same sums in jax.numpy."""
    rng = np.random.default_rng(2)
    xs, x = tokens(rng, 3, 5), tokens(rng, 3)
    lengths, ones = jnp.asarray([5, 3, 0], jnp.int32), jnp.ones((3,), jnp.int32)
    grads = {}
    for kernel in ("auto", "xla"):
        built = layer(cache_layout="heads_major", max_len=MAX_LEN, decode_kernel=kernel)

        def loss(weights, xs, x, built=built):  # a ragged prefill, then a step
            ys, cache = extend(weights, built.cache, xs, lengths, config=built.config)
            y, _ = extend(weights, cache, x[:, None], ones, config=built.config)
            return jnp.sum(ys**2) + jnp.sum(jnp.sin(y))

        grads[kernel] = jax.grad(loss, argnums=(0, 1, 2))(built.weights, xs, x)
    for got, want in zip(jax.tree.leaves(grads["auto"]), jax.tree.leaves(grads["xla"]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ the rule


@pytest.fixture
def gpu(monkeypatch):
    """Pretends the backend is a GPU: only tracing may follow (nothing is lowered)."""
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)


def attention_jaxpr(config: kvattn.AttentionConfig, num_new: int = 1, write_first: bool = False) -> str:
    """The traced step (`forward.extend`, not compiled) of a fresh layer with `config`'s options."""
    fields = {name: getattr(config, name) for name in ("max_len", "window", "num_kv_heads", "batch_size",
                                                       "cache_dtype", "cache_layout", "logit_softcap", "num_pages",
                                                       "page_size", "decode_kernel", "head_dim", "data_axis")}
    built = kvattn.MultiHeadAttention(config.num_heads, config.in_features, rngs=nnx.Rngs(0), **fields)
    if config.paged:
        table = jnp.ones((config.batch_size, config.pages_per_sequence), jnp.int32)
        cache = built.paged_cache(table, jnp.zeros((config.batch_size,), jnp.int32))
    else:
        cache = built.cache
    xs = jnp.zeros((config.batch_size, num_new, config.in_features))
    lengths = jnp.ones((config.batch_size,), jnp.int32)
    # `extend` unwrapped and a fresh partial: tracing never reuses a jaxpr traced before the fixture.
    traced = functools.partial(extend.__wrapped__, config=built.config, write_first=write_first)
    return str(jax.make_jaxpr(traced)(built.weights, cache, xs, lengths))


def config(**options) -> kvattn.AttentionConfig:
    defaults = {"num_kv_heads": 2, "batch_size": 2, "head_dim": HEAD_DIM}
    if "window" not in options or "num_pages" in options:
        defaults["max_len"] = 32
    return kvattn.AttentionConfig(4, 8, **{**defaults, **options})


PAGED = {"num_pages": 9, "page_size": 4}
RUNS_THE_KERNEL = [
    {"cache_layout": "heads_major"},
    {"cache_layout": "heads_major", "window": 32},  # a ring written first (the drivers)
    dict(**PAGED),
    dict(**PAGED, cache_layout="heads_major", cache_dtype="int8", logit_softcap=5.0),
]
RUNS_XLA = {  # options -> why the rule keeps XLA
    "slots-major (the kernel would transpose the cache)": {},
    "bfloat16": {"cache_layout": "heads_major", "cache_dtype": "bfloat16"},
    "int8 contiguous": {"cache_layout": "heads_major", "cache_dtype": "int8"},
    "soft-cap contiguous": {"cache_layout": "heads_major", "logit_softcap": 5.0},
    "slots not a multiple of 16": {"cache_layout": "heads_major", "max_len": 40},
    "head_dim 24": {"cache_layout": "heads_major", "head_dim": 24},
    "head_dim 8": {"cache_layout": "heads_major", "head_dim": 8},
    "paged window": dict(**PAGED, window=8),
    "bfloat16 pool": dict(**PAGED, cache_dtype="bfloat16"),
    "page_size 3": {"num_pages": 12, "page_size": 3},
    "sharded": {"cache_layout": "heads_major", "data_axis": "data"},
    "forced xla": {"cache_layout": "heads_major", "decode_kernel": "xla"},
}


@pytest.mark.parametrize("options", RUNS_THE_KERNEL, ids=str)
def test_auto_runs_the_kernel_on_a_gpu_for_a_decode_step_it_serves(gpu, options):
    write_first = "window" in options and "num_pages" not in options
    assert "pallas_call" in attention_jaxpr(config(**options), write_first=write_first)
    assert "pallas_call" not in attention_jaxpr(config(**options), num_new=3)  # prefill


@pytest.mark.parametrize("options", RUNS_XLA.values(), ids=RUNS_XLA.keys())
def test_auto_runs_xla_on_a_gpu_where_the_kernel_would_not_serve(gpu, options):
    assert "pallas_call" not in attention_jaxpr(config(**options), write_first=True)


@pytest.mark.parametrize("options", RUNS_THE_KERNEL, ids=str)
def test_auto_runs_no_pallas_kernel_off_a_gpu(monkeypatch, options):
    monkeypatch.setattr(kernels, "on_gpu", lambda: False)
    assert "pallas_call" not in attention_jaxpr(config(**options), write_first=True)


@needs_native
def test_auto_runs_the_native_kernel_on_a_cpu_for_a_decode_step_it_serves():
    """A contiguous float32 heads-major cache, read first or (a ring) written first; never prefill, never XLA's else."""
    runs = (({"cache_layout": "heads_major"}, False), ({"cache_layout": "heads_major", "window": 32}, True))
    for options, write_first in runs:
        assert native.DECODE_ATTENTION in attention_jaxpr(config(**options), write_first=write_first)
        assert native.DECODE_ATTENTION not in attention_jaxpr(config(**options), num_new=3)
    for why, options in RUNS_XLA.items():
        if why != "slots not a multiple of 16":  # the native kernel reads any number of slots
            assert native.DECODE_ATTENTION not in attention_jaxpr(config(**options), write_first=True), why


@needs_native
def test_auto_runs_the_native_prefill_kernel_on_a_cpu_for_a_chunk_it_serves(monkeypatch):
    """A chunk read first over a contiguous float32 heads-major cache; never a step, never where XLA's path is kept."""
    assert native.PREFILL_ATTENTION in attention_jaxpr(config(cache_layout="heads_major"), num_new=3)
    assert native.PREFILL_ATTENTION not in attention_jaxpr(config(cache_layout="heads_major"))
    keeps_xla = {**RUNS_XLA, "window": {"cache_layout": "heads_major", "window": 32},
                 "forced pallas": {"cache_layout": "heads_major", "decode_kernel": "pallas"}}
    for why, options in keeps_xla.items():
        if why != "slots not a multiple of 16":
            assert native.PREFILL_ATTENTION not in attention_jaxpr(config(**options), num_new=3), why
    assert native.PREFILL_ATTENTION not in attention_jaxpr(config(cache_layout="heads_major"), num_new=3,
                                                           write_first=True)
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)
    assert native.PREFILL_ATTENTION not in attention_jaxpr(config(cache_layout="heads_major"), num_new=3)


@pytest.mark.parametrize(
    ("mode", "native_cannot", "on_gpu", "path"),
    [("auto", None, False, "native"), ("auto", "why", False, "xla"), ("auto", None, True, "xla"),
     ("xla", None, False, "xla"), ("pallas", None, False, "xla"), ("interpret", None, False, "xla")],
)
def test_chunk_route(monkeypatch, mode, native_cannot, on_gpu, path):
    monkeypatch.setattr(kernels, "on_gpu", lambda: on_gpu)
    assert kernels.chunk_route(mode, native_cannot) == path


def test_a_forced_kernel_refuses_what_it_cannot_serve(gpu):
    assert "pallas_call" in attention_jaxpr(config(decode_kernel="pallas"))  # forced, the transpose is paid
    with pytest.raises(UnsupportedConfigError, match="no logit soft-cap; use decode_kernel='auto'"):
        attention_jaxpr(config(decode_kernel="pallas", logit_softcap=5.0))
    with pytest.raises(UnsupportedConfigError, match="ring read before the write"):
        attention_jaxpr(config(decode_kernel="interpret", window=32))
    with pytest.raises(UnsupportedConfigError, match="no window"):
        attention_jaxpr(config(decode_kernel="pallas", window=8, **PAGED))


def test_a_forced_kernel_refuses_a_backend_off_a_gpu_and_a_sharded_layer(monkeypatch):
    monkeypatch.setattr(kernels, "on_gpu", lambda: False)
    with pytest.raises(UnsupportedConfigError, match="not a GPU"):
        attention_jaxpr(config(decode_kernel="pallas", cache_layout="heads_major"))
    with pytest.raises(ValueError, match="no sharding rule"):
        config(decode_kernel="interpret", model_axis="model")
    with pytest.raises(ValueError, match="decode_kernel must be one of"):
        config(decode_kernel="triton")


@pytest.mark.parametrize(
    ("mode", "cannot", "in_place", "on_gpu", "native_cannot", "path"),
    [
        ("auto", None, True, True, None, "pallas"),
        ("auto", None, False, True, None, "xla"),
        ("auto", "why", True, True, None, "xla"),
        ("auto", None, True, False, "why", "xla"),
        ("auto", "why", True, False, None, "native"),
        ("auto", None, False, False, None, "xla"),
        ("xla", None, True, False, None, "xla"),
        ("pallas", None, False, True, None, "pallas"),
        ("interpret", None, False, False, None, "interpret"),
    ],
)
def test_route(monkeypatch, mode, cannot, in_place, on_gpu, native_cannot, path):
    monkeypatch.setattr(kernels, "on_gpu", lambda: on_gpu)
    assert kernels.route(mode, cannot, in_place=in_place, native_cannot=native_cannot) == path


def test_the_benchmark_reports_the_kernel_path_unavailable_off_a_gpu(monkeypatch, tmp_path):
    from benchmarks.kernels import run_kernels

    monkeypatch.setattr(kernels, "on_gpu", lambda: False)
    result = run_kernels(out_dir=tmp_path, quick=True)
    assert not result["available"] and "decode" not in result
    assert "Kernel path unavailable" in (tmp_path / "kernels.md").read_text()
