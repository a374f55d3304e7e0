"""How long a long prompt holds running streams: their gaps between tokens while it is prefilled, against without.

The serving-speed target (#36): while one 8k-token prompt is prefilled,
running streams' inter-token gap p99 stays within 2x their gap without it.
On the model benchmark's random 125M Llama (`benchmarks.model.LLAMA_125M`,
float32 or int8 weights), a `kvattn.serving.Server` of 8 sequences, pages
of 16, 64-token chunks, one prefill chunk a step, runs 7 streams (128-token
prompts, greedy, never stopping) and, per setting of `step_tokens`:

- `alone`: the streams' gaps over `--steps` steps with nothing else queued;
- `prefill`: their gaps from the long prompt's submission to its first
  token (its TTFT, reported too);
- `after`: their gaps over `--steps` steps after that, nothing else
  queued: the streams alone again, as deep as the prefill left them. The
  streams decode through the whole prefill (a thousand steps or more for
  8k tokens), so their own attention grows meanwhile; `after` is their gap
  without the prompt at the depth the prefill's last (and costliest) steps
  see, `alone` at the depth it started from.

A gap is the time between two tokens of one stream, as `on_token` sees them
(host work included). Settings are measured in turn within each repeat, each
after a warm-up of every program (compilation excluded); p50 and p99 pool
the repeats; the machine's load average is printed.

    python -m tools.prefill_stall [--weights int8] [--prompt 8192] [--step-tokens none,24,40] [--repeats 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from benchmarks.model import LLAMA_125M, write_llama_checkpoint
from benchmarks.provenance import load_average
from kvattn import models
from kvattn.generation import SamplingParams
from kvattn.serving.server import Server

BATCH, STREAMS, STREAM_PROMPT, PAGE, CHUNK = 8, 7, 128, 16, 64


class Gaps:
    """Each stream's token times; the gaps between consecutive ones since `mark`."""

    def __init__(self):
        self.times: dict[int, list[float]] = {}
        self.since = 0.0

    def __call__(self, index: int, _token) -> None:
        self.times.setdefault(index, []).append(time.perf_counter())

    def mark(self) -> None:
        self.since = time.perf_counter()

    def collect(self, streams) -> list[float]:
        return [1e3 * gap for index in streams for gap in np.diff([t for t in self.times[index] if t >= self.since])]


def measure(server: Server, long_prompt: list[int], steps: int, rng) -> dict:
    """One setting: the streams' gaps alone and while `long_prompt` is prefilled, and its TTFT."""
    gaps = Gaps()
    streams = [server.submit(rng.integers(1, 32000, STREAM_PROMPT).tolist(),
                             SamplingParams(max_tokens=server.config.cache.max_len - STREAM_PROMPT,
                                            ignore_eos=True), on_token=gaps)
               for _ in range(STREAMS)]
    while len(server.scheduler.decoding()) < STREAMS:
        server.step()
    gaps.mark()
    for _ in range(steps):
        server.step()
    alone = gaps.collect(streams)
    first = []
    gaps.mark()
    start = time.perf_counter()
    server.submit(long_prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                  on_token=lambda index, token: first.append(time.perf_counter()))
    while not first:
        server.step()
    ttft = first[0] - start
    during = gaps.collect(streams)
    gaps.mark()
    for _ in range(steps):
        server.step()
    after = gaps.collect(streams)
    assert len(server.scheduler.decoding()) == STREAMS, "the long prompt still decodes: `after` would not be alone"
    for index in streams:
        server.abort(index)
    return {"alone": alone, "during": during, "after": after, "ttft_s": ttft}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", choices=("int8",), default=None)
    parser.add_argument("--prompt", type=int, default=8192, help="the long prompt's tokens")
    parser.add_argument("--step-tokens", default="none,24,40", help="settings of Server(step_tokens=...)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed without the long prompt")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    settings = [None if s == "none" else int(s) for s in args.step_tokens.split(",")]
    max_len = args.prompt + 2 * PAGE  # the streams run as long as that too
    with tempfile.TemporaryDirectory() as directory:
        write_llama_checkpoint(directory, **LLAMA_125M, max_position_embeddings=max_len)
        model = models.from_pretrained(directory, max_len=max_len, batch_size=BATCH, page_size=PAGE,
                                       num_pages=BATCH * max_len // PAGE + 1,
                                       weights=args.weights)
    server = Server(model, chunk=CHUNK, prefix_caching=False, prefills_per_step=1, donate_pools=True)
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(1, 32000, args.prompt).tolist()
    for setting in settings:
        server.step_tokens = setting
        server.warm_up()
    print(f"load average before: {load_average()}")
    results = {setting: [] for setting in settings}
    for _ in range(args.repeats):
        for setting in settings:
            server.step_tokens = setting
            results[setting].append(measure(server, long_prompt, args.steps, rng))
    print(f"load average after: {load_average()}")
    print(f"weights {args.weights or 'float32'}, {STREAMS} streams, a {args.prompt}-token prompt, chunk {CHUNK}")
    print("| step_tokens | gap alone p50 / p99 ms | gap during prefill p50 / p99 ms | gap after p50 / p99 ms "
          "| p99 ratio to alone / after | prompt TTFT s |")
    print("|---|---|---|---|---|---|")
    for setting, runs in results.items():
        alone, during, after = (np.concatenate([r[key] for r in runs]) for key in ("alone", "during", "after"))
        ttft = np.median([r["ttft_s"] for r in runs])
        p = lambda values, q: float(np.percentile(values, q))
        print(f"| {setting or f'none ({CHUNK} + rows)'} | {p(alone, 50):.1f} / {p(alone, 99):.1f} | "
              f"{p(during, 50):.1f} / {p(during, 99):.1f} | {p(after, 50):.1f} / {p(after, 99):.1f} | "
              f"{p(during, 99) / p(alone, 99):.2f} / {p(during, 99) / p(after, 99):.2f} | {ttft:.1f} |")


if __name__ == "__main__":
    main()
