"""One paged sequence on disk: saved and restored into another pool, and every bad file refused with nothing changed."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import kvattn
from kvattn.paging import OutOfPagesError, PageManager
from tests.helpers import BATCH, CHUNK, IN_FEATURES, manager_for, replace_once
from tests.helpers import paged_layers as layers
from tests.helpers import random_tokens as tokens


# ------------------------------------------------------------------ sequence snapshots


def test_a_saved_sequence_continues_in_another_pool(tmp_path):
    """Saved from a sequences-major pool of 8-token pages, loaded into a heads-major one of 1-token pages: same steps."""
    source, _ = layers(8, num_pages=16)
    target, _ = layers(1, num_pages=33, cache_layout="heads_major")
    rng = np.random.default_rng(5)
    managers = [manager_for(source), manager_for(target)]
    seq = managers[0].add()
    counts = np.zeros(BATCH, np.int32)
    counts[seq] = CHUNK
    source.prefill(tokens(rng, BATCH, CHUNK), jnp.asarray(counts), pages=managers[0].reserve(counts))
    path = tmp_path / "sequence.safetensors"
    kvattn.save_sequence(source, managers[0], seq, path, tokens=[7, 8, 9])
    managers[1].add()  # the restored sequence lands in another sequence
    restored, recorded = kvattn.load_sequence(target, managers[1], path)
    assert restored == 1 and recorded == [7, 8, 9] and managers[1].pos[restored] == CHUNK
    managers[1].check()
    x = jnp.broadcast_to(tokens(rng, 1), (BATCH, IN_FEATURES))  # the same token in every row
    for layer, manager, row in ((source, managers[0], seq), (target, managers[1], restored)):
        counts = np.zeros(BATCH, np.int32)
        counts[row] = 1
        got = layer.step(x, jnp.asarray(counts > 0), pages=manager.reserve(counts))
        if layer is source:
            want = got[row]
        else:
            np.testing.assert_allclose(got[row], want, rtol=1e-5, atol=1e-6)


def test_a_bad_sequence_snapshot_changes_nothing(tmp_path):
    source, _ = layers(8, num_pages=16)
    manager = manager_for(source)
    seq = manager.add()
    counts = np.zeros(BATCH, np.int32)
    counts[seq] = 2
    source.prefill(tokens(np.random.default_rng(6), BATCH, CHUNK), jnp.asarray(counts), pages=manager.reserve(counts))
    path = tmp_path / "sequence.safetensors"
    kvattn.save_sequence(source, manager, seq, path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # a flipped bit in the last tensor
    path.write_bytes(bytes(data))
    def state():
        return (manager.refcount.copy(), manager.tables.copy(), manager.live.copy(), manager.num_free,
                np.asarray(source.k_pages[...]))

    before = state()
    with pytest.raises(kvattn.SnapshotError, match="sha256|checksum"):
        kvattn.load_sequence(source, manager, path)
    kvattn.save_sequence(source, manager, seq, path)
    other = PageManager(16, 4, BATCH, 4)
    with pytest.raises(ValueError, match="is not layer"):
        kvattn.load_sequence(source, other, path)  # a manager of another pool
    for _ in range(BATCH - 1):
        manager.add()
    with pytest.raises(OutOfPagesError, match="free sequence"):
        kvattn.load_sequence(source, manager, path)
    for b in range(1, BATCH):
        manager.free(b)
    with pytest.raises(ValueError, match="save_sequence"):
        kvattn.save_cache(source, tmp_path / "pool.safetensors")
    for got, want in zip(state(), before, strict=True):
        np.testing.assert_array_equal(got, want)


def saved_sequence(tmp_path, token_ids=(7, 8)):
    """A paged layer, a manager holding a 2-token sequence, and the path of its snapshot."""
    layer, _ = layers(8, num_pages=16)
    manager = manager_for(layer)
    seq = manager.add()
    counts = np.zeros(BATCH, np.int32)
    counts[seq] = 2
    layer.prefill(tokens(np.random.default_rng(6), BATCH, CHUNK), jnp.asarray(counts), pages=manager.reserve(counts))
    path = tmp_path / "sequence.safetensors"
    kvattn.save_sequence(layer, manager, seq, path, tokens=token_ids)
    return layer, manager, path


@pytest.mark.parametrize(
    "old, new",
    [
        (b'"tokens":"[7,8]"', b'"tokens":"[6,8]"'),  # one bit: another prompt's ids for these keys and values
        (b'"length":"2"', b'"length":"3"'),
        (b'\\"num_kv_heads\\":2', b'\\"num_kv_heads\\":3'),
        (b'\\"k\\":{\\"dtype\\":\\"float32\\"', b'\\"k\\":{\\"dtype\\":\\"float16\\"'),
    ],
    ids=["tokens", "length", "config", "tensors"],
)
def test_a_changed_byte_in_a_sequence_snapshots_metadata_fails_its_checksum(tmp_path, old, new):
    import re

    layer, manager, path = saved_sequence(tmp_path)
    replace_once(path, old, new)
    live = manager.live.copy()
    match = rf"{re.escape(str(path))}: corrupted snapshot: its metadata fails its checksum"
    with pytest.raises(kvattn.SnapshotError, match=match):
        kvattn.load_sequence(layer, manager, path)
    np.testing.assert_array_equal(manager.live, live)


def test_a_version_1_sequence_snapshot_is_refused_with_what_to_do(tmp_path):
    """Version 1 checksummed only the tensors: its token ids could not be trusted, so it must be saved again."""
    import safetensors.numpy

    layer, manager, path = saved_sequence(tmp_path)
    with safetensors.safe_open(path, "np") as file:
        tensors, metadata = {name: file.get_tensor(name) for name in file.keys()}, dict(file.metadata())
    del metadata["metadata_sha256"]
    safetensors.numpy.save_file(tensors, path, metadata={**metadata, "format_version": "1"})
    with pytest.raises(kvattn.SnapshotError, match="format_version '1'.*save the sequence again with save_sequence"):
        kvattn.load_sequence(layer, manager, path)


@pytest.mark.parametrize("kind", ["sparse", "dev_zero"])
def test_a_huge_or_endless_file_is_refused_as_a_sequence_snapshot_from_its_header(tmp_path, kind):
    import time

    layer, _ = layers(8, num_pages=16)
    path = "/dev/zero" if kind == "dev_zero" else tmp_path / "huge.safetensors"
    if kind == "sparse":
        with open(path, "wb") as file:
            file.truncate(5 << 30)  # 5 GiB of zeros, sparse: no disk used
    start = time.perf_counter()
    with pytest.raises(kvattn.SnapshotError, match="header is not valid JSON|not a regular file"):
        kvattn.load_sequence(layer, manager_for(layer), path)
    assert time.perf_counter() - start < 2
