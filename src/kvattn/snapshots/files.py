"""The files of a snapshot: bounded reads and checksummed metadata.

`kvattn.snapshots.cache` (a layer's cache) and `kvattn.snapshots.sequence`
(one paged sequence) decide what a snapshot holds and check it against
layers; this module moves the bytes and checks everything that needs no
layer.

A snapshot is a safetensors file: an 8-byte little-endian header length,
a JSON header (each tensor's dtype, shape and data offsets, and a
`__metadata__` object of strings), then the tensor data. A load trusts
nothing before it is checked, and reads in this order:

1. Only a regular file is opened for reading (not `/dev/zero`, a pipe or a
   directory), and first only its header: at most `MAX_HEADER_BYTES`
   (safetensors' own bound) and within the file's size from `fstat`.
2. `metadata_sha256`, the sha256 of the canonical JSON (`dumps`: sorted
   keys, no spaces) of every other metadata entry, is verified before
   anything else in the metadata is used, so one flipped bit anywhere in
   it (token ids, lengths, configs, tensor specs, piece indices) is caught.
3. The caller compares the metadata with its layers: configuration, then
   every tensor's dtype and shape, which bounds what the file may hold.
4. Only then is the file's size compared with what its header describes,
   and the data read and checked against the metadata's checksums.

Every `SnapshotError` raised while a file is open names the file.

Writes are atomic: `kvattn.snapshots.atomic`.

Snapshots of arrays that span processes are written in pieces:
`kvattn.snapshots.pieces`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import stat
import struct
from collections.abc import Iterator
from typing import BinaryIO

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from kvattn.errors import SnapshotError

__all__ = [
    "MAX_HEADER_BYTES",
    "METADATA_CHECKSUM",
    "Header",
    "check_entries_match_specs",
    "check_tensors_match_specs",
    "check_weights",
    "checked_fingerprint",
    "checked_metadata",
    "dumps",
    "is_sha256",
    "loads_object",
    "metadata_checksum",
    "opened",
    "read_header",
    "read_tensors",
    "sealed",
    "sha256",
    "tensor_spec",
    "tensor_specs",
]

METADATA_CHECKSUM = "metadata_sha256"
HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100_000_000
SHA256 = frozenset("0123456789abcdef")

# The safetensors dtype codes of every NumPy dtype a cache may hold.
NUMPY_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "F32": np.dtype(np.float32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F64": np.dtype(np.float64),
}
DTYPES_BY_NAME = {dtype.name: dtype for dtype in NUMPY_DTYPES.values()}




# -------------------------------------------------------------------- writing


def dumps(value) -> str:
    """The canonical JSON of a metadata entry: sorted keys, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()).hexdigest()


def tensor_spec(array: np.ndarray) -> dict:
    return {"dtype": array.dtype.name, "shape": list(array.shape), "sha256": sha256(array)}


def metadata_checksum(metadata: dict) -> str:
    """The sha256 of the canonical JSON of every metadata entry but `metadata_sha256` itself."""
    others = {key: value for key, value in metadata.items() if key != METADATA_CHECKSUM}
    return hashlib.sha256(dumps(others).encode()).hexdigest()


def sealed(metadata: dict) -> dict:
    """`metadata` with its `metadata_sha256`."""
    return {**metadata, METADATA_CHECKSUM: metadata_checksum(metadata)}


# -------------------------------------------------------------------- reading


@contextlib.contextmanager
def opened(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """`path` open for reading if it is a regular file; a `SnapshotError` raised inside names the file."""
    try:
        # O_NONBLOCK: opening a pipe must not wait for a writer before it can be refused.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise SnapshotError("not a regular file; a snapshot is a file that kvattn wrote")
        with os.fdopen(fd, "rb") as file:
            yield file
    except SnapshotError as error:
        raise SnapshotError(f"{os.fspath(path)}: {error}") from None


@dataclasses.dataclass(frozen=True)
class Header:
    """A safetensors file's header, read with its data left unread."""

    raw: bytes
    """The length prefix and the JSON, as in the file."""
    metadata: object
    """The `__metadata__` entry as found (None if absent); `checked_metadata` checks it."""
    entries: dict
    """Tensor name -> (NumPy dtype, shape), as the header describes the data."""
    file_size: int

    @property
    def data_size(self) -> int:
        return sum(dtype.itemsize * math.prod(shape) for dtype, shape in self.entries.values())


def read_header(file: BinaryIO) -> Header:
    """The header at the start of an `opened` file, read after bounding its length; the data is not read."""
    file_size = os.fstat(file.fileno()).st_size
    file.seek(0)
    length_bytes = file.read(HEADER_LENGTH_BYTES)
    if len(length_bytes) < HEADER_LENGTH_BYTES:
        raise SnapshotError(f"not a safetensors file: {file_size} bytes, too short to hold a header")
    (length,) = struct.unpack("<Q", length_bytes)
    if length > MAX_HEADER_BYTES:
        raise SnapshotError(
            f"not a safetensors file: its header claims {length} bytes, "
            f"more than the {MAX_HEADER_BYTES} a header may have"
        )
    if length > file_size - HEADER_LENGTH_BYTES:
        raise SnapshotError(
            f"truncated or corrupted file: its header claims {length} bytes, but the file has only {file_size} bytes"
        )
    raw = file.read(length)
    if len(raw) != length:
        raise SnapshotError(f"truncated file: it ended {len(raw)} bytes into its {length}-byte header")
    try:
        parsed = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise SnapshotError(f"corrupted file: the safetensors header is not valid JSON ({error})") from None
    if not isinstance(parsed, dict):
        raise SnapshotError(f"corrupted file: the safetensors header is a JSON {type(parsed).__name__}, not an object")
    entries = {name: _entry(name, entry) for name, entry in parsed.items() if name != "__metadata__"}
    return Header(length_bytes + raw, parsed.get("__metadata__"), entries, file_size)


def _entry(name: str, entry) -> tuple[np.dtype, tuple[int, ...]]:
    valid = (
        isinstance(entry, dict)
        and isinstance(entry.get("dtype"), str)
        and isinstance(entry.get("shape"), list)
        and all(type(size) is int and size >= 0 for size in entry["shape"])
    )
    if not valid:
        raise SnapshotError(
            f'corrupted file: the header\'s entry for tensor {name!r} must be {{"dtype": str, "shape": [int, ...], '
            f'"data_offsets": [int, int]}}, got {repr(entry)[:200]}'
        )
    dtype = NUMPY_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise SnapshotError(f"tensor {name!r} has unsupported dtype {entry['dtype']}")
    return dtype, tuple(entry["shape"])


def read_tensors(file: BinaryIO, header: Header) -> dict[str, np.ndarray]:
    """The tensors of an `opened` file, read only once its size is exactly what its header describes.

    Call it after checking `header.entries` (their dtypes and shapes bound
    what is read); safetensors itself then checks the data offsets.
    """
    expected = len(header.raw) + header.data_size
    if header.file_size != expected:
        raise SnapshotError(
            f"truncated or corrupted file: its header describes {expected} bytes, the file has {header.file_size}"
        )
    file.seek(len(header.raw))
    data = file.read(header.data_size)
    if len(data) != header.data_size:
        raise SnapshotError(f"truncated file: it ended {len(data)} bytes into its {header.data_size} bytes of data")
    try:
        views = safetensors.deserialize(header.raw + data)
    except safetensors.SafetensorError as error:
        raise SnapshotError(f"truncated or corrupted file: {error}") from None
    return {
        name: np.frombuffer(view["data"], dtype=header.entries[name][0].newbyteorder("<")).reshape(view["shape"])
        for name, view in views
    }


def checked_metadata(metadata, format_name: str, what: str, versions: dict, reads: str) -> dict:
    """A header's metadata, its checksum verified before anything in it is used.

    Args:
      metadata: `Header.metadata`.
      format_name: the `format` entry it must hold.
      what: what the file is, for messages ("cache snapshot").
      versions: each `format_version` this kvattn reads -> the string
        entries that version must hold (key None: files without a
        format_version).
      reads: what to tell the user of a file of another version.

    Returns:
      The metadata, every entry of its version present.
    """
    if not isinstance(metadata, dict):
        raise SnapshotError(f"not a kvattn {what}: expected format {format_name!r}, got None")
    if METADATA_CHECKSUM in metadata and metadata[METADATA_CHECKSUM] != metadata_checksum(metadata):
        raise SnapshotError(
            f"corrupted snapshot: its metadata fails its checksum (sha256 {metadata_checksum(metadata)}, expected "
            f"{metadata[METADATA_CHECKSUM]!r}); the file was damaged after it was written"
        )
    if metadata.get("format") != format_name:
        raise SnapshotError(f"not a kvattn {what}: expected format {format_name!r}, got {metadata.get('format')!r}")
    version = metadata.get("format_version")
    if not isinstance(version, str) and not (version is None and None in versions):
        raise SnapshotError("corrupted snapshot: metadata lacks ['format_version']")
    if version not in versions:
        raise SnapshotError(f"unsupported {what} format_version {version!r}; {reads}")
    missing = [key for key in versions[version] if not isinstance(metadata.get(key), str)]
    if missing:
        raise SnapshotError(
            f"corrupted snapshot: metadata lacks {missing}; expected string entries {versions[version]}"
        )
    return metadata


def loads_object(metadata: dict, key: str) -> dict:
    """A metadata entry that holds a JSON object."""
    try:
        value = json.loads(metadata[key])
    except (ValueError, RecursionError):
        raise SnapshotError(
            f"corrupted snapshot: metadata {key!r} is not valid JSON: {metadata[key][:200]!r}"
        ) from None
    if not isinstance(value, dict):
        raise SnapshotError(f"corrupted snapshot: metadata {key!r} must be a JSON object, got {metadata[key][:200]!r}")
    return value


def tensor_specs(metadata: dict, checksummed: bool = True) -> dict:
    """The metadata's `tensors`: name -> {"dtype", "shape"} and, when `checksummed`, "sha256"; each checked."""
    specs = loads_object(metadata, "tensors")
    keys = ["dtype", "sha256", "shape"] if checksummed else ["dtype", "shape"]
    for name, spec in specs.items():
        valid = (
            isinstance(spec, dict)
            and sorted(spec) == keys
            and isinstance(spec["dtype"], str)
            and spec["dtype"] in DTYPES_BY_NAME
            and isinstance(spec["shape"], list)
            and all(type(size) is int and size >= 0 for size in spec["shape"])
            and (not checksummed or is_sha256(spec["sha256"]))
        )
        if not valid:
            expected = '"dtype": str, "shape": [int, ...]' + (', "sha256": hex' if checksummed else "")
            raise SnapshotError(
                f"corrupted snapshot: metadata for tensor {name!r} must be {{{expected}}}, got {repr(spec)[:200]}"
            )
    return specs


def checked_fingerprint(metadata: dict) -> str:
    fingerprint = metadata["weights_fingerprint"]
    if not is_sha256(fingerprint):
        raise SnapshotError(f"corrupted snapshot: weights_fingerprint {fingerprint!r} is not 64 lowercase hex digits")
    return fingerprint


def is_sha256(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= SHA256


def check_entries_match_specs(header: Header, specs: dict) -> None:
    """The header describes exactly the tensors the metadata lists (no data read yet)."""
    if sorted(header.entries) != sorted(specs):
        raise SnapshotError(
            f"corrupted snapshot: its metadata lists tensors {sorted(specs)} in the file, which holds "
            f"{sorted(header.entries)}"
        )
    for name, (dtype, shape) in sorted(header.entries.items()):
        spec = specs[name]
        if spec["dtype"] != dtype.name or tuple(spec["shape"]) != shape:
            raise SnapshotError(
                f"corrupted snapshot: metadata says tensor {name!r} is {spec['dtype']} {tuple(spec['shape'])}, "
                f"the file holds {dtype.name} {shape}"
            )


def check_tensors_match_specs(tensors: dict[str, np.ndarray], specs: dict) -> None:
    """The tensors read are exactly those the metadata lists, bit for bit (the checksums)."""
    if sorted(tensors) != sorted(specs):
        raise SnapshotError(
            f"corrupted snapshot: metadata lists tensors {sorted(specs)}, the file holds {sorted(tensors)}"
        )
    for name, array in sorted(tensors.items()):
        spec = specs[name]
        if spec["dtype"] != array.dtype.name or spec["shape"] != list(array.shape):
            raise SnapshotError(
                f"corrupted snapshot: metadata says tensor {name!r} is {spec['dtype']} {tuple(spec['shape'])}, "
                f"the file holds {array.dtype.name} {array.shape}"
            )
        if spec["sha256"] != sha256(array):
            raise SnapshotError(
                f"corrupted snapshot: tensor {name!r} fails its checksum (sha256 {sha256(array)}, "
                f"expected {spec['sha256']}); the file was damaged after it was written"
            )


def check_weights(saved: str, current: str) -> None:
    if saved != current:
        raise SnapshotError(
            f"snapshot was filled by other weights: fingerprint {saved} in the file, {current} for this "
            "layer, so its keys and values do not belong to these weights. Recompute the cache, or pass "
            "allow_weight_mismatch=True to load it anyway."
        )
