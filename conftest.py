"""A strict test environment, applied before any kvattn module is imported.

Shape annotations on kvattn's functions are checked at run time (jaxtyping +
beartype), and implicit rank promotion raises instead of broadcasting.
"""

import os

# The suite's programs are tiny, so compiling them is most of its time: XLA:CPU's LLVM backend runs
# without optimisation here (about a third less CPU for the suite), fusions are emitted by XLA's
# elemental emitter rather than its MLIR fusion emitters (on a 2-core AMD EPYC, the suite's tests ran in
# 6:58 instead of 12:38), and each program's LLVM module is compiled whole rather than split for threads
# that two busy test workers leave no core for (two engine-heavy files side by side: 14-29% less time).
# The HLO passes, which fusions form and the YNNPACK calls stay XLA's defaults; subprocesses (servers, the
# mesh and multi-host checks) inherit the setting. A user's own XLA_FLAGS naming any of these flags leaves them all out:
# XLA_FLAGS=--xla_backend_optimization_level=2 make test runs the suite as compiled by default. The flags
# found are kept for the one check that needs XLA's defaults in a process of its own
# (tests.helpers.default_compile_env).
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")
_found = os.environ.get("XLA_FLAGS", "")
os.environ.setdefault("KVATTN_TESTS_XLA_FLAGS_FOUND", _found)
if not any(flag.split("=")[0] in _found for flag in FAST_COMPILE):
    os.environ["XLA_FLAGS"] = " ".join([_found, *FAST_COMPILE]).strip()

import jax  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

with install_import_hook("kvattn", "beartype.beartype"):
    import kvattn  # noqa: F401

settings.register_profile(
    "kvattn",
    deadline=None,
    max_examples=10,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)
# A longer random search for local bug hunting, and the slowest cases CI leaves out
# (four JAX processes in test_multihost): HYPOTHESIS_PROFILE=wide make test
settings.register_profile("wide", parent=settings.get_profile("kvattn"), derandomize=False, max_examples=60)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvattn"))

# The suite's longest files, longest first. pytest-xdist hands out whole files (`--dist loadfile`), by default
# in order of their number of tests, which leaves a long file of few tests (the multi-host run, a benchmark's
# end-to-end run) to start last while the other worker idles. `make test` turns that order off
# (`--no-loadscope-reorder`) and these start first instead; every other file follows in collection order.
LONGEST_FIRST = (
    "tests/benchmarks/test_bench.py",
    "tests/serving/test_server.py",
    "tests/layer/test_sharding.py",
    "tests/layer/test_multihost.py",
    "tests/serving/test_llm.py",
    "tests/layer/test_decoding.py",
    "tests/serving/test_http.py",
    "tests/layer/test_forward.py",
    "tests/models/test_hf_equivalence.py",
    "tests/benchmarks/test_speculative.py",
    "tests/caches/test_contract.py",
    "tests/generation/test_speculative.py",
    "tests/layer/test_attention.py",
)


def pytest_collection_modifyitems(config, items):
    import pathlib

    import pytest

    root = pathlib.Path(__file__).parent
    if missing := [path for path in LONGEST_FIRST if not (root / path).is_file()]:
        raise pytest.UsageError(f"conftest.LONGEST_FIRST names files that are gone: {missing}")
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
