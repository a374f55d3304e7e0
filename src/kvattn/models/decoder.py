"""Decoder-only language models built from kvattn layers, as a family's block spec names them.

`CausalLM(config, max_len=..., batch_size=..., rngs=...)` holds an
embedding (plus a learned position table where the spec says so),
`num_layers` blocks (norm, attention, norm, MLP), a final norm and the
output projection (tied to the embedding when the checkpoint ties them).
Which norm, which MLP, which positions and which biases are the fields of
`config.block` (`kvattn.models.spec.BlockSpec`); no family is named here.
Every block's attention (a `kvattn.MultiHeadAttention`) owns its KV cache,
so the model decodes with `prefill(tokens, lengths)` and `step(tokens)` like one
layer does, and `model(tokens)` is the full causal forward without a cache.
Token ids are checked at each call (`kvattn.models.tokens`): eagerly an id
outside `[0, vocab_size)` raises before any cache changes; under `jit` its
sequence writes nothing and gets NaN logits.
Built with `num_pages` and `page_size`, every layer holds a page pool
instead, and the calls take `pages=` (a `kvattn.PageBatch`, which one
`kvattn.PageManager` hands out for all layers): see `kvattn.serving`.

Weights are stored in the form a step reads, so no compiled program
concatenates, transposes or converts them: the query, key and value kernels
side by side in one `qkv` kernel, Llama's gate and up kernels in one
`gate_up`, each a single dot per step where the checkpoint has two or three;
each projection and the embedding table hold their weights in one storage
form chosen when the model is built (`kvattn.models.layers`): int8 with
per-output scales under `weights="int8"`, float otherwise, laid out for the
native dots where they run (`kvattn.math.quant`). `load_weight` stores a
float weight in that form (what `kvattn.models.hf` calls for each tensor).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn.kernels import dots
from kvattn.math import quant
from kvattn import validation as check
from kvattn.layer.attention import MultiHeadAttention
from kvattn.config import AttentionConfig
from kvattn.layer.forward import FusedWeights
from kvattn.models.layers import (
    MLP_LAYERS, NORM_LAYERS, HeadScale, Linear, initial, storage_dtype, stored_form, table_form,
)
from kvattn.models.model_config import ModelConfig
from kvattn.models.tokens import in_vocab, token_ids

__all__ = ["WEIGHTS", "CausalLM"]

# What `CausalLM(weights=...)` stores: None, float weights in the model's dtype; "int8" (`kvattn.math.quant`);
# "bfloat16", float weights in bfloat16 (the model still computes in its dtype); "int4" (`kvattn.math.int4`).
WEIGHTS = (None, "int8", "bfloat16", "int4")


class Attention(MultiHeadAttention):
    """kvattn's attention layer with its projections stored as the step reads them (`kvattn.layer.forward.FusedWeights`).

    `qkv` holds the query, key and value kernels side by side, `(D, N + 2K,
    H)` (biases `(N + 2K, H)`), so a step projects with one dot rather than
    three and no program concatenates them; `out` is `(N, H, D)`. With
    `weights="int8"`, both are int8 with per-output scales (`kvattn.math.quant`). Every
    other part of the layer, its config, caches and methods, is
    `kvattn.MultiHeadAttention`'s.
    """

    def __init__(self, config: AttentionConfig, *, weights: str | None, rngs: nnx.Rngs | None):
        # Not MultiHeadAttention.__init__: it would build the four projections apart, which these replace.
        # The rest is made as it makes it: the config, the per-head norm scales and (its own method) the cache.
        if not config.biased("query") == config.biased("key") == config.biased("value"):
            raise ValueError(f"the fused projection needs query, key and value biased alike, got {config.use_bias!r}")
        self.config = config
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        dtype = jnp.dtype(config.param_dtype)
        self.qkv = Linear((config.in_features,), (heads + 2 * kv_heads, head_dim), bias=config.biased("query"),
                          dtype=dtype, weights=weights, rngs=rngs)
        self.out = Linear((heads, head_dim), (config.out_features,), bias=config.biased("out"), dtype=dtype,
                          weights=weights, rngs=rngs)
        if config.normalize_qk:
            offset = config.normalize_qk == "rms_offset"
            self.query_ln, self.key_ln = (HeadScale(head_dim, dtype, offset=offset) for _ in range(2))
        self._build_cache()

    @property
    def weights(self) -> FusedWeights:
        """The projections as the pure step takes them."""
        norms_ = (self.query_ln.scale[...], self.key_ln.scale[...]) if self.config.normalize_qk else (None, None)
        return FusedWeights(self.qkv.weight, self.qkv.bias_value(), self.out.weight, self.out.bias_value(), *norms_)


class Block(nnx.Module):
    """Pre-norm residual block: `x + attention(norm(x))`, then `x + mlp(norm(x))`, norm and MLP as the spec names.

    With the spec's `post_norms`, each branch's output is normalised again before it is added (Gemma's
    `x + post_norm(attention(norm(x)))`).
    """

    def __init__(self, config: ModelConfig, attention: Attention, dtype, *, weights: str | None,
                 rngs: nnx.Rngs | None):
        norm = functools.partial(NORM_LAYERS[config.block.norm], config.hidden_size, config.norm_eps, dtype)
        self.attention_norm = norm()
        self.attention = attention
        self.mlp_norm = norm()
        self.mlp = MLP_LAYERS[config.block.mlp](config, dtype, weights=weights, rngs=rngs)
        post = config.block.post_norms
        self.attention_post_norm, self.mlp_post_norm = (norm(), norm()) if post else (None, None)

    def forward(self, x, attend):
        h = attend(self.attention_norm(x))
        x = x + (h if self.attention_post_norm is None else self.attention_post_norm(h))
        h = self.mlp(self.mlp_norm(x))
        return x + (h if self.mlp_post_norm is None else self.mlp_post_norm(h))


class CausalLM(nnx.Module):
    """A decoder-only language model whose attention layers carry kvattn's KV caches.

    Args:
      config: the model's sizes and options.
      max_len: cache capacity per sequence (prompt plus new tokens).
      batch_size: sequences decoded together.
      dtype: computation dtype (float32 or bfloat16), and the weights' unless
        `weights` says otherwise.
      weights: None for float weights in `dtype`; `"int8"`: every
        projection (and a tied embedding table) in int8 with per-output
        float32 scales, its dots int8 by int8 (`kvattn.math.quant`), an
        untied embedding table, only ever gathered, staying float;
        `"int4"`: the same with 4-bit values and a bfloat16 scale per
        group of 32 inputs (`kvattn.math.int4`);
        `"bfloat16"`: every weight matrix (and the embedding table) stored
        in bfloat16 while the model computes in `dtype`, each dot widening
        the weights exactly (a bfloat16 checkpoint's values, at half the
        bytes of float32). Float32 and bfloat16 kernels (and a tied table,
        the head's) are stored as panels where
        `kvattn.kernels.route.use_panels` says kvattn's dot of that dtype runs.
      cache_dtype: the caches' storage (see `kvattn.MultiHeadAttention`).
      num_pages, page_size: a paged cache per layer (see
        `kvattn.MultiHeadAttention`); `batch_size` then counts the sequence
        slots, and a sliding window frees pages instead of using a ring.
      spare_slots: slots each sliding layer's ring keeps past its window
        (`kvattn.Contiguous`), so `truncate` rolls it back `spare_slots + 1`
        tokens: speculative decoding of K drafts needs `K - 1`.
      rngs: random initial weights (LeCun normal); without, zeros
        (`from_pretrained` overwrites every value).
    """

    def __init__(self, config: ModelConfig, *, max_len: int, batch_size: int = 1, dtype=jnp.float32,
                 weights: str | None = None, cache_dtype=None, num_pages: int | None = None,
                 page_size: int | None = None, spare_slots: int = 0, rngs: nnx.Rngs | None = None):
        block = config.block
        learned = block.positions == "learned"
        if learned and isinstance(max_len, (int, np.integer)) and max_len > config.max_position_embeddings:
            raise ValueError(
                f"max_len={max_len} exceeds the {config.max_position_embeddings} learned positions of this "
                f"{config.family} model (max_position_embeddings): it cannot place a token past them"
            )
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {list(WEIGHTS)}, got {weights!r}")
        self.config = config
        self.dtype = dtype = jnp.dtype(dtype)
        hidden, vocab = config.hidden_size, config.vocab_size
        # A tied table is the head's kernel `(D, V)`, in the form a projection of it would take (`table_form`).
        self.embed_form = table_form(vocab, hidden, dtype, weights=weights, tied=config.tie_embeddings)
        self.embed_dtype = storage_dtype(dtype, weights)
        if rngs is None:
            table = self.embed_form.blank((hidden,), (vocab,), self.embed_dtype)
        else:
            table = self.embed_form.from_float(initial((vocab, hidden), 1, rngs).T, (vocab,), self.embed_dtype)
        main, scale = table.stored()
        self.embed = nnx.Param(jnp.asarray(main))
        self.embed_scale = None if scale is None else nnx.Param(jnp.asarray(scale))
        self.positions = (
            nnx.Param(initial((config.max_position_embeddings, hidden), 1, rngs).astype(dtype)) if learned else None
        )
        biased = (("query", "key", "value") if config.attention_bias else ()) + (("out",) if block.out_bias else ())
        qk_norm = ("rms_offset" if block.norm == "rms_offset" else "rms") if config.qk_norm else False

        @functools.cache  # layers alike share one config (and so one compiled program per shape)
        def attention(window: int | None, rope) -> AttentionConfig:
            # Heads-major caches (and pages): a step's attention is then a plain batched dot over (B, K)
            # that reads the cache in place; slots-major would cost K times the flops (see kvattn.math.ops).
            # Measured with tools/model_floor.py: 53.0 -> 43.0 ms/token at B=8, 19.0 -> 17.8 at B=1.
            capacity = {"window": window, "spare_slots": spare_slots} if window else {"max_len": max_len}
            if num_pages is not None:
                capacity = {"max_len": max_len, "window": window, "num_pages": num_pages, "page_size": page_size}
            return AttentionConfig(
                config.num_heads, hidden, head_dim=config.head_dim, num_kv_heads=config.num_kv_heads,
                batch_size=batch_size, use_bias=biased, rope=rope, normalize_qk=qk_norm, qk_norm_eps=config.norm_eps,
                logit_softcap=config.attn_logit_softcap, query_scale=config.query_scale, dtype=dtype,
                param_dtype=dtype, cache_dtype=cache_dtype or dtype, cache_layout="heads_major", **capacity,
            )

        def window(layer: int) -> int | None:
            slides = config.sliding(layer) and config.sliding_window < max_len
            return config.sliding_window if slides else None

        self.blocks = nnx.List([
            # longrope's set is the model's, by its max_len, whatever each layer's cache holds (a ring of a window).
            Block(config, Attention(attention(window(i), _for_length(config.layer_rope(i), max_len)), weights=weights,
                                    rngs=rngs), dtype,
                  weights=weights, rngs=rngs)
            for i in range(config.num_layers)
        ])
        self.final_norm = NORM_LAYERS[block.norm](hidden, config.norm_eps, dtype)
        self.lm_head = None if config.tie_embeddings else Linear(
            (hidden,), (vocab,), bias=False, dtype=dtype, weights=weights, rngs=rngs
        )

    @classmethod
    def shapes_only(cls, config: ModelConfig, **kwargs) -> CausalLM:
        """A `CausalLM(config, **kwargs)` whose parameters are shapes, holding no memory, until `load_weight`
        stores each (`from_pretrained` stores all of them); its caches are built, zeroed.

        A loader that built the model first would hold its initial weights
        beside the ones it reads, the largest of them twice at the moment one
        replaces the other.
        """
        model = nnx.eval_shape(lambda: cls(config, **kwargs))
        for block in model.blocks:
            block.attention._build_cache()  # the layer's own cache builder, now with arrays
        return model

    def load_weight(self, path: str, value) -> None:
        """Stores a float weight at a parameter path, in this model's form: its dtype, or int8 with scales.

        Args:
          path: the parameter as `nnx.state` names it, e.g.
            `"blocks/0/mlp/down/kernel"`.
          value: a float array in the layout the parameter has without
            `weights="int8"`.

        Raises:
          ValueError: `value` has another shape than the parameter.
        """
        owner, name = self._owner(path)
        variable = getattr(owner, name)
        want = tuple(variable.shape)
        if isinstance(owner, Linear) and name == "kernel":
            want = owner.kernel_shape()
        elif owner is self and name == "embed":
            want = (self.config.vocab_size, self.config.hidden_size)
        if tuple(np.shape(value)) != want:
            raise ValueError(f"{path} holds shape {want}, got a weight of shape {tuple(np.shape(value))}")
        if isinstance(owner, Linear) and name == "kernel":
            owner.load_kernel(value)
        elif owner is self and name == "embed":
            value = value if hasattr(value, "T") else np.asarray(value)
            main, scale = stored_form(self.embed_form, value.T, (self.config.vocab_size,), self.embed_dtype).stored()
            self.embed.set_value(jax.device_put(main))
            if scale is not None:
                self.embed_scale.set_value(jax.device_put(scale))
        else:
            variable.set_value(jnp.asarray(np.asarray(value), variable.dtype))

    def weight_value(self, path: str) -> jax.Array:
        """The weight at a parameter path in the layout `load_weight` takes, whatever form stores it.

        A projection's kernel comes back `(*inputs, *outputs)` and the
        embedding table `(V, D)` in float (panels laid back, int8
        dequantized); every other parameter as it is stored.
        """
        owner, name = self._owner(path)
        if isinstance(owner, Linear) and name == "kernel":
            return owner.float_kernel()
        if owner is self and name == "embed":
            return self.table.to_float().T
        return getattr(owner, name)[...]

    def _owner(self, path: str) -> tuple[nnx.Module, str]:
        """The module holding a parameter path, e.g. `"blocks/0/mlp/down/kernel"`, and the parameter's name."""
        *parents, name = path.split("/")
        owner = self
        for part in parents:
            owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
        return owner, name

    @property
    def cache_config(self) -> AttentionConfig:
        """The attention config of the layer whose cache holds the fewest tokens, which bounds the model's.

        Every layer shares the batch size and the cache's spec but for its
        window: with some layers sliding (a ring of `window` slots, whose
        capacity is unbounded), it is a full-attention layer's.
        """
        return min((block.attention.config for block in self.blocks), key=lambda config: config.capacity)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None for full attention), in layer order."""
        return tuple(block.attention.config.window for block in self.blocks)

    @property
    def pos(self) -> jax.Array:
        """Tokens each sequence holds, `(B,)` (every layer's cache agrees)."""
        return self.blocks[0].attention.pos[...]

    @property
    def table(self) -> quant.Form:
        """The embedding table in its form (`embed_form`): the head's kernel `(D, V)` when tied."""
        scale = None if self.embed_scale is None else self.embed_scale[...]
        return self.embed_form.from_stored(self.embed[...], scale, (self.config.vocab_size,))

    def _embed(self, tokens, positions):
        x = self.table.rows(tokens, self.dtype)
        if self.config.block.scale_embeddings:
            x = x * jnp.asarray(math.sqrt(self.config.hidden_size), x.dtype)
        if self.positions is not None:
            x = x + jnp.take(self.positions[...], positions, axis=0)
        return x

    def _logits(self, x):
        x = self.final_norm(x)
        logits = self.lm_head(x) if self.lm_head is not None else dots.dense(x, self.table)
        logits = logits.astype(jnp.float32)
        cap = self.config.final_logit_softcap
        return logits if cap is None else jnp.tanh(logits / jnp.float32(cap)) * jnp.float32(cap)

    def _tokens(self, tokens, shape, lengths=None):
        """`(tokens, valid)`: checked ids (eagerly it raises; traced, bad ids become 0), the rows without a bad one."""
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

    def step(self, tokens, active=None, *, pages=None, head=True):
        """Appends one token per sequence `(B,)` int: logits `(B, V)`.

        `head=False` skips the head: the logits are then zeros. `generate`
        passes False for its last token, which it appends to the caches but
        whose logits nothing reads.

        Raises:
          ValueError: `head` is not a Python bool (it picks the program).
        """
        if not isinstance(head, bool):
            raise ValueError(f"head must be True or False, got {head!r}")
        tokens, valid = self._tokens(tokens, (None,))
        if valid is not None:  # a sequence with a bad id writes nothing
            active = valid if active is None else active & valid
        x = self._embed(tokens, self.pos if pages is None else jnp.asarray(pages.pos))
        for block in self.blocks:
            x = block.forward(x, lambda h, attention=block.attention: attention.step(h, active, pages=pages))
        logits = self._logits(x) if head else jnp.zeros((*x.shape[:-1], self.config.vocab_size), jnp.float32)
        return self._poison(logits, valid)

    def mixed(self, tokens, active, chunks, lengths, *, pages):
        """One token for each of `B` decoding sequences and a prefill chunk for each of `C` others, in one call
        (a paged model): `(logits (B, V), last logits (C, V))`.

        A serving step that decodes running requests while another's prompt
        is prefilled: every weight is read once for both, where a decode step
        and a prefill call would each read it. Each output equals what `step`
        and `prefill(..., last_only=True)` give apart.

        Args:
          tokens: int `(B,)`: each decoding sequence's next token.
          active: bool `(B,)`: inactive rows write nothing (their logits are not to be read).
          chunks: int `(C, T)`, right-padded: each prefilling sequence's next tokens.
          lengths: int `(C,)`: the real tokens of each chunk.
          pages: the call's `PageBatch`: `B + C` rows, the decoding sequences' first.
        """
        tokens, valid = self._tokens(tokens, (None,))
        chunks, chunks_valid = self._tokens(chunks, (None, None))
        decoding, (prefilling, width) = tokens.shape[0], chunks.shape
        active = check.mask(self.cache_config, active, "active", decoding)
        lengths = jnp.asarray(check.ints(lengths, "lengths", ((prefilling,),), 0, width))
        if valid is not None:  # a sequence with a bad id writes nothing
            active = active & valid
        if chunks_valid is not None:
            lengths = jnp.where(chunks_valid, lengths, 0)
        row_lengths = jnp.concatenate([active.astype(jnp.int32), lengths])
        pos = jnp.asarray(pages.pos)
        positions = jnp.concatenate([pos[:decoding], (pos[decoding:, None] + jnp.arange(width)[None, :]).reshape(-1)])
        x = self._embed(jnp.concatenate([tokens, chunks.reshape(-1)]), positions)
        groups = ((decoding, 1), (prefilling, width))
        for block in self.blocks:
            x = block.forward(x, functools.partial(block.attention.ragged, lengths=row_lengths, groups=groups,
                                                   pages=pages))
        last = decoding + jnp.arange(prefilling) * width + jnp.maximum(lengths, 1) - 1
        logits = self._logits(jnp.concatenate([x[:decoding], x[last]]))
        return self._poison(logits[:decoding], valid), self._poison(logits[decoding:], chunks_valid)

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


def _for_length(rope, max_len):
    return None if rope is None else rope.for_length(max_len)
