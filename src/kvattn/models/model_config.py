"""One frozen config per decoder-only model, read from a Hugging Face `config.json`.

Two families: `"gpt2"` (learned positions, LayerNorm, GELU, tied
embeddings) and `"llama"` (RMSNorm, SwiGLU, rotary positions, grouped
queries), which covers Llama 2/3, Mistral (sliding window), Qwen2 (qkv
biases) and Qwen3 (per-head RMS QK-norm, explicit `head_dim`, tied
embeddings). Anything else in a config that would change the computation is
refused by name, and so is every size that is not a positive int, every
epsilon that is not a positive finite number, heads that do not divide, and
rotary settings whose frequencies are not finite: nothing is allocated from
a config before it has passed.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from kvattn.config import INT32_MAX
from kvattn.errors import UnsupportedConfigError
from kvattn.rope import RoPE, rope_tables

__all__ = ["ModelConfig", "from_hf_config"]

_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Far past any real model's (64-256), and small enough that checking the rotary
# frequencies of a config, before its weights are read, allocates next to nothing.
MAX_HEAD_DIM = 2**16
_FAMILIES = ("gpt2", "llama")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The sizes and options of a decoder-only model (see the module docstring for the families).

    Every field is checked on construction: sizes are positive ints,
    `num_heads` is a multiple of `num_kv_heads`, `norm_eps` is a positive
    finite float, and the rotary settings give finite frequencies for
    `head_dim`.
    """

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

    def __post_init__(self):
        if self.family not in _FAMILIES:
            raise UnsupportedConfigError(f"family must be one of {list(_FAMILIES)}, got {self.family!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        if self.head_dim > MAX_HEAD_DIM:
            raise UnsupportedConfigError(f"head_dim must be at most {MAX_HEAD_DIM}, got {self.head_dim}")
        if self.sliding_window is not None:
            object.__setattr__(self, "sliding_window", _positive_int("sliding_window", self.sliding_window))
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedConfigError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        eps = self.norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating)) or not 0 < eps < math.inf:
            raise UnsupportedConfigError(f"norm_eps must be a positive finite number, got {eps!r}")
        object.__setattr__(self, "norm_eps", float(eps))
        for name in ("tie_embeddings", "attention_bias", "qk_norm"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise UnsupportedConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
            object.__setattr__(self, name, bool(getattr(self, name)))
        if self.family == "gpt2" and self.rope is not None:
            raise UnsupportedConfigError("gpt2 models use learned positions, not rope")
        if self.rope is not None:
            try:
                inv_freq, attention_factor, _ = rope_tables(self.rope, self.head_dim)
            except (ValueError, ArithmeticError) as error:
                raise UnsupportedConfigError(f"rope settings {self.rope.to_json()} are not valid: {error}") from None
            if not (np.isfinite(inv_freq).all() and (inv_freq > 0).all() and math.isfinite(attention_factor)):
                raise UnsupportedConfigError(
                    f"rope settings {self.rope.to_json()} give non-finite or non-positive frequencies for "
                    f"head_dim={self.head_dim}"
                )


def _positive_int(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not 1 <= value <= INT32_MAX:
        raise UnsupportedConfigError(f"{name} must be a positive int of at most {INT32_MAX}, got {value!r}")
    return int(value)


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


def _divide(config: dict, size_key: str, heads_key: str) -> int:
    """`config[size_key] // config[heads_key]`, refused unless both are positive ints and it divides."""
    size, heads = _positive_int(size_key, _get(config, size_key)), _positive_int(heads_key, _get(config, heads_key))
    if size % heads:
        raise UnsupportedConfigError(f"config.json has {size_key}={size}, not a multiple of {heads_key}={heads}")
    return size // heads


def from_hf_config(config: dict) -> ModelConfig:
    """A `ModelConfig` from a Hugging Face `config.json` (as a dict); refuses what it cannot run or is not valid."""
    if not isinstance(config, dict):
        raise UnsupportedConfigError(f"config.json must hold a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type == "gpt2":
        _refuse(config, "activation_function", ("gelu_new",))
        if config.get("scale_attn_by_inverse_layer_idx") or config.get("reorder_and_upcast_attn"):
            raise UnsupportedConfigError("config.json asks for GPT-2 attention variants kvattn.models does not run")
        if config.get("scale_attn_weights") is False:
            raise UnsupportedConfigError("config.json has scale_attn_weights=False; kvattn scales by 1/sqrt(head_dim)")
        hidden = _get(config, "n_embd")
        inner = config.get("n_inner")
        return ModelConfig(
            family="gpt2", vocab_size=_get(config, "vocab_size"), hidden_size=hidden,
            num_layers=_get(config, "n_layer"), num_heads=_get(config, "n_head"), num_kv_heads=_get(config, "n_head"),
            head_dim=_divide(config, "n_embd", "n_head"),
            intermediate_size=4 * _positive_int("n_embd", hidden) if inner is None else inner,
            norm_eps=_get(config, "layer_norm_epsilon", 1e-5),
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
    head_dim = config.get("head_dim")
    if head_dim is None:
        head_dim = _divide(config, "hidden_size", "num_attention_heads")
    # transformers 5 writes `rope_parameters` (theta inside); earlier versions `rope_theta` + `rope_scaling`.
    parameters = config.get("rope_parameters") or {}
    if not isinstance(parameters, dict):
        raise UnsupportedConfigError(f"config.json has rope_parameters={parameters!r}; expected an object")
    parameters = dict(parameters)
    theta = parameters.pop("rope_theta", None)
    theta = config.get("rope_theta", 10000.0) if theta is None else theta
    rotary = parameters.pop("partial_rotary_factor", None)
    rotary = config.get("partial_rotary_factor") if rotary is None else rotary
    scaling = parameters if parameters.get("rope_type", "default") != "default" else config.get("rope_scaling")
    rotary_dim = None
    if rotary is not None and rotary != 1.0:
        if isinstance(rotary, bool) or not isinstance(rotary, (int, float)) or not 0 < rotary <= 1:
            raise UnsupportedConfigError(
                f"config.json has partial_rotary_factor={rotary!r}; expected a number in (0, 1]"
            )
        rotary_dim = int(_positive_int("head_dim", head_dim) * rotary)
    sliding = None
    if model_type == "mistral" or (model_type in ("qwen2", "qwen3") and config.get("use_sliding_window")):
        sliding = config.get("sliding_window")
        if model_type != "mistral" and config.get("max_window_layers", 0) < _get(config, "num_hidden_layers"):
            raise UnsupportedConfigError("config.json slides the window on only some layers (max_window_layers)")
    try:
        rope = RoPE(theta=theta, scaling=scaling, rotary_dim=rotary_dim)
    except (TypeError, ValueError) as error:
        raise UnsupportedConfigError(f"config.json has rope settings kvattn cannot use: {error}") from None
    return ModelConfig(
        family="llama", vocab_size=_get(config, "vocab_size"), hidden_size=_get(config, "hidden_size"),
        num_layers=_get(config, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=heads if config.get("num_key_value_heads") is None else config["num_key_value_heads"],
        head_dim=head_dim,
        intermediate_size=_get(config, "intermediate_size"), norm_eps=_get(config, "rms_norm_eps", 1e-6),
        tie_embeddings=config.get("tie_word_embeddings", False),
        max_position_embeddings=_get(config, "max_position_embeddings"),
        rope=rope,
        attention_bias=config.get("attention_bias", model_type == "qwen2"),
        qk_norm=model_type == "qwen3", sliding_window=sliding,
    )
