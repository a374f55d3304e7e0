"""One paged sequence on disk: save the keys and values a sequence holds in every paged layer, load them into a new sequence.

A sequence snapshot is a safetensors file (no pickle) holding, for each
paged layer under its path, `k` and `v` `(length, K, H)` in the storage
dtype (and `k_scale`, `v_scale` `(length, K)` for int8), token by token
whatever the pool's page size or layout, and in its string metadata:

  format               "kvattn.sequence_snapshot"
  format_version       "2"
  length               tokens the sequence holds
  tokens               JSON: the token ids, when the caller gave them, else null
  config               JSON: path -> the layer's recorded configuration (as
                       `kvattn.save_cache` records it), less `batch_size`,
                       `max_len` and `cache_layout`
  tensors              JSON: name -> {"dtype", "shape", "sha256"}
  weights_fingerprint  `kvattn.weights_fingerprint` of the saving module
  metadata_sha256      sha256 of the canonical JSON of every other entry
                       (`kvattn.snapshots.files.metadata_checksum`)

The token ids are what a server trusts to register the pages for prefix
caching, and nothing else can vouch for them: hence the metadata checksum,
verified before any entry is used. Version 1 had none, so it is refused
with a request to save the sequence again.

Loading reads the header alone first (`kvattn.snapshots.files`), checks all
of it against the layers, then reads and checks the data, then claims a
sequence and pages from the `PageManager` (raising `OutOfPagesError` first if
they cannot be had), so a failed load changes neither the manager nor any
layer. A sequence may be restored into a pool with another page size,
layout, number of sequences or `max_len` (at least its length).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
import safetensors.numpy
from flax import nnx

from kvattn.caches import storage

from kvattn.caches.storage import Stored
from kvattn.caches.base import NULL_PAGE, blocks_spanned
from kvattn.errors import OutOfPagesError, SnapshotError
from kvattn.paging import PageManager
from kvattn.caches import paged
from kvattn.snapshots import atomic, files
from kvattn.snapshots.cache import attention_layers, weights_fingerprint

__all__ = ["load_sequence", "save_sequence"]

FORMAT_NAME = "kvattn.sequence_snapshot"
FORMAT_VERSION = 2
_METADATA_KEYS = ("format", "format_version", "length", "tokens", "config", "tensors", "weights_fingerprint",
                  files.METADATA_CHECKSUM)
_UNSUPPORTED = (
    f"this kvattn reads version {FORMAT_VERSION}. Version 1 kept its token ids outside any checksum, so they cannot "
    "be trusted: save the sequence again with save_sequence (or recompute it)."
)


def save_sequence(module: nnx.Module, manager: PageManager, seq: int, path: str | os.PathLike, *,
                  tokens=None) -> None:
    """Writes what `seq` holds in every paged layer of `module` to a snapshot file, atomically.

    Args:
      module: a paged `MultiHeadAttention`, or a module holding them (a
        paged `CausalLM`), whose pools hold the sequence's pages.
      manager: the `PageManager` that owns the sequence.
      sequence: a live sequence.
      path: the file to create or replace; its directory must exist.
      tokens: optionally the token ids the sequence holds, recorded so that a
        loader can register the pages for prefix caching.
    """
    layers = _paged_layers(module, manager)
    seq = int(seq)
    if not 0 <= seq < manager.max_sequences or not manager.live[seq]:
        raise ValueError(
            f"sequence must be a live sequence of the manager, got {seq} (live: {np.flatnonzero(manager.live).tolist()})"
        )
    length = int(manager.pos[seq])
    if manager.window is not None and length > 0 and manager.tables[seq, 0] == NULL_PAGE:
        raise ValueError(
            f"sequence {seq} has released the pages that left its window; a windowed sequence cannot be saved"
        )
    if tokens is not None:
        tokens = [int(t) for t in np.asarray(tokens).reshape(-1)]
        if len(tokens) != length:
            raise ValueError(f"tokens must list the sequence's {length} tokens, got {len(tokens)}")
    pages = manager.tables[seq, : blocks_spanned(length, manager.page_size)]
    tensors = {}
    for prefix, layer in layers.items():
        for name, stored in zip("kv", _pool(layer), strict=True):
            held = storage.read_sequence(stored, pages, length, layer.config.layout)
            tensors[_name(prefix, name)] = np.asarray(held.values)
            if held.scale is not None:
                tensors[_name(prefix, f"{name}_scale")] = np.asarray(held.scale)
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "length": str(length),
        "tokens": files.dumps(tokens),
        "config": files.dumps(_sequence_config(layers)),
        "tensors": files.dumps({name: files.tensor_spec(array) for name, array in tensors.items()}),
        "weights_fingerprint": weights_fingerprint(module),
    }
    atomic.write_atomically(Path(path), safetensors.numpy.save(tensors, metadata=files.sealed(metadata)))


def load_sequence(module: nnx.Module, manager: PageManager, path: str | os.PathLike, *,
                  allow_weight_mismatch: bool = False) -> tuple[int, list[int] | None]:
    """Restores a saved sequence into a new sequence, after checking everything.

    Args:
      module: paged layers configured like the saving ones (their page size
        and layout may differ).
      manager: the `PageManager` to take a sequence and pages from.
      path: a file written by `save_sequence`.
      allow_weight_mismatch: load even if other weights filled the snapshot.

    Returns:
      `(sequence, tokens)`: the sequence now holding the sequence, and the token ids
      the snapshot recorded (None if it recorded none).

    Raises:
      SnapshotError: the file is not a valid snapshot for these layers (the
        message names the file).
      OutOfPagesError: no sequence, or too few pages, for the sequence.
    """
    layers = _paged_layers(module, manager)
    with files.opened(path) as file:
        header = files.read_header(file)
        metadata = files.checked_metadata(header.metadata, FORMAT_NAME, "sequence snapshot",
                                          {str(FORMAT_VERSION): _METADATA_KEYS}, reads=_UNSUPPORTED)
        length, tokens, specs, fingerprint = _parse(metadata)
        files.check_entries_match_specs(header, specs)
        saved_config, config = files.loads_object(metadata, "config"), _sequence_config(layers)
        if saved_config != config:
            raise SnapshotError(
                f"snapshot was saved by differently configured layers: {saved_config} in the file, {config} here"
            )
        too_long = sorted(prefix or "(the layer)" for prefix, layer in layers.items()
                          if length > layer.config.cache.max_len)
        if too_long:
            raise SnapshotError(f"the snapshot holds {length} tokens, more than max_len of layers {too_long}")
        expected = {}
        for prefix, layer in layers.items():
            shape = (length, layer.config.num_kv_heads, layer.config.head_dim)
            for name in "kv":
                expected[_name(prefix, name)] = (np.dtype(layer.config.cache.dtype).name, shape)
                if layer.config.cache.dtype == "int8":
                    expected[_name(prefix, f"{name}_scale")] = ("float32", shape[:2])
        got = {name: (spec["dtype"], tuple(spec["shape"])) for name, spec in specs.items()}
        if got != expected:
            raise SnapshotError(f"snapshot tensors {got} do not fit these layers, which expect {expected}")
        tensors = files.read_tensors(file, header)
        files.check_tensors_match_specs(tensors, specs)
        if not allow_weight_mismatch:
            files.check_weights(fingerprint, weights_fingerprint(module))
    num_pages = blocks_spanned(length, manager.page_size)  # every page is written at once, window or not
    if manager.live.all() or num_pages > manager.num_free + manager.num_cached:
        raise OutOfPagesError(
            f"cannot load a {length}-token sequence now: it needs a free sequence and {num_pages} pages; "
            f"{int((~manager.live).sum())} sequences and {manager.num_free + manager.num_cached} pages can be had"
        )
    seq = manager.add()
    try:
        counts = np.zeros(manager.max_sequences, np.int32)
        counts[seq] = length
        pages = manager.reserve(counts).table[seq, :num_pages]
        pools = {
            prefix: [
                storage.write_sequence(
                    stored, pages, Stored(tensors[_name(prefix, name)], tensors.get(_name(prefix, f"{name}_scale"))),
                    layer.config.layout,
                )
                for name, stored in zip("kv", _pool(layer), strict=True)
            ]
            for prefix, layer in layers.items()
        }
        jax.block_until_ready(pools)
    except BaseException:
        manager.free(seq)
        raise
    for prefix, layer in layers.items():
        k, v = pools[prefix]
        layer.set_pool(paged.PagedKVCache(k, v, None, None))
    return seq, tokens


def _paged_layers(module: nnx.Module, manager: PageManager) -> dict:
    """The module's kvattn layers, checked to be paged and to agree with the manager's pool."""
    layers = attention_layers(module)
    unpaged = sorted(prefix or "(the layer)" for prefix, layer in layers.items() if not layer.config.cache.paged)
    if unpaged:
        raise ValueError(
            f"sequence snapshots are for paged layers; these are contiguous (use kvattn.save_cache): {unpaged}"
        )
    wanted = (manager.num_pages, manager.page_size, manager.max_pages_per_sequence)
    for prefix, layer in layers.items():
        spec = layer.config.cache
        if (spec.num_pages, spec.page_size, spec.pages_per_sequence) != wanted:
            raise ValueError(
                f"the manager's pool (num_pages, page_size, max_pages_per_sequence) = {wanted} is not layer "
                f"{prefix or '(the layer)'}'s {(spec.num_pages, spec.page_size, spec.pages_per_sequence)}"
            )
    return layers


# What may differ between the saving and the loading layers: how many sequences and
# tokens the pool holds, and its layout (a snapshot is stored token by token).
_FREE_FIELDS = ("batch_size", "max_len", "cache_layout")


def _sequence_config(layers: dict) -> dict:
    """What must agree between the saving and the loading layers."""
    return {prefix: {k: v for k, v in layer.config.recorded().items() if k not in _FREE_FIELDS}
            for prefix, layer in layers.items()}


def _pool(layer) -> tuple[Stored, Stored]:
    cache = layer.paged_cache(None, None)
    return cache.k, cache.v


def _name(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _parse(metadata: dict) -> tuple[int, list[int] | None, dict, str]:
    """The checked contents of a sequence snapshot's metadata (its checksum already verified)."""
    if not (metadata["length"].isascii() and metadata["length"].isdigit() and len(metadata["length"]) < 19):
        raise SnapshotError(f"corrupted snapshot: length {metadata['length']!r} is not a token count")
    length = int(metadata["length"])
    try:
        tokens = json.loads(metadata["tokens"])
    except (ValueError, RecursionError) as error:
        raise SnapshotError(f"corrupted snapshot: tokens is not JSON ({error})") from None
    if tokens is not None and (not isinstance(tokens, list) or len(tokens) != length
                               or not all(isinstance(t, int) for t in tokens)):
        raise SnapshotError(f"corrupted snapshot: tokens must be null or {length} ints")
    return length, tokens, files.tensor_specs(metadata), files.checked_fingerprint(metadata)
