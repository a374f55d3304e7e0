"""kvattn.generation.adjust and the one sampler's processing against transformers' own logits processors.

tests/fixtures/sampling/processors.npz holds random logits and histories put
through transformers' processors (tools/make_sampling_fixture.py); the
presence and frequency penalties, which transformers does not have, are
checked against OpenAI's documented formula in NumPy.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from kvattn.generation.adjust import Adjuster
from kvattn.generation.sampling import (
    Adjustments, RowSampling, Sampling, SamplingParams, adjusted, filter_rows, filtered, scaled_rows,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sampling"
ARRAYS = np.load(FIXTURE / "processors.npz")
META = json.loads((FIXTURE / "processors.json").read_text())
CASES = META["cases"]


@jax.jit
def _processed(logits, adjustments, rows):
    return scaled_rows(adjusted(logits, adjustments), rows)[1]


def _adjusters(params: SamplingParams, history: np.ndarray, prompt_tokens: int, vocab: int,
               stops=()) -> list[Adjuster]:
    """An adjuster per row of `history` (its prompt, then the tokens it generated, each accepted)."""
    out = []
    for row in history:
        adjuster = Adjuster(params, row[:prompt_tokens].tolist(), stops, vocab)
        for token in row[prompt_tokens:]:
            adjuster.accept(int(token))
        out.append(adjuster)
    return out


def _filled(adjusters: list[Adjuster], vocab: int) -> Adjustments:
    arrays = Adjustments.neutral((len(adjusters), 1, vocab))
    for row, adjuster in enumerate(adjusters):
        adjuster.fill(*(a[row] for a in arrays))
    return Adjustments(*(a[:, 0] for a in arrays))


@pytest.mark.parametrize("number", range(len(CASES)))
def test_the_sampler_processes_logits_as_transformers_does(number):
    case = CASES[number]
    logits, history, expected = (ARRAYS[f"{number}/{name}"] for name in ("logits", "history", "expected"))
    params = SamplingParams(max_tokens=16, temperature=case["temperature"], top_k=case["top_k"] or None,
                            top_p=case["top_p"] if case["top_p"] < 1 else None, min_p=case["min_p"],
                            repetition_penalty=case["repetition"],
                            logit_bias={int(k): v for k, v in case["bias"].items()}, min_tokens=case["min_tokens"])
    adjusters = _adjusters(params, history, META["prompt_tokens"], logits.shape[1], META["eos_token_ids"])
    rows = RowSampling.of([(params.sampling, 0, 0, 0, 0)] * len(history), len(history))
    got = np.asarray(_processed(logits, _filled(adjusters, logits.shape[1]), rows))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-5, atol=1e-5)


def test_presence_and_frequency_penalties_follow_openais_formula():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, 30)).astype(np.float32)
    history = rng.integers(0, 10, (2, 12))
    params = SamplingParams(max_tokens=16, presence_penalty=0.5, frequency_penalty=-0.75)
    got = np.asarray(adjusted(logits, _filled(_adjusters(params, history, 4, 30), 30)))
    counts = np.stack([np.bincount(row[4:], minlength=30) for row in history])  # the completion's tokens only
    want = logits - counts * params.frequency_penalty - (counts > 0) * params.presence_penalty
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_each_drafted_position_is_adjusted_as_if_the_drafts_before_it_were_kept():
    rng = np.random.default_rng(2)
    params = SamplingParams(max_tokens=16, presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.4,
                            logit_bias={2: 1.5}, min_tokens=3)
    prompt, drafts = [1, 5, 5, 9], [5, 7, 7]
    adjuster = Adjuster(params, prompt, {0}, 12)
    adjuster.accept(3)
    arrays = Adjustments.neutral((len(drafts) + 1, 12))
    adjuster.fill(*arrays, drafts=drafts)
    for j in range(len(drafts) + 1):
        alone = Adjuster(params, prompt, {0}, 12)
        for token in [3, *drafts[:j]]:
            alone.accept(token)
        want = Adjustments.neutral((1, 12))
        alone.fill(*want)
        for got_array, want_array in zip(arrays, want):
            np.testing.assert_array_equal(got_array[j], want_array[0], err_msg=f"position {j}")
    logits = rng.standard_normal(12).astype(np.float32)
    assert np.isneginf(np.asarray(adjusted(logits, Adjustments(*(a[1] for a in arrays))))[0])  # min_tokens: 2 < 3
    assert np.isfinite(np.asarray(adjusted(logits, Adjustments(*(a[2] for a in arrays))))[0])  # 3 tokens: allowed


def test_min_p_in_the_static_sampler_equals_the_row_sampler():
    logits = np.random.default_rng(3).standard_normal((4, 40)).astype(np.float32) * 3
    sampling = Sampling(temperature=0.8, top_k=None, top_p=0.95, min_p=0.1)
    rows = np.full(4, 0, np.int32), np.full(4, 0.95, np.float32), np.full(4, 0.1, np.float32)
    np.testing.assert_array_equal(np.asarray(filtered(logits, sampling)),
                                  np.asarray(filter_rows(logits / 0.8, *rows)))
    assert np.isneginf(np.asarray(filtered(logits, sampling))).any()


@pytest.mark.parametrize("settings, message", [
    (dict(presence_penalty=2.5), "presence_penalty must lie in"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must lie in"),
    (dict(repetition_penalty=0), "repetition_penalty must be finite and > 0"),
    (dict(logit_bias={3: 101}), "a logit_bias value must lie in"),
    (dict(logit_bias={-1: 1}), "a logit_bias token id must be an int >= 0"),
    (dict(logit_bias=[1, 2]), "logit_bias must map token ids to numbers"),
    (dict(min_tokens=17), "min_tokens must be an int in [0, 16]"),
    (dict(min_p=1.5), "min_p must lie in [0.0, 1.0]"),
])
def test_bad_settings_are_refused_by_name(settings, message):
    with pytest.raises((TypeError, ValueError), match=message.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(max_tokens=16, **settings)


def test_logit_bias_is_kept_as_sorted_pairs_so_params_stay_hashable():
    params = SamplingParams(logit_bias={9: 1, 2: -3.5})
    assert params.logit_bias == ((2, -3.5), (9, 1.0))
    assert hash(params) == hash(SamplingParams(logit_bias=[(2, -3.5), (9, 1)]))


def test_allowed_token_ids_leave_every_other_id_at_minus_infinity():
    params = SamplingParams(allowed_token_ids=[2, 5], logit_bias={5: 1.0})
    adjuster = Adjuster(params, [1], {0}, 8)
    row = Adjustments(*(a[0] for a in _filled([adjuster], 8)))
    got = np.asarray(adjusted(np.zeros(8, np.float32), row))
    assert np.isfinite(got).nonzero()[0].tolist() == [2, 5] and got[5] == 1.0
