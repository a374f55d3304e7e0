"""`python -m benchmarks.serve_generate`: `kvattn.generation.generate` on a serve benchmark's requests.

The fixed-batch reference #36 holds the server to: the same prompts (as
token ids) and output lengths, `--batch` at a time in the order given, each
batch one `generate` call of its longest `max_tokens` (a request's tokens
past its own `max_tokens` are made and not counted: fixed batches pay for
their longest member). Every batch runs once untimed (compilation), then
all are timed in turn, prefill included; the whole is what the server's
saturation figure is: output tokens counted over wall seconds.

    python -m benchmarks.serve_generate --checkpoint DIR --requests FILE.json --batch 8 --max-len 1024 \
        [--weights int8]

`FILE.json` lists `{"prompt": [ids...], "max_tokens": n}`; prints one JSON
object: `output_tokens`, `seconds`, `output_tokens_per_s`, `batches`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np

from kvattn import generation, models


def batches(requests: list[dict], batch: int) -> list[tuple[np.ndarray, np.ndarray, int, int]]:
    """`(prompts (batch, width) right-padded, lengths, max_new_tokens, real rows)` per batch; a short last batch
    repeats its first request in the rows it lacks (their tokens not counted)."""
    out = []
    for start in range(0, len(requests), batch):
        group = requests[start : start + batch]
        rows = group + [group[0]] * (batch - len(group))
        width = max(len(r["prompt"]) for r in rows)
        prompts = np.zeros((batch, width), np.int32)
        for row, request in enumerate(rows):
            prompts[row, : len(request["prompt"])] = request["prompt"]
        lengths = np.array([len(r["prompt"]) for r in rows], np.int32)
        out.append((prompts, lengths, max(r["max_tokens"] for r in group), len(group)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--requests", required=True, help="a JSON list of {prompt: [ids], max_tokens: n}")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--max-len", type=int, required=True)
    parser.add_argument("--weights", choices=("int8",), default=None)
    args = parser.parse_args(argv)
    with open(args.requests) as f:
        requests = json.load(f)
    model = models.from_pretrained(args.checkpoint, max_len=args.max_len, batch_size=args.batch,
                                   weights=args.weights)
    work = batches(requests, args.batch)

    def run(prompts, lengths, new_tokens) -> float:
        """One batch from empty caches (emptied untimed): its seconds."""
        model.reset()
        jax.block_until_ready(jax.tree.leaves(model.pos))
        started = time.perf_counter()
        jax.block_until_ready(generation.generate(model, prompts, new_tokens, lengths=lengths).tokens)
        return time.perf_counter() - started

    for prompts, lengths, new_tokens, _ in work:  # compiles every batch's program
        run(prompts, lengths, new_tokens)
    seconds = sum(run(prompts, lengths, new_tokens) for prompts, lengths, new_tokens, _ in work)
    counted = sum(r["max_tokens"] for r in requests)  # each batch makes its longest; each request counts its own
    json.dump({"output_tokens": counted, "seconds": seconds, "output_tokens_per_s": counted / seconds,
               "batches": len(work)}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
