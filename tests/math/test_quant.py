"""Compact weights: int8 kernels and their dots (`kvattn.math.quant`), and models built on them.

The int8 dot is checked against the float64 product of its own quantized
operands (int32 accumulation is exact, so only the final rescale rounds); a
model with `weights="int8"` against its float32 twin on transformers'
fixtures, within the error torch's own dynamic int8 quantization makes on
them. jax issue 39103 (YNNPACK returning wrong rows past 32768 for a dot
followed by a reduction in one fusion, jaxlib 0.10.2) is pinned on the
paths kvattn compiles: projection then norm, in float32 and int8.

Where kvattn's native int8 dot runs (AVX2 or AVX512-VNNI), kernels are stored tiled
for it: a tiled model must compute what the untiled one does, bit for bit
(the dot itself is held to XLA's exact int32 products in the native
kernels' harness, `tests/kernels/test_native.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn import generation, models
from kvattn.config import AttentionConfig, RoPE
from kvattn.kernels import dots, native, route
from kvattn.layer import forward
from kvattn.math import norms, quant
from kvattn.models import ModelConfig
from kvattn.models.layers import Linear, RMSNorm
from tests.helpers import FIXTURES, assert_decodes_as_its_forward, expected

# The largest logit error (a share of the largest float32 logit, over the fixture's prompts) of transformers
# under torch.ao.quantization.quantize_dynamic(Linear, qint8), torch 2.13, against its own float32 run;
# measured by `python -m benchmarks.quant_accuracy`. kvattn's int8 must stay within 1.5x of it.
TORCH_INT8_ERROR = {"llama": 0.253, "qwen2": 0.126}


def test_quantize_keeps_each_output_channel_within_half_its_step():
    kernel = np.random.default_rng(0).standard_normal((32, 3, 5), np.float32) * np.arange(1, 16).reshape(1, 3, 5)
    kernel[:, 1, 2] = 0  # a channel of zeros
    int8 = quant.quantize(kernel)
    assert int8.values.dtype == jnp.int8 and int8.values.shape == (3, 5, 32) and int8.scale.shape == (3, 5)
    error = np.abs(np.moveaxis(int8.values * int8.scale[..., None], -1, 0) - kernel)
    assert (error <= np.asarray(int8.scale)[None] / 2 + 1e-7).all()
    assert float(int8.scale[1, 2]) == 1.0 and not np.asarray(int8.values[1, 2]).any()
    # Channels are independent: parts quantized apart are the whole quantized (what loading relies on).
    parts = [quant.quantize(kernel[:, :1]), quant.quantize(kernel[:, 1:])]
    np.testing.assert_array_equal(np.concatenate([p.values for p in parts]), int8.values)
    np.testing.assert_array_equal(np.concatenate([p.scale for p in parts]), int8.scale)


def test_quantize_refuses_what_int8_cannot_hold():
    with pytest.raises(ValueError, match="floating-point kernel, got int32"):
        quant.quantize(np.ones((4, 4), np.int32))
    with pytest.raises(ValueError, match=f"at most {quant.INT8_MAX_FEATURES} products"):
        quant.quantize(np.zeros((quant.INT8_MAX_FEATURES + 1, 1), np.float32))


@pytest.mark.parametrize("form", ["values", "tiles"])
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3)])
def test_an_int8_dot_is_the_exact_product_of_its_quantized_operands(lead, form):
    """One row (padded to two inside XLA's path), several, and several leading axes: the same exact products."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((*lead, 48), np.float32))
    int8 = quant.quantize(rng.standard_normal((48, 4, 8), np.float32))
    kernel = int8 if form == "values" else quant.tile(int8)
    got = np.asarray(jax.jit(dots.dense)(x, kernel))
    values, scale = quant.quantize_rows(np.asarray(x).reshape(-1, 48))
    products = np.asarray(values, np.int64) @ np.asarray(int8.values, np.int64).reshape(32, 48).T
    want = products * np.asarray(scale, np.float64) * np.asarray(int8.scale, np.float64).reshape(1, 32)
    np.testing.assert_allclose(got.reshape(-1, 32), want, rtol=1e-6, atol=0)
    assert got.shape == (*lead, 4, 8) and got.dtype == x.dtype
    # Against the float kernel: off by the quantization steps only.
    exact = np.asarray(x, np.float64).reshape(-1, 48) @ np.asarray(quant.dequantize(kernel), np.float64).reshape(48, 32)
    assert np.abs(got.reshape(-1, 32) - exact).max() < 0.02 * np.abs(exact).max()


# ------------------------------------------------------------------ the native int8 dot and tiled kernels

needs_native = pytest.mark.skipif(not native.available(native.INT8_DOT),
                                  reason="the native int8 dot is not built or cannot run here")
# The native dots the forms are chosen for: the int8 dot (tiles) and the float32 and bfloat16 ones (panels).
NATIVE_DOTS = all(native.available(target) for target in (native.INT8_DOT, native.F32_DOT, native.BF16_DOT))


def test_tiles_hold_the_values_and_give_them_back():
    rng = np.random.default_rng(4)
    int8 = quant.quantize(rng.standard_normal((12, 2, 16), np.float32))
    tiled = quant.tile(int8)
    assert tiled.tiles.shape == (2, 3, 16, 4) and tiled.tiles.dtype == np.uint8 and tiled.inputs == 12
    # Tile 1, group 2, lane 5: output 16 + 5 = (1, 5), inputs 8..11, stored + 128.
    np.testing.assert_array_equal(tiled.tiles[1, 2, 5].astype(int) - 128, int8.values[1, 5, 8:12])
    np.testing.assert_array_equal(quant.untile(tiled).values, int8.values)
    on_device = quant.tile(quant.Int8Weights(jnp.asarray(int8.values), jnp.asarray(int8.scale)))
    np.testing.assert_array_equal(np.asarray(on_device.tiles), tiled.tiles)
    table = quant.Int8Weights(int8.values.reshape(32, 12), int8.scale.reshape(32))
    ids = jnp.asarray([[0, 31, 17], [16, 5, 5]])
    np.testing.assert_array_equal(quant.rows(quant.tile(table), ids), np.asarray(table.values)[np.asarray(ids)])
    with pytest.raises(ValueError, match="outputs divisible by 16 and inputs by 4, got 24 outputs and 12 inputs"):
        quant.tile(quant.quantize(rng.standard_normal((12, 24), np.float32)))
    assert quant.can_tile(32, 12) and not quant.can_tile(50257, 768) and not quant.can_tile(32, 10)


def test_tile_and_quantize_refuse_what_a_tiled_kernel_cannot_represent():
    """Wider ints would wrap (300 -> 44), floats truncate (1.7 -> 1), and no inputs would give no tiles."""
    scale = np.ones(16, np.float32)
    for dtype in (np.int16, np.float32):
        with pytest.raises(TypeError, match=f"holds int8 values, got {np.dtype(dtype)}"):
            quant.tile(quant.Int8Weights(np.full((16, 4), 300 if dtype == np.int16 else 1.7, dtype), scale))
    with pytest.raises(ValueError, match="at least one output and one input, got 16 and 0"):
        quant.tile(quant.Int8Weights(np.zeros((16, 0), np.int8), scale))
    with pytest.raises(ValueError, match=r"at least one input and output, got \(0, 16\)"):
        quant.quantize(np.zeros((0, 16), np.float32))
    assert not quant.can_tile(16, 0) and not quant.can_tile(0, 4)


def test_rows_refuses_ids_outside_the_kernel_and_both_forms_agree_when_traced():
    table = quant.quantize(np.random.default_rng(6).standard_normal((12, 32), np.float32))
    for kernel in (table, quant.tile(table)):
        for ids in ([0, 32], [-1, 3]):
            with pytest.raises(IndexError, match=r"ids in 0 \.\. 31 \(the kernel's outputs\), got"):
                quant.rows(kernel, np.asarray(ids))
        with pytest.raises(TypeError, match="integer ids, got float32"):
            quant.rows(kernel, np.asarray([1.0], np.float32))
    traced = [jax.jit(quant.rows)(kernel, jnp.asarray([-3, 40, 5])) for kernel in (table, quant.tile(table))]
    np.testing.assert_array_equal(traced[0], table.values[[0, 31, 5]])
    np.testing.assert_array_equal(traced[1], traced[0])


def test_a_tiled_kernel_reads_the_same_through_xla_without_the_native_dot(monkeypatch):
    rng = np.random.default_rng(9)
    int8 = quant.quantize(rng.standard_normal((20, 48), np.float32))
    x = jnp.asarray(rng.standard_normal((3, 20), np.float32))
    want = np.asarray(jax.jit(lambda x, k: dots.dense(x, k))(x, int8))
    monkeypatch.setattr(native, "available", lambda kernel=None: False)
    assert not route.use_tiles(48, 20)
    np.testing.assert_array_equal(jax.jit(lambda x, k: dots.dense(x, k))(x, quant.tile(int8)), want)


def test_a_zero_row_gives_zeros_and_a_non_finite_row_stays_non_finite_alone():
    rng = np.random.default_rng(3)
    int8 = quant.quantize(rng.standard_normal((16, 8), np.float32))
    x = rng.standard_normal((3, 16), np.float32)
    x[0], x[2, 5] = 0, np.nan
    y = np.asarray(jax.jit(dots.dense)(jnp.asarray(x), int8))
    assert (y[0] == 0).all() and np.isfinite(y[1]).all() and np.isnan(y[2]).all()


# ------------------------------------------------------------------ the storage forms, each against float64

FORMS = [quant.FloatWeights, quant.TableWeights, quant.PanelWeights, quant.Int8Weights, quant.TiledInt8Weights]
INT8_FORMS = (quant.Int8Weights, quant.TiledInt8Weights)


def _form_of(form, features=(32,), seed=21):
    """A float32 kernel `(48, *features)` and `form` built from it."""
    kernel = (np.random.default_rng(seed).standard_normal((48, *features)) / 4).astype(np.float32)
    return kernel, form.from_float(kernel, features, np.float32)


@pytest.mark.parametrize("form", FORMS, ids=lambda form: form.__name__)
def test_a_form_gives_back_its_kernel_and_its_stored_arrays(form):
    """Exactly for the float forms; within half a step per output for int8, its scales the channels' max / 127."""
    for features in ((32,), (2, 16)) if form is not quant.TableWeights else ((32,),):
        kernel, weights = _form_of(form, features)
        assert isinstance(weights, form) and weights.features == features and weights.inputs == 48
        back = np.asarray(weights.to_float(), np.float64)
        assert back.shape == (48, *features)
        if form in INT8_FORMS:
            scale = np.abs(kernel).max(0) / 127
            np.testing.assert_allclose(np.asarray(weights.scale), scale, rtol=1e-6)
            assert (np.abs(back - kernel) <= scale / 2 + 1e-7).all()
        else:
            np.testing.assert_array_equal(back, kernel)
        main, scale = weights.stored()
        again = form.from_stored(jnp.asarray(main), None if scale is None else jnp.asarray(scale), features)
        assert type(again) is form and (scale is None) == (form not in INT8_FORMS)
        np.testing.assert_array_equal(np.asarray(again.to_float()), np.asarray(weights.to_float()))


@pytest.mark.parametrize("form", FORMS, ids=lambda form: form.__name__)
def test_dense_of_every_form_is_the_float64_product_of_what_it_holds(form):
    """Float forms: the float64 product of x and the kernel, to float32 rounding. Int8 forms: the float64 product
    of x's rows quantized as `dense` quantizes them and the dequantized kernel, to the final rescale's rounding."""
    _, weights = _form_of(form)
    x = jax.random.normal(jax.random.key(22), (2, 3, 48))
    got = np.asarray(jax.jit(dots.dense)(x, weights), np.float64)
    assert got.shape == (2, 3, 32)
    rows = np.asarray(x, np.float64).reshape(-1, 48)
    if form in INT8_FORMS:
        values, row_scale = quant.quantize_rows(np.asarray(x).reshape(-1, 48))
        rows = values.astype(np.float64) * row_scale
    want = (rows @ np.asarray(weights.to_float(), np.float64)).reshape(2, 3, 32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("form", FORMS, ids=lambda form: form.__name__)
def test_rows_of_a_form_are_its_float_kernel_s_columns(form):
    """An embedding's lookup: output t's inputs, exactly the float kernel's column t; a form without rows says so."""
    _, weights = _form_of(form)
    ids = jnp.asarray([[0, 31], [17, 17]])
    if form is quant.FloatWeights:
        with pytest.raises(TypeError, match="a FloatWeights stores no rows"):
            weights.rows(ids, jnp.float32)
        return
    got = np.asarray(jax.jit(weights.rows, static_argnums=1)(ids, jnp.float32))
    np.testing.assert_array_equal(got, np.asarray(weights.to_float(), np.float64).T[np.asarray(ids)])


@pytest.mark.parametrize("native_runs", [True, False])
@pytest.mark.parametrize("weights", [None, "int8", "bfloat16"])
def test_linear_and_the_embedding_hold_one_form_each_the_one_the_dots_here_say(weights, native_runs, monkeypatch):
    if not native_runs:
        monkeypatch.setattr(native, "available", lambda kernel=None: False)
    elif not NATIVE_DOTS:
        pytest.skip("the native dots are not built or cannot run here")
    compact = weights == "int8"
    for dtype in (jnp.float32, jnp.bfloat16):
        for inputs, outputs in (((64,), (96,)), ((2, 16), (48,)), ((64,), (40,)), ((6,), (32,))):
            linear = Linear(inputs, outputs, bias=False, dtype=dtype, weights=weights, rngs=None)
            out, fan_in = int(np.prod(outputs)), int(np.prod(inputs))
            if compact:
                want = quant.TiledInt8Weights if route.use_tiles(out, fan_in) else quant.Int8Weights
            elif weights == "bfloat16":  # stored in bfloat16 whatever the model computes in
                want = quant.PanelWeights if route.use_panels(out, jnp.bfloat16) else quant.FloatWeights
                assert linear.kernel[...].dtype == jnp.bfloat16
            else:  # a model computing in bfloat16 keeps XLA's dot (the bfloat16 panel dot sums in float32)
                paneled = dtype == jnp.float32 and route.use_panels(out, dtype)
                want = quant.PanelWeights if paneled else quant.FloatWeights
            assert linear.form is want, (dtype, inputs, outputs)
            held = [value for value in vars(linear).values() if isinstance(value, type) and issubclass(value, quant.Form)]
            assert held == [want] and isinstance(linear.weight, want)
            assert not any(name in vars(linear) for name in ("tiled", "paneled"))
    for tied in (False, True):
        config = ModelConfig(family="llama", vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=16, intermediate_size=48, norm_eps=1e-5, tie_embeddings=tied,
                             max_position_embeddings=16, rope=RoPE(theta=10000.0))
        model = models.CausalLM(config, max_len=8, weights=weights)
        if not tied:
            want = quant.TableWeights
        elif compact:
            want = quant.TiledInt8Weights if route.use_tiles(64, 32) else quant.Int8Weights
        else:
            stored = jnp.bfloat16 if weights == "bfloat16" else jnp.float32
            want = quant.PanelWeights if route.use_panels(64, stored) else quant.TableWeights
        assert model.embed_form is want and isinstance(model.table, want)
        assert (model.embed_scale is not None) == (want in INT8_FORMS)
        assert (model.lm_head is None) == tied


# ------------------------------------------------------------------ jax issue 39103

ROWS = 40_000  # past 32768, the row from which YNNPACK's wrong results began


def _rows_agree(program, args, tail: slice):
    """`program` over all rows, against the same program over `tail`'s rows alone (a shape the bug never hit)."""
    whole = np.asarray(jax.jit(program)(*args))
    alone = np.asarray(jax.jit(program)(*(a[tail] for a in args[:1]), *args[1:]))
    np.testing.assert_allclose(whole[tail], alone, rtol=1e-5, atol=1e-6)
    return whole


@pytest.mark.parametrize("form", ["float32", "float32 panels", "int8", "int8 tiled"])
def test_a_projection_then_a_norm_is_right_past_32768_rows(form, monkeypatch):
    """The decoder's Linear and RMSNorm: XLA:CPU fuses the float32 pair into one YNNPACK fusion (dot, reduce)."""
    compact = form.startswith("int8")
    if form in ("float32", "int8"):  # XLA's dots, as where the native ones cannot run
        monkeypatch.setattr(native, "available", lambda kernel=None: False)
    elif not NATIVE_DOTS:
        pytest.skip("the native dots are not built or cannot run here")
    linear = Linear((64,), (96,), bias=False, dtype=jnp.float32, weights="int8" if compact else None,
                    rngs=nnx.Rngs(0))
    forms = {"float32": quant.FloatWeights, "float32 panels": quant.PanelWeights, "int8": quant.Int8Weights,
             "int8 tiled": quant.TiledInt8Weights}
    assert linear.form is forms[form] and isinstance(linear.weight, forms[form])
    norm = RMSNorm(96, 1e-6, jnp.float32)
    x = jax.random.normal(jax.random.key(5), (ROWS, 64))
    got = _rows_agree(lambda x, kernel: norms.rms_norm(dots.dense(x, kernel), norm.weight[...], 1e-6),
                      (x, linear.weight), slice(32_760, 32_800))
    kernel = linear.weight.to_float()
    y = np.asarray(x, np.float64) @ np.asarray(kernel, np.float64)
    want = y / np.sqrt((y * y).mean(-1, keepdims=True) + 1e-6)
    tolerance = 1e-5 if not compact else 0.05  # int8 activations round each row to its own 1/127 steps
    assert np.abs(got[32_768:] - want[32_768:]).max() < tolerance * np.abs(want).max()


def test_qk_norm_projections_are_right_past_32768_tokens():
    """The layer's projection of every token, then RMS QK-norm per head: a vmapped mat-vec and a reduction."""
    config = AttentionConfig(2, 16, max_len=8, head_dim=8, normalize_qk="rms")
    weights = kvattn.MultiHeadAttention(2, 16, max_len=8, head_dim=8, normalize_qk="rms", rngs=nnx.Rngs(0)).weights
    x = jax.random.normal(jax.random.key(6), (1, ROWS, 16))
    positions = jnp.zeros((1, ROWS), jnp.int32)

    def queries(x, weights):
        return forward.attention_inputs(config, weights.fused(), x, positions[:, : x.shape[1]])[0]

    whole = np.asarray(jax.jit(queries)(x, weights))
    alone = np.asarray(jax.jit(queries)(x[:, 32_760:32_800], weights))
    np.testing.assert_allclose(whole[:, 32_760:32_800], alone, rtol=1e-5, atol=1e-6)
    q = np.einsum("btd,dnh->btnh", np.asarray(x, np.float64), np.asarray(weights.query_kernel, np.float64))
    want = q / np.sqrt((q * q).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(whole[:, 32_768:], want[:, 32_768:], atol=1e-4)


# ------------------------------------------------------------------ models


@functools.cache
def twins(family: str):
    """The fixture's model in float32 and in int8, and transformers' prompts and outputs."""
    make = functools.partial(models.from_pretrained, FIXTURES / family, max_len=16, batch_size=3)
    return expected(family), make(), make(weights="int8")


@functools.cache
def forward_logits(family: str):
    """Both twins' logits of every prompt at once (the causal forward reads no padding)."""
    want, full, compact = twins(family)
    prompts = jnp.asarray(want["prompts"])
    return np.asarray(full_forward(full, prompts)), np.asarray(full_forward(compact, prompts))


@nnx.jit
def full_forward(model, tokens):
    return model(tokens)


@pytest.mark.parametrize("family", sorted(TORCH_INT8_ERROR))
def test_int8_logits_stay_within_torch_dynamic_int8_error(family):
    want = twins(family)[0]
    reference, got = forward_logits(family)
    errors = [np.abs(got[row, :length] - reference[row, :length]).max() / np.abs(reference[row, :length]).max()
              for row, length in enumerate(want["lengths"])]
    assert 0 < max(errors) <= 1.5 * TORCH_INT8_ERROR[family], (family, errors)


@pytest.mark.parametrize("family", sorted(TORCH_INT8_ERROR))
def test_int8_models_hold_int8_kernels_a_quarter_of_the_float_bytes(family):
    params = [{"/".join(map(str, k)): v[...] for k, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}
              for m in twins(family)[1:]]
    kernels = [name for name in params[1] if name.endswith("kernel")]
    dtypes = {name: params[1][name].dtype for name in kernels}
    assert kernels and set(dtypes.values()) <= {jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8)}
    # Tiled (uint8, values + 128) where the native dot runs and the shape fits (not llama's 97-token head).
    assert (jnp.uint8 in dtypes.values()) == native.available(native.INT8_DOT)
    assert sum(params[1][name].nbytes for name in kernels) * 4 == sum(params[0][name].nbytes for name in kernels)


def test_an_int8_model_decodes_through_its_caches_as_its_full_forward_computes():
    """qwen2: a tied head (the embedding table is its int8 kernel) and the fused bias."""
    want, _, model = twins("qwen2")
    assert_decodes_as_its_forward(model, want, full_forward)


@needs_native
def test_a_tiled_int8_model_computes_what_the_untiled_one_does(monkeypatch):
    """A tied head read from the tiled table (lookup and logits), fused projections: the same bits.

    The fixtures' vocabularies (97 tokens) do not fit whole tiles, so this
    model's sizes are chosen to: every kernel and the table are tiled.
    """
    config = ModelConfig(family="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                         head_dim=16, intermediate_size=48, norm_eps=1e-5, tie_embeddings=True,
                         max_position_embeddings=16, rope=RoPE(theta=10000.0))

    # Random float weights in the float layout, loaded into both as from_pretrained loads a checkpoint.
    rng = np.random.default_rng(0)
    reference = models.CausalLM(config, max_len=16)
    paths = ["/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(reference, nnx.Param))]
    floats = {path: (rng.standard_normal(np.shape(reference.weight_value(path))) / 4).astype(np.float32)
              for path in paths}

    def build():
        model = models.CausalLM(config, max_len=16, batch_size=2, weights="int8")
        for path, value in floats.items():
            model.load_weight(path, value)
        return model

    tiled = build()
    monkeypatch.setattr(native, "available", lambda kernel=None: False)
    untiled = build()
    assert tiled.embed_form is quant.TiledInt8Weights
    assert all(block.mlp.down.form is block.attention.qkv.form is quant.TiledInt8Weights for block in tiled.blocks)
    assert untiled.embed_form is quant.Int8Weights and untiled.embed.dtype == jnp.int8
    np.testing.assert_array_equal(quant.untile(tiled.table).values, untiled.embed[...])
    prompts = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 6)), jnp.int32)
    np.testing.assert_array_equal(full_forward(tiled, prompts), full_forward(untiled, prompts))


# ------------------------------------------------------------------ float32 panels and the native float32 dot


def test_panels_hold_the_kernel_and_give_it_back():
    rng = np.random.default_rng(11)
    kernel = rng.standard_normal((12, 2, 16)).astype(np.float32)
    paneled = quant.panel(kernel)
    assert paneled.panels.shape == (2, 12, 16) and paneled.features == (2, 16) and paneled.inputs == 12
    np.testing.assert_array_equal(paneled.panels[1, 7], kernel[7, 1])  # panel 1 holds outputs 16..31
    np.testing.assert_array_equal(quant.unpanel(paneled), kernel)
    np.testing.assert_array_equal(np.asarray(quant.panel(jnp.asarray(kernel)).panels), paneled.panels)
    with pytest.raises(ValueError, match="float32 or bfloat16 with outputs divisible by 16, got float32 with 24 outputs"):
        quant.panel(kernel[:, :, :12])
    with pytest.raises(ValueError, match="got float64 with 32 outputs"):
        quant.panel(kernel.astype(np.float64))
    assert not route.use_panels(24, jnp.float32) and not route.use_panels(24, jnp.bfloat16)
    assert not route.use_panels(32, jnp.float16)  # no native dot of float16 panels
    # bfloat16 panels: the same layout, the kernel's exact values back.
    half = quant.panel(kernel.astype(jnp.bfloat16))
    assert half.panels.dtype == jnp.bfloat16
    np.testing.assert_array_equal(quant.unpanel(half), kernel.astype(jnp.bfloat16))
    assert route.use_panels(32, jnp.float32) == native.available(native.F32_DOT)


@needs_native
def test_a_paneled_model_computes_what_the_plain_one_does(monkeypatch):
    """Every float32 kernel as panels against the same model on XLA's dots: logits to float32's rounding, and the
    weights it was given back exactly."""
    model = models.from_pretrained(FIXTURES / "llama", max_len=16)
    kernels = [model.blocks[0].attention.qkv, model.blocks[0].attention.out, model.blocks[0].mlp.down]
    assert all(linear.form is quant.PanelWeights for linear in kernels) and model.blocks[0].mlp.down.kernel.shape == (4, 96, 16)
    monkeypatch.setattr(native, "available", lambda kernel=None: False)
    plain = models.from_pretrained(FIXTURES / "llama", max_len=16)
    assert plain.blocks[0].mlp.down.form is quant.FloatWeights
    for path, _ in nnx.to_flat_state(nnx.state(plain, nnx.Param)):
        path = "/".join(map(str, path))
        np.testing.assert_array_equal(model.weight_value(path), plain.weight_value(path), err_msg=path)
    monkeypatch.undo()  # the paneled model's programs need the native dot registered
    prompts = jnp.asarray(np.random.default_rng(2).integers(0, 97, (2, 6)), jnp.int32)
    want = np.asarray(jax.jit(lambda p: plain(p))(prompts))
    np.testing.assert_allclose(full_forward(model, prompts), want, rtol=1e-5, atol=1e-5)


@needs_native
def test_a_tied_table_in_panels_is_both_the_lookup_and_the_head(monkeypatch):
    """A tied float32 table stored as the head's panels `(V / 16, D, 16)`: the embedding gathers its rows from
    them, the head multiplies by them, and the model computes what the plain one does."""
    config = ModelConfig(family="llama", vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=16, intermediate_size=48, norm_eps=1e-5, tie_embeddings=True,
                         max_position_embeddings=16, rope=RoPE(theta=10000.0))
    rng = np.random.default_rng(3)
    paneled = models.CausalLM(config, max_len=16, batch_size=2)
    paths = ["/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(paneled, nnx.Param))]
    floats = {path: (rng.standard_normal(np.shape(paneled.weight_value(path))) / 4).astype(np.float32)
              for path in paths}
    monkeypatch.setattr(native, "available", lambda kernel=None: False)
    plain = models.CausalLM(config, max_len=16, batch_size=2)
    monkeypatch.undo()
    for model in (paneled, plain):
        for path, value in floats.items():
            model.load_weight(path, value)
    assert paneled.embed_form is quant.PanelWeights and paneled.embed.shape == (4, 32, 16)
    assert plain.embed_form is quant.TableWeights
    np.testing.assert_array_equal(paneled.weight_value("embed"), floats["embed"])
    prompts = jnp.asarray(rng.integers(0, 64, (2, 6)), jnp.int32)
    np.testing.assert_allclose(full_forward(paneled, prompts), full_forward(plain, prompts), rtol=1e-5, atol=1e-5)
    tokens = [generation.generate(model, prompts, 4).tokens for model in (paneled, plain)]
    np.testing.assert_array_equal(*tokens)


def test_weights_that_would_run_slower_or_do_not_exist_are_refused(monkeypatch):
    if native.available(native.BF16_DOT):
        with pytest.raises(ValueError, match="weights='bfloat16' on the CPU computes in float32 .* dtype=bfloat16"):
            models.from_pretrained(FIXTURES / "llama", max_len=8, weights="bfloat16", dtype=jnp.bfloat16)
    # Where kvattn's bfloat16 dot cannot run, XLA:CPU's bfloat16 dots would be slower than float32's.
    monkeypatch.setattr(native, "available", lambda target=None: False)
    monkeypatch.setattr(native, "unavailable_reason", lambda target: "no AVX-512 (a stand-in)")
    with pytest.raises(ValueError, match=r"weights='bfloat16' needs fast bfloat16 dots, which the cpu backend lacks "
                                         r"here \(no AVX-512 \(a stand-in\)\)"):
        models.from_pretrained(FIXTURES / "llama", max_len=8, weights="bfloat16")
    with pytest.raises(ValueError, match=r"weights must be one of \[None, 'int8', 'bfloat16', 'int4'\], got 'int2'"):
        models.from_pretrained(FIXTURES / "llama", max_len=8, weights="int2")
    with pytest.raises(ValueError, match=r"dtype=float16 cannot be the caches' storage.*among \['bfloat16', 'float32', "):
        models.from_pretrained(FIXTURES / "llama", max_len=8, dtype=jnp.float16)


def test_load_weight_names_the_shape_it_expected():
    for model in twins("llama")[1:]:
        with pytest.raises(ValueError, match=r"blocks/0/mlp/down/kernel holds shape \(96, 64\), got .* \(64, 96\)"):
            model.load_weight("blocks/0/mlp/down/kernel", np.zeros((64, 96), np.float32))


def test_the_drivers_take_a_layer_whose_weights_are_stored_fused_and_compact():
    layer = twins("qwen2")[2].blocks[0].attention  # with the fused bias
    layer.reset()
    x = jax.random.normal(jax.random.key(7), (3, layer.in_features))
    np.testing.assert_allclose(kvattn.Decoder(layer).step(x), layer.step(x), rtol=1e-5, atol=1e-5)
    layer.reset()
