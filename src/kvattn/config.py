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

__all__ = [
    "CACHE_DTYPES", "DECODE_KERNELS", "INT32_MAX", "LAYOUTS", "NULL_PAGE", "AttentionConfig", "RoPE",
    "default_length_buckets",
]

# `pos` is int32: the most tokens a sequence may ever append, ring or not.
INT32_MAX = 2**31 - 1

# Page 0 of every page pool maps nothing: table entries without a page point
# at it, the host never hands it out, and the device never writes it.
NULL_PAGE = 0


def blocks_spanned(num_tokens, page_size: int):
    """Blocks (pages) that `num_tokens` tokens from position 0 touch: an int, or an array of them."""
    return -(-num_tokens // page_size)

# Storage name -> bytes per stored element.
CACHE_DTYPES = {"float32": 4, "bfloat16": 2, "int8": 1}

# Inside, a cache layout is named by the letters of its axes (legend in `kvattn.math.ops`); the words are what
# callers pass as `cache_layout`, and `AttentionConfig.layout` turns them into the letters.
SLOTS_MAJOR, HEADS_MAJOR = "BSKH", "BKSH"
LAYOUTS = {"slots_major": SLOTS_MAJOR, "heads_major": HEADS_MAJOR}

# What a decode step's attention runs (the rule is `kvattn.kernels.route`).
DECODE_KERNELS = ("auto", "xla", "pallas", "interpret")

# Caches of a batch larger than this no longer fit a typical last-level CPU cache.
_CACHE_RESIDENT_BYTES = 32 * 2**20


def _recorded(default=dataclasses.MISSING):
    """A field a cache snapshot records: a cache only loads into a layer that agrees on it."""
    return dataclasses.field(default=default, metadata={"recorded": True})


# Rotary position embedding's settings (the rotation is `kvattn.math.rope`).
_SCALINGS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_YARN_OPTIONAL = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")


@typing.no_type_check  # validated by hand in __post_init__, with the documented errors
@dataclasses.dataclass(frozen=True)
class RoPE:
    """Rotary position embedding settings.

    Args:
      theta: the frequency base (`rope_theta`).
      scaling: a Hugging Face `rope_scaling` dict, or None: `{"rope_type":
        "linear", "factor": f}`, `{"rope_type": "llama3", "factor",
        "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings"}` or `{"rope_type": "yarn",
        "factor", "original_max_position_embeddings", ...}` (`beta_fast`,
        `beta_slow`, `mscale`, `mscale_all_dim`, `attention_factor`,
        `truncate` as in transformers). The older key `"type"` is accepted
        for `"rope_type"`.
      rotary_dim: how many leading dims of each head rotate (even); None for
        the whole head (GPT-NeoX and Phi rotate a part).
      interleaved: pair dims (0, 1), (2, 3)... instead of rotate-half.

    >>> RoPE(scaling={"rope_type": "linear", "factor": 2.0}).scaling_dict
    {'factor': 2.0, 'rope_type': 'linear'}
    """

    theta: float = 10000.0
    scaling: tuple | None = None
    rotary_dim: int | None = None
    interleaved: bool = False

    def __post_init__(self):
        if isinstance(self.theta, bool) or not isinstance(self.theta, (int, float, np.number)) or not self.theta > 1:
            raise ValueError(f"RoPE theta must be a number > 1, got {self.theta!r}")
        object.__setattr__(self, "theta", float(self.theta))
        if self.rotary_dim is not None:
            if isinstance(self.rotary_dim, bool) or not isinstance(self.rotary_dim, (int, np.integer)):
                raise TypeError(f"RoPE rotary_dim must be an even positive int or None, got {self.rotary_dim!r}")
            if self.rotary_dim < 2 or self.rotary_dim % 2:
                raise ValueError(f"RoPE rotary_dim must be an even positive int or None, got {self.rotary_dim!r}")
            object.__setattr__(self, "rotary_dim", int(self.rotary_dim))
        object.__setattr__(self, "interleaved", bool(self.interleaved))
        object.__setattr__(self, "scaling", _normalise_scaling(self.scaling))

    @property
    def scaling_dict(self) -> dict | None:
        """`scaling` as the dict it came from (normalised: `rope_type`, floats)."""
        return None if self.scaling is None else dict(self.scaling)

    def to_json(self) -> dict:
        return {"theta": self.theta, "scaling": self.scaling_dict, "rotary_dim": self.rotary_dim,
                "interleaved": self.interleaved}

    def rotated_dims(self, head_dim: int) -> int:
        """How many dims of a `head_dim`-wide head rotate; raises if `rotary_dim` does not fit."""
        rotary_dim = head_dim if self.rotary_dim is None else self.rotary_dim
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"RoPE rotary_dim ({rotary_dim}) must be even and at most head_dim ({head_dim})")
        return rotary_dim


def _normalise_scaling(scaling) -> tuple | None:
    if scaling is None:
        return None
    if isinstance(scaling, tuple):
        scaling = dict(scaling)
    if not isinstance(scaling, dict):
        raise TypeError(f"RoPE scaling must be a Hugging Face rope_scaling dict or None, got {scaling!r}")
    scaling = dict(scaling)
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None)
    scaling.pop("type", None)
    if kind not in _SCALINGS:
        raise ValueError(f"RoPE scaling rope_type must be one of {sorted(_SCALINGS)}, got {kind!r}")
    allowed = set(_SCALINGS[kind]) | (set(_YARN_OPTIONAL) if kind == "yarn" else set())
    missing = [key for key in _SCALINGS[kind] if scaling.get(key) is None]
    unknown = sorted(set(scaling) - allowed)
    if missing or unknown:
        raise ValueError(
            f"RoPE scaling of rope_type {kind!r} needs {list(_SCALINGS[kind])}"
            + (f" (optional: {list(_YARN_OPTIONAL)})" if kind == "yarn" else "")
            + f"; missing {missing}, unknown {unknown}"
        )
    normalised = {"rope_type": kind}
    for key, value in scaling.items():
        if value is None:
            continue
        if key == "truncate":
            normalised[key] = bool(value)
        elif isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
            raise ValueError(f"RoPE scaling {key} must be a finite number, got {value!r}")
        else:
            normalised[key] = float(value)
    if normalised.get("factor", 1.0) <= 0:
        raise ValueError(f"RoPE scaling factor must be positive, got {normalised['factor']}")
    return tuple(sorted(normalised.items()))



# Validated by hand in `__post_init__`, whose errors are the documented ones;
# run-time type checkers (the test suite's) would pre-empt them.
@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """The sizes and options of a `MultiHeadAttention` layer.

    Args:
      num_heads: query heads N.
      in_features: model width D.
      max_len: cache capacity in tokens per sequence; exactly one of
        `max_len` and `window` is given.
      window: sliding-window attention over the last `window` tokens, kept
        in a ring of `window` slots: a stream can run forever at constant
        memory.
      head_dim: width H of a head; defaults to `qkv_features // num_heads`.
      qkv_features: width of all query heads together, `N * H` (Flax's
        name); defaults to `in_features`. Give it or `head_dim`, not both
        unless they agree.
      out_features: width of the output; defaults to `in_features`.
      num_kv_heads: key/value heads K; must divide `num_heads`. Defaults to
        `num_heads`.
      batch_size: sequences the cache holds, or None for one unbatched one.
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
      qk_norm_eps: the epsilon of that normalisation.
      logit_softcap: `cap * tanh(scores / cap)` on the attention logits
        before masking (Gemma 2), or None.
      rope: a `kvattn.RoPE`, rotary position embedding at each token's
        absolute position, applied to queries and keys before the key is
        cached; None for no positional encoding in the layer.
      cache_dtype: storage of keys and values, anything `numpy.dtype` reads
        that names float32 (the default), bfloat16 (half the memory) or int8
        (a quarter, plus one float32 scale per token and head):
        `jnp.bfloat16`, `"int8"`... Attention math is float32.
      cache_layout: `"slots_major"` `(max_len, K, H)` or `"heads_major"`
        `(K, max_len, H)`: the same results; XLA:CPU's batched dots want the
        head axis first, so heads-major attention is faster there.
      length_buckets: attend only over the smallest of these static prefix
        lengths that holds every filled slot, so a step costs about the
        filled length rather than `max_len`. None picks
        `default_length_buckets`; `()` always reads the whole buffer;
        buckets past `max_len` are ignored.
      data_axis, model_axis: names of mesh axes to shard over: sequences of
        the batch over `data_axis`, heads (projections and cache) over
        `model_axis`. Recorded as Flax `out_sharding` annotations, applied
        when the layer is built under `jax.set_mesh(mesh)` or by
        `kvattn.shard`.
      num_pages, page_size: a paged cache (give both): one pool of
        `num_pages` pages of `page_size` tokens (`k_pages`, `v_pages`,
        `(P, page, K, H)`, or `(P, K, page, H)` heads-major) shared by the
        `batch_size` sequence slots, each holding up to `max_len` tokens
        through its page table (see `kvattn.caches.paged`). Every `step`/`prefill`
        then takes `pages=`, the `PageBatch` a host `kvattn.PageManager`
        hands out, and any number of rows; `reset`, `truncate`, `fork` and
        `reorder` are the manager's. `window` may be given with `max_len`:
        it limits what a token sees, and the host frees the pages that fall
        out of it.
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

    # Annotated with the normalised values; construction also accepts NumPy
    # integers, dtypes for `cache_dtype` and any integer sequence for buckets.
    num_heads: int = _recorded()
    in_features: int = _recorded()
    max_len: int | None = _recorded(None)
    window: int | None = _recorded(None)
    head_dim: int | None = _recorded(None)
    num_kv_heads: int | None = _recorded(None)
    batch_size: int | None = _recorded(None)
    use_bias: bool | tuple[str, ...] = _recorded(True)
    cache_dtype: str = _recorded("float32")
    cache_layout: str = _recorded("slots_major")
    length_buckets: tuple[int, ...] | None = None
    data_axis: str | None = None
    model_axis: str | None = None
    qkv_features: int | None = _recorded(None)
    out_features: int | None = _recorded(None)
    dtype: str | None = _recorded(None)
    param_dtype: str = _recorded("float32")
    normalize_qk: bool | str = _recorded(False)
    qk_norm_eps: float = _recorded(1e-6)
    logit_softcap: float | None = _recorded(None)
    rope: RoPE | None = _recorded(None)
    num_pages: int | None = None
    page_size: int | None = None
    decode_kernel: str = "auto"

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        put("num_heads", positive_int("num_heads", self.num_heads))
        put("in_features", positive_int("in_features", self.in_features))
        if (self.num_pages is None) != (self.page_size is None):
            raise ValueError(
                f"a paged cache needs both num_pages and page_size, got num_pages={self.num_pages!r} "
                f"and page_size={self.page_size!r}"
            )
        if self.num_pages is not None:
            put("num_pages", positive_int("num_pages", self.num_pages))
            put("page_size", positive_int("page_size", self.page_size))
            if self.num_pages < 2 or self.max_len is None or self.batch_size is None:
                raise ValueError(
                    "a paged cache needs num_pages >= 2 (page 0 is the null page), max_len (tokens per sequence) "
                    f"and batch_size (sequences), got num_pages={self.num_pages}, max_len={self.max_len!r}, "
                    f"batch_size={self.batch_size!r}"
                )
        elif (self.max_len is None) == (self.window is None):
            raise ValueError(
                f"give exactly one of max_len (a bounded cache) or window (a ring), "
                f"got max_len={self.max_len!r} and window={self.window!r}"
            )
        for name in ("max_len", "window", "batch_size"):
            value = getattr(self, name)
            put(name, None if value is None else positive_int(name, value))
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
        if self.normalize_qk not in (False, True, "rms") or isinstance(self.normalize_qk, np.ndarray):
            raise ValueError(f"normalize_qk must be False, True (LayerNorm, Flax's) or 'rms', got {self.normalize_qk!r}")
        put("normalize_qk", self.normalize_qk if isinstance(self.normalize_qk, str) else bool(self.normalize_qk))
        put("qk_norm_eps", positive_float("qk_norm_eps", self.qk_norm_eps))
        if self.logit_softcap is not None:
            put("logit_softcap", positive_float("logit_softcap", self.logit_softcap))
        if self.rope is not None:
            if not isinstance(self.rope, RoPE):
                raise TypeError(f"rope must be a kvattn.RoPE or None, got {self.rope!r}")
            self.rope.rotated_dims(self.head_dim)
        put("cache_dtype", cache_dtype_name(self.cache_dtype))
        if self.cache_layout not in LAYOUTS:
            raise ValueError(f"cache_layout must be one of {sorted(LAYOUTS)}, got {self.cache_layout!r}")
        if self.length_buckets is None:
            batch_bytes = (self.batch_size or 1) * self.num_slots * self.cache_bytes_per_token
            put("length_buckets", default_length_buckets(self.num_slots, cache_bytes=batch_bytes))
        else:
            put("length_buckets", _buckets(self.length_buckets, self.num_slots))
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

    @property
    def paged(self) -> bool:
        """Whether the cache is a page pool (`num_pages`, `page_size`)."""
        return self.num_pages is not None

    @property
    def pages_per_sequence(self) -> int:
        """A paged cache's table width: the blocks of `max_len` tokens."""
        return blocks_spanned(self.max_len, self.page_size)

    @property
    def num_slots(self) -> int:
        """Slots per sequence: `max_len`, or the ring's `window` (a paged cache's `max_len` with any window)."""
        return self.window if self.max_len is None else self.max_len

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
        """The fields a cache snapshot records, as the values they read back from JSON."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("recorded")}
        if values["rope"] is not None:
            values["rope"] = values["rope"].to_json()
        return json.loads(json.dumps(values))

    @classmethod
    def recorded_fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("recorded"))


def positive_int(name: str, value, *, error: type[Exception] | None = None, at_most: int | None = None) -> int:
    """`value` as a Python int, if it is an integer >= 1 (NumPy and 0-d integer arrays included, never a bool).

    With `at_most`, also at most that. Raises `error` if given, else
    `TypeError` for a value that is not an integer and `ValueError` for one
    out of range.
    """
    bound = "" if at_most is None else f" of at most {at_most}"
    if isinstance(value, (bool, np.bool_)) or not _is_integer(value):
        raise (error or TypeError)(f"{name} must be a positive int{bound}, got {value!r}")
    if int(value) < 1 or (at_most is not None and int(value) > at_most):
        raise (error or ValueError)(f"{name} must be a positive int{bound}, got {value!r}")
    return int(value)


def _is_integer(value) -> bool:
    if isinstance(value, (int, np.integer)):
        return True
    return getattr(value, "shape", None) == () and np.issubdtype(getattr(value, "dtype", np.float32), np.integer)


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


def cache_dtype_name(dtype) -> str:
    """The storage name of `dtype` (`jnp.bfloat16`, `np.dtype("int8")`, `"float32"`...)."""
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {sorted(CACHE_DTYPES)} (a name or a dtype), got {dtype!r}")
    return name


def _buckets(buckets, num_slots: int) -> tuple[int, ...]:
    """Explicit bucket lengths: positive ints, sorted; those at or past `num_slots` fold into it."""
    array_like = hasattr(buckets, "__array__")
    if isinstance(buckets, (str, bytes)) or not (array_like or isinstance(buckets, Iterable)):
        raise TypeError(f"length_buckets must be a sequence of positive ints or None, got {buckets!r}")
    values = np.asarray(buckets if array_like else list(buckets))
    if values.ndim != 1:
        raise TypeError(f"length_buckets must be a sequence of positive ints or None, got {buckets!r}")
    values = values.tolist()
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"length_buckets must be positive ints (slot counts), got {values}")
    # Buckets at or past the slot count add nothing: the last one is all slots.
    return tuple(sorted({b for b in values if b < num_slots} | {num_slots}))


def default_length_buckets(max_len: int, smallest: int = 128, cache_bytes: int = 0) -> tuple[int, ...]:
    """Static prefix lengths a step may read: doublings from `smallest` up to a limit, then `max_len`.

    A dot cannot read part of a buffer on XLA:CPU: a bucket's K/V prefix is
    first copied out, and a prefix only pays when that copy costs less than
    reading the whole buffers. While the batch's caches (`cache_bytes` in
    all) stay in the CPU's last-level cache, the dot reads them several times
    faster per byte than the copy runs, so buckets stop at `max_len / 8`;
    once they spill to DRAM, both run at DRAM speed and buckets go on to
    `max_len / 4`. The measurements behind the limits are on the benchmarks page (docs/benchmarks).

    >>> default_length_buckets(2048)
    (128, 256, 2048)
    >>> default_length_buckets(2048, cache_bytes=64 * 2**20)
    (128, 256, 512, 2048)
    >>> default_length_buckets(300)
    (300,)
    """
    limit = max_len // (4 if cache_bytes > _CACHE_RESIDENT_BYTES else 8)
    buckets = []
    size = min(smallest, max_len)
    while size <= limit:
        buckets.append(size)
        size *= 2
    buckets.append(max_len)
    return tuple(buckets)

