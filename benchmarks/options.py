"""`python -m benchmarks --options`: what rotary positions, QK-norm and bfloat16 compute cost per token.

Each variant is the benchmark's layer with one option set (`VARIANTS`); the
weights it shares with the plain layer are the plain layer's, cast to its
`param_dtype`. Every variant is timed with the driver of `kvattn_decode`:
`kvattn.decode` over one burst of `burst_tokens` tokens ending with T slots
filled, from a cache the variant prefilled itself (its keys are stored
rotated and normalised as it stores them), reloaded before every burst.

Bursts are interleaved: each round times one burst of every variant, after
an untimed warm-up burst of its own (`time_calls`), starting one variant
later each round, so a machine that drifts during the run moves every
variant alike. A figure is the median over `repeats` rounds; its ratio
divides it by the plain layer's figure at the same B and T, from the same
rounds.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvattn
from benchmarks.bench_config import DEFAULT_LAYOUT, BenchConfig
from benchmarks.contenders import Progress
from benchmarks.timing import PREFILL_CHUNK, CacheFiller, CacheState, load_state, time_calls

__all__ = ["LLAMA3_SCALING", "VARIANTS", "OptionsBench", "measure_options"]

# Llama 3.1's `rope_scaling`, as its config.json spells it.
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# name: (the layer's keyword arguments beyond the plain layer's, how they read in the tables)
VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "plain": ({}, "(none)"),
    "rope": ({"rope": kvattn.RoPE()}, "rope=RoPE()"),
    "rope_llama3": ({"rope": kvattn.RoPE(scaling=LLAMA3_SCALING)}, "rope=RoPE(scaling=llama3)"),
    "qk_rms": ({"normalize_qk": "rms"}, 'normalize_qk="rms"'),
    "rope+qk_rms": ({"rope": kvattn.RoPE(), "normalize_qk": "rms"}, 'rope=RoPE(), normalize_qk="rms" (Qwen3-like)'),
    "bf16_compute": ({"dtype": jnp.bfloat16}, "dtype=bfloat16"),
    "bf16_params": ({"param_dtype": jnp.bfloat16, "dtype": jnp.bfloat16}, "param_dtype=dtype=bfloat16"),
}


class OptionsBench:
    """Every variant of one batch size: its timed layer and its cache filler, all on one stream."""

    def __init__(self, config: BenchConfig, batch_size: int):
        self.config = config
        self.batch_size = batch_size
        self.layout = config.layouts[0]
        plain = config.layer(self.batch_size, self.layout)
        params = nnx.state(plain, nnx.Param)
        # Past max_len by one chunk, so the fillers' prefill chunks are all full.
        stream_len = config.max_len + min(PREFILL_CHUNK, config.max_len)
        self.stream = jax.random.normal(jax.random.key(1), (batch_size, stream_len, config.in_features))
        self.layers, self.fillers = {}, {}
        for name, (options, _) in VARIANTS.items():
            timed = plain if name == "plain" else config.layer(self.batch_size, self.layout, **options)
            # States are saved slots-major, in float32.
            filler = config.layer(self.batch_size, DEFAULT_LAYOUT, "float32", **options)
            for layer in (timed, filler):
                dtype = jnp.dtype(layer.config.param_dtype)
                nnx.update(layer, jax.tree.map(lambda leaf, dtype=dtype: leaf.astype(dtype), params))
            self.layers[name] = timed
            self.fillers[name] = CacheFiller(filler, self.stream)

    def weight_bytes(self, name: str) -> int:
        return sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(self.layers[name], nnx.Param)))

    def measure_filled(self, filled: int, progress: Progress) -> list[dict[str, Any]]:
        """Every variant's row at filled length `filled`, from interleaved rounds of bursts."""
        count = self.config.burst_tokens
        states = {name: filler.state_at(filled - count) for name, filler in self.fillers.items()}
        chunk = jax.block_until_ready(self.stream[:, filled - count : filled])
        names = list(VARIANTS)
        samples: dict[str, list[float]] = {name: [] for name in names}
        outputs = {}
        for round_index in range(self.config.repeats):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                progress.set_postfix_str(f"B={self.batch_size} T={filled} round {round_index + 1} {name}")
                timing = self.time_decode(name, states[name], chunk)
                samples[name] += timing.ms
                outputs[name] = timing.last_output
            progress.update()
        history = jax.block_until_ready(self.stream[:, :filled])
        plain_ms = float(np.median(samples["plain"]))
        rows = []
        for name in names:
            ms = float(np.median(samples[name]))
            # The variant's own uncached forward over the same history: what decode must reproduce.
            reference = self.layers[name](history)[:, -1].astype(jnp.float32)
            step_bytes = self.weight_bytes(name) + self.config.kv_bytes(self.batch_size, filled)
            rows.append({
                "batch_size": self.batch_size,
                "filled": filled,
                "variant": name,
                "options": VARIANTS[name][1],
                "tokens_timed": count,
                "ms_per_token": ms,
                "samples_ms_per_token": samples[name],
                "ratio_to_plain": ms / plain_ms,
                "bytes_per_step": step_bytes,
                "bytes_per_s": step_bytes / (ms * 1e-3),
                "max_abs_diff_vs_recompute": float(jnp.max(jnp.abs(outputs[name].astype(jnp.float32) - reference))),
            })
        return rows

    def time_decode(self, name: str, state: CacheState, chunk: jax.Array):
        """One warm-up and one timed burst of `kvattn.decode` on variant `name`, from a fresh copy of `state`."""
        layer = self.layers[name]
        timing = time_calls(lambda loaded: kvattn.decode(loaded, chunk), 1, prepare=lambda: load_state(layer, state),
                            units=chunk.shape[1])
        return timing._replace(last_output=timing.last_output[:, -1])


def measure_options(config: BenchConfig, progress: Progress) -> list[dict[str, Any]]:
    """Every variant's row at every batch size and filled length; `progress` advances once per round."""
    rows = []
    for batch_size in config.batch_sizes:
        bench = OptionsBench(config, batch_size)
        for filled in config.filled:
            rows.extend(bench.measure_filled(filled, progress))
    return rows
