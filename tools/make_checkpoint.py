"""Random checkpoints at the sizes people run, made by transformers in bfloat16: what the benchmarks load.

    python -m tools.make_checkpoint llama-1b --torch-python PY [--out DIR]    # Llama-3.2-1B's shapes, 2.5 GB
    python -m tools.make_checkpoint qwen-0.5b --torch-python PY [--out DIR]   # Qwen2.5-0.5B's shapes, 1 GB
    python -m tools.make_checkpoint llama-3b --torch-python PY [--out DIR]    # Llama-3.2-3B's shapes, 6.4 GB

Dev-only. Each is a `save_pretrained` directory of random weights
(transformers' own initialisation, std 0.02) with the real model's sizes,
tied embeddings and bfloat16 storage, made by `PY` (an interpreter with
torch and transformers), plus the serving benchmark's tokenizer trained to
the model's vocabulary here (`benchmarks.serve_checkpoint`), so that
llama.cpp's converter takes it too (`python -m tools.llama_cpp convert DIR
--pre-tokenizer default`). Written once under `$KVATTN_CACHE` (default
`~/.cache/kvattn/checkpoints/NAME`), never committed; the directory's
`made_with.json` says what made it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

__all__ = ["SHAPES", "make"]

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# The published configs' sizes (Llama-3.2-1B and 3B, Qwen2.5-0.5B), random weights.
SHAPES = {
    "llama-1b": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True)),
    "llama-3b": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True)),
    "qwen-0.5b": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True)),
}


def default_dir(name: str) -> pathlib.Path:
    root = pathlib.Path(os.environ.get("KVATTN_CACHE", pathlib.Path.home() / ".cache" / "kvattn"))
    return root / "checkpoints" / name


# Run by the torch interpreter: the model, saved in bfloat16.
_WORKER = r"""
import json, sys, torch, transformers
args = json.loads(sys.argv[1])
torch.manual_seed(args["seed"])
torch.set_default_dtype(torch.bfloat16)  # built in bfloat16: a 3B model never exists in float32 here
config = getattr(transformers, args["config"])(**args["sizes"], **args["ids"])
model = getattr(transformers, args["model"])(config).eval()
model.save_pretrained(args["directory"], safe_serialization=True)
print(json.dumps({"parameters": sum(p.numel() for p in model.parameters()), "torch": torch.__version__,
                  "transformers": transformers.__version__}))
"""


def make(name: str, torch_python: str, out: str | os.PathLike | None = None, seed: int = 0) -> pathlib.Path:
    """The checkpoint `name` (a key of `SHAPES`) under `out`, made once (the model by `torch_python`)."""
    from benchmarks.serve_checkpoint import BOS, EOS, corpus, train_tokenizer

    directory = pathlib.Path(out) if out is not None else default_dir(name)
    stamp = directory / "made_with.json"
    config_name, model_name, sizes = SHAPES[name]
    wanted = {"name": name, "sizes": sizes, "seed": seed}
    if stamp.exists() and json.loads(stamp.read_text()).get("wanted") == wanted:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus(), sizes["vocab_size"])
    ids = {"bos_token_id": tokenizer.token_to_id(BOS), "eos_token_id": tokenizer.token_to_id(EOS)}
    arguments = {"config": config_name, "model": model_name, "sizes": sizes, "ids": ids, "seed": seed,
                 "directory": str(directory)}
    made = subprocess.run([torch_python, "-c", _WORKER, json.dumps(arguments)], check=True, capture_output=True,
                          text=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS}, indent=2) + "\n")
    stamp.write_text(json.dumps({"wanted": wanted, **json.loads(made.stdout.splitlines()[-1])}, indent=2) + "\n")
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(SHAPES))
    parser.add_argument("--torch-python", required=True, help="an interpreter with torch and transformers")
    parser.add_argument("--out", help="the directory (default: under $KVATTN_CACHE or ~/.cache/kvattn)")
    args = parser.parse_args()
    sys.stdout.write(f"{make(args.name, args.torch_python, args.out)}\n")


if __name__ == "__main__":
    main()
