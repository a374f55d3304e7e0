"""The console script: `kvattn demo` end to end at tiny sizes."""

from __future__ import annotations

import sys

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


def test_demo_without_the_bench_extra_names_the_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich.console", None)  # makes `import rich.console` raise ImportError
    assert cli.main(["demo", *TINY]) == 2
    captured = capsys.readouterr()
    assert "need the bench extra, which provides rich: pip install 'kvattn[bench]'" in captured.err
    assert captured.out == ""
