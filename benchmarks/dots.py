"""`python -m benchmarks.dots`: the ways to multiply activations by stored weights on this backend, side by side.

What `kvattn.math.quant` chose is measured here, on a stack of `LAYERS` weights
of the 125M model's widest projection (`D` -> `F`, Llama's fused gate and
up), chained so that no dot can start before the one ahead of it ends, for
`M` rows (decode at batch size M). Every variant is one `jax.jit` program,
timed after a warm-up with `block_until_ready`, interleaved with the others,
the median of `repeats`:

  float32                 `x @ W`, W `(D, F)` float32 (XLA's dot)
  float32, native (panels)  `kvattn.kernels.dots.dense` of a `PanelWeights`: the same
                          float32 W laid out in panels of 16 outputs for
                          kvattn's native float32 dot, where it runs (what
                          float32 models run there)
  int8, native (tiled)    `kvattn.kernels.dots.dense` of a `TiledInt8Weights`:
                          the same int8 values laid out for kvattn's native
                          dot (AVX512-VNNI or AVX2, `kvattn.kernels.native`), where it runs
  int4, native            `kvattn.kernels.dots.dense` of an `Int4Weights`
                          (`kvattn.math.int4`: 4-bit values, a bfloat16
                          scale per 32 inputs) on kvattn's native 4-bit dot
  int4, native (tiled)    the same on a `TiledInt4Weights` (eight outputs'
                          blocks side by side: what int4 models store where
                          the native dot runs)
  int4, XLA's twin        the same dot as XLA runs it where the native one
                          cannot (its twin: a batched int8 dot per group)
  int8                    `kvattn.kernels.dots.dense` of an `Int8Weights`: W int8
                          `(F, D)` with per-output scales, x quantized per
                          row, XLA's int8 by int8 into int32 (one row padded
                          to two)
  int8, one row unpadded  the same dot with a single row, as XLA:CPU gets it
                          without the padding
  int8, (D, F)            the int8 dot with W stored inputs-first
  int8, operands swapped  the same int8 dot with W as its first operand,
                          the rows second, `(F, M)` transposed after
  int8, uint8 rows        x shifted to uint8 (x + 128, VNNI's u8 by s8
                          form), `128 * sum(W)` per output taken back
  int8, weight-only (F, D)  W int8 `(F, D)` converted to float32 inside the
                          dot that reads it, x float32, then scaled
  int8, converted         W int8 converted to float32 before a float32 dot
                          (weight-only quantization, dequantized per call)
  bfloat16                W bfloat16, x cast to bfloat16, accumulated in
                          float32 (`preferred_element_type`)

With `--torch-python`, the same stack in torch (CPU), in a subprocess, as
torch's own answer to the same dots:

  torch float32           `torch.nn.functional.linear`, W `(F, D)` float32
  torch int8 (dynamic)    `torch.ao.nn.quantized.dynamic.Linear` (qint8,
                          FBGEMM: per-tensor activation scales, weights
                          packed once, ahead of the calls)

Each row gives milliseconds for the stack and the weight bytes read per
second. Writes `dots.json` and `dots.md`; `XLA_FLAGS` as found is recorded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from benchmarks import torch_worker
from benchmarks.provenance import load_average, machine_info, source_revision, versions
from benchmarks.report import table, write

__all__ = ["measure_dots", "measure_torch"]

LAYERS, D, F = 12, 768, 4096


def _variants() -> dict[str, tuple[Any, Any]]:
    """name -> (one layer's dot `(x, w) -> y (M, F)`, the stacked weights it reads)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from kvattn.kernels import dots, native
    from kvattn.math import int4, quant

    rng = np.random.default_rng(0)
    floats = [rng.standard_normal((D, F), np.float32) * 0.02 for _ in range(LAYERS)]
    int8 = [quant.quantize(w) for w in floats]
    inputs_first = [quant.Int8Weights(np.ascontiguousarray(k.values.T), k.scale) for k in int8]

    def unpadded(x, w):
        values, scale = quant.quantize_rows(x)
        products = lax.dot_general(values, w.values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
        return products.astype(jnp.float32) * scale * w.scale[None]

    def inputs_first_dot(x, w):
        values, scale = quant.quantize_rows(x)
        products = lax.dot_general(values, w.values, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        return products.astype(jnp.float32) * scale * w.scale[None]

    def swapped(x, w):  # the weights as the dot's first operand, the rows second: (F, M), transposed after
        values, scale = quant.quantize_rows(x)
        products = lax.dot_general(w.values, values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
        return products.T.astype(jnp.float32) * scale * w.scale[None]

    def unsigned(x, w):  # rows shifted to uint8 (VNNI multiplies u8 by s8), the shift's products taken back
        values, scale = quant.quantize_rows(x)
        shifted = (values.astype(jnp.int32) + 128).astype(jnp.uint8)
        products = lax.dot_general(shifted, w.values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
        products = products - 128 * jnp.sum(w.values.astype(jnp.int32), axis=1)[None]
        return products.astype(jnp.float32) * scale * w.scale[None]

    def weight_only(x, w):  # the int8 (F, D) values converted inside the dot that reads them, x stays float
        return lax.dot_general(x, w.values.astype(jnp.float32), (((1,), (1,)), ((), ()))) * w.scale[None]

    def converted(x, w):
        return x @ (w.values.astype(jnp.float32).T * w.scale[None])

    def bfloat16(x, w):
        return lax.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)

    def device(weights):
        return [jax.tree.map(jnp.asarray, w) for w in weights]  # a form is a pytree of its arrays

    tiled = [quant.tile(k) for k in int8] if native.available(native.INT8_DOT) else []
    panels = [quant.panel(jnp.asarray(w)) for w in floats] if native.available(native.F32_DOT) else []
    bf16_panels = [quant.panel(jnp.asarray(w, jnp.bfloat16)) for w in floats] if native.available(
        native.BF16_DOT) else []
    four = [int4.quantize_groups(w) for w in floats]

    def four_on_xla(x, w):  # what an int4 model runs where the native dot does not
        values, scale = quant.quantize_rows(x)
        return native.int4_dot_on_xla(values, w.packed, w.scale) * scale
    return {
        "float32": (lambda x, w: x @ w, device(floats)),
        **({"float32, native (panels)": (dots.dense, panels)} if panels else {}),
        **({"bfloat16, native (panels)": (dots.dense, bf16_panels)} if bf16_panels else {}),
        **({"int8, native (tiled)": (dots.dense, device(tiled))} if tiled else {}),
        **({"int4, native": (dots.dense, device(four)),
            "int4, native (tiled)": (dots.dense, device([int4.tile(w) for w in four]))}
           if native.available(native.INT4_DOT) else {}),
        "int4, XLA's twin": (four_on_xla, device(four)),
        "int8": (dots.dense, device(int8)),
        "int8, one row unpadded": (unpadded, device(int8)),
        "int8, (D, F)": (inputs_first_dot, device(inputs_first)),
        "int8, operands swapped": (swapped, device(int8)),
        "int8, uint8 rows": (unsigned, device(int8)),
        "int8, weight-only (F, D)": (weight_only, device(int8)),
        "int8, converted": (converted, device(int8)),
        "bfloat16": (bfloat16, [jnp.asarray(w, jnp.bfloat16) for w in floats]),
    }


def _stack(dot):
    """`jax.jit` of the chained stack: each layer's input depends on the output before it."""
    import jax

    def run(x, weights):
        for w in weights:
            y = dot(x, w)
            x = x + 1e-3 * y[:, : x.shape[1]]
        return x

    return jax.jit(run)


def _bytes(weights) -> int:
    import jax

    return sum(leaf.nbytes for leaf in jax.tree.leaves(weights))


def measure_dots(rows=(1, 2, 8), repeats: int = 15) -> dict[str, Any]:
    """Milliseconds per stack of every variant at every row count (module docstring)."""
    import jax
    import jax.numpy as jnp

    variants = _variants()
    results = []
    for m in rows:
        x = jnp.asarray(np.random.default_rng(1).standard_normal((m, D), np.float32))
        programs = {name: (_stack(dot), weights) for name, (dot, weights) in variants.items()}
        for program, weights in programs.values():
            jax.block_until_ready(program(x, weights))  # compile, untimed
        samples = {name: [] for name in programs}
        for _ in range(repeats):
            for name, (program, weights) in programs.items():
                started = time.perf_counter()
                jax.block_until_ready(program(x, weights))
                samples[name].append(time.perf_counter() - started)
        for name, (_, weights) in programs.items():
            seconds = statistics.median(samples[name])
            results.append({"rows": m, "variant": name, "ms": 1e3 * seconds, "weight_bytes": _bytes(weights),
                            "weight_gbs": _bytes(weights) / seconds / 1e9})
    return {"layers": LAYERS, "in_features": D, "out_features": F, "repeats": repeats, "results": results}


_TORCH_SCRIPT = r"""
import statistics, time
layers, d, f = args["layers"], args["in_features"], args["out_features"]
generator = torch.Generator().manual_seed(0)
weights = [torch.randn(f, d, generator=generator) * 0.02 for _ in range(layers)]
compact = []
for w in weights:
    linear = torch.ao.nn.quantized.dynamic.Linear(d, f, dtype=torch.qint8)
    scale = w.abs().amax(dim=1) / 127
    q = torch.quantize_per_channel(w, scale.double(), torch.zeros(f, dtype=torch.long), 0, torch.qint8)
    linear.set_weight_bias(q, None)
    compact.append(linear)
variants = {"torch float32": lambda x, i: torch.nn.functional.linear(x, weights[i]),
            "torch int8 (dynamic)": lambda x, i: compact[i](x)}
out = {"torch": torch.__version__, "results": []}
with torch.inference_mode():
    for m in args["rows"]:
        x0 = torch.randn(m, d, generator=generator)
        def run(dot):
            x = x0
            for i in range(layers):
                x = x + 1e-3 * dot(x, i)[:, :d]
            return x
        for dot in variants.values():
            run(dot)
        samples = {name: [] for name in variants}
        for _ in range(args["repeats"]):
            for name, dot in variants.items():
                started = time.perf_counter()
                run(dot)
                samples[name].append(time.perf_counter() - started)
        for name in variants:
            out["results"].append({"rows": m, "variant": name, "seconds": statistics.median(samples[name])})
print(json.dumps(out))
"""


def measure_torch(python: str, rows, repeats: int, threads: int = 2) -> dict[str, Any]:
    """The torch variants (module docstring), run by `python` in a subprocess; rows or `unavailable`."""
    args = {"layers": LAYERS, "in_features": D, "out_features": F, "rows": list(rows), "repeats": repeats,
            "threads": threads}
    measured = torch_worker.run(python, _TORCH_SCRIPT, args)
    if "unavailable" in measured:
        return measured
    weight_bytes = {"torch float32": LAYERS * D * F * 4, "torch int8 (dynamic)": LAYERS * (D * F + 4 * F)}
    return {"torch": measured["torch"], "results": [
        {"rows": r["rows"], "variant": r["variant"], "ms": 1e3 * r["seconds"],
         "weight_bytes": weight_bytes[r["variant"]], "weight_gbs": weight_bytes[r["variant"]] / r["seconds"] / 1e9}
        for r in measured["results"]]}


def markdown(results: dict[str, Any]) -> str:
    body = [[r["rows"], r["variant"], f"{r['ms']:.2f}", f"{r['weight_bytes'] / 1e6:.0f}", f"{r['weight_gbs']:.1f}"]
            for r in sorted(results["results"], key=lambda r: r["rows"])]
    header = ["M", "variant", "ms per stack", "weight MB", "weight GB/s"]
    title = (f"{results['layers']} chained dots ({results['in_features']} -> {results['out_features']}), median of "
             f"{results['repeats']}; XLA_FLAGS={results['xla_flags']!r}")
    return "\n".join([title, "", *table(header, body)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dots", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8], help="M: rows per dot")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--torch-python", help="also time torch's float32 and dynamic int8 Linear, run by this Python")
    parser.add_argument("--out-dir", default="bench-results")
    args = parser.parse_args(argv)
    load = load_average()
    results = {"xla_flags": os.environ.get("XLA_FLAGS"), **measure_dots(tuple(args.rows), args.repeats),
               "machine": machine_info(), "versions": versions(), "source": source_revision()}
    if args.torch_python:
        torch = measure_torch(args.torch_python, args.rows, args.repeats)
        results["torch"] = torch.get("torch", torch.get("unavailable"))
        results["results"] += torch.get("results", [])
    results["load_average"] = {"before": load, "after": load_average()}
    write(args.out_dir, "dots", results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
