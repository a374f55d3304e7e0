"""One frozen configuration per layer: every static fact about it, normalised once.

The layer, the compiled drivers (as their static argument), the snapshot's
recorded configuration and the benchmark all read `AttentionConfig`; nothing
else declares these settings. Construction validates and normalises every
field (NumPy integers become `int`, dtypes become their names, bucket lists
become a sorted tuple), so two configs describing the same layer are equal and
hash alike, and a config can always be written as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np

from kvattn.caches.base import CACHE_DTYPES, INT32_MAX, LAYOUTS, CacheSpec, spec_from_options
from kvattn.errors import positive_int
from kvattn.rotary import RoPE  # the config's rotary settings, kept in a leaf of their own

__all__ = ["DECODE_KERNELS", "AttentionConfig", "RoPE"]

# What a decode step's attention runs (the rule is `kvattn.kernels.route`).
DECODE_KERNELS = ("auto", "xla", "pallas", "interpret")

# The storage keyword arguments: sugar for a cache spec (`kvattn.caches.base.spec_from_options`).
STORAGE_OPTIONS = ("max_len", "batch_size", "cache_dtype", "cache_layout", "length_buckets", "num_pages", "page_size",
                   "spare_slots")

# What a cache snapshot records, in this order: a cache only loads into a layer that agrees on each.
# (Not `query_scale`: it scales the queries, never what the cache holds.)
RECORDED_FIELDS = (
    "num_heads", "in_features", "max_len", "window", "head_dim", "num_kv_heads", "batch_size", "use_bias",
    "cache_dtype", "cache_layout", "qkv_features", "out_features", "dtype", "param_dtype", "normalize_qk",
    "qk_norm_eps", "logit_softcap", "rope",
)


# Validated by hand in `__post_init__`, whose errors are the documented ones;
# run-time type checkers (the test suite's) would pre-empt them.
@typing.no_type_check
@dataclasses.dataclass(frozen=True, init=False)
class AttentionConfig:
    """The sizes and options of a `MultiHeadAttention` layer: the attention, and its cache as a spec.

    Args:
      num_heads: query heads N.
      in_features: model width D.
      cache: how keys and values are stored, a `kvattn.Contiguous` or
        `kvattn.Paged` spec (capacity, batch size, dtype, layout...; see
        `kvattn.caches.base`). The storage keyword arguments `max_len`,
        `batch_size`, `cache_dtype`, `cache_layout`, `length_buckets`,
        `num_pages`, `page_size`, `spare_slots` are sugar for one (give those or `cache`),
        and the properties of the same names read the spec.
      window: sliding-window attention over the last `window` tokens; with a
        contiguous cache without `max_len`, kept in a ring of `window` slots
        (a stream can run forever at constant memory).
      head_dim: width H of a head; defaults to `qkv_features // num_heads`.
      qkv_features: width of all query heads together, `N * H` (Flax's
        name); defaults to `in_features`. Give it or `head_dim`, not both
        unless they agree.
      out_features: width of the output; defaults to `in_features`.
      num_kv_heads: key/value heads K; must divide `num_heads`. Defaults to
        `num_heads`.
      use_bias: whether the projections have biases: a bool for all four,
        or the names of those that do, e.g. `("query", "key", "value")`
        (Qwen2: no bias on `out`).
      dtype: the computation dtype of the projections (Flax's `dtype`);
        None infers it from the inputs and parameters. Softmax and its
        accumulation always run in float32.
      param_dtype: storage dtype of the weights (Flax's `param_dtype`).
      normalize_qk: normalise queries and keys per head before attention:
        False; True for Flax's form (LayerNorm without bias, parameters
        `query_ln`/`key_ln`); or `"rms"` for RMSNorm with a learned scale
        (Qwen3, OLMo 2), under the same parameter names.
        `"rms_offset"` is RMSNorm scaled by `1 + scale` (Gemma 3's; its scales
        start at zero).
      qk_norm_eps: the epsilon of that normalisation.
      query_scale: the attention logits' scale, `(q . k) * query_scale`
        (Gemma's `query_pre_attn_scalar ** -0.5`); None for `1 / sqrt(head_dim)`.
      logit_softcap: `cap * tanh(scores / cap)` on the attention logits
        before masking (Gemma 2), or None.
      rope: a `kvattn.RoPE`, rotary position embedding at each token's
        absolute position, applied to queries and keys before the key is
        cached; None for no positional encoding in the layer. longrope
        without `long` set takes its long factors when `capacity` passes
        the switch (`RoPE.for_length`).
      data_axis, model_axis: names of mesh axes to shard over: sequences of
        the batch over `data_axis`, heads (projections and cache) over
        `model_axis`. Recorded as Flax `out_sharding` annotations, applied
        when the layer is built under `jax.set_mesh(mesh)` or by
        `kvattn.shard`.
      decode_kernel: what a decode step's attention runs (one new token per
        sequence; prefill always runs XLA): `"auto"` (the default) jax's
        Pallas GPU kernels when the backend is a GPU and they serve this
        layer, kvattn's native kernel on a CPU where it is built and serves
        this layer (a contiguous float32 heads-major cache, no soft-cap;
        `kvattn.kernels.native`), else XLA; `"xla"` always XLA; `"pallas"` always the kernels,
        refusing a layer or a backend they cannot serve; `"interpret"` the
        kernels in Pallas's interpret mode, on any backend (slow: for
        tests). See `kvattn.kernels`. A sharded layer (`data_axis` or
        `model_axis`) runs XLA: the kernels have no sharding rule.

    >>> AttentionConfig(2, 8, max_len=np.int64(16), cache_dtype=np.dtype("int8")).max_len
    16
    """

    # Annotated with the normalised values.
    num_heads: int
    in_features: int
    cache: CacheSpec
    window: int | None = None
    head_dim: int | None = None
    num_kv_heads: int | None = None
    use_bias: bool | tuple[str, ...] = True
    data_axis: str | None = None
    model_axis: str | None = None
    qkv_features: int | None = None
    out_features: int | None = None
    dtype: str | None = None
    param_dtype: str = "float32"
    normalize_qk: bool | str = False
    qk_norm_eps: float = 1e-6
    logit_softcap: float | None = None
    query_scale: float | None = None
    rope: RoPE | None = None
    decode_kernel: str = "auto"

    def __init__(self, num_heads, in_features, *, cache=None, **options):
        storage = {name: options.pop(name) for name in STORAGE_OPTIONS if name in options}
        fields = {f.name: f for f in dataclasses.fields(self)}
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise TypeError(f"AttentionConfig got unexpected keyword arguments {unknown}")
        if cache is None:
            cache = spec_from_options(**storage)
        elif storage:
            raise TypeError(f"give cache= or the storage keyword arguments {sorted(storage)}, not both")
        elif not isinstance(cache, CacheSpec):
            raise TypeError(f"cache must be a cache spec (kvattn.Contiguous, kvattn.Paged), got {cache!r}")
        values = dict(num_heads=num_heads, in_features=in_features, cache=cache)
        for name, field in fields.items():
            object.__setattr__(self, name, values[name] if name in values else options.get(name, field.default))
        self.__post_init__()

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        put("num_heads", positive_int("num_heads", self.num_heads))
        put("in_features", positive_int("in_features", self.in_features))
        put("window", None if self.window is None else positive_int("window", self.window))
        qkv_features = None if self.qkv_features is None else positive_int("qkv_features", self.qkv_features)
        if self.head_dim is None:
            width, name = (self.in_features, "in_features") if qkv_features is None else (qkv_features, "qkv_features")
            if width % self.num_heads:
                raise ValueError(
                    f"{name} ({width}) must be divisible by num_heads ({self.num_heads}) "
                    "when head_dim is not given; pass head_dim explicitly"
                )
            put("head_dim", width // self.num_heads)
        put("head_dim", positive_int("head_dim", self.head_dim))
        if qkv_features is not None and qkv_features != self.num_heads * self.head_dim:
            raise ValueError(
                f"qkv_features ({qkv_features}) must equal num_heads * head_dim "
                f"({self.num_heads} * {self.head_dim}); give one of them"
            )
        put("qkv_features", self.num_heads * self.head_dim)
        put("out_features", self.in_features if self.out_features is None else positive_int("out_features", self.out_features))
        put("num_kv_heads", self.num_heads if self.num_kv_heads is None else positive_int("num_kv_heads", self.num_kv_heads))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        put("use_bias", _biases(self.use_bias))
        put("dtype", None if self.dtype is None else float_dtype_name("dtype", self.dtype))
        put("param_dtype", float_dtype_name("param_dtype", self.param_dtype))
        if self.normalize_qk not in (False, True, "rms", "rms_offset") or isinstance(self.normalize_qk, np.ndarray):
            raise ValueError(
                f"normalize_qk must be False, True (LayerNorm, Flax's), 'rms' or 'rms_offset', got {self.normalize_qk!r}"
            )
        put("normalize_qk", self.normalize_qk if isinstance(self.normalize_qk, str) else bool(self.normalize_qk))
        put("qk_norm_eps", positive_float("qk_norm_eps", self.qk_norm_eps))
        if self.logit_softcap is not None:
            put("logit_softcap", positive_float("logit_softcap", self.logit_softcap))
        if self.query_scale is not None:
            put("query_scale", positive_float("query_scale", self.query_scale))
        if self.rope is not None:
            if not isinstance(self.rope, RoPE):
                raise TypeError(f"rope must be a kvattn.RoPE or None, got {self.rope!r}")
            self.rope.rotated_dims(self.head_dim)
        put("cache", self.cache.fitted(self.window, self.cache_bytes_per_token))
        if self.rope is not None:  # longrope's set, for the longest sequence the cache holds (`RoPE.long`)
            put("rope", self.rope.for_length(self.capacity))
        for name in ("data_axis", "model_axis"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a mesh axis name (str) or None, got {value!r}")
        if not isinstance(self.decode_kernel, str) or self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, got {self.decode_kernel!r}")
        if self.decode_kernel in ("pallas", "interpret") and (self.data_axis or self.model_axis):
            raise ValueError(
                f"decode_kernel={self.decode_kernel!r} cannot run a sharded layer (data_axis={self.data_axis!r}, "
                f"model_axis={self.model_axis!r}): the Pallas kernels have no sharding rule; use 'auto' or 'xla'"
            )

    def biased(self, projection: str) -> bool:
        """Whether projection `"query"`, `"key"`, `"value"` or `"out"` has a bias."""
        return self.use_bias if isinstance(self.use_bias, bool) else projection in self.use_bias

    # The storage settings, read from the cache spec (their one home).
    max_len = property(lambda self: self.cache.max_len, doc="`cache.max_len`")
    batch_size = property(lambda self: self.cache.batch_size, doc="`cache.batch_size`")
    cache_dtype = property(lambda self: self.cache.dtype, doc="`cache.dtype`")
    cache_layout = property(lambda self: self.cache.layout, doc="`cache.layout`, the word")
    length_buckets = property(lambda self: getattr(self.cache, "length_buckets", None), doc="`cache.length_buckets`")
    num_pages = property(lambda self: getattr(self.cache, "num_pages", None), doc="`cache.num_pages` (paged)")
    page_size = property(lambda self: getattr(self.cache, "page_size", None), doc="`cache.page_size` (paged)")
    paged = property(lambda self: self.cache.paged, doc="Whether the cache is a page pool.")
    pages_per_sequence = property(lambda self: self.cache.pages_per_sequence, doc="A paged cache's table width.")

    @property
    def num_slots(self) -> int:
        """Slots per sequence: `max_len`, or the ring's `window` (a paged cache's `max_len` with any window)."""
        return self.cache.num_slots(self.window)

    @property
    def capacity(self) -> int:
        """Tokens one sequence may append in all: `max_len`, or the int32 limit of `pos` for a ring."""
        return INT32_MAX if self.max_len is None else self.max_len

    @property
    def layout(self) -> str:
        """The cache layout's axis letters, e.g. `"BSKH"`."""
        return LAYOUTS[self.cache_layout]

    @property
    def heads_split(self) -> bool:
        """Whether heads are split over devices (projections then stay apart)."""
        return self.model_axis is not None

    @property
    def cache_bytes_per_token(self) -> int:
        """Cache bytes one token takes in one sequence: keys, values and, for int8, their scales."""
        scales = 2 * self.num_kv_heads * 4 if self.cache_dtype == "int8" else 0
        return 2 * self.num_kv_heads * self.head_dim * CACHE_DTYPES[self.cache_dtype] + scales

    def recorded(self) -> dict:
        """The fields a cache snapshot records (`RECORDED_FIELDS`), as the values they read back from JSON."""
        values = {name: getattr(self, name) for name in RECORDED_FIELDS}
        if values["rope"] is not None:
            values["rope"] = values["rope"].to_json()
        return json.loads(json.dumps(values))

    @classmethod
    def recorded_fields(cls) -> tuple[str, ...]:
        return RECORDED_FIELDS


def positive_float(name: str, value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


_PROJECTIONS = ("key", "out", "query", "value")


def _biases(use_bias) -> bool | tuple[str, ...]:
    """`use_bias` as True, False, or the sorted names of the biased projections."""
    if isinstance(use_bias, (bool, np.bool_)):
        return bool(use_bias)
    if isinstance(use_bias, str) or not isinstance(use_bias, Iterable):
        raise TypeError(f"use_bias must be a bool or a collection of projection names {_PROJECTIONS}, got {use_bias!r}")
    names = set(use_bias)
    unknown = sorted(map(str, names - set(_PROJECTIONS)))
    if unknown:
        raise ValueError(f"use_bias names projections among {_PROJECTIONS}, got {unknown}")
    if names == set(_PROJECTIONS) or not names:
        return bool(names)
    return tuple(sorted(names))


def float_dtype_name(name: str, dtype) -> str:
    """The name of a floating dtype (`jnp.bfloat16`, `"float32"`...)."""
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or not jnp.issubdtype(resolved, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype (float32, bfloat16, float16...), got {dtype!r}")
    return resolved.name
