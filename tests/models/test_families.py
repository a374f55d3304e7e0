"""The family registry: every `model_type` translates, its table fills exactly its model, and the decoder names none.

A new family joins `kvattn.models.families.MODEL_TYPES` and `MINIMAL` below;
these tests then hold its translation and its weight table to the same
contract as GPT-2's and Llama's.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from kvattn import models
from kvattn.models import decoder, hf, spec, table
from kvattn.models.families import FAMILIES, MODEL_TYPES
from tests.helpers import FAMILIES as FIXTURE_FAMILIES

# The fewest keys each family's translation needs, by family name; the registry's `model_type` is added.
MINIMAL = {
    "gpt2": {"vocab_size": 32, "n_embd": 16, "n_layer": 2, "n_head": 2, "n_positions": 16},
    "llama": {"vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "intermediate_size": 24, "max_position_embeddings": 16},
}
MINIMAL["phi3"] = MINIMAL["llama"]  # the same block: only its table differs
MINIMAL["gemma"] = {**MINIMAL["llama"], "head_dim": 8}  # Gemma's head_dim defaults to 256


def minimal(model_type: str) -> dict:
    return {**MINIMAL[MODEL_TYPES[model_type].name], "model_type": model_type}


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
def test_every_registered_model_type_translates_a_minimal_config(model_type):
    config = models.from_hf_config(minimal(model_type))
    assert config.family == MODEL_TYPES[model_type].name
    assert config.block is MODEL_TYPES[model_type].block
    assert (config.num_layers, config.vocab_size, config.hidden_size) == (2, 32, 16)


def test_every_registered_model_type_has_transformers_fixtures():
    """The equivalence suite (tests/models/test_hf_equivalence.py) runs over exactly the registered model types."""
    assert set(FIXTURE_FAMILIES) == set(MODEL_TYPES)


def test_the_registry_is_consistent():
    assert all(FAMILIES[family.name] is family for family in MODEL_TYPES.values())
    assert set(FAMILIES) == {family.name for family in MODEL_TYPES.values()}
    # Every kind a block spec may name has a layer the decoder builds.
    assert set(decoder.NORM_LAYERS) == set(spec.NORMS)
    assert set(decoder.MLP_LAYERS) == set(spec.MLPS)


def test_an_unknown_model_type_is_refused_with_the_known_ones():
    with pytest.raises(models.UnsupportedConfigError, match="model_type='falcon'") as error:
        models.from_hf_config({**minimal("llama"), "model_type": "falcon"})
    assert all(repr(model_type) in str(error.value) for model_type in MODEL_TYPES)
    with pytest.raises(models.UnsupportedConfigError, match="model_type=None"):
        models.from_hf_config(MINIMAL["llama"])
    with pytest.raises(models.UnsupportedConfigError, match="family must be one of"):
        dataclasses.replace(models.from_hf_config(minimal("llama")), family="falcon")


def test_a_block_spec_refuses_kinds_the_decoder_does_not_build():
    with pytest.raises(ValueError, match="BlockSpec.norm must be one of"):
        spec.BlockSpec(norm="batch", mlp="gelu", positions="learned", out_bias=True, mlp_bias=True)
    with pytest.raises(TypeError, match="BlockSpec.mlp_bias must be a bool"):
        spec.BlockSpec(norm="rms", mlp="gelu", positions="rotary", out_bias=False, mlp_bias=1)


def test_learned_positions_refuse_rope():
    config = models.from_hf_config(minimal("llama"))
    with pytest.raises(models.UnsupportedConfigError, match="gpt2 models use learned positions, not rope"):
        dataclasses.replace(config, family="gpt2")


# What one checkpoint of a family may choose in its config.json, beside the choices its model_type implies.
CHOICES = {
    "gpt2": [{}, {"tie_word_embeddings": False}],
    "llama": [{}, {"tie_word_embeddings": True}, {"attention_bias": True}, {"tie_word_embeddings": True,
                                                                            "attention_bias": True}],
    "phi3": [{}, {"tie_word_embeddings": True}],  # biases are refused (a fused qkv_proj has none)
    "gemma": [{}, {"tie_word_embeddings": False}],  # gemma2 and gemma3_text (QK-norm) both ask this
}


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
def test_each_family_table_fills_exactly_its_models_parameters_in_their_shapes(model_type):
    for choice, weights in itertools.product(CHOICES[MODEL_TYPES[model_type].name], (None, "int8")):
        config = models.from_hf_config({**minimal(model_type), **choice})
        model = models.CausalLM(config, max_len=8, weights=weights)
        # An int8 parameter's scales are stored with it, never named by a table.
        params = {path for path in hf.parameter_paths(model) if not path.endswith("_scale")}
        assert hf.filled_parameters(config) == params, (config, weights)
        # Every tensor converts to its target's shape: `load_weight` refuses any other, and a part is its slice.
        pieces: dict[str, dict[int, tuple]] = {}
        for want in hf.expected_tensors(config).values():
            if not want.targets:  # a buffer, never read
                continue
            parts = want.row.convert(np.zeros(want.shape, np.float32), config)
            for target, part in zip(want.targets, parts, strict=True):
                if isinstance(target, table.Part):
                    pieces.setdefault(target.path, {})[target.index] = (target, part)
                else:
                    model.load_weight(target, part)
        for path, held in pieces.items():
            assert sorted(held) == list(range(len(next(iter(held.values()))[0].sizes))), path
            fused = np.concatenate([held[index][1] for index in sorted(held)], axis=held[0][0].axis)
            model.load_weight(path, fused)
            for target, part in held.values():
                assert fused[hf.locate(target, config)[1]].shape == part.shape, (path, target.index)


def test_the_decoder_names_no_family():
    """`decoder.py` builds whatever block spec it is given; no string in it is a family name or a model type."""
    source = Path(decoder.__file__).read_text()
    named = {node.value for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Constant)}
    assert not named & (set(FAMILIES) | set(MODEL_TYPES))


@pytest.mark.parametrize(("changes", "match"), [
    ({"attention_bias": True}, "attention_bias=True; kvattn.models runs bias-free Phi-3"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}},
     r"rope settings kvattn cannot use: .*missing \['original_max_position_embeddings'\]"),
    ({"original_max_position_embeddings": 8,
      "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 3}},
     r"one factor per rotated pair \(4\), got 3"),
    ({"original_max_position_embeddings": 8,
      "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0, 0.0, 1.0, 1.0]}},
     "long_factor must be a non-empty list of positive finite numbers"),
    ({"original_max_position_embeddings": 8, "rope_scaling": {
        "type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "short_mscale": 1.1}},
     r"unknown \['short_mscale'\]"),
])
def test_phi3_refuses_what_its_fused_table_or_rope_cannot_hold(changes, match):
    with pytest.raises(models.UnsupportedConfigError, match=match):
        models.from_hf_config({**minimal("phi3"), **changes})


def test_phi3_longrope_is_completed_as_transformers_completes_it():
    """The switch from the config's top level, `factor` from the two lengths (it sets the attention factor),
    "su" as longrope's old name; a model picks its set of factors by its max_len."""
    factors = {"short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [1.0, 4.0, 8.0, 16.0]}
    for kind in ("longrope", "su"):
        config = models.from_hf_config({**minimal("phi3"), "max_position_embeddings": 64,
                                        "original_max_position_embeddings": 8,
                                        "rope_scaling": {"type": kind, **factors}})
        assert config.rope.scaling_dict == {"rope_type": "longrope", "factor": 8.0,
                                            "original_max_position_embeddings": 8.0,
                                            **{key: tuple(value) for key, value in factors.items()}}
        assert config.rope.long is None and config.rope.long_past == 8
    assert [models.CausalLM(config, max_len=n, rngs=nnx.Rngs(0)).blocks[1].attention.config.rope.long
            for n in (8, 9)] == [False, True]


def test_gemma_layers_slide_as_transformers_lays_them_out():
    gemma2 = models.from_hf_config({**minimal("gemma2"), "num_hidden_layers": 4, "sliding_window": 8})
    assert [gemma2.sliding(i) for i in range(4)] == [True, False, True, False]
    assert gemma2.query_scale == 256 ** -0.5 and gemma2.local_rope is None
    gemma3 = models.from_hf_config({**minimal("gemma3_text"), "num_hidden_layers": 12, "query_pre_attn_scalar": 64,
                                    "rope_theta": 1e6, "rope_local_base_freq": 1e4})
    assert [i for i in range(12) if not gemma3.sliding(i)] == [5, 11] and gemma3.qk_norm
    assert gemma3.query_scale == 64 ** -0.5 and gemma3.sliding_window == 4096  # transformers' default window
    assert (gemma3.rope.theta, gemma3.local_rope.theta) == (1e6, 1e4)
    assert gemma3.layer_rope(5) is gemma3.rope and gemma3.layer_rope(4) is gemma3.local_rope
    # transformers 5 keys the rotary settings by layer type; a scaling applies to the full layers only.
    keyed = models.from_hf_config({**minimal("gemma3_text"), "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert keyed.rope.scaling_dict == {"rope_type": "linear", "factor": 8.0} and keyed.local_rope.scaling is None
    unwindowed = models.from_hf_config({**minimal("gemma2"), "sliding_window": None})
    assert unwindowed.layer_types is None and not unwindowed.sliding(0)


@pytest.mark.parametrize(("changes", "match"), [
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar=0"),
    ({"layer_types": ["sliding_attention"]}, "layer_types must list one of"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types must list one of"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcap must be a positive finite number"),
])
def test_gemma_refuses_what_it_cannot_run_by_name(changes, match):
    with pytest.raises(models.UnsupportedConfigError, match=match):
        models.from_hf_config({**minimal("gemma2"), **changes})


def test_a_model_of_sliding_and_full_layers_is_bounded_by_its_full_ones():
    config = models.from_hf_config({**minimal("gemma2"), "sliding_window": 4})
    model = models.CausalLM(config, max_len=12)
    assert model.windows == (4, None)
    assert model.cache_config.capacity == 12  # the ring of the sliding layer holds 4 slots and never fills
    # Layers alike share one config object (one compiled program per shape).
    four = models.CausalLM(dataclasses.replace(config, num_layers=4, layer_types=None), max_len=12)
    assert four.blocks[0].attention.config is four.blocks[3].attention.config
