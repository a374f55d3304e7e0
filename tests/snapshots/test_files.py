"""Snapshot files: bounded reads, refused non-files, killed saves, and multi-process pieces checked before use."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tracemalloc

import jax.numpy as jnp
import pytest
import safetensors
import safetensors.numpy
from flax import nnx

import kvattn
from kvattn.errors import SnapshotError
from kvattn.snapshots import files, load_cache, pieces, save_cache, snapshot_info
from tests.helpers import assert_same_bits, cache_arrays


def make_layer(seed=0):
    return kvattn.MultiHeadAttention(4, 8, max_len=12, num_kv_heads=2, batch_size=3, rngs=nnx.Rngs(seed))


def filled_layer():
    layer = make_layer()
    layer.prefill(jnp.ones((3, 2, 8)), jnp.array([2, 1, 0], jnp.int32))
    return layer


def assert_refused_quickly(layer, path, match):
    before = cache_arrays(layer)
    start = time.perf_counter()
    with pytest.raises(SnapshotError, match=match):
        load_cache(layer, path)
    assert time.perf_counter() - start < 2
    assert_same_bits(cache_arrays(layer), before)


# ------------------------------------------------------------ bounded reads


def test_a_huge_sparse_file_is_refused_from_its_header_alone(tmp_path):
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as file:
        file.truncate(5 << 30)  # 5 GiB of zeros, sparse: no disk used
    assert_refused_quickly(make_layer(), path, rf"{re.escape(str(path))}: .*header is not valid JSON")
    with open(path, "r+b") as file:  # a header length past the 100 MB bound safetensors itself keeps
        file.write((200 << 20).to_bytes(8, "little"))
    assert_refused_quickly(make_layer(), path, "header claims 209715200 bytes, more than the 100000000 a header may")


def test_a_file_longer_than_its_header_describes_is_refused_before_reading(tmp_path):
    layer = filled_layer()
    path = tmp_path / "cache.safetensors"
    save_cache(layer, path)
    with open(path, "r+b") as file:
        file.truncate(5 << 30)  # the right header, then gigabytes of sparse zeros
    match = r"truncated or corrupted file: its header describes \d+ bytes, the file has 5368709120"
    assert_refused_quickly(make_layer(), path, match)


@pytest.mark.parametrize("kind", ["dev_zero", "fifo", "directory"])
def test_what_is_not_a_regular_file_is_refused_without_reading_it(tmp_path, kind):
    if kind == "dev_zero":
        path = "/dev/zero"
    elif kind == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)  # opening it for reading must not wait for a writer
    else:
        path = tmp_path
    assert_refused_quickly(make_layer(), path, "not a regular file")
    with pytest.raises(SnapshotError, match="not a regular file"):
        snapshot_info(path)


# --------------------------------------------------------------- killed saves


KILLED_SAVE = """
import os, sys, time
from flax import nnx
import kvattn
from kvattn.snapshots import atomic

path, temp = sys.argv[1:]
if temp == "named":  # as where O_TMPFILE is missing
    del os.O_TMPFILE

def half_then_hang(file, payload):
    file.write(payload[: len(payload) // 2])
    file.flush()
    print("half written", flush=True)
    time.sleep(60)

atomic.write_and_sync = half_then_hang
kvattn.save_cache(kvattn.MultiHeadAttention(4, 8, max_len=12, num_kv_heads=2, batch_size=3, rngs=nnx.Rngs(0)), path)
"""


@pytest.mark.parametrize("temp", ["unnamed", "named"])
def test_a_save_killed_mid_write_leaves_the_old_snapshot_and_nothing_the_next_save_keeps(tmp_path, temp):
    path = tmp_path / "cache.safetensors"
    save_cache(make_layer(), path)
    earlier = path.read_bytes()
    child = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(path), temp], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "half written\n"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
        child.stdout.close()
    assert path.read_bytes() == earlier
    left = sorted(os.listdir(tmp_path))
    if temp == "unnamed":
        assert left == ["cache.safetensors"]  # an O_TMPFILE inode has no name to leave behind
    else:
        assert len(left) == 2 and left[0].startswith(f".cache.safetensors.{child.pid}.")

    alive = tmp_path / f".cache.safetensors.{os.getpid()}.0123abcd.tmp"  # a live process's save in progress
    alive.write_bytes(b"")
    layer = filled_layer()
    save_cache(layer, path)
    assert sorted(os.listdir(tmp_path)) == [alive.name, "cache.safetensors"]
    target = make_layer()
    load_cache(target, path)
    assert_same_bits(cache_arrays(target), cache_arrays(layer))


# ---------------------------------------------------------------------- pieces


def saved_in_pieces(tmp_path, layer):
    """A snapshot of `layer` written the way several processes write one (here one process, one piece file)."""
    path = tmp_path / "cache.safetensors"
    save_cache(layer, path)
    with safetensors.safe_open(path, "np") as file:
        metadata = dict(file.metadata())
    for key in ("tensors", "metadata_sha256"):
        del metadata[key]
    arrays = {"/".join(map(str, var_path)): variable[...]
              for var_path, variable in nnx.to_flat_state(nnx.state(layer, nnx.Cache))}
    pieces.write_pieces(path, arrays, metadata)
    return path, tmp_path / "cache.safetensors.process-0-of-1"


def test_a_snapshot_in_pieces_round_trips_with_every_header_checksummed(tmp_path):
    layer = filled_layer()
    path, piece = saved_in_pieces(tmp_path, layer)
    assert snapshot_info(path).pieces == (piece.name,)
    with safetensors.safe_open(piece, "np") as file:
        assert file.metadata()["format_version"] == "2"
    target = make_layer()
    load_cache(target, path)
    assert_same_bits(cache_arrays(target), cache_arrays(layer))


def replace_once(path, old: bytes, new: bytes):
    data = path.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    path.write_bytes(data.replace(old, new))


def test_a_changed_byte_in_a_piece_index_is_refused(tmp_path):
    path, piece = saved_in_pieces(tmp_path, filled_layer())
    replace_once(piece, b'\\"tensor\\":\\"k_cache\\"', b'\\"tensor\\":\\"v_cache\\"')
    assert_refused_quickly(make_layer(), path, rf"{re.escape(str(piece))}: corrupted snapshot: its metadata fails")


def legacy_pieces_snapshot(path, layer, index, specs=None, keys=("k_cache#0.0",)):
    """A version 2 snapshot listing one hand-made piece file (no checksums then): its metadata holds `index`,
    its pieces under `keys` each the layer's whole `k_cache`."""
    whole = cache_arrays(layer)
    save_cache(layer, path)
    info = snapshot_info(path)
    name = f"{path.name}.process-0-of-1"
    safetensors.numpy.save_file({key: whole["k_cache"] for key in keys}, path.parent / name,
                                metadata={"format": "kvattn.cache_snapshot_pieces", "index": index})
    specs = specs or {k: {"dtype": a.dtype.name, "shape": list(a.shape)} for k, a in whole.items()}
    metadata = {"format": "kvattn.cache_snapshot", "format_version": "2", "config": json.dumps(info.config),
                "weights_fingerprint": info.weights_fingerprint, "pieces": json.dumps([name]),
                "tensors": json.dumps(specs)}
    safetensors.numpy.save_file({}, path, metadata=metadata)
    return path.parent / name


@pytest.mark.parametrize(
    "index, match",
    [
        ("{not json", r"metadata 'index' is not valid JSON"),
        ('{"k_cache#0.0": {"tensor": "k_cache", "sha256": "' + "0" * 64 + '"}}',
         r"index entry 'k_cache#0.0' must be \{\"tensor\": str, \"start\": \[int, ...\], \"sha256\": hex\}"),
        ('{"k_cache#0.0": {"tensor": "k_cache", "start": [0, 0, 0], "sha256": "' + "0" * 64 + '"}}',
         r"piece 'k_cache#0.0' is float32 \(3, 12, 2, 2\), which does not fit tensor 'k_cache' at \[0, 0, 0\]"),
    ],
    ids=["not_json", "no_start", "wrong_rank"],
)
def test_a_malformed_legacy_piece_index_is_a_snapshot_error_naming_the_piece_file(tmp_path, index, match):
    path = tmp_path / "cache.safetensors"
    piece = legacy_pieces_snapshot(path, filled_layer(), index)
    assert_refused_quickly(make_layer(), path, rf"{re.escape(str(piece))}: .*{match}")


def test_overlapping_pieces_are_refused_before_their_data_is_read(tmp_path, monkeypatch):
    path = tmp_path / "cache.safetensors"
    layer = filled_layer()
    checksum = files.sha256(cache_arrays(layer)["k_cache"])
    entry = {"tensor": "k_cache", "start": [0, 0, 0, 0], "sha256": checksum}
    keys = ("k_cache#0.0", "k_cache#0.1")
    legacy_pieces_snapshot(path, layer, json.dumps(dict.fromkeys(keys, entry)), keys=keys)
    monkeypatch.setattr(files, "read_tensors", None)  # any read of piece data fails the test
    assert_refused_quickly(make_layer(), path, r"the pieces of tensor 'k_cache' do not cover it exactly once: "
                                               r"piece 'k_cache#0.1' overlaps another")


def test_pieces_whose_specs_claim_a_huge_tensor_are_refused_before_anything_is_allocated(tmp_path):
    path = tmp_path / "cache.safetensors"
    layer = filled_layer()
    specs = {k: {"dtype": a.dtype.name, "shape": list(a.shape)} for k, a in cache_arrays(layer).items()}
    specs["k_cache"]["shape"] = [3, 1 << 27, 2, 2]  # 6 GiB of float32
    legacy_pieces_snapshot(path, layer, "{}", specs)
    (tmp_path / "cache.safetensors.process-0-of-1").unlink()  # nothing past the layer check may be read
    tracemalloc.start()
    try:
        assert_refused_quickly(
            make_layer(), path, r"tensor 'k_cache' is float32 \(3, 134217728, 2, 2\) in the snapshot, the layer expects"
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20
