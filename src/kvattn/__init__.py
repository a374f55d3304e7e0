"""kvattn: multi-head attention with a KV cache for JAX and Flax NNX."""

from kvattn.attention import MultiHeadAttention
from kvattn.errors import (
    CacheOverflowError, CheckpointError, InvalidStateError, KvattnError, MissingExtraError, OutOfPagesError, SnapshotError,
    UnsupportedConfigError,
)
from kvattn.config import AttentionConfig
from kvattn.rope import RoPE
from kvattn.decoding import Decoder, Generation, attend, decode, generate
from kvattn.sharding import make_mesh, shard
from kvattn.paging import PageBatch, PageManager
from kvattn.paged_snapshot import load_sequence, save_sequence
from kvattn.snapshot import SnapshotInfo, load_cache, save_cache, snapshot_info, weights_fingerprint

__all__ = [
    "AttentionConfig",
    "CacheOverflowError",
    "CheckpointError",
    "Decoder",
    "Generation",
    "InvalidStateError",
    "KvattnError",
    "MissingExtraError",
    "MultiHeadAttention",
    "OutOfPagesError",
    "PageBatch",
    "PageManager",
    "RoPE",
    "SnapshotError",
    "SnapshotInfo",
    "UnsupportedConfigError",
    "attend",
    "decode",
    "generate",
    "load_cache",
    "load_sequence",
    "make_mesh",
    "save_cache",
    "save_sequence",
    "shard",
    "snapshot_info",
    "weights_fingerprint",
]
