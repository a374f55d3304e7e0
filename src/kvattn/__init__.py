"""kvattn: multi-head attention with a KV cache for JAX and Flax NNX."""

from kvattn.attention import MultiHeadAttention
from kvattn.errors import (
    CacheOverflowError, CheckpointError, InvalidStateError, KvattnError, MissingExtraError, OutOfPagesError,
    SnapshotError, UnsupportedConfigError,
)
from kvattn.config import AttentionConfig
from kvattn.rope import RoPE
from kvattn.decoding import Decoder, Rollout, attend, decode, rollout
from kvattn.sharding import make_mesh, shard
from kvattn.paging import PageBatch, PageManager
from kvattn.paging.snapshot import load_sequence, save_sequence
from kvattn.snapshot import SnapshotInfo, load_cache, save_cache, snapshot_info, weights_fingerprint

__all__ = [
    "AttentionConfig",
    "CacheOverflowError",
    "CheckpointError",
    "Decoder",
    "InvalidStateError",
    "KvattnError",
    "MissingExtraError",
    "MultiHeadAttention",
    "OutOfPagesError",
    "PageBatch",
    "PageManager",
    "RoPE",
    "Rollout",
    "SnapshotError",
    "SnapshotInfo",
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
