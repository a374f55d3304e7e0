"""Fast drivers: the donated Decoder, the compiled decode loop, on-device generate."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import kvattn
from kvattn.layer import decoding
from tests.helpers import assert_caches_close, assert_same_bits, cache_arrays, stream
from tests.reference import assert_close, causal_attention, weights_of


def make_layer(max_len=24, batch_size=None, **kwargs):
    return kvattn.MultiHeadAttention(
        4, 8, max_len=max_len, batch_size=batch_size, length_buckets=(8,), rngs=nnx.Rngs(0), **kwargs
    )


@pytest.mark.parametrize("layout", ["slots_major", "heads_major"])
def test_decoder_equals_python_loop_and_reference(layout):
    layer = make_layer(cache_layout=layout)
    xs = stream((12,))
    decoder = kvattn.Decoder(layer)
    fast = jnp.concatenate([decoder.prefill(xs[:5])] + [decoder.step(x)[None] for x in xs[5:]])
    assert_close(fast, causal_attention(weights_of(layer), xs))
    assert int(layer.pos[...]) == 0  # untouched until sync
    assert decoder.pos == 12
    slow_layer = make_layer(cache_layout=layout)
    slow = jnp.concatenate([slow_layer.prefill(xs[:5])] + [slow_layer.step(x)[None] for x in xs[5:]])
    np.testing.assert_allclose(fast, slow, rtol=1e-6, atol=1e-6)
    decoder.sync()
    assert int(layer.pos[...]) == 12
    np.testing.assert_allclose(layer.step(xs[0]), decoder.step(xs[0]), rtol=1e-6, atol=1e-6)


def test_decoder_overflow_raises_before_running():
    layer = make_layer(max_len=4)
    decoder = kvattn.Decoder(layer)
    decoder.prefill(stream((3,)))
    y = decoder.step(stream((1,))[0])
    with pytest.raises(kvattn.CacheOverflowError, match="max_len=4"):
        decoder.step(stream((1,))[0])
    assert decoder.pos == 4
    assert np.isfinite(np.asarray(y)).all()
    assert int(decoder.sync().pos[...]) == 4


def test_batched_decoder_tracks_active_sequences():
    layer = make_layer(batch_size=2, max_len=3)
    decoder = kvattn.Decoder(layer)
    decoder.prefill(stream((2, 2)), jnp.array([2, 0]))
    decoder.step(stream((2,)), jnp.array([True, True]))
    np.testing.assert_array_equal(decoder.pos, [3, 1])
    with pytest.raises(kvattn.CacheOverflowError, match=r"sequences \[0\]"):
        decoder.step(stream((2,)))
    decoder.step(stream((2,)), jnp.array([False, True]))
    np.testing.assert_array_equal(np.asarray(decoder.sync().pos[...]), [3, 2])


def test_decoder_step_compiles_once():
    layer = make_layer(max_len=40)
    decoder = kvattn.Decoder(layer)
    program = decoder._programs["step"]
    before = program._cache_size()
    for x in stream((20,)):
        decoder.step(x)
    assert program._cache_size() - before == 1


def full_cache_copies(hlo: str, shape: str) -> list[str]:
    return [line for line in hlo.splitlines() if re.search(rf"= {re.escape(shape)}\S* copy\(", line)]


def relayouts_of_size(hlo: str, size: int) -> list[str]:
    """Copies and transposes whose result has `size` elements."""
    found = []
    for line in hlo.splitlines():
        match = re.search(r"= f32\[([\d,]*)\]\S* (copy|transpose)\(", line)
        if match and np.prod([int(d) for d in match.group(1).split(",") if d]) == size:
            found.append(line.strip())
    return found


def assert_in_place(hlo: str, cache_shape: tuple[int, ...], kernel_sizes: list[int]):
    """No cache-sized copy, and no copy or transpose of a weight kernel, anywhere in `hlo`."""
    assert full_cache_copies(hlo, "f32[" + ",".join(map(str, cache_shape)) + "]") == []
    for size in kernel_sizes:
        assert relayouts_of_size(hlo, size) == []


def in_place_layer(layout, batch_size):
    # D=40, head width 10: a kernel's 400 or 1200 elements match no other array of the step.
    return kvattn.MultiHeadAttention(
        4, 40, max_len=256, batch_size=batch_size, cache_layout=layout, length_buckets=(8,), rngs=nnx.Rngs(0)
    )


KERNEL_SIZES = [40 * 4 * 10, 40 * 12 * 10]  # one projection, the fused query-key-value kernel


@pytest.mark.parametrize("layout", ["slots_major", "heads_major"])
@pytest.mark.parametrize("batch_size", [None, 2])
def test_compiled_step_updates_the_cache_in_place(layout, batch_size):
    """The donated Decoder step aliases its cache outputs to its inputs and never copies a whole buffer."""
    layer = in_place_layer(layout, batch_size)
    decoder = kvattn.Decoder(layer)
    x = stream(() if batch_size is None else (batch_size,), in_features=40)
    hlo = decoder._programs["step"].lower(decoder._weights, decoder._cache, x, None).compile().as_text()
    assert hlo.splitlines()[0].count("-alias)") == 3  # k, v and pos reuse their input buffers
    assert_in_place(hlo, decoder._cache.k.values.shape, KERNEL_SIZES)


@pytest.mark.parametrize("batch_size", [None, 2])
def test_layer_step_under_donated_jit_updates_the_cache_in_place(batch_size):
    """`layer.step` itself, jitted with its cache donated as a user would, copies no buffer either."""
    layer = in_place_layer("slots_major", batch_size)
    graphdef, cache, rest = nnx.split(layer, nnx.Cache, ...)

    @functools.partial(jax.jit, donate_argnums=1)
    def step(rest, cache, x):
        model = nnx.merge(graphdef, cache, rest)
        return model.step(x), nnx.state(model, nnx.Cache)

    x = stream(() if batch_size is None else (batch_size,), in_features=40)
    hlo = step.lower(rest, cache, x).compile().as_text()
    assert hlo.splitlines()[0].count("-alias)") == 3
    assert_in_place(hlo, layer.k_cache[...].shape, KERNEL_SIZES)
    assert_in_place(hlo, (1, *layer.k_cache[...].shape), KERNEL_SIZES)


@pytest.mark.parametrize("layout", ["slots_major", "heads_major"])
def test_decode_loop_body_copies_no_buffer(layout):
    """Inside `decode`'s loop nothing cache-sized is copied; a slots-major cache is transposed only outside it."""
    layer = in_place_layer(layout, None)
    xs = jnp.ones((5, 40))
    program = decoding._compiled(decoding._decode, False, ("config",))
    hlo = program.lower(layer.config, layer.weights, layer.stored_cache, xs).compile().as_text()
    loop_bodies = [c for c in re.split(r"\n(?=\S)", hlo) if "wide.region" in c.split("\n")[0]]
    assert loop_bodies
    for body in loop_bodies:
        assert_in_place(body, (1, 4, 256, 10), KERNEL_SIZES)
        assert_in_place(body, (4, 256, 10), KERNEL_SIZES)


@pytest.mark.parametrize("batch_size", [None, 2])
def test_decode_equals_step_loop_and_reference(batch_size):
    lead = () if batch_size is None else (batch_size,)
    xs = stream((*lead, 10))
    looped, compiled = make_layer(batch_size=batch_size), make_layer(batch_size=batch_size)
    looped.prefill(xs[..., :3, :])
    compiled.prefill(xs[..., :3, :])
    expected = jnp.stack([looped.step(xs[..., t, :]) for t in range(3, 10)], axis=-2)
    got = kvattn.decode(compiled, xs[..., 3:, :])
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert_caches_close(cache_arrays(looped), cache_arrays(compiled), rtol=1e-6, atol=1e-6)
    weights = weights_of(compiled)
    for b in range(batch_size or 1):
        seq = xs[b] if batch_size else xs
        row = got[b] if batch_size else got
        assert_close(row, causal_attention(weights, seq)[3:])


def test_decode_raises_before_running_when_stream_does_not_fit():
    layer = make_layer(max_len=6)
    layer.prefill(stream((3,)))
    before = cache_arrays(layer)
    with pytest.raises(kvattn.CacheOverflowError):
        kvattn.decode(layer, stream((4,)))
    assert_same_bits(before, cache_arrays(layer))


def feedback(y):
    return jnp.tanh(y)


def test_generate_equals_manual_feedback_loop():
    layer, manual = make_layer(), make_layer()
    x0 = stream(())
    result = kvattn.rollout(layer, x0, 6, feedback)
    assert int(result.length) == 6
    x, expected = x0, []
    for _ in range(6):
        y = manual.step(x)
        expected.append(y)
        x = feedback(y)
    np.testing.assert_allclose(result.outputs, jnp.stack(expected), rtol=1e-5, atol=1e-6)
    inputs = [x0] + [feedback(y) for y in expected[:-1]]
    assert_close(result.outputs, causal_attention(weights_of(layer), jnp.stack(inputs)))
    assert int(layer.pos[...]) == 6


def test_generate_stops_cleanly_at_capacity():
    layer = make_layer(max_len=5)
    layer.prefill(stream((2,)))
    before_k = np.asarray(layer.k_cache[...]).copy()
    result = kvattn.rollout(layer, stream((), seed=3), 6, feedback)
    assert int(result.length) == 3
    assert np.isfinite(np.asarray(result.outputs[:3])).all()
    assert np.isnan(np.asarray(result.outputs[3:])).all()
    assert int(layer.pos[...]) == 5
    np.testing.assert_array_equal(np.asarray(layer.k_cache[...])[:2], before_k[:2])
    full = kvattn.rollout(layer, stream(()), 2, feedback)
    assert int(full.length) == 0 and np.isnan(np.asarray(full.outputs)).all()


def test_batched_generate_runs_until_every_sequence_is_full():
    layer = make_layer(batch_size=2, max_len=4)
    layer.prefill(stream((2, 2)), jnp.array([2, 0]))
    result = kvattn.rollout(layer, stream((2,)), 5, feedback)
    assert result.outputs.shape == (2, 5, 8)
    assert int(result.length) == 4
    assert np.isfinite(np.asarray(result.outputs[0, :2])).all()
    assert np.isnan(np.asarray(result.outputs[0, 2:])).all()  # sequence 0 full after 2 steps
    assert np.isfinite(np.asarray(result.outputs[1, :4])).all()
    np.testing.assert_array_equal(np.asarray(layer.pos[...]), [4, 4])


def test_generate_rejects_bad_step_count():
    with pytest.raises(ValueError, match="num_steps must be a non-negative int"):
        kvattn.rollout(make_layer(), stream(()), -1, feedback)


def test_generate_program_is_reused_for_the_same_next_input():
    layer = make_layer()
    kvattn.rollout(layer, stream(()), 3, feedback)
    program = decoding._compiled(decoding._rollout, False, ("config", "num_steps", "next_input"))
    before = program._cache_size()
    layer.reset()
    kvattn.rollout(layer, stream((), seed=2), 3, feedback)
    assert program._cache_size() == before


@settings(max_examples=8, deadline=None)
@given(
    layout=st.sampled_from(["slots_major", "heads_major"]),
    heads=st.sampled_from([(4, 4), (4, 2), (4, 1)]),  # N, K
    use_bias=st.booleans(),
    window=st.sampled_from([None, 3, 5]),
    chunk=st.integers(1, 4),
    seed=st.integers(0, 99),
)
def test_drivers_equal_the_layer_and_the_reference(layout, heads, use_bias, window, chunk, seed):
    """The drivers' working form (fused, heads-major, write first) equals the layer's own read-first step.

    A batch of two sequences at different positions, some inactive steps,
    a ring that wraps, grouped-query heads: Decoder (prefill + steps) and
    `decode` against eager `prefill`/`step`, and both against the reference.
    """
    num_heads, num_kv_heads = heads
    size = dict(max_len=None, window=window) if window else dict(max_len=12)

    def build():
        return kvattn.MultiHeadAttention(
            num_heads, 8, num_kv_heads=num_kv_heads, batch_size=2, use_bias=use_bias, cache_layout=layout,
            length_buckets=(2, 4), rngs=nnx.Rngs(seed), **size,
        )

    eager, driven = build(), build()
    xs = stream((2, chunk + 6), seed=seed)
    lengths = jnp.array([chunk, chunk - 1])
    active = [jnp.array([True, t % 2 == 0]) for t in range(3)]

    expected = [eager.prefill(xs[:, :chunk], lengths)]
    expected += [eager.step(xs[:, chunk + t], active[t])[:, None] for t in range(3)]
    decoder = kvattn.Decoder(driven)
    got = [decoder.prefill(xs[:, :chunk], lengths)]
    got += [decoder.step(xs[:, chunk + t], active[t])[:, None] for t in range(3)]
    np.testing.assert_allclose(jnp.concatenate(got, 1), jnp.concatenate(expected, 1), rtol=1e-5, atol=1e-5)
    assert_caches_close(cache_arrays(decoder.sync()), cache_arrays(eager), rtol=1e-5, atol=1e-5)

    tail = xs[:, chunk + 3 :]
    decoded = kvattn.decode(driven, tail)
    stepped = jnp.stack([eager.step(x) for x in jnp.swapaxes(tail, 0, 1)], 1)
    np.testing.assert_allclose(decoded, stepped, rtol=1e-5, atol=1e-5)
    # Sequence 0 took every token: its outputs are the reference's for the whole stream.
    first = jnp.concatenate([jnp.concatenate(got, 1)[0], decoded[0]])
    assert_close(first, causal_attention(weights_of(eager), xs[0], window=window))
