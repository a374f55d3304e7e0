"""`kvattn bench`: per-token decode time of kvattn against Flax and recompute baselines.

Every figure is measured in one run, on one random stream and one set of
weights shared by all contenders:

  kvattn_step/<layout>    `Decoder.step` in a Python loop (the fast path)
  kvattn_decode/<layout>  `kvattn.decode`, the whole burst in one `lax.scan`
  flax_nnx_jit            `nnx.MultiHeadAttention(decode=True)` stepped by `nnx.jit`
  flax_scan               the same Flax layer stepped inside one donated `lax.scan`
  recompute               `layer(history)[:, -1]`: a full causal forward per token
  calibration             a jitted mat-vec reading as many bytes as one step

"Per-token time at filled length T" is the time of one decode step (one token
for each of the B sequences) while the cache fills up to T: the cache is
prefilled (untimed) to just below T, and a burst of steps that ends with T
slots filled is timed, after warm-up, with `jax.block_until_ready`; the
figure is the median over `repeats` bursts, each starting from the same saved
cache. Python-loop contenders run one untimed lead-in step per burst, so the
copy of the restored cache is never timed.

"Per-token time over a whole generation" is measured directly at the
smallest batch size: every contender but recompute and the calibration runs
one whole `max_len`-token generation from an empty cache (after an untimed
warm-up), as a user would, and the median over `generation_repeats` runs is
divided by `max_len`. Elsewhere (recompute, larger batches) it is the mean
over filled lengths 1..max_len of the measured curve, interpolated linearly
between the measured T (and held constant outside them); the interpolated
figure is kept beside the measured one in the JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

import kvattn
from kvattn import cache as cache_ops
from kvattn import ops
from kvattn.demo import flax_twin

__all__ = ["BenchConfig", "run"]

CACHE_DTYPES = cache_ops.CACHE_DTYPES
DEFAULT_LAYOUT = "slots_major"
PREFILL_CHUNK = 128
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
        return cache_ops.bytes_per_token(self.num_heads, self.head_dim, self.dtype)

    def kv_bytes(self, batch_size: int, filled: int) -> int:
        """Bytes of keys and values a step must read at `filled` slots."""
        return batch_size * filled * self.cache_bytes_per_token

    def validate(self) -> None:
        """Raises ValueError, naming the fix, for settings the benchmark cannot run."""
        if self.dtype not in CACHE_DTYPES:
            raise ValueError(
                f"dtype must be one of {sorted(CACHE_DTYPES)}, the cache dtypes kvattn stores, got {self.dtype!r}"
            )
        unknown = [layout for layout in self.layouts if layout not in ops.LAYOUTS]
        if unknown or not self.layouts:
            raise ValueError(f"layouts must be a non-empty subset of {sorted(ops.LAYOUTS)}, got {self.layouts}")
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


class CacheState(NamedTuple):
    """A saved cache in the slots-major layout `(B, S, K, H)`, holding `pos` tokens per sequence."""

    keys: jax.Array
    values: jax.Array
    pos: int


class Timing(NamedTuple):
    """Per-token times of the timed bursts and the output of the burst's last token."""

    ms_per_token: list[float]
    last_output: jax.Array


def run(
    *,
    in_features: int = 512,
    num_heads: int = 8,
    max_len: int = 2048,
    batch_sizes: tuple[int, ...] = (1, 8),
    filled: tuple[int, ...] = (128, 256, 512, 1024, 1536, 2048),
    layouts: tuple[str, ...] = ("slots_major", "heads_major"),
    dtype: str = "float32",
    repeats: int = 5,
    generation_repeats: int = 3,
    out_dir: str | os.PathLike = "bench-results",
    quick: bool = False,
) -> dict[str, Any]:
    """Runs the benchmark, prints its tables and writes `results.json` and PNG plots.

    Args:
      in_features, num_heads, max_len: layer sizes.
      batch_sizes: batch sizes to measure.
      filled: filled lengths T to measure.
      layouts: kvattn cache layouts to measure.
      dtype: kvattn's cache storage dtype, "float32", "bfloat16" or "int8"
        (the Flax baselines always store float32).
      repeats: timed bursts per figure (median reported).
      generation_repeats: timed whole `max_len`-token generations per
        contender at the smallest batch size (median reported; 0: none).
      out_dir: directory for `results.json`, `per_token_time.png` and
        `bandwidth_share.png`; created if missing.
      quick: replace the sizes by tiny ones (a smoke test in seconds).

    Returns:
      The results, as written to `results.json`.
    """
    sizes = dict(
        in_features=in_features,
        num_heads=num_heads,
        max_len=max_len,
        batch_sizes=tuple(batch_sizes),
        filled=tuple(sorted(set(filled))),
        repeats=repeats,
        generation_repeats=generation_repeats,
    )
    if quick:
        sizes.update(QUICK_SIZES)
    config = BenchConfig(layouts=tuple(layouts), dtype=dtype, **sizes)
    config.validate()
    started = time.perf_counter()
    results = measure(config)
    results["elapsed_s"] = time.perf_counter() - started
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(markdown_tables(results))
    plot_time(results, out / "per_token_time.png")
    plot_bandwidth(results, out / "bandwidth_share.png")
    print_tables(results)
    return results


def measure(config: BenchConfig) -> dict[str, Any]:
    """Measures every contender at every batch size and filled length.

    Returns:
      The results dict (config, machine, versions, memory, measurements,
      generation means and target ratios).
    """
    names = contender_names(config.layouts)
    load_before = _load_average()
    rows, whole = [], []
    steps = len(config.batch_sizes) * len(config.filled) * len(names)
    steps += len(generation_contenders(config.layouts)) if config.generation_repeats else 0
    with tqdm(total=steps, desc="kvattn bench") as progress:
        for batch_size in config.batch_sizes:
            bench = BatchBench(config, batch_size)
            for filled in config.filled:
                rows.extend(bench.measure_filled(filled, progress))
            if config.generation_repeats and batch_size == min(config.batch_sizes):
                whole.extend(bench.measure_generation(progress))
    generation = generation_means(config, rows, whole)
    return {
        "config": dataclasses.asdict(config),
        "machine": {**machine_info(), "load_average_before": load_before, "load_average_after": _load_average()},
        "versions": versions(),
        "source": source_revision(),
        "method": {
            "per_token": "median over repeats of (burst time / tokens), burst ending with T slots filled",
            "burst_tokens": {name: tokens_timed(config, name) for name in names},
            "generation_mean": "at the smallest batch size: median over generation_repeats of one whole "
            "max_len-token generation from an empty cache / max_len (recompute: interpolated); other batch "
            "sizes: mean over filled lengths 1..max_len of the per-token curve, linearly interpolated "
            "between measured T, constant outside them",
            "bytes_per_step": "weight bytes + filled K/V bytes (B * T * 2 * K * H * itemsize)",
        },
        "memory": [
            {
                "batch_size": batch_size,
                "cache_bytes_per_token_per_layer": config.cache_bytes_per_token,
                "cache_bytes_total": batch_size * config.max_len * config.cache_bytes_per_token,
            }
            for batch_size in config.batch_sizes
        ],
        "measurements": rows,
        "whole_generation": whole,
        "generation": generation,
        "targets": targets(config, rows, generation),
    }


def contender_names(layouts: tuple[str, ...]) -> list[str]:
    """Every contender's name, in the order they are measured and shown."""
    kvattn_names = [f"kvattn_step/{layout}" for layout in layouts]
    kvattn_names += [f"kvattn_decode/{layout}" for layout in layouts]
    return ["recompute", *kvattn_names, "flax_nnx_jit", "flax_scan", "calibration"]


def generation_contenders(layouts: tuple[str, ...]) -> list[str]:
    """The contenders timed over a whole generation: all but recompute (minutes per token) and calibration."""
    return contender_names(layouts)[1:-1]


def tokens_timed(config: BenchConfig, name: str) -> int:
    """How many tokens (or mat-vecs) one timed burst of contender `name` runs."""
    if name == "recompute":
        return 1
    if name == "flax_nnx_jit":
        return config.slow_burst_tokens
    return config.burst_tokens


@nnx.jit
def flax_step(module: nnx.MultiHeadAttention, x: jax.Array) -> jax.Array:
    """One Flax decode step under graph-mode `nnx.jit`, as a Flax user writes it."""
    return module(x)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def flax_scan(graphdef, params, cache, rest, xs):
    """Flax decode steps over `xs` `(T, B, 1, D)` inside one `lax.scan`, cache donated.

    Returns:
      `(ys, cache)`: outputs `(T, B, 1, D)` and the advanced cache.
    """

    def body(cache, x):
        module = nnx.merge(graphdef, params, cache, rest)
        y = module(x)
        return nnx.state(module, nnx.Cache), y

    cache, ys = jax.lax.scan(body, cache, xs)
    return ys, cache


@jax.jit
def matvec(matrix: jax.Array, vector: jax.Array) -> jax.Array:
    """The bandwidth calibration: one pass over `matrix`."""
    return matrix @ vector


def time_bursts(prepare: Callable[[], Any], burst: Callable[[Any], jax.Array], repeats: int, tokens: int) -> Timing:
    """Times `burst(prepare())` once untimed (warm-up, compiles) then `repeats` times.

    Args:
      prepare: untimed set-up of one burst; must leave nothing pending on the device.
      burst: the timed work; returns the last output.
      repeats: timed bursts.
      tokens: tokens per burst, the divisor of the per-token time.

    Returns:
      The per-token milliseconds of each timed burst and the last output.
    """
    samples = []
    for attempt in range(repeats + 1):
        state = prepare()
        started = time.perf_counter()
        output = jax.block_until_ready(burst(state))
        elapsed = time.perf_counter() - started
        if attempt:
            samples.append(elapsed / tokens * 1e3)
    return Timing(samples, output)


def to_layout(cache: jax.Array, layout: str) -> jax.Array:
    """A fresh copy of a slots-major cache `(B, S, K, H)` in `layout`."""
    if ops.LAYOUTS[layout] == ops.SLOTS_MAJOR:
        return jnp.copy(cache)
    return jnp.swapaxes(cache, 1, 2)


class CacheFiller:
    """Prefills one slots-major cache along the stream and saves it at increasing positions."""

    def __init__(self, layer: kvattn.MultiHeadAttention, stream: jax.Array):
        self._decoder = kvattn.Decoder(layer)
        self._stream = stream
        self._chunk = min(PREFILL_CHUNK, layer.max_len)
        self._pos = 0

    def state_at(self, pos: int) -> CacheState:
        """The cache after the first `pos` tokens of the stream (pos never decreases)."""
        batch_size = self._stream.shape[0]
        while self._pos < pos:
            take = min(self._chunk, pos - self._pos)
            # Always a full chunk, its tail masked by lengths: one compiled prefill.
            chunk = self._stream[:, self._pos : self._pos + self._chunk]
            self._decoder.prefill(chunk, np.full((batch_size,), take, np.int32))
            self._pos += take
        layer = self._decoder.sync()
        state = CacheState(layer.k_cache[...], layer.v_cache[...], pos)
        return jax.block_until_ready(state)


class BatchBench:
    """The layers, the stream and the baselines of one batch size."""

    def __init__(self, config: BenchConfig, batch_size: int):
        self.config = config
        self.batch_size = batch_size
        self.layers = {layout: self._kvattn_layer(layout) for layout in config.layouts}
        filler_layer = self._kvattn_layer(DEFAULT_LAYOUT, "float32")  # states are saved in float32
        # Every contender runs the very same weights.
        self.params = nnx.state(self.layers[config.layouts[0]], nnx.Param)
        self.weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(self.params))
        for layer in [*self.layers.values(), filler_layer]:
            nnx.update(layer, self.params)
        self.flax_layer = flax_twin(filler_layer, batch_size)
        # Past max_len by one chunk, so the filler's prefill chunks are all full.
        stream_len = config.max_len + min(PREFILL_CHUNK, config.max_len)
        self.stream = jax.random.normal(jax.random.key(1), (batch_size, stream_len, config.in_features))
        self.filler = CacheFiller(filler_layer, self.stream)

    def _kvattn_layer(self, layout: str, dtype: str | None = None) -> kvattn.MultiHeadAttention:
        return kvattn.MultiHeadAttention(
            self.config.num_heads,
            self.config.in_features,
            max_len=self.config.max_len,
            batch_size=self.batch_size,
            cache_layout=layout,
            cache_dtype=dtype or self.config.dtype,
            rngs=nnx.Rngs(0),
        )

    def measure_filled(self, filled: int, progress: tqdm) -> list[dict[str, Any]]:
        """Every contender's row at filled length `filled`."""
        config = self.config
        fast, slow = config.burst_tokens, config.slow_burst_tokens
        # Python loops start one lead-in token earlier than the scans.
        starts = sorted({filled - fast - 1, filled - fast, filled - slow - 1})
        states = {pos: self.filler.state_at(pos) for pos in starts}
        step_bytes = self.weight_bytes + config.kv_bytes(self.batch_size, filled)
        plan = {"recompute": functools.partial(self.time_recompute, filled)}
        for layout in config.layouts:
            plan[f"kvattn_step/{layout}"] = functools.partial(
                self.time_kvattn_step, layout, states[filled - fast - 1], fast
            )
        for layout in config.layouts:
            plan[f"kvattn_decode/{layout}"] = functools.partial(
                self.time_kvattn_decode, layout, states[filled - fast], fast
            )
        plan["flax_nnx_jit"] = functools.partial(self.time_flax_jit, states[filled - slow - 1], slow)
        plan["flax_scan"] = functools.partial(self.time_flax_scan, states[filled - fast], fast)
        plan["calibration"] = functools.partial(self.time_calibration, step_bytes)
        timings = {}
        for name, timer in plan.items():
            progress.set_postfix_str(f"B={self.batch_size} T={filled} {name}")
            timings[name] = timer()
            progress.update()
        calibration, reference = timings["calibration"], timings["recompute"].last_output
        return [
            self._row(name, filled, timing, step_bytes, calibration, None if name == "calibration" else reference)
            for name, timing in timings.items()
        ]

    def measure_generation(self, progress: tqdm) -> list[dict[str, Any]]:
        """Each fast contender timed over one whole `max_len`-token generation from an empty cache."""
        config = self.config
        count = config.max_len
        zeros = jnp.zeros((self.batch_size, count, config.num_heads, config.head_dim), jnp.float32)
        empty = CacheState(zeros, zeros, 0)
        warm_up = self.stream[:, -1]  # not among the generation's max_len tokens
        timers = {
            **{f"kvattn_step/{layout}": functools.partial(self.time_kvattn_step, layout) for layout in config.layouts},
            **{f"kvattn_decode/{layout}": functools.partial(self.time_kvattn_decode, layout) for layout in config.layouts},
            "flax_nnx_jit": self.time_flax_jit,
            "flax_scan": self.time_flax_scan,
        }
        rows = []
        for name, timer in timers.items():
            progress.set_postfix_str(f"B={self.batch_size} whole generation {name}")
            timing = timer(empty, count, repeats=config.generation_repeats, warm_up=warm_up)
            rows.append({
                "batch_size": self.batch_size,
                "contender": name,
                "ms_per_token": float(np.median(timing.ms_per_token)),
                "samples_ms_per_token": [float(t) for t in timing.ms_per_token],
            })
            progress.update()
        return rows

    def _row(self, name, filled, timing, step_bytes, calibration, reference) -> dict[str, Any]:
        """One contender's figures at one filled length, and its output's distance to `reference`."""
        ms = float(np.median(timing.ms_per_token))
        calibration_ms = float(np.median(calibration.ms_per_token))
        row = {
            "batch_size": self.batch_size,
            "filled": filled,
            "contender": name,
            "layout": name.split("/")[1] if "/" in name else None,
            "tokens_timed": tokens_timed(self.config, name),
            "ms_per_token": ms,
            "samples_ms_per_token": [float(s) for s in timing.ms_per_token],
            "bytes_per_step": step_bytes,
            "bytes_per_s": step_bytes / (ms * 1e-3),
            "calibration_share": calibration_ms / ms,
        }
        if reference is not None:
            output = jnp.reshape(timing.last_output, reference.shape)
            row["max_abs_diff_vs_recompute"] = float(jnp.max(jnp.abs(output - reference)))
        return row

    # ---------------------------------------------------------- contenders

    def tokens(self, start: int, stop: int) -> list[jax.Array]:
        """Stream tokens `start..stop-1`, each `(B, D)`, sliced ahead of any timing."""
        return jax.block_until_ready([self.stream[:, t] for t in range(start, stop)])

    def load_kvattn(self, layout: str, state: CacheState) -> kvattn.MultiHeadAttention:
        """The `layout` layer holding a fresh copy of `state`."""
        layer = self.layers[layout]
        # Encoding is per token and head, so encoding the whole float32 cache
        # stores exactly what appending its tokens one by one would.
        dtype = CACHE_DTYPES[self.config.dtype]
        keys, key_scales = cache_ops.encode(to_layout(state.keys, layout), dtype)
        values, value_scales = cache_ops.encode(to_layout(state.values, layout), dtype)
        layer.k_cache.set_value(keys)
        layer.v_cache.set_value(values)
        if key_scales is not None:
            layer.k_scale.set_value(key_scales)
            layer.v_scale.set_value(value_scales)
        layer.pos.set_value(jnp.full((self.batch_size,), state.pos, jnp.int32))
        jax.block_until_ready(nnx.state(layer, nnx.Cache))
        return layer

    def load_flax(self, state: CacheState) -> nnx.MultiHeadAttention:
        """The Flax layer holding a fresh copy of `state` (one index for the whole batch).

        `set_value` replaces the arrays without reading the old ones, which a
        donating contender may have deleted.
        """
        layer = self.flax_layer
        layer.cached_key.set_value(jnp.copy(state.keys))
        layer.cached_value.set_value(jnp.copy(state.values))
        layer.cache_index.set_value(jnp.asarray(state.pos, jnp.int32))
        jax.block_until_ready(nnx.state(layer, nnx.Cache))
        return layer

    def time_recompute(self, filled: int) -> Timing:
        """A full causal forward over the `filled` tokens of history, per token."""
        layer = self.layers[self.config.layouts[0]]
        history = jax.block_until_ready(self.stream[:, :filled])
        timing = time_bursts(lambda: history, layer, self.config.repeats, 1)
        return timing._replace(last_output=timing.last_output[:, -1])

    def _loop_tokens(self, state: CacheState, count: int, warm_up: jax.Array | None):
        """A Python loop's untimed lead-in token and its `count` timed tokens, each `(B, D)`.

        By default the lead-in is the first token after `state`, stepped on the
        timed layer (the state is saved one token early), so restoring the
        cache is never timed. With `warm_up` (a whole generation) the lead-in
        is that token, stepped on a throw-away copy, and the timed tokens
        start right at `state`.
        """
        if warm_up is None:
            lead_in, *tokens = self.tokens(state.pos, state.pos + 1 + count)
            return lead_in, tokens
        return warm_up, self.tokens(state.pos, state.pos + count)

    def time_kvattn_step(
        self, layout: str, state: CacheState, count: int, repeats: int | None = None, warm_up: jax.Array | None = None
    ) -> Timing:
        """`Decoder.step` in a Python loop, after one untimed lead-in step (see `_loop_tokens`)."""
        lead_in, tokens = self._loop_tokens(state, count, warm_up)

        def prepare():
            layer = self.load_kvattn(layout, state)
            decoder = kvattn.Decoder(layer)
            jax.block_until_ready(decoder.step(lead_in))
            if warm_up is not None:
                decoder = kvattn.Decoder(layer)  # the warmed one is thrown away
            jax.block_until_ready(decoder._cache)
            return decoder

        def burst(decoder):
            for x in tokens:
                y = decoder.step(x)
            return y

        return time_bursts(prepare, burst, repeats or self.config.repeats, count)

    def time_kvattn_decode(
        self, layout: str, state: CacheState, count: int, repeats: int | None = None, warm_up: jax.Array | None = None
    ) -> Timing:
        """`kvattn.decode` over `count` tokens in one call."""
        chunk = jax.block_until_ready(self.stream[:, state.pos : state.pos + count])
        timing = time_bursts(
            lambda: self.load_kvattn(layout, state),
            lambda layer: kvattn.decode(layer, chunk),
            repeats or self.config.repeats,
            count,
        )
        return timing._replace(last_output=timing.last_output[:, -1])

    def time_flax_jit(
        self, state: CacheState, count: int, repeats: int | None = None, warm_up: jax.Array | None = None
    ) -> Timing:
        """Flax's decode step under `nnx.jit` in a Python loop, after one untimed lead-in step (see `_loop_tokens`)."""
        lead_in, tokens = self._loop_tokens(state, count, warm_up)
        lead_in, *tokens = jax.block_until_ready([x[:, None, :] for x in [lead_in, *tokens]])

        def prepare():
            layer = self.load_flax(state)
            jax.block_until_ready(flax_step(layer, lead_in))
            return layer if warm_up is None else self.load_flax(state)

        def burst(layer):
            for x in tokens:
                y = flax_step(layer, x)
            return y

        return time_bursts(prepare, burst, repeats or self.config.repeats, count)

    def time_flax_scan(
        self, state: CacheState, count: int, repeats: int | None = None, warm_up: jax.Array | None = None
    ) -> Timing:
        """Flax's decode step over `count` tokens inside one donated `lax.scan`."""
        chunk = self.stream[:, state.pos : state.pos + count]
        xs = jax.block_until_ready(jnp.swapaxes(chunk, 0, 1)[:, :, None, :])

        def prepare():
            return nnx.split(self.load_flax(state), nnx.Param, nnx.Cache, ...)

        def burst(split):
            graphdef, params, cache, rest = split
            ys, _ = flax_scan(graphdef, params, cache, rest, xs)
            return ys

        timing = time_bursts(prepare, burst, repeats or self.config.repeats, count)
        return timing._replace(last_output=timing.last_output[-1])

    def time_calibration(self, step_bytes: int) -> Timing:
        """A mat-vec over `step_bytes` bytes of float32, `burst_tokens` times per burst."""
        width = self.config.in_features
        rows = -(-step_bytes // (4 * width))
        matrix = jax.block_until_ready(jnp.ones((rows, width), jnp.float32))
        vector = jnp.ones((width,), jnp.float32)
        count = self.config.burst_tokens

        def burst(_):
            for _ in range(count):
                y = matvec(matrix, vector)
            return y

        return time_bursts(lambda: None, burst, self.config.repeats, count)


# ------------------------------------------------------------------ summaries


def generation_means(
    config: BenchConfig, rows: list[dict[str, Any]], whole: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each contender's mean per-token time over a whole `max_len`-token generation.

    Where a whole generation was timed (`whole`), that figure is the mean;
    elsewhere it is the mean of the per-token curve over filled lengths
    1..max_len, linearly interpolated between the measured T. Both are kept.

    Returns:
      One row per batch size and contender (calibration excluded).
    """
    lengths = np.arange(1, config.max_len + 1)
    timed = {(w["batch_size"], w["contender"]): w["ms_per_token"] for w in whole}
    means = []
    for batch_size in config.batch_sizes:
        for name in contender_names(config.layouts)[:-1]:
            curve = sorted((r["filled"], r["ms_per_token"]) for r in rows if _matches(r, batch_size, name))
            filled, ms = zip(*curve, strict=True)
            interpolated = float(np.mean(np.interp(lengths, filled, ms)))
            measured = timed.get((batch_size, name))
            means.append({
                "batch_size": batch_size,
                "contender": name,
                "ms_per_token": interpolated if measured is None else measured,
                "method": "interpolated" if measured is None else "whole generation",
                "interpolated_ms_per_token": interpolated,
            })
    return means


def _matches(row: dict[str, Any], batch_size: int, name: str) -> bool:
    return row["batch_size"] == batch_size and row["contender"] == name


def targets(config: BenchConfig, rows: list[dict[str, Any]], generation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The decode targets at the smallest batch size, each with its threshold and verdict.

    Speed-ups compare generation means; "fastest" is the kvattn layout with
    the lowest generation mean for that loop.
    """
    batch_size = min(config.batch_sizes)
    mean = {g["contender"]: g["ms_per_token"] for g in generation if g["batch_size"] == batch_size}
    default = DEFAULT_LAYOUT if DEFAULT_LAYOUT in config.layouts else config.layouts[0]

    def fastest(loop):
        return min(config.layouts, key=lambda layout: mean[f"{loop}/{layout}"])

    def at(name, filled):
        (row,) = [r for r in rows if _matches(r, batch_size, name) and r["filled"] == filled]
        return row

    def speedup(baseline, contender, threshold, note=""):
        return _target(f"{contender}{note} vs {baseline}", mean[baseline] / mean[contender], ">=", threshold)

    step_fast, decode_fast = fastest("kvattn_step"), fastest("kvattn_decode")
    shortest, longest = min(config.filled), max(config.filled)
    found = [
        speedup("flax_nnx_jit", f"kvattn_step/{default}", 5),
        speedup("flax_nnx_jit", f"kvattn_step/{step_fast}", 15, " (fastest)"),
        speedup("flax_scan", f"kvattn_decode/{default}", 3),
        speedup("flax_scan", f"kvattn_decode/{decode_fast}", 7, " (fastest)"),
        *[speedup("recompute", f"kvattn_decode/{layout}", 100) for layout in dict.fromkeys([default, decode_fast])],
    ]
    for layout in config.layouts:
        threshold = 0.5 if layout == decode_fast else None
        share = at(f"kvattn_decode/{layout}", longest)["calibration_share"]
        found.append(
            _target(f"kvattn_decode/{layout} share of calibration bandwidth at T={longest}", share, ">=", threshold)
        )
    for name in [f"kvattn_decode/{layout}" for layout in config.layouts] + ["calibration"]:
        ratio = at(name, shortest)["ms_per_token"] / at(name, longest)["ms_per_token"]
        # The calibration's own ratio is the bound a purely bandwidth-bound step would reach.
        threshold = 0.5 if name == f"kvattn_decode/{decode_fast}" else None
        found.append(_target(f"{name} time at T={shortest} / at T={longest}", ratio, "<=", threshold))
    for target in found:
        target["batch_size"] = batch_size
    return found


def _target(name: str, value: float, compare: str, threshold: float | None) -> dict[str, Any]:
    """One target row; `threshold` None means report only."""
    if threshold is None:
        met = None
    else:
        met = bool(value >= threshold) if compare == ">=" else bool(value <= threshold)
    return {"name": name, "value": float(value), "compare": compare, "threshold": threshold, "met": met}


def machine_info() -> dict[str, Any]:
    """The CPU model, core count, OS and the JAX device the figures come from."""
    model = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "jax_backend": jax.default_backend(),
        "jax_device": str(jax.devices()[0]),
    }


def _load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages: a busy machine shows in every figure."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def source_revision() -> dict[str, Any]:
    """The git commit of the measured kvattn source and whether it had uncommitted changes.

    Both None outside a git checkout (an installed wheel) or without git.
    """
    here = Path(__file__).parent

    def git(*args):
        try:
            done = subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, check=False)
        except OSError:
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    changes = git("status", "--porcelain", "--", ".")
    return {"commit": commit, "dirty": None if commit is None else bool(changes)}


def versions() -> dict[str, str]:
    """Versions of Python and the packages measured."""
    packages = ("kvattn", "jax", "jaxlib", "flax", "numpy")
    return {"python": platform.python_version(), **{name: metadata.version(name) for name in packages}}


# ------------------------------------------------------------------ output


def markdown_tables(results: dict[str, Any]) -> str:
    """The run's per-token, generation-mean and target tables as Markdown, for BENCHMARKS.md."""
    config = results["config"]
    lines = []
    for batch_size in config["batch_sizes"]:
        lines += [
            f"### B = {batch_size}, {config['dtype']} cache: ms per token (achieved GB/s, % of calibration)",
            "",
            "| contender | " + " | ".join(f"T={t}" for t in config["filled"]) + " | mean over generation |",
            "|---|" + "---:|" * (len(config["filled"]) + 1),
        ]
        means = {
            g["contender"]: f"{g['ms_per_token']:.3g}" + (" (whole)" if g["method"] == "whole generation" else "")
            for g in results["generation"]
            if g["batch_size"] == batch_size
        }
        rows = [r for r in results["measurements"] if r["batch_size"] == batch_size]
        for name in dict.fromkeys(r["contender"] for r in rows):
            cells = []
            for filled in config["filled"]:
                row = next(r for r in rows if r["contender"] == name and r["filled"] == filled)
                share = "" if name == "calibration" else f", {row['calibration_share']:.0%}"
                cells.append(f"{row['ms_per_token']:.3g} ({row['bytes_per_s'] / 1e9:.3g} GB/s{share})")
            mean = means.get(name, "—")
            lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {mean} |")
        lines.append("")
    if results.get("whole_generation"):
        lines += [
            "(whole): timed over one whole generation from an empty cache; other means interpolate the columns.",
            "",
        ]
    lines += ["### Targets", "", "| B | ratio | value | target | verdict |", "|---:|---|---:|---:|---|"]
    for target in results["targets"]:
        goal = "report" if target["threshold"] is None else f"{target['compare']} {target['threshold']}"
        verdict = "—" if target["met"] is None else ("met" if target["met"] else "**missed**")
        lines.append(f"| {target['batch_size']} | {target['name']} | {target['value']:.3g} | {goal} | {verdict} |")
    return "\n".join(lines) + "\n"


def print_tables(results: dict[str, Any]) -> None:
    """Prints the per-token table, the generation means and the targets with rich."""
    console = Console()
    table = Table(title="Per-token decode time (one step of B sequences)")
    for column in ("B", "T", "contender", "ms/token", "GB/s", "% calib", "|Δ|"):
        table.add_column(column, justify="left" if column == "contender" else "right", no_wrap=True)
    for row in results["measurements"]:
        diff = row.get("max_abs_diff_vs_recompute")
        table.add_row(
            str(row["batch_size"]),
            str(row["filled"]),
            row["contender"],
            f"{row['ms_per_token']:.4g}",
            f"{row['bytes_per_s'] / 1e9:.3g}",
            f"{100 * row['calibration_share']:.1f}",
            "" if diff is None else f"{diff:.0e}",
        )
    console.print(table)

    generation = Table(title=f"Mean per-token time over a {results['config']['max_len']}-token generation")
    for column in ("B", "contender", "ms/token", "from", "interpolated"):
        generation.add_column(column, justify="left" if column in ("contender", "from") else "right", no_wrap=True)
    for row in results["generation"]:
        generation.add_row(
            str(row["batch_size"]),
            row["contender"],
            f"{row['ms_per_token']:.4g}",
            row["method"],
            f"{row['interpolated_ms_per_token']:.4g}",
        )
    console.print(generation)

    memory = Table(title="Cache memory")
    for column in ("B", "bytes/token/layer", "total cache bytes"):
        memory.add_column(column, justify="right")
    for row in results["memory"]:
        memory.add_row(
            str(row["batch_size"]), str(row["cache_bytes_per_token_per_layer"]), str(row["cache_bytes_total"])
        )
    console.print(memory)

    verdicts = Table(title="Targets")
    for column in ("B", "ratio", "value", "target", "verdict"):
        verdicts.add_column(column, justify="left" if column == "ratio" else "right")
    for target in results["targets"]:
        goal = "report" if target["threshold"] is None else f"{target['compare']} {target['threshold']:g}"
        verdict = {None: "", True: "[green]met", False: "[red]missed"}[target["met"]]
        verdicts.add_row(str(target["batch_size"]), target["name"], f"{target['value']:.3g}", goal, verdict)
    console.print(verdicts)


def _by_batch(results: dict[str, Any]):
    """Yields `(batch_size, {contender: (filled, rows)})` for the plots."""
    for batch_size in results["config"]["batch_sizes"]:
        curves = {}
        for row in results["measurements"]:
            if row["batch_size"] == batch_size:
                curves.setdefault(row["contender"], []).append(row)
        yield batch_size, curves


def _figure(results: dict[str, Any]) -> tuple[Figure, list]:
    """One panel per batch size, filled lengths on a log-2 axis ticked at the measured T."""
    batch_sizes, filled = results["config"]["batch_sizes"], results["config"]["filled"]
    figure = Figure(figsize=(5 * len(batch_sizes) + 3, 4.5), layout="constrained")
    axes = list(figure.subplots(1, len(batch_sizes), squeeze=False)[0])
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(filled, labels=[str(t) for t in filled])
        ax.grid(True, which="both", alpha=0.3)
    return figure, axes


def _save(figure: Figure, axes: list, path: Path) -> None:
    """Adds one legend beside the panels and writes the PNG."""
    figure.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize="small")
    figure.savefig(path, dpi=120)


def plot_time(results: dict[str, Any], path: Path) -> None:
    """Per-token time against filled length, one panel per batch size, log y."""
    figure, axes = _figure(results)
    for ax, (batch_size, curves) in zip(axes, _by_batch(results), strict=True):
        for name, rows in curves.items():
            style = dict(linestyle="--", color="black") if name == "calibration" else {}
            label = "calibration (mat-vec over the step's bytes)" if name == "calibration" else name
            ax.plot([r["filled"] for r in rows], [r["ms_per_token"] for r in rows], marker="o", label=label, **style)
        ax.set(yscale="log", xlabel="filled length T", ylabel="ms per token", title=f"batch size {batch_size}")
    _save(figure, axes, path)


def plot_bandwidth(results: dict[str, Any], path: Path) -> None:
    """Share of the calibration bandwidth against filled length, one panel per batch size."""
    figure, axes = _figure(results)
    for ax, (batch_size, curves) in zip(axes, _by_batch(results), strict=True):
        for name, rows in curves.items():
            if name != "calibration":
                shares = [100 * r["calibration_share"] for r in rows]
                ax.plot([r["filled"] for r in rows], shares, marker="o", label=name)
        ax.axhline(100, color="black", linestyle="--", label="calibration")
        ax.set(
            yscale="log", xlabel="filled length T", ylabel="% of calibration bytes/s", title=f"batch size {batch_size}"
        )
    _save(figure, axes, path)
