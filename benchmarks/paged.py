"""`python -m benchmarks --paged`: the paged cache side by side with the contiguous one, in one run.

Six measurements, each against the issue's target:

- memory: pages allocated over tokens held, lengths uniform in [16, max_len];
- concurrency: sequences admitted into the memory of `budget` contiguous
  sequences, lengths uniform with mean / max_len <= 0.4;
- forks: pages held by N forks of a P-token prompt after each appends a token;
- prefix hit: time to the first token of a 1024-token prompt on a `Server`,
  cold and on a prefix-cache hit (compilation excluded);
- decode step: a compiled loop of steps at B=8, contiguous (written first, as
  the decoding drivers do) and paged, at several filled lengths, with the
  calibration bandwidth of a streaming read of the same bytes (what bounds the
  paged step on XLA:CPU, the copy of its pages into views, is measured by
  tools/gather_bound.py);
- host: `PageManager.reserve` per sequence per decode step.

Times are medians over repeats, after a warm-up call, with
`block_until_ready`.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
from typing import Any

import numpy as np

from benchmarks.baselines import bandwidth
from benchmarks.report import paged_markdown, target, write
from benchmarks.timing import median_ms, step_loop

__all__ = ["measure_paged", "run_paged"]

PAGED_DEFAULTS = dict(
    page_size=16, max_len=2048, batch_size=8, filled=(128, 512, 2048), prompt_len=1024, repeats=7, burst=16,
    in_features=512, num_heads=8, num_kv_heads=8,
)
PAGED_QUICK = dict(
    page_size=4, max_len=64, batch_size=2, filled=(16, 48), prompt_len=32, repeats=2, burst=4, in_features=32,
    num_heads=4, num_kv_heads=2,
)


def _manager(num_pages: int, page_size: int, max_sequences: int, max_len: int):
    from kvattn.paging import PageManager

    return PageManager(num_pages, page_size, max_sequences, math.ceil(max_len / page_size))


def memory(page_size: int, max_len: int, num_sequences: int, rng) -> dict[str, Any]:
    """Pages allocated per token held, for lengths uniform in [16, max_len]."""
    lengths = rng.integers(16, max_len + 1, num_sequences)
    manager = _manager(1 + sum(math.ceil(n / page_size) for n in lengths), page_size, num_sequences, max_len)
    for length in lengths:
        slot = manager.add()
        counts = np.zeros(num_sequences, np.int32)
        counts[slot] = length
        manager.reserve(counts)
    allocated = manager.num_live * page_size
    return dict(sequences=num_sequences, tokens=int(lengths.sum()), allocated_tokens=allocated,
                allocated_over_used=allocated / lengths.sum(),
                contiguous_allocated_over_used=num_sequences * max_len / lengths.sum())


def concurrency(page_size: int, max_len: int, budget: int, mean_fraction: float) -> dict[str, Any]:
    """Sequences admitted at their final lengths into the memory of `budget` contiguous sequences.

    Lengths are spread evenly over [16, 2 * mean_fraction * max_len - 16]. No cache
    can beat `max_len / mean`: pages only lose the unfilled part of each
    sequence's last page.
    """
    high = round(2 * mean_fraction * max_len) - 16
    # Evenly spaced lengths, taken shortest and longest alternately: every pair
    # admitted has the mean asked for, so the result does not hang on a sample.
    spread = np.linspace(16, high, 64 * budget).round().astype(int)
    grid = np.stack([spread[: len(spread) // 2], spread[::-1][: len(spread) // 2]], axis=1).reshape(-1)
    manager = _manager(1 + budget * max_len // page_size, page_size, len(grid), max_len)
    lengths = []
    for length in grid.tolist():
        if manager.admission(length) != "now":
            break
        slot = manager.add()
        counts = np.zeros(manager.max_sequences, np.int32)
        counts[slot] = length
        manager.reserve(counts)
        lengths.append(length)
    mean = float(np.mean(lengths))
    return dict(contiguous_sequences=budget, paged_sequences=len(lengths), mean_over_max_len=mean / max_len,
                ratio=len(lengths) / budget, ideal=max_len / mean)


def forks(page_size: int, prompt_len: int, num_forks: int) -> dict[str, Any]:
    """Pages held by `num_forks` forks of one prompt, after each appends one token."""
    manager = _manager(1 + (num_forks + 1) * math.ceil((prompt_len + 1) / page_size), page_size, num_forks + 1,
                       prompt_len + 1)
    parent = manager.add()
    counts = np.zeros(num_forks + 1, np.int32)
    counts[parent] = prompt_len
    manager.reserve(counts)
    for child in range(num_forks + 1):
        if child != parent:
            manager.fork(parent, child)
    manager.free(parent)  # the prompt's owner is done: only the forks hold it now
    counts = np.ones(num_forks + 1, np.int32)
    counts[parent] = 0
    manager.reserve(counts)
    manager.check()
    return dict(prompt_len=prompt_len, forks=num_forks, pages=manager.num_live,
                expected=math.ceil(prompt_len / page_size) + num_forks,
                copied=num_forks * math.ceil((prompt_len + 1) / page_size))


def host_bookkeeping(page_size: int, batch_size: int, steps: int) -> dict[str, Any]:
    """Microseconds of `PageManager.reserve` per sequence per decode step (a page allocated every `page_size` steps)."""
    manager = _manager(1 + batch_size * math.ceil(steps / page_size), page_size, batch_size, steps)
    for _ in range(batch_size):
        manager.add()
    ones = np.ones(batch_size, np.int32)

    def run():
        for _ in range(steps):
            manager.reserve(ones)

    ms = median_ms(run, 1, warm_ups=0)  # one pass: each reserve moves the sequences on
    return dict(steps=steps, batch_size=batch_size, us_per_sequence_step=1e3 * ms / steps / batch_size)


def decode_steps(sizes: dict, rng, repeats: int) -> list[dict[str, Any]]:
    """ms per step at B, contiguous and paged, for each filled length, with the calibration bandwidth.

    The contiguous cache runs in the decoding drivers' working form (heads-major,
    written first); the paged pool in both layouts.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import kvattn
    from kvattn.caches import paged, storage
    batch, max_len, page_size, burst = sizes["batch_size"], sizes["max_len"], sizes["page_size"], sizes["burst"]
    num_pages = 1 + batch * math.ceil(max_len / page_size)

    def build(layout, **paging):
        return kvattn.MultiHeadAttention(
            sizes["num_heads"], sizes["in_features"], num_kv_heads=sizes["num_kv_heads"], max_len=max_len,
            batch_size=batch, cache_layout=layout, rngs=nnx.Rngs(0), **paging,
        )

    layers = {
        "contiguous": build("heads_major"),
        "paged/slots_major": build("slots_major", num_pages=num_pages, page_size=page_size),
        "paged/heads_major": build("heads_major", num_pages=num_pages, page_size=page_size),
    }
    weights = layers["contiguous"].weights.fused()
    config = layers["contiguous"].config
    weight_bytes = sum(w.size * w.dtype.itemsize for w in jax.tree.leaves(weights))
    loops = {name: step_loop(layer.config, burst) for name, layer in layers.items()}
    rows = []
    for filled in sizes["filled"]:
        start = min(filled, max_len - burst)
        xs = jnp.asarray(rng.standard_normal((batch, burst, sizes["in_features"])).astype(np.float32))
        manager = _manager(num_pages, page_size, batch, max_len)
        for _ in range(batch):
            manager.add()
        manager.reserve(np.full(batch, start, np.int32))
        pages = manager.reserve(np.full(batch, burst, np.int32))  # a compiled loop reserves before it starts
        state = {"contiguous": jax.tree.map(jnp.zeros_like, layers["contiguous"].cache)}
        for name, layer in layers.items():
            if layer.config.paged:
                k_pool, v_pool = storage.empty_pool(num_pages, page_size, config.num_kv_heads, config.head_dim,
                                                    jnp.float32, layer.config.layout)
                state[name] = paged.PagedKVCache(k_pool, v_pool, jnp.asarray(pages.table), jnp.asarray(pages.pos),
                                                 layout=layer.config.layout)

        def run(name):
            cache = state[name].replace(pos=jnp.full((batch,), start, jnp.int32))
            state[name] = jax.block_until_ready(loops[name](weights, cache, xs))[0]

        times = {name: median_ms(functools.partial(run, name), repeats) * 1e-3 / burst for name in loops}
        step_bytes = weight_bytes + batch * (start + burst // 2) * config.cache_bytes_per_token
        limit = bandwidth(step_bytes, repeats)
        for name, seconds in times.items():
            rows.append(dict(contender=name, filled=filled, ms_per_step=1e3 * seconds, step_bytes=step_bytes,
                             gbs=step_bytes / seconds / 1e9, share_of_calibration=step_bytes / limit / seconds,
                             paged_over_contiguous=seconds / times["contiguous"]))
        rows.append(dict(contender="calibration", filled=filled, ms_per_step=1e3 * step_bytes / limit,
                         step_bytes=step_bytes, gbs=limit / 1e9))
    return rows


def prefix_hit(sizes: dict, rng, repeats: int) -> dict[str, Any]:
    """Seconds to the first token of a `prompt_len` prompt on a `Server`: cold, and on a prefix-cache hit."""
    from flax import nnx

    from kvattn import RoPE
    from kvattn import SamplingParams
    from kvattn.models import CausalLM, ModelConfig
    from kvattn.serving import Server

    config = ModelConfig(
        "llama", vocab_size=1024, hidden_size=sizes["in_features"], num_layers=2, num_heads=sizes["num_heads"],
        num_kv_heads=sizes["num_kv_heads"], head_dim=sizes["in_features"] // sizes["num_heads"],
        intermediate_size=2 * sizes["in_features"], norm_eps=1e-5, tie_embeddings=True,
        max_position_embeddings=sizes["max_len"], rope=RoPE(),
    )
    prompt_len, page_size = sizes["prompt_len"], sizes["page_size"]
    model = CausalLM(config, max_len=prompt_len + 8, batch_size=1, num_pages=1 + 8 * math.ceil(prompt_len / page_size),
                      page_size=page_size, rngs=nnx.Rngs(0))
    chunk = max(page_size, 64 // page_size * page_size)
    server = Server(model, chunk=chunk)

    def first_token(prompt, salt):
        server.submit(prompt, SamplingParams(max_tokens=1), salt=salt)
        return server.run()[0]

    first_token(rng.integers(0, 1024, prompt_len), b"warm-up")  # compiles both programs
    cold, hit = [], []
    for repeat in range(repeats):
        prompt = rng.integers(0, 1024, prompt_len)
        salt = repeat.to_bytes(4, "little")
        cold.append(first_token(prompt, salt))
        hit.append(first_token(prompt, salt))
    assert all(h.tokens == c.tokens for h, c in zip(hit, cold, strict=True))
    cold_s = statistics.median(c.first_token_seconds for c in cold)
    hit_s = statistics.median(h.first_token_seconds for h in hit)
    return dict(prompt_len=prompt_len, chunk=chunk, cached_tokens=hit[0].cached_tokens, cold_ms=1e3 * cold_s,
                hit_ms=1e3 * hit_s, speedup=cold_s / hit_s)


def measure_paged(*, quick: bool = False, repeats: int | None = None, seed: int = 0, **overrides) -> dict[str, Any]:
    """Every paged measurement, with the issue's targets."""
    sizes = dict(PAGED_QUICK if quick else PAGED_DEFAULTS, **overrides)
    if repeats is not None:
        sizes["repeats"] = repeats
    rng = np.random.default_rng(seed)
    page_size, max_len = sizes["page_size"], sizes["max_len"]
    result = dict(
        sizes=sizes,
        memory=memory(page_size, max_len, 256, rng),
        concurrency=[concurrency(page_size, max_len, 256, fraction) for fraction in (0.4, 0.39)],
        forks=forks(page_size, sizes["prompt_len"] - 24, 8),
        host=host_bookkeeping(page_size, sizes["batch_size"], 4096),
        decode=decode_steps(sizes, rng, sizes["repeats"]),
        prefix_hit=prefix_hit(sizes, rng, sizes["repeats"]),
    )
    result["targets"] = _targets(result)
    return result


def _targets(result: dict) -> list[dict[str, Any]]:
    best = {}
    for row in result["decode"]:
        if row["contender"].startswith("paged/"):
            if row["filled"] not in best or row["ms_per_step"] < best[row["filled"]]["ms_per_step"]:
                best[row["filled"]] = row
    decode = list(best.values())
    concurrency = result["concurrency"][0]
    return [
        target("memory: allocated / used", result["memory"]["allocated_over_used"], "<=", 1.04),
        target(f"concurrency: paged / contiguous sequences (mean / max length {concurrency['mean_over_max_len']:.2f})",
               concurrency["ratio"], ">=", 2.5),
        target("forks: pages held / (ceil(P/page) + N)", result["forks"]["pages"] / result["forks"]["expected"], "<=",
               1),
        target("prefix hit: time to first token, cold / hit", result["prefix_hit"]["speedup"], ">=", 10),
        target("decode step: paged / contiguous (worst filled length)", max(r["paged_over_contiguous"] for r in decode),
               "<=", 1.2),
        target("decode step: share of calibration bandwidth (worst filled length)",
               min(r["share_of_calibration"] for r in decode), ">=", 0.6),
        target("host: us per sequence per step", result["host"]["us_per_sequence_step"], "<=", 50),
    ]


def run_paged(*, out_dir: str | os.PathLike = "bench-results", quick: bool = False,
              repeats: int | None = None) -> dict[str, Any]:
    """Measures, writes `paged.json` and `paged.md` under `out_dir`, shows the tables."""
    result = measure_paged(quick=quick, repeats=repeats)
    write(out_dir, "paged", result, paged_markdown(result))
    return result
