"""Where the engine's time goes at saturation, without HTTP: `Server` against `generate` on the same requests.

The serving benchmark's saturation workload (#36: 32 requests of 128 random
prompt ids and 64 new tokens, 8 sequences at a time, greedy, prefix caching
off) run through `kvattn.serving.Server` directly, and through
`kvattn.generation.generate` in batches of 8 (`benchmarks.serve_generate`),
on the model benchmark's random 125M Llama (`benchmarks.model.LLAMA_125M`).
Per repeat, the two in turn after a warm-up of each (compilation excluded):

- the engine's wall time split into its device calls (decode calls, with
  their mean active rows; prefill calls, of one or more chunks) and the host time between
  them (scheduling, bookkeeping, sampling rows: what overlapping the next
  step with this one could win at most);
- `generate`'s prompts alone (`max_new_tokens=1`) and the whole, so its
  prefill and decode split too.

    python -m tools.engine_saturation [--weights int8] [--chunk 128] [--prefills-per-step 1] [--async-scheduling] [--step-tokens 136]

from the repository root.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time

import jax
import numpy as np

from benchmarks.model import LLAMA_125M, write_llama_checkpoint
from benchmarks.provenance import load_average
from benchmarks.serve_generate import batches
from kvattn import generation, models
from kvattn.caches.base import blocks_spanned
from kvattn.generation import SamplingParams
from kvattn.serving.server import DEFAULT_CHUNK_PAGES, Server

REQUESTS, PROMPT, NEW, BATCH, PAGE, MAX_LEN = 32, 128, 64, 8, 16, 1024


class _Timed:
    """Wraps a `Runner`'s device calls, adding up each kind's seconds (and the active rows of decode calls)."""

    def __init__(self, runner):
        self.seconds, self.calls, self.rows = collections.Counter(), collections.Counter(), []
        for name in ("decode", "prefills", "mixed"):  # `Runner.prefill` calls `prefills`
            setattr(runner, name, self._wrap(name, getattr(runner, name)))

    def _wrap(self, name, call):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            outputs = call(*args, **kwargs)  # the runner waits for the outputs: the call's whole time
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1
            if name == "decode":
                self.rows.append(int(np.sum(args[1])))
            return outputs
        return timed

    def clear(self):
        self.seconds.clear(), self.calls.clear(), self.rows.clear()


def _serve(server: Server, requests) -> float:
    for request in requests:
        server.submit(request["prompt"], SamplingParams(max_tokens=request["max_tokens"], ignore_eos=True))
    start = time.perf_counter()
    while not server.idle:
        server.step()
    return time.perf_counter() - start


def _generate(model, work, new_tokens: int | None) -> float:
    """Every batch from empty caches (emptied untimed), `new_tokens` each (None: the batch's own): seconds."""
    seconds = 0.0
    for prompts, lengths, wanted, _ in work:
        model.reset()
        jax.block_until_ready(jax.tree.leaves(model.pos))
        start = time.perf_counter()
        jax.block_until_ready(generation.generate(model, prompts, new_tokens or wanted, lengths=lengths).tokens)
        seconds += time.perf_counter() - start
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", choices=("int8",), help="int8 weights (default float32)")
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK_PAGES * PAGE, help="the engine's prefill chunk")
    parser.add_argument("--prefills-per-step", type=int, default=1, help="as kvattn serve's (default 1)")
    parser.add_argument("--async-scheduling", action="store_true", help="Server(async_scheduling=True)")
    parser.add_argument("--step-tokens", type=int, help="Server(step_tokens=...): a chunk rides in the decode call")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    requests = [{"prompt": rng.integers(0, LLAMA_125M["vocab_size"], PROMPT).tolist(), "max_tokens": NEW}
                for _ in range(REQUESTS)]
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = write_llama_checkpoint(directory, **LLAMA_125M, max_position_embeddings=MAX_LEN)
        fixed = models.from_pretrained(checkpoint, max_len=MAX_LEN, batch_size=BATCH, weights=args.weights)
        paged = models.from_pretrained(checkpoint, max_len=MAX_LEN, batch_size=BATCH, weights=args.weights,
                                       num_pages=BATCH * blocks_spanned(MAX_LEN, PAGE) + 1, page_size=PAGE)
    server = Server(paged, chunk=args.chunk, prefills_per_step=args.prefills_per_step, prefix_caching=False,
                    async_scheduling=args.async_scheduling, step_tokens=args.step_tokens, donate_pools=True)
    server.warm_up()
    timed = _Timed(server.runner)
    work = batches(requests, BATCH)
    _serve(server, requests), _generate(fixed, work, 1), _generate(fixed, work, None)  # compile, untimed
    tokens = REQUESTS * NEW
    print(f"{REQUESTS} requests of {PROMPT} prompt ids and {NEW} new tokens, {BATCH} at a time, "
          f"{args.weights or 'float32'} weights; engine chunk {args.chunk}, "
          f"{args.prefills_per_step} prefill chunks a step, step tokens {args.step_tokens}, "
          "prefix caching off")
    for repeat in range(args.repeats):
        load = load_average()
        timed.clear()
        engine = _serve(server, requests)
        prompts, whole = _generate(fixed, work, 1), _generate(fixed, work, None)
        device = sum(timed.seconds.values())
        print(f"repeat {repeat + 1} (load {load[0]:.2f}): engine {engine:.2f} s ({tokens / engine:.1f} tok/s), generate "
              f"{whole:.2f} s ({tokens / whole:.1f} tok/s): engine / generate throughput {whole / engine:.3f}")
        for name in ("decode", "mixed", "prefills"):
            if timed.calls[name]:
                rows = f", {np.mean(timed.rows):.2f} active rows on average" if name == "decode" else ""
                print(f"  engine {name}: {timed.calls[name]} calls, {timed.seconds[name]:.2f} s, "
                      f"{1e3 * timed.seconds[name] / timed.calls[name]:.1f} ms each{rows}")
        if args.async_scheduling:  # decode calls are dispatched and read apart: their time is not one span
            print("  (async scheduling: decode calls overlap the host's work, not split)")
        else:
            print(f"  engine host between calls: {engine - device:.2f} s ({(engine - device) / engine:.1%})")
        print(f"  generate: prompts {prompts:.2f} s, decoding {whole - prompts:.2f} s")


if __name__ == "__main__":
    main()
