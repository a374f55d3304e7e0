"""Modern attention options on every path: rotary positions, QK-norm, soft-capping, mixed precision, Flax's shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import kvattn
from kvattn.rotary import RoPE
from tests.helpers import ROPES, assert_same_bits, cache_arrays, stream
from tests.reference import ReferenceCache, assert_close, causal_attention, weights_of

D = 16


def perturbed(layer, seed=7):
    """Non-trivial norm scales and biases, so that a missing one would show."""
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    for name in ("query_ln", "key_ln"):
        if hasattr(layer, name):
            scale = getattr(layer, name).scale
            scale[...] = 1 + 0.3 * jax.random.normal(next(keys), scale[...].shape)
    for name in ("query", "key", "value", "out"):
        bias = getattr(layer, name).bias
        if bias is not None:
            bias[...] = 0.2 * jax.random.normal(next(keys), bias[...].shape)
    return layer


# ---------------------------------------------------- every path, every option


OPTIONS = st.fixed_dictionaries(
    {
        "rope": st.sampled_from(sorted(ROPES)),
        "normalize_qk": st.sampled_from([False, True, "rms", "rms_offset"]),
        "logit_softcap": st.sampled_from([None, 3.0]),
        "query_scale": st.sampled_from([None, 0.2]),
        "num_kv_heads": st.sampled_from([4, 2, 1]),
        "use_bias": st.sampled_from([True, False, ("query", "key", "value")]),
        "window": st.sampled_from([None, 4]),
    }
)


def modern_layer(options, batch_size=2, **overrides):
    options = dict(options)
    window = options.pop("window")
    capacity = dict(window=window) if window else dict(max_len=24)
    return perturbed(kvattn.MultiHeadAttention(
        4, D, batch_size=batch_size, rope=ROPES[options.pop("rope")], rngs=nnx.Rngs(0),
        **capacity, **options, **overrides,
    ))


@settings(max_examples=7)  # each example compiles every path anew: kept small for CI's 2 cores
@given(options=OPTIONS, data=st.data())
def test_every_path_equals_the_reference(options, data):
    """Ragged prefill at an offset, steps, a Decoder, decode and generate all equal the float64 reference."""
    layer = modern_layer(options)
    reference = ReferenceCache(weights_of(layer), 2, options["window"])
    xs = stream((2, 12), seed=data.draw(st.integers(0, 50)), in_features=D)

    def expect(ys, sequence_tokens):
        for b, tokens in enumerate(sequence_tokens):
            for t, token in tokens:
                assert_close(ys[b, t], reference.append(b, token))

    # A first chunk, ragged.
    lengths = [3, 1]
    ys = layer.prefill(xs[:, :3], jnp.array(lengths))
    expect(ys, [[(t, xs[b, t]) for t in range(lengths[b])] for b in range(2)])
    # A step for one sequence only, then a chunk at different offsets.
    y = layer.step(xs[:, 3], jnp.array([False, True]))
    expect(y[:, None], [[], [(0, xs[1, 3])]])
    ys = layer.prefill(xs[:, 4:7])
    expect(ys, [[(t, xs[b, 4 + t]) for t in range(3)] for b in range(2)])
    # The compiled drivers continue from there.
    decoder = kvattn.Decoder(layer)
    y = decoder.step(xs[:, 7])
    expect(y[:, None], [[(0, xs[b, 7])] for b in range(2)])
    decoder.sync()
    ys = kvattn.decode(layer, xs[:, 8:10])
    expect(ys, [[(t, xs[b, 8 + t]) for t in range(2)] for b in range(2)])
    # The uncached forward of a whole history (no window: windowed histories are checked token by token above).
    if not options["window"]:
        history = np.stack(reference.histories[0])
        assert_close(layer(jnp.asarray(history, jnp.float32)), causal_attention(weights_of(layer), history))


@settings(max_examples=3)
@given(options=OPTIONS)
def test_generate_feeds_each_output_back(options):
    layer = modern_layer(options, batch_size=None)
    reference = ReferenceCache(weights_of(layer), 1, options["window"])
    x = stream((), in_features=D)
    layer.prefill(stream((3,), seed=3, in_features=D))
    for token in stream((3,), seed=3, in_features=D):
        reference.append(0, token)
    outputs = kvattn.rollout(layer, x, 4, jnp.tanh).outputs
    for y in outputs:
        assert_close(y, reference.append(0, x))
        x = jnp.tanh(y)


def test_fork_reorder_truncate_reset_keep_rotary_positions():
    layer = modern_layer({"rope": "llama3", "normalize_qk": "rms", "logit_softcap": None, "num_kv_heads": 2,
                          "use_bias": True, "window": None}, batch_size=3)
    reference = ReferenceCache(weights_of(layer), 3)
    xs = stream((3, 8), in_features=D)
    layer.prefill(xs[:, :5], jnp.array([5, 2, 0]))
    for b, length in enumerate([5, 2, 0]):
        for t in range(length):
            reference.append(b, xs[b, t])
    layer.fork(0, [2])
    reference.fork(0, [2])
    layer.reorder(jnp.array([1, 0, 2]))
    reference.reorder([1, 0, 2])
    layer.truncate(jnp.array([2, 3, 4]))
    reference.truncate([2, 3, 4])
    layer.reset([0])
    reference.reset([0])
    y = layer.step(xs[:, 5])
    for b in range(3):
        assert_close(y[b], reference.append(b, xs[b, 5]))


def test_gemma_options_offset_qk_norm_and_query_scale_equal_the_reference():
    """Gemma 3's per-head norm scaled by `1 + scale`, and a logit scale other than 1/sqrt(H), in a ring."""
    layer = modern_layer({"rope": "llama3", "normalize_qk": "rms_offset", "logit_softcap": 3.0, "num_kv_heads": 2,
                          "use_bias": False, "window": 4, "query_scale": 0.3})
    assert float(jnp.abs(layer.query_ln.scale[...] - 1).max()) > 0.1  # perturbed away from the rms form's ones
    reference = ReferenceCache(weights_of(layer), 2, 4)
    xs = stream((2, 9), in_features=D)
    ys = layer.prefill(xs[:, :6])
    for b in range(2):
        for t in range(6):
            assert_close(ys[b, t], reference.append(b, xs[b, t]))
    for t in range(6, 9):
        y = layer.step(xs[:, t])
        for b in range(2):
            assert_close(y[b], reference.append(b, xs[b, t]))
    offset = kvattn.MultiHeadAttention(4, D, max_len=8, normalize_qk="rms_offset", rngs=nnx.Rngs(0))
    assert not offset.query_ln.scale[...].any(), "an offset norm starts at zero: it scales by 1"


def test_a_ring_keeps_counting_rotary_positions_past_its_slots():
    layer = kvattn.MultiHeadAttention(4, D, window=3, rope=RoPE(), rngs=nnx.Rngs(0))
    xs = stream((11,), in_features=D)
    ys = kvattn.decode(layer, xs)
    weights = weights_of(layer)
    for t in range(11):
        start = max(0, t - 2)
        assert_close(ys[t], causal_attention(weights, xs[start : t + 1], start=start)[-1])


def test_snapshots_record_every_option(tmp_path):
    layer = modern_layer({"rope": "yarn", "normalize_qk": True, "logit_softcap": 3.0, "num_kv_heads": 2,
                          "use_bias": ("query", "key", "value"), "window": None})
    layer.prefill(stream((2, 3), in_features=D))
    path = tmp_path / "c.safetensors"
    kvattn.save_cache(layer, path)
    config = kvattn.snapshot_info(path).config
    assert config["rope"]["scaling"]["rope_type"] == "yarn" and config["normalize_qk"] is True
    assert config["use_bias"] == ["key", "query", "value"] and config["logit_softcap"] == 3.0
    same = modern_layer({"rope": "yarn", "normalize_qk": True, "logit_softcap": 3.0, "num_kv_heads": 2,
                         "use_bias": ("query", "key", "value"), "window": None})
    kvattn.load_cache(same, path)
    assert_same_bits(cache_arrays(same), cache_arrays(layer))
    other = modern_layer({"rope": "llama3", "normalize_qk": True, "logit_softcap": 3.0, "num_kv_heads": 2,
                          "use_bias": ("query", "key", "value"), "window": None})
    with pytest.raises(kvattn.SnapshotError, match="differently configured layer: rope="):
        kvattn.load_cache(other, path)


# ------------------------------------------------------ precision and shapes


def test_bfloat16_computation_stays_close_to_the_float32_reference():
    """dtype=bfloat16 runs the projections in bfloat16; softmax stays float32. Measured error bound."""
    layer = perturbed(kvattn.MultiHeadAttention(
        4, D, max_len=16, dtype=jnp.bfloat16, rope=RoPE(), normalize_qk="rms", rngs=nnx.Rngs(0)))
    xs = stream((8,), in_features=D)
    ys = kvattn.decode(layer, xs)
    assert ys.dtype == jnp.bfloat16
    expected = causal_attention(weights_of(layer), xs)
    error = np.abs(np.asarray(ys, np.float64) - expected).max() / np.abs(expected).max()
    assert error < 3e-2


def test_bfloat16_parameters_are_stored_as_such():
    layer = kvattn.MultiHeadAttention(4, D, max_len=8, param_dtype=jnp.bfloat16, normalize_qk=True, rngs=nnx.Rngs(0))
    assert layer.query.kernel[...].dtype == jnp.bfloat16 and layer.query_ln.scale[...].dtype == jnp.bfloat16
    assert layer.step(jnp.ones(D)).dtype == jnp.float32  # promoted with the float32 input, as in Flax


def test_flax_shape_options():
    """qkv_features, out_features, out_kernel_init/out_bias_init, biases per projection, leading batch axes."""
    layer = kvattn.MultiHeadAttention(
        2, 3, qkv_features=6, out_features=5, max_len=8, use_bias=("query", "key", "value"),
        out_kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(0),
    )
    assert layer.head_dim == 3 and layer.out.kernel[...].shape == (2, 3, 5) and layer.out.bias is None
    np.testing.assert_array_equal(layer.out.kernel[...], 1.0)
    xs = jax.random.normal(jax.random.key(0), (2, 3, 7, 3))
    ys = layer(xs)
    assert ys.shape == (2, 3, 7, 5)
    assert_close(ys[1, 2], causal_attention(weights_of(layer), xs[1, 2]))
    assert layer.prefill(xs[0, 0]).shape == (7, 5)
    with pytest.raises(ValueError, match=r"qkv_features \(6\) must equal num_heads \* head_dim \(2 \* 2\)"):
        kvattn.MultiHeadAttention(2, 3, qkv_features=6, head_dim=2, max_len=8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="use_bias names projections among"):
        kvattn.MultiHeadAttention(2, 4, max_len=8, use_bias=("q",), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="RoPE rotary_dim"):
        kvattn.MultiHeadAttention(2, 4, max_len=8, rope=RoPE(rotary_dim=4), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="RoPE scaling of rope_type 'yarn' needs"):
        RoPE(scaling={"rope_type": "yarn", "factor": 2.0})


# ----------------------------------------------------- Flax's own tests, ported


def flax_twin(layer, **kwargs):
    """`nnx.MultiHeadAttention` holding the kvattn layer's weights (same paths and shapes)."""
    twin = nnx.MultiHeadAttention(
        layer.num_heads, layer.in_features, qkv_features=layer.qkv_features, out_features=layer.out_features,
        decode=False, rngs=nnx.Rngs(1), **kwargs,
    )
    nnx.update(twin, nnx.state(layer, nnx.Param))
    return twin


def test_flax_basic_shapes():
    """Flax's `test_basic`: qkv_features=6, out_features=6 on (1, 7, 3)."""
    layer = kvattn.MultiHeadAttention(2, 3, qkv_features=6, out_features=6, max_len=8, rngs=nnx.Rngs(0))
    assert layer(jnp.ones((1, 7, 3))).shape == (1, 7, 6)


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("normalize_qk", [True, False])
@pytest.mark.parametrize("dtype, param_dtype", [(None, jnp.float32), (jnp.float16, jnp.float32), (None, jnp.float16)])
def test_flax_attention_equivalence(use_bias, normalize_qk, dtype, param_dtype):
    """Flax's `test_nnx_attention_equivalence`, against kvattn: the same weights give Flax's causal outputs."""
    layer = kvattn.MultiHeadAttention(
        2, 3, qkv_features=6, out_features=6, max_len=8, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
        normalize_qk=normalize_qk, rngs=nnx.Rngs(42),
    )
    twin = flax_twin(layer, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, normalize_qk=normalize_qk)
    xs = jax.random.normal(jax.random.key(0), (2, 5, 3)).astype(param_dtype)
    expected = twin(xs, mask=nnx.make_causal_mask(jnp.ones((2, 5))), decode=False)
    got = layer(xs)
    assert got.dtype == expected.dtype
    # Flax's softmax runs in the computation dtype, kvattn's in float32: half precision differs by its rounding.
    tolerance = 1e-5 if (dtype or param_dtype) == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), atol=tolerance, rtol=tolerance)
    # And the cache agrees with the uncached forward.
    cached = jnp.stack([layer.step(x) for x in xs[0]])
    np.testing.assert_allclose(np.asarray(cached, np.float32), np.asarray(got[0], np.float32), atol=tolerance, rtol=tolerance)


def test_flax_autoregressive_decode_with_x64():
    """Flax's `test_autoregressive_decode_with_x64`: decoding works with x64 enabled."""
    with jax.enable_x64(True):
        layer = kvattn.MultiHeadAttention(2, 4, qkv_features=4, max_len=4, batch_size=1, rngs=nnx.Rngs(0))
        x = jnp.ones((1, 4, 4))
        assert layer.k_cache[...].shape == (1, 4, 2, 2)
        y1, y2 = layer.step(x[:, 0]), layer.step(x[:, 1])
        assert y1.shape == y2.shape == (1, 4)
        assert np.asarray(layer.pos[...]).tolist() == [2]


def test_complex_inputs_are_refused_clearly():
    layer = kvattn.MultiHeadAttention(2, 4, max_len=4, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="xs must have a floating dtype, got complex64"):
        layer(jnp.ones((3, 4), jnp.complex64))


@pytest.mark.parametrize("decode_kernel", ["xla", "auto"])
@pytest.mark.parametrize("write_first", [False, True], ids=["read first", "written first"])
def test_a_nan_token_in_a_prefill_reaches_no_earlier_token(decode_kernel, write_first):
    """A NaN hidden state at token 3 of a prefill: tokens 0-2 get what a prefill of them alone gets, the rest NaN.

    `"auto"` takes the native prefill kernel where it runs (heads-major float32), `"xla"` the XLA twin. A
    `Decoder` writes the chunk before it reads it.
    """
    layer = kvattn.MultiHeadAttention(2, 32, max_len=16, batch_size=1, cache_layout="heads_major",
                                      decode_kernel=decode_kernel, rngs=nnx.Rngs(0))  # head_dim 16: the kernel's
    xs = jax.random.normal(jax.random.key(1), (1, 8, 32)).at[0, 3].set(jnp.nan)
    def prefill(xs):
        layer.reset()
        return np.asarray(kvattn.Decoder(layer).prefill(xs) if write_first else layer.prefill(xs))

    alone, got = prefill(xs[:, :3]), prefill(xs)
    # Equal but for rounding: XLA:CPU may tile a dot of 3 rows and one of 8 differently (on AVX2, it does).
    np.testing.assert_allclose(got[0, :3], alone[0], rtol=1e-5, atol=1e-6)
    assert np.isnan(got[0, 3:]).all()
