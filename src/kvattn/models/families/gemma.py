"""The Gemma 2 and Gemma 3 families: Llama's projections in a block of four `(1 + w)` RMSNorms and GeGLU.

What sets them apart from Llama, each a field of the block spec or the
config: every norm scales by `1 + weight` in float32 (`"rms_offset"`),
attention's and the MLP's outputs are normalised again before each residual
add (`post_norms`), the embedded tokens are multiplied by
`sqrt(hidden_size)`, the MLP gates with tanh GELU, the logits' scale is
`query_pre_attn_scalar ** -0.5`, and layers alternate between a sliding
window and full attention (`layer_types`: Gemma 2 every other layer, Gemma
3 five of six). Gemma 2 soft-caps the attention and the output logits;
Gemma 3 instead normalises queries and keys per head (with `1 + w` too) and
rotates its sliding layers with their own base (`local_rope`). Both tie
the output projection to the embedding.

`model_type` `"gemma2"` and `"gemma3_text"` (`Gemma3ForCausalLM`, the 1B
model and every text-only checkpoint); the multimodal `"gemma3"` is refused
by the registry.
"""

from __future__ import annotations

from kvattn.errors import UnsupportedConfigError
from kvattn.models.families import llama
from kvattn.models.hf_config import read, refuse, rope
from kvattn.models.spec import BlockSpec, Family
from kvattn.models.table import Row

__all__ = ["BLOCK", "FAMILY", "TABLE", "translate"]

# Every other layer slides in Gemma 2 (the first does), five of each six in Gemma 3 (transformers' defaults).
_PATTERN = {"gemma2": 2, "gemma3_text": 6}


def _layer_types(config: dict, num_layers: int) -> tuple[str, ...]:
    types = config.get("layer_types")
    if types is None:
        pattern = config.get("sliding_window_pattern", _PATTERN[config["model_type"]])
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise UnsupportedConfigError(f"config.json has sliding_window_pattern={pattern!r}; expected an int >= 1")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    return tuple(types) if isinstance(types, list) else types


def translate(config: dict) -> dict:
    """A Gemma 2 or Gemma 3 (text) `config.json` as `ModelConfig` fields; refuses what kvattn does not run."""
    model_type = config["model_type"]
    for key in ("hidden_activation", "hidden_act"):
        refuse(config, key, ("gelu_pytorch_tanh",))
    for key in ("attention_bias", "use_bidirectional_attention"):
        if config.get(key):
            raise UnsupportedConfigError(f"config.json has {key}={config[key]!r}; kvattn.models runs Gemma without it")
    heads = read(config, "num_attention_heads")
    head_dim = read(config, "head_dim", 256)
    num_layers = read(config, "num_hidden_layers")
    parameters = config.get("rope_parameters") or {}
    if model_type == "gemma3_text":
        # transformers 5 keys the rotary settings by layer type; earlier versions had `rope_local_base_freq`.
        per_type = isinstance(parameters, dict) and "full_attention" in parameters
        full = rope(config, head_dim, parameters["full_attention"] if per_type else parameters)
        local = rope(config, head_dim, (parameters.get("sliding_attention") or {}) if per_type else {},
                     theta_key="rope_local_base_freq", scaling_key=None)
    else:
        full, local = rope(config, head_dim), None
    softcaps = {name: config.get(key) for name, key in (("attn_logit_softcap", "attn_logit_softcapping"),
                                                         ("final_logit_softcap", "final_logit_softcapping"))}
    sliding = config.get("sliding_window", 4096)
    scalar = read(config, "query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not scalar > 0:
        raise UnsupportedConfigError(f"config.json has query_pre_attn_scalar={scalar!r}; expected a positive number")
    return {
        "vocab_size": read(config, "vocab_size"), "hidden_size": read(config, "hidden_size"),
        "num_layers": num_layers, "num_heads": heads,
        "num_kv_heads": heads if config.get("num_key_value_heads") is None else config["num_key_value_heads"],
        "head_dim": head_dim, "intermediate_size": read(config, "intermediate_size"),
        "norm_eps": read(config, "rms_norm_eps", 1e-6), "tie_embeddings": config.get("tie_word_embeddings", True),
        "max_position_embeddings": read(config, "max_position_embeddings"), "rope": full,
        "local_rope": None if local == full else local, "qk_norm": model_type == "gemma3_text",
        # transformers' default window; with none, every layer attends in full.
        "sliding_window": sliding, "layer_types": None if sliding is None else _layer_types(config, num_layers),
        "query_scale": float(scalar) ** -0.5, **softcaps,
    }


BLOCK = BlockSpec(norm="rms_offset", mlp="gated_gelu", positions="rotary", out_bias=False, mlp_bias=False,
                  post_norms=True, scale_embeddings=True)

_LAYER = "layers.{i}."
_NORMS = {
    _LAYER + "post_attention_layernorm.weight": "attention_post_norm",  # Llama's name for its MLP's norm
    _LAYER + "pre_feedforward_layernorm.weight": "mlp_norm",
    _LAYER + "post_feedforward_layernorm.weight": "mlp_post_norm",
}
_BIASES = {_LAYER + f"self_attn.{name}_proj.bias" for name in "qkv"}

# Llama's table without biases, its second norm renamed, and the MLP's two norms after it.
TABLE = tuple(row for row in llama.TABLE if row.source not in _BIASES and row.source not in _NORMS) + tuple(
    Row(source, ("blocks/{i}/" + target + "/weight",), ("D",)) for source, target in _NORMS.items()
)

FAMILY = Family("gemma", BLOCK, translate, "model.", TABLE)
