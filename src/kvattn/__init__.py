"""kvattn: multi-head attention with a KV cache for JAX and Flax NNX."""

from kvattn.attention import CacheOverflowError, InvalidStateError, MultiHeadAttention
from kvattn.config import AttentionConfig
from kvattn.rope import RoPE
from kvattn.decoding import Decoder, Generation, attend, decode, generate
from kvattn.sharding import make_mesh, shard
from kvattn.snapshot import SnapshotError, SnapshotInfo, load_cache, save_cache, snapshot_info, weights_fingerprint

__all__ = [
    "AttentionConfig",
    "CacheOverflowError",
    "Decoder",
    "Generation",
    "InvalidStateError",
    "MultiHeadAttention",
    "RoPE",
    "SnapshotError",
    "SnapshotInfo",
    "attend",
    "decode",
    "generate",
    "load_cache",
    "make_mesh",
    "save_cache",
    "shard",
    "snapshot_info",
    "weights_fingerprint",
]
