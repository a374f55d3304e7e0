"""The run's summaries: each contender's mean over a whole generation, and the decode targets with their verdicts."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.bench_config import DEFAULT_LAYOUT, BenchConfig, contender_names
from benchmarks.report import target

__all__ = ["generation_means", "targets"]


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
    the lowest generation mean for that loop. The `kvattn_decode` targets
    measure the safe default (`donate=False`); a report-only row per layout
    gives its generation mean over the donated path's.
    """
    batch_size = min(config.batch_sizes)
    mean = {g["contender"]: g["ms_per_token"] for g in generation if g["batch_size"] == batch_size}
    default = DEFAULT_LAYOUT if DEFAULT_LAYOUT in config.layouts else config.layouts[0]

    def fastest(loop):
        return min(config.layouts, key=lambda layout: mean[f"{loop}/{layout}"])

    def at(name, filled):
        (row,) = [r for r in rows if _matches(r, batch_size, name) and r["filled"] == filled]
        return row

    def check(name, value, compare, threshold):
        return target(name, value, compare, threshold, batch_size=batch_size)

    def speedup(baseline, contender, threshold, note=""):
        return check(f"{contender}{note} vs {baseline}", mean[baseline] / mean[contender], ">=", threshold)

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
            check(f"kvattn_decode/{layout} share of calibration bandwidth at T={longest}", share, ">=", threshold)
        )
    for name in [f"kvattn_decode/{layout}" for layout in config.layouts] + ["calibration"]:
        ratio = at(name, shortest)["ms_per_token"] / at(name, longest)["ms_per_token"]
        # The calibration's own ratio is the bound a purely bandwidth-bound step would reach.
        threshold = 0.5 if name == f"kvattn_decode/{decode_fast}" else None
        found.append(check(f"{name} time at T={shortest} / at T={longest}", ratio, "<=", threshold))
    for layout in config.layouts:
        # What keeping the caller's cache costs beside updating it in place.
        safe, donated = f"kvattn_decode/{layout}", f"kvattn_decode_donated/{layout}"
        found.append(check(f"{safe} (safe default) / {donated} time", mean[safe] / mean[donated], "<=", None))
    return found

