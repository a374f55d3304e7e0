"""The paged cache against the contiguous one: the layer, its invariants, and serving a queue of requests.

The host half (`kvattn.paging`) has its own tests in
tests/paging/; here the device follows its tables. The oracle is the
contiguous layer (itself checked against the float64 reference elsewhere)
and, for the pure step, the float64 reference directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvattn
from hypothesis import given

from kvattn import models, ops
from kvattn.models import serving
from kvattn.paging import OutOfPagesError, PageManager
from kvattn.step import extend
from tests.reference import ReferenceCache, assert_close, weights_of
from tests.reference import attention as reference_attention

BATCH, IN_FEATURES, NUM_HEADS, NUM_KV_HEADS, MAX_LEN = 3, 8, 4, 2, 16
CHUNK = 3  # one prefill width: each layer compiles prefill once


@functools.cache
def layers(page_size: int, cache_dtype: str = "float32", window: int | None = None, num_pages: int = 12,
           cache_layout: str = "slots_major"):
    """A paged layer and a contiguous one with the same weights, built once per configuration."""

    def build(**paging):
        capacity = dict(max_len=MAX_LEN) if window is None or paging else dict(window=window)
        return kvattn.MultiHeadAttention(
            NUM_HEADS, IN_FEATURES, num_kv_heads=NUM_KV_HEADS, batch_size=BATCH, cache_dtype=cache_dtype,
            rngs=nnx.Rngs(0), **capacity, **paging,
        )

    paged_layer = build(num_pages=num_pages, page_size=page_size, window=window, cache_layout=cache_layout)
    return paged_layer, build()


def manager_for(layer) -> PageManager:
    config = layer.config
    return PageManager(config.num_pages, config.page_size, BATCH, config.pages_per_sequence, window=config.window)


def poison_free_pages(layer, manager):
    """NaN in every page no table points at: no output may change."""
    free = jnp.asarray(np.flatnonzero(manager.refcount == 0))
    # int8 pages cannot hold NaN; their scales can.
    names = ("k_page_scale", "v_page_scale") if layer.cache_dtype == "int8" else ("k_pages", "v_pages")
    for name in names:
        variable = getattr(layer, name)
        variable[...] = variable[...].at[free].set(jnp.nan)


def tokens(rng, *shape):
    return jnp.asarray(rng.standard_normal((*shape, IN_FEATURES)).astype(np.float32))


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
        return MAX_LEN - int(self.manager.lengths[b])

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
        state = (self.manager.refcount.copy(), self.manager.tables.copy(), self.manager.lengths.copy())
        try:
            batch = self.manager.reserve(counts)
        except OutOfPagesError:
            for got, want in zip((self.manager.refcount, self.manager.tables, self.manager.lengths), state):
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
        keep = data.draw(st.integers(0, int(self.manager.lengths[slot])))
        self.manager.truncate(slot, keep)
        keeps = self.manager.lengths.copy()
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
                                          self.manager.lengths[self.manager.live])


PagedMachine.TestCase.settings = settings(
    max_examples=12, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck)
)
test_paged_machine = PagedMachine.TestCase


# ------------------------------------------------------------------ serving


def expected_fixture(family: str) -> dict:
    from tests.test_models import expected

    return expected(family)


@functools.cache
def fixture_run(family: str):
    """Greedy generation on a tiny checkpoint: contiguous `generate`, and a Server on a tight paged pool."""
    from tests.test_models import FIXTURES

    want = expected_fixture(family)
    prompts, lengths = want["prompts"], want["lengths"]
    reference = models.from_pretrained(FIXTURES / family, max_len=48, batch_size=len(lengths))
    generated = np.asarray(models.generate(reference, prompts, 12, lengths=lengths).tokens)
    model = models.from_pretrained(FIXTURES / family, max_len=48, batch_size=3, num_pages=10, page_size=4)
    server = models.Server(model, chunk=8)
    requests = [prompts[row, :length] for row, length in enumerate(lengths)] * 2  # the repeats hit the cache
    for prompt in requests:
        server.submit(prompt, 12)
    completions = server.run()
    server.manager.check()
    return generated, completions, server


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_server_equals_generate_token_for_token(family):
    generated, completions, server = fixture_run(family)
    for completion in completions:
        np.testing.assert_array_equal(completion.tokens, generated[completion.request % len(generated)])
    if server.config.window is None:  # a window frees pages: nothing to share, and no shortage here
        assert sum(c.cached_tokens for c in completions) > 0, "the repeated prompts must hit the prefix cache"
        assert sum(c.preemptions for c in completions) > 0, "the pool is tight enough to preempt"


def test_a_prefix_hit_is_bit_identical_to_a_cold_run():
    _, completions, _ = fixture_run("llama")
    half = len(completions) // 2
    assert any(hit.cached_tokens > 0 for hit in completions[half:])
    for cold, hit in zip(completions[:half], completions[half:], strict=True):
        assert hit.tokens == cold.tokens
        assert hit.logprobs == cold.logprobs  # exact: the same programs on the same pages


def test_a_stop_token_or_a_single_new_token_ends_a_request_at_its_prefill():
    generated, _, server = fixture_run("llama")
    prompt = np.asarray(expected_fixture("llama")["prompts"][0, :5])
    server.submit(prompt, 1)
    server.submit(prompt, 8, stop_tokens=(int(generated[0, 0]),))
    for completion in server.run():
        assert completion.tokens == [int(generated[0, 0])]
    server.manager.check()


def test_a_failed_device_call_loses_no_request(monkeypatch):
    """The decode program consumes the pools, then fails: every request is recomputed and ends as if nothing failed."""
    generated, _, server = fixture_run("llama")
    want = expected_fixture("llama")
    decode, calls = serving._decode_program, []

    def failing(*args, **kwargs):
        calls.append(1)
        result = decode(*args, **kwargs)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return result

    monkeypatch.setattr(serving, "_decode_program", failing)
    for row, length in enumerate(want["lengths"]):
        server.submit(want["prompts"][row, :length], 12)
    with pytest.raises(RuntimeError, match="device lost"):
        server.run()
    assert server.manager.num_live == 0 and len(server._queue) == len(want["lengths"])
    completions = server.run()
    assert all(c.preemptions >= 1 for c in completions)
    for completion in completions:
        np.testing.assert_array_equal(completion.tokens, generated[completion.request - completions[0].request])
    server.manager.check()


def test_serving_compiles_once_over_many_admissions():
    _, _, server = fixture_run("llama")
    before = (serving._prefill_program._cache_size(), serving._decode_program._cache_size())
    rng = np.random.default_rng(0)
    for _ in range(8):
        server.submit(rng.integers(0, 64, rng.integers(1, 20)), int(rng.integers(1, 6)))
    assert len(server.run()) == 8
    server.manager.check()
    assert (serving._prefill_program._cache_size(), serving._decode_program._cache_size()) == before


def test_server_refuses_what_can_never_fit():
    _, _, server = fixture_run("llama")
    with pytest.raises(ValueError, match="can never fit"):
        server.submit([1] * 40, 20)
    with pytest.raises(ValueError, match="token ids"):
        server.submit([], 3)


# ------------------------------------------------------------------ sequence snapshots


def test_a_saved_sequence_continues_in_another_pool(tmp_path):
    """Saved from a slots-major pool of 8-token pages, loaded into a heads-major one of 1-token pages: same next steps."""
    source, _ = layers(8, num_pages=16)
    target, _ = layers(1, num_pages=33, cache_layout="heads_major")
    rng = np.random.default_rng(5)
    managers = [manager_for(source), manager_for(target)]
    slot = managers[0].add()
    counts = np.zeros(BATCH, np.int32)
    counts[slot] = CHUNK
    source.prefill(tokens(rng, BATCH, CHUNK), jnp.asarray(counts), pages=managers[0].reserve(counts))
    path = tmp_path / "sequence.safetensors"
    kvattn.save_sequence(source, managers[0], slot, path, tokens=[7, 8, 9])
    managers[1].add()  # the restored sequence lands in another slot
    restored, recorded = kvattn.load_sequence(target, managers[1], path)
    assert restored == 1 and recorded == [7, 8, 9] and managers[1].lengths[restored] == CHUNK
    managers[1].check()
    x = jnp.broadcast_to(tokens(rng, 1), (BATCH, IN_FEATURES))  # the same token in every row
    for layer, manager, row in ((source, managers[0], slot), (target, managers[1], restored)):
        counts = np.zeros(BATCH, np.int32)
        counts[row] = 1
        got = layer.step(x, jnp.asarray(counts > 0), pages=manager.reserve(counts))
        if layer is source:
            want = got[row]
        else:
            np.testing.assert_allclose(got[row], want, rtol=1e-5, atol=1e-6)


def test_a_bad_sequence_snapshot_changes_nothing(tmp_path):
    source, _ = layers(8, num_pages=16)
    manager = manager_for(source)
    slot = manager.add()
    counts = np.zeros(BATCH, np.int32)
    counts[slot] = 2
    source.prefill(tokens(np.random.default_rng(6), BATCH, CHUNK), jnp.asarray(counts), pages=manager.reserve(counts))
    path = tmp_path / "sequence.safetensors"
    kvattn.save_sequence(source, manager, slot, path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # a flipped bit in the last tensor
    path.write_bytes(bytes(data))
    def state():
        return (manager.refcount.copy(), manager.tables.copy(), manager.live.copy(), manager.num_free,
                np.asarray(source.k_pages[...]))

    before = state()
    with pytest.raises(kvattn.SnapshotError, match="sha256|checksum"):
        kvattn.load_sequence(source, manager, path)
    kvattn.save_sequence(source, manager, slot, path)
    other = PageManager(16, 4, BATCH, 4)
    with pytest.raises(ValueError, match="is not layer"):
        kvattn.load_sequence(source, other, path)  # a manager of another pool
    for _ in range(BATCH - 1):
        manager.add()
    with pytest.raises(OutOfPagesError, match="free slot"):
        kvattn.load_sequence(source, manager, path)
    for b in range(1, BATCH):
        manager.free(b)
    with pytest.raises(ValueError, match="save_sequence"):
        kvattn.save_cache(source, tmp_path / "pool.safetensors")
    for got, want in zip(state(), before, strict=True):
        np.testing.assert_array_equal(got, want)


def saved_sequence(tmp_path, token_ids=(7, 8)):
    """A paged layer, a manager holding a 2-token sequence, and the path of its snapshot."""
    layer, _ = layers(8, num_pages=16)
    manager = manager_for(layer)
    slot = manager.add()
    counts = np.zeros(BATCH, np.int32)
    counts[slot] = 2
    layer.prefill(tokens(np.random.default_rng(6), BATCH, CHUNK), jnp.asarray(counts), pages=manager.reserve(counts))
    path = tmp_path / "sequence.safetensors"
    kvattn.save_sequence(layer, manager, slot, path, tokens=token_ids)
    return layer, manager, path


def replace_once(path, old: bytes, new: bytes):
    data = path.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new), old
    path.write_bytes(data.replace(old, new))


@pytest.mark.parametrize(
    "old, new",
    [
        (b'"tokens":"[7,8]"', b'"tokens":"[6,8]"'),  # one bit: another prompt's ids for these keys and values
        (b'"length":"2"', b'"length":"3"'),
        (b'\\"num_kv_heads\\":2', b'\\"num_kv_heads\\":3'),
        (b'\\"k\\":{\\"dtype\\":\\"float32\\"', b'\\"k\\":{\\"dtype\\":\\"float16\\"'),
    ],
    ids=["tokens", "length", "config", "tensors"],
)
def test_a_changed_byte_in_a_sequence_snapshots_metadata_fails_its_checksum(tmp_path, old, new):
    import re

    layer, manager, path = saved_sequence(tmp_path)
    replace_once(path, old, new)
    live = manager.live.copy()
    match = rf"{re.escape(str(path))}: corrupted snapshot: its metadata fails its checksum"
    with pytest.raises(kvattn.SnapshotError, match=match):
        kvattn.load_sequence(layer, manager, path)
    np.testing.assert_array_equal(manager.live, live)


def test_a_version_1_sequence_snapshot_is_refused_with_what_to_do(tmp_path):
    """Version 1 checksummed only the tensors: its token ids could not be trusted, so it must be saved again."""
    import safetensors.numpy

    layer, manager, path = saved_sequence(tmp_path)
    with safetensors.safe_open(path, "np") as file:
        tensors, metadata = {name: file.get_tensor(name) for name in file.keys()}, dict(file.metadata())
    del metadata["metadata_sha256"]
    safetensors.numpy.save_file(tensors, path, metadata={**metadata, "format_version": "1"})
    with pytest.raises(kvattn.SnapshotError, match="format_version '1'.*save the sequence again with save_sequence"):
        kvattn.load_sequence(layer, manager, path)


@pytest.mark.parametrize("kind", ["sparse", "dev_zero"])
def test_a_huge_or_endless_file_is_refused_as_a_sequence_snapshot_from_its_header(tmp_path, kind):
    import time

    layer, _ = layers(8, num_pages=16)
    path = "/dev/zero" if kind == "dev_zero" else tmp_path / "huge.safetensors"
    if kind == "sparse":
        with open(path, "wb") as file:
            file.truncate(5 << 30)  # 5 GiB of zeros, sparse: no disk used
    start = time.perf_counter()
    with pytest.raises(kvattn.SnapshotError, match="header is not valid JSON|not a regular file"):
        kvattn.load_sequence(layer, manager_for(layer), path)
    assert time.perf_counter() - start < 2


def test_a_windowed_server_counts_the_pages_a_whole_chunk_needs():
    """With a window, prefill writes a chunk at once beside the window: that many pages, not one token's worth."""
    from tests.test_models import FIXTURES

    model = models.from_pretrained(FIXTURES / "mistral", max_len=48, batch_size=2, num_pages=10, page_size=4)
    server = models.Server(model, chunk=32)  # window 8: a 32-token chunk spans up to 11 pages, the pool has 9
    with pytest.raises(ValueError, match="can never fit"):
        server.submit(list(range(1, 41)), 1)
    server.submit(list(range(1, 9)), 1)  # an 8-token chunk fits
