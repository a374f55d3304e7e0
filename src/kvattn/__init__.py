"""kvattn: multi-head attention with a KV cache for JAX and Flax NNX.

The public names are imported on first use (PEP 562), so `import kvattn`
(and `kvattn --help`, or `import kvattn.errors`) loads no JAX until a name
that needs it is read: `kvattn.MultiHeadAttention` and
`from kvattn import MultiHeadAttention` work as eager imports would.
"""

from __future__ import annotations

import importlib
import typing

if typing.TYPE_CHECKING:  # the same names, visible to type checkers and to the API docs' static reader
    from kvattn.layer.attention import MultiHeadAttention
    from kvattn.config import AttentionConfig
    from kvattn.caches.base import Contiguous, Paged
    from kvattn.layer.decoding import Decoder, Rollout, attend, decode, rollout
    from kvattn.errors import (
        CacheOverflowError, CheckpointError, InvalidStateError, KvattnError, MissingExtraError, OutOfPagesError,
        SnapshotError, UnsupportedConfigError,
    )
    from kvattn.generation.sampling import SamplingParams, StructuredOutputs
    from kvattn.paging import PageBatch, PageManager
    from kvattn.rotary import RoPE
    from kvattn.serving.llm import LLM
    from kvattn.layer.sharding import make_mesh, shard
    from kvattn.snapshots.cache import SnapshotInfo, load_cache, save_cache, snapshot_info, weights_fingerprint
    from kvattn.snapshots.sequence import load_sequence, save_sequence

# Each public name and the module it is imported from on first use. A new public name is one line here,
# one in `__all__`, and one in the TYPE_CHECKING imports above.
_EXPORTS = {
    "AttentionConfig": "kvattn.config",
    "CacheOverflowError": "kvattn.errors",
    "CheckpointError": "kvattn.errors",
    "Contiguous": "kvattn.caches.base",
    "Decoder": "kvattn.layer.decoding",
    "InvalidStateError": "kvattn.errors",
    "LLM": "kvattn.serving.llm",
    "KvattnError": "kvattn.errors",
    "MissingExtraError": "kvattn.errors",
    "MultiHeadAttention": "kvattn.layer.attention",
    "OutOfPagesError": "kvattn.errors",
    "PageBatch": "kvattn.paging",
    "PageManager": "kvattn.paging",
    "Paged": "kvattn.caches.base",
    "RoPE": "kvattn.rotary",
    "Rollout": "kvattn.layer.decoding",
    "SamplingParams": "kvattn.generation.sampling",
    "SnapshotError": "kvattn.errors",
    "SnapshotInfo": "kvattn.snapshots.cache",
    "StructuredOutputs": "kvattn.generation.sampling",
    "UnsupportedConfigError": "kvattn.errors",
    "attend": "kvattn.layer.decoding",
    "decode": "kvattn.layer.decoding",
    "load_cache": "kvattn.snapshots.cache",
    "load_sequence": "kvattn.snapshots.sequence",
    "make_mesh": "kvattn.layer.sharding",
    "rollout": "kvattn.layer.decoding",
    "save_cache": "kvattn.snapshots.cache",
    "save_sequence": "kvattn.snapshots.sequence",
    "shard": "kvattn.layer.sharding",
    "snapshot_info": "kvattn.snapshots.cache",
    "weights_fingerprint": "kvattn.snapshots.cache",
}

__all__ = [
    "AttentionConfig",
    "CacheOverflowError",
    "CheckpointError",
    "Contiguous",
    "Decoder",
    "InvalidStateError",
    "LLM",
    "KvattnError",
    "MissingExtraError",
    "MultiHeadAttention",
    "OutOfPagesError",
    "PageBatch",
    "PageManager",
    "Paged",
    "RoPE",
    "Rollout",
    "SamplingParams",
    "SnapshotError",
    "SnapshotInfo",
    "StructuredOutputs",
    "UnsupportedConfigError",
    "attend",
    "decode",
    "load_cache",
    "load_sequence",
    "make_mesh",
    "rollout",
    "save_cache",
    "save_sequence",
    "shard",
    "snapshot_info",
    "weights_fingerprint",
]


def _installed_version() -> str:
    """The installed distribution's version; "0+unknown" when kvattn runs from a source tree never installed."""
    import importlib.metadata  # read on first use: the metadata scan costs more than the rest of `import kvattn`

    try:
        return importlib.metadata.version("kvattn")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def __getattr__(name: str):
    """A public name, or `__version__`, imported on its first use and kept as a module global."""
    if name == "__version__":
        value = _installed_version()
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:  # an AttributeError, so `from kvattn import submodule` falls back to importing the submodule
        raise AttributeError(f"module 'kvattn' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})
