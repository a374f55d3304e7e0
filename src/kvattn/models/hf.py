"""Loading Hugging Face checkpoints (config.json + safetensors) into `DecoderLM`, without torch.

Weights are read with `safetensors.numpy` from `model.safetensors` or the
shards a `model.safetensors.index.json` lists, renamed and laid out for
kvattn: torch `Linear` weights `(out, in)` are transposed to `(in, out)`;
GPT-2's `Conv1D` weights are already `(in, out)`; attention projections are
split into heads (`(D, N, H)` for query/key/value, `(N, H, D)` for out).
Every tensor the model needs must be present with its expected shape, and
every tensor in the files must be used, or loading refuses by name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from kvattn.models.config import UnsupportedConfigError, from_hf_config
from kvattn.models.decoder import DecoderLM

__all__ = ["from_pretrained", "load_safetensors"]


def load_safetensors(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory: `model.safetensors`, or the shards its index lists."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")
    tensors = {}
    for file in files:
        tensors.update(safetensors.numpy.load_file(directory / file))
    return tensors


def from_pretrained(path: str | os.PathLike, *, max_len: int, batch_size: int = 1, dtype=None,
                    cache_dtype=None, num_pages: int | None = None, page_size: int | None = None) -> DecoderLM:
    """A `DecoderLM` holding a Hugging Face checkpoint's weights.

    Args:
      path: a directory with `config.json` and `model.safetensors` (or a
        sharded `model.safetensors.index.json`).
      max_len: cache capacity per sequence (prompt plus new tokens).
      batch_size: sequences decoded together.
      dtype: computation and weight dtype; defaults to float32.
      cache_dtype: the caches' storage; defaults to `dtype`.
      num_pages, page_size: paged caches instead of contiguous ones (see
        `DecoderLM` and `kvattn.models.serving`).

    Raises:
      UnsupportedConfigError: the configuration asks for something kvattn
        does not run (the message names the field and its value).
      ValueError: a tensor is missing, unexpected or of the wrong shape.
    """
    path = Path(path)
    config = from_hf_config(json.loads((path / "config.json").read_text()))
    dtype = jnp.dtype(dtype or jnp.float32)
    model = DecoderLM(config, max_len=max_len, batch_size=batch_size, dtype=dtype, cache_dtype=cache_dtype,
                      num_pages=num_pages, page_size=page_size, rngs=nnx.Rngs(0))
    tensors = load_safetensors(path)
    weights = (_gpt2 if config.family == "gpt2" else _llama)(config, tensors)
    unused = sorted(set(tensors) - set(_used(tensors, weights)))
    if unused:
        raise ValueError(f"checkpoint tensors kvattn.models does not know: {unused[:8]}{' ...' if len(unused) > 8 else ''}")
    # `nnx.state` hands out the model's own Variables: assigning to them loads the model.
    for key, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = "/".join(map(str, key))
        if name not in weights:
            raise ValueError(f"the checkpoint has no tensor for {name}")
        value = weights[name][1]
        if value.shape != variable[...].shape:
            raise ValueError(f"{name}: the checkpoint's {weights[name][0]} has shape {value.shape}, expected {variable[...].shape}")
        variable[...] = jnp.asarray(value, dtype)
    return model


def _used(tensors: dict, weights: dict) -> set[str]:
    used = {source for source, _ in weights.values()}
    return {name for name in tensors if name in used}


class _Mapping:
    """kvattn parameter path -> (checkpoint name, converted value), built with `put`."""

    def __init__(self, tensors: dict, prefix: str):
        self.tensors = tensors
        # Checkpoints name tensors with or without the base model's prefix ("model.", "transformer.").
        self.names = {name[len(prefix):] if name.startswith(prefix) else name: name for name in tensors}
        self.out: dict[str, tuple[str, np.ndarray]] = {}

    def put(self, target: str, source: str, convert=lambda a: a) -> None:
        if source not in self.names:
            raise ValueError(f"the checkpoint has no tensor {source!r} (for {target})")
        self.out[target] = (self.names[source], convert(self.tensors[self.names[source]]))


def _llama(config, tensors: dict) -> dict[str, tuple[str, np.ndarray]]:
    """kvattn parameter path -> (checkpoint name, value) for the Llama family."""
    mapping = _Mapping(tensors, "model.")
    put = mapping.put
    heads, kv_heads, head_dim, hidden = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size

    put("embed", "embed_tokens.weight")
    put("final_norm/weight", "norm.weight")
    if not config.tie_embeddings:
        put("lm_head", "lm_head.weight", lambda w: w.T)
    for i in range(config.num_layers):
        layer, block = f"layers.{i}.", f"blocks/{i}/"
        put(block + "attention_norm/weight", layer + "input_layernorm.weight")
        put(block + "mlp_norm/weight", layer + "post_attention_layernorm.weight")
        for target, source, count in (("query", "q_proj", heads), ("key", "k_proj", kv_heads), ("value", "v_proj", kv_heads)):
            put(f"{block}attention/{target}/kernel", f"{layer}self_attn.{source}.weight",
                lambda w, n=count: w.T.reshape(hidden, n, head_dim))
            if config.attention_bias:
                put(f"{block}attention/{target}/bias", f"{layer}self_attn.{source}.bias",
                    lambda b, n=count: b.reshape(n, head_dim))
        put(f"{block}attention/out/kernel", f"{layer}self_attn.o_proj.weight", lambda w: w.T.reshape(heads, head_dim, hidden))
        if config.qk_norm:
            put(f"{block}attention/query_ln/scale", f"{layer}self_attn.q_norm.weight")
            put(f"{block}attention/key_ln/scale", f"{layer}self_attn.k_norm.weight")
        for target, source in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            put(f"{block}mlp/{target}/kernel", f"{layer}mlp.{source}.weight", lambda w: w.T)
    return mapping.out


def _gpt2(config, tensors: dict) -> dict[str, tuple[str, np.ndarray]]:
    """kvattn parameter path -> (checkpoint name, value) for GPT-2 (Conv1D weights are `(in, out)`)."""
    mapping = _Mapping(tensors, "transformer.")
    put = mapping.put
    heads, head_dim, hidden = config.num_heads, config.head_dim, config.hidden_size

    put("embed", "wte.weight")
    put("positions", "wpe.weight")
    put("final_norm/weight", "ln_f.weight")
    put("final_norm/bias", "ln_f.bias")
    if not config.tie_embeddings:
        put("lm_head", "lm_head.weight", lambda w: w.T)
    for i in range(config.num_layers):
        layer, block = f"h.{i}.", f"blocks/{i}/"
        for target, source in (("attention_norm", "ln_1"), ("mlp_norm", "ln_2")):
            put(block + f"{target}/weight", layer + f"{source}.weight")
            put(block + f"{target}/bias", layer + f"{source}.bias")
        for part, target in enumerate(("query", "key", "value")):
            columns = slice(part * hidden, (part + 1) * hidden)
            put(f"{block}attention/{target}/kernel", f"{layer}attn.c_attn.weight",
                lambda w, c=columns: w[:, c].reshape(hidden, heads, head_dim))
            put(f"{block}attention/{target}/bias", f"{layer}attn.c_attn.bias",
                lambda b, c=columns: b[c].reshape(heads, head_dim))
        put(f"{block}attention/out/kernel", f"{layer}attn.c_proj.weight", lambda w: w.reshape(heads, head_dim, hidden))
        put(f"{block}attention/out/bias", f"{layer}attn.c_proj.bias")
        put(f"{block}mlp/up/kernel", f"{layer}mlp.c_fc.weight")
        put(f"{block}mlp/up/bias", f"{layer}mlp.c_fc.bias")
        put(f"{block}mlp/down/kernel", f"{layer}mlp.c_proj.weight")
        put(f"{block}mlp/down/bias", f"{layer}mlp.c_proj.bias")
    # GPT-2 checkpoints may keep non-parameter buffers (the causal mask) under attn.bias / attn.masked_bias.
    for name in tensors:
        if name.endswith(("attn.bias", "attn.masked_bias")):
            mapping.out[f"buffer:{name}"] = (name, tensors[name])
    return mapping.out



