"""The Llama family: RMSNorm, a gated SiLU MLP, rotary positions, grouped queries.

It covers Llama 2/3 (llama3 rotary scaling), Mistral (a sliding window),
Qwen2 (query, key and value biases) and Qwen3 (per-head RMS QK-norm, an
explicit `head_dim`, a tied head): one block, and each `model_type`'s
defaults read from its `config.json` here. The checkpoint stores torch
`Linear` weights `(out, in)`, transposed on loading; its query, key and
value projections fill the three parts of `attention/qkv` along its heads
axis, its gate and up projections the two halves of `mlp/gate_up`.
"""

from __future__ import annotations

from kvattn.errors import UnsupportedConfigError
from kvattn.models.hf_config import divide, positive_int, read, refuse
from kvattn.models.spec import BlockSpec, Family
from kvattn.models.table import Part, Row, transpose
from kvattn.config import RoPE

__all__ = ["BLOCK", "FAMILY", "TABLE", "translate"]


def translate(config: dict) -> dict:
    """A Llama, Mistral, Qwen2 or Qwen3 `config.json` as `ModelConfig` fields; refuses what kvattn does not run."""
    model_type = config.get("model_type")
    refuse(config, "hidden_act", ("silu",))
    if config.get("mlp_bias"):
        raise UnsupportedConfigError("config.json has mlp_bias=True; kvattn.models runs bias-free Llama MLPs")
    if config.get("pretraining_tp", 1) != 1:
        raise UnsupportedConfigError(f"config.json has pretraining_tp={config['pretraining_tp']}; only 1 is supported")
    heads = read(config, "num_attention_heads")
    head_dim = config.get("head_dim")
    if head_dim is None:
        head_dim = divide(config, "hidden_size", "num_attention_heads")
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
        rotary_dim = int(positive_int("head_dim", head_dim) * rotary)
    sliding = None
    if model_type == "mistral" or (model_type in ("qwen2", "qwen3") and config.get("use_sliding_window")):
        sliding = config.get("sliding_window")
        if model_type != "mistral" and config.get("max_window_layers", 0) < read(config, "num_hidden_layers"):
            raise UnsupportedConfigError("config.json slides the window on only some layers (max_window_layers)")
    try:
        rope = RoPE(theta=theta, scaling=scaling, rotary_dim=rotary_dim)
    except (TypeError, ValueError) as error:
        raise UnsupportedConfigError(f"config.json has rope settings kvattn cannot use: {error}") from None
    return {
        "vocab_size": read(config, "vocab_size"), "hidden_size": read(config, "hidden_size"),
        "num_layers": read(config, "num_hidden_layers"), "num_heads": heads,
        "num_kv_heads": heads if config.get("num_key_value_heads") is None else config["num_key_value_heads"],
        "head_dim": head_dim, "intermediate_size": read(config, "intermediate_size"),
        "norm_eps": read(config, "rms_norm_eps", 1e-6), "tie_embeddings": config.get("tie_word_embeddings", False),
        "max_position_embeddings": read(config, "max_position_embeddings"), "rope": rope,
        # Qwen2 biases its query, key and value projections unless told otherwise; Qwen3 normalizes them per head.
        "attention_bias": config.get("attention_bias", model_type == "qwen2"), "qk_norm": model_type == "qwen3",
        "sliding_window": sliding,
    }


BLOCK = BlockSpec(norm="rms", mlp="gated_silu", positions="rotary", out_bias=False, mlp_bias=False)


def _heads_in(heads: str):
    """torch `Linear` `(heads * H, D)` -> `(D, heads, H)`; `heads` names the config field."""
    return lambda w, c: (w.T.reshape(c.hidden_size, getattr(c, heads), c.head_dim),)


def _heads_bias(heads: str):
    return lambda b, c: (b.reshape(getattr(c, heads), c.head_dim),)


def _heads_out(w, config):
    """torch `Linear` `(D, N * H)` -> `(N, H, D)`."""
    return (w.T.reshape(config.num_heads, config.head_dim, config.hidden_size),)


def _untied(config):
    return not config.tie_embeddings


def _biased(config):
    return config.attention_bias


def _qk_norm(config):
    return config.qk_norm


_ATTENTION = "blocks/{i}/attention/"


def _qkv(param: str, index: int) -> Part:
    """Query (0), key (1) or value (2) heads along the heads axis of `qkv`.

    The kernel is `(D, N + 2K, H)`, the bias `(N + 2K, H)`.
    """
    return Part(_ATTENTION + "qkv/" + param, 1 if param == "kernel" else 0, ("N", "K", "K"), index)


def _gate_up(index: int) -> Part:
    """Gate (0) or up (1) along the features of `gate_up` `(D, 2I)`."""
    return Part("blocks/{i}/mlp/gate_up/kernel", 1, ("I", "I"), index)


TABLE = (
    Row("embed_tokens.weight", ("embed",), ("V", "D")),
    Row("norm.weight", ("final_norm/weight",), ("D",)),
    Row("lm_head.weight", ("lm_head/kernel",), ("V", "D"), transpose, when=_untied),
    Row("layers.{i}.input_layernorm.weight", ("blocks/{i}/attention_norm/weight",), ("D",)),
    Row("layers.{i}.post_attention_layernorm.weight", ("blocks/{i}/mlp_norm/weight",), ("D",)),
    Row("layers.{i}.self_attn.q_proj.weight", (_qkv("kernel", 0),), ("Q", "D"), _heads_in("num_heads")),
    Row("layers.{i}.self_attn.k_proj.weight", (_qkv("kernel", 1),), ("KV", "D"), _heads_in("num_kv_heads")),
    Row("layers.{i}.self_attn.v_proj.weight", (_qkv("kernel", 2),), ("KV", "D"), _heads_in("num_kv_heads")),
    Row("layers.{i}.self_attn.q_proj.bias", (_qkv("bias", 0),), ("Q",), _heads_bias("num_heads"), _biased),
    Row("layers.{i}.self_attn.k_proj.bias", (_qkv("bias", 1),), ("KV",), _heads_bias("num_kv_heads"), _biased),
    Row("layers.{i}.self_attn.v_proj.bias", (_qkv("bias", 2),), ("KV",), _heads_bias("num_kv_heads"), _biased),
    Row("layers.{i}.self_attn.o_proj.weight", (_ATTENTION + "out/kernel",), ("D", "Q"), _heads_out),
    Row("layers.{i}.self_attn.q_norm.weight", (_ATTENTION + "query_ln/scale",), ("H",), when=_qk_norm),
    Row("layers.{i}.self_attn.k_norm.weight", (_ATTENTION + "key_ln/scale",), ("H",), when=_qk_norm),
    Row("layers.{i}.mlp.gate_proj.weight", (_gate_up(0),), ("I", "D"), transpose),
    Row("layers.{i}.mlp.up_proj.weight", (_gate_up(1),), ("I", "D"), transpose),
    Row("layers.{i}.mlp.down_proj.weight", ("blocks/{i}/mlp/down/kernel",), ("D", "I"), transpose),
)

FAMILY = Family("llama", BLOCK, translate, "model.", TABLE)
