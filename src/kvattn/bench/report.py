"""The runs' tables: Markdown for BENCHMARKS.md, and rich tables on the console."""

from __future__ import annotations

from typing import Any

from kvattn.bench.extra import require

__all__ = ["markdown_tables", "options_markdown", "print_options", "print_tables"]


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
    console = require("rich.console").Console()
    Table = require("rich.table").Table
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


def options_markdown(results: dict[str, Any]) -> str:
    """`run_options`'s table as Markdown: one row per variant, ms per token (ratio to plain) per B and T."""
    config, rows = results["config"], results["measurements"]
    columns = [(b, t) for b in config["batch_sizes"] for t in config["filled"]]
    lines = [
        f"### ms per token of `kvattn.decode` ({config['dtype']} cache, {config['layouts'][0]}; "
        "× the plain layer in the same run)",
        "",
        "| variant | layer options | " + " | ".join(f"B={b} T={t}" for b, t in columns) + " |",
        "|---|---|" + "---:|" * len(columns),
    ]
    for name, spelled in results["variants"].items():
        cells = []
        for batch_size, filled in columns:
            (row,) = [r for r in rows if (r["batch_size"], r["filled"], r["variant"]) == (batch_size, filled, name)]
            cells.append(f"{row['ms_per_token']:.3g} ({row['ratio_to_plain']:.2f}×)")
        lines.append(f"| `{name}` | `{spelled}` | " + " | ".join(cells) + " |")
    diff = max(r["max_abs_diff_vs_recompute"] for r in rows)
    lines += ["", f"Every variant's last output matches its own uncached forward within {diff:.1e}."]
    return "\n".join(lines) + "\n"


def print_options(results: dict[str, Any]) -> None:
    """Prints `run_options`'s rows with rich."""
    console = require("rich.console").Console()
    table = require("rich.table").Table(title="What each layer option costs per decoded token (kvattn.decode)")
    for column in ("B", "T", "variant", "ms/token", "× plain", "GB/s", "|Δ|"):
        table.add_column(column, justify="left" if column == "variant" else "right", no_wrap=True)
    for row in results["measurements"]:
        table.add_row(
            str(row["batch_size"]),
            str(row["filled"]),
            row["variant"],
            f"{row['ms_per_token']:.4g}",
            f"{row['ratio_to_plain']:.2f}",
            f"{row['bytes_per_s'] / 1e9:.3g}",
            f"{row['max_abs_diff_vs_recompute']:.0e}",
        )
    console.print(table)
