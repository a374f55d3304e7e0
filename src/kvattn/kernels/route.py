"""The one place that chooses what runs: XLA, a Pallas kernel (compiled or interpreted) or a native kernel.

Per operation, from the mode a cache carries (`AttentionConfig.decode_kernel`
as `cache_kernel` passes it on) and from what the call asks:

- **a decode step** (one new token per sequence; `step_path`):
  - `"xla"`: `kvattn.math.ops`.
  - `"auto"`: on a GPU, the Pallas kernel where it serves the call
    (`contiguous_limits`, `paged_limits`) and reads the cache in place; on
    the CPU, the native kernel under the same conditions (`native_limits`,
    `native_paged_limits`); else `kvattn.math.ops`.
  - `"pallas"`: the Pallas kernel, or `UnsupportedConfigError` naming what it
    lacks (a backend that is not a GPU included).
  - `"interpret"`: the Pallas kernel in its interpret mode, on any backend
    (what the tests run on the CPU), under the same limits.
- **a prefill chunk** (several new tokens; `chunk_path`): the native prefill
  kernel under `"auto"` on a CPU backend, for a contiguous cache read first
  that it serves; XLA everywhere else. No Pallas kernel takes chunks, so a
  forced mode (`"pallas"`, `"interpret"`) leaves chunks on XLA rather than
  refusing them; a paged chunk takes the native paged prefill kernel under
  the same rule (`native_paged_limits`).
- **a weight dot** (`use_panels`, `use_tiles`, `use_int4_tiles`: which form a model stores;
  `panel_dot`, `tiled_dense`, `int4_dot`: what `kvattn.kernels.dots.dense` runs): the
  native dots where they are available on the CPU backend, XLA's dot of the
  same values everywhere else (chosen per platform at lowering).

`contiguous_attention` runs what is chosen for a contiguous cache (the cache
hands over its XLA read), `paged_path` names it for a paged pool. Axis
letters follow `kvattn.math.ops`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int, Int8, Shaped, UInt8

from kvattn.caches.base import HEADS_MAJOR, SLOTS_MAJOR
from kvattn.errors import UnsupportedConfigError
from kvattn.kernels import cpu, native, pallas
from kvattn.math import quant

__all__ = [
    "bfloat16_weights", "cache_kernel", "chunk_path", "contiguous_attention", "contiguous_limits", "int4_dot",
    "native_limits", "native_paged_limits", "on_gpu", "paged_limits", "paged_path", "panel_dot", "step_path",
    "tiled_dense", "use_int4_tiles", "use_panels", "use_tiles",
]


def cache_kernel(config) -> str:
    """The mode a layer's cache carries: `config.decode_kernel`, and `"xla"` for a sharded layer under `"auto"`.

    A `pallas_call` has no sharding rule: XLA would gather a sharded cache
    onto every device to run it.
    """
    sharded = config.data_axis is not None or config.model_axis is not None
    return "xla" if sharded and config.decode_kernel == "auto" else config.decode_kernel


def on_gpu() -> bool:
    """Whether the default backend is a GPU (the tests replace this to check the rule)."""
    return jax.default_backend() == "gpu"


def _on_cpu() -> bool:
    return not on_gpu() and jax.default_backend() == "cpu"


# ------------------------------------------------------------------ the rules


def step_path(mode: str, cannot: str | None, *, in_place: bool = True,
              native_cannot: str | None = "no native kernel reads this cache") -> str:
    """Which path a decode step takes: `"xla"`, `"pallas"` (compiled for the GPU), `"interpret"` or `"native"`.

    Args:
      mode: `AttentionConfig.decode_kernel`, as the cache carries it.
      cannot: why the Pallas kernel cannot serve this call
        (`contiguous_limits`, `paged_limits`), or None.
      in_place: whether the kernel would read the cache where it lies;
        `"auto"` takes a kernel only then, a forced mode pays the copy.
      native_cannot: why the native CPU kernel cannot serve this call
        (`native_limits`), or None; `"auto"` takes it on a CPU backend.

    Raises:
      UnsupportedConfigError: a forced mode (`"pallas"`, `"interpret"`) the
        call cannot take, or `"pallas"` on a backend that is not a GPU.
    """
    if mode == "xla":
        return "xla"
    if mode == "auto":
        if on_gpu():
            return "pallas" if cannot is None and in_place else "xla"
        return "native" if native_cannot is None and in_place and jax.default_backend() == "cpu" else "xla"
    if cannot is None and mode == "pallas" and not on_gpu():
        cannot = f"the backend is {jax.default_backend()!r}, not a GPU ('interpret' runs the kernel anywhere, slowly)"
    if cannot is not None:
        raise UnsupportedConfigError(
            f"decode_kernel={mode!r}, but the Pallas kernel cannot serve this decode step: {cannot}; "
            "use decode_kernel='auto' (XLA there) or 'xla'"
        )
    return mode


def chunk_path(mode: str, native_cannot: str | None) -> str:
    """Which path a chunk of several new tokens per sequence takes: `"native"` or `"xla"`.

    The native prefill kernel under `"auto"` on a CPU backend, where it
    serves the call (`native_limits` with the prefill kernel); XLA
    everywhere else, forced modes included (no Pallas kernel takes chunks).
    """
    return "native" if mode == "auto" and native_cannot is None and _on_cpu() else "xla"


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _head_dim_limit(head_dim: int) -> str | None:
    if head_dim < pallas.MIN_TILE or not _power_of_two(head_dim):
        return f"head_dim {head_dim} is not a power of two >= {pallas.MIN_TILE} (Triton's tiles)"
    return None


def _float32_interval(kernel: str, k_cache, k_scale, layout: str, *, window, write_first,
                      logit_softcap) -> str | None:
    """What both contiguous kernels need: float32 values, no soft-cap, one interval of slots to read."""
    if k_scale is not None or k_cache.dtype != jnp.float32:
        return f"the cache is {k_cache.dtype}; the {kernel} reads float32 caches"
    if logit_softcap is not None:
        return f"the {kernel} has no logit soft-cap"
    if window is not None and not write_first:
        return "a ring read before the write must skip one slot (the drivers write first)"
    if window is not None and k_cache.shape[layout.index("S")] != window:
        return "a ring with spare slots holds more than its window (the kernels read every slot it holds)"
    return None


def contiguous_limits(
    k_cache: Shaped[Array, "B ..."],
    k_scale: Array | None,
    layout: str,
    *,
    window: int | None,
    write_first: bool,
    logit_softcap: float | None,
) -> str | None:
    """Why `decode_attention.gqa` cannot serve a decode step over this contiguous cache, or None.

    It has no soft-cap, no int8 scales, and reads one interval of slots: a
    ring read before the write would have to skip the slot about to be
    overwritten. Its dots take the query in the cache's dtype, so a
    bfloat16 cache would round queries and weights to bfloat16, below the
    float32 attention math kvattn promises. Slots split evenly into tiles of
    16 or more.
    """
    num_slots, head_dim = k_cache.shape[layout.index("S")], k_cache.shape[-1]
    cannot = _float32_interval("decode kernel", k_cache, k_scale, layout, window=window, write_first=write_first,
                               logit_softcap=logit_softcap)
    if cannot is None and num_slots % pallas.MIN_TILE:
        cannot = f"{num_slots} slots are not a multiple of {pallas.MIN_TILE}"
    return cannot or _head_dim_limit(head_dim)


def native_limits(
    k_cache: Shaped[Array, "B ..."],
    k_scale: Array | None,
    layout: str,
    *,
    window: int | None,
    write_first: bool,
    logit_softcap: float | None,
    kernel: str = native.DECODE_ATTENTION,
) -> str | None:
    """Why the native `kernel` (`native.DECODE_ATTENTION` for a step, `PREFILL_ATTENTION` for a chunk) cannot
    serve a call over this contiguous cache, or None.

    Both read float32 heads-major caches (one interval of slots, as the
    Pallas kernel), have no soft-cap, and take head dims in 16-float
    vectors; the prefill kernel reads first.
    """
    reason = native.unavailable_reason(kernel)
    if reason is not None:
        return f"kvattn's native {kernel.removeprefix('kvattn_')} cannot run here: {reason}"
    if layout != HEADS_MAJOR:
        return "the native kernel reads heads-major caches"
    if kernel == native.PREFILL_ATTENTION and write_first:
        return "the native prefill kernel reads the cache before the write"
    cannot = _float32_interval("native kernel", k_cache, k_scale, layout, window=window, write_first=write_first,
                               logit_softcap=logit_softcap)
    if cannot is None and k_cache.shape[-1] % 16:
        cannot = f"head_dim {k_cache.shape[-1]} is not a multiple of 16"
    return cannot


def paged_limits(k_pages: Shaped[Array, "P ..."], layout: str, *, window: int | None) -> str | None:
    """Why the paged kernel cannot serve a decode step over this pool, or None.

    It reads every position from the sequence's first (no window), in whole
    pages (a power of two of slots), from float32 pools or int8 ones with
    their scales (bfloat16: see `contiguous_limits`). It soft-caps as
    `kvattn.math.ops` does.
    """
    page_size = k_pages.shape[1 if layout == SLOTS_MAJOR else 2]
    if k_pages.dtype not in (jnp.float32, jnp.int8):
        return f"the pool is {k_pages.dtype}; the paged kernel reads float32 or int8 pools"
    if window is not None:
        return "the paged kernel has no window (it reads from each sequence's first position)"
    if not _power_of_two(page_size):
        return f"page_size {page_size} is not a power of two (Triton's tiles)"
    return _head_dim_limit(k_pages.shape[-1])


# ------------------------------------------------------------------ attention


def contiguous_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K H"],
    lengths: Int[Array, " B"],
    written: Int[Array, " B"],
    k_cache: Shaped[Array, "B ..."],
    v_cache: Shaped[Array, "B ..."],
    k_scale: Array | None,
    old_pos: Int[Array, " B"],
    pos: Int[Array, " B"],
    *,
    mode: str,
    layout: str,
    window: int | None,
    write_first: bool,
    logit_softcap: float | None,
    on_xla: Callable[[], Float[Array, "B T N H"]],
) -> Float[Array, "B T N H"]:
    """Attention of new queries over a contiguous cache, on whatever the rules pick; `on_xla()` is XLA's path.

    Args:
      q, k, v: the new tokens' queries (unscaled), keys and values.
      lengths: new tokens per sequence; written: those written first.
      k_cache, v_cache, k_scale: the cache as the read sees it: written
        (`write_first`) or as it was.
      old_pos, pos: tokens each sequence held before the call, and holds
        as read (`pos` = `old_pos` when read first).
      mode: the cache's `kernel` (`cache_kernel`).
      layout, window, write_first, logit_softcap: the cache's and the call's.
      on_xla: the cache's own read on `kvattn.math.ops`.
    """
    limits = {"window": window, "write_first": write_first, "logit_softcap": logit_softcap}
    if q.shape[1] > 1:
        native_cannot = native_limits(k_cache, k_scale, layout, kernel=native.PREFILL_ATTENTION, **limits)
        if chunk_path(mode, native_cannot) == "native":
            return cpu.contiguous_chunk(q, k, v, lengths, k_cache, v_cache, old_pos)
        return on_xla()
    path = step_path(
        mode,
        contiguous_limits(k_cache, k_scale, layout, **limits),
        in_place=layout == HEADS_MAJOR,
        native_cannot=native_limits(k_cache, k_scale, layout, **limits),
    )
    if path == "xla":
        return on_xla()
    if path == "native":
        def run(q, new_len, visible, **new):
            return cpu.contiguous_step(q, new_len, k_cache, v_cache, visible, **new)
    else:
        def run(q, new_len, visible, **new):
            return pallas.contiguous_step(q, new_len, k_cache, v_cache, visible, layout, interpret=path == "interpret",
                                          **new)
    if write_first:  # a ring written first holds exactly the window up to the new token
        return run(q, written, pos if window is None else jnp.minimum(pos, window))
    return run(q, lengths, old_pos, new=(k, v))


def native_paged_limits(k_pages: Shaped[Array, "P ..."], layout: str, *, window: int | None,
                        logit_softcap: float | None, kernel: str = native.PAGED_DECODE_ATTENTION) -> str | None:
    """Why the native paged `kernel` (`native.PAGED_DECODE_ATTENTION` for a step, `PAGED_PREFILL_ATTENTION` for
    a chunk) cannot serve a call over this pool, or None.

    Both read float32 heads-major pages, from each sequence's first position
    (no window), without a soft-cap, head dims in 16-float vectors.
    """
    reason = native.unavailable_reason(kernel)
    if reason is not None:
        return f"kvattn's native {kernel.removeprefix('kvattn_')} cannot run here: {reason}"
    if layout != HEADS_MAJOR:
        return "the native paged kernel reads heads-major pools"
    if k_pages.dtype != jnp.float32:
        return f"the pool is {k_pages.dtype}; the native paged kernel reads float32 pools"
    if window is not None:
        return "the native paged kernel has no window (it reads from each sequence's first position)"
    if logit_softcap is not None:
        return "the native paged kernel has no logit soft-cap"
    if k_pages.shape[-1] % 16:
        return f"head_dim {k_pages.shape[-1]} is not a multiple of 16"
    return None


def paged_path(mode: str, num_new: int, k_pages: Shaped[Array, "P ..."], layout: str, *, window: int | None,
               logit_softcap: float | None = None) -> str:
    """Which path attention over a paged pool takes: for a chunk, `chunk_path` with the native paged prefill
    kernel; for a step, `step_path` with `paged_limits` and `native_paged_limits`.

    A Pallas path (`"pallas"`, `"interpret"`) runs `kvattn.kernels.pallas.paged_step`
    over the pool written first with its page tails zeroed; `"native"` runs
    `kvattn.kernels.cpu.paged_step` (a step) or `paged_chunk` (a chunk).
    """
    if num_new > 1:
        return chunk_path(mode, native_paged_limits(k_pages, layout, window=window, logit_softcap=logit_softcap,
                                                    kernel=native.PAGED_PREFILL_ATTENTION))
    return step_path(mode, paged_limits(k_pages, layout, window=window),
                     native_cannot=native_paged_limits(k_pages, layout, window=window, logit_softcap=logit_softcap))


# ------------------------------------------------------------------ weight dots


# The native dot of each dtype panels are stored in.
_PANEL_DOTS = {
    jnp.dtype(jnp.float32): (native.F32_DOT, native.f32_dot, native.f32_dot_on_xla),
    jnp.dtype(jnp.bfloat16): (native.BF16_DOT, native.bf16_dot, native.bf16_dot_on_xla),
}


def use_panels(outputs: int, dtype) -> bool:
    """Whether a kernel of `outputs` (the product of `F`) stored in `dtype` is best stored as panels here.

    It must be float32 or bfloat16 with whole panels, and that dtype's
    native dot must run on this backend.
    """
    dot = _PANEL_DOTS.get(jnp.dtype(dtype))
    return (dot is not None and outputs % quant.PANEL_OUTPUTS == 0 and jax.default_backend() == "cpu"
            and native.available(dot[0]))


def bfloat16_weights() -> bool:
    """Whether `weights="bfloat16"` runs here as bfloat16 panels under float32 computation (kvattn's bfloat16 dot on
    the CPU), rather than as bfloat16 everywhere (a GPU's or TPU's fast bfloat16 dots) or not at all."""
    return use_panels(quant.PANEL_OUTPUTS, jnp.bfloat16)


def use_int4_tiles(outputs: int) -> bool:
    """Whether a 4-bit kernel of `outputs` is best stored tiled here: whole tiles of 8, and the native dot runs."""
    return outputs % 8 == 0 and jax.default_backend() == "cpu" and native.available(native.INT4_DOT)


def use_tiles(outputs: int, inputs: int) -> bool:
    """Whether an int8 kernel of this shape is best stored tiled here: it fits, and the native dot runs here."""
    return quant.can_tile(outputs, inputs) and jax.default_backend() == "cpu" and native.available(native.INT8_DENSE)


def panel_dot(rows: Float[Array, "M D"], panels: Shaped[Array, "Np D 16"]) -> Float[Array, "M N"]:
    """`rows @ kernel` in float32 for the float32 or bfloat16 kernel `panels` lays out: that dtype's native dot
    on the CPU, XLA's dot of the same values elsewhere."""
    target, dot, twin = _PANEL_DOTS[jnp.dtype(panels.dtype)]
    if not native.available(target):
        return twin(rows, panels)
    return lax.platform_dependent(rows, panels, cpu=dot, default=twin)


def int4_dot(values: Int8[Array, "M D"], packed: UInt8[Array, "..."], scale) -> Float[Array, "M N"]:
    """The group-scaled float32 sums of int8 `values` by 4-bit weights (either layout of
    `kvattn.kernels.native.int4_dot`): the native dot on the CPU, XLA's twin elsewhere."""
    if not native.available(native.INT4_DOT):
        return native.int4_dot_on_xla(values, packed, scale)
    return lax.platform_dependent(values, packed, scale, cpu=native.int4_dot, default=native.int4_dot_on_xla)


def tiled_dense(rows: Float[Array, "M D"], tiles: UInt8[Array, "Nt Dg 16 4"], scale: Float[Array, " N"]
                ) -> Float[Array, "M N"]:
    """The int8 dense of float32 `rows` by tiled int8 weights with their float32 `scale` (`native.int8_dense`):
    the native kernel on the CPU, its XLA twin elsewhere."""
    if not native.available(native.INT8_DENSE):
        return native.int8_dense_on_xla(rows, tiles, scale)
    return lax.platform_dependent(rows, tiles, scale, cpu=native.int8_dense, default=native.int8_dense_on_xla)
