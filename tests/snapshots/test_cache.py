"""Cache snapshots: exact round trips, every refusal, atomic writes, and a fuzz of load_cache."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvattn
from kvattn.errors import SnapshotError
from kvattn.snapshots import atomic, load_cache, save_cache, snapshot_info, weights_fingerprint
from tests.helpers import assert_same_bits, cache_arrays, replace_once

CONFIG = dict(num_heads=4, in_features=8, max_len=12, num_kv_heads=2, batch_size=3)
# What a snapshot of `make_layer()` records.
SAVED_CONFIG = dict(
    num_heads=4,
    num_kv_heads=2,
    head_dim=2,
    in_features=8,
    max_len=12,
    window=None,
    batch_size=3,
    cache_dtype="float32",
    cache_layout="slots_major",
    use_bias=True,
    qkv_features=8,
    out_features=8,
    dtype=None,
    param_dtype="float32",
    normalize_qk=False,
    qk_norm_eps=1e-6,
    logit_softcap=None,
    rope=None,
)
V1_FIELDS = ("num_heads", "num_kv_heads", "head_dim", "in_features", "max_len", "window", "batch_size",
             "cache_dtype", "cache_layout")


def make_layer(seed=0, **overrides):
    config = {**CONFIG, **overrides}
    return kvattn.MultiHeadAttention(
        config.pop("num_heads"), config.pop("in_features"), **config, rngs=nnx.Rngs(seed)
    )


def fill(layer, seed=1):
    """Puts a few tokens (ragged in a batch) into the layer's cache."""
    rng = np.random.default_rng(seed)
    lead = () if layer.batch_size is None else (layer.batch_size,)
    chunk = jnp.asarray(rng.standard_normal((*lead, 3, layer.in_features)), jnp.float32)
    lengths = None if layer.batch_size is None else jnp.arange(layer.batch_size, dtype=jnp.int32) % 4
    layer.prefill(chunk, lengths)
    layer.step(jnp.asarray(rng.standard_normal((*lead, layer.in_features)), jnp.float32))
    return layer


def read_snapshot(path) -> tuple[dict, dict]:
    """Tensors and metadata of a file, read with safetensors alone."""
    with safetensors.safe_open(path, framework="numpy") as file:
        return {name: file.get_tensor(name) for name in file.keys()}, dict(file.metadata())


def metadata_checksum(metadata: dict) -> str:
    """The documented `metadata_sha256`: over the canonical JSON of every other entry."""
    others = {key: value for key, value in metadata.items() if key != "metadata_sha256"}
    return hashlib.sha256(json.dumps(others, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_snapshot(path, tensors, metadata, refresh_tensor_specs=True, seal=True):
    """Writes a hand-made snapshot.

    By default its metadata's tensor specs and checksums match `tensors`, and
    its metadata checksum is recomputed (version 3) or left out (earlier
    versions, which had none), so that only the change a test makes is wrong.
    """
    metadata = dict(metadata)
    if refresh_tensor_specs:
        specs = {
            name: {
                "dtype": array.dtype.name,
                "shape": list(array.shape),
                "sha256": hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest(),
            }
            for name, array in tensors.items()
        }
        metadata["tensors"] = json.dumps(specs)
    metadata.pop("metadata_sha256", None)
    if seal and metadata.get("format_version") == "3":
        metadata["metadata_sha256"] = metadata_checksum(metadata)
    safetensors.numpy.save_file(tensors, path, metadata=metadata)


def assert_refused(layer, path, match, **kwargs):
    before = cache_arrays(layer)
    with pytest.raises(SnapshotError, match=match):
        load_cache(layer, path, **kwargs)
    assert_same_bits(cache_arrays(layer), before)


@pytest.fixture
def saved(tmp_path):
    """A filled batched layer, its snapshot path, and a fresh layer with the same weights."""
    layer = fill(make_layer())
    path = tmp_path / "cache.safetensors"
    save_cache(layer, path)
    return layer, path, make_layer()


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize(
    "overrides",
    [
        dict(batch_size=None),
        dict(cache_layout="heads_major"),
        dict(num_kv_heads=1, use_bias=False),
        dict(cache_dtype="int8", cache_layout="heads_major"),
        dict(batch_size=None, cache_dtype="bfloat16"),
        dict(max_len=None, window=2),
    ],
    ids=["unbatched", "heads_major_gqa", "mqa_no_bias", "int8", "bfloat16", "window"],
)
def test_round_trip_restores_the_cache_bit_for_bit_and_decoding_continues_identically(tmp_path, overrides):
    original = fill(make_layer(**overrides))
    path = tmp_path / "cache.safetensors"
    save_cache(original, path)
    restored = make_layer(**overrides)
    load_cache(restored, path)
    assert_same_bits(cache_arrays(restored), cache_arrays(original))

    lead = () if original.batch_size is None else (original.batch_size,)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((*lead, original.in_features)), jnp.float32)
    np.testing.assert_array_equal(restored.step(x), original.step(x))
    assert_same_bits(cache_arrays(restored), cache_arrays(original))


def test_loaded_arrays_keep_the_sharding_of_the_cache_they_replace(saved):
    layer, path, target = saved
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    by_sequence = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    # set_value replaces the array; `[...] =` would copy it into the old sharding.
    target.k_cache.set_value(jax.device_put(target.k_cache[...], by_sequence))
    load_cache(target, path)
    assert target.k_cache[...].sharding == by_sequence
    assert_same_bits(cache_arrays(target), cache_arrays(layer))


def test_save_leaves_the_layer_unchanged_and_writes_the_same_content_twice(tmp_path):
    layer = fill(make_layer())
    before = cache_arrays(layer)
    save_cache(layer, tmp_path / "a.safetensors")
    save_cache(layer, tmp_path / "b.safetensors")
    assert_same_bits(cache_arrays(layer), before)
    # Not the same bytes: safetensors orders metadata keys by a hash map.
    tensors_a, metadata_a = read_snapshot(tmp_path / "a.safetensors")
    tensors_b, metadata_b = read_snapshot(tmp_path / "b.safetensors")
    assert_same_bits(tensors_a, tensors_b)
    assert metadata_a == metadata_b


def test_file_holds_the_cache_and_documented_metadata(saved):
    layer, path, _ = saved
    tensors, metadata = read_snapshot(path)
    assert_same_bits(tensors, cache_arrays(layer))
    assert metadata["format"] == "kvattn.cache_snapshot" and metadata["format_version"] == "3"
    assert metadata["metadata_sha256"] == metadata_checksum(metadata)
    assert json.loads(metadata["config"]) == SAVED_CONFIG
    specs = json.loads(metadata["tensors"])
    for name, array in tensors.items():
        assert specs[name] == {
            "dtype": array.dtype.name,
            "shape": list(array.shape),
            "sha256": hashlib.sha256(array.tobytes()).hexdigest(),
        }
    assert metadata["weights_fingerprint"] == weights_fingerprint(layer)


def test_snapshot_info_reads_the_metadata_without_a_layer(saved):
    layer, path, _ = saved
    info = snapshot_info(path)
    assert info.format_version == 3
    assert info.config == SAVED_CONFIG
    assert {name: spec["shape"] for name, spec in info.tensors.items()} == {
        "k_cache": [3, 12, 2, 2],
        "v_cache": [3, 12, 2, 2],
        "pos": [3],
    }
    assert info.weights_fingerprint == weights_fingerprint(layer)


def test_snapshot_info_refuses_a_file_that_is_not_a_snapshot(tmp_path):
    path = tmp_path / "plain.safetensors"
    safetensors.numpy.save_file({"w": np.zeros(3, np.float32)}, path)
    with pytest.raises(SnapshotError, match="not a kvattn cache snapshot"):
        snapshot_info(path)
    path.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(SnapshotError, match="header claims 1000000 bytes"):
        snapshot_info(path)


# ------------------------------------------------------------ weights fingerprint


def test_weights_fingerprint_is_the_documented_hash():
    layer = make_layer()
    digest = hashlib.sha256()
    for path, variable in sorted(nnx.to_flat_state(nnx.state(layer, nnx.Param)), key=lambda item: item[0]):
        values = np.asarray(variable[...], dtype="<f4")
        digest.update(f"{'/'.join(path)}:{list(values.shape)}\n".encode())
        digest.update(values.tobytes())
    assert weights_fingerprint(layer) == digest.hexdigest()


def test_weights_fingerprint_follows_the_weights_not_the_cache():
    layer = make_layer()
    fingerprint = weights_fingerprint(layer)
    assert weights_fingerprint(fill(layer)) == fingerprint
    assert weights_fingerprint(make_layer(max_len=5, batch_size=None)) == fingerprint
    assert weights_fingerprint(make_layer(seed=1)) != fingerprint
    layer.out.bias[...] = layer.out.bias[...].at[3].add(1e-6)
    assert weights_fingerprint(layer) != fingerprint


# -------------------------------------------------------------------- refusals


@pytest.mark.parametrize("keep", [0, 7, 8, 100, -1], ids=lambda keep: f"keep{keep}")
def test_refuses_a_truncated_file(saved, keep):
    _, path, target = saved
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    assert_refused(target, path, "truncated|corrupted|too short")


def test_refuses_trailing_garbage(saved):
    _, path, target = saved
    path.write_bytes(path.read_bytes() + b"\0" * 8)
    assert_refused(target, path, "truncated or corrupted file")


def test_refuses_a_flipped_bit_in_the_tensor_data(saved):
    _, path, target = saved
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x10  # the last byte of the last tensor's data
    path.write_bytes(bytes(data))
    assert_refused(target, path, "fails its checksum")


def test_refuses_a_header_that_is_not_json(saved):
    _, path, target = saved
    data = bytearray(path.read_bytes())
    data[8] = ord("[")  # the opening brace of the header
    path.write_bytes(bytes(data))
    assert_refused(target, path, "header is not valid JSON")


def test_refuses_a_plain_safetensors_file(saved):
    layer, path, target = saved
    safetensors.numpy.save_file(cache_arrays(layer), path)
    assert_refused(target, path, "not a kvattn cache snapshot: expected format 'kvattn.cache_snapshot', got None")


def test_reads_a_version_1_snapshot_as_recording_the_defaults_of_later_fields(saved):
    """Version 1 predates the modern-attention options: its layers had all of them at their defaults."""
    layer, path, target = saved
    tensors, metadata = read_snapshot(path)
    v1_config = {field: SAVED_CONFIG[field] for field in V1_FIELDS}
    write_snapshot(path, tensors, {**metadata, "format_version": "1", "config": json.dumps(v1_config)})
    info = snapshot_info(path)
    assert info.format_version == 1 and info.config == SAVED_CONFIG
    load_cache(target, path)
    assert_same_bits(cache_arrays(target), cache_arrays(layer))
    rotary = make_layer(rope=kvattn.RoPE())
    assert_refused(rotary, path, r"rope=None \(layer has \{'theta': 10000.0")


def test_reads_a_version_2_snapshot_which_had_no_metadata_checksum(saved):
    """Its config, tensor specs and fingerprint are all compared with the layer and the data, as before."""
    layer, path, target = saved
    tensors, metadata = read_snapshot(path)
    write_snapshot(path, tensors, {**metadata, "format_version": "2"})
    assert "metadata_sha256" not in read_snapshot(path)[1]
    assert snapshot_info(path).format_version == 2
    load_cache(target, path)
    assert_same_bits(cache_arrays(target), cache_arrays(layer))


def test_refuses_another_format_version(saved):
    _, path, target = saved
    tensors, metadata = read_snapshot(path)
    write_snapshot(path, tensors, {**metadata, "format_version": "4"})
    assert_refused(target, path, "unsupported cache snapshot format_version '4'; this kvattn reads versions 1, 2 and 3")


@pytest.mark.parametrize(
    "old, new",
    [
        (b'\\"max_len\\":12', b'\\"max_len\\":13'),
        (b'\\"pos\\":{\\"dtype\\":\\"int32\\"', b'\\"pos\\":{\\"dtype\\":\\"int16\\"'),
        (b'"format_version":"3"', b'"format_version":"2"'),  # one bit: an old version would skip the checksum
        (b'"format":"kvattn.cache_snapshot"', b'"format":"kvattn.cache_snapshou"'),
    ],
    ids=["config", "tensors", "version", "format"],
)
def test_a_changed_byte_anywhere_in_the_metadata_fails_its_checksum(saved, old, new):
    _, path, target = saved
    replace_once(path, old, new)
    assert_refused(target, path, rf"{re.escape(str(path))}: corrupted snapshot: its metadata fails its checksum")
    with pytest.raises(SnapshotError, match="fails its checksum"):
        snapshot_info(path)


def test_a_version_3_snapshot_without_its_metadata_checksum_is_refused(saved):
    _, path, target = saved
    replace_once(path, b'"metadata_sha256"', b'"metadata_sha257"')  # the checksum's own key damaged
    assert_refused(target, path, r"metadata lacks \['metadata_sha256'\]")


@pytest.mark.parametrize("key", ["config", "tensors", "weights_fingerprint", "format_version", "metadata_sha256"])
def test_refuses_missing_metadata(saved, key):
    _, path, target = saved
    tensors, metadata = read_snapshot(path)
    del metadata[key]
    write_snapshot(path, tensors, metadata, refresh_tensor_specs=False, seal=key != "metadata_sha256")
    assert_refused(target, path, rf"metadata lacks \['{key}'\]")


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("config", "{not json", "'config' is not valid JSON"),
        ("config", "[1, 2]", "'config' must be a JSON object"),
        ("config", '{"max_len": 12}', "config has fields"),
        ("weights_fingerprint", "abc", "is not 64 lowercase hex digits"),
    ],
)
def test_refuses_malformed_metadata(saved, key, value, match):
    _, path, target = saved
    tensors, metadata = read_snapshot(path)
    write_snapshot(path, tensors, {**metadata, key: value})
    assert_refused(target, path, match)


def test_refuses_tensor_specs_that_disagree_with_the_data(saved):
    _, path, target = saved
    tensors, metadata = read_snapshot(path)
    specs = json.loads(metadata["tensors"])
    specs["pos"]["shape"] = [4]
    write_snapshot(path, tensors, {**metadata, "tensors": json.dumps(specs)}, refresh_tensor_specs=False)
    assert_refused(target, path, r"metadata says tensor 'pos' is int32 \(4,\), the file holds int32 \(3,\)")


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(max_len=16), r"max_len=16 \(layer has 12\)"),
        (dict(batch_size=2), r"batch_size=2 \(layer has 3\)"),
        (dict(batch_size=None), r"batch_size=None \(layer has 3\)"),
        (dict(cache_layout="heads_major"), r"cache_layout='heads_major' \(layer has 'slots_major'\)"),
        (dict(num_kv_heads=4), r"num_kv_heads=4 \(layer has 2\)"),
        (dict(head_dim=3), r"head_dim=3 \(layer has 2\)"),
        (dict(cache_dtype="bfloat16"), r"cache_dtype='bfloat16' \(layer has 'float32'\)"),
        (dict(max_len=None, window=12), r"max_len=None \(layer has 12\), window=12 \(layer has None\)"),
    ],
)
def test_refuses_a_differently_configured_layer(tmp_path, overrides, match):
    path = tmp_path / "cache.safetensors"
    save_cache(make_layer(**overrides), path)
    assert_refused(fill(make_layer()), path, "differently configured layer: " + match)


def test_refuses_a_config_that_matches_only_up_to_json_type(saved):
    _, path, target = saved
    tensors, metadata = read_snapshot(path)
    config = json.loads(metadata["config"])
    write_snapshot(path, tensors, {**metadata, "config": json.dumps({**config, "max_len": 12.0})})
    assert_refused(target, path, r"max_len=12.0 \(layer has 12\)")


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_refuses_missing_or_extra_tensors(saved, change):
    _, path, target = saved
    tensors, metadata = read_snapshot(path)
    if change == "missing":
        del tensors["v_cache"]
    else:
        tensors["scales"] = np.ones(3, np.float32)
    write_snapshot(path, tensors, metadata)
    assert_refused(target, path, r"snapshot holds tensors \[.*\], the layer's cache is \['k_cache', 'pos', 'v_cache'\]")


@pytest.mark.parametrize(
    "name, dtype, match",
    [
        ("pos", np.int64, r"'pos' is int64 \(3,\) in the snapshot, the layer expects int32 \(3,\)"),
        ("k_cache", np.float16, r"'k_cache' is float16 \(3, 12, 2, 2\) in the snapshot, the layer expects float32"),
    ],
)
def test_refuses_other_dtypes(saved, name, dtype, match):
    _, path, target = saved
    tensors, metadata = read_snapshot(path)
    tensors[name] = tensors[name].astype(dtype)
    write_snapshot(path, tensors, metadata)
    assert_refused(target, path, match)


def test_refuses_other_shapes_under_a_matching_config(saved):
    _, path, target = saved
    tensors, metadata = read_snapshot(path)
    tensors["v_cache"] = np.zeros((3, 13, 2, 2), np.float32)
    write_snapshot(path, tensors, metadata)
    assert_refused(
        target, path, r"'v_cache' is float32 \(3, 13, 2, 2\) in the snapshot, the layer expects float32 \(3, 12, 2, 2\)"
    )


@pytest.mark.parametrize("bad_pos", [-1, 13], ids=["negative", "past_max_len"])
def test_refuses_pos_out_of_range(saved, bad_pos):
    _, path, target = saved
    tensors, metadata = read_snapshot(path)
    tensors["pos"] = np.array([0, bad_pos, 2], np.int32)
    write_snapshot(path, tensors, metadata)
    assert_refused(target, path, rf"pos must lie in \[0, max_len=12\], got \[{bad_pos}\] at sequences \[1\]")


def test_a_windowed_layer_accepts_any_non_negative_pos(tmp_path):
    layer = fill(make_layer(max_len=None, window=2))
    path = tmp_path / "cache.safetensors"
    save_cache(layer, path)
    tensors, metadata = read_snapshot(path)
    # Sequence 2 fills its whole ring, so any later position fits its slots.
    assert np.asarray(tensors["pos"]).tolist() == [1, 2, 3]
    tensors["pos"] = np.array([1, 2, 1000], np.int32)
    write_snapshot(path, tensors, metadata)
    target = make_layer(max_len=None, window=2)
    load_cache(target, path)
    assert np.asarray(target.pos[...]).tolist() == [1, 2, 1000]
    tensors["pos"] = np.array([1, -2, 1000], np.int32)
    write_snapshot(path, tensors, metadata)
    assert_refused(target, path, r"pos must be >= 0, got \[-2\] at sequences \[1\]")


def test_refuses_a_cache_filled_by_other_weights_unless_allowed(saved):
    layer, path, _ = saved
    stranger = make_layer(seed=5)
    assert_refused(stranger, path, "filled by other weights.*allow_weight_mismatch=True")
    load_cache(stranger, path, allow_weight_mismatch=True)
    assert_same_bits(cache_arrays(stranger), cache_arrays(layer))


def test_a_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_cache(make_layer(), tmp_path / "absent.safetensors")


# --------------------------------------------------------------- atomic writes


def _half_then_fail(file, payload):
    file.write(payload[: len(payload) // 2])
    file.flush()
    raise OSError("disk full")


@pytest.mark.parametrize("earlier_file", [False, True], ids=["fresh", "overwrite"])
@pytest.mark.parametrize("failure", ["mid_write", "fsync", "replace", "interrupt"])
def test_a_failed_save_leaves_no_partial_file(tmp_path, monkeypatch, earlier_file, failure):
    path = tmp_path / "cache.safetensors"
    if earlier_file:
        save_cache(make_layer(), path)
    earlier = path.read_bytes() if earlier_file else None

    def interrupt(*args):
        raise KeyboardInterrupt

    def fail(*args):
        raise OSError("simulated failure")

    layer = fill(make_layer())
    if failure == "mid_write":
        monkeypatch.setattr(atomic, "write_and_sync", _half_then_fail)
    elif failure == "fsync":
        monkeypatch.setattr(atomic.os, "fsync", fail)
    elif failure == "replace":
        monkeypatch.setattr(atomic.os, "replace", fail)
    else:
        monkeypatch.setattr(atomic, "write_and_sync", interrupt)
    with pytest.raises(KeyboardInterrupt if failure == "interrupt" else OSError):
        save_cache(layer, path)
    monkeypatch.undo()

    assert os.listdir(tmp_path) == (["cache.safetensors"] if earlier_file else [])
    if earlier_file:
        assert path.read_bytes() == earlier


def test_a_save_replaces_an_earlier_snapshot(tmp_path):
    path = tmp_path / "cache.safetensors"
    save_cache(make_layer(), path)
    layer = fill(make_layer())
    save_cache(layer, path)
    assert os.listdir(tmp_path) == ["cache.safetensors"]
    target = make_layer()
    load_cache(target, path)
    assert_same_bits(cache_arrays(target), cache_arrays(layer))


# ------------------------------------------------------------------------ fuzz


@pytest.fixture(scope="module")
def fuzz_subject(tmp_path_factory):
    """The bytes of a snapshot, the cache they hold, a same-weights layer to load into, and a scratch path."""
    layer = fill(make_layer())
    path = tmp_path_factory.mktemp("fuzz") / "cache.safetensors"
    save_cache(layer, path)
    return path.read_bytes(), cache_arrays(layer), make_layer(), path


def _split(data: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _join(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


@st.composite
def flipped_bits(draw, data, start=0):
    """1 to 4 bits flipped at offsets from `start` on."""
    mutated = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        mutated[draw(st.integers(start, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
    return bytes(mutated)


@st.composite
def truncated_or_extended(draw, data):
    cut = draw(st.integers(0, len(data)))
    return data[:cut] + draw(st.binary(max_size=16))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-20, 20) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def edited_metadata(draw, data):
    """A well-formed safetensors file whose kvattn metadata was edited (keys, values, nested JSON), resealed or not."""
    header, body = _split(data)
    metadata = header["__metadata__"]
    key = draw(st.sampled_from(sorted(metadata) + ["extra"]))
    action = draw(st.sampled_from(["delete", "text", "edit_json"]))
    if action == "delete":
        metadata.pop(key, None)
    elif action == "text" or key not in ("config", "tensors"):
        metadata[key] = draw(st.text(max_size=70))
    else:
        nested = json.loads(metadata[key])
        field = draw(st.sampled_from(sorted(nested) + ["extra"]))
        if key == "tensors" and field in nested and draw(st.booleans()):
            nested[field][draw(st.sampled_from(["dtype", "shape", "sha256"]))] = draw(JSON_VALUES)
        else:
            nested[field] = draw(JSON_VALUES)
        metadata[key] = json.dumps(nested)
    if key != "metadata_sha256" and "metadata_sha256" in metadata and draw(st.booleans()):
        metadata["metadata_sha256"] = metadata_checksum(metadata)  # so the checks past the checksum are fuzzed too
    return _join(header, body)


@st.composite
def edited_tensor_header(draw, data):
    """A tensor entry of the safetensors header itself changed: dtype, shape or offsets."""
    header, body = _split(data)
    name = draw(st.sampled_from(["k_cache", "v_cache", "pos"]))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
    if field == "dtype":
        header[name]["dtype"] = draw(st.sampled_from(["F16", "F32", "F64", "I32", "I64", "U8", "BF16", "X"]))
    else:
        header[name][field] = draw(st.lists(st.integers(-2, 2000), max_size=4))
    return _join(header, body)


def mutations(data):
    tensor_data_start = 8 + struct.unpack("<Q", data[:8])[0]
    return st.one_of(
        flipped_bits(data),
        flipped_bits(data, start=tensor_data_start),
        truncated_or_extended(data),
        edited_metadata(data),
        edited_tensor_header(data),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_load_cache_refuses_cleanly_or_round_trips_exactly(fuzz_subject, data):
    original, saved_cache, target, path = fuzz_subject
    path.write_bytes(data.draw(mutations(original)))
    target.reset()
    before = cache_arrays(target)
    try:
        load_cache(target, path)
    except SnapshotError:
        assert_same_bits(cache_arrays(target), before)
    else:
        assert_same_bits(cache_arrays(target), saved_cache)
