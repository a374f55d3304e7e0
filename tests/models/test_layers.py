"""Weights stored in their forms a slice at a time (`kvattn.models.layers.stored_form`), bit for bit as whole.

Every form is built per output (int8 scales per output, panels and tiles
of 16 outputs), so the forms of slices of the first output axis, joined,
must be the form of the whole kernel: checked over forms, storage dtypes,
input and output axes, slice sizes and the arrays loading passes (NumPy,
JAX, a `Joined` of parts).
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings

from kvattn.math import quant
from kvattn.models import layers, tensors

# Each form with the storage dtypes it takes.
FORMS = [(quant.FloatWeights, np.float32), (quant.FloatWeights, jnp.bfloat16), (quant.TableWeights, np.float32),
         (quant.Int8Weights, np.float32), (quant.TiledInt8Weights, np.float32), (quant.PanelWeights, np.float32),
         (quant.PanelWeights, jnp.bfloat16)]


@st.composite
def kernels(draw):
    form, dtype = draw(st.sampled_from(FORMS))
    if form is quant.TableWeights:
        inputs, features = (draw(st.integers(1, 12)),), (draw(st.integers(1, 40)),)
    else:
        inputs = draw(st.sampled_from([(4,), (8,), (2, 4), (12,)]))
        inner = draw(st.sampled_from([(), (1,), (4,), (16,), (3, 8)]))
        # Panels and tiles need outputs in whole groups of 16.
        first = draw(st.integers(1, 9)) * 16 // math.gcd(math.prod(inner), 16)
        features = (first, *inner)
    seed = draw(st.integers(0, 2**16))
    kernel = np.random.default_rng(seed).standard_normal((*inputs, *features)).astype(np.float32)
    return form, dtype, kernel, features, draw(st.integers(1, 4096)), draw(st.sampled_from(["numpy", "jax", "joined"]))


@settings(max_examples=60, deadline=None)
@given(kernels())
def test_a_form_stored_a_slice_at_a_time_is_the_whole_form_bit_for_bit(case):
    form, dtype, kernel, features, slice_bytes, given_as = case
    inputs_ndim = kernel.ndim - len(features)
    want = form.from_float(kernel, features, dtype)
    if given_as == "jax":
        source = jnp.asarray(kernel)
    elif given_as == "joined" and inputs_ndim == 1:  # parts along the first output axis, as a fused kernel's
        cut = sorted({0, features[0] // 3, features[0] // 2, features[0]})
        source = tensors.Joined([kernel[:, a:b] for a, b in zip(cut, cut[1:]) if a < b], 1)
    else:
        source = kernel
    saved, tensors.SLICE_BYTES = tensors.SLICE_BYTES, slice_bytes
    try:
        got = layers.stored_form(form, source, features, dtype)
    finally:
        tensors.SLICE_BYTES = saved
    assert type(got) is form and got.features == want.features
    for a, b in zip(got.stored(), want.stored(), strict=True):
        if b is None:
            assert a is None
            continue
        assert isinstance(a, np.ndarray) and a.ctypes.data % 64 == 0  # adopted by JAX on the CPU without a copy
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a.view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def test_aligned_empty_arrays_start_on_64_bytes_in_any_dtype():
    for shape, dtype in [((3, 5), np.float32), ((7,), np.int8), ((2, 3, 4), jnp.bfloat16), ((1,), np.float32)]:
        array = layers.aligned_empty(shape, dtype)
        assert array.shape == shape and array.dtype == dtype and array.ctypes.data % 64 == 0
        array[...] = 1  # writable, its own memory
    assert layers.aligned_empty((0, 4), np.float32).shape == (0, 4)
