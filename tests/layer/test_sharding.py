"""Sharding on a mesh: the layer split over 4 and 8 simulated CPU devices equals it on one.

The device count is fixed when JAX starts and the rest of the suite runs on
one device, so the multi-device checks live in `tests/sharding_checks.py`
and run once, in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`; the tests below read
its report. Argument checks that need no second device run here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx

import kvattn
from kvattn.layer.sharding import make_mesh, shard
from tests.sharding_checks import DEVICES, EVERY, IN_FEATURES, LAYOUTS, cases

TIMEOUT_S = 600


@pytest.fixture(scope="module")
def report() -> subprocess.CompletedProcess:
    """One run of every multi-device check, on CPU devices whatever accelerator is present."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    root = Path(__file__).parents[2]
    return subprocess.run(
        [sys.executable, "-m", "tests.sharding_checks", *LAYOUTS], capture_output=True, text=True, env=env, cwd=root,
        timeout=TIMEOUT_S, check=False,
    )


def outcome(report: subprocess.CompletedProcess, name: str) -> str:
    """The report's line for check `name`, without its PASS/FAIL prefix; fails if it did not pass."""
    lines = [line for line in report.stdout.splitlines() if line.split(": ", 1)[0][5:] == name]
    assert lines, f"no result for {name!r}; the run printed:\n{report.stdout}\n{report.stderr[-3000:]}"
    assert lines[0].startswith("PASS "), f"{lines[0]}\n{report.stderr[-3000:]}"
    return lines[0].split(": ", 1)[1]


def test_every_check_passes(report):
    failed = [line for line in report.stdout.splitlines() if line.startswith("FAIL")]
    assert report.returncode == 0 and not failed, f"{report.stdout}\n{report.stderr[-3000:]}"


@pytest.mark.parametrize("case", cases(LAYOUTS, EVERY), ids=str)
def test_sharded_layer_equals_the_layer_on_one_device(report, case):
    """Step, prefill, nnx.jit, decode and Decoder agree to 1e-5; caches keep their shardings after each."""
    outcome(report, str(case))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_built_under_set_mesh_is_placed_like_shard_places_it(report, layout):
    outcome(report, f"int8 built on mesh {layout}")


def collectives_of(summary: str) -> list[str]:
    return summary.split("collectives: ", 1)[1].split("; ")


@pytest.mark.parametrize("case", [c for c in cases(LAYOUTS, EVERY) if c.model > 1], ids=str)
def test_model_placement_reduces_once_after_out(report, case):
    """Tensor parallel, either layout: one all-reduce of out's partial sums `(B/data * T, D)`; no cache moves."""
    summary = outcome(report, str(case))
    assert "cache stays put" in summary
    partial_sums = f"all-reduce [{case.batch_size // case.data},{IN_FEATURES}]"
    assert sorted(collectives_of(summary)) == sorted([partial_sums] + (["all-reduce []"] if case.data > 1 else []))


@pytest.mark.parametrize("case", [c for c in cases(LAYOUTS, EVERY) if c.model == 1], ids=str)
def test_data_placement_communicates_one_scalar(report, case):
    """Batch over 8 devices: each device steps its own sequences' caches; only the batch's longest fill crosses."""
    summary = outcome(report, str(case))
    assert "cache stays put" in summary and summary.endswith("collectives: all-reduce []")


def test_paged_pool_splits_over_kv_heads(report):
    """Prefill and steps with the pool split over 4 devices equal one device's; only out's partial sums cross."""
    summary = outcome(report, "paged over heads")
    assert collectives_of(summary) == [f"all-reduce [2,{IN_FEATURES}]"]


def test_indivisible_heads_are_refused_before_anything_moves(report):
    message = outcome(report, "indivisible heads")
    assert "expected a multiple of 4, got 1" in message and "num_kv_heads" in message


# ------------------------------------------------------- one device, here


def annotated_layer(**kw) -> kvattn.MultiHeadAttention:
    """Annotations need no mesh until the layer is placed."""
    return kvattn.MultiHeadAttention(2, 8, max_len=4, batch_size=2, rngs=nnx.Rngs(0), **kw)


def test_make_mesh_has_auto_data_and_model_axes():
    mesh = make_mesh()
    assert mesh.axis_names == ("data", "model") and dict(mesh.shape) == {"data": 1, "model": 1}
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}


def test_shard_refuses_a_layer_without_annotations():
    layer = kvattn.MultiHeadAttention(2, 8, max_len=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no sharding annotations.*data_axis"):
        shard(layer, make_mesh())


def test_shard_refuses_an_axis_the_mesh_lacks():
    with pytest.raises(ValueError, match=r"mesh axis 'batch', but the mesh has axes \('data', 'model'\)"):
        shard(annotated_layer(data_axis="batch"), make_mesh())


def test_shard_refuses_explicit_mesh_axes():
    explicit = jax.make_mesh((1, 1), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with pytest.raises(ValueError, match="AxisType.Auto .*got {'data': 'Explicit', 'model': 'Explicit'}"):
        shard(annotated_layer(data_axis="data"), explicit)
