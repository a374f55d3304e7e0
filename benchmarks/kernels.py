"""`python -m benchmarks.kernels`: decode steps on jax's Pallas GPU kernels against XLA, on a GPU.

Each contender runs a compiled loop of `burst` decode steps at B=8 (written
first, as the decoding drivers do) with the layer's `decode_kernel` forced to
`"xla"` or to `"pallas"` (see `kvattn.kernels`), at several filled lengths:

- contiguous: the drivers' working form, heads-major (the decode kernel's
  layout, read in place);
- paged/slots_major, paged/heads_major: a page pool of either layout.

Reported per row: ms per step, the bytes one step reads (weights and the
filled cache), GB/s, their share of the calibration (a streaming read of the
same bytes, `benchmarks.baselines.bandwidth`: what memory delivers to a plain read),
paged over contiguous for the same implementation, and how far the kernel's
outputs are from XLA's. Targets (issue #23): a paged step at most 1.2x the
contiguous one at B=8, and decoding at T=2048 at least 70% of the
calibration bandwidth.

On a backend that is not a GPU nothing is timed: the report says the kernel
path is unavailable (interpret mode checks correctness, not speed; the XLA
path on CPU is `python -m benchmarks --paged`). Times are medians over
repeats after a warm-up call, with `block_until_ready`.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
from typing import Any

import numpy as np

from benchmarks.report import table, target, write
from benchmarks.timing import step_loop, time_calls

__all__ = ["KERNEL_DEFAULTS", "KERNEL_QUICK", "measure_kernels", "run_kernels"]

KERNEL_DEFAULTS = {
    "batch_size": 8, "max_len": 2048, "page_size": 16, "filled": (512, 2048), "burst": 16, "repeats": 7,
    "in_features": 1024, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
}
KERNEL_QUICK = {
    "batch_size": 2, "max_len": 64, "page_size": 16, "filled": (32, 64), "burst": 4, "repeats": 2,
    "in_features": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
}
IMPLEMENTATIONS = ("xla", "pallas")


def _layers(sizes: dict, implementation: str) -> dict:
    from flax import nnx

    import kvattn

    num_pages = 1 + sizes["batch_size"] * math.ceil(sizes["max_len"] / sizes["page_size"])

    def build(layout, **paging):
        return kvattn.MultiHeadAttention(
            sizes["num_heads"], sizes["in_features"], num_kv_heads=sizes["num_kv_heads"], head_dim=sizes["head_dim"],
            max_len=sizes["max_len"], batch_size=sizes["batch_size"], cache_layout=layout, rngs=nnx.Rngs(0),
            decode_kernel=implementation, **paging,
        )

    return {
        "contiguous": build("heads_major"),
        "paged/slots_major": build("slots_major", num_pages=num_pages, page_size=sizes["page_size"]),
        "paged/heads_major": build("heads_major", num_pages=num_pages, page_size=sizes["page_size"]),
    }


def _fresh_cache(layer, pages, start: int):
    """An empty cache of `layer` holding `start` tokens per sequence (paged: through `pages`), nothing pending."""
    import jax
    import jax.numpy as jnp

    from kvattn.caches import paged

    config = layer.config
    if config.paged:
        arrays = {name: jnp.zeros(shape, dtype) for name, (shape, _, dtype) in paged.variables(config).items()}
        cache = paged.bound_pool(config, arrays, jnp.asarray(pages.table), jnp.asarray(pages.pos))
    else:
        cache = jax.tree.map(jnp.zeros_like, layer.cache)
    return jax.block_until_ready(cache.replace(pos=jnp.full((config.batch_size,), start, jnp.int32)))


def _time_steps(layer, weights, xs, pages, start: int, repeats: int):
    """Seconds per step of `layer`'s loop from a fresh cache (never timed), and the loop's summed outputs."""
    loop = step_loop(layer.config, xs.shape[1])
    timing = time_calls(lambda cache: loop(weights, cache, xs)[1], repeats,
                        prepare=functools.partial(_fresh_cache, layer, pages, start), units=xs.shape[1])
    return statistics.median(timing.ms) * 1e-3, np.asarray(timing.last_output)


def decode_steps(sizes: dict, rng) -> list[dict[str, Any]]:
    """ms per step of every contender and implementation at each filled length, with the calibration."""
    import jax
    import jax.numpy as jnp

    from benchmarks.baselines import bandwidth
    from kvattn.errors import UnsupportedConfigError
    from kvattn.paging import PageManager

    batch, max_len, page_size, burst = sizes["batch_size"], sizes["max_len"], sizes["page_size"], sizes["burst"]
    layers = {implementation: _layers(sizes, implementation) for implementation in IMPLEMENTATIONS}
    reference = layers["xla"]["contiguous"]
    weights = reference.weights.fused()
    weight_bytes = sum(w.size * w.dtype.itemsize for w in jax.tree.leaves(weights))
    rows = []
    for filled in sizes["filled"]:
        start = filled - burst
        xs = jnp.asarray(rng.standard_normal((batch, burst, sizes["in_features"])).astype(np.float32))
        manager = PageManager(layers["xla"]["paged/slots_major"].config.num_pages, page_size, batch,
                              math.ceil(max_len / page_size))
        for _ in range(batch):
            manager.add()
        manager.reserve(np.full(batch, start, np.int32))
        pages = manager.reserve(np.full(batch, burst, np.int32))  # a compiled loop reserves before it starts
        step_bytes = weight_bytes + batch * filled * reference.config.cache_bytes_per_token
        limit = bandwidth(step_bytes, sizes["repeats"])
        times, outputs = {}, {}
        for implementation, contenders in layers.items():
            for name, layer in contenders.items():
                try:
                    times[implementation, name], outputs[implementation, name] = _time_steps(
                        layer, weights, xs, pages, start, sizes["repeats"]
                    )
                except UnsupportedConfigError as refusal:
                    rows.append({"implementation": implementation, "contender": name, "filled": filled,
                                 "refused": str(refusal)})
        for (implementation, name), seconds in times.items():
            contiguous = times.get((implementation, "contiguous"))
            xla = outputs["xla", name]
            rows.append({
                "implementation": implementation, "contender": name, "filled": filled, "ms_per_step": 1e3 * seconds,
                "step_bytes": step_bytes, "gbs": step_bytes / seconds / 1e9,
                "share_of_calibration": step_bytes / limit / seconds,
                "over_contiguous": None if contiguous is None else seconds / contiguous,
                "max_diff_from_xla": float(np.max(np.abs(outputs[implementation, name] - xla)) / np.max(np.abs(xla))),
            })
        rows.append({"implementation": "", "contender": "calibration", "filled": filled,
                     "ms_per_step": 1e3 * step_bytes / limit, "step_bytes": step_bytes, "gbs": limit / 1e9})
    return rows


def _targets(rows: list[dict[str, Any]], sizes: dict) -> list[dict[str, Any]]:
    timed = [r for r in rows if r.get("implementation") == "pallas" and "ms_per_step" in r]
    paged = [r["over_contiguous"] for r in timed if r["contender"].startswith("paged/") and r["over_contiguous"]]
    longest = [r["share_of_calibration"] for r in timed if r["contender"] == "contiguous"
               and r["filled"] == max(sizes["filled"])]
    return [
        target(f"pallas paged step / contiguous at B={sizes['batch_size']} (worst)", max(paged, default=None), "<=",
               1.2),
        target(f"pallas decode at T={max(sizes['filled'])}: share of calibration bandwidth",
               max(longest, default=None), ">=", 0.7),
    ]


def measure_kernels(*, quick: bool = False, repeats: int | None = None, seed: int = 0, **overrides) -> dict[str, Any]:
    """Every row and the targets, or, off a GPU, only why the kernel path is unavailable."""
    import jax

    from kvattn.kernels import route

    sizes = dict(KERNEL_QUICK if quick else KERNEL_DEFAULTS, **overrides)
    if repeats is not None:
        sizes["repeats"] = repeats
    device = str(jax.devices()[0].device_kind)
    result = {"sizes": sizes, "backend": jax.default_backend(), "device": device, "available": route.on_gpu()}
    if not result["available"]:
        result["reason"] = (
            f"the backend is {result['backend']!r}: jax's Pallas GPU kernels need a GPU, and their interpret mode "
            "checks correctness, not speed; nothing was timed"
        )
        return result
    result["decode"] = decode_steps(sizes, np.random.default_rng(seed))
    result["targets"] = _targets(result["decode"], sizes)
    return result


def kernels_markdown(result: dict[str, Any]) -> str:
    sizes = result["sizes"]
    lines = [
        (f"Backend {result['backend']} ({result['device']}); layer D={sizes['in_features']}, N={sizes['num_heads']}, "
         f"K={sizes['num_kv_heads']}, H={sizes['head_dim']}, page {sizes['page_size']}, max_len {sizes['max_len']}, "
         f"B={sizes['batch_size']}."),
        "",
    ]
    if not result["available"]:
        return "\n".join([*lines, f"Kernel path unavailable: {result['reason']}.", ""])
    body = []
    for row in sorted(result["decode"], key=lambda r: (r["filled"], r["implementation"], r["contender"])):
        if "refused" in row:
            body.append([row["filled"], row["implementation"], row["contender"], "refused", "", "", "", ""])
        elif row["contender"] == "calibration":
            body.append([row["filled"], "", "calibration", f"{row['ms_per_step']:.3f}", "", f"{row['gbs']:.3g}", "", ""])
        else:
            ratio = "" if row["over_contiguous"] is None else f"{row['over_contiguous']:.2f}"
            body.append([row["filled"], row["implementation"], row["contender"], f"{row['ms_per_step']:.3f}", ratio,
                         f"{row['gbs']:.3g}", f"{100 * row['share_of_calibration']:.0f}%",
                         f"{row['max_diff_from_xla']:.1e}"])
    lines += [
        *table(["filled T", "path", "contender", "ms/step", "/ contiguous", "GB/s", "% of calibration",
                "max diff / max (vs xla)"], body),
        "",
        *table(["target", "value", "goal", "verdict"], [
            [t["name"], "n/a" if t["value"] is None else f"{t['value']:.3g}", f"{t['compare']} {t['threshold']:g}",
             "—" if t["met"] is None else ("met" if t["met"] else "**missed**")] for t in result["targets"]
        ]),
    ]
    for row in result["decode"]:
        if "refused" in row:
            lines += ["", f"{row['implementation']} {row['contender']} at T={row['filled']}: {row['refused']}"]
    return "\n".join(lines) + "\n"


def run_kernels(*, out_dir: str | os.PathLike = "bench-results", quick: bool = False,
                repeats: int | None = None) -> dict[str, Any]:
    """Measures, writes `kernels.json` and `kernels.md` under `out_dir`, shows the tables."""
    result = measure_kernels(quick=quick, repeats=repeats)
    write(out_dir, "kernels", result, kernels_markdown(result))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, help="timed repeats per figure (median reported)")
    parser.add_argument("--out-dir", default="bench-results", help="where kernels.json and kernels.md go")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    args = parser.parse_args(argv)
    run_kernels(out_dir=args.out_dir, quick=args.quick, repeats=args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
