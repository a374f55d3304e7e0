"""The files of a cache snapshot: safetensors bytes, atomic writes, checksums, and per-process pieces.

`kvattn.snapshot` decides what a snapshot holds and checks it against a
layer; this module only moves bytes. A layer whose arrays span several
processes (JAX multi-controller) is saved as *pieces*: each process writes
one file beside the snapshot holding only the shards it owns (replica 0 of
each), each with its index in the global tensor and its sha256; the
snapshot file itself then holds the metadata and the list of piece files.
Reading assembles the pieces into whole tensors and checks that they cover
every element exactly once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

__all__ = [
    "HEADER_LENGTH_BYTES",
    "SnapshotError",
    "decode_tensors",
    "dumps",
    "header",
    "header_length",
    "is_sha256",
    "piece_file_names",
    "read_pieces",
    "sha256",
    "write_atomically",
    "write_own_pieces",
]

PIECES_FORMAT = "kvattn.cache_snapshot_pieces"
HEADER_LENGTH_BYTES = 8
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



class SnapshotError(ValueError):
    """A snapshot file cannot be loaded into this layer; the layer was not changed."""

    __module__ = "kvattn.snapshot"  # raised and documented there


def checked_metadata(header: dict, format_name: str, what: str, keys: tuple[str, ...]) -> dict:
    """A header's string metadata, after checking its format name and that every key holds a string."""
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or metadata.get("format") != format_name:
        found = metadata.get("format") if isinstance(metadata, dict) else None
        raise SnapshotError(f"not a kvattn {what}: expected format {format_name!r}, got {found!r}")
    missing = [key for key in keys if not isinstance(metadata.get(key), str)]
    if missing:
        raise SnapshotError(f"corrupted snapshot: metadata lacks {missing}; expected string entries {keys}")
    return metadata


def write_atomically(path: Path, payload: bytes) -> None:
    """Writes `payload` to a temporary file in `path`'s directory, then renames it onto `path`."""
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            write_and_sync(file, payload)
        os.replace(temp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_name)
        raise
    sync_directory(path.parent)


def write_and_sync(file, payload: bytes) -> None:
    file.write(payload)
    file.flush()
    os.fsync(file.fileno())


def sync_directory(directory: Path) -> None:
    """Makes the rename itself durable (POSIX; elsewhere a directory cannot be opened)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()).hexdigest()


def dumps(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def header_length(length_bytes: bytes, total_size: int) -> int:
    if len(length_bytes) < HEADER_LENGTH_BYTES:
        raise SnapshotError(f"not a safetensors file: {total_size} bytes, too short to hold a header")
    (length,) = struct.unpack("<Q", length_bytes[:HEADER_LENGTH_BYTES])
    if length > total_size - HEADER_LENGTH_BYTES:
        raise SnapshotError(
            f"truncated or corrupted file: its header claims {length} bytes, "
            f"but the file has only {total_size} bytes"
        )
    return length


def header(data: bytes, total_size: int) -> dict:
    """The safetensors JSON header at the start of `data` (which holds at least all of it)."""
    length = header_length(data[:HEADER_LENGTH_BYTES], total_size)
    raw = data[HEADER_LENGTH_BYTES : HEADER_LENGTH_BYTES + length]
    try:
        parsed = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise SnapshotError(f"corrupted file: the safetensors header is not valid JSON ({error})") from None
    if not isinstance(parsed, dict):
        raise SnapshotError(f"corrupted file: the safetensors header is a JSON {type(parsed).__name__}, not an object")
    return parsed


def is_sha256(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= SHA256


def decode_tensors(data: bytes) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file, structure checked by safetensors itself."""
    try:
        views = safetensors.deserialize(data)
    except safetensors.SafetensorError as error:
        raise SnapshotError(f"truncated or corrupted file: {error}") from None
    tensors = {}
    for name, view in views:
        dtype = NUMPY_DTYPES.get(view["dtype"])
        if dtype is None:
            raise SnapshotError(f"tensor {name!r} has unsupported dtype {view['dtype']}")
        tensors[name] = np.frombuffer(view["data"], dtype=dtype.newbyteorder("<")).reshape(view["shape"])
    return tensors


# -------------------------------------------------------------------- pieces


def piece_file_names(path: Path, num_processes: int) -> list[str]:
    """The names of the piece files beside snapshot `path`, one per process."""
    return [f"{path.name}.process-{index}-of-{num_processes}" for index in range(num_processes)]


def write_own_pieces(path: Path, arrays: dict[str, jax.Array]) -> None:
    """Writes, atomically, the shards this process owns of every array (`jax.Array`s spanning processes)."""
    pieces, index = {}, {}
    for name, array in sorted(arrays.items()):
        for number, shard in enumerate(s for s in array.addressable_shards if s.replica_id == 0):
            data = np.asarray(shard.data)
            start = [0 if part.start is None else part.start for part in shard.index]
            key = f"{name}#{jax.process_index()}.{number}"
            pieces[key] = data
            index[key] = {"tensor": name, "start": start, "sha256": sha256(data)}
    own = piece_file_names(path, jax.process_count())[jax.process_index()]
    metadata = {"format": PIECES_FORMAT, "index": dumps(index)}
    write_atomically(path.parent / own, safetensors.numpy.save(pieces, metadata=metadata))


def read_pieces(directory: Path, files: list[str], specs: dict) -> dict[str, np.ndarray]:
    """Whole tensors from piece files, after checking every checksum and that the pieces tile each tensor once."""
    tensors = {name: np.zeros(spec["shape"], np.dtype(spec["dtype"])) for name, spec in specs.items()}
    covered = {name: np.zeros(spec["shape"], np.int32) for name, spec in specs.items()}
    for file in files:
        if Path(file).name != file:
            raise SnapshotError(f"corrupted snapshot: piece file {file!r} must be a name beside the snapshot")
        data = (directory / file).read_bytes()
        metadata = header(data, len(data)).get("__metadata__") or {}
        if metadata.get("format") != PIECES_FORMAT or not isinstance(metadata.get("index"), str):
            raise SnapshotError(f"corrupted snapshot: {file} is not a kvattn snapshot piece file")
        index = json.loads(metadata["index"])
        pieces = decode_tensors(data)
        if sorted(pieces) != sorted(index):
            raise SnapshotError(f"corrupted snapshot: {file} holds pieces {sorted(pieces)}, its index {sorted(index)}")
        for key, piece in pieces.items():
            entry = index[key]
            name = entry.get("tensor")
            if name not in tensors or piece.dtype != tensors[name].dtype or len(entry["start"]) != piece.ndim:
                raise SnapshotError(f"corrupted snapshot: piece {key!r} in {file} does not fit any tensor")
            if entry.get("sha256") != sha256(piece):
                raise SnapshotError(f"corrupted snapshot: piece {key!r} in {file} fails its checksum")
            where = tuple(slice(start, start + size) for start, size in zip(entry["start"], piece.shape, strict=True))
            if any(s.start < 0 or s.stop > dim for s, dim in zip(where, tensors[name].shape, strict=True)):
                raise SnapshotError(f"corrupted snapshot: piece {key!r} in {file} lies outside tensor {name!r}")
            tensors[name][where] = piece
            covered[name][where] += 1
    for name, counts in covered.items():
        if not (counts == 1).all():
            raise SnapshotError(
                f"corrupted snapshot: the pieces of tensor {name!r} do not cover it exactly once "
                f"({int((counts == 0).sum())} elements missing, {int((counts > 1).sum())} written twice)"
            )
    return tensors
