"""The Llama family: RMSNorm, a gated SiLU MLP, rotary positions, grouped queries.

It covers Llama 2/3 (llama3 rotary scaling), Mistral (a sliding window),
Qwen2 (query, key and value biases) and Qwen3 (per-head RMS QK-norm, an
explicit `head_dim`, a tied head): one block, and each `model_type`'s
defaults read from its `config.json` here. The checkpoint stores torch
`Linear` weights `(out, in)`, transposed on loading; its query, key and
value projections fill the three parts of `attention/qkv` along its heads
axis, its gate and up projections the two halves of `mlp/gate_up`.

Phi-3 (`PHI3`) is the same block with its own table: its checkpoints store
the query, key and value projections fused as `qkv_proj` and the gate and
up projections as `gate_up_proj`, each split into the same parts on
loading. Its `longrope` scaling (Phi-3-128k, Phi-3.5) turns with one set
of factors per model, by its `max_len` (`kvattn.RoPE.long`); any rotary
scaling kvattn does not compute is refused (by `RoPE`).
"""

from __future__ import annotations

from kvattn.errors import UnsupportedConfigError
from kvattn.models.hf_config import divide, read, refuse, rope
from kvattn.models.spec import BlockSpec, Family
from kvattn.models.table import Part, Row, transpose

__all__ = ["BLOCK", "FAMILY", "PHI3", "PHI3_TABLE", "TABLE", "translate"]


def translate(config: dict) -> dict:
    """A Llama, Mistral, Qwen2 or Qwen3 `config.json` as `ModelConfig` fields; refuses what kvattn does not run."""
    model_type = config.get("model_type")
    refuse(config, "hidden_act", ("silu",))
    if config.get("mlp_bias"):
        raise UnsupportedConfigError("config.json has mlp_bias=True; kvattn.models runs bias-free Llama MLPs")
    if model_type == "phi3" and config.get("attention_bias"):
        raise UnsupportedConfigError("config.json has attention_bias=True; kvattn.models runs bias-free Phi-3 models")
    if config.get("pretraining_tp", 1) != 1:
        raise UnsupportedConfigError(f"config.json has pretraining_tp={config['pretraining_tp']}; only 1 is supported")
    heads = read(config, "num_attention_heads")
    head_dim = config.get("head_dim")
    if head_dim is None:
        head_dim = divide(config, "hidden_size", "num_attention_heads")
    sliding = None
    if model_type in ("mistral", "phi3") or (model_type in ("qwen2", "qwen3") and config.get("use_sliding_window")):
        sliding = config.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and config.get("max_window_layers", 0) < read(config, "num_hidden_layers"):
            raise UnsupportedConfigError("config.json slides the window on only some layers (max_window_layers)")
    return {
        "vocab_size": read(config, "vocab_size"), "hidden_size": read(config, "hidden_size"),
        "num_layers": read(config, "num_hidden_layers"), "num_heads": heads,
        "num_kv_heads": heads if config.get("num_key_value_heads") is None else config["num_key_value_heads"],
        "head_dim": head_dim, "intermediate_size": read(config, "intermediate_size"),
        "norm_eps": read(config, "rms_norm_eps", 1e-6), "tie_embeddings": config.get("tie_word_embeddings", False),
        "max_position_embeddings": read(config, "max_position_embeddings"), "rope": rope(config, head_dim),
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


def _fused_qkv(w, config):
    """torch `qkv_proj` `((N + 2K) * H, D)`: the query, key and value heads, each `(D, heads, H)`."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return (*_heads_in("num_heads")(w[:q], config), *_heads_in("num_kv_heads")(w[q : q + kv], config),
            *_heads_in("num_kv_heads")(w[q + kv :], config))


def _fused_gate_up(w, config):
    """torch `gate_up_proj` `(2I, D)`: the gate, then the up projection, each `(D, I)`."""
    return w[: config.intermediate_size].T, w[config.intermediate_size :].T


_FUSED = {"layers.{i}.self_attn.qkv_proj.weight": Row(
              "layers.{i}.self_attn.qkv_proj.weight", (_qkv("kernel", 0), _qkv("kernel", 1), _qkv("kernel", 2)),
              ("QKV", "D"), _fused_qkv),
          "layers.{i}.mlp.gate_up_proj.weight": Row(
              "layers.{i}.mlp.gate_up_proj.weight", (_gate_up(0), _gate_up(1)), ("2I", "D"), _fused_gate_up)}
_SPLIT = {"layers.{i}.self_attn.q_proj.weight": "layers.{i}.self_attn.qkv_proj.weight",
          "layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.gate_up_proj.weight"}
_DROPPED = {"layers.{i}.self_attn.k_proj.weight", "layers.{i}.self_attn.v_proj.weight",
            "layers.{i}.mlp.up_proj.weight", "layers.{i}.self_attn.q_norm.weight", "layers.{i}.self_attn.k_norm.weight",
            *(f"layers.{{i}}.self_attn.{name}_proj.bias" for name in "qkv")}

# Llama's table with the fused rows in place of the ones they fuse (Phi-3 has no attention biases nor QK-norm).
PHI3_TABLE = tuple(_FUSED[_SPLIT[row.source]] if row.source in _SPLIT else row for row in TABLE
                   if row.source not in _DROPPED)

PHI3 = Family("phi3", BLOCK, translate, "model.", PHI3_TABLE)
