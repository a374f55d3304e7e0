"""The contenders of one batch size: the layers sharing one set of weights, and a timer for each way to decode."""

from __future__ import annotations

import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvattn
from benchmarks.baselines import flax_scan, flax_step, flax_twin, matvec
from benchmarks.bench_config import DEFAULT_LAYOUT, BenchConfig, tokens_timed
from benchmarks.timing import PREFILL_CHUNK, CacheFiller, CacheState, Timing, load_state, time_calls

__all__ = ["BatchBench", "Progress"]


class Progress(Protocol):
    """The progress bar the measurements advance (a tqdm bar)."""

    def set_postfix_str(self, s: str) -> None: ...

    def update(self, n: int = 1) -> None: ...


class BatchBench:
    """The layers, the stream and the baselines of one batch size."""

    def __init__(self, config: BenchConfig, batch_size: int):
        self.config = config
        self.batch_size = batch_size
        self.layers = {layout: config.layer(batch_size, layout) for layout in config.layouts}
        filler_layer = config.layer(batch_size, DEFAULT_LAYOUT, "float32")  # states are saved in float32
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

    def measure_filled(self, filled: int, progress: Progress) -> list[dict[str, Any]]:
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
        for donate, loop in ((False, "kvattn_decode"), (True, "kvattn_decode_donated")):
            for layout in config.layouts:
                plan[f"{loop}/{layout}"] = functools.partial(
                    self.time_kvattn_decode, layout, states[filled - fast], fast, donate=donate
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

    def measure_generation(self, progress: Progress) -> list[dict[str, Any]]:
        """Each fast contender timed over one whole `max_len`-token generation from an empty cache."""
        config = self.config
        count = config.max_len
        zeros = jnp.zeros((self.batch_size, count, config.num_heads, config.head_dim), jnp.float32)
        empty = CacheState(zeros, zeros, 0)
        warm_up = self.stream[:, -1]  # not among the generation's max_len tokens
        timers = {
            **{f"kvattn_step/{layout}": functools.partial(self.time_kvattn_step, layout) for layout in config.layouts},
            **{f"kvattn_decode/{layout}": functools.partial(self.time_kvattn_decode, layout) for layout in config.layouts},
            **{
                f"kvattn_decode_donated/{layout}": functools.partial(self.time_kvattn_decode, layout, donate=True)
                for layout in config.layouts
            },
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
                "ms_per_token": float(np.median(timing.ms)),
                "samples_ms_per_token": [float(t) for t in timing.ms],
            })
            progress.update()
        return rows

    def _row(self, name, filled, timing, step_bytes, calibration, reference) -> dict[str, Any]:
        """One contender's figures at one filled length, and its output's distance to `reference`."""
        ms = float(np.median(timing.ms))
        calibration_ms = float(np.median(calibration.ms))
        row = {
            "batch_size": self.batch_size,
            "filled": filled,
            "contender": name,
            "layout": name.split("/")[1] if "/" in name else None,
            "tokens_timed": tokens_timed(self.config, name),
            "ms_per_token": ms,
            "samples_ms_per_token": [float(s) for s in timing.ms],
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
        return load_state(self.layers[layout], state)

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
        timing = time_calls(layer, self.config.repeats, prepare=lambda: history)
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

        return time_calls(burst, repeats or self.config.repeats, prepare=prepare, units=count)

    def time_kvattn_decode(
        self,
        layout: str,
        state: CacheState,
        count: int,
        repeats: int | None = None,
        warm_up: jax.Array | None = None,
        *,
        donate: bool = False,
    ) -> Timing:
        """`kvattn.decode` over `count` tokens in one call, with `donate` as given.

        Every burst starts from a freshly loaded cache, so a donated burst
        only ever hands over arrays it was given for that purpose.
        """
        chunk = jax.block_until_ready(self.stream[:, state.pos : state.pos + count])
        timing = time_calls(
            lambda layer: kvattn.decode(layer, chunk, donate=donate),
            repeats or self.config.repeats,
            prepare=lambda: self.load_kvattn(layout, state),
            units=count,
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

        return time_calls(burst, repeats or self.config.repeats, prepare=prepare, units=count)

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

        timing = time_calls(burst, repeats or self.config.repeats, prepare=prepare, units=count)
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

        return time_calls(burst, self.config.repeats, units=count)
