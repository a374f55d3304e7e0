"""The console script: `kvattn demo` end to end at tiny sizes, `kvattn generate` and `kvattn serve` refusing bad
input in one line, `--help` without JAX, and generation ending where the checkpoint says."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvattn
from kvattn import cli, models
from kvattn.serving import llm as llm_module
from tests.helpers import FIXTURES

FIXTURE = FIXTURES / "gpt2"  # vocab_size 97
CHAT = FIXTURES / "chat"  # a tokenizer, a chat template, end-of-sequence ids [1, 5]; 512 trained positions
KVATTN = Path(sys.executable).parent / "kvattn"
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
        (["--speculative", "ngram:0"], ["--speculative", "in [1, 64]", "'ngram:0'"]),
        (["--speculative", "ngram:99999999999"], ["--speculative", "in [1, 64]", "'ngram:99999999999'"]),
        (["--speculative", "ngram:4:65"], ["--speculative", "in [1, 64]", "'ngram:4:65'"]),
        (["--weights", "int2"], ["--weights", "'int2'", "int4"]),
        (["--chat"], ["--chat needs --prompt"]),
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
    ([str(FIXTURES / "chat"), "--step-tokens", "8"], 2, "--step-tokens to exceed --max-batch 8, got 8"),
    ([str(FIXTURES / "chat"), "--step-tokens", "24", "--speculative", "ngram:3"], 2, "not both"),
    ([str(FIXTURES / "chat"), "--port", "70000"], 2, "in [0, 65535], got '70000'"),
    ([str(FIXTURES / "chat"), "--chat-template", "/nonexistent"], 2, "--chat-template to name a file"),
    ([str(FIXTURES / "chat"), "--api-key", "clé"], 2, "--api-key to be printable ASCII"),  # no header carries it
    ([str(FIXTURE)], 1, "has no tokenizer.json"),
])
def test_serve_refuses_what_cannot_work_before_loading_anything(capsys, arguments, status, words):
    with pytest.raises(SystemExit) if status == 2 else contextlib.nullcontext() as exit_:
        assert cli.main(["serve", *arguments]) == status
    if status == 2:
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


# ----------------------------------------------------------------- version, help


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"kvattn {importlib.metadata.version('kvattn')}\n"
    assert kvattn.__version__ == importlib.metadata.version("kvattn")


def test_help_and_version_import_no_jax():
    script = """if True:
        import sys
        import kvattn.errors
        from kvattn import cli
        for argv in (["--help"], ["demo", "--help"], ["generate", "--help"], ["serve", "--help"], ["--version"]):
            try:
                cli.main(argv)
            except SystemExit as exit_:
                assert exit_.code == 0, (argv, exit_.code)
        print(sorted({name.split(".")[0] for name in sys.modules} & {"jax", "jaxlib", "flax", "numpy"}),
              file=sys.stderr)
    """
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "[]\n"
    assert "(default: 64)" in done.stdout  # generate's --max-new-tokens: defaults are shown


def test_public_names_load_on_first_use():
    assert sorted(kvattn.__all__) == sorted(set(kvattn.__all__)) and set(kvattn.__all__) <= set(dir(kvattn))
    for name in kvattn.__all__:
        assert getattr(kvattn, name).__name__ == name, name
    with pytest.raises(AttributeError, match="no attribute 'MultiHeadAtention'"):
        kvattn.MultiHeadAtention  # noqa: B018


# ------------------------------------------------------------------------ serve


def test_serve_reports_a_port_in_use_at_once_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        done = subprocess.run([str(KVATTN), "serve", str(CHAT), "--port", str(port)], capture_output=True, text=True,
                              timeout=60, check=False)
        elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"kvattn serve: port {port} on 127.0.0.1 is in use"), done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert elapsed < 10, f"{elapsed:.1f} s: the port must be taken before anything loads"


def test_serve_refuses_a_chat_template_that_fails_a_plain_conversation_before_loading(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(models, "from_pretrained", lambda *args, **kwargs: pytest.fail("loaded anyway"))
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ raise_exception('no ' + m.role + ' role here') }}{% endfor %}")
    status, err = run(["serve", str(CHAT), "--port", "0", "--chat-template", str(template)], capsys)
    assert status == 1 and err.startswith("kvattn serve: the chat template fails on a plain system + user "
                                          "conversation (the chat template refused the messages: TemplateError: "
                                          "no system role here)"), err
    assert err.count("\n") == 1, err


def test_serve_refuses_a_max_len_past_the_trained_context_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(models, "from_pretrained", lambda *args, **kwargs: pytest.fail("loaded anyway"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", str(CHAT), "--port", "0", "--max-len", "513"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvattn serve: --max-len 513 is past the checkpoint's trained context of 512 positions")
    assert "--allow-long-context" in err and err.count("\n") == 1, err


def test_serve_accepts_a_long_context_and_int8_weights_when_told_to(monkeypatch, capsys):
    loaded = {}

    def from_pretrained(path, **kwargs):
        loaded.update(kwargs)
        raise ValueError("stopped at loading")

    monkeypatch.setattr(models, "from_pretrained", from_pretrained)
    assert cli.main(["serve", str(CHAT), "--port", "0", "--max-len", "1000", "--allow-long-context",
                     "--weights", "int8"]) == 1
    assert loaded["max_len"] == 1000 and loaded["weights"] == "int8"
    lines = capsys.readouterr().err.splitlines()
    assert "past the checkpoint's trained context of 512 positions" in lines[0] and "may degrade" in lines[0]
    assert lines[1].startswith(f"kvattn serve: loading {CHAT} (max_len 1000")
    assert lines[2:] == ["kvattn serve: stopped at loading"]


# --------------------------------------------------------------------- generate


def test_generate_refuses_a_context_past_the_trained_one_unless_told(monkeypatch, capsys):
    argv = ["generate", str(CHAT), "--prompt-ids", "1", "2", "--max-new-tokens", "511"]
    refused_in_one_line(*run(argv, capsys), 2, "513", "trained context of 512 positions", "--allow-long-context")
    loaded = {}

    def from_pretrained(path, **kwargs):
        loaded.update(kwargs)
        raise ValueError("stopped at loading")

    monkeypatch.setattr(llm_module, "from_pretrained", from_pretrained)  # generate loads through kvattn.LLM
    status, err = run([*argv, "--allow-long-context"], capsys)
    assert status == 1 and err.endswith("kvattn generate: stopped at loading\n"), err
    assert loaded["max_len"] == 513


def test_generate_reports_a_malformed_tokenizer_json_in_one_line(tmp_path, capsys):
    checkpoint = tmp_path / "chat"
    shutil.copytree(CHAT, checkpoint)
    (checkpoint / "tokenizer.json").write_text("{}")
    status, err = run(["generate", str(checkpoint), "--prompt", "Hello"], capsys)
    refused_in_one_line(status, err, 1, str(checkpoint / "tokenizer.json"))


def test_generate_chat_refuses_a_checkpoint_without_a_chat_template_in_one_line(tmp_path, capsys):
    checkpoint = tmp_path / "chat"
    shutil.copytree(CHAT, checkpoint)
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": None}))
    status, err = run(["generate", str(checkpoint), "--chat", "--prompt", "Hello"], capsys)
    refused_in_one_line(status, err, 2, "--chat needs a chat template", str(checkpoint))


GREEDY = json.loads((CHAT / "expected.json").read_text())["greedy"]  # transformers' greedy tokens after a chat prompt


def with_eos(tmp_path, eos_token_id, file: str, tokenizer: bool = True) -> Path:
    """A copy of the chat checkpoint whose end-of-sequence id is `eos_token_id`, set in `file` alone."""
    checkpoint = tmp_path / "chat"
    shutil.copytree(CHAT, checkpoint)
    (checkpoint / "generation_config.json").unlink()
    if not tokenizer:
        (checkpoint / "tokenizer.json").unlink()
    config = json.loads((checkpoint / "config.json").read_text()) if file == "config.json" else {}
    (checkpoint / file).write_text(json.dumps({**config, "eos_token_id": eos_token_id}))
    return checkpoint


def test_generate_chat_stops_at_the_end_of_sequence_id(tmp_path, capsys):
    from kvattn.serving.tokenizer import Tokenizer

    stop = GREEDY["new_tokens"][3]
    checkpoint = with_eos(tmp_path, [7, stop], "generation_config.json")
    assert cli.main(["generate", str(checkpoint), "--chat", "--prompt", "Hello!", "--max-new-tokens", "12"]) == 0
    captured = capsys.readouterr()
    # The chat template's prompt gives transformers' greedy tokens; the end-of-sequence id shows no text.
    assert captured.out == Tokenizer.from_directory(CHAT).decode(GREEDY["new_tokens"][:3])
    assert captured.err.startswith("\n4 tokens in "), captured.err


@pytest.mark.parametrize("weights", [None, "int8"])
def test_generate_from_ids_stops_at_config_jsons_end_of_sequence_id(tmp_path, monkeypatch, capsys, weights):
    loaded = {}

    def from_pretrained(path, **kwargs):
        loaded.update(kwargs)
        return load(path, **kwargs)

    load = models.from_pretrained
    monkeypatch.setattr(llm_module, "from_pretrained", from_pretrained)
    checkpoint = with_eos(tmp_path, GREEDY["new_tokens"][3], "config.json", tokenizer=False)
    argv = ["generate", str(checkpoint), "--prompt-ids", *map(str, GREEDY["prompt"]), "--max-new-tokens", "12"]
    assert cli.main([*argv, *(["--weights", weights] if weights else [])]) == 0
    assert loaded["weights"] == weights
    printed = [int(token) for token in capsys.readouterr().out.split()]
    if weights is None:
        assert printed == GREEDY["new_tokens"][:4]
    else:  # int8 weights may round to other tokens; the run ends at the id all the same
        stop = GREEDY["new_tokens"][3]
        assert 1 <= len(printed) <= 12 and stop not in printed[:-1], printed
        assert printed[-1] == stop or len(printed) == 12, printed
