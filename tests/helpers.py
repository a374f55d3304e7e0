"""Helpers shared by the test modules: input streams and exact views of a layer's cache.

Test modules import from here and from `tests.reference`, never from each other.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx


def stream(shape, seed: int = 1, in_features: int = 8) -> jax.Array:
    """Standard-normal tokens `(*shape, in_features)`, the same for the same seed."""
    return jax.random.normal(jax.random.key(seed), (*shape, in_features))


def cache_arrays(layer) -> dict[str, np.ndarray]:
    """A copy of the layer's cache variables, by name (the names a snapshot stores)."""
    return {name[0]: np.array(variable[...]) for name, variable in nnx.to_flat_state(nnx.state(layer, nnx.Cache))}


def assert_same_bits(got: dict, want: dict):
    """The same names, and for each the same dtype, shape and bytes."""
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert got[name].tobytes() == want[name].tobytes(), name


def assert_caches_close(got: dict, want: dict, rtol: float, atol: float):
    """The same names, and for each values equal within tolerance."""
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)
