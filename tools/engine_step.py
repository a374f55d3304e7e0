"""The engine's decode step against `generate`'s, on the same model, side by side in one run.

The serving-speed target (#36) compares one decode step of the paged engine
(`kvattn.serving.Server`, what `kvattn serve` and `kvattn.LLM` run) with one
step of the fixed-batch loop (`kvattn.generation.generate`), at B=8 and
512-token contexts, pages of 16, on the model benchmark's random 125M Llama
(`benchmarks.model.LLAMA_125M`, float32 or int8 weights).

- `generate`: `(t(1 + N) - t(1)) / N` of whole calls, prompt included, so
  the difference is N decode steps;
- the engine: each `Server.step()` after every request has its first token
  (decode only: no prefill chunk shares it), timed alone, host work included;

in turn within each repeat, medians over repeats, after a warm-up of each
(compilation excluded), with the machine's load average. Greedy: the
script reports how far the engine's tokens equal `generate`'s (all of them
with float32 weights; with int8 weights, where an activation a rounding
apart in the two programs can quantize to another int8 value, a random
model's near ties can part them).

    python -m tools.engine_step [--weights int8] [--repeats 5] [--new-tokens 32]   # from the repository root
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from benchmarks.model import LLAMA_125M, greedy_agreement, write_llama_checkpoint
from benchmarks.provenance import load_average
from kvattn import generation, models
from kvattn.generation import SamplingParams
from kvattn.caches.base import blocks_spanned
from kvattn.serving.server import Server

BATCH, PROMPT, PAGE = 8, 512, 16


def _generate(model, prompts, new_tokens: int) -> tuple[float, np.ndarray]:
    """A whole `generate` call from empty caches (emptied untimed): its seconds and tokens."""
    jax.block_until_ready(nnx.state(model, nnx.Cache))
    model.reset()
    jax.block_until_ready(nnx.state(model, nnx.Cache))
    start = time.perf_counter()
    tokens = jax.block_until_ready(generation.generate(model, prompts, new_tokens).tokens)
    return time.perf_counter() - start, np.asarray(tokens)


def _engine(server: Server, prompts, new_tokens: int) -> tuple[list[float], np.ndarray]:
    """Each decode-only step's seconds, and the tokens of every request."""
    started = set()
    for prompt in prompts:
        server.submit(prompt.tolist(), SamplingParams(max_tokens=new_tokens, ignore_eos=True),
                      on_token=lambda index, _: started.add(index))
    steps, done = [], []
    while not server.idle:
        decoding = len(started) == len(prompts)
        start = time.perf_counter()
        done += server.step()
        if decoding:
            steps.append(time.perf_counter() - start)
    done.sort(key=lambda c: c.request)
    return steps, np.asarray([c.tokens for c in done])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", choices=("int8",), help="int8 weights (default float32)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    new_tokens, max_len = args.new_tokens, PROMPT + args.new_tokens + 1
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = write_llama_checkpoint(directory, **LLAMA_125M, max_position_embeddings=max_len)
        fixed = models.from_pretrained(checkpoint, max_len=max_len, batch_size=BATCH, weights=args.weights)
        paged = models.from_pretrained(checkpoint, max_len=max_len, batch_size=BATCH, weights=args.weights,
                                       num_pages=BATCH * blocks_spanned(max_len, PAGE) + 1, page_size=PAGE)
    prompts = np.random.default_rng(0).integers(0, LLAMA_125M["vocab_size"], (BATCH, PROMPT)).astype(np.int32)
    server = Server(paged, chunk=4 * PAGE, prefix_caching=False)
    server.warm_up()
    _generate(fixed, prompts, 1), _generate(fixed, prompts, 1 + new_tokens), _engine(server, prompts, 4)  # compile
    generated, stepped, loads, agreement = [], [], [], []
    for _ in range(args.repeats):
        loads.append(load_average())
        first, _ = _generate(fixed, prompts, 1)
        whole, want = _generate(fixed, prompts, 1 + new_tokens)
        generated.append((whole - first) / new_tokens)
        steps, got = _engine(server, prompts, 1 + new_tokens)
        stepped.append(statistics.median(steps))
        agreement.append(greedy_agreement(got, want))
    ours, theirs = statistics.median(stepped), statistics.median(generated)
    print(f"B={BATCH}, {PROMPT}-token prompts, pages of {PAGE}, {args.weights or 'float32'} weights, "
          f"{args.repeats} repeats, load {loads[0]} .. {loads[-1]}")
    print(f"generate step {1e3 * theirs:.2f} ms, engine step {1e3 * ours:.2f} ms: engine / generate "
          f"{ours / theirs:.2f}x")
    print(f"greedy tokens equal to generate's up to the first difference: {min(agreement):.3f} (1: all)")
    print("per repeat, engine / generate ms: " + ", ".join(f"{1e3 * s:.1f} / {1e3 * g:.1f}"
                                                         for s, g in zip(stepped, generated, strict=True)))


if __name__ == "__main__":
    main()
