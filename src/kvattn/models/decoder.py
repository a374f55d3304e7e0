"""Decoder-only language models built from kvattn layers: GPT-2 and the Llama family.

`CausalLM(config, max_len=..., batch_size=..., rngs=...)` holds an
embedding, `num_layers` blocks (norm, `kvattn.MultiHeadAttention`, norm,
MLP), a final norm and the output projection (tied to the embedding when
the checkpoint ties them). Every block's attention owns its KV cache, so the
model decodes with `prefill(tokens, lengths)` and `step(tokens)` like one
layer does, and `model(tokens)` is the full causal forward without a cache.
Token ids are checked at each call (`kvattn.models.tokens`): eagerly an id
outside `[0, vocab_size)` raises before any cache changes; under `jit` its
sequence writes nothing and gets NaN logits.
Built with `num_pages` and `page_size`, every layer holds a page pool
instead, and the calls take `pages=` (a `kvattn.PageBatch`, which one
`kvattn.PageManager` hands out for all layers): see `kvattn.serving`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn import norms
from kvattn import validation as check
from kvattn.attention import MultiHeadAttention
from kvattn.models.model_config import ModelConfig
from kvattn.models.tokens import in_vocab, token_ids

__all__ = ["CausalLM"]


class RMSNorm(nnx.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, normalised in float32 and scaled after the cast back (Llama's order)."""

    def __init__(self, features: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((features,), dtype))
        self.eps = eps

    def __call__(self, x):
        return norms.rms_norm(x, self.weight[...], self.eps, scale_after_cast=True)


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias (GPT-2's), normalised in float32 and scaled after the cast back."""

    def __init__(self, features: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((features,), dtype))
        self.bias = nnx.Param(jnp.zeros((features,), dtype))
        self.eps = eps

    def __call__(self, x):
        return norms.layer_norm(x, self.weight[...], self.eps, self.bias[...], scale_after_cast=True)


class Linear(nnx.Module):
    """`x @ kernel (+ bias)`, kernel `(in, out)`."""

    def __init__(self, features_in: int, features_out: int, bias: bool, dtype):
        self.kernel = nnx.Param(jnp.zeros((features_in, features_out), dtype))
        self.bias = nnx.Param(jnp.zeros((features_out,), dtype)) if bias else None

    def __call__(self, x):
        y = x @ self.kernel[...]
        return y if self.bias is None else y + norms.along_last(self.bias[...], y)


class MLP(nnx.Module):
    """SwiGLU (Llama: `down(silu(gate(x)) * up(x))`) or GELU (GPT-2: `down(gelu_tanh(up(x)))`)."""

    def __init__(self, config: ModelConfig, dtype):
        self.gated = config.family == "llama"
        bias = config.family == "gpt2"
        self.up = Linear(config.hidden_size, config.intermediate_size, bias, dtype)
        self.gate = Linear(config.hidden_size, config.intermediate_size, bias, dtype) if self.gated else None
        self.down = Linear(config.intermediate_size, config.hidden_size, bias, dtype)

    def __call__(self, x):
        if self.gated:
            return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
        return self.down(jax.nn.gelu(self.up(x), approximate=True))


class Block(nnx.Module):
    """Pre-norm residual block: `x + attention(norm(x))`, then `x + mlp(norm(x))`."""

    def __init__(self, config: ModelConfig, attention: MultiHeadAttention, dtype):
        norm = RMSNorm if config.family == "llama" else LayerNorm
        self.attention_norm = norm(config.hidden_size, config.norm_eps, dtype)
        self.attention = attention
        self.mlp_norm = norm(config.hidden_size, config.norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(self, x, attend):
        x = x + attend(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class CausalLM(nnx.Module):
    """A decoder-only language model whose attention layers carry kvattn's KV caches.

    Args:
      config: the model's sizes and options.
      max_len: cache capacity per sequence (prompt plus new tokens).
      batch_size: sequences decoded together.
      dtype: computation and parameter dtype (float32 or bfloat16).
      cache_dtype: the caches' storage (see `kvattn.MultiHeadAttention`).
      num_pages, page_size: a paged cache per layer (see
        `kvattn.MultiHeadAttention`); `batch_size` then counts the sequence
        slots, and a sliding window frees pages instead of using a ring.
      rngs: only for initial values; `from_pretrained` overwrites them.
    """

    def __init__(self, config: ModelConfig, *, max_len: int, batch_size: int = 1, dtype=jnp.float32,
                 cache_dtype=None, num_pages: int | None = None, page_size: int | None = None, rngs: nnx.Rngs):
        learned = config.family == "gpt2"
        if learned and isinstance(max_len, (int, np.integer)) and max_len > config.max_position_embeddings:
            raise ValueError(
                f"max_len={max_len} exceeds the {config.max_position_embeddings} learned positions of this "
                f"{config.family} model (n_positions): it cannot place a token past them"
            )
        self.config = config
        dtype = jnp.dtype(dtype)
        self.embed = nnx.Param(jnp.zeros((config.vocab_size, config.hidden_size), dtype))
        self.positions = (
            nnx.Param(jnp.zeros((config.max_position_embeddings, config.hidden_size), dtype))
            if config.family == "gpt2" else None
        )
        window = config.sliding_window if config.sliding_window and config.sliding_window < max_len else None
        # Heads-major caches (and pages): a step's attention is then a plain batched dot over (B, K)
        # that reads the cache in place; slots-major would cost K times the flops (see kvattn.ops).
        # Measured with tools/model_floor.py: 53.0 -> 43.0 ms/token at B=8, 19.0 -> 17.8 at B=1.
        capacity = dict(window=window) if window else dict(max_len=max_len)
        if num_pages is not None:
            capacity = dict(max_len=max_len, window=window, num_pages=num_pages, page_size=page_size)

        def attention():
            return MultiHeadAttention(
                config.num_heads, config.hidden_size, head_dim=config.head_dim, num_kv_heads=config.num_kv_heads,
                batch_size=batch_size, use_bias=True if config.family == "gpt2" else (
                    ("query", "key", "value") if config.attention_bias else False),
                rope=config.rope, normalize_qk="rms" if config.qk_norm else False, qk_norm_eps=config.norm_eps,
                dtype=dtype, param_dtype=dtype, cache_dtype=cache_dtype or dtype, cache_layout="heads_major",
                rngs=rngs, **capacity,
            )

        self.blocks = nnx.List([Block(config, attention(), dtype) for _ in range(config.num_layers)])
        norm = RMSNorm if config.family == "llama" else LayerNorm
        self.final_norm = norm(config.hidden_size, config.norm_eps, dtype)
        self.lm_head = None if config.tie_embeddings else nnx.Param(jnp.zeros((config.hidden_size, config.vocab_size), dtype))

    @property
    def pos(self) -> jax.Array:
        """Tokens each sequence holds, `(B,)` (every layer's cache agrees)."""
        return self.blocks[0].attention.pos[...]

    def _embed(self, tokens, positions):
        x = jnp.take(self.embed[...], tokens, axis=0)
        if self.positions is not None:
            x = x + jnp.take(self.positions[...], positions, axis=0)
        return x

    def _logits(self, x):
        x = self.final_norm(x)
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return (x @ head).astype(jnp.float32)

    def _tokens(self, tokens, shape, lengths=None):
        """`(tokens, valid)`: checked ids (eagerly it raises; traced, bad ids become 0) and the rows without a bad one."""
        tokens = token_ids(tokens, self.config.vocab_size, "tokens", shape)
        if not check.is_traced(tokens):
            return jnp.asarray(tokens), None
        valid, tokens = in_vocab(tokens, self.config.vocab_size)
        return tokens, valid

    @staticmethod
    def _poison(logits, valid):
        """NaN logits for the rows whose ids were out of range (under `jit`, where nothing can raise)."""
        if valid is None:
            return logits
        return jnp.where(valid.reshape(valid.shape + (1,) * (logits.ndim - 1)), logits, jnp.nan)

    def __call__(self, tokens):
        """The full causal forward of `tokens` `(B, T)` int, no cache: logits `(B, T, V)` float32."""
        tokens, valid = self._tokens(tokens, (None, None))
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self._embed(tokens, positions)
        for block in self.blocks:
            x = block.forward(x, block.attention)
        return self._poison(self._logits(x), valid)

    def prefill(self, tokens, lengths=None, *, pages=None, last_only: bool = False):
        """Appends `tokens` `(B, T)` (right-padded, `lengths` real per sequence) to every cache: logits `(B, T, V)`.

        Every id, padding included, must lie in `[0, vocab_size)`. With
        `last_only`, only the logits of each sequence's last real token,
        `(B, V)`: generation needs no others, and the output projection of
        every prompt position costs a quarter of a small model's prefill.
        """
        tokens, valid = self._tokens(tokens, (None, None))  # a paged call may take fewer rows
        if valid is not None:  # a sequence with a bad id writes nothing
            full = jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32) if lengths is None else lengths
            lengths = jnp.where(valid, full, 0)
        pos = self.pos if pages is None else jnp.asarray(pages.pos)
        x = self._embed(tokens, pos[:, None] + jnp.arange(tokens.shape[1])[None, :])
        for block in self.blocks:
            x = block.forward(x, lambda h, attention=block.attention: attention.prefill(h, lengths, pages=pages))
        if last_only:
            last = jnp.full(tokens.shape[:1], tokens.shape[1]) if lengths is None else jnp.asarray(lengths)
            x = jnp.take_along_axis(x, (jnp.maximum(last, 1) - 1)[:, None, None], axis=1)[:, 0]
        return self._poison(self._logits(x), valid)

    def step(self, tokens, active=None, *, pages=None):
        """Appends one token per sequence `(B,)` int: logits `(B, V)`."""
        tokens, valid = self._tokens(tokens, (None,))
        if valid is not None:  # a sequence with a bad id writes nothing
            active = valid if active is None else active & valid
        x = self._embed(tokens, self.pos if pages is None else jnp.asarray(pages.pos))
        for block in self.blocks:
            x = block.forward(x, lambda h, attention=block.attention: attention.step(h, active, pages=pages))
        return self._poison(self._logits(x), valid)

    def reset(self, which=None):
        for block in self.blocks:
            block.attention.reset(which)

    def truncate(self, keep):
        for block in self.blocks:
            block.attention.truncate(keep)

    def fork(self, source, targets):
        for block in self.blocks:
            block.attention.fork(source, targets)

    def reorder(self, order):
        for block in self.blocks:
            block.attention.reorder(order)
