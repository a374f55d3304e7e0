"""The console script: `kvattn demo` end to end at tiny sizes, and `kvattn generate` refusing bad input in one line."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys

import pytest

from kvattn import cli
from tests.helpers import FIXTURES

FIXTURE = FIXTURES / "gpt2"  # vocab_size 97
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


def test_demo_refuses_a_stream_longer_than_the_cache_in_one_line(capsys):
    assert cli.main(["demo", *TINY, "--tokens", "40"]) == 1
    assert capsys.readouterr().err == "kvattn demo: num_tokens (40) must not exceed max_len (32)\n"


def test_demo_without_the_bench_extra_names_the_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich.console", None)  # makes `import rich.console` raise ImportError
    assert cli.main(["demo", *TINY]) == 2
    captured = capsys.readouterr()
    assert "need the bench extra, which provides rich: pip install 'kvattn[bench]'" in captured.err
    assert captured.out == ""


def run(argv, capsys) -> tuple[int, str]:
    """`kvattn.cli.main(argv)`'s exit status (argparse's refusals raise SystemExit) and its stderr."""
    try:
        status = cli.main(argv)
    except SystemExit as exit:
        status = exit.code
    return status, capsys.readouterr().err


def refused_in_one_line(status: int, err: str, expected_status: int, *words: str) -> None:
    assert status == expected_status, err
    assert err.startswith("kvattn generate: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err and all(word in err for word in words), err


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        (["--temperature", "-1"], ["--temperature", ">= 0", "'-1'"]),
        (["--temperature", "nan"], ["--temperature", "'nan'"]),
        (["--top-p", "0"], ["--top-p", "(0, 1]", "'0'"]),
        (["--top-p", "1.5"], ["--top-p", "'1.5'"]),
        (["--top-k", "0"], ["--top-k", ">= 1", "'0'"]),
        (["--max-new-tokens", "0"], ["--max-new-tokens", "'0'"]),
        (["--max-new-tokens", "two"], ["--max-new-tokens", "'two'"]),
        (["--max-len", "4"], ["--max-len >= 5", "got 4"]),  # 2 prompt tokens + 3 new ones
        (["--prompt-ids", "1", "-2"], ["--prompt-ids", ">= 0", "'-2'"]),
        (["--speculative", "draft:2"], ["--speculative", "ngram:K", "'draft:2'"]),
        (["--speculative", "ngram:0"], ["--speculative", "K, N >= 1", "'ngram:0'"]),
    ],
)
def test_generate_refuses_bad_arguments_as_usage_errors(capsys, arguments, words):
    argv = ["generate", str(FIXTURE), "--prompt-ids", "1", "2", "--max-new-tokens", "3", *arguments]
    refused_in_one_line(*run(argv, capsys), 2, *words)


def test_generate_refuses_a_missing_checkpoint_or_tokenizer_as_usage_errors(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    refused_in_one_line(*run(["generate", str(missing), "--prompt-ids", "1"], capsys), 2, str(missing), "not exist")
    refused_in_one_line(*run(["generate", str(FIXTURE), "--prompt", "hi"], capsys), 2, "tokenizer.json", "--prompt-ids")


def test_generate_refuses_out_of_vocabulary_ids_in_one_line(capsys):
    status, err = run(["generate", str(FIXTURE), "--prompt-ids", "1", "97", "--max-new-tokens", "2"], capsys)
    refused_in_one_line(status, err, 1, "97")


@pytest.mark.parametrize("damage", ["no weights", "weights not safetensors", "config not json", "unsupported config"])
def test_generate_refuses_a_checkpoint_that_does_not_load_in_one_line(tmp_path, capsys, damage):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(FIXTURE, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    damages = {
        "no weights": lambda: (checkpoint / "model.safetensors").unlink(),
        "weights not safetensors": lambda: (checkpoint / "model.safetensors").write_bytes(b"not a tensor file"),
        "config not json": lambda: (checkpoint / "config.json").write_text("{"),
        "unsupported config": lambda: (checkpoint / "config.json").write_text(
            json.dumps({**config, "model_type": "falcon"})
        ),
    }
    damages[damage]()
    status, err = run(["generate", str(checkpoint), "--prompt-ids", "1", "--max-new-tokens", "2"], capsys)
    refused_in_one_line(status, err, 1)
    if damage == "unsupported config":
        assert "model_type='falcon'" in err


@pytest.mark.parametrize("arguments, status, words", [
    (["/nonexistent"], 2, "expected a checkpoint directory"),
    ([str(FIXTURES / "chat"), "--chunk", "12"], 2, "multiple of --page-size 16, got 12"),
    ([str(FIXTURES / "chat"), "--port", "70000"], 2, "in [0, 65535], got '70000'"),
    ([str(FIXTURES / "chat"), "--chat-template", "/nonexistent"], 2, "--chat-template to name a file"),
    ([str(FIXTURE)], 1, "has no tokenizer.json"),
])
def test_serve_refuses_what_cannot_work_before_loading_anything(capsys, arguments, status, words):
    with pytest.raises(SystemExit) if status == 2 else contextlib.nullcontext() as exit_:
        assert cli.main(["serve", *arguments]) == status
    if status == 2:
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
