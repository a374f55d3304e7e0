"""One frozen config per decoder-only model, read from a Hugging Face `config.json`.

A config names its family (`kvattn.models.families`: `"gpt2"`, and
`"llama"`, which covers Llama 2/3, Mistral, Qwen2 and Qwen3), whose block
spec (`ModelConfig.block`) says what the decoder builds; its fields are the
sizes and what one checkpoint chooses within the family. `from_hf_config`
finds the family by the config's `model_type` and lets it translate the
rest. Anything else in a config that would change the computation is
refused by name, and so is every size that is not a positive int, every
epsilon that is not a positive finite number, heads that do not divide, and
rotary settings whose frequencies are not finite: nothing is allocated from
a config before it has passed.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from kvattn.errors import UnsupportedConfigError
from kvattn.models.families import FAMILIES, MODEL_TYPES
from kvattn.models.spec import BlockSpec
from kvattn.caches.base import INT32_MAX
from kvattn.rotary import RoPE
from kvattn.errors import positive_int
from kvattn.math.rope import rope_tables

__all__ = ["LAYER_TYPES", "ModelConfig", "from_hf_config"]

LAYER_TYPES = ("full_attention", "sliding_attention")

# Far past any real model's (64-256), and small enough that checking the rotary frequencies of a config,
# before its weights are read, allocates next to nothing.
MAX_HEAD_DIM = 2**16


def _size(name: str, value) -> int:
    """A size field as an int in `[1, INT32_MAX]`, else an `UnsupportedConfigError` naming it."""
    return positive_int(name, value, error=UnsupportedConfigError, at_most=INT32_MAX)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The sizes and options of a decoder-only model of a registered family (`kvattn.models.families`).

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
    layer_types: tuple[str, ...] | None = None
    """Per layer, `"sliding_attention"` (over `sliding_window`) or `"full_attention"`, as Hugging Face names
    them; None: every layer slides when there is a window."""
    local_rope: RoPE | None = None
    """The sliding layers' rotary settings where they differ from `rope` (Gemma 3's local base)."""
    query_scale: float | None = None
    """The attention logits' scale (Gemma's `query_pre_attn_scalar ** -0.5`); None: `1 / sqrt(head_dim)`."""
    attn_logit_softcap: float | None = None
    """`cap * tanh(scores / cap)` on every attention logit (Gemma 2), or None."""
    final_logit_softcap: float | None = None
    """`cap * tanh(logits / cap)` on the output logits (Gemma 2), or None."""

    def __post_init__(self):
        if not isinstance(self.family, str) or self.family not in FAMILIES:
            raise UnsupportedConfigError(f"family must be one of {sorted(FAMILIES)}, got {self.family!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            object.__setattr__(self, name, _size(name, getattr(self, name)))
        if self.head_dim > MAX_HEAD_DIM:
            raise UnsupportedConfigError(f"head_dim must be at most {MAX_HEAD_DIM}, got {self.head_dim}")
        if self.sliding_window is not None:
            object.__setattr__(self, "sliding_window", _size("sliding_window", self.sliding_window))
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
        for name in ("query_scale", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not 0 < value < math.inf:
                    raise UnsupportedConfigError(f"{name} must be a positive finite number or None, got {value!r}")
                object.__setattr__(self, name, float(value))
        if self.layer_types is not None:
            types = self.layer_types
            if isinstance(types, str) or not isinstance(types, (tuple, list)) or len(types) != self.num_layers \
                    or any(kind not in LAYER_TYPES for kind in types):
                raise UnsupportedConfigError(
                    f"layer_types must list one of {list(LAYER_TYPES)} for each of the {self.num_layers} layers, "
                    f"got {types!r}"
                )
            object.__setattr__(self, "layer_types", tuple(types))
            if "sliding_attention" in types and self.sliding_window is None:
                raise UnsupportedConfigError("layer_types has sliding_attention layers but sliding_window is None")
        if self.block.positions == "learned" and (self.rope is not None or self.local_rope is not None):
            raise UnsupportedConfigError(f"{self.family} models use learned positions, not rope")
        if self.local_rope is not None and self.rope is None:
            raise UnsupportedConfigError("local_rope is given without rope")
        for rope in (self.rope, self.local_rope):
            if rope is None:
                continue
            try:
                inv_freq, attention_factor, _ = rope_tables(rope, self.head_dim)
            except (ValueError, ArithmeticError) as error:
                raise UnsupportedConfigError(f"rope settings {rope.to_json()} are not valid: {error}") from None
            if not (np.isfinite(inv_freq).all() and (inv_freq > 0).all() and math.isfinite(attention_factor)):
                raise UnsupportedConfigError(
                    f"rope settings {rope.to_json()} give non-finite or non-positive frequencies for "
                    f"head_dim={self.head_dim}"
                )

    def sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends over a sliding window."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding_attention"

    def layer_rope(self, layer: int) -> RoPE | None:
        """Layer `layer`'s rotary settings: `local_rope` on a sliding layer where there is one, else `rope`."""
        return self.local_rope if self.local_rope is not None and self.sliding(layer) else self.rope

    @property
    def block(self) -> BlockSpec:
        """What the decoder builds for this config's family."""
        return FAMILIES[self.family].block


def from_hf_config(config: dict) -> ModelConfig:
    """A `ModelConfig` from a Hugging Face `config.json` (as a dict); refuses what it cannot run or is not valid.

    The config's `model_type` picks the family (`kvattn.models.families.MODEL_TYPES`), which translates the rest.
    """
    if not isinstance(config, dict):
        raise UnsupportedConfigError(f"config.json must hold a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    family = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UnsupportedConfigError(
            f"config.json has model_type={model_type!r}; kvattn.models supports model_type in {sorted(MODEL_TYPES)}"
        )
    return ModelConfig(family=family.name, **family.translate(config))
