"""GPT-2: learned positions, LayerNorm, a GELU MLP, biases on every projection, a tied head by default.

The checkpoint stores `Conv1D` weights, already `(in, out)`, and the query,
key and value projections fused as `c_attn`.
"""

from __future__ import annotations

from kvattn.errors import UnsupportedConfigError
from kvattn.models.hf_config import divide, positive_int, read, refuse
from kvattn.models.spec import BlockSpec, Family
from kvattn.models.table import Row, transpose

__all__ = ["BLOCK", "FAMILY", "TABLE", "translate"]


def translate(config: dict) -> dict:
    """A GPT-2 `config.json` as `ModelConfig` fields; refuses the attention variants kvattn does not run."""
    refuse(config, "activation_function", ("gelu_new",))
    if config.get("scale_attn_by_inverse_layer_idx") or config.get("reorder_and_upcast_attn"):
        raise UnsupportedConfigError("config.json asks for GPT-2 attention variants kvattn.models does not run")
    if config.get("scale_attn_weights") is False:
        raise UnsupportedConfigError("config.json has scale_attn_weights=False; kvattn scales by 1/sqrt(head_dim)")
    hidden = read(config, "n_embd")
    inner = config.get("n_inner")
    return {
        "vocab_size": read(config, "vocab_size"), "hidden_size": hidden, "num_layers": read(config, "n_layer"),
        "num_heads": read(config, "n_head"), "num_kv_heads": read(config, "n_head"),
        "head_dim": divide(config, "n_embd", "n_head"),
        "intermediate_size": 4 * positive_int("n_embd", hidden) if inner is None else inner,
        "norm_eps": read(config, "layer_norm_epsilon", 1e-5), "tie_embeddings": config.get("tie_word_embeddings", True),
        "max_position_embeddings": read(config, "n_positions"), "attention_bias": True,
    }


BLOCK = BlockSpec(norm="layer", mlp="gelu", positions="learned", out_bias=True, mlp_bias=True)


def _conv_qkv(w, config):
    """The fused `c_attn` `(D, 3 * N * H)` -> `(D, 3N, H)`: query, key and value heads side by side."""
    return (w.reshape(config.hidden_size, 3 * config.num_heads, config.head_dim),)


def _qkv_bias(b, config):
    return (b.reshape(3 * config.num_heads, config.head_dim),)


def _conv_heads_out(w, config):
    """`Conv1D` `(N * H, D)` -> `(N, H, D)`."""
    return (w.reshape(config.num_heads, config.head_dim, config.hidden_size),)


def _untied(config):
    return not config.tie_embeddings


def _biased(config):
    return config.attention_bias


_ATTENTION = "blocks/{i}/attention/"

TABLE = (
    Row("wte.weight", ("embed",), ("V", "D")),
    Row("wpe.weight", ("positions",), ("P", "D")),
    Row("ln_f.weight", ("final_norm/weight",), ("D",)),
    Row("ln_f.bias", ("final_norm/bias",), ("D",)),
    Row("lm_head.weight", ("lm_head/kernel",), ("V", "D"), transpose, when=_untied),
    Row("h.{i}.ln_1.weight", ("blocks/{i}/attention_norm/weight",), ("D",)),
    Row("h.{i}.ln_1.bias", ("blocks/{i}/attention_norm/bias",), ("D",)),
    Row("h.{i}.attn.c_attn.weight", (_ATTENTION + "qkv/kernel",), ("D", "3Q"), _conv_qkv),
    Row("h.{i}.attn.c_attn.bias", (_ATTENTION + "qkv/bias",), ("3Q",), _qkv_bias, _biased),
    Row("h.{i}.attn.c_proj.weight", (_ATTENTION + "out/kernel",), ("Q", "D"), _conv_heads_out),
    Row("h.{i}.attn.c_proj.bias", (_ATTENTION + "out/bias",), ("D",)),
    Row("h.{i}.ln_2.weight", ("blocks/{i}/mlp_norm/weight",), ("D",)),
    Row("h.{i}.ln_2.bias", ("blocks/{i}/mlp_norm/bias",), ("D",)),
    Row("h.{i}.mlp.c_fc.weight", ("blocks/{i}/mlp/up/kernel",), ("D", "I")),
    Row("h.{i}.mlp.c_fc.bias", ("blocks/{i}/mlp/up/bias",), ("I",)),
    Row("h.{i}.mlp.c_proj.weight", ("blocks/{i}/mlp/down/kernel",), ("I", "D")),
    Row("h.{i}.mlp.c_proj.bias", ("blocks/{i}/mlp/down/bias",), ("D",)),
    # Non-parameter buffers some GPT-2 checkpoints keep (the causal mask): allowed, never read.
    Row("h.{i}.attn.bias", (), None, optional=True),
    Row("h.{i}.attn.masked_bias", (), None, optional=True),
)

FAMILY = Family("gpt2", BLOCK, translate, "transformer.", TABLE)
