"""kvattn's benchmarks (`make bench`, `python -m benchmarks`): per-token decode time against Flax and recompute.

This package lives beside the library, not in its wheel, and uses kvattn as
a user would. Four suites, each writing `<name>.json` and `<name>.md` with
`benchmarks.report.write`, every time taken by `benchmarks.timing.time_calls`:

  run           the contenders below (`results`, plus two PNG plots)
  run_options   `--options`: what each layer option costs (`benchmarks.options`)
  run_model     `--model`: whole-model decoding (`benchmarks.model`)
  run_paged     `--paged`: the paged cache against the contiguous one (`benchmarks.paged`)

The default run's contenders are measured in one run, on one random stream
and one set of weights shared by all of them:

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

All need the `bench` extra (tables, progress, plots), which
`kvattn.extra.require` imports where it is used.
"""

from benchmarks.bench_config import BenchConfig
from benchmarks.model import run_model
from benchmarks.paged import run_paged
from benchmarks.runner import run, run_options

__all__ = ["BenchConfig", "run", "run_model", "run_options", "run_paged"]
