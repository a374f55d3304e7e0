"""kvattn: multi-head attention with a KV cache for JAX and Flax NNX."""

from kvattn.attention import CacheOverflowError, InvalidStateError, MultiHeadAttention
from kvattn.config import AttentionConfig
from kvattn.rope import RoPE
from kvattn.decoding import Decoder, Generation, attend, decode, generate
from kvattn.sharding import make_mesh, shard
from kvattn.paging import OutOfPagesError, PageBatch, PageManager
from kvattn.paged_snapshot import load_sequence, save_sequence
from kvattn.snapshot import SnapshotError, SnapshotInfo, load_cache, save_cache, snapshot_info, weights_fingerprint

__all__ = [
    "AttentionConfig",
    "CacheOverflowError",
    "Decoder",
    "Generation",
    "InvalidStateError",
    "MultiHeadAttention",
    "OutOfPagesError",
    "PageBatch",
    "PageManager",
    "RoPE",
    "SnapshotError",
    "SnapshotInfo",
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
