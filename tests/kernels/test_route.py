"""The route (`kvattn.kernels.route`): which path each operation takes, checked by tracing.

The GPU check is replaced (`route.on_gpu`); nothing here lowers a kernel for
a GPU. Where the native kernels are built, the CPU's choices are checked
by the FFI targets in the traced step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import kvattn
from kvattn import UnsupportedConfigError, kernels
from kvattn.kernels import native, route
from kvattn.layer.forward import extend

HEAD_DIM = 16
def needs_native(target):
    return pytest.mark.skipif(not native.available(target), reason=f"{target} is not built or cannot run here")


# ------------------------------------------------------------------ the rule


@pytest.fixture
def gpu(monkeypatch):
    """Pretends the backend is a GPU: only tracing may follow (nothing is lowered)."""
    monkeypatch.setattr(route, "on_gpu", lambda: True)


def attention_jaxpr(config: kvattn.AttentionConfig, num_new: int = 1, write_first: bool = False) -> str:
    """The traced step (`forward.extend`, not compiled) of a fresh layer with `config`'s options."""
    fields = {name: getattr(config, name) for name in ("max_len", "window", "num_kv_heads", "batch_size",
                                                       "cache_dtype", "cache_layout", "logit_softcap", "num_pages",
                                                       "page_size", "decode_kernel", "head_dim", "data_axis")}
    if not config.paged:
        fields["spare_slots"] = config.cache.spare_slots
    built = kvattn.MultiHeadAttention(config.num_heads, config.in_features, rngs=nnx.Rngs(0), **fields)
    if config.paged:
        table = jnp.ones((config.batch_size, config.pages_per_sequence), jnp.int32)
        cache = built.paged_cache(table, jnp.zeros((config.batch_size,), jnp.int32))
    else:
        cache = built.cache
    xs = jnp.zeros((config.batch_size, num_new, config.in_features))
    lengths = jnp.ones((config.batch_size,), jnp.int32)
    # `extend` unwrapped and a fresh partial: tracing never reuses a jaxpr traced before the fixture.
    traced = functools.partial(extend.__wrapped__, config=built.config, write_first=write_first)
    return str(jax.make_jaxpr(traced)(built.weights, cache, xs, lengths))


def config(**options) -> kvattn.AttentionConfig:
    defaults = {"num_kv_heads": 2, "batch_size": 2, "head_dim": HEAD_DIM}
    if "window" not in options or "num_pages" in options:
        defaults["max_len"] = 32
    return kvattn.AttentionConfig(4, 8, **{**defaults, **options})


PAGED = {"num_pages": 9, "page_size": 4}
RUNS_THE_KERNEL = [
    {"cache_layout": "heads_major"},
    {"cache_layout": "heads_major", "window": 32},  # a ring written first (the drivers)
    dict(**PAGED),
    dict(**PAGED, cache_layout="heads_major", cache_dtype="int8", logit_softcap=5.0),
]
RUNS_XLA = {  # options -> why the rule keeps XLA
    "slots-major (the kernel would transpose the cache)": {},
    "bfloat16": {"cache_layout": "heads_major", "cache_dtype": "bfloat16"},
    "int8 contiguous": {"cache_layout": "heads_major", "cache_dtype": "int8"},
    "soft-cap contiguous": {"cache_layout": "heads_major", "logit_softcap": 5.0},
    "slots not a multiple of 16": {"cache_layout": "heads_major", "max_len": 40},
    "head_dim 24": {"cache_layout": "heads_major", "head_dim": 24},
    "head_dim 8": {"cache_layout": "heads_major", "head_dim": 8},
    "paged window": dict(**PAGED, window=8),
    "ring with spare slots (it holds more than its window)": {"cache_layout": "heads_major", "window": 32,
                                                              "spare_slots": 16},
    "bfloat16 pool": dict(**PAGED, cache_dtype="bfloat16"),
    "page_size 3": {"num_pages": 12, "page_size": 3},
    "sharded": {"cache_layout": "heads_major", "data_axis": "data"},
    "forced xla": {"cache_layout": "heads_major", "decode_kernel": "xla"},
}


@pytest.mark.parametrize("options", RUNS_THE_KERNEL, ids=str)
def test_auto_runs_the_kernel_on_a_gpu_for_a_decode_step_it_serves(gpu, options):
    write_first = "window" in options and "num_pages" not in options
    assert "pallas_call" in attention_jaxpr(config(**options), write_first=write_first)
    assert "pallas_call" not in attention_jaxpr(config(**options), num_new=3)  # prefill


@pytest.mark.parametrize("options", RUNS_XLA.values(), ids=RUNS_XLA.keys())
def test_auto_runs_xla_on_a_gpu_where_the_kernel_would_not_serve(gpu, options):
    assert "pallas_call" not in attention_jaxpr(config(**options), write_first=True)


@pytest.mark.parametrize("options", RUNS_THE_KERNEL, ids=str)
def test_auto_runs_no_pallas_kernel_off_a_gpu(monkeypatch, options):
    monkeypatch.setattr(route, "on_gpu", lambda: False)
    assert "pallas_call" not in attention_jaxpr(config(**options), write_first=True)


@needs_native(native.DECODE_ATTENTION)
def test_auto_runs_the_native_kernel_on_a_cpu_for_a_decode_step_it_serves():
    """A contiguous float32 heads-major cache, read first or (a ring) written first; never prefill, never XLA's else."""
    runs = (({"cache_layout": "heads_major"}, False), ({"cache_layout": "heads_major", "window": 32}, True))
    for options, write_first in runs:
        assert native.DECODE_ATTENTION in attention_jaxpr(config(**options), write_first=write_first)
        assert native.DECODE_ATTENTION not in attention_jaxpr(config(**options), num_new=3)
    for why, options in RUNS_XLA.items():
        if why != "slots not a multiple of 16":  # the native kernel reads any number of slots
            assert native.DECODE_ATTENTION not in attention_jaxpr(config(**options), write_first=True), why


@needs_native(native.PAGED_DECODE_ATTENTION)
def test_auto_runs_the_native_paged_kernel_on_a_cpu_for_a_decode_step_it_serves(monkeypatch):
    """A float32 heads-major pool without a window or soft-cap; never a chunk, never a pool it cannot read."""
    heads = dict(**PAGED, cache_layout="heads_major")
    assert native.PAGED_DECODE_ATTENTION in attention_jaxpr(config(**heads))
    assert native.PAGED_DECODE_ATTENTION not in attention_jaxpr(config(**heads), num_new=3)
    keeps_xla = {"slots-major": PAGED, "window": dict(heads, window=8), "int8": dict(heads, cache_dtype="int8"),
                 "bfloat16": dict(heads, cache_dtype="bfloat16"), "soft-cap": dict(heads, logit_softcap=5.0),
                 "head_dim 24": dict(heads, head_dim=24), "forced xla": dict(heads, decode_kernel="xla")}
    for why, options in keeps_xla.items():
        assert native.PAGED_DECODE_ATTENTION not in attention_jaxpr(config(**options)), why
    monkeypatch.setattr(route, "on_gpu", lambda: True)
    assert native.PAGED_DECODE_ATTENTION not in attention_jaxpr(config(**heads))


@needs_native(native.PREFILL_ATTENTION)
def test_auto_runs_the_native_prefill_kernel_on_a_cpu_for_a_chunk_it_serves(monkeypatch):
    """A chunk read first over a contiguous float32 heads-major cache; never a step, never where XLA's path is kept."""
    assert native.PREFILL_ATTENTION in attention_jaxpr(config(cache_layout="heads_major"), num_new=3)
    assert native.PREFILL_ATTENTION not in attention_jaxpr(config(cache_layout="heads_major"))
    keeps_xla = {**RUNS_XLA, "window": {"cache_layout": "heads_major", "window": 32},
                 "forced pallas": {"cache_layout": "heads_major", "decode_kernel": "pallas"}}
    for why, options in keeps_xla.items():
        if why != "slots not a multiple of 16":
            assert native.PREFILL_ATTENTION not in attention_jaxpr(config(**options), num_new=3), why
    assert native.PREFILL_ATTENTION not in attention_jaxpr(config(cache_layout="heads_major"), num_new=3,
                                                           write_first=True)
    monkeypatch.setattr(route, "on_gpu", lambda: True)
    assert native.PREFILL_ATTENTION not in attention_jaxpr(config(cache_layout="heads_major"), num_new=3)


@pytest.mark.parametrize(
    ("mode", "native_cannot", "on_gpu", "path"),
    [("auto", None, False, "native"), ("auto", "why", False, "xla"), ("auto", None, True, "xla"),
     ("xla", None, False, "xla"), ("pallas", None, False, "xla"), ("interpret", None, False, "xla")],
)
def test_chunk_path(monkeypatch, mode, native_cannot, on_gpu, path):
    monkeypatch.setattr(route, "on_gpu", lambda: on_gpu)
    assert route.chunk_path(mode, native_cannot) == path


def test_a_forced_kernel_refuses_what_it_cannot_serve(gpu):
    assert "pallas_call" in attention_jaxpr(config(decode_kernel="pallas"))  # forced, the transpose is paid
    with pytest.raises(UnsupportedConfigError, match="no logit soft-cap; use decode_kernel='auto'"):
        attention_jaxpr(config(decode_kernel="pallas", logit_softcap=5.0))
    with pytest.raises(UnsupportedConfigError, match="ring read before the write"):
        attention_jaxpr(config(decode_kernel="interpret", window=32))
    with pytest.raises(UnsupportedConfigError, match="no window"):
        attention_jaxpr(config(decode_kernel="pallas", window=8, **PAGED))


def test_a_forced_kernel_refuses_a_backend_off_a_gpu_and_a_sharded_layer(monkeypatch):
    monkeypatch.setattr(route, "on_gpu", lambda: False)
    with pytest.raises(UnsupportedConfigError, match="not a GPU"):
        attention_jaxpr(config(decode_kernel="pallas", cache_layout="heads_major"))
    with pytest.raises(ValueError, match="no sharding rule"):
        config(decode_kernel="interpret", model_axis="model")
    with pytest.raises(ValueError, match="decode_kernel must be one of"):
        config(decode_kernel="triton")


@pytest.mark.parametrize(
    ("mode", "cannot", "in_place", "on_gpu", "native_cannot", "path"),
    [
        ("auto", None, True, True, None, "pallas"),
        ("auto", None, False, True, None, "xla"),
        ("auto", "why", True, True, None, "xla"),
        ("auto", None, True, False, "why", "xla"),
        ("auto", "why", True, False, None, "native"),
        ("auto", None, False, False, None, "xla"),
        ("xla", None, True, False, None, "xla"),
        ("pallas", None, False, True, None, "pallas"),
        ("interpret", None, False, False, None, "interpret"),
    ],
)
def test_step_path(monkeypatch, mode, cannot, in_place, on_gpu, native_cannot, path):
    monkeypatch.setattr(route, "on_gpu", lambda: on_gpu)
    assert route.step_path(mode, cannot, in_place=in_place, native_cannot=native_cannot) == path


def test_the_benchmark_reports_the_kernel_path_unavailable_off_a_gpu(monkeypatch, tmp_path):
    from benchmarks.kernels import run_kernels

    monkeypatch.setattr(kernels, "on_gpu", lambda: False)  # what the benchmark asks
    result = run_kernels(out_dir=tmp_path, quick=True)
    assert not result["available"] and "decode" not in result
    assert "Kernel path unavailable" in (tmp_path / "kernels.md").read_text()
