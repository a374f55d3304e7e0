"""4-bit weights (`kvattn.math.int4`): the group quantizer, its packing, the dot, and models built on them.

The dot is checked against the float64 product of its own operands: `x`'s
rows quantized as `dense` quantizes them, and the kernel the 4-bit values
and group scales stand for (each group's int32 sum is exact, so only the
scaling and the float32 sum over groups round). A model with
`weights="int4"` is checked against a float32 model holding the kernels its
4-bit values stand for, and its cached decoding against its own forward.
"""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given

from kvattn import models
from kvattn.rotary import RoPE
from kvattn.kernels import dots, native, route
from kvattn.math import int4, quant
from kvattn.models import ModelConfig, layers
from kvattn.models.layers import Linear
from tests.helpers import FIXTURES, assert_decodes_as_its_forward, expected


def _kernel(inputs=64, features=(3, 16), seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((inputs, *features)) * rng.uniform(0.1, 4, (inputs, *features))).astype(np.float32)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_each_weight_is_within_half_a_step_of_its_group_and_the_largest_is_stored_as_minus_8(group):
    kernel = _kernel(128, (3, 5))
    kernel[:32, 1, 2] = 0  # a group of zeros
    weights = int4.quantize_groups(kernel, group)
    assert weights.packed.dtype == np.uint8 and weights.packed.shape == (3, 5, 64)
    assert weights.scale.dtype == jnp.bfloat16 and weights.scale.shape == (3, 5, 128 // group)
    assert weights.features == (3, 5) and weights.inputs == 128 and weights.group == group
    values = np.asarray(weights.values()).reshape(3, 5, -1, group)
    scale = np.asarray(weights.scale, np.float32)[..., None]
    grouped = np.moveaxis(kernel, 0, -1).reshape(3, 5, -1, group)
    step = np.abs(scale)
    # Half a step, but for values past 7.5 steps on the other side of the largest (at most one step: 7 of 8).
    ratio = np.divide(grouped, scale, out=np.zeros_like(grouped), where=scale != 0)
    bound = np.where(ratio > 7.5, step, step / 2) + 1e-6
    assert (np.abs(values * scale - grouped) <= bound).all()
    largest = np.argmax(np.abs(grouped), axis=-1)[..., None]
    nonzero = np.take_along_axis(grouped, largest, -1) != 0
    assert (np.take_along_axis(values, largest, -1)[nonzero] == -8).all()
    if group == 32:
        assert float(weights.scale[1, 2, 0]) == 0 and not np.asarray(weights.values())[1, 2, :32].any()
    # Outputs are independent: parts quantized apart are the whole quantized (what loading relies on).
    parts = [int4.quantize_groups(kernel[:, :1], group), int4.quantize_groups(kernel[:, 1:], group)]
    np.testing.assert_array_equal(np.concatenate([p.packed for p in parts]), weights.packed)
    np.testing.assert_array_equal(np.concatenate([p.scale for p in parts]), weights.scale)
    # JAX quantizes to the same bits as NumPy.
    traced = jax.jit(functools.partial(int4.quantize_groups, group=group))(jnp.asarray(kernel))
    np.testing.assert_array_equal(np.asarray(traced.packed), weights.packed)
    np.testing.assert_array_equal(np.asarray(traced.scale).view(np.uint16), weights.scale.view(np.uint16))


@given(st.integers(1, 3), st.integers(1, 4), st.integers(0, 2**16))
def test_packing_holds_every_value_in_q4_0_order(outputs, blocks, seed):
    values = np.random.default_rng(seed).integers(-8, 8, (outputs, 32 * blocks)).astype(np.int8)
    packed = int4.pack(values)
    assert packed.dtype == np.uint8 and packed.shape == (outputs, 16 * blocks)
    np.testing.assert_array_equal(np.asarray(int4.unpack(packed)), values)
    np.testing.assert_array_equal(np.asarray(int4.pack(jnp.asarray(values))), packed)
    # Byte i of a block: input i in the low nibble, input i + 16 in the high one, each biased by 8.
    np.testing.assert_array_equal(packed[:, :16] & 0xF, values[:, :16] + 8)
    np.testing.assert_array_equal(packed[:, :16] >> 4, values[:, 16:32] + 8)


FORMS = [int4.Int4Weights, int4.TiledInt4Weights]


@pytest.mark.parametrize("form", FORMS)
def test_the_form_gives_back_its_kernel_its_stored_arrays_and_its_rows(form):
    kernel = _kernel(64, (2, 16))
    weights = form.from_float(kernel, (2, 16), np.float32)
    back = np.asarray(weights.to_float())
    assert back.shape == (64, 2, 16) and np.abs(back - kernel).max() <= np.abs(kernel).max() / 8
    np.testing.assert_array_equal(back, np.asarray(int4.quantize_groups(kernel).to_float()))  # the layout only
    main, scale = weights.stored()
    again = form.from_stored(jnp.asarray(main), jnp.asarray(scale), (2, 16))
    np.testing.assert_array_equal(np.asarray(again.to_float()), back)
    table = form.from_float(_kernel(64, (40,)), (40,), np.float32)
    ids = jnp.asarray([[0, 39], [17, 17]])
    got = np.asarray(jax.jit(table.rows, static_argnums=1)(ids, jnp.float32))
    np.testing.assert_array_equal(got, np.asarray(table.to_float()).T[np.asarray(ids)])
    blank = form.blank((64,), (2, 16), np.float32)
    assert [a.shape for a in blank.stored()] == [a.shape for a in weights.stored()]
    assert not np.asarray(blank.to_float()).any()


def test_tiles_hold_eight_outputs_blocks_side_by_side_and_untile_back():
    weights = int4.quantize_groups(_kernel(64, (3, 8)))
    tiled = int4.tile(weights)
    assert tiled.tiles.shape == (3, 2, 8, 16) and tiled.scale.shape == (3, 2, 8) and tiled.features == (3, 8)
    packed = weights.packed.reshape(24, 2, 16)
    np.testing.assert_array_equal(tiled.tiles[1, 1, 5], packed[13, 1])  # output 8 + 5, block 1
    scales = weights.scale.reshape(24, 2).view(np.uint16)
    np.testing.assert_array_equal(tiled.scale[2, 0].view(np.uint16), scales[16:, 0])
    for back in (int4.untile(tiled), int4.untile(int4.tile(jax.tree.map(jnp.asarray, weights)))):
        np.testing.assert_array_equal(np.asarray(back.packed), weights.packed)
        np.testing.assert_array_equal(np.asarray(back.scale).view(np.uint16), weights.scale.view(np.uint16))
    with pytest.raises(ValueError, match="outputs in whole tiles of 8, got 12"):
        int4.tile(int4.quantize_groups(_kernel(64, (12,))))


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3)])
def test_the_dot_is_the_float64_product_of_what_it_holds(lead, group, tiled):
    weights = int4.quantize_groups(_kernel(256, (3, 16), seed=4), group)
    weights = int4.tile(weights) if tiled else weights
    x = jax.random.normal(jax.random.key(5), (*lead, 256))
    got = np.asarray(jax.jit(dots.dense)(x, weights), np.float64)
    assert got.shape == (*lead, 3, 16)
    values, row_scale = quant.quantize_rows(np.asarray(x).reshape(-1, 256))
    rows = values.astype(np.float64) * row_scale
    want = (rows @ np.asarray(weights.to_float(), np.float64).reshape(256, -1)).reshape(*lead, 3, 16)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_zero_row_gives_zeros_and_non_finite_values_stay_non_finite_alone():
    kernel = _kernel(64, (4,), seed=6)
    kernel[40, 1] = np.inf
    weights = int4.quantize_groups(kernel)
    assert not np.isfinite(np.asarray(weights.scale, np.float32)[1, 1]) and np.isfinite(
        np.asarray(weights.scale, np.float32)[[0, 2, 3]]).all()
    x = np.random.default_rng(7).standard_normal((3, 64)).astype(np.float32)
    x[0], x[2, 5] = 0, np.nan
    y = np.asarray(jax.jit(dots.dense)(jnp.asarray(x), weights))
    assert (y[0, [0, 2, 3]] == 0).all() and np.isnan(y[:, 1]).all()
    assert np.isfinite(y[1, [0, 2, 3]]).all() and np.isnan(y[2]).all()


def test_what_4_bit_groups_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="floating-point kernel, got int32"):
        int4.quantize_groups(np.ones((32, 4), np.int32))
    with pytest.raises(ValueError, match="inputs divisible by the group, a multiple of 32; got 48 inputs in groups "
                                         "of 32"):
        int4.quantize_groups(np.ones((48, 4), np.float32))
    with pytest.raises(ValueError, match="got 64 inputs in groups of 16"):
        int4.quantize_groups(np.ones((64, 4), np.float32), group=16)
    with pytest.raises(ValueError, match="at least one output"):
        int4.quantize_groups(np.ones((64, 0), np.float32))


@given(st.sampled_from([(32,), (64,), (2, 32)]), st.sampled_from([(), (4,), (3, 8)]), st.integers(1, 5),
       st.integers(1, 4096), st.integers(0, 2**16), st.booleans())
def test_stored_a_slice_at_a_time_the_form_is_the_whole_form_bit_for_bit(inputs, inner, first, slice_bytes, seed,
                                                                         joined):
    """As `tests/models/test_layers.py` checks the other forms: from slices of outputs (of a fused kernel's parts
    too, a `Joined`), the form of the whole kernel, rows and tiles."""
    for form in FORMS:
        _stored_a_slice_at_a_time(form, inputs, inner, first, slice_bytes, seed, joined)


def _stored_a_slice_at_a_time(form, inputs, inner, first, slice_bytes, seed, joined):
    features = (first * 16, *inner)
    kernel = np.random.default_rng(seed).standard_normal((*inputs, *features)).astype(np.float32)
    want = form.from_float(kernel, features, np.float32)
    source = kernel
    if joined and len(inputs) == 1:
        cut = sorted({0, features[0] // 3, features[0]})
        source = layers.tensors.Joined([kernel[:, a:b] for a, b in zip(cut, cut[1:]) if a < b], 1)
    saved, layers.tensors.SLICE_BYTES = layers.tensors.SLICE_BYTES, slice_bytes
    try:
        got = layers.stored_form(form, source, features, np.float32)
    finally:
        layers.tensors.SLICE_BYTES = saved
    for a, b in zip(got.stored(), want.stored(), strict=True):
        assert isinstance(a, np.ndarray) and a.ctypes.data % 64 == 0 and a.dtype == b.dtype
        np.testing.assert_array_equal(a.view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


# ------------------------------------------------------------------ models

CONFIG = ModelConfig(family="llama", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, intermediate_size=128, norm_eps=1e-5, tie_embeddings=True,
                     max_position_embeddings=32, rope=RoPE(theta=10000.0))


def _initialised(weights):
    """The same LeCun-normal weights (one seed) in `weights`' form: a model of ordinary gain."""
    return models.CausalLM(CONFIG, max_len=16, weights=weights, rngs=nnx.Rngs(0))


def _dequantized(compact):
    """A float32 model holding exactly the kernels (and the tied table) `compact`'s 4-bit values stand for."""
    twin = _initialised(None)
    for path, module in nnx.iter_graph(compact):
        if isinstance(module, Linear):
            twin.load_weight("/".join(map(str, path)) + "/kernel", np.asarray(module.float_kernel()))
    twin.load_weight("embed", np.asarray(compact.table.to_float()).T)
    return twin


@nnx.jit
def full_forward(model, tokens):
    return model(tokens)


def _error(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_an_int4_model_computes_what_its_dequantized_kernels_do_but_for_its_rows_rounding_to_int8():
    """Every projection and the tied head, wired to the right groups: off the float32 model holding the
    dequantized kernels by the activations' int8 rounding only (what int8 weights also pay, ~1% here), and off
    float32 by the 4-bit rounding (~11% of the largest logit here; int8 ~1%)."""
    compact, full = _initialised("int4"), _initialised(None)
    tiled = route.use_int4_tiles(CONFIG.vocab_size)
    assert compact.embed_form is (int4.TiledInt4Weights if tiled else int4.Int4Weights)
    tokens = jax.random.randint(jax.random.key(1), (3, 12), 0, CONFIG.vocab_size)
    got, want = np.asarray(full_forward(compact, tokens)), np.asarray(full_forward(_dequantized(compact), tokens))
    assert _error(got, want) < 0.03
    assert _error(got, np.asarray(full_forward(full, tokens))) < 0.25


@functools.cache
def _fixture(family: str):
    make = functools.partial(models.from_pretrained, FIXTURES / family, max_len=16, batch_size=3)
    return expected(family), make(), make(weights="int4")


def test_an_int4_checkpoint_holds_4_bit_kernels_and_decodes_through_its_caches_as_its_forward_computes():
    """qwen2 from its checkpoint: a tied head (the embedding table is its int4 kernel) and the fused bias."""
    want, full, model = _fixture("qwen2")
    params = [{"/".join(map(str, k)): v[...] for k, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}
              for m in (full, model)]
    kernels = [name for name in params[1] if name.endswith("kernel") or name == "embed"]
    assert "embed" in kernels and {params[1][name].dtype for name in kernels} == {jnp.dtype(jnp.uint8)}
    # 4 bits a weight and a bfloat16 scale per 32 inputs: 4.5 bits, against float32's 32.
    packed = sum(params[1][name].nbytes + params[1][f"{name}_scale"].nbytes for name in kernels)
    assert packed * 64 == sum(params[0][name].nbytes for name in kernels) * 9
    assert_decodes_as_its_forward(model, want, full_forward)


@pytest.mark.parametrize("tiled", [False, True])
def test_the_dot_on_xla_computes_what_the_native_dot_does(monkeypatch, tiled):
    """Where the native 4-bit dot cannot run (another backend, a CPU without AVX2), XLA's twin runs instead."""
    weights = int4.quantize_groups(_kernel(128, (40,), seed=8))
    weights = int4.tile(weights) if tiled else weights
    x = jax.random.normal(jax.random.key(9), (5, 128))
    here = np.asarray(jax.jit(lambda x, w: dots.dense(x, w))(x, weights))
    monkeypatch.setattr(native, "available", lambda target=None: False)
    twin = np.asarray(jax.jit(lambda x, w: dots.dense(x, w))(x, weights))  # a new function: traced again
    np.testing.assert_allclose(twin, here, rtol=1e-5, atol=1e-5)
