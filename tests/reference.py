"""The independent oracle: causal multi-head attention in float64 NumPy.

Shares no code with kvattn. Grouped-query attention is done the plain way,
by repeating each kv head for its group of query heads. Three levels, each
built on the one before: `attention` (queries over keys, no weights),
`causal_attention` (a layer's projections around it, one sequence), and
`ReferenceCache` (a batched cached layer as per-sequence token histories).
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


def attention(q, k, v, positions, window: int | None = None) -> np.ndarray:
    """Queries `(T, N, H)` at `positions` over keys and values `(S, K, H)` at positions `0 .. S-1`.

    Query t sees keys `0 .. positions[t]`; with `window`, only the last
    `window` of them. Returns `(T, N, H)`.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # query head n reads kv head n // group
    scores = np.einsum("tnh,snh->nts", q, k) / np.sqrt(q.shape[-1])
    t, s = np.asarray(positions)[:, None], np.arange(len(k))[None, :]
    allowed = s <= t
    if window is not None:
        allowed &= s > t - window
    scores = np.where(allowed, scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("nts,snh->tnh", probs, v)


def causal_attention(weights: dict[str, np.ndarray], xs, window: int | None = None) -> np.ndarray:
    """Full causal self-attention of one sequence `(T, D)` -> `(T, D)`.

    With `window`, token t sees only tokens `t - window + 1 .. t`.
    """
    xs = np.asarray(xs, np.float64)
    q = np.einsum("td,dnh->tnh", xs, weights["query_kernel"]) + weights["query_bias"]
    k = np.einsum("td,dkh->tkh", xs, weights["key_kernel"]) + weights["key_bias"]
    v = np.einsum("td,dkh->tkh", xs, weights["value_kernel"]) + weights["value_bias"]
    context = attention(q, k, v, np.arange(len(xs)), window)
    return np.einsum("tnh,nhd->td", context, weights["out_kernel"]) + weights["out_bias"]


class ReferenceCache:
    """A batched cached layer in float64: per sequence, the list of tokens it holds.

    Every cache operation is a list edit. A token's output is the last row of
    `causal_attention` over its sequence's history (the last `window` tokens
    of it for a ring).
    """

    def __init__(self, weights: dict[str, np.ndarray], batch_size: int, window: int | None = None):
        self.weights = weights
        self.window = window
        self.histories: list[list[np.ndarray]] = [[] for _ in range(batch_size)]

    @property
    def lengths(self) -> list[int]:
        return [len(history) for history in self.histories]

    def append(self, sequence: int, token) -> np.ndarray:
        """Adds `token` `(D,)` to `sequence`; returns its output `(D,)`."""
        history = self.histories[sequence]
        history.append(np.asarray(token, np.float64))
        visible = history[-self.window :] if self.window is not None else history
        return causal_attention(self.weights, np.stack(visible))[-1]

    def reset(self, sequences):
        for sequence in sequences:
            self.histories[sequence] = []

    def truncate(self, keeps):
        """Keeps the first `keeps[b]` tokens of each sequence b."""
        self.histories = [history[:keep] for history, keep in zip(self.histories, keeps, strict=True)]

    def fork(self, source: int, targets):
        for target in targets:
            self.histories[target] = list(self.histories[source])

    def reorder(self, order):
        """Sequence b takes the history of sequence `order[b]`."""
        self.histories = [list(self.histories[source]) for source in order]


def assert_close(actual, expected, rtol: float = RTOL, atol: float = ATOL):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol)
