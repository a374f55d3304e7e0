"""Where a whole-model generation spends its time on XLA:CPU: the profiler's thunks, grouped.

Runs `kvattn.generation.generate` on the model benchmark's random 125M Llama
(`benchmarks.model.LLAMA_125M`, float32, prompt 128) twice under
`jax.profiler.trace`, once for the first token alone and once for
`--new-tokens`, and prints, for each, the time of XLA's thunks grouped by
kind and output shape (names as the optimised HLO gives them: a
`ynn_fusion` is a YNNPACK call, `dot` XLA's own, `cond` a step's bucketed
attention read). Decode figures are per token: the difference of the two
runs over the `new_tokens - 1` steps between them. Nested thunks (inside a
`cond`) are counted in their group and in the `cond`'s.

    python -m tools.step_profile [--batch 1] [--new-tokens 32] [--weights int8] [--checkpoint DIR]

from the repository root; `--checkpoint` profiles a Llama-family checkpoint
directory instead (`python -m tools.make_checkpoint llama-1b`).

Times under the profiler run a few percent slower than untimed ones; the
shares are what it is for.
"""

import argparse
import atexit
import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile

# XLA writes each optimised program's HLO here (for the thunks' shapes): set before JAX starts its backend.
HLO_DIR = tempfile.mkdtemp(prefix="kvattn-step-profile-")
atexit.register(shutil.rmtree, HLO_DIR, ignore_errors=True)
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={HLO_DIR} --xla_dump_hlo_as_text".strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import model as bench  # noqa: E402
from kvattn import generation, models  # noqa: E402
from kvattn.models import decoder  # noqa: E402

HLO_OP = re.compile(r"%(\S+) = (\S+) (\w+)\(")


def _thunks(run, hlo_files):
    """`{(kind, shape): microseconds}` of the thunks one `run()` executes, and their counts.

    `hlo_files`: the optimised HLO of the programs `run` calls, which name
    the thunks (names repeat across programs, so only these).
    """
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            run()
        (trace,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
        events = json.load(gzip.open(trace))["traceEvents"]
    shapes = {}
    for path in hlo_files:
        module = path.split(".")[1]
        for name, shape, _ in HLO_OP.findall(open(path).read()):
            shapes.setdefault((module, name), shape)
    total, count = collections.Counter(), collections.Counter()
    for event in events:
        name = event.get("name", "")
        if event.get("ph") != "X" or name.startswith(("$", "end:")) or "Execute" in name or "Pjit" in name:
            continue
        module = event.get("args", {}).get("hlo_module", "")
        key = (re.sub(r"[.\d]+(clone)?.*$", "", name), shapes.get((module, name), ""))
        total[key] += event["dur"]
        count[key] += 1
    return total, count


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--weights", choices=["float32", *(w for w in decoder.WEIGHTS if w)], default="float32")
    parser.add_argument("--checkpoint", help="a checkpoint directory to profile instead of the random 125M Llama")
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()
    prompt_len = 128
    weights = None if args.weights == "float32" else args.weights
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = args.checkpoint or bench.write_llama_checkpoint(
            directory, **bench.LLAMA_125M, max_position_embeddings=prompt_len + args.new_tokens)
        model = models.from_pretrained(checkpoint, max_len=prompt_len + args.new_tokens, batch_size=args.batch,
                                       weights=weights)
    prompts = np.random.default_rng(0).integers(0, model.config.vocab_size, (args.batch, prompt_len))

    def generations(count):
        def run():
            model.reset()
            jax.block_until_ready(nnx.state(model, nnx.Cache))
            jax.block_until_ready(generation.generate(model, prompts, count).tokens)
        return run

    written, files = set(), {}
    for count in (1, args.new_tokens):  # compile both (untimed), which writes their HLO
        generations(count)()
        now = set(glob.glob(f"{HLO_DIR}/*after_optimizations.txt"))
        files[count], written = now - written, now
    first, first_count = _thunks(generations(1), files[1])
    whole, whole_count = _thunks(generations(args.new_tokens), files[args.new_tokens])
    steps = args.new_tokens - 1
    print(f"B={args.batch}, {args.weights}: first token (prefill and one step), ms")
    _print(first, first_count, 1, args.top)
    decode = {key: (whole[key] - first.get(key, 0)) for key in whole}
    counts = {key: (whole_count[key] - first_count.get(key, 0)) for key in whole}
    print(f"\ndecode, ms per token over {steps} steps")
    _print(collections.Counter(decode), counts, steps, args.top)


def _print(total, count, per, top):
    grand = sum(value for (kind, _), value in total.items() if kind != "cond")
    print(f"  {'ms':>8} {'calls':>7}  kind  shape   (all but cond: {grand / 1e3 / per:.2f} ms)")
    for (kind, shape), value in sorted(total.items(), key=lambda item: -item[1])[:top]:
        print(f"  {value / 1e3 / per:8.3f} {count[(kind, shape)] / per:7.1f}  {kind}  {shape}")


if __name__ == "__main__":
    main()
