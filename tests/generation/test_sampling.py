"""The one sampler: `SamplingParams` checked once, `filter_rows` against a float64 definition, `sample` is `draw`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvattn.generation.sampling import (
    MAX_TOP_LOGPROBS, RowSampling, Sampling, SamplingParams, draw, filter_rows, filtered, greedy_tokens, row_keys,
    sample, sample_rows, scaled_rows,
)


@pytest.mark.parametrize("settings_, error, message", [
    (dict(max_tokens=0), ValueError, "max_tokens must be an int >= 1, got 0"),
    (dict(max_tokens=2.0), TypeError, "max_tokens must be an int, got float"),
    (dict(temperature=-1.0), ValueError, "temperature must be finite and >= 0"),
    (dict(top_k=0), ValueError, "top_k must be a positive int"),
    (dict(top_p=1.5), ValueError, "top_p must lie in"),
    (dict(seed=2**32), ValueError, r"seed must be an int in \[0, 4294967295\]"),
    (dict(n=0), ValueError, "n must be an int >= 1"),
    (dict(stop=[""]), TypeError, "stop must be a non-empty string"),
    (dict(stop=5), TypeError, "stop must be a non-empty string"),
    (dict(stop_token_ids=[1.0]), TypeError, "stop_token_ids must be an int id"),
    (dict(stop_token_ids=[-1]), ValueError, "stop_token_ids must be an int >= 0"),
    (dict(logprobs=21), ValueError, r"logprobs must be an int in \[0, 20\]"),
    (dict(ignore_eos=1), TypeError, "ignore_eos must be a bool"),
])
def test_sampling_params_refuse_what_cannot_run(settings_, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**settings_)


def test_sampling_params_normalise_what_users_write():
    params = SamplingParams(stop="\n", stop_token_ids=7, temperature=1, top_k=np.int64(3))
    assert params.stop == ("\n",) and params.stop_token_ids == (7,)
    assert params.sampling == Sampling(1.0, 3) and params.stop_ids({2, 3}) == {2, 3, 7}
    assert SamplingParams(stop_token_ids=[7], ignore_eos=True).stop_ids({2}) == {7}
    assert hash(params) == hash(SamplingParams(stop=("\n",), stop_token_ids=(7,), temperature=1.0, top_k=3))


def reference_filter(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Top-k then top-p in float64, by definition: keep the k best (ties at the edge kept), then the smallest
    prefix of them, best first, whose probability before each token is below p."""
    logits = np.asarray(logits, np.float64)
    ranked = np.sort(logits)[::-1]
    k = len(logits) if top_k == 0 else min(top_k, len(logits))
    probs = np.exp(ranked[:k] - ranked[0])
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    kept = max(int(np.sum(before < top_p)), 1)
    return np.where(logits < ranked[kept - 1], -np.inf, logits)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-4, 4), min_size=2, max_size=9), st.integers(0, 10), st.sampled_from([1.0, 0.9, 0.5,
                                                                                                  0.05]))
def test_filter_rows_keeps_what_its_definition_keeps(values, top_k, top_p):
    logits = np.asarray(values, np.float32) * 0.75  # ties included
    got = np.asarray(FILTER(logits[None], jnp.array([top_k]), jnp.array([top_p], jnp.float32)))[0]
    want = reference_filter(logits, top_k, top_p)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))


FILTER = jax.jit(filter_rows)


def test_every_face_draws_through_one_sampler():
    """The fixed-batch loops' `sample` is `draw` with split keys; the engine's `sample_rows` is `draw` with each
    row's own key; both filter through `filter_rows`."""
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 11)).astype(np.float32))
    sampling = Sampling(0.8, top_k=5, top_p=0.9)
    key = jax.random.key(3)
    rows = jnp.full((4,), 5), jnp.full((4,), 0.9, jnp.float32)
    want = draw(filter_rows(logits / 0.8, *rows), jax.random.split(key, 4))
    assert sample(logits, key, sampling).tolist() == want.tolist()
    np.testing.assert_array_equal(filtered(logits, sampling), filter_rows(logits / 0.8, *rows))
    settings_ = RowSampling.of([(sampling, 7, 0, i, 0) for i in range(4)], 4)
    tokens = sample_rows(logits, settings_)[0]
    assert tokens.tolist() == draw(filter_rows(logits / 0.8, *rows), row_keys(settings_)).tolist()
    greedy = RowSampling.of([(Sampling(), 7, 0, 0, 0)], 4)
    assert sample_rows(logits, greedy)[0].tolist() == jnp.argmax(logits, axis=-1).tolist()


SAMPLE_ROWS = jax.jit(sample_rows)


@pytest.mark.parametrize("temperatures", [(0.0, 0.7, 1.3), (0.0, 0.0, 0.0)])  # the second: no row draws
@pytest.mark.parametrize("asked", [(0, 0, 0), (0, 3, 0), (20, 20, 20)])
def test_alternatives_are_log_softmax_and_made_only_when_a_row_asks(asked, temperatures):
    """The chosen token's and the top alternatives' log-probabilities are log_softmax of the scaled logits, to
    float32 rounding: the sampler's program and a separate one may sum the exponentials in another order."""
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((3, 50)).astype(np.float32) * 4)
    logits = logits.at[0, 7].set(-jnp.inf)
    rows = RowSampling.of([(Sampling(t), 3, 0, 1, top) for t, top in zip(temperatures, asked)], 3)
    tokens, chosen, top_ids, top_logprobs = SAMPLE_ROWS(logits, rows)
    log_softmax = jax.jit(lambda x: jax.nn.log_softmax(scaled_rows(x, rows)[0], axis=-1))(logits)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
    close(chosen, jnp.take_along_axis(log_softmax, tokens[:, None], axis=-1)[:, 0])
    if any(asked):
        want_logprobs, want_ids = jax.lax.top_k(log_softmax, MAX_TOP_LOGPROBS)
        np.testing.assert_array_equal(top_ids, want_ids)
        close(top_logprobs, want_logprobs)
    else:  # nobody asked: no top-k ran
        assert not np.any(top_ids) and not np.any(top_logprobs)


GREEDY = jax.jit(greedy_tokens)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([-np.inf, -2.0, -0.5, 0.0, 0.5, 3.0, np.inf, np.nan]), min_size=5, max_size=5),
                min_size=1, max_size=4))
def test_greedy_tokens_is_argmax_with_its_ties_nan_and_inf(rows):
    logits = np.asarray(rows, np.float32)
    assert GREEDY(logits).tolist() == np.argmax(logits, axis=-1).tolist()
