"""`python -m benchmarks.xla_flags`: whole-model generation under candidate XLA:CPU flags, in alternating processes.

kvattn sets no XLA flag: flags are process-wide, and which are fastest
depends on the machine and the jaxlib. This measures candidates as a user
would set them, in `XLA_FLAGS` before JAX starts, on the model benchmark's
checkpoint (`benchmarks.model.LLAMA_125M`, random weights): each round runs
one subprocess per candidate, in turn, and each subprocess times
`kvattn.generation.generate` for every batch size and weights (after an untimed
warm-up, `t(n)` the median over `repeats` runs producing n new tokens from
empty caches; decode ms/token `(t(new_tokens) - t(1)) / (new_tokens - 1)`,
first token `t(1)`). A candidate's figure is the median over rounds; its
tokens are compared with the default's.

  default          XLA_FLAGS as this process found it
  ynn_off          --xla_cpu_experimental_ynn_fusion_type= (no YNNPACK
                   fusions: XLA's own dots and reductions)
  ynn_dots_only    --xla_cpu_experimental_ynn_fusion_type=individual_dot
                   (YNNPACK dots, XLA's reductions)
  vector_width_512 --xla_cpu_prefer_vector_width=512 (the default is 256)

A candidate's flags are appended to the `XLA_FLAGS` found, so they win over
the same flag there. Writes `xla_flags.json` and `xla_flags.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.model import LLAMA_125M, write_llama_checkpoint
from benchmarks.provenance import load_average, machine_info, source_revision, versions
from benchmarks.report import table, write

__all__ = ["CANDIDATES", "measure_flags"]

CANDIDATES = {
    "default": "",
    "ynn_off": "--xla_cpu_experimental_ynn_fusion_type=",
    "ynn_dots_only": "--xla_cpu_experimental_ynn_fusion_type=individual_dot",
    "vector_width_512": "--xla_cpu_prefer_vector_width=512",
}

_CHILD = r"""
import json, statistics, sys, time
import jax, numpy as np
from kvattn import generation, models
args = json.loads(sys.argv[1])
out = []
for batch in args["batch_sizes"]:
    prompts = np.random.default_rng(0).integers(0, args["vocab_size"], (batch, args["prompt_len"]))
    for weights in args["weights"]:
        model = models.from_pretrained(args["checkpoint"], max_len=args["prompt_len"] + args["new_tokens"],
                                       batch_size=batch, weights=None if weights == "float32" else weights)
        def once(count):
            model.reset()
            jax.block_until_ready(model.pos)
            started = time.perf_counter()
            tokens = jax.block_until_ready(generation.generate(model, prompts, count).tokens)
            return time.perf_counter() - started, tokens
        once(1), once(args["new_tokens"])
        firsts, wholes = [], []
        for _ in range(args["repeats"]):
            firsts.append(once(1)[0])
            elapsed, tokens = once(args["new_tokens"])
            wholes.append(elapsed)
        first, whole = statistics.median(firsts), statistics.median(wholes)
        out.append({"batch_size": batch, "weights": weights, "first_token_ms": 1e3 * first,
                    "decode_ms_per_token": 1e3 * (whole - first) / (args["new_tokens"] - 1),
                    "tokens": np.asarray(tokens).tolist()})
print(json.dumps(out))
"""


def measure_flags(*, batch_sizes=(1, 8), weights=("float32", "int8"), prompt_len: int = 128, new_tokens: int = 32,
                  repeats: int = 3, rounds: int = 2, candidates=tuple(CANDIDATES)) -> list[dict]:
    """One row per (batch size, weights, candidate): first token and decode ms/token (module docstring)."""
    found = os.environ.get("XLA_FLAGS", "")
    runs: dict[str, list] = {name: [] for name in candidates}
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = write_llama_checkpoint(Path(scratch) / "checkpoint",
                                            max_position_embeddings=prompt_len + new_tokens, **LLAMA_125M)
        args = {"checkpoint": str(checkpoint), "batch_sizes": list(batch_sizes), "weights": list(weights),
                "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
                "vocab_size": LLAMA_125M["vocab_size"]}
        for _ in range(rounds):
            for name in candidates:
                env = dict(os.environ, XLA_FLAGS=f"{found} {CANDIDATES[name]}".strip())
                done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], env=env, capture_output=True,
                                      text=True, check=False)
                lines = done.stdout.strip().splitlines()
                if done.returncode != 0 or not lines:
                    raise RuntimeError(f"candidate {name} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
                runs[name].append(json.loads(lines[-1]))
    rows = []
    for name, measured in runs.items():
        for index, first in enumerate(measured[0]):
            samples = [run[index] for run in measured]
            reference = runs[candidates[0]][0][index]["tokens"]
            rows.append({"batch_size": first["batch_size"], "weights": first["weights"], "candidate": name,
                         "flags": CANDIDATES[name],
                         "first_token_ms": statistics.median(s["first_token_ms"] for s in samples),
                         "decode_ms_per_token": statistics.median(s["decode_ms_per_token"] for s in samples),
                         "same_tokens_as_default": all(s["tokens"] == reference for s in samples)})
    return rows


def markdown(results: dict[str, Any]) -> str:
    baseline = {(r["batch_size"], r["weights"]): r for r in results["rows"] if r["candidate"] == "default"}
    body = []
    for row in results["rows"]:
        base = baseline.get((row["batch_size"], row["weights"]))
        speedup = "" if base is None else f"{base['decode_ms_per_token'] / row['decode_ms_per_token']:.2f}"
        body.append([row["batch_size"], row["weights"], row["candidate"], f"{row['decode_ms_per_token']:.2f}", speedup,
                     f"{row['first_token_ms']:.1f}", "yes" if row["same_tokens_as_default"] else "no"])
    header = ["B", "weights", "candidate", "decode ms/token", "speedup over default", "first token ms",
              "same tokens"]
    return "\n".join([f"XLA_FLAGS={results['xla_flags']!r}", "", *table(header, body)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.xla_flags", description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--weights", nargs="+", choices=("float32", "int8"), default=["float32", "int8"])
    parser.add_argument("--candidates", nargs="+", choices=tuple(CANDIDATES), default=list(CANDIDATES))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out-dir", default="bench-results")
    args = parser.parse_args(argv)
    load = load_average()
    rows = measure_flags(batch_sizes=tuple(args.batch_sizes), weights=tuple(args.weights), new_tokens=args.new_tokens,
                         repeats=args.repeats, rounds=args.rounds, candidates=tuple(args.candidates))
    results = {"xla_flags": os.environ.get("XLA_FLAGS"), "rows": rows, "machine": machine_info(),
               "versions": versions(), "source": source_revision(),
               "load_average": {"before": load, "after": load_average()}}
    write(args.out_dir, "xla_flags", results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
