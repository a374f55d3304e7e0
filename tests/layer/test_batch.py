"""Batched caches: sequences at different positions, ragged prefill, slot reuse, GQA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import kvattn
from tests.helpers import assert_same_bits, cache_arrays, stream
from tests.reference import assert_close, causal_attention, weights_of


def batched_layer(batch_size=3, num_heads=4, num_kv_heads=None, max_len=16, seed=0, **kwargs):
    return kvattn.MultiHeadAttention(
        num_heads, 8, max_len=max_len, batch_size=batch_size, num_kv_heads=num_kv_heads, rngs=nnx.Rngs(seed), **kwargs
    )


def single_like(layer, max_len=None):
    """An unbatched layer holding the same weights."""
    single = kvattn.MultiHeadAttention(
        layer.num_heads, layer.in_features, max_len=max_len or layer.max_len,
        num_kv_heads=layer.num_kv_heads, rngs=nnx.Rngs(99),
    )
    nnx.update(single, nnx.state(layer, nnx.Param))
    return single


def test_batched_state_shapes():
    layer = batched_layer(batch_size=3, num_heads=4, num_kv_heads=2)
    assert layer.k_cache[...].shape == (3, 16, 2, 2)
    assert layer.v_cache[...].shape == (3, 16, 2, 2)
    assert layer.pos[...].shape == (3,) and layer.pos[...].dtype == jnp.int32
    assert layer.key.kernel[...].shape == (8, 2, 2)
    assert layer.key.bias[...].shape == (2, 2)
    heads_major = batched_layer(batch_size=3, num_heads=4, num_kv_heads=2, cache_layout="heads_major")
    assert heads_major.k_cache[...].shape == (3, 2, 16, 2)


@pytest.mark.parametrize("layout", ["slots_major", "heads_major"])
def test_ragged_batch_with_early_finishers_equals_each_sequence_alone(layout):
    layer = batched_layer(num_kv_heads=2, cache_layout=layout)
    prompts = stream((3, 5))
    lengths = np.array([5, 2, 0])
    out = layer.prefill(prompts, jnp.asarray(lengths))
    np.testing.assert_array_equal(out[1, 2:], 0.0)  # padding outputs are zeros
    np.testing.assert_array_equal(out[2], 0.0)
    np.testing.assert_array_equal(layer.pos[...], lengths)

    steps = stream((4, 3), seed=2)
    active_plan = np.array([[1, 1, 1], [1, 0, 1], [0, 0, 1], [1, 0, 1]], bool)
    step_outs = [layer.step(x, jnp.asarray(active)) for x, active in zip(steps, active_plan)]

    weights = weights_of(layer)
    for b in range(3):
        history = [prompts[b, : lengths[b]]]
        alone = single_like(layer)
        if lengths[b]:
            assert_close(out[b, : lengths[b]], causal_attention(weights, prompts[b, : lengths[b]]))
            np.testing.assert_allclose(
                out[b, : lengths[b]], alone.prefill(prompts[b, : lengths[b]]), rtol=1e-5, atol=1e-5
            )
        for t, active in enumerate(active_plan[:, b]):
            if not active:
                np.testing.assert_array_equal(step_outs[t][b], 0.0)
                continue
            history.append(steps[t, b][None])
            expected = causal_attention(weights, jnp.concatenate(history))[-1]
            assert_close(step_outs[t][b], expected)
            np.testing.assert_allclose(step_outs[t][b], alone.step(steps[t, b]), rtol=1e-5, atol=1e-5)
        assert int(layer.pos[...][b]) == sum(len(h) for h in history)


def test_padding_never_enters_the_cache():
    layer = batched_layer(batch_size=2)
    prompts = stream((2, 4))
    garbage = prompts.at[1, 2:].set(1e6)
    layer.prefill(garbage, jnp.array([4, 2]))
    k_cache = np.asarray(layer.k_cache[...])
    np.testing.assert_array_equal(k_cache[1, 2:], 0.0)
    clean = batched_layer(batch_size=2)
    clean.prefill(prompts, jnp.array([4, 2]))
    assert_same_bits(cache_arrays(clean), cache_arrays(layer))


def test_reset_which_leaves_others_bit_identical_and_slot_is_reusable():
    layer = batched_layer()
    layer.prefill(stream((3, 4)))
    before = cache_arrays(layer)
    layer.reset([1])
    after = cache_arrays(layer)
    k_before, k_after = before["k_cache"], after["k_cache"]
    np.testing.assert_array_equal(k_after[[0, 2]], k_before[[0, 2]])
    np.testing.assert_array_equal(k_after[1], 0.0)
    np.testing.assert_array_equal(np.asarray(layer.pos[...]), [4, 0, 4])

    layer.reset([])  # no sequence: nothing changes
    np.testing.assert_array_equal(np.asarray(layer.pos[...]), [4, 0, 4])
    layer.reset(jnp.array([False, False, True]))
    np.testing.assert_array_equal(np.asarray(layer.pos[...]), [4, 0, 0])
    fresh = stream((3, 3), seed=5)
    out = layer.prefill(fresh, jnp.array([0, 3, 3]))
    alone = single_like(layer)
    np.testing.assert_allclose(out[1], alone.prefill(fresh[1]), rtol=1e-5, atol=1e-5)
    assert_close(out[2], causal_attention(weights_of(layer), fresh[2]))


def test_per_sequence_overflow_eager_raises_before_any_change():
    layer = batched_layer(batch_size=2, max_len=4)
    layer.prefill(stream((2, 4)), jnp.array([4, 1]))
    before = cache_arrays(layer)
    with pytest.raises(kvattn.CacheOverflowError, match=r"sequences \[0\]"):
        layer.step(stream((2,))[:, :])
    assert_same_bits(before, cache_arrays(layer))
    # With the full sequence inactive, the others proceed.
    layer.step(stream((2,)), jnp.array([False, True]))
    np.testing.assert_array_equal(np.asarray(layer.pos[...]), [4, 2])


def test_per_sequence_overflow_under_jit_touches_only_that_sequence():
    layer = batched_layer(batch_size=2, max_len=4)
    layer.prefill(stream((2, 4)), jnp.array([4, 1]))
    before = cache_arrays(layer)
    x = stream((2,), seed=3)
    y = nnx.jit(lambda layer, x: layer.step(x))(layer, x)
    assert np.isnan(np.asarray(y[0])).all()
    assert np.isfinite(np.asarray(y[1])).all()
    after = cache_arrays(layer)
    np.testing.assert_array_equal(after["k_cache"][0], before["k_cache"][0])
    np.testing.assert_array_equal(np.asarray(layer.pos[...]), [4, 2])
    history = jnp.concatenate([stream((2, 4))[1, :1], x[1][None]])
    assert_close(y[1], causal_attention(weights_of(layer), history)[-1])


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_gqa_and_mqa_equal_reference_with_repeated_heads(num_kv_heads):
    layer = batched_layer(batch_size=2, num_heads=4, num_kv_heads=num_kv_heads, max_len=12)
    xs = stream((2, 7))
    layer.prefill(xs[:, :4])
    outs = [layer.step(xs[:, t]) for t in range(4, 7)]
    weights = weights_of(layer)
    for b in range(2):
        expected = causal_attention(weights, xs[b])
        assert_close(jnp.stack([o[b] for o in outs]), expected[4:])


def test_gqa_does_not_repeat_the_cache():
    """The compiled step never materialises a cache-sized array with N (not K) heads."""
    layer = batched_layer(batch_size=2, num_heads=4, num_kv_heads=1, max_len=64, length_buckets=())
    graphdef, state = nnx.split(layer)

    def step(state, x):
        layer = nnx.merge(graphdef, state)
        return layer.step(x)

    hlo = jax.jit(step).lower(state, stream((2,))).compile().as_text()
    assert "f32[2,64,4,2]" not in hlo and "f32[2,4,64,2]" not in hlo
    assert "f32[2,64,1,2]" in hlo or "f32[2,64,2]" in hlo


def test_fork_shares_a_prefix_and_reorder_selects_beams():
    layer = batched_layer()
    prefix = stream((3, 4))
    layer.prefill(prefix, jnp.array([4, 0, 0]))
    layer.fork(0, jnp.array([False, True, True]))
    np.testing.assert_array_equal(np.asarray(layer.pos[...]), [4, 4, 4])
    suffixes = stream((3,), seed=6)
    outs = layer.step(suffixes)
    weights = weights_of(layer)
    for b in range(3):
        history = jnp.concatenate([prefix[0], suffixes[b][None]])
        assert_close(outs[b], causal_attention(weights, history)[-1])
    layer.reorder(jnp.array([2, 2, 0]))
    nxt = stream((3,), seed=7)
    outs = layer.step(nxt)
    sources = [2, 2, 0]
    for b in range(3):
        history = jnp.concatenate([prefix[0], suffixes[sources[b]][None], nxt[b][None]])
        assert_close(outs[b], causal_attention(weights, history)[-1])


def test_batched_truncate_per_sequence():
    layer = batched_layer(batch_size=2)
    xs = stream((2, 6))
    layer.prefill(xs)
    layer.truncate(jnp.array([2, 5]))
    np.testing.assert_array_equal(np.asarray(layer.pos[...]), [2, 5])
    out = layer.step(xs[:, 0])
    weights = weights_of(layer)
    assert_close(out[0], causal_attention(weights, jnp.concatenate([xs[0, :2], xs[0, :1]]))[-1])
    assert_close(out[1], causal_attention(weights, jnp.concatenate([xs[1, :5], xs[1, :1]]))[-1])


def test_batched_attend_with_padded_histories():
    layer = batched_layer(batch_size=2)
    history = stream((2, 5))
    x = stream((2,), seed=4)
    y = kvattn.attend(layer, history, x, lengths=jnp.array([5, 2]))
    weights = weights_of(layer)
    assert_close(y[0], causal_attention(weights, jnp.concatenate([history[0], x[0][None]]))[-1])
    assert_close(y[1], causal_attention(weights, jnp.concatenate([history[1, :2], x[1][None]]))[-1])
    np.testing.assert_array_equal(np.asarray(layer.pos[...]), [6, 3])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda layer: layer.step(jnp.ones((2, 8))), r"batch_size=3 rows, got shape \(2, 8\)"),
        (lambda layer: layer.step(jnp.ones((3, 8)), jnp.ones(3)), r"active must be bool \(3,\)"),
        (
            lambda layer: layer.prefill(jnp.ones((3, 2, 8)), jnp.array([1, 3, 0])),
            r"lengths must lie in \[0, 2\], got \[1, 3, 0\]",
        ),
        (lambda layer: layer.prefill(jnp.ones((3, 2, 8)), jnp.array([1.0, 1, 1])), "lengths must be int"),
        (lambda layer: layer.reset([3]), r"which indices must lie in \[0, 3\)"),
        (lambda layer: layer.fork(5, [0]), r"source must lie in \[0, 3\)"),
        (lambda layer: layer.reorder(jnp.array([0, 1])), r"order must be int \(3,\)"),
        (lambda layer: layer.reorder(jnp.array([0, 1, 3])), r"order must lie in \[0, 2\], got \[0, 1, 3\]"),
    ],
)
def test_bad_batched_input_is_named_and_changes_nothing(call, message):
    layer = batched_layer()
    layer.prefill(stream((3, 2)))
    before = cache_arrays(layer)
    with pytest.raises(ValueError, match=message):
        call(layer)
    assert_same_bits(before, cache_arrays(layer))


@settings(max_examples=10)
@given(
    heads=st.sampled_from([(4, 4), (4, 2), (4, 1)]),
    data=st.data(),
)
def test_random_ragged_batches_equal_reference(heads, data):
    """Random lengths and activity; chunk width fixed at 3 so compilations stay few."""
    num_heads, num_kv_heads = heads
    batch = 3
    layer = batched_layer(batch_size=batch, num_heads=num_heads, num_kv_heads=num_kv_heads, max_len=20)
    histories = [[] for _ in range(batch)]
    weights = weights_of(layer)
    seed = data.draw(st.integers(0, 10_000))
    for round_ in range(data.draw(st.integers(1, 4))):
        if data.draw(st.booleans()):
            lengths = np.array(data.draw(st.lists(st.integers(0, 3), min_size=batch, max_size=batch)))
            xs = stream((batch, 3), seed=seed + round_)
            out = layer.prefill(xs, jnp.asarray(lengths))
            for b in range(batch):
                for t in range(lengths[b]):
                    histories[b].append(xs[b, t])
                    assert_close(out[b, t], causal_attention(weights, jnp.stack(histories[b]))[-1])
        else:
            active = np.array(data.draw(st.lists(st.booleans(), min_size=batch, max_size=batch)))
            x = stream((batch,), seed=seed + round_)
            out = layer.step(x, jnp.asarray(active))
            for b in range(batch):
                if active[b]:
                    histories[b].append(x[b])
                    assert_close(out[b], causal_attention(weights, jnp.stack(histories[b]))[-1])
                else:
                    np.testing.assert_array_equal(out[b], 0.0)
    np.testing.assert_array_equal(np.asarray(layer.pos[...]), [len(h) for h in histories])


def test_fork_reorder_truncate_reset_run_under_jit():
    eager, jitted = batched_layer(), batched_layer()
    xs = stream((3, 4))
    for layer in (eager, jitted):
        layer.prefill(xs, jnp.array([4, 3, 1]))
    order, keep, targets = jnp.array([1, 0, 0]), jnp.array([2, 3, 1]), jnp.array([False, False, True])

    @nnx.jit
    def shuffle(layer, order, keep, targets):
        layer.fork(1, targets)
        layer.reorder(order)
        layer.truncate(keep)
        layer.reset(jnp.array([False, True, False]))

    shuffle(jitted, order, keep, targets)
    eager.fork(1, targets)
    eager.reorder(order)
    eager.truncate(keep)
    eager.reset([1])
    assert_same_bits(cache_arrays(eager), cache_arrays(jitted))
    np.testing.assert_array_equal(np.asarray(jitted.pos[...]), [2, 0, 1])
