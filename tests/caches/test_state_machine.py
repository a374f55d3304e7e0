"""Random programs of cache operations, every output checked against a float64 NumPy reference.

The model of a batched layer is `tests.reference.ReferenceCache`: per
sequence, the list of tokens it holds (its history). Every rule applies one
cache operation to the layer and to the model; every output of step and
prefill must equal the model's, the last row of causal attention over the
sequence's history (its last `window` tokens for a ring), recomputed in
float64 from the layer's weights. Rules act only where capacity
allows, except the overflow rules, which check that an overflowing call
raises and leaves the state bit-identical.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvattn
from kvattn.snapshots import load_cache, save_cache
from tests.helpers import assert_same_bits, cache_arrays
from tests.reference import ReferenceCache, assert_close, causal_attention, weights_of

BATCH, IN_FEATURES, NUM_HEADS, NUM_KV_HEADS, MAX_LEN = 3, 8, 4, 2, 12
# One prefill width, so the layer compiles prefill once; lengths make it ragged.
CHUNK = 3


@functools.cache
def layer_pair(seed: int, cache_layout: str, window: int | None):
    """Two layers with the same weights, built once and reset by each run: building costs more than most runs."""
    return make_layer(seed, cache_layout, window), make_layer(seed, cache_layout, window)


def make_layer(seed: int, cache_layout: str, window: int | None = None) -> kvattn.MultiHeadAttention:
    return kvattn.MultiHeadAttention(
        NUM_HEADS,
        IN_FEATURES,
        max_len=MAX_LEN if window is None else None,
        window=window,
        num_kv_heads=NUM_KV_HEADS,
        batch_size=BATCH,
        cache_layout=cache_layout,
        length_buckets=(4, 8),
        rngs=nnx.Rngs(seed),
    )


def test_reference_agrees_with_the_uncached_forward():
    layer = make_layer(0, "slots_major")
    tokens = np.random.default_rng(0).standard_normal((BATCH, 5, IN_FEATURES)).astype(np.float32)
    expected = np.stack([causal_attention(weights_of(layer), tokens[b]) for b in range(BATCH)])
    assert_close(layer(jnp.asarray(tokens)), expected)


# ------------------------------------------------------------------ the machine


SEQUENCES = st.lists(st.integers(0, BATCH - 1), max_size=BATCH)
MASKS = st.lists(st.booleans(), min_size=BATCH, max_size=BATCH)


def which_argument(which):
    """Indices or a bool mask as the layer takes them (None stays None)."""
    if which is None:
        return None
    if which and isinstance(which[0], bool):
        return np.asarray(which, np.bool_)
    return np.asarray(which, np.int32)


def chosen(which) -> list[int]:
    if which is None:
        return list(range(BATCH))
    if which and isinstance(which[0], bool):
        return [b for b in range(BATCH) if which[b]]
    return sorted(set(which))


class CacheMachine(RuleBasedStateMachine):
    """Drives a batched layer and its float64 model side by side."""

    cache_layout = "slots_major"
    window = None

    def __init__(self):
        super().__init__()
        self.directory = tempfile.TemporaryDirectory()
        self.layer = None
        self.model = None

    @initialize(seed=st.integers(0, 2))
    def build(self, seed):
        # The twin has the same weights and its own cache: snapshots are
        # loaded into it, then the two swap.
        self.layer, self.twin = layer_pair(seed, self.cache_layout, self.window)
        self.layer.reset()
        self.twin.reset()
        self.model = ReferenceCache(weights_of(self.layer), BATCH, self.window)
        self.rng = np.random.default_rng(seed)

    def teardown(self):
        self.directory.cleanup()

    # ------------------------------------------------------------- helpers

    def tokens(self, *shape) -> np.ndarray:
        return self.rng.standard_normal((*shape, IN_FEATURES)).astype(np.float32)

    def room(self, sequence: int) -> float:
        """How many more tokens the sequence takes (a ring never fills)."""
        return np.inf if self.window is not None else MAX_LEN - self.model.lengths[sequence]

    # ----------------------------------------------------------- decoding

    @rule(wanted=MASKS)
    def step(self, wanted):
        active = [want and self.room(b) > 0 for b, want in enumerate(wanted)]
        x = self.tokens(BATCH)
        mask = None if all(active) else jnp.asarray(active)
        ys = np.asarray(self.layer.step(jnp.asarray(x), mask))
        for b in range(BATCH):
            if active[b]:
                assert_close(ys[b], self.model.append(b, x[b]))
            else:
                assert not ys[b].any(), "an inactive sequence must return zeros"

    @rule(wanted=st.lists(st.integers(0, CHUNK), min_size=BATCH, max_size=BATCH))
    def prefill(self, wanted):
        lengths = [min(want, self.room(b)) for b, want in enumerate(wanted)]
        self.prefill_lengths(lengths)

    @precondition(lambda self: self.window is None)
    @rule(sequence=st.integers(0, BATCH - 1))
    def fill_to_capacity(self, sequence):
        while self.room(sequence):
            lengths = [0] * BATCH
            lengths[sequence] = min(CHUNK, self.room(sequence))
            self.prefill_lengths(lengths)

    def prefill_lengths(self, lengths):
        xs = self.tokens(BATCH, CHUNK)
        argument = None if lengths == [CHUNK] * BATCH else jnp.asarray(lengths, jnp.int32)
        ys = np.asarray(self.layer.prefill(jnp.asarray(xs), argument))
        for b, length in enumerate(lengths):
            for t in range(length):
                assert_close(ys[b, t], self.model.append(b, xs[b, t]))
            assert not ys[b, length:].any(), "padding outputs must be zeros"

    # ------------------------------------------------------- cache editing

    @rule(which=st.none() | SEQUENCES | MASKS)
    def reset(self, which):
        self.layer.reset(which_argument(which))
        self.model.reset(chosen(which))

    @precondition(lambda self: self.window is None)  # a ring cannot roll back
    @rule(wanted=st.lists(st.integers(0, MAX_LEN), min_size=BATCH, max_size=BATCH), one_count=st.booleans())
    def truncate(self, wanted, one_count):
        if one_count:
            keep = min([wanted[0]] + self.model.lengths)
            self.layer.truncate(keep)
            keeps = [keep] * BATCH
        else:
            keeps = [min(want, length) for want, length in zip(wanted, self.model.lengths)]
            self.layer.truncate(np.asarray(keeps, np.int32))
        self.model.truncate(keeps)

    # (`targets` is a keyword of `rule` itself, hence `copies`.)
    @rule(source=st.integers(0, BATCH - 1), copies=SEQUENCES | MASKS)
    def fork(self, source, copies):
        self.layer.fork(source, which_argument(copies))
        self.model.fork(source, chosen(copies))

    @rule(order=st.lists(st.integers(0, BATCH - 1), min_size=BATCH, max_size=BATCH))
    def reorder(self, order):
        self.layer.reorder(np.asarray(order, np.int32))
        self.model.reorder(order)

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
        active = [want or b == full for b, want in enumerate(others)]
        self.assert_overflow(lambda x: self.layer.step(x[:, 0], jnp.asarray(active)))

    @precondition(lambda self: any(self.room(b) < CHUNK for b in range(BATCH)))
    @rule()
    def overflowing_prefill_raises_and_changes_nothing(self):
        self.assert_overflow(lambda xs: self.layer.prefill(xs))

    def assert_overflow(self, call):
        before = cache_arrays(self.layer)
        with pytest.raises(kvattn.CacheOverflowError):
            call(jnp.asarray(self.tokens(BATCH, CHUNK)))
        assert_same_bits(cache_arrays(self.layer), before)

    # ----------------------------------------------------------- invariants

    @invariant()
    def pos_counts_the_history(self):
        if self.layer is not None:
            assert np.asarray(self.layer.pos[...]).tolist() == self.model.lengths

    @invariant()
    def slots_past_pos_are_zero(self):
        if self.layer is None:
            return
        slot_axis = 1 if self.cache_layout == "slots_major" else 2
        for name in ("k_cache", "v_cache"):
            cache = np.moveaxis(np.asarray(getattr(self.layer, name)[...]), slot_axis, 1)
            for b, length in enumerate(self.model.lengths):
                # A ring fills slots 0, 1, ... and then wraps, so this holds for it too.
                assert not cache[b, length:].any(), f"{name} of sequence {b} holds data past pos"


class HeadsMajorCacheMachine(CacheMachine):
    cache_layout = "heads_major"


class WindowedCacheMachine(CacheMachine):
    """A ring of 2 slots, narrower than the prefill chunk: most tokens are evicted mid-chunk."""

    window = 2


MACHINE_SETTINGS = settings(
    max_examples=25, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = MACHINE_SETTINGS
TestHeadsMajorCacheMachine = HeadsMajorCacheMachine.TestCase
TestHeadsMajorCacheMachine.settings = MACHINE_SETTINGS
TestWindowedCacheMachine = WindowedCacheMachine.TestCase
TestWindowedCacheMachine.settings = MACHINE_SETTINGS
