"""`run` and `run_options`: measure, then write the JSON, the Markdown (and plots) and show the tables."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from kvattn import extra

from benchmarks.bench_config import QUICK_SIZES, BenchConfig, contender_names, generation_contenders, tokens_timed
from benchmarks.contenders import BatchBench
from benchmarks.options import VARIANTS, measure_options
from benchmarks.plots import plot_bandwidth, plot_time
from benchmarks.provenance import load_average, machine_info, source_revision, versions
from benchmarks.report import options_markdown, results_markdown, write
from benchmarks.summary import generation_means, targets

__all__ = ["measure", "run", "run_options"]


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
    """Runs the benchmark, shows its tables and writes `results.json`, `results.md` and PNG plots.

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
      out_dir: directory for `results.json`, `results.md`, `per_token_time.png`
        and `bandwidth_share.png`; created if missing.
      quick: replace the sizes by tiny ones (a smoke test).

    Returns:
      The results, as written to `results.json`.
    """
    sizes = _sizes(in_features, num_heads, max_len, batch_sizes, filled, repeats, quick)
    sizes.setdefault("generation_repeats", generation_repeats)
    config = BenchConfig(layouts=tuple(layouts), dtype=dtype, **sizes)
    config.validate()
    started = time.perf_counter()
    results = measure(config)
    results["elapsed_s"] = time.perf_counter() - started
    write(out_dir, "results", results, results_markdown(results))
    plot_time(results, Path(out_dir) / "per_token_time.png")
    plot_bandwidth(results, Path(out_dir) / "bandwidth_share.png")
    return results


def measure(config: BenchConfig) -> dict[str, Any]:
    """Measures every contender at every batch size and filled length.

    Returns:
      The results dict (config, machine, versions, memory, measurements,
      generation means and target ratios).
    """
    names = contender_names(config.layouts)
    load_before = load_average()
    rows, whole = [], []
    steps = len(config.batch_sizes) * len(config.filled) * len(names)
    steps += len(generation_contenders(config.layouts)) if config.generation_repeats else 0
    tqdm = extra.require("tqdm").tqdm
    with tqdm(total=steps, desc="benchmarks") as progress:
        for batch_size in config.batch_sizes:
            bench = BatchBench(config, batch_size)
            for filled in config.filled:
                rows.extend(bench.measure_filled(filled, progress))
            if config.generation_repeats and batch_size == min(config.batch_sizes):
                whole.extend(bench.measure_generation(progress))
    generation = generation_means(config, rows, whole)
    return {
        **_provenance(config, load_before),
        "method": {
            "per_token": "median over repeats of (burst time / tokens), burst ending with T slots filled",
            "burst_tokens": {name: tokens_timed(config, name) for name in names},
            "generation_mean": "at the smallest batch size: median over generation_repeats of one whole "
            "max_len-token generation from an empty cache / max_len (recompute: interpolated); other batch "
            "sizes: mean over filled lengths 1..max_len of the per-token curve, linearly interpolated "
            "between measured T, constant outside them",
            "bytes_per_step": "weight bytes + filled K/V bytes (B * T * 2 * K * H * itemsize)",
            "donation": "kvattn_decode: decode(layer, xs), the default donate=False, which leaves the caller's "
            "cache arrays alive; kvattn_decode_donated: decode(layer, xs, donate=True), the cache updated in place",
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


def run_options(
    *,
    in_features: int = 512,
    num_heads: int = 8,
    max_len: int = 2048,
    batch_sizes: tuple[int, ...] = (1, 8),
    filled: tuple[int, ...] = (512, 2048),
    layout: str = "slots_major",
    dtype: str = "float32",
    repeats: int = 9,
    out_dir: str | os.PathLike = "bench-results",
    quick: bool = False,
) -> dict[str, Any]:
    """Times `kvattn.decode` on the plain layer and on each variant of `benchmarks.options.VARIANTS`.

    Writes `options.json` and `options.md` (beside, never over, `run`'s
    files) and shows the table.

    Args:
      in_features, num_heads, max_len: layer sizes.
      batch_sizes: batch sizes to measure.
      filled: filled lengths T to measure.
      layout: the cache layout of every variant.
      dtype: the cache storage dtype of every variant.
      repeats: interleaved rounds, each timing one burst of every variant
        (median reported).
      out_dir: directory for the two files; created if missing.
      quick: replace the sizes by tiny ones (a smoke test).

    Returns:
      The results, as written to `options.json`.
    """
    sizes = _sizes(in_features, num_heads, max_len, batch_sizes, filled, repeats, quick)
    sizes["generation_repeats"] = 0
    config = BenchConfig(layouts=(layout,), dtype=dtype, **sizes)
    config.validate()
    started = time.perf_counter()
    load_before = load_average()
    tqdm = extra.require("tqdm").tqdm
    with tqdm(total=len(config.batch_sizes) * len(config.filled) * config.repeats, desc="benchmarks --options") as bar:
        rows = measure_options(config, bar)
    results = {
        **_provenance(config, load_before),
        "method": {
            "per_token": "median over repeats of (burst time / tokens) of kvattn.decode(layer, xs), burst ending "
            "with T slots filled, from the cache the variant itself prefilled",
            "interleaving": "each round times one burst of every variant after an untimed warm-up burst of its "
            "own, the order starting one variant later each round",
            "ratio_to_plain": "the variant's median / the plain layer's median at the same B and T",
            "bytes_per_step": "the variant's weight bytes + filled K/V bytes (B * T * 2 * K * H * itemsize)",
        },
        "variants": {name: spelled for name, (_, spelled) in VARIANTS.items()},
        "measurements": rows,
        "elapsed_s": time.perf_counter() - started,
    }
    write(out_dir, "options", results, options_markdown(results))
    return results


def _provenance(config: BenchConfig, load_before: Any) -> dict[str, Any]:
    """The config, machine, versions and source revision a set of figures comes from."""
    return {
        "config": dataclasses.asdict(config),
        "machine": {**machine_info(), "load_average_before": load_before, "load_average_after": load_average()},
        "versions": versions(),
        "source": source_revision(),
    }


def _sizes(in_features, num_heads, max_len, batch_sizes, filled, repeats, quick) -> dict:
    """The sizes of a run (the tiny `QUICK_SIZES` with `quick`)."""
    sizes = dict(
        in_features=in_features, num_heads=num_heads, max_len=max_len, batch_sizes=tuple(batch_sizes),
        filled=tuple(sorted(set(filled))), repeats=repeats,
    )
    return sizes | QUICK_SIZES if quick else sizes
