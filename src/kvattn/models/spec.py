"""A model family as data: the block its decoder builds, and how its checkpoints map.

A family (one file in `kvattn.models.families`) is a `Family`: the
translation of a Hugging Face `config.json` into `ModelConfig` fields, the
weight table `kvattn.models.hf` loads by (`kvattn.models.table`), and the
`BlockSpec` that `CausalLM` builds. The spec names the family's
architecture; what one checkpoint chooses within it (biased query, key and
value projections, per-head QK-norm, a tied head, a sliding window, the
rotary settings) are `ModelConfig` fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

from kvattn.models.table import Row

__all__ = ["MLPS", "NORMS", "POSITIONS", "BlockSpec", "Family"]

NORMS = ("layer", "rms", "rms_offset")
MLPS = ("gelu", "gated_silu", "gated_gelu")
POSITIONS = ("learned", "rotary")


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """What the decoder builds for a family, each field one of a few named kinds.

    Attributes:
      norm: `"layer"`, LayerNorm with weight and bias (GPT-2's); `"rms"`,
        RMSNorm with a weight (Llama's); `"rms_offset"`, RMSNorm scaled by
        `1 + weight` in float32 (Gemma's, whose weights start at zero).
        Every norm of the model, per-head QK-norms included.
      mlp: `"gelu"`, `down(gelu_tanh(up(x)))` (GPT-2's `c_fc`, `c_proj`);
        `"gated_silu"`, `down(silu(gate(x)) * up(x))` with gate and up one
        kernel `gate_up` (Llama's); `"gated_gelu"`, the same with
        `gelu_tanh` (Gemma's GeGLU).
      positions: `"learned"`, a table `(P, D)` added to the embedding, which
        bounds the context; `"rotary"`, rope inside attention (the
        `ModelConfig`'s `rope`).
      out_bias: whether attention's output projection has a bias.
      mlp_bias: whether the MLP's projections have biases.
      post_norms: whether attention's and the MLP's outputs are normalised
        again before each residual add (Gemma 2/3's four norms a block:
        `attention_post_norm`, `mlp_post_norm`).
      scale_embeddings: whether the embedded tokens are multiplied by
        `sqrt(hidden_size)`, in the computation dtype (Gemma's).
    """

    norm: Literal["layer", "rms", "rms_offset"]
    mlp: Literal["gelu", "gated_silu", "gated_gelu"]
    positions: Literal["learned", "rotary"]
    out_bias: bool
    mlp_bias: bool
    post_norms: bool = False
    scale_embeddings: bool = False

    def __post_init__(self):
        for name, kinds in (("norm", NORMS), ("mlp", MLPS), ("positions", POSITIONS)):
            if getattr(self, name) not in kinds:
                raise ValueError(f"BlockSpec.{name} must be one of {list(kinds)}, got {getattr(self, name)!r}")
        for name in ("out_bias", "mlp_bias", "post_norms", "scale_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"BlockSpec.{name} must be a bool, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its block, its `config.json` translation and its weight table.

    Attributes:
      name: the `ModelConfig.family` its configs carry.
      block: what the decoder builds.
      translate: a `config.json` dict -> the `ModelConfig` fields it gives
        (all but `family`), refusing by name whatever the family cannot run.
      prefix: the base model's prefix on checkpoint names (`"model."`),
        which a checkpoint may leave out.
      table: the weight table, read top to bottom.
    """

    name: str
    block: BlockSpec
    translate: Callable[[dict], dict]
    prefix: str
    table: tuple[Row, ...]
