"""One contract for every registered cache type, checked against a float64 NumPy reference.

The suite is parametrised over `kvattn.caches.registry.CACHE_TYPES`: a new
cache type is picked up by every test here, and fails until it has a
`Harness` below (how to build a layer with it and hand it each call's
arguments). The model of a batched layer is `tests.reference.ReferenceCache`:
per sequence, the list of tokens it holds. A random program of cache
operations (a hypothesis state machine) runs on the layer and on the model;
every output of step and prefill must equal the model's, recomputed in
float64 from the layer's weights. Rules act only where capacity allows,
except the overflow rules: an eager call that would overflow raises and
leaves the state bit-identical, and under `jit` an overflowing sequence
gets NaN outputs and writes nothing. Editing rules (reset, truncate, fork,
reorder, a snapshot round trip) run where the type supports them.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvattn
from kvattn.caches.registry import CACHE_TYPES, cache_type
from kvattn.layer.forward import extend
from kvattn.paging import PageManager
from kvattn.snapshots import load_cache, save_cache
from tests.helpers import assert_same_bits, cache_arrays
from tests.reference import ReferenceCache, assert_close, causal_attention, weights_of

BATCH, IN_FEATURES, NUM_HEADS, NUM_KV_HEADS, MAX_LEN = 3, 8, 4, 2, 12
# One prefill width, so the layer compiles prefill once; lengths make it ragged.
CHUNK = 3


# ------------------------------------------------------------------ harnesses


class ContiguousHarness:
    """`kvattn.Contiguous`: the layer serves every call and edit itself; a ring when `window` is set."""

    edits = ("reset", "truncate", "fork", "reorder", "snapshot")

    def __init__(self, layout: str = "slots_major", window: int | None = None):
        self.layout, self.window = layout, window
        if window is not None:
            self.edits = ("reset", "fork", "reorder", "snapshot")  # a ring cannot roll back

    def spec(self) -> kvattn.Contiguous:
        return kvattn.Contiguous(max_len=MAX_LEN if self.window is None else None, batch_size=BATCH,
                                 layout=self.layout, length_buckets=(4, 8))

    def start(self, layer):
        layer.reset()

    def call(self, layer, xs, counts, step: bool):
        if step:
            return layer.step(xs[:, 0], jnp.asarray(counts > 0))[:, None]
        return layer.prefill(xs, jnp.asarray(counts, jnp.int32))

    def lengths(self, layer) -> list[int]:
        return np.asarray(layer.pos[...]).tolist()

    def capacity(self) -> float:
        return np.inf if self.window is not None else MAX_LEN

    def unchecked(self, layer):
        """The layer's cache as the pure step takes it, bound without the eager checks."""
        return cache_type(layer.config.cache).bind(layer.config, layer_arrays(layer))

    def reset(self, layer, which):
        layer.reset(np.asarray(which, np.int32))

    def truncate(self, layer, keeps):
        layer.truncate(np.asarray(keeps, np.int32))

    def fork(self, layer, source, targets):
        layer.fork(source, np.asarray(targets, np.int32))

    def reorder(self, layer, order):
        layer.reorder(np.asarray(order, np.int32))


class PagedHarness:
    """`kvattn.Paged`: a host `PageManager` owns the sequences and hands each call its `PageBatch`."""

    edits = ("reset", "truncate", "fork", "reorder")

    def __init__(self, page_size: int, layout: str = "slots_major"):
        self.page_size, self.layout = page_size, layout

    def spec(self) -> kvattn.Paged:
        # Pages for every sequence to fill, plus the null page: a reservation never fails here.
        return kvattn.Paged(num_pages=1 + BATCH * -(-MAX_LEN // self.page_size), page_size=self.page_size,
                            max_len=MAX_LEN, batch_size=BATCH, layout=self.layout)

    def start(self, layer):
        config = layer.config
        self.manager = PageManager(config.num_pages, config.page_size, BATCH, config.pages_per_sequence)
        for _ in range(BATCH):
            self.manager.add()

    def poison_free_pages(self, layer):
        """NaN in every page no table points at: no output may change."""
        free = jnp.asarray(np.flatnonzero(self.manager.refcount == 0))
        for name in cache_type(layer.config.cache).variables(layer.config):
            variable = getattr(layer, name)
            variable[...] = variable[...].at[free].set(jnp.nan)

    def call(self, layer, xs, counts, step: bool):
        pages = self.manager.reserve(np.asarray(counts, np.int32))
        self.poison_free_pages(layer)
        if step:
            return layer.step(xs[:, 0], jnp.asarray(counts > 0), pages=pages)[:, None]
        return layer.prefill(xs, jnp.asarray(counts, jnp.int32), pages=pages)

    def lengths(self, layer) -> list[int]:
        return self.manager.pos.tolist()

    def capacity(self) -> float:
        return MAX_LEN

    def unchecked(self, layer):
        return layer.paged_cache(jnp.asarray(self.manager.tables), jnp.asarray(self.manager.pos, jnp.int32))

    def reset(self, layer, which):
        for slot in sorted(set(which)):
            self.manager.free(slot)
        assert sorted(self.manager.add() for _ in set(which)) == sorted(set(which))

    def truncate(self, layer, keeps):
        for slot, keep in enumerate(keeps):
            self.manager.truncate(slot, keep)

    def fork(self, layer, source, targets):
        for target in targets:
            if target != source:
                self.manager.fork(source, target)

    def reorder(self, layer, order):
        self.manager.reorder(list(order))


# Each registered spec type -> its harnesses (the variants the contract runs).
HARNESSES = {
    kvattn.Contiguous: {
        "contiguous": ContiguousHarness(),
        "contiguous heads-major": ContiguousHarness("heads_major"),
        "ring": ContiguousHarness(window=2),  # narrower than a prefill chunk: most tokens are evicted mid-chunk
    },
    kvattn.Paged: {
        "paged page 2": PagedHarness(2),
        "paged page 4 heads-major": PagedHarness(4, "heads_major"),
    },
}
VARIANTS = [(name, harness) for spec_type in CACHE_TYPES for name, harness in HARNESSES.get(spec_type, {}).items()]


@pytest.mark.parametrize("spec_type", list(CACHE_TYPES), ids=lambda t: t.__name__)
def test_every_registered_cache_type_runs_the_contract(spec_type):
    assert HARNESSES.get(spec_type), f"{spec_type.__name__} is registered but has no harness in this suite"
    assert CACHE_TYPES[spec_type].spec is spec_type


@pytest.mark.parametrize("variant", [name for name, _ in VARIANTS])
def test_a_nan_token_in_a_chunk_reaches_only_the_tokens_that_see_it(variant):
    """A NaN hidden state at token 1 of a prefill: token 0 and the other sequences get what float64 gives them.

    A pool writes the chunk before reading it, so a later token's slot is
    weighed 0 by an earlier query, and 0 * NaN is NaN unless it is kept out.
    """
    layer, harness = layer_pair(0, variant)[0], dict(VARIANTS)[variant]
    harness.start(layer)
    model = ReferenceCache(weights_of(layer), BATCH, layer.config.window)
    xs = np.random.default_rng(4).standard_normal((BATCH, CHUNK, IN_FEATURES)).astype(np.float32)
    xs[0, 1] = np.nan
    ys = np.asarray(harness.call(layer, jnp.asarray(xs), np.full(BATCH, CHUNK, np.int32), step=False))
    for b in range(BATCH):
        for t in range(CHUNK):
            assert_close(ys[b, t], model.append(b, xs[b, t]))  # NaN where float64 has it, and only there
    assert np.isfinite(ys[0, 0]).all() and np.isnan(ys[0, 1:]).all()
    harness.start(layer)


def layer_arrays(layer) -> dict:
    return {name: getattr(layer, name)[...] for name in cache_type(layer.config.cache).variables(layer.config)}


@functools.cache
def layer_pair(seed: int, variant: str):
    """Two layers with the same weights, built once and restarted by each run: building costs more than most runs."""
    return make_layer(seed, variant), make_layer(seed, variant)


def make_layer(seed: int, variant: str) -> kvattn.MultiHeadAttention:
    harness = dict(VARIANTS)[variant]
    return kvattn.MultiHeadAttention(NUM_HEADS, IN_FEATURES, cache=harness.spec(), window=getattr(harness, "window", None),
                                     num_kv_heads=NUM_KV_HEADS, rngs=nnx.Rngs(seed))


def test_reference_agrees_with_the_uncached_forward():
    layer = make_layer(0, "contiguous")
    tokens = np.random.default_rng(0).standard_normal((BATCH, 5, IN_FEATURES)).astype(np.float32)
    expected = np.stack([causal_attention(weights_of(layer), tokens[b]) for b in range(BATCH)])
    assert_close(layer(jnp.asarray(tokens)), expected)


@pytest.mark.parametrize("variant", [name for name, _ in VARIANTS])
def test_variables_bind_unbind_round_trip(variant):
    """Any arrays of the declared shapes and dtypes come back bit-identical through `bind` and `unbind`."""
    layer, harness = make_layer(0, variant), dict(VARIANTS)[variant]
    harness.start(layer)
    kind = cache_type(layer.config.cache)
    rng = np.random.default_rng(0)
    for name, (shape, _, dtype) in kind.variables(layer.config).items():
        values = rng.integers(-100, 100, shape) if jnp.issubdtype(dtype, jnp.integer) else rng.standard_normal(shape)
        getattr(layer, name)[...] = jnp.asarray(values, dtype)
    if isinstance(harness, ContiguousHarness):  # `pos` counts tokens: keep it valid
        layer.pos[...] = jnp.asarray([0, 1, 2], jnp.int32)
    before = layer_arrays(layer)
    cache = harness.unchecked(layer)
    assert isinstance(cache, kind)
    assert_same_bits({k: np.asarray(v) for k, v in cache.unbind(layer.config).items()},
                     {k: np.asarray(v) for k, v in before.items()})


# ------------------------------------------------------------------ the machine


MASKS = st.lists(st.booleans(), min_size=BATCH, max_size=BATCH)


@functools.cache
def overflow_step(config):
    return jax.jit(functools.partial(extend, config=config))


class CacheContract(RuleBasedStateMachine):
    """Drives a batched layer of one cache type and its float64 model side by side."""

    variant = "contiguous"

    def __init__(self):
        super().__init__()
        self.directory = tempfile.TemporaryDirectory()
        self.layer = None
        self.harness = dict(VARIANTS)[self.variant]

    @initialize(seed=st.integers(0, 2))
    def build(self, seed):
        # The twin has the same weights and its own cache: snapshots are
        # loaded into it, then the two swap.
        self.layer, self.twin = layer_pair(seed, self.variant)
        self.harness.start(self.layer)
        self.twin.reset() if isinstance(self.harness, ContiguousHarness) else None
        self.model = ReferenceCache(weights_of(self.layer), BATCH, self.layer.config.window)
        self.rng = np.random.default_rng(seed)

    def teardown(self):
        self.directory.cleanup()

    def tokens(self, *shape) -> np.ndarray:
        return self.rng.standard_normal((*shape, IN_FEATURES)).astype(np.float32)

    def room(self, sequence: int) -> float:
        return self.harness.capacity() - self.model.lengths[sequence]

    def supports(edit: str):
        return precondition(lambda self: edit in self.harness.edits)

    # ----------------------------------------------------------- decoding

    @rule(wanted=MASKS)
    def step(self, wanted):
        counts = np.array([want and self.room(b) > 0 for b, want in enumerate(wanted)], np.int32)
        self.check_call(counts, 1)

    @rule(wanted=st.lists(st.integers(0, CHUNK), min_size=BATCH, max_size=BATCH))
    def prefill(self, wanted):
        self.check_call(np.array([min(want, self.room(b)) for b, want in enumerate(wanted)], np.int32), CHUNK)

    @precondition(lambda self: self.harness.capacity() < np.inf)
    @rule(sequence=st.integers(0, BATCH - 1))
    def fill_to_capacity(self, sequence):
        while self.room(sequence):
            counts = np.zeros(BATCH, np.int32)
            counts[sequence] = min(CHUNK, self.room(sequence))
            self.check_call(counts, CHUNK)

    def check_call(self, counts, width: int):
        xs = self.tokens(BATCH, width)
        ys = np.asarray(self.harness.call(self.layer, jnp.asarray(xs), counts, step=width == 1))
        for b, count in enumerate(counts):
            for t in range(count):
                assert_close(ys[b, t], self.model.append(b, xs[b, t]))
            assert not ys[b, count:].any(), "padding and inactive outputs must be zeros"

    # ------------------------------------------------------- cache editing

    @supports("reset")
    @rule(which=st.lists(st.integers(0, BATCH - 1), max_size=BATCH))
    def reset(self, which):
        self.harness.reset(self.layer, which)
        self.model.reset(sorted(set(which)))

    @supports("truncate")
    @rule(wanted=st.lists(st.integers(0, MAX_LEN), min_size=BATCH, max_size=BATCH))
    def truncate(self, wanted):
        keeps = [min(want, length) for want, length in zip(wanted, self.model.lengths)]
        self.harness.truncate(self.layer, keeps)
        self.model.truncate(keeps)

    # (`targets` is a keyword of `rule` itself, hence `copies`.)
    @supports("fork")
    @rule(source=st.integers(0, BATCH - 1), copies=st.lists(st.integers(0, BATCH - 1), max_size=BATCH))
    def fork(self, source, copies):
        self.harness.fork(self.layer, source, sorted(set(copies)))
        self.model.fork(source, sorted(set(copies)))

    @supports("reorder")
    @rule(order=st.lists(st.integers(0, BATCH - 1), min_size=BATCH, max_size=BATCH))
    def reorder(self, order):
        self.harness.reorder(self.layer, order)
        self.model.reorder(order)

    @supports("snapshot")
    @rule()
    def save_and_load_into_the_twin(self):
        path = Path(self.directory.name) / "cache.safetensors"
        save_cache(self.layer, path)
        load_cache(self.twin, path)
        assert_same_bits(cache_arrays(self.twin), cache_arrays(self.layer))
        self.layer, self.twin = self.twin, self.layer

    # ------------------------------------------------------------- overflow

    @precondition(lambda self: any(self.room(b) == 0 for b in range(BATCH)))
    @rule(others=MASKS)
    def overflowing_step_raises_and_changes_nothing(self, others):
        full = next(b for b in range(BATCH) if self.room(b) == 0)
        counts = np.array([want or b == full for b, want in enumerate(others)], np.int32)
        before = cache_arrays(self.layer)
        with pytest.raises((kvattn.CacheOverflowError, kvattn.OutOfPagesError)):
            self.harness.call(self.layer, jnp.asarray(self.tokens(BATCH, 1)), counts, step=True)
        assert_same_bits(cache_arrays(self.layer), before)

    @precondition(lambda self: any(self.room(b) == 0 for b in range(BATCH)))
    @rule()
    def overflow_under_jit_gives_nan_and_writes_nothing(self):
        """The in-graph half: a full sequence asked for one more token; the others ask for none."""
        full = np.array([self.room(b) == 0 for b in range(BATCH)])
        cache = self.harness.unchecked(self.layer)
        before = jax.tree.map(np.asarray, cache.unbind(self.layer.config))
        xs = jnp.asarray(self.tokens(BATCH, 1))
        ys, after = overflow_step(self.layer.config)(self.layer.weights, cache, xs, jnp.asarray(full, jnp.int32))
        assert np.isnan(np.asarray(ys)[full]).all(), "an overflowing sequence's outputs must be NaN"
        assert_same_bits(jax.tree.map(np.asarray, after.unbind(self.layer.config)), before)
        np.testing.assert_array_equal(np.asarray(after.pos), np.asarray(cache.pos))

    # ----------------------------------------------------------- invariants

    @invariant()
    def pos_counts_the_history(self):
        if self.layer is not None:
            assert self.harness.lengths(self.layer) == self.model.lengths


def contract_case(variant: str):
    """The machine's test case for one variant; a paged call costs more (a reservation, poisoned pages)."""
    case = type(f"Contract[{variant}]", (CacheContract,), {"variant": variant}).TestCase
    examples = 8 if isinstance(dict(VARIANTS)[variant], PagedHarness) else 20
    case.settings = settings(max_examples=examples, stateful_step_count=16, deadline=None,
                             suppress_health_check=list(HealthCheck))
    return case


globals().update({"TestContract_" + name.replace(" ", "_").replace("-", "_"): contract_case(name)
                  for name, _ in VARIANTS})
