"""Sliding-window ring caches and compact cache storage (bfloat16, int8)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import kvattn
from tests.helpers import assert_same_bits, cache_arrays, stream
from tests.reference import assert_close, causal_attention, weights_of

# Relative L2 error of each output token against the float32 cache, on
# standard-normal inputs (docs/guide/layer.md lists the measured values).
DTYPE_TOLERANCE = {"bfloat16": 1e-2, "int8": 3e-2}


def windowed(window=4, batch_size=None, **kwargs):
    return kvattn.MultiHeadAttention(
        2, 8, window=window, batch_size=batch_size, length_buckets=(2,), rngs=nnx.Rngs(0), **kwargs
    )


# ------------------------------------------------------------------- window


@pytest.mark.parametrize("layout", ["slots_major", "heads_major"])
def test_window_steps_run_past_capacity_and_equal_windowed_reference(layout):
    layer = windowed(window=4, cache_layout=layout)
    assert layer.k_cache[...].shape[:2] in ((4, 2), (2, 4))
    xs = stream((11,))
    ys = jnp.stack([layer.step(x) for x in xs])
    assert_close(ys, causal_attention(weights_of(layer), xs, window=4))
    assert int(layer.pos[...]) == 11  # counts every token; the ring holds the last 4


@settings(max_examples=10)
@given(chunks=st.lists(st.sampled_from([1, 3, 6]), min_size=1, max_size=5), seed=st.integers(0, 999))
def test_window_prefill_across_the_wrap_point(chunks, seed):
    """Chunks of 3 and 6 land on every phase of a 4-slot ring; 6 > 4 overwrites within the chunk."""
    layer = windowed(window=4)
    xs = stream((sum(chunks),), seed=seed)
    outputs, start = [], 0
    for size in chunks:
        chunk = xs[start : start + size]
        outputs.append(layer.step(chunk[0])[None] if size == 1 else layer.prefill(chunk))
        start += size
    assert_close(jnp.concatenate(outputs), causal_attention(weights_of(layer), xs, window=4))


def test_window_decode_loop_and_batched_sequences_at_different_phases():
    layer = windowed(window=3, batch_size=2)
    xs = stream((2, 9))
    layer.prefill(xs[:, :4], jnp.array([4, 1]))
    got = kvattn.decode(layer, xs[:, 4:])
    weights = weights_of(layer)
    assert_close(got[0], causal_attention(weights, xs[0], window=3)[4:])
    second = jnp.concatenate([xs[1, :1], xs[1, 4:]])
    assert_close(got[1], causal_attention(weights, second, window=3)[1:])
    np.testing.assert_array_equal(np.asarray(layer.pos[...]), [9, 6])


def test_window_never_overflows_even_under_jit():
    layer = windowed(window=2)
    step = nnx.jit(lambda layer, x: layer.step(x))
    ys = jnp.stack([step(layer, x) for x in stream((7,))])
    assert np.isfinite(np.asarray(ys)).all()
    gen = kvattn.rollout(layer, stream(()), 5, jnp.tanh)
    assert int(gen.length) == 5


def test_window_configuration_errors():
    with pytest.raises(ValueError, match="exactly one of max_len"):
        kvattn.MultiHeadAttention(2, 8, max_len=8, window=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="exactly one of max_len"):
        kvattn.MultiHeadAttention(2, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="spare_slots are a ring's"):
        kvattn.MultiHeadAttention(2, 8, max_len=8, spare_slots=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="spare_slots must be an int >= 0, got -1"):
        windowed(spare_slots=-1)
    layer = windowed()
    layer.prefill(stream((7,)))  # wrapped: holds positions 3..6
    before = cache_arrays(layer)
    with pytest.raises(ValueError, match=r"sequences \[0\] cannot roll back to \[5\] tokens: .* spare_slots=0 "
                                         r".* at most 1 tokens"):
        layer.truncate(5)
    assert_same_bits(before, cache_arrays(layer))


@pytest.mark.parametrize("spare", [0, 3])
def test_a_ring_rolls_back_its_spare_slots_and_one_as_if_never_decoded(spare):
    """Truncate, then decode on: equal to the float64 reference of the kept history, over every wrap phase."""
    window, xs = 3, stream((2, 16))
    layer = windowed(window=window, batch_size=2, spare_slots=spare)
    assert layer.k_cache[...].shape[1] == window + spare
    weights = weights_of(layer)
    kept = [[], []]
    layer.prefill(xs[:, :5], jnp.array([5, 2]))
    kept[0], kept[1] = list(xs[0, :5]), list(xs[1, :2])
    for t in range(5, 16):
        ys = layer.step(xs[:, t])
        for b in range(2):
            kept[b].append(xs[b, t])
            assert_close(ys[b], causal_attention(weights, np.stack(kept[b]), window=window)[-1])
        if t % 4 == 3:  # roll back as deep as the ring allows, the second sequence one token less
            pos = np.asarray(layer.pos[...])
            keep = pos - np.array([spare + 1, spare])
            layer.truncate(jnp.asarray(keep))
            kept = [history[: int(k)] for history, k in zip(kept, keep, strict=True)]
            np.testing.assert_array_equal(np.asarray(layer.pos[...]), keep)
    # Under jit nothing can raise: a roll-back past the spare slots empties and poisons the sequence.
    layer.reset()
    layer.prefill(xs[:, : 2 * (window + spare) + 1])  # wrapped twice
    poisoned = nnx.jit(lambda layer, keep: layer.truncate(keep))
    pos = np.asarray(layer.pos[...])
    poisoned(layer, jnp.asarray([pos[0] - spare - 2, pos[1] - spare - 1]))
    assert np.asarray(layer.pos[...]).tolist() == [-1, pos[1] - spare - 1]
    assert not np.asarray(layer.k_cache[...])[0].any() and np.asarray(layer.k_cache[...])[1].any()


# ------------------------------------------------------------ compact dtypes


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("layout", ["slots_major", "heads_major"])
def test_compact_cache_stays_within_its_documented_error(dtype, layout):
    in_features = 32
    xs = stream((40,), in_features=in_features)
    exact = kvattn.MultiHeadAttention(4, in_features, max_len=48, rngs=nnx.Rngs(0))
    compact = kvattn.MultiHeadAttention(
        4, in_features, max_len=48, cache_dtype=dtype, cache_layout=layout, rngs=nnx.Rngs(0)
    )
    reference = kvattn.decode(exact, xs)
    compact.prefill(xs[:7])
    got = jnp.concatenate([compact.prefill(xs[7:10]), kvattn.decode(compact, xs[10:])])
    error = np.linalg.norm(np.asarray(got - reference[7:]), axis=-1)
    error /= np.linalg.norm(np.asarray(reference[7:]), axis=-1)
    assert error.max() <= DTYPE_TOLERANCE[dtype]
    assert error.max() > 0  # the storage really is compact
    assert compact.k_cache[...].dtype == jnp.dtype(dtype)


def test_int8_cache_state_and_memory():
    layer = kvattn.MultiHeadAttention(4, 32, max_len=16, batch_size=2, cache_dtype="int8", rngs=nnx.Rngs(0))
    state = nnx.state(layer, nnx.Cache)
    assert set(state.keys()) == {"k_cache", "v_cache", "pos", "k_scale", "v_scale"}
    assert layer.k_scale[...].shape == (2, 16, 4) and layer.k_scale[...].dtype == jnp.float32
    assert layer.cache_bytes_per_token == 2 * 4 * 8 * 1 + 2 * 4 * 4
    float32 = kvattn.MultiHeadAttention(4, 32, max_len=16, rngs=nnx.Rngs(0))
    bfloat16 = kvattn.MultiHeadAttention(4, 32, max_len=16, cache_dtype="bfloat16", rngs=nnx.Rngs(0))
    assert float32.cache_bytes_per_token == 2 * bfloat16.cache_bytes_per_token == 256


def test_int8_batch_operations_move_scales_with_their_tokens():
    layer = kvattn.MultiHeadAttention(2, 8, max_len=8, batch_size=3, cache_dtype="int8", rngs=nnx.Rngs(0))
    xs = stream((3, 4))
    layer.prefill(xs, jnp.array([4, 2, 0]))
    layer.fork(0, [2])
    layer.reorder(jnp.array([2, 1, 0]))
    layer.truncate(jnp.array([3, 2, 3]))
    np.testing.assert_array_equal(np.asarray(layer.k_scale[...])[:, 3:], 0.0)
    out = layer.step(stream((3,), seed=5))
    exact = kvattn.MultiHeadAttention(2, 8, max_len=8, rngs=nnx.Rngs(0))
    expected = exact.prefill(jnp.concatenate([xs[0, :3], stream((3,), seed=5)[:1]]))[-1]
    np.testing.assert_allclose(out[0], expected, rtol=0.05, atol=0.05)


def test_unknown_cache_dtype_is_named():
    with pytest.raises(ValueError, match="cache_dtype must be one of"):
        kvattn.MultiHeadAttention(2, 8, max_len=8, cache_dtype="float16", rngs=nnx.Rngs(0))
