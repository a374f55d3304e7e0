"""Snapshots of arrays that span processes, written in pieces, one file per process.

A layer whose arrays span several processes (JAX multi-controller) is saved
as *pieces*: each process writes one file beside the snapshot,
`{name}.process-{i}-of-{n}`, holding the shards it owns (replica 0 of each)
under keys `{tensor}#{process}.{number}`, with this string metadata:

  format           "kvattn.cache_snapshot_pieces"
  format_version   "2"
  index            JSON: piece key -> {"tensor", "start", "sha256"}: the
                   tensor it is part of, its first index there, and the
                   sha256 of its little-endian C-order bytes
  metadata_sha256  as in `kvattn.snapshots.files`

The snapshot file itself then holds no tensors: its metadata lists the
piece files. A load checks every piece file's header, and that the pieces
tile each tensor exactly once, before it reads any piece's data. Piece
files of cache snapshots before version 3 have neither format_version nor
metadata_sha256; they are still read, since every entry of their index is
cross-checked (its keys against the file's pieces, each piece's sha256
against its data, its place by the exact tiling).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import safetensors.numpy
from jax.experimental import multihost_utils

from kvattn.errors import SnapshotError
from kvattn.snapshots import atomic, files

__all__ = ["PIECES_FORMAT", "PIECES_FORMAT_VERSION", "piece_file_names", "read_pieces", "write_pieces"]

PIECES_FORMAT = "kvattn.cache_snapshot_pieces"
PIECES_FORMAT_VERSION = 2


PIECES_VERSIONS = {str(PIECES_FORMAT_VERSION): ("format", "format_version", "index", files.METADATA_CHECKSUM)}
LEGACY_PIECES_VERSIONS = {None: ("format", "index")}


def piece_file_names(path: Path, num_processes: int) -> list[str]:
    """The names of the piece files beside snapshot `path`, one per process."""
    return [f"{path.name}.process-{index}-of-{num_processes}" for index in range(num_processes)]


def write_pieces(path: Path, arrays: dict[str, jax.Array], metadata: dict) -> None:
    """Saves arrays that span processes: each writes the shards it owns, then process 0 the snapshot listing them.

    Every process calls it (it waits for all of them twice).

    Args:
      path: the snapshot file; the piece files go beside it.
      arrays: name -> `jax.Array`.
      metadata: the snapshot's metadata less `tensors`, `pieces` and the
        checksum, which this adds.
    """
    pieces, index = {}, {}
    for name, array in sorted(arrays.items()):
        for number, shard in enumerate(s for s in array.addressable_shards if s.replica_id == 0):
            data = np.asarray(shard.data)
            key = f"{name}#{jax.process_index()}.{number}"
            pieces[key] = data
            start = [part.start or 0 for part in shard.index]
            index[key] = {"tensor": name, "start": start, "sha256": files.sha256(data)}
    names = piece_file_names(path, jax.process_count())
    own = {"format": PIECES_FORMAT, "format_version": str(PIECES_FORMAT_VERSION), "index": files.dumps(index)}
    payload = safetensors.numpy.save(pieces, metadata=files.sealed(own))
    atomic.write_atomically(path.parent / names[jax.process_index()], payload)
    multihost_utils.sync_global_devices(f"kvattn.save_cache pieces {path}")
    if jax.process_index() == 0:
        specs = {name: {"dtype": np.dtype(a.dtype).name, "shape": list(a.shape)} for name, a in arrays.items()}
        listing = {**metadata, "tensors": files.dumps(specs), "pieces": files.dumps(names)}
        atomic.write_atomically(path, safetensors.numpy.save({}, metadata=files.sealed(listing)))
    multihost_utils.sync_global_devices(f"kvattn.save_cache done {path}")


def read_pieces(directory: Path, names: list[str], specs: dict, *, legacy: bool) -> dict[str, np.ndarray]:
    """Whole tensors from piece files: every header and the tiling checked before any data is read.

    Args:
      directory: where the piece files lie.
      names: the piece files' names.
      specs: tensor name -> {"dtype", "shape"}, already checked against
        the layer (this allocates the tensors they describe).
      legacy: the snapshot predates version 3, so its piece files carry no
        format_version nor metadata checksum.
    """
    covered = {name: np.zeros(spec["shape"], np.bool_) for name, spec in specs.items()}
    headers = {}
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise SnapshotError(f"corrupted snapshot: piece file {name!r} must be a name beside the snapshot")
        with files.opened(directory / name) as file:
            header = files.read_header(file)
            for key, (where, tensor, _) in _pieces(header, specs, legacy).items():
                if covered[tensor][where].any():
                    raise SnapshotError(
                        f"corrupted snapshot: the pieces of tensor {tensor!r} do not cover it exactly once: "
                        f"piece {key!r} overlaps another"
                    )
                covered[tensor][where] = True
        headers[name] = header
    for tensor, seen in covered.items():
        if not seen.all():
            raise SnapshotError(
                f"corrupted snapshot: the pieces of tensor {tensor!r} do not cover it exactly once "
                f"({int(seen.size - seen.sum())} elements missing)"
            )
    tensors = {name: np.zeros(spec["shape"], files.DTYPES_BY_NAME[spec["dtype"]]) for name, spec in specs.items()}
    for name in names:
        with files.opened(directory / name) as file:
            header = files.read_header(file)
            if header != headers[name]:
                raise SnapshotError("the piece file changed while it was read")
            places = _pieces(header, specs, legacy)
            for key, piece in files.read_tensors(file, header).items():
                where, tensor, checksum = places[key]
                if files.sha256(piece) != checksum:
                    raise SnapshotError(f"corrupted snapshot: piece {key!r} fails its checksum; the file was damaged")
                tensors[tensor][where] = piece
    return tensors


def _pieces(header: files.Header, specs: dict, legacy: bool) -> dict[str, tuple[tuple[slice, ...], str, str]]:
    """Piece key -> (its place in its tensor, the tensor's name, its sha256), from a piece file's checked header."""
    metadata = files.checked_metadata(
        header.metadata, PIECES_FORMAT, "snapshot piece file", LEGACY_PIECES_VERSIONS if legacy else PIECES_VERSIONS,
        reads=f"this kvattn reads version {PIECES_FORMAT_VERSION}",
    )
    index = files.loads_object(metadata, "index")
    if sorted(index) != sorted(header.entries):
        raise SnapshotError(
            f"corrupted snapshot: the file holds pieces {sorted(header.entries)}, its index lists {sorted(index)}"
        )
    places = {}
    for key, entry in index.items():
        valid = (
            isinstance(entry, dict)
            and sorted(entry) == ["sha256", "start", "tensor"]
            and isinstance(entry["tensor"], str)
            and isinstance(entry["start"], list)
            and all(type(start) is int and start >= 0 for start in entry["start"])
            and files.is_sha256(entry["sha256"])
        )
        if not valid:
            raise SnapshotError(
                f"corrupted snapshot: index entry {key!r} must be "
                f'{{"tensor": str, "start": [int, ...], "sha256": hex}}, got {repr(entry)[:200]}'
            )
        dtype, shape = header.entries[key]
        tensor, start = entry["tensor"], entry["start"]
        spec = specs.get(tensor)
        fits = (
            spec is not None
            and spec["dtype"] == dtype.name
            and len(start) == len(shape) == len(spec["shape"])
            and all(first + size <= dim for first, size, dim in zip(start, shape, spec["shape"], strict=True))
        )
        if not fits:
            raise SnapshotError(
                f"corrupted snapshot: piece {key!r} is {dtype.name} {shape}, "
                f"which does not fit tensor {tensor!r} at {start}"
            )
        where = tuple(slice(first, first + size) for first, size in zip(start, shape, strict=True))
        places[key] = (where, tensor, entry["sha256"])
    return places
