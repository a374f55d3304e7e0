"""`kvattn demo`: decode a seeded stream through the cache, check it, and time it against baselines."""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvattn
from kvattn.extra import require

__all__ = ["flax_twin", "run_demo"]


def flax_twin(layer: kvattn.MultiHeadAttention, batch_size: int) -> nnx.MultiHeadAttention:
    """Flax's `nnx.MultiHeadAttention(decode=True)` holding `layer`'s weights, its cache ready for `batch_size`."""
    twin = nnx.MultiHeadAttention(
        layer.num_heads,
        layer.in_features,
        qkv_features=layer.num_heads * layer.head_dim,
        num_kv_heads=layer.num_kv_heads,
        use_bias=layer.use_bias,
        decode=True,
        rngs=nnx.Rngs(0),
    )
    nnx.update(twin, nnx.state(layer, nnx.Param))
    twin.init_cache((batch_size, layer.max_len, layer.in_features))
    return twin


def _timed(fn, *args):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def _flax_step_time(layer: kvattn.MultiHeadAttention, xs, num_steps: int) -> float:
    """Median seconds per token of Flax's decode layer with the same weights, stepped by `nnx.jit`."""
    flax_layer = flax_twin(layer, xs.shape[0])
    step = nnx.jit(lambda module, x: module(x))
    step(flax_layer, xs[:, :1])  # compile
    return statistics.median(_timed(step, flax_layer, xs[:, t : t + 1]) for t in range(1, num_steps + 1))


def _recompute_time(layer: kvattn.MultiHeadAttention, xs, num_lengths: int = 6) -> float:
    """Seconds per token to recompute full attention over the history, averaged over the stream."""
    forward = nnx.jit(lambda module, history: module(history)[..., -1, :])
    lengths = np.linspace(1, xs.shape[1], num_lengths).round().astype(int)
    times = []
    for length in lengths:
        history = xs[:, :length]
        forward(layer, history)  # compile this length
        times.append(statistics.median(_timed(forward, layer, history) for _ in range(3)))
    return float(np.mean(times))


def run_demo(
    *,
    in_features: int = 512,
    num_heads: int = 8,
    num_kv_heads: int | None = None,
    max_len: int = 2048,
    num_tokens: int = 512,
    batch_size: int | None = None,
    cache_layout: str = "slots_major",
    seed: int = 0,
    tolerance: float = 1e-4,
    console: Any = None,
) -> dict:
    """Decodes a seeded random stream one step at a time, checks it, times it, prints a report.

    Every cached output is compared with full causal attention over the same
    stream (the layer's uncached path). Then the cached step is timed against
    Flax's `nnx.MultiHeadAttention(decode=True)` holding the same weights and
    against recomputing attention from the history.

    Args:
      in_features, num_heads, num_kv_heads, max_len, batch_size, cache_layout:
        the layer, as in `MultiHeadAttention`.
      num_tokens: length of the decoded stream (at most `max_len`).
      seed: seeds the weights and the stream.
      tolerance: largest max-abs error that passes.
      console: the rich `Console` to print to (a fresh one by default).

    Returns:
      The report: `max_abs_error`, `passed`, and seconds per token for
      `kvattn_step`, `flax_decode` and `recompute`, with the two speedups.
    """
    if num_tokens > max_len:
        raise ValueError(f"num_tokens ({num_tokens}) must not exceed max_len ({max_len})")
    console = console or require("rich.console").Console()
    layer = kvattn.MultiHeadAttention(
        num_heads,
        in_features,
        max_len=max_len,
        num_kv_heads=num_kv_heads,
        batch_size=batch_size,
        cache_layout=cache_layout,
        rngs=nnx.Rngs(seed),
    )
    batch = batch_size or 1
    xs = jax.random.normal(jax.random.key(seed + 1), (batch, num_tokens, in_features))
    stream = xs if batch_size else xs[0]

    decoder = kvattn.Decoder(layer)
    outputs, step_times = [], []
    for t in range(num_tokens):
        token = stream[..., t, :]
        start = time.perf_counter()
        outputs.append(jax.block_until_ready(decoder.step(token)))
        step_times.append(time.perf_counter() - start)
    cached = jnp.stack(outputs, axis=-2)
    full = layer(stream)
    max_abs_error = float(jnp.max(jnp.abs(cached - full)))
    passed = bool(np.isfinite(max_abs_error) and max_abs_error <= tolerance)

    kvattn_step = statistics.median(step_times[1:]) if num_tokens > 1 else step_times[0]
    flax_decode = _flax_step_time(layer, xs, num_steps=min(64, num_tokens - 1) or 1)
    recompute = _recompute_time(layer, xs)
    report = dict(
        max_abs_error=max_abs_error,
        passed=passed,
        kvattn_step=kvattn_step,
        flax_decode=flax_decode,
        recompute=recompute,
        speedup_vs_flax=flax_decode / kvattn_step,
        speedup_vs_recompute=recompute / kvattn_step,
    )
    _print_report(console, report, layer, num_tokens)
    return report


def _print_report(console: Any, report: dict, layer: kvattn.MultiHeadAttention, num_tokens: int) -> None:
    shape = f"D={layer.in_features} H={layer.num_heads} K={layer.num_kv_heads} Dh={layer.head_dim}"
    batch = f" batch={layer.batch_size}" if layer.batch_size else ""
    console.print(f"[bold]kvattn demo[/]: {shape} max_len={layer.max_len}{batch} layout={layer.cache_layout}")
    verdict = "[green]PASS[/]" if report["passed"] else "[red]FAIL[/]"
    console.print(
        f"decoded {num_tokens} tokens one step at a time; max |cached - full causal attention| = "
        f"{report['max_abs_error']:.2e}  {verdict}"
    )
    Table = require("rich.table").Table
    table = Table(title="per-token time (median, compile excluded)")
    table.add_column("path")
    table.add_column("ms / token", justify="right")
    table.add_column("kvattn speedup", justify="right")
    table.add_row("kvattn cached step (Decoder)", f"{report['kvattn_step'] * 1e3:.3f}", "1.0x")
    table.add_row(
        "flax nnx.MultiHeadAttention(decode=True), nnx.jit",
        f"{report['flax_decode'] * 1e3:.3f}",
        f"{report['speedup_vs_flax']:.1f}x",
    )
    table.add_row(
        "recompute full attention from history",
        f"{report['recompute'] * 1e3:.3f}",
        f"{report['speedup_vs_recompute']:.1f}x",
    )
    console.print(table)
