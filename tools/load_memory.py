"""Peak resident memory while `from_pretrained` loads a checkpoint, against the loaded model's bytes.

One fresh process per weight form (float32, bfloat16, int8, int4), each reading
its own high-water mark (`getrusage`'s `ru_maxrss`) before and after the
load: the JAX runtime's baseline, the peak, and the bytes of every
parameter the model holds (`nnx.state(model, nnx.Param)`), and their ratio.

    python -m tools.load_memory CHECKPOINT_DIR [--weights float32 bfloat16 int8 int4]   # from the repository root
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_WORKER = r"""
import json, resource, sys
import jax, jax.numpy as jnp
from flax import nnx
jnp.zeros(1).block_until_ready()  # the runtime up: the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
from kvattn import models
weights = None if sys.argv[2] == "float32" else sys.argv[2]
model = models.from_pretrained(sys.argv[1], max_len=16, weights=weights)
jax.block_until_ready(nnx.state(model))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
params = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
print(json.dumps({"baseline": base, "peak": peak, "params": params}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--weights", nargs="+", default=["float32", "bfloat16", "int8", "int4"])
    args = parser.parse_args()
    print("| weights | model GB | baseline GB | peak GB | peak - baseline over model |")
    print("|---|---:|---:|---:|---:|")
    for weights in args.weights:
        done = subprocess.run([sys.executable, "-c", _WORKER, args.checkpoint, weights], check=True,
                              capture_output=True, text=True)
        got = json.loads(done.stdout.splitlines()[-1])
        print(f"| {weights} | {got['params'] / 1e9:.2f} | {got['baseline'] / 1e9:.2f} | {got['peak'] / 1e9:.2f} | "
              f"{(got['peak'] - got['baseline']) / got['params']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
