"""kvattn: multi-head attention with a KV cache for JAX and Flax NNX."""

from kvattn.attention import CacheOverflowError, MultiHeadAttention, attend
from kvattn.decoding import Decoder, Generation, decode, generate

__all__ = [
    "CacheOverflowError",
    "Decoder",
    "Generation",
    "MultiHeadAttention",
    "attend",
    "decode",
    "generate",
]
