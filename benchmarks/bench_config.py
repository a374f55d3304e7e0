"""What one benchmark run measures: its sizes, its contenders, and the tokens each timed burst runs."""

from __future__ import annotations

import dataclasses

import kvattn
from kvattn.caches.base import CACHE_DTYPES, LAYOUTS

__all__ = [
    "DEFAULT_LAYOUT",
    "QUICK_SIZES",
    "BenchConfig",
    "contender_names",
    "generation_contenders",
    "tokens_timed",
]

DEFAULT_LAYOUT = "slots_major"
QUICK_SIZES = dict(
    in_features=32,
    num_heads=4,
    max_len=64,
    batch_sizes=(1, 2),
    filled=(16, 64),
    repeats=2,
    burst_tokens=4,
    slow_burst_tokens=2,
    generation_repeats=1,
)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Sizes and measurement settings of one benchmark run.

    Args:
      in_features: model width D.
      num_heads: query (and kv) heads N.
      max_len: cache capacity per sequence.
      batch_sizes: sequences decoded together, one set of figures each.
      filled: filled lengths T at which per-token time is measured.
      layouts: kvattn cache layouts to measure.
      dtype: cache storage dtype name.
      repeats: timed bursts per figure; the median is reported.
      generation_repeats: timed whole `max_len`-token generations per
        contender, at the smallest batch size (0: interpolate only).
      burst_tokens: tokens per timed burst of the fast contenders.
      slow_burst_tokens: tokens per timed burst of Flax under `nnx.jit`.
    """

    in_features: int
    num_heads: int
    max_len: int
    batch_sizes: tuple[int, ...]
    filled: tuple[int, ...]
    layouts: tuple[str, ...]
    dtype: str
    repeats: int
    generation_repeats: int
    burst_tokens: int = 32
    slow_burst_tokens: int = 4

    @property
    def head_dim(self) -> int:
        return self.in_features // self.num_heads

    @property
    def cache_bytes_per_token(self) -> int:
        """Bytes one token adds to the cache of one layer: keys and values of every kv head (+ int8 scales)."""
        layer = kvattn.AttentionConfig(self.num_heads, self.in_features, max_len=self.max_len, cache_dtype=self.dtype)
        return layer.cache_bytes_per_token

    def layer(self, batch_size: int, layout: str, cache_dtype: str | None = None, **options) -> kvattn.MultiHeadAttention:
        """The benchmarked layer at these sizes (seeded weights, shared by every contender), with `options`."""
        from flax import nnx

        return kvattn.MultiHeadAttention(
            self.num_heads, self.in_features, max_len=self.max_len, batch_size=batch_size, cache_layout=layout,
            cache_dtype=cache_dtype or self.dtype, rngs=nnx.Rngs(0), **options,
        )

    def kv_bytes(self, batch_size: int, filled: int) -> int:
        """Bytes of keys and values a step must read at `filled` slots."""
        return batch_size * filled * self.cache_bytes_per_token

    def validate(self) -> None:
        """Raises ValueError, naming the fix, for settings the benchmark cannot run."""
        if self.dtype not in CACHE_DTYPES:
            raise ValueError(
                f"dtype must be one of {sorted(CACHE_DTYPES)}, the cache dtypes kvattn stores, got {self.dtype!r}"
            )
        unknown = [layout for layout in self.layouts if layout not in LAYOUTS]
        if unknown or not self.layouts:
            raise ValueError(f"layouts must be a non-empty subset of {sorted(LAYOUTS)}, got {self.layouts}")
        if self.in_features % self.num_heads:
            raise ValueError(f"in_features ({self.in_features}) must be divisible by num_heads ({self.num_heads})")
        if self.repeats < 1 or not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"repeats and batch_sizes must be positive, got {self.repeats} and {self.batch_sizes}")
        lowest = max(self.burst_tokens, self.slow_burst_tokens) + 1
        bad = [t for t in self.filled if not lowest <= t <= self.max_len]
        if bad or not self.filled:
            raise ValueError(
                f"filled lengths must lie in [{lowest}, max_len={self.max_len}] so a timed burst fits below them, "
                f"got {self.filled}"
            )


def contender_names(layouts: tuple[str, ...]) -> list[str]:
    """Every contender's name, in the order they are measured and shown."""
    kvattn_names = [f"kvattn_step/{layout}" for layout in layouts]
    kvattn_names += [f"kvattn_decode/{layout}" for layout in layouts]
    kvattn_names += [f"kvattn_decode_donated/{layout}" for layout in layouts]
    return ["recompute", *kvattn_names, "flax_nnx_jit", "flax_scan", "calibration"]


def generation_contenders(layouts: tuple[str, ...]) -> list[str]:
    """The contenders timed over a whole generation: all but calibration and recompute, whose full forwards would dominate the run."""
    return contender_names(layouts)[1:-1]


def tokens_timed(config: BenchConfig, name: str) -> int:
    """How many tokens (or mat-vecs) one timed burst of contender `name` runs."""
    if name == "recompute":
        return 1
    if name == "flax_nnx_jit":
        return config.slow_burst_tokens
    return config.burst_tokens
