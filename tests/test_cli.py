"""The console script: `kvattn demo` end to end at tiny sizes."""

from __future__ import annotations

import pytest

from kvattn import cli

TINY = ["--in-features", "16", "--num-heads", "2", "--max-len", "32", "--tokens", "12"]


def test_demo_passes_and_reports_speedups(capsys):
    assert cli.main(["demo", *TINY]) == 0
    printed = capsys.readouterr().out
    assert "PASS" in printed
    assert "flax nnx.MultiHeadAttention(decode=True)" in printed
    assert "recompute full attention" in printed


def test_demo_batched_gqa_heads_major(capsys):
    args = ["demo", *TINY, "--batch-size", "2", "--num-kv-heads", "1", "--cache-layout", "heads_major"]
    assert cli.main(args) == 0
    assert "batch=2" in capsys.readouterr().out


def test_demo_exits_non_zero_when_the_check_fails(capsys):
    assert cli.main(["demo", *TINY, "--tolerance", "-1"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_demo_rejects_a_stream_longer_than_the_cache():
    with pytest.raises(ValueError, match="num_tokens"):
        cli.main(["demo", *TINY, "--tokens", "40"])
