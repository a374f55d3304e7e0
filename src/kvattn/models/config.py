"""One frozen config per decoder-only model, read from a Hugging Face `config.json`.

Two families: `"gpt2"` (learned positions, LayerNorm, GELU, tied
embeddings) and `"llama"` (RMSNorm, SwiGLU, rotary positions, grouped
queries), which covers Llama 2/3, Mistral (sliding window), Qwen2 (qkv
biases) and Qwen3 (per-head RMS QK-norm, explicit `head_dim`, tied
embeddings). Anything else in a config that would change the computation is
refused by name.
"""

from __future__ import annotations

import dataclasses

from kvattn.rope import RoPE

__all__ = ["ModelConfig", "UnsupportedConfigError", "from_hf_config"]

_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedConfigError(ValueError):
    """A checkpoint's configuration asks for something kvattn.models does not implement."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The sizes and options of a decoder-only model (see the module docstring for the families)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    tie_embeddings: bool
    max_position_embeddings: int
    rope: RoPE | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None


def _get(config: dict, key: str, default=None):
    value = config.get(key, default)
    if value is None and default is None:
        raise UnsupportedConfigError(f"config.json lacks {key!r}, which a {config.get('model_type')} model needs")
    return value


def _refuse(config: dict, key: str, allowed) -> None:
    value = config.get(key)
    if value is not None and value not in allowed:
        raise UnsupportedConfigError(
            f"config.json has {key}={value!r}; kvattn.models supports {key} in {sorted(map(repr, allowed))}"
        )


def from_hf_config(config: dict) -> ModelConfig:
    """A `ModelConfig` from a Hugging Face `config.json` (as a dict); refuses what it cannot run."""
    model_type = config.get("model_type")
    if model_type == "gpt2":
        _refuse(config, "activation_function", ("gelu_new",))
        if config.get("scale_attn_by_inverse_layer_idx") or config.get("reorder_and_upcast_attn"):
            raise UnsupportedConfigError("config.json asks for GPT-2 attention variants kvattn.models does not run")
        if config.get("scale_attn_weights") is False:
            raise UnsupportedConfigError("config.json has scale_attn_weights=False; kvattn scales by 1/sqrt(head_dim)")
        hidden = _get(config, "n_embd")
        heads = _get(config, "n_head")
        return ModelConfig(
            family="gpt2", vocab_size=_get(config, "vocab_size"), hidden_size=hidden,
            num_layers=_get(config, "n_layer"), num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
            intermediate_size=config.get("n_inner") or 4 * hidden, norm_eps=_get(config, "layer_norm_epsilon", 1e-5),
            tie_embeddings=config.get("tie_word_embeddings", True), max_position_embeddings=_get(config, "n_positions"),
            attention_bias=True,
        )
    if model_type not in _LLAMA_TYPES:
        raise UnsupportedConfigError(
            f"config.json has model_type={model_type!r}; kvattn.models supports gpt2 and {list(_LLAMA_TYPES)}"
        )
    _refuse(config, "hidden_act", ("silu",))
    if config.get("mlp_bias"):
        raise UnsupportedConfigError("config.json has mlp_bias=True; kvattn.models runs bias-free Llama MLPs")
    if config.get("pretraining_tp", 1) != 1:
        raise UnsupportedConfigError(f"config.json has pretraining_tp={config['pretraining_tp']}; only 1 is supported")
    heads = _get(config, "num_attention_heads")
    hidden = _get(config, "hidden_size")
    # transformers 5 writes `rope_parameters` (theta inside); earlier versions `rope_theta` + `rope_scaling`.
    parameters = dict(config.get("rope_parameters") or {})
    theta = parameters.pop("rope_theta", None) or config.get("rope_theta", 10000.0)
    rotary = parameters.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor")
    scaling = parameters if parameters.get("rope_type", "default") != "default" else config.get("rope_scaling")
    sliding = None
    if model_type == "mistral" or (model_type in ("qwen2", "qwen3") and config.get("use_sliding_window")):
        sliding = config.get("sliding_window")
        if model_type != "mistral" and config.get("max_window_layers", 0) < _get(config, "num_hidden_layers"):
            raise UnsupportedConfigError("config.json slides the window on only some layers (max_window_layers)")
    head_dim = config.get("head_dim") or hidden // heads
    return ModelConfig(
        family="llama", vocab_size=_get(config, "vocab_size"), hidden_size=hidden,
        num_layers=_get(config, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim,
        intermediate_size=_get(config, "intermediate_size"), norm_eps=_get(config, "rms_norm_eps", 1e-6),
        tie_embeddings=config.get("tie_word_embeddings", False),
        max_position_embeddings=_get(config, "max_position_embeddings"),
        rope=RoPE(theta=theta, scaling=scaling,
                  rotary_dim=None if rotary in (None, 1.0) else int(head_dim * rotary)),
        attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type == "qwen3", sliding_window=sliding,
    )
