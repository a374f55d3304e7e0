"""`tools.llama_cpp`'s GGUF cache, without llama.cpp: its converter stands in as a function that writes the file."""

import pathlib

import pytest

from tools import llama_cpp


def test_an_interrupted_conversion_leaves_no_gguf_that_a_later_run_would_reuse(tmp_path, monkeypatch):
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    monkeypatch.setenv("KVATTN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(llama_cpp, "source", lambda version: tmp_path / "tree")

    def converter(contents: bytes, then=None):
        def run(command, **kwargs):
            pathlib.Path(command[command.index("--outfile") + 1]).write_bytes(contents)
            if then is not None:
                raise then
        return run

    monkeypatch.setattr(llama_cpp, "_run", converter(b"half a file", then=KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        llama_cpp.convert(checkpoint, ("f32",))
    monkeypatch.setattr(llama_cpp, "_run", converter(b"the whole file"))
    path = llama_cpp.convert(checkpoint, ("f32",))["f32"]
    assert path.name == "model-f32.gguf"
    assert path.read_bytes() == b"the whole file"
    monkeypatch.setattr(llama_cpp, "_run", converter(b"converted again"))
    assert llama_cpp.convert(checkpoint, ("f32",))["f32"].read_bytes() == b"the whole file"  # cached
