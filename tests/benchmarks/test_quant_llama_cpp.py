"""`benchmarks.quant_llama_cpp`: the figures it compares compact weights by (llama.cpp itself is not run here)."""

from __future__ import annotations

import pytest

from benchmarks.quant_llama_cpp import compare, markdown


def test_compare_counts_top1_agreement_the_largest_logprob_error_and_misses():
    reference = [{1: -0.1, 2: -2.0, 3: -3.0}, {4: -0.5, 5: -1.0}]
    got = [{1: -0.2, 2: -2.5}, {5: -0.4, 4: -0.9}]  # token 3 missing; the second position's top-1 moved
    row = compare(got, reference)
    assert row["top1_agreement"] == 0.5 and row["misses"] == 1 and row["positions"] == 2
    assert row["logprob_error"] == pytest.approx(0.6)  # |-0.4 - (-1.0)|


def test_compare_needs_the_same_positions():
    with pytest.raises(ValueError):
        compare([{1: 0.0}], [{1: 0.0}, {1: 0.0}])


def test_markdown_names_each_engine_form_and_the_floor_between_the_engines():
    row = {"top1_agreement": 0.75, "logprob_error": 0.125, "misses": 2, "positions": 4}
    results = {"rows": {"kvattn": {"int8": row}, "llama.cpp": {"int4": row}}, "engines_float32": row, "top": 10}
    text = markdown(results)
    assert "| kvattn | int8 | 0.750 | 0.125 | 2 of 40 |" in text and "| llama.cpp | Q4_0 |" in text
    assert "llama.cpp F32 against kvattn float32" in text
