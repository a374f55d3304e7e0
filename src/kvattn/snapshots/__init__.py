"""Snapshots on disk: a layer's or a model's whole KV cache, and one sequence of a paged pool.

The modules, in the order data flows:

- `files`: the file format, once for both kinds: bounded header reads,
  checksummed metadata, atomic writes.
- `pieces`: arrays that span processes, written one piece file per process.
- `cache`: a layer's or a model's cache (`save_cache`, `load_cache`,
  `snapshot_info`, `weights_fingerprint`).
- `sequence`: one paged sequence (`save_sequence`, `load_sequence`),
  which finds its layers and fingerprints its weights as `cache` does.

The same names are `kvattn.save_cache`, `kvattn.load_sequence`...
"""

from kvattn.snapshots.cache import (
    SnapshotInfo, attention_layers, load_cache, save_cache, snapshot_info, weights_fingerprint,
)
from kvattn.snapshots.sequence import load_sequence, save_sequence

__all__ = [
    "SnapshotInfo",
    "attention_layers",
    "load_cache",
    "load_sequence",
    "save_cache",
    "save_sequence",
    "snapshot_info",
    "weights_fingerprint",
]
