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


def weights_of(layer) -> dict:
    """The layer's parameters as float64 arrays (zero biases when it has none) and its options as data.

    Options read from `layer.config`: `norm` (None, "layer", "rms" or
    "rms_offset") with `eps` and the `query_ln`/`key_ln` scales, `softcap`,
    `query_scale`, and `rope` as a plain dict (theta, scaling, rotary_dim,
    interleaved).
    """
    out = {}
    for name in ("query", "key", "value", "out"):
        linear = getattr(layer, name)
        kernel = np.asarray(linear.kernel[...], np.float64)
        out[f"{name}_kernel"] = kernel
        bias_shape = kernel.shape[1:] if name != "out" else kernel.shape[-1:]
        bias = np.zeros(bias_shape) if linear.bias is None else np.asarray(linear.bias[...], np.float64)
        out[f"{name}_bias"] = bias
    config = layer.config
    out["norm"] = {False: None, True: "layer", "rms": "rms", "rms_offset": "rms_offset"}[config.normalize_qk]
    out["eps"] = config.qk_norm_eps
    if out["norm"]:
        out["query_ln"] = np.asarray(layer.query_ln.scale[...], np.float64)
        out["key_ln"] = np.asarray(layer.key_ln.scale[...], np.float64)
    out["softcap"] = config.logit_softcap
    out["query_scale"] = config.query_scale
    rope = config.rope
    out["rope"] = None if rope is None else dict(
        theta=rope.theta, scaling=rope.scaling_dict, rotary_dim=rope.rotary_dim, interleaved=rope.interleaved,
        long=rope.long,
    )
    return out


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None, rotary_dim: int | None, long: bool = False):
    """Angular frequency of each rotated pair, and the factor on cos/sin, following transformers' formulas
    (`long`: longrope's long factors, which transformers takes for a call past the switch)."""
    dims = rotary_dim or head_dim
    freqs = np.array([theta ** (-2.0 * i / dims) for i in range(dims // 2)])
    kind = (scaling or {}).get("rope_type")
    if kind is None or kind == "default":
        return freqs, 1.0
    if kind == "longrope":
        factor, old = scaling.get("factor", 1.0), scaling["original_max_position_embeddings"]
        attention_factor = scaling.get("attention_factor") or (
            np.sqrt(1 + np.log(factor) / np.log(old)) if factor > 1 else 1.0)
        return freqs / np.array(scaling["long_factor" if long else "short_factor"]), attention_factor
    factor = scaling["factor"]
    if kind == "linear":
        return freqs / factor, 1.0
    if kind == "llama3":
        old = scaling["original_max_position_embeddings"]
        low_wavelength = old / scaling["low_freq_factor"]
        high_wavelength = old / scaling["high_freq_factor"]
        result = []
        for freq in freqs:
            wavelength = 2 * np.pi / freq
            if wavelength < high_wavelength:
                result.append(freq)
            elif wavelength > low_wavelength:
                result.append(freq / factor)
            else:
                smooth = (old / wavelength - scaling["low_freq_factor"]) / (
                    scaling["high_freq_factor"] - scaling["low_freq_factor"]
                )
                result.append((1 - smooth) * freq / factor + smooth * freq)
        return np.array(result), 1.0
    assert kind == "yarn", kind
    old = scaling["original_max_position_embeddings"]

    def dim_for(rotations):
        return dims * np.log(old / (rotations * 2 * np.pi)) / (2 * np.log(theta))

    low = max(np.floor(dim_for(scaling.get("beta_fast", 32))), 0)
    high = min(np.ceil(dim_for(scaling.get("beta_slow", 1))), dims - 1)
    if scaling.get("truncate") is False:
        low, high = max(dim_for(scaling.get("beta_fast", 32)), 0), min(dim_for(scaling.get("beta_slow", 1)), dims - 1)
    ramp = np.clip((np.arange(dims // 2) - low) / ((high + 0.001 if high == low else high) - low), 0, 1)
    result = freqs * (1 - ramp) + freqs / factor * ramp
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        def mscale(m=1.0):
            return 0.1 * m * np.log(factor) + 1.0 if factor > 1 else 1.0

        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(m) / mscale(m_all) if m and m_all else mscale()
    return result, attention_factor


def rotate(x, positions, rope: dict) -> np.ndarray:
    """Queries or keys `(T, heads, H)` turned by `positions`, as complex numbers: pair (a, b) is a + ib."""
    x = np.array(x, np.float64)
    head_dim = x.shape[-1]
    dims = rope["rotary_dim"] or head_dim
    freqs, attention_factor = rope_frequencies(head_dim, rope["theta"], rope["scaling"], rope["rotary_dim"],
                                               bool(rope.get("long")))
    phasor = attention_factor * np.exp(1j * np.asarray(positions, np.float64)[:, None] * freqs)[:, None, :]
    part = x[..., :dims]
    if rope["interleaved"]:
        z = (part[..., 0::2] + 1j * part[..., 1::2]) * phasor
        part = np.stack([z.real, z.imag], axis=-1).reshape(part.shape)
    else:
        z = (part[..., : dims // 2] + 1j * part[..., dims // 2 :]) * phasor
        part = np.concatenate([z.real, z.imag], axis=-1)
    x[..., :dims] = part
    return x


def normalise(x, scale, kind: str, eps: float) -> np.ndarray:
    """Per-head LayerNorm (no bias) or RMSNorm over the last axis, times `scale` (`1 + scale` for "rms_offset")."""
    if kind == "layer":
        x = x - x.mean(axis=-1, keepdims=True)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1 + scale if kind == "rms_offset" else scale)


def attention(q, k, v, positions, window: int | None = None, softcap: float | None = None,
              query_scale: float | None = None) -> np.ndarray:
    """Queries `(T, N, H)` at `positions` over keys and values `(S, K, H)` at positions `0 .. S-1`.

    Query t sees keys `0 .. positions[t]`; with `window`, only the last
    `window` of them; logits are `q . k * query_scale` (`1 / sqrt(H)` when
    None); with `softcap`, they become `softcap * tanh(logits / softcap)`.
    Returns `(T, N, H)`.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # query head n reads kv head n // group
    scale = 1 / np.sqrt(q.shape[-1]) if query_scale is None else query_scale
    scores = np.einsum("tnh,snh->nts", q, k) * scale
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    t, s = np.asarray(positions)[:, None], np.arange(len(k))[None, :]
    allowed = s <= t
    if window is not None:
        allowed &= s > t - window
    scores = np.where(allowed, scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("nts,snh->tnh", probs, v)


def causal_attention(weights: dict, xs, window: int | None = None, start: int = 0) -> np.ndarray:
    """Full causal self-attention of one sequence `(T, D)` -> `(T, out_features)`.

    With `window`, token t sees only tokens `t - window + 1 .. t`. Token t
    sits at absolute position `start + t` (only rotary positions see it).
    """
    xs = np.asarray(xs, np.float64)
    q = np.einsum("td,dnh->tnh", xs, weights["query_kernel"]) + weights["query_bias"]
    k = np.einsum("td,dkh->tkh", xs, weights["key_kernel"]) + weights["key_bias"]
    v = np.einsum("td,dkh->tkh", xs, weights["value_kernel"]) + weights["value_bias"]
    if weights.get("norm"):
        q = normalise(q, weights["query_ln"], weights["norm"], weights["eps"])
        k = normalise(k, weights["key_ln"], weights["norm"], weights["eps"])
    if weights.get("rope"):
        q = rotate(q, start + np.arange(len(xs)), weights["rope"])
        k = rotate(k, start + np.arange(len(xs)), weights["rope"])
    context = attention(q, k, v, np.arange(len(xs)), window, weights.get("softcap"), weights.get("query_scale"))
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
        return causal_attention(self.weights, np.stack(visible), start=len(history) - len(visible))[-1]

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
