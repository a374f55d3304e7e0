"""The one report writer: each run's results as JSON and Markdown, the Markdown also shown on the console.

Every suite builds its tables with `table`, states its targets with `target`
(one format for all: name, value, compare, threshold, met, and the batch
size or dtype they hold at), and hands the results to `write`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvattn.extra import require

__all__ = [
    "finished_rows", "model_markdown", "options_markdown", "paged_markdown", "results_markdown", "table", "target",
    "targets_table", "write",
]


def target(name: str, value: float | None, compare: str, threshold: float | None, **context) -> dict[str, Any]:
    """One target row: `value` against `threshold` (`compare` ">=" or "<=").

    `threshold` None means report only, `value` None not measured; `met` is
    None in both cases. `context` (batch_size, dtype) is kept in the row.
    """
    met = None
    if threshold is not None and value is not None:
        met = bool(value >= threshold) if compare == ">=" else bool(value <= threshold)
    value = None if value is None else float(value)
    return {"name": name, "value": value, "compare": compare, "threshold": threshold, "met": met, **context}


def finished_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without their generated tokens, with tokens per second (every sequence of the batch counted)."""
    out = []
    for row in rows:
        row = {name: value for name, value in row.items() if name != "tokens"}
        if "decode_ms_per_token" in row:
            row["tokens_per_s"] = row["batch_size"] * 1e3 / row["decode_ms_per_token"]
        out.append(row)
    return out


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A Markdown table, its first column left-aligned and the others right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def targets_table(targets: list[dict[str, Any]], context: dict[str, str]) -> list[str]:
    """The targets as a table; `context` maps a row's keys to the column headers that show them."""
    rows = []
    for t in targets:
        goal = "report" if t["threshold"] is None else f"{t['compare']} {t['threshold']:g}"
        verdict = "—" if t["met"] is None else ("met" if t["met"] else "**missed**")
        value = "n/a" if t["value"] is None else f"{t['value']:.3g}"
        rows.append([*(t[key] for key in context), t["name"], value, goal, verdict])
    return table([*context.values(), "target", "value", "goal", "verdict"], rows)


def results_markdown(results: dict[str, Any]) -> str:
    """The contenders' per-token, generation-mean and target tables, for BENCHMARKS.md."""
    config = results["config"]
    lines = []
    for batch_size in config["batch_sizes"]:
        means = {
            g["contender"]: f"{g['ms_per_token']:.3g}" + (" (whole)" if g["method"] == "whole generation" else "")
            for g in results["generation"]
            if g["batch_size"] == batch_size
        }
        rows = [r for r in results["measurements"] if r["batch_size"] == batch_size]
        body = []
        for name in dict.fromkeys(r["contender"] for r in rows):
            cells = []
            for filled in config["filled"]:
                row = next(r for r in rows if r["contender"] == name and r["filled"] == filled)
                share = "" if name == "calibration" else f", {row['calibration_share']:.0%}"
                cells.append(f"{row['ms_per_token']:.3g} ({row['bytes_per_s'] / 1e9:.3g} GB/s{share})")
            body.append([f"`{name}`", *cells, means.get(name, "—")])
        (memory,) = [m for m in results["memory"] if m["batch_size"] == batch_size]
        lines += [
            f"### B = {batch_size}, {config['dtype']} cache: ms per token (achieved GB/s, % of calibration)",
            "",
            *table(["contender", *(f"T={t}" for t in config["filled"]), "mean over generation"], body),
            "",
            f"Cache: {memory['cache_bytes_per_token_per_layer']} bytes per token per layer, "
            f"{memory['cache_bytes_total']} bytes at max_len.",
            "",
        ]
    if results.get("whole_generation"):
        lines += [
            "(whole): timed over one whole generation from an empty cache; other means interpolate the columns.",
            "",
        ]
    diff = max(r["max_abs_diff_vs_recompute"] for r in results["measurements"] if r["contender"] != "calibration")
    lines += [f"Every contender's last output matches recompute within {diff:.1e}.", "", "### Targets", ""]
    lines += targets_table(results["targets"], {"batch_size": "B"})
    return "\n".join(lines) + "\n"


def options_markdown(results: dict[str, Any]) -> str:
    """The options run's table: one row per variant, ms per token (ratio to plain) per B and T."""
    config, rows = results["config"], results["measurements"]
    columns = [(b, t) for b in config["batch_sizes"] for t in config["filled"]]
    body = []
    for name, spelled in results["variants"].items():
        cells = []
        for batch_size, filled in columns:
            (row,) = [r for r in rows if (r["batch_size"], r["filled"], r["variant"]) == (batch_size, filled, name)]
            cells.append(f"{row['ms_per_token']:.3g} ({row['ratio_to_plain']:.2f}×)")
        body.append([f"`{name}`", f"`{spelled}`", *cells])
    diff = max(r["max_abs_diff_vs_recompute"] for r in rows)
    lines = [
        f"### ms per token of `kvattn.decode` ({config['dtype']} cache, {config['layouts'][0]}; "
        "× the plain layer in the same run)",
        "",
        *table(["variant", "layer options", *(f"B={b} T={t}" for b, t in columns)], body),
        "",
        f"Every variant's last output matches its own uncached forward within {diff:.1e}.",
    ]
    return "\n".join(lines) + "\n"


def model_markdown(results: dict[str, Any]) -> str:
    """The model run's contenders and targets."""
    body = []
    for row in results["rows"]:
        base = [row["dtype"], row["batch_size"]]
        if "unavailable" in row:
            body.append([*base, row["contender"], f"unavailable: {row['unavailable']}", "", "", ""])
            continue
        name = row["contender"]
        if name == "limit":
            name = f"limit ({row['step_bytes'] / 1e6:.0f} MB at {row['bandwidth_gbs']:.1f} GB/s)"
        first = f"{row['first_token_ms']:.1f}" if "first_token_ms" in row else ""
        agree = f"{row['agrees_with_kvattn']:.2f}" if "agrees_with_kvattn" in row else ""
        body.append([*base, name, f"{row['decode_ms_per_token']:.2f}", f"{row['tokens_per_s']:.1f}", first, agree])
    header = ["dtype", "B", "contender", "decode ms/token", "tokens/s", "first token ms", "greedy agreement"]
    lines = [*table(header, body), "", "Targets of `kvattn.generation.generate`:", ""]
    if "int8" in results["config"]["dtypes"] and "int8_dot" in results:
        lines = [*table(header, body), "", f"kvattn's int8 dots: {results['int8_dot']}.", "",
                 "Targets of `kvattn.generation.generate`:", ""]
    lines += targets_table(results["targets"], {"dtype": "dtype", "batch_size": "B"})
    return "\n".join(lines) + "\n"


def paged_markdown(result: dict[str, Any]) -> str:
    """The paged run's decode steps, concurrency, prefix hit and targets."""
    sizes = result["sizes"]
    body = []
    for row in sorted(result["decode"], key=lambda r: r["filled"]):
        if row["contender"] == "calibration":
            body.append([row["filled"], "calibration", f"{row['ms_per_step']:.3f}", "", f"{row['gbs']:.1f}", ""])
        else:
            body.append([row["filled"], row["contender"], f"{row['ms_per_step']:.3f}",
                         f"{row['paged_over_contiguous']:.2f}", f"{row['gbs']:.1f}",
                         f"{100 * row['share_of_calibration']:.0f}%"])
    lines = [
        f"Layer D={sizes['in_features']}, N={sizes['num_heads']}, K={sizes['num_kv_heads']}, "
        f"page {sizes['page_size']}, max_len {sizes['max_len']}, B={sizes['batch_size']}; "
        f"medians of {sizes['repeats']} repeats.",
        "",
        *table(["filled T", "contender", "ms/step", "/ contiguous", "GB/s", "% of calibration"], body),
        "",
    ]
    for c in result["concurrency"]:
        lines += [
            f"Concurrency at mean / max length {c['mean_over_max_len']:.3f}: {c['paged_sequences']} sequences in the "
            f"memory of {c['contiguous_sequences']} contiguous ones, {c['ratio']:.2f}x (no cache can pass "
            f"max_len / mean = {c['ideal']:.2f}x).",
            "",
        ]
    hit = result["prefix_hit"]
    lines += [
        f"Prefix hit ({hit['prompt_len']}-token prompt, chunk {hit['chunk']}, {hit['cached_tokens']} tokens cached): "
        f"first token {hit['cold_ms']:.1f} ms cold, {hit['hit_ms']:.1f} ms on a hit.",
        "",
        *targets_table(result["targets"], {}),
    ]
    return "\n".join(lines) + "\n"


def write(out_dir: str | os.PathLike, stem: str, results: dict[str, Any], markdown: str) -> None:
    """Writes `<stem>.json` and `<stem>.md` under `out_dir` (created if missing) and shows the Markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    require("rich.console").Console().print(require("rich.markdown").Markdown(markdown))
