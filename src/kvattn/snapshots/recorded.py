"""What a cache snapshot records of a layer, read back and checked: its configuration's fields (with the
defaults of fields added after version 1), the tensors' dtypes and shapes against the layer, and the cache's
invariants (`pos` within capacity, unfilled slots zero). `kvattn.snapshots.cache` saves and loads through these.
"""

from __future__ import annotations

import numpy as np

from kvattn.config import AttentionConfig
from kvattn.errors import SnapshotError

__all__ = ["CONFIG_FIELDS", "check_config", "check_pos", "check_specs_fit_layer", "check_unfilled_slots_zero", "fields"]

# Version 1 recorded only these fields; every field added since had its
# default value then (the options did not exist), so a version 1 file reads
# as if it recorded those defaults.
_V1_FIELDS = ("num_heads", "num_kv_heads", "head_dim", "in_features", "max_len", "window", "batch_size",
              "cache_dtype", "cache_layout")

CONFIG_FIELDS = AttentionConfig.recorded_fields()


def fields(config, version: int) -> dict:
    """One layer's recorded configuration, checked; a version 1 one completed with the later defaults."""
    fields = _V1_FIELDS if version == 1 else CONFIG_FIELDS
    if not isinstance(config, dict) or sorted(config) != sorted(fields):
        found = sorted(config) if isinstance(config, dict) else config
        raise SnapshotError(f"corrupted snapshot: config has fields {found}, expected {sorted(fields)}")
    return {**_defaults_after_v1(config), **config} if version == 1 else config


def _defaults_after_v1(config: dict) -> dict:
    """The recorded values of the fields version 2 added, as a layer of version 1's days had them."""
    try:
        sizes = AttentionConfig(**config).recorded()
    except (TypeError, ValueError) as error:
        raise SnapshotError(f"corrupted snapshot: its version 1 config is not a valid layer configuration ({error})")
    return {field: value for field, value in sizes.items() if field not in _V1_FIELDS}


def check_config(saved: dict, expected: dict) -> None:
    if "layers" in saved or "layers" in expected:
        saved_layers, expected_layers = saved.get("layers", {"": saved}), expected.get("layers", {"": expected})
        if sorted(saved_layers) != sorted(expected_layers):
            raise SnapshotError(
                f"snapshot holds the caches of layers {sorted(saved_layers)}, the module has {sorted(expected_layers)}"
            )
        pairs = [(f"{prefix}: ", saved_layers[prefix], expected_layers[prefix]) for prefix in sorted(expected_layers)]
    else:
        pairs = [("", saved, expected)]
    differences = [
        f"{where}{field}={fields[field]!r} (layer has {wanted[field]!r})"
        for where, fields, wanted in pairs
        for field in CONFIG_FIELDS
        if type(fields[field]) is not type(wanted[field]) or fields[field] != wanted[field]
    ]
    if differences:
        raise SnapshotError(
            f"snapshot was saved by a differently configured layer: {', '.join(differences)}. "
            "Build the layer with the snapshot's configuration (see snapshot_info)."
        )


def check_specs_fit_layer(specs: dict, current: dict) -> None:
    """The metadata's tensors are the layer's, in dtype and shape: what bounds the data a load reads."""
    if sorted(specs) != sorted(current):
        raise SnapshotError(f"snapshot holds tensors {sorted(specs)}, the layer's cache is {sorted(current)}")
    for name, spec in sorted(specs.items()):
        want_dtype, want_shape = np.dtype(current[name].dtype), tuple(current[name].shape)
        if spec["dtype"] != want_dtype.name or tuple(spec["shape"]) != want_shape:
            raise SnapshotError(
                f"tensor {name!r} is {spec['dtype']} {tuple(spec['shape'])} in the snapshot, "
                f"the layer expects {want_dtype.name} {want_shape}"
            )


def check_pos(pos: np.ndarray, max_len: int | None) -> None:
    """`pos` counts tokens: at most `max_len`, or any count for a ring (`max_len` None)."""
    past_capacity = pos > max_len if max_len is not None else np.zeros(pos.shape, np.bool_)
    bad = np.flatnonzero((pos < 0) | past_capacity)
    if bad.size:
        valid = "be >= 0" if max_len is None else f"lie in [0, max_len={max_len}]"
        raise SnapshotError(
            f"corrupted snapshot: pos must {valid}, got {pos.reshape(-1)[bad].tolist()} at sequences {bad.tolist()}"
        )


def check_unfilled_slots_zero(tensors: dict[str, np.ndarray], config: AttentionConfig) -> None:
    """Slots at or past each sequence's filled count (`min(pos, slots)`) hold exact zeros in every cache tensor."""
    pos = tensors["pos"].reshape(-1).astype(np.int64)
    filled = np.minimum(pos, config.num_slots)
    for name, array in sorted(tensors.items()):
        if name == "pos":
            continue
        batched = array if config.cache.batch_size is not None else array[None]
        slots = np.moveaxis(batched, config.layout.index("S"), 1)
        nonzero = np.any(slots.reshape(*slots.shape[:2], -1) != 0, axis=-1)  # B S
        unfilled = np.arange(slots.shape[1])[None, :] >= filled[:, None]
        bad = np.flatnonzero(np.any(nonzero & unfilled, axis=1))
        if bad.size:
            raise SnapshotError(
                f"corrupted snapshot: tensor {name!r} holds non-zero values in unfilled slots (past pos) of "
                f"sequences {bad.tolist()}; a layer keeps them at exactly zero"
            )
