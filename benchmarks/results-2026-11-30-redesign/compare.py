"""Old-vs-new and safe-vs-donated tables of BENCHMARKS.md (2026-11-30) from the runs beside this file.

Usage: python compare.py  (reads old-*/results.json and new-*/results.json next to it)
"""

import json
import pathlib
import statistics

HERE = pathlib.Path(__file__).parent
RUNS = {side: [json.loads(p.read_text()) for p in sorted(HERE.glob(f"{side}-*/results.json"))] for side in ("old", "new")}
LAYOUTS = ("slots_major", "heads_major")


def figure(run, contender, batch, filled):
    """ms/token at filled length `filled`, or the generation mean when `filled` is "gen"."""
    if filled == "gen":
        rows = [g for g in run["generation"] if g["contender"] == contender and g["batch_size"] == batch]
    else:
        rows = [
            m
            for m in run["measurements"]
            if m["contender"] == contender and m["batch_size"] == batch and m["filled"] == filled
        ]
    (row,) = rows
    return row["ms_per_token"]


def fmt(x):
    return f"{x:.3g}"


config = RUNS["old"][0]["config"]
BATCHES, LENGTHS = config["batch_sizes"], [*config["filled"], "gen"]


def length_label(batch, filled):
    if filled != "gen":
        return str(filled)
    return "whole gen." if batch == min(BATCHES) else "gen. mean (interp.)"


PAIRS = [(f"kvattn_step/{lay}",) * 2 for lay in LAYOUTS]
PAIRS += [(f"kvattn_decode/{lay}", f"kvattn_decode_donated/{lay}") for lay in LAYOUTS]
PAIRS += [(f"kvattn_decode/{lay}",) * 2 for lay in LAYOUTS]
PAIRS += [("flax_nnx_jit",) * 2, ("flax_scan",) * 2]

print("| contender: old → new | B | T | old runs | new runs | median old | median new | new/old | new/old, each run ÷ its flax_scan |")
print("|---|---:|---|---|---|---:|---:|---:|---:|")
for old_name, new_name in PAIRS:
    if old_name == new_name:
        label = f"`{old_name}`" + (f" → `{new_name}` (safe)" if old_name.startswith("kvattn_decode/") else "")
    else:
        label = f"`{old_name}` → `{new_name}`"
    for batch in BATCHES:
        for filled in LENGTHS:
            old = [figure(r, old_name, batch, filled) for r in RUNS["old"]]
            new = [figure(r, new_name, batch, filled) for r in RUNS["new"]]
            ratio = statistics.median(new) / statistics.median(old)
            scan = "—"
            if not old_name.startswith("flax"):
                old_n = [o / figure(r, "flax_scan", batch, filled) for o, r in zip(old, RUNS["old"])]
                new_n = [n / figure(r, "flax_scan", batch, filled) for n, r in zip(new, RUNS["new"])]
                scan = f"{statistics.median(new_n) / statistics.median(old_n):.2f}"
            print(
                f"| {label} | {batch} | {length_label(batch, filled)} | {', '.join(map(fmt, old))} | "
                f"{', '.join(map(fmt, new))} | {fmt(statistics.median(old))} | {fmt(statistics.median(new))} | "
                f"{ratio:.2f} | {scan} |"
            )

def cells(values):
    return " | ".join(values)


header = " | ".join("generation (B=1 whole, B=8 interp.)" if f == "gen" else f"T={f}" for f in LENGTHS)
print()
print("Flax baselines (unchanged code): max/min over all six runs (median new / median old)")
print()
print(f"| baseline | B | {header} |")
print("|---|---:|" + "---:|" * len(LENGTHS))
for name in ("flax_nnx_jit", "flax_scan"):
    for batch in BATCHES:
        row = []
        for filled in LENGTHS:
            values = [figure(r, name, batch, filled) for side in RUNS.values() for r in side]
            old = statistics.median(figure(r, name, batch, filled) for r in RUNS["old"])
            new = statistics.median(figure(r, name, batch, filled) for r in RUNS["new"])
            row.append(f"{max(values) / min(values):.2f} ({new / old:.2f})")
        print(f"| `{name}` | {batch} | {cells(row)} |")

print()
print("Safe default / donated, same run: median of the new runs (each run)")
print()
print(f"| layout | B | {header} |")
print("|---|---:|" + "---:|" * len(LENGTHS))
for lay in LAYOUTS:
    for batch in BATCHES:
        row = []
        for filled in LENGTHS:
            ratios = [
                figure(r, f"kvattn_decode/{lay}", batch, filled) / figure(r, f"kvattn_decode_donated/{lay}", batch, filled)
                for r in RUNS["new"]
            ]
            row.append(f"**{statistics.median(ratios):.2f}** ({', '.join(f'{x:.2f}' for x in ratios)})")
        print(f"| {lay} | {batch} | {cells(row)} |")
