"""Compute kernels, and the one place that chooses among them.

- `route`: which path each operation takes (a decode step, a prefill chunk,
  a weight dot): XLA, a Pallas kernel (compiled or interpreted) or a native
  one; `contiguous_attention` runs what it picks for a contiguous cache.
- `pallas`: jax's Pallas GPU decode kernels over kvattn's caches.
- `cpu`: kvattn's native attention kernels over a contiguous cache or a paged pool.
- `partials`: the decode kernels' unnormalised sums, joined and normalised.
- `dots`: the weight dots over every form `kvattn.math.quant` stores.
- `native`: the compiled kernels for XLA:CPU, listed once (`native.KERNELS`).
"""

from kvattn.kernels import cpu, native
from kvattn.kernels.cpu import contiguous_chunk
from kvattn.kernels.pallas import contiguous_step, paged_step
from kvattn.kernels.route import (
    cache_kernel,
    chunk_path,
    contiguous_attention,
    contiguous_limits,
    native_limits,
    native_paged_limits,
    on_gpu,
    paged_limits,
    paged_path,
    step_path,
)

__all__ = [
    "cache_kernel", "chunk_path", "contiguous_attention", "contiguous_chunk", "contiguous_limits",
    "contiguous_step", "cpu", "native", "native_limits", "native_paged_limits", "on_gpu", "paged_limits", "paged_path", "paged_step",
    "step_path",
]
