"""The independent oracle: causal multi-head attention in float64 NumPy.

Shares no code with kvattn. Grouped-query attention is done the plain way,
by repeating each kv head for its group of query heads.
"""

from __future__ import annotations

import numpy as np

# float32 kernels against this float64 reference, on standard-normal inputs
# and lecun-normal weights: |kvattn - reference| <= ATOL + RTOL * |reference|.
RTOL = 1e-4
ATOL = 1e-4


def weights_of(layer) -> dict[str, np.ndarray]:
    """The layer's parameters as float64 arrays, zero biases when it has none."""
    out = {}
    for name in ("query", "key", "value", "out"):
        linear = getattr(layer, name)
        kernel = np.asarray(linear.kernel[...], np.float64)
        out[f"{name}_kernel"] = kernel
        bias_shape = kernel.shape[1:] if name != "out" else kernel.shape[-1:]
        bias = np.zeros(bias_shape) if linear.bias is None else np.asarray(linear.bias[...], np.float64)
        out[f"{name}_bias"] = bias
    return out


def causal_attention(weights: dict[str, np.ndarray], xs, window: int | None = None) -> np.ndarray:
    """Full causal self-attention of one sequence `(T, D)` -> `(T, D)`.

    With `window`, token t sees only tokens `t - window + 1 .. t`.
    """
    xs = np.asarray(xs, np.float64)
    q = np.einsum("td,dnh->tnh", xs, weights["query_kernel"]) + weights["query_bias"]
    k = np.einsum("td,dkh->tkh", xs, weights["key_kernel"]) + weights["key_bias"]
    v = np.einsum("td,dkh->tkh", xs, weights["value_kernel"]) + weights["value_bias"]
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("tnh,snh->nts", q, k) / np.sqrt(q.shape[-1])
    t, s = np.arange(len(xs))[:, None], np.arange(len(xs))[None, :]
    allowed = s <= t
    if window is not None:
        allowed &= s > t - window
    scores = np.where(allowed, scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    ctx = np.einsum("nts,snh->tnh", probs, v)
    return np.einsum("tnh,nhd->td", ctx, weights["out_kernel"]) + weights["out_bias"]


def assert_close(actual, expected, rtol: float = RTOL, atol: float = ATOL):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol)
