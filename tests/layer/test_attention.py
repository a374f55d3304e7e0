"""The single-sequence layer: the seed's contract, against the float64 reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import kvattn
from tests.helpers import assert_caches_close, assert_same_bits, cache_arrays, stream
from tests.reference import assert_close, causal_attention, weights_of


def make_layer(num_heads=2, in_features=8, max_len=16, seed=0, **kwargs):
    return kvattn.MultiHeadAttention(num_heads, in_features, max_len=max_len, rngs=nnx.Rngs(seed), **kwargs)


# ------------------------------------------------------------- the seed's case


def seed_example_layer():
    """One head of width one: zero queries, identity keys/values/out, no bias."""
    layer = kvattn.MultiHeadAttention(1, 1, max_len=3, use_bias=False, rngs=nnx.Rngs(0))
    layer.query.kernel[...] = jnp.zeros((1, 1, 1))
    layer.key.kernel[...] = jnp.ones((1, 1, 1))
    layer.value.kernel[...] = jnp.ones((1, 1, 1))
    layer.out.kernel[...] = jnp.ones((1, 1, 1))
    return layer


def test_seed_worked_example():
    layer = seed_example_layer()
    assert float(layer.step(jnp.array([2.0]))[0]) == pytest.approx(2.0)
    assert float(layer.step(jnp.array([6.0]))[0]) == pytest.approx(4.0)
    assert int(layer.pos[...]) == 2
    np.testing.assert_allclose(np.asarray(layer.v_cache[...]).reshape(3), [2.0, 6.0, 0.0])


def test_seed_example_unfilled_slot_is_masked_not_averaged():
    layer = seed_example_layer()
    layer.step(jnp.array([2.0]))
    # Without masking the zero slot this would be (2 + 6 + 0) / 3.
    assert float(layer.step(jnp.array([6.0]))[0]) != pytest.approx(8.0 / 3.0)


# --------------------------------------------------------------- state layout


def test_cache_and_params_are_separate_state():
    layer = make_layer(num_heads=2, in_features=8, max_len=16)
    cache = nnx.state(layer, nnx.Cache)
    assert set(cache.keys()) == {"k_cache", "v_cache", "pos"}
    assert cache["k_cache"][...].shape == (16, 2, 4)
    assert cache["k_cache"][...].dtype == jnp.float32
    assert cache["v_cache"][...].shape == (16, 2, 4)
    assert cache["pos"][...].shape == () and cache["pos"][...].dtype == jnp.int32
    params = nnx.state(layer, nnx.Param)
    assert set(params.keys()) == {"query", "key", "value", "out"}
    assert params["query"]["kernel"][...].shape == (8, 2, 4)
    assert params["out"]["kernel"][...].shape == (2, 4, 8)
    assert params["out"]["bias"][...].shape == (8,)


def test_head_dim_override():
    layer = make_layer(num_heads=2, in_features=8, head_dim=3)
    assert layer.k_cache[...].shape == (16, 2, 3)
    xs = stream((5,))
    assert_close(layer.prefill(xs), causal_attention(weights_of(layer), xs))


# -------------------------------------------------------- equivalence oracle


@settings(max_examples=12)
@given(
    heads=st.sampled_from([(1, 1), (2, 4), (4, 3)]),
    chunks=st.lists(st.sampled_from([1, 3]), min_size=1, max_size=6),
    use_bias=st.booleans(),
    layout=st.sampled_from(["slots_major", "heads_major"]),
    seed=st.integers(0, 2**16),
)
def test_mixed_steps_and_prefills_equal_reference(heads, chunks, use_bias, layout, seed):
    """Any mix of prefills (chunk > 1) and steps (chunk == 1) equals full causal attention.

    Chunk sizes come from a small set to bound compilations; offsets still
    vary freely, and the buckets (4, 8) are crossed at many positions.
    """
    num_heads, head_dim = heads
    layer = kvattn.MultiHeadAttention(
        num_heads,
        8,
        head_dim=head_dim,
        max_len=24,
        use_bias=use_bias,
        cache_layout=layout,
        length_buckets=(4, 8),
        rngs=nnx.Rngs(seed),
    )
    xs = stream((sum(chunks),), seed=seed + 1)
    outputs, start = [], 0
    for size in chunks:
        chunk = xs[start : start + size]
        outputs.append(layer.step(chunk[0])[None] if size == 1 else layer.prefill(chunk))
        start += size
    expected = causal_attention(weights_of(layer), xs)
    assert_close(jnp.concatenate(outputs), expected)
    assert_close(layer(xs), expected)
    assert int(layer.pos[...]) == len(xs)


def test_prefill_equals_steps_bit_for_bit_state():
    xs = stream((7,))
    stepped, filled = make_layer(), make_layer()
    stepped_out = jnp.stack([stepped.step(x) for x in xs])
    filled.prefill(xs[:2])
    filled_out = jnp.concatenate([filled.prefill(xs[2:])])
    np.testing.assert_allclose(stepped_out[2:], filled_out, rtol=1e-5, atol=1e-6)
    assert_caches_close(cache_arrays(stepped), cache_arrays(filled), rtol=1e-6, atol=1e-6)
    assert int(filled.pos[...]) == 7


def test_cached_and_uncached_do_not_drift_over_a_long_stream():
    layer = make_layer(max_len=200, length_buckets=(16, 64))
    xs = stream((200,))
    ys = kvattn.decode(layer, xs)
    assert_close(ys, causal_attention(weights_of(layer), xs))


def test_minus_inf_masking_survives_huge_negative_scores():
    """Valid scores near -1e12 must still win over unfilled slots."""
    layer = kvattn.MultiHeadAttention(1, 1, max_len=4, use_bias=False, rngs=nnx.Rngs(0))
    layer.query.kernel[...] = jnp.full((1, 1, 1), 1e6)
    layer.key.kernel[...] = jnp.full((1, 1, 1), -1e6)
    layer.value.kernel[...] = jnp.ones((1, 1, 1))
    layer.out.kernel[...] = jnp.ones((1, 1, 1))
    # Scores are 1e6 * -1e6 * x_q * x_k, about -1e12: a -1e9 penalty on the
    # unfilled (zero-score) slots would hand them all the weight.
    y1 = layer.step(jnp.array([1.0]))
    y2 = layer.step(jnp.array([3.0]))
    assert float(y1[0]) == pytest.approx(1.0)
    # Token 2 scores 1e12*3*1 vs 1e12*3*3; the softmax puts all weight on token 1.
    assert float(y2[0]) == pytest.approx(1.0)
    assert np.isfinite(np.asarray(y2)).all()


# ----------------------------------------------------------------- overflow


def test_eager_overflow_raises_before_any_change():
    layer = make_layer(max_len=4)
    layer.prefill(stream((3,)))
    before = cache_arrays(layer)
    with pytest.raises(kvattn.CacheOverflowError, match="max_len=4"):
        layer.prefill(stream((2,)))
    assert_same_bits(before, cache_arrays(layer))
    layer.step(stream((1,))[0])
    before = cache_arrays(layer)
    with pytest.raises(kvattn.CacheOverflowError):
        layer.step(stream((1,))[0])
    assert_same_bits(before, cache_arrays(layer))


def test_jitted_overflow_writes_nothing_and_returns_nan():
    layer = make_layer(max_len=3)
    step = nnx.jit(lambda layer, x: layer.step(x))
    prefill = nnx.jit(lambda layer, xs: layer.prefill(xs))
    for x in stream((3,)):
        assert np.isfinite(np.asarray(step(layer, x))).all()
    before = cache_arrays(layer)
    y = step(layer, stream((1,), seed=9)[0])
    assert np.isnan(np.asarray(y)).all()
    assert_same_bits(before, cache_arrays(layer))
    layer.reset()
    prefill(layer, stream((2,)))
    before = cache_arrays(layer)
    ys = prefill(layer, stream((2,), seed=5))
    assert np.isnan(np.asarray(ys)).all()
    assert_same_bits(before, cache_arrays(layer))


# -------------------------------------------------- reset and independence


def test_reset_returns_to_fresh_state():
    layer, fresh = make_layer(), make_layer()
    layer.prefill(stream((5,)))
    layer.reset()
    assert_same_bits(cache_arrays(fresh), cache_arrays(layer))
    xs = stream((4,), seed=3)
    assert_close(layer.prefill(xs), causal_attention(weights_of(layer), xs))


def test_two_layers_do_not_interfere():
    first, second = make_layer(seed=0), make_layer(seed=0)
    a, b = stream((6,), seed=1), stream((6,), seed=2)
    for x_a, x_b in zip(a, b):
        first.step(x_a)
        second.step(x_b)
    assert_close(first.step(a[0]), causal_attention(weights_of(first), jnp.concatenate([a, a[:1]]))[-1])
    assert_close(second.step(b[0]), causal_attention(weights_of(second), jnp.concatenate([b, b[:1]]))[-1])


# ------------------------------------------------------------------- attend


@pytest.mark.parametrize("history_len", [0, 1, 6])
def test_attend_equals_last_row_of_full_forward(history_len):
    layer = make_layer()
    xs = stream((history_len + 1,))
    y = kvattn.attend(layer, xs[:history_len], xs[history_len])
    assert_close(y, causal_attention(weights_of(layer), xs)[-1])
    np.testing.assert_allclose(y, layer(xs)[-1], rtol=1e-5, atol=1e-6)
    assert int(layer.pos[...]) == history_len + 1


def test_attend_rebuilds_on_every_call_and_decoding_continues():
    layer = make_layer()
    xs = stream((6,))
    kvattn.attend(layer, stream((9,), seed=7), xs[0])  # unrelated earlier history
    y = kvattn.attend(layer, xs[:4], xs[4])
    assert_close(y, causal_attention(weights_of(layer), xs[:5])[-1])
    assert_close(layer.step(xs[5]), causal_attention(weights_of(layer), xs)[-1])


def test_attend_too_long_history_raises_before_change():
    layer = make_layer(max_len=4)
    layer.prefill(stream((2,)))
    before = cache_arrays(layer)
    with pytest.raises(kvattn.CacheOverflowError):
        kvattn.attend(layer, stream((4,)), stream((1,))[0])
    assert_same_bits(before, cache_arrays(layer))


def test_attend_under_nnx_jit():
    layer = make_layer()
    xs = stream((5,))
    y = nnx.jit(kvattn.attend)(layer, xs[:4], xs[4])
    assert_close(y, causal_attention(weights_of(layer), xs)[-1])
    assert int(layer.pos[...]) == 5


# --------------------------------------------------------------- compilation


def test_jitted_step_compiles_once_for_every_position():
    layer = make_layer(max_len=40, length_buckets=(8, 16))
    traces = []

    @nnx.jit
    def step(layer, x):
        traces.append(None)
        return layer.step(x)

    xs = stream((20,))
    ys = [step(layer, x) for x in xs]
    assert len(traces) == 1
    assert_close(jnp.stack(ys), causal_attention(weights_of(layer), xs))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_heads=0), "num_heads must be a positive int, got 0"),
        (dict(num_heads=3), r"in_features \(8\) must be divisible by num_heads \(3\)"),
        (dict(max_len=0), "max_len must be a positive int, got 0"),
        (dict(head_dim=-1), "head_dim must be a positive int, got -1"),
        (dict(num_kv_heads=3, num_heads=4), r"num_kv_heads \(3\) must divide num_heads \(4\)"),
        (dict(cache_layout="columns"), "cache_layout must be one of"),
        (dict(length_buckets=(0, 4)), "length_buckets must be positive"),
    ],
)
def test_bad_configuration_is_named(kwargs, message):
    config = dict(num_heads=2, in_features=8, max_len=16) | kwargs
    num_heads, in_features = config.pop("num_heads"), config.pop("in_features")
    with pytest.raises(ValueError, match=message):
        kvattn.MultiHeadAttention(num_heads, in_features, rngs=nnx.Rngs(0), **config)


def test_non_integer_size_is_a_type_error():
    with pytest.raises(TypeError, match="max_len"):
        kvattn.MultiHeadAttention(2, 8, max_len=2.5, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda layer: layer.step(jnp.ones(7)), ValueError, r"end in in_features=8, got shape \(7,\)"),
        (lambda layer: layer.step(jnp.ones((1, 8))), ValueError, r"x must have rank 1 .* got shape \(1, 8\)"),
        (lambda layer: layer.step(jnp.ones(8, jnp.int32)), TypeError, "floating dtype, got int32"),
        (lambda layer: layer.prefill(jnp.ones((0, 8))), ValueError, "at least one token"),
        (lambda layer: layer.prefill(jnp.ones(8)), ValueError, "rank 2"),
        (lambda layer: layer.step(jnp.ones(8), active=jnp.array([True])), ValueError, "only for layers built with"),
        (lambda layer: layer.truncate(5), ValueError, "truncate keeps 0..pos"),
        # Any number of leading batch axes is fine for the uncached forward (Flax's shapes); fewer than 2 is not.
        (lambda layer: layer(jnp.ones(8)), ValueError, r"rank >= 2 \(\.\.\., T, D=8\)"),
        (lambda layer: kvattn.attend(layer, jnp.ones((2, 8)), jnp.ones(9)), ValueError, "in_features=8"),
    ],
)
def test_bad_input_is_named_and_changes_nothing(call, error, message):
    layer = make_layer()
    layer.prefill(stream((2,)))
    before = cache_arrays(layer)
    with pytest.raises(error, match=message):
        call(layer)
    assert_same_bits(before, cache_arrays(layer))


# ------------------------------------------------------------------ rollback


def test_truncate_equals_never_having_decoded():
    xs, draft = stream((6,)), stream((3,), seed=4)
    layer, clean = make_layer(), make_layer()
    layer.prefill(xs[:4])
    layer.prefill(draft)
    layer.truncate(4)
    clean.prefill(xs[:4])
    assert_same_bits(cache_arrays(clean), cache_arrays(layer))
    assert_close(layer.prefill(xs[4:]), causal_attention(weights_of(layer), xs)[4:])


# ------------------------------------------------------------ Flax interop


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
def test_weights_copied_from_flax_give_flax_outputs(num_kv_heads):
    flax_layer = nnx.MultiHeadAttention(
        4, 16, num_kv_heads=num_kv_heads, decode=False, rngs=nnx.Rngs(3)
    )
    layer = kvattn.MultiHeadAttention(4, 16, num_kv_heads=num_kv_heads, max_len=12, rngs=nnx.Rngs(0))
    nnx.update(layer, nnx.state(flax_layer, nnx.Param))
    xs = stream((9,), in_features=16)
    causal = nnx.make_causal_mask(jnp.ones((1, 9)))
    expected = flax_layer(xs[None], mask=causal)[0]
    np.testing.assert_allclose(layer(xs), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.prefill(xs), expected, rtol=1e-5, atol=1e-5)

    flax_layer.init_cache((1, 12, 16))
    flax_steps = jnp.stack([flax_layer(x[None, None], decode=True)[0, 0] for x in xs])
    np.testing.assert_allclose(flax_steps, expected, rtol=1e-5, atol=1e-5)
    # And back: kvattn's weights drive Flax's layer to the same outputs.
    other = make_layer(4, 16, seed=8, num_kv_heads=num_kv_heads)
    nnx.update(flax_layer, nnx.state(other, nnx.Param))
    np.testing.assert_allclose(flax_layer(xs[None], mask=causal, decode=False)[0], other(xs), rtol=1e-5, atol=1e-5)


def test_layer_buckets_follow_the_batch_cache_size():
    def buckets(batch_size):
        return kvattn.MultiHeadAttention(8, 512, max_len=2048, batch_size=batch_size, rngs=nnx.Rngs(0)).length_buckets

    assert buckets(None) == (128, 256, 2048)  # 8 MiB of caches
    assert buckets(8) == (128, 256, 512, 2048)  # 64 MiB
