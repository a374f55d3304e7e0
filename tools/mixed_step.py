"""A decode call and a prefill chunk apart, against the two in one call (`Server`'s mixed step), side by side.

On the model benchmark's random 125M Llama (`benchmarks.model.LLAMA_125M`,
float32 or int8 weights), a `kvattn.serving.Server` of 9 sequences, pages of
16: 8 requests decode from 512-token prompts while a 4,096-token prompt is
prefilled 64 tokens at a time (`--chunk`). In turn within each repeat: the 8 rows' decode
call alone, one chunk alone, and both in one mixed call (`Server._decode`,
`_prefill_together`, `_mixed`, host work included; each call advances the
requests, so the chunk's depth grows through the run). Medians after two
repeats of warm-up; the machine's load average is printed.

    python -m tools.mixed_step [--weights int8] [--chunk 64] [--repeats 12]   # from the repository root
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

from benchmarks.model import LLAMA_125M, write_llama_checkpoint
from benchmarks.provenance import load_average
from kvattn import models
from kvattn.generation import SamplingParams
from kvattn.serving.server import Server

BATCH, PROMPT, LONG, PAGE, CHUNK = 8, 512, 4096, 16, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", choices=("int8",), default=None)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--chunk", type=int, default=CHUNK, help="prefill chunk, a multiple of 16")
    args = parser.parse_args()
    max_len = LONG + 256
    with tempfile.TemporaryDirectory() as directory:
        write_llama_checkpoint(directory, **LLAMA_125M, max_position_embeddings=max_len)
        model = models.from_pretrained(directory, max_len=max_len, batch_size=BATCH + 1, page_size=PAGE,
                                       num_pages=(BATCH + 1) * max_len // PAGE + 1, weights=args.weights)
    server = Server(model, chunk=args.chunk, prefix_caching=False, prefills_per_step=1, donate_pools=True)
    server.warm_up()
    rng = np.random.default_rng(0)
    for _ in range(BATCH):
        # Room for the steps that prefill the others one chunk at a time, then for the timed calls.
        room = BATCH * PROMPT // args.chunk + 2 * args.repeats + 8
        server.submit(rng.integers(1, 32000, PROMPT).tolist(), SamplingParams(max_tokens=room, ignore_eos=True))
    while len(server.scheduler.decoding()) < BATCH:
        server.step()
    long = server.submit(rng.integers(1, 32000, LONG).tolist(), SamplingParams(max_tokens=1, ignore_eos=True))
    server.scheduler.admit()
    seq = next(s for s, r in enumerate(server.scheduler.seqs) if r is not None and r.index == long)
    decoding = server.scheduler.decoding()
    calls = {"decode": lambda: server._decode(decoding), "chunk": lambda: server._prefill_together([seq]),
             "mixed": lambda: server._mixed(decoding, seq)}
    times = {name: [] for name in calls}
    print(f"load average before: {load_average()}")
    for _ in range(args.repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    print(f"load average after: {load_average()}")
    ms = {name: 1e3 * statistics.median(values[2:]) for name, values in times.items()}
    apart = ms["decode"] + ms["chunk"]
    print(f"weights {args.weights or 'float32'}, chunk {args.chunk}: decode {ms['decode']:.1f} ms, "
          f"chunk {ms['chunk']:.1f} ms, "
          f"apart {apart:.1f} ms, mixed {ms['mixed']:.1f} ms ({ms['mixed'] / apart:.3f} of apart)")


if __name__ == "__main__":
    main()
