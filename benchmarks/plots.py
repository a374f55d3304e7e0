"""The run's plots: per-token time and share of the calibration bandwidth against filled length."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvattn.extra import require

__all__ = ["plot_bandwidth", "plot_time"]


def _by_batch(results: dict[str, Any]):
    """Yields `(batch_size, {contender: (filled, rows)})` for the plots."""
    for batch_size in results["config"]["batch_sizes"]:
        curves = {}
        for row in results["measurements"]:
            if row["batch_size"] == batch_size:
                curves.setdefault(row["contender"], []).append(row)
        yield batch_size, curves


def _figure(results: dict[str, Any]) -> tuple[Any, list]:
    """A matplotlib `Figure` and its axes: one panel per batch size, filled lengths on a log-2 axis ticked at the measured T."""
    batch_sizes, filled = results["config"]["batch_sizes"], results["config"]["filled"]
    Figure = require("matplotlib.figure").Figure
    figure = Figure(figsize=(5 * len(batch_sizes) + 3, 4.5), layout="constrained")
    axes = list(figure.subplots(1, len(batch_sizes), squeeze=False)[0])
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(filled, labels=[str(t) for t in filled])
        ax.grid(True, which="both", alpha=0.3)
    return figure, axes


def _save(figure: Any, axes: list, path: Path) -> None:
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
