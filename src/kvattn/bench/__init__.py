"""`kvattn bench`: per-token decode time of kvattn against Flax and recompute baselines.

Every figure is measured in one run, on one random stream and one set of
weights shared by all contenders:

  kvattn_step/<layout>    `Decoder.step` in a Python loop (the fast path)
  kvattn_decode/<layout>  `kvattn.decode`, the whole burst in one `lax.scan`;
                          the default `donate=False`, so the caller's cache survives
  kvattn_decode_donated/<layout>
                          the same with `donate=True`: the layer's cache updated in place
  flax_nnx_jit            `nnx.MultiHeadAttention(decode=True)` stepped by `nnx.jit`
  flax_scan               the same Flax layer stepped inside one donated `lax.scan`
  recompute               `layer(history)[:, -1]`: a full causal forward per token
  calibration             a jitted mat-vec reading as many bytes as one step

"Per-token time at filled length T" is the time of one decode step (one token
for each of the B sequences) while the cache fills up to T: the cache is
prefilled (untimed) to just below T, and a burst of steps that ends with T
slots filled is timed, after warm-up, with `jax.block_until_ready`; the
figure is the median over `repeats` bursts, each starting from the same saved
cache. Python-loop contenders run one untimed lead-in step per burst, so the
copy of the restored cache is never timed.

"Per-token time over a whole generation" is measured directly at the
smallest batch size: every contender but recompute and the calibration runs
one whole `max_len`-token generation from an empty cache (after an untimed
warm-up), as a user would, and the median over `generation_repeats` runs is
divided by `max_len`. Elsewhere (recompute, larger batches) it is the mean
over filled lengths 1..max_len of the measured curve, interpolated linearly
between the measured T (and held constant outside them); the interpolated
figure is kept beside the measured one in the JSON.

`run` measures and writes the files; `run_options` (`kvattn bench --options`)
times `kvattn.decode` on the layer with rotary positions, QK-norm or
bfloat16 compute against the plain layer, interleaved in one run (see
`kvattn.bench.options`); `run_demo` is `kvattn demo`. All need
the `bench` extra (tables, progress, plots), which `kvattn.bench.extra`
imports only where it is used, so `import kvattn` never loads it.
"""

from kvattn.bench.config import BenchConfig
from kvattn.bench.demo import run_demo
from kvattn.bench.runner import run, run_options

__all__ = ["BenchConfig", "run", "run_demo", "run_options"]
