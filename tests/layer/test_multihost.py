"""Several hosts, tested: every decoding path under JAX multi-controller, with real processes on loopback.

Each case starts 2 or 4 Python processes on 127.0.0.1 (2 simulated CPU
devices each), joined by `jax.distributed.initialize` with gloo collectives,
and runs `tests/multihost_scenarios.py` on a data x model mesh over all their
devices, inputs as global arrays. The same scenario on one device, in this
process, is the oracle: outputs and caches must agree to 1e-5.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from tests import multihost_scenarios
from tests.multihost import Context, launch

TOLERANCE = 1e-5


_ORACLES: dict[str, dict] = {}


def one_device(layout: str) -> dict:
    """The scenario on one device, in this process (computed once per layout)."""
    if layout not in _ORACLES:
        _ORACLES[layout] = multihost_scenarios.decoding_paths(Context(0, 1, {"layout": layout}))
    return _ORACLES[layout]


def assert_equal_results(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for key, expected in want.items():
        if isinstance(expected, dict):
            assert_equal_results(got[key], expected)
        elif isinstance(expected, np.ndarray) and expected.dtype.kind == "f":
            np.testing.assert_allclose(got[key], expected, rtol=TOLERANCE, atol=TOLERANCE, err_msg=key)
        else:
            np.testing.assert_array_equal(got[key], expected, err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize(
    "num_processes, data, model, layout",
    [(2, 2, 2, "slots_major"),
     pytest.param(4, 4, 2, "heads_major", marks=pytest.mark.skipif(
         os.environ.get("HYPOTHESIS_PROFILE") != "wide",
         reason="four JAX processes on two cores take a minute: HYPOTHESIS_PROFILE=wide runs them"))],
    ids=["2 processes, data=2 x model=2", "4 processes, data=4 x model=2"],
)
def test_every_decoding_path_equals_one_device(tmp_path, num_processes, data, model, layout):
    """Eager step/prefill, Decoder, decode, generate, fork/reorder/truncate/reset, attend, overflow, snapshot."""
    path = tmp_path / "cache.safetensors"
    result = launch("decoding_paths", num_processes, data=data, model=model, layout=layout, snapshot=str(path))
    got = dict(result.value)
    after_save = got.pop("after_save")
    oracle = one_device(layout)
    assert_equal_results(got, oracle)
    assert got["overflow_raised"] and got["unchanged_after_overflow"]
    # Every process wrote only its own piece; the snapshot loads into one process on one device.
    info = kvattn.snapshot_info(path)
    assert len(info.pieces) == num_processes and all((tmp_path / piece).exists() for piece in info.pieces)
    layer, _ = multihost_scenarios.build(Context(0, 1, {"layout": layout}))
    kvattn.load_cache(layer, path)
    final = multihost_scenarios.cache(layer)
    assert_equal_results(final, oracle["final_cache"])
    xs = np.random.default_rng(0).standard_normal((4, 14, 16)).astype(np.float32)
    np.testing.assert_allclose(layer.step(jnp.asarray(xs[:, 11])), after_save, rtol=TOLERANCE, atol=TOLERANCE)


def test_a_snapshot_with_a_missing_or_damaged_piece_is_refused(tmp_path):
    """The pieces are checked like a whole file: checksums, coverage, names; the layer is left as it was."""
    import safetensors.numpy

    from kvattn.snapshots.files import dumps, sha256
    from kvattn.snapshots.pieces import PIECES_FORMAT

    layer = kvattn.MultiHeadAttention(2, 8, max_len=4, batch_size=2, rngs=nnx.Rngs(0))
    layer.prefill(jnp.ones((2, 2, 8)))
    path = tmp_path / "c.safetensors"
    kvattn.save_cache(layer, path)
    whole, header = safetensors.numpy.load_file(path), kvattn.snapshot_info(path)

    def write(pieces_per_file):
        names = []
        for number, pieces in enumerate(pieces_per_file):
            index = {key: {"tensor": key.split("#")[0], "start": start, "sha256": sha256(array)}
                     for key, (start, array) in pieces.items()}
            name = f"{path.name}.process-{number}-of-{len(pieces_per_file)}"
            safetensors.numpy.save_file({k: a for k, (_, a) in pieces.items()}, tmp_path / name,
                                        metadata={"format": PIECES_FORMAT, "index": dumps(index)})
            names.append(name)
        metadata = {"format": "kvattn.cache_snapshot", "format_version": "2", "config": dumps(header.config),
                    "weights_fingerprint": header.weights_fingerprint, "pieces": dumps(names),
                    "tensors": dumps({k: {"dtype": a.dtype.name, "shape": list(a.shape)} for k, a in whole.items()})}
        safetensors.numpy.save_file({}, path, metadata=metadata)

    def split(name, rows):  # sequence `rows` of a tensor, as one piece
        return {f"{name}#{rows.start}": ([rows.start] + [0] * (whole[name].ndim - 1), whole[name][rows])}

    halves = [{k: v for name in whole for k, v in split(name, slice(b, b + 1)).items()} for b in (0, 1)]
    write(halves)
    target = kvattn.MultiHeadAttention(2, 8, max_len=4, batch_size=2, rngs=nnx.Rngs(0))
    kvattn.load_cache(target, path)  # the good pieces assemble into the whole cache
    np.testing.assert_array_equal(target.k_cache[...], layer.k_cache[...])
    target.reset()
    write(halves[:1] + [{}])
    with pytest.raises(kvattn.SnapshotError, match="do not cover it exactly once"):
        kvattn.load_cache(target, path)
    bad = {k: (start, array + 1 if k.startswith("k_cache") else array) for k, (start, array) in halves[1].items()}
    (tmp_path / f"{path.name}.process-1-of-2").unlink()
    write([halves[0], halves[1]])
    piece = tmp_path / f"{path.name}.process-1-of-2"
    loaded = safetensors.numpy.load_file(piece)
    metadata = safetensors.safe_open(piece, "np").metadata()
    safetensors.numpy.save_file({k: bad[k][1] for k in loaded}, piece, metadata=metadata)
    with pytest.raises(kvattn.SnapshotError, match="fails its checksum"):
        kvattn.load_cache(target, path)
    assert not np.asarray(target.k_cache[...]).any() and not np.asarray(target.pos[...]).any()
