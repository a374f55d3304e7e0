"""A layer's or a model's KV cache on disk: save it, load it back, refuse anything else.

A snapshot is a safetensors file (no pickle) holding the layer's `nnx.Cache`
variables under their attribute paths (the names its cache type gives them,
`kvattn.caches.base.CacheType.variables`, prefixed with the layer's path,
`blocks/0/attention/...`, in a module holding several layers) and, in the safetensors string metadata:

  format               "kvattn.cache_snapshot"
  format_version       "3"
  config               JSON: the saving layer's recorded configuration
                       (`AttentionConfig.recorded()`), or
                       {"layers": {path: configuration}}
  tensors              JSON: name -> {"dtype", "shape", "sha256"}, where
                       sha256 is taken over the tensor's little-endian
                       C-order bytes, so flipped bits in the data are caught
  weights_fingerprint  `weights_fingerprint` of the layer that filled the cache
  pieces               only when several processes saved it: JSON, the list
                       of piece files beside it that hold the tensors (then
                       the file holds none, and `tensors` no sha256: each
                       piece carries its own; see `kvattn.snapshots.pieces`)
  metadata_sha256      sha256 of the canonical JSON of every other entry
                       (`kvattn.snapshots.files.metadata_checksum`)

`kvattn.snapshots.files` documents how a file is read: its header alone, and
its metadata checked against its checksum and the layer, before any tensor
data is read or allocated.

Versions 1 and 2, which had no `metadata_sha256`, are still read: every
entry a load trusts in them is cross-checked anyway (the config and every
tensor's dtype and shape against the layer, the tensors against their
checksums, the fingerprint against the weights). Version 1 also predates
the options recorded since (`kvattn.snapshots.recorded`).

A cache is only meaningful for the weights that produced its keys and values,
so loading refuses a snapshot taken under other weights unless asked not to.
Comparing `weights_fingerprint(layer)` with `snapshot_info(path)` is the cheap
way to tell, without loading, whether a snapshot is still valid for a layer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import jax
import numpy as np
import safetensors.numpy
from flax import nnx

from kvattn.errors import SnapshotError
from kvattn.layer.attention import MultiHeadAttention
from kvattn.snapshots import atomic, files, pieces, recorded
from kvattn.validation import host

__all__ = [
    "SnapshotInfo", "attention_layers", "load_cache", "save_cache", "snapshot_info",
    "weights_fingerprint",
]

FORMAT_NAME = "kvattn.cache_snapshot"
FORMAT_VERSION = 3
_METADATA_KEYS = ("format", "format_version", "config", "tensors", "weights_fingerprint")
# Each version this kvattn reads -> the metadata it must hold (versions 1 and 2 had no checksum).
_VERSIONS = {"1": _METADATA_KEYS, "2": _METADATA_KEYS, str(FORMAT_VERSION): (*_METADATA_KEYS, files.METADATA_CHECKSUM)}

@dataclasses.dataclass(frozen=True)
class SnapshotInfo:
    """What a snapshot's metadata says about it (read without a layer)."""

    format_version: int
    config: dict
    """The saving layer's configuration, keyed by `kvattn.snapshots.recorded.CONFIG_FIELDS`."""
    tensors: dict
    """Tensor name -> {"dtype": str, "shape": list[int], "sha256": str}."""
    weights_fingerprint: str
    """`weights_fingerprint` of the layer whose cache was saved."""
    pieces: tuple[str, ...] = ()
    """The per-process piece files beside the snapshot, when several processes saved it."""


# ---------------------------------------------------------------------- public


def weights_fingerprint(layer: nnx.Module) -> str:
    """A hex sha256 of the layer's weights: the cheap check that a snapshot still fits them.

    Hashes, in sorted path order, each `nnx.Param` leaf's path (`query/kernel`),
    its shape, and its values as little-endian float32 bytes. Equal weights
    give equal fingerprints in any process; changing any weight changes it.

    Args:
      layer: any NNX module; only its `nnx.Param` variables are read.

    Returns:
      64 lowercase hex digits.

    Example:
      >>> from flax import nnx
      >>> import kvattn
      >>> from kvattn.snapshots import weights_fingerprint
      >>> a = kvattn.MultiHeadAttention(2, 8, max_len=4, rngs=nnx.Rngs(0))
      >>> b = kvattn.MultiHeadAttention(2, 8, max_len=16, rngs=nnx.Rngs(0))
      >>> weights_fingerprint(a) == weights_fingerprint(b)  # max_len is not a weight
      True
    """
    digest = hashlib.sha256()
    for name, array in sorted(_flat_arrays(layer, nnx.Param).items()):
        values = np.ascontiguousarray(host(array), dtype="<f4")
        digest.update(f"{name}:{list(values.shape)}\n".encode())
        digest.update(values.tobytes())
    return digest.hexdigest()


def save_cache(layer: nnx.Module, path: str | os.PathLike) -> None:
    """Writes the layer's KV cache (its `nnx.Cache` variables) to a snapshot file, atomically.

    `layer` may also be any module holding kvattn layers (a whole
    `kvattn.models.CausalLM`): every layer's cache goes into the one file,
    under its path, with each layer's configuration recorded.

    The bytes go to an unnamed file beside `path` (a temporary one where
    the system has no `O_TMPFILE`), are flushed and fsynced, and only then
    named and renamed onto `path`: a crash or kill mid-save leaves any
    earlier file at `path` intact and never a partial one, and nothing that
    the next save to `path` does not remove. Like `tempfile.mkstemp`, the
    new file is readable and writable by its owner only. The layer is not
    changed.

    Args:
      layer: the layer whose cache to save.
      path: the snapshot file to create or replace; its directory must exist.

    `load_cache`'s example shows a round trip.
    """
    path = Path(path)
    _contiguous(layer)
    arrays = _flat_arrays(layer, nnx.Cache)
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "config": files.dumps(_layer_config(layer)),
        "weights_fingerprint": weights_fingerprint(layer),
    }
    if not all(array.is_fully_addressable for array in arrays.values()):
        pieces.write_pieces(path, arrays, metadata)
        return
    tensors = {name: np.asarray(array) for name, array in arrays.items()}
    metadata["tensors"] = files.dumps({name: files.tensor_spec(array) for name, array in tensors.items()})
    atomic.write_atomically(path, safetensors.numpy.save(tensors, metadata=files.sealed(metadata)))


def load_cache(layer: nnx.Module, path: str | os.PathLike, *, allow_weight_mismatch: bool = False) -> None:
    """Replaces the layer's KV cache with a snapshot's, after checking everything.

    The whole file is validated before the layer is touched, and its header
    before any tensor data is read or allocated: the format and the
    metadata checksum, the layer configuration, tensor names, shapes and
    dtypes, the file's size; then per-tensor checksums, `0 <= pos <= max_len`
    (`0 <= pos` for a windowed layer), that every unfilled slot is zero (a
    layer never holds anything else there, and a NaN there would poison
    later steps), and that the snapshot was filled by the same weights.
    Any failure raises `SnapshotError` naming the file, what was expected
    and what was found, and leaves the layer exactly as it was. The loaded
    arrays take the devices and sharding of the cache they replace.

    Args:
      layer: the layer (or module holding kvattn layers) to receive the
        cache; it must be configured like the one that saved it (batch_size,
        max_len or window, heads, cache_dtype, cache_layout, options...).
      path: a file written by `save_cache`.
      allow_weight_mismatch: load even if the snapshot was filled by other
        weights (its keys and values then do not match this layer's).

    Raises:
      SnapshotError: the file is not a valid snapshot for this layer.
      OSError: the file cannot be read.

    Example:
      >>> import tempfile, os
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import kvattn
      >>> from kvattn.snapshots import load_cache, save_cache
      >>> layer = kvattn.MultiHeadAttention(2, 8, max_len=16, rngs=nnx.Rngs(0))
      >>> _ = layer.prefill(jnp.ones((5, 8)))
      >>> with tempfile.TemporaryDirectory() as tmp:
      ...     path = os.path.join(tmp, "prompt.safetensors")
      ...     save_cache(layer, path)
      ...     layer.reset()
      ...     load_cache(layer, path)
      >>> int(layer.pos[...])
      5
    """
    _contiguous(layer)
    flat = nnx.to_flat_state(nnx.state(layer, nnx.Cache))
    variables = {_path_name(var_path): variable for var_path, variable in flat}
    with files.opened(path) as file:
        header = files.read_header(file)
        info = _parse_info(header.metadata)
        files.check_entries_match_specs(header, {} if info.pieces else info.tensors)
        recorded.check_config(info.config, _layer_config(layer))
        recorded.check_specs_fit_layer(info.tensors, {name: variable[...] for name, variable in variables.items()})
        if info.pieces:
            legacy = info.format_version < 3
            tensors = pieces.read_pieces(Path(path).parent, list(info.pieces), info.tensors, legacy=legacy)
        else:
            tensors = files.read_tensors(file, header)
            files.check_tensors_match_specs(tensors, info.tensors)
        for prefix, attention in attention_layers(layer).items():
            own = {name[len(prefix) + 1 :] if prefix else name: array for name, array in tensors.items()
                   if not prefix or name.startswith(prefix + "/")}
            recorded.check_pos(own["pos"], attention.max_len)
            recorded.check_unfilled_slots_zero(own, attention.config)
        if not allow_weight_mismatch:
            files.check_weights(info.weights_fingerprint, weights_fingerprint(layer))
    # Everything is checked and on its devices before the first assignment.
    placed = {name: _place_like(tensors[name], variable[...]) for name, variable in variables.items()}
    for name, variable in variables.items():
        variable[...] = placed[name]


def snapshot_info(path: str | os.PathLike) -> SnapshotInfo:
    """Reads a snapshot's metadata without a layer, from the file's header only.

    Args:
      path: a file written by `save_cache`.

    Returns:
      The `SnapshotInfo`; tensor data and checksums are not read (`load_cache`
      checks them).

    Raises:
      SnapshotError: the header is not that of a kvattn cache snapshot, or
        its metadata fails its checksum.
      OSError: the file cannot be read.

    Example:
      >>> import tempfile, os
      >>> from flax import nnx
      >>> import kvattn
      >>> from kvattn.snapshots import save_cache, snapshot_info, weights_fingerprint
      >>> layer = kvattn.MultiHeadAttention(2, 8, max_len=16, batch_size=3, rngs=nnx.Rngs(0))
      >>> with tempfile.TemporaryDirectory() as tmp:
      ...     save_cache(layer, os.path.join(tmp, "c.safetensors"))
      ...     info = snapshot_info(os.path.join(tmp, "c.safetensors"))
      >>> info.config["max_len"], info.tensors["pos"]["shape"]
      (16, [3])
      >>> info.weights_fingerprint == weights_fingerprint(layer)
      True
    """
    with files.opened(path) as file:
        return _parse_info(files.read_header(file).metadata)


def attention_layers(module: nnx.Module) -> dict[str, MultiHeadAttention]:
    """The kvattn layers whose caches a snapshot of `module` holds, by path ("" for a lone layer).

    Both kinds of snapshot find their layers here: `save_cache` and
    `load_cache` (a layer's or a model's whole cache) and `save_sequence`
    and `load_sequence` (one paged sequence), so a path names the same
    layer in either file.

    Args:
      module: a `kvattn.MultiHeadAttention`, or any module holding them
        (a `kvattn.models.CausalLM`).

    Returns:
      Path -> layer: `{"": module}` for a lone layer, else each layer's
      attribute path joined with "/" (`blocks/0/attention`), in
      `nnx.iter_modules` order.

    Raises:
      TypeError: `module` is not a kvattn layer and holds none.

    Example:
      >>> from flax import nnx
      >>> import kvattn
      >>> from kvattn.snapshots import attention_layers
      >>> list(attention_layers(kvattn.MultiHeadAttention(2, 8, max_len=4, rngs=nnx.Rngs(0))))
      ['']
    """
    if isinstance(module, MultiHeadAttention):
        return {"": module}
    found = {_path_name(path): sub for path, sub in nnx.iter_modules(module) if isinstance(sub, MultiHeadAttention)}
    if not found:
        raise TypeError(f"a cache snapshot needs a kvattn.MultiHeadAttention or a module holding them, got {module!r}")
    return found


def _contiguous(module: nnx.Module) -> None:
    layers = attention_layers(module)
    paged = sorted(prefix or "(the layer)" for prefix, layer in layers.items() if layer.config.cache.paged)
    if paged:
        raise ValueError(
            f"a paged layer's pool serves many sequences, with the host PageManager's tables: save one sequence "
            f"with kvattn.save_sequence instead (paged: {paged})"
        )


def _layer_config(module: nnx.Module) -> dict:
    """The configuration a snapshot records: a layer's `recorded.CONFIG_FIELDS`, or `{"layers": {path: fields}}`."""
    layers = attention_layers(module)
    if list(layers) == [""]:
        return layers[""].config.recorded()
    return {"layers": {prefix: layer.config.recorded() for prefix, layer in layers.items()}}


# ------------------------------------------------------------------- reading


def _parse_info(metadata) -> SnapshotInfo:
    """Checks a header's metadata (its checksum first) and returns it decoded."""
    metadata = files.checked_metadata(
        metadata, FORMAT_NAME, "cache snapshot", _VERSIONS,
        reads=f"this kvattn reads versions 1, 2 and {FORMAT_VERSION}. Save the cache again with this kvattn.",
    )
    version = int(metadata["format_version"])
    config = files.loads_object(metadata, "config")
    if version > 1 and sorted(config) == ["layers"] and isinstance(config["layers"], dict) and config["layers"]:
        config = {"layers": {prefix: recorded.fields(fields, version) for prefix, fields in config["layers"].items()}}
    else:
        config = recorded.fields(config, version)
    piece_files = _pieces(metadata)
    tensors = files.tensor_specs(metadata, checksummed=not piece_files)
    return SnapshotInfo(version, config, tensors, files.checked_fingerprint(metadata), piece_files)


def _pieces(metadata: dict) -> tuple[str, ...]:
    """The piece files a multi-process snapshot lists (checksums live in them), or () for a whole file."""
    if "pieces" not in metadata:
        return ()
    try:
        pieces = json.loads(metadata["pieces"])
    except (ValueError, RecursionError):
        pieces = None
    if not isinstance(pieces, list) or not pieces or not all(isinstance(p, str) for p in pieces):
        raise SnapshotError(
            f"corrupted snapshot: metadata 'pieces' must list piece file names, got {metadata['pieces']!r}"
        )
    return tuple(pieces)


# ------------------------------------------------------------------- helpers


def _flat_arrays(module: nnx.Module, variable_type) -> dict:
    """The module's variables of one type as `{"a/b": array}`."""
    flat = nnx.to_flat_state(nnx.state(module, variable_type))
    return {_path_name(var_path): variable[...] for var_path, variable in flat}


def _path_name(var_path) -> str:
    return "/".join(str(part) for part in var_path)


def _place_like(array: np.ndarray, like):
    """`array` on the devices and sharding of `like`, which it replaces."""
    return jax.device_put(np.array(array, dtype=array.dtype.newbyteorder("=")), like.sharding)
