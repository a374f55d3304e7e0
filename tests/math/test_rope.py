"""Rotary positions (`kvattn.math.rope`, settings in `kvattn.rotary.RoPE`): closed forms and the float64 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvattn.rotary import RoPE
from kvattn.math.rope import apply_rope
from tests.helpers import LLAMA3, ROPES, YARN
from tests.reference import assert_close, rope_frequencies, rotate

# ---------------------------------------------------------- closed-form cases


def test_rotation_by_a_known_angle():
    """One pair at frequency 1 turns by its position in radians; pairs at lower frequencies by less."""
    x = jnp.array([[[[1.0, 0.0]]]])  # B T heads H
    for position in (0, 1, 3):
        got = apply_rope(x, jnp.array([[position]]), RoPE())
        np.testing.assert_allclose(got[0, 0, 0], [np.cos(position), np.sin(position)], atol=1e-6)
    # H = 4, rotate-half: dims (0, 2) at frequency 1, dims (1, 3) at theta ** -1/2 = 0.01.
    y = apply_rope(jnp.array([[[[1.0, 1.0, 0.0, 0.0]]]]), jnp.array([[2]]), RoPE(theta=10000.0))
    np.testing.assert_allclose(y[0, 0, 0], [np.cos(2), np.cos(0.02), np.sin(2), np.sin(0.02)], atol=1e-6)
    # Interleaved pairs (0, 1) and (2, 3) instead.
    z = apply_rope(jnp.array([[[[1.0, 0.0, 1.0, 0.0]]]]), jnp.array([[2]]), RoPE(theta=10000.0, interleaved=True))
    np.testing.assert_allclose(z[0, 0, 0], [np.cos(2), np.sin(2), np.cos(0.02), np.sin(0.02)], atol=1e-6)
    # Partial: the dims past rotary_dim pass through untouched.
    w = apply_rope(jnp.array([[[[1.0, 0.0, 5.0, 6.0]]]]), jnp.array([[1]]), RoPE(rotary_dim=2))
    np.testing.assert_allclose(w[0, 0, 0], [np.cos(1), np.sin(1), 5.0, 6.0], atol=1e-6)


@pytest.mark.parametrize("name", ["half", "interleaved", "partial", "llama3", "yarn", "longrope_long"])
def test_scores_depend_only_on_the_distance_between_positions(name):
    rope = EIGHT[name]
    q, k = (jax.random.normal(jax.random.key(i), (1, 1, 1, 8)) for i in (1, 2))

    def score(query_pos, key_pos):
        rotated_q = apply_rope(q, jnp.array([[query_pos]]), rope)
        rotated_k = apply_rope(k, jnp.array([[key_pos]]), rope)
        return float(jnp.sum(rotated_q * rotated_k))

    for shift in (1, 7, 100):
        assert score(5 + shift, 2 + shift) == pytest.approx(score(5, 2), rel=1e-4, abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)


# longrope for heads of 8 (four pairs), each set of factors.
LONGROPE_8 = {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [1.0, 3.0, 8.0, 20.0],
              "original_max_position_embeddings": 16, "factor": 8.0}
EIGHT = {**ROPES, **{f"longrope_{kind}": RoPE(theta=1000.0, scaling=LONGROPE_8, long=kind == "long")
                     for kind in ("short", "long")}}


@pytest.mark.parametrize("name", ["half", "interleaved", "partial", "linear", "llama3", "yarn", "longrope_short",
                                  "longrope_long"])
def test_rotation_equals_the_reference(name):
    rope = EIGHT[name]
    x = jax.random.normal(jax.random.key(0), (1, 5, 3, 8))
    positions = jnp.array([[0, 1, 9, 40, 1000]])
    as_dict = dict(theta=rope.theta, scaling=rope.scaling_dict, rotary_dim=rope.rotary_dim,
                   interleaved=rope.interleaved, long=rope.long)
    assert_close(apply_rope(x, positions, rope)[0], rotate(x[0], positions[0], as_dict), rtol=1e-4, atol=2e-4)


def test_longrope_divides_each_pair_by_its_factor_and_scales_by_transformers_attention_factor():
    """Worked by hand: pair i's frequency is theta ** (-i / 4) over its factor; cos and sin are multiplied by
    sqrt(1 + ln(factor) / ln(original)) = sqrt(1 + ln 8 / ln 16) = sqrt(1.75) for either set."""
    x = jnp.array([[[[1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]]]])
    for kind, factors in (("short", LONGROPE_8["short_factor"]), ("long", LONGROPE_8["long_factor"])):
        got = apply_rope(x, jnp.array([[5]]), EIGHT[f"longrope_{kind}"])[0, 0, 0]
        angles = 5 * 1000.0 ** (-np.arange(4) / 4) / np.array(factors)
        want = np.sqrt(1.75) * np.concatenate([np.cos(angles), np.sin(angles)])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # A layer picks by the longest sequence its cache holds; a set named is kept.
    assert RoPE(scaling=LONGROPE_8).for_length(16).long is False and RoPE(scaling=LONGROPE_8).for_length(17).long
    assert RoPE(scaling=LONGROPE_8).for_length(None).long and RoPE(scaling=LONGROPE_8, long=False).for_length(99).long \
        is False
    assert RoPE(scaling=YARN).for_length(99).long is None
    with pytest.raises(ValueError, match="RoPE long picks longrope's set of factors"):
        RoPE(scaling=YARN, long=True)


def test_scaled_frequencies_follow_the_published_rules():
    """Spot values of llama3 and yarn scaling, worked by hand from their definitions."""
    freqs, factor = rope_frequencies(8, 1000.0, LLAMA3, None)
    plain = 1000.0 ** (-np.arange(4) / 4)
    # Wavelengths 2 pi / plain: 6.3 (between 16 / 4 and 16 / 1: blended), then 35, 199, 1117 (past 16: divided by 4).
    blend = (16 / (2 * np.pi) - 1.0) / (4.0 - 1.0)
    assert freqs[0] == pytest.approx((1 - blend) * plain[0] / 4 + blend * plain[0])
    np.testing.assert_allclose(freqs[1:], plain[1:] / 4)
    assert rope_frequencies(8, 1000.0, {**LLAMA3, "original_max_position_embeddings": 64}, None)[0][0] == plain[0]
    assert factor == 1.0
    _, attention_factor = rope_frequencies(8, 1000.0, YARN, None)
    assert attention_factor == pytest.approx(0.1 * np.log(4.0) + 1.0)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("interleaved", [False, True])
def test_a_program_evaluates_cos_and_sin_once_per_position(tokens, interleaved):
    """Queries and keys of several layers rotated at the same positions, in one program, one token or a chunk: XLA
    computes one cosine and one sine op for all of them, never one inside each head's rotation (a decode step of
    the 125M Llama spent 0.5 ms on that)."""
    rope = RoPE(interleaved=interleaved)
    positions = jnp.arange(2 * tokens).reshape(2, tokens)

    def layers(q, k):
        for _ in range(3):
            q, k = apply_rope(q, positions, rope) * 1.5, apply_rope(k, positions, rope) * 0.5
        return q, k

    hlo = jax.jit(layers).lower(jnp.ones((2, tokens, 6, 16)), jnp.ones((2, tokens, 2, 16))).compile().as_text()
    assert (hlo.count(" cosine("), hlo.count(" sine(")) == (1, 1)
